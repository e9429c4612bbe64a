"""Clause 7, request state retired (the backend's per-request structures, table
``backend_state``; this project's extension).

A request the scheduler released (finished, aborted or retracted: it holds no
``req_to_token`` row) has no backend state left once a launch that follows its release
has completed, nor at a step where the loop is idle; and no backend state exists for a
request the scheduler does not hold, nor one that maps a held request to another row
than the scheduler's.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from contract_lib.contract.base import ClauseResult, NotExercised, result
from contract_lib.contract.registry import EXTENSIONS, clause
from contract_lib.frames import Frames


def _backend_state(frames: Frames) -> pd.DataFrame:
    state = frames.tables.get("backend_state", pd.DataFrame())
    return pd.DataFrame() if state is None else state


def _no_backend_state(frames: Frames) -> str | None:
    return "the loop's backend kept no per-request state" if _backend_state(frames).empty else None


def _last_of_each(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct ``keys`` (sorted) and the position of each one's last occurrence."""
    distinct, first_from_end = np.unique(keys[::-1], return_index=True)
    return distinct, len(keys) - 1 - first_from_end


def _lookup(distinct: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Per key, its index in the sorted ``distinct`` keys, or -1 where it is not one."""
    if len(distinct) == 0:
        return np.full(len(keys), -1)
    at = np.minimum(np.searchsorted(distinct, keys), len(distinct) - 1)
    return np.where(distinct[at] == keys, at, -1)


def _take(values: np.ndarray, at: np.ndarray, missing: float) -> np.ndarray:
    """``values[at]``, with ``missing`` where ``at`` is -1 (``values`` may be empty)."""
    taken = values[np.maximum(at, 0)] if len(values) else np.zeros(len(at), values.dtype)
    return np.where(at >= 0, taken, missing)


def _released_since(rid_codes: np.ndarray, steps: np.ndarray, has_row: np.ndarray,
                    released: np.ndarray) -> np.ndarray:
    """Per request row, the step its released streak began (-1: not in one).

    A row is in a streak when the request is released and held a row at some step up
    to it; a streak is a run of such rows, by request then step."""
    order = np.lexsort((steps, rid_codes))  # stable: equal keys keep their order
    rid, step = rid_codes[order], steps[order]
    new_request = np.ones(len(rid), dtype=bool)
    new_request[1:] = rid[1:] != rid[:-1]
    group = np.cumsum(new_request) - 1
    held = np.cumsum(has_row[order])
    held_before = np.concatenate(([0], held))[np.flatnonzero(new_request)]
    member = released[order] & (held - held_before[group] > 0)
    begins = member.copy()  # a streak begins at a member whose predecessor is not one
    begins[1:] &= new_request[1:] | ~member[:-1]
    # each member takes the step of the last streak begun at or before it
    began = step[begins][np.maximum(np.cumsum(begins) - 1, 0)] if begins.any() else step
    since = np.full(len(rid), -1)
    since[order] = np.where(member, began, -1)
    return since


@clause(7, "request state retired", fields=("backend_state",), origin=EXTENSIONS,
        readers=("a re-admitted request id (routes as a continuation)",
                 "the pool flush (syncs through the row)"),
        unexercised=_no_backend_state)
def check_retired(frames: Frames) -> ClauseResult:
    """Clause 7: the backend keeps no state for a request the scheduler released."""
    loop = frames.loop
    state = _backend_state(frames)
    requests = frames.requests
    # Requests and entries are keyed by (request, step), one int per key; every entry
    # is classified in numpy, and only violations are walked in Python (a long run
    # holds ~200 k entries).
    codes, _ = pd.factorize(pd.concat([requests["rid"], state["rid"]], ignore_index=True))
    req_codes, state_codes = codes[:len(requests)], codes[len(requests):]
    req_steps = requests["step"].to_numpy(dtype=np.int64)
    state_steps = state["step"].to_numpy(dtype=np.int64)
    span = int(max(req_steps.max(initial=0), state_steps.max(initial=0))) + 2
    req_keys, state_keys = req_codes * span + req_steps + 1, state_codes * span + state_steps + 1

    has_row = requests["req_pool_idx"].notna().to_numpy()
    released = requests["finished"].astype(bool).to_numpy() | ~has_row
    since = _released_since(req_codes, req_steps, has_row, released)
    # (request, step) -> its row and its streak's start: the last row of a key wins
    held_keys, held_last = _last_of_each(req_keys)
    held_at = _lookup(held_keys, state_keys)
    is_held = held_at >= 0
    held_row = _take(requests["req_pool_idx"].to_numpy(dtype=float)[held_last], held_at,
                     np.nan)
    in_streak = since >= 0
    streak_keys, streak_last = _last_of_each(req_keys[in_streak])
    streak_at = _lookup(streak_keys, state_keys)
    start = _take(since[in_streak][streak_last], streak_at, -1)

    row = state["row"].to_numpy(dtype=float)
    maps_other = (is_held & (start < 0) & ~np.isnan(row) & ~np.isnan(held_row)
                  & (row != held_row))
    launch_steps = np.unique(frames.launches["step"].to_numpy(dtype=np.int64))
    first = np.searchsorted(launch_steps, start, side="left")
    end = np.searchsorted(launch_steps, state_steps, side="left")
    steps = frames.steps
    idle = (steps["is_fully_idle"].astype(bool) & (steps["result_queue_len"] == 0)).to_numpy()
    kept = is_held & (start >= 0)
    after_launch = kept & (end > first)
    while_idle = kept & ~after_launch & np.isin(state_steps, steps["step"].to_numpy()[idle])

    rows = []
    found = np.flatnonzero(~is_held | maps_other | after_launch | while_idle)
    for index, rid, structure in zip(found.tolist(), state["rid"].to_numpy()[found].tolist(),
                                     state["structure"].to_numpy()[found].tolist()):
        step = int(state_steps[index])
        mapped = None if np.isnan(row[index]) else int(row[index])
        entry = f"{structure}[{rid!r}]" + ("" if mapped is None else f" -> row {mapped}")
        if not is_held[index]:
            rows.append({"field": structure, "step": step, "rid": rid,
                         "expected": "no state (the scheduler does not hold this request)",
                         "actual": entry, "explanation": "backend state for a request id "
                         "the scheduler never received or no longer knows"})
        elif maps_other[index]:
            rows.append({"field": structure, "step": step, "rid": rid,
                         "expected": f"row {int(held_row[index])} (the scheduler's)",
                         "actual": entry, "explanation": "the backend maps the request "
                         "to a row it no longer holds: a sync through it writes KV into "
                         "another request's slots"})
        else:
            seen = int(start[index])
            if after_launch[index]:
                launched = launch_steps[first[index]:end[index]]
                why = (f"kept after launch(es) at step {launched[0]}"
                       f"{'...' + str(launched[-1]) if len(launched) > 1 else ''} that "
                       f"followed its release (seen at step {seen})")
            else:
                why = f"kept while the loop is idle (released, seen at step {seen})"
            rows.append({"field": structure, "step": step, "rid": rid,
                         "expected": "no state (released)", "actual": entry,
                         "explanation": why + ": a re-admitted id routes as a continuation, "
                         "a pool flush syncs through the stale row, and the cache's arrays "
                         "stay allocated"})
    released_seen = len(np.unique(req_codes[in_streak]))
    if not released_seen and not rows:
        raise NotExercised("no request was released")
    structures = state["structure"].nunique()
    note = (f"{len(state)} backend entries over {structures} per-request structures "
            f"checked; {released_seen} requests released")
    return result(7, loop, rows, note)
