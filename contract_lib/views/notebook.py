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
