"""Triage: where to look first, one request at one step (text, figure, widget)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from contract_lib.contract import Report, check, live_mask, violation_message
from contract_lib.frames import Frames
from contract_lib.views.counter_figures import COUNTER_STYLES
from contract_lib.views.slot_figures import SLOT_COLOURS, slot_rows
from contract_lib.views.style import (
    GREY,
    LEGEND,
    MAX_WIDTH,
    SMALL_CELL,
    int_ticks,
    post_steps,
    request_rows,
    run_label,
    titles,
    wrap,
)
from contract_lib.workloads import Workload, load_workload


def first_violation(report: Report) -> dict[str, Any] | None:
    """The first violation of the lowest violated clause (the one ``assert_contract``
    raises: :attr:`Report.violations` is ordered by clause, then step), or None."""
    hits = report.violations
    return None if hits.empty else hits.iloc[0].to_dict()


def triage_focus(frames: Frames, report: Report) -> tuple[int, str | None]:
    """Where to look first: the step and request of :func:`first_violation` (for a
    clause without a request, the first request live at that step); with no violation,
    the last step and the first request; None for the request of a run that stopped
    before the scheduler knew any."""
    first = first_violation(report)
    rids = list(dict.fromkeys(frames.requests["rid"])) or [None]
    if first is None:
        return int(frames.steps["step"].max()), rids[0]
    step = int(first["step"])
    if first.get("rid") is not None:
        return step, first["rid"]
    at_step = frames.requests[frames.requests["step"] == step]
    live = at_step[live_mask(at_step)]["rid"].tolist()
    return step, (live or at_step["rid"].tolist() or rids)[0]


def recorded_summary(frames: Frames, workload: Workload | str | Path) -> str:
    """What a run recorded before it stopped: its steps and launches, each request of
    ``workload`` it knew (finished, or live when it stopped, with the tokens emitted),
    and those it never got to."""
    spec = workload if isinstance(workload, Workload) else load_workload(workload)
    steps = frames.steps["step"]
    last = frames.requests.drop_duplicates("rid", keep="last").set_index("rid")
    known = [f"{rid} ({'finished' if last.at[rid, 'finished'] else 'live'}, emitted "
             f"{int(last.at[rid, 'emitted'])})" for rid in last.index]
    missing = [r.rid for r in spec.requests if r.rid not in last.index]
    span = f"steps {int(steps.min())}-{int(steps.max())}" if len(steps) else "no step"
    launches = f"{len(frames.launches)} launch{'' if len(frames.launches) == 1 else 'es'}"
    return wrap(f"recorded before it stopped: {span}, {launches}; "
                f"requests {', '.join(known) or 'none'}; never known to the scheduler: "
                f"{', '.join(missing) or 'none'}")


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
        if r.state != "recorded":
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
        lines.append(f"request {rid}: not known to the scheduler yet" if rid is not None
                     else "no request known to the scheduler in this run")
        return wrap("\n".join(lines))
    r = rows.iloc[0]

    def num(value):
        return "-" if value is None or pd.isna(value) else str(int(value))

    state = "finished" if r["finished"] else "live"
    lines.append(f"request {rid} ({state}, row {num(r['req_pool_idx'])}): emitted "
                 f"{int(r['emitted'])}, kv_computed {num(r['kv_computed'])}, seq_lens "
                 f"{num(r['seq_len'])}, kv_committed_len {num(r['kv_committed_len'])}, "
                 f"kv_allocated_len {num(r['kv_allocated_len'])}, cache_protected_len "
                 f"{num(r['cache_protected_len'])}, cached_tokens {num(r['cached_tokens'])}")
    states = slot_rows(frames)
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
    return wrap("\n".join(lines))


def step_figure(frames: Frames, step: int, rid: str | None) -> Figure:
    """One request at one step: its counters over the run (the step marked) and its
    ``req_to_token`` row at that step coloured by clause-1 state; a note for ``rid``
    None (a run that stopped before the scheduler knew any request, :func:`triage_focus`),
    a ValueError naming the known ones for a request not in the run."""
    fig = Figure(figsize=(MAX_WIDTH, 8.4), layout="constrained")
    if rid is None:
        ax = fig.subplots()
        ax.text(0.5, 0.5, f"{run_label(frames)}: no request known to the scheduler",
                ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return fig
    left, right = fig.subplots(2, 1, height_ratios=(1.3, 1))
    rows = request_rows(frames, rid)
    live = rows[live_mask(rows)]
    for column, label, style in COUNTER_STYLES:
        x, y = post_steps(live["step"], live[column].astype(float))
        left.step(x, y, where="post", label=label, **style)
    left.axvline(step, color=GREY, linestyle="-.", linewidth=1.5, label=f"step {step}")
    left.set_xlabel("step")
    left.set_ylabel("positions (tokens)")
    left.set_title(f"counters of {rid}")
    left.legend(fontsize=LEGEND, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    int_ticks(left, "x")
    states = slot_rows(frames)
    states = states[(states["step"] == step) & (states["rid"] == rid)]
    if states.empty:
        right.text(0.5, 0.5, f"{rid} holds no req_to_token row at step {step}",
                   ha="center", va="center", transform=right.transAxes)
        right.set_axis_off()
    else:
        colours = [SLOT_COLOURS[s][1] for s in states["state"]]
        right.bar(states["position"], np.ones(len(states)), width=1.0, color=colours,
                  edgecolor="white")
        for r in states.itertuples(index=False):
            right.text(r.position, 0.5, str(int(r.slot)), rotation=90, ha="center",
                       va="center", fontsize=SMALL_CELL)
        right.set_yticks([])
        right.set_xlabel("position p")
        int_ticks(right, "x")
        right.set_title(f"req_to_token[row {int(states['req_pool_idx'].iloc[0])}, p] at "
                        f"step {step} (slot ids)")
        present = list(dict.fromkeys(states["state"]))
        right.legend(handles=[Patch(facecolor=SLOT_COLOURS[s][1], label=SLOT_COLOURS[s][0])
                              for s in present], fontsize=LEGEND, loc="upper left",
                     bbox_to_anchor=(1.01, 1), frameon=False)
    titles(fig, f"{run_label(frames)}: request {rid} at step {step}",
           "Top: the counters must sit on the grey kv_computed line. Bottom: every "
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
    if not rids:
        return widgets.Label("no request known to the scheduler: nothing to explore")
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



def clause_view(frames: Frames, report: Report, *others: Frames,
                labels: Sequence[str] | None = None) -> Figure | None:
    """The figure of the first violated clause's own subject, ``frames`` first and then
    ``others`` (e.g. the unpatched run, the torch loops) as further panels: the slot row
    (clause 1), the counters (2), the stamps (3), the relay events (4), the idle-predicate
    lanes (5), the HRRN clock (6), the backend state lanes (7); None when no clause is
    violated."""
    from contract_lib.views import (
        counter_figures as counters,
        extension_figures as extensions,
        idle_figures as idle,
        relay_figures as relay,
        slot_figures as slots,
        stamp_figures as stamps,
    )

    first = first_violation(report)
    if first is None:
        return None
    runs = (frames, *others)
    _, rid = triage_focus(frames, report)
    clause = int(first["clause"])
    by_clause = {
        1: lambda: slots.slot_grid(*runs, rid=rid, labels=labels),
        2: lambda: counters.counter_drift(*runs, rid=rid, labels=labels),
        3: lambda: stamps.step_stamps(*runs, labels=labels),
        4: lambda: relay.relay_events(*runs, labels=labels),
        5: lambda: idle.idle_predicate(*runs, labels=labels),
        6: lambda: extensions.scheduling_clock(*runs, labels=labels),
        7: lambda: extensions.retired_lanes(*runs, labels=labels),
    }
    if clause not in by_clause:
        return None
    return by_clause[clause]()
