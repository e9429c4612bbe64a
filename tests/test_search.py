"""``search``: generated workloads are valid, reference campaigns on the torch loops find
nothing, built-in bugs are found and shrunk within a stated budget, the CLI's exit codes
and found-workload files, the example database, and a Dask executor.

Budgets here are small and seeds fixed (runs are served from the frame cache after the
first session); the full per-patch table is in README.md and benchmarks/search.md.
"""

from __future__ import annotations

import re
import threading
import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings

import contract_lib
from contract_lib import loops
from contract_lib.campaigns import search as search_mod
from contract_lib.campaigns.search import Campaign, judge, search, to_toml, workloads
from contract_lib.cli import main
from contract_lib.contract import check
from contract_lib.workloads import Workload, load_workload

DIFFS = Path(__file__).resolve().parent.parent / "data" / "diffs"

@settings(max_examples=200, deadline=None, database=None)
@given(workloads())
def test_generated_workloads_are_valid_and_round_trip_through_toml(workload):
    workload.check_vocabulary(512)
    contexts: dict[str, int] = {}
    for spec in workload.requests:
        contexts[spec.rid] = (len(spec.prompt) + spec.max_new_tokens
                              + (contexts[spec.turn_of] if spec.turn_of else 0))
    assert max(contexts.values()) < 1024
    assert "disable_overlap_schedule" not in workload.server_args
    assert "page_size" not in workload.server_args
    if "max_total_tokens" in workload.server_args:
        assert workload.server_args["max_total_tokens"] > max(contexts.values())
    assert Workload.from_dict(tomllib.loads(to_toml(workload, ["a header"]))) == workload


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_reference_campaigns_on_the_torch_loops_find_nothing(loop):
    campaign = search(Campaign(loop, budget=8, seed=0, database=False))
    assert campaign.found is None, campaign.found
    assert campaign.examples >= 6 and campaign.rejected <= 2


# (loop, patch, clause asked, clause found, field): each built-in bug, seed 0, budget 30.
BUGS = [
    ("mlx", "no-forward-ct", 3, 3, "forward_ct"),
    ("mlx", "no-launch-ts", None, 3, "launch_ts"),
    ("overlap", "skip-relay-publish", 4, 4, "output_tokens_buf"),
    ("mlx", None, 2, 2, "seq_lens"),
    ("mlx", None, 5, 5, "result_queue"),
]


@pytest.mark.parametrize("loop, patch, clause, expected, field", BUGS,
                         ids=[f"{b[0]}-{b[1] or 'unpatched'}-{b[3]}" for b in BUGS])
def test_builtin_bugs_are_found_and_shrunk(loop, patch, clause, expected, field):
    campaign = search(Campaign(loop, patch, clause, budget=30, seed=0, database=False))
    assert campaign.found is not None
    workload, finding = campaign.found
    assert (finding.kind, finding.clause, finding.field) == ("violation", expected, field)
    assert len(workload.requests) == 1 and not workload.server_args
    assert workload.requests[0].max_new_tokens <= 3 and len(workload.requests[0].prompt) == 1
    # The minimal workload shows the clause on its own run, and not on the torch loop.
    assert not check(contract_lib.run(workload, loop, patch=patch)).clauses[expected].violations.empty
    assert check(contract_lib.run(workload, "normal"), "rfc").verdict().code == 0


def test_a_held_out_patch_of_the_torch_loop_is_found():
    """A patch the search was not written for (tests/user_patches.py, clause 3 on the
    torch normal loop)."""
    campaign = search(Campaign("normal", "user_patches:stale_forward_iter", budget=30,
                               seed=0, database=False))
    assert campaign.found is not None
    assert (campaign.found[1].clause, campaign.found[1].field) == (3, "forward_iter")


def test_a_crash_is_a_finding():
    campaign = search(Campaign("normal", "user_patches:raise_in_loop", budget=30, seed=0,
                               shrink_budget=5, database=False))
    assert campaign.found is not None and campaign.found[1].kind == "not-finished"
    assert "injected fault" in campaign.found[1].line


def test_unequal_tokens_are_a_finding(run_cached):
    ours, theirs = run_cached("single-decode", "normal"), run_cached("staggered", "normal")
    finding = judge(ours, theirs, clause=None)
    assert finding.kind == "tokens" and finding.line.startswith("request a: normal emitted")
    assert judge(ours, ours, clause=None) is None


def test_cli_writes_the_minimal_workload_and_exits_1(tmp_path, capsys):
    code = main(["search", "--loop", "mlx", "--patch", "no-forward-ct", "--clause", "3",
                 "--budget", "10", "--no-database", "--out", str(tmp_path)])
    assert code == 1
    path = tmp_path / "mlx.no-forward-ct.clause-3.toml"
    header = [line for line in path.read_text().splitlines() if line.startswith("#")]
    assert header[0].startswith("# found by: python -m contract_lib search --loop mlx "
                                "--patch no-forward-ct --clause 3")
    assert header[1] == "# finding: violation (clause 3, field forward_ct, step 0)"
    assert header[2].startswith("# clause 3 (step stamped): field forward_ct at step 0")
    workload = load_workload(path)
    report = check(contract_lib.run(workload, "mlx", patch="no-forward-ct"))
    assert report.clauses[3].first()["field"] == "forward_ct"
    assert f"minimal workload written to {path}" in capsys.readouterr().out


def test_cli_exits_0_when_the_budget_is_spent(capsys):
    assert main(["search", "--loop", "normal", "--budget", "3", "--no-database"]) == 0
    out = capsys.readouterr().out.splitlines()
    # The numbers say the same thing: examples generated, bounded by --budget.
    generated = int(re.match(r"seed 0: nothing found in (\d+) examples \((\d+) distinct",
                             out[0]).group(1))
    assert out[1] == f"no finding on --loop normal in {generated} examples (--budget 3)"
    assert generated >= 3


@pytest.mark.parametrize("argv, message", [
    (["--loop", "gpu"], "unknown loop 'gpu'"),
    (["--loop", "mlx", "--patch", "no-such-patch"], "unknown patch 'no-such-patch'"),
    (["--loop", "overlap", "--patch", "user_patches:overlap_off_after_build"],
     "failed in set-up, so every generated workload would: --loop overlap asked for "
     "event_loop_overlap"),
    (["--loop", "mlx", "--sglang", "/nonexistent"], "--sglang /nonexistent: no such directory"),
    (["--loop", "mlx", "--diff", str(DIFFS / "stale-context.diff")], "does not apply to"),
    (["--loop", "mlx", "--budget", "0"], "the budget must be at least 1"),
])
def test_cli_usage_and_setup_errors_exit_2_at_once_on_one_line(argv, message, capsys):
    assert main(["search", "--budget", "5", *argv, "--no-database"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1  # no progress bar before it
    assert err.startswith("error: ") and message in err


def test_a_patch_that_fails_whatever_the_workload_stops_the_search_before_it_generates(
        tmp_path, monkeypatch, capsys):
    """A patch module that raises at import passes the name check (it exists): the
    set-up probe reports it before any workload is generated or run."""
    (tmp_path / "broken_patch_module.py").write_text('raise RuntimeError("broken module")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    campaign = Campaign("mlx", "broken_patch_module:fix", budget=5, database=False)
    with pytest.raises(search_mod.SearchSetupError, match="RuntimeError: broken module"):
        search(campaign)
    assert (campaign.generated, campaign.runs) == (0, 0)
    assert main(["search", "--loop", "mlx", "--patch", "broken_patch_module:fix",
                 "--budget", "5", "--no-database"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        "error: set-up probe on mlx, patch broken_patch_module:fix (sglang "
        f"{contract_lib.run(search_mod.PROBE, 'mlx').meta['sglang_version']}) failed in "
        "set-up, so every generated workload would: RuntimeError: broken module"]


def test_a_search_runs_on_the_sglang_its_diffs_make():
    """fix-backend-state.diff fixes clause 7, which the unpatched MLX loop violates at
    once: with the diff, the same search finds nothing; the command and the file name
    say which SGLang."""
    assert search(Campaign("mlx", clause=7, budget=4, database=False)).found is not None
    diff = str(DIFFS / "fix-backend-state.diff")
    fixed = search(Campaign("mlx", clause=7, budget=4, database=False, diffs=(diff,)))
    assert fixed.found is None and fixed.generated >= 4
    assert f"--diff {diff}" in fixed.command()
    assert fixed.slug == "mlx.unpatched.clause-7.diff-fix-backend-state"


def test_the_example_database_replays_a_found_failure_first(tmp_path, monkeypatch):
    monkeypatch.setattr(search_mod, "DATABASE_DIR", tmp_path)
    first = search(Campaign("mlx", None, 2, budget=30, seed=0))
    assert first.found is not None and first.examples > 1
    again = search(Campaign("mlx", None, 2, budget=30, seed=5))
    assert again.examples == 1 and again.found[0] == first.found[0]


def test_runs_go_through_a_dask_executor():
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(processes=False, n_workers=1, threads_per_worker=2,
                                  dashboard_address=None) as cluster, \
            distributed.Client(cluster) as client, \
            distributed.get_task_stream(client) as tasks:
        campaign = search(Campaign("mlx", "no-forward-ct", 3, budget=5, seed=0,
                                   database=False), executor=client.get_executor())
    assert campaign.found is not None and campaign.found[1].clause == 3
    # Every run (the loop's and its torch reference's) was a task on the cluster.
    assert len([t for t in tasks.data if t["key"].startswith("run-")]) == 2 * campaign.runs



FOUND = sorted(search_mod.FOUND_DIR.glob("*.toml"))


def _found_by_a_pinned_loop(path) -> bool:
    """A found workload whose search ran a loop pinned to another release (omni)."""
    words = path.read_text().splitlines()[0].split()
    loop = words[words.index("--loop") + 1] if "--loop" in words else None
    return loop is not None and loops.spec(loop).sglang is not None


@pytest.mark.parametrize("path", [
    pytest.param(p, marks=pytest.mark.releases) if _found_by_a_pinned_loop(p) else p
    for p in FOUND], ids=[p.stem for p in FOUND])
def test_each_shipped_found_workload_shows_the_violation_its_header_states(path):
    header = dict(line[2:].split(": ", 1) for line in path.read_text().splitlines()[:2])
    words = header["found by"].split()
    loop = words[words.index("--loop") + 1]
    patches = [words[i + 1] for i, w in enumerate(words) if w == "--patch"]
    clause, field = re.match(r"violation \(clause (\d), field (\w+)", header["finding"]).groups()
    first = check(contract_lib.run(load_workload(path), loop, patch=patches or None)
                  ).clauses[int(clause)].first()
    assert first is not None and first["field"] == field


def test_a_set_stop_event_ends_the_campaign_before_its_next_run():
    """What Ctrl-C does to side-by-side campaigns (``search_many``): each stops at once."""
    stop = threading.Event()
    stop.set()
    campaign = Campaign("normal", budget=5, database=False)
    with pytest.raises(KeyboardInterrupt):
        search(campaign, stop=stop)
    assert campaign.runs == 0


def test_cli_dask_option_runs_on_the_given_scheduler(tmp_path):
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(processes=False, n_workers=1, threads_per_worker=2,
                                  dashboard_address=None) as cluster:
        code = main(["search", "--loop", "mlx", "--patch", "no-forward-ct", "--clause", "3",
                     "--budget", "3", "--no-database", "--out", str(tmp_path),
                     "--dask", cluster.scheduler_address])
        assert code == 1
        # The runs were computed on the cluster (tasks named after contract_lib.run).
        assert cluster.scheduler.task_prefixes["run"].all_durations["compute"] > 0
