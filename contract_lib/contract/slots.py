"""Clause 1, slots recorded (field ``req_to_token``).

For every live request and every position ``p < kv_computed``, ``req_to_token[row, p]``
is a real slot recorded for this request: written into its row while it held the row
(the allocator handed the slot to it, or it is its own radix-matched prefix), not the
padding slot 0, not free in the allocator, and not held by another live request (a slot
both requests hold at the same position inside their radix-protected prefix,
``p < cache_protected_len``, is shared by design). An entry the request never wrote is
``stale``: left by the row's previous holder, it points at a slot the radix tree keeps
for another request. At the boundary after a torch launch, a position it computed past
the request's protected prefix records the slot its forward wrote that position's KV
to (``forward_slots``); another slot is ``misplaced``: the KV is elsewhere than the
scheduler says (inside the protected prefix the radix tree's slot stands, which may be
another request's copy of the same KV).
"""

from __future__ import annotations

import pandas as pd

from contract_lib.contract.base import (ClauseResult, NotExercised, ints, live, no_rows,
                                        result)
from contract_lib.contract.registry import clause
from contract_lib.frames import Frames

SLOT_STATES = ("recorded", "not computed", "slot 0", "free", "shared", "stale",
               "misplaced")
BAD_SLOT_STATES = ("slot 0", "free", "shared", "stale", "misplaced")
_NO_ROWS = no_rows(field="str", step="int64", rid=object, expected="str", actual="str",
                   explanation="str")


def slot_states(frames: Frames) -> pd.DataFrame:
    """Every ``slots`` entry of a live request, classified for clause 1.

    Adds ``kv_computed``, ``cache_protected_len`` and ``state``: ``recorded``, ``not
    computed`` (``position >= kv_computed``: allocated ahead, not checked), or one of the
    violations ``slot 0`` (the padding slot), ``free`` (free in the allocator), ``shared``
    (held by another live request other than by radix sharing: the same position inside
    both rows' protected prefix), ``stale`` (an entry this request never wrote: left by
    the row's previous holder, a slot the radix tree keeps for another request),
    ``misplaced`` (at the boundary after a torch launch, a position it computed, past the
    protected prefix, whose entry is not the slot the forward wrote its KV to; adds
    ``forward_slot``). The first
    of ``slot 0``, ``free``, ``shared``, ``stale``, ``misplaced`` that applies wins.
    """
    alive = live(frames.requests)[["step", "rid", "kv_computed", "cache_protected_len"]]
    slots = frames.slots.merge(alive, on=["step", "rid"], how="inner")
    forward = frames.forward_slots.assign(step=frames.forward_slots["step"] + 1).rename(
        columns={"slot": "forward_slot"})[["step", "rid", "position", "forward_slot"]]
    slots = slots.merge(forward.drop_duplicates(["step", "rid", "position"], keep="last"),
                        on=["step", "rid", "position"], how="left")
    computed = slots["position"] < slots["kv_computed"]
    inside = slots[computed]
    # Only a slot entered more than once at a step can be shared: group those alone.
    twice = inside[inside.duplicated(["step", "slot"], keep=False)]
    shared = twice.index  # (empty)
    if len(twice):
        by_slot = twice.assign(private=twice["position"] >= twice["cache_protected_len"]
                               ).groupby(["step", "slot"])
        held = ((by_slot["rid"].transform("nunique") > 1)
                & ((by_slot["position"].transform("nunique") > 1)
                   | by_slot["private"].transform("any")))
        shared = held[held].index
    state = pd.Series("not computed", index=slots.index)
    state[computed] = "recorded"
    # Inside the protected prefix the radix tree took the positions over: their entries
    # are the tree's slots, which may be another request's copy of the same KV (SGLang
    # frees the duplicate when it inserts a prefix the tree already holds).
    state[computed & slots["forward_slot"].notna()
          & (slots["position"] >= slots["cache_protected_len"])
          & (slots["slot"] != slots["forward_slot"])] = "misplaced"
    written = slots["written"] if "written" in slots else pd.Series(True, index=slots.index)
    state[computed & (written == False)] = "stale"  # noqa: E712 - None means unknown
    state[shared] = "shared"
    state[computed & slots["slot_free"].astype(bool)] = "free"
    state[computed & (slots["slot"] == 0)] = "slot 0"
    return slots.assign(state=state)


@clause(1, "slots recorded", fields=("req_to_token",),
        audit_fields=("req_to_token[]", "out_cache_loc", "free_pages"),
        readers=("MLX _sync_decode_kv_to_pool (pool slot ids)",
                 "radix insertion (keys the request's slots)"))
def check_slots(frames: Frames) -> ClauseResult:
    loop = frames.loop
    states = slot_states(frames)
    checked = states[states["state"] != "not computed"]
    if checked.empty:
        raise NotExercised("no live request had a launched position")
    bad = checked[checked["state"].isin(BAD_SLOT_STATES)]
    note = f"{len(checked)} (step, request, position) entries checked"
    if bad.empty:
        return result(1, loop, _NO_ROWS, note)
    padding, free, shared, stale, misplaced = (bad["state"] == kind
                                               for kind in BAD_SLOT_STATES)
    slot = "slot " + ints(bad["slot"])
    others = pd.Series("", index=bad.index)
    if shared.any():
        rids = bad[shared].groupby(["step", "slot"])["rid"].transform(
            lambda group: ", ".join(sorted(set(group))))
        others[shared] = [", ".join(r for r in all_.split(", ") if r != own)
                          for all_, own in zip(rids, bad.loc[shared, "rid"])]
    actual = slot.where(~free, slot + " (free)").where(~shared, slot + " (also held by "
                                                        + others + ")")
    actual = actual.where(~padding, "slot 0").where(
        ~stale, slot + " (never written for " + bad["rid"] + ")").where(
        ~misplaced, slot + " (its KV went to slot "
        + ints(bad["forward_slot"].where(misplaced, 0)) + ")")
    explanation = pd.Series(
        "another live request's slot: a pool sync would overwrite its KV", index=bad.index)
    explanation = explanation.where(
        ~stale, "an entry this request never wrote: left by the row's previous holder, a "
                "slot the radix tree keeps for another request; a pool sync would "
                "overwrite that request's cached KV")
    explanation = explanation.where(
        ~misplaced, "the forward wrote this position's KV to another slot than the one "
                    "recorded: a pool sync and the radix tree read the recorded slot")
    explanation = explanation.where(
        ~free, "a slot the allocator holds as free: a stale entry in a reused row")
    explanation = explanation.where(
        ~padding, "the padding slot: the scheduler never recorded this position, so a "
                  "pool sync would write its KV to slot 0")
    rows = pd.DataFrame({
        "field": "req_to_token", "step": bad["step"].astype("int64"), "rid": bad["rid"],
        "expected": "an allocated slot of " + bad["rid"] + " at position "
                    + ints(bad["position"]),
        "actual": actual, "explanation": explanation})
    return result(1, loop, rows, note)
