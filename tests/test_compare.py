"""``compare``: the same workloads through a base and a head SGLang, clause by clause."""

from __future__ import annotations

import re

import pytest

from contract_lib.campaigns import compare as cmp
from contract_lib.cli import main
from contract_lib.contract import HOLDS, MASKED, NOT_EXERCISED, VIOLATED
from contract_lib.paths import DATA_DIR
from contract_lib.wire.protocol import RunSetupError

GOOD = DATA_DIR / "diffs" / "fix-backend-state.diff"
BAD = DATA_DIR / "diffs" / "stale-context.diff"


@pytest.fixture()
def diffs_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CONTRACT_LIB_DIFFS_DIR", str(tmp_path / "diffs"))
    return tmp_path / "diffs"


# -- sides and changes (no runs) ---------------------------------------------------------------


@pytest.mark.fast
def test_a_side_parses_its_parts():
    side = cmp.parse_side("release=0.5.22,diff=a.diff,patch=x,diff=b.diff,patch=y")
    assert (side.release, side.path, side.diffs, side.patches) == (
        "0.5.22", None, ("a.diff", "b.diff"), ("x", "y"))
    assert cmp.parse_side("") == cmp.Side("venv")
    assert cmp.parse_side("path=/src/sglang").path == "/src/sglang"


@pytest.mark.fast
@pytest.mark.parametrize("text, expected", [
    ("release=0.5.22,path=/x", "exclude each other"),
    ("release=0.5.22,release=0.5.23", "release given 2 times"),
    ("diff", "bad part 'diff'"),
    ("sglang=0.5.22", "bad part 'sglang=0.5.22'"),
    ("patch=", "bad part 'patch='"),
])
def test_a_bad_side_is_a_usage_error(text, expected):
    with pytest.raises(RunSetupError, match=expected):
        cmp.parse_side(text)


@pytest.mark.fast
@pytest.mark.parametrize("base, head, change", [
    (VIOLATED, HOLDS, cmp.Change.FIXED),
    (MASKED, HOLDS, cmp.Change.FIXED),
    (cmp.KNOWN_UPSTREAM, HOLDS, cmp.Change.FIXED),
    (HOLDS, VIOLATED, cmp.Change.BROKE),
    (NOT_EXERCISED, MASKED, cmp.Change.BROKE),
    (VIOLATED, VIOLATED, cmp.Change.KEPT),
    (HOLDS, HOLDS, cmp.Change.KEPT),
    (HOLDS, NOT_EXERCISED, cmp.Change.KEPT),
    (VIOLATED, NOT_EXERCISED, cmp.Change.VACUOUS),  # no fix earned
    (HOLDS, "crashed", cmp.Change.NOT_FINISHED),
    ("setup-error", HOLDS, cmp.Change.USAGE),
    (HOLDS, "vacuous", cmp.Change.VACUOUS),
    ("damaged", "intact", cmp.Change.FIXED),  # the real runner's KV pool row
    ("intact", "damaged", cmp.Change.BROKE),
    # no cell: the KV pool row on a torch loop (it read "not-finished", exit 3), and on a
    # side whose MLX run crashed (its table lacked the row: KeyError, exit 70)
    ("-", "-", cmp.Change.KEPT),
    ("damaged", "-", cmp.Change.KEPT),
])
def test_what_the_head_did_to_a_clause(base, head, change):
    assert cmp.classify(base, head) == change


# -- real runs ---------------------------------------------------------------------------------


def _changes(result: cmp.Comparison) -> dict[tuple[str, str], str]:
    table = result.clause_table()
    return {(r.clause.split()[0], r.loop): r.change for r in table.itertuples()}


def test_the_good_diff_fixes_clause_7_and_nothing_else(diffs_dir):
    result = cmp.compare(None, f"diff={GOOD}", workloads=["two-turn"], progress=False)
    changes = _changes(result)
    assert {key for key, change in changes.items() if change != "kept"} == {("7", "mlx")}
    assert changes[("7", "mlx")] == "fixed"
    assert {loop for _, loop in changes} == {"normal", "overlap", "mlx"}
    assert result.outcome() == cmp.Change.FIXED == 0
    runs = result.run_table().set_index("loop")
    assert (runs["same tokens"] == "yes").all()
    assert runs.loc["mlx", "radix reuse (base -> head)"] == "a2 19 -> 19"
    assert runs.loc["mlx", "first difference"].startswith("step 1: backend_state")
    assert runs.loc["normal", "first difference"] == "none"
    text = result.text()
    assert "compare: fixed (exit 0): fixed 7 request state retired on mlx" in text


def test_the_diff_and_its_built_in_patch_agree_and_reverting_it_breaks(diffs_dir):
    as_patch = cmp.compare(None, "patch=fix-backend-state", workloads=["two-turn"],
                           loops=["mlx"], progress=False)
    as_diff = cmp.compare(None, f"diff={GOOD}", workloads=["two-turn"], loops=["mlx"],
                          progress=False)
    assert as_patch.clause_table()["head"].tolist() == as_diff.clause_table()["head"].tolist()
    reverted = cmp.compare(f"diff={GOOD}", None, workloads=["two-turn"], loops=["mlx"],
                           progress=False)
    assert _changes(reverted)[("7", "mlx")] == "broke"
    assert reverted.outcome() == cmp.Change.BROKE == 1
    same = cmp.compare(None, "", workloads=["two-turn"], loops=["mlx"], progress=False)
    assert same.outcome() == cmp.Change.KEPT == 5
    assert same.run_table()["first difference"].tolist() == ["none"]


def test_a_clause_both_sides_violate_can_get_worse_or_better():
    """The MLX loop already violates clause 7: a head that keeps more requests' runner
    state said "kept" (exit 5, nothing changed); it is worse (exit 1), and the reverse
    better (still violated: exit 5)."""
    worse = cmp.compare(None, "patch=user_patches:stale_rids_kept_by_the_runner",
                        workloads=["two-turn"], loops=["mlx"], progress=False)
    assert _changes(worse)[("7", "mlx")] == "worse"
    assert worse.outcome() == cmp.Change.BROKE
    assert re.search(r"compare: broke \(exit 1\): worse 7 request state retired on mlx \(6 "
                     r"\(workload, field, request\) violations new, 0 gone\) \[field "
                     r"tp_worker\.\S+ at step \d+ on two-turn, request \w+", worse.text())
    better = cmp.compare("patch=user_patches:stale_rids_kept_by_the_runner", None,
                         workloads=["two-turn"], loops=["mlx"], progress=False)
    assert _changes(better)[("7", "mlx")] == "better"
    assert better.outcome() == cmp.Change.KEPT


def test_every_fixed_or_broken_clause_names_its_fields_and_first_step():
    """``compare`` said "broke 3 step stamped" and never named ``launch_ts``; ``check``
    does. A fixed known upstream bug says it no longer reproduces."""
    broke = cmp.compare(None, "patch=no-launch-ts", workloads=["two-turn"], loops=["mlx"],
                        progress=False)
    assert "broke 3 step stamped on mlx [field launch_ts at step 1 on two-turn]" in \
        broke.text()
    fixed = cmp.compare(None, "patch=fix-processed-tokens-counter", workloads=["two-turn"],
                        loops=["normal"], progress=False)
    assert ("fixed 6 scheduling clocks advanced on normal [field processed_tokens_counter "
            "at step 2 on two-turn; known upstream bug processed-tokens-counter no longer "
            "reproduces]") in fixed.text()


def test_a_run_that_did_not_finish_says_why():
    """A head that crashes: every cell read ``crashed``, and the error was nowhere."""
    crashed = cmp.compare(None, "patch=user_patches:raise_in_loop", workloads=["two-turn"],
                          loops=["normal"], progress=False)
    assert crashed.outcome() == cmp.Change.NOT_FINISHED
    assert ("run two-turn on normal (head): crashed: " in crashed.text()
            and "injected fault in get_next_batch_to_run" in crashed.text())


def test_cli_compare_exit_codes(diffs_dir, capsys):
    assert main(["compare", "--head", f"diff={GOOD}", "--loop", "mlx", "two-turn"]) == 0
    out = capsys.readouterr().out
    assert "base: venv" in out and "+fix-backend-state.diff" in out
    assert main(["compare", "--base", f"diff={GOOD}", "--head", "", "--loop", "mlx",
                 "two-turn"]) == 1
    capsys.readouterr()
    assert main(["compare", "--head", f"diff={BAD}", "two-turn"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "scheduler.py hunk #1" in err
    assert main(["compare", "--head", "release=0.5.23,path=/x", "two-turn"]) == 2
    assert main(["compare", "--head", "", "no-such-workload"]) == 2


@pytest.mark.releases
def test_the_real_runner_kv_pool_is_a_row_judged_as_a_clause():
    """0.5.22 with ``unclamped-sync`` (0.5.21's pool sync) damages the MLX KV pool; the
    plain release does not: the KV pool row says fixed, and the exit code follows."""
    result = cmp.compare("release=0.5.22,patch=unclamped-sync", "release=0.5.22",
                         workloads=["two-turn"], runner="real", progress=False)
    table = result.clause_table().set_index("clause")
    row = table.loc["- KV pool (real MlxModelRunner)"]
    assert (row["base"], row["head"], row["change"]) == ("damaged (1/1)", "intact (1/1)",
                                                        "fixed")
    assert result.outcome() == cmp.Change.FIXED
    runs = result.run_table()
    assert runs["pool base"].iloc[0].startswith("balanced, KV DAMAGED")
    assert runs["same tokens"].iloc[0] == "NO"  # the damaged pool's second turn
