"""The safety net under the clauses: each request's tokens are the fake model's
continuation of its prompt (``next_token`` over the request's own history; the workload's
scripted tokens where it has them), the same on every loop.

Not a clause: a wrong token is a downstream symptom, and the clauses name causes. A run
whose tokens differ although no clause and no pool law found anything fails on this
(a gap in the contract: the verdict says so), so a wrong answer is never a pass.
Model-free runs only; a request whose held prompt is not the prompt fed (SGLang
truncated or replaced it) is not judged."""

from __future__ import annotations

import pandas as pd

from contract_lib import loops
from contract_lib.child.shims.model import next_token
from contract_lib.contract.base import emitted_tokens, first_step_showing
from contract_lib.frames import Frames

COLUMNS = ["rid", "index", "step", "expected", "actual"]


def wrong_outputs(frames: Frames) -> pd.DataFrame:
    """Per request, its first token that is not the model's (``index`` in its output,
    the ``step`` that first showed it), in request order."""
    prompts = frames.meta.get("prompts") or {}
    if frames.meta.get("runner", "model-free") != "model-free" or frames.outputs.empty:
        return pd.DataFrame(columns=COLUMNS)
    script = {rid: dict(map(tuple, pairs))
              for rid, pairs in (frames.meta.get("script") or {}).items()}
    requests = frames.requests
    held = requests.drop_duplicates("rid", keep="last").set_index("rid")["prompt_len"]
    rows = []
    for rid, tokens in emitted_tokens(frames).items():
        prompt = prompts.get(rid)
        if not prompt or held.get(rid) != len(prompt):
            continue
        scripted, last = script.get(rid, {}), prompt[-1]
        for index, token in enumerate(tokens):
            expected = scripted.get(index, next_token(last, len(prompt) + index))
            if token != expected:
                rows.append({"rid": rid, "index": index, "expected": int(expected),
                             "actual": int(token)})
                break
            last = token
    steps = first_step_showing(requests, {row["rid"]: row["index"] for row in rows})
    last_step = int(requests["step"].max()) if len(requests) else 0
    for row in rows:
        row["step"] = steps.get(row["rid"], last_step)
    return pd.DataFrame(rows, columns=COLUMNS)


def same_tokens(run: Frames, other: Frames) -> dict[str, bool]:
    """Per request that finished in both runs of one workload (in ``run``'s request
    order), whether the two emitted the same tokens, as every correct loop must: a
    request that finished by a stop or its length emits exactly the same tokens; one
    aborted in either run may stop a token apart (an abort lands at a step, and each loop
    steps at its own cadence), so the shorter output must begin the longer. A request
    that did not finish in both (a run that stopped early) is not compared. A PD
    prefill side emits each request's first token only (its ``max_new_tokens`` is set
    to 1, ``disaggregation/prefill.py``): that token is what it is compared on."""
    ends = [_finish_reasons(frames) for frames in (run, other)]
    tokens = [frames.output_tokens() for frames in (run, other)]
    if loops.known(run.loop).first_token_only or loops.known(other.loop).first_token_only:
        tokens = [{rid: emitted[:1] for rid, emitted in side.items()} for side in tokens]
    same = {}
    for rid in ends[0]:
        if rid not in ends[1]:
            continue
        ours, theirs = tokens[0].get(rid, []), tokens[1].get(rid, [])
        if "abort" in (ends[0][rid], ends[1][rid]):
            shorter, longer = sorted((ours, theirs), key=len)
            same[rid] = longer[:len(shorter)] == shorter
        else:
            same[rid] = ours == theirs
    return same


def _finish_reasons(frames: Frames) -> dict[str, str]:
    """Each request that finished in the run, in request order: its finish reason."""
    last = frames.requests.drop_duplicates("rid", keep="last").set_index("rid")
    return {rid: str(last.at[rid, "finish_reason"])
            for rid in dict.fromkeys(frames.requests["rid"]) if last.at[rid, "finished"]}
