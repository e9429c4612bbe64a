"""Clause 3, step stamped (fields ``forward_ct``, ``forward_iter``, ``launch_ts``).

Every launch advances ``forward_ct`` by exactly one; the batch ``process_batch_result``
receives for it carries ``forward_iter == forward_ct`` of that launch and a set
``launch_ts``: the stamp the batch had when it was launched (where the launch recorded
one), increasing over launches, and taken at the launch on the loop's clock
(``time.monotonic()``, as SGLang stamps it and the frames' ``wall_time`` is taken):
between the step boundary the launch followed and the next one. And ``after_idle_gap``
(where the release has it) says whether the scheduler idled since the previous launch:
an iteration ended with nothing to run (``_record_step_counters`` reads it to time the
step; docs/contract.md, "after_idle_gap", says why both loops' shapes are right).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from contract_lib.contract.base import ClauseResult, ordered_by, result
from contract_lib.contract.registry import clause
from contract_lib.frames import Frames


def _nothing_launched(frames: Frames) -> str | None:
    return "no forward was launched" if frames.launches.empty else None


def _rows(field: str, bad: pd.DataFrame, step: str, expected, actual,
          explanation: str) -> pd.DataFrame:
    """The violation rows of one kind: ``bad``'s launches, at their column ``step``."""
    return pd.DataFrame({"field": field, "step": bad[step], "launch": bad["launch"],
                         "expected": expected, "actual": actual, "explanation": explanation})


@clause(3, "step stamped", fields=("forward_ct", "forward_iter", "launch_ts"),
        audit_fields=("forward_ct", "forward_iter", "launch_ts", "after_idle_gap",
                      "_sched_idled"),
        readers=("the watchdog (forward_ct)", "the profiler step predicate",
                 "_record_step_counters (forward_iter, launch_ts)"),
        unexercised=_nothing_launched)
def check_stamps(frames: Frames) -> ClauseResult:
    loop = frames.loop
    launches = ordered_by(frames.launches, "launch")
    ct = launches["forward_ct"].astype("int64")
    expected_ct = ct.shift(1, fill_value=int(frames.steps["forward_ct"].iloc[0])) + 1
    bad_ct = launches[ct != expected_ct]
    processed = launches[launches["processed_step"].notna()]
    iters = processed["processed_forward_iter"]
    bad_iter = processed[iters.isna() | (iters != processed["forward_ct"])]
    # A field the release does not have is not checked (``Frames.absent``).
    has_ts, has_gap = ("launch_ts" not in frames.absent,
                       "after_idle_gap" not in frames.absent)
    ts = pd.to_numeric(processed["processed_launch_ts"], errors="coerce")
    missing = processed[ts.isna()] if has_ts else processed.iloc[:0]
    previous = ts.ffill().shift(1)
    backwards = processed[ts <= previous]
    stamped = pd.to_numeric(processed["launch_ts"], errors="coerce")
    restamped = processed[stamped.notna() & ts.notna() & (ts != stamped)]
    clock = frames.steps.set_index("step")["wall_time"]
    earliest = processed["step"].map(clock)
    latest = (processed["step"] + 1).map(clock).fillna(float("inf"))
    off_clock = processed[(ts < earliest) | (ts > latest)]
    # An idle gap: since the previous launch, an iteration ended with nothing to run.
    # SGLang's loops set ``_sched_idled`` exactly where they leave ``last_batch`` None:
    # torch, an iteration that launched nothing; MLX, also one whose chain broke and
    # then found nothing (after launching). So the boundaries after the previous
    # launch's step, up to this launch's, show ``last_batch`` None (boundary 0, before
    # any iteration, shows the initial None, not an idle iteration).
    previous_step = launches["step"].shift(1, fill_value=-1)[processed.index]
    steps = frames.steps
    idle = np.sort(steps.loc[steps["last_batch_mode"].isna() & (steps["step"] >= 1),
                             "step"].to_numpy(dtype="int64"))
    after_gap = pd.Series(
        np.searchsorted(idle, processed["step"].to_numpy(), side="right")
        > np.searchsorted(idle, previous_step.to_numpy() + 1, side="left"),
        index=processed.index)
    stamped_gap = processed["processed_after_idle_gap"]
    bad_gap = processed[stamped_gap.notna() & (stamped_gap.astype(object) != after_gap)
                        & has_gap]
    parts = []  # a table per kind of violation found (each ~1 ms of pandas to build)
    if len(bad_ct):
        parts.append(_rows(
            "forward_ct", bad_ct, "step", expected_ct[bad_ct.index].astype(object),
            ct[bad_ct.index].astype(object),
            "a launch must advance forward_ct by one; the watchdog and the profiler count "
            "launches by it"))
    if len(bad_iter):
        parts.append(_rows(
            "forward_iter", bad_iter, "processed_step", bad_iter["forward_ct"].astype(object),
            bad_iter["processed_forward_iter"].astype(object),
            "process_batch_result received a batch whose forward_iter is not its launch's "
            "forward_ct"))
    if len(missing):
        parts.append(_rows(
            "launch_ts", missing, "processed_step", "a monotonic timestamp", None,
            "process_batch_result received a batch with no launch_ts; "
            "_record_step_counters subtracts it"))
    if len(backwards):
        parts.append(_rows(
            "launch_ts", backwards, "processed_step",
            [f"> {value:.6f}" for value in previous[backwards.index]],
            [f"{value:.6f}" for value in ts[backwards.index]],
            "launch_ts did not advance between launches; _record_step_counters reads the "
            "time between them"))
    if len(restamped):
        parts.append(_rows(
            "launch_ts", restamped, "processed_step",
            [f"{value:.6f} (stamped at launch)" for value in stamped[restamped.index]],
            [f"{value:.6f}" for value in ts[restamped.index]],
            "the batch was stamped again after its launch; _record_step_counters reads "
            "the time since its launch"))
    if len(off_clock):
        parts.append(_rows(
            "launch_ts", off_clock, "processed_step",
            [f"between {low:.6f} and {high:.6f} (time.monotonic around its launch, "
             f"steps {step} to {step + 1})" for low, high, step in
             zip(earliest[off_clock.index], latest[off_clock.index], off_clock["step"])],
            [f"{value:.6f}" for value in ts[off_clock.index]],
            "launch_ts is not a stamp of the loop's clock taken at the launch; "
            "_record_step_counters subtracts time.monotonic() stamps from it"))
    if len(bad_gap):
        gap = after_gap[bad_gap.index]
        parts.append(_rows(
            "after_idle_gap", bad_gap, "processed_step", gap.astype(object),
            bad_gap["processed_after_idle_gap"].astype(object),
            [f"an iteration between the previous launch (step {int(low)}) and this one "
             f"(step {int(high)}) ended with nothing to run (last_batch None)"
             if idled else f"the previous launch was at step {int(low)}, this one at "
             f"{int(high)}: every iteration between ended with a batch" for idled, low, high
             in zip(gap, previous_step[bad_gap.index], bad_gap["step"])]))
        parts[-1]["explanation"] += ("; _record_step_counters times a step after an idle "
                                     "gap from its own launch, not the previous step's")
    rows = pd.concat(parts or [pd.DataFrame(columns=["step"])])
    rows["step"] = rows["step"].astype("int64")
    note = f"{len(launches)} launches checked"
    return result(3, loop, rows, note)
