"""Whole-session set-up for tests/ and notebooks/: the warm servers of this test session
live in a temporary directory of their own (inherited by CLI subprocesses and notebook
kernels, so they share them) and are stopped when the session ends: pytest never leaves
a server behind, and never uses or stops the user's."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from contract_lib.runs import pool, servers

_saved: dict[str, str | None] = {}
_prestarts: list = []


def pytest_configure(config):
    directory = tempfile.mkdtemp(prefix="contract_lib-servers-")
    _saved[pool.SERVER_DIR_ENV] = os.environ.get(pool.SERVER_DIR_ENV)
    os.environ[pool.SERVER_DIR_ENV] = directory


def pytest_collection_finish(session):
    """Notebooks collected: start the servers of the venv's SGLang and of each installed
    release now, side by side, in the background while the first kernels start (each
    import would otherwise wait for the first run that needs it)."""
    if any(str(item.path).endswith(".ipynb") for item in session.items):
        from contract_lib.sources.versions import installed_release_folders

        _prestarts.extend(pool.prestart([None, *installed_release_folders()]))


def pytest_unconfigure(config):
    directory = Path(os.environ[pool.SERVER_DIR_ENV])
    for thread in _prestarts:  # a server still starting would be missed by stop_all
        thread.join()
    servers.stop_all(directory)
    shutil.rmtree(directory, ignore_errors=True)
    if _saved.get(pool.SERVER_DIR_ENV) is None:
        os.environ.pop(pool.SERVER_DIR_ENV, None)
    else:
        os.environ[pool.SERVER_DIR_ENV] = _saved[pool.SERVER_DIR_ENV]
