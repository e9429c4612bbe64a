"""Base against head: the same workloads through two SGLangs, clause by clause.

A *side* is an SGLang (a release, or a source tree) with optional diffs and patches,
written as comma-separated ``key=value`` parts (:func:`parse_side`)::

    release=0.5.23                      # a supported release (default: the venv's)
    path=~/src/sglang                   # a source tree (a checkout's root or python/)
    diff=fix.diff,diff=more.diff        # upstream diffs, applied in order
    patch=fix-backend-state             # built-in or module:callable patches

``release`` and ``path`` exclude each other; ``diff`` and ``patch`` repeat. An empty side
is the venv's SGLang, unpatched. :func:`compare` runs every (workload, loop) on both sides
(all runs in parallel) and :class:`Comparison` says, per clause and loop, whether the head
**fixed** it (violated on base, holds on head), **kept** it (same class of status), or
**broke** it (not violated on base, violated on head); where both sides violate it,
**worse** (the head violates a (workload, field, request) the base does not) or
**better** (the head violates fewer of them, and none new); per run it says whether the
emitted tokens are equal, each later turn's radix reuse, the KV pool, and the first
step where the frames differ. SGLang's own KV pool conservation row (``leak`` /
``balanced``, shown when either side leaked) and, with the real MLX runner, the KV pool
row (``damaged`` / ``intact``) are judged like clauses, as ``check`` fails on them too.

Exit codes (:meth:`Comparison.outcome`; the first that applies, as
:data:`contract_lib.verdict.PRECEDENCE` orders a command's runs):

====  =============  ===================================================================
code  outcome        when
====  =============  ===================================================================
130   interrupted    Ctrl-C
2     usage          a usage or set-up error (a side that does not parse, a tree that
                     cannot be driven, a diff that does not apply, a run that failed
                     before its loop)
1     broke          the head broke a clause (it holds or is not exercised on base and is
                     violated on head), or made one it already violated worse, whatever
                     else it fixed
3     not-finished   a run on either side crashed, died or timed out
4     vacuous        a run on either side was vacuous, or a clause violated on base is
                     not exercised on head (no fix was earned)
0     fixed          the head fixed at least one clause and broke none
5     kept           no clause changed (or one still violated got better)
====  =============  ===================================================================
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from contract_lib import loops as registry
from contract_lib.campaigns.run_diff import (
    cached_tokens_at_end,
    first_difference,
    later_turns,
    left_aligned,
    pool_summary,
)
from contract_lib.campaigns.status import (
    KNOWN_UPSTREAM,
    SETUP_ERROR,
    VACUOUS,
    Status,
    default_loops,
)
from contract_lib.contract import (
    HOLDS,
    MASKED,
    NOT_EXERCISED,
    NOT_PRESENT,
    VIOLATED,
    Report,
    check,
    kv_damage,
)
from contract_lib.frames import Frames
from contract_lib.patches.builtin import patch_spec
from contract_lib.runs.harness import frames_or_raise, run_many
from contract_lib.runs.loop_choice import runnable
from contract_lib.sources.diffs import model_free_notes
from contract_lib.sources.origin import Source, resolve
from contract_lib.verdict import ExitCode, Outcome
from contract_lib.wire.protocol import RunSetupError
from contract_lib.workloads import load_workload, workload_names

SIDE_KEYS = ("release", "path", "diff", "patch")


class Change(ExitCode):
    """What the head did to a clause, or to the whole comparison; the value is the exit
    code (see the module docstring). Set-up, not-finished, vacuous and interrupted share
    a run's :class:`~contract_lib.verdict.Outcome` codes."""

    FIXED = 0
    BROKE = 1
    USAGE = Outcome.USAGE.value
    NOT_FINISHED = Outcome.NOT_FINISHED.value
    VACUOUS = Outcome.VACUOUS.value
    KEPT = 5
    INTERRUPTED = Outcome.INTERRUPTED.value


# The order in which a comparison's changes decide its exit code.
PRECEDENCE = (Change.INTERRUPTED, Change.USAGE, Change.BROKE, Change.NOT_FINISHED,
              Change.VACUOUS, Change.FIXED, Change.KEPT)
# Cell statuses; ``damaged`` / ``intact``: the real runner's MLX KV pool row; ``leak`` /
# ``balanced``: SGLang's pool conservation row (shown when a side leaked).
_BAD = {VIOLATED, MASKED, KNOWN_UPSTREAM, "damaged", "leak"}
_CLEAN = {HOLDS, NOT_EXERCISED, NOT_PRESENT, "intact", "balanced"}
_FATES = {SETUP_ERROR: Change.USAGE, VACUOUS: Change.VACUOUS,
          "interrupted": Change.INTERRUPTED}
# A clause violated on both sides, more or less on the head: the exit code each counts as.
_DEGREES = {"worse": Change.BROKE, "better": Change.KEPT}
NO_CELL = "-"  # a row with nothing to judge in this column or on this side


@dataclasses.dataclass(frozen=True)
class Side:
    """One side of a comparison: an SGLang (``release`` or ``path``; neither: the venv's)
    with ``diffs`` applied and ``patches`` run."""

    text: str
    release: str | None = None
    path: str | None = None
    diffs: tuple[str, ...] = ()
    patches: tuple[str, ...] = ()

    def source(self) -> Source:
        """Resolve the SGLang (installs a release, checks a tree, builds a diff copy)."""
        base = self.path if self.path is not None else self.release
        return resolve(str(Path(base).expanduser()) if self.path else base, self.diffs)

    @property
    def patch(self) -> str | None:
        return patch_spec(list(self.patches))


def parse_side(text: str | None) -> Side:
    """``release=V|path=P`` and any ``diff=F`` / ``patch=P`` parts, comma-separated (see
    the module docstring); :class:`RunSetupError` naming the bad part otherwise."""
    text = (text or "").strip()
    values: dict[str, list[str]] = {key: [] for key in SIDE_KEYS}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in SIDE_KEYS or not value:
            raise RunSetupError(f"side {text!r}: bad part {part!r}; expected comma-separated "
                                f"KEY=VALUE with KEY one of {', '.join(SIDE_KEYS)} (e.g. "
                                "release=0.5.23,diff=fix.diff,patch=fix-backend-state)")
        values[key].append(value)
    for key in ("release", "path"):
        if len(values[key]) > 1:
            raise RunSetupError(f"side {text!r}: {key} given {len(values[key])} times")
    if values["release"] and values["path"]:
        raise RunSetupError(f"side {text!r}: release and path exclude each other (a side "
                            "is one SGLang; diffs and patches go on top of it)")
    return Side(text or "venv", (values["release"] or [None])[0],
                (values["path"] or [None])[0], tuple(values["diff"]),
                tuple(values["patch"]))


def classify(base: str, head: str) -> Change:
    """What the head did to one (clause, loop) cell, from the two sides' worst statuses
    over the workloads (:meth:`contract_lib.campaigns.status.Status.table`'s cells). ``-``: the
    row has no cell there (no MLX KV pool on a torch loop; a side whose MLX runs earned
    no pool verdict, whose clause rows say why): nothing changed in it."""
    if NO_CELL in (base, head):
        return Change.KEPT
    for status in (base, head):
        if status not in _BAD | _CLEAN:
            return _FATES.get(status, Change.NOT_FINISHED)
    if head in _BAD:
        return Change.KEPT if base in _BAD else Change.BROKE
    if base in _BAD:
        return Change.FIXED if head in (HOLDS, "intact", "balanced") else Change.VACUOUS
    return Change.KEPT


def _status_of(cell: str) -> str:
    """``violated (6/6)`` -> ``violated``."""
    return cell.rsplit(" (", 1)[0]


@dataclasses.dataclass
class Comparison:
    """Both sides' checked runs of every (workload, loop)."""

    base: Side
    head: Side
    labels: tuple[str, str]  # the two SGLangs as reports name them
    runs: dict[tuple[str, str], tuple[Frames, Frames]]
    clauses: str = "all"

    _checked: dict[int, dict[tuple[str, str], Report]] = dataclasses.field(
        default_factory=dict, repr=False)

    def reports(self, side: int) -> dict[tuple[str, str], Report]:
        if side not in self._checked:
            self._checked[side] = {key: check(pair[side], self.clauses)
                                   for key, pair in self.runs.items()}
        return self._checked[side]

    def violated(self, side: int, clause: int, loop: str) -> set[tuple[str, str, str]]:
        """``(workload, field, request)`` of every violation of ``clause`` on ``loop``."""
        found = set()
        for (workload, run_loop), report in self.reports(side).items():
            result = report.clauses.get(clause)
            if run_loop == loop and result is not None:
                found |= {(workload, str(field), str(rid)) for field, rid in zip(
                    result.violations["field"], result.violations["rid"])}
        return found

    def kv_damage(self) -> list[dict[tuple[str, str], bool]]:
        """Per side, whether each MLX run damaged the KV pool (a row of the clause table,
        judged as a clause: :func:`contract_lib.contract.kv_damage.kv_rows`)."""
        sides = [{key: pair[side] for key, pair in self.runs.items()} for side in (0, 1)]
        return kv_damage.kv_rows(sides, real="real" in (self.runner(0), self.runner(1)))

    def runner(self, side: int) -> str:
        """``real`` when a run of the side ran SGLang's real MLX runner."""
        return ("real" if any(pair[side].meta.get("runner") == "real"
                              for pair in self.runs.values()) else "model-free")

    def clause_table(self) -> pd.DataFrame:
        """One row per (clause, loop): each side's worst status over the workloads (as
        ``status`` shows it) and the change."""
        statuses = [Status(self.reports(side), runner=self.runner(side), kv_damaged=damage)
                    for side, damage in zip((0, 1), self.kv_damage())]
        pool_row = any(status.leaks() for status in statuses)  # on both sides, or neither
        tables = [dataclasses.replace(status, pool_row=pool_row).table()
                  for status in statuses]
        rows_of_both = tables[0].index.append(tables[1].index.difference(tables[0].index))
        tables = [table.reindex(rows_of_both, fill_value=NO_CELL) for table in tables]
        rows = []
        for clause in tables[0].index:
            for loop in tables[0].columns:
                base, head = tables[0].loc[clause, loop], tables[1].loc[clause, loop]
                change = classify(_status_of(base), _status_of(head)).label
                if change == "kept" and {_status_of(base), _status_of(head)} <= _BAD:
                    change = self._degree(clause, loop)
                rows.append({"clause": clause, "loop": loop, "base": base, "head": head,
                             "change": change})
        return pd.DataFrame(rows, columns=["clause", "loop", "base", "head", "change"])

    def _degree(self, clause: str, loop: str) -> str:
        """A clause both sides violate: ``worse`` when the head violates a (workload,
        field, request) the base does not, ``better`` when it violates fewer and none
        new, else ``kept`` (and for the pool rows, which name no field)."""
        new, gone = self._delta(clause, loop)
        return "worse" if new else "better" if gone else "kept"

    def _delta(self, clause: str, loop: str) -> tuple[int, int]:
        """How many (workload, field, request) violations of a clause row the head adds,
        and how many of the base's it no longer has (0, 0 for the pool rows)."""
        number = clause.split(" ", 1)[0]
        if not number.isdigit():
            return 0, 0
        base, head = (self.violated(side, int(number), loop) for side in (0, 1))
        return len(head - base), len(base - head)

    def _fields(self, clause: str, loop: str, change: str) -> str:
        """`` [field F at step S on W, ...]``: each field a fixed (broke, worse, better)
        clause row violates on the side that has it (the base for fixed and better, the
        head otherwise; for worse and better only the new or gone ones), at its first
        step; for a fixed row, the catalogued upstream bugs that no longer reproduce."""
        number = clause.split(" ", 1)[0]
        if not number.isdigit():
            return ""
        side = 0 if change in ("fixed", "better") else 1
        keep = None
        if change in ("worse", "better"):
            base, head = (self.violated(s, int(number), loop) for s in (0, 1))
            keep = head - base if change == "worse" else base - head
        first: dict[str, tuple[int, str, str]] = {}
        for (workload, run_loop), report in self.reports(side).items():
            result = report.clauses.get(int(number))
            if run_loop != loop or result is None:
                continue
            for v in result.violations.itertuples(index=False):
                if keep is not None and (workload, str(v.field), str(v.rid)) not in keep:
                    continue
                where = (int(v.step), workload, "" if v.rid is None else f", request {v.rid}")
                first[v.field] = min(first.get(v.field, where), where)
        named = [f"field {field} at step {step} on {workload}{rid}"
                 for field, (step, workload, rid) in sorted(first.items(),
                                                            key=lambda f: f[1])]
        if change == "fixed":
            gone = sorted({m.bug for (_, run_loop), report in self.reports(1).items()
                           if run_loop == loop for m in report.gone
                           if m.clause == int(number)})
            named += [f"known upstream bug {bug} no longer reproduces" for bug in gone]
        return f" [{'; '.join(named)}]" if named else ""

    def run_table(self) -> pd.DataFrame:
        """One row per (workload, loop): tokens equal, later turns' radix reuse, the KV
        pool on each side, and the first step whose frames differ."""
        rows = []
        for (workload, loop), (base, head) in self.runs.items():
            reuse = [f"{rid} {cached_tokens_at_end(base, rid)} -> {cached_tokens_at_end(head, rid)}"
                     for rid in later_turns(workload)]
            rows.append({"workload": workload, "loop": loop,
                         "same tokens": "yes" if base.output_tokens() == head.output_tokens()
                         else "NO",
                         "radix reuse (base -> head)": ", ".join(reuse) or "-",
                         "pool base": pool_summary(base), "pool head": pool_summary(head),
                         "first difference": first_difference(base, head)})
        return pd.DataFrame(rows)

    def outcome(self) -> Change:
        """The exit code: the first of :data:`PRECEDENCE` any clause cell has; a usage
        error when no run earned a cell (every run refused as unsupported)."""
        present = {_DEGREES.get(c) or Change[c.upper().replace("-", "_")]
                   for c in self.clause_table()["change"]}
        if not present:
            return Change.USAGE
        return next(c for c in PRECEDENCE if c in present or c == Change.KEPT)

    def text(self) -> str:
        clauses = self.clause_table()
        lines = [f"base: {self.base.text}  = sglang {self.labels[0]}"
                 f"{' + patch ' + self.base.patch if self.base.patch else ''}",
                 f"head: {self.head.text}  = sglang {self.labels[1]}"
                 f"{' + patch ' + self.head.patch if self.head.patch else ''}", ""]
        lines += left_aligned(clauses).splitlines()
        lines += ["", "(worst status over the workloads, and in how many of them it shows)",
                  ""]
        lines += left_aligned(self.run_table()).splitlines()
        outcome = self.outcome()
        changed = clauses[clauses["change"].isin(["fixed", "broke", "worse", "better"])]
        said = "; ".join(f"{r.change} {r.clause} on {r.loop}" + (
            " ({} (workload, field, request) violations new, {} gone)".format(
                *self._delta(r.clause, r.loop)) if r.change in ("worse", "better") else "")
            + self._fields(r.clause, r.loop, r.change) for r in changed.itertuples())
        for side, name in enumerate(("base", "head")):
            for workload, loop, fate in Status(self.reports(side)).runs_not_finished():
                lines.append(f"run {workload} on {loop} ({name}): {fate}")
        if any(registry.known(loop).mlx and pair[0].meta.get("runner") != "real"
               for (_, loop), pair in self.runs.items()):
            lines += model_free_notes([*self.base.diffs, *self.head.diffs])
        lines += ["", f"compare: {outcome.label} (exit {int(outcome)})"
                  + (f": {said}" if said else "")]
        return "\n".join(line.rstrip() for line in lines)


def compare(base: Side | str | None, head: Side | str | None,
            workloads: Sequence[str] | None = None, loops: Sequence[str] | None = None,
            clauses: str = "all", runner: str = "model-free", cache: bool = True,
            warm: bool = True, progress: bool = True) -> Comparison:
    """Run every workload through every loop on both sides (in parallel) and return the
    :class:`Comparison`. Set-up errors (a side, a tree, a diff, a bad name) raise before
    any run starts."""
    sides = [s if isinstance(s, Side) else parse_side(s) for s in (base, head)]
    workloads = list(workloads or workload_names())
    for workload in workloads:
        load_workload(workload)  # a bad name fails before anything is built
    loops = list(runnable(loops or default_loops(runner)))
    sources = [side.source() for side in sides]  # one at a time: installs and builds
    keys = [(w, loop) for w in workloads for loop in loops]
    jobs = [{"workload": w, "loop": loop, "patch": side.patch, "cache": cache, "warm": warm,
             "runner": runner, **_sglang(side, source, loop)}
            for side, source in zip(sides, sources) for w, loop in keys]
    results = frames_or_raise(run_many(jobs, progress=progress))
    runs = {key: (results[i], results[len(keys) + i]) for i, key in enumerate(keys)}
    return Comparison(sides[0], sides[1], (sources[0].label, sources[1].label), runs,
                      clauses)


def _sglang(side: Side, source: Source, loop: str) -> dict[str, Any]:
    """A run's SGLang arguments: the resolved source, except on a loop pinned to its own
    release (``omni``), which resolves the side's diffs on that release itself."""
    if registry.spec(loop).sglang is not None and side.release is None and side.path is None:
        return {"sglang": None, "diff": list(side.diffs)}
    return {"sglang": source}
