"""This project's extension clauses (6, 7) and the memory-pressure view of clause 2."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from contract_lib.contract import check, live_mask
from contract_lib.frames import Frames
from contract_lib.views.style import (
    BLACK,
    BLUE,
    GREY,
    LIGHT_GREEN,
    LIGHT_GREY,
    ORANGE,
    SALMON,
    STEP_LABEL,
    VERMILLION,
    count_axes,
    int_ticks,
    legend,
    panels,
    post_steps,
    titles,
    ylabel,
)


def clock_table(frames: Frames) -> pd.DataFrame:
    """Per step: the HRRN clock ``processed_tokens_counter`` at the step boundary, the
    tokens the step's launches prefilled (``prefilled_tokens``), and the clock's advance
    to the next boundary (clause 6 wants advance == prefilled)."""
    steps = frames.steps.sort_values("step")[["step", "processed_tokens_counter"]]
    prefilled = frames.launches.groupby("step")["prefilled_tokens"].sum()
    table = steps.assign(prefilled=steps["step"].map(prefilled).fillna(0).astype(int))
    table["advance"] = table["processed_tokens_counter"].shift(-1) - table[
        "processed_tokens_counter"]
    return table.astype({"advance": "Int64"}).reset_index(drop=True)


def scheduling_clock(*runs: Frames, labels: Sequence[str] | None = None) -> Figure:
    """Clause 6: the HRRN clock per step against the tokens the run has prefilled so
    far, one panel per run."""
    view = panels(runs, labels, sharey=True)
    for ax, frames, name in view:
        table = clock_table(frames)
        truth = table["prefilled"].cumsum().shift(1, fill_value=0)
        base = int(table["processed_tokens_counter"].iloc[0])
        x, y = post_steps(table["step"], truth + base)
        ax.step(x, y, where="post", color=BLACK, linewidth=3, alpha=0.35)
        x, y = post_steps(table["step"], table["processed_tokens_counter"])
        ax.step(x, y, where="post", color=BLUE, linewidth=1.6)
        end = int(table["processed_tokens_counter"].iloc[-1])
        ax.set_title(f"{name} ({frames.meta['workload']})\nclock {end}, prefilled "
                     f"{int(table['prefilled'].sum())}")
        count_axes(ax)
        view.summary.append(f"{name}: clock {end} for {int(table['prefilled'].sum())} "
                            "prefilled tokens")
    ylabel(view.axes, "tokens")
    legend(view.fig, [Line2D([], [], color=BLACK, linewidth=3, alpha=0.35,
                             label="tokens prefilled so far (ground truth)"),
                      Line2D([], [], color=BLUE, linewidth=1.6,
                             label="processed_tokens_counter (HRRN's clock)")])
    titles(view.fig, "Clause 6, scheduling clocks advanced: processed_tokens_counter",
           "The clock must advance by the tokens each step prefilled. "
           + "; ".join(view.summary) + ".")
    return view.fig


_RETIRED = [
    ("held", "held by the scheduler, backend state present", LIGHT_GREEN),
    ("held, no state", "held by the scheduler, no backend state", LIGHT_GREY),
    ("left over", "released, backend state still present (allowed until a launch "
                  "completes)", SALMON),
    ("violation", "released, state still present: a clause-7 violation", VERMILLION),
]


def retired_lanes(*runs: Frames, labels: Sequence[str] | None = None) -> Figure:
    """Clause 7: per request and step, whether the scheduler holds the request and
    whether the backend keeps state for it; the checker's violations in red."""
    view = panels(runs, labels, height=3.8)
    cmap = ListedColormap([c for *_, c in _RETIRED])
    code = {name: i for i, (name, *_) in enumerate(_RETIRED)}
    for ax, frames, name in view:
        requests = frames.requests
        rids = list(dict.fromkeys(requests["rid"]))
        first, last = int(frames.steps["step"].min()), int(frames.steps["step"].max())
        grid = np.full((len(rids), last - first + 1), np.nan)
        held = set(zip(requests.loc[live_mask(requests), "step"],
                       requests.loc[live_mask(requests), "rid"]))
        state = set(zip(frames.backend_state["step"], frames.backend_state["rid"]))
        violations = check(frames).clauses[7].violations
        bad = set(zip(violations["step"], violations["rid"]))
        for (step, rid) in held | state:
            if rid not in rids:
                continue
            kind = ("violation" if (step, rid) in bad else
                    "held" if (step, rid) in held and (step, rid) in state else
                    "held, no state" if (step, rid) in held else "left over")
            grid[rids.index(rid), int(step) - first] = code[kind]
        ax.imshow(np.ma.masked_invalid(grid), aspect="auto", cmap=cmap, vmin=-0.5,
                  vmax=len(_RETIRED) - 0.5, interpolation="nearest",
                  extent=(first - 0.5, last + 0.5, len(rids) - 0.5, -0.5))
        ax.set_yticks(range(len(rids)), rids)
        ax.set_xlabel(STEP_LABEL)
        int_ticks(ax, "x")
        ax.set_title(f"{name} ({frames.meta['workload']})\n{len(violations)} violations")
        view.summary.append(f"{name}: {len(violations)}")
    ylabel(view.axes, "request")
    legend(view.fig, [Patch(facecolor=c, edgecolor="#777777", label=l)
                      for _, l, c in _RETIRED], ncols=2)
    titles(view.fig, "Clause 7, request state retired: the backend's per-request state",
           "A released request's backend state must be gone once a later launch has "
           "completed (violations: " + ", ".join(view.summary) + ").")
    return view.fig


def memory_table(frames: Frames) -> pd.DataFrame:
    """Per step, over the live requests: positions computed (``kv_computed``), what the
    scheduler accounts for (``kv_committed_len``), the pool size (``kv_total``) and the
    retractions so far."""
    requests = frames.requests
    live = requests[live_mask(requests)]
    sums = live.groupby("step")[["kv_computed", "kv_committed_len"]].sum()
    retractions = requests.groupby("step")["retractions"].sum()
    steps = frames.steps.sort_values("step").set_index("step")
    return pd.DataFrame({
        "computed": sums["kv_computed"].reindex(steps.index, fill_value=0),
        "accounted": sums["kv_committed_len"].reindex(steps.index, fill_value=0),
        "pool": steps["kv_total"],
        "retractions": retractions.reindex(steps.index).ffill().fillna(0),
    }).astype(int).reset_index()


def memory_pressure(*runs: Frames, labels: Sequence[str] | None = None) -> Figure:
    """Clause 2 under memory pressure: per step, the positions the live requests have
    computed against what the scheduler accounts for and the pool's size; retractions
    marked. A loop whose counters lag never sees the pool fill, so never retracts."""
    view = panels(runs, labels, sharey=True)
    for ax, frames, name in view:
        table = memory_table(frames)
        for column, style in (("computed", dict(color=BLACK, linewidth=3, alpha=0.35)),
                              ("accounted", dict(color=BLUE, linewidth=1.6))):
            x, y = post_steps(table["step"], table[column])
            ax.step(x, y, where="post", **style)
        ax.axhline(int(table["pool"].iloc[0]), color=GREY, linestyle="--", linewidth=1.2)
        retracted = table[table["retractions"].diff().fillna(0) > 0]["step"]
        for step in retracted:
            ax.axvline(step, color=ORANGE, linewidth=1.4, linestyle=":")
        over = int((table["computed"] > table["pool"]).sum())
        ax.set_title(f"{name} ({frames.meta['workload']})\n"
                     f"{int(table['retractions'].iloc[-1])} retractions, computed above "
                     f"the pool at {over} steps")
        count_axes(ax)
        view.summary.append(f"{name}: {int(table['retractions'].iloc[-1])} retractions, "
                            f"peak computed {int(table['computed'].max())}")
    ylabel(view.axes, "positions (tokens) over the live requests")
    legend(view.fig, [Line2D([], [], color=BLACK, linewidth=3, alpha=0.35,
                             label="computed (kv_computed, summed)"),
                      Line2D([], [], color=BLUE, linewidth=1.6,
                             label="accounted by the scheduler (kv_committed_len, summed)"),
                      Line2D([], [], color=GREY, linestyle="--", label="KV pool size"),
                      Line2D([], [], color=ORANGE, linestyle=":",
                             label="a request retracted (check_decode_mem)")], ncols=2)
    titles(view.fig, "Clause 2 under memory pressure: computed positions against the pool",
           "; ".join(view.summary) + ".")
    return view.fig
