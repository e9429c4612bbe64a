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
# # Clause 1 end to end: the silent wrong output, on the release that shipped it
#
# [01-slots](01-slots.ipynb) shows the MLX loop leaving `req_to_token` unrecorded for
# every chained decode position. Those runs replace the model, so nothing reads the
# entries. This notebook runs the **real reader**: SGLang's own `MlxModelRunner`, on
# MLX's CPU backend, with a tiny random-weight Llama that mlx-lm builds locally (2 layers,
# 64 wide, seed 0, nothing downloaded). The runner keeps one contiguous KV cache per
# request and copies it into the shared `MlxAttentionKVPool` at the slot ids the
# scheduler wrote into `req_to_token`; a later request with a radix hit reads its prefix
# from those slots.
#
# **The reader, release by release.**
# - Through **0.5.21**, `MlxModelRunner._sync_decode_kv_to_pool` syncs a request's decode
#   KV up to its cache offset, unclamped. `MlxTpModelWorker` calls it for every active
#   request before each extend launch (`flush_all_decode_kv`), and `remove_request`
#   calls it when a request leaves the batch, through whatever row the runner last saw.
# - **0.5.22** (#30147's approach) syncs only at release, while the request still owns its
#   row, clamped to `owned_kv_len()` (`release_request_row`).
#
# **Four runs of `two-turn`**, all with the real runner: 0.5.21's own code (installed into
# `.cache/sglang/0.5.21`, no patch); 0.5.23 with the built-in `unclamped-sync` patch,
# which puts 0.5.21's three code points back; 0.5.23 as shipped; and 0.5.23 with the
# candidate fix `fix-chained-accounting`, which records every position. Every run is
# checked against **mlx-lm's own greedy generation** on the same model (its own KV cache,
# no SGLang). The torch loops stay model-free, so they are not compared here.

# %%
# %matplotlib inline

import contract_lib
from contract_lib import views
from contract_lib.campaigns.status import releases_status
from contract_lib.contract import check, kv_damage
from contract_lib.sources.tiny_model import (
    CONFIG,
    reference_outputs,
    tiny_model_dir,
    weights_digest,
)

views.setup()

print(views.bug_card(1))
print()
print(f"tiny model: {CONFIG['num_hidden_layers']} layers, hidden {CONFIG['hidden_size']}, "
      f"{CONFIG['num_key_value_heads']} KV heads, vocab {CONFIG['vocab_size']}; weights "
      f"sha256 {weights_digest(tiny_model_dir())} (seed 0)")

# %%
old = contract_lib.run("two-turn", "mlx", runner="real", sglang="0.5.21")
revert = contract_lib.run("two-turn", "mlx", runner="real", patch="unclamped-sync")
shipped = contract_lib.run("two-turn", "mlx", runner="real")
fixed = contract_lib.run("two-turn", "mlx", runner="real", patch="fix-chained-accounting")
runs = (old, revert, shipped, fixed)
labels = ["0.5.21", "0.5.23 + unclamped-sync", "0.5.23", "0.5.23 + fix"]
reference = reference_outputs("two-turn")
for frames, label in zip(runs, labels):
    print(f"{label:<24} {views.crash_summary(frames)}")
print("0.5.21 needs:", ", ".join(s for s in old.meta["shims"] if "backport" in s))

# %% [markdown]
# 0.5.21 cannot build a Scheduler on this stack as shipped: its `MlxModelRunnerStub`
# lacks the `logical_max_total_num_tokens` override that 0.5.22 added, so
# `alloc_memory_pool` reads a `kv_cache_configurator` the stub never sets
# (`AttributeError`, an upstream startup bug of 0.5.21's stub). The harness backports
# that one property (`backports.install_release_compat`); the sync code under test is
# 0.5.21's as shipped.
#
# ## The slot picture
#
# The scheduler side is the same on every release: request `a`'s row over the steps,
# with the chained positions above the committed bound left at slot 0 (red). Only the
# fix records them.

# %%
views.slot_grid(old, shipped, fixed, rid="a", labels=[labels[0], labels[2], labels[3]])

# %% [markdown]
# Where `a`'s KV went in the pool. One row per write (the step it happened in, and the
# runner path), one cell per position, labelled with the slot id:
#
# - **0.5.21, step 5**: `c` arrives, and the extend-time flush syncs `a`'s positions
#   16-19 through its row. Position 16 holds slot 29; positions 17-19 were never
#   recorded, so their KV goes to **slot 0**. The runner's synced offset is now 20, so
#   the slots the scheduler records later for positions 17 and 18 (41 and 44) are never
#   written.
# - **0.5.21, step 16**: `a` has finished and its row has been handed to the second turn
#   `a2`. `a2`'s prefill is the next extend launch, and its flush still syncs `a`
#   (the runner never removed it) through the old row: positions 20-27 go into slots
#   46-53, **`a2`'s own slots**, at the same positions.
# - **0.5.23** syncs at release only, up to `owned_kv_len()` = 19: the chained positions
#   19-27 are dropped (hatched). Their KV is lost, not misplaced.
# - **0.5.23 + fix**: every position was recorded, and the release writes all of them.
#
# The positions and slots of this list are those of the runs, checked here:

# %%
syncs = old.kv_syncs.query("rid == 'a'").set_index(["step", "kind", "position"])["slot"]
assert syncs[5, "flush"].to_dict() == {16: 29, 17: 0, 18: 0, 19: 0}
recorded = views.slot_rows(old).query("rid == 'a' and state == 'recorded'")
assert recorded.groupby("position")["slot"].last()[[17, 18]].tolist() == [41, 44]
assert not old.kv_syncs.query("slot in (41, 44)")["rid"].eq("a").any()
assert syncs[16, "flush"].to_dict() == dict(zip(range(20, 28), range(46, 54)))
assert set(old.kv_syncs.query("step == 16 and rid == 'a'")["owner"]) == {"a2"}
assert shipped.kv_syncs.query("rid == 'a' and kind == 'dropped'")["position"].tolist() == list(
    range(19, 28))

# %%
views.kv_writes(old, shipped, fixed, rid="a", labels=[labels[0], labels[2], labels[3]])

# %%
print("0.5.21: writes through unrecorded or foreign slots, per step, request and path")
print(views.text_table(views.damage_table(old)))

# %% [markdown]
# ## The pool contents at the end
#
# For each request, the slots the radix tree serves for its tokens, compared with the KV
# mlx-lm's own model computes for the same tokens, layer by layer: `ok`, `zero` (never
# written) or `wrong`. The black bar is `a2`'s `cached_tokens`: positions left of it are
# the radix hit its prefill read from the pool.

# %%
views.kv_pool_verdicts(*runs, rid="a2", labels=labels)

# %%
for frames, label in zip(runs, labels):
    print(label)
    print(views.text_table(kv_damage.summary_table(frames)))
    print()

# %%
a2_cached = {label: int(f.requests.query("rid == 'a2'")["cached_tokens"].iloc[-1])
             for f, label in zip(runs, labels)}
pool_a2 = old.kv_pool.query("rid == 'a2'")
views.md(f"On 0.5.21, `a2`'s radix hit covers **{a2_cached['0.5.21']}** positions "
         f"(0.5.23: {a2_cached['0.5.23']}, with the fix: {a2_cached['0.5.23 + fix']}); "
         f"its pool slots end {', '.join(f'{n} {v}' for v, n in pool_a2['verdict'].value_counts().sort_index().items())}.")

# %% [markdown]
# On 0.5.21, as computed above, `a2`'s radix hit covers 19 positions. Two of them, 17
# and 18, sit in slots 41 and 44, which nothing ever wrote: the step-5 flush sent their
# KV to slot 0. `a2`'s prefill attends over those zeros, so every position it computes
# from there on (19-31) holds other KV than mlx-lm's. Its last position (32) is zero: 0.5.21 writes decode KV
# only at the next extend launch or when the request leaves the batch, and neither
# happened before the run ended. The overwrite of slots 46-53 at step 16 happened just
# before `a2`'s own prefill wrote them again, so here it is masked. On 0.5.23 and with
# the fix every matched slot is `ok`. Checked on the runs:

# %%
verdicts = pool_a2.set_index("position")["verdict"]
assert a2_cached["0.5.21"] == 19 and verdicts[[17, 18]].eq("zero").all()
assert pool_a2.set_index("position")["slot"][[17, 18]].tolist() == [41, 44]
assert verdicts[19:31].eq("wrong").all() and verdicts[32] == "zero" and verdicts.index.max() == 32
assert all((f.kv_pool.query("rid == 'a2'")["verdict"] == "ok").all() for f in (shipped, fixed))

# %% [markdown]
# ## The diverging tokens
#
# The same prompts through mlx-lm's greedy generation, then each run. A token that
# differs from mlx-lm's is in brackets.

# %%
print(views.text_table(views.token_table(*runs, reference=reference, labels=labels)))

# %%
reference_a2 = reference["a2"]
old_a2 = old.output_tokens()["a2"]
wrong_tokens = sum(x != y for x, y in zip(old_a2, reference_a2))
assert old_a2[0] == reference_a2[0] and wrong_tokens == len(reference_a2) - 1
assert old.status == "finished" and check(old).pool.empty  # no crash, no pool leak
assert {rid for rid, tokens in reference.items() if old.output_tokens().get(rid) != tokens} == {"a2"}
views.md(f"On 0.5.21, **{wrong_tokens} of {len(reference_a2)}** of `a2`'s tokens differ "
         "from mlx-lm's; every other request's tokens match.")

# %% [markdown]
# `a`, `b` and `c` are right everywhere: each decodes from its own contiguous cache,
# which the pool sync never touches. `a2` is the request that reads the pool, and on
# 0.5.21 its tokens after the first are wrong (counted above). Nothing fails: no
# exception, no pool leak (SGLang's conservation law balances), only different tokens.
# That is the "silent wrong
# output" of #30093.
#
# The revert patch replays 0.5.21's run exactly on 0.5.23's code:

# %%
print("0.5.21 unpatched == 0.5.23 + unclamped-sync:", views.same_tables(old, revert))

# %% [markdown]
# ## The three releases side by side
#
# Every shipped workload through the MLX loop with the real runner, on each release. The
# clause rows measure the scheduler's bookkeeping, which the three releases share: clause
# 1 is violated on all of them. The last row measures the reader: whether a run wrote KV
# through slot 0 or into another live request's slots, or left a radix-matched slot zero
# or wrong.

# %%
side_by_side = releases_status(["0.5.21", "0.5.22", "0.5.23"], runner="real",
                               progress=False)
print(side_by_side.text())

# %% [markdown]
# What the damage is, per workload, on 0.5.21 (positions; wrong output = requests whose
# tokens differ from mlx-lm's). A workload whose outputs are scripted or cut (`emit`, a
# stop list, an abort) has no mlx-lm reference, and one the MLX loop refuses (a page size
# its allocator cannot serve) does not run: both are listed under the table.

# %%
damage, left_out = views.damage_by_workload("0.5.21")
print(views.text_table(damage))
for workload, why in left_out.items():
    print(f"left out: {workload}: {why}")

# %%
zero_everywhere = bool((damage["zero"] > 0).all())
into_slot0 = int((damage["into slot 0"] > 0).sum())
foreign = damage.loc[damage["into another live request"] > 0, "workload"].tolist()
views.md(
    f"**Where things stand.** 0.5.21 shipped the damage. On "
    f"{'every' if zero_everywhere else 'some'} workload above its pool ends with "
    "radix-matched slots that were never written (`zero`): they wait for a sync that only "
    "the next extend launch or a removal would do. On "
    f"**{into_slot0} of the {len(damage)}**, chained positions' KV goes into the padding "
    f"slot. On {', '.join(f'`{w}`' for w in foreign) or 'none'}, a sync also writes into "
    "another live request's slots and the second turn emits wrong tokens.")

# %% [markdown]
# The one workload with a radix hit on a reused row is `two-turn`. 0.5.22 clamped the
# reader, which
# turns the damage into the cache loss of clause 2 ([02-counters](02-counters.ipynb)):
# `a2` reuses only the committed prefix (the `cached_tokens` counted above) and
# recomputes the rest. The writer side,
# recording every chained position (#30093's allocation half, `fix-chained-accounting`),
# is still open on 0.5.23; with it the clamp has nothing left to drop and `a2` reuses
# everything `a` computed.
