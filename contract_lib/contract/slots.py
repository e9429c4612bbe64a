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
another request's copy of the same KV). And wherever every launch recorded its forward
slots (the torch loops and omni), a slot's KV must be of the position it is recorded at:
an entry whose slot a forward last wrote at another position is ``misplaced`` too, and
so is one whose slot another request's forward wrote at the same position when the two
requests' token sequences differ at or before it (a radix-shared slot was written at
the same position of the same prefix; the sequences are the prompts fed, meta
``prompts``, and the tokens emitted). A PD decode side's prebuilt batch writes KV
without a forward (the transfer, or a retracted request's restore): its slots hold the
positions its row records for them (``prebuilt``).
"""

from __future__ import annotations

import pandas as pd

from contract_lib.contract.base import (
    ClauseResult,
    NotExercised,
    ints,
    live_requests,
    no_rows,
    result,
)
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
    ``forward_slot``; or, when every launch recorded its forward slots, an entry whose
    slot a forward last wrote at another position, or at this position for another
    request whose tokens differ from this one's at or before it; adds ``slot_position``,
    ``slot_writer`` and ``agreed``, the length of the two requests' common token
    prefix). The first of ``slot 0``, ``free``, ``shared``, ``stale``, ``misplaced``
    that applies wins.
    """
    alive = live_requests(frames)[["step", "rid", "kv_computed", "cache_protected_len"]]
    slots = frames.slots.merge(alive, on=["step", "rid"], how="inner")
    if frames.forward_slots.empty and len(slots):  # the column a merge would add (NaN)
        slots = slots.assign(forward_slot=float("nan"))
    else:
        forward = frames.forward_slots.assign(step=frames.forward_slots["step"] + 1).rename(
            columns={"slot": "forward_slot"})[["step", "rid", "position", "forward_slot"]]
        slots = slots.merge(forward.drop_duplicates(["step", "rid", "position"],
                                                    keep="last"),
                            on=["step", "rid", "position"], how="left")
    positions = _slot_positions(frames)
    if positions.empty:  # the columns a merge with no row would add (~1.3 ms less)
        slots = slots.assign(slot_position=float("nan"),
                             slot_writer=pd.Series(float("nan"), index=slots.index,
                                                   dtype=object))
    else:
        slots = slots.merge(positions, on=["step", "slot"], how="left")
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
    state[computed & slots["slot_position"].notna()
          & (slots["slot_position"] != slots["position"])] = "misplaced"
    slots["agreed"] = _common_prefixes(frames, slots)
    state[computed & (slots["position"] >= slots["agreed"])] = "misplaced"
    written = slots["written"] if "written" in slots else pd.Series(True, index=slots.index)
    state[computed & (written == False)] = "stale"  # noqa: E712 - None means unknown
    state[shared] = "shared"
    state[computed & slots["slot_free"].astype(bool)] = "free"
    state[computed & (slots["slot"] == 0)] = "slot 0"
    return slots.assign(state=state)


def _common_prefixes(frames: Frames, slots: pd.DataFrame) -> pd.Series:
    """Per entry whose slot another request's forward last wrote (``slot_writer``): how
    many leading tokens the two requests' sequences (prompt fed, then tokens emitted)
    share; NaN elsewhere, or where the run did not record its prompts."""
    agreed = pd.Series(float("nan"), index=slots.index)
    prompts = frames.meta.get("prompts")
    foreign = slots["slot_writer"].notna() & (slots["slot_writer"] != slots["rid"])
    if not prompts or not foreign.any():
        return agreed
    emitted = frames.outputs.sort_values(["rid", "index"]).groupby("rid")["token"].agg(list)
    tokens = {rid: list(prompt) + emitted.get(rid, []) for rid, prompt in prompts.items()}
    pairs = slots.loc[foreign, ["rid", "slot_writer"]].drop_duplicates()
    common = {}
    for rid, writer in pairs.itertuples(index=False):
        mine, theirs = tokens.get(rid), tokens.get(writer)
        if mine is None or theirs is None:
            continue
        length = min(len(mine), len(theirs))
        common[(rid, writer)] = next(
            (i for i in range(length) if mine[i] != theirs[i]), length)
    keys = pd.Series(list(zip(slots.loc[foreign, "rid"], slots.loc[foreign, "slot_writer"])),
                     index=slots.index[foreign])
    agreed[foreign] = keys.map(common).astype("float64")
    return agreed


def _slot_positions(frames: Frames) -> pd.DataFrame:
    """``(step, slot, slot_position, slot_writer)``: at each step boundary, the position
    a forward last wrote each slot's KV at, and for which request, for every slot the
    run's ``slots`` entries name. Empty unless every launch that computed positions
    recorded its forward slots (the MLX loop's do not; a batch shape the capture could
    not read records none)."""
    columns = {"step": "int64", "slot": "int64", "slot_position": "float64",
               "slot_writer": object}
    forward, launches = frames.forward_slots, frames.launches
    computing = launches[launches["mode"].isin(["extend", "decode", "mixed"])
                         & ~launches["chained"].astype(bool)]
    if forward.empty or not set(computing["launch"]) <= set(forward["launch"]):
        return pd.DataFrame({name: pd.Series(dtype=kind) for name, kind in columns.items()})
    # A write at step s is seen from the boundary s + 1 on; the last one wins (a
    # prebuilt batch's before its iteration's launches).
    writes = pd.concat([_prebuilt_writes(frames), forward.sort_values("launch").assign(
        step=forward["step"] + 1)[["step", "slot", "position", "rid"]]]).drop_duplicates(
        ["step", "slot"], keep="last").astype(
        {"step": "int64", "slot": "int64", "position": "int64"})
    entries = frames.slots[["step", "slot"]].astype("int64").drop_duplicates().sort_values(
        "step")
    found = pd.merge_asof(entries, writes.sort_values("step"), on="step", by="slot",
                          direction="backward")
    return found.rename(columns={"position": "slot_position", "rid": "slot_writer"}).astype(
        {"slot_position": "float64"})


def _prebuilt_writes(frames: Frames) -> pd.DataFrame:
    """``(step, slot, position, rid)``: the KV a PD decode side's prebuilt batch put in
    place without a forward (transferred from the prefill side, or restored after a
    retraction, ``restore_kv_cache``), in the slots of positions ``< kv_computed`` its
    row records at the next boundary ``step`` (``prepare_for_prebuilt`` reads the
    batch's ``out_cache_loc`` off that row, ``decode_schedule_batch_mixin.py:44-52``)."""
    prebuilt = frames.tables.get("prebuilt")
    if prebuilt is None or prebuilt.empty:
        return pd.DataFrame(columns=["step", "slot", "position", "rid"])
    after = prebuilt.assign(step=prebuilt["step"] + 1)[["step", "rid", "kv_computed"]]
    entries = frames.slots.merge(after, on=["step", "rid"], how="inner")
    return entries[entries["position"] < entries["kv_computed"]][["step", "slot",
                                                                  "position", "rid"]]


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
    elsewhere = misplaced & bad["forward_slot"].notna() & (bad["slot"] != bad["forward_slot"])
    foreign = misplaced & ~elsewhere & (bad["slot_position"] == bad["position"])
    moved = misplaced & ~elsewhere & ~foreign
    # Each kind's text is built for its own rows only (a run can have ~10^5 of them).
    slot = "slot " + ints(bad["slot"])
    actual, explanation = slot.copy(), pd.Series(
        "another live request's slot: a pool sync would overwrite its KV", index=bad.index)
    if shared.any():
        rids = bad[shared].groupby(["step", "slot"])["rid"].transform(
            lambda group: ", ".join(sorted(set(group))))
        others = [", ".join(r for r in all_.split(", ") if r != own)
                  for all_, own in zip(rids, bad.loc[shared, "rid"])]
        actual[shared] = slot[shared] + " (also held by " + pd.Series(
            others, index=rids.index) + ")"
    for mask, text, why in (
            (free, lambda: slot[free] + " (free)",
             "a slot the allocator holds as free: a stale entry in a reused row"),
            (stale, lambda: slot[stale] + " (never written for " + bad["rid"][stale] + ")",
             "an entry this request never wrote: left by the row's previous holder, a slot "
             "the radix tree keeps for another request; a pool sync would overwrite that "
             "request's cached KV"),
            (moved, lambda: slot[moved] + " (holds the KV of position "
             + ints(bad["slot_position"][moved]) + ")",
             "the slot recorded holds another position's KV: attention and the radix tree "
             "read it as this position's"),
            (foreign, lambda: slot[foreign] + " (holds " + bad["slot_writer"][foreign]
             + "'s KV of this position; their tokens differ from position "
             + ints(bad["agreed"][foreign]) + ")",
             "the slot holds the KV another request computed for another token sequence: "
             "attention reads it as this request's context (a radix match longer than "
             "the prefixes really shared)"),
            (elsewhere, lambda: slot[elsewhere] + " (its KV went to slot "
             + ints(bad["forward_slot"][elsewhere]) + ")",
             "the forward wrote this position's KV to another slot than the one recorded: a "
             "pool sync and the radix tree read the recorded slot"),
            (padding, lambda: "slot 0",
             "the padding slot: the scheduler never recorded this position, so a pool sync "
             "would write its KV to slot 0")):
        if mask.any():
            actual[mask], explanation[mask] = text(), why
    rows = pd.DataFrame({
        "field": "req_to_token", "step": bad["step"].astype("int64"), "rid": bad["rid"],
        "expected": "an allocated slot of " + bad["rid"] + " at position "
                    + ints(bad["position"]),
        "actual": actual, "explanation": explanation})
    return result(1, loop, rows, note)
