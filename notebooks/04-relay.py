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
# # Clause 4: relays published or provably unread (`future_map.output_tokens_buf`)
#
# **The clause.** The overlap scheduler hands each request's latest sampled token to its
# next forward through a relay buffer, `future_map.output_tokens_buf` (one row per
# request row). Every read of the relay by `resolve_forward_inputs` must see the value
# the loop last published to that row, for that request's latest token. A loop that
# never reads the relay satisfies the clause: it is provably unread.
#
# **Who writes it.** Only the torch branch of `run_batch`: `_relay_forward_payload`
# (`managers/scheduler.py:4965`) calls `FutureMap.stash` after the forward. The MLX loop
# never does.
#
# **Who reads it (SGLang 0.5.23).** `resolve_forward_inputs`
# (`managers/overlap_utils.py:113`) reads it in two places:
# - a decode batch without `input_ids` gathers `output_tokens_buf[req_pool_indices]`
#   (`overlap_utils.py:144`);
# - a **mixed** batch gathers `output_tokens_buf[mix_running_indices]` for its decode
#   lanes (`overlap_utils.py:131`) and concatenates them after the prefill ids with `torch.cat`.
#
# On MLX a pure decode batch never reaches the relay, because `_finalize_mlx_pending_job`
# sets `input_ids` from the finished step. A mixed batch does reach it: with
# `--enable-mixed-chunk` and `--chunked-prefill-size`, a long prompt that arrives while
# another request decodes is prefilled in chunks, each mixed with the running decode.
#
# **What goes wrong.** The mixed batch feeds never-written memory into `input_ids`. On
# MPS the `torch.cat` segfaults the scheduler (exit -11), which is #32591, the "segfault
# behind a flag pair". That PR proposed rejecting the flag on MLX and was closed.
# **0.5.23 still has the path**, and nothing rejects the flag, so the clause is open on
# MLX.
#
# **Where this departs from the RFC.** The RFC's status table says the path was
# "disabled on MLX by #32591". #32591 was closed without merging, and the installed
# 0.5.23 accepts `--enable-mixed-chunk` with the MLX overlap loop (the run below reaches
# the mixed batch), so this suite reports the clause as open rather than taking the RFC's
# word.

# %%
# %matplotlib inline
import contract_lib
from contract_lib import views
from contract_lib.contract import check, violation_message

views.setup()

print(views.bug_card(4))

# %% [markdown]
# ## Three runs of `mixed-chunk`
#
# Request `a` decodes. At step 5 a 40-token prompt `b` arrives, and with
# `enable_mixed_chunk` and `chunked_prefill_size=16` it is prefilled over three mixed
# batches. The runs: the torch reference, MLX as shipped, and the torch loop with a
# deliberate break, `skip-relay-publish`. That patch removes the `stash` from
# `run_batch`, to show that the checker catches the same fault on the reference loop.

# %%
normal = contract_lib.run("mixed-chunk", "normal")
mlx = contract_lib.run("mixed-chunk", "mlx")
broken = contract_lib.run("mixed-chunk", "normal", patch="skip-relay-publish")
for frames in (normal, mlx, broken):
    print(views.crash_summary(frames))
mixed = mlx.launches[mlx.launches["mode"] == "mixed"]
assert len(mixed) == 3 and mixed["rids"].str.contains("b").all()  # b's three chunks

# %% [markdown]
# ## Green: the torch loop publishes before every read

# %%
result = check(normal).clauses[4]
print(f"clause 4 on {views.run_label(normal)}: {result.status} ({result.note})")

# %% [markdown]
# ## Red: the MLX mixed batch reads rows nobody wrote (still open on 0.5.23)
#
# The relay is poisoned with -1 when it is built (as SGLang's own debug mode does), so an
# unpublished read shows as -1:

# %%
report = check(mlx)
result = report.clauses[4]
print(f"clause 4 on {views.run_label(mlx)}: {result.status}, {len(result.violations)} "
      "unpublished reads")
print(views.wrap(violation_message(result.first())))
print()
print(views.text_table(result.violations[["step", "launch", "rid", "actual"]]))
assert result.violations["launch"].isin(mixed["launch"]).all()  # only the mixed batches

# %% [markdown]
# On Linux CPU the `torch.cat` does not crash, and the MLX decode lane takes its token from
# the MLX runner, not from `input_ids`. The model discards the -1, and both loops emit
# the same tokens. The contract still catches the read, which is what crashes on MPS:

# %%
print("same tokens on normal and mlx:", normal.output_tokens() == mlx.output_tokens())

# %% [markdown]
# ## The deliberate break: the checker is not MLX-specific
#
# With the publish removed from `run_batch`, every relay read on the torch loop sees a
# row nobody wrote, including the plain decode reads:

# %%
result = check(broken).clauses[4]
print(f"clause 4 on {views.run_label(broken)}: {result.status}, {len(result.violations)} "
      "unpublished reads")
print(views.wrap(violation_message(result.first())))

# %% [markdown]
# Every relay event, per step and row. A write (▲) follows each torch forward, and the
# next read (●) sees it. On MLX there are no writes at all, and the only reads are the
# three mixed batches (shaded), each reading -1.

# %%
views.relay_events(normal, mlx, broken)
