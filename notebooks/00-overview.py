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
# # The per-step contract of SGLang's scheduler loops: overview
#
# `Scheduler.run_batch` does two jobs: it runs the torch forward, **and** it does the
# per-step bookkeeping that backend-neutral code reads: the radix cache, the watchdog,
# the profiler and the idle predicates. The MLX overlap loop
# (`event_loop_overlap_mlx`, `hardware_backend/mlx/scheduler_mixin.py`) replaces the
# forward and is meant to inherit the bookkeeping, but nothing enforces that. RFC #32833
# writes the inheritance down as a five-clause **per-step contract**. In July, four bugs
# broke four of the five clauses.
#
# This suite runs short workloads through the **real, installed SGLang 0.5.23** loops:
# torch `normal` (`event_loop_normal`), torch `overlap` (`event_loop_overlap`) and `mlx`
# (`event_loop_overlap_mlx`). Only the model forward is replaced, by a deterministic
# next-token function. The suite records the scheduler's own state at every **step
# boundary**: the entry of `Scheduler.ingest_requests` at the top of each loop
# iteration. It then checks the clauses there. A failure names the clause and the field,
# not a downstream symptom.
#
# ## The contract in a page
#
# A step that emits tokens must leave these five clauses true when it ends:
#
# | # | clause | field(s) | who reads it (0.5.23) | when it is stale |
# |---|---|---|---|---|
# | 1 | **slots recorded** | `req_to_token` | MLX decode-KV pool sync `_sync_decode_kv_to_pool`; radix `checkpoint` | KV written to padding slot 0 or over another request's slots |
# | 2 | **counters advanced** | `seq_lens`, `kv_committed_len`, `kv_allocated_len` | `release_kv_cache` → radix insert up to `owned_kv_len()`; `check_decode_mem` | the radix tree keeps only the lagging prefix: silent cache loss |
# | 3 | **step stamped** | `forward_ct`, `forward_iter`, `launch_ts` | watchdog, profiler, `_record_step_counters` | watchdog SIGQUIT, endless profiling, `TypeError` at startup |
# | 4 | **relays published or provably unread** | `future_map.output_tokens_buf` | `resolve_forward_inputs` | a mixed batch reads never-written memory (segfault on MPS) |
# | 5 | **in-flight predicates test any overlap loop** | `result_queue` term of `is_fully_idle` | `release_memory_occupation`, `flush_cache`, health check | "idle" with a job in flight |
#
# `docs/contract.md` gives the exact check for each clause. Each check compares the
# scheduler's fields with a ground truth recorded at the model boundary. The main one is
# `kv_computed`: how many positions of a request a launched forward has computed.

# %%
# %matplotlib inline
import warnings

# Deprecation notices differ between library versions and nbval compares stderr.
for category in (DeprecationWarning, FutureWarning):
    warnings.simplefilter("ignore", category)

import contract_lib
from contract_lib import plots
from contract_lib.contract import check
from contract_lib.status import status

# %% [markdown]
# ## Two loops, one workload
#
# The `two-turn` workload: requests `a` and `b` decode together, `c` arrives during their
# decode, and after `a` finishes a second turn `a2` arrives. The prompt of `a2` is `a`'s
# prompt and output plus four new tokens. Here it runs through the torch overlap loop and
# the MLX loop. Both keep one job in flight, and both emit exactly the same tokens:

# %%
overlap = contract_lib.run("two-turn", "overlap")
mlx = contract_lib.run("two-turn", "mlx")
print(plots.crash_summary(overlap))
print(plots.crash_summary(mlx))
print("same tokens on both loops:", overlap.output_tokens() == mlx.output_tokens())

# %% [markdown]
# The tokens match, but the two loops do different things at each step. On the torch
# loop, every launch is a fresh `run_batch` forward. The batch it runs has been through
# `get_next_batch_to_run` → `prepare_for_decode`, which allocates the next slot, writes
# `req_to_token` and advances the counters. On MLX, once a request is decoding and no new
# prompt is waiting, the next step is **chained**: it is built directly on the previous
# step's still-lazy tokens (`_launch_chained`) and skips all of that bookkeeping.

# %%
plots.launch_timeline(overlap, mlx)

# %% [markdown]
# Checking the contract on both runs shows what the chained steps leave behind:

# %%
for frames in (overlap, mlx):
    print(plots.run_label(frames))
    print(plots.text_table(plots.report_table(check(frames))))
    print()

# %% [markdown]
# ## The measured clause × loop table for the installed SGLang
#
# Every shipped workload (`single-decode`, `two-turn`, `staggered`, `finish-mid-chain`,
# `mixed-chunk`) runs through every loop and is checked. Each cell shows the worst status
# over the five workloads, and how many workloads show it. `violated-masked` means the
# reader got the right answer only because another term of the predicate did.
# `not-exercised` means the run never reached what the clause is about (the `normal` loop
# has nothing in flight).

# %%
measured = status(progress=False)
print(measured.text())

# %% [markdown]
# On 0.5.23 the torch loops satisfy every clause, and so does clause 3 on MLX (fixed by
# #29217 and #32447). Clauses 1, 2 and 5 are open on MLX on every workload, and clause 4
# is open on MLX wherever a mixed batch reads the relay (`mixed-chunk`).
#
# ## Reading order
#
# One notebook per clause. Each one states the clause, names the SGLang code that reads
# the field, replays the July bug on the real code (red) and shows the fixed or current
# state (green, or red where 0.5.23 still has the bug):
#
# 1. [01 — slots recorded](01-slots.ipynb): `req_to_token` on chained decode (#30093, #30147). Open on MLX.
# 2. [02 — counters advanced](02-counters.ipynb): `seq_lens` / `kv_committed_len` lag, and the radix reuse it costs (#30093, #33874, #40046). Open on MLX.
# 3. [03 — step stamped](03-step-stamps.ipynb): `forward_ct` (#29217) and `launch_ts` (#32245 → #32447). Fixed; replayed with patches.
# 4. [04 — relays published or provably unread](04-relay.ipynb): the mixed-chunk relay read (#32591). Open on MLX.
# 5. [05 — in-flight predicates](05-idle-predicate.ipynb): `is_fully_idle` on the MLX queue (#32934). Open (masked) on MLX.
# 6. [06 — triage](06-triage.ipynb): a parameterised notebook for a new run (workload, loop, patch): the first violated clause and field, the frames around it, and a step explorer.
# 7. [07 — effects audit](07-effects-audit.ipynb): what the MLX loop's steps do not write that the torch loops' do, found without being told; two fields no clause covers yet (`processed_tokens_counter`, `decode_batch_idx`).
#
# Read 01 and 02 together, since they share a root cause: chained decode skips
# `prepare_for_decode`. 03 is the fixed clause and shows what a regression looks like.
# Start with 06 when you have a new patch to triage.
