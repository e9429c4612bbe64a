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
# # Search: the smallest workload that breaks a clause
#
# The shipped workloads are hand-written: a bug that needs a particular interleaving of
# arrivals, turns, chunking and memory pressure shows only if someone guessed it.
# `python -m contract_lib search` generates workloads with
# [Hypothesis](https://hypothesis.readthedocs.io), runs each through the real loop, stops
# at the first contract violation (or crash, or tokens unequal to the torch `normal`
# loop's) and **shrinks** it: Hypothesis tries smaller variants (fewer requests, shorter
# prompts, earlier arrivals, fewer server-arg overrides) and keeps every one that still
# shows the same clause, until no smaller variant does.
#
# The story here is clause 4 on the MLX loop as shipped, the mixed-chunk relay read of
# #32591: the shipped workload `mixed-chunk` was written after the segfault report
# (`enable_mixed_chunk`, `chunked_prefill_size = 16`, a 40-token prompt arriving during
# a decode). What does the bug really need?

# %%
import pandas as pd

import contract_lib
from contract_lib import views
from contract_lib.campaigns.search import Campaign, judge, search, to_toml, workload_size
from contract_lib.contract import check
from contract_lib.views.text import step_table

views.setup()

print(views.bug_card(4))

# %% [markdown]
# ## The campaign
#
# Seed 0, a budget of 100 generated examples, clause 4 only (the MLX loop as shipped also
# violates clauses 1, 2 and 5 on almost any workload), and no example database, so the
# notebook replays the same search every time. From the command line this is
# `python -m contract_lib search --loop mlx --clause 4 --budget 100 --seed 0 --no-database`.

# %%
campaign = search(Campaign("mlx", clause=4, budget=100, seed=0, database=False))
workload, finding = campaign.found
print(f"{campaign.examples} examples generated until the first finding; "
      f"{campaign.runs} workloads run in all (generation and shrinking)")

# %% [markdown]
# ## The generated failure
#
# The first generated workload that violated clause 4, as Hypothesis drew it:

# %%
first, first_finding = campaign.history[0]
print(to_toml(first, []))
print(first_finding.line)

# %% [markdown]
# ## The shrink steps
#
# Every smaller workload that still violated clause 4, in the order Hypothesis found
# them (it also tried many that did not, and dropped them):

# %%
steps = pd.DataFrame([{**workload_size(w), "arrivals": [r.arrival for r in w.requests],
                       "overrides": " ".join(f"{k}={v}" for k, v in w.server_args.items())}
                      for w, _ in campaign.history]).drop(columns="server_args")
steps.index.name = "step"
print(steps.to_string())

# %% [markdown]
# ## The minimal workload
#
# Two requests of one prompt token each, one arriving while the other decodes, and
# `enable_mixed_chunk` alone: no chunked prefill, no long prompt. Any arrival that is
# prefilled while a decode is in flight makes a mixed batch, and the mixed batch's decode
# lane reads a relay row the MLX loop never published.

# %%
print(to_toml(workload, []))
print(finding.line)
assert [len(r.prompt) for r in workload.requests] == [1, 1]
assert workload.server_args == {"enable_mixed_chunk": True}

# %% [markdown]
# ## Its frames
#
# The minimal workload run through the MLX loop, its per-step table and its clause
# table (all clauses, the RFC's five and this project's 6 and 7). The torch `normal` loop
# on the same workload holds the RFC's five; it violates clause 6 only as the known
# upstream bug `processed-tokens-counter` (fixed by `fix-processed-tokens-counter`), which
# `search` does not count as a finding.

# %%
frames = contract_lib.run(workload, "mlx")
print(step_table(frames))
print()
print(check(frames).text())

# %%
reference = contract_lib.run(workload, "normal")
print(check(reference, "rfc").verdict().line())
print("finding on the torch normal loop:", judge(reference, None, clause=None))

# %% [markdown]
# `search` writes the minimal workload to `data/workloads/found/` with a header stating
# the command, the clause, field and step, and the violation line; see the README's
# "Searching for the smallest breaking workload" for the per-bug table.
