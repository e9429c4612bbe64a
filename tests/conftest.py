"""Shared fixtures: one real run per (workload, loop, patch, runner, release) per session."""

from __future__ import annotations

import functools

import pytest

import contract_lib


@functools.lru_cache(maxsize=None)
def _cached_run(workload: str, loop: str, patch: str | None, runner: str = "model-free",
                sglang: str | None = None) -> contract_lib.Frames:
    return contract_lib.run(workload, loop, patch=patch, runner=runner, sglang=sglang)


@pytest.fixture(scope="session")
def run_cached():
    """``run_cached(workload, loop, patch=None, runner="model-free", sglang=None)``: a
    real run, shared within the session (and served from the frame cache across them).

    Tests must not mutate the returned frames.
    """
    return lambda workload, loop, patch=None, runner="model-free", sglang=None: (
        _cached_run(workload, loop, patch, runner, sglang))


@pytest.fixture()
def private_cache(tmp_path, monkeypatch):
    """A frame cache of the test's own (enabled), in ``tmp_path / "frames"``."""
    monkeypatch.setenv("CONTRACT_LIB_CACHE_DIR", str(tmp_path / "frames"))
    monkeypatch.delenv("CONTRACT_LIB_NO_CACHE", raising=False)
    return tmp_path / "frames"


# -- tiers ---------------------------------------------------------------------------------
# Every test gets exactly one tier marker (registered in pyproject.toml): a test module
# declares ``fast`` or ``releases`` itself (``pytestmark``); notebooks are ``notebooks``;
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
