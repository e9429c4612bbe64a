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
# (`contract_lib/child/effects.py`). Two kinds of writes are not *effects* and are set aside:
# assigning a value that is already there (the same object, or an equal number), and
# building a new object (`ScheduleBatch.copy()` for the batch every overlap loop hands to
# `process_batch_result`, new `Req`s).
#
# Then each field's **cadence** is measured per loop, over the decode launches (where
# chained and fresh MLX launches differ): changed at every decode launch, only at fresh
# ones (when the MLX chain breaks), at some, or never. A **finding** is a field that both
# torch loops change at every decode launch and the MLX loop does not
# (`contract_lib/campaigns/audit.py`). For each finding the audit greps the installed SGLang for
# the code that reads the field, and says whether a shipped clause already checks it.

# %%
# %matplotlib inline
from contract_lib import views
from contract_lib.campaigns.audit import audit

views.setup()

# %% [markdown]
# ## The findings on `two-turn`, SGLang 0.5.23

# %%
result = audit("two-turn", progress=False)
print(views.text_table(views.audit_table(result)))

# %%
views.audit_cadences(result)

# %%
from contract_lib.contract import EXTENDED_FIELDS, EXTENSION_CLAUSES

findings = result.findings
extended = {field for fields in EXTENDED_FIELDS.values() for field in fields}
beyond = (findings["clause"].isna() | findings["clause"].isin(list(EXTENSION_CLAUSES))
          | findings["field"].isin(extended))
views.md(f"**{int((~beyond).sum())} of the {len(findings)} findings** are fields the RFC's "
         f"clauses check; **{int(beyond.sum())}** are not covered by any RFC clause "
         f"({int(findings['clause'].isna().sum())} by no clause at all).")

# %% [markdown]
# The allocation and `req_to_token[]` writes are clause 1. `seq_lens*`,
# `kv_committed_len` and `kv_allocated_len` are clause 2. All of them come from the same
# skipped call: `_launch_chained` never reaches `prepare_for_decode` →
# `alloc_for_decode`, so they change only when the chain breaks (orange), or, for the
# allocation-side ones, only at some launches (salmon). That the audit finds them
# without being told is the check on the audit itself.
#
# The findings beyond the RFC are the reason for this project's extensions. Here is
# where each one is written and read, and the clause that now covers it:

# %%
print(views.beyond_rfc_text(result))

# %% [markdown]
# ### `Scheduler.processed_tokens_counter`: the HRRN aging axis
#
# `run_batch` advances it by `batch.extend_num_tokens` before every forward
# (`managers/scheduler.py:4633`). The `hrrn` schedule policy reads it as its clock: a
# request snapshots it on arrival (`req.arrival_processed_tokens`, :3495), and its
# priority grows with `processed_tokens - arrival_processed_tokens`
# (`managers/schedule_policy.py:469-489`, fed at `managers/scheduler.py:4132`). The frames record the counter
# at every step boundary; on `two-turn`:

# %%
import contract_lib

clock_runs = [contract_lib.run("two-turn", loop) for loop in ("normal", "mlx")]
for frames in clock_runs:
    table = views.clock_table(frames)
    print(f"{views.run_label(frames)}: counter per step "
          f"{' '.join(map(str, table['processed_tokens_counter'].head(8)))} ...; "
          f"advances {' '.join(map(str, table['advance'].dropna().astype(int).head(8)))} ...")
torch_clock, mlx_clock = (views.clock_table(f) for f in clock_runs)
first_prefill = int(torch_clock.loc[torch_clock["prefilled"] > 0, "prefilled"].iloc[0])
only_decode = clock_runs[0].launches.groupby("step")["mode"].agg(lambda m: set(m) == {"decode"})
decode_steps = torch_clock[torch_clock["step"].map(only_decode).eq(True)
                           & torch_clock["advance"].notna()]
assert (decode_steps["advance"] > 0).any()  # decode steps advance the torch clock
assert (mlx_clock["processed_tokens_counter"] == 0).all()  # the MLX clock never moves

# %%
views.scheduling_clock(*clock_runs)

# %% [markdown]
# The MLX loop never calls `run_batch` and never advances the counter. What HRRN then
# does follows from its sort key in the installed SGLang (printed from the source, not
# copied):

# %%
import importlib.util
from pathlib import Path

policy = Path(importlib.util.find_spec("sglang").submodule_search_locations[0],
              "srt/managers/schedule_policy.py").read_text().splitlines()
start = next(i for i, line in enumerate(policy) if "def _key(r: Req)" in line)
print("\n".join(policy[start:start + 11]))

# %%
views.md(
    f"On MLX the clock stays at {int(mlx_clock['processed_tokens_counter'].max())}, so "
    "`waited_tokens` is 0 for every waiting request, `ratio_delta` is 0, and the key is "
    "`(0, rid)`: **HRRN degenerates to ordering by request id** (not by size; requests "
    "with nothing to prefill still go first), and no waiting request ever ages. On the "
    f"torch loop the counter advances at decode steps too: after the first prefill of "
    f"{first_prefill} tokens, the {len(decode_steps)} decode-only steps advance it by "
    + ", ".join(f"{v} ({n} steps)" for v, n in
                decode_steps["advance"].astype(int).value_counts().sort_index(
                    ascending=False).items())
    + ", although the comment above that line says \"Decode / prebuilt batches "
    "contribute 0\": `prepare_for_decode` never resets `extend_num_tokens`, so each decode "
    "step adds again the token count of the prefill the running batch came from. The torch loops over-age waiting "
    "requests and the MLX loop does not age them at all: the two loops disagree in "
    "opposite directions.")

# %% [markdown]
# **This is now clause 6, "scheduling clocks advanced"** (`contract_lib/contract/clocks.py`,
# an extension of the RFC's five clauses, checked by default): at every step boundary
# the clock has advanced by exactly the tokens the previous step's launches prefilled.
# The torch loops fail it exactly as the catalogued upstream bug
# `processed-tokens-counter` predicts (each batch's stale `extend_num_tokens`), and the
# MLX loop at every prefill (`mlx-clock`): both are reported as `known upstream`, not as
# failures unless `--strict-known`.
#
# ### `Req.decode_batch_idx`: the per-request decode step count
#
# `prepare_for_decode` increments it for every request in the batch
# (`managers/schedule_batch.py:3782-3783`). Readers:
# - SWA eviction (`schedule_batch.py:4087`, `decode_batch_idx >= 1`).
# - The SWA retain window, which releases a request's prefill SWA lock once
#   `decode_batch_idx >= retain_window` (`schedule_batch.py:4103`).
# - Mamba state tracking, as the lookahead `req.decode_batch_idx -
#   batch.mamba_decode_batch_idx_cpu[i]` (`batch_result_processor.py:1391`, :1666) and the
#   untracked-batch marker (:1413).
#
# On MLX chained decode it lags behind the real number of decode steps, exactly like
# `seq_lens`. The SWA retain window therefore closes late, by the chain length, and
# keeps prefix SWA locked longer than intended. These readers only run for SWA and hybrid
# (mamba) models, which this model-free suite does not exercise. So the lag is measured
# here, but its damage is not.
#
# **This is now part of clause 2** (`contract_lib/contract/counters.py`): "counters advanced"
# checks `Req.decode_batch_idx` beside `seq_lens` and `kv_committed_len` (expected:
# `kv_computed - kv_prefilled`); same root cause, same fix (`fix-chained-accounting`).
#
# ## The extension clauses, measured
#
# Clause 7, **request state retired**, comes from the backend's own per-request
# structures (the MLX worker's and runner's dicts keyed by request id): a released
# request must leave none behind once a later launch has completed. Every shipped
# workload on every loop, with the RFC's clauses and the extensions:

# %%
from contract_lib.campaigns.status import status
from contract_lib.contract import check

extended = status(progress=False)
print(extended.text())

# %% [markdown]
# Under memory pressure the MLX loop keeps per-request state for requests the scheduler
# has released (clause 7), shown against the torch loop and the candidate fix:

# %%
pressure = [contract_lib.run("memory-pressure", "normal"),
            contract_lib.run("memory-pressure", "mlx"),
            contract_lib.run("memory-pressure", "mlx", patch="fix-chained-accounting")]
for frames in pressure:
    retired = check(frames).clauses[7]
    print(f"clause 7 on {views.run_label(frames)}: {retired.status}, "
          f"{len(retired.violations)} violations")

# %%
views.retired_lanes(*pressure)

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
