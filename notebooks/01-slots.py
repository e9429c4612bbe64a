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
# # Clause 1: slots recorded (`req_to_token`)
#
# **The clause.** Take every live request (one that holds a `req_to_token` row and has
# not finished) and every position `p` whose KV a launched forward has computed
# (`p < kv_computed`). Then `req_to_token[row, p]` must name a real KV slot of that
# request. It must not be the padding slot 0, a slot the allocator holds as free, or a
# slot another live request holds. The one exception is a radix-shared prefix, where two
# requests hold the same slot at the same position inside their protected prefix.
#
# **Who writes it.** `prepare_for_decode` calls `alloc_for_decode`
# (`mem_cache/allocation.py`, `alloc_for_decode` / `alloc_for_decode_default`), which
# allocates the next slot and writes it to `req_to_token[row, position]`. The torch
# loops do this for every decode step. On MLX, a *chained* launch (`_launch_chained`,
# `hardware_backend/mlx/scheduler_mixin.py:191`) builds the next step on the previous
# step's lazy tokens and never reaches `prepare_for_decode`.
#
# **Who reads it (SGLang 0.5.23).**
# - `MlxModelRunner._sync_decode_kv_to_pool` (`hardware_backend/mlx/model_runner.py:843`)
#   reads `req_to_token[row, synced:current]` as pool slot ids and copies the MLX
#   per-request KV into the shared pool at those slots. It is called through
#   `release_request_row` (:871) from `MlxTpModelWorker.prepare_for_kv_cache_release`
#   when a request is released.
# - The radix cache (`mem_cache/unified_radix_cache.py`, `checkpoint`) keys the cached
#   prefix of a finished request by the slots in its row.
#
# **What goes wrong when it is stale** (#30093, #30147):
# - In a fresh row the entry is 0, so the decode KV lands in padding slot 0 and is lost
#   for reuse.
# - In a reused row the entry is a previous request's slot id, so the sync overwrites
#   another live request's KV. The result is a silent wrong output on a later radix hit.

# %%
# %matplotlib inline
import contract_lib
from contract_lib import views
from contract_lib.contract import check, violation_message

views.setup()

print(views.bug_card(1))

# %% [markdown]
# ## Three runs of `two-turn`
#
# The torch reference (`normal`), the MLX loop as shipped in 0.5.23, and the MLX loop with
# the candidate fix `fix-chained-accounting`. This fix follows #33874 and #40046 and is
# not merged: every chained continuation runs `prepare_for_decode`, gated on
# `check_decode_mem`.

# %%
normal = contract_lib.run("two-turn", "normal")
mlx = contract_lib.run("two-turn", "mlx")
fixed = contract_lib.run("two-turn", "mlx", patch="fix-chained-accounting")
for frames in (normal, mlx, fixed):
    print(views.crash_summary(frames))

# %% [markdown]
# ## Red: chained decode leaves `req_to_token` unwritten (still open on 0.5.23)
#
# This is not a replay: the installed 0.5.23 code violates the clause as shipped. The
# checker names the clause, the field, the step and the request:

# %%
report = check(mlx)
result = report.clauses[1]
print(f"clause 1 on {views.run_label(mlx)}: {result.status}, "
      f"{len(result.violations)} unrecorded (step, request, position) entries over all "
      f"requests, {(result.violations['rid'] == 'a').sum()} of them request a's")
print(views.wrap(violation_message(result.first())))

# %% [markdown]
# The grid below shows request `a`'s row over the steps of each run: one column per
# step, one cell per position. Cells below the black `kv_computed` line hold KV the
# forward has computed, so each must hold a real slot. On MLX, each chained step adds a
# position the scheduler never recorded (slot 0, in red, its slot id written in the
# cell). The dashed `kv_committed_len` line shows how far the scheduler thinks the row
# goes. The panel titles count request `a`'s entries only (one per step and computed
# position), so they are a part of the all-requests count printed above.

# %%
views.slot_grid(normal, mlx, fixed, rid="a")

# %% [markdown]
# One step shows a detail of the bug: the first fresh decode launch after a chain,
# because a new request arrived and broke the chain. The sentence below is computed from
# the run:

# %%
a = views.slot_rows(mlx).query("rid == 'a'")
launches = mlx.launches.sort_values("launch")
decodes = launches[launches["mode"] == "decode"]
after_chain = decodes["chained"].shift(fill_value=False) & ~decodes["chained"]
fresh = int(decodes.loc[after_chain, "step"].iloc[0])  # prepare_for_decode ran here
look = fresh + 1
before, at = (a[a["step"] == s].set_index("position") for s in (fresh, look))
new = at[(at["slot"] != 0) & (at["slot"] != before["slot"].reindex(at.index))]
zero = at.index[at["state"] == "slot 0"].tolist()
committed = int(mlx.requests.query("rid == 'a' and step == @fresh")["kv_committed_len"].iloc[0])
finish = int(mlx.requests.query("rid == 'a' and finished")["step"].min())


def fate(position: int) -> str:
    later = a[(a["position"] == position) & (a["step"] > look) & (a["state"] == "recorded")]
    if later.empty:
        return f"{position} stays at slot 0 until `a` finishes at step {finish}"
    first = later.iloc[0]
    return f"{position} gets slot {int(first['slot'])} at step {int(first['step'])}"


views.md(
    f"At step {fresh} `prepare_for_decode` ran once, for that fresh decode. By step {look} "
    f"it had written **{len(new)}** slot(s) into `a`'s row: "
    + ", ".join(f"slot {int(r.slot)} at position {p}" for p, r in new.iterrows())
    + f", at the position the counters pointed to (the committed bound at step {fresh} was "
    f"{committed}), not at the next position the forward would compute. At step {look} positions "
    f"{', '.join(map(str, zero))} still hold slot 0. Later: "
    + "; ".join(fate(p) for p in zero) + ". A position the counters reach again is "
    "recorded late; the ones they skip stay at slot 0.")

# %% [markdown]
# The text view of that step:

# %%
print(views.step_snapshot(mlx, look, "a", report=report))

# %% [markdown]
# **Where 0.5.23 stands.** The allocation half of #30093 is open: `_launch_chained` still
# does not call `prepare_for_decode`, so clause 1 is violated on every shipped workload
# (see the table in [00-overview](00-overview.ipynb)). 0.5.22 did change the *reader*.
# The sync now runs only at release (`release_request_row`) and is clamped to
# `owned_kv_len()`, which is bounded by `kv_committed_len`. So the unrecorded positions
# above the committed bound are no longer synced into slot 0. Instead they are never
# synced or inserted at all, which is the cache loss of clause 2
# ([02-counters](02-counters.ipynb)).
#
# *Model-free note:* these runs replace the model, so the MLX decode-KV pool sync never
# writes real KV here. This notebook shows the unrecorded positions, not the wrong output
# they lead to; [08-wrong-output](08-wrong-output.ipynb) runs the real `MlxModelRunner`
# and measures that output on 0.5.21, the release that shipped it.
#
# ## Green: the candidate fix records every position

# %%
for frames in (normal, fixed):
    result = check(frames).clauses[1]
    print(f"clause 1 on {views.run_label(frames)}: {result.status} ({result.note})")
print("KV pool conservation with the fix:",
      "balanced at every step" if check(fixed).pool.empty else "leaks")
