"""The five clauses of the per-step contract, checked on a run's frames.

A step that emits tokens must leave the following true when it ends (RFC #32833). Each
clause is checked at every step boundary (or launch) of the run; see
``docs/contract.md`` for the SGLang readers of every field and what goes wrong when it
is stale. Terms: a request is *live* at a step when it has a ``req_to_token`` row and has
not finished; ``kv_computed`` is the number of its positions whose KV a launched forward
has computed or queued (recorded at the model boundary).

1. **Slots recorded** (field ``req_to_token``). For every live request and every position
   ``p < kv_computed``, ``req_to_token[row, p]`` is a real slot: not the padding slot 0,
   not free in the allocator, and not held by another live request (a slot both requests
   hold at the same position inside their radix-protected prefix,
   ``p < cache_protected_len``, is shared by design). Reader: the MLX decode-KV pool sync ``_sync_decode_kv_to_pool`` reads these
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

Besides the clauses, the report carries SGLang's own KV pool conservation law
(``available + evictable + protected + uncached == total``, ``InvariantChecker``)
evaluated at every step boundary, including the drained end state.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pandas as pd

from contract_lib.frames import Frames

CLAUSES: dict[int, str] = {
    1: "slots recorded",
    2: "counters advanced",
    3: "step stamped",
    4: "relays published or provably unread",
    5: "in-flight predicates test any overlap loop",
}

HOLDS, VIOLATED, MASKED, NOT_EXERCISED = "holds", "violated", "violated-masked", "not-exercised"

VIOLATION_COLUMNS = ["clause", "name", "field", "loop", "step", "launch", "rid", "expected",
                     "actual", "explanation"]


class ContractViolation(AssertionError):
    """Raised by :func:`assert_contract`; the message starts ``clause N (name): field F``."""


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

    @property
    def ok(self) -> bool:
        """True when no clause is violated (``holds`` or ``not-exercised`` everywhere)."""
        return all(r.status in (HOLDS, NOT_EXERCISED) for r in self.clauses.values())

    @property
    def violations(self) -> pd.DataFrame:
        """Every violation of every clause, ordered by clause then step."""
        frames = [r.violations for r in self.clauses.values() if not r.violations.empty]
        if not frames:
            return pd.DataFrame(columns=VIOLATION_COLUMNS)
        return pd.concat(frames, ignore_index=True)

    def table(self) -> pd.DataFrame:
        """One row per clause: status, violation count and the first violation."""
        rows = []
        for number, result in self.clauses.items():
            first = result.first() or {}
            rows.append({
                "clause": number, "name": result.name, "status": result.status,
                "violations": len(result.violations), "first_step": first.get("step"),
                "first_field": first.get("field"), "first_rid": first.get("rid"),
                "note": result.note,
            })
        return pd.DataFrame(rows)

    def text(self) -> str:
        """A short text table and the first violation per clause, for terminals."""
        meta = self.meta
        patch = f", patch {meta['patch']}" if meta.get("patch") else ""
        lines = [f"{meta['workload']} on {meta['loop']}{patch} (sglang "
                 f"{meta['sglang_version']}): run {meta['status']}, {meta['steps']} steps"]
        if meta.get("error"):
            error = meta["error"]
            lines.append(f"  run {meta['status']}: {error['type']}: {error['message']}")
        lines.append("")
        lines.append(f"  {'clause':<48} {'status':<16} violations")
        for number, result in self.clauses.items():
            label = f"{number} {result.name}"
            lines.append(f"  {label:<48} {result.status:<16} {len(result.violations)}")
        leaks = len(self.pool)
        lines.append(f"  {'- KV pool conservation (SGLang InvariantChecker)':<48} "
                     f"{'leak' if leaks else 'balanced':<16} {leaks}")
        for number, result in self.clauses.items():
            first = result.first()
            if first is not None:
                lines.append("")
                lines.append(violation_message(first))
            elif result.status == NOT_EXERCISED:
                lines.append("")
                lines.append(f"clause {number} ({result.name}): not exercised: {result.note}")
        if leaks:
            first = self.pool.iloc[0]
            lines.append("")
            lines.append(f"KV pool: first leak at step {first['step']}: {first['explanation']}")
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


def _violations(clause: int, loop: str, rows: list[dict[str, Any]]) -> pd.DataFrame:
    table = pd.DataFrame(
        [{"clause": clause, "name": CLAUSES[clause], "loop": loop, "launch": None,
          "rid": None, **row} for row in rows], columns=VIOLATION_COLUMNS)
    return table.sort_values(["step", "launch"], kind="stable",
                             na_position="first").reset_index(drop=True)


def _live(requests: pd.DataFrame) -> pd.DataFrame:
    mask = (~requests["finished"].astype(bool) & requests["req_pool_idx"].notna()
            & requests["kv_computed"].notna())
    return requests[mask]


# -- clause 1 ------------------------------------------------------------------------------


def check_slots(frames: Frames) -> ClauseResult:
    loop = frames.loop
    live = _live(frames.requests)[["step", "rid", "kv_computed", "cache_protected_len"]]
    slots = frames.slots.merge(live, on=["step", "rid"], how="inner")
    slots = slots[slots["position"] < slots["kv_computed"]]
    if slots.empty:
        return ClauseResult(1, NOT_EXERCISED, "no live request had a launched position",
                            _violations(1, loop, []))
    # Radix sharing puts one slot at the same position of several rows, inside each
    # row's protected prefix. Any other slot held by two live requests is a violation.
    by_slot = slots.assign(private=slots["position"] >= slots["cache_protected_len"]
                           ).groupby(["step", "slot"])
    holders = by_slot["rid"].transform("nunique")
    positions = by_slot["position"].transform("nunique")
    any_private = by_slot["private"].transform("any")
    shared = (holders > 1) & ((positions > 1) | any_private) & (slots["slot"] != 0)
    padding = slots["slot"] == 0
    free = slots["slot_free"].astype(bool) & ~padding
    bad = slots[padding | free | shared]
    rows = []
    for r in bad.itertuples(index=False):
        if r.slot == 0:
            actual, why = "slot 0", ("the padding slot: the scheduler never recorded this "
                                     "position, so a pool sync would write its KV to slot 0")
        elif r.slot_free:
            actual, why = f"slot {r.slot} (free)", (
                "a slot the allocator holds as free: a stale entry in a reused row")
        else:
            others = sorted(set(slots[(slots["step"] == r.step) & (slots["slot"] == r.slot)]
                                ["rid"]) - {r.rid})
            actual, why = f"slot {r.slot} (also held by {', '.join(others)})", (
                "another live request's slot: a pool sync would overwrite its KV")
        rows.append({"field": "req_to_token", "step": int(r.step), "rid": r.rid,
                     "expected": f"an allocated slot of {r.rid} at position {r.position}",
                     "actual": actual, "explanation": why})
    checked = f"{len(slots)} (step, request, position) entries checked"
    return ClauseResult(1, VIOLATED if rows else HOLDS, checked, _violations(1, loop, rows))


# -- clause 2 ------------------------------------------------------------------------------

_COUNTERS = {"seq_len": "seq_lens", "kv_committed_len": "kv_committed_len",
             "kv_allocated_len": "kv_allocated_len"}


def check_counters(frames: Frames) -> ClauseResult:
    loop = frames.loop
    live = _live(frames.requests)
    if live.empty:
        return ClauseResult(2, NOT_EXERCISED, "no live request had a launched position",
                            _violations(2, loop, []))
    rows = []
    for column, field in _COUNTERS.items():
        bad = live[live[column].notna() & (live[column] != live["kv_computed"])]
        for r in bad.itertuples(index=False):
            computed, value = int(r.kv_computed), int(getattr(r, column))
            direction = "lags" if value < computed else "leads"
            rows.append({
                "field": field, "step": int(r.step), "rid": r.rid, "expected": computed,
                "actual": value,
                "explanation": f"{field} {direction} the {computed} positions the forward "
                               f"computed by {abs(computed - value)}; radix insertion and "
                               "release stop at the committed bound"})
    order = {field: i for i, field in enumerate(_COUNTERS.values())}
    violations = _violations(2, loop, rows)
    violations = violations.sort_values(
        ["step", "field"], key=lambda s: s.map(order) if s.name == "field" else s,
        kind="stable").reset_index(drop=True)
    note = f"{len(live)} (step, request) counter sets checked"
    return ClauseResult(2, VIOLATED if rows else HOLDS, note, violations)


# -- clause 3 ------------------------------------------------------------------------------


def check_stamps(frames: Frames) -> ClauseResult:
    loop = frames.loop
    launches = frames.launches.sort_values("launch")
    if launches.empty:
        return ClauseResult(3, NOT_EXERCISED, "no forward was launched",
                            _violations(3, loop, []))
    rows = []
    previous_ct = int(frames.steps["forward_ct"].iloc[0])
    previous_ts = None
    for r in launches.itertuples(index=False):
        base = {"step": int(r.step), "launch": int(r.launch)}
        if r.forward_ct != previous_ct + 1:
            rows.append({**base, "field": "forward_ct", "expected": previous_ct + 1,
                         "actual": int(r.forward_ct),
                         "explanation": "a launch must advance forward_ct by one; the "
                                        "watchdog and the profiler count launches by it"})
        previous_ct = int(r.forward_ct)
        processed = r.processed_step is not None and not pd.isna(r.processed_step)
        if not processed:
            continue
        base["step"] = int(r.processed_step)
        if pd.isna(r.processed_forward_iter) or r.processed_forward_iter != r.forward_ct:
            rows.append({**base, "field": "forward_iter", "expected": int(r.forward_ct),
                         "actual": _plain(r.processed_forward_iter),
                         "explanation": "process_batch_result received a batch whose "
                                        "forward_iter is not its launch's forward_ct"})
        ts = r.processed_launch_ts
        if ts is None or pd.isna(ts):
            rows.append({**base, "field": "launch_ts", "expected": "a monotonic timestamp",
                         "actual": None,
                         "explanation": "process_batch_result received a batch with no "
                                        "launch_ts; _record_step_counters subtracts it"})
        else:
            if previous_ts is not None and ts < previous_ts:
                rows.append({**base, "field": "launch_ts",
                             "expected": f">= {previous_ts:.6f}", "actual": f"{ts:.6f}",
                             "explanation": "launch_ts went backwards between launches"})
            previous_ts = ts
    note = f"{len(launches)} launches checked"
    return ClauseResult(3, VIOLATED if rows else HOLDS, note, _violations(3, loop, rows))


def _plain(value):
    return None if value is None or pd.isna(value) else int(value)


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
    rows = []
    for r in bad.itertuples(index=False):
        poisoned = r.value == -1
        if r.kind == "mixed":
            fate = ("reached batch.input_ids of a mixed batch (torch.cat with the prefill "
                    "ids; on MPS this is the #32591 segfault)")
            if loop == "mlx":
                fate += "; the MLX decode lane then takes its token from the runner, so "\
                        "the model discarded the value"
        else:
            fate = "became the decode input id of the forward"
        rows.append({
            "field": "output_tokens_buf", "step": int(r.step), "launch": int(r.launch),
            "rid": r.rid, "expected": "the token last published for this request",
            "actual": f"{int(r.value)} ({'never written' if poisoned else 'stale'})",
            "explanation": f"row {int(r.row)} read unpublished; the value {fate}"})
    note = f"{len(reads)} relay reads checked"
    return ClauseResult(4, VIOLATED if rows else HOLDS, note, _violations(4, loop, rows))


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
    rows = []
    for r in bad.itertuples(index=False):
        masked = not r.is_fully_idle
        rows.append({
            "field": "result_queue", "step": int(r.step),
            "expected": "not idle (in-flight term)",
            "actual": f"idle with {int(r.result_queue_len)} job(s) queued",
            "explanation": ("the in-flight term ignores this loop's result_queue; the real "
                            "predicate said busy only because the running/last batch terms "
                            "did" if masked else
                            "the predicate reported idle while work was in flight")})
    if not rows:
        status = HOLDS
    elif all(not r.is_fully_idle for r in bad.itertuples(index=False)):
        status = MASKED
    else:
        status = VIOLATED
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


def check(frames: Frames) -> Report:
    """Check all five clauses on one run's frames (whatever its status)."""
    return Report(meta=dict(frames.meta),
                  clauses={number: fn(frames) for number, fn in CHECKS.items()},
                  pool=check_pool(frames))


def assert_contract(frames: Frames) -> Report:
    """Raise :class:`ContractViolation` for the lowest violated clause, else return the
    report. For pytest: the message starts ``clause N (name): field F``."""
    report = check(frames)
    for result in report.clauses.values():
        first = result.first()
        if first is not None:
            raise ContractViolation(violation_message(first))
    return report
