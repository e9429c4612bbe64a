"""The effects audit as a table and a cadence figure."""

from __future__ import annotations

import dataclasses

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from contract_lib.views.style import (
    CELL,
    GREEN,
    ORANGE,
    SALMON,
    SKY,
    VERMILLION,
    figure,
    legend,
    titles,
)

# By a cadence's first word (``every decode launch``, ``some extend launches``, ...).
_CADENCE_COLOURS = {"every": GREEN, "fresh": ORANGE, "some": SALMON, "outside": SKY,
                    "never": VERMILLION}


def audit_table(audit) -> pd.DataFrame:
    """The audit's findings, one row per field: cadence per loop, covering clause, readers."""
    findings = audit.findings
    return pd.DataFrame({
        "field": findings["object"] + "." + findings["field"],
        **{loop: findings[loop] for loop in audit.loops},
        "clause": findings["clause"].map(lambda c: "-" if pd.isna(c) else str(int(c))),
        "readers": findings["readers"],
    })


def audit_cadences(audit) -> Figure:
    """Findings x loops, each cell coloured by how often that loop's steps change the field
    (over decode launches); the right margin names the clause that covers it, if any."""
    table = audit_table(audit)
    audited = list(audit.loops)
    fig, axes = figure(1, panel_width=8.5, height=2.2 + 0.32 * max(1, len(table)))
    ax = axes[0][0]
    for row, record in enumerate(table.itertuples(index=False)):
        for col, loop in enumerate(audited):
            ax.add_patch(Rectangle((col, row), 1, 1, edgecolor="white", linewidth=1.5,
                                   facecolor=_CADENCE_COLOURS[
                                       getattr(record, loop).split()[0]]))
        ax.text(len(audited) + 0.1, row + 0.5,
                "no clause" if record.clause == "-" else f"clause {record.clause}",
                va="center", fontsize=CELL,
                color=VERMILLION if record.clause == "-" else "#333333",
                fontweight="bold" if record.clause == "-" else "normal")
    ax.set_xlim(0, len(audited) + 1.1)
    ax.set_ylim(len(table), 0)
    ax.set_xticks([i + 0.5 for i in range(len(audited))], audited)
    ax.set_yticks([i + 0.5 for i in range(len(table))], table["field"])
    ax.set_xlabel("loop")
    ax.set_ylabel("object.field")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.tick_params(length=0)
    titles(fig, f"Effects audit: {audit.workload}",
           f"Green: the loop's steps change the field at every {audit.mode} launch. "
           "Orange: only at fresh launches (the MLX chain breaks). Salmon: at some. Red: "
           "never. Fields marked 'no clause' are bookkeeping no clause checks yet.")
    labels = {"every": f"every {audit.mode} launch",
              "fresh": f"fresh {audit.mode} launches only",
              "some": f"some {audit.mode} launches",
              "outside": f"outside {audit.mode} launches", "never": "never"}
    legend(fig, [Patch(facecolor=c, label=labels[word])
                 for word, c in _CADENCE_COLOURS.items()], ncols=3)
    return fig



def beyond_rfc_text(audit) -> str:
    """:meth:`Audit.text <contract_lib.campaigns.audit.Audit.text>` of the findings no clause of
    the RFC covers: uncovered, or covered only by this project's extensions (clauses 6
    and 7, the fields added to clause 2); the grouped noise left out."""
    from contract_lib.contract import EXTENDED_FIELDS, EXTENSION_CLAUSES

    findings = audit.findings
    extended = {field for fields in EXTENDED_FIELDS.values() for field in fields}
    beyond = (findings["clause"].isna() | findings["clause"].isin(list(EXTENSION_CLAUSES))
              | findings["field"].isin(extended))
    return dataclasses.replace(audit, findings=findings[beyond],
                               noise=audit.noise.iloc[:0]).text()
