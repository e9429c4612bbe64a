"""The measured clause x loop table: every shipped workload through every loop, checked.

:func:`status` runs one SGLang release; :func:`releases_status` runs several side by
side (one column per release, one row per clause and loop).
"""

from __future__ import annotations

import dataclasses

import pandas as pd

from contract_lib import loops as registry
from contract_lib.contract import (
    CLAUSES,
    EXTENDED_FIELDS,
    HOLDS,
    MASKED,
    NOT_EXERCISED,
    NOT_PRESENT,
    POOL_ROW,
    VIOLATED,
    Report,
    check,
    origin,
)
from contract_lib.frames import Frames
from contract_lib.patches.builtin import PatchArg, patch_spec
from contract_lib.runs.harness import frames_or_raise, run_many
from contract_lib.runs.loop_choice import runnable
from contract_lib.verdict import Outcome, loop_mismatch, setup_failed, unsupported, worst
from contract_lib.workloads import workload_names

# The extra row of a real-runner table: did a run write KV through slot 0 or into another
# live request's slots, or leave a radix-matched slot zero or wrong (contract_lib.child.kvpool)?
KV_POOL_ROW = "- KV pool (real MlxModelRunner)"
MODEL_FREE_KV_POOL_ROW = "- KV pool (model-free runner's contents)"
POOL_NOTE = ("(KV pool conservation: leak = available + evictable + protected + "
             "uncached != total at a step boundary, SGLang's own law)")
KV_POOL_NOTE = ("(KV pool: damaged = KV written through slot 0 or into another live "
                "request's slots, or a radix-matched slot left zero or wrong)")

# A run's clause cell: a violation found in its frames shows whatever became of the run
# (it is evidence); otherwise a run that did not reach the end of its loop shows its fate
# (``setup-error`` for a run that never entered the requested loop, else the run status),
# and a finished but vacuous run (no clause exercised, an unexpected aborted request)
# shows ``vacuous``: none of them earned ``holds``.
SETUP_ERROR, VACUOUS = "setup-error", "vacuous"
# A run the loop refused in set-up because SGLang, as built for it, cannot run what the
# workload asks (e.g. page_size > 1 on MLX): it has no clause statuses (no cell counts
# it), does not count in the exit code, and the line under the table names it.
UNSUPPORTED = "unsupported"
# Worst first: the status a (clause, loop) cell shows over several workloads.
_SEVERITY = [VIOLATED, MASKED, SETUP_ERROR, "crashed", "died", "timeout", "interrupted",
             VACUOUS, HOLDS, NOT_EXERCISED, NOT_PRESENT]
# The cell of a (clause, loop) whose every violating run reproduces catalogued upstream
# bugs exactly (``Report.known``): reported, and no failure unless --strict-known.
KNOWN_UPSTREAM = "known upstream"


def run_cell_status(report: Report) -> str | None:
    """What a run's non-violated clause cells show instead of their own status, or None
    when the run earned its clause statuses."""
    meta = report.meta
    if unsupported(meta):
        return UNSUPPORTED
    if setup_failed(meta) or loop_mismatch(meta):
        return SETUP_ERROR
    if meta["status"] != "finished":
        return meta["status"]
    return VACUOUS if report.vacuity() else None


def run_outcome(report: Report, reference: bool) -> Outcome:
    """A run's contribution to ``status``'s exit code: its fate, and a clause violation
    only on a reference (torch) loop and not as a catalogued upstream bug reproduced
    exactly (``Report.known``, unless ``strict_known``); the MLX loop's violations are
    the measurement. A run the loop refused as unsupported counts for nothing."""
    if unsupported(report.meta):
        return Outcome.PASS
    outcome = report.verdict().outcome
    if outcome != Outcome.VIOLATED:
        return outcome
    if report.meta["status"] != "finished":
        return Outcome.NOT_FINISHED
    if reference and (not report.pool.empty or report.failing()):
        return Outcome.VIOLATED  # a known upstream bug is reported, not failed
    return Outcome.VACUOUS if report.vacuity() else Outcome.PASS


@dataclasses.dataclass
class Status:
    """Reports of every (workload, loop) run, and their summary per clause and loop."""

    reports: dict[tuple[str, str], Report]
    sglang: str | None = None
    runner: str = "model-free"
    # (workload, loop) -> whether the run damaged the MLX KV pool (:func:`kv_damage.kv_rows`).
    kv_damaged: dict[tuple[str, str], bool] = dataclasses.field(default_factory=dict)
    # Show SGLang's pool conservation row even when no run leaked (a comparison's other
    # side leaked); it is shown whenever one did.
    pool_row: bool = False

    def leaks(self) -> bool:
        """Whether any run's frames broke SGLang's KV pool conservation law."""
        return any(not r.pool.empty for r in self.reports.values())

    def shows_pool_row(self) -> bool:
        return self.pool_row or self.leaks()

    def per_run(self) -> pd.DataFrame:
        """One row per (workload, loop, clause) with that run's status; none for a run
        the loop refused as unsupported."""
        rows = []
        for (workload, loop), report in self.reports.items():
            fate = run_cell_status(report)
            if fate == UNSUPPORTED:
                continue
            for number, result in report.clauses.items():
                shown = result.status if result.status in (VIOLATED, MASKED) else (
                    fate or result.status)
                rows.append({"workload": workload, "loop": loop, "clause": number,
                             "name": CLAUSES[number], "status": shown,
                             "clause_status": result.status,
                             "violations": len(result.violations),
                             # under strict_known a known bug is a plain violation
                             "finding": ", ".join(m.bug for m in report.known[number])
                             if number in report.known and not report.strict_known
                             else None})
        return pd.DataFrame(rows, columns=["workload", "loop", "clause", "name", "status",
                                           "clause_status", "violations", "finding"])

    def table(self) -> pd.DataFrame:
        """Clause x loop: the worst status over workloads, with how many it shows in."""
        per_run = self.per_run()
        present = set(per_run["loop"])
        columns = [loop for loop in registry.names() if loop in present]
        rows = []
        extended = any(r.clause_set == "all" for r in self.reports.values())
        for number in sorted(set(per_run["clause"])):
            row = {"clause": f"{number} {CLAUSES[number]}"}
            if extended and number in EXTENDED_FIELDS:
                row["clause"] += f" (+ {', '.join(EXTENDED_FIELDS[number])})"
            for loop in columns:
                worst, count, total = worst_cell(
                    per_run[(per_run["clause"] == number) & (per_run["loop"] == loop)])
                row[loop] = f"{worst} ({count}/{total})"
            rows.append(row)
        if self.shows_pool_row():
            rows.append({"clause": f"- {POOL_ROW}", **{
                loop: "{} ({}/{})".format(*self.pool_cell(loop)) for loop in columns}})
        if self.kv_damaged:
            rows.append({"clause": KV_POOL_ROW if self.runner == "real"
                         else MODEL_FREE_KV_POOL_ROW, **{
                             loop: "{} ({}/{})".format(*cell) if (cell := self.kv_cell(loop))
                             else "-" for loop in columns}})  # "-": no MLX KV pool
        return pd.DataFrame(rows, columns=["clause", *columns]).set_index("clause")

    def pool_cell(self, loop: str) -> tuple[str, int, int]:
        """SGLang's pool conservation law over ``loop``'s runs that recorded a step:
        ``leak`` (in how many) or ``balanced``, of how many."""
        seen = [not r.pool.empty for (_, l), r in self.reports.items()
                if l == loop and r.meta.get("steps")]
        return ("leak", sum(seen), len(seen)) if any(seen) else \
            ("balanced", len(seen), len(seen))

    def kv_cell(self, loop: str) -> tuple[str, int, int] | None:
        """The MLX KV pool over ``loop``'s runs with a verdict: ``damaged`` (in how many)
        or ``intact``, of how many; None when the loop has no MLX KV pool."""
        cell = [bad for (_, l), bad in self.kv_damaged.items() if l == loop]
        if not cell:
            return None
        return ("damaged", sum(cell), len(cell)) if any(cell) else \
            ("intact", len(cell), len(cell))

    def runs_not_finished(self) -> list[tuple[str, str, str]]:
        """(workload, loop, what happened) of every run that did not earn its clause
        statuses: not finished, set-up error, vacuous."""
        out = []
        for (w, l), r in self.reports.items():
            fate = run_cell_status(r)
            if fate is not None:
                reason, error = r.verdict().reason, r.meta.get("error") or {}
                message = f"{error.get('type', 'error')}: {error.get('message')}"
                if error.get("message") and error["message"] not in reason:
                    reason += f" ({message})"
                out.append((w, l, f"{fate}: {reason}"))
        return out

    def outcome(self) -> Outcome:
        """The exit code of ``status``: a run that did not finish (3), failed in set-up
        (2) or was vacuous (4), or a violation on a torch reference loop (1). A run the
        loop refused as unsupported counts for nothing, but a table of nothing else
        (every run refused) is a usage error (2): no verdict was earned."""
        if self.reports and all(unsupported(r.meta) for r in self.reports.values()):
            return Outcome.USAGE
        return worst(run_outcome(r, loop in registry.reference_names())
                     for (_, loop), r in self.reports.items())

    def reference_violations(self) -> pd.DataFrame:
        """Violations on the torch loops, which must satisfy every clause, except the
        catalogued upstream bugs they reproduce exactly (:meth:`known_upstream`)."""
        per_run = self.per_run()
        bad = (per_run["loop"].isin(registry.reference_names())
               & per_run["status"].isin([VIOLATED, MASKED]) & per_run["finding"].isna())
        return per_run[bad]

    def absent(self) -> list[tuple[int, str, str]]:
        """(clause, field, why) for every field of a clause the release does not have
        (:attr:`contract_lib.frames.Frames.absent`; a reason may depend on what the
        workload builds, e.g. its radix tree), over the runs."""
        return sorted({(number, name, why) for report in self.reports.values()
                       for number, result in report.clauses.items()
                       for name, why in result.absent.items()})

    def absent_note(self) -> list[str]:
        """A line per field the release does not have: not checked, and why."""
        where = f"sglang {self.sglang}" if self.sglang else "the venv's sglang"
        return [f"(not present in {where}, not checked: clause {number} {name}: {why})"
                for number, name, why in self.absent()]

    def known_upstream(self) -> pd.DataFrame:
        """Runs whose violations of a clause are exactly catalogued upstream bugs'
        (``finding``: their ids in ``data/bugs.toml``)."""
        per_run = self.per_run()
        return per_run[per_run["finding"].notna()]

    def text(self) -> str:
        table = self.table()
        width = max((len(c) for c in table.index), default=len("clause")) + 2
        header = "clause".ljust(width) + "".join(f"{loop:<24}" for loop in table.columns)
        lines, previous = [header], None
        for clause in table.index:
            lines += _section(clause, previous)
            previous = clause
            lines.append(clause.ljust(width) + "".join(f"{table.loc[clause, loop]:<24}"
                                                       for loop in table.columns))
        lines.append("")
        lines.append("(worst status over the workloads, and in how many of them it shows)")
        lines += _findings_note(table)
        lines += self.absent_note()
        if self.shows_pool_row():
            lines.append(POOL_NOTE)
        if self.kv_damaged:
            lines.append(KV_POOL_NOTE)
        for workload, loop, status in self.runs_not_finished():
            lines.append(f"run {workload} on {loop}: {status}")
        return "\n".join(line.rstrip() for line in lines)


def worst_cell(cell: pd.DataFrame) -> tuple[str, int, int]:
    """A (clause, loop) cell of :meth:`Status.per_run` rows: its worst status (``known
    upstream`` when every violating run is a catalogued bug), in how many runs it shows,
    of how many."""
    worst = min(cell["status"], key=_SEVERITY.index)
    count = int((cell["status"] == worst).sum())
    if worst == VIOLATED and cell.loc[cell["status"] == worst, "finding"].notna().all():
        worst = KNOWN_UPSTREAM
    return worst, count, len(cell)


def _section(label: str, previous: str | None) -> list[str]:
    """``[RFC #32833]`` / ``[this project's extensions]`` before the first clause row of
    each (``label`` is ``"N name"``; other rows, e.g. the KV pool's, open none)."""
    number = label.split(" ", 1)[0]
    if not number.isdigit():
        return []
    before = previous.split(" ", 1)[0] if previous else ""
    if before.isdigit() and origin(int(before)) == origin(int(number)):
        return []
    return [f"[{origin(int(number))}]"]


def _findings_note(table: pd.DataFrame) -> list[str]:
    if not table.astype(str).apply(lambda c: c.str.startswith(KNOWN_UPSTREAM)).any().any():
        return []
    return [f"({KNOWN_UPSTREAM} = violated exactly as a catalogued upstream bug predicts, "
            "see data/bugs.toml; reported, not a failure unless --strict-known)"]


def default_loops(runner: str = "model-free") -> tuple[str, ...]:
    """The registry's default loops (SGLang's), or only its MLX ones for the real runner
    (the torch loops stay model-free). ``omni`` (sglang-omni, pinned to SGLang 0.5.22)
    runs when asked for."""
    names = registry.default_names()
    return tuple(n for n in names if registry.spec(n).mlx) if runner == "real" else names


def status(workloads: list[str] | None = None, loops: tuple[str, ...] | None = None,
           patch: PatchArg = None, progress: bool = True, cache: bool = True,
           warm: bool = True, runner: str = "model-free", sglang: str | None = None,
           clauses: str = "all", strict_known: bool = False) -> Status:
    """Run and check every workload through every loop (in parallel) on one release."""
    return releases_status([sglang], workloads, loops, patch, progress, cache, warm,
                           runner, clauses, strict_known=strict_known).statuses[0]


@dataclasses.dataclass
class ReleasesStatus:
    """:class:`Status` of several SGLang releases, side by side."""

    statuses: list[Status]

    def table(self) -> pd.DataFrame:
        """Rows (clause, loop), one column per release: the worst status over workloads."""
        tables = {s.sglang: s.table() for s in self.statuses}
        rows = []
        for clause in next(iter(tables.values())).index:
            for loop in next(iter(tables.values())).columns:
                row = {"clause": clause, "loop": loop}
                for version, table in tables.items():
                    row[version] = table.loc[clause, loop] if loop in table else "-"
                rows.append(row)
        return pd.DataFrame(rows).set_index(["clause", "loop"])

    def text(self) -> str:
        if len(self.statuses) == 1:
            return self.statuses[0].text()
        table = self.table()
        width = max(len(c) for c, _ in table.index) + 2
        loop_width = max(len(loop) for _, loop in table.index) + 2
        versions = list(table.columns)
        runner = self.statuses[0].runner
        column = max([24] + [len(f"sglang {v}  ") for v in versions])  # a tree's label is long
        lines = ["clause".ljust(width) + "loop".ljust(loop_width)
                 + "".join(f"sglang {v}".ljust(column) for v in versions)]
        previous = None
        for clause, loop in table.index:
            label = clause if clause != previous else ""
            if clause != previous:
                lines += _section(clause, previous)
            previous = clause
            lines.append(label.ljust(width) + loop.ljust(loop_width) + "".join(
                f"{table.loc[(clause, loop), v]:<{column}}" for v in versions))
        lines.append("")
        lines.append("(worst status over the workloads, and in how many of them it shows"
                     + ("; MLX with the real MlxModelRunner)" if runner == "real" else ")"))
        if any(s.kv_damaged for s in self.statuses):
            lines.append(KV_POOL_NOTE)
        lines += _findings_note(table)
        for s in self.statuses:
            lines += s.absent_note()
        for s in self.statuses:
            for workload, loop, state in s.runs_not_finished():
                lines.append(f"run {workload} on {loop} (sglang {s.sglang}): {state}")
        return "\n".join(line.rstrip() for line in lines)

    def reference_violations(self) -> pd.DataFrame:
        frames = []
        for s in self.statuses:
            bad = s.reference_violations()
            frames.append(bad.assign(sglang=s.sglang))
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    def outcome(self) -> Outcome:
        return worst(s.outcome() for s in self.statuses)


def releases_status(versions: list[str | None], workloads: list[str] | None = None,
                    loops: tuple[str, ...] | None = None, patch: PatchArg = None,
                    progress: bool = True, cache: bool = True, warm: bool = True,
                    runner: str = "model-free", clauses: str = "all",
                    diffs: list[str] | None = None,
                    strict_known: bool = False) -> ReleasesStatus:
    """Every workload through every loop on each SGLang in ``versions`` (a release, None:
    the venv's, or a source-tree path; ``diffs`` applied to each), all runs in parallel;
    each release installs on first use."""
    from contract_lib.sources.origin import resolve

    workloads = workloads or workload_names()
    loops = runnable(loops or default_loops(runner))
    spec = patch_spec(patch)
    # Install or build before the parallel runs, one at a time.
    sources = {source.label: (source, v) for v in versions
               for source in [resolve(v, diffs)]}
    keys = [(v, w, loop) for v in sources for w in workloads for loop in loops]
    # A pinned loop (``omni``) runs on its release: the default (None) lets it choose it.
    frames = run_many([{"workload": w, "loop": loop, "patch": spec, "cache": cache,
                        "warm": warm, "runner": runner,
                        **({"sglang": sources[v][1], "diff": diffs}
                           if registry.spec(loop).sglang else {"sglang": sources[v][0]})}
                       for v, w, loop in keys], progress=progress)
    frames = frames_or_raise(frames)  # e.g. a bad server arg: the table needs every run
    return checked_releases(
        {version: {(w, loop): f for (v, w, loop), f in zip(keys, frames) if v == version}
         for version in sources}, runner, clauses, strict_known)


def checked_releases(runs: dict[str, dict[tuple[str, str], Frames]],
                     runner: str = "model-free", clauses: str = "all",
                     strict_known: bool = False) -> ReleasesStatus:
    """The tables of runs already made (per release label, (workload, loop) -> frames,
    e.g. saved ones): each checked, with the MLX KV pool row."""
    from contract_lib.contract.kv_damage import kv_rows

    damage = kv_rows(list(runs.values()), real=runner == "real")
    return ReleasesStatus([
        Status({key: check(f, clauses, strict_known) for key, f in version_runs.items()},
               sglang=version, runner=runner, kv_damaged=version_damage)
        for (version, version_runs), version_damage in zip(runs.items(), damage)])
