"""The measured clause x loop table: every shipped workload through every loop, checked."""

from __future__ import annotations

import dataclasses

import pandas as pd

from contract_lib.contract import (CLAUSES, HOLDS, MASKED, NOT_EXERCISED, VIOLATED, Report,
                                   check)
from contract_lib.harness import LOOPS, run_many
from contract_lib.patches import PatchArg, patch_spec
from contract_lib.workloads import workload_names

# Worst first: the status a (clause, loop) cell shows over several workloads.
_SEVERITY = [VIOLATED, MASKED, HOLDS, NOT_EXERCISED]
REFERENCE_LOOPS = ("normal", "overlap")


@dataclasses.dataclass
class Status:
    """Reports of every (workload, loop) run, and their summary per clause and loop."""

    reports: dict[tuple[str, str], Report]

    def per_run(self) -> pd.DataFrame:
        """One row per (workload, loop, clause) with that run's status."""
        rows = []
        for (workload, loop), report in self.reports.items():
            for number, result in report.clauses.items():
                rows.append({"workload": workload, "loop": loop, "clause": number,
                             "name": CLAUSES[number], "status": result.status,
                             "violations": len(result.violations)})
        return pd.DataFrame(rows)

    def table(self) -> pd.DataFrame:
        """Clause x loop: the worst status over workloads, with how many it shows in."""
        per_run = self.per_run()
        loops = [loop for loop in LOOPS if loop in set(per_run["loop"])]
        rows = []
        for number, name in CLAUSES.items():
            row = {"clause": f"{number} {name}"}
            for loop in loops:
                cell = per_run[(per_run["clause"] == number) & (per_run["loop"] == loop)]
                worst = min(cell["status"], key=_SEVERITY.index)
                count = int((cell["status"] == worst).sum())
                row[loop] = f"{worst} ({count}/{len(cell)})"
            rows.append(row)
        return pd.DataFrame(rows).set_index("clause")

    def runs_not_finished(self) -> list[tuple[str, str, str]]:
        return [(w, l, r.meta["status"]) for (w, l), r in self.reports.items()
                if r.meta["status"] != "finished"]

    def reference_violations(self) -> pd.DataFrame:
        """Violations on the torch loops, which must satisfy every clause."""
        per_run = self.per_run()
        bad = per_run["loop"].isin(REFERENCE_LOOPS) & per_run["status"].isin([VIOLATED, MASKED])
        return per_run[bad]

    def text(self) -> str:
        table = self.table()
        width = max(len(c) for c in table.index) + 2
        header = "clause".ljust(width) + "".join(f"{loop:<24}" for loop in table.columns)
        lines = [header] + [
            clause.ljust(width) + "".join(f"{table.loc[clause, loop]:<24}"
                                          for loop in table.columns)
            for clause in table.index]
        lines.append("")
        lines.append("(worst status over the workloads, and in how many of them it shows)")
        for workload, loop, status in self.runs_not_finished():
            lines.append(f"run {workload} on {loop}: {status}")
        return "\n".join(line.rstrip() for line in lines)


def status(workloads: list[str] | None = None, loops: tuple[str, ...] = LOOPS,
           patch: PatchArg = None, progress: bool = True, cache: bool = True,
           warm: bool = True) -> Status:
    """Run and check every workload through every loop (in parallel)."""
    workloads = workloads or workload_names()
    spec = patch_spec(patch)
    keys = [(w, loop) for w in workloads for loop in loops]
    frames = run_many([{"workload": w, "loop": loop, "patch": spec, "cache": cache,
                        "warm": warm} for w, loop in keys], progress=progress)
    return Status({key: check(f) for key, f in zip(keys, frames)})
