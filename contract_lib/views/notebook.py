"""What every notebook of the suite does first, and how it states a run's verdict."""

from __future__ import annotations

import warnings

from contract_lib.contract import Report, check
from contract_lib.frames import Frames
from contract_lib.views.style import wrap


def setup() -> None:
    """Silence deprecation notices: they differ between library versions, and nbval
    compares stderr."""
    for category in (DeprecationWarning, FutureWarning):
        warnings.simplefilter("ignore", category)


def verdict_line(run: Frames | Report) -> str:
    """The run's verdict (:meth:`Report.verdict <contract_lib.contract.Report.verdict>`)
    as one wrapped line: ``verdict: violated (exit 1): clause 1, clause 2 violated``."""
    report = run if isinstance(run, Report) else check(run)
    return wrap(report.verdict().line())


def md(text: str):
    """Markdown rendered from values computed in the notebook (so a sentence cannot go
    stale when SGLang or the library changes)."""
    from IPython.display import Markdown

    return Markdown(text)


class Stop(Exception):
    """Stops a notebook at the cell that raised it, shown as its one-line message
    (IPython renders ``_render_traceback_`` instead of a traceback; papermill and nbval
    still see an error and stop)."""

    def _render_traceback_(self) -> list[str]:
        return [f"stopped: {self}"]


def check_switches(**switches) -> None:
    """Stop a parameterised notebook on an on/off parameter that is not ``True`` or
    ``False``: papermill's ``-p name false`` passes the string ``"false"``, which Python
    would read as on."""
    for name, value in switches.items():
        if not isinstance(value, bool):
            raise Stop(f"{name} must be True or False (papermill: -p {name} False), "
                       f"got {value!r}")


def checked_run(workload, loop: str, **options) -> tuple[Frames, Report]:
    """``contract_lib.run`` and ``check`` for a parameterised notebook: a bad parameter
    (the library's one-line message) or a run that failed in set-up raises
    :class:`Stop` here, before any later cell reads frames that are not there."""
    import contract_lib
    from contract_lib.verdict import setup_failed

    try:
        frames = contract_lib.run(workload, loop, **options)
    except Exception as error:  # only the library's own input errors are shortened
        if not type(error).__module__.startswith("contract_lib"):
            raise
        raise Stop(f"{type(error).__name__}: {error}") from None
    report = check(frames)
    if setup_failed(frames.meta) or frames.steps.empty:
        raise Stop(report.verdict().line())
    return frames, report
