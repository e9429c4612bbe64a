"""The contract's history: a clause x release grid per loop, each cell coloured by its
worst status over the runs (:func:`contract_lib.campaigns.history.history_cells`)."""

from __future__ import annotations

import textwrap
from typing import Sequence

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from contract_lib.campaigns.history import KV_POOL, POOL, history_cells, release_label
from contract_lib.campaigns.status import KNOWN_UPSTREAM, ReleasesStatus
from contract_lib.contract import CLAUSES, HOLDS, MASKED, NOT_EXERCISED, NOT_PRESENT, VIOLATED
from contract_lib.views.style import (
    GREEN,
    GREY,
    LIGHT_GREY,
    SALMON,
    VERMILLION,
    legend,
    titles,
)

# status -> (fill, ink, the word in the cell); any other status (a run's fate:
# setup-error, crashed, vacuous, ...) is GREY with its own word.
_LOOK = {
    VIOLATED: (VERMILLION, "white", "violated"),
    "damaged": (VERMILLION, "white", "damaged"),
    "leak": (VERMILLION, "white", "leak"),
    MASKED: (SALMON, "black", "masked"),
    KNOWN_UPSTREAM: (SALMON, "black", "known\nupstream"),
    HOLDS: (GREEN, "white", "holds"),
    "intact": (GREEN, "white", "intact"),
    "balanced": (GREEN, "white", "balanced"),
    NOT_PRESENT: (LIGHT_GREY, "black", "not\npresent"),
    NOT_EXERCISED: (LIGHT_GREY, "black", "not\nexercised"),
}
_LEGEND = [(VERMILLION, "violated (KV pool: damaged; pool conservation: leak)"),
           (SALMON, "violated-masked, or known upstream (a catalogued bug)"),
           (GREEN, "holds (KV pool: intact; pool conservation: balanced)"),
           (LIGHT_GREY, "not present in the release, or not exercised"),
           (GREY, "the run earned no status (crashed, set-up error, ...)")]
_ROWS = {KV_POOL: "MLX KV pool", POOL: "KV pool\nconservation"}
ROW_HEIGHT, WIDTH = 0.42, 10.0


def _look(status: str) -> tuple[str, str, str]:
    return _LOOK.get(status, (GREY, "white", status))


def _fields_text(fields: str) -> str:
    """Up to two violated fields (their last dotted part), one a line; else how many."""
    names = [field.rsplit(".", 1)[-1] for field in fields.split(", ") if field]
    return "\n".join(names) if len(names) <= 2 else f"{len(names)} fields"


def _panel(ax, cells: pd.DataFrame, releases: list[str], title: str) -> None:
    clauses = list(dict.fromkeys(cells["clause"]))
    for y, clause in enumerate(clauses):
        row_cells = cells[cells["clause"] == clause]
        fields = row_cells["fields"].map(_fields_text)
        varying = fields[row_cells["fields"] != ""].nunique() > 1  # tells releases apart
        for row, named in zip(row_cells.itertuples(index=False), fields):
            fill, ink, word = _look(row.status)
            text = word + (f" {row.count}/{row.total}" if row.total > 1 else "")
            x = releases.index(row.sglang)
            ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, facecolor=fill,
                                   edgecolor="white", linewidth=1.5))
            ax.text(x, y - (0.2 if varying and named else 0), text, ha="center",
                    va="center", color=ink, fontsize=7, linespacing=1.0)
            if varying and named:
                ax.text(x, y + 0.17, named, ha="center", va="center", color=ink,
                        fontsize=6, linespacing=1.0)
    ax.set_xlim(-0.5, len(releases) - 0.5)
    ax.set_ylim(len(clauses) - 0.5, -0.5)
    ax.set_xticks(range(len(releases)), releases, fontsize=8.5)
    ax.xaxis.tick_top()
    ax.set_yticks(range(len(clauses)), [
        _ROWS.get(c) or textwrap.fill(f"{c} {CLAUSES[c]}", 22) for c in clauses], fontsize=8)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_title(title, fontsize=9.5, loc="left")


def clause_history(result: ReleasesStatus, loops: Sequence[str] | None = None) -> Figure:
    """Clause x release, one grid per loop (default: every loop of ``result``, in the
    registry's order): each cell the worst status over that release's runs of the
    loop; the violated fields are written where they differ between releases."""
    cells = history_cells(result)
    loops = list(loops or dict.fromkeys(cells["loop"]))
    unknown = [loop for loop in loops if loop not in set(cells["loop"])]
    if unknown:
        raise ValueError(f"no run of loop {', '.join(unknown)} in these releases "
                         f"(loops: {', '.join(dict.fromkeys(cells['loop']))})")
    releases = [release_label(s) for s in result.statuses]
    heights = [cells.loc[cells["loop"] == loop, "clause"].nunique() for loop in loops]
    fig = Figure(figsize=(WIDTH, ROW_HEIGHT * sum(heights) + 0.75 * len(loops) + 1.6),
                 layout="constrained")
    axes = fig.subplots(len(loops), 1, squeeze=False,
                        gridspec_kw={"height_ratios": heights})[:, 0]
    for ax, loop in zip(axes, loops):
        workloads = sorted({w for s in result.statuses for w, l in s.reports if l == loop})
        runner = " (the real MlxModelRunner)" if result.statuses[0].runner == "real" else ""
        _panel(ax, cells[cells["loop"] == loop], releases,
               f"loop {loop}{runner}: {', '.join(workloads)}")
    shown = cells[cells["loop"].isin(loops)]
    fills = {_look(status)[0] for status in shown["status"]}
    legend(fig, [Patch(facecolor=c, label=l) for c, l in _LEGEND if c in fills], ncols=2)
    red = shown["status"].map(lambda status: _look(status)[0] == VERMILLION).sum()
    titles(fig, f"The contract across SGLang {releases[0]} to {releases[-1]}",
           f"{red} of {len(shown)} cells red; each cell is the worst status over the "
           "release's runs of that loop (n/m: in how many it shows).")
    return fig
