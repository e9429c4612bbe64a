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
# per-step bookkeeping that code outside the model reads: the radix cache, the watchdog,
# the profiler and the idle predicates. The MLX overlap loop
# (`event_loop_overlap_mlx`, `hardware_backend/mlx/scheduler_mixin.py`) replaces the
# forward and is meant to inherit the bookkeeping, but nothing enforces that.
# [RFC #32833](https://github.com/sgl-project/sglang/issues/32833) writes the inheritance
# down as a five-clause **per-step contract**.
#
# This suite runs short workloads through the **real, installed SGLang 0.5.23** loops:
# torch `normal` (`event_loop_normal`), torch `overlap` (`event_loop_overlap`) and `mlx`
# (`event_loop_overlap_mlx`). Only the model forward is replaced, by a deterministic
# next-token function. At every step boundary (defined below) the suite records the
# scheduler's own state and checks the clauses. A failure names the clause and the
# field, not a downstream symptom.
#
# ## Words used in every notebook
#
# - **Loop**: one of SGLang's scheduler event loops. The torch loops `normal` and
#   `overlap` are the **reference**: they must satisfy every clause. `mlx` is the loop
#   under test.
# - **Workload**: a short scripted list of requests (prompt tokens, tokens to generate,
#   the loop iteration each arrives in) and server arguments (`data/workloads/*.toml`).
# - **Step** and **step boundary**: a *step* is one iteration of the scheduler loop. Its
#   *boundary* is its top, the entry of `Scheduler.ingest_requests`, before that
#   iteration's requests arrive. The suite records the scheduler's state there and checks
#   the clauses there: step `k` shows what iterations `0..k-1` left.
# - **Frames**: what a run records, as pandas tables: `steps` (one row per step
#   boundary), `launches` (one per launch), `requests` (one per request and step),
#   `slots`, `relay` and more. `contract_lib.run(workload, loop)` returns them.
# - **Launch**: one batch handed to the forward. A step can make zero, one or two.
#   A **fresh** launch went through `get_next_batch_to_run` and `prepare_for_decode`,
#   which allocate the next slot, write `req_to_token` and advance the counters. A
#   **chained** launch (MLX only, `_launch_chained`) is a decode built directly on the
#   previous launch's still-lazy output tokens, without that bookkeeping.
# - **`kv_computed`**: the ground truth, recorded at the model boundary: how many
#   positions of a request launched forwards have computed (or queued) KV for.
# - **`kv_committed_len`**, **`kv_allocated_len`**, **`seq_lens`**: the scheduler's own
#   counts of the same positions (committed to the request, allocated for it, in the
#   batch). **`owned_kv_len()`** is what a finished request hands to the radix cache,
#   bounded by `kv_committed_len`.
# - **Radix (prefix) cache**: SGLang's tree of token prefixes whose KV is kept after a
#   request finishes (`mem_cache/`). A later request whose prompt starts with a cached
#   prefix reuses that KV (`cached_tokens`) instead of computing it again.
# - **KV slot** and **request row**: the KV pool is an array of slots, one position's KV
#   each. `req_to_token` is a table with one **row** per live request
#   (`req_pool_idx`); entry `req_to_token[row, p]` names the slot holding position `p`'s
#   KV. Slot 0 is padding and never holds real KV. A finished request's row is handed to
#   the next request.
# - **`cache_protected_len`**: the length of the prefix a request shares with the radix
#   cache (its slots belong to the tree; clause 1 allows two requests the same slot there).
# - **Extend / prefill / decode / mixed batch**: a *prefill* computes a prompt's KV; SGLang
#   calls a prefill that continues a cached prefix an *extend* (the forward mode of both
#   is `extend`). A *decode* computes one new position per request. A *mixed* batch
#   (`--enable-mixed-chunk`) runs a prefill chunk and the running decodes together.
# - **Relay**: `future_map.output_tokens_buf[row]`, where an overlap loop publishes a
#   request's newest token so the next launch can read it before the previous one is
#   processed (clause 4).
# - **HRRN clock**: `Scheduler.processed_tokens_counter`, the number of tokens prefilled
#   so far; the `hrrn` scheduling policy reads it to age waiting requests (clause 6).
# - **Clause statuses**: `holds`; `violated`; **`violated-masked`** (clause 5: the
#   predicate gave the right answer only because another of its terms did);
#   **`not-exercised`** (the run never reached what the clause is about, e.g. nothing in
#   flight on `normal`); **`not-present`** (the release has none of the clause's fields
#   and nothing in it reads them); **`known upstream`** (violated exactly as a catalogued
#   upstream bug of `data/bugs.toml` predicts, step by step: reported, not a failure
#   unless `--strict-known`).
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
# This project adds two clauses and one field that the effects audit
# ([07](07-effects-audit.ipynb)) found beyond the RFC, checked by default
# (`contract_lib/contract/`, clauses 6 and 7 in `clocks.py` and `retired.py`; `check(frames, clauses="rfc")` checks the RFC's five only):
# clause 2 also covers `Req.decode_batch_idx`; **6 scheduling clocks advanced**
# (`processed_tokens_counter`, HRRN's clock); **7 request state retired** (the backend's
# per-request structures let go of released requests).
#
# `docs/contract.md` gives the exact check for each clause. Each check compares the
# scheduler's fields with a ground truth recorded at the model boundary, `kv_computed`
# above all.
#
# ## The bugs behind it
#
# The RFC counts four bugs in July 2026 that each hit a clause (a `TypeError` at startup,
# silent cache loss, silent wrong output, a segfault behind a flag pair) and a fifth
# clause that gives the right answer by accident. The suite replays the upstream bugs it
# catalogues in `data/bugs.toml`, each against the clause and field it breaks:

# %%
# %matplotlib inline
import contract_lib
from contract_lib import views
from contract_lib.campaigns.history import history_cells
from contract_lib.campaigns.saved_history import saved_status
from contract_lib.campaigns.status import status
from contract_lib.contract import check
from contract_lib.patches.catalog import bug_catalog
from contract_lib.sources.versions import release_spans

views.setup()

catalog = bug_catalog()
print(views.text_table(views.catalog_table(catalog)))

# %%
upstream = [bug for bug in catalog if "found by this project" not in bug["prs"][0]]
ours = [bug for bug in catalog if bug not in upstream]


def clauses(bugs: list[dict]) -> str:
    return ", ".join(map(str, sorted({bug["clause"] for bug in bugs})))


views.md(f"`data/bugs.toml` holds **{len(catalog)}** bugs: **{len(upstream)}** of SGLang's "
         f"history, against clauses {clauses(upstream)}, and **{len(ours)}** this project found, "
         f"against clauses {clauses(ours)}. Each clause's notebook starts with its bugs' cards.")

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
print(views.crash_summary(overlap))
print(views.crash_summary(mlx))
assert overlap.output_tokens() == mlx.output_tokens()
print("same tokens on both loops:", overlap.output_tokens() == mlx.output_tokens())
print(views.verdict_line(overlap))
print(views.verdict_line(mlx))

# %% [markdown]
# The tokens match, but the two loops do different things at each step. On the torch
# loop, every launch is a fresh `run_batch` forward. The batch it runs has been through
# `get_next_batch_to_run` → `prepare_for_decode`, which allocates the next slot, writes
# `req_to_token` and advances the counters. On MLX, once a request is decoding and no new
# prompt is waiting, the next step is **chained**: it is built directly on the previous
# step's still-lazy tokens (`_launch_chained`) and skips all of that bookkeeping.

# %%
views.launch_timeline(overlap, mlx)

# %% [markdown]
# One MLX step has **two launches**. `event_loop_overlap_mlx` builds the chained launch
# *before* it blocks on the previous one's tokens (that is how it keeps the device busy).
# If processing those tokens finishes a request, the chained launch's batch is out of
# date: the loop finalises it at once and then schedules a fresh batch through
# `get_next_batch_to_run`, in the same iteration. On this run:

# %%
per_step = mlx.launches.groupby("step")["launch"].count()
double = per_step[per_step > 1].index.tolist()
lines = []
for step in double:
    launched = mlx.launches[mlx.launches["step"] == step]
    done = mlx.requests[(mlx.requests["step"] == step + 1) & mlx.requests["finished"]
                        & ~mlx.requests["rid"].isin(
                            mlx.requests[(mlx.requests["step"] == step)
                                         & mlx.requests["finished"]]["rid"])]["rid"]
    kinds = " then ".join(f"a {'chained' if r.chained else 'fresh'} {r.mode} of {r.rids}"
                          for r in launched.itertuples())
    lines.append(f"step {step}: {kinds}; finished there: {', '.join(done) or 'none'}")
views.md("Steps with two launches: " + ("; ".join(lines) if lines else "none") + ".")

# %% [markdown]
# Checking the contract on both runs shows what the chained steps leave behind:

# %%
for frames in (overlap, mlx):
    print(views.run_label(frames))
    print(views.text_table(views.report_table(check(frames))))
    print()

# %% [markdown]
# ## The measured clause × loop table for the installed SGLang
#
# Every shipped workload (`contract_lib.workload_names()`) runs through every loop and is
# checked. Each cell shows the worst status over the workloads, and how many workloads
# show it. `known upstream` marks a violation that is exactly what a catalogued upstream
# bug (`data/bugs.toml`) predicts, step by step: reported, not a failure unless
# `--strict-known` (the torch loops' own HRRN clock and the MLX loop's that never moves). `violated-masked` means the
# reader got the right answer only because another term of the predicate did.
# `not-exercised` means the run never reached what the clause is about (the `normal` loop
# has nothing in flight). The `omni` column is a replacement loop from outside SGLang,
# sglang-omni's `OmniScheduler`, on its pinned SGLang 0.5.22 ([09](09-omni.ipynb)).

# %%
measured = status(loops=("normal", "overlap", "mlx", "omni"), progress=False)
print(measured.text())

# %% [markdown]
# On 0.5.23 the torch loops satisfy every RFC clause (clause 6 is a known upstream clock
# bug on every loop, [07](07-effects-audit.ipynb)), and so does clause 3 on MLX (fixed by
# #29217 and #32447). Clauses 1, 2 and 5 are open on MLX on every workload, and clause 4
# is open on MLX wherever a mixed batch reads the relay (`mixed-chunk`). The assertion
# below keeps that paragraph true:

# %%
cells = measured.per_run()
rfc = cells[cells["clause"] <= 5]
torch_bad = rfc[rfc["loop"].isin(["normal", "overlap"])
                & rfc["status"].isin(["violated", "violated-masked"])]
assert torch_bad.empty, torch_bad
on_mlx = rfc[rfc["loop"] == "mlx"].pivot(index="workload", columns="clause", values="status")
assert (on_mlx[3] == "holds").all()
assert on_mlx[[1, 2, 5]].isin(["violated", "violated-masked"]).all().all()
assert on_mlx.index[on_mlx[4] == "violated"].tolist() == ["mixed-chunk"]

# %% [markdown]
# ## The same table with the candidate fixes
#
# `fix-chained-accounting` (every chained step runs `prepare_for_decode`, the approach of
# #33874 and #40046) and `fix-idle-predicate` (`is_fully_idle` tests the MLX queue, #32934)
# are not merged. With both applied to every run:

# %%
patched = status(patch="fix-chained-accounting+fix-idle-predicate", progress=False)
print(patched.text())

# %%
cells = patched.per_run()
on_mlx = cells[(cells["loop"] == "mlx") & (cells["clause"] <= 5)].pivot(
    index="workload", columns="clause", values="status")
# Clauses 1 and 2 (and 5) hold on every shipped workload with the fixes; clause 4 stays
# open on mixed-chunk: nothing publishes the relay on MLX.
assert not on_mlx[[1, 2, 3, 5]].isin(["violated", "violated-masked"]).any().any()
assert on_mlx.index[on_mlx[4] == "violated"].tolist() == ["mixed-chunk"]

# %% [markdown]
# ## The contract across releases
#
# Every release this project supports, unpatched, read from saved runs of each
# (`data/history`, re-made by `scripts/make-history-fixtures`; `status --sglang
# 0.5.14..0.5.23` measures every shipped workload live). The MLX loop:

# %%
past = saved_status()
views.clause_history(past, loops=["mlx"])

# %%
cells = history_cells(past)
red = cells["status"].isin(["violated", "violated-masked"])
torch_red = cells[cells["loop"].isin(["normal", "overlap"]) & red
                  & cells["clause"].isin(range(1, 6))]
releases = list(dict.fromkeys(cells["sglang"]))
assert torch_red.empty, torch_red
mlx_cells = cells[(cells["loop"] == "mlx") & cells["clause"].isin(range(1, 8))]
always = [c for c, g in mlx_cells.groupby("clause") if g["status"].isin(
    ["violated", "violated-masked"]).all()]
moved = {c: release_spans(g.loc[g["status"] == "holds", "sglang"].tolist())
         for c, g in mlx_cells.groupby("clause") if (g["status"] == "holds").any()}
views.md(
    f"Over {releases[0]} to {releases[-1]}: the torch loops hold RFC clauses 1-5 on "
    f"every release (not shown; [12](12-history.ipynb) draws them). On MLX, clauses "
    f"{', '.join(map(str, always))} are red on every release; "
    + "; ".join(f"clause {c} holds only on {where}" for c, where in moved.items())
    + ". [12](12-history.ipynb) walks the releases bug by bug.")

# %% [markdown]
# ## Reading order
#
# One notebook per clause. Each one states the clause, names the SGLang code that reads
# the field, replays the July bug on the real code (red) and shows the fixed or current
# state (green, or red where 0.5.23 still has the bug):
#
# 1. [01 — slots recorded](01-slots.ipynb): `req_to_token` on chained decode (#30093, #30147). Open on MLX.
# 2. [02 — counters advanced](02-counters.ipynb): `seq_lens` / `kv_committed_len` lag, the radix reuse it costs (#30093, #33874, #40046), and what the loops do under memory pressure. Open on MLX.
# 3. [03 — step stamped](03-step-stamps.ipynb): `forward_ct` (#29217) and `launch_ts` (#32245 → #32447). Fixed; replayed with patches.
# 4. [04 — relays published or provably unread](04-relay.ipynb): the mixed-chunk relay read (#32591). Open on MLX.
# 5. [05 — in-flight predicates](05-idle-predicate.ipynb): `is_fully_idle` on the MLX queue (#32934). Open (masked) on MLX.
# 6. [06 — triage](06-triage.ipynb): a parameterised notebook for a new run (workload, loop, patch, runner, release): the verdict, the first violated clause and field, that clause's own view, a comparison with the unpatched run and the torch loops, and a step explorer.
# 7. [07 — effects audit](07-effects-audit.ipynb): what the MLX loop's steps do not write that the torch loops' do, found without being told; the fields no RFC clause covers, and this project's extension clauses.
# 8. [08 — wrong output](08-wrong-output.ipynb): clause 1 end to end with SGLang's real `MlxModelRunner` and a tiny local model: where the unrecorded positions' KV went on 0.5.21, 0.5.22 and 0.5.23, and the wrong tokens it caused.
# 9. [09 — omni](09-omni.ipynb): the same contract on a loop from outside SGLang, sglang-omni's `OmniScheduler`.
# 10. [10 — search](10-search.ipynb): searching for workloads that break a clause, rather than writing them by hand.
# 11. [11 — disaggregation](11-disaggregation.ipynb): one request across a PD prefill side and a decode side, what the fake transfer shares between them, and two bugs of the disaggregation paths' history replayed (#12839's kind found by clause 2's `finished_output`; #30175, which nothing here can show).
# 12. [12 — history](12-history.ipynb): every release from 0.5.14 to 0.5.23, unpatched, bug by bug: each July bug on the release that shipped it and the one that fixed it.
#
# Read 01 and 02 together, since they share a root cause: chained decode skips
# `prepare_for_decode`. 03 is the fixed clause and shows what a regression looks like.
# Start with 06 when you have a new patch to triage.
