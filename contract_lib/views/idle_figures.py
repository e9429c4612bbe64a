"""Clause 5 (in-flight predicates): ``is_fully_idle()`` against the in-flight queue."""

from __future__ import annotations

from typing import Sequence

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from contract_lib.frames import Frames
from contract_lib.views.style import (
    BLACK,
    BLUE,
    CELL,
    LIGHT_GREEN,
    VERMILLION,
    int_ticks,
    legend,
    panels,
    titles,
)

_IDLE_CELLS = [
    ("empty", "nothing in flight", "white"),
    ("in flight", "jobs in flight (count written in the cell)", BLACK),
    ("busy", "predicate says busy", BLUE),
    ("idle", "predicate says idle (nothing in flight)", LIGHT_GREEN),
    ("wrong", "says idle while work is in flight", VERMILLION),
]


def idle_predicate(*runs: Frames, labels: Sequence[str] | None = None) -> Figure:
    """Per step: jobs in flight (``result_queue_len``), ``is_fully_idle()`` as the
    loop's readers call it, and the probe with every other term masked to idle; one
    panel per run. A red cell is the in-flight term missing queued work."""
    view = panels(runs, labels, panel_width=5.4, height=3.6)
    fig, summary = view.fig, view.summary
    cmap = ListedColormap([c for *_, c in _IDLE_CELLS])
    code = {name: i for i, (name, *_) in enumerate(_IDLE_CELLS)}
    for ax, frames, name in view:
        steps = frames.steps.sort_values("step")
        queue = steps["result_queue_len"].astype(int).to_numpy()
        grid = np.zeros((3, len(steps)))
        for i, (q, real, probe) in enumerate(zip(queue, steps["is_fully_idle"].astype(bool),
                                                 steps["idle_probe"].astype(bool))):
            grid[0, i] = code["in flight" if q else "empty"]
            for row, says_idle in ((1, real), (2, probe)):
                grid[row, i] = code["busy" if not says_idle else
                                    ("wrong" if q else "idle")]
        first, last = int(steps["step"].iloc[0]), int(steps["step"].iloc[-1])
        ax.imshow(grid, aspect="auto", cmap=cmap, vmin=-0.5, vmax=len(_IDLE_CELLS) - 0.5,
                  interpolation="nearest", extent=(first - 0.5, last + 0.5, 2.5, -0.5))
        for i, q in enumerate(queue):
            if q:
                ax.text(first + i, 0, str(q), ha="center", va="center", fontsize=CELL,
                        color="white")
        for y in (0.5, 1.5):
            ax.axhline(y, color="white", linewidth=2)
        ax.set_yticks([0, 1, 2], ["result_queue\n(in flight)", "is_fully_idle()\nas called",
                                  "is_fully_idle()\nother terms masked"])
        ax.set_xlabel("step (scheduler-loop iteration)")
        int_ticks(ax, "x")
        wrong = int(((queue > 0) & steps["idle_probe"].astype(bool).to_numpy()).sum())
        in_flight = int((queue > 0).sum())
        ax.set_title(f"{name} ({frames.meta['workload']})\nmasked probe idle at {wrong} of "
                     f"{in_flight} in-flight steps")
        summary.append(f"{name}: {wrong}/{in_flight}")
    handles = [Patch(facecolor=c, edgecolor="#777777", label=l) for _, l, c in _IDLE_CELLS]
    legend(fig, handles, ncols=3)
    titles(fig, "Clause 5, in-flight predicates: is_fully_idle() against the in-flight queue",
           "Steps where the masked probe says idle with work in flight ("
           + ", ".join(summary) + "): the real answer was right only because the running "
           "and last batch terms said busy.")
    return fig

