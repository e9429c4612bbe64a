"""The catalogue of upstream bugs (``data/bugs.toml``): each bug's id, PRs, clause, field,
symptom, flags, the releases read (``affected``) and measured (``measured``), how
contract_lib replays it (``replay``) and the built-in patch that fixes it (``fix``)."""

from __future__ import annotations

import functools
import tomllib

from contract_lib.paths import BUG_CATALOG


def bug_catalog() -> list[dict]:
    """Every bug of the catalogue, in its order."""
    return list(_by_id().values())


def bug(bug_id: str) -> dict:
    """The catalogue's entry ``bug_id`` (KeyError if none)."""
    return _by_id()[bug_id]


@functools.lru_cache(maxsize=1)
def _by_id() -> dict[str, dict]:
    with BUG_CATALOG.open("rb") as handle:
        return {entry["id"]: entry for entry in tomllib.load(handle)["bug"]}
