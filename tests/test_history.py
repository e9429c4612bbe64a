"""The contract's history: SGLang 0.5.14-0.5.23, unpatched, each July bug red on the
release that shipped it and green on the one that fixed it (../shared/docs/sglang-history.md).

The fast tests read the saved runs of every release (``data/history``, written by
``scripts/make-history-fixtures``); the ``releases`` tests check those files against
live runs of the oldest release and of the two newest (which tests/test_releases.py
drives anyway), and run held-out workloads on the oldest and the newest.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import matplotlib
import pandas as pd
import pytest

from contract_lib import views
from contract_lib.campaigns import history
from contract_lib.campaigns.saved_history import (
    load_file,
    save_run,
    saved_files,
    saved_releases,
    saved_run,
    saved_status,
    swept_status,
)
from contract_lib.cli import main
from contract_lib.contract import HOLDS, MASKED, NOT_PRESENT, VIOLATED, check, kv_damage
from contract_lib.frames import FramesFormatError
from contract_lib.paths import SWEEP_DIR
from contract_lib.sources.versions import SUPPORTED_SGLANG_VERSIONS
from contract_lib.workloads import workload_names

matplotlib.use("Agg")

fast = pytest.mark.fast
SHUTDOWN = "user_patches:shutdown_after_three_results"
HELD_OUT = sorted((Path(__file__).parent / "workloads" / "held-out").glob("*.toml"))
# Live: the oldest release, and the two newest (installed for tests/test_releases.py);
# of the sweep (every shipped workload), the oldest and the venv's.
LIVE = ("0.5.14", "0.5.22", "0.5.23")
SWEEP_LIVE = ("0.5.14", "0.5.23")


def _from(version: str, first: str) -> bool:
    """Whether ``version`` is ``first`` or a later supported release."""
    order = list(SUPPORTED_SGLANG_VERSIONS)
    return order.index(version) >= order.index(first)


@pytest.fixture(scope="session")
def past():
    """The saved model-free runs of every release, checked once for the session."""
    return saved_status()


def _report(past, version: str, workload: str, loop: str):
    return past.statuses[SUPPORTED_SGLANG_VERSIONS.index(version)].reports[(workload, loop)]


def _violations(report, clause: int, field: str):
    found = report.clauses[clause].violations
    return found[found["field"] == field]


def _mlx(version: str):
    return saved_run(version, "two-turn", "mlx")


@fast
def test_every_supported_release_has_its_saved_runs():
    assert saved_releases() == list(SUPPORTED_SGLANG_VERSIONS)
    names = {v: sorted(p.name for p in saved_files() if p.parent.name == v)
             for v in saved_releases()}
    assert len({tuple(n) for n in names.values()}) == 1, names  # the same runs on each


@fast
def test_the_sweep_has_every_shipped_workload_on_every_release():
    """What docs/history.md's release tables read: each shipped workload through
    normal, overlap and mlx, and mlx with the real runner (scripts/make-history-fixtures)."""
    names = {f"{w}.{run}.json.gz" for w in workload_names()
             for run in ("normal", "overlap", "mlx", "mlx.real")}
    assert saved_releases(SWEEP_DIR) == list(SUPPORTED_SGLANG_VERSIONS)
    for version in SUPPORTED_SGLANG_VERSIONS:
        assert {p.name for p in (SWEEP_DIR / version).glob("*.json.gz")} == names, version


@fast
def test_saving_the_same_run_again_keeps_the_file(tmp_path):
    """scripts/make-history-fixtures rewrites only a run whose frames changed (wall
    clock aside), so re-making the history changes only what changed."""
    run = _mlx("0.5.23")
    path, written = save_run(run, tmp_path)
    assert written and path == tmp_path / "0.5.23" / "two-turn.mlx.json.gz"
    again = load_file(path)
    again.steps["wall_time"] += 1.0  # a wall-clock column: not a change
    assert save_run(again, tmp_path) == (path, False)
    again.launches.loc[again.launches.index[0], "forward_ct"] += 1
    assert save_run(again, tmp_path) == (path, True)
    assert load_file(path).launches["forward_ct"].equals(again.launches["forward_ct"])


@fast
@pytest.mark.parametrize("content", [b"{}", b"\x1f\x8b\x08\x00cut"], ids=["plain", "cut"])
def test_a_saved_run_that_is_not_gzipped_json_names_its_file(tmp_path, content):
    path = tmp_path / "two-turn.mlx.json.gz"
    path.write_bytes(content)
    with pytest.raises(FramesFormatError, match=f"{path}: not a gzipped frames file"):
        load_file(path)


@fast
def test_a_workload_missing_from_the_sweep_names_the_script(tmp_path):
    shutil.copytree(SWEEP_DIR / "0.5.23", tmp_path / "0.5.23")
    (tmp_path / "0.5.23" / "abort.overlap.json.gz").unlink()
    with pytest.raises(FileNotFoundError, match="abort.overlap.json.gz: no saved history "
                       "run; add it to scripts/make-history-fixtures"):
        swept_status(["0.5.23"], ["normal", "overlap"], directory=tmp_path)


class TestTheSavedRuns:
    """The tests reading the saved runs' clause tables (``past``, checked once per
    session: one class, so one xdist worker checks them; conftest.py's scheduler)."""

    @fast
    def test_forward_ct_never_advanced_then_counted_late_then_at_launch(self, past):
        """Clause 3 on the MLX loop: 0.5.14 never advances ``forward_ct`` (#29217); 0.5.15
        and 0.5.16 count every launch but at finalize, so launches made before the previous
        one was finalized see it one behind (the profiler predicate one queued decode late),
        and no ``forward_iter`` is stamped; 0.5.17 counts and stamps at launch (#32447)."""
        never = _mlx("0.5.14")
        launches = len(never.launches)
        assert int(never.steps["forward_ct"].iloc[-1]) == 0
        assert len(_violations(_report(past, "0.5.14", "two-turn", "mlx"), 3,
                               "forward_ct")) == launches
        for version in ("0.5.15", "0.5.16"):
            late, report = _mlx(version), _report(past, version, "two-turn", "mlx")
            assert int(late.steps["forward_ct"].iloc[-1]) == len(late.launches) == launches
            assert 0 < len(_violations(report, 3, "forward_ct")) < launches
            assert len(_violations(report, 3, "forward_iter")) == launches
        assert _report(past, "0.5.17", "two-turn", "mlx").clauses[3].status == HOLDS


    @fast
    @pytest.mark.parametrize("version", SUPPORTED_SGLANG_VERSIONS)
    def test_after_idle_gap_stamped_by_run_batch_only_until_0_5_21(self, past, version):
        """``run_batch`` stamps ``after_idle_gap`` from 0.5.18, the MLX launch only from
        0.5.21: a2, launched after idle iterations, carried False on 0.5.18-0.5.20; before
        0.5.18 the field is not present."""
        frames = _mlx(version)
        gap = _violations(_report(past, version, "two-turn", "mlx"), 3, "after_idle_gap")
        if "after_idle_gap" in frames.absent:
            assert not _from(version, "0.5.18") and gap.empty
        elif not _from(version, "0.5.21"):
            assert gap[["expected", "actual"]].values.tolist() == [[True, False]]
            launch = frames.launches.set_index("launch").loc[int(gap["launch"].iloc[0])]
            assert (launch["rids"], launch["mode"]) == ("a2", "extend")
        else:
            assert gap.empty


    @fast
    @pytest.mark.parametrize("version, absent", [
        ("0.5.14", {"cache_protected_len", "launch_ts", "after_idle_gap",
                    "processed_tokens_counter"}),
        ("0.5.17", {"cache_protected_len", "after_idle_gap", "processed_tokens_counter"}),
        ("0.5.20", {"cache_protected_len"}),
        ("0.5.21", set())])
    def test_fields_a_release_does_not_have_are_not_present(self, past, version, absent):
        """Each field arrived with its reader: ``launch_ts`` 0.5.17, ``after_idle_gap``
        0.5.18, the HRRN clock 0.5.20; what the tree kept is written at release from 0.5.21."""
        assert set(saved_run(version, "two-turn", "normal").absent) == absent
        clause6 = _report(past, version, "two-turn", "normal").clauses[6].status
        assert (clause6 == NOT_PRESENT) == ("processed_tokens_counter" in absent)


    @fast
    @pytest.mark.parametrize("version", SUPPORTED_SGLANG_VERSIONS)
    @pytest.mark.parametrize("loop", ["normal", "overlap"])
    def test_torch_loops_hold_the_contract_on_every_release(self, past, version, loop):
        """No false positive across history: the reference loops hold every clause on every
        release but the catalogued clock bug (0.5.20 on), which is not an RFC clause."""
        report = _report(past, version, "two-turn", loop)
        assert report.ok, report.verdict().line()
        assert set(report.known) == ({6} if _from(version, "0.5.20") else set())
        assert all(report.clauses[n].status != VIOLATED for n in range(1, 6))


    @fast
    @pytest.mark.parametrize("version", SUPPORTED_SGLANG_VERSIONS)
    def test_the_open_clauses_are_red_on_every_release(self, past, version):
        """Clause 1 (unrecorded positions), 2 (chained accounting), 4 (the mixed-chunk
        relay) and 7 (backend state) were open from 0.5.14 to 0.5.23; clause 5 is masked
        from 0.5.16 (0.5.14-0.5.15's ``is_fully_idle`` also tests ``cur_batch``, which the
        MLX loop sets)."""
        two_turn = _report(past, version, "two-turn", "mlx").clauses
        assert [two_turn[n].status for n in (1, 2, 7)] == [VIOLATED] * 3
        assert two_turn[5].status == (MASKED if _from(version, "0.5.16") else HOLDS)
        mixed = _report(past, version, "mixed-chunk", "mlx")
        assert mixed.clauses[4].status == VIOLATED


    @fast
    def test_the_history_text_has_a_block_per_loop_and_the_fields_per_release(self, past):
        text = history.history_text(past)
        blocks = [line for line in text.splitlines() if line.startswith("loop ")]
        assert blocks == ["loop normal", "loop overlap", "loop mlx"]
        assert ("  clause 3 violated forward_ct, forward_iter (0.5.14-0.5.16); after_idle_gap "
                "(0.5.18-0.5.20)") in text
        assert "(not present in 0.5.14-0.5.16, not checked: clause 3 launch_ts:" in text
        assert max(len(line) for line in text.splitlines()) <= 140


    @fast
    def test_the_history_cells_are_the_side_by_side_table(self, past):
        """The history's cells are the releases' own tables, read another way."""
        cells = history.history_cells(past).set_index(["loop", "clause", "sglang"])
        for status in past.statuses:
            table = status.table()
            for clause_label, row in table.iterrows():
                number = (int(clause_label.split(" ", 1)[0]) if clause_label[0].isdigit()
                          else history.POOL if "conservation" in clause_label
                          else history.KV_POOL)
                for loop, text in row.items():
                    if text == "-":  # no MLX KV pool on a torch loop
                        continue
                    cell = cells.loc[(loop, number, status.sglang)]
                    assert text == f"{cell.status} ({cell['count']}/{cell.total})"


    @fast
    def test_a_leak_on_one_release_shows_in_every_view(self):
        """SGLang's pool conservation law broken at a step of one release's run: the
        history's cells, text and figure show a ``pool conservation`` row, red there (the
        normal loop's two-turn runs of the two newest releases)."""
        from contract_lib.campaigns.status import checked_releases

        runs = {version: {("two-turn", "normal"): saved_run(version, "two-turn", "normal")}
                for version in ("0.5.22", "0.5.23")}
        leaky = runs["0.5.23"][("two-turn", "normal")]
        leaky.steps.loc[3, "pool_leak"] = True
        result = checked_releases(runs)
        cells = history.history_cells(result).set_index(["loop", "clause", "sglang"])
        assert cells.loc[("normal", history.POOL, "0.5.23"), "status"] == "leak"
        assert cells.loc[("normal", history.POOL, "0.5.22"), "status"] == "balanced"
        assert "(KV pool conservation: leak =" in history.history_text(result)
        fig = views.clause_history(result, loops=["normal"])
        assert "leak" in [t.get_text() for t in fig.axes[0].texts]


    @fast
    def test_a_release_range_runs_every_release_between_in_order(self, past, monkeypatch,
                                                                 capsys):
        """``--sglang 0.5.14..0.5.23`` (here with a repeated one) asks for each release once,
        oldest first, and prints the history layout (more than three releases)."""
        from contract_lib.campaigns import status

        asked = []

        def saved_instead(versions, **_options):
            asked.extend(versions)
            return past

        monkeypatch.setattr(status, "releases_status", saved_instead)
        assert main(["status", "--sglang", "0.5.22", "--sglang", "0.5.14..0.5.23"]) == 0
        assert asked == ["0.5.22", *[v for v in SUPPORTED_SGLANG_VERSIONS if v != "0.5.22"]]
        assert "loop mlx\nrelease" in capsys.readouterr().out


    @fast
    def test_the_clause_by_release_figure(self, past):
        fig = views.clause_history(past, loops=["mlx", "normal"])
        assert len(fig.axes) == 2
        ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
        assert ticks == list(SUPPORTED_SGLANG_VERSIONS)
        cell_texts = [t.get_text() for t in fig.axes[0].texts]
        assert cell_texts.count("forward_ct\nforward_iter") == 3  # 0.5.14-0.5.16
        assert cell_texts.count("after_idle_gap") == 3  # 0.5.18-0.5.20
        assert not any("fields" in text for text in cell_texts)  # clause 7's differ: 5 each
        assert fig.legends
        assert [t.get_text() for t in fig.texts][:2][0].startswith("The contract")
        fig.canvas.draw()
        with pytest.raises(ValueError, match="no run of loop omni"):
            views.clause_history(past, loops=["omni"])


    @fast
    def test_the_catalogue_says_where_the_saved_runs_show_each_bug(self, past):
        """Each bug's ``measured`` (data/bugs.toml) names the releases whose saved runs show
        it, as :func:`views.read_against_measured` reads them from the runs."""
        from contract_lib.patches.catalog import bug_catalog

        shutdown = {v: saved_run(v, "two-turn", "mlx", SHUTDOWN) for v in saved_releases()}
        table = views.read_against_measured(bug_catalog(), past, saved_status(runner="real"),
                                            shutdown)
        measured = {bug["id"]: bug["measured"] for bug in bug_catalog()}
        for bug, shown in zip(table["bug"], table["red in the saved runs"]):
            shown = shown.removeprefix("none").replace("KV pool damaged: ", "")
            for span in shown.split("; "):
                assert not span or span in measured[bug], (bug, span)



@fast
@pytest.mark.parametrize("version", SUPPORTED_SGLANG_VERSIONS)
def test_the_unclamped_sync_damages_the_pool_until_0_5_22(version):
    """Clause 1's reader: through 0.5.21 the decode-KV sync is unclamped and writes
    through unrecorded req_to_token positions (slot 0, other requests' slots), with the
    real MlxModelRunner and with the model-free runner (each release's own sync)."""
    real = saved_run(version, "two-turn", "mlx", runner="real")
    assert real.status == "finished", real.error
    assert kv_damage.damaged(real) == kv_damage.damaged(_mlx(version)) == (
        not _from(version, "0.5.22"))


@fast
def test_the_damage_changes_a_later_turns_tokens_until_0_5_22():
    """With the real runner, a2 (a radix hit on a's reused row) reads the damaged KV: its
    tokens differ from the clamped releases', the other requests' do not."""
    clamped = saved_run("0.5.22", "two-turn", "mlx", runner="real").output_tokens()
    for version in SUPPORTED_SGLANG_VERSIONS:
        tokens = saved_run(version, "two-turn", "mlx", runner="real").output_tokens()
        differ = {rid for rid in tokens if tokens[rid] != clamped[rid]}
        assert differ == (set() if _from(version, "0.5.22") else {"a2"}), version


@fast
@pytest.mark.parametrize("version, startup", [
    ("0.5.14", "backport-stub-alloc-memory-pool"), ("0.5.16", "backport-stub-dp-size"),
    ("0.5.21", "backport-stub-logical-max-total-num-tokens")])
def test_the_stub_runners_startup_bugs_are_backported(version, startup):
    """0.5.14's MLX stub has no alloc_memory_pool (0.5.15 added it), 0.5.16's reads a
    dp_size ModelRunner no longer has (0.5.17 reads ps.attn_dp_size), 0.5.21's lacks
    logical_max_total_num_tokens (0.5.22): only that release's runs carry the backport."""
    for other in SUPPORTED_SGLANG_VERSIONS:
        frames = saved_run(other, "two-turn", "normal")
        assert frames.status == "finished"
        assert (startup in frames.meta["shims"]) == (other == version), other


@fast
@pytest.mark.parametrize("version", SUPPORTED_SGLANG_VERSIONS)
def test_the_shims_name_the_release_whose_triton_stand_in_was_loaded(version):
    """<= 0.5.18's own stand-in breaks torch 2.13's Inductor import: the venv's (0.5.23)
    is loaded instead; from 0.5.19 each release's own."""
    shims = saved_run(version, "two-turn", "mlx").meta["shims"]
    expected = version if _from(version, "0.5.19") else "0.5.23"
    assert [s for s in shims if s.startswith("triton-standin")] == [
        f"triton-standin-{expected}"]


@fast
@pytest.mark.parametrize("version", SUPPORTED_SGLANG_VERSIONS)
def test_the_mlx_loop_ignores_gracefully_exit_until_0_5_17(version):
    """#32447: until 0.5.17 the MLX loop never reads ``gracefully_exit`` (a shutdown
    waits out its grace period); the torch loops return at their next iteration. No
    clause sees it: the flag is read, not written, and the frames of the run it was set
    in equal the unpatched run's; the run's end shows it."""
    for loop in ("normal", "mlx"):
        frames = saved_run(version, "two-turn", loop, SHUTDOWN)
        if loop == "normal" or _from(version, "0.5.17"):
            assert frames.status == "crashed" and frames.meta["steps"] <= 4
            assert "loop returned without finishing" in frames.error["message"]
        else:
            assert frames.status == "finished"
            plain = _mlx(version).comparable()
            for name, table in frames.comparable().items():
                pd.testing.assert_frame_equal(table, plain[name], obj=name)


# -- the history view ----------------------------------------------------------------------


@fast
@pytest.mark.parametrize("value, message", [
    ("0.5.23..0.5.14", "release range 0.5.23..0.5.14: empty (0.5.23 is newer than 0.5.14)"),
    ("0.5.13..0.5.23", "release range 0.5.13..0.5.23: not supported: 0.5.13"),
    ("0.5.14..", "release range 0.5.14..: an end is missing")])
def test_a_bad_release_range_is_one_line_and_exit_2(capsys, value, message):
    assert main(["status", "--sglang", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1


# -- checked against live runs -------------------------------------------------------------


@pytest.mark.releases
@pytest.mark.parametrize("path", [p for p in saved_files() if p.parent.name in LIVE]
                         + [p for p in saved_files(SWEEP_DIR) if p.parent.name in SWEEP_LIVE],
                         ids=lambda p: f"{p.parent.parent.name}/{p.parent.name}/{p.name}")
def test_the_saved_runs_are_todays_runs(run_cached, path):
    """Else re-run ``scripts/make-history-fixtures`` (a change in what runs record)."""
    saved = load_file(path)
    meta = saved.meta
    fresh = run_cached(meta["workload"], meta["loop"], meta["patch"], meta["runner"],
                       meta["sglang_version"])
    assert (saved.status, meta["steps"]) == (fresh.status, fresh.meta["steps"])
    # whose Triton stand-in, which backports (none: refused before the build)
    assert meta.get("shims") == fresh.meta.get("shims")
    fate = ("type", "phase", "message")  # an error's log tail has timestamps
    assert ({k: saved.error.get(k) for k in fate} if saved.error else None) == (
        {k: fresh.error.get(k) for k in fate} if fresh.error else None)
    for name, table in fresh.comparable().items():
        pd.testing.assert_frame_equal(saved.comparable()[name], table, obj=name)


@pytest.mark.releases
@pytest.mark.parametrize("version", ["0.5.14", "0.5.23"])
@pytest.mark.parametrize("loop", ["normal", "overlap"])
@pytest.mark.parametrize("workload", HELD_OUT, ids=lambda p: p.stem)
def test_no_false_positive_on_held_out_workloads(run_cached, version, loop, workload):
    """Workloads written for this test (never shipped) on the oldest and the newest
    release: the torch loops hold every clause (the clock bug is catalogued)."""
    frames = run_cached(str(workload), loop, sglang=version)
    report = check(frames)
    assert report.ok, report.verdict().line()
    assert {n for n, r in report.clauses.items() if r.status == HOLDS} >= {1, 2, 3, 4}


@pytest.mark.releases
def test_a_patch_of_code_the_release_lacks_is_a_set_up_refusal(capsys):
    """``no-forward-ct`` edits ``_prepare_mlx_launch``, which 0.5.17 introduced: on 0.5.14
    a set-up error naming the missing symbol, not a crash."""
    assert main(["check", "--loop", "mlx", "--workload", "single-decode", "--sglang",
                 "0.5.14", "--patch", "no-forward-ct"]) == 2
    out = capsys.readouterr().out
    assert ("patch 'no-forward-ct': sglang 0.5.14 has no "
            "SchedulerMlxOverlapMixin._prepare_mlx_launch, the code this patch changes") in out

