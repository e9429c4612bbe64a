"""A run beside its references (the unpatched run, the torch loops) on one workload."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import pandas as pd

from contract_lib.contract import check
from contract_lib.contract.outputs import same_tokens
from contract_lib.frames import Frames
from contract_lib.views.style import labels_for
from contract_lib.workloads import Workload, load_workload


def clause_comparison(*runs: Frames, labels: Sequence[str] | None = None) -> pd.DataFrame:
    """One row per clause, one column per run: the clause's status and violation count
    (``violated (12)``), then the run's verdict and whether it emitted the first run's
    tokens (:func:`~contract_lib.contract.outputs.same_tokens`: every request that
    finished on both, an abort a token apart allowed; ``NO (a2)`` names the requests
    that differ, ``-`` when no request finished on both)."""
    names = labels_for(runs, labels)
    rows: dict[str, dict[str, str]] = {}
    for name, frames in zip(names, runs):
        report = check(frames)
        for number, result in report.clauses.items():
            count = f" ({len(result.violations)})" if len(result.violations) else ""
            rows.setdefault(f"{number} {result.name}", {})[name] = result.status + count
        rows.setdefault("verdict", {})[name] = report.verdict().outcome.label
        same = same_tokens(runs[0], frames)
        differ = [rid for rid, equal in same.items() if not equal]
        rows.setdefault("same tokens as the first run", {})[name] = (
            f"NO ({', '.join(differ)})" if differ else "yes" if same else "-")
    table = pd.DataFrame.from_dict(rows, orient="index")[names]
    return table.rename_axis("clause").reset_index()


def later_turns(workload: Workload | str | Path) -> list[str]:
    """The requests of a workload that are later turns of another (``turn_of``)."""
    spec = workload if isinstance(workload, Workload) else load_workload(workload)
    return [r.rid for r in spec.requests if r.turn_of is not None]
