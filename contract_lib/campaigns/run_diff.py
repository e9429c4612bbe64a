"""Two runs of one workload side by side: later turns' radix reuse, the KV pool over the
run, and the first step whose frames differ (``compare``'s per-run table)."""

from __future__ import annotations

import pandas as pd

from contract_lib.contract import kv_damage
from contract_lib.frames import Frames
from contract_lib.workloads import load_workload


def left_aligned(table: pd.DataFrame) -> str:
    """A table as left-aligned text columns."""
    widths = {c: max([len(str(c))] + [len(str(v)) for v in table[c]]) for c in table}
    rows = [[str(c) for c in table]] + [[str(v) for v in row] for row in table.values]
    return "\n".join("  ".join(f"{v:<{widths[c]}}" for v, c in zip(row, table))
                     for row in rows)


def later_turns(workload: str) -> list[str]:
    return [r.rid for r in load_workload(workload).requests if r.turn_of is not None]


def cached_tokens_at_end(frames: Frames, rid: str) -> str:
    """A later turn's ``cached_tokens`` at its last step (``-`` if it never ran)."""
    seen = frames.requests[frames.requests["rid"] == rid]
    return str(int(seen["cached_tokens"].iloc[-1])) if len(seen) else "-"


def pool_summary(frames: Frames) -> str:
    """The KV pool over the run: SGLang's conservation law (``balanced`` or how many steps
    leak), the peak positions in use of the pool's total, and whether the MLX KV pool was
    damaged (:func:`contract_lib.contract.kv_damage.damaged`; the model-free runner's, when it was)."""
    steps = frames.steps
    if steps.empty:
        return "-"
    leaks = int(steps["pool_leak"].astype(bool).sum())
    peak = int((steps["kv_total"] - steps["kv_available"]).max())
    state = f"leak at {leaks} steps" if leaks else "balanced"
    if frames.meta.get("runner") == "real" or kv_damage.damaged(frames):  # model-free: when damaged
        verdict = kv_damage.kv_verdict(frames)
        state += {True: ", KV DAMAGED", False: ", KV intact", None: ", KV not judged"}[verdict]
    return f"{state}, peak {peak}/{int(steps['kv_total'].max())}"


def first_difference(base: Frames, head: Frames) -> str:
    """The first step at which any per-step table differs (wall-clock columns aside),
    with the tables and columns that differ there; ``none`` when all are equal."""
    a, b = base.comparable(), head.comparable()
    found: dict[int, list[str]] = {}
    for name in sorted(set(a) & set(b)):
        left, right = a[name], b[name]
        if "step" not in left.columns or left.equals(right):
            continue
        for step in sorted(set(left["step"]) | set(right["step"])):
            x = left[left["step"] == step].reset_index(drop=True)
            y = right[right["step"] == step].reset_index(drop=True)
            if not x.equals(y):
                found.setdefault(int(step), []).append(f"{name}{_columns(x, y)}")
                break
    if not found:
        same = all(a[n].equals(b[n]) for n in set(a) & set(b))
        return "none" if same else "no per-step difference (outputs differ)"
    step = min(found)
    return f"step {step}: {', '.join(found[step])}"


def _columns(x: pd.DataFrame, y: pd.DataFrame) -> str:
    """`` (col, col)``: the columns whose values differ, when both have the same rows."""
    if x.shape != y.shape:
        return f" ({len(x)} vs {len(y)} rows)"
    columns = [c for c in x.columns if not x[c].equals(y[c])]
    return f" ({', '.join(columns)})" if columns else ""
