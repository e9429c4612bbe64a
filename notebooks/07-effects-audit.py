# %% [markdown]
# # Effects audit: what a replacement loop forgets
#
# The five clauses were written down after the bugs. The next bug will be in a field
# nobody has listed yet. This notebook makes the suite look for such fields itself.
#
# **How.** An *audit run* records every attribute write the loop's steps make to the
# objects the contract is about: the `Scheduler`, `ScheduleBatch`, `Req` and its
# `ReqKvInfo`, the `FutureMap`, the tree cache, the KV allocator, the `ReqToTokenPool`
# (its `write`, as `req_to_token[]`), the metrics reporter and the profiler manager. Each
# write is kept with its step and the SGLang function that made it
# (`contract_lib/effects.py`). Two kinds of writes are not *effects* and are set aside:
# assigning a value that is already there (the same object, or an equal number), and
# building a new object (`ScheduleBatch.copy()` for the batch every overlap loop hands to
# `process_batch_result`, new `Req`s).
#
# Then each field's **cadence** is measured per loop, over the decode launches (where
# chained and fresh MLX launches differ): changed at every decode launch, only at fresh
# ones (when the MLX chain breaks), at some, or never. A **finding** is a field that both
# torch loops change at every decode launch and the MLX loop does not
# (`contract_lib/audit.py`). For each finding the audit greps the installed SGLang for
# the code that reads the field, and says whether a shipped clause already checks it.

# %%
# %matplotlib inline
from contract_lib import views
from contract_lib.audit import audit

views.setup()

# %% [markdown]
# ## The findings on `two-turn`, SGLang 0.5.23

# %%
result = audit("two-turn", progress=False)
print(views.text_table(views.audit_table(result)))

# %%
views.audit_cadences(result)

# %% [markdown]
# Eight of the ten findings are fields the clauses already check. The allocation and
# `req_to_token[]` writes are clause 1. `seq_lens*`, `kv_committed_len` and
# `kv_allocated_len` are clause 2. All of them come from the same skipped call:
# `_launch_chained` never reaches `prepare_for_decode` → `alloc_for_decode`, so they change
# only when the chain breaks (orange), or, for the allocation-side ones, only at some
# launches (yellow). That the audit finds them without being told is the check on the
# audit itself.
#
# Two findings are **not covered by any clause**. Here is where each one is written and
# read:

# %%
uncovered = result.findings[result.findings["clause"].isna()]
for row in uncovered.itertuples(index=False):
    print(f"{row.object}.{row.field}: normal {row.normal}, overlap {row.overlap}, "
          f"mlx {row.mlx}")
    print(f"  written by {', '.join(row.written_by)}")
    print(f"  read at {row.readers} sites, e.g. {', '.join(row.reader_sites[:3])}")

# %% [markdown]
# ### `Scheduler.processed_tokens_counter`: the HRRN aging axis
#
# `run_batch` advances it by `batch.extend_num_tokens` before every forward
# (`managers/scheduler.py:4633`). The `hrrn` schedule policy reads it as its clock: a
# request snapshots it on arrival (`req.arrival_processed_tokens`, :3495), and its
# priority grows with `processed_tokens - arrival_processed_tokens`
# (`managers/schedule_policy.py:469-489`, fed at :4132). The MLX loop never calls
# `run_batch` and never advances it, so under `--schedule-policy hrrn` on MLX no waiting
# request ever ages: HRRN degenerates to ordering by size.
#
# The audit also shows something on the **torch** side. The counter changes at *every
# decode* launch, even though the comment above that line says "Decode / prebuilt batches
# contribute 0". `prepare_for_decode` never resets `extend_num_tokens`, so each decode
# step adds the last prefill's token count again. Measured on `two-turn`: the counter
# grows by 28 at each decode step after the first prefill of 28 tokens (0 → 28 → 56 → …).
# So the torch loops over-age waiting requests by the prefill length at every decode
# step, and the MLX loop does not age them at all. The two loops disagree in opposite
# directions.
#
# **Proposal: a sixth clause, "scheduling clocks advanced".** At every launch,
# `processed_tokens_counter` advances by the tokens the launch prefills: by the batch's
# extend tokens for an extend or mixed batch, by zero for decode. The torch loops would
# fail it today (a finding to file upstream), and the MLX loop would fail it at every
# prefill. The reader that gets it wrong is HRRN's `calc_priority`.
#
# ### `Req.decode_batch_idx`: the per-request decode step count
#
# `prepare_for_decode` increments it for every request in the batch
# (`managers/schedule_batch.py:3782-3783`). Readers:
# - SWA eviction (`schedule_batch.py:4087`, `decode_batch_idx >= 1`).
# - The SWA retain window, which releases a request's prefill SWA lock once
#   `decode_batch_idx >= retain_window` (:4103).
# - Mamba state tracking, as the lookahead `req.decode_batch_idx -
#   batch.mamba_decode_batch_idx_cpu[i]` (`batch_result_processor.py:1391, 1666`) and the
#   untracked-batch marker (:1413).
#
# On MLX chained decode it lags behind the real number of decode steps, exactly like
# `seq_lens`. The SWA retain window therefore closes late, by the chain length, and
# keeps prefix SWA locked longer than intended. These readers only run for SWA and hybrid
# (mamba) models, which this model-free suite does not exercise. So the lag is measured
# here, but its damage is not.
#
# **Proposal: extend clause 2 rather than add a clause.** "Counters advanced" should list
# `Req.decode_batch_idx` beside `seq_lens` and `kv_committed_len`: it is the same
# counter-per-launched-step invariant, with the same root cause and the same fix
# (`fix-chained-accounting` runs `prepare_for_decode` per chained step).

# %% [markdown]
# ## The audit sees a broken clause it was not told about
#
# The replay of #29217 (`no-forward-ct`) removes the `forward_ct` advance from the MLX
# launch. The audit, which knows nothing about clause 3, now lists `Scheduler.forward_ct`
# as changed at every decode launch by the torch loops and never by MLX. Without the
# patch it does not list it:

# %%
broken = audit("two-turn", patch="no-forward-ct", progress=False)
for name, audited in (("0.5.23", result), ("0.5.23 + no-forward-ct", broken)):
    found = set(audited.findings["object"] + "." + audited.findings["field"])
    print(f"{name}: Scheduler.forward_ct listed: {'Scheduler.forward_ct' in found}")

# %% [markdown]
# ## Seeing it on a timeline
#
# `python -m contract_lib trace --workload two-turn --loop normal --loop mlx` writes a
# Chrome trace event file of both loops side by side, for https://ui.perfetto.dev or
# chrome://tracing. It has one process per loop, tracks for the scheduler step, fresh and
# chained launches and each request, per-request counters (tokens computed, `seq_lens`,
# `kv_committed_len`), and an instant event for every clause violation carrying clause,
# field, expected and actual. The timestamps are synthetic (step *k* at *k* ms), so the
# file is byte-stable; `--wall-clock` uses the recorded times instead.
