"""Clause 2, counters advanced (fields ``seq_lens``, ``kv_committed_len``,
``kv_allocated_len``; this project's extension adds ``decode_batch_idx``).

For every live request, each counter equals ``kv_computed``: zero lag behind the tokens
computed. The torch overlap loop's counters include its one in-flight step, and so does
``kv_computed``, so that lead is the reference. And when a request that finished (by
length or a stop) is released, the radix tree keeps what it committed: at the first
boundary where it holds no row, its ``cache_protected_len`` (what the tree's insert
protected) is its committed length (at most its prompt and output), in whole pages;
not checked when the run disables the radix cache; a request admitted after that
release reuses what the tree kept (``cached_tokens``) unless something may have left the
tree in between, and counts the hit once (at most one token short of its prompt,
unchanged after its first prefill). Each request is served as fed: its
prompt is the prompt fed, a finish by length emitted its ``max_new_tokens``, a finish on
a stop token ends at the first token it matched, and it emits only tokens the forward
produced for it, each once, none after it ended; a retraction is counted; and the
allocator has the radix tree evict at most what an allocation is short of. The
extension: ``decode_batch_idx``
equals ``kv_computed - kv_prefilled`` (every decode launch computes exactly one position
of each of its requests), and a request that ended was answered: its final output sent
to the client (``finished_output``) by the boundary that first shows it ended. The
radix cache rules are in :mod:`.radix`, what each request was served and emitted in
:mod:`.emitted`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import pandas as pd

from contract_lib.contract.base import (
    HOLDS,
    VIOLATED,
    ClauseResult,
    live_mask,
    live_requests,
    live_rows,
    no_rows,
    request_columns,
    result,
    violations,
)
from contract_lib.contract.emitted import (
    answered,
    emitted_as_produced,
    ended_where_sglang_ended_it,
    first_token_after_the_prompt,
    retractions_counted,
    served_as_fed,
    stopped_at_a_stop_token,
)
from contract_lib.contract.radix import (
    cache_hits_counted_once,
    committed_pages,
    evicted_beyond_need,
    released_requests,
    reused_what_the_tree_kept,
)
from contract_lib.contract.registry import clause, extend
from contract_lib.frames import Frames

_COUNTERS = {"seq_len": "seq_lens", "kv_committed_len": "kv_committed_len",
             "kv_allocated_len": "kv_allocated_len"}
_NO_ROWS = no_rows(field="str", step="int64", rid=object, expected=object, actual=object,
                   explanation="str")


def _no_live_request(frames: Frames) -> str | None:
    """Exercised by a live request's counters, or by a token emitted (what each request
    was served and emitted: a PD prefill side's requests end in the iteration of their
    first token, never live at a boundary)."""
    requests = frames.requests
    if live_mask(requests).any() or (requests["emitted"] > 0).any():
        return None
    return "no live request had a launched position, and no token was emitted"


def counters_equal_the_positions_computed(frames: Frames) -> list[pd.DataFrame]:
    """``seq_lens``, ``kv_committed_len`` and ``kv_allocated_len`` of every live request
    equal ``kv_computed`` (order 0-2: one per counter)."""
    columns, live = request_columns(frames), live_rows(frames)
    parts = []
    for order, (column, field) in enumerate(_COUNTERS.items()):
        counter = columns[column]
        wrong = live & pd.notna(counter) & (counter != columns["kv_computed"])
        if not wrong.any():
            continue
        bad = frames.requests[wrong]
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
    return parts


def the_tree_keeps_what_was_committed(frames: Frames) -> list[pd.DataFrame]:
    """At a finished request's release, the radix tree's insert protects what it
    committed (``cache_protected_len``, where the release records it), and a later
    request reuses what the tree kept (:func:`.radix.reused_what_the_tree_kept`)."""
    released = released_requests(frames)
    owned = committed_pages(frames, released)
    # What the tree kept, where the release records it (else the reuse rule alone).
    recorded = "cache_protected_len" not in frames.absent
    kept = released["cache_protected_len"].astype("int64") if recorded else owned
    lost = kept.to_numpy() < owned.to_numpy()
    parts = []
    if lost.any():
        bad = released[lost]
        parts.append(pd.DataFrame({
            "field": "cache_protected_len", "step": bad["step"].astype("int64"),
            "rid": bad["rid"], "expected": owned[bad.index].astype(object),
            "actual": kept[bad.index].astype(object),
            "explanation": "the radix tree kept " + kept[bad.index].astype(str) + " of the "
                           + owned[bad.index].astype(str) + " positions the request "
                           "committed when it was released: a later request with this "
                           "prefix prefills the rest again (silent cache loss)",
            "order": RADIX}))
    return parts + reused_what_the_tree_kept(
        frames, released, np.minimum(kept.to_numpy(), owned.to_numpy()), order=RADIX)


@dataclasses.dataclass(frozen=True)
class Rule:
    """One of clause 2's rules: its name (as docs/contract.md states it), its group, and
    its check (frames -> violation parts, each with an ``order`` that sorts the kinds
    found at one step)."""

    name: str
    group: str
    check: Callable[[Frames], list[pd.DataFrame]]


# Sort orders of the groups' violations within a step (counters take 0-2).
RADIX, SERVED, EMITTED, ALLOCATOR = 3, 4, 5, 6

RULES: tuple[Rule, ...] = (
    Rule("each counter equals the positions computed", "counters",
         counters_equal_the_positions_computed),
    Rule("the radix tree keeps what the request committed, and a later request reuses it",
         "radix cache", the_tree_keeps_what_was_committed),
    Rule("a cache hit is counted once, as computed", "radix cache",
         lambda frames: cache_hits_counted_once(frames, order=RADIX)),
    Rule("each request is served as fed", "served and emitted",
         lambda frames: served_as_fed(frames, order=SERVED)),
    Rule("it emits only tokens the forward produced for it, each once", "served and emitted",
         lambda frames: emitted_as_produced(frames, order=EMITTED)),
    Rule("nothing is emitted after it ended", "served and emitted",
         lambda frames: ended_where_sglang_ended_it(frames, order=EMITTED)),
    Rule("a stop token ends it, at the first one emitted", "served and emitted",
         lambda frames: stopped_at_a_stop_token(frames, order=EMITTED)),
    Rule("its first token follows the launch that computed its whole prompt",
         "served and emitted", lambda frames: first_token_after_the_prompt(frames, order=EMITTED)),
    Rule("the allocator evicts at most its shortfall", "allocator",
         lambda frames: evicted_beyond_need(frames, order=ALLOCATOR)),
    Rule("a retraction is counted", "allocator",
         lambda frames: retractions_counted(frames, order=ALLOCATOR)),
)


@clause(2, "counters advanced", fields=tuple(_COUNTERS.values()),
        audit_fields=("seq_lens", "seq_lens_cpu", "orig_seq_lens", "seq_lens_sum",
                      "kv_committed_len", "kv_allocated_len", "cache_protected_len"),
        readers=("release_kv_cache (owned_kv_len, bounded by kv_committed_len)",
                 "check_decode_mem", "retraction budget"),
        unexercised=_no_live_request)
def check_counters(frames: Frames) -> ClauseResult:
    """Clause 2: every rule of :data:`RULES`."""
    parts = [part for rule in RULES for part in rule.check(frames)]
    rows = pd.concat(parts).sort_values(["step", "order"], kind="stable").drop(
        columns="order") if parts else _NO_ROWS
    note = (f"{len(live_requests(frames))} (step, request) counter sets checked, "
            f"{len(released_requests(frames))} releases into the radix tree")
    return result(2, frames.loop, rows, note)


@extend(2, fields=("decode_batch_idx", "finished_output"))
def check_counters_extended(frames: Frames) -> ClauseResult:
    """Clause 2 with ``decode_batch_idx`` added to the RFC's three counters (read by SWA
    eviction, the SWA retain window and mamba tracking), and every ended request
    answered (``finished_output``, read by the tokenizer manager: the client's response)."""
    base = check_counters(frames)
    requests = frames.requests
    unanswered = answered(frames)
    found = base.violations
    if len(unanswered):
        found = pd.concat([found, violations(2, frames.loop, unanswered)],
                          ignore_index=True).sort_values("step", kind="stable").reset_index(
                              drop=True)
        base = ClauseResult(2, VIOLATED, base.note, found)
    if "decode_batch_idx" not in requests:
        return base
    columns = request_columns(frames)
    recorded = (live_rows(frames) & pd.notna(columns["decode_batch_idx"])
                & pd.notna(columns["kv_prefilled"]))
    if not recorded.any():
        return ClauseResult(2, base.status, base.note + "; decode_batch_idx not recorded "
                            "by this SGLang", base.violations)
    wrong = recorded & (columns["decode_batch_idx"]
                        != columns["kv_computed"] - columns["kv_prefilled"])
    if wrong.any():
        bad = requests[wrong]
        expected = (bad["kv_computed"] - bad["kv_prefilled"]).astype("int64")
        value = bad["decode_batch_idx"].astype("int64")
        lag = expected - value
        direction = pd.Series("lags", index=bad.index).where(lag > 0, "leads")
        rows = pd.DataFrame({
            "field": "decode_batch_idx", "step": bad["step"].astype("int64"),
            "rid": bad["rid"], "expected": expected.astype(object),
            "actual": value.astype(object),
            "explanation": "decode_batch_idx " + direction + " the "
                           + expected.astype(str) + " decode steps computed "
                           "since the request's prefill by " + lag.abs().astype(str)
                           + "; SWA eviction, the SWA retain window and mamba tracking "
                           "count decode steps by it"})
        extra = violations(2, frames.loop, rows)
        found = pd.concat([base.violations, extra], ignore_index=True).sort_values(
            "step", kind="stable").reset_index(drop=True)
    note = base.note + f"; decode_batch_idx on {int(recorded.sum())}"
    return ClauseResult(2, VIOLATED if len(found) else HOLDS, note, found)
