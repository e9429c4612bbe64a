"""The report of a checked run: one result per clause of a clause set, SGLang's own pool
conservation law, the aborted requests, and the run's verdict; :func:`check` and
:func:`assert_contract`.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np
import pandas as pd

from contract_lib.contract.base import (
    NOT_EXERCISED,
    NOT_PRESENT,
    VIOLATION_COLUMNS,
    ClauseResult,
    NotExercised,
    one_check,
    ordered_by,
    violations,
)
from contract_lib.contract.idle import never_overlapped
from contract_lib.contract.known import KnownMatch, judge
from contract_lib.contract.outputs import COLUMNS as OUTPUT_COLUMNS, wrong_outputs
from contract_lib.contract.registry import (
    EXTENDED_FIELDS,
    REGISTRY,
    Check,
    clause_checks,
    origin,
)
from contract_lib.frames import Frames, run_title
from contract_lib.verdict import Outcome, Verdict, verdict


class ContractViolation(AssertionError):
    """Raised by :func:`assert_contract`; the message starts ``clause N (name): field F``."""


class UntrustedVerdict(ContractViolation):
    """Raised by :func:`assert_contract` when no clause is violated but the run cannot
    pass: ``outcome`` (:class:`contract_lib.verdict.Outcome`) says why, ``status`` is the
    run's status; ``type`` and ``message`` are its error's, if any."""

    def __init__(self, verdict_: Verdict, meta: dict[str, Any]) -> None:
        error = meta.get("error") or {}
        self.outcome = verdict_.outcome
        self.status = meta.get("status")
        self.type = error.get("type")
        self.message = error.get("message")
        super().__init__(f"{run_title(meta)}: {verdict_.outcome.label}: {verdict_.reason}")


class RunDidNotFinish(UntrustedVerdict):
    """The run crashed, died or timed out (or failed in set-up, or entered another loop
    than the one asked for): the clauses it did not violate prove nothing."""


class VacuousRun(UntrustedVerdict):
    """The run finished but exercised no clause, or SGLang aborted a request the workload
    did not declare as expected to be aborted."""


class KnownUpstreamBug(ContractViolation):
    """Raised by :func:`assert_contract` when the run's only findings are catalogued
    upstream bugs reproduced exactly (``report.known``): an expected failure. The
    pytest plugin reports it as ``xfail`` (``--contract-strict-known``: a failure)."""

    def __init__(self, report: "Report") -> None:
        self.report = report
        super().__init__("known upstream: " + "; ".join(
            m.line() for matches in report.known.values() for m in matches))


@dataclasses.dataclass
class Report:
    """The check of one run: a result per clause, the pool check, and the run's fate."""

    meta: dict[str, Any]
    clauses: dict[int, ClauseResult]
    pool: pd.DataFrame
    # Requests SGLang aborted: rid, message, expected (declared by the workload).
    aborted: pd.DataFrame = dataclasses.field(
        default_factory=lambda: pd.DataFrame(columns=ABORTED_COLUMNS))
    clause_set: str = "all"
    # Why the run of an overlap loop is another loop's (nothing ever in flight), or None.
    not_overlapping: str | None = None
    # Per request, its first token that is not the fake model's (:mod:`.outputs`).
    wrong_outputs: pd.DataFrame = dataclasses.field(
        default_factory=lambda: pd.DataFrame(columns=OUTPUT_COLUMNS))
    # A finished MLX run damaged the KV pool, either runner's (:mod:`contract_lib.child.kvpool`).
    kv_damaged: bool = False
    # Clause -> the catalogued upstream bugs that explain each of its violations exactly
    # (:mod:`.known`), and the catalogued bugs this run no longer reproduces.
    known: dict[int, list[KnownMatch]] = dataclasses.field(default_factory=dict)
    gone: list[KnownMatch] = dataclasses.field(default_factory=list)
    # Known upstream bugs fail the run too (``--strict-known``).
    strict_known: bool = False

    def failing(self) -> dict[int, ClauseResult]:
        """The violated clauses that fail the run: all of them under ``strict_known``,
        else those not explained exactly by catalogued upstream bugs."""
        return {n: r for n, r in self.clauses.items() if not r.violations.empty
                and (self.strict_known or n not in self.known)}

    @property
    def ok(self) -> bool:
        """True only for a pass: the requested loop ran to the end, no clause violated
        nor pool leak, at least one exercised, no unexpected aborted request (see
        :meth:`verdict`)."""
        return self.verdict().outcome == Outcome.PASS

    def verdict(self, kv_damaged: bool = False) -> Verdict:
        """The run's outcome and exit code (:mod:`contract_lib.verdict`); the KV pool
        counts as damaged when the report found it so, or the caller says it is."""
        return verdict(self, kv_damaged or self.kv_damaged)

    def vacuity(self) -> list[str]:
        """Why a finished run proves nothing, unless its workload declares it expected:
        requests SGLang aborted, a declared abort that did not happen, or no clause
        exercised."""
        expect = self.meta.get("expect") or {}
        reasons = [f"SGLang aborted request {r.rid}: {r.message}"
                   for r in self.aborted.itertuples(index=False) if not r.expected]
        reasons += [f"request {rid} is declared aborted ([expect] aborted), but SGLang did "
                    "not abort it" for rid in expect.get("declared_aborted", ())
                    if rid not in set(self.aborted["rid"])]
        if (all(r.status in (NOT_EXERCISED, NOT_PRESENT) for r in self.clauses.values())
                and not expect.get("vacuous")):
            reasons.append("no clause was exercised")
        return reasons

    @property
    def violations(self) -> pd.DataFrame:
        """Every violation of every clause, ordered by clause then step."""
        frames = [r.violations for r in self.clauses.values() if not r.violations.empty]
        if not frames:
            return pd.DataFrame(columns=VIOLATION_COLUMNS)
        return pd.concat(frames, ignore_index=True)

    def table(self) -> pd.DataFrame:
        """One row per clause: status, violation count, the first violation, and where
        the clause comes from (``RFC #32833`` or ``this project's extensions``)."""
        rows = []
        for number, result in self.clauses.items():
            first = result.first() or {}
            rows.append({
                "clause": number, "name": result.name, "status": result.status,
                "violations": len(result.violations), "first_step": first.get("step"),
                "first_field": first.get("field"), "first_rid": first.get("rid"),
                "note": result.note, "origin": origin(number),
                "absent": ", ".join(result.absent) or None,
            })
        return pd.DataFrame(rows)

    def text(self) -> str:
        """A short text table and the first violation per clause, for terminals."""
        meta = self.meta
        lines = [f"{run_title(meta)}: run {meta['status']}, {meta['steps']} steps"]
        if meta.get("error"):
            error = meta["error"]
            lines.append(f"  run {meta['status']}: {error['type']}: {error['message']}")
        lines.append("")
        lines.append(f"  {'clause':<48} {'status':<16} violations")
        section = None
        for number, result in self.clauses.items():
            if origin(number) != section:
                section = origin(number)
                lines.append(f"  [{section}]")
            label = f"{number} {result.name}"
            if self.clause_set == "all" and number in EXTENDED_FIELDS:
                label += f" (+ {', '.join(EXTENDED_FIELDS[number])})"
            lines.append(f"  {label:<48} {result.status:<16} {len(result.violations)}")
        leaks = len(self.pool)
        lines.append(f"  {'- ' + POOL_ROW:<48} "
                     f"{'leak' if leaks else 'balanced':<16} {leaks}")
        for number, result in self.clauses.items():
            first = result.first()
            if first is not None:
                lines.append("")
                lines.append(violation_message(first))
                if number in self.known:
                    lines.append(f"  (known upstream: {', '.join(m.bug for m in self.known[number])}"
                                 " in data/bugs.toml, below)")
            elif result.status == NOT_EXERCISED:
                lines.append("")
                lines.append(f"clause {number} ({result.name}): not exercised: {result.note}")
            if result.absent:
                lines.append("")
                lines += [f"clause {number} ({result.name}): field {name} not present in this "
                          f"release: {why}" for name, why in result.absent.items()]
        if leaks:
            first = self.pool.iloc[0]
            lines.append("")
            lines.append(f"KV pool: first leak at step {first['step']}: {first['explanation']}")
        if self.known:
            lines.append("")
            lines.append("known upstream (catalogued bugs reproduced exactly; "
                         + ("they fail the run: --strict-known)" if self.strict_known else
                            "not a failure unless --strict-known)"))
            lines += [f"  {m.line()}" for matches in self.known.values() for m in matches]
        if self.gone:
            lines.append("")
            lines += [m.line() for m in self.gone]
        for r in self.aborted.itertuples(index=False):
            lines.append("")
            lines.append(f"request {r.rid} aborted by SGLang"
                         f"{' (declared expected)' if r.expected else ''}: {r.message}")
        outcome = self.verdict()
        # A violated run whose table shows nothing red (the outputs safety net) says why.
        unexplained = not leaks and all(r.first() is None for r in self.clauses.values())
        absent = any(r.absent for r in self.clauses.values())
        if (outcome.outcome not in (Outcome.PASS, Outcome.VIOLATED) or not self.aborted.empty
                or (outcome.outcome == Outcome.VIOLATED and unexplained) or self.known
                or absent):
            lines.append("")
            lines.append(outcome.line())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()


def violation_message(v: dict[str, Any]) -> str:
    """``clause N (name): field F at step S [request R]: expected E, got A. why``"""
    where = f"step {v['step']}"
    if v.get("launch") is not None and not pd.isna(v.get("launch")):
        where += f" (launch {int(v['launch'])})"
    if v.get("rid") is not None:
        where += f", request {v['rid']}"
    return (f"clause {v['clause']} ({v['name']}): field {v['field']} at {where} on "
            f"{v['loop']}: expected {v['expected']}, got {v['actual']}. {v['explanation']}")


# -- pool conservation ---------------------------------------------------------------------

# SGLang's own KV pool conservation law, judged beside the clauses (a leak fails a run).
POOL_ROW = "KV pool conservation (SGLang InvariantChecker)"


def check_pool(frames: Frames) -> pd.DataFrame:
    """Steps at which SGLang's own pool conservation laws did not balance: the KV pool's
    (its checker's verdict, ``pool_leak``) and the ``req_to_token`` rows' (its idle
    check's law at every step: free rows + rows the requests hold == the pool's rows);
    and steps at which the radix tree protects KV while no request holds a row."""
    steps = frames.steps
    column = {name: steps[name].to_numpy() for name in (
        "step", "loop", "pool_leak", "kv_available", "kv_evictable", "kv_protected",
        "kv_uncached", "kv_total", "rows_free", "rows_total")}
    rows = []  # (step, loop, explanation), from numpy columns (pandas: ~2 ms a run)
    rows += [(int(column["step"][at]), column["loop"][at],
              "available {} + evictable {} + protected {} + uncached {} != total {}".format(
                  *(column[name][at] for name in ("kv_available", "kv_evictable",
                                                  "kv_protected", "kv_uncached", "kv_total"))))
             for at in np.flatnonzero(column["pool_leak"].astype(bool))]
    # The rows the requests hold at each step (each row once).
    requests = frames.requests
    holding = requests["req_pool_idx"].notna().to_numpy()
    held_at = collections.Counter(step for step, _ in set(zip(
        requests["step"].to_numpy()[holding].tolist(),
        requests["req_pool_idx"].to_numpy()[holding].tolist())))
    counted = np.flatnonzero(pd.notna(column["rows_free"]) & pd.notna(column["rows_total"]))
    held = np.array([held_at.get(step, 0) for step in column["step"][counted].tolist()],
                    dtype="int64")
    lost = column["rows_free"][counted] + held != column["rows_total"][counted]
    rows += [(int(column["step"][at]), column["loop"][at],
              f"req_to_token rows: free {int(column['rows_free'][at])} + held by requests "
              f"{count} != total {int(column['rows_total'][at])}")
             for at, count in zip(counted[lost], held[lost])]
    # The radix tree's locks are taken for requests (their matched prefix): with no
    # request holding a row, none may be left (a lock never released keeps that KV
    # from eviction for good; the law above counts it as accounted for).
    locked = counted[(held == 0) & (column["kv_protected"][counted] > 0)]
    rows += [(int(column["step"][at]), column["loop"][at],
              f"protected {int(column['kv_protected'][at])} with no request holding a row: "
              "a radix tree lock never released (that KV can never be evicted)")
             for at in locked]
    return pd.DataFrame(rows, columns=["step", "loop", "explanation"]).sort_values(
        "step", kind="stable", ignore_index=True)


# -- aborted requests ----------------------------------------------------------------------

ABORTED_COLUMNS = ["rid", "message", "expected"]


def aborted_requests(frames: Frames) -> pd.DataFrame:
    """Requests whose last recorded ``finish_reason`` is SGLang's ``abort``, with its
    message and whether the workload declares the abort expected (``[expect] aborted``).
    Frames recorded without the ``finish_reason`` column have none."""
    requests = frames.requests
    if "finish_reason" not in requests or requests.empty:
        return pd.DataFrame(columns=ABORTED_COLUMNS)
    last = ordered_by(requests, "step").groupby("rid", sort=False).tail(1)
    aborted = last[last["finish_reason"] == "abort"]
    expected = set((frames.meta.get("expect") or {}).get("aborted", ()))
    messages = [m if isinstance(m, str) and m else "(no message)"  # None or NaN: none
                for m in aborted["finish_message"]]
    return pd.DataFrame({"rid": aborted["rid"].tolist(), "message": messages,
                         "expected": [rid in expected for rid in aborted["rid"]]},
                        columns=ABORTED_COLUMNS)



def evaluate(number: int, check_: Check, frames: Frames) -> ClauseResult:
    """Run one clause's check: ``not-present`` when the run's SGLang has none of its
    fields (:attr:`Frames.absent`), ``not-exercised`` (with the reason) when its
    declared condition or the check itself says the run gave it nothing to check; the
    result lists the clause's fields the release does not have (``absent``)."""
    declared = REGISTRY[number]
    names = (*declared.fields, *declared.audit_fields, *declared.extended_fields)
    absent = {name: why for name, why in frames.absent.items() if name in names}
    if declared.fields and all(name in absent for name in declared.fields):
        return ClauseResult(number, NOT_PRESENT, "; ".join(absent.values()),
                            violations(number, frames.loop, []), absent)
    why = declared.unexercised(frames) if declared.unexercised else None
    if why is None:
        try:
            return dataclasses.replace(check_(frames), absent=absent)
        except NotExercised as exc:
            why = str(exc)
    return ClauseResult(number, NOT_EXERCISED, why, violations(number, frames.loop, []),
                        absent)


def check(frames: Frames, clauses: str = "all", strict_known: bool = False) -> Report:
    """Check a clause set on one run's frames (whatever its status): ``"all"`` (the
    RFC's five and this project's extensions) or ``"rfc"`` (the RFC's five only); the
    report's :meth:`Report.verdict` says whether the run earned a pass. A clause whose
    violations are exactly a catalogued upstream bug's (:mod:`.known`) is reported as
    known upstream and fails the run only with ``strict_known``."""
    checks = clause_checks(clauses)
    with one_check():
        results = {number: evaluate(number, check_, frames)
                   for number, check_ in checks.items()}
        known, gone = judge(frames, results)
        return Report(meta=dict(frames.meta), clauses=results,
                      pool=check_pool(frames), aborted=aborted_requests(frames),
                      clause_set=clauses, not_overlapping=never_overlapped(frames),
                      wrong_outputs=wrong_outputs(frames), kv_damaged=_kv_damaged(frames),
                      known=known, gone=gone, strict_known=strict_known)


def _kv_damaged(frames: Frames) -> bool:
    """A finished MLX run damaged the KV pool: the real runner's, or the model-free
    runner's contents (the command line reads the same, and its pass needs an intact
    pool: so does :attr:`Report.ok`)."""
    if frames.status != "finished":
        return False
    from contract_lib.contract import kv_damage

    return kv_damage.damaged(frames)


def assert_contract(frames: Frames, clauses: str = "all", strict_known: bool = False
                    ) -> Report:
    """Return the report of a run that passes, else raise.

    :class:`ContractViolation` for the lowest violated clause (the message starts
    ``clause N (name): field F``, for pytest), even from a run that did not finish, else
    for SGLang's pool conservation law not balancing (``KV pool conservation ...``);
    otherwise :class:`RunDidNotFinish` (crashed, died, timeout, set-up failure, another
    loop) or :class:`VacuousRun` (no clause exercised, an unexpected aborted request);
    and, for a run that passes but reproduces catalogued upstream bugs exactly,
    :class:`KnownUpstreamBug` (pytest reports it as ``xfail``). With ``strict_known`` a
    known bug's clause is a plain :class:`ContractViolation`."""
    report = check(frames, clauses, strict_known)
    for result in report.failing().values():
        first = result.first()
        if first is not None:
            raise ContractViolation(violation_message(first))
    if not report.pool.empty:
        first = report.pool.iloc[0]
        raise ContractViolation(f"{POOL_ROW} on {first['loop']}: first leak at step "
                                f"{first['step']}: {first['explanation']}")
    outcome = report.verdict()
    if outcome.outcome == Outcome.VACUOUS:
        raise VacuousRun(outcome, report.meta)
    if outcome.outcome != Outcome.PASS:
        raise RunDidNotFinish(outcome, report.meta)
    if report.known:
        raise KnownUpstreamBug(report)
    return report
