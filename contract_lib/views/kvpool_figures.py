"""Clause 1 end to end on the real MLX runner: pool writes, pool verdicts, tokens."""

from __future__ import annotations

from typing import Sequence

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from contract_lib.contract.kv_damage import summary_table
from contract_lib.frames import Frames
from contract_lib.views.style import (
    BROWN,
    GREEN,
    LIGHT_GREEN,
    LIGHT_GREY,
    MAX_WIDTH,
    PURPLE,
    SALMON,
    SKY,
    SMALL_CELL,
    VERMILLION,
    int_ticks,
    labels_for,
    legend,
    panels,
    titles,
    ylabel,
)

WRITE_TARGETS = {
    "own": ("the writer's own slot", LIGHT_GREEN),
    "shared prefix": ("a radix-shared prefix slot (same tokens)", SKY),
    "slot 0": ("padding slot 0 (position never recorded)", VERMILLION),
    "other live request": ("another live request's slot", PURPLE),
    "free": ("a free slot", SALMON),
    "cached": ("a slot only the radix tree holds", BROWN),
    "dropped": ("not written: the clamped release dropped it", LIGHT_GREY),
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
    view = panels(runs, labels, panel_width=5.8, height=4.8)
    fig, axes, summary = view.fig, view.axes, view.summary
    colours = {target: colour for target, (_, colour) in WRITE_TARGETS.items()}
    used: set[str] = set()
    for ax, frames, name in view:
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
                        fontsize=SMALL_CELL, rotation=90, color="white" if bad else "#333333",
                        fontweight="bold" if bad else "normal")
        ax.set_xlim(-0.5, int(syncs["position"].max()) + 0.5)
        ax.set_ylim(len(events) - 0.5, -0.5)
        ax.set_yticks(range(len(events)), [f"step {s}: {k}" for s, k in events])
        ax.set_xlabel("position p of the request")
        int_ticks(ax, "x")
        written = syncs[syncs["kind"] != "dropped"]
        into_zero = int((written["target"] == "slot 0").sum())
        into_other = int((written["target"] == "other live request").sum())
        dropped = int((syncs["kind"] == "dropped").sum())
        owners = ", ".join(sorted(set(written.loc[written["target"] == "other live request",
                                                  "owner"].dropna())))
        ax.set_title(f"{name}: request {rid}\n{into_zero} into slot 0, {into_other} into "
                     f"another live request{f' ({owners})' if owners else ''}, "
                     f"{dropped} dropped")
        summary.append(f"{name}: {into_zero} into slot 0, {into_other} into another live "
                       "request")
    ylabel(axes, "write (step: kind)")
    legend(fig, [Patch(facecolor=colours[t], edgecolor="#777777",
                        hatch="//" if t == "dropped" else None, label=WRITE_TARGETS[t][0])
                  for t in WRITE_TARGETS if t in used or t in ("own", "slot 0")], ncols=3)
    titles(fig, f"Clause 1 end to end: where request {rid}'s KV went in the MLX KV pool",
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
    names = labels_for(runs, labels)
    fig = Figure(figsize=(MAX_WIDTH, 2.2 + 0.8 * len(runs)), layout="constrained")
    ax = fig.subplots()
    summary = []
    width = 0
    for row, (frames, name) in enumerate(zip(runs, names)):
        pool = frames.kv_pool[frames.kv_pool["rid"] == rid]
        for r in pool.itertuples(index=False):
            ax.add_patch(Rectangle((r.position - 0.5, row - 0.4), 1, 0.8, edgecolor="white",
                                   facecolor=VERDICT_COLOURS[r.verdict][1], linewidth=0.8))
            ax.text(r.position, row, str(int(r.slot)), ha="center", va="center",
                    fontsize=SMALL_CELL, rotation=90,
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
    ax.set_yticks(range(len(runs)), names)
    ax.set_xlabel(f"position p of request {rid}'s tokens (prompt + output)")
    int_ticks(ax, "x")
    handles = [Patch(facecolor=c, label=label) for label, c in VERDICT_COLOURS.values()]
    handles.append(Line2D([], [], color="black", linewidth=2.2,
                          label=f"cached_tokens of {rid}: positions left of it came from the "
                                "pool (radix hit)"))
    legend(fig, handles, ncols=2)
    titles(fig, f"The MLX KV pool at the end: request {rid}'s radix-matched slots",
           "Every slot must hold the KV mlx-lm's own model computes for these tokens. "
           + "; ".join(summary) + ".")
    return fig


def token_table(*runs: Frames, reference: dict[str, list[int]],
                labels: Sequence[str] | None = None) -> pd.DataFrame:
    """Emitted tokens per request and run against ``reference`` (e.g.
    :func:`contract_lib.sources.tiny_model.reference_outputs`): a token that differs is shown in
    brackets, and ``matches`` says whether the whole output does."""
    names = labels_for(runs, labels)
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



def damage_table(frames: Frames) -> pd.DataFrame:
    """The pool writes that went through an unrecorded slot (slot 0) or into another live
    request's slot, grouped per step, request, write path and target: the positions
    (first-last), the slot ids and whose slots they were."""
    syncs = frames.kv_syncs
    damage = syncs[syncs["target"].isin(["slot 0", "other live request"])]
    return (damage.groupby(["step", "rid", "kind", "target"], sort=True)
            .agg(positions=("position", lambda p: f"{p.min()}-{p.max()}"),
                 slots=("slot", lambda s: " ".join(map(str, s))),
                 owner=("owner", lambda o: ", ".join(sorted(set(o.dropna()))) or "-"))
            .reset_index())


def same_tables(first: Frames, second: Frames,
                names: Sequence[str] = ("kv_syncs", "kv_pool", "outputs", "slots",
                                        "requests")) -> dict[str, bool]:
    """Whether each named frame table of two runs is equal (wall-clock columns left out,
    :meth:`Frames.comparable <contract_lib.frames.Frames.comparable>`)."""
    a, b = first.comparable(), second.comparable()
    return {name: a[name].equals(b[name]) for name in names}


def damage_by_workload(sglang: str, workloads: Sequence[str] | None = None,
                       ) -> tuple[pd.DataFrame, dict[str, str]]:
    """:func:`damage_summary` of every free-running workload (default: every shipped one)
    through the MLX loop with the real runner on release ``sglang``, one row each; and
    the workloads left out, with why (scripted or cut outputs mlx-lm cannot reproduce, or
    a set-up the loop refuses)."""
    from contract_lib.runs.harness import run
    from contract_lib.sources.tiny_model import reference_outputs
    from contract_lib.verdict import unsupported
    from contract_lib.workloads import load_workload, workload_names

    rows, left_out = [], {}
    for name in workloads or workload_names():
        if not load_workload(name).free_running():
            left_out[name] = "scripted tokens, stop list or abort: no reference output"
            continue
        frames = run(name, "mlx", runner="real", sglang=sglang)
        refused = unsupported(frames.meta)
        if refused:
            left_out[name] = refused
            continue
        rows.append({"workload": name, **damage_summary(frames, reference_outputs(name))})
    return pd.DataFrame(rows), left_out


def damage_summary(frames: Frames, reference: dict[str, list[int]]) -> dict:
    """One run's pool damage in positions (:func:`contract_lib.contract.kv_damage.summary_table`
    totals) and the requests whose tokens differ from ``reference``."""
    totals = summary_table(frames)[["into slot 0", "into another live request", "zero",
                                    "wrong"]].sum()
    outputs = frames.output_tokens()
    wrong = [rid for rid, tokens in reference.items() if outputs.get(rid) != tokens]
    return {**{k: int(v) for k, v in totals.items()}, "wrong output": ", ".join(wrong) or "-"}
