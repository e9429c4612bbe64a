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
# loop, a release, or a patch you suspect. Set the parameters in the next cell, or run
# it with papermill (in the dev dependencies):
#
# ```
# papermill 06-triage.ipynb out.ipynb -p workload my-workload.toml -p loop mlx \
#     -p patch fix-chained-accounting -p explore False \
#     -y '{"server_args": {"chunked_prefill_size": 32}}'
# ```
#
# It runs the workload through the real SGLang loop, checks the clauses, prints the
# run's verdict, takes you to the first violation and shows that clause's own view,
# compares the run with the unpatched run and the torch loops on the same workload, and
# ends with a step explorer.
#
# - `workload`: a shipped workload (`single-decode`, `two-turn`, `staggered`,
#   `finish-mid-chain`, `mixed-chunk`, ...) or a path to a workload `.toml`.
# - `loop`: `normal`, `overlap`, `mlx` (or `omni`).
# - `patch`: `None`, a built-in patch (`no-forward-ct`, `no-launch-ts`,
#   `fix-chained-accounting`, `fix-idle-predicate`, `skip-relay-publish`, ...; combine
#   them with `+`), or your own `module:function`.
# - `server_args`: `ServerArgs` overrides on top of the workload's own, a dict. With
#   papermill pass it as YAML: `-y '{"server_args": {"max_total_tokens": 256}}'`
#   (`-p` only passes strings and numbers).
# - `runner`: `model-free` (the forward replaced) or `real` (SGLang's `MlxModelRunner`
#   with a tiny local model; `mlx` loop only).
# - `sglang`: `None` (the installed release) or another supported release, e.g. `0.5.21`.
# - `compare`: also run the references (the same run without the patch, and the torch
#   loops) and show them beside it.
# - `explore`: end with the interactive step explorer (ipywidgets). Pass
#   `-p explore False` to papermill: a stored notebook cannot move a slider, and nbclient
#   can hang for good on a widget cell (jupyter/nbclient#312); the static view follows
#   either way.
#
# A bad parameter, or a run that fails in set-up, stops at the next cell with the
# library's one-line message. A run that crashed, died or timed out in its loop is shown
# as far as it got, with the crash, and every cell still runs.

# %% tags=["parameters"]
workload = "two-turn"
loop = "mlx"
patch = None
server_args = {}
runner = "model-free"
sglang = None
compare = True
explore = True

# %%
# %matplotlib inline
from contract_lib import views
from contract_lib.contract import violation_message

views.setup()

views.check_switches(compare=compare, explore=explore)
options = dict(runner=runner, sglang=sglang)
frames, report = views.checked_run(workload, loop, patch=patch, server_args=server_args,
                                   **options)
print(views.crash_summary(frames))
if frames.status != "finished":
    print(views.recorded_summary(frames, workload))
print()
print(views.text_table(views.report_table(report)))
print()
print(views.verdict_line(report))

# %% [markdown]
# ## The first violation
#
# The lowest-numbered violated clause, and its first step. This is the message
# `assert_contract` raises. `step` and `rid` below locate it; with no violation they
# point at the last step. A run that did not finish says where it stopped.

# %%
first = views.first_violation(report)
step, rid = views.triage_focus(frames, report)
if first:
    print(views.wrap(violation_message(first)))
else:
    print("no clause violated in the frames recorded; " + views.verdict_line(report))
if frames.error:
    print()
    print(views.crash_summary(frames))
print(f"\nlooking at step {step}, request {rid}")

# %% [markdown]
# ## The clause's own view, beside the references
#
# The references are the same workload with no patch (when a patch was given) and the
# torch loops, which satisfy the RFC's clauses. The figure is the violated clause's own
# subject: the `req_to_token` row (clause 1), the counters (2), the stamps (3), the relay
# reads and writes (4), the idle-predicate lanes (5).

# %%
references = []
if compare:
    wanted = [(loop, options)] if patch else []  # the same run without the patch
    wanted += [(torch, dict(sglang=sglang)) for torch in ("normal", "overlap") if torch != loop]
    references = [views.checked_run(workload, name, server_args=server_args, **extra)[0]
                  for name, extra in wanted]
runs = (frames, *references)
print(views.text_table(views.clause_comparison(*runs)))

# %%
figure = views.clause_view(frames, report, *references)
figure if figure is not None else print("no clause violated: nothing to draw")

# %% [markdown]
# ## Later turns: what the radix cache reused
#
# For every request of the workload that is a later turn of another (`turn_of`): its
# `cached_tokens` on each run against the ideal, every position the earlier turn
# computed. A run that commits fewer positions than it computed reuses less. The ideal
# is measured on the reference: the first torch loop that finished (else the first run
# that did), never on a run that stopped before the earlier turn's whole output.

# %%
turns = views.later_turns(workload)
for turn in turns:
    reuse = views.radix_reuse_table(*runs, rid=turn, workload=workload)
    source = reuse.attrs["ideal_from"] or "no run that finished (compare=True runs the torch loops)"
    print(f"{turn}, a later turn of {reuse.attrs['parent']}: cached_tokens against the ideal "
          f"(measured on {source})")
    print(views.text_table(reuse))
if not turns:
    print("the workload has no later turn")

# %% [markdown]
# ## The frames around that step
#
# Each request's counters at the step before, at, and after the violation. `kv_computed`
# is the ground truth recorded at the model boundary. Clause 2 requires the three
# counters to equal it, and clause 1 requires every position below it to hold a real
# slot.

# %%
print(views.text_table(views.frames_around(frames, step, before=1, after=1)))

# %% [markdown]
# ## Step explorer
#
# With a live kernel, move the slider and choose a request. The view shows that
# request's counters over the run and its `req_to_token` row at the chosen step. The cell
# is skipped by the notebook tests (`NBVAL_SKIP`): a widget needs a live kernel. With
# `explore = False` (a papermill run) it shows nothing.

# %%
# NBVAL_SKIP
views.step_explorer(frames, step=step, rid=rid) if explore else None

# %% [markdown]
# ## The same view, static
#
# The step explorer at the step and request chosen above, as text and as a figure, so
# the notebook reads without a live kernel:

# %%
print(views.step_snapshot(frames, step, rid, report=report))

# %%
views.step_figure(frames, step, rid)
