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
# # Triage: which clause does this run break, and where?
#
# Use this notebook to check a run you have not seen before: a new workload, another
# loop, or a patch you suspect. Set the parameters in the next cell, or run it with
# papermill (`papermill 06-triage.ipynb out.ipynb -p loop mlx -p patch
# fix-chained-accounting`). It runs the workload through the real SGLang loop, checks
# the five clauses, and takes you to the first violation: the clause and field, the
# frames around that step, and then a step explorer.
#
# - `workload`: a shipped workload (`single-decode`, `two-turn`, `staggered`,
#   `finish-mid-chain`, `mixed-chunk`) or a path to a workload `.toml`.
# - `loop`: `normal`, `overlap` or `mlx`.
# - `patch`: `None`, a built-in patch (`no-forward-ct`, `no-launch-ts`,
#   `fix-chained-accounting`, `fix-idle-predicate`, `skip-relay-publish`; combine them
#   with `+`), or your own `module:function`.
# - `server_args`: `ServerArgs` overrides on top of the workload's own.

# %% tags=["parameters"]
workload = "two-turn"
loop = "mlx"
patch = None
server_args = {}

# %%
# %matplotlib inline
import warnings

# Deprecation notices differ between library versions and nbval compares stderr.
for category in (DeprecationWarning, FutureWarning):
    warnings.simplefilter("ignore", category)

import contract_lib
from contract_lib import plots
from contract_lib.contract import check, violation_message

frames = contract_lib.run(workload, loop, patch=patch, server_args=server_args)
report = check(frames)
print(plots.crash_summary(frames))
print()
print(plots.text_table(plots.report_table(report)))

# %% [markdown]
# ## The first violation
#
# The lowest-numbered violated clause, and its first step. This is the message
# `assert_contract` raises. `step` and `rid` below locate it; with no violation they
# point at the last step.

# %%
first = plots.first_violation(report)
step, rid = plots.triage_focus(frames, report)
print(violation_message(first) if first else "every clause holds (or is not exercised)")
print(f"\nlooking at step {step}, request {rid}")

# %% [markdown]
# ## The frames around that step
#
# Each request's counters at the step before, at, and after the violation. `kv_computed`
# is the ground truth recorded at the model boundary. Clause 2 requires the three
# counters to equal it, and clause 1 requires every position below it to hold a real
# slot.

# %%
print(plots.text_table(plots.frames_around(frames, step, before=1, after=1)))

# %% [markdown]
# ## Step explorer
#
# With a live kernel, move the slider and choose a request. The view shows that
# request's counters over the run and its `req_to_token` row at the chosen step. The cell
# is skipped by the notebook tests (`NBVAL_SKIP`): a widget needs a live kernel.

# %%
# NBVAL_SKIP
plots.step_explorer(frames, step=step, rid=rid)

# %% [markdown]
# ## The same view, static
#
# The step explorer at the step and request chosen above, as text and as a figure, so
# the notebook reads without a live kernel:

# %%
print(plots.step_snapshot(frames, step, rid, report=report))

# %%
plots.step_figure(frames, step, rid)
