"""The one palette of the notebook suite and the helpers every figure shares.

A colour means one thing in every figure (Okabe-Ito, distinguishable with the common
colour-vision deficiencies):

========== =========================================================================
colour     meaning
========== =========================================================================
GREEN      holds / correct (a recorded slot, a published read, a set stamp)
VERMILLION the violation itself (slot 0, an unpublished read, a missing stamp, lost KV)
SALMON     a milder violation (a stale entry to a free slot, masked, known upstream)
BROWN      state left behind by someone else (a row's previous holder, a cached slot)
PURPLE     another live request (a shared slot, KV written over another request's)
BLUE       what the scheduler recorded (its counters, fresh launches, relay writes)
ORANGE     a chained MLX launch, and what happens only without one
SKY        prefill / extend work and the shared prompt prefix
YELLOW     a mixed (extend + decode) batch
BLACK      ground truth recorded at the model boundary (``kv_computed``, in flight)
GREY       not checked / not applicable / never processed
========== =========================================================================

Every figure is built without pyplot (no global state, Agg-compatible), at most
:data:`MAX_WIDTH` inches wide (about a notebook's output width at 100 dpi, so nothing is
scaled down): runs that do not fit side by side get one row each, and :func:`titles`
sets every text to the sizes below, legible at that width.
"""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Iterator, Sequence

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from contract_lib.frames import Frames

GREEN, VERMILLION, SALMON, BROWN = "#009E73", "#D55E00", "#F4A582", "#8C510A"
PURPLE, BLUE, ORANGE, SKY = "#CC79A7", "#0072B2", "#E69F00", "#56B4E9"
YELLOW, BLACK, GREY = "#F0E442", "#000000", "#999999"
LIGHT_GREEN, LIGHT_GREY, LIGHT_SKY = "#CFE8CF", "#E6E6E6", "#D6E9F5"

STEP_LABEL = "step (scheduler-loop iteration)"
MAX_WIDTH = 10.0  # inches
# Font sizes (points) at MAX_WIDTH: the figure title, its subtitle, a panel's title,
# axis labels, tick labels and legends, and text written inside a plot (cell labels).
TITLE, SUBTITLE, PANEL_TITLE, LABEL, TICK, LEGEND = 14, 11, 12, 11, 10.5, 10.5
CELL, SMALL_CELL = 9.5, 8


def run_label(frames: Frames) -> str:
    """``loop`` or ``loop + patch`` (``mlx real`` for the real runner): how a run is
    named in panels and tables."""
    patch = frames.meta.get("patch")
    loop = f"{frames.loop} real" if frames.meta.get("runner") == "real" else frames.loop
    return f"{loop} + {patch}" if patch else loop


def labels_for(runs: Sequence[Frames], labels: Sequence[str] | None) -> list[str]:
    """``labels`` checked against ``runs``, or each run's :func:`run_label`."""
    if labels is None:
        return [run_label(f) for f in runs]
    if len(labels) != len(runs):
        raise ValueError(f"{len(labels)} labels for {len(runs)} runs")
    return list(labels)


def wrap(text: str, width: int = 100, indent: str = "  ") -> str:
    """Each line of ``text`` wrapped at ``width`` for a notebook's text output
    (continuations indented)."""
    return "\n".join("\n".join(textwrap.wrap(line, width, subsequent_indent=indent,
                                             break_on_hyphens=False) or [""])
                     for line in text.splitlines() or [""])


def figure(n_panels: int, *, panel_width: float = 5.0, height: float = 4.2,
           rows: int = 1, height_ratios: Sequence[float] | None = None,
           sharey: bool = False):
    """A constrained-layout figure with ``rows`` axes per panel and ``n_panels`` panels,
    room left at the top for a title and a subtitle (see :func:`titles`). Panels sit side
    by side when they fit in :data:`MAX_WIDTH`, else one per row, full width. Either way
    ``axes[row][panel]``: the ``row``-th axes of panel ``panel``."""
    side_by_side = n_panels * panel_width <= MAX_WIDTH * 1.05
    ratios = list(height_ratios or [1] * rows)
    if side_by_side:
        fig = Figure(figsize=(max(panel_width * n_panels, 6.5), height), layout="constrained")
        grid = fig.subplots(rows, n_panels, squeeze=False, sharey=sharey,
                            gridspec_kw={"height_ratios": ratios})
        return fig, [list(row) for row in grid]
    fig = Figure(figsize=(MAX_WIDTH, 1.6 + n_panels * (height - 1.2)), layout="constrained")
    grid = fig.subplots(rows * n_panels, 1, squeeze=False, sharey=sharey,
                        gridspec_kw={"height_ratios": ratios * n_panels})
    return fig, [[grid[panel * rows + row][0] for panel in range(n_panels)]
                 for row in range(rows)]


def ylabel(axes: list, text: str, row: int = 0) -> None:
    """``text`` as the y label of row ``row``'s first-column axes (every run's when the
    panels are stacked)."""
    for ax in axes[row]:
        if ax.get_subplotspec().is_first_col():
            ax.set_ylabel(text)


def _sizes(fig: Figure) -> None:
    """Every panel title, axis label and tick label at the suite's sizes."""
    for ax in fig.axes:
        ax.title.set_fontsize(PANEL_TITLE)
        ax.xaxis.label.set_fontsize(LABEL)
        ax.yaxis.label.set_fontsize(LABEL)
        ax.tick_params(labelsize=TICK)


def titles(fig: Figure, title: str, subtitle: str) -> None:
    """Title (bold) and a subtitle saying what the reader should see, above the panels;
    every text of the figure set to the suite's sizes."""
    _sizes(fig)
    width, height = fig.get_size_inches()
    lines = textwrap.wrap(subtitle, width=int(width * 10.5)) or [""]
    fig.text(0.5, 1 - 0.08 / height, title, ha="center", va="top", fontsize=TITLE,
             fontweight="bold")
    fig.text(0.5, 1 - 0.40 / height, "\n".join(lines), ha="center", va="top",
             fontsize=SUBTITLE, style="italic", color="#333333")
    top = 1 - (0.58 + 0.19 * len(lines)) / height
    fig.get_layout_engine().set(rect=(0, 0, 1, top))


def legend(fig: Figure, handles: list, ncols: int | None = None) -> None:
    """The figure's legend below the panels, in as many columns (at most ``ncols``) as
    its longest label lets fit in the figure's width."""
    longest = max(len(h.get_label()) for h in handles) * LEGEND * 0.55 / 72 + 0.7
    fit = max(1, int(fig.get_size_inches()[0] // longest))
    fig.legend(handles=handles, loc="outside lower center", frameon=False, fontsize=LEGEND,
               ncols=min(ncols or 3, fit, len(handles)))


def int_ticks(ax, axis: str = "x") -> None:
    """Integer ticks only (steps, positions, launches and counts are integers)."""
    (ax.xaxis if axis == "x" else ax.yaxis).set_major_locator(
        MaxNLocator(integer=True, min_n_ticks=1))


def count_axes(ax) -> None:
    """A step-by-count panel: step label, integer ticks on both axes, a light grid."""
    ax.set_xlabel(STEP_LABEL)
    int_ticks(ax, "x")
    int_ticks(ax, "y")
    ax.grid(alpha=0.3)


def request_rows(frames: Frames, rid: str) -> pd.DataFrame:
    """The ``requests`` rows of one request, by step; a one-line error naming the known
    requests when it is not in the run."""
    rows = frames.requests[frames.requests["rid"] == rid].sort_values("step")
    if rows.empty:
        known = ", ".join(dict.fromkeys(frames.requests["rid"]))
        raise ValueError(f"request {rid!r} is not in the {run_label(frames)} run "
                         f"(requests: {known})")
    return rows


def post_steps(steps: Sequence[int], values: Sequence[float]):
    """x, y for ``step(where="post")`` so the last value spans its whole step."""
    steps, values = list(steps), list(values)
    if not steps:
        return steps, values
    return steps + [steps[-1] + 1], values + [values[-1]]


def no_frames(ax, frames: Frames, name: str, summary: list[str]) -> bool:
    """Mark a panel whose run recorded no step (it died in setup); True if so."""
    if not frames.steps.empty:
        return False
    reason = f"run {frames.status}"
    if frames.error:
        reason += f":\n{frames.error['type']}: {textwrap.shorten(frames.error['message'], 50)}"
    ax.text(0.5, 0.5, f"no frames recorded\n({reason})", ha="center", va="center",
            transform=ax.transAxes, color=VERMILLION, fontsize=CELL)
    ax.set_title(name)
    ax.set_xlabel(STEP_LABEL)
    summary.append(f"{name}: no frames")
    return True


@dataclasses.dataclass
class Panels:
    """One panel per run: iterate for ``(ax, frames, name)`` of the runs that recorded
    frames (a run without frames gets a marked panel and a summary entry instead);
    ``summary`` collects one phrase per run for the subtitle."""

    fig: Figure
    axes: list
    runs: Sequence[Frames]
    names: list[str]
    summary: list[str]

    def __iter__(self) -> Iterator[tuple[object, Frames, str]]:
        for ax, frames, name in zip(self.axes[0], self.runs, self.names):
            if not no_frames(ax, frames, name, self.summary):
                yield ax, frames, name


def panels(runs: Sequence[Frames], labels: Sequence[str] | None = None,
           **layout) -> Panels:
    """A figure with one column of panels per run (``layout``: see :func:`figure`)."""
    fig, axes = figure(len(runs), **layout)
    return Panels(fig, axes, runs, labels_for(runs, labels), [])
