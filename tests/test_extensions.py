"""This project's extensions of the contract: clause 2's decode_batch_idx, clauses 6 and 7.

Each is seen failing and passing on crafted frames, measured on the three loops, on the
three supported releases, and judged against every built-in patch.
"""

from __future__ import annotations

import copy

import pandas as pd
import pytest

import contract_lib
from contract_lib.campaigns.status import KNOWN_UPSTREAM, Status
from contract_lib.cli import main
from contract_lib.contract import (
    CLAUSES,
    EXTENSIONS,
    HOLDS,
    NOT_EXERCISED,
    NOT_PRESENT,
    RFC,
    VIOLATED,
    check,
)
from contract_lib.patches.builtin import BUILTIN_PATCHES
from contract_lib.patches.catalog import bug_catalog
from contract_lib.verdict import Outcome, unsupported

WORKLOADS = contract_lib.workload_names()
ALL_FIXES = ("fix-chained-accounting+fix-idle-predicate+fix-processed-tokens-counter"
             "+fix-backend-state")


def _copy(frames: contract_lib.Frames) -> contract_lib.Frames:
    return contract_lib.Frames(tables={k: v.copy() for k, v in frames.tables.items()},
                               meta=copy.deepcopy(frames.meta))


def _status(frames, clause, clauses="all"):
    return check(frames, clauses).clauses[clause].status


# -- crafted frames (fast tier: committed frames) -----------------------------------------------


@pytest.fixture()
def torch_good(saved, saved_report):
    """Torch overlap on two-turn with the HRRN clock fixed: every clause holds (its
    committed frames, a fresh copy to edit)."""
    run = ("two-turn", "overlap", "fix-processed-tokens-counter")
    assert saved_report(*run).ok
    return saved(*run)


@pytest.fixture()
def mlx_good(saved, saved_report):
    """MLX on two-turn with state retirement fixed: clause 7 holds (committed frames)."""
    run = ("two-turn", "mlx", "fix-backend-state")
    assert saved_report(*run).clauses[7].status == HOLDS
    return saved(*run)


@pytest.mark.fast
def test_decode_batch_idx_fails_when_it_lags(torch_good):
    r = torch_good.requests
    row = r[(r.step == 8) & (r.rid == "b")].index[0]
    torch_good.requests.loc[row, "decode_batch_idx"] -= 1
    result = check(torch_good).clauses[2]
    assert result.status == VIOLATED and len(result.violations) == 1
    first = result.first()
    assert (first["field"], first["step"], first["rid"]) == ("decode_batch_idx", 8, "b")
    assert first["expected"] - first["actual"] == 1
    assert _status(torch_good, 2, "rfc") == HOLDS  # not one of the RFC's fields


def _known(report, clause: int) -> list[str]:
    """The catalogued upstream bugs that explain ``clause``'s violations exactly."""
    return [m.bug for m in report.known.get(clause, [])]


@pytest.mark.fast
def test_clause6_fails_on_a_clock_that_runs_ahead_or_lags(torch_good):
    steps = torch_good.steps
    ahead = torch_good.steps.copy()
    ahead.loc[ahead.step >= 9, "processed_tokens_counter"] += 5
    torch_good.tables["steps"] = ahead
    report = check(torch_good)
    result = report.clauses[6]
    assert result.status == VIOLATED and len(result.violations) == 1
    first = result.first()
    assert (first["field"], first["step"], first["expected"], first["actual"]) == (
        "processed_tokens_counter", 9, "+0", "+5")
    assert _known(report, 6) == []  # ahead, but not by what the batch carried
    lag = steps.copy()
    lag.loc[lag.step >= 1, "processed_tokens_counter"] -= 3
    torch_good.tables["steps"] = lag
    report = check(torch_good)
    result = report.clauses[6]
    assert result.status == VIOLATED and result.first()["step"] == 1
    assert "missed 3" in result.first()["explanation"]
    assert _known(report, 6) == []  # a lagging clock is not the catalogued bug


@pytest.mark.fast
def test_clause6_not_present_without_a_counter_not_exercised_without_a_launch(torch_good):
    """A release with no HRRN clock (<= 0.5.19) has clause 6 ``not-present``, the reason
    in its note and the verdict; a run that launched nothing, ``not-exercised``."""
    frames = _copy(torch_good)
    why = ("sglang 0.5.19 has no Scheduler.processed_tokens_counter and its reader "
           "Scheduler._get_new_batch_prefill_raw does not read it")
    frames.meta["absent_fields"] = {"processed_tokens_counter": why}
    frames.tables["steps"] = frames.steps.assign(processed_tokens_counter=None)
    report = check(frames)
    result = report.clauses[6]
    assert (result.status, result.note) == (NOT_PRESENT, why)
    assert result.absent == {"processed_tokens_counter": why}
    assert "not present in sglang" in report.verdict().reason
    assert "processed_tokens_counter (clause 6)" in report.verdict().reason
    torch_good.tables["launches"] = torch_good.launches.iloc[0:0]
    assert _status(torch_good, 6) == NOT_EXERCISED


def _add_state(frames, **row):
    entry = {"step": None, "rid": None, "structure": "tp_worker._mlx_runner._req_caches",
             "row": None, **row}
    frames.tables["backend_state"] = pd.concat(
        [frames.backend_state, pd.DataFrame([entry])], ignore_index=True)


def _released_at(frames, rid):
    r = frames.requests
    return int(r[(r.rid == rid) & r.finished.astype(bool)].step.min())


@pytest.mark.fast
def test_clause7_fails_on_state_kept_at_idle(mlx_good):
    last = int(mlx_good.steps.step.max())
    assert _released_at(mlx_good, "a2") == last  # no launch since: only idleness counts
    _add_state(mlx_good, step=last, rid="a2")
    result = check(mlx_good).clauses[7]
    assert result.status == VIOLATED
    first = result.first()
    assert (first["field"], first["step"], first["rid"]) == (
        "tp_worker._mlx_runner._req_caches", last, "a2")
    assert "kept while the loop is idle" in first["explanation"]


@pytest.mark.fast
def test_clause7_fails_on_state_kept_after_a_launch(mlx_good):
    released = _released_at(mlx_good, "c")
    launches = mlx_good.launches[mlx_good.launches.step >= released]
    after = int(launches.step.min()) + 1
    _add_state(mlx_good, step=released, rid="c")  # seen at its release: still in grace
    assert _status(mlx_good, 7) == HOLDS
    _add_state(mlx_good, step=after, rid="c")
    first = check(mlx_good).clauses[7].first()
    assert (first["step"], first["rid"]) == (after, "c")
    assert "kept after launch" in first["explanation"]


@pytest.mark.fast
def test_clause7_fails_on_state_for_a_request_the_scheduler_does_not_hold(mlx_good):
    _add_state(mlx_good, step=5, rid="ghost", structure="tp_worker._mlx_active_rids")
    first = check(mlx_good).clauses[7].first()
    assert (first["rid"], first["field"]) == ("ghost", "tp_worker._mlx_active_rids")
    assert "does not hold" in first["expected"]


@pytest.mark.fast
def test_clause7_fails_on_a_row_the_request_no_longer_holds(mlx_good):
    r = mlx_good.requests
    row = int(r[(r.step == 5) & (r.rid == "a")].req_pool_idx.iloc[0])
    _add_state(mlx_good, step=5, rid="a", structure="tp_worker._mlx_runner._req_pool_idx",
               row=row)
    assert _status(mlx_good, 7) == HOLDS
    _add_state(mlx_good, step=6, rid="a", structure="tp_worker._mlx_runner._req_pool_idx",
               row=row + 1)
    first = check(mlx_good).clauses[7].first()
    assert (first["step"], first["expected"]) == (6, f"row {row} (the scheduler's)")


@pytest.mark.fast
def test_clause7_judges_each_entry_whatever_order_the_rows_come_in(saved):
    """The check keys entries by (request, step): shuffled tables give the same records
    (within a step, in the order of the entries)."""
    def records(frames):
        found = check(frames).clauses[7].violations
        return found.sort_values(["step", "rid", "field"]).reset_index(drop=True)

    frames = saved("two-turn", "mlx")  # unfixed: state kept after release
    expected = records(frames)
    assert len(expected) > 0
    for name in ("backend_state", "requests", "launches", "steps"):
        frames.tables[name] = frames.tables[name].sample(frac=1, random_state=7)
    pd.testing.assert_frame_equal(records(frames), expected)


@pytest.mark.fast
def test_clause7_not_exercised_without_backend_state(mlx_good):
    mlx_good.tables["backend_state"] = mlx_good.backend_state.iloc[0:0]
    assert _status(mlx_good, 7) == NOT_EXERCISED


@pytest.mark.fast
def test_backend_state_sees_structures_bound_or_keyed_later():
    """The recorder re-reads the worker's attribute names only when their names or types
    changed, a held object's when its attribute count or its None attributes changed;
    a dict bound where None was, an object added, a dict keyed later are still found at
    the next step."""
    from types import SimpleNamespace

    from contract_lib.child.capture.backend_state import BackendStateRecorder

    worker = SimpleNamespace(model_runner=SimpleNamespace(rows_of={}), pending=None)
    recorder = BackendStateRecorder(SimpleNamespace(tp_worker=worker))
    reqs = {"a": object()}

    def structures(step):
        return {(rid, structure) for _step, rid, structure, _row in recorder.rows(step, reqs)}

    assert structures(0) == set()
    worker.pending = {"a"}  # None -> a set: same names, another type
    worker.model_runner.rows_of["a"] = 3  # same layout, keyed now
    found = {("a", "tp_worker.pending"), ("a", "tp_worker.model_runner.rows_of")}
    assert structures(1) == found
    worker.draft_runner = SimpleNamespace(req_pool_idx={"a": 1})  # a new runner
    found |= {("a", "tp_worker.draft_runner.req_pool_idx")}
    assert structures(2) == found
    # Held objects are found by what they are, not by name: an engine whose cache is
    # bound where None was, one that gains a structure, one rebound to a non-container.
    worker.engine = SimpleNamespace(caches=None, rows=[])
    assert structures(3) == found
    worker.engine.caches = {"a": object()}
    worker.engine.synced = {"a"}
    worker.engine.rows = {"a": 2}  # was a list
    found |= {("a", "tp_worker.engine.caches"), ("a", "tp_worker.engine.synced"),
              ("a", "tp_worker.engine.rows")}
    assert structures(4) == found
    worker.engine.caches = [1]  # no longer a container: skipped, not a crash
    assert structures(5) == found - {("a", "tp_worker.engine.caches")}
    worker.link = recorder.s  # the scheduler itself is not the backend's
    recorder.s.book = {"a": 1}
    assert ("a", "tp_worker.link.book") not in structures(6)


@pytest.mark.fast
def test_report_sections_and_clause_sets(saved):
    frames = saved("two-turn", "normal")
    text = check(frames).text()
    assert text.index(f"[{RFC}]") < text.index("1 slots recorded")
    assert text.index(f"[{EXTENSIONS}]") < text.index("6 scheduling clocks advanced")
    assert "2 counters advanced (+ decode_batch_idx, finished_output)" in text
    assert "known upstream: processed-tokens-counter in data/bugs.toml" in text
    rfc = check(frames, "rfc")
    assert list(rfc.clauses) == [1, 2, 3, 4, 5] and rfc.ok
    assert "decode_batch_idx" not in rfc.text() and EXTENSIONS not in rfc.text()
    with pytest.raises(ValueError, match="unknown clause set"):
        check(frames, "rfc+")


# -- real runs: the three loops ---------------------------------------------------------------


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_torch_loops_on_the_extensions(run_cached, workload, loop):
    report = check(run_cached(workload, loop))
    assert report.clauses[2].status == HOLDS  # decode_batch_idx advances on torch
    six = report.clauses[6]
    assert six.status == VIOLATED and _known(report, 6) == ["processed-tokens-counter"]
    assert report.ok and not check(run_cached(workload, loop), strict_known=True).ok
    assert report.clauses[7].status == NOT_EXERCISED
    assert report.clauses[7].note == "the loop's backend kept no per-request state"
    fixed = check(run_cached(workload, loop, "fix-processed-tokens-counter"))
    assert fixed.ok and fixed.clauses[6].status == HOLDS
    assert [m.bug for m in fixed.gone] == ["processed-tokens-counter"]


@pytest.mark.parametrize("workload", WORKLOADS)
def test_mlx_loop_on_the_extensions(run_cached, workload):
    if unsupported(run_cached(workload, "mlx").meta):
        pytest.skip(f"the mlx loop refuses {workload}")  # e.g. page_size > 1
    report = check(run_cached(workload, "mlx"))
    six, seven = report.clauses[6], report.clauses[7]
    assert six.status == VIOLATED and _known(report, 6) == ["mlx-clock"]
    assert set(six.violations["actual"]) == {"+0"}  # the MLX loop never advances it
    assert seven.status == VIOLATED
    last = int(run_cached(workload, "mlx").steps.step.max())
    assert last in set(seven.violations["step"])  # the state outlives the run: idle
    fixed = check(run_cached(workload, "mlx", ALL_FIXES))
    expected = {n: HOLDS for n in CLAUSES}  # every registered clause, a new one too
    if workload == "mixed-chunk":
        expected[4] = VIOLATED  # the relay is still never published on MLX
    assert {n: r.status for n, r in fixed.clauses.items()} == expected


def test_decode_batch_idx_lags_on_chained_decode(run_cached):
    frames = run_cached("two-turn", "mlx")
    fields = check(frames).clauses[2].violations.groupby("field").size()
    assert fields["decode_batch_idx"] > 0
    first_chained = int(frames.launches.query("chained").step.min())
    bad = check(frames).clauses[2].violations.query("field == 'decode_batch_idx'")
    assert int(bad.step.min()) == first_chained + 1
    fixed = check(run_cached("two-turn", "mlx", "fix-chained-accounting")).clauses[2]
    assert fixed.status == HOLDS


def test_memory_pressure_torch_retracts_mlx_does_not(run_cached):
    def retractions(frames):  # SGLang's own Req.retraction_count, summed over requests
        return int(frames.requests.groupby("rid")["retractions"].max().sum())

    def peak_computed(frames):
        r = frames.requests
        live = r[~r.finished.astype(bool) & r.req_pool_idx.notna()]
        return int(live.groupby("step").kv_computed.sum().max())

    normal = run_cached("memory-pressure", "normal")
    pool = int(normal.steps.kv_total.iloc[0])
    for loop in ("normal", "overlap"):
        frames = run_cached("memory-pressure", loop)
        assert retractions(frames) > 0 and peak_computed(frames) <= pool
        assert check(frames, "rfc").ok
    mlx = run_cached("memory-pressure", "mlx")
    assert retractions(mlx) == 0 and peak_computed(mlx) > pool
    fixed = run_cached("memory-pressure", "mlx", "fix-chained-accounting")
    assert retractions(fixed) == retractions(normal) and peak_computed(fixed) <= pool
    for frames in (mlx, fixed):
        assert frames.output_tokens() == normal.output_tokens()
    assert check(run_cached("memory-pressure", "mlx", ALL_FIXES)).ok


# -- every built-in patch judged against clauses 6 and 7 --------------------------------------

# patch -> (clause 6, clause 7) on two-turn on the MLX loop. On the torch loops clause 6 is
# the known upstream bug unless the patch fixes it, and clause 7 is not exercised
# (they keep no backend state).
JUDGED = {
    "no-forward-ct": ("violated", "violated"),
    "no-launch-ts": ("violated", NOT_EXERCISED),  # crashes at the first processed batch
    "fix-chained-accounting": ("violated", "violated"),
    "fix-idle-predicate": ("violated", "violated"),
    "skip-relay-publish": ("violated", "violated"),
    "unclamped-sync": ("violated", "violated"),
    "fix-processed-tokens-counter": (HOLDS, "violated"),
    "fix-backend-state": ("violated", HOLDS),
    # PD-disaggregation replays: nothing the MLX loop runs
    "prebuilt-skips-stream-output": ("violated", "violated"),
    "disagg-skips-ngram-embedding": ("violated", "violated"),
    "fix-mixed-chunk-relay": ("violated", "violated"),
}


@pytest.mark.fast
def test_every_builtin_patch_is_judged():
    assert set(JUDGED) == set(BUILTIN_PATCHES)


@pytest.mark.parametrize("patch", sorted(JUDGED))
def test_builtin_patch_against_clauses_6_and_7(run_cached, patch):
    mlx = check(run_cached("two-turn", "mlx", patch))
    assert (mlx.clauses[6].status, mlx.clauses[7].status) == JUDGED[patch]
    torch = check(run_cached("two-turn", "overlap", patch))
    six = torch.clauses[6]
    if patch == "fix-processed-tokens-counter":
        assert six.status == HOLDS
    else:
        assert _known(torch, 6) == ["processed-tokens-counter"]
    assert torch.clauses[7].status == NOT_EXERCISED


def test_unclamped_sync_keeps_the_row_mapping_too(run_cached):
    base = check(run_cached("two-turn", "mlx")).clauses[7].violations
    kept = check(run_cached("two-turn", "mlx", "unclamped-sync")).clauses[7].violations
    assert "tp_worker._mlx_runner._req_pool_idx" not in set(base.field)
    assert "tp_worker._mlx_runner._req_pool_idx" in set(kept.field)


# -- releases and the real runner -------------------------------------------------------------


@pytest.mark.releases
@pytest.mark.parametrize("version", ["0.5.21", "0.5.22"])
def test_extensions_on_older_releases(run_cached, version):
    torch = check(run_cached("two-turn", "overlap", sglang=version))
    assert _known(torch, 6) == ["processed-tokens-counter"]
    mlx = check(run_cached("two-turn", "mlx", sglang=version))
    assert mlx.clauses[6].status == VIOLATED and mlx.clauses[7].status == VIOLATED
    fixed = check(run_cached("two-turn", "mlx", ALL_FIXES, sglang=version))
    assert fixed.ok


def test_backend_state_fix_with_the_real_runner(run_cached):
    red = run_cached("two-turn", "mlx", runner="real")
    green = run_cached("two-turn", "mlx", "fix-backend-state", runner="real")
    assert check(red).clauses[7].status == VIOLATED
    assert check(green).clauses[7].status == HOLDS
    assert green.output_tokens() == red.output_tokens()


# -- status and check ---------------------------------------------------------------------------


@pytest.mark.fast
def test_status_shows_known_upstream_bugs_without_failing_the_reference_gate(saved):
    reports = {(w, loop): check(saved(w, loop)) for w in ("two-turn", "single-decode")
               for loop in ("normal", "overlap", "mlx")}
    status = Status(reports)
    table = status.table()
    six = "6 scheduling clocks advanced"
    assert table.loc[six, "normal"] == f"{KNOWN_UPSTREAM} (2/2)"
    assert table.loc[six, "mlx"] == f"{KNOWN_UPSTREAM} (2/2)"  # mlx-clock
    assert status.reference_violations().empty
    assert set(status.known_upstream().loop) == {"normal", "overlap", "mlx"}
    text = status.text()
    assert text.index(f"[{RFC}]") < text.index(f"[{EXTENSIONS}]") < text.index(six)
    assert "2 counters advanced (+ decode_batch_idx, finished_output)" in text
    # a torch clause-6 violation that is not the catalogued bug still fails the gate
    lag = saved("two-turn", "normal", "fix-processed-tokens-counter")
    lag.tables["steps"] = lag.steps.assign(processed_tokens_counter=0)
    reports[("two-turn", "normal")] = check(lag)
    assert list(Status(reports).reference_violations().clause) == [6]


@pytest.mark.fast
def test_known_upstream_bugs_are_catalogued_with_their_fix():
    bugs = {bug["id"]: bug for bug in bug_catalog()}
    bug = bugs["processed-tokens-counter"]
    assert bug["clause"] == 6 and set(bug["loops"]) == {
        "normal", "overlap", "omni", "mlx-normal", "disagg-decode-normal",
        "disagg-decode-overlap"}  # every loop whose launches run_batch stamps
    assert bugs["backend-state"]["clause"] == 7
    assert {bugs[b]["fix"] for b in ("processed-tokens-counter", "mlx-clock")} == {
        "fix-processed-tokens-counter"}
    assert all(bug.get("fix") in BUILTIN_PATCHES for bug in bugs.values() if "fix" in bug)


def test_check_exit_codes_by_clause_set(capsys):
    args = ["check", "--loop", "normal", "--workload", "single-decode", "--out", "/dev/null"]
    assert main(args) == 0  # clause 6: the torch loops' own HRRN clock, known upstream
    out = capsys.readouterr().out
    assert "clause 6 (scheduling clocks advanced): field processed_tokens_counter" in out
    assert "known upstream (catalogued bugs reproduced exactly" in out
    assert main(args + ["--strict-known"]) == 1
    assert main(args + ["--clauses", "rfc"]) == 0
    assert main(args + ["--patch", "fix-processed-tokens-counter"]) == 0
    assert "processed-tokens-counter, clause 6 field processed_tokens_counter: no longer " \
        "reproduces (its fix, patch fix-processed-tokens-counter, is applied)" in (
            capsys.readouterr().out)


@pytest.mark.parametrize("mutant", ["clock_counts_prefill_twice", "clock_adds_every_batch"])
def test_loop_local_clock_bugs_on_real_runs_are_plain_violations(run_cached, mutant):
    """With fix-processed-tokens-counter applied, a loop that adds each extend batch's
    tokens again at processing (the clock ahead at every prefill), or every batch's as
    the catalogued bug does: neither is the known upstream bug (it was labelled as it,
    and ``status`` exited 0); both fail."""
    frames = run_cached("two-turn", "normal",
                        f"fix-processed-tokens-counter+user_patches:{mutant}")
    report = check(frames)
    assert report.clauses[6].status == VIOLATED and not report.known
    assert report.verdict().outcome == Outcome.VIOLATED
    status = Status({("two-turn", "normal"): report})
    assert list(status.reference_violations().clause) == [6]
    assert status.outcome() == Outcome.VIOLATED


@pytest.mark.fast
def test_an_unknown_clause_set_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["check", "--loop", "normal", "--workload", "single-decode", "--clauses", "6"])
    assert exited.value.code == 2
    assert "invalid choice: '6'" in capsys.readouterr().err


@pytest.mark.fast
def test_frames_without_the_extension_tables_are_not_exercised(torch_good):
    """Frames recorded before the extensions (no backend_state table, no counter or
    decode_batch_idx column) check as not exercised, with the reason, never as holds."""
    del torch_good.tables["backend_state"]
    torch_good.tables["steps"] = torch_good.steps.drop(columns="processed_tokens_counter")
    torch_good.tables["requests"] = torch_good.requests.drop(
        columns=["decode_batch_idx", "kv_prefilled"])
    report = check(torch_good)
    assert report.clauses[6].status == NOT_EXERCISED
    assert report.clauses[7].status == NOT_EXERCISED
    assert report.clauses[2].status == HOLDS  # the RFC's three counters still checked


@pytest.mark.releases
@pytest.mark.parametrize("workload", ["two-turn", "mixed-chunk"])
def test_omni_copies_the_clock_bug_and_the_fix_covers_it(run_cached, workload):
    """sglang-omni's OmniScheduler.stamp_batch_launch copies run_batch's counter lines:
    the same known upstream bug; fix-processed-tokens-counter patches that copy too.
    Its ModelWorker keeps no per-request state: clause 7 is not exercised."""
    report = check(run_cached(workload, "omni"))
    assert _known(report, 6) == ["processed-tokens-counter"]
    assert report.clauses[7].status == NOT_EXERCISED
    assert report.clauses[2].status == HOLDS
    fixed = check(run_cached(workload, "omni", "fix-processed-tokens-counter"))
    assert fixed.clauses[6].status == HOLDS
