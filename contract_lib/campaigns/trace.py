"""Step traces in the Chrome trace event format, for ui.perfetto.dev and chrome://tracing.

One process per loop, so several loops sit side by side. Tracks (threads) per process:
``scheduler step`` (one slice per step boundary-to-boundary), ``violations: clause N``
(one instant event per step, field and request, with the count and the first violation's
expected and actual), ``launches: fresh #k`` and ``launches: chained #k`` (one slice per launch, from
its launch step to the step ``process_batch_result`` received it; launches are spread
over numbered lanes so no two slices on a track overlap, which Perfetto rejects), and one
track per request (arrival to finish). Counter tracks per request: tokens computed,
``seq_lens``, ``kv_committed_len``, tokens emitted.

Timestamps are synthetic by default: step ``k`` spans ``[k * 1000, (k + 1) * 1000)`` us, so
the same run gives a byte-identical file. ``wall_clock=True`` uses the recorded wall time
of each step boundary instead (launch slices then keep their step-relative position).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from contract_lib.atomic import atomic_write
from contract_lib.contract import Report, check
from contract_lib.frames import Frames

STEP_US = 1000
_MARGIN_US = 50


def _clock(frames: Frames, wall_clock: bool):
    """step -> start timestamp (us) and duration (us) of that step."""
    steps = frames.steps.sort_values("step")
    if not wall_clock or steps.empty:
        return (lambda step: float(step) * STEP_US), (lambda step: float(STEP_US))
    starts = dict(zip(steps["step"], (steps["wall_time"] - steps["wall_time"].min()) * 1e6))
    last = max(starts)
    typical = max(1.0, float(pd.Series(list(starts.values())).diff().median() or STEP_US))

    def start(step):
        step = int(step)
        return starts.get(step, starts[last] + (step - last) * typical)

    return start, (lambda step: max(1.0, start(int(step) + 1) - start(step)))


def _plain(value):
    """A JSON-native value: numpy scalars unwrapped, NaN as None."""
    if value is None:
        return None
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and value != value:
        return None
    return value


def _lanes(intervals: list[tuple[float, float]]) -> list[int]:
    """Greedy interval partitioning: the lane of each interval, none overlapping."""
    ends: list[float] = []
    lanes = []
    for begin, end in intervals:
        for lane, lane_end in enumerate(ends):
            if lane_end <= begin:
                ends[lane] = end
                lanes.append(lane)
                break
        else:
            ends.append(end)
            lanes.append(len(ends) - 1)
    return lanes


def trace_events(frames: Frames, report: Report | None = None, *, pid: int = 1,
                 wall_clock: bool = False) -> list[dict[str, Any]]:
    """The trace events of one run (one process)."""
    report = report if report is not None else check(frames)
    start, duration = _clock(frames, wall_clock)
    patch = f" + {frames.meta['patch']}" if frames.meta.get("patch") else ""
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
         "args": {"name": f"{frames.loop}{patch} ({frames.meta['workload']})"}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
         "args": {"sort_index": pid}},
    ]
    tids: dict[str, int] = {}

    def tid(track: str) -> int:
        if track not in tids:
            tids[track] = len(tids) + 1
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tids[track],
                           "args": {"name": track}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid,
                           "tid": tids[track], "args": {"sort_index": tids[track]}})
        return tids[track]

    for row in frames.steps.sort_values("step").itertuples(index=False):
        events.append({
            "ph": "X", "name": f"step {row.step}", "cat": "step", "pid": pid,
            "tid": tid("scheduler step"), "ts": start(row.step),
            "dur": duration(row.step) - 1,
            "args": {"forward_ct": int(row.forward_ct), "in_flight": int(row.result_queue_len),
                     "is_fully_idle": bool(row.is_fully_idle),
                     "idle_probe": bool(row.idle_probe), "running_bs": int(row.running_bs),
                     "running_mode": _plain(row.running_mode)}})

    last_step = int(frames.steps["step"].max()) if len(frames.steps) else 0
    for kind in ("fresh", "chained"):
        launches = frames.launches[frames.launches["chained"].astype(bool) == (kind == "chained")]
        spans = []
        for row in launches.itertuples(index=False):
            end_step = row.processed_step if pd.notna(row.processed_step) else last_step + 1
            begin = start(row.step) + _MARGIN_US
            end = max(begin + _MARGIN_US, start(end_step) + duration(end_step) / 2)
            spans.append((begin, end, row))
        for (begin, end, row), lane in zip(spans, _lanes([(b, e) for b, e, _ in spans])):
            events.append({
                "ph": "X", "name": f"{row.mode or 'launch'} {row.rids}", "cat": "launch",
                "pid": pid, "tid": tid(f"launches: {kind} #{lane}"), "ts": begin,
                "dur": end - begin,
                "args": {"launch": int(row.launch), "forward_ct": int(row.forward_ct),
                         "forward_iter": None if pd.isna(row.processed_forward_iter)
                         else int(row.processed_forward_iter),
                         "processed_step": None if pd.isna(row.processed_step)
                         else int(row.processed_step)}})

    requests = frames.requests
    for rid, group in requests.groupby("rid", sort=False):
        first = int(group["step"].min())
        finished = group[group["finished"].astype(bool)]
        end_step = int(finished["step"].min()) if len(finished) else last_step
        events.append({"ph": "X", "name": f"request {rid}", "cat": "request", "pid": pid,
                       "tid": tid(f"request {rid}"), "ts": start(first),
                       "dur": max(1.0, start(end_step) - start(first)),
                       "args": {"prompt_len": int(group["prompt_len"].iloc[0])}})
        for row in group.itertuples(index=False):
            values = {"computed": row.kv_computed, "seq_lens": row.seq_len,
                      "kv_committed_len": row.kv_committed_len, "emitted": row.emitted}
            events.append({"ph": "C", "name": f"{rid} tokens", "pid": pid,
                           "ts": start(row.step),
                           "args": {k: (0 if pd.isna(v) else int(v))
                                    for k, v in values.items()}})

    violations = report.violations
    groups = violations.groupby(["clause", "step", "field", "rid"], sort=True, dropna=False)
    for index, ((clause, step, field, rid), group) in enumerate(groups):
        first = group.iloc[0]
        # One track per violated clause, one instant per (step, field, request) with the
        # count, spread inside the step so that no two instants share a timestamp (a
        # viewer nests same-time instants into rows, pushing the other tracks away).
        offset = (index % 50 + 1) * duration(step) / 52
        events.append({
            "ph": "i", "s": "t", "name": f"clause {clause} {field}", "cat": "violation",
            "pid": pid, "tid": tid(f"violations: clause {clause}"),
            "ts": start(step) + offset,
            "args": {"clause": int(clause), "field": field, "rid": _plain(rid),
                     "count": len(group), "expected": str(first["expected"]),
                     "actual": str(first["actual"]), "explanation": first["explanation"]}})
    return events


def build_trace(runs: list[Frames], *, wall_clock: bool = False) -> dict[str, Any]:
    """A whole trace file: one process per run, in the given order."""
    events: list[dict[str, Any]] = []
    for pid, frames in enumerate(runs, start=1):
        events.extend(trace_events(frames, pid=pid, wall_clock=wall_clock))
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"timestamps": "wall clock" if wall_clock else
                          f"synthetic: step k starts at k*{STEP_US} us"}}


def write_trace(runs: list[Frames], path: str | Path, *, wall_clock: bool = False) -> Path:
    """Write the trace of ``runs`` to ``path`` (atomically: a failed write leaves the
    previous file)."""
    path = Path(path)
    with atomic_write(path) as handle:
        handle.write(json.dumps(build_trace(runs, wall_clock=wall_clock), indent=None,
                                separators=(",", ":"), default=str) + "\n")
    return path
