"""Shared fixtures: one real run per (workload, loop, patch) per test session."""

from __future__ import annotations

import functools

import pytest

import contract_lib


@functools.lru_cache(maxsize=None)
def _cached_run(workload: str, loop: str, patch: str | None) -> contract_lib.Frames:
    return contract_lib.run(workload, loop, patch=patch)


@pytest.fixture(scope="session")
def run_cached():
    """``run_cached(workload, loop, patch=None)``: a real run, shared within the session.

    Tests must not mutate the returned frames.
    """
    return lambda workload, loop, patch=None: _cached_run(workload, loop, patch)
