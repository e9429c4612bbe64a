"""A PD pair run (:mod:`contract_lib.campaigns.pair`): one request across the prefill and
the decode side, its hand-off token crossing between them."""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import ConnectionPatch

from contract_lib.views.style import (
    BLACK,
    BLUE,
    GREEN,
    SKY,
    VERMILLION,
    count_axes,
    figure,
    legend,
    post_steps,
    request_rows,
    titles,
)


def pair_journey(pair, rid: str) -> Figure:
    """Request ``rid`` on each side of ``pair`` (a :class:`~contract_lib.campaigns.pair.Pair`),
    step by step: the KV positions computed for it (``kv_computed``) and the tokens it
    emitted, its launches, and the hand-off: the first token the prefill side emitted,
    which the decode side's prebuilt batch admits the request with."""
    sides = [("prefill", pair.prefill), ("decode", pair.decode)]
    sides = [(side, frames) for side, frames in sides if frames is not None]
    fig, axes = figure(len(sides), panel_width=5.4, height=4.6, sharey=True)
    handoff = pair.handoffs().get(rid)
    points = {}
    for ax, (side, frames) in zip(axes[0], sides):
        rows = request_rows(frames, rid)
        rows = rows[rows["step"] <= _ended_at(rows)]
        computed = rows[rows["kv_computed"].notna()]
        x, y = post_steps(computed["step"], computed["kv_computed"].astype(int))
        ax.step(x, y, where="post", color=BLACK, linewidth=1.8)
        x, y = post_steps(rows["step"], rows["emitted"].astype(int))
        ax.step(x, y, where="post", color=GREEN, linewidth=1.8)
        lanes = frames.launches[frames.launches["rids"].fillna("").str.split(",").map(
            lambda ids: rid in ids)]
        for mode, colour, marker in (("extend", SKY, "s"), ("decode", BLUE, "o")):
            steps = lanes.loc[lanes["mode"] == mode, "step"]
            ax.scatter(steps, [0] * len(steps), color=colour, marker=marker, s=22,
                       clip_on=False, zorder=3)
        admitted = frames.prebuilt[frames.prebuilt["rid"] == rid]
        ax.scatter(admitted["step"], [0] * len(admitted), color=VERMILLION, marker="*",
                   s=90, clip_on=False, zorder=4)
        ax.scatter(admitted["step"], admitted["kv_computed"], color=BLACK, marker="D", s=30,
                   zorder=4)
        first = rows[rows["emitted"] > 0]
        if len(first):
            points[side] = (int(first["step"].iloc[0]), 1)
            ax.scatter(*points[side], color=VERMILLION, marker="*", s=90, zorder=4)
        end = rows.iloc[-1]
        ax.set_title(f"{side} side: {frames.loop}\n{rid} ends at step {int(end['step'])} "
                     f"({end['finish_reason']}), {int(end['emitted'])} token(s)", fontsize=10)
        count_axes(ax)
    axes[0][0].set_ylabel("positions / tokens of the request")
    if len(points) == 2:
        fig.add_artist(ConnectionPatch(
            points["prefill"], points["decode"], "data", "data", axesA=axes[0][0],
            axesB=axes[0][1], color=VERMILLION, arrowstyle="->", linewidth=1.4,
            linestyle="--"))
    legend(fig, [
        Line2D([], [], color=BLACK, linewidth=1.8, label="KV positions computed (kv_computed)"),
        Line2D([], [], color=BLACK, marker="D", linestyle="",
               label="KV the transfer put in place (prebuilt batch)"),
        Line2D([], [], color=GREEN, linewidth=1.8, label="tokens emitted"),
        Line2D([], [], color=SKY, marker="s", linestyle="", label="extend launch (prefill)"),
        Line2D([], [], color=BLUE, marker="o", linestyle="", label="decode launch"),
        Line2D([], [], color=VERMILLION, marker="*", markersize=11, linestyle="",
               label=f"hand-off token {handoff} (prefill side's first, decode side's "
                     "first; prebuilt batch at 0)"),
    ], ncols=2)
    titles(fig, f"Request {rid} across the PD pair ({pair.workload.name})",
           "The prefill side computes the prompt and emits one token; the decode side "
           "admits the request already prefilled with that token (a prebuilt batch, no "
           "forward; its KV moved by the fake transfer, i.e. not at all) and decodes the "
           "rest. The black diamond: the prompt's positions arrive by transfer, not by "
           "a launch.")
    return fig


def _ended_at(rows) -> int:
    """The first step a request's rows show it ended (its last step if it never did)."""
    ended = rows[rows["finished"].astype(bool)]
    return int(ended["step"].min()) if len(ended) else int(rows["step"].max())
