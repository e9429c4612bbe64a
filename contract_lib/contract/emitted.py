"""Clause 2's rules on what each request was served and emitted: its prompt the prompt
fed, a finish by length after its ``max_new_tokens``, only tokens the forward produced
for it (in order, each once; on a PD decode side, the transferred hand-off token first),
none after it ended, a stop token ending it, its first token only after its whole prompt
was computed, and each retraction counted. Called by :mod:`.counters`."""

from __future__ import annotations

import numpy as np
import pandas as pd

from contract_lib.contract.base import (
    by_request,
    emitted_tokens,
    first_of_each,
    first_step_showing,
    handoffs,
    in_step_order,
    ints,
    ordered_by,
    request_columns,
    retractions,
)
from contract_lib.contract.radix import run_arg
from contract_lib.frames import Frames


def served_as_fed(frames: Frames, order: int) -> list[pd.DataFrame]:
    """Each request as it was fed: its prompt (``origin_input_ids``) the prompt fed (meta
    ``prompts``; not for a request SGLang aborted, whose prompt it replaces; at most it
    with ``allow_auto_truncate``), and at its finish by length, as many tokens emitted
    (``output_ids``) as its ``max_new_tokens`` (SGLang's own, after its caps). First
    step each, per request."""
    requests, parts = frames.requests, []
    columns = request_columns(frames)
    rids, reason = columns["rid"], columns["finish_reason"]
    lengths = {rid: len(prompt) for rid, prompt in (frames.meta.get("prompts") or {}).items()}
    fed = np.array([lengths.get(rid, np.nan) for rid in rids.tolist()], dtype="float64")
    aborted = set(rids[reason == "abort"].tolist())
    # ``allow_auto_truncate``: SGLang may cut a prompt too long for the context.
    truncates = bool(run_arg(frames, "allow_auto_truncate"))
    held = columns["prompt_len"]
    differs = (held > fed) if truncates else (held != fed)
    wrong = ~np.isnan(fed) & differs & np.array([rid not in aborted for rid in rids.tolist()],
                                                dtype=bool)
    if wrong.any():
        bad = requests[wrong].drop_duplicates("rid")
        fed_bad = pd.Series(fed, index=requests.index)[bad.index].astype("int64")
        parts.append(pd.DataFrame({
            "field": "origin_input_ids", "step": bad["step"].astype("int64"),
            "rid": bad["rid"], "expected": fed_bad.astype(object),
            "actual": bad["prompt_len"].astype("int64").astype(object),
            "explanation": "the prompt the scheduler holds is not the prompt fed ("
                           + fed_bad.astype(str) + " tokens): the "
                           "request is computed from another prompt", "order": order}))
    if "max_new_tokens" in columns:
        done = first_of_each(rids, np.flatnonzero(
            (reason == "length") & pd.notna(columns["max_new_tokens"])))
        # A prefill emits its token even when SGLang capped the budget to 0.
        budget = np.maximum(columns["max_new_tokens"][done].astype("int64"), 1)
        short = columns["emitted"][done] != budget
        if short.any():
            bad = requests.iloc[done[short]]
            parts.append(pd.DataFrame({
                "field": "output_ids", "step": bad["step"].astype("int64"),
                "rid": bad["rid"],
                "expected": pd.Series(budget[short], index=bad.index).astype(object),
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


def _produced(launches: pd.DataFrame, known: set[str], handed_off: dict[str, int]
              ) -> tuple[dict[str, list[int]], set[str]]:
    """What the forward produced for each request, in launch order (each launch's
    ``tokens``, aligned with its ``rids``; a launch with none, an MLX launch never
    finalized, delivered none), after the hand-off token of a request prefilled
    elsewhere (``handed_off``: the remote prefill's), and the requests with a lane
    whose token is unknown (or in a launch whose ids do not read as ``known`` ones: all
    the known ids its ``rids`` contains)."""
    produced: dict[str, list[int]] = {rid: [token] for rid, token in handed_off.items()}
    unknown: set[str] = set()
    by_first: dict[str, list[str]] = {}  # known ids by their first fragment
    for rid in known:
        by_first.setdefault(rid.split(",")[0], []).append(rid)
    ordered = ordered_by(launches, "launch")
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


def emitted_as_produced(frames: Frames, order: int) -> list[pd.DataFrame]:
    """Each request's tokens (``output_ids``) are tokens the forward produced for it, in
    order, each emitted once: a subsequence of its lanes' tokens over its launches (a
    lane's token may go unemitted: a chunk's, an overlap loop's step past the finish).
    A result applied twice, or to another request, emits a token nothing produced
    there. First such token per request; not judged for a request with a lane whose
    token was not recorded. On a PD decode side the first token produced is the
    transferred hand-off (``prebuilt``), not a local forward's."""
    if "tokens" not in frames.launches or frames.outputs.empty:
        return []
    requests = frames.requests
    produced, unknown = _produced(frames.launches, set(requests["rid"]), handoffs(frames))
    found = []  # (rid, index, expected, actual, produced, held)
    for rid, emitted in emitted_tokens(frames).items():
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


def ended_where_sglang_ended_it(frames: Frames, order: int) -> list[pd.DataFrame]:
    """A request emits no token (``output_ids``) after it ended (finished, or ended by
    the abort SGLang sent it), and a finish on a stop token ends it at the first
    occurrence of the token it matched (``finish_matched``; a stop string's is not
    read). First step each, per request."""
    columns, by_rid = request_columns(frames), by_request(frames)
    rids, steps, emitted = columns["rid"], columns["step"], columns["emitted"]
    ended = first_of_each(rids, by_rid[columns["finished"][by_rid].astype(bool)])
    if not len(ended):
        return []
    # Each request's first ended row, and each row against it.
    end_row = dict(zip(rids[ended].tolist(), ended.tolist()))
    at_end = np.array([end_row.get(rid, -1) for rid in rids.tolist()])
    has_end = at_end >= 0
    went_on = np.zeros(len(rids), dtype=bool)
    went_on[has_end] = ((steps[has_end] > steps[at_end[has_end]])
                        & (emitted[has_end] > emitted[at_end[has_end]]))
    after = first_of_each(rids, by_rid[went_on[by_rid]])
    rows = [{"field": "output_ids", "step": int(steps[index]), "rid": rids[index],
             "expected": int(emitted[end]), "actual": int(emitted[index]),
             "explanation": f"tokens emitted after the request ended at step "
                            f"{int(steps[end])} "
                            f"({columns['finish_reason'][end] or 'abort'}): it was "
                            "computed for a client told it was done", "order": order}
            for index, end in ((index, end_row[rids[index]]) for index in after)]
    # Each request's last row (by request, then step).
    ordered = rids[by_rid]
    last = by_rid[np.append(ordered[1:] != ordered[:-1], True)]
    gone_on = set(rids[after].tolist())
    matched_at = columns["finish_matched"]
    stops = [index for index in last if columns["finish_reason"][index] == "stop"
             and pd.notna(matched_at[index]) and rids[index] not in gone_on]
    if stops:
        tokens = emitted_tokens(frames)
        wrong = []  # (rid, matched, stop position or None, emitted)
        for index in stops:
            rid, matched = rids[index], int(matched_at[index])
            output = tokens.get(rid, [])
            stop = output.index(matched) + 1 if matched in output else None
            if stop != len(output):
                wrong.append((rid, matched, stop, len(output)))
        # The step the token past the stop shows (outputs are read after the last step:
        # a crashed run's may show none), else the step it ended.
        past = first_step_showing(frames.requests,
                                  {rid: stop for rid, _, stop, _ in wrong if stop})
        rows += [{
            "field": "output_ids",
            "step": past.get(rid, int(steps[end_row[rid]]) if rid in end_row else 0),
            "rid": rid, "expected": stop if stop else f"a last token {matched}",
            "actual": count,
            "explanation": f"finished on stop token {matched}, but " + (
                f"it is token {stop} of the {count} emitted: the request went on past its "
                "stop" if stop else "it emitted no such token"), "order": order}
            for rid, matched, stop, count in wrong]
    return [pd.DataFrame(rows)] if rows else []


def first_token_after_the_prompt(frames: Frames, order: int) -> list[pd.DataFrame]:
    """A request's first token comes from the prefill of its whole prompt: it shows only
    after the result of the launch that first computed every prompt position
    (``kv_computed`` at least ``prompt_len``) was processed. A middle chunk's result
    taken for the last one emits a token from half a prompt. (A request id holding a
    comma is judged only when its prompt was not computed at all by then.) Not judged
    on a PD decode side for a request prefilled elsewhere: its first token came with
    its transferred KV (``prebuilt``), committed before any local launch."""
    columns, by_step = request_columns(frames), in_step_order(frames)
    rids, steps, computed = columns["rid"], columns["step"], columns["kv_computed"]
    handed_off = handoffs(frames)
    if handed_off:
        by_step = by_step[[rid not in handed_off for rid in rids[by_step].tolist()]]
    first = first_of_each(rids, by_step[(columns["emitted"][by_step] > 0)
                                        & pd.notna(computed[by_step])])
    if not len(first):
        return []
    whole = first_of_each(rids, by_step[computed[by_step] >= columns["prompt_len"][by_step]])
    whole_at = dict(zip(rids[whole].tolist(), steps[whole].tolist()))
    computed_at = np.array([whole_at.get(rid, np.nan) for rid in rids[first].tolist()],
                           dtype="float64")
    early = np.isnan(computed_at) | (computed_at > steps[first])
    # The launch that first computed the whole prompt: the first launch, in the step
    # before that, with the request among its lanes -> when its result was processed.
    launches = frames.launches
    processed_at: dict[tuple[str, int], float] = {}
    for _, step, lanes, processed_step in sorted(zip(
            launches["launch"].tolist(), launches["step"].tolist(), launches["rids"].tolist(),
            launches["processed_step"].tolist()), key=lambda lane: lane[0]):
        for rid in (lanes if isinstance(lanes, str) else "").split(","):
            processed_at.setdefault((rid, int(step)), float(processed_step))
    processed = np.array([np.nan if too_early else processed_at.get((rid, int(at) - 1), np.nan)
                          for rid, at, too_early in zip(rids[first].tolist(),
                                                        computed_at.tolist(), early)],
                         dtype="float64")
    unprocessed = ~np.isnan(processed) & (steps[first] <= processed)
    flagged = early | unprocessed
    if not flagged.any():
        return []
    bad = frames.requests.iloc[first[flagged]]
    done = processed[flagged]
    return [pd.DataFrame({
        "field": "output_ids", "step": bad["step"].astype("int64"), "rid": bad["rid"],
        "expected": "first token after the prefill of " + ints(bad["prompt_len"])
                    + " prompt positions",
        "actual": [f"before it was processed (step {int(d)})" if d == d else
                   f"after {int(k)} computed" for d, k in zip(done, bad["kv_computed"])],
        "explanation": "the request emitted its first token before the result of the "
                       "launch that computed its whole prompt was processed: a prefill "
                       "chunk's result was taken for the last one", "order": order})]


def stopped_at_a_stop_token(frames: Frames, order: int) -> list[pd.DataFrame]:
    """A request that emits one of its stop tokens (its stop ids, the model's EOS, unless
    it ignores EOS: meta ``stop_ids``, SGLang's own sets) finishes there, on that
    token: ``finish_reason`` stop with ``finish_matched`` that token, and nothing after
    it. A length finish on it sends the client the stop token a stop would have
    trimmed (SGLang #17487). An abort may end it there; an unfinished request is not
    judged unless it went on past the token. Not judged on a PD prefill side: it ends
    every request at its hand-off, by length (``FINISH_LENGTH(length=0)``,
    ``disaggregation/prefill.py:1226``), without a stop check of the first token
    (``process_batch_result_disagg_prefill``, :901): the decode side checks it."""
    stops = frames.meta.get("stop_ids") or {}
    if not stops or run_arg(frames, "disaggregation_mode") == "prefill":
        return []
    tokens, columns = emitted_tokens(frames), request_columns(frames)
    last: dict[str, int] = {}  # each request's last row
    ended: dict[str, int] = {}  # the first step each shows its end
    for index, (rid, step, finished) in enumerate(zip(
            columns["rid"].tolist(), columns["step"].tolist(),
            columns["finished"].astype(bool).tolist())):
        last[rid] = index
        if finished:
            ended.setdefault(rid, step)
    rows = []
    for rid, ids in stops.items():
        emitted, ids = tokens.get(rid, []), set(ids)
        at = next((i for i, token in enumerate(emitted) if token in ids), None)
        if at is None or rid not in last:
            continue
        reason = columns["finish_reason"][last[rid]]
        matched = columns["finish_matched"][last[rid]]
        past = len(emitted) > at + 1
        wrong_finish = reason in ("length", "stop") and not (
            reason == "stop" and matched == emitted[at])
        if past or wrong_finish:
            rows.append({
                "field": "output_ids",
                "step": int(ended.get(rid, columns["step"][last[rid]])),
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


def retractions_counted(frames: Frames, order: int) -> list[pd.DataFrame]:
    """A request that gives its ``req_to_token`` row back before it ended was retracted
    (or preempted), and SGLang counts it (``retraction_count``, its ``num_retractions``):
    between two steps the count rises by exactly the retractions seen."""
    by_request_rows, same, gave_back = retractions(frames)
    counted = request_columns(frames)["retractions"][by_request_rows].astype("float64")
    rise = np.full(len(by_request_rows), np.nan)
    rise[1:] = np.where(same[1:], counted[1:] - counted[:-1], np.nan)
    wrong = ~np.isnan(rise) & (rise != gave_back)
    if not wrong.any():
        return []
    bad = frames.requests.iloc[by_request_rows[wrong]]
    expected = np.append(np.nan, counted[:-1])[wrong] + gave_back[wrong]
    return [pd.DataFrame({
        "field": "retraction_count", "step": bad["step"].astype("int64"), "rid": bad["rid"],
        "expected": expected.astype("int64").astype(object),
        "actual": counted[wrong].astype("int64").astype(object),
        "explanation": ["the request gave its row back unfinished (retracted) and its "
                        "retraction count did not rise" if retracted else "the retraction "
                        "count rose with no retraction" for retracted in gave_back[wrong]],
        "order": order})]


def answered(frames: Frames) -> pd.DataFrame:
    """Each request that ended was answered: at the first step boundary that shows it
    ended, its end has reached the client (``end_sent``: SGLang's ``finished_output``,
    which ``stream_output`` sets as it sends the final output, or the ``AbortReq``
    output of an abort while it was queued). Every path that ends a request streams it
    in the same call (``process_batch_result_*``, the PD prefill side's inflight queue,
    the decode side's prebuilt batch); one that does not leaves the client waiting for a
    response that never comes (the kind of SGLang #12839's review: ``stream_output``
    dropped for prebuilt batches). Not judged where the release has no
    ``finished_output``. Rows as the other rules' (``field`` ``finished_output``)."""
    columns, by_step = request_columns(frames), in_step_order(frames)
    if "end_sent" not in columns:
        return pd.DataFrame()
    ended = first_of_each(columns["rid"], by_step[columns["finished"][by_step].astype(bool)])
    sent = columns["end_sent"][ended]
    unsent = ended[pd.notna(sent) & (sent == False)]  # noqa: E712
    if not len(unsent):
        return pd.DataFrame()
    bad = frames.requests.iloc[unsent]
    return pd.DataFrame({
        "field": "finished_output", "step": bad["step"].astype("int64"), "rid": bad["rid"],
        "expected": "its end sent to the client", "actual": "never sent",
        "explanation": "the request ended (" + bad["finish_reason"].fillna("?").astype(str)
                       + ") but stream_output never sent its final output "
                       "(finished_output): the client waits for an answer that never "
                       "comes"})
