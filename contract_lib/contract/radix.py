"""Clause 2's radix cache rules: what the tree kept of a released request, what later
requests reused of it (``cached_tokens``, counted once and as computed), and what the
allocator had the tree evict. Helpers :func:`released_requests`, :func:`committed_pages` and
:func:`run_arg` are shared with :mod:`.counters`."""

from __future__ import annotations

import collections

import numpy as np
import pandas as pd

from contract_lib.contract.base import (
    derived,
    emitted_tokens,
    first_of_each,
    handoffs,
    in_step_order,
    ordered_by,
    request_columns,
    retractions,
)
from contract_lib.frames import Frames


def evicted_beyond_need(frames: Frames, order: int) -> list[pd.DataFrame]:
    """The KV allocator evicts from the radix tree only what an allocation is short of:
    each ``evict_to_free_tokens`` call asks the tree for at most its shortfall
    (``need - available``, in whole pages, at least one page), and one that was short
    of nothing evicts nothing. Evicting more throws away cached prefixes a later
    request would have reused (silent cache loss)."""
    evictions = frames.tables.get("evictions")
    if evictions is None or evictions.empty:
        return []
    page = int(run_arg(frames, "page_size") or 1)
    short = (evictions["need"] - evictions["available"]).clip(lower=0)
    bound = ((short + page - 1) // page * page).clip(lower=page).where(short > 0, 0)
    asked = pd.to_numeric(evictions["asked"], errors="coerce")
    evicted = evictions["evictable_before"] - evictions["evictable_after"]
    bad = evictions[(asked > bound) | ((short == 0) & (evicted > 0))]
    if bad.empty:
        return []
    return [pd.DataFrame({
        "field": "evict_for_alloc", "step": bad["step"].astype("int64"), "rid": None,
        "expected": [f"<= {int(b)}" for b in bound[bad.index]],
        "actual": [int(a) if a == a else int(e) for a, e in
                   zip(asked[bad.index], evicted[bad.index])],
        "explanation": [f"an allocation of {int(n)} tokens with {int(f)} free ({int(g)} "
                        f"short) had the radix tree evict beyond that ({int(e)} of its "
                        f"{int(c)} cached tokens evicted): cached prefixes thrown away for "
                        "nothing (silent cache loss)" for n, f, g, e, c in
                        zip(bad["need"], bad["available"], short[bad.index],
                            evicted[bad.index], bad["evictable_before"])],
        "order": order})]


def _disturbed_iterations(frames: Frames) -> list[int]:
    """The loop iterations (numbered as the boundary before them) in which the radix
    tree may have lost cached tokens: an allocation had it evict, a request was
    retracted (a release path that evicts), or the tree held fewer tokens
    (``kv_evictable + kv_protected``) at the next boundary. Sorted."""
    steps = ordered_by(frames.steps, "step")
    size = (steps["kv_evictable"] + steps["kv_protected"]).to_numpy()
    numbers = steps["step"].to_numpy()
    disturbed = set(numbers[:-1][size[1:] < size[:-1]].tolist())
    evictions = frames.tables.get("evictions")
    if evictions is not None and len(evictions):
        gone = evictions["evictable_after"] < evictions["evictable_before"]
        disturbed.update(evictions.loc[gone, "step"].astype("int64").tolist())
    by_request_rows, _, gave_back = retractions(frames)
    steps_given_back = request_columns(frames)["step"][by_request_rows[gave_back]]
    disturbed.update((steps_given_back - 1).tolist())
    return sorted(disturbed)


def reused_what_the_tree_kept(frames: Frames, released: pd.DataFrame, kept: np.ndarray,
                               order: int) -> list[pd.DataFrame]:
    """A request admitted after a finished request was released reuses what the radix
    tree kept of it: at least the longest prefix its prompt shares with that request's
    prompt and output as kept (``cache_protected_len``), at most one token short of
    its own prompt, in whole pages (SGLang's match bound), whenever nothing could have
    left the tree in between (:func:`_disturbed_iterations`). Read off SGLang's
    ``cached_tokens`` (the most any step shows). A tree that kept the right number of
    positions under the wrong keys, or lost them, fails here (silent cache loss)."""
    prompts = frames.meta.get("prompts") or {}
    if released.empty or not prompts or "cached_tokens" not in frames.requests:
        return []
    page = int(run_arg(frames, "page_size") or 1)
    outputs = emitted_tokens(frames)
    disturbed = _disturbed_iterations(frames)
    admitted, reused, prompt_len = _per_request(frames)
    # What the tree kept of each released request, in release order: (step, rid, tokens).
    kept_tokens = sorted(
        (int(step), rid, (list(prompts[rid]) + outputs.get(rid, []))[:int(length)])
        for step, rid, length in zip(released["step"], released["rid"], kept)
        if rid in prompts and length >= page)
    # The hash of each kept page-aligned prefix -> (its latest release step, its rid).
    prefixes: dict[int, tuple[int, str]] = {}
    tokens_of: dict[str, list[int]] = {}
    rows, next_release, cut = [], 0, 0
    for rid, at in admitted:
        while next_release < len(kept_tokens) and kept_tokens[next_release][0] <= at:
            step, other, tokens = kept_tokens[next_release]
            tokens_of[other], digest = tokens, 0
            for length, token in enumerate(tokens, 1):
                digest = hash((digest, token))
                if length % page == 0:
                    prefixes[digest] = (step, other)
            next_release += 1
        prompt = prompts.get(rid)
        if (prompt is None or reused.get(rid) is None
                or prompt_len.get(rid) != len(prompt)):
            continue
        while cut < len(disturbed) and disturbed[cut] <= at:
            cut += 1
        earliest = disturbed[cut - 1] + 2 if cut else -1  # a release after the last loss
        bound, digest, best = (len(prompt) - 1) // page * page, 0, None
        for length, token in enumerate(prompt[:bound], 1):
            digest = hash((digest, token))
            found = prefixes.get(digest) if length % page == 0 else None
            if (found is not None and found[0] >= earliest
                    and tokens_of[found[1]][:length] == prompt[:length]):
                best = (length, found)
        if best is not None and reused[rid] < best[0]:
            (length, (step, other)) = best
            rows.append({"field": "cached_tokens", "step": int(at) + 1, "rid": rid,
                         "expected": length, "actual": int(reused[rid]),
                         "explanation": f"reused {int(reused[rid])} cached tokens where the "
                         f"radix tree held a {length}-token prefix of its prompt from "
                         f"{other!r} (released at step {step}, nothing evicted since): the "
                         "tree lost or mis-keyed what that request committed (silent "
                         "cache loss)", "order": order})
    return [pd.DataFrame(rows)] if rows else []


def _per_request(frames: Frames) -> tuple[list[tuple[str, int]], dict[str, float],
                                          dict[str, float]]:
    """Per request: the boundary before its first step holding a ``req_to_token`` row
    (when it was admitted; ordered by it, then by request), the most ``cached_tokens``
    any step shows (absent where none does) and its first ``prompt_len`` shown. One
    pass over the requests table."""
    columns = request_columns(frames)
    admitted: dict[str, int] = {}
    reused: dict[str, float] = {}
    prompt_len: dict[str, float] = {}
    for rid, step, row, cached, length in zip(
            columns["rid"].tolist(), columns["step"].tolist(),
            columns["req_pool_idx"].tolist(), columns["cached_tokens"].tolist(),
            columns["prompt_len"].tolist()):
        if row == row and row is not None and step - 1 < admitted.get(rid, step):
            admitted[rid] = step - 1
        if cached == cached and cached is not None and cached > reused.get(rid, -1):
            reused[rid] = cached
        if rid not in prompt_len and length == length and length is not None:
            prompt_len[rid] = length
    return sorted(sorted(admitted.items()), key=lambda item: item[1]), reused, prompt_len


def cache_hits_counted_once(frames: Frames, order: int) -> list[pd.DataFrame]:
    """SGLang counts a request's cache hit (``cached_tokens``) once, at its first prefill:
    at most one token short of its prompt (its match bound), and unchanged from the
    first step that shows the prefill on (a later chunk reuses the request's own
    earlier chunks, a re-prefill after a retraction what it had computed: neither is a
    cache hit). First step each. On a PD decode side a request prefilled elsewhere
    reports the prefill side's hit (``_commit_transfer_to_req``,
    ``disaggregation/decode.py:2709``): its first local launch is a decode, whose first
    position is no cache hit, so only the first two rules judge it."""
    if "cached_tokens" not in frames.requests:
        return []
    columns, by_step = request_columns(frames), in_step_order(frames)
    rids, steps = columns["rid"], columns["step"]
    cached = columns["cached_tokens"].astype("float64")
    bound = np.maximum(columns["prompt_len"] - 1, 0)
    first = first_of_each(rids, by_step[pd.notna(columns["kv_computed"][by_step])])
    prefilled = columns["kv_prefilled"][first] if "kv_prefilled" in columns else None
    computed_from = _first_computed_position(frames, rids[first], steps[first], prefilled)
    for rid in handoffs(frames):  # prefilled elsewhere: a decode launch computes first
        computed_from.pop(rid, None)
    # Per row: its request's hit at the first prefill, the step of that prefill, and the
    # prefix that prefill did not compute (NaN where unknown).
    at_first, since, skipped = (
        np.array([by_rid.get(rid, np.nan) for rid in rids.tolist()], dtype="float64")
        for by_rid in (dict(zip(rids[first].tolist(), cached[first].tolist())),
                       dict(zip(rids[first].tolist(), steps[first].tolist())),
                       computed_from))
    counted = ~np.isnan(cached)
    over = counted & (cached > bound)
    changed = counted & ~np.isnan(at_first) & (steps > since) & (cached != at_first)
    # The hit is the prefix the first prefill did not compute (where its slots are known).
    miscounted = counted & ~np.isnan(skipped) & (steps == since) & (cached != skipped)
    flagged = np.flatnonzero(over | changed | miscounted)
    if not len(flagged):
        return []
    rows = []
    for index in first_of_each(rids, flagged[np.argsort(steps[flagged], kind="stable")]):
        value, prefix = int(cached[index]), skipped[index]
        if over[index]:
            expected, why = (f"<= {int(bound[index])}", f"{value} cached tokens for a "
                             f"{int(columns['prompt_len'][index])}-token prompt: a cache "
                             "hit is at most one token short of the prompt")
        elif miscounted[index]:
            expected, why = int(prefix), (
                f"the first prefill computed from position {int(prefix)} on (its first "
                f"{int(prefix)} tokens reused) and counted {value} cached tokens")
        else:
            expected, why = int(at_first[index]), (
                f"the cache hit counted at the first prefill ({int(at_first[index])}) "
                f"grew to {value}: a later chunk or a re-prefill after a retraction was "
                "counted as a cache hit")
        rows.append({"field": "cached_tokens", "step": int(steps[index]),
                     "rid": rids[index], "expected": expected, "actual": value,
                     "explanation": why + " (users' cached_tokens, the hit rate)",
                     "order": order})
    return [pd.DataFrame(rows)]


def _first_computed_position(frames: Frames, rids: np.ndarray, steps: np.ndarray,
                             prefilled: np.ndarray | None) -> dict[str, int]:
    """Per request whose first prefill is known: the first position it computed (the
    prefix it reused), read off the forward's slots where the launch recorded them
    (torch loops, omni), else off a launch that prefilled that request alone (MLX):
    what it prefilled (``prefilled_tokens``) back from where the prefill ended
    (``kv_prefilled``). ``rids``, ``steps``, ``prefilled``: each request's first row
    showing a launch, its step and ``kv_prefilled`` (None: not recorded)."""
    found = _alone_first_prefill(frames, rids, steps, prefilled)
    slots = frames.tables.get("forward_slots")
    if slots is None or slots.empty:
        return found
    # Each request's earliest launch in the forward's slots, and its least position there.
    earliest: dict[str, tuple[int, int]] = {}
    for rid, launch, position in zip(slots["rid"].tolist(), slots["launch"].tolist(),
                                     slots["position"].tolist()):
        earliest[rid] = min(earliest.get(rid, (launch, position)), (launch, position))
    step_of: dict[int, int] = {}
    for launch, step in zip(frames.launches["launch"].tolist(),
                            frames.launches["step"].tolist()):
        step_of.setdefault(launch, step)
    # That launch is the request's first only if no boundary before it showed one.
    first_shown = dict(zip(rids.tolist(), steps.tolist()))
    found.update((rid, int(position)) for rid, (launch, position) in earliest.items()
                 if launch in step_of and first_shown.get(rid) == step_of[launch] + 1)
    return found


def _alone_first_prefill(frames: Frames, rids: np.ndarray, steps: np.ndarray,
                         prefilled: np.ndarray | None) -> dict[str, int]:
    """:func:`_first_computed_position` from launches that prefilled one request alone:
    the only launch of the step before the request's first launched row, whose lanes
    are that request (not chained, not mixed with decode lanes)."""
    launches = frames.launches
    if prefilled is None or "prefilled_tokens" not in launches:
        return {}  # frames recorded before these columns
    per_step = collections.Counter(launches["step"].tolist())
    alone = {step: (lanes, tokens) for step, mode, chained, lanes, tokens in zip(
        launches["step"].tolist(), launches["mode"].tolist(),
        launches["chained"].to_numpy().astype(bool).tolist(), launches["rids"].tolist(),
        launches["prefilled_tokens"].tolist())
        if mode in ("extend", "prefill") and not chained and per_step[step] == 1}
    found = {}
    for rid, step, length in zip(rids.tolist(), steps.tolist(), prefilled.tolist()):
        lanes, tokens = alone.get(step - 1, (None, None))
        if lanes == rid and length == length:
            found[rid] = int(length) - int(tokens)
    return found


def run_arg(frames: Frames, name: str):
    """A server arg as the scheduler ran with it (meta ``resolved_args``: SGLang may
    override what was given), else as given (frames recorded before it was kept)."""
    resolved = frames.meta.get("resolved_args") or {}
    return resolved[name] if name in resolved else frames.meta.get("server_args", {}).get(name)


@derived
def released_requests(frames: Frames) -> pd.DataFrame:
    """Each request that finished by length or a stop, at the first boundary where it
    holds no ``req_to_token`` row (released); none when the radix cache is disabled."""
    requests = frames.requests
    if run_arg(frames, "disable_radix_cache"):
        return requests.iloc[0:0]
    columns, order = request_columns(frames), in_step_order(frames)
    reason = columns["finish_reason"]
    done = (columns["finished"].astype(bool) & pd.isna(columns["req_pool_idx"])
            & ((reason == "length") | (reason == "stop"))
            & pd.notna(columns["kv_committed_len"]) & pd.notna(columns["cache_protected_len"]))
    return requests.iloc[first_of_each(columns["rid"], order[done[order]])]


def committed_pages(frames: Frames, released: pd.DataFrame) -> pd.Series:
    """What each released request committed, at most its prompt and output (a stop that
    landed before the last committed position), in whole pages."""
    page = int(run_arg(frames, "page_size") or 1)
    committed = np.minimum(released["kv_committed_len"].to_numpy(dtype="int64"),
                           (released["prompt_len"] + released["emitted"]).to_numpy(
                               dtype="int64"))
    return pd.Series(committed // page * page, index=released.index)
