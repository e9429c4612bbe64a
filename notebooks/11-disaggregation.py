# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # One request across the PD-disaggregation pair
#
# With `--disaggregation-mode`, SGLang splits serving across two servers: a *prefill*
# server computes each prompt and its first token, then hands the request off (its KV
# and that token) to a *decode* server, which admits it already prefilled and decodes
# the rest. Both run their own event loops (`event_loop_{normal,overlap}_disagg_prefill`,
# `..._disagg_decode`), built on batch builders of their own: exactly the kind of
# replacement loop the contract is about.
#
# A **pair run** (`contract_lib.campaigns.pair`, `python -m contract_lib pair`) runs one
# workload through a prefill side, then through a decode side, on SGLang's fake KV
# transfer backend (a transfer completes at once and moves nothing), and compares the
# finished requests with `event_loop_normal`'s tokens. What the two sides share and what
# they do not:

# %%
# %matplotlib inline
from contract_lib import views
from contract_lib.campaigns.pair import SHARED, pair

views.setup()
print(views.wrap(SHARED))

result = pair("staggered")
print(views.wrap(result.verdict().line()))

# %% [markdown]
# ## Every request, both sides
#
# Each request is handed off at the step its prefill ends (its first token), admitted by
# a prebuilt batch on the decode side, and ends there with `event_loop_normal`'s tokens.

# %%
print(views.text_table(result.requests()))

# %% [markdown]
# ## Following request `b`
#
# `b` arrives at the same step on both sides, each side counting its own steps. On the
# prefill side one extend launch computes its prompt and samples its first token; the
# transfer "completes" and the request ends there by length. On the decode side the
# request arrives already prefilled: a prebuilt batch admits it with that token, without
# a forward, and the first decode launch reads the token from the relay.

# %%
print(views.text_table(result.journey("b")))

# %%
views.pair_journey(result, "b")

# %% [markdown]
# ## What the decode side must do for a prebuilt batch: SGLang #12839's kind
#
# A prebuilt batch never goes through `run_batch`: the decode side's batch builder does
# its bookkeeping itself (`process_prebuilt`, then `process_batch_result_prebuilt`). The
# review of #12839, which moved this handling around, flagged that the move dropped
# `stream_output` for these batches. Replayed here (`prebuilt-skips-stream-output`) on
# requests that end at their first token, the hand-off: `a` asks for one token, `b`'s
# first token is the model's EOS. They are released, and never answered. Clause 2's
# extension field `finished_output` names it: a request that ended has had its final
# output sent by the boundary that first shows it ended.

# %%
from contract_lib.contract import violation_message  # noqa: E402
from contract_lib.workloads import Workload  # noqa: E402

first_token = Workload.from_dict({"name": "first-token-finish", "max_steps": 60, "requests": [
    {"rid": "a", "prompt_range": [20, 32], "max_new_tokens": 1},
    {"rid": "b", "prompt_range": [40, 50], "max_new_tokens": 6, "emit": {"0": 2}},
    {"rid": "c", "prompt_range": [60, 70], "max_new_tokens": 6}]})
for patch in (None, "prebuilt-skips-stream-output"):
    replay = pair(first_token, patch=patch)
    print(f"patch {patch or '(none)'}:")
    print(views.wrap("  " + replay.reports["decode"].verdict().line()))
    clause = replay.reports["decode"].clauses[2]
    if clause.status == "violated":
        print(views.wrap("  " + violation_message(clause.first())))

# %% [markdown]
# ## What no run here can show: SGLang #30175
#
# Before #31134, the per-batch n-gram embedding hook ran only in `get_next_batch_to_run`;
# the disaggregation loops and the prebuilt batch never attached the token table, and a
# LongCat model crashed on its first request. Replayed (`disagg-skips-ngram-embedding`),
# it changes nothing a run here records: the hook writes nothing for a model without
# n-gram embedding, and the model that reads it needs CUDA-only kernels. The contract
# has no field for that table (the missing field is a per-request relay, clause 4's
# kind: `data/bugs.toml`, `docs/contract.md`).

# %%
replay = pair("staggered", patch="disagg-skips-ngram-embedding")
for side in ("prefill", "decode"):
    ours, theirs = getattr(result, side).comparable(), getattr(replay, side).comparable()
    same = all(ours[name].equals(theirs[name]) for name in ours)
    print(f"{side} side with the hook skipped: every table as without it: {same}")
