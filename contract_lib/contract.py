"""The five clauses of the per-step contract, checked on a run's frames.

A step that emits tokens must leave the following true when it ends (RFC #32833). Each
clause is checked at every step boundary (or launch) of the run; see
``docs/contract.md`` for the SGLang readers of every field and what goes wrong when it
is stale. Terms: a request is *live* at a step when it has a ``req_to_token`` row and has
not finished; ``kv_computed`` is the number of its positions whose KV a launched forward
has computed or queued (recorded at the model boundary).

1. **Slots recorded** (field ``req_to_token``). For every live request and every position
   ``p < kv_computed``, ``req_to_token[row, p]`` is a real slot recorded for this request:
   written into its row while it held the row (the allocator handed the slot to it, or it
   is its own radix-matched prefix), not the padding slot 0, not free in the allocator,
   and not held by another live request (a slot both requests hold at the same position
   inside their radix-protected prefix, ``p < cache_protected_len``, is shared by
   design). An entry the request never wrote is ``stale``: left by the row's previous
   holder, it points at a slot the radix tree keeps for another request. Reader: the MLX decode-KV pool sync ``_sync_decode_kv_to_pool`` reads these
   entries as pool slot ids; radix insertion keys the request's slots by them.
2. **Counters advanced** (fields ``seq_lens``, ``kv_committed_len``, ``kv_allocated_len``).
   For every live request, each counter equals ``kv_computed``: zero lag behind the
   tokens computed. The torch overlap loop's counters include its one in-flight step,
   and so does ``kv_computed``, so that lead is the reference. Reader:
   ``release_kv_cache`` checkpoints the radix tree up to ``owned_kv_len()``, bounded by
   ``kv_committed_len``; ``check_decode_mem`` and retraction budget on them.
3. **Step stamped** (fields ``forward_ct``, ``forward_iter``, ``launch_ts``). Every launch
   advances ``forward_ct`` by exactly one; the batch ``process_batch_result`` receives
   for it carries ``forward_iter == forward_ct`` of that launch and a set ``launch_ts``,
   non-decreasing over launches. Readers: the watchdog (``forward_ct``), the profiler
   step predicate, ``_record_step_counters`` (``forward_iter``, ``launch_ts``).
4. **Relays published or provably unread** (field ``output_tokens_buf``). Every read of
   ``future_map.output_tokens_buf`` by ``resolve_forward_inputs`` sees the value the
   loop last published to that row for that request's latest token. A loop that never
   reads the relay satisfies the clause (provably unread). Reader:
   ``resolve_forward_inputs`` (decode gather; the decode lanes of a mixed batch).
5. **In-flight predicates test any overlap loop** (field ``result_queue``). Whenever an
   overlap loop holds in-flight work (``result_queue`` not empty), ``is_fully_idle``
   evaluated with every other term masked to idle (running batch empty, last batch,
   chunked request and waiting queue none) says "not idle". If the masked probe says
   idle while the real predicate said busy, the answer was right only by accident:
   ``violated-masked``. Readers: ``release_memory_occupation`` (asserts it),
   ``flush_cache``, the health check, HiCache attach/detach, PD role switch.

This project's extensions (clause 2's ``decode_batch_idx``, 6 scheduling clocks advanced,
7 request state retired) live in :mod:`contract_lib.extensions`; :func:`check` runs the
set ``clauses="all"`` (default) or ``"rfc"`` (the five as the RFC states them).

Besides the clauses, the report carries SGLang's own KV pool conservation law
(``available + evictable + protected + uncached == total``, ``InvariantChecker``)
evaluated at every step boundary, including the drained end state.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pandas as pd

from contract_lib.extensions import (EXTENDED_FIELDS, EXTENSION_CLAUSES, clause_checks,
                                     origin, sglang_finding)
from contract_lib.frames import Frames, run_title
from contract_lib.verdict import Outcome, Verdict, verdict

CLAUSES: dict[int, str] = {
    1: "slots recorded",
    2: "counters advanced",
    3: "step stamped",
    4: "relays published or provably unread",
    5: "in-flight predicates test any overlap loop",
    **EXTENSION_CLAUSES,
}

HOLDS, VIOLATED, MASKED, NOT_EXERCISED = "holds", "violated", "violated-masked", "not-exercised"

VIOLATION_COLUMNS = ["clause", "name", "field", "loop", "step", "launch", "rid", "expected",
                     "actual", "explanation"]


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


@dataclasses.dataclass
class ClauseResult:
    clause: int
    status: str
    note: str
    violations: pd.DataFrame

    @property
    def name(self) -> str:
        return CLAUSES[self.clause]

    def first(self) -> dict[str, Any] | None:
        if self.violations.empty:
            return None
        return self.violations.iloc[0].to_dict()


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

    @property
    def ok(self) -> bool:
        """True only for a pass: the requested loop ran to the end, no clause violated,
        at least one exercised, no unexpected aborted request (see :meth:`verdict`)."""
        return self.verdict().outcome == Outcome.PASS

    def verdict(self, kv_damaged: bool = False) -> Verdict:
        """The run's outcome and exit code (:mod:`contract_lib.verdict`)."""
        return verdict(self, kv_damaged)

    def vacuity(self) -> list[str]:
        """Why a finished run proves nothing, unless its workload declares it expected:
        requests SGLang aborted, or no clause exercised."""
        expect = self.meta.get("expect") or {}
        reasons = [f"SGLang aborted request {r.rid}: {r.message}"
                   for r in self.aborted.itertuples(index=False) if not r.expected]
        if (all(r.status == NOT_EXERCISED for r in self.clauses.values())
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
        lines.append(f"  {'- KV pool conservation (SGLang InvariantChecker)':<48} "
                     f"{'leak' if leaks else 'balanced':<16} {leaks}")
        for number, result in self.clauses.items():
            first = result.first()
            if first is not None:
                lines.append("")
                lines.append(violation_message(first))
                finding = sglang_finding(number, result)
                if finding:
                    lines.append(f"  (an SGLang-wide finding, not this loop's own: bug "
                                 f"{finding} in data/bugs.toml)")
            elif result.status == NOT_EXERCISED:
                lines.append("")
                lines.append(f"clause {number} ({result.name}): not exercised: {result.note}")
        if leaks:
            first = self.pool.iloc[0]
            lines.append("")
            lines.append(f"KV pool: first leak at step {first['step']}: {first['explanation']}")
        for r in self.aborted.itertuples(index=False):
            lines.append("")
            lines.append(f"request {r.rid} aborted by SGLang"
                         f"{' (declared expected)' if r.expected else ''}: {r.message}")
        outcome = self.verdict()
        if outcome.outcome not in (Outcome.PASS, Outcome.VIOLATED) or not self.aborted.empty:
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


def _violations(clause: int, loop: str, rows: pd.DataFrame | list[dict[str, Any]]
                ) -> pd.DataFrame:
    """A clause's violation records in schema order, sorted by step (then launch)."""
    table = pd.DataFrame(rows) if isinstance(rows, list) else rows
    table = table.assign(clause=clause, name=CLAUSES[clause], loop=loop)
    table = table.reindex(columns=VIOLATION_COLUMNS).astype({"launch": object, "rid": object})
    table = table.where(table.notna(), None)
    return table.sort_values(["step", "launch"], kind="stable",
                             na_position="first").reset_index(drop=True)


def live_mask(requests: pd.DataFrame) -> pd.Series:
    """Live request rows: holding a ``req_to_token`` row, not finished, launched."""
    return (~requests["finished"].astype(bool) & requests["req_pool_idx"].notna()
            & requests["kv_computed"].notna())


def _live(requests: pd.DataFrame) -> pd.DataFrame:
    return requests[live_mask(requests)]


def _ints(series: pd.Series) -> pd.Series:
    return series.astype("int64").astype(str)


# -- clause 1 ------------------------------------------------------------------------------


SLOT_STATES = ("recorded", "not computed", "slot 0", "free", "shared", "stale")
BAD_SLOT_STATES = ("slot 0", "free", "shared", "stale")


def slot_states(frames: Frames) -> pd.DataFrame:
    """Every ``slots`` entry of a live request, classified for clause 1.

    Adds ``kv_computed``, ``cache_protected_len`` and ``state``: ``recorded``, ``not
    computed`` (``position >= kv_computed``: allocated ahead, not checked), or one of the
    violations ``slot 0`` (the padding slot), ``free`` (free in the allocator), ``shared``
    (held by another live request other than by radix sharing: the same position inside
    both rows' protected prefix), ``stale`` (an entry this request never wrote: left by
    the row's previous holder, a slot the radix tree keeps for another request). The
    first of ``slot 0``, ``free``, ``shared``, ``stale`` that applies wins. Frames
    without the ``written`` column (older recordings) never show ``stale``.
    """
    live = _live(frames.requests)[["step", "rid", "kv_computed", "cache_protected_len"]]
    slots = frames.slots.merge(live, on=["step", "rid"], how="inner")
    computed = slots["position"] < slots["kv_computed"]
    inside = slots[computed]
    by_slot = inside.assign(private=inside["position"] >= inside["cache_protected_len"]
                            ).groupby(["step", "slot"])
    shared = ((by_slot["rid"].transform("nunique") > 1)
              & ((by_slot["position"].transform("nunique") > 1)
                 | by_slot["private"].transform("any")))
    state = pd.Series("not computed", index=slots.index)
    state[computed] = "recorded"
    written = slots["written"] if "written" in slots else pd.Series(True, index=slots.index)
    state[computed & (written == False)] = "stale"  # noqa: E712 - None means unknown
    state[shared[shared].index] = "shared"
    state[computed & slots["slot_free"].astype(bool)] = "free"
    state[computed & (slots["slot"] == 0)] = "slot 0"
    return slots.assign(state=state)


def check_slots(frames: Frames) -> ClauseResult:
    loop = frames.loop
    states = slot_states(frames)
    checked = states[states["state"] != "not computed"]
    if checked.empty:
        return ClauseResult(1, NOT_EXERCISED, "no live request had a launched position",
                            _violations(1, loop, []))
    bad = checked[checked["state"].isin(BAD_SLOT_STATES)]
    padding, free, shared, stale = (bad["state"] == kind for kind in BAD_SLOT_STATES)
    slot = "slot " + _ints(bad["slot"])
    others = pd.Series("", index=bad.index)
    if shared.any():
        rids = bad[shared].groupby(["step", "slot"])["rid"].transform(
            lambda group: ", ".join(sorted(set(group))))
        others[shared] = [", ".join(r for r in all_.split(", ") if r != own)
                          for all_, own in zip(rids, bad.loc[shared, "rid"])]
    actual = slot.where(~free, slot + " (free)").where(~shared, slot + " (also held by "
                                                        + others + ")")
    actual = actual.where(~padding, "slot 0").where(
        ~stale, slot + " (never written for " + bad["rid"] + ")")
    explanation = pd.Series(
        "another live request's slot: a pool sync would overwrite its KV", index=bad.index)
    explanation = explanation.where(
        ~stale, "an entry this request never wrote: left by the row's previous holder, a "
                "slot the radix tree keeps for another request; a pool sync would "
                "overwrite that request's cached KV")
    explanation = explanation.where(
        ~free, "a slot the allocator holds as free: a stale entry in a reused row")
    explanation = explanation.where(
        ~padding, "the padding slot: the scheduler never recorded this position, so a "
                  "pool sync would write its KV to slot 0")
    rows = pd.DataFrame({
        "field": "req_to_token", "step": bad["step"].astype("int64"), "rid": bad["rid"],
        "expected": "an allocated slot of " + bad["rid"] + " at position "
                    + _ints(bad["position"]),
        "actual": actual, "explanation": explanation})
    note = f"{len(checked)} (step, request, position) entries checked"
    return ClauseResult(1, VIOLATED if len(rows) else HOLDS, note,
                        _violations(1, loop, rows))


# -- clause 2 ------------------------------------------------------------------------------

_COUNTERS = {"seq_len": "seq_lens", "kv_committed_len": "kv_committed_len",
             "kv_allocated_len": "kv_allocated_len"}


def check_counters(frames: Frames) -> ClauseResult:
    loop = frames.loop
    live = _live(frames.requests)
    if live.empty:
        return ClauseResult(2, NOT_EXERCISED, "no live request had a launched position",
                            _violations(2, loop, []))
    parts = []
    for order, (column, field) in enumerate(_COUNTERS.items()):
        bad = live[live[column].notna() & (live[column] != live["kv_computed"])]
        computed, value = bad["kv_computed"].astype("int64"), bad[column].astype("int64")
        direction = pd.Series("lags", index=bad.index).where(value < computed, "leads")
        parts.append(pd.DataFrame({
            "field": field, "step": bad["step"].astype("int64"), "rid": bad["rid"],
            "expected": computed.astype(object), "actual": value.astype(object),
            "explanation": f"{field} " + direction + " the " + computed.astype(str)
                           + " positions the forward computed by "
                           + (computed - value).abs().astype(str)
                           + "; radix insertion and release stop at the committed bound",
            "order": order}))
    rows = pd.concat(parts).sort_values(["step", "order"], kind="stable").drop(
        columns="order")
    note = f"{len(live)} (step, request) counter sets checked"
    return ClauseResult(2, VIOLATED if len(rows) else HOLDS, note, _violations(2, loop, rows))


# -- clause 3 ------------------------------------------------------------------------------


def check_stamps(frames: Frames) -> ClauseResult:
    loop = frames.loop
    launches = frames.launches.sort_values("launch")
    if launches.empty:
        return ClauseResult(3, NOT_EXERCISED, "no forward was launched",
                            _violations(3, loop, []))
    ct = launches["forward_ct"].astype("int64")
    expected_ct = ct.shift(1, fill_value=int(frames.steps["forward_ct"].iloc[0])) + 1
    bad_ct = launches[ct != expected_ct]
    parts = [pd.DataFrame({
        "field": "forward_ct", "step": bad_ct["step"], "launch": bad_ct["launch"],
        "expected": expected_ct[bad_ct.index].astype(object),
        "actual": ct[bad_ct.index].astype(object),
        "explanation": "a launch must advance forward_ct by one; the watchdog and the "
                       "profiler count launches by it"})]
    processed = launches[launches["processed_step"].notna()]
    iters = processed["processed_forward_iter"]
    bad_iter = processed[iters.isna() | (iters != processed["forward_ct"])]
    parts.append(pd.DataFrame({
        "field": "forward_iter", "step": bad_iter["processed_step"],
        "launch": bad_iter["launch"], "expected": bad_iter["forward_ct"].astype(object),
        "actual": bad_iter["processed_forward_iter"].astype(object),
        "explanation": "process_batch_result received a batch whose forward_iter is not "
                       "its launch's forward_ct"}))
    ts = pd.to_numeric(processed["processed_launch_ts"], errors="coerce")
    missing = processed[ts.isna()]
    parts.append(pd.DataFrame({
        "field": "launch_ts", "step": missing["processed_step"], "launch": missing["launch"],
        "expected": "a monotonic timestamp", "actual": None,
        "explanation": "process_batch_result received a batch with no launch_ts; "
                       "_record_step_counters subtracts it"}))
    previous = ts.ffill().shift(1)
    backwards = processed[ts < previous]
    parts.append(pd.DataFrame({
        "field": "launch_ts", "step": backwards["processed_step"],
        "launch": backwards["launch"],
        "expected": [f">= {value:.6f}" for value in previous[backwards.index]],
        "actual": [f"{value:.6f}" for value in ts[backwards.index]],
        "explanation": "launch_ts went backwards between launches"}))
    rows = pd.concat([p for p in parts if len(p)] or [pd.DataFrame(columns=["step"])])
    rows["step"] = rows["step"].astype("int64")
    note = f"{len(launches)} launches checked"
    return ClauseResult(3, VIOLATED if len(rows) else HOLDS, note, _violations(3, loop, rows))


# -- clause 4 ------------------------------------------------------------------------------


def check_relay(frames: Frames) -> ClauseResult:
    loop = frames.loop
    reads = frames.relay[frames.relay["event"] == "read"]
    decode_launches = frames.launches["mode"].isin(["decode", "mixed"]).sum()
    if reads.empty:
        if decode_launches == 0:
            return ClauseResult(4, NOT_EXERCISED, "no decode or mixed batch was launched",
                                _violations(4, loop, []))
        return ClauseResult(4, HOLDS, f"relay never read over {decode_launches} decode/mixed "
                            "launches (provably unread)", _violations(4, loop, []))
    bad = reads[~reads["published_for_rid"].astype(bool)]
    fate = pd.Series("became the decode input id of the forward", index=bad.index)
    mixed_fate = ("reached batch.input_ids of a mixed batch (torch.cat with the prefill ids; "
                  "on MPS this is the #32591 segfault)")
    if loop == "mlx":
        mixed_fate += ("; the MLX decode lane then takes its token from the runner, so the "
                       "model discarded the value")
    fate = fate.where(bad["kind"] != "mixed", mixed_fate)
    written = pd.Series("stale", index=bad.index).where(bad["value"] != -1, "never written")
    rows = pd.DataFrame({
        "field": "output_tokens_buf", "step": bad["step"].astype("int64"),
        "launch": bad["launch"], "rid": bad["rid"],
        "expected": "the token last published for this request",
        "actual": _ints(bad["value"]) + " (" + written + ")",
        "explanation": "row " + _ints(bad["row"]) + " read unpublished; the value " + fate})
    note = f"{len(reads)} relay reads checked"
    return ClauseResult(4, VIOLATED if len(rows) else HOLDS, note, _violations(4, loop, rows))


# -- clause 5 ------------------------------------------------------------------------------


def check_idle_predicate(frames: Frames) -> ClauseResult:
    loop = frames.loop
    steps = frames.steps
    overlap = steps["enable_overlap"].astype(bool) | steps["enable_overlap_mlx"].astype(bool)
    if not overlap.any():
        return ClauseResult(5, NOT_EXERCISED, "not an overlap loop: no in-flight work",
                            _violations(5, loop, []))
    in_flight = steps[overlap & (steps["result_queue_len"] > 0)]
    if in_flight.empty:
        return ClauseResult(5, NOT_EXERCISED, "no step held in-flight work",
                            _violations(5, loop, []))
    bad = in_flight[in_flight["idle_probe"].astype(bool)]
    masked = ~bad["is_fully_idle"].astype(bool)
    # The loop's in-flight work: SGLang's overlap loops queue it in ``result_queue``;
    # sglang-omni's lookahead holds one launched step in ``async_pending``.
    queue = "async_pending" if loop == "omni" else "result_queue"
    rows = pd.DataFrame({
        "field": queue, "step": bad["step"].astype("int64"),
        "expected": "not idle (in-flight term)",
        "actual": "idle with " + _ints(bad["result_queue_len"]) + " job(s) queued",
        "explanation": pd.Series(
            "the predicate reported idle while work was in flight", index=bad.index).where(
            ~masked, f"the in-flight term ignores this loop's {queue}; the real "
                     "predicate said busy only because the running/last batch terms did")})
    status = HOLDS if bad.empty else MASKED if masked.all() else VIOLATED
    note = f"{len(in_flight)} steps with in-flight work checked"
    return ClauseResult(5, status, note, _violations(5, loop, rows))


# -- pool conservation ---------------------------------------------------------------------


def check_pool(frames: Frames) -> pd.DataFrame:
    """Steps at which SGLang's own pool conservation law did not balance."""
    steps = frames.steps
    leaks = steps[steps["pool_leak"].astype(bool)]
    rows = []
    for r in leaks.itertuples(index=False):
        rows.append({"step": int(r.step), "loop": r.loop, "explanation": (
            f"available {r.kv_available} + evictable {r.kv_evictable} + protected "
            f"{r.kv_protected} + uncached {r.kv_uncached} != total {r.kv_total}")})
    return pd.DataFrame(rows, columns=["step", "loop", "explanation"])


CHECKS = {1: check_slots, 2: check_counters, 3: check_stamps, 4: check_relay,
          5: check_idle_predicate}


# -- aborted requests ----------------------------------------------------------------------

ABORTED_COLUMNS = ["rid", "message", "expected"]


def aborted_requests(frames: Frames) -> pd.DataFrame:
    """Requests whose last recorded ``finish_reason`` is SGLang's ``abort``, with its
    message and whether the workload declares the abort expected (``[expect] aborted``).
    Frames recorded without the ``finish_reason`` column have none."""
    requests = frames.requests
    if "finish_reason" not in requests or requests.empty:
        return pd.DataFrame(columns=ABORTED_COLUMNS)
    last = requests.sort_values("step", kind="stable").groupby("rid", sort=False).tail(1)
    aborted = last[last["finish_reason"] == "abort"]
    expected = set((frames.meta.get("expect") or {}).get("aborted", ()))
    return pd.DataFrame({"rid": aborted["rid"].tolist(),
                         "message": aborted["finish_message"].tolist(),
                         "expected": [rid in expected for rid in aborted["rid"]]},
                        columns=ABORTED_COLUMNS)



def check(frames: Frames, clauses: str = "all") -> Report:
    """Check a clause set on one run's frames (whatever its status): ``"all"`` (the
    RFC's five and this project's extensions) or ``"rfc"`` (the RFC's five only); the
    report's :meth:`Report.verdict` says whether the run earned a pass."""
    checks = clause_checks(clauses)
    return Report(meta=dict(frames.meta),
                  clauses={number: checks[number](frames) for number in sorted(checks)},
                  pool=check_pool(frames), aborted=aborted_requests(frames),
                  clause_set=clauses)


def assert_contract(frames: Frames, clauses: str = "all") -> Report:
    """Return the report of a run that passes, else raise.

    :class:`ContractViolation` for the lowest violated clause (the message starts
    ``clause N (name): field F``, for pytest), even from a run that did not finish;
    otherwise :class:`RunDidNotFinish` (crashed, died, timeout, set-up failure, another
    loop) or :class:`VacuousRun` (no clause exercised, an unexpected aborted request)."""
    report = check(frames, clauses)
    for result in report.clauses.values():
        first = result.first()
        if first is not None:
            raise ContractViolation(violation_message(first))
    outcome = report.verdict()
    if outcome.outcome == Outcome.VACUOUS:
        raise VacuousRun(outcome, report.meta)
    if outcome.outcome != Outcome.PASS:
        raise RunDidNotFinish(outcome, report.meta)
    return report
