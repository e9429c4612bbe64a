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

import numpy as np
import pandas as pd

from contract_lib.contract.base import (
    ClauseResult,
    NotExercised,
    emitted_tokens,
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
    # The live entries and what the forwards wrote, joined on integer keys in numpy (the
    # pandas merges and merge_asof this replaces: ~4 ms of a run's 7.9): keys of (step,
    # request[, position]).
    alive, entries, forward = live_requests(frames), frames.slots, frames.forward_slots
    rid_codes, _ = pd.factorize(np.concatenate([
        table["rid"].to_numpy(dtype=object) for table in (entries, alive, forward)]),
        use_na_sentinel=False)
    entry_rid, alive_rid, forward_rid = np.split(rid_codes, np.cumsum([len(entries),
                                                                       len(alive)]))
    rids = int(rid_codes.max()) + 1 if len(rid_codes) else 1
    holder = _last_match(alive["step"].to_numpy() * rids + alive_rid,
                         entries["step"].to_numpy() * rids + entry_rid)
    kept = np.flatnonzero(holder >= 0)
    slots = entries.take(kept).reset_index(drop=True)
    holder = holder[kept]
    for column in ("kv_computed", "cache_protected_len"):
        slots[column] = alive[column].to_numpy()[holder]
    # The slot the forward of the launch before each boundary wrote the position's KV to.
    bound = 1 + max(int(entries["position"].max()) if len(entries) else 0,
                    int(forward["position"].max()) if len(forward) else 0)
    wrote = _last_match(
        ((forward["step"].to_numpy() + 1) * rids + forward_rid) * bound
        + forward["position"].to_numpy(),
        (slots["step"].to_numpy() * rids + entry_rid[kept]) * bound
        + slots["position"].to_numpy())
    slots["forward_slot"] = _taken(forward["slot"].to_numpy(dtype="float64"), wrote, np.nan)
    written_at, writer = _slot_positions(frames, slots)
    slots["slot_position"] = written_at
    slots["slot_writer"] = pd.Series(writer, index=slots.index, dtype=object)
    # The masks in numpy (in pandas, ten comparisons and assignments: ~1.5 ms a run).
    position, slot = slots["position"].to_numpy(), slots["slot"].to_numpy()
    computed = position < slots["kv_computed"].to_numpy(dtype="float64")
    private = position >= slots["cache_protected_len"].to_numpy(dtype="float64")
    shared = _shared_by_accident(slots, computed, private)
    state = np.where(computed, "recorded", "not computed").astype(object)
    # Inside the protected prefix the radix tree took the positions over: their entries
    # are the tree's slots, which may be another request's copy of the same KV (SGLang
    # frees the duplicate when it inserts a prefix the tree already holds).
    forward = slots["forward_slot"].to_numpy(dtype="float64")
    state[computed & ~np.isnan(forward) & private & (slot != forward)] = "misplaced"
    written_at = slots["slot_position"].to_numpy(dtype="float64")
    state[computed & ~np.isnan(written_at) & (written_at != position)] = "misplaced"
    slots["agreed"] = _common_prefixes(frames, slots)
    state[computed & (position >= slots["agreed"].to_numpy())] = "misplaced"
    if "written" in slots:  # None: unknown
        state[computed & (slots["written"].to_numpy() == False)] = "stale"  # noqa: E712
    state[shared] = "shared"
    state[computed & slots["slot_free"].to_numpy().astype(bool)] = "free"
    state[computed & (slot == 0)] = "slot 0"
    return slots.assign(state=pd.Series(state, index=slots.index, dtype="str"))


def _shared_by_accident(slots: pd.DataFrame, computed: np.ndarray, private: np.ndarray
                        ) -> np.ndarray:
    """Which computed entries hold a slot another live request holds at the same step
    (at another position, or past either's protected prefix: not radix sharing)."""
    shared = np.zeros(len(slots), dtype=bool)
    steps, slot = slots["step"].to_numpy(), slots["slot"].to_numpy()
    keys = steps[computed] * (int(slot.max()) + 1) + slot[computed] if len(slots) else steps
    _, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
    twice = np.flatnonzero(computed)[counts[inverse] > 1]
    if not len(twice):  # only a slot entered more than once at a step can be shared
        return shared
    # Per (step, slot) entered twice: how many requests and positions hold it, and
    # whether any holds it past its protected prefix.
    _, group = np.unique(keys[counts[inverse] > 1], return_inverse=True)
    groups = int(group.max()) + 1

    def distinct(values: np.ndarray) -> np.ndarray:
        codes, _ = pd.factorize(values)
        return np.bincount(np.unique(group * (int(codes.max()) + 1) + codes)
                           // (int(codes.max()) + 1), minlength=groups)

    held = ((distinct(slots["rid"].to_numpy(dtype=object)[twice]) > 1)
            & ((distinct(slots["position"].to_numpy()[twice]) > 1)
               | (np.bincount(group, weights=private[twice], minlength=groups) > 0)))
    shared[twice[held[group]]] = True
    return shared


def _common_prefixes(frames: Frames, slots: pd.DataFrame) -> pd.Series:
    """Per entry whose slot another request's forward last wrote (``slot_writer``): how
    many leading tokens the two requests' sequences (prompt fed, then tokens emitted)
    share; NaN elsewhere, or where the run did not record its prompts."""
    agreed = np.full(len(slots), np.nan)
    prompts = frames.meta.get("prompts")
    writers, rids = slots["slot_writer"].to_numpy(), slots["rid"].to_numpy()
    foreign = np.flatnonzero(pd.notna(writers) & (writers != rids))
    if not prompts or not len(foreign):
        return pd.Series(agreed, index=slots.index)
    emitted = emitted_tokens(frames)
    common: dict[tuple[str, str], int | None] = {}  # None: a prompt not recorded
    for index in foreign:
        pair = (rids[index], writers[index])
        if pair not in common:
            mine, theirs = prompts.get(pair[0]), prompts.get(pair[1])
            if mine is None or theirs is None:
                common[pair] = None
                continue
            mine = list(mine) + emitted.get(pair[0], [])
            theirs = list(theirs) + emitted.get(pair[1], [])
            length = min(len(mine), len(theirs))
            common[pair] = next((i for i in range(length) if mine[i] != theirs[i]), length)
        if common[pair] is not None:
            agreed[index] = common[pair]
    return pd.Series(agreed, index=slots.index)


def _slot_positions(frames: Frames, slots: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """Per entry of ``slots``: the position a forward last wrote its slot's KV at by that
    step boundary (float, NaN for none), and for which request (NaN for none). All NaN
    unless every launch that computed positions recorded its forward slots (the MLX
    loop's do not; a batch shape the capture could not read records none)."""
    unknown = (np.full(len(slots), np.nan), np.full(len(slots), np.nan, dtype=object))
    forward, launches = frames.forward_slots, frames.launches
    if forward.empty or not len(slots):
        return unknown
    computing = launches[launches["mode"].isin(["extend", "decode", "mixed"])
                         & ~launches["chained"].astype(bool)]
    if not set(computing["launch"]) <= set(forward["launch"]):
        return unknown
    # A write at step s is seen from the boundary s + 1 on; the last one wins (a
    # prebuilt batch's before its iteration's launches; a forward's in launch order).
    ordered = forward.take(np.argsort(forward["launch"].to_numpy(), kind="stable"))
    prebuilt = _prebuilt_writes(frames)

    def writes(column: str, dtype: str) -> np.ndarray:
        return np.concatenate([prebuilt[column].to_numpy(dtype=dtype),
                               ordered[column].to_numpy(dtype=dtype)])

    step = np.concatenate([prebuilt["step"].to_numpy(dtype="int64"),
                           ordered["step"].to_numpy(dtype="int64") + 1])
    slot, position = writes("slot", "int64"), writes("position", "float64")
    # Per entry, the last write to its slot at or before its step.
    steps = 1 + max(int(step.max()), int(slots["step"].max()))
    entry_slot, entry_step = slots["slot"].to_numpy(), slots["step"].to_numpy()
    last = _last_at_or_before(slot * steps + step, entry_slot * steps + entry_step)
    last[(last >= 0) & (slot[np.maximum(last, 0)] != entry_slot)] = -1
    return _taken(position, last, np.nan), _taken(writes("rid", object), last, np.nan)


def _last_at_or_before(keys: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """Per query, the index of the greatest of ``keys`` at most the query (of equal keys,
    the last); -1 where none is."""
    if not len(keys):
        return np.full(len(queries), -1)
    order = np.argsort(keys, kind="stable")
    at = np.searchsorted(keys[order], queries, side="right") - 1
    return np.where(at >= 0, order[np.maximum(at, 0)], -1)


def _last_match(keys: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """Per query, the index of the last of ``keys`` equal to it; -1 where none is."""
    found = _last_at_or_before(keys, queries)
    if len(keys):
        found[(found >= 0) & (keys[np.maximum(found, 0)] != queries)] = -1
    return found


def _taken(values: np.ndarray, at: np.ndarray, missing) -> np.ndarray:
    """``values[at]``, ``missing`` where ``at`` is -1."""
    if not len(values):
        return np.full(len(at), missing, dtype=values.dtype)
    return np.where(at >= 0, values[np.maximum(at, 0)], missing)


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
    state = states["state"].to_numpy()
    checked = int((state != "not computed").sum())
    if not checked:
        raise NotExercised("no live request had a launched position")
    note = f"{checked} (step, request, position) entries checked"
    violated = np.isin(state, BAD_SLOT_STATES)  # each a state of a computed position
    if not violated.any():
        return result(1, loop, _NO_ROWS, note)
    bad = states[violated]
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
