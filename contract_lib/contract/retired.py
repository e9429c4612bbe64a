"""Clause 7, request state retired (the backend's per-request structures, table
``backend_state``; this project's extension).

A request the scheduler released (finished, aborted or retracted: it holds no
``req_to_token`` row) has no backend state left once a launch that follows its release
has completed, nor at a step where the loop is idle; and no backend state exists for a
request the scheduler does not hold, nor one that maps a held request to another row
than the scheduler's.
"""

from __future__ import annotations

import bisect

import pandas as pd

from contract_lib.contract.base import ClauseResult, NotExercised, result
from contract_lib.contract.registry import EXTENSIONS, clause
from contract_lib.frames import Frames


def _backend_state(frames: Frames) -> pd.DataFrame:
    state = frames.tables.get("backend_state", pd.DataFrame())
    return pd.DataFrame() if state is None else state


def _no_backend_state(frames: Frames) -> str | None:
    return "the loop's backend kept no per-request state" if _backend_state(frames).empty else None


@clause(7, "request state retired", fields=("backend_state",), origin=EXTENSIONS,
        readers=("a re-admitted request id (routes as a continuation)",
                 "the pool flush (syncs through the row)"),
        unexercised=_no_backend_state)
def check_retired(frames: Frames) -> ClauseResult:
    """Clause 7: the backend keeps no state for a request the scheduler released."""
    loop = frames.loop
    state = _backend_state(frames)
    requests = frames.requests
    released = (requests["finished"].astype(bool) | requests["req_pool_idx"].isna()).tolist()
    keys = list(zip(requests["rid"].tolist(), requests["step"].tolist()))
    has_row = requests["req_pool_idx"].notna().tolist()
    steps = frames.steps.set_index("step")
    idle = (steps["is_fully_idle"].astype(bool) & (steps["result_queue_len"] == 0))
    idle_steps = set(idle.index[idle.to_numpy()].tolist())
    launch_steps = sorted(set(frames.launches["step"].astype(int)))
    since: dict[tuple[str, int], int] = {}  # (rid, step) -> step its released streak began
    start, had_row, current = None, False, None
    for index in sorted(range(len(keys)), key=keys.__getitem__):  # by request, then step
        rid, step = keys[index]
        if rid != current:
            start, had_row, current = None, False, rid
        had_row |= has_row[index]
        if released[index] and had_row:
            start = step if start is None else start
            since[(rid, step)] = start
        else:
            start = None
    held_rows = dict(zip(keys, requests["req_pool_idx"].tolist()))
    rows, released_seen = [], {key[0] for key in since}
    # Column lists, walked in Python (pandas' per-row access was most of a long run's check).
    mapped = [None if missing else int(row) for row, missing
              in zip(state["row"].tolist(), state["row"].isna().tolist())]
    for step, rid, structure, row in zip(state["step"].astype(int).tolist(),
                                         state["rid"].tolist(), state["structure"].tolist(),
                                         mapped):
        entry = f"{structure}[{rid!r}]" + ("" if row is None else f" -> row {row}")
        if (rid, step) not in held_rows:
            rows.append({"field": structure, "step": step, "rid": rid,
                         "expected": "no state (the scheduler does not hold this request)",
                         "actual": entry, "explanation": "backend state for a request id "
                         "the scheduler never received or no longer knows"})
            continue
        start = since.get((rid, step))
        if start is None:
            held = held_rows[(rid, step)]
            if row is not None and not pd.isna(held) and row != int(held):
                rows.append({"field": structure, "step": step, "rid": rid,
                             "expected": f"row {int(held)} (the scheduler's)",
                             "actual": entry, "explanation": "the backend maps the request "
                             "to a row it no longer holds: a sync through it writes KV into "
                             "another request's slots"})
            continue
        # the launch steps in [start, step), found by bisection (the rows times the
        # launches, walked, made a long run's check quadratic)
        first, end = bisect.bisect_left(launch_steps, start), bisect.bisect_left(launch_steps,
                                                                                 step)
        if end > first:
            why = (f"kept after launch(es) at step {launch_steps[first]}"
                   f"{'...' + str(launch_steps[end - 1]) if end - first > 1 else ''} that "
                   f"followed its release (seen at step {start})")
        elif step in idle_steps:
            why = f"kept while the loop is idle (released, seen at step {start})"
        else:
            continue
        rows.append({"field": structure, "step": step, "rid": rid,
                     "expected": "no state (released)", "actual": entry,
                     "explanation": why + ": a re-admitted id routes as a continuation, "
                     "a pool flush syncs through the stale row, and the cache's arrays "
                     "stay allocated"})
    if not released_seen and not rows:
        raise NotExercised("no request was released")
    structures = state["structure"].nunique()
    note = (f"{len(state)} backend entries over {structures} per-request structures "
            f"checked; {len(released_seen)} requests released")
    return result(7, loop, rows, note)
