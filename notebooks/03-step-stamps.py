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
# # Clause 3: step stamped (`forward_ct`, `forward_iter`, `launch_ts`)
#
# **The clause.** Every launch advances `forward_ct` by exactly one. The batch that
# `process_batch_result` receives for that launch carries `forward_iter` equal to that
# launch's `forward_ct`, and a `launch_ts` that is set, is the stamp the batch had at its
# launch, increases from launch to launch, and is a stamp of the loop's clock
# (`time.monotonic()`) taken at the launch, between two step boundaries.
#
# **Who writes them.** On the torch loops, `run_batch` does. On MLX,
# `_prepare_mlx_launch` (`hardware_backend/mlx/scheduler_mixin.py:92`) mirrors
# `run_batch`'s launch boundary for fresh and chained launches alike:
# `forward_ct += 1`, `forward_iter = forward_ct`, `launch_ts = time.monotonic()`, then
# the profiler predicate.
#
# **Who reads them (SGLang 0.5.23).**
# - The watchdog (`managers/scheduler_components/invariant_checker.py:494`) is built with
#   `get_counter=lambda: scheduler.forward_ct` (:520). It fires when the counter stops
#   moving while a batch is active.
# - The profiler: `_profile_batch_predicate`
#   (`managers/scheduler_components/profiler_manager.py:413`) stops step-bounded
#   profiling when `forward_ct` reaches its target.
# - `Scheduler._record_step_counters` (`managers/scheduler.py:5120`) reads
#   `forward_iter` and subtracts `launch_ts` for the busy-time counters.
#
# **Where this departs from the RFC.** The RFC also names "the SWA eviction cadence" as a
# reader of these stamps. On 0.5.23, `ScheduleBatch._swa_eviction_trigger`
# (`managers/schedule_batch.py:4047`) reads `forward_iter` only on AMD's FlyDSL MegaMoE
# path (`forward_iter % eviction_interval`); everywhere else SWA eviction is gated on each
# request's tokens (`seqlen`), not on an iteration counter. The cadence reader moved after
# the RFC's anchor commit, so it is not listed above. The per-request decode count SWA
# reads instead, `Req.decode_batch_idx`, is a counter, and this project checks it under
# clause 2 (see [07-effects-audit](07-effects-audit.ipynb)).
#
# **What goes wrong when they are stale.**
# - A `forward_ct` that never moves means step-bounded profiling never stops. Under Metal
#   capture, the 300 s watchdog then SIGQUITs the server (#29217, June).
# - A missing `launch_ts` is a `TypeError` on the first processed batch. The warmup
#   kills the scheduler at startup, and `/health_generate` stays green (#32245, fixed by
#   #32447 in July).
#
# **Status on 0.5.23: fixed.** The installed code satisfies the clause. The bugs are
# replayed below with two built-in patches that remove exactly the line each bug lacked:
# `no-forward-ct` and `no-launch-ts`.

# %%
# %matplotlib inline
import contract_lib
from contract_lib import views
from contract_lib.contract import check, violation_message

views.setup()

print(views.bug_card(3))

# %% [markdown]
# ## Three runs of `two-turn` on MLX, and the torch reference

# %%
normal = contract_lib.run("two-turn", "normal")
mlx = contract_lib.run("two-turn", "mlx")
no_ct = contract_lib.run("two-turn", "mlx", patch="no-forward-ct")
no_ts = contract_lib.run("two-turn", "mlx", patch="no-launch-ts")
for frames in (normal, mlx, no_ct, no_ts):
    print(views.crash_summary(frames))

# %% [markdown]
# ## Green: 0.5.23 stamps every launch, chained ones included
#
# The first launches of the shipped MLX loop. The chained ones (column `chained`)
# advanced `forward_ct` by one like the fresh ones, and the batch `process_batch_result`
# received carries the matching `forward_iter` and a set `launch_ts`. `launch_ts` is shown as set / None
# only, because it is a wall-clock value.

# %%
for frames in (normal, mlx):
    print(f"clause 3 on {views.run_label(frames)}: {check(frames).clauses[3].status}")
print()
stamps = views.stamps_table(mlx)
print(views.text_table(stamps.head(6)))
assert stamps.head(6)["chained"].any()
assert (stamps["forward_ct"] == stamps["expected_ct"]).all()
assert (stamps["forward_iter"] == stamps["forward_ct"]).all()
assert (stamps["launch_ts"] == "set").all()

# %% [markdown]
# ## Red, replay of #29217: the MLX launch without `forward_ct += 1`
#
# The patch removes the counter advance and the profiler call from `_prepare_mlx_launch`.
# `forward_iter` is still stamped, from the stale counter, because 0.5.23's
# `_record_step_counters` would raise on a missing one. That way the replay isolates
# `forward_ct`. The run finishes with the same tokens, and only the checker notices:

# %%
report = check(no_ct)
print(f"clause 3 on {views.run_label(no_ct)}: {report.clauses[3].status}, "
      f"{len(report.clauses[3].violations)} launches")
print(views.wrap(violation_message(report.clauses[3].first())))
print("same tokens as unpatched:", no_ct.output_tokens() == mlx.output_tokens())

# %% [markdown]
# ## Red, replay of #32245: the MLX launch without `launch_ts`, a recorded crash
#
# The patch removes `batch.launch_ts = time.monotonic()`. The first batch reaches
# `_record_step_counters`, and the scheduler dies with the July `TypeError`. The harness
# keeps every frame taken before the crash, so the checker can still say which clause
# and field caused it. Here is the report of the crashed run: clause 3, `launch_ts`, at
# the step where `process_batch_result` received the batch.

# %%
print(views.crash_summary(no_ts))
print()
print(check(no_ts).text())

# %% [markdown]
# The three MLX runs, launch by launch. The counter must follow the dashed diagonal, the
# received `forward_iter` (×) must sit on the counter, and the lane below must be all
# "set". Under `no-forward-ct` the counter stays at 0. Under `no-launch-ts` the run
# crashes on its first processed batch.

# %%
views.step_stamps(mlx, no_ct, no_ts)
