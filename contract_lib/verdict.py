"""One verdict per run, and the exit code every command derives from it.

A green verdict is earned: the loop that was asked for ran to the end, at least one clause
was exercised, every clause held, SGLang's KV pool conservation law balanced at every step
boundary, and SGLang aborted no request the workload did not declare. Every other outcome
has its own exit code, so CI can tell a finding from a broken run:

====  ================  ============================================================
code  outcome           when
====  ================  ============================================================
0     ``pass``          the requested loop ran to the end, no clause violated nor pool
                        leak, at least one clause exercised, no unexpected aborted request
1     ``violated``      a clause is violated, SGLang's own KV pool conservation law
                        (``InvariantChecker``) did not balance at a step boundary (a
                        leak), or, ``--runner real``, the MLX KV pool was damaged; or,
                        none of these, a request emitted tokens the fake model did not
                        compute (a gap in the contract); wins over 3 and 4: the frames
                        taken are evidence
2     ``usage``         usage or set-up error: unknown names, a bad patch, a run that
                        failed before its loop, the loop SGLang would enter is not the
                        loop asked for
3     ``not-finished``  the run crashed, died or timed out (``max_steps`` included) and
                        no clause was violated in the frames it got
4     ``vacuous``       finished, but no clause was exercised or SGLang aborted a
                        request, and the workload does not declare that expected
130   ``interrupted``   Ctrl-C (reserved here; wired by the command line)
====  ================  ============================================================

The command line adds two codes that are not a run's outcome: 70 (contract_lib itself
failed: a bug of the tool, never a verdict) and 143 (SIGTERM, handled as Ctrl-C).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from contract_lib import loops


class ExitCode(enum.IntEnum):
    """An answer whose value is the process exit code (members in subclasses)."""

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", "-")


class Outcome(ExitCode):
    """A run's (or a command's) outcome; the value is the process exit code."""

    PASS = 0
    VIOLATED = 1
    USAGE = 2
    NOT_FINISHED = 3
    VACUOUS = 4
    INTERRUPTED = 130


# When a command summarises several runs: the outcome it exits with is the first of these
# that any run has (a broken set-up hides everything; a violation is evidence even from a
# run that did not finish).
PRECEDENCE = (Outcome.INTERRUPTED, Outcome.USAGE, Outcome.VIOLATED, Outcome.NOT_FINISHED,
              Outcome.VACUOUS, Outcome.PASS)

# The SGLang event-loop function each registered loop must enter (kept as a name for
# callers; :func:`loop_mismatch` reads the registry, so a loop registered later counts).
LOOP_FUNCTIONS = loops.loop_functions()


@dataclasses.dataclass(frozen=True)
class Verdict:
    """An outcome and the one-line reason for it."""

    outcome: Outcome
    reason: str

    @property
    def code(self) -> int:
        return int(self.outcome)

    def line(self) -> str:
        return f"verdict: {self.outcome.label} (exit {self.code}): {self.reason}"


def worst(outcomes) -> Outcome:
    """The outcome a command over several runs exits with (PASS for none)."""
    present = set(outcomes)
    return next((o for o in PRECEDENCE if o in present), Outcome.PASS)


def setup_failed(meta: dict) -> bool:
    """The run never reached its loop (bad server arg, a patch that would not apply, the
    wrong loop): a set-up error."""
    error = meta.get("error") or {}
    return meta.get("status") != "finished" and error.get("phase") == "setup"


def unsupported(meta: dict) -> str | None:
    """Why the loop, as SGLang built it, refused the workload in set-up
    (:class:`contract_lib.wire.protocol.Unsupported`, e.g. a page size the MLX backend's KV
    allocator cannot serve), or None. Still a set-up error for ``run``/``check``."""
    error = meta.get("error") or {}
    if setup_failed(meta) and error.get("type") == "Unsupported":
        return error.get("message")
    return None


def loop_mismatch(meta: dict) -> str | None:
    """Why the loop that ran is not the loop asked for, or None. A run that finished
    without entering any ``event_loop_*`` method (none recorded in ``loop_function``) ran
    a loop of its own: something replaced SGLang's dispatch, so the loop asked for was
    not judged. A loop registered in another process (function unknown here) is not
    judged."""
    entered = meta.get("loop_function")
    wanted = loops.loop_functions().get(meta.get("loop"))
    if wanted is None or entered == wanted:
        return None
    if entered is None:
        if meta.get("status") != "finished":
            return None  # it never reached a loop, or stopped in one: not a pass anyway
        return (f"--loop {meta['loop']} asked for {wanted}, but the run finished without "
                "entering it or any other event_loop_* method: something (a patch or a "
                "diff) replaced SGLang's dispatch, so the loop asked for never ran")
    return (f"--loop {meta['loop']} asked for {wanted}, but SGLang entered {entered} "
            f"(enable_overlap={meta.get('enable_overlap')}, "
            f"enable_overlap_mlx={meta.get('enable_overlap_mlx')})")


def verdict(report: Any, kv_damaged: bool = False) -> Verdict:
    """The verdict on one checked run (``report``: a :class:`contract_lib.contract.Report`,
    not imported: the contract imports this module; ``kv_damaged``: the real runner damaged the MLX KV
    pool, see :func:`contract_lib.contract.kv_damage.damaged`). Its reason ends with the clauses'
    fields the run's SGLang does not have, if any (no violation: nothing reads them)."""
    found = _verdict(report, kv_damaged)
    absent = [f"{name} (clause {number})" for number, r in report.clauses.items()
              for name in getattr(r, "absent", {})]
    if not absent:
        return found
    return Verdict(found.outcome, f"{found.reason}; not present in sglang "
                                  f"{report.meta.get('sglang_version')} (no violation): "
                                  f"{', '.join(absent)}")


def _verdict(report: Any, kv_damaged: bool) -> Verdict:
    meta = report.meta
    status, error = meta.get("status"), meta.get("error") or {}
    failure = f"{error.get('type')}: {error.get('message')}" if error else ""
    if setup_failed(meta):
        return Verdict(Outcome.USAGE, f"the run failed in set-up: {failure}")
    mismatch = loop_mismatch(meta) or getattr(report, "not_overlapping", None)
    if mismatch:
        return Verdict(Outcome.USAGE, mismatch)
    clauses = [f"clause {n}" for n in report.failing()]
    found = [f"{', '.join(clauses)} violated"] if clauses else []
    if not report.pool.empty:
        first = report.pool.iloc[0]
        found.append(f"the KV pool's accounting did not balance (first at step "
                     f"{first['step']}: {first['explanation']})")
    if kv_damaged:
        found.append("the MLX KV pool was damaged")
    wrong = getattr(report, "wrong_outputs", None)
    if not found and wrong is not None and len(wrong):
        first = wrong.iloc[0]
        found.append(f"no clause found a cause, but {len(wrong)} request(s) emitted tokens "
                     f"the model did not compute (first: {first['rid']} token "
                     f"{first['index']} at step {first['step']}: expected {first['expected']}"
                     f", got {first['actual']}): a gap in the contract")
    known = getattr(report, "known", {})
    known_note = ("known upstream bugs reproduced exactly as catalogued: " + ", ".join(
        f"{m.bug} (clause {n})" for n, matches in known.items() for m in matches)
        + (" (failing: --strict-known)" if getattr(report, "strict_known", False) else
           " (not a failure; --strict-known makes it one)")) if known else ""
    if found:
        suffix = "" if status == "finished" else f" (and the run {status})"
        also = f"; also {known_note}" if known_note else ""
        return Verdict(Outcome.VIOLATED, f"{'; '.join(found)}{suffix}{also}")
    if status != "finished":
        return Verdict(Outcome.NOT_FINISHED,
                       f"the run {status} after {meta.get('steps')} steps: {failure}; no "
                       "clause was violated in the frames it got, which proves nothing")
    reasons = report.vacuity()
    if reasons:
        return Verdict(Outcome.VACUOUS, "; ".join(reasons))
    if known:
        return Verdict(Outcome.PASS, "the requested loop ran to the end, every exercised "
                                     f"clause held but for {known_note}")
    return Verdict(Outcome.PASS, "the requested loop ran to the end, every exercised "
                                 "clause held")
