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
# # Clause 5: in-flight predicates test any overlap loop (`result_queue`)
#
# **The clause.** Whenever an overlap loop holds in-flight work (`result_queue` not
# empty), `is_fully_idle()` must say "not idle" *because of* that work. Other terms could
# also make the predicate say busy, so the checker evaluates it a second time with every
# other term masked to idle: running batch empty, no last batch, no chunked request, empty
# waiting queue. That **masked probe** must still say busy. If it says idle while the real
# predicate said busy, the answer was right only by accident. The checker reports this
# as `violated-masked`.
#
# **The predicate (SGLang 0.5.23).** `Scheduler.is_fully_idle`
# (`managers/scheduler.py:5337`) has the in-flight term
# `not self.enable_overlap or len(self.result_queue) == 0` (:5349). The two overlap
# flags are mutually exclusive by construction: `enable_overlap` means torch overlap and
# `enable_overlap_mlx` means MLX overlap. So on MLX the first disjunct is always true and
# the queue is never inspected.
#
# **Who reads it.**
# - `release_memory_occupation` (`managers/scheduler_components/weight_updater.py:337`)
#   *asserts* it.
# - `flush_cache` (`managers/scheduler.py:5520`) resets both pools behind it.
# - The health check (`managers/scheduler.py:2241`), `on_idle` (:5254) and HiCache attach/detach (:5423, :5479)
#   also call it.
#
# **What goes wrong.** Nothing today. The MLX loop keeps `running_batch` / `last_batch`
# non-empty whenever its queue is, so those terms say busy. Nothing enforces that
# coupling. If it breaks, for example on a pause path (0.5.22+ drains the queue under
# `pause_generation`), `release_memory_occupation` or `flush_cache` could run with a job
# in flight. #32934 proposed testing either flag. It was closed without merging, and the
# term is **unchanged in 0.5.23**.

# %%
# %matplotlib inline
import contract_lib
from contract_lib import views
from contract_lib.contract import check, violation_message

views.setup()

print(views.bug_card(5))

# %% [markdown]
# ## Three runs of `two-turn`
#
# The torch overlap loop, MLX as shipped, and MLX with `fix-idle-predicate`, the one-line
# change of #32934:
# `not (self.enable_overlap or self.enable_overlap_mlx) or len(self.result_queue) == 0`.

# %%
overlap = contract_lib.run("two-turn", "overlap")
mlx = contract_lib.run("two-turn", "mlx")
fixed = contract_lib.run("two-turn", "mlx", patch="fix-idle-predicate")
for frames in (overlap, mlx, fixed):
    print(views.crash_summary(frames))

# %% [markdown]
# ## Red (masked): on 0.5.23 the MLX queue term says idle with a job in flight

# %%
report = check(mlx)
result = report.clauses[5]
print(f"clause 5 on {views.run_label(mlx)}: {result.status}, {len(result.violations)} "
      f"steps ({result.note})")
print(views.wrap(violation_message(result.first())))

# %% [markdown]
# ## Green: the torch overlap loop, and MLX with the fix

# %%
for frames in (overlap, fixed):
    result = check(frames).clauses[5]
    print(f"clause 5 on {views.run_label(frames)}: {result.status} ({result.note})")

# %% [markdown]
# Step by step: the top lane is the in-flight queue, the middle lane is the predicate as
# SGLang's readers call it, and the bottom lane is the masked probe. The middle lane is
# right on every run. On unpatched MLX the bottom lane turns red wherever a job is in
# flight: the queue term alone would have said idle.

# %%
views.idle_predicate(overlap, mlx, fixed)

# %% [markdown]
# The fix changes only the predicate, so the other open MLX clauses stay as they were.
# This is the shape the RFC proposes for each clause: a small production change, red on
# the parent and green on the branch.

# %%
print(views.text_table(views.report_table(check(fixed))))
