"""The contract's history: SGLang 0.5.14-0.5.20, unpatched, each July bug red on the
release that shipped it and green on the one that fixed it (../shared/docs/sglang-history.md).

Releases are installed on first use into ``.cache/sglang/<version>`` (0.5.16-0.5.20 with
the ``xgrammar`` they import); each test drives only the releases it reads.
"""

from __future__ import annotations

import pytest

from contract_lib.cli import main
from contract_lib.contract import HOLDS, NOT_PRESENT, VIOLATED, check

# Tier: other SGLang releases, installed from the package index on first use.
pytestmark = pytest.mark.releases


def _violations(frames, clause: int, field: str):
    found = check(frames).clauses[clause].violations
    return found[found["field"] == field]


def test_forward_ct_never_advanced_then_counted_late_then_at_launch(run_cached):
    """Clause 3 on the MLX loop: 0.5.14 never advances ``forward_ct`` (#29217); 0.5.15
    counts every launch but at finalize, so launches made before the previous one was
    finalized see it one behind (the profiler predicate one queued decode late), and
    no ``forward_iter`` is stamped; 0.5.17 counts and stamps at launch (#32447)."""
    never = run_cached("two-turn", "mlx", sglang="0.5.14")
    launches = len(never.launches)
    assert int(never.steps["forward_ct"].iloc[-1]) == 0
    assert len(_violations(never, 3, "forward_ct")) == launches
    late = run_cached("two-turn", "mlx", sglang="0.5.15")
    assert int(late.steps["forward_ct"].iloc[-1]) == len(late.launches) == launches
    assert 0 < len(_violations(late, 3, "forward_ct")) < launches
    assert len(_violations(late, 3, "forward_iter")) == launches
    assert check(run_cached("two-turn", "mlx", sglang="0.5.17")).clauses[3].status == HOLDS


@pytest.mark.parametrize("version, stamped", [("0.5.18", False), ("0.5.20", False),
                                              ("0.5.21", True)])
def test_after_idle_gap_stamped_by_run_batch_only_until_0_5_21(run_cached, version, stamped):
    """``run_batch`` stamps ``after_idle_gap`` from 0.5.18, the MLX launch only from
    0.5.21: a2, launched after idle iterations, carried False before."""
    gap = _violations(run_cached("two-turn", "mlx", sglang=version), 3, "after_idle_gap")
    assert gap.empty == stamped
    if not stamped:
        assert (gap["expected"].tolist(), gap["actual"].tolist()) == ([True], [False])


@pytest.mark.parametrize("version, absent", [
    ("0.5.14", {"cache_protected_len", "launch_ts", "after_idle_gap",
                "processed_tokens_counter"}),
    ("0.5.17", {"cache_protected_len", "after_idle_gap", "processed_tokens_counter"}),
    ("0.5.20", {"cache_protected_len"}),
    ("0.5.21", set())])
def test_fields_a_release_does_not_have_are_not_present(run_cached, version, absent):
    """Each field arrived with its reader: ``launch_ts`` 0.5.17, ``after_idle_gap``
    0.5.18, the HRRN clock 0.5.20; what the tree kept is written at release from 0.5.21."""
    frames = run_cached("two-turn", "normal", sglang=version)
    assert set(frames.absent) == absent
    report = check(frames, "rfc")
    assert report.ok, report.verdict().line()
    clause6 = check(frames).clauses[6].status
    assert (clause6 == NOT_PRESENT) == ("processed_tokens_counter" in absent)


@pytest.mark.parametrize("version", ["0.5.14", "0.5.17", "0.5.20"])
@pytest.mark.parametrize("loop", ["normal", "overlap"])
@pytest.mark.parametrize("workload", ["memory-pressure", "mixed-chunk", "staggered"])
def test_torch_loops_hold_the_rfc_on_older_releases(run_cached, version, loop, workload):
    """The reference loops hold RFC #32833's five clauses on the releases before the
    supported three (no false positive across history)."""
    report = check(run_cached(workload, loop, sglang=version), "rfc")
    assert report.ok, report.verdict().line()


@pytest.mark.parametrize("version, pool", [("0.5.14", True), ("0.5.20", True),
                                           ("0.5.22", False)])
def test_the_unclamped_sync_damages_the_pool_until_0_5_22(run_cached, version, pool):
    """Clause 1's reader: through 0.5.21 the decode-KV sync is unclamped and writes
    through unrecorded req_to_token positions (slot 0, other requests' slots); the
    model-free runner runs each release's own sync."""
    from contract_lib.contract import kv_damage

    assert kv_damage.damaged(run_cached("two-turn", "mlx", sglang=version)) == pool


@pytest.mark.parametrize("version, startup", [("0.5.14", "backport-stub-alloc-memory-pool"),
                                              ("0.5.16", "backport-stub-dp-size")])
def test_the_stub_runners_startup_bugs_are_backported(run_cached, version, startup):
    """0.5.14's MLX stub has no alloc_memory_pool (0.5.15 added it), 0.5.16's reads a
    dp_size ModelRunner no longer has (0.5.17 reads ps.attn_dp_size): the Scheduler
    build fails without the backport, on every loop (the torch loops use the stub too)."""
    frames = run_cached("single-decode", "normal", sglang=version)
    assert frames.status == "finished" and startup in frames.meta["shims"]


def test_a_patch_of_code_the_release_lacks_is_a_set_up_refusal(capsys):
    """``no-forward-ct`` edits ``_prepare_mlx_launch``, which 0.5.17 introduced: on 0.5.16
    a set-up error naming the missing symbol, not a crash."""
    assert main(["check", "--loop", "mlx", "--workload", "single-decode", "--sglang",
                 "0.5.16", "--patch", "no-forward-ct"]) == 2
    out = capsys.readouterr().out
    assert ("patch 'no-forward-ct': sglang 0.5.16 has no "
            "SchedulerMlxOverlapMixin._prepare_mlx_launch, the code this patch changes") in out


def test_the_open_clauses_are_red_on_the_oldest_release(run_cached):
    """Clause 2 (chained accounting) and clause 4 (the mixed-chunk relay) were already
    open on 0.5.14, as on 0.5.23."""
    two_turn = check(run_cached("two-turn", "mlx", sglang="0.5.14"))
    assert two_turn.clauses[2].status == VIOLATED
    mixed = check(run_cached("mixed-chunk", "mlx", sglang="0.5.14"))
    assert mixed.clauses[4].status == VIOLATED


@pytest.mark.parametrize("version, loop, honoured", [
    ("0.5.16", "mlx", False), ("0.5.16", "normal", True), ("0.5.17", "mlx", True)])
def test_the_mlx_loop_ignores_gracefully_exit_until_0_5_17(run_cached, version, loop,
                                                           honoured):
    """#32447: until 0.5.17 the MLX loop never reads ``gracefully_exit`` (a shutdown
    waits out its grace period); the torch loops return at their next iteration. No
    clause sees it: the flag is read, not written, so the effects audit records nothing
    and no step-boundary field differs; the run's end shows it."""
    frames = run_cached("two-turn", loop, "user_patches:shutdown_after_three_results",
                        sglang=version)
    if honoured:
        assert frames.status == "crashed" and frames.meta["steps"] <= 4
        assert "loop returned without finishing" in frames.error["message"]
    else:
        assert frames.status == "finished"
