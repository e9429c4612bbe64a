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
of each of its requests). The radix cache rules are in :mod:`.radix`.
"""

from __future__ import annotations

import pandas as pd

from contract_lib.contract.base import (HOLDS, VIOLATED, ClauseResult, first_step_showing, ints,
                                        live, live_mask, no_rows, result, retractions,
                                        violations)
from contract_lib.contract.radix import (_cache_hits_counted_once, _committed_pages,
                                         _evicted_beyond_need, _released,
                                         _reused_what_the_tree_kept, _run_arg)
from contract_lib.contract.registry import clause, extend
from contract_lib.frames import Frames

_COUNTERS = {"seq_len": "seq_lens", "kv_committed_len": "kv_committed_len",
             "kv_allocated_len": "kv_allocated_len"}
_NO_ROWS = no_rows(field="str", step="int64", rid=object, expected=object, actual=object,
                   explanation="str")


def _no_live_request(frames: Frames) -> str | None:
    return None if live_mask(frames.requests).any() else "no live request had a launched position"


@clause(2, "counters advanced", fields=tuple(_COUNTERS.values()),
        audit_fields=("seq_lens", "seq_lens_cpu", "orig_seq_lens", "seq_lens_sum",
                      "kv_committed_len", "kv_allocated_len", "cache_protected_len"),
        readers=("release_kv_cache (owned_kv_len, bounded by kv_committed_len)",
                 "check_decode_mem", "retraction budget"),
        unexercised=_no_live_request)
def check_counters(frames: Frames) -> ClauseResult:
    loop = frames.loop
    alive = live(frames.requests)
    parts = []
    for order, (column, field) in enumerate(_COUNTERS.items()):
        bad = alive[alive[column].notna() & (alive[column] != alive["kv_computed"])]
        if bad.empty:
            continue
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
    released = _released(frames)
    owned = _committed_pages(frames, released)
    # What the tree kept, where the release records it (else the reuse rule alone).
    recorded = "cache_protected_len" not in frames.absent
    kept = released["cache_protected_len"].astype("int64") if recorded else owned
    bad = released[kept < owned]
    if len(bad):
        parts.append(pd.DataFrame({
            "field": "cache_protected_len", "step": bad["step"].astype("int64"),
            "rid": bad["rid"], "expected": owned[bad.index].astype(object),
            "actual": kept[bad.index].astype(object),
            "explanation": "the radix tree kept " + kept[bad.index].astype(str) + " of the "
                           + owned[bad.index].astype(str) + " positions the request "
                           "committed when it was released: a later request with this "
                           "prefix prefills the rest again (silent cache loss)",
            "order": len(_COUNTERS)}))
    parts += _reused_what_the_tree_kept(frames, released, kept.clip(upper=owned),
                                        order=len(_COUNTERS))
    parts += _cache_hits_counted_once(frames, order=len(_COUNTERS))
    parts += _served(frames, order=len(_COUNTERS) + 1)
    parts += _emitted_as_produced(frames, order=len(_COUNTERS) + 2)
    parts += _ended_where_sglang_ended_it(frames, order=len(_COUNTERS) + 2)
    parts += _stopped_at_a_stop_token(frames, order=len(_COUNTERS) + 2)
    parts += _first_token_after_the_prompt(frames, order=len(_COUNTERS) + 2)
    parts += _evicted_beyond_need(frames, order=len(_COUNTERS) + 3)
    parts += _retractions_counted(frames, order=len(_COUNTERS) + 3)
    rows = pd.concat(parts).sort_values(["step", "order"], kind="stable").drop(
        columns="order") if parts else _NO_ROWS
    note = (f"{len(alive)} (step, request) counter sets checked, {len(released)} "
            "releases into the radix tree")
    return result(2, loop, rows, note)


def _served(frames: Frames, order: int) -> list[pd.DataFrame]:
    """Each request as it was fed: its prompt (``origin_input_ids``) the prompt fed (meta
    ``prompts``; not for a request SGLang aborted, whose prompt it replaces; at most it
    with ``allow_auto_truncate``), and at its finish by length, as many tokens emitted
    (``output_ids``) as its ``max_new_tokens`` (SGLang's own, after its caps). First
    step each, per request."""
    requests, parts = frames.requests, []
    prompts = frames.meta.get("prompts") or {}
    fed = requests["rid"].map({rid: len(prompt) for rid, prompt in prompts.items()})
    aborted = set(requests.loc[requests["finish_reason"] == "abort", "rid"])
    # ``allow_auto_truncate``: SGLang may cut a prompt too long for the context.
    truncates = bool(_run_arg(frames, "allow_auto_truncate"))
    differs = (requests["prompt_len"] > fed) if truncates else (requests["prompt_len"] != fed)
    bad = requests[fed.notna() & differs
                   & ~requests["rid"].isin(aborted)].drop_duplicates("rid")
    if len(bad):
        parts.append(pd.DataFrame({
            "field": "origin_input_ids", "step": bad["step"].astype("int64"),
            "rid": bad["rid"], "expected": fed[bad.index].astype("int64").astype(object),
            "actual": bad["prompt_len"].astype("int64").astype(object),
            "explanation": "the prompt the scheduler holds is not the prompt fed ("
                           + fed[bad.index].astype("int64").astype(str) + " tokens): the "
                           "request is computed from another prompt", "order": order}))
    if "max_new_tokens" in requests:
        done = requests[(requests["finish_reason"] == "length")
                        & requests["max_new_tokens"].notna()].drop_duplicates("rid")
        # A prefill emits its token even when SGLang capped the budget to 0.
        budget = done["max_new_tokens"].astype("int64").clip(lower=1)
        bad = done[done["emitted"] != budget]
        if len(bad):
            parts.append(pd.DataFrame({
                "field": "output_ids", "step": bad["step"].astype("int64"),
                "rid": bad["rid"],
                "expected": budget[bad.index].astype(object),
                "actual": bad["emitted"].astype("int64").astype(object),
                "explanation": "finished by length after " + bad["emitted"].astype(
                    "int64").astype(str) + " tokens, not its max_new_tokens: the request "
                    "ended short (or long) of its budget", "order": order}))
    return parts


def _lanes(rids: str, known: set[str], count: int) -> list[str] | None:
    """A launch's ``rids`` (comma-joined) as its ``count`` request ids, where a request
    id may itself hold commas (free text): fragments are joined until they make a known
    id. None when they do not make ``count`` known ids."""
    lanes, pending = [], None
    for fragment in rids.split(","):
        pending = fragment if pending is None else f"{pending},{fragment}"
        if pending in known:
            lanes.append(pending)
            pending = None
    return lanes if pending is None and len(lanes) == count else None


def _produced(launches: pd.DataFrame, known: set[str]
              ) -> tuple[dict[str, list[int]], set[str]]:
    """What the forward produced for each request, in launch order (each launch's
    ``tokens``, aligned with its ``rids``; a launch with none, an MLX launch never
    finalized, delivered none), and the requests with a lane whose token is unknown
    (or in a launch whose ids do not read as ``known`` ones: all the known ids its
    ``rids`` contains)."""
    produced: dict[str, list[int]] = {}
    unknown: set[str] = set()
    by_first: dict[str, list[str]] = {}  # known ids by their first fragment
    for rid in known:
        by_first.setdefault(rid.split(",")[0], []).append(rid)
    ordered = launches.sort_values("launch")
    for rids, tokens in zip(ordered["rids"], ordered["tokens"]):
        if not isinstance(tokens, str):
            continue
        values = tokens.split(",")
        lanes = _lanes(rids, known, len(values))
        if lanes is None:
            unknown.update(rid for fragment in rids.split(",")
                           for rid in by_first.get(fragment, ()))
            continue
        for rid, value in zip(lanes, values):
            if value:
                produced.setdefault(rid, []).append(int(value))
            else:
                unknown.add(rid)
    return produced, unknown


def _emitted_as_produced(frames: Frames, order: int) -> list[pd.DataFrame]:
    """Each request's tokens (``output_ids``) are tokens the forward produced for it, in
    order, each emitted once: a subsequence of its lanes' tokens over its launches (a
    lane's token may go unemitted: a chunk's, an overlap loop's step past the finish).
    A result applied twice, or to another request, emits a token nothing produced
    there. First such token per request; not judged for a request with a lane whose
    token was not recorded."""
    if "tokens" not in frames.launches or frames.outputs.empty:
        return []
    requests = frames.requests
    produced, unknown = _produced(frames.launches, set(requests["rid"]))
    found = []  # (rid, index, expected, actual, produced, held)
    for rid, emitted in frames.output_tokens().items():
        if rid in unknown:
            continue
        stream, at = produced.get(rid, []), 0
        for index, token in enumerate(emitted):
            start = at
            while at < len(stream) and stream[at] != token:
                at += 1
            if at == len(stream):
                found.append((rid, index, stream[start] if start < len(stream)
                               else "no further token", int(token), len(stream),
                               len(emitted)))
                break
            at += 1
    if not found:
        return []
    steps = first_step_showing(requests, {rid: index for rid, index, *_ in found})
    last = int(requests["step"].max())
    return [pd.DataFrame([{
        "field": "output_ids", "step": steps.get(rid, last), "rid": rid,
        "expected": expected, "actual": actual,
        "explanation": f"output token {index} ({actual}) is none the forward produced for "
                       f"the request after the tokens before it (it produced {made}, the "
                       f"request holds {held}): a result applied twice, or to another "
                       "request", "order": order}
        for rid, index, expected, actual, made, held in found])]


def _ended_where_sglang_ended_it(frames: Frames, order: int) -> list[pd.DataFrame]:
    """A request emits no token (``output_ids``) after it ended (finished, or ended by
    the abort SGLang sent it), and a finish on a stop token ends it at the first
    occurrence of the token it matched (``finish_matched``; a stop string's is not
    read). First step each, per request."""
    requests = frames.requests.sort_values(["rid", "step"], kind="stable")
    ended = requests[requests["finished"].astype(bool)].drop_duplicates("rid").set_index(
        "rid")  # each request's first ended row
    if ended.empty:
        return []
    end_step = requests["rid"].map(ended["step"])
    end_emitted = requests["rid"].map(ended["emitted"])
    after = requests[(requests["step"] > end_step) & (requests["emitted"] > end_emitted)
                     ].drop_duplicates("rid")
    rows = [{"field": "output_ids", "step": int(row.step), "rid": row.rid,
             "expected": int(ended.at[row.rid, "emitted"]), "actual": int(row.emitted),
             "explanation": f"tokens emitted after the request ended at step "
                            f"{int(ended.at[row.rid, 'step'])} "
                            f"({ended.at[row.rid, 'finish_reason'] or 'abort'}): it was "
                            "computed for a client told it was done", "order": order}
            for row in after.itertuples(index=False)]
    last = requests.drop_duplicates("rid", keep="last")
    stops = last[(last["finish_reason"] == "stop") & last["finish_matched"].notna()
                 & ~last["rid"].isin(after["rid"])]
    if len(stops):
        tokens = frames.output_tokens()
        wrong = []  # (rid, matched, stop position or None, emitted)
        for rid, matched in zip(stops["rid"], stops["finish_matched"].astype("int64")):
            emitted = tokens.get(rid, [])
            stop = emitted.index(matched) + 1 if matched in emitted else None
            if stop != len(emitted):
                wrong.append((rid, int(matched), stop, len(emitted)))
        # The step the token past the stop shows (outputs are read after the last step:
        # a crashed run's may show none), else the step it ended.
        past = first_step_showing(requests, {rid: stop for rid, _, stop, _ in wrong if stop})
        rows += [{
            "field": "output_ids", "step": past.get(rid, int(ended["step"].get(rid, 0))),
            "rid": rid, "expected": stop if stop else f"a last token {matched}",
            "actual": count,
            "explanation": f"finished on stop token {matched}, but " + (
                f"it is token {stop} of the {count} emitted: the request went on past its "
                "stop" if stop else "it emitted no such token"), "order": order}
            for rid, matched, stop, count in wrong]
    return [pd.DataFrame(rows)] if rows else []


def _first_token_after_the_prompt(frames: Frames, order: int) -> list[pd.DataFrame]:
    """A request's first token comes from the prefill of its whole prompt: it shows only
    after the result of the launch that first computed every prompt position
    (``kv_computed`` at least ``prompt_len``) was processed. A middle chunk's result
    taken for the last one emits a token from half a prompt. (A request id holding a
    comma is judged only when its prompt was not computed at all by then.)"""
    requests = frames.requests.sort_values("step", kind="stable")
    first = requests[(requests["emitted"] > 0) & requests["kv_computed"].notna()
                     ].drop_duplicates("rid")
    if first.empty:
        return []
    whole = requests[requests["kv_computed"] >= requests["prompt_len"]].drop_duplicates(
        "rid").set_index("rid")["step"]
    computed_at = first["rid"].map(whole)
    early = computed_at.isna() | (computed_at > first["step"])
    # The launch that first computed the whole prompt: the first launch, in the step
    # before that, with the request among its lanes.
    lanes = frames.launches[["launch", "step", "rids", "processed_step"]].assign(
        rid=lambda t: t["rids"].fillna("").str.split(",")).explode("rid")
    lanes = lanes.sort_values("launch", kind="stable").drop_duplicates(["rid", "step"])
    launch = first[~early].assign(step=computed_at[~early] - 1)[["rid", "step"]].merge(
        lanes[["rid", "step", "processed_step"]], on=["rid", "step"], how="left")
    processed = pd.Series(launch["processed_step"].to_numpy(), index=first.index[~early])
    unprocessed = processed.notna() & (first.loc[~early, "step"] <= processed)
    bad = first[early | unprocessed.reindex(first.index, fill_value=False)]
    if bad.empty:
        return []
    done = processed.reindex(bad.index)
    return [pd.DataFrame({
        "field": "output_ids", "step": bad["step"].astype("int64"), "rid": bad["rid"],
        "expected": "first token after the prefill of " + ints(bad["prompt_len"])
                    + " prompt positions",
        "actual": [f"before it was processed (step {int(d)})" if d == d else
                   f"after {int(k)} computed" for d, k in zip(done, bad["kv_computed"])],
        "explanation": "the request emitted its first token before the result of the "
                       "launch that computed its whole prompt was processed: a prefill "
                       "chunk's result was taken for the last one", "order": order})]


def _stopped_at_a_stop_token(frames: Frames, order: int) -> list[pd.DataFrame]:
    """A request that emits one of its stop tokens (its stop ids, the model's EOS, unless
    it ignores EOS: meta ``stop_ids``, SGLang's own sets) finishes there, on that
    token: ``finish_reason`` stop with ``finish_matched`` that token, and nothing after
    it. A length finish on it sends the client the stop token a stop would have
    trimmed (SGLang #17487). An abort may end it there; an unfinished request is not
    judged unless it went on past the token."""
    stops = frames.meta.get("stop_ids") or {}
    if not stops:
        return []
    tokens = frames.output_tokens()
    requests = frames.requests
    last = requests.drop_duplicates("rid", keep="last").set_index("rid")
    ended = requests[requests["finished"].astype(bool)].drop_duplicates("rid").set_index(
        "rid")["step"]  # the first step each shows its end
    rows = []
    for rid, ids in stops.items():
        emitted, ids = tokens.get(rid, []), set(ids)
        at = next((i for i, token in enumerate(emitted) if token in ids), None)
        if at is None or rid not in last.index:
            continue
        reason, matched = last.at[rid, "finish_reason"], last.at[rid, "finish_matched"]
        past = len(emitted) > at + 1
        wrong_finish = reason in ("length", "stop") and not (
            reason == "stop" and matched == emitted[at])
        if past or wrong_finish:
            rows.append({
                "field": "output_ids", "step": int(ended.get(rid, last.at[rid, "step"])),
                "rid": rid, "expected": f"stop on token {emitted[at]} at {at + 1}",
                "actual": f"{reason} after {len(emitted)}",
                "explanation": f"token {at} of the output is stop token {emitted[at]}, and "
                               + ("the request went on past it" if past else
                                  f"it finished by {reason}" + (
                                      f" on {int(matched)}" if matched == matched and
                                      matched is not None else "")
                                  + ": the client gets the stop token a stop trims"),
                "order": order})
    return [pd.DataFrame(rows)] if rows else []


def _retractions_counted(frames: Frames, order: int) -> list[pd.DataFrame]:
    """A request that gives its ``req_to_token`` row back before it ended was retracted
    (or preempted), and SGLang counts it (``retraction_count``, its ``num_retractions``):
    between two steps the count rises by exactly the retractions seen."""
    requests, same, gave_back = retractions(frames.requests)
    retracted = gave_back.astype("int64")
    counted = pd.to_numeric(requests["retractions"], errors="coerce")
    rise = (counted - counted.shift(1)).where(same)
    bad = requests[rise.notna() & (rise != retracted)]
    if bad.empty:
        return []
    return [pd.DataFrame({
        "field": "retraction_count", "step": bad["step"].astype("int64"), "rid": bad["rid"],
        "expected": (counted.shift(1) + retracted)[bad.index].astype("int64").astype(object),
        "actual": counted[bad.index].astype("int64").astype(object),
        "explanation": ["the request gave its row back unfinished (retracted) and its "
                        "retraction count did not rise" if r else "the retraction count "
                        "rose with no retraction" for r in retracted[bad.index]],
        "order": order})]


@extend(2, fields=("decode_batch_idx",))
def check_counters_extended(frames: Frames) -> ClauseResult:
    """Clause 2 with ``decode_batch_idx`` added to the RFC's three counters (read by SWA
    eviction, the SWA retain window and mamba tracking)."""
    base = check_counters(frames)
    requests = frames.requests
    if "decode_batch_idx" not in requests:
        return base
    alive = requests[live_mask(requests) & requests["decode_batch_idx"].notna()
                     & requests["kv_prefilled"].notna()]
    if alive.empty:
        return ClauseResult(2, base.status, base.note + "; decode_batch_idx not recorded "
                            "by this SGLang", base.violations)
    expected = (alive["kv_computed"] - alive["kv_prefilled"]).astype("int64")
    value = alive["decode_batch_idx"].astype("int64")
    bad = alive[value != expected]
    found = base.violations
    if len(bad):
        lag = (expected[bad.index] - value[bad.index])
        direction = pd.Series("lags", index=bad.index).where(lag > 0, "leads")
        rows = pd.DataFrame({
            "field": "decode_batch_idx", "step": bad["step"].astype("int64"),
            "rid": bad["rid"], "expected": expected[bad.index].astype(object),
            "actual": value[bad.index].astype(object),
            "explanation": "decode_batch_idx " + direction + " the "
                           + expected[bad.index].astype(str) + " decode steps computed "
                           "since the request's prefill by " + lag.abs().astype(str)
                           + "; SWA eviction, the SWA retain window and mamba tracking "
                           "count decode steps by it"})
        extra = violations(2, frames.loop, rows)
        found = pd.concat([base.violations, extra], ignore_index=True).sort_values(
            "step", kind="stable").reset_index(drop=True)
    note = base.note + f"; decode_batch_idx on {len(alive)}"
    return ClauseResult(2, VIOLATED if len(found) else HOLDS, note, found)
