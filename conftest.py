"""Whole-session set-up for tests/ and notebooks/: the warm servers of this test session
live in a temporary directory of their own (inherited by CLI subprocesses and notebook
kernels, so they share them) and are stopped when the session ends: pytest never leaves
a server behind, and never uses or stops the user's."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from contract_lib import pool

_saved: dict[str, str | None] = {}


def pytest_configure(config):
    directory = tempfile.mkdtemp(prefix="contract_lib-servers-")
    _saved[pool.SERVER_DIR_ENV] = os.environ.get(pool.SERVER_DIR_ENV)
    os.environ[pool.SERVER_DIR_ENV] = directory


def pytest_unconfigure(config):
    directory = Path(os.environ[pool.SERVER_DIR_ENV])
    pool.stop_all(directory)
    shutil.rmtree(directory, ignore_errors=True)
    if _saved.get(pool.SERVER_DIR_ENV) is None:
        os.environ.pop(pool.SERVER_DIR_ENV, None)
    else:
        os.environ[pool.SERVER_DIR_ENV] = _saved[pool.SERVER_DIR_ENV]
