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
# # The contract's history, bug by bug
#
# The July bugs of the per-step contract shipped in SGLang releases, and every release
# this project supports is on PyPI. `--sglang VERSION` drives each release's own loops
# (what each needed is in `contract_lib/sources/compat.py` and `docs/history.md`), so
# each bug can be read on the release that shipped it and on the one that fixed it,
# **unpatched**: the RFC's "red on parent, green on branch" on the real artifacts, with
# no patch of ours in between.
#
# This notebook reads saved runs (`data/history`, written by
# `scripts/make-history-fixtures`), so it installs nothing: per release, `two-turn`
# through the torch loops, through MLX and through MLX with SGLang's real
# `MlxModelRunner`, `mixed-chunk` through MLX, and `two-turn` with a shutdown asked for.
# `tests/test_history.py` checks the saved runs of the oldest and newest releases
# against live ones; `status --sglang 0.5.14..0.5.23` measures every shipped workload
# live (its cost is in the README). Every release number and count below is read from
# those runs.

# %%
# %matplotlib inline
import pandas as pd

from contract_lib import views
from contract_lib.campaigns.history import history_cells
from contract_lib.campaigns.saved_history import saved_releases, saved_run, saved_status
from contract_lib.patches.catalog import bug_catalog
from contract_lib.sources.versions import release_spans

views.setup()

releases = saved_releases()
history = saved_status()
real_history = saved_status(runner="real")
cells = history_cells(history)
mlx = {v: saved_run(v, "two-turn", "mlx") for v in releases}
SHUTDOWN = "user_patches:shutdown_after_three_results"  # sets gracefully_exit
print(f"{len(releases)} releases, {releases[0]} to {releases[-1]}; saved runs of each:")
for workload, loop in history.statuses[0].reports:
    print(f"  {workload} on {loop}")
print("  two-turn on mlx with the real MlxModelRunner")
print(f"  two-turn on normal and mlx with patch {SHUTDOWN}")

# %% [markdown]
# ## The history at a glance
#
# One grid per loop: a row per clause (and, on MLX, the KV pool), a column per release,
# each cell the worst status over that release's saved runs of the loop. Where a clause's
# violated fields differ between releases, the cell names them.

# %%
views.clause_history(history)

# %%
def spans(mask) -> str:
    """The releases of the cells selected by ``mask``, as runs of consecutive ones."""
    return release_spans(list(dict.fromkeys(cells.loc[mask, "sglang"]))) or "none"


on_mlx = cells["loop"] == "mlx"
red = cells["status"].isin(["violated", "violated-masked"])
every = [c for c in range(1, 8)
         if (on_mlx & (cells["clause"] == c) & red).sum() == len(releases)]
changed = [c for c in range(1, 8) if c not in every]
views.md(f"On MLX, clauses {', '.join(map(str, every))} are red on every release "
         f"({releases[0]} to {releases[-1]}); clauses {', '.join(map(str, changed))} "
         "change colour along the way: the bugs below.")

# %% [markdown]
# ## 1. `forward_ct` (#29217) and the profiler predicate's late step (#32447)
#
# Clause 3: every launch advances `forward_ct` by exactly one, and the batch
# `process_batch_result` receives carries `forward_iter` equal to it. The watchdog and
# the profiler read `forward_ct`; `_record_step_counters` reads `forward_iter`. The bug
# cards of clause 3 (what `data/bugs.toml` read and what was measured):

# %%
print(views.bug_card(3))

# %% [markdown]
# Per release, `two-turn` on MLX: how many launches there were, `forward_ct` at the end,
# how many launches did not see it advanced by one at their launch, how many were
# processed without their `forward_iter` stamp.

# %%
stamps = views.stamp_history(mlx)
print(views.text_table(stamps))

# %%
never = stamps[stamps["forward_ct at the end"] == 0]["release"].tolist()
late = stamps[(stamps["forward_ct at the end"] == stamps["launches"])
              & (stamps["forward_ct not advanced at launch"] > 0)]
fixed = stamps[(stamps["forward_ct not advanced at launch"] == 0)
               & (stamps["forward_iter not stamped"] == 0)]["release"].tolist()
views.md(
    f"**{release_spans(never)}** never advances `forward_ct` on MLX: "
    f"{stamps['launches'].iloc[0]} launches, the count 0 at the end. "
    f"**{release_spans(late['release'].tolist())}** count every launch (the count at the "
    "end equals the launches) but when the job is finalized, not when it is launched: "
    f"{late['forward_ct not advanced at launch'].iloc[0]} of "
    f"{late['launches'].iloc[0]} launches were made before the previous one was "
    "finalized and saw the count one behind (the profiler predicate runs one queued "
    "decode late), and no launch is stamped `forward_iter`. From "
    f"**{fixed[0]}** on, both are right at every launch.")

# %% [markdown]
# The same, launch by launch, on the first release of each kind (dashed: the expected
# count; a missing `forward_iter` is a cross):

# %%
kinds = [never[0], late["release"].iloc[0], fixed[0]]
views.step_stamps(*[mlx[v] for v in kinds], labels=[f"mlx, sglang {v}" for v in kinds])

# %% [markdown]
# ## 2. `after_idle_gap`
#
# `run_batch` stamps `after_idle_gap` on a batch launched after the scheduler idled, and
# `_record_step_counters` reads it to time the step; the MLX launch has to stamp it too.
# In `two-turn`, `a2` arrives after the first turn finished and the loop idled.

# %%
gaps = []
for version, frames in mlx.items():
    report = history.statuses[releases.index(version)].reports[("two-turn", "mlx")]
    found = report.clauses[3].violations
    for row in found[found["field"] == "after_idle_gap"].itertuples():
        launch = frames.launches.set_index("launch").loc[int(row.launch)]
        gaps.append({"release": version, "launch": int(row.launch), "step": int(row.step),
                     "requests": launch["rids"], "mode": launch["mode"],
                     "expected": row.expected, "got": row.actual})
gaps = pd.DataFrame(gaps)
print(views.text_table(gaps))

# %%
absent = [v for v, f in mlx.items() if "after_idle_gap" in f.absent]
wrong = list(dict.fromkeys(gaps["release"]))
right = [v for v in releases if v not in absent and v not in wrong]
views.md(
    f"The field does not exist on **{release_spans(absent)}** (clause 3 lists it as not "
    f"present, with the reason). On **{release_spans(wrong)}** the launch of "
    f"`{gaps['requests'].iloc[0]}` after the idle iterations carries the default "
    f"`{gaps['got'].iloc[0]}`: the step is timed across the idle gap. From "
    f"**{right[0]}** the MLX launch stamps it.")

# %% [markdown]
# ## 3. The graceful exit (#32447)
#
# A `ShutdownReq` only sets `gracefully_exit`; a loop has to read it and return. The
# saved runs set it after the third result (a test patch, as a shutdown would) on the
# torch `normal` loop and on MLX:

# %%
shutdown = {loop: {v: saved_run(v, "two-turn", loop, SHUTDOWN) for v in releases}
            for loop in ("normal", "mlx")}
print(views.text_table(views.shutdown_history(shutdown)))

# %%
ignored = [v for v, f in shutdown["mlx"].items() if f.status == "finished"]
same = all(
    shutdown["mlx"][v].comparable()[name].equals(table)
    for v in ignored for name, table in mlx[v].comparable().items())
views.md(
    f"On **{release_spans(ignored)}** the MLX loop runs on to the end after the flag is "
    "set (a real shutdown waits out its grace period and is killed); the torch loop "
    "returns at its next iteration on every release, and so does MLX from "
    f"**{[v for v in releases if v not in ignored][0]}**. No clause can see it: the flag "
    "is read, never written, so the effects audit records nothing, and the frames of "
    "the run in which it was set are "
    + ("**equal, table by table, to the unpatched run's**" if same else "not equal to "
       "the unpatched run's")
    + ". The run's end shows it.")

# %% [markdown]
# ## 4. Clause 1's reader: the KV pool
#
# Chained MLX decode leaves `req_to_token` positions unrecorded (clause 1, red on every
# release). The reader is the decode-KV pool sync, which copies a request's KV into the
# shared pool through those positions. With SGLang's real `MlxModelRunner` (a tiny local
# model on MLX's CPU backend), per release: positions written through padding slot 0 or
# into another live request's slots, radix-matched slots left zero or wrong at the end,
# the pool's verdict with either runner (the model-free runner runs each release's own
# sync methods), and the requests whose tokens differ from the newest release's.

# %%
print(views.bug_card(1))

# %%
real = {v: saved_run(v, "two-turn", "mlx", runner="real") for v in releases}
pool = views.kv_history(real, mlx)
print(views.text_table(pool))

# %%
damaged = pool[pool["real runner"] == "damaged"]["release"].tolist()
foreign = pool[pool["into another live request"] > 0]["release"].tolist()
agree = (pool["real runner"] == pool["model-free runner"]).all()
wrong_tokens, = set(pool.loc[pool["real runner"] == "damaged", "tokens unlike the newest's"])
views.md(
    f"The pool is damaged on **{release_spans(damaged)}** and intact from "
    f"**{[v for v in releases if v not in damaged][0]}**, which clamps the sync to what "
    "the request owns. "
    + (f"On {release_spans(foreign)} some of the writes land in another live request's "
       "slots; " if foreign else "")
    + f"on every damaged release `{wrong_tokens}`, a "
    "radix hit on the first turn's reused row, emits other tokens. The model-free "
    "runner's verdict " + ("agrees on every release." if agree else "differs."))

# %% [markdown]
# ## 5. What stays open
#
# The chained accounting (clause 2), the mixed-chunk relay (clause 4), the idle
# predicate (clause 5) and the backend's per-request state (clause 7); clause 6's clock
# arrives with the HRRN policy.

# %%
for clause in (2, 4, 5):
    print(views.bug_card(clause), end="\n\n")

# %%
lines = []
for clause in range(1, 8):
    mine = on_mlx & (cells["clause"] == clause)
    shown = cells[mine].set_index("sglang")["status"]
    lines.append(f"- clause {clause}: " + "; ".join(
        f"{status} on {spans(mine & (cells['status'] == status))}"
        for status in dict.fromkeys(shown)))
views.md("On MLX, per clause, each status and the releases showing it:\n\n"
         + "\n".join(lines))

# %%
holds5 = spans(on_mlx & (cells["clause"] == 5) & (cells["status"] == "holds"))
views.md(
    f"Clause 5 holds on {holds5} for a reason in the predicate itself: there "
    "`is_fully_idle` also tests `cur_batch`, which the MLX loop sets to the in-flight "
    "job's batch; the next release renamed it `cur_batch_for_debug` and dropped the term, "
    "and the queue term has never tested the MLX loop.")

# %% [markdown]
# ## 6. The torch loops: no false positive across history
#
# The reference loops must satisfy the contract on every release: what they do not hold
# is a catalogued upstream bug (clause 6's clock, `processed-tokens-counter`).

# %%
torch = cells[cells["loop"].isin(["normal", "overlap"])]
rfc_red = torch[(torch["clause"].isin(range(1, 6))) & torch["status"].isin(
    ["violated", "violated-masked"])]
known = torch[torch["status"] == "known upstream"]
assert rfc_red.empty, rfc_red
views.md(
    "On `normal` and `overlap`, RFC clauses 1-5 hold (or are not exercised) on every "
    f"release, {releases[0]} to {releases[-1]}. Clause 6 is "
    f"`{known['status'].iloc[0]}` on {release_spans(list(dict.fromkeys(known['sglang'])))}"
    f" ({', '.join(sorted(set(known['fields'])))}) and not present before. Workloads "
    "this project does not ship give the same on the oldest and newest releases "
    "(`tests/workloads/held-out`, in `tests/test_history.py`).")

# %% [markdown]
# ## 7. What was read, against what was measured
#
# `data/bugs.toml` says which releases each bug affects as read from the wheels and
# threads (`../shared/docs/sglang-history.md`). Beside it, the releases whose saved runs
# show it: a field it names violated in its clause on its loop (for clause 1's reader,
# the real runner's pool damaged; for the graceful exit, the MLX run that went on).

# %%
table = views.read_against_measured(bug_catalog(), history, real_history, shutdown["mlx"])
for row in table.itertuples(index=False):
    print(views.wrap(f"{row.bug} (clause {row.clause}, {row.loop})\n"
                     f"read: {row[3]}\nred in the saved runs: {row[4]}"), end="\n\n")
