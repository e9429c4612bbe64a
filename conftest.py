"""Whole-session set-up for tests/ and notebooks/: the warm servers of this test session
live in a temporary directory of their own (inherited by xdist's workers, CLI
subprocesses and notebook kernels, so they share them) and are stopped when the session
ends: pytest never leaves a server behind, and never uses or stops the user's."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from contract_lib.runs import pool, servers

_saved: dict[str, str | None] = {}
_prestarts: list = []


def _xdist_worker() -> bool:
    """This process is a pytest-xdist worker (its controller made the server directory)."""
    return "PYTEST_XDIST_WORKER" in os.environ


def pytest_configure(config):
    # One directory for the whole session: xdist's workers inherit the controller's, so
    # both fork from one server per SGLang folder (each server start imports SGLang,
    # ~6.2 s of CPU), as CLI subprocesses and notebook kernels already did. A test that
    # kills or stops a server uses a directory of its own (the ``servers`` fixture,
    # tests/conftest.py).
    if _xdist_worker() and os.environ.get(pool.SERVER_DIR_ENV):
        return
    directory = tempfile.mkdtemp(prefix="contract_lib-servers-")
    for name, value in ((pool.SERVER_DIR_ENV, directory),
                        # A release's server exits two minutes after its last run, not
                        # fifteen: a session drives up to ten releases, ~0.5 GB each.
                        (pool.IDLE_ENV, os.environ.get(pool.IDLE_ENV) or "120")):
        _saved[name] = os.environ.get(name)
        os.environ[name] = value


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: scripts/test runs two workers
def pytest_xdist_make_scheduler(config, log):
    """Tests spread one by one over the workers, but a notebook's cells, which share one
    kernel in order, all on one worker, and so are a test class's tests, which share its
    class-scoped fixtures (a private warm server: tests/test_server.py). (xdist's
    ``loadgroup`` cannot say this: it marks a group in ``item._nodeid``, which nbval's
    cells do not report as their nodeid.)"""
    from xdist.scheduler import LoadScopeScheduling

    class NotebooksWhole(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path, _, rest = nodeid.partition("::")
            if path.endswith(".ipynb"):
                return path
            if rest.startswith("Test") and "::" in rest:  # a class's test
                return f"{path}::{rest.split('::', 1)[0]}"
            return nodeid

    return NotebooksWhole(config, log)


def pytest_collection_finish(session):
    """Notebooks collected: start the venv's SGLang server now, in the background while
    the first kernels start (its import would otherwise wait for the first run); another
    release's server starts when a run needs it."""
    if any(str(item.path).endswith(".ipynb") for item in session.items):
        _prestarts.extend(pool.prestart([None]))


def pytest_unconfigure(config):
    for thread in _prestarts:  # a server still starting would be missed by stop_all
        thread.join()
    if not _saved:  # an xdist worker: the other may still run; its controller stops them
        return
    directory = Path(os.environ[pool.SERVER_DIR_ENV])
    servers.stop_all(directory)
    shutil.rmtree(directory, ignore_errors=True)
    for name, value in _saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
