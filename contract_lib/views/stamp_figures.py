"""Clause 3 (step stamped): ``forward_ct``, ``forward_iter`` and ``launch_ts`` per launch."""

from __future__ import annotations

import textwrap
from typing import Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from contract_lib.frames import Frames
from contract_lib.views.style import (
    BLACK,
    BLUE,
    CELL,
    GREEN,
    GREY,
    VERMILLION,
    figure,
    int_ticks,
    labels_for,
    legend,
    no_frames,
    post_steps,
    titles,
)


def stamps_table(frames: Frames) -> pd.DataFrame:
    """Per launch: step, mode, chained, ``forward_ct`` after the launch, the expected
    count, and what ``process_batch_result`` received (``forward_iter``; ``launch_ts``
    as ``set`` / ``None``, or ``-`` when the batch was never processed)."""
    launches = frames.launches.sort_values("launch")
    start = int(frames.steps["forward_ct"].iloc[0]) if len(frames.steps) else 0
    processed = launches["processed_step"].notna()
    ts = np.where(~processed, "-",
                  np.where(launches["processed_launch_ts"].notna(), "set", "None"))
    table = pd.DataFrame({
        "launch": launches["launch"].astype(int),
        "step": launches["step"].astype(int),
        "mode": launches["mode"],
        "chained": launches["chained"].astype(bool),
        "forward_ct": launches["forward_ct"].astype(int),
        "expected_ct": start + np.arange(1, len(launches) + 1),
        "forward_iter": launches["processed_forward_iter"].astype("Int64"),
        "launch_ts": ts,
    })
    return table.reset_index(drop=True)


def step_stamps(*runs: Frames, labels: Sequence[str] | None = None) -> Figure:
    """``forward_ct`` and the received ``forward_iter`` per launch against the expected
    count, and whether ``launch_ts`` was set, one column of panels per run."""
    names = labels_for(runs, labels)
    fig, axes = figure(len(runs), height=5.0, rows=2, height_ratios=(4, 1))
    summary = []
    ts_style = {"set": dict(marker="o", color=GREEN), "None": dict(marker="X", color=VERMILLION),
                "-": dict(marker="s", color=GREY)}
    for col, (frames, name) in enumerate(zip(runs, names)):
        ax, lane = axes[0][col], axes[1][col]
        if frames.launches.empty:
            if not no_frames(ax, frames, name, summary):
                ax.text(0.5, 0.5, "no launch", ha="center", transform=ax.transAxes)
                summary.append(f"{name}: no launch")
            lane.set_xlabel("launch (in launch order)")
            continue
        table = stamps_table(frames)
        x = table["launch"]
        ax.plot(x, table["expected_ct"], color=BLACK, linestyle="--", linewidth=1.2)
        xs, ys = post_steps(x, table["forward_ct"])
        ax.step(xs, ys, where="post", color=BLUE, linewidth=1.4)
        ax.plot(x, table["forward_ct"], "o", color=BLUE, markersize=5)
        received = table.dropna(subset=["forward_iter"])
        ax.plot(received["launch"], received["forward_iter"].astype(float), "x",
                color=BLUE, markersize=9, markeredgewidth=1.5)
        status = frames.status
        ax.set_title(f"{name}\n{len(table)} launches, run {status}")
        top = max(int(table["expected_ct"].max()), int(table["forward_ct"].max()))
        ax.set_ylim(-0.6, top + 1)
        ax.set_xlim(0.5, len(table) + 0.5)
        ax.set_ylabel("counter value")
        ax.grid(alpha=0.3)
        int_ticks(ax, "x")
        int_ticks(ax, "y")
        for value, style in ts_style.items():
            hit = table[table["launch_ts"] == value]
            lane.plot(hit["launch"], np.zeros(len(hit)), linestyle="none", markersize=8,
                      **style)
        lane.set_yticks([0], ["launch_ts"])
        lane.set_xlim(ax.get_xlim())
        lane.set_xlabel("launch (in launch order)")
        int_ticks(lane, "x")
        if frames.error:
            ax.text(0.02, 0.97, f"{frames.error['type']}: "
                    + textwrap.shorten(frames.error["message"], 60), transform=ax.transAxes,
                    va="top", fontsize=CELL, color=VERMILLION)
        moved = bool((table["forward_ct"] == table["expected_ct"]).all())
        ts_none = int((table["launch_ts"] == "None").sum())
        summary.append(f"{name}: forward_ct {'advances' if moved else 'does not advance'}"
                       f" per launch, launch_ts missing on {ts_none}")
    handles = [Line2D([], [], color=BLACK, linestyle="--",
                      label="expected forward_ct (one more per launch)"),
               Line2D([], [], color=BLUE, marker="o", label="forward_ct after the launch"),
               Line2D([], [], color=BLUE, marker="x", linestyle="none", markeredgewidth=1.5,
                      label="forward_iter received by process_batch_result"),
               Line2D([], [], linestyle="none", label="launch_ts received: set",
                      **ts_style["set"]),
               Line2D([], [], linestyle="none", label="launch_ts received: None",
                      **ts_style["None"]),
               Line2D([], [], linestyle="none", label="batch never processed",
                      **ts_style["-"])]
    legend(fig, handles, ncols=3)
    titles(fig, "Clause 3, step stamped: forward_ct, forward_iter and launch_ts per launch",
           "; ".join(summary) + ".")
    return fig

