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
# # A replacement loop from outside SGLang: sglang-omni's `OmniScheduler`
#
# The contract is written for any loop that replaces `run_batch`'s step. sglang-omni
# (PyPI `sglang-omni` 0.1.9, built on SGLang 0.5.22) ships one, in code nobody here
# wrote: `OmniScheduler` (`sglang_omni/scheduling/omni_scheduler.py`).
#
# **What it inherits.** It is not a `Scheduler` subclass: its `__getattr__` binds every
# missing name to SGLang's `Scheduler` class, so upstream batch selection
# (`get_next_batch_to_run`, `get_new_batch_prefill`), result processing
# (`process_batch_result`), the idle predicate (`is_fully_idle`) and `flush_cache` run
# on its own state, with SGLang's pools and the `FutureMap` relay.
#
# **What it does not.** It owns its loop, `event_loop_async_decode`: each iteration
# launches the current decode step and then resolves the previous one (a one-step
# lookahead; the launched step waits in `async_pending`). It owns the per-forward
# bookkeeping `run_batch` would do (`stamp_batch_launch`: "Mirror upstream per-forward
# bookkeeping for custom runner paths"), its model runner and execution bridge, its ingress
# (an `inbox` fed by a pipeline stage) and its idle path (no `on_idle` leak checks).
#
# Loop `omni` drives it model-free on SGLang 0.5.22 with the same rule as the SGLang
# loops: its platform gates, its model and its ingress are replaced, nothing else
# (`docs/omni.md`). Here it runs `two-turn` beside the torch loops of the same release.

# %%
# %matplotlib inline
import contract_lib
from contract_lib import views
from contract_lib.contract import check, violation_message

views.setup()

normal = contract_lib.run("two-turn", "normal", sglang="0.5.22")
overlap = contract_lib.run("two-turn", "overlap", sglang="0.5.22")
omni = contract_lib.run("two-turn", "omni")
for frames in (normal, overlap, omni):
    print(f"{views.crash_summary(frames)} (sglang {frames.meta['sglang_version']})")
print("replaced on omni:", ", ".join(s for s in omni.meta["shims"] if s.startswith("omni")))

# %% [markdown]
# ## Same tokens, same bookkeeping
#
# The fake model's next token depends only on the positions a forward computes, so equal
# tokens mean the lookahead computes the right positions. Clauses 1–4 hold:
# `stamp_batch_launch` keeps `forward_ct` / `forward_iter` / `launch_ts` as `run_batch`
# does, and the execution bridge publishes every sampled id through the `FutureMap`
# before the next forward reads it.

# %%
assert omni.output_tokens() == normal.output_tokens() == overlap.output_tokens()
assert all(check(omni).clauses[n].status == "holds" for n in (1, 2, 3, 4))
print("tokens equal on normal, overlap and omni:", omni.output_tokens() == normal.output_tokens())
print(views.text_table(views.report_table(check(omni))))

# %% [markdown]
# ## The lookahead overrun: one position past each finish, some launches dropped
#
# The lookahead launches a request's next decode before it resolves the step that
# finishes it, so every finishing request is computed one position past its end. A
# launch that still holds a running request is processed as usual (the finished lanes'
# tokens are discarded). A launch all of whose requests have finished is resolved and
# dropped: it never reaches `process_batch_result`. The overrun position is committed
# and cached all the same, so the second turn `a2` reuses one more cached token than on
# the torch loops: the KV of `a`'s last emitted token, which the overrun forward computed.

# %%
finished = (omni.requests[omni.requests["finished"].astype(bool)]
            .groupby("rid")["step"].min().reset_index().sort_values(["step", "rid"])
            .set_index("rid")["step"])
dropped = omni.launches[omni.launches["processed_step"].isna()]
last, torch_last = (f.requests.sort_values("step").groupby("rid").last() for f in (omni, normal))
ahead = (last["kv_committed_len"] - torch_last["kv_committed_len"]).astype(int)
assert (ahead == 1).all() and len(omni.launches) == len(normal.launches) + len(dropped)
reuse = views.radix_reuse_table(normal, overlap, omni, rid="a2")
print(views.text_table(reuse))
cached = reuse.set_index("run")["cached_tokens"]
assert cached["omni"] == cached["normal"] + 1 == cached["overlap"] + 1
views.md(
    f"On `two-turn`, **{len(finished)}** requests finish ("
    + ", ".join(f"`{rid}` at step {step}" for rid, step in finished.items())
    + f") and each ends with `kv_committed_len` one above the torch loops'. **{len(dropped)}** "
    "launches are dropped, "
    + " and ".join(f"`{r.rids}`'s (launched at step {r.step})" for r in dropped.itertuples())
    + f": omni makes {len(omni.launches)} launches where `normal` makes {len(normal.launches)}. "
    "A request that finishes while another keeps decoding rides its overrun in a launch "
    "that is processed. The figure marks the dropped launches (grey X).")

# %%
views.launch_timeline(normal, overlap, omni)

# %% [markdown]
# ## Clause 5: the inherited idle predicate cannot see the lookahead
#
# `is_fully_idle`, bound to `OmniScheduler`, has the in-flight term
# `not self.enable_overlap or len(self.result_queue) == 0`; `enable_overlap` is False on
# this loop and the launched step sits in `async_pending`, which no term reads. With the
# other terms masked it says idle at every step with a step in flight; the real predicate
# said busy only because the running batch still held the requests (`violated-masked`).
# A reader on this loop: `flush_cache` after an admin weight update, run at the top of a
# loop iteration, exactly where `async_pending` can hold a step.

# %%
result = check(omni).clauses[5]
print(f"clause 5 on {views.run_label(omni)}: {result.status} ({result.note})")
print(views.wrap(violation_message(result.first())))

# %%
views.idle_predicate(overlap, omni)
