"""A pytest plugin (entry point ``pytest11``, name ``contract_lib``): the ``contract_run``
fixture, so a test in SGLang's own tree is two lines::

    def test_mlx_loop_keeps_the_contract(contract_run):
        assert_contract(contract_run("two-turn", loop="mlx"), clauses="rfc")

Tests that use the fixture get the ``contract`` marker (``pytest -m contract`` selects
them). When such a test fails, its report gains a "contract_lib runs" section naming
each run and the file its frames were saved to (``Frames.load`` reads it back).

A run whose only findings are catalogued upstream bugs reproduced exactly
(``assert_contract`` raises ``KnownUpstreamBug``) is reported as ``xfail`` with the
bugs named, as the command line's ``check`` exits 0 on it; ``--contract-strict-known``
makes it a failure, as ``check --strict-known`` does. ``--contract-diff FILE`` applies an
upstream diff (a fix under review) to the SGLang of every run, as ``check --diff`` does,
so a test can be run with and without a fix without installing it.

pytest imports this module in every session of every project where contract_lib is
installed, so it imports nothing but pytest and the package's face (which imports its
names on first use): the harness (and with it pandas and, in
the run's child, SGLang) is imported when a test first calls ``contract_run``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import pytest

if TYPE_CHECKING:
    from contract_lib.frames import Frames

MARKER = "contract"
FIXTURE = "contract_run"
_RUNS = pytest.StashKey[list]()  # per test item: (run title, status, frames file)


STRICT_KNOWN = "--contract-strict-known"
DIFF = "--contract-diff"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("contract_lib").addoption(
        STRICT_KNOWN, action="store_true", dest="contract_strict_known",
        help="fail a test whose run reproduces catalogued upstream bugs exactly "
             "(by default: xfail, naming them)")
    parser.getgroup("contract_lib").addoption(
        DIFF, action="append", default=[], dest="contract_diff", metavar="FILE",
        help="apply this upstream diff (a/python/sglang/...) to the SGLang of every "
             "contract_run, before the test's own diffs (repeatable)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{MARKER}: drives workloads through SGLang's real scheduler loops "
        f"with contract_lib (given to every test that uses the {FIXTURE} fixture)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if FIXTURE in getattr(item, "fixturenames", ()):
            item.add_marker(MARKER)


@pytest.fixture
def contract_run(request: pytest.FixtureRequest,
                 tmp_path: Path) -> Callable[..., "Frames"]:
    """``contract_run(workload, loop="mlx", patch=None, **run_kwargs) -> Frames``.

    Runs ``workload`` (a shipped workload name, a ``.toml`` path or a ``Workload``)
    through ``loop`` of the installed SGLang with only the model forward replaced, and
    returns its frames, whatever happened (check them with
    ``contract_lib.contract.assert_contract``). ``patch`` and ``run_kwargs``
    (``server_args``, ``runner``, ``sglang``, ``diff``, ``cache``...) are those of
    ``contract_lib.run``; finished runs are served from its frame cache unless
    ``cache=False``. Bad input raises its one-line error (``WorkloadError``,
    ``RunSetupError``, ``UnsupportedSGLangError`` for an SGLang contract_lib cannot
    drive). Every run's frames are saved in the test's ``tmp_path``. Diffs given with
    ``--contract-diff`` are applied first.
    """
    runs = request.node.stash.setdefault(_RUNS, [])
    invoked = request.config.invocation_params.dir
    given = [invoked / d for d in request.config.getoption("contract_diff")]

    def run(workload: Any, loop: str = "mlx", patch: Any = None, **run_kwargs: Any) -> "Frames":
        from contract_lib.frames import run_title
        from contract_lib.runs.harness import run as run_loop
        from contract_lib.runs.loop_choice import runnable

        runnable([loop])  # a loop that cannot run here: its one-line RunSetupError
        own = run_kwargs.pop("diff", None)
        own = [own] if isinstance(own, (str, Path)) else list(own or ())
        diff = [*given, *own] or None
        frames = run_loop(workload, loop, patch=patch, diff=diff, **run_kwargs)
        path = frames.save(tmp_path / f"run{len(runs)}.{frames.meta['workload']}.{loop}.json")
        runs.append((run_title(frames.meta), frames.status, path))
        return frames

    return run


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    outcome = yield
    report = outcome.get_result()
    if (report.failed and call.excinfo is not None and _known_upstream(call.excinfo.value)
            and not item.config.getoption("contract_strict_known")):
        report.outcome = "skipped"  # how pytest records an expected failure
        report.wasxfail = str(call.excinfo.value)
        return
    runs = item.stash.get(_RUNS, None)
    if runs and report.failed:
        report.sections.append(("contract_lib runs", "\n".join(
            f"{title}: {status}; frames: {path}" for title, status, path in runs)))


def _known_upstream(error: BaseException) -> bool:
    """Whether ``error`` is ``assert_contract``'s ``KnownUpstreamBug`` (its module is
    loaded if the test raised it: nothing is imported here)."""
    report = sys.modules.get("contract_lib.contract.report")
    return report is not None and isinstance(error, report.KnownUpstreamBug)
