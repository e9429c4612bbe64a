"""Clause 4 (relays published or provably unread): ``output_tokens_buf`` reads and writes."""

from __future__ import annotations

from typing import Sequence

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from contract_lib.frames import Frames
from contract_lib.views.style import (
    BLUE,
    CELL,
    GREEN,
    VERMILLION,
    YELLOW,
    int_ticks,
    legend,
    panels,
    titles,
    ylabel,
)


def relay_events(*runs: Frames, labels: Sequence[str] | None = None) -> Figure:
    """Relay (``future_map.output_tokens_buf``) reads and writes per step and row, one
    panel per run; reads coloured by whether they saw the value published for that
    request's latest token. Steps that launched a mixed batch are shaded."""
    view = panels(runs, labels, height=4.4)
    fig, axes, summary = view.fig, view.axes, view.summary
    styles = {
        "write": dict(marker="^", color=BLUE, markersize=7),
        "published": dict(marker="o", color=GREEN, markersize=7),
        "unpublished": dict(marker="X", color=VERMILLION, markersize=10),
    }
    for ax, frames, name in view:
        relay = frames.relay[frames.relay["event"] != "fed"]  # the buffer's own events
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
                        textcoords="offset points", ha="center", fontsize=CELL,
                        color=VERMILLION)
        if rows:
            ax.set_yticks(rows, [f"row {row} ({', '.join(owners.get(row, ['?']))})"
                                 for row in rows])
            ax.set_ylim(min(rows) - 0.7, max(rows) + 0.7)
        ax.set_xlim(-0.5, int(frames.steps["step"].max()) + 0.5)
        ax.set_xlabel("step (scheduler-loop iteration)")
        int_ticks(ax, "x")
        ax.grid(axis="x", alpha=0.2)
        bad = int((~ok).sum())
        ax.set_title(f"{name} ({frames.meta['workload']})\n{len(writes)} writes, "
                     f"{len(reads)} reads, {bad} unpublished")
        summary.append(f"{name}: {bad} of {len(reads)} reads unpublished")
    ylabel(axes, "relay row (request holding it)")
    handles = [Line2D([], [], linestyle="none", label="write (FutureMap.stash after a "
                                                        "forward)", **styles["write"]),
               Line2D([], [], linestyle="none", label="read by resolve_forward_inputs: the "
                                                        "published token", **styles["published"]),
               Line2D([], [], linestyle="none", label="read of an unpublished row "
                                                        "(value shown; -1 = never written)",
                      **styles["unpublished"]),
               Patch(facecolor=YELLOW, alpha=0.25, label="step launched a mixed batch")]
    legend(fig, handles, ncols=2)
    titles(fig, "Clause 4, relays published or provably unread: output_tokens_buf",
           "; ".join(summary) + ". Every read must follow a write of the same row for the "
           "same request's latest token.")
    return fig

