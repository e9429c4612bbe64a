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
# # Clause 2: counters advanced (`seq_lens`, `kv_committed_len`, `kv_allocated_len`)
#
# **The clause.** For every live request, each of the three counters equals
# `kv_computed`, the number of positions whose KV the forward has computed or queued. The
# torch overlap loop runs one step ahead, and both its counters and `kv_computed` include
# that in-flight step, so that lead is the reference, not a violation.
#
# **Who writes them.** `prepare_for_decode` (`managers/schedule_batch.py`) advances
# `seq_lens`. `alloc_for_decode_default` (`mem_cache/allocation.py`) does
# `kv_allocated_len += 1; kv_committed_len += 1`. As with clause 1, a chained MLX launch
# skips both.
#
# **Who reads them (SGLang 0.5.23).**
# - `release_kv_cache` (`mem_cache/common.py:400`) checkpoints a finished request into
#   the radix tree with `tree_cache.checkpoint(req, up_to=req.owned_kv_len())` (:431).
#   `owned_kv_len()` (`managers/schedule_batch.py:1552`) is bounded by
#   `kv_committed_len`.
# - `check_decode_mem` (`managers/schedule_batch.py:3432`, called by
#   `prepare_for_decode`) and retraction budget memory on them.
#
# **What goes wrong when they lag.** The finished request is inserted into the radix tree
# only up to the lagging bound, so the next turn of the conversation computes again what
# was already computed. This is silent cache loss. #40046 measured it on an M4: "a
# 40-token continuation reused only 9 cached tokens instead of 39". The counters never
# catch up: the next fresh `prepare_for_decode` adds one, however long the chain was.

# %%
# %matplotlib inline
import contract_lib
from contract_lib import views
from contract_lib.contract import check, violation_message

views.setup()

print(views.bug_card(2))

# %% [markdown]
# ## Four runs of `two-turn`
#
# The two torch loops, MLX as shipped, and MLX with the candidate fix
# `fix-chained-accounting` (the approach of #33874 and #40046, not merged).

# %%
normal = contract_lib.run("two-turn", "normal")
overlap = contract_lib.run("two-turn", "overlap")
mlx = contract_lib.run("two-turn", "mlx")
fixed = contract_lib.run("two-turn", "mlx", patch="fix-chained-accounting")
for frames in (normal, overlap, mlx, fixed):
    print(views.crash_summary(frames))

# %% [markdown]
# ## Red: the counters stop on every chained step (still open on 0.5.23)
#
# As for clause 1, this is the shipped code, not a replay. On 0.5.23, `_launch_chained`
# still lacks `prepare_for_decode`:

# %%
report = check(mlx)
result = report.clauses[2]
print(f"clause 2 on {views.run_label(mlx)}: {result.status}, {len(result.violations)} "
      "lagging counters")
print(views.wrap(violation_message(result.first())))

# %% [markdown]
# The counters of request `a` over the run, against `kv_computed`. On the torch loop all
# four lines coincide. On MLX the counters stay flat through every chained step and move
# by one when the chain breaks. The shaded gap is KV that has been computed but not
# committed. (The three counters are nudged a quarter position apart so that lines
# that coincide stay visible.)

# %%
views.counter_drift(normal, mlx, fixed, rid="a")

# %% [markdown]
# The same counters against the tokens `a` has emitted rather than against steps: the
# torch loop and MLX take different numbers of steps, but emit the same tokens, so this
# lines the runs up token by token.

# %%
views.counter_drift(normal, mlx, fixed, rid="a", x="emitted")

# %% [markdown]
# ## The cost: radix reuse of the second turn
#
# When `a` finishes, `release_kv_cache` inserts its positions into the radix tree up to
# `owned_kv_len()`, so at most `kv_committed_len` of them. The second turn `a2` starts
# with `a`'s prompt and output. In the ideal case it reuses every position `a` computed:
# its prompt and output, less one. The last output token is sampled but never fed back,
# so its KV is never computed. On this run:

# %%
a_end = normal.requests.query("rid == 'a'").iloc[-1]
ideal = int(a_end["prompt_len"]) + int(a_end["emitted"]) - 1
views.md(f"prompt ({int(a_end['prompt_len'])}) + output ({int(a_end['emitted'])}) - 1 = "
         f"**{ideal}** positions `a2` could reuse.")

# %%
runs = (normal, overlap, mlx, fixed)
print(views.text_table(views.radix_reuse_table(*runs, rid="a2")))

# %%
views.radix_reuse(*runs, rid="a2")

# %% [markdown]
# What each run reuses, and why the fixed MLX run can reuse one more than the torch
# loops, computed from the table above:

# %%
reuse = views.radix_reuse_table(*runs, rid="a2").set_index("run")["cached_tokens"]
torch_reuse, mlx_reuse, fixed_reuse = (int(reuse[views.run_label(f)])
                                       for f in (normal, mlx, fixed))
a_mlx = mlx.requests.query("rid == 'a' and finished").iloc[0]
computed, committed = int(a_mlx["kv_computed"]), int(a_mlx["kv_committed_len"])
assert int(reuse[views.run_label(overlap)]) == torch_reuse == ideal
assert mlx_reuse == committed  # the lagging committed bound
assert computed == ideal + 1 and fixed_reuse == computed  # the chain ran one step ahead
views.md(
    f"`a` finished on MLX with **{computed}** positions computed and **{committed}** "
    f"committed (the counter figure above): **{computed - committed}** chained positions "
    f"never committed. So `a2` reuses **{mlx_reuse}** tokens where the torch loops reuse "
    f"**{torch_reuse}**, and computes the other **{torch_reuse - mlx_reuse}** again. The "
    f"last of the {computed - committed} is the position of `a`'s last emitted token: the "
    "MLX chain computed its KV one step ahead (the lookahead launch made before the finish "
    f"was seen), which the torch loops never compute. With the fix MLX commits all "
    f"{computed} and reuses **{fixed_reuse}** ({fixed_reuse - torch_reuse:+d} against the "
    "torch loops): the finish-during-chain over-commit raised in #33874's review. Whether "
    "SGLang's own pool conservation law (`InvariantChecker`) still balances:")

# %%
for frames in (mlx, fixed):
    result = check(frames).clauses[2]
    pool = check(frames).pool
    print(f"{views.run_label(frames)}: clause 2 {result.status}; KV pool "
          f"{'balanced at every step' if pool.empty else f'leaks at {len(pool)} steps'}")

# %% [markdown]
# ## Under memory pressure: the loop that does not count does not retract
#
# The RFC says the retraction budget stays self-consistent on MLX because chained steps
# never allocate. The `memory-pressure` workload tests what that costs: a pool of 128
# slots, two requests decoding when two more arrive, 192 positions needed in all. Per
# step, the positions the live requests have computed (grey) against what the scheduler
# accounts for (blue) and the pool size (dashed); a dotted line marks a retraction.

# %%
pressure = [contract_lib.run("memory-pressure", "normal"),
            contract_lib.run("memory-pressure", "mlx"),
            contract_lib.run("memory-pressure", "mlx", patch="fix-chained-accounting")]
for frames in pressure:
    table = views.memory_table(frames)
    print(f"{views.run_label(frames):<30} retractions {int(table['retractions'].iloc[-1])}, "
          f"peak computed {int(table['computed'].max())} of a {int(table['pool'].iloc[0])}-slot "
          f"pool, peak accounted {int(table['accounted'].max())}")

# %%
views.memory_pressure(*pressure)

# %%
torch_p, mlx_p, fixed_p = (views.memory_table(f) for f in pressure)
assert torch_p["retractions"].iloc[-1] > 0 and (torch_p["computed"] <= torch_p["pool"]).all()
assert mlx_p["retractions"].iloc[-1] == 0 and (mlx_p["computed"] > mlx_p["pool"]).any()
assert fixed_p["retractions"].iloc[-1] == torch_p["retractions"].iloc[-1]
views.md(
    f"The torch loop retracts {int(torch_p['retractions'].iloc[-1])} times and never computes "
    f"more positions than the pool has slots. MLX never retracts: its live requests reach "
    f"**{int(mlx_p['computed'].max())}** computed positions in a {int(mlx_p['pool'].iloc[0])}-slot "
    f"pool while the scheduler accounts for {int(mlx_p['accounted'].max())}, because "
    "`check_decode_mem` runs in `prepare_for_decode`, which chained steps skip. With "
    f"`fix-chained-accounting` MLX retracts like torch ({int(fixed_p['retractions'].iloc[-1])} "
    "times). This departs from the RFC's text (\"the measured cost is radix truncation, "
    "not a memory pressure miscalculation\"): under pressure the lag is also a memory "
    "miscalculation. Model-free, the MLX per-request caches grow past the pool unseen; "
    "on a device they would use memory the scheduler believes free.")

# %% [markdown]
# **Where 0.5.23 stands:** open. #30147 (the 0.5.22 sync clamp) bounds the *reader* by
# the committed count but does not advance it. #33874 was closed and #40046 is open.
# `fix-chained-accounting` turns clauses 1 and 2 green on every shipped workload: the
# status table of the patched runs in [00-overview](00-overview.ipynb) shows it, and an
# assertion there keeps that sentence true.
