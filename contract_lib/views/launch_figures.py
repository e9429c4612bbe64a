"""Overview: fresh vs chained launches per step and the in-flight depth."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from contract_lib.frames import Frames
from contract_lib.views.style import (
    BLUE,
    CELL,
    GREY,
    ORANGE,
    SKY,
    int_ticks,
    legend,
    panels,
    post_steps,
    titles,
    ylabel,
)

_LAUNCH_KINDS = [
    ("prefill", "fresh launch: extend / mixed (prefill)", SKY, "//"),
    ("fresh", "fresh launch: decode (went through run_batch / get_next_batch_to_run)",
     BLUE, None),
    ("chained", "chained launch: decode built on the previous step's lazy tokens",
     ORANGE, "xx"),
]


def launch_kinds(frames: Frames) -> pd.DataFrame:
    """Launches per step by kind (``prefill``, ``fresh`` decode, ``chained``) plus the
    in-flight depth ``result_queue_len``, one row per step."""
    launches = frames.launches
    kind = np.where(launches["chained"].astype(bool), "chained",
                    np.where(launches["mode"].isin(["extend", "mixed"]), "prefill", "fresh"))
    counts = (pd.DataFrame({"step": launches["step"], "kind": kind})
              .groupby(["step", "kind"]).size().unstack(fill_value=0))
    table = frames.steps[["step", "result_queue_len"]].set_index("step")
    for name, *_ in _LAUNCH_KINDS:
        table[name] = counts[name] if name in counts else 0
    return table.fillna(0).astype(int).reset_index()


def launch_timeline(*runs: Frames, labels: Sequence[str] | None = None) -> Figure:
    """Launches per step (fresh vs chained) and the in-flight depth, one panel per run."""
    view = panels(runs, labels, sharey=True)
    fig, axes, summary = view.fig, view.axes, view.summary
    any_dropped = False
    for ax, frames, name in view:
        table = launch_kinds(frames)
        bottom = np.zeros(len(table))
        for kind, _, colour, hatch in _LAUNCH_KINDS:
            ax.bar(table["step"], table[kind], bottom=bottom, width=0.7, color=colour,
                   hatch=hatch, edgecolor="white", linewidth=0.5)
            bottom += table[kind].to_numpy()
        x, y = post_steps(table["step"] - 0.5, table["result_queue_len"])
        ax.step(x, y, where="post", color="black", linewidth=1.8)
        n_chained, n_total = int(table["chained"].sum()), int(len(frames.launches))
        dropped = frames.launches[frames.launches["processed_step"].isna()]
        tops = (table.set_index("step")[[k for k, *_ in _LAUNCH_KINDS]].sum(axis=1))
        for launch in dropped.itertuples(index=False):
            top = float(tops.get(launch.step, 0))
            ax.plot(launch.step, top + 0.3, marker="X", markersize=11, color=GREY,
                    markeredgecolor="black", linestyle="none")
            ax.annotate(launch.rids, (launch.step, top + 0.3), xytext=(8, 0),
                        textcoords="offset points", ha="left", va="center", fontsize=CELL)
        never = (f", {len(dropped)} never processed ("
                 + ", ".join(f"{r.rids} at step {r.step}" for r in dropped.itertuples())
                 + ")") if len(dropped) else ""
        any_dropped = any_dropped or bool(len(dropped))
        ax.set_title(f"{name} ({frames.meta['workload']})\n{n_total} launches, "
                     f"{n_chained} chained{never}")
        ax.set_xlabel("step (scheduler-loop iteration)")
        int_ticks(ax, "x")
        int_ticks(ax, "y")
        ax.grid(axis="y", alpha=0.3)
        summary.append(f"{name}: {n_chained} of {n_total} launches chained{never}")
    ylabel(axes, "launches / jobs in flight")
    handles = [Patch(facecolor=c, hatch=h, edgecolor="white", label=l)
               for _, l, c, h in _LAUNCH_KINDS]
    handles.append(Line2D([], [], color="black", linewidth=1.8,
                          label="in flight at the step boundary (result_queue_len)"))
    if any_dropped:
        handles.append(Line2D([], [], marker="X", markersize=11, color=GREY,
                              markeredgecolor="black", linestyle="none",
                              label="a launch never processed (resolved and dropped), "
                                    "its requests named"))
    legend(fig, handles, ncols=2)
    titles(fig, "Launch timeline: which steps went through the scheduler's bookkeeping",
           "; ".join(summary) + ". A chained launch skips get_next_batch_to_run and "
           "prepare_for_decode, so its step's bookkeeping is what the contract checks.")
    return fig

