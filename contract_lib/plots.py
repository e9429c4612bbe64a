"""Figures and small tables for the notebook suite: one function per view of a run.

Every figure function takes :class:`~contract_lib.frames.Frames` (or a
:class:`~contract_lib.contract.Report`) and returns a :class:`matplotlib.figure.Figure`
built without pyplot (no global state, Agg-compatible), with a title, a one-line
subtitle saying what to look at, labelled axes and a legend. Several runs are drawn as
side-by-side panels, one per run, labelled ``loop`` or ``loop + patch`` unless
``labels`` are given. Per-step counters are drawn with ``step(..., where="post")``:
the value a step boundary shows holds until the next boundary.

Nothing here reads a wall clock: ``launch_ts`` is shown as set / None only, so every
figure and table is the same for two runs of the same input.

Views, by clause:

- overview: :func:`launch_timeline` (fresh vs chained launches and the in-flight depth);
- clause 1: :func:`slot_grid` (``req_to_token`` over steps, unrecorded entries marked),
  :func:`slot_states` (the classification behind it, the same as the checker's);
- clause 2: :func:`counter_drift`, :func:`radix_reuse` / :func:`radix_reuse_table`;
- clause 3: :func:`step_stamps`, :func:`stamps_table`;
- clause 4: :func:`relay_events`;
- clause 5: :func:`idle_predicate`;
- triage: :func:`report_table`, :func:`first_violation`, :func:`triage_focus`,
  :func:`frames_around`, :func:`crash_summary`, :func:`bug_card`, :func:`step_snapshot`, :func:`step_figure`,
  :func:`step_explorer` (ipywidgets);
- clause 1 end to end, real MLX runner (``kv_syncs``, ``kv_pool``): :func:`kv_writes`
  (where each position's KV was written, and whose slot that was),
  :func:`kv_pool_verdicts` (the radix-matched slots against mlx-lm's KV),
  :func:`token_table` (emitted tokens against a reference, divergences marked).
"""

from __future__ import annotations

import re
import textwrap
from typing import Any, Sequence

import numpy as np
import pandas as pd
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from contract_lib.contract import CLAUSES, Report, check, live_mask, violation_message
from contract_lib.contract import slot_states as classify_slots
from contract_lib.frames import Frames

# Okabe-Ito: distinguishable with the common colour-vision deficiencies.
BLUE, ORANGE, GREEN, VERMILLION = "#0072B2", "#E69F00", "#009E73", "#D55E00"
PURPLE, SKY, YELLOW, GREY = "#CC79A7", "#56B4E9", "#F0E442", "#999999"

# -- shared helpers --------------------------------------------------------------------------


def run_label(frames: Frames) -> str:
    """``loop`` or ``loop + patch`` (``mlx real`` for the real runner): how a run is
    named in panels and tables."""
    patch = frames.meta.get("patch")
    loop = f"{frames.loop} real" if frames.meta.get("runner") == "real" else frames.loop
    return f"{loop} + {patch}" if patch else loop


def _labels(runs: Sequence[Frames], labels: Sequence[str] | None) -> list[str]:
    if labels is None:
        return [run_label(f) for f in runs]
    if len(labels) != len(runs):
        raise ValueError(f"{len(labels)} labels for {len(runs)} runs")
    return list(labels)


def _figure(n_panels: int, *, panel_width: float = 5.2, height: float = 4.2,
            rows: int = 1, height_ratios: Sequence[float] | None = None,
            sharey: bool = False):
    """A constrained-layout figure with ``rows x n_panels`` axes, room left at the top
    for a title and a subtitle (see :func:`_titles`)."""
    fig = Figure(figsize=(max(panel_width * n_panels, 6.5), height), layout="constrained")
    axes = fig.subplots(rows, n_panels, squeeze=False, sharey=sharey,
                        gridspec_kw={"height_ratios": height_ratios} if height_ratios else None)
    return fig, axes


def _titles(fig: Figure, title: str, subtitle: str) -> None:
    """Title (bold) and a subtitle saying what the reader should see, above the panels."""
    width, height = fig.get_size_inches()
    lines = textwrap.wrap(subtitle, width=int(width * 11.5)) or [""]
    fig.text(0.5, 1 - 0.08 / height, title, ha="center", va="top", fontsize=12.5,
             fontweight="bold")
    fig.text(0.5, 1 - 0.36 / height, "\n".join(lines), ha="center", va="top", fontsize=9.5,
             style="italic", color="#333333")
    top = 1 - (0.5 + 0.17 * len(lines)) / height
    fig.get_layout_engine().set(rect=(0, 0, 1, top))


def _legend(fig: Figure, handles: list, ncols: int | None = None) -> None:
    fig.legend(handles=handles, loc="outside lower center", frameon=False, fontsize=8.5,
               ncols=ncols or min(len(handles), 4))


def _int_ticks(ax, axis: str = "x") -> None:
    from matplotlib.ticker import MaxNLocator

    (ax.xaxis if axis == "x" else ax.yaxis).set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))


def _request_rows(frames: Frames, rid: str) -> pd.DataFrame:
    rows = frames.requests[frames.requests["rid"] == rid].sort_values("step")
    if rows.empty:
        known = ", ".join(dict.fromkeys(frames.requests["rid"]))
        raise ValueError(f"request {rid!r} is not in the {run_label(frames)} run "
                         f"(requests: {known})")
    return rows


def _post_steps(steps: Sequence[int], values: Sequence[float]):
    """x, y for ``step(where="post")`` so the last value spans its whole step."""
    steps, values = list(steps), list(values)
    if not steps:
        return steps, values
    return steps + [steps[-1] + 1], values + [values[-1]]


def _no_frames(ax, frames: Frames, name: str, summary: list[str]) -> bool:
    """Mark a panel whose run recorded no step (it died in setup); True if so."""
    if not frames.steps.empty:
        return False
    reason = f"run {frames.status}"
    if frames.error:
        reason += f":\n{frames.error['type']}: {textwrap.shorten(frames.error['message'], 50)}"
    ax.text(0.5, 0.5, f"no frames recorded\n({reason})", ha="center", va="center",
            transform=ax.transAxes, color=VERMILLION, fontsize=9)
    ax.set_title(name, fontsize=10)
    ax.set_xlabel("step (scheduler-loop iteration)")
    summary.append(f"{name}: no frames")
    return True


# -- overview: launch timeline ---------------------------------------------------------------

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
    names = _labels(runs, labels)
    fig, axes = _figure(len(runs), sharey=True)
    summary = []
    for ax, frames, name in zip(axes[0], runs, names):
        if _no_frames(ax, frames, name, summary):
            continue
        table = launch_kinds(frames)
        bottom = np.zeros(len(table))
        for kind, _, colour, hatch in _LAUNCH_KINDS:
            ax.bar(table["step"], table[kind], bottom=bottom, width=0.7, color=colour,
                   hatch=hatch, edgecolor="white", linewidth=0.5)
            bottom += table[kind].to_numpy()
        x, y = _post_steps(table["step"] - 0.5, table["result_queue_len"])
        ax.step(x, y, where="post", color="black", linewidth=1.8)
        n_chained, n_total = int(table["chained"].sum()), int(len(frames.launches))
        ax.set_title(f"{name} ({frames.meta['workload']})\n{n_total} launches, "
                     f"{n_chained} chained", fontsize=10)
        ax.set_xlabel("step (scheduler-loop iteration)")
        _int_ticks(ax, "x")
        _int_ticks(ax, "y")
        ax.grid(axis="y", alpha=0.3)
        summary.append(f"{name}: {n_chained} of {n_total} launches chained")
    axes[0][0].set_ylabel("launches / jobs in flight")
    handles = [Patch(facecolor=c, hatch=h, edgecolor="white", label=l)
               for _, l, c, h in _LAUNCH_KINDS]
    handles.append(Line2D([], [], color="black", linewidth=1.8,
                          label="in flight at the step boundary (result_queue_len)"))
    _legend(fig, handles, ncols=2)
    _titles(fig, "Launch timeline: which steps went through the scheduler's bookkeeping",
            "; ".join(summary) + ". A chained launch skips get_next_batch_to_run and "
            "prepare_for_decode, so its step's bookkeeping is what the contract checks.")
    return fig


# -- clause 1: req_to_token ------------------------------------------------------------------

SLOT_STATES = {
    "recorded": ("a real slot of this request", "#cfe8cf"),
    "not computed": ("allocated, KV not computed yet (not checked)", "#e6e6e6"),
    "slot 0": ("slot 0: never recorded (padding slot)", VERMILLION),
    "free": ("a free slot: stale entry", ORANGE),
    "shared": ("held by another live request", PURPLE),
    "stale": ("never written for this request: the row's previous holder's slot", "#8c510a"),
}
_BAD_STATES = ("slot 0", "free", "shared", "stale")


def slot_states(frames: Frames) -> pd.DataFrame:
    """Every ``slots`` entry of a live request with its clause-1 state
    (:func:`contract_lib.contract.slot_states`), ordered for plotting."""
    out = classify_slots(frames)[["step", "rid", "req_pool_idx", "position", "slot",
                                  "kv_computed", "state"]]
    return out.sort_values(["step", "rid", "position"]).reset_index(drop=True)


def _state_grid(states: pd.DataFrame):
    codes = {name: i for i, name in enumerate(SLOT_STATES)}
    steps = list(range(int(states["step"].min()), int(states["step"].max()) + 1))
    positions = int(states["position"].max()) + 1
    grid = np.full((positions, len(steps)), np.nan)
    labels = np.full((positions, len(steps)), "", dtype=object)
    for r in states.itertuples(index=False):
        grid[r.position, steps.index(r.step)] = codes[r.state]
        labels[r.position, steps.index(r.step)] = str(int(r.slot))
    return steps, grid, labels


def slot_grid(*runs: Frames, rid: str, labels: Sequence[str] | None = None,
              annotate: bool = True) -> Figure:
    """``req_to_token`` row of one request over steps, one panel per run: every entry
    coloured by its clause-1 state, the slot id written in the cell, and the
    ``kv_computed`` and ``kv_committed_len`` boundaries drawn across the steps."""
    names = _labels(runs, labels)
    fig, axes = _figure(len(runs), panel_width=5.6, height=5.4)
    cmap = ListedColormap([colour for _, colour in SLOT_STATES.values()])
    summary = []
    for ax, frames, name in zip(axes[0], runs, names):
        if _no_frames(ax, frames, name, summary):
            continue
        states = slot_states(frames)
        states = states[states["rid"] == rid]
        if states.empty:
            ax.text(0.5, 0.5, f"request {rid} was never live", ha="center",
                    transform=ax.transAxes)
            summary.append(f"{name}: no live entries")
            continue
        steps, grid, text = _state_grid(states)
        ax.imshow(np.ma.masked_invalid(grid), origin="lower", aspect="auto", cmap=cmap,
                  vmin=-0.5, vmax=len(SLOT_STATES) - 0.5, interpolation="nearest",
                  extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, grid.shape[0] - 0.5))
        if annotate and grid.size <= 2400:
            size = 6 if grid.shape[0] <= 40 else 4.5
            for (pos, col), label in np.ndenumerate(text):
                if label:
                    bad = grid[pos, col] >= 2
                    ax.text(steps[col], pos, label, ha="center", va="center", fontsize=size,
                            color="white" if bad else "#333333",
                            fontweight="bold" if bad else "normal")
        rows = _request_rows(frames, rid)
        live = rows[live_mask(rows) & rows["step"].isin(steps)]
        for column, style in (("kv_computed", dict(color="black", linewidth=2.0)),
                              ("kv_committed_len", dict(color=BLUE, linewidth=1.6,
                                                        linestyle="--"))):
            x, y = _post_steps(live["step"] - 0.5, live[column] - 0.5)
            ax.step(x, y, where="post", **style)
        bad = states[states["state"].isin(_BAD_STATES)]
        checked = int((states["state"] != "not computed").sum())
        row_ids = ", ".join(str(int(r)) for r in dict.fromkeys(states["req_pool_idx"]))
        ax.set_title(f"{name}: request {rid} (row {row_ids})\n{len(bad)} of {checked} "
                     "computed entries unrecorded", fontsize=10)
        ax.set_xlabel("step (scheduler-loop iteration)")
        _int_ticks(ax, "x")
        summary.append(f"{name}: {len(bad)} unrecorded")
    axes[0][0].set_ylabel("position p (column of req_to_token[row, p])")
    handles = [Patch(facecolor=c, edgecolor="#777777", label=l)
               for l, c in SLOT_STATES.values()]
    handles += [Line2D([], [], color="black", linewidth=2.0,
                       label="kv_computed: positions below hold computed KV"),
                Line2D([], [], color=BLUE, linewidth=1.6, linestyle="--",
                       label="kv_committed_len: what the scheduler recorded")]
    _legend(fig, handles, ncols=3)
    _titles(fig, f"Clause 1, slots recorded: req_to_token of request {rid}",
            "Every cell below the black line must hold a real slot of the request. "
            + "; ".join(summary) + ".")
    return fig


# -- clause 2: counters ----------------------------------------------------------------------

_COUNTER_STYLES = [
    ("kv_computed", "kv_computed (ground truth: positions the forward computed)",
     dict(color="black", linewidth=3.2, alpha=0.55)),
    ("seq_len", "seq_lens", dict(color=BLUE, linewidth=1.6)),
    ("kv_committed_len", "kv_committed_len", dict(color=VERMILLION, linewidth=1.6,
                                                  linestyle="--")),
    ("kv_allocated_len", "kv_allocated_len", dict(color=GREEN, linewidth=1.6,
                                                  linestyle=":")),
]


def counter_drift(*runs: Frames, rid: str, labels: Sequence[str] | None = None) -> Figure:
    """A request's counters against ``kv_computed`` over steps, one panel per run; the
    gap between computed and committed positions is shaded."""
    names = _labels(runs, labels)
    fig, axes = _figure(len(runs), sharey=True)
    summary = []
    for ax, frames, name in zip(axes[0], runs, names):
        if _no_frames(ax, frames, name, summary):
            continue
        rows = _request_rows(frames, rid)
        live = rows[live_mask(rows)]
        for column, _, style in _COUNTER_STYLES:
            x, y = _post_steps(live["step"], live[column].astype(float))
            ax.step(x, y, where="post", **style)
        x, computed = _post_steps(live["step"], live["kv_computed"].astype(float))
        _, committed = _post_steps(live["step"], live["kv_committed_len"].astype(float))
        ax.fill_between(x, committed, computed, step="post", color=VERMILLION, alpha=0.15,
                        where=np.array(computed) > np.array(committed))
        done = rows[rows["finished"].astype(bool)]
        if not done.empty:
            end = done.iloc[0]
            ax.axvline(end["step"], color=GREY, linestyle="-.", linewidth=1)
            ax.text(0.97, 0.04, f"finished at step {int(end['step'])}:\ncommitted "
                    f"{int(end['kv_committed_len'])} of {int(end['kv_computed'])} computed",
                    transform=ax.transAxes, ha="right", va="bottom", fontsize=8.5,
                    bbox=dict(facecolor="white", edgecolor=GREY, alpha=0.9))
            summary.append(f"{name} commits {int(end['kv_committed_len'])} of "
                           f"{int(end['kv_computed'])}")
        lag = int((live["kv_computed"] - live["kv_committed_len"]).max()) if len(live) else 0
        ax.set_title(f"{name}: request {rid}\nlargest lag behind kv_computed: {lag}",
                     fontsize=10)
        ax.set_xlabel("step (scheduler-loop iteration)")
        _int_ticks(ax, "x")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("positions (tokens)")
    handles = [Line2D([], [], label=label, **style) for _, label, style in _COUNTER_STYLES]
    handles.append(Patch(facecolor=VERMILLION, alpha=0.15,
                         label="computed but not committed (lost to the radix tree)"))
    _legend(fig, handles, ncols=3)
    _titles(fig, f"Clause 2, counters advanced: request {rid}",
            "The three counters must sit on the grey line. " + "; ".join(summary)
            + ": release_kv_cache inserts into the radix tree only up to the committed "
            "count.")
    return fig


def _reuse_ideal(frames: Frames, rid: str) -> tuple[str, int]:
    from contract_lib.workloads import load_workload

    spec = load_workload(frames.meta["workload"]).request(rid)
    if spec.turn_of is None:
        raise ValueError(f"request {rid!r} is not a later turn; pass ideal=")
    parent = _request_rows(frames, spec.turn_of).iloc[-1]
    return spec.turn_of, int(parent["prompt_len"]) + int(parent["emitted"]) - 1


def radix_reuse_table(*runs: Frames, rid: str = "a2", labels: Sequence[str] | None = None,
                      ideal: int | None = None) -> pd.DataFrame:
    """``cached_tokens`` of a later turn per run, against the ideal reuse: the parent
    turn's prompt + output - 1 (every position whose KV the parent computed; the last
    output token is never fed back), taken from the first run."""
    names = _labels(runs, labels)
    parent = None
    if ideal is None:
        parent, ideal = _reuse_ideal(runs[0], rid)
    rows = []
    for frames, name in zip(runs, names):
        seen = frames.requests[frames.requests["rid"] == rid]
        cached = int(seen["cached_tokens"].iloc[-1]) if len(seen) else None
        rows.append({"run": name, "cached_tokens": cached, "ideal": ideal,
                     "difference": None if cached is None else cached - ideal})
    table = pd.DataFrame(rows).astype({"cached_tokens": "Int64", "difference": "Int64"})
    table.attrs["parent"] = parent
    return table


def radix_reuse(*runs: Frames, rid: str = "a2", labels: Sequence[str] | None = None,
                ideal: int | None = None) -> Figure:
    """Bar chart of :func:`radix_reuse_table`: cached tokens of the later turn per run."""
    table = radix_reuse_table(*runs, rid=rid, labels=labels, ideal=ideal)
    ideal = int(table["ideal"].iloc[0])
    parent = table.attrs.get("parent")
    fig = Figure(figsize=(max(6.5, 1.9 * len(table) + 2.5), 4.6), layout="constrained")
    ax = fig.subplots()
    cached = table["cached_tokens"].fillna(0).astype(int)
    colours = [GREY if pd.isna(c) else GREEN if c >= ideal else VERMILLION
               for c in table["cached_tokens"]]
    bars = ax.bar(table["run"], cached, color=colours, width=0.6)
    ax.bar_label(bars, labels=["never ran" if pd.isna(c) else f"{c} ({d:+d})" for c, d in
                               zip(table["cached_tokens"], table["difference"])],
                 padding=2, fontsize=9)
    ax.axhline(ideal, color="black", linestyle="--", linewidth=1.2)
    ax.set_ylabel(f"cached_tokens of {rid} (prefix served by the radix tree)")
    ax.set_xlabel("run")
    ax.set_ylim(0, max(ideal, int(cached.max())) * 1.18)
    ax.tick_params(axis="x", labelsize=8.5)
    whose = f"{parent}'s prompt + output - 1" if parent else "ideal"
    handles = [Line2D([], [], color="black", linestyle="--",
                      label=f"ideal: every position {parent or 'the parent'} computed "
                            f"({whose} = {ideal})"),
               Patch(facecolor=GREEN, label="reuses at least the ideal"),
               Patch(facecolor=VERMILLION, label="re-computes cached KV (cache loss)")]
    _legend(fig, handles, ncols=2)
    short = table[table["difference"].fillna(0) < 0]
    said = ", ".join(f"{r.run} loses {-r.difference}" for r in short.itertuples())
    _titles(fig, f"Clause 2 downstream: radix reuse of the second turn {rid}",
            (said or "no run loses cached tokens") + "; each lost token is a position "
            "the first turn computed but never committed, so its KV is computed again.")
    return fig


# -- clause 3: step stamps -------------------------------------------------------------------


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
    names = _labels(runs, labels)
    fig, axes = _figure(len(runs), height=5.0, rows=2, height_ratios=(4, 1))
    summary = []
    ts_style = {"set": dict(marker="o", color=GREEN), "None": dict(marker="X", color=VERMILLION),
                "-": dict(marker="s", color=GREY)}
    for col, (frames, name) in enumerate(zip(runs, names)):
        ax, lane = axes[0][col], axes[1][col]
        if frames.launches.empty:
            if not _no_frames(ax, frames, name, summary):
                ax.text(0.5, 0.5, "no launch", ha="center", transform=ax.transAxes)
                summary.append(f"{name}: no launch")
            lane.set_xlabel("launch (in launch order)")
            continue
        table = stamps_table(frames)
        x = table["launch"]
        ax.plot(x, table["expected_ct"], color=GREY, linestyle="--", linewidth=1.2)
        xs, ys = _post_steps(x, table["forward_ct"])
        ax.step(xs, ys, where="post", color=BLUE, linewidth=1.4)
        ax.plot(x, table["forward_ct"], "o", color=BLUE, markersize=5)
        received = table.dropna(subset=["forward_iter"])
        ax.plot(received["launch"], received["forward_iter"].astype(float), "x",
                color=ORANGE, markersize=8, markeredgewidth=2)
        status = frames.status
        ax.set_title(f"{name}\n{len(table)} launches, run {status}", fontsize=10)
        top = max(int(table["expected_ct"].max()), int(table["forward_ct"].max()))
        ax.set_ylim(-0.6, top + 1)
        ax.set_xlim(0.5, len(table) + 0.5)
        ax.set_ylabel("counter value")
        ax.grid(alpha=0.3)
        _int_ticks(ax, "x")
        _int_ticks(ax, "y")
        for value, style in ts_style.items():
            hit = table[table["launch_ts"] == value]
            lane.plot(hit["launch"], np.zeros(len(hit)), linestyle="none", markersize=8,
                      **style)
        lane.set_yticks([0], ["launch_ts"])
        lane.set_xlim(ax.get_xlim())
        lane.set_xlabel("launch (in launch order)")
        _int_ticks(lane, "x")
        if frames.error:
            ax.text(0.02, 0.97, f"{frames.error['type']}: "
                    + textwrap.shorten(frames.error["message"], 60), transform=ax.transAxes,
                    va="top", fontsize=8, color=VERMILLION)
        moved = bool((table["forward_ct"] == table["expected_ct"]).all())
        ts_none = int((table["launch_ts"] == "None").sum())
        summary.append(f"{name}: forward_ct {'advances' if moved else 'does not advance'}"
                       f" per launch, launch_ts missing on {ts_none}")
    handles = [Line2D([], [], color=GREY, linestyle="--",
                      label="expected forward_ct (one more per launch)"),
               Line2D([], [], color=BLUE, marker="o", label="forward_ct after the launch"),
               Line2D([], [], color=ORANGE, marker="x", linestyle="none", markeredgewidth=2,
                      label="forward_iter received by process_batch_result"),
               Line2D([], [], linestyle="none", label="launch_ts received: set",
                      **ts_style["set"]),
               Line2D([], [], linestyle="none", label="launch_ts received: None",
                      **ts_style["None"]),
               Line2D([], [], linestyle="none", label="batch never processed",
                      **ts_style["-"])]
    _legend(fig, handles, ncols=3)
    _titles(fig, "Clause 3, step stamped: forward_ct, forward_iter and launch_ts per launch",
            "; ".join(summary) + ".")
    return fig


# -- clause 4: relay -------------------------------------------------------------------------


def relay_events(*runs: Frames, labels: Sequence[str] | None = None) -> Figure:
    """Relay (``future_map.output_tokens_buf``) reads and writes per step and row, one
    panel per run; reads coloured by whether they saw the value published for that
    request's latest token. Steps that launched a mixed batch are shaded."""
    names = _labels(runs, labels)
    fig, axes = _figure(len(runs), height=4.4)
    summary = []
    styles = {
        "write": dict(marker="^", color=BLUE, markersize=7),
        "published": dict(marker="o", color=GREEN, markersize=7),
        "unpublished": dict(marker="X", color=VERMILLION, markersize=10),
    }
    for ax, frames, name in zip(axes[0], runs, names):
        if _no_frames(ax, frames, name, summary):
            continue
        relay = frames.relay
        mixed_steps = sorted(set(frames.launches.loc[frames.launches["mode"] == "mixed",
                                                     "step"]))
        for step in mixed_steps:
            ax.axvspan(step - 0.5, step + 0.5, color=YELLOW, alpha=0.25, linewidth=0)
        rows = sorted(set(relay["row"].astype(int)))
        if not rows:
            ax.text(0.5, 0.5, "relay never read or written", ha="center",
                    transform=ax.transAxes)
        owners = {}
        for r in relay.dropna(subset=["rid"]).itertuples(index=False):
            owners.setdefault(int(r.row), [])
            if r.rid not in owners[int(r.row)]:
                owners[int(r.row)].append(r.rid)
        writes = relay[relay["event"] == "write"]
        reads = relay[relay["event"] == "read"]
        ok = reads["published_for_rid"].astype(bool)
        for frame, key, dx in ((writes, "write", 0.18), (reads[ok], "published", -0.18),
                               (reads[~ok], "unpublished", -0.18)):
            ax.plot(frame["step"] + dx, frame["row"], linestyle="none", **styles[key])
        for r in reads[~ok].itertuples(index=False):
            ax.annotate(str(int(r.value)), (r.step - 0.18, r.row), xytext=(0, 7),
                        textcoords="offset points", ha="center", fontsize=7.5,
                        color=VERMILLION)
        if rows:
            ax.set_yticks(rows, [f"row {row} ({', '.join(owners.get(row, ['?']))})"
                                 for row in rows])
            ax.set_ylim(min(rows) - 0.7, max(rows) + 0.7)
        ax.set_xlim(-0.5, int(frames.steps["step"].max()) + 0.5)
        ax.set_xlabel("step (scheduler-loop iteration)")
        _int_ticks(ax, "x")
        ax.grid(axis="x", alpha=0.2)
        bad = int((~ok).sum())
        ax.set_title(f"{name} ({frames.meta['workload']})\n{len(writes)} writes, "
                     f"{len(reads)} reads, {bad} unpublished", fontsize=10)
        summary.append(f"{name}: {bad} of {len(reads)} reads unpublished")
    axes[0][0].set_ylabel("relay row (request holding it)")
    handles = [Line2D([], [], linestyle="none", label="write (FutureMap.stash after a "
                                                        "forward)", **styles["write"]),
               Line2D([], [], linestyle="none", label="read by resolve_forward_inputs: the "
                                                        "published token", **styles["published"]),
               Line2D([], [], linestyle="none", label="read of an unpublished row "
                                                        "(value shown; -1 = never written)",
                      **styles["unpublished"]),
               Patch(facecolor=YELLOW, alpha=0.25, label="step launched a mixed batch")]
    _legend(fig, handles, ncols=2)
    _titles(fig, "Clause 4, relays published or provably unread: output_tokens_buf",
            "; ".join(summary) + ". Every read must follow a write of the same row for the "
            "same request's latest token.")
    return fig


# -- clause 5: idle predicate ----------------------------------------------------------------

_IDLE_CELLS = [
    ("empty", "nothing in flight", "white"),
    ("in flight", "jobs in flight (count written in the cell)", "#8c8c8c"),
    ("busy", "predicate says busy", BLUE),
    ("idle", "predicate says idle (nothing in flight)", "#d6e9f5"),
    ("wrong", "says idle while work is in flight", VERMILLION),
]


def idle_predicate(*runs: Frames, labels: Sequence[str] | None = None) -> Figure:
    """Per step: jobs in flight (``result_queue_len``), ``is_fully_idle()`` as the
    loop's readers call it, and the probe with every other term masked to idle; one
    panel per run. A red cell is the in-flight term missing queued work."""
    names = _labels(runs, labels)
    fig, axes = _figure(len(runs), panel_width=5.4, height=3.6)
    cmap = ListedColormap([c for *_, c in _IDLE_CELLS])
    code = {name: i for i, (name, *_) in enumerate(_IDLE_CELLS)}
    summary = []
    for ax, frames, name in zip(axes[0], runs, names):
        if _no_frames(ax, frames, name, summary):
            continue
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
                ax.text(first + i, 0, str(q), ha="center", va="center", fontsize=8,
                        color="white")
        for y in (0.5, 1.5):
            ax.axhline(y, color="white", linewidth=2)
        ax.set_yticks([0, 1, 2], ["result_queue\n(in flight)", "is_fully_idle()\nas called",
                                  "is_fully_idle()\nother terms masked"], fontsize=8.5)
        ax.set_xlabel("step (scheduler-loop iteration)")
        _int_ticks(ax, "x")
        wrong = int(((queue > 0) & steps["idle_probe"].astype(bool).to_numpy()).sum())
        in_flight = int((queue > 0).sum())
        ax.set_title(f"{name} ({frames.meta['workload']})\nmasked probe idle at {wrong} of "
                     f"{in_flight} in-flight steps", fontsize=10)
        summary.append(f"{name}: {wrong}/{in_flight}")
    handles = [Patch(facecolor=c, edgecolor="#777777", label=l) for _, l, c in _IDLE_CELLS]
    _legend(fig, handles, ncols=3)
    _titles(fig, "Clause 5, in-flight predicates: is_fully_idle() against the in-flight queue",
            "Steps where the masked probe says idle with work in flight ("
            + ", ".join(summary) + "): the real answer was right only because the running "
            "and last batch terms said busy.")
    return fig


# -- tables for reports and triage -----------------------------------------------------------


def report_table(report: Report) -> pd.DataFrame:
    """One row per clause: status, violation count and where the first violation is."""
    rows = []
    for number, result in report.clauses.items():
        first = result.first()
        where = "-"
        if first is not None:
            where = f"{first['field']} at step {first['step']}"
            if first.get("rid") is not None:
                where += f", request {first['rid']}"
        rows.append({"clause": f"{number} {result.name}", "status": result.status,
                     "violations": len(result.violations), "first violation": where})
    return pd.DataFrame(rows)


def text_table(table: pd.DataFrame) -> str:
    """A DataFrame as plain text with text columns left-aligned and numbers
    right-aligned (``DataFrame.to_string`` right-aligns everything)."""
    def cell(value) -> str:
        return "-" if value is None or (not isinstance(value, str) and pd.isna(value)) \
            else str(value)

    columns = list(table.columns)
    cells = [[cell(v) for v in table[c]] for c in columns]
    numeric = [pd.api.types.is_numeric_dtype(table[c]) and not
               pd.api.types.is_bool_dtype(table[c]) for c in columns]
    widths = [max([len(str(c))] + [len(v) for v in col]) for c, col in zip(columns, cells)]
    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, widths, numeric)).rstrip()
    return "\n".join([line([str(c) for c in columns])]
                     + [line(row) for row in zip(*cells)])


def first_violation(report: Report) -> dict[str, Any] | None:
    """The first violation of the lowest violated clause (what ``assert_contract``
    raises), or None when every clause holds."""
    for result in report.clauses.values():
        first = result.first()
        if first is not None:
            return first
    return None


def triage_focus(frames: Frames, report: Report) -> tuple[int, str]:
    """Where to look first: the step and request of :func:`first_violation` (for a
    clause without a request, the first request live at that step); with no violation,
    the last step and the first request."""
    first = first_violation(report)
    rids = list(dict.fromkeys(frames.requests["rid"]))
    if first is None:
        return int(frames.steps["step"].max()), rids[0]
    step = int(first["step"])
    if first.get("rid") is not None:
        return step, first["rid"]
    at_step = frames.requests[frames.requests["step"] == step]
    live = at_step[live_mask(at_step)]["rid"].tolist()
    return step, (live or at_step["rid"].tolist() or rids)[0]


def bug_card(clause: int) -> str:
    """The July bugs of one clause from ``data/bugs.toml``: PRs, symptom, the flags that
    expose it, affected releases and how contract_lib replays it."""
    from contract_lib.patches import bug_catalog

    cards = []
    for bug in bug_catalog():
        if bug["clause"] != clause:
            continue
        cards.append("\n".join([
            f"{bug['id']} (clause {bug['clause']}, field {bug['field']}): "
            f"{', '.join(bug['prs'])}",
            *textwrap.wrap(f"symptom: {bug['symptom']}", 92, subsequent_indent="  "),
            *textwrap.wrap(f"flags: {bug['flags']}", 92, subsequent_indent="  "),
            *textwrap.wrap(f"affected: {bug['affected']}", 92, subsequent_indent="  "),
            *textwrap.wrap(f"replay: {bug['replay']}", 92, subsequent_indent="  "),
        ]))
    return "\n\n".join(cards) or f"no catalogued bug for clause {clause}"


_AROUND_COLUMNS = ["step", "rid", "emitted", "finished", "req_pool_idx", "kv_computed",
                   "seq_len", "kv_committed_len", "kv_allocated_len", "cache_protected_len",
                   "cached_tokens"]


def frames_around(frames: Frames, step: int, *, before: int = 1, after: int = 1,
                  rid: str | None = None) -> pd.DataFrame:
    """The ``requests`` rows of steps ``step - before .. step + after`` (one request's
    when ``rid`` is given), integer columns shown as integers."""
    requests = frames.requests
    mask = requests["step"].between(step - before, step + after)
    if rid is not None:
        mask &= requests["rid"] == rid
    table = requests.loc[mask, _AROUND_COLUMNS].copy()
    for column in _AROUND_COLUMNS[4:]:
        table[column] = table[column].astype("Int64")
    return table.sort_values(["step", "rid"]).reset_index(drop=True)


_FRAME_LINE = re.compile(r'File "(?:[^"]*/)?(sglang/[^"]+)", line (\d+), in (\S+)')


def crash_summary(frames: Frames) -> str:
    """How a run ended: ``finished``, or the error and the SGLang call chain that raised
    it (paths relative to the installed package, so the text is machine-independent)."""
    error = frames.error
    if not error:
        return f"{run_label(frames)}: {frames.status} after {frames.meta['steps']} steps"
    lines = [f"{run_label(frames)}: {frames.status} during {error['phase']} after "
             f"{frames.meta['steps']} steps",
             f"  {error['type']}: {error['message']}"]
    chain = [frame for frame in _FRAME_LINE.findall(error.get("traceback") or "")
             if frame[2] != "wrapper"]
    if chain:
        lines.append("  raised in SGLang code:")
        lines += [f"    {path}:{line} {function}" for path, line, function in chain[-4:]]
    return "\n".join(lines)


# -- step explorer (triage) ------------------------------------------------------------------


def _compact_row(states: pd.DataFrame) -> str:
    """``req_to_token`` entries as runs: ``0-15: slots 1-16 | 16: 29 | 17: 0 (slot 0!)``."""
    parts: list[str] = []
    run: list = []

    def flush():
        if not run:
            return
        (p0, s0, _), (p1, s1, _) = run[0], run[-1]
        parts.append(f"{p0}: {s0}" if p0 == p1 else f"{p0}-{p1}: slots {s0}-{s1}")
        run.clear()

    for r in states.itertuples(index=False):
        entry = (int(r.position), int(r.slot), r.state)
        if r.state in _BAD_STATES or r.state == "not computed":
            flush()
            mark = "" if r.state == "not computed" else "!"
            parts.append(f"{entry[0]}: {entry[1]} ({r.state}{mark})")
        elif run and entry[0] == run[-1][0] + 1 and entry[1] == run[-1][1] + 1:
            run.append(entry)
        else:
            flush()
            run.append(entry)
    flush()
    return " | ".join(parts)


def step_snapshot(frames: Frames, step: int, rid: str, report: Report | None = None) -> str:
    """A text view of one request at one step: the loop's state, the launches of that
    step, the request's counters, its ``req_to_token`` row and the violations there."""
    steps = frames.steps.set_index("step")
    if step not in steps.index:
        raise ValueError(f"step {step} is not in the run (steps 0..{steps.index.max()})")
    s = steps.loc[step]
    idle = "idle" if s["is_fully_idle"] else "busy"
    probe = "idle" if s["idle_probe"] else "busy"
    batch = f"{s['running_mode']} x{int(s['running_bs'])}" if s["running_bs"] else "none"
    lines = [f"step {step} of {frames.meta['workload']} on {run_label(frames)}: forward_ct "
             f"{int(s['forward_ct'])}, in flight {int(s['result_queue_len'])}, "
             f"is_fully_idle {idle} (masked probe {probe}), running batch {batch}"]
    launched = frames.launches[frames.launches["step"] == step]
    kinds = [f"#{int(r.launch)} {r.mode}{' chained' if r.chained else ''} ({r.rids})"
             for r in launched.itertuples(index=False)]
    lines.append("launches: " + (", ".join(kinds) if kinds else "none"))
    rows = frames.requests[(frames.requests["step"] == step) & (frames.requests["rid"] == rid)]
    if rows.empty:
        lines.append(f"request {rid}: not known to the scheduler yet")
        return "\n".join(lines)
    r = rows.iloc[0]

    def num(value):
        return "-" if value is None or pd.isna(value) else str(int(value))

    state = "finished" if r["finished"] else "live"
    lines.append(f"request {rid} ({state}, row {num(r['req_pool_idx'])}): emitted "
                 f"{int(r['emitted'])}, kv_computed {num(r['kv_computed'])}, seq_lens "
                 f"{num(r['seq_len'])}, kv_committed_len {num(r['kv_committed_len'])}, "
                 f"kv_allocated_len {num(r['kv_allocated_len'])}, cache_protected_len "
                 f"{num(r['cache_protected_len'])}, cached_tokens {num(r['cached_tokens'])}")
    states = slot_states(frames)
    states = states[(states["step"] == step) & (states["rid"] == rid)]
    if not states.empty:
        lines.append(f"req_to_token[{num(r['req_pool_idx'])}, :{len(states)}]: "
                     + _compact_row(states))
    report = report or check(frames)
    hits = report.violations
    if not hits.empty:
        hits = hits[(hits["step"] == step) & ((hits["rid"] == rid) | hits["rid"].isna())]
    if hits.empty:
        lines.append("violations here: none")
    else:
        for clause, group in hits.groupby("clause", sort=True):
            more = f" (+{len(group) - 1} more)" if len(group) > 1 else ""
            lines.append(violation_message(group.iloc[0].to_dict()) + more)
    return "\n".join(lines)


def step_figure(frames: Frames, step: int, rid: str) -> Figure:
    """One request at one step: its counters over the run (the step marked) and its
    ``req_to_token`` row at that step coloured by clause-1 state."""
    fig = Figure(figsize=(11, 4.6), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=(1, 1.3))
    rows = _request_rows(frames, rid)
    live = rows[live_mask(rows)]
    for column, label, style in _COUNTER_STYLES:
        x, y = _post_steps(live["step"], live[column].astype(float))
        left.step(x, y, where="post", label=label, **style)
    left.axvline(step, color=PURPLE, linewidth=1.5, label=f"step {step}")
    left.set_xlabel("step")
    left.set_ylabel("positions (tokens)")
    left.set_title(f"counters of {rid}", fontsize=10)
    left.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=2,
                frameon=False)
    _int_ticks(left, "x")
    states = slot_states(frames)
    states = states[(states["step"] == step) & (states["rid"] == rid)]
    if states.empty:
        right.text(0.5, 0.5, f"{rid} holds no req_to_token row at step {step}",
                   ha="center", va="center", transform=right.transAxes)
        right.set_axis_off()
    else:
        colours = [SLOT_STATES[s][1] for s in states["state"]]
        right.bar(states["position"], np.ones(len(states)), width=1.0, color=colours,
                  edgecolor="white")
        for r in states.itertuples(index=False):
            right.text(r.position, 0.5, str(int(r.slot)), rotation=90, ha="center",
                       va="center", fontsize=7)
        right.set_yticks([])
        right.set_xlabel("position p")
        _int_ticks(right, "x")
        right.set_title(f"req_to_token[row {int(states['req_pool_idx'].iloc[0])}, p] at "
                        f"step {step} (slot ids)", fontsize=10)
        present = list(dict.fromkeys(states["state"]))
        right.legend(handles=[Patch(facecolor=SLOT_STATES[s][1], label=SLOT_STATES[s][0])
                              for s in present], fontsize=7.5, loc="upper center",
                     bbox_to_anchor=(0.5, -0.22), ncols=2, frameon=False)
    _titles(fig, f"{run_label(frames)}: request {rid} at step {step}",
            "Left: the counters must sit on the grey kv_computed line. Right: every "
            "computed position must hold a real slot.")
    return fig


def step_explorer(frames: Frames, step: int | None = None, rid: str | None = None):
    """An ipywidgets view: a step slider and a request dropdown driving
    :func:`step_figure` and :func:`step_snapshot`. Needs a live kernel; for a static
    notebook print :func:`step_snapshot` instead."""
    import ipywidgets as widgets
    from IPython.display import display

    steps = frames.steps["step"]
    rids = list(dict.fromkeys(frames.requests["rid"]))
    slider = widgets.IntSlider(value=int(step if step is not None else steps.min()),
                               min=int(steps.min()), max=int(steps.max()), description="step",
                               continuous_update=False)
    dropdown = widgets.Dropdown(options=rids, value=rid or rids[0], description="request")
    out = widgets.Output()
    report = check(frames)

    def render(*_):
        with out:
            out.clear_output(wait=True)
            display(step_figure(frames, slider.value, dropdown.value))
            print(step_snapshot(frames, slider.value, dropdown.value, report=report))

    slider.observe(render, names="value")
    dropdown.observe(render, names="value")
    render()
    return widgets.VBox([widgets.HBox([slider, dropdown]), out])


__all__ = [
    "CLAUSES", "bug_card", "counter_drift", "crash_summary", "first_violation", "frames_around",
    "idle_predicate", "launch_kinds", "launch_timeline", "radix_reuse", "radix_reuse_table",
    "relay_events", "report_table", "run_label", "slot_grid", "slot_states", "stamps_table",
    "step_explorer", "step_figure", "step_snapshot", "step_stamps", "text_table",
    "triage_focus", "kv_writes", "kv_pool_verdicts", "token_table",
]


# -- effects audit -----------------------------------------------------------------------------

_CADENCE_COLOURS = {
    "every decode launch": GREEN, "fresh decode launches only": ORANGE,
    "some decode launches": YELLOW, "outside decode launches": SKY, "never": VERMILLION,
}


def audit_table(audit) -> pd.DataFrame:
    """The audit's findings, one row per field: cadence per loop, covering clause, readers."""
    findings = audit.findings
    return pd.DataFrame({
        "field": findings["object"] + "." + findings["field"],
        **{loop: findings[loop] for loop in ("normal", "overlap", "mlx")},
        "clause": findings["clause"].map(lambda c: "-" if pd.isna(c) else str(int(c))),
        "readers": findings["readers"],
    })


def audit_cadences(audit) -> Figure:
    """Findings x loops, each cell coloured by how often that loop's steps change the field
    (over decode launches); the right margin names the clause that covers it, if any."""
    table = audit_table(audit)
    loops = ["normal", "overlap", "mlx"]
    fig, axes = _figure(1, panel_width=8.5, height=2.2 + 0.32 * max(1, len(table)))
    ax = axes[0][0]
    for row, record in enumerate(table.itertuples(index=False)):
        for col, loop in enumerate(loops):
            ax.add_patch(Rectangle((col, row), 1, 1, edgecolor="white", linewidth=1.5,
                                   facecolor=_CADENCE_COLOURS[getattr(record, loop)]))
        ax.text(len(loops) + 0.1, row + 0.5,
                "no clause" if record.clause == "-" else f"clause {record.clause}",
                va="center", fontsize=8.5,
                color=VERMILLION if record.clause == "-" else "#333333",
                fontweight="bold" if record.clause == "-" else "normal")
    ax.set_xlim(0, len(loops) + 1.1)
    ax.set_ylim(len(table), 0)
    ax.set_xticks([i + 0.5 for i in range(len(loops))], loops)
    ax.set_yticks([i + 0.5 for i in range(len(table))], table["field"], fontsize=8.5)
    ax.set_xlabel("loop")
    ax.set_ylabel("object.field")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.tick_params(length=0)
    _titles(fig, f"Effects audit: {audit.workload}",
            "Green: the loop's steps change the field at every decode launch. Orange: only "
            "at fresh launches (the MLX chain breaks). Red: never. Fields marked 'no clause' "
            "are bookkeeping no clause checks yet.")
    _legend(fig, [Patch(facecolor=c, label=label) for label, c in _CADENCE_COLOURS.items()],
            ncols=3)
    return fig


# -- clause 1 end to end: the real MLX runner's KV pool --------------------------------------

WRITE_TARGETS = {
    "own": ("the writer's own slot", "#cfe8cf"),
    "shared prefix": ("a radix-shared prefix slot (same tokens)", SKY),
    "slot 0": ("padding slot 0 (position never recorded)", VERMILLION),
    "other live request": ("another live request's slot", PURPLE),
    "free": ("a free slot", ORANGE),
    "cached": ("a slot only the radix tree holds", YELLOW),
    "dropped": ("not written: the clamped release dropped it", "#d9d9d9"),
}

VERDICT_COLOURS = {
    "ok": ("ok: the KV mlx-lm computes for these tokens", GREEN),
    "zero": ("zero: the slot was never written", VERMILLION),
    "wrong": ("wrong: other KV (overwritten, or computed over zeros)", PURPLE),
}


def kv_writes(*runs: Frames, rid: str, labels: Sequence[str] | None = None) -> Figure:
    """Every write of request ``rid``'s KV into the MLX attention KV pool, one panel per
    run: one row per write event (step and kind), one column per position, each cell
    coloured by whose slot it went to and labelled with the slot id (``kv_syncs``)."""
    names = _labels(runs, labels)
    fig, axes = _figure(len(runs), panel_width=5.8, height=4.8)
    colours = {target: colour for target, (_, colour) in WRITE_TARGETS.items()}
    summary = []
    used: set[str] = set()
    for ax, frames, name in zip(axes[0], runs, names):
        if _no_frames(ax, frames, name, summary):
            continue
        syncs = frames.kv_syncs[frames.kv_syncs["rid"] == rid]
        if syncs.empty:
            ax.text(0.5, 0.5, f"no pool writes of {rid}\n(model-free run?)", ha="center",
                    va="center", transform=ax.transAxes)
            summary.append(f"{name}: no writes")
            continue
        events = list(dict.fromkeys(zip(syncs["step"], syncs["kind"])))
        for row, (step, kind) in enumerate(events):
            event = syncs[(syncs["step"] == step) & (syncs["kind"] == kind)]
            for r in event.itertuples(index=False):
                target = "dropped" if kind == "dropped" else r.target
                used.add(target)
                bad = target in ("slot 0", "other live request", "free", "cached")
                ax.add_patch(Rectangle((r.position - 0.5, row - 0.5), 1, 1,
                                       facecolor=colours[target], edgecolor="white",
                                       linewidth=0.8, hatch="//" if kind == "dropped" else None))
                ax.text(r.position, row, str(int(r.slot)), ha="center", va="center",
                        fontsize=5.5, rotation=90, color="white" if bad else "#333333",
                        fontweight="bold" if bad else "normal")
        ax.set_xlim(-0.5, int(syncs["position"].max()) + 0.5)
        ax.set_ylim(len(events) - 0.5, -0.5)
        ax.set_yticks(range(len(events)), [f"step {s}: {k}" for s, k in events], fontsize=8)
        ax.set_xlabel("position p of the request")
        _int_ticks(ax, "x")
        written = syncs[syncs["kind"] != "dropped"]
        into_zero = int((written["target"] == "slot 0").sum())
        into_other = int((written["target"] == "other live request").sum())
        dropped = int((syncs["kind"] == "dropped").sum())
        owners = ", ".join(sorted(set(written.loc[written["target"] == "other live request",
                                                  "owner"].dropna())))
        ax.set_title(f"{name}: request {rid}\n{into_zero} into slot 0, {into_other} into "
                     f"another live request{f' ({owners})' if owners else ''}, "
                     f"{dropped} dropped", fontsize=10)
        summary.append(f"{name}: {into_zero} into slot 0, {into_other} into another live "
                       "request")
    axes[0][0].set_ylabel("write (step: kind)")
    _legend(fig, [Patch(facecolor=colours[t], edgecolor="#777777",
                        hatch="//" if t == "dropped" else None, label=WRITE_TARGETS[t][0])
                  for t in WRITE_TARGETS if t in used or t in ("own", "slot 0")], ncols=3)
    _titles(fig, f"Clause 1 end to end: where request {rid}'s KV went in the MLX KV pool",
            "A pool sync writes each position's KV to the slot req_to_token names for it; "
            "an unrecorded position names slot 0, or in a reused row another request's "
            "slot. " + "; ".join(summary) + ".")
    return fig


def kv_pool_verdicts(*runs: Frames, rid: str = "a2", labels: Sequence[str] | None = None,
                     ) -> Figure:
    """The pool slots the radix tree serves for request ``rid`` at the end of each run,
    one row per run: each position coloured by its verdict against mlx-lm's KV
    (``kv_pool``), labelled with the slot id; the request's ``cached_tokens`` (the
    prefix its prefill read from the pool) marked."""
    names = _labels(runs, labels)
    fig = Figure(figsize=(11, 1.7 + 0.75 * len(runs)), layout="constrained")
    ax = fig.subplots()
    summary = []
    width = 0
    for row, (frames, name) in enumerate(zip(runs, names)):
        pool = frames.kv_pool[frames.kv_pool["rid"] == rid]
        for r in pool.itertuples(index=False):
            ax.add_patch(Rectangle((r.position - 0.5, row - 0.4), 1, 0.8, edgecolor="white",
                                   facecolor=VERDICT_COLOURS[r.verdict][1], linewidth=0.8))
            ax.text(r.position, row, str(int(r.slot)), ha="center", va="center",
                    fontsize=6, rotation=90,
                    color="#333333" if r.verdict == "ok" else "white")
        width = max(width, len(pool))
        seen = frames.requests[frames.requests["rid"] == rid]
        if len(seen):
            cached = int(seen["cached_tokens"].iloc[-1])
            ax.plot([cached - 0.5] * 2, [row - 0.48, row + 0.48], color="black",
                    linewidth=2.2)
        counts = pool["verdict"].value_counts()
        summary.append(f"{name}: " + ", ".join(f"{int(counts.get(v, 0))} {v}"
                                               for v in VERDICT_COLOURS))
    ax.set_xlim(-0.5, max(width, 1) - 0.5)
    ax.set_ylim(len(runs) - 0.5, -0.5)
    ax.set_yticks(range(len(runs)), names, fontsize=9)
    ax.set_xlabel(f"position p of request {rid}'s tokens (prompt + output)")
    _int_ticks(ax, "x")
    handles = [Patch(facecolor=c, label=label) for label, c in VERDICT_COLOURS.values()]
    handles.append(Line2D([], [], color="black", linewidth=2.2,
                          label=f"cached_tokens of {rid}: positions left of it came from the "
                                "pool (radix hit)"))
    _legend(fig, handles, ncols=2)
    _titles(fig, f"The MLX KV pool at the end: request {rid}'s radix-matched slots",
            "Every slot must hold the KV mlx-lm's own model computes for these tokens. "
            + "; ".join(summary) + ".")
    return fig


def token_table(*runs: Frames, reference: dict[str, list[int]],
                labels: Sequence[str] | None = None) -> pd.DataFrame:
    """Emitted tokens per request and run against ``reference`` (e.g.
    :func:`contract_lib.tiny_model.reference_outputs`): a token that differs is shown in
    brackets, and ``matches`` says whether the whole output does."""
    names = _labels(runs, labels)
    rows = []
    for rid, expected in reference.items():
        rows.append({"request": rid, "run": "mlx-lm reference",
                     "tokens": " ".join(map(str, expected)), "matches": "-"})
        for frames, name in zip(runs, names):
            got = frames.output_tokens().get(rid, [])
            shown = [str(t) if i < len(expected) and t == expected[i] else f"[{t}]"
                     for i, t in enumerate(got)]
            rows.append({"request": rid, "run": name, "tokens": " ".join(shown),
                         "matches": "yes" if got == expected else "NO"})
    return pd.DataFrame(rows)
