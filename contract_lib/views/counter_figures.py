"""Clause 2 (counters advanced): counters against ``kv_computed``, and the radix reuse a
lagging counter costs."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from contract_lib import loops
from contract_lib.contract import live_mask
from contract_lib.frames import Frames
from contract_lib.views.style import (
    BLACK,
    BLUE,
    CELL,
    GREEN,
    GREY,
    MAX_WIDTH,
    VERMILLION,
    int_ticks,
    labels_for,
    legend,
    panels,
    post_steps,
    request_rows,
    titles,
    ylabel,
)
from contract_lib.workloads import Workload, load_workload

COUNTER_STYLES = [
    ("kv_computed", "kv_computed (ground truth: positions the forward computed)",
     dict(color=BLACK, linewidth=3.2, alpha=0.35)),
    ("seq_len", "seq_lens", dict(color=BLUE, linewidth=1.5, marker="o", markersize=3.5)),
    ("kv_committed_len", "kv_committed_len", dict(color=BLUE, linewidth=1.5, linestyle="--",
                                                  marker="s", markersize=3.5)),
    ("kv_allocated_len", "kv_allocated_len", dict(color=BLUE, linewidth=1.5, linestyle=":",
                                                  marker="^", markersize=3.5)),
]
"""Counter, legend label and line style; the scheduler's three counters share the
scheduler's colour and differ by line and marker."""

# Vertical nudge (positions) per counter, so counters that coincide stay visible.
_NUDGE = {"kv_computed": 0.0, "seq_len": 0.25, "kv_committed_len": 0.0,
          "kv_allocated_len": -0.25}
_X_AXES = {"step": "step (scheduler-loop iteration)",
           "emitted": "tokens emitted by the request so far"}


def _through_finish(rows: pd.DataFrame) -> pd.DataFrame:
    """A request's live rows and the row of the step it finished at (so the lines end
    at the values the request finished with)."""
    finished = rows["finished"].astype(bool)
    first_done = rows.loc[finished, "step"].min()
    keep = live_mask(rows) | (rows["step"] == first_done)
    return rows[keep & rows["kv_computed"].notna()]


def counter_drift(*runs: Frames, rid: str, labels: Sequence[str] | None = None,
                  x: str = "step") -> Figure:
    """A request's counters against ``kv_computed``, one panel per run, over steps
    (``x="step"``) or over the tokens it has emitted (``x="emitted"``, which lines runs
    of different step counts up); the gap between computed and committed positions is
    shaded, and each line ends at the value the request finished with."""
    if x not in _X_AXES:
        raise ValueError(f"x must be one of {', '.join(_X_AXES)}, not {x!r}")
    view = panels(runs, labels, sharey=True)
    fig, axes, summary = view.fig, view.axes, view.summary
    for ax, frames, name in view:
        rows = request_rows(frames, rid)
        drawn = _through_finish(rows)
        xs = drawn[x].astype(int)
        for column, _, style in COUNTER_STYLES:
            px, py = post_steps(xs, drawn[column].astype(float) + _NUDGE[column])
            ax.step(px, py, where="post", **style)
        px, computed = post_steps(xs, drawn["kv_computed"].astype(float))
        _, committed = post_steps(xs, drawn["kv_committed_len"].astype(float))
        ax.fill_between(px, committed, computed, step="post", color=VERMILLION, alpha=0.15,
                        where=np.array(computed) > np.array(committed))
        done = rows[rows["finished"].astype(bool)]
        if not done.empty:
            end = done.iloc[0]
            ax.axvline(end[x], color=GREY, linestyle="-.", linewidth=1)
            ax.text(0.97, 0.04, f"finished at step {int(end['step'])}:\ncommitted "
                    f"{int(end['kv_committed_len'])} of {int(end['kv_computed'])} computed",
                    transform=ax.transAxes, ha="right", va="bottom", fontsize=CELL,
                    bbox=dict(facecolor="white", edgecolor=GREY, alpha=0.9))
            summary.append(f"{name} commits {int(end['kv_committed_len'])} of "
                           f"{int(end['kv_computed'])}")
        lag = int((drawn["kv_computed"] - drawn["kv_committed_len"]).max()) if len(drawn) else 0
        ax.set_title(f"{name}: request {rid}\nlargest lag behind kv_computed: {lag}")
        ax.set_xlabel(_X_AXES[x])
        int_ticks(ax, "x")
        int_ticks(ax, "y")
        ax.grid(alpha=0.3)
    ylabel(axes, "positions (tokens)")
    handles = [Line2D([], [], label=label, **style) for _, label, style in COUNTER_STYLES]
    handles.append(Patch(facecolor=VERMILLION, alpha=0.15,
                         label="computed but not committed (lost to the radix tree)"))
    legend(fig, handles, ncols=3)
    titles(fig, f"Clause 2, counters advanced: request {rid}",
           "The three counters must sit on the grey line (nudged apart by a quarter "
           "position so coinciding lines stay visible). " + "; ".join(summary)
           + ": release_kv_cache inserts into the radix tree only up to the committed "
           "count.")
    return fig


def _reuse_ideal(runs: Sequence[Frames], rid: str, workload: Workload | str | Path | None
                 ) -> tuple[str, int | None, int | None]:
    """The parent of later turn ``rid``, the ideal reuse and the index of the run it is
    taken from:
    the first finished run of a reference loop among ``runs`` (else the first finished
    run; a run that stopped early never shows the parent's whole output); None, None
    when no run finished with the parent in it."""
    spec = load_workload(workload or runs[0].meta["workload"]) \
        if not isinstance(workload, Workload) else workload
    turn = spec.request(rid)
    if turn.turn_of is None:
        raise ValueError(f"request {rid!r} is not a later turn; pass ideal=")
    finished = [i for i, f in enumerate(runs) if f.status == "finished"
                and (f.requests["rid"] == turn.turn_of).any()]
    source = next((i for i in finished if loops.known(runs[i].loop).reference),
                  finished[0] if finished else None)
    if source is None:
        return turn.turn_of, None, None
    parent = request_rows(runs[source], turn.turn_of).iloc[-1]
    return turn.turn_of, int(parent["prompt_len"]) + int(parent["emitted"]) - 1, source


def radix_reuse_table(*runs: Frames, rid: str = "a2", labels: Sequence[str] | None = None,
                      ideal: int | None = None,
                      workload: Workload | str | Path | None = None) -> pd.DataFrame:
    """``cached_tokens`` of a later turn per run, against the ideal reuse: the parent
    turn's prompt + output - 1 (every position whose KV the parent computed; the last
    output token is never fed back), taken from the first finished run of a reference
    loop (else the first finished run; missing when none finished). ``workload`` (a name,
    a ``.toml`` path or a :class:`~contract_lib.workloads.Workload`) says which request
    is whose later turn; by default the workload the first run names. ``attrs``:
    ``parent``, and ``ideal_from``, the label of the run the ideal comes from."""
    names = labels_for(runs, labels)
    parent = ideal_from = None
    if ideal is None:
        parent, ideal, source = _reuse_ideal(runs, rid, workload)
        ideal_from = None if source is None else names[source]
    rows = []
    for frames, name in zip(runs, names):
        seen = frames.requests[frames.requests["rid"] == rid]
        cached = int(seen["cached_tokens"].iloc[-1]) if len(seen) else None
        rows.append({"run": name, "cached_tokens": cached, "ideal": ideal,
                     "difference": None if None in (cached, ideal) else cached - ideal})
    table = pd.DataFrame(rows).astype({"cached_tokens": "Int64", "ideal": "Int64",
                                       "difference": "Int64"})
    table.attrs.update(parent=parent, ideal_from=ideal_from)
    return table


def radix_reuse(*runs: Frames, rid: str = "a2", labels: Sequence[str] | None = None,
                ideal: int | None = None,
                workload: Workload | str | Path | None = None) -> Figure:
    """Bar chart of :func:`radix_reuse_table`: cached tokens of the later turn per run."""
    table = radix_reuse_table(*runs, rid=rid, labels=labels, ideal=ideal, workload=workload)
    if table["ideal"].isna().all():
        raise ValueError(f"no run finished with {table.attrs['parent']} in it: no ideal "
                         f"reuse of {rid} to draw against; pass ideal=")
    ideal = int(table["ideal"].iloc[0])
    parent = table.attrs.get("parent")
    fig = Figure(figsize=(min(MAX_WIDTH, max(6.5, 1.9 * len(table) + 2.5)), 4.8),
                 layout="constrained")
    ax = fig.subplots()
    cached = table["cached_tokens"].fillna(0).astype(int)
    colours = [GREY if pd.isna(c) else GREEN if c >= ideal else VERMILLION
               for c in table["cached_tokens"]]
    bars = ax.bar(table["run"], cached, color=colours, width=0.6)
    ax.bar_label(bars, labels=["never ran" if pd.isna(c) else f"{c} ({d:+d})" for c, d in
                               zip(table["cached_tokens"], table["difference"])],
                 padding=2, fontsize=CELL)
    ax.axhline(ideal, color="black", linestyle="--", linewidth=1.2)
    ax.set_ylabel(f"cached_tokens of {rid} (prefix served by the radix tree)")
    ax.set_xlabel("run")
    ax.set_ylim(0, max(ideal, int(cached.max())) * 1.18)
    whose = f"{parent}'s prompt + output - 1" if parent else "ideal"
    handles = [Line2D([], [], color="black", linestyle="--",
                      label=f"ideal: every position {parent or 'the parent'} computed "
                            f"({whose} = {ideal})"),
               Patch(facecolor=GREEN, label="reuses at least the ideal"),
               Patch(facecolor=VERMILLION, label="re-computes cached KV (cache loss)")]
    legend(fig, handles, ncols=2)
    short = table[table["difference"].fillna(0) < 0]
    said = ", ".join(f"{r.run} loses {-r.difference}" for r in short.itertuples())
    titles(fig, f"Clause 2 downstream: radix reuse of the second turn {rid}",
           (said or "no run loses cached tokens") + "; each lost token is a position "
           "the first turn computed but never committed, so its KV is computed again.")
    return fig

