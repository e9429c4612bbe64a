"""Shared fixtures: one real run per (workload, loop, patch, runner, release) per session,
and the committed frames of such runs (``tests/fixtures``) for the fast tier."""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

import contract_lib

FIXTURES = Path(__file__).resolve().parent / "fixtures"


@functools.lru_cache(maxsize=None)
def _cached_run(workload: str, loop: str, patch: str | None, runner: str = "model-free",
                sglang: str | None = None) -> contract_lib.Frames:
    return contract_lib.run(workload, loop, patch=patch, runner=runner, sglang=sglang)


@contextlib.contextmanager
def _private_servers():
    """A server directory of its own (``CONTRACT_LIB_SERVER_DIR``, servers switched on);
    every server in it is stopped at the end. Not under ``tmp_path``: a UNIX socket's path
    holds at most 107 bytes, and pytest-xdist makes ``tmp_path`` long enough to pass it
    (the server then runs cold, warning)."""
    from contract_lib.runs import pool, servers as warm

    parent = Path(tempfile.mkdtemp(prefix="contract_lib-test-"))
    directory = parent / "servers"
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(pool.SERVER_DIR_ENV, str(directory))
            patch.delenv(pool.SERVER_SWITCH_ENV, raising=False)
            yield directory
    finally:
        warm.stop_all(directory)
        shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture()
def servers():
    """A server directory of the test's own, for a test that starts, kills, stops or
    times out servers (the session's serve both xdist workers)."""
    with _private_servers() as directory:
        yield directory


@pytest.fixture(scope="class")
def class_servers():
    """A server directory shared by a test class's tests (a class runs whole on one
    worker: conftest.py), for tests that run on a private server but do not start, stop
    or replace it: one server start (~6 s of CPU) for them all."""
    with _private_servers() as directory:
        yield directory


@pytest.fixture(scope="session")
def run_cached():
    """``run_cached(workload, loop, patch=None, runner="model-free", sglang=None)``: a
    real run, shared within the session (and served from the frame cache across them).

    Tests must not mutate the returned frames.
    """
    return lambda workload, loop, patch=None, runner="model-free", sglang=None: (
        _cached_run(workload, loop, patch, runner, sglang))


@functools.lru_cache(maxsize=None)
def _fixture(name: str) -> contract_lib.Frames:
    path = FIXTURES / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such frame fixture; add the run to "
                                "scripts/make-fixtures and run it")
    return contract_lib.Frames.load(path)  # checked against the frame schema


def saved_frames(workload: str, loop: str, patch: str | None = None) -> contract_lib.Frames:
    """The committed frames of ``run(workload, loop, patch=patch)`` (``tests/fixtures``,
    written by ``scripts/make-fixtures``): a fresh copy per call, free to edit."""
    return _fixture(f"{workload}.{loop}" + (f".{patch}" if patch else "")).copy()


@pytest.fixture(scope="session")
def saved():
    """``saved(workload, loop, patch=None)``: the committed frames of that real run, as
    ``run_cached`` would return them (pure pandas, no Scheduler); a fresh copy per call."""
    return saved_frames


@functools.lru_cache(maxsize=None)
def _saved_report(workload: str, loop: str, patch: str | None = None):
    from contract_lib.contract import check

    return check(saved_frames(workload, loop, patch))


@pytest.fixture(scope="session")
def saved_report():
    """``saved_report(workload, loop, patch=None)``: the report of ``check`` on those
    committed frames, checked once per session (shared: read it, do not edit it)."""
    return _saved_report


@pytest.fixture()
def module_on_disk(tmp_path, monkeypatch):
    """``module_on_disk(name, text)``: ``text`` written to ``tmp_path / name.py`` and
    imported afresh (``inspect`` needs a source file to read a function's lines)."""
    def write(name: str, text: str):
        (tmp_path / f"{name}.py").write_text(text)
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.delitem(sys.modules, name, raising=False)
        return importlib.import_module(name)
    return write


@pytest.fixture()
def private_cache(tmp_path, monkeypatch):
    """A frame cache of the test's own (enabled), in ``tmp_path / "frames"``."""
    monkeypatch.setenv("CONTRACT_LIB_CACHE_DIR", str(tmp_path / "frames"))
    monkeypatch.delenv("CONTRACT_LIB_NO_CACHE", raising=False)
    return tmp_path / "frames"


@pytest.fixture(autouse=True)
def _other_releases_only_in_their_tier(request, monkeypatch):
    """Outside the ``releases`` tier, a test that asks to run another SGLang release than
    the venv's, or sglang-omni, fails naming it: it would install it on first use
    (~100-280 MB, ~10 s each), which only that tier may do. (A subprocess the test starts
    is not watched.)"""
    if request.node.get_closest_marker("releases"):
        return
    from contract_lib.sources import omni_release, origin, versions

    def refuse(what: str):
        raise AssertionError(f"{request.node.nodeid} drives {what} outside the releases "
                             "tier: mark it `pytest.mark.releases`, or use the venv's")

    def sglang_path(version, _real=versions.sglang_path):
        sandboxed = os.environ.get(versions.RELEASES_DIR_ENV)  # the test's own folder
        if sandboxed or version in (None, versions.installed_sglang_version()):
            return _real(version)
        refuse(f"sglang {version}")

    monkeypatch.setattr(origin, "sglang_path", sglang_path)
    monkeypatch.setattr(versions, "sglang_path", sglang_path)
    monkeypatch.setattr(omni_release, "omni_path", lambda: refuse("sglang-omni"))


# -- tiers ---------------------------------------------------------------------------------
# Every test gets exactly one tier marker (registered in pyproject.toml): a test module
# or a test declares ``fast`` or ``releases`` itself; notebooks are ``notebooks``;
# everything else drives a real loop.
_TIERS = ("fast", "real_loop", "releases", "notebooks")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(item.get_closest_marker(tier) for tier in _TIERS):
            continue
        path = str(item.path)
        if path.endswith(".ipynb") or "notebook" in item.path.name:  # executes notebooks
            item.add_marker(pytest.mark.notebooks)
        else:
            item.add_marker(pytest.mark.real_loop)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """``pytest -m fast``: skip importing test modules that mark no test ``fast`` (their
    imports, e.g. hypothesis, jupytext, papermill, cost seconds of the tier's budget).
    A module's fast tests say so in its text: ``pytest.mark.fast`` or ``pytestmark``."""
    if (_fast_tier(config) and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_")
            and "mark.fast" not in collection_path.read_text(encoding="utf-8")):
        return True
    return None


def _fast_tier(config: pytest.Config) -> bool:
    return config.getoption("markexpr", "").strip() == "fast"


def _imported_sglang() -> bool:
    return getattr(sys.modules.get("sglang"), "__spec__", None) is not None


@pytest.fixture(autouse=True)
def _the_fast_tier_imports_no_sglang(request):
    """``pytest -m fast`` fails the test after which SGLang is imported, in whichever
    process runs it (an xdist worker's session status would not reach the controller);
    the tier is pure pandas (``tests/test_tiers.py`` also runs it with SGLang
    unimportable). A stand-in module a test plants (no import spec) is not an import."""
    yield
    if _fast_tier(request.config) and _imported_sglang():
        pytest.fail("the fast tier imported sglang (this test, or a module collected "
                    "before it)", pytrace=False)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """And so does a single process whose collection alone imported SGLang."""
    if _fast_tier(session.config) and _imported_sglang():
        print("\nerror: the fast tier imported sglang", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
