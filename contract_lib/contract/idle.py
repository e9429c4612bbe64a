"""Clause 5, in-flight predicates test any overlap loop (field ``result_queue``; the
loop's in-flight term, :attr:`contract_lib.loops.LoopSpec.in_flight`).

Whenever an overlap loop holds in-flight work, ``is_fully_idle`` evaluated with every
other term masked to idle (running batch empty, last batch, chunked request and waiting
queue none) says "not idle", asked as each of its callers asks (no arguments, the health
check's ``for_health_check``, the flush's ``ignore_waiting``). If the masked probe says
idle while the real predicate said busy, the answer was right only by accident:
``violated-masked``.

In-flight work at a step boundary is what the loop's in-flight term holds
(``result_queue_len``) or a launch made at an earlier step and processed at this one or
later (from the ``launches`` table): a loop that keeps its in-flight work somewhere else
than SGLang's queue still holds it. On a PD-disaggregation loop, normal or overlap, the
requests in its disaggregation queues (``disagg_queued``: bootstrap, preallocation,
transfer, inflight) are in-flight work too: ``is_fully_idle`` tests them
(``managers/scheduler.py:5373-5381``), except for the health check, which leaves them
out by design (:5338-5342), so the probe does not ask it about them.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from contract_lib import loops
from contract_lib.contract.base import ClauseResult, derived, ints, no_rows, result
from contract_lib.contract.registry import clause
from contract_lib.frames import Frames

_NO_ROWS = no_rows(field="str", step="int64", expected="str", actual="str",
                   explanation="str")


def _overlap(steps: pd.DataFrame) -> np.ndarray:
    return (steps["enable_overlap"].to_numpy().astype(bool)
            | steps["enable_overlap_mlx"].to_numpy().astype(bool))


def _launched_in_flight(frames: Frames) -> np.ndarray:
    """Per step: launches made at an earlier step and processed at this step or later (a
    launch never processed, e.g. one dropped unprocessed, is not counted)."""
    processed = frames.launches["processed_step"].to_numpy(dtype="float64")
    made = frames.launches["step"].to_numpy(dtype="float64")[~np.isnan(processed)]
    processed = processed[~np.isnan(processed)]
    steps = frames.steps["step"].to_numpy(dtype="float64")
    if (processed >= made).all():  # as a loop records them: made < s <= processed is
        # made < s, less processed < s (which implies it), counted in sorted arrays
        return (np.searchsorted(np.sort(made), steps, side="left")
                - np.searchsorted(np.sort(processed), steps, side="left"))
    # crafted frames: each pair compared (quadratic)
    return ((made[None, :] < steps[:, None]) & (steps[:, None] <= processed[None, :])).sum(
        axis=1)


@derived
def _in_flight(frames: Frames) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per step: the launches in flight, the requests in a disaggregation loop's queues,
    and whether it holds in-flight work (an overlap loop's, or queued requests)."""
    steps = frames.steps
    launched, queued = _launched_in_flight(frames), _queued(steps)
    busy = (steps["result_queue_len"].to_numpy() > 0) | (launched > 0)
    return launched, queued, (_overlap(steps) & busy) | (queued > 0)


def _queued(steps: pd.DataFrame) -> np.ndarray:
    """Per step, the requests in the disaggregation queues (0 on other loops)."""
    if "disagg_queued" not in steps:
        return np.zeros(len(steps), dtype="int64")
    return np.nan_to_num(steps["disagg_queued"].to_numpy(dtype="float64")).astype("int64")


def never_overlapped(frames: Frames) -> str | None:
    """Why a finished run of an overlap loop (its steps say overlap is on) is another
    loop: none of its launches (two or more) was still in flight at a step boundary, so
    the loop body that ran never overlapped; else None."""
    launches = len(frames.launches)
    if (frames.status != "finished" or launches < 2 or not _overlap(frames.steps).any()
            or _in_flight(frames)[2].any()):
        return None
    return (f"--loop {frames.loop} ran with overlap on, but none of its {launches} launches "
            "was still in flight at a step boundary: the loop body that ran does not "
            "overlap (another loop's)")


def _no_in_flight_work(frames: Frames) -> str | None:
    if not _overlap(frames.steps).any() and not frames.steps["disagg_queued"].notna().any():
        return "not an overlap loop: no in-flight work"
    if not _in_flight(frames)[2].any():
        return "no step held in-flight work"
    return None


@clause(5, "in-flight predicates test any overlap loop", fields=("result_queue",),
        audit_fields=("result_queue",),
        readers=("release_memory_occupation (asserts it)", "flush_cache",
                 "the health check", "HiCache attach/detach", "PD role switch"),
        unexercised=_no_in_flight_work)
def check_idle_predicate(frames: Frames) -> ClauseResult:
    loop = frames.loop
    launched, queued, in_flight = _in_flight(frames)
    note = f"{int(in_flight.sum())} steps with in-flight work checked"
    found = in_flight & frames.steps["idle_probe"].to_numpy().astype(bool)
    if not found.any():
        return result(5, loop, _NO_ROWS, note)
    bad = frames.steps[found].assign(launched=launched[found], queued=queued[found])
    masked = ~bad["is_fully_idle"].astype(bool)
    queue = loops.known(loop).in_flight
    elsewhere = pd.Series("", index=bad.index).where(
        bad["launched"] <= bad["result_queue_len"],
        " and " + ints(bad["launched"]) + f" launch(es) in flight outside {queue}")
    elsewhere += pd.Series("", index=bad.index).where(
        bad["queued"] == 0, " and " + ints(bad["queued"]) + " request(s) in the "
        "disaggregation queues")
    rows = pd.DataFrame({
        "field": queue, "step": bad["step"].astype("int64"),
        "expected": "not idle (in-flight term)",
        "actual": "idle with " + ints(bad["result_queue_len"]) + " job(s) queued" + elsewhere,
        "explanation": pd.Series(
            "the predicate reported idle while work was in flight", index=bad.index).where(
            ~masked, f"the in-flight term ignores this loop's {queue}; the real "
                     "predicate said busy only because the running/last batch terms did")})
    return result(5, loop, rows, note, masked=bool(masked.all()))
