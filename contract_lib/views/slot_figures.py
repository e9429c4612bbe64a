"""Clause 1 (slots recorded): a request's ``req_to_token`` row over steps."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from contract_lib.contract import live_mask, slot_states
from contract_lib.frames import Frames
from contract_lib.views.style import (
    BLACK,
    BLUE,
    BROWN,
    CELL,
    LIGHT_GREEN,
    LIGHT_GREY,
    PURPLE,
    SALMON,
    SMALL_CELL,
    VERMILLION,
    int_ticks,
    legend,
    panels,
    post_steps,
    request_rows,
    titles,
    ylabel,
)

SLOT_COLOURS = {
    "recorded": ("a real slot of this request", LIGHT_GREEN),
    "not computed": ("allocated, KV not computed yet (not checked)", LIGHT_GREY),
    "slot 0": ("slot 0: never recorded (padding slot)", VERMILLION),
    "free": ("a free slot: stale entry", SALMON),
    "shared": ("held by another live request", PURPLE),
    "stale": ("never written for this request: the row's previous holder's slot", BROWN),
    "misplaced": ("not the slot the forward wrote this position's KV to", BLACK),
}
"""Legend text and colour of each clause-1 state of :func:`contract_lib.contract.slot_states`."""
UNCHECKED = ("recorded", "not computed")


def slot_rows(frames: Frames) -> pd.DataFrame:
    """:func:`contract_lib.contract.slot_states` ordered by step, request and position."""
    return slot_states(frames).sort_values(["step", "rid", "position"]).reset_index(drop=True)


def _state_grid(states: pd.DataFrame):
    codes = {name: i for i, name in enumerate(SLOT_COLOURS)}
    steps = list(range(int(states["step"].min()), int(states["step"].max()) + 1))
    positions = int(states["position"].max()) + 1
    grid = np.full((positions, len(steps)), np.nan)
    labels = np.full((positions, len(steps)), "", dtype=object)
    for r in states.itertuples(index=False):
        grid[r.position, steps.index(r.step)] = codes[r.state]
        labels[r.position, steps.index(r.step)] = str(int(r.slot))
    return steps, grid, labels


def slot_grid(*runs: Frames, rid: str, labels: Sequence[str] | None = None,
              annotate: str = "bad") -> Figure:
    """``req_to_token`` row of one request over steps, one panel per run: every entry
    coloured by its clause-1 state, and the ``kv_computed`` and ``kv_committed_len``
    boundaries drawn across the steps. Slot ids are written in the violating cells
    (``annotate="bad"``), in every cell (``"all"``, legible for short runs) or none."""
    if annotate not in ("bad", "all", "none"):
        raise ValueError(f"annotate must be 'bad', 'all' or 'none', not {annotate!r}")
    view = panels(runs, labels, panel_width=5.6, height=6.4)
    fig, axes, summary = view.fig, view.axes, view.summary
    cmap = ListedColormap([colour for _, colour in SLOT_COLOURS.values()])
    for ax, frames, name in view:
        states = slot_rows(frames)
        states = states[states["rid"] == rid]
        if states.empty:
            ax.text(0.5, 0.5, f"request {rid} was never live", ha="center",
                    transform=ax.transAxes)
            summary.append(f"{name}: no live entries")
            continue
        steps, grid, text = _state_grid(states)
        ax.imshow(np.ma.masked_invalid(grid), origin="lower", aspect="auto", cmap=cmap,
                  vmin=-0.5, vmax=len(SLOT_COLOURS) - 0.5, interpolation="nearest",
                  extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, grid.shape[0] - 0.5))
        bad_codes = [i for i, s in enumerate(SLOT_COLOURS) if s not in UNCHECKED]
        for (pos, col), label in np.ndenumerate(text):
            bad = grid[pos, col] in bad_codes
            if label and (annotate == "all" or (annotate == "bad" and bad)):
                ax.text(steps[col], pos, label, ha="center", va="center",
                        fontsize=CELL if bad else SMALL_CELL, color="white" if bad else "#333333",
                        fontweight="bold" if bad else "normal")
        rows = request_rows(frames, rid)
        live = rows[live_mask(rows) & rows["step"].isin(steps)]
        for column, style in (("kv_computed", dict(color=BLACK, linewidth=2.0)),
                              ("kv_committed_len", dict(color=BLUE, linewidth=1.6,
                                                        linestyle="--"))):
            x, y = post_steps(live["step"] - 0.5, live[column] - 0.5)
            ax.step(x, y, where="post", **style)
        bad = states[~states["state"].isin(UNCHECKED)]
        checked = int((states["state"] != "not computed").sum())
        row_ids = ", ".join(str(int(r)) for r in dict.fromkeys(states["req_pool_idx"]))
        ax.set_title(f"{name}: request {rid} (row {row_ids})\n{len(bad)} of {checked} "
                     "computed entries unrecorded")
        ax.set_xlabel("step (scheduler-loop iteration)")
        int_ticks(ax, "x")
        int_ticks(ax, "y")
        summary.append(f"{name}: {len(bad)} unrecorded")
    ylabel(axes, "position p (column of req_to_token[row, p])")
    handles = [Patch(facecolor=c, edgecolor="#777777", label=l)
               for l, c in SLOT_COLOURS.values()]
    handles += [Line2D([], [], color=BLACK, linewidth=2.0,
                       label="kv_computed: positions below hold computed KV"),
                Line2D([], [], color=BLUE, linewidth=1.6, linestyle="--",
                       label="kv_committed_len: what the scheduler recorded")]
    legend(fig, handles, ncols=3)
    titles(fig, f"Clause 1, slots recorded: req_to_token of request {rid}",
           "Every cell below the black line must hold a real slot of the request; slot ids "
           "are written where they break the clause. "
           + "; ".join(summary) + ".")
    return fig

