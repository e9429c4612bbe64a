"""The checker: each clause seen failing on crafted frames, and on the real code."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

import contract_lib
from contract_lib.cli import main
from contract_lib.contract import (
    HOLDS,
    MASKED,
    NOT_EXERCISED,
    VIOLATED,
    ContractViolation,
    assert_contract,
    check,
)
from contract_lib.verdict import unsupported

WORKLOADS = contract_lib.workload_names()
WORKLOADS_DIR = Path(__file__).parent / "workloads"


def _statuses(report):
    return {n: r.status for n, r in report.clauses.items()}


# -- crafted frames: every clause fails on its own (fast tier: committed frames) -------------


@pytest.fixture()
def good(saved, saved_report):
    """A run that satisfies every clause (torch overlap, two-turn; with the HRRN clock
    fixed, clause 6, which the torch loops violate as shipped): its committed frames, a
    fresh copy to edit."""
    run = ("two-turn", "overlap", "fix-processed-tokens-counter")
    assert saved_report(*run).ok
    return saved(*run)


def _only(report, clause, status=VIOLATED):
    statuses = _statuses(report)
    assert statuses.pop(clause) == status
    assert all(s in (HOLDS, NOT_EXERCISED) for s in statuses.values()), statuses
    return report.clauses[clause].first()


def _live_slot(frames, step=5):
    s = frames.slots
    return s[(s.step == step) & (s.rid == "a") & (s.position == 3)].index[0]


@pytest.mark.fast
def test_clause1_fails_on_padding_slot(good):
    good.slots.loc[_live_slot(good), "slot"] = 0
    first = _only(check(good), 1)
    assert (first["field"], first["step"], first["rid"], first["actual"]) == (
        "req_to_token", 5, "a", "slot 0")


@pytest.mark.fast
def test_clause1_fails_on_free_slot(good):
    good.slots.loc[_live_slot(good), "slot_free"] = True
    first = _only(check(good), 1)
    assert first["field"] == "req_to_token" and "free" in first["actual"]


@pytest.mark.fast
def test_clause1_fails_on_slot_shared_with_another_live_request(good):
    s = good.slots
    b_slot = s[(s.step == 5) & (s.rid == "b") & (s.position == 11)].slot.iloc[0]
    good.slots.loc[_live_slot(good), "slot"] = b_slot
    first = _only(check(good), 1)
    assert "also held by b" in first["actual"]


@pytest.mark.fast
def test_clause1_fails_on_entry_left_by_the_rows_previous_holder(good):
    """A real slot, not free, held by no other live request, but never written into the
    row for this request (e.g. a finished request's radix-cached slot): stale."""
    good.slots.loc[_live_slot(good), "written"] = False
    first = _only(check(good), 1)
    assert first["actual"].endswith("(never written for a)")
    assert "previous holder" in first["explanation"]


@pytest.mark.fast
def test_clause2_fails_on_lagging_counter(good):
    r = good.requests
    row = r[(r.step == 7) & (r.rid == "b")].index[0]
    good.requests.loc[row, "kv_committed_len"] -= 2
    first = _only(check(good), 2)
    assert (first["field"], first["step"], first["rid"]) == ("kv_committed_len", 7, "b")
    assert first["expected"] - first["actual"] == 2


@pytest.mark.fast
@pytest.mark.parametrize("token, unknown_lane, status", [(152, False, VIOLATED),
                                                          (66, False, HOLDS),
                                                          (152, True, HOLDS)])
def test_clause2_fails_on_an_output_token_nothing_produced(good, token, unknown_lane,
                                                           status):
    """Request a's sixth token made its fifth again (152): no launch produced it there.
    Its own token (66) holds, and so does a request with a lane whose token is unknown
    (it is not judged)."""
    outputs = good.outputs
    outputs.loc[(outputs.rid == "a") & (outputs["index"] == 5), "token"] = token
    if unknown_lane:
        good.launches.loc[good.launches.index[0], "tokens"] = ",".join(
            [""] * len(good.launches.iloc[0]["rids"].split(",")))
    report = check(good)
    assert report.clauses[2].status == status
    if status == VIOLATED:  # (clause 1 reads the outputs too: its prefixes differ now)
        first = report.clauses[2].first()
        assert (first["field"], first["step"], first["rid"]) == ("output_ids", 8, "a")
        assert (first["expected"], first["actual"]) == (66, 152)


@pytest.mark.fast
def test_a_field_the_release_does_not_have_is_not_present_not_violated(good):
    """Batches without ``launch_ts`` violate clause 3, unless the run's SGLang has no such
    field nor a reader of it (<= 0.5.16): then clause 3 checks the rest, lists the field
    as not present with the reason, and the verdict says so."""
    good.launches["launch_ts"] = None
    good.launches["processed_launch_ts"] = None
    first = _only(check(good), 3)
    assert (first["field"], first["actual"]) == ("launch_ts", None)
    why = ("sglang 0.5.16 has no ScheduleBatch.launch_ts nor its reader "
           "Scheduler._record_step_counters")
    good.meta["absent_fields"] = {"launch_ts": why}
    report = check(good)
    assert report.ok and report.clauses[3].status == HOLDS
    assert report.clauses[3].absent == {"launch_ts": why}
    assert f"field launch_ts not present in this release: {why}" in report.text()
    assert report.verdict().reason.endswith(
        "not present in sglang 0.5.23 (no violation): launch_ts (clause 3)")
    good.launches.loc[good.launches.index[3], "forward_ct"] += 1  # the rest still checked
    assert _only(check(good), 3)["field"] == "forward_ct"


@pytest.mark.fast
def test_where_the_release_does_not_record_what_it_kept_the_reuse_rule_judges(good):
    """<= 0.5.20 release a finished request without writing what the radix tree kept into
    its ``cache_protected_len``: the kept-at-release rule is not checked there, and a
    later request reusing less than the request committed still fails clause 2."""
    requests = good.requests
    released = requests[(requests.rid == "a") & requests.req_pool_idx.isna()
                        & requests.finished.astype(bool)]
    requests.loc[released.index, "cache_protected_len"] = 16  # its prompt, as <= 0.5.20
    assert _only(check(good), 2)["field"] == "cache_protected_len"
    good.meta["absent_fields"] = {"cache_protected_len": "not written at release"}
    report = check(good)
    assert report.ok and report.clauses[2].absent == {
        "cache_protected_len": "not written at release"}
    a2 = requests.index[requests.rid == "a2"]
    requests.loc[a2, "cached_tokens"] = 16  # a2 reused a's prompt only
    first = _only(check(good), 2)
    assert (first["field"], first["rid"], first["expected"], first["actual"]) == (
        "cached_tokens", "a2", 27, 16)


@pytest.mark.fast
def test_clause3_fails_on_an_idle_gap_not_stamped(good):
    """two-turn's a2 is launched after steps in which nothing was: its batch must say so."""
    launches = good.launches
    gapped = launches.index[launches["processed_after_idle_gap"].astype(bool)]
    assert len(gapped) == 1
    launches.loc[gapped, "processed_after_idle_gap"] = False
    first = _only(check(good), 3)
    assert (first["field"], first["expected"], first["actual"]) == ("after_idle_gap", True,
                                                                     False)
    assert "ended with nothing to run" in first["explanation"]


@pytest.mark.fast
def test_clause2_fails_on_a_stop_token_before_the_last(good):
    """Request b finished on its next-to-last token, as a stop, and no step shows its last
    token (outputs are read after the last step, as a crashed run's may be): reported at
    the step it ended, not an error."""
    requests, outputs = good.requests, good.outputs
    tokens = outputs.loc[outputs.rid == "b", "token"].tolist()
    assert tokens.index(tokens[-2]) == len(tokens) - 2
    b = requests.rid == "b"
    ended = requests.index[b & requests.finished.astype(bool)]
    requests.loc[ended, ["finish_reason", "finish_matched"]] = ["stop", tokens[-2]]
    requests.loc[b, "emitted"] = requests.loc[b, "emitted"].clip(upper=len(tokens) - 1)
    rows = check(good).clauses[2].violations
    first = rows[rows.rid == "b"].iloc[0]
    assert (first["field"], first["step"], first["expected"], first["actual"]) == (
        "output_ids", int(requests.loc[ended, "step"].min()), len(tokens) - 1, len(tokens))


@pytest.mark.fast
@pytest.mark.parametrize("asked, evicted, status", [(8, 10, HOLDS), (9, 10, VIOLATED),
                                                    (None, 0, HOLDS)])
def test_clause2_fails_on_an_eviction_beyond_the_shortfall(good, asked, evicted, status):
    """An allocation of 50 tokens with 42 free may have the tree evict 8 (it may free a
    whole leaf more); asking for 9 throws cached prefixes away."""
    good.tables["evictions"] = pd.DataFrame([{
        "step": 5, "need": 50, "available": 42, "asked": asked,
        "evictable_before": 38, "evictable_after": 38 - evicted}])
    report = check(good)
    assert report.clauses[2].status == status
    if status == VIOLATED:
        first = _only(report, 2)
        assert (first["field"], first["step"], first["expected"], first["actual"]) == (
            "evict_for_alloc", 5, "<= 8", 9)


@pytest.mark.fast
def test_clause2_fails_on_a_retraction_count_with_no_retraction(good):
    """Request a's count rises at step 6 though it kept its row: the count is users'
    ``num_retractions``."""
    requests = good.requests
    requests.loc[(requests.rid == "a") & (requests.step >= 6), "retractions"] = 1
    first = _only(check(good), 2)
    assert (first["field"], first["step"], first["rid"], first["expected"],
            first["actual"]) == ("retraction_count", 6, "a", 0, 1)


@pytest.mark.fast
def test_tokens_the_model_did_not_compute_fail_a_run_no_clause_faults(good):
    """Request c's third token replaced in what the forward produced and what it emitted
    (consistent with each other, so no clause sees it): not the model's continuation of
    its prompt, so not a pass; the verdict says no clause found the cause."""
    launches, outputs = good.launches, good.outputs
    lanes = [(index, rids.split(",").index("c")) for index, rids in launches["rids"].items()
             if "c" in rids.split(",")]
    index, lane = lanes[2]
    tokens = launches.loc[index, "tokens"].split(",")
    row = (outputs.rid == "c") & (outputs["index"] == 2)
    assert int(tokens[lane]) == int(outputs.loc[row, "token"].iloc[0])
    tokens[lane] = "99"
    launches.loc[index, "tokens"] = ",".join(tokens)
    outputs.loc[row, "token"] = 99
    report = check(good)
    assert all(r.status in (HOLDS, NOT_EXERCISED) for r in report.clauses.values())
    verdict = report.verdict()
    assert verdict.outcome.value == 1 and "a gap in the contract" in verdict.reason
    assert report.wrong_outputs.iloc[0][["rid", "index", "actual"]].tolist() == ["c", 2, 99]
    assert "a gap in the contract" in report.text()  # the table is all green: say why


@pytest.mark.fast
def test_request_ids_with_commas_read_as_lanes():
    """``launches.rids`` joins request ids with commas, and an id is free text: a run with
    a request "p,q" was a clause 2 false red (its lanes read as "p" and "q")."""
    from contract_lib.contract.emitted import _lanes

    assert _lanes("p,q,r", {"p,q", "r"}, 2) == ["p,q", "r"]
    assert _lanes("p,q,r", {"p", "p,q", "r"}, 2) is None  # ambiguous: not judged
    assert _lanes("a,b", {"a", "b"}, 3) is None


@pytest.mark.fast
def test_clause3_fails_on_each_stamp(good):
    launches = good.launches
    broken = good.launches.copy()
    good.tables["launches"] = broken.assign(forward_ct=launches.forward_ct.where(
        launches.launch != 3, launches.forward_ct - 1))
    assert _only(check(good), 3)["field"] == "forward_ct"
    good.tables["launches"] = broken.assign(processed_forward_iter=launches.forward_ct + 1)
    assert _only(check(good), 3)["field"] == "forward_iter"
    good.tables["launches"] = broken.assign(processed_launch_ts=None)
    assert _only(check(good), 3)["field"] == "launch_ts"
    good.tables["launches"] = broken.assign(
        processed_launch_ts=launches.processed_launch_ts[::-1].values)
    assert _only(check(good), 3)["field"] == "launch_ts"


@pytest.mark.fast
def test_clause4_fails_on_unpublished_read(good):
    reads = good.relay.index[good.relay.event == "read"]
    good.relay.loc[reads[2], "published_for_rid"] = False
    first = _only(check(good), 4)
    assert first["field"] == "output_tokens_buf"


@pytest.mark.fast
def test_clause5_masked_and_plain_violation(good):
    busy = good.steps.index[good.steps.result_queue_len > 0]
    good.steps.loc[busy[1], "idle_probe"] = True
    assert _only(check(good), 5, MASKED)["field"] == "result_queue"
    good.steps.loc[busy[1], "is_fully_idle"] = True
    assert _only(check(good), 5, VIOLATED)["field"] == "result_queue"


@pytest.mark.fast
def test_an_abort_without_a_message_says_so(good):
    last = good.requests.index[-1]
    good.requests.loc[last, ["finish_reason", "finish_message"]] = ["abort", None]
    assert list(check(good).aborted["message"]) == ["(no message)"]


def test_a_pool_leak_fails_the_run(good):
    """SGLang's own conservation law not balancing is a finding, not a footnote: the run
    is violated (it passed with the leak printed in its table) and ``assert_contract``
    raises naming the law and the step."""
    good.steps.loc[4, "pool_leak"] = True
    report = check(good)
    assert list(report.pool.step) == [4] and not report.ok
    assert report.verdict().reason.startswith(
        "the KV pool's accounting did not balance (first at step 4: available ")
    with pytest.raises(ContractViolation, match=r"^KV pool conservation \(SGLang "
                                                r"InvariantChecker\) on \w+: first leak at step 4"):
        assert_contract(good)


@pytest.mark.fast
def test_a_tree_lock_with_no_request_fails_the_run(good):
    """The radix tree protecting KV at a step where no request holds a row (a lock never
    released): SGLang's own law counts protected slots as accounted for."""
    last = good.steps.index[-1]
    good.steps.loc[last, "kv_protected"] = 27
    report = check(good)
    assert list(report.pool.step) == [good.steps.loc[last, "step"]]
    assert "protected 27 with no request holding a row" in report.verdict().reason


@pytest.mark.parametrize("loop", ["normal", "overlap", "mlx"])
def test_a_release_that_keeps_its_tree_lock_fails_the_run(run_cached, loop):
    """``release_kv_cache`` never unlocking the request's node: its prefix stays protected
    (never evictable) and the runs passed. First seen at the idle steps before a2."""
    base = ("fix-chained-accounting+fix-idle-predicate+fix-processed-tokens-counter"
            if loop == "mlx" else "fix-processed-tokens-counter")
    report = check(run_cached("two-turn", loop,
                              f"{base}+user_patches:release_keeps_the_tree_lock"))
    assert not report.ok and "a radix tree lock never released" in report.pool.iloc[0][
        "explanation"]


# -- the torch loops are the reference ------------------------------------------------------


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_torch_loops_satisfy_every_clause(run_cached, workload, loop):
    report = assert_contract(run_cached(workload, loop), clauses="rfc")
    assert report.pool.empty
    expected_5 = NOT_EXERCISED if loop == "normal" else HOLDS
    assert _statuses(report) == {1: HOLDS, 2: HOLDS, 3: HOLDS, 4: HOLDS, 5: expected_5}


# -- the RFC's test: red on 0.5.23's MLX loop, green with the candidate fixes ----------------


def test_mlx_two_turn_on_0_5_23(run_cached):
    frames = run_cached("two-turn", "mlx")
    report = check(frames, clauses="rfc")
    assert _statuses(report) == {1: VIOLATED, 2: VIOLATED, 3: HOLDS, 4: HOLDS, 5: MASKED}
    first_chained = int(frames.launches.query("chained").step.min())
    # the first chained launch is queued at that step; the next boundary sees it
    assert report.clauses[1].first()["step"] == first_chained + 1
    assert report.clauses[2].first()["step"] == first_chained + 1
    with pytest.raises(ContractViolation, match=r"^clause 1 \(slots recorded\): field "
                                                r"req_to_token at step 3, request a"):
        assert_contract(frames, clauses="rfc")


def test_mlx_with_both_fixes_satisfies_every_clause(run_cached):
    frames = run_cached("two-turn", "mlx", "fix-chained-accounting+fix-idle-predicate")
    assert _statuses(assert_contract(frames, clauses="rfc")) == {n: HOLDS for n in range(1, 6)}


# -- each built-in patch: red where the bug is, green where the fix is -----------------------


def test_no_forward_ct_red_green(run_cached):
    red = check(run_cached("two-turn", "mlx", "no-forward-ct")).clauses[3]
    assert red.status == VIOLATED
    first = red.first()
    assert (first["field"], first["launch"], first["expected"], first["actual"]) == (
        "forward_ct", 1, 1, 0)
    assert check(run_cached("two-turn", "mlx")).clauses[3].status == HOLDS


def test_no_launch_ts_is_the_startup_type_error(run_cached):
    frames = run_cached("two-turn", "mlx", "no-launch-ts")
    assert frames.status == "crashed" and frames.error["type"] == "TypeError"
    assert "_record_step_counters" in frames.error["traceback"]
    report = check(frames)
    first = report.clauses[3].first()
    assert (first["field"], first["launch"]) == ("launch_ts", 1)
    assert "run crashed: TypeError" in report.text()


def test_mixed_chunk_reads_unpublished_relay_on_mlx_only(run_cached):
    red = check(run_cached("mixed-chunk", "mlx")).clauses[4]
    assert red.status == VIOLATED and len(red.violations) == 3
    assert red.first()["actual"] == "-1 (never written)"
    assert "mixed batch" in red.first()["explanation"]
    torch_reads = run_cached("mixed-chunk", "overlap").relay.query(
        "kind == 'mixed' and event == 'read'")
    assert len(torch_reads) == 3 and torch_reads.published_for_rid.all()


def test_fix_chained_accounting_turns_clauses_1_and_2_green(run_cached):
    for workload in WORKLOADS:
        frames = run_cached(workload, "mlx", "fix-chained-accounting")
        if unsupported(frames.meta):  # e.g. page_size > 1 on MLX
            continue
        report = check(frames)
        assert report.clauses[1].status == HOLDS, workload
        assert report.clauses[2].status == HOLDS, workload
        assert report.pool.empty, workload  # no leaked slot, finish-during-chain included


def test_fix_chained_accounting_restores_prefix_reuse(run_cached):
    def cached(loop, patch=None):
        r = run_cached("two-turn", loop, patch).requests
        return int(r[r.rid == "a2"].cached_tokens.max())

    assert cached("mlx") < cached("normal")
    assert cached("mlx", "fix-chained-accounting") >= cached("normal")


def test_fix_idle_predicate_red_green(run_cached):
    assert check(run_cached("two-turn", "mlx")).clauses[5].status == MASKED
    assert check(run_cached("two-turn", "mlx", "fix-idle-predicate")).clauses[5].status == HOLDS


def test_skip_relay_publish_breaks_clause_4_on_torch(run_cached):
    report = check(run_cached("two-turn", "overlap", "skip-relay-publish"))
    first = report.clauses[4].first()
    assert report.clauses[4].status == VIOLATED
    assert (first["field"], first["actual"]) == ("output_tokens_buf", "-1 (never written)")


def test_a_relay_overwritten_after_its_publish_breaks_clause_4(run_cached):
    """The relay rows are recorded as they hold after the stash, not as the stash was
    given them, and a read must see what was last published: a stash that publishes,
    then overwrites the rows, passed as published."""
    report = check(run_cached("two-turn", "overlap",
                              "user_patches:relay_overwritten_after_stash"), "rfc")
    first = report.clauses[4].first()
    assert report.clauses[4].status == VIOLATED
    assert (first["field"], first["step"], first["rid"], first["actual"]) == (
        "output_tokens_buf", 1, "a", "7 (stale)")


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_a_radix_insert_cut_short_at_release_breaks_clause_2(run_cached, loop):
    """A finished request's release keeps what it committed in the radix tree: an insert
    two positions short (the counters right, the pool balanced, a later turn's
    cached_tokens two lower) passed."""
    report = check(run_cached("two-turn", loop, "user_patches:truncated_finish_insert"),
                   "rfc")
    first = report.clauses[2].first()
    assert report.clauses[2].status == VIOLATED
    assert (first["field"], first["rid"], first["expected"], first["actual"]) == (
        "cache_protected_len", "b", 21, 19)


@pytest.mark.parametrize("loop, workload, expected", [
    ("normal", "two-turn", 27), ("overlap", "page-size-4", 28), ("mlx", "two-turn", 27)])
def test_radix_keys_off_by_one_break_clause_2(run_cached, loop, workload, expected):
    """A radix insert keyed by the prompt and the outputs from the second one on: the
    slots and the protected length right, the pool balanced, and a later turn matched
    only the prompt (a2 prefilled 11 tokens again). It passed on the torch loops: a
    request admitted after one was released reuses the prefix the tree kept of it."""
    base = ("fix-chained-accounting+fix-idle-predicate+fix-processed-tokens-counter"
            if loop == "mlx" else "fix-processed-tokens-counter")
    frames = run_cached(workload, loop, f"{base}+user_patches:radix_keys_skip_first_output")
    found = check(frames).clauses[2].violations
    reuse = found[found["field"] == "cached_tokens"]
    assert (reuse["rid"].tolist(), reuse["expected"].tolist(), reuse["actual"].tolist()) == (
        ["a2"], [expected], [16])
    assert "nothing evicted since" in reuse["explanation"].iloc[0]


@pytest.mark.parametrize("loop", ["normal", "overlap", "mlx"])
@pytest.mark.parametrize("workload, patch, step, expected, actual", [
    ("retraction-shared", "retraction_recounts_the_cache_hit", None, "<= 15", None),
    ("chunk-one", "chunks_counted_as_cache_hits", 5, 0, 16)])
def test_a_cache_hit_counted_twice_breaks_clause_2(run_cached, loop, workload, patch,
                                                   step, expected, actual):
    """SGLang #11900 (a re-prefill after a retraction counts its radix hit again) and
    #2555 (later chunks count the request's own earlier chunks as hits), reintroduced:
    users' cached_tokens exceed the prompt or grow after the first prefill; every run
    passed. A hit is counted once, at most one token short of the prompt."""
    base = ("fix-chained-accounting+fix-idle-predicate+fix-processed-tokens-counter"
            if loop == "mlx" else "fix-processed-tokens-counter")
    frames = run_cached(str(WORKLOADS_DIR / f"{workload}.toml"), loop,
                        f"{base}+user_patches:{patch}")
    first = check(frames).clauses[2].first()
    assert (first["field"], first["rid"], first["expected"]) == ("cached_tokens", "b", expected)
    if step is not None:
        assert (first["step"], first["actual"]) == (step, actual)


@pytest.mark.parametrize("loop, expected", [
    ("normal", 27), ("overlap", 27), ("mlx", 28),
    pytest.param("omni", 28, marks=pytest.mark.releases)])
def test_a_cache_hit_counted_one_high_breaks_clause_2(run_cached, loop, expected):
    """A radix hit counted one token high: within the prompt, counted once, above what
    the tree allowed, and it passed. The hit is the prefix the first prefill did not
    compute: read off its forward slots (torch, omni), or off a launch that prefilled
    the request alone (MLX)."""
    base = ("fix-chained-accounting+fix-idle-predicate+fix-processed-tokens-counter"
            if loop == "mlx" else "fix-processed-tokens-counter")
    frames = run_cached("two-turn", loop, f"{base}+user_patches:cache_hit_counted_one_high")
    first = check(frames).clauses[2].first()
    assert (first["field"], first["step"], first["rid"], first["expected"],
            first["actual"]) == ("cached_tokens", 17, "a2", expected, expected + 1)


def test_a_reuse_after_an_eviction_is_not_expected(run_cached, monkeypatch):
    """The reuse check expects nothing once the tree may have lost tokens: f's prompt is
    a prefix of c's, and c's cached prefix was evicted before f came (f reused none of
    it). Without the eviction guard the check would call that cache loss."""
    from contract_lib.contract import radix

    frames = run_cached(str(WORKLOADS_DIR / "radix-eviction.toml"), "normal",
                        "fix-processed-tokens-counter")
    assert len(frames.evictions) > 0

    def reuse_findings():
        found = check(frames).clauses[2].violations
        return found.loc[found["field"] == "cached_tokens", "rid"].tolist()

    assert reuse_findings() == []
    monkeypatch.setattr(radix, "_disturbed_iterations", lambda frames: [])
    assert reuse_findings() == ["f"]


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_slots_permuted_inside_the_protected_prefix_break_clause_1(run_cached, loop):
    """A slot's KV must be of the position it is recorded at, inside the radix-protected
    prefix too: two of a request's own slots swapped before each radix insert (the pool
    balances, no slot is another request's) passed."""
    report = check(run_cached("two-turn", loop, "user_patches:checkpoint_swaps_last_two"),
                   "rfc")
    first = report.clauses[1].first()
    assert report.clauses[1].status == VIOLATED
    assert (first["field"], first["rid"]) == ("req_to_token", "a")
    assert first["expected"].endswith("at position 14")
    assert report.clauses[1].violations["actual"].str.contains(
        "holds the KV of position").any()


SHARED_PREFIX = str(Path(__file__).parent / "workloads" / "shared-prefix.toml")


@pytest.mark.parametrize("loop, page_size, patch, slot", [
    ("normal", 1, "radix_match_one_token_long", 11),
    ("overlap", 1, "radix_match_one_token_long", 11),
    ("normal", 4, "radix_match_page_ceil", 14)])
def test_a_radix_match_past_the_shared_prefix_breaks_clause_1(loop, page_size, patch, slot):
    """A slot shared through the radix tree must hold the KV of the same tokens: a match
    one token (or one partial page) longer than the prompts share served b the KV a
    computed for its own token at position 10, at the right position, and passed."""
    def report(name):
        return check(contract_lib.run(SHARED_PREFIX, loop, patch=f"user_patches:{name}",
                                      server_args={"page_size": page_size}), "rfc")

    assert report("python_tree_core").clauses[1].status == HOLDS  # the same tree, unpatched
    broken = report(patch).clauses[1]
    first = broken.first()
    assert broken.status == VIOLATED
    assert (first["field"], first["rid"], first["step"]) == ("req_to_token", "b", 13)
    assert first["expected"].endswith("at position 10")
    assert first["actual"] == (f"slot {slot} (holds a's KV of this position; their tokens "
                               "differ from position 10)")


def test_a_reader_that_feeds_other_rows_breaks_clause_4(run_cached):
    """A read is what it fed the batch, not what the rows the capture expected held: a
    reader that gathers a decode batch's rows in reverse passed as published."""
    report = check(run_cached("two-turn", "overlap", "user_patches:relay_reader_flipped"),
                   "rfc")
    first = report.clauses[4].first()
    assert report.clauses[4].status == VIOLATED
    assert (first["field"], first["step"], first["rid"]) == ("output_tokens_buf", 1, "a")
    assert "(last published: " in first["explanation"]


@pytest.mark.parametrize("workload, loop, patch, step", [
    ("two-turn", "normal", "skip-relay-publish", 1),
    ("mixed-chunk", "mlx", "fix-chained-accounting+fix-idle-predicate", 5)])
def test_a_reader_reached_through_another_name_is_still_recorded(
        run_cached, workload, loop, patch, step):
    """A refactor that moves the relay reader onto ``FutureMap`` reaches it through its
    defining module, not the loops' bindings: its unpublished reads went unrecorded and
    clause 4 held as "provably unread"."""
    frames = run_cached(workload, loop, f"user_patches:relay_reader_on_future_map+{patch}")
    report = check(frames, "rfc")
    first = report.clauses[4].first()
    assert report.clauses[4].status == VIOLATED
    assert (first["field"], first["step"]) == ("output_tokens_buf", step)
    # each read recorded once, however many wrapped bindings it passed through
    reads = frames.relay[frames.relay.event == "read"]
    assert not reads.duplicated(["launch", "row"]).any()


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_a_gather_around_the_reader_is_checked_at_the_forward(run_cached, loop):
    """``run_batch`` gathers the relay rows itself, in reverse, without calling the
    reader: no read was recorded and clause 4 held as "provably unread". What the
    forward was fed is read at the forward."""
    report = check(run_cached("two-turn", loop, "user_patches:relay_gathered_inline"), "rfc")
    first = report.clauses[4].first()
    assert report.clauses[4].status == VIOLATED
    assert (first["step"], first["rid"]) == (1, "a")
    assert first["actual"].endswith("(fed, no recorded read)")
    assert first["expected"].startswith("the request's latest token ")


@pytest.mark.parametrize("patch, expected", [
    ("frozen_launch_ts", "> "), ("wall_clock_launch_ts", "(time.monotonic around its launch")])
def test_a_launch_ts_that_does_not_tick_on_the_loops_clock_breaks_clause_3(
        run_cached, patch, expected):
    """launch_ts must increase from launch to launch and be a stamp of the loop's clock
    taken during the run; a frozen or a wall-clock stamp passed as merely set."""
    report = check(run_cached("finish-mid-chain", "normal", f"user_patches:{patch}"), "rfc")
    first = report.clauses[3].first()
    assert report.clauses[3].status == VIOLATED and first["field"] == "launch_ts"
    assert expected in first["expected"]


def test_a_batch_stamped_again_before_its_processing_breaks_clause_3(run_cached):
    """The batch processed must carry the stamp of its launch: restamped just before
    process_batch_result (increasing, on the loop's clock), it passed."""
    report = check(run_cached("two-turn", "overlap", "user_patches:launch_ts_at_processing"),
                   "rfc")
    first = report.clauses[3].first()
    assert report.clauses[3].status == VIOLATED and first["field"] == "launch_ts"
    assert first["launch"] == 1 and first["expected"].endswith("(stamped at launch)")


@pytest.mark.parametrize("patch", ["idle_in_flight_term_only_by_default",
                                   "idle_flag_of_one_caller"])
def test_an_in_flight_term_kept_only_for_a_plain_call_breaks_clause_5(run_cached, patch):
    """The predicate is asked as each caller may ask: one that tells the health check
    and the flush idle while a job is queued (a plain call still says busy) passed, and
    so did one whose new flag, passed by one caller only, drops the in-flight term."""
    report = check(run_cached("two-turn", "overlap", f"user_patches:{patch}"), "rfc")
    first = report.clauses[5].first()
    assert report.clauses[5].status == MASKED and first["step"] == 1
    assert first["actual"] == "idle with 1 job(s) queued"


def test_in_flight_work_kept_outside_the_queue_is_still_in_flight(run_cached):
    """In-flight work is also read from the launches (made earlier, processed at this
    step or later): a loop that keeps it outside ``result_queue`` was 'not exercised'."""
    report = check(run_cached("two-turn", "overlap", "user_patches:in_flight_elsewhere"),
                   "rfc")
    first = report.clauses[5].first()
    assert report.clauses[5].status == MASKED and first["step"] == 1
    assert first["actual"] == ("idle with 0 job(s) queued and 1 launch(es) in flight "
                               "outside result_queue")


def test_a_decode_that_does_not_advance_its_counters_breaks_clause_2(run_cached):
    """On the torch loops a decode lane's computed positions are counted (one more than
    the request had), not read off the batch's ``seq_lens``: a skipped
    ``prepare_for_decode`` passed, the reference being the counter itself."""
    report = check(run_cached("finish-mid-chain", "normal",
                              "user_patches:skip_some_decode_prepares"), "rfc")
    first = report.clauses[2].first()
    assert report.clauses[2].status == VIOLATED
    assert (first["field"], first["step"], first["rid"], first["expected"],
            first["actual"]) == ("seq_lens", 4, "a", 13, 12)


def test_slots_recorded_for_another_request_break_clause_1(run_cached):
    """A position a torch launch computed must record the slot its forward wrote the KV
    to (``forward_slots``): decode slots recorded in swapped rows passed, each entry
    being a real, written, unshared slot."""
    report = check(run_cached("finish-mid-chain", "normal", "user_patches:swap_decode_slots"),
                   "rfc")
    first = report.clauses[1].first()
    assert report.clauses[1].status == VIOLATED
    assert (first["step"], first["rid"], first["actual"]) == (
        2, "a", "slot 33 (its KV went to slot 31)")


def test_user_patch_is_reported_against_its_clause_and_field(run_cached):
    report = check(run_cached("single-decode", "normal", "user_patches:stale_forward_iter"))
    assert _statuses(report)[3] == VIOLATED
    assert report.clauses[3].first()["field"] == "forward_iter"


# -- the command ----------------------------------------------------------------------------


def test_check_command_exit_codes(capsys):
    assert main(["check", "--loop", "normal", "--workload", "single-decode",
                 "--clauses", "rfc", "--out", "/dev/null"]) == 0
    assert main(["check", "--loop", "mlx", "--workload", "single-decode",
                 "--out", "/dev/null"]) == 1
    out = capsys.readouterr().out
    assert "clause 1 (slots recorded): field req_to_token" in out
    assert main(["check", "--loop", "mlx", "--workload", "nope"]) == 2
    assert "unknown workload" in capsys.readouterr().err


def test_patched_loop_keeps_the_capture_hooks(run_cached):
    """A source patch of the MLX loop must still have its relay reads recorded."""
    report = check(run_cached("mixed-chunk", "mlx", "fix-chained-accounting"))
    assert report.clauses[4].status == VIOLATED and len(report.clauses[4].violations) == 3


def test_a_run_that_fails_in_setup_is_exit_code_2(capsys):
    assert main(["check", "--loop", "normal", "--workload", "single-decode",
                 "--server-arg", "max_runing_requests=4", "--out", "/dev/null"]) == 2
    captured = capsys.readouterr()  # checked before the run (stderr) or in it (stdout)
    assert "max_runing_requests" in captured.out + captured.err


DETERMINISTIC_ON_FLASHINFER = {"enable_deterministic_inference": True,
                               "attention_backend": "flashinfer",
                               "chunked_prefill_size": 4096}  # 0.5.22 (omni) asks for it


@pytest.mark.parametrize("loop, server_args, resolved", [
    ("normal", DETERMINISTIC_ON_FLASHINFER,
     {"page_size": 1, "disable_radix_cache": True, "disaggregation_mode": "null"}),
    pytest.param("omni", DETERMINISTIC_ON_FLASHINFER,
                 {"page_size": 1, "disable_radix_cache": True, "disaggregation_mode": "null"},
                 marks=pytest.mark.releases),
    ("normal", {"attention_backend": "hpc_ops"},
     {"page_size": 64, "disable_radix_cache": False, "disaggregation_mode": "null"})])
def test_server_args_are_read_as_sglang_resolved_them(loop, server_args, resolved):
    """SGLang overrides some args it was given (deterministic inference on flashinfer
    disables the radix cache; an MLA backend sets 64-token pages): read as given, the
    first was a clause 2 false red (0 positions protected; on omni too, whose scheduler
    keeps no resolved copy: the tree's own switch is read) and the second refused as an
    unsupported page size."""
    frames = contract_lib.run("two-turn", loop, patch="fix-processed-tokens-counter",
                              server_args=server_args)
    assert frames.status == "finished" and frames.meta["resolved_args"] == resolved
    assert check(frames).clauses[2].status == HOLDS


@pytest.mark.parametrize("patch, field, step, rid, expected, actual", [
    ("finish_after_two_tokens", "output_ids", 3, "a", 12, 2),
    ("request_c_never_scheduled", "output_ids", 6, "c", 6, 0),
    ("prompt_loses_its_last_token", "origin_input_ids", 1, "a", 16, 15)])
def test_a_request_not_served_as_fed_breaks_clause_2(run_cached, patch, field, step, rid,
                                                       expected, actual):
    """A loop that ends requests early by length, drops one (finished, never queued), or
    computes a shortened prompt: every counter agreed with what was computed, and it
    passed. The prompt held must be the prompt fed, and a length finish its budget."""
    frames = run_cached("two-turn", "overlap",
                        f"fix-processed-tokens-counter+user_patches:{patch}")
    first = check(frames).clauses[2].first()
    assert (first["field"], first["step"], first["rid"]) == (field, step, rid)
    assert (first["expected"], first["actual"]) == (expected, actual)


@pytest.mark.parametrize("loop", ["overlap", "mlx"])
@pytest.mark.parametrize("patch, step, expected, actual", [
    ("every_fourth_decode_processed_twice", 6, 66, 152),
    ("decode_tokens_to_the_wrong_lanes", 3, 230, 378)])
def test_a_result_applied_twice_or_to_other_lanes_breaks_clause_2(run_cached, loop, patch,
                                                                  step, expected, actual):
    """A decode result processed twice, or given to its batch's requests in reverse: every
    counter moved with the tokens, and the runs passed (duplicated or swapped text). Each
    request's tokens must be ones the forward produced for it, in order, each once."""
    base = ("fix-chained-accounting+fix-idle-predicate+fix-processed-tokens-counter"
            if loop == "mlx" else "fix-processed-tokens-counter")
    report = check(run_cached("two-turn", loop, f"{base}+user_patches:{patch}"))
    first = report.clauses[2].first()
    assert (first["field"], first["step"], first["rid"]) == ("output_ids", step, "a")
    assert (first["expected"], first["actual"]) == (expected, actual)


@pytest.mark.parametrize("loop", ["overlap", "mlx"])
@pytest.mark.parametrize("workload, patch, step, rid, expected, actual", [
    ("stop-tokens", "stop_check_one_late", 7, "b", 4, 5),
    ("abort", "abort_keeps_queued", 6, "b", 0, 1)])
def test_a_request_served_past_its_end_breaks_clause_2(run_cached, loop, workload, patch,
                                                       step, rid, expected, actual):
    """A stop that ends its request a token late, and an abort that leaves its request
    queued (served for a client told it was aborted), passed on the torch loops: the
    first stop token must be the last, and nothing is emitted after a request ended."""
    base = ("fix-chained-accounting+fix-idle-predicate+fix-processed-tokens-counter"
            if loop == "mlx" else "fix-processed-tokens-counter")
    first = check(run_cached(workload, loop, f"{base}+user_patches:{patch}")).clauses[2].first()
    assert (first["field"], first["step"], first["rid"]) == ("output_ids", step, rid)
    assert (first["expected"], first["actual"]) == (expected, actual)


@pytest.mark.parametrize("loop", ["normal", "overlap", "mlx"])
def test_a_launch_after_an_idle_gap_stamped_contiguous_breaks_clause_3(run_cached, loop):
    """Every batch stamped ``after_idle_gap = False`` (run_batch, the MLX launch): the
    step after the idle gap before a2 was timed with the gap in it, and passed."""
    base = ("fix-chained-accounting+fix-idle-predicate+fix-processed-tokens-counter"
            if loop == "mlx" else "fix-processed-tokens-counter")
    report = check(run_cached("two-turn", loop, f"{base}+user_patches:idle_gap_not_stamped"))
    first = report.clauses[3].first()
    assert (first["field"], first["expected"], first["actual"]) == ("after_idle_gap", True,
                                                                     False)


@pytest.mark.parametrize("loop", ["normal", "overlap", "mlx"])
def test_an_idle_pass_after_a_launch_in_the_same_iteration_is_an_idle_gap(run_cached, loop):
    """The MLX loop idles in the iteration whose chain broke, after launching: the next
    launch says after_idle_gap (it did pass through on_idle). Both reviewers' cases read
    it as a violation (an idle gap only after an iteration that launched nothing); it is
    the torch loops' own rule: since the previous launch, an iteration ended with nothing
    to run (last_batch None). Stamped contiguous, it is still a violation."""
    base = ("fix-chained-accounting+fix-idle-predicate+fix-processed-tokens-counter"
            if loop == "mlx" else "fix-processed-tokens-counter")
    workload = str(WORKLOADS_DIR / "idle-after-chain.toml")
    frames = run_cached(workload, loop, base)
    assert check(frames).clauses[3].status == HOLDS
    launches = frames.launches
    b = launches[launches["rids"] == "b"].iloc[0]
    before = launches[launches["launch"] < b["launch"]].iloc[-1]
    assert bool(b["processed_after_idle_gap"])
    # MLX: the previous launch is in the iteration just before (it launched, then idled)
    assert int(b["step"] - before["step"]) == (1 if loop == "mlx" else 2)
    broken = check(run_cached(workload, loop, f"{base}+user_patches:idle_gap_not_stamped"))
    first = broken.clauses[3].first()
    assert (first["field"], first["launch"], first["expected"], first["actual"]) == (
        "after_idle_gap", b["launch"], True, False)


@pytest.mark.parametrize("loop", ["normal", "overlap", "mlx"])
@pytest.mark.parametrize("patch, step, expected, actual", [
    ("evict_the_whole_need", 12, "<= {short}", 50),
    ("evict_without_shortfall", 0, "<= 0", 16)])
def test_an_eviction_beyond_the_shortfall_breaks_clause_2(run_cached, loop, patch, step,
                                                          expected, actual):
    """SGLang #32016 reintroduced (the tree asked to evict the whole allocation, not its
    shortfall) and a shortfall that forgets what is free: cached prefixes were thrown
    away (c re-prefilled a2's prompt) and every run passed."""
    base = ("fix-chained-accounting+fix-idle-predicate+fix-processed-tokens-counter"
            if loop == "mlx" else "fix-processed-tokens-counter")
    frames = run_cached(str(WORKLOADS_DIR / "evict-shortfall.toml"), loop,
                        f"{base}+user_patches:{patch}")
    first = check(frames).clauses[2].first()
    row = frames.evictions.iloc[0] if step == 0 else frames.evictions.set_index("step").loc[
        step]
    short = int(row["need"] - row["available"])
    assert (first["field"], first["step"], first["actual"]) == ("evict_for_alloc", step,
                                                                actual)
    assert first["expected"] == expected.format(short=short)


@pytest.mark.parametrize("loop, workload, step, rid", [
    ("normal", "retraction", 19, "b"), ("overlap", "retraction", 19, "b"),
    ("mlx", "memory-pressure", 28, "d")])
def test_a_retraction_not_counted_breaks_clause_2(run_cached, loop, workload, step, rid):
    """``reset_for_retract`` not counting: users' ``num_retractions`` read 0 for a
    retracted request (and the MLX worker's cleanup keyed on the count misses it); the
    runs passed. A request that gives its row back unfinished must be counted."""
    base = ("fix-chained-accounting+fix-idle-predicate+fix-processed-tokens-counter"
            if loop == "mlx" else "fix-processed-tokens-counter")
    path = str(WORKLOADS_DIR / f"{workload}.toml") if workload == "retraction" else workload
    first = check(run_cached(path, loop, f"{base}+user_patches:retraction_not_counted")
                  ).clauses[2].first()
    assert (first["field"], first["step"], first["rid"], first["expected"],
            first["actual"]) == ("retraction_count", step, rid, 1, 0)


@pytest.mark.parametrize("loop, steps", [("normal", (4, 6)), ("overlap", (5, 7)),
                                         ("mlx", (5, 6))])
def test_a_stop_token_finished_by_length_breaks_clause_2(run_cached, loop, steps):
    """SGLang #17487 reintroduced (the length cap tested before the stop token and EOS):
    a stop landing as the last allowed token ends the request by length, untrimmed, and
    every run passed. A request that emits one of its stop tokens stops on it."""
    base = ("fix-chained-accounting+fix-idle-predicate+fix-processed-tokens-counter"
            if loop == "mlx" else "fix-processed-tokens-counter")
    frames = run_cached(str(WORKLOADS_DIR / "stop-at-last.toml"), loop,
                        f"{base}+user_patches:length_before_stop")
    found = check(frames).clauses[2].violations
    assert found[["field", "step", "rid", "expected", "actual"]].values.tolist() == [
        ["output_ids", steps[0], "b", "stop on token 2 at 4", "length after 4"],
        ["output_ids", steps[1], "a", "stop on token 7 at 6", "length after 6"]]


@pytest.mark.parametrize("loop, step, actual", [
    ("normal", 4, "after 32 computed"), ("overlap", 5, "before it was processed (step 5)"),
    ("mlx", 5, "before it was processed (step 5)")])
def test_a_middle_chunk_taken_for_the_last_breaks_clause_2(run_cached, loop, step, actual):
    """A middle prefill chunk's result processed as the last one (sglang-jax #971's
    counter, ported): b emits a token from 32 of its 40 prompt positions. Only the
    outputs safety net saw it (no clause named a cause). The first token shows only
    after the launch that computed the whole prompt was processed."""
    base = ("fix-chained-accounting+fix-idle-predicate+fix-processed-tokens-counter"
            if loop == "mlx" else "fix-processed-tokens-counter")
    frames = run_cached(str(WORKLOADS_DIR / "chunk-three.toml"), loop,
                        f"{base}+user_patches:middle_chunk_not_counted")
    first = check(frames).clauses[2].first()
    assert (first["field"], first["step"], first["rid"], first["actual"]) == (
        "output_ids", step, "b", actual)


def test_an_mlx_prefill_fed_another_lanes_ids_is_not_a_pass(run_cached):
    """The MLX worker feeding every request of an extend batch the first request's ids
    (its slots, lengths and counters right): the model-free runner computed each
    prefill's token from the request's own ids, not the ids it was fed, and the run
    passed. It now runs on what it is fed, as the real runner does, so b's output is
    not the model's continuation of its prompt."""
    frames = run_cached("two-turn", "mlx",
                        "fix-chained-accounting+fix-idle-predicate+fix-processed-tokens-"
                        "counter+fix-backend-state+user_patches:mlx_prefill_ids_from_the_"
                        "first_lane")
    report = check(frames)
    assert not report.ok
    assert report.wrong_outputs["rid"].unique().tolist() == ["b"]
    assert report.wrong_outputs.iloc[0][["index", "step"]].tolist() == [0, 2]


def test_an_mlx_chunk_fed_as_decode_fails_even_the_rfc_clause_set(run_cached):
    """A one-token last chunk run as a decode lane on MLX (fed its stale prediction):
    every token of b is wrong, and under ``--clauses rfc`` every clause held (the runner's
    offsets advance either way; MLX records no fed input). The outputs are not the
    model's continuation of the prompt: not a pass."""
    frames = run_cached(str(WORKLOADS_DIR / "chunk-one.toml"), "mlx",
                        "fix-chained-accounting+fix-idle-predicate+fix-processed-tokens-"
                        "counter+fix-backend-state+user_patches:one_token_chunk_as_decode")
    report = check(frames, clauses="rfc")
    assert all(r.status != VIOLATED for r in report.clauses.values())
    assert report.verdict().outcome.value == 1
    assert report.wrong_outputs.iloc[0][["rid", "index"]].tolist() == ["b", 0]


def test_a_prompt_sglang_truncates_is_served_as_fed(tmp_path):
    """``allow_auto_truncate`` cuts a prompt longer than the context, and SGLang caps its
    budget to 0 (its prefill still emits a token): both are SGLang's own doing."""
    path = tmp_path / "truncated.toml"
    path.write_text('name = "truncated"\nmax_steps = 60\n[server_args]\n'
                    'allow_auto_truncate = true\ncontext_length = 64\n'
                    '[[requests]]\nrid = "a"\nprompt_range = [20, 100]\nmax_new_tokens = 4\n'
                    '[[requests]]\nrid = "b"\nprompt_range = [120, 130]\nmax_new_tokens = 6\n')
    frames = contract_lib.run(str(path), "normal", patch="fix-processed-tokens-counter")
    first = frames.requests.drop_duplicates("rid").set_index("rid")
    assert first.loc["a", "prompt_len"] < 80 and first.loc["a", "max_new_tokens"] == 0
    assert check(frames).clauses[2].status == HOLDS


@pytest.mark.fast
def test_what_a_check_derives_is_never_another_runs(good):
    """Within one check, a derived value is keyed by its frames' id: frames dropped in
    the middle of a check (a rule's temporary copy) must not hand their value to the
    frames that next take the freed id (CPython reuses it at once)."""
    from contract_lib.contract.base import derived, one_check
    from contract_lib.frames import Frames

    requests = derived(lambda frames: len(frames.requests))
    whole, part = dict(good.tables), {**good.tables, "requests": good.requests.iloc[:3]}
    for _ in range(5):
        with one_check():
            dropped = Frames(tables=part, meta=good.meta)
            assert requests(dropped) == 3
            del dropped
            assert requests(Frames(tables=whole, meta=good.meta)) == len(good.requests)
