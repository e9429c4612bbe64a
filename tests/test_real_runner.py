"""SGLang's real MlxModelRunner on MLX's CPU backend, with the tiny local mlx-lm model.

Clause 1 end to end: on 0.5.23 the clamped release sync drops the unrecorded chained
positions (cache loss, no damage); with ``unclamped-sync`` (0.5.21's sync restored) the
same workload writes decode KV into slot 0 and into another live request's slots, and
the second turn, a radix hit on a reused row, emits different tokens than the fixed
path. Everything is measured from the frames (``kv_syncs``, ``kv_pool``, ``outputs``).
"""

from __future__ import annotations

import pandas as pd
import pytest

import contract_lib
from contract_lib.contract import check, kv_damage
from contract_lib.sources.tiny_model import (
    build_tiny_model,
    reference_outputs,
    tiny_model_dir,
    weights_digest,
)

REAL = "real"


@pytest.fixture(scope="module")
def two_turn(run_cached):
    runs = {
        "shipped": run_cached("two-turn", "mlx", runner=REAL),
        "unclamped": run_cached("two-turn", "mlx", "unclamped-sync", runner=REAL),
        "fixed": run_cached("two-turn", "mlx", "fix-chained-accounting", runner=REAL),
    }
    for name, frames in runs.items():
        assert frames.status == "finished", (name, frames.error)
    return runs


@pytest.fixture(scope="module")
def reference():
    return reference_outputs("two-turn")


def _writes(frames, target):
    syncs = frames.kv_syncs
    return syncs[(syncs.kind != "dropped") & (syncs.target == target)]


# -- the runner and the model ----------------------------------------------------------------


def test_tiny_model_is_built_locally_and_deterministically(tmp_path):
    path = tiny_model_dir()
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in path.iterdir()}
    assert weights_digest(build_tiny_model(tmp_path / "again")) == weights_digest(path)


def test_real_runner_is_sglangs_own_and_deterministic():
    first, second = (contract_lib.run("two-turn", "mlx", runner=REAL, cache=False)
                     for _ in range(2))
    for frames in (first, second):
        assert frames.status == "finished", frames.error
        assert "mlx-model-free-runner" not in frames.meta["shims"]
        assert frames.meta["runner"] == REAL
    a, b = first.comparable(), second.comparable()
    assert a.keys() == b.keys()
    for name in a:
        pd.testing.assert_frame_equal(a[name], b[name], obj=name)
    assert first.output_tokens() == second.output_tokens()
    assert len(first.kv_syncs) > 0 and len(first.kv_pool) > 0


def test_real_runner_emits_mlx_lm_greedy_tokens(two_turn, reference):
    assert two_turn["shipped"].output_tokens() == reference
    assert two_turn["fixed"].output_tokens() == reference


def test_real_runner_is_mlx_only():
    with pytest.raises(contract_lib.RunSetupError, match="only the mlx loop"):
        contract_lib.run("two-turn", "normal", runner=REAL)
    with pytest.raises(contract_lib.RunSetupError, match="model-free, real"):
        contract_lib.run("two-turn", "mlx", runner="cuda")


# -- 0.5.23 as shipped: the clamped sync drops the unrecorded positions ---------------------


def test_clamped_sync_drops_the_unrecorded_chained_positions(two_turn):
    frames = two_turn["shipped"]
    for target in ("slot 0", "other live request", "free"):
        assert _writes(frames, target).empty, target
    assert (frames.kv_pool.verdict == "ok").all()
    assert frames.meta["kv_pool"]["slot0_nonzero"] is False
    # What the clamp leaves out: a's chained positions past its committed bound, whose
    # req_to_token entries are 0 (never recorded). They never reach the pool, so the
    # second turn reuses only the committed prefix (clause 2's cache loss).
    dropped = frames.kv_syncs.query("kind == 'dropped' and rid == 'a'")
    final = frames.requests.query("rid == 'a' and finished").iloc[0]
    assert dropped.position.min() == final.kv_committed_len
    assert dropped.position.max() == final.kv_computed - 1
    assert (dropped.slot == 0).all()
    a2 = frames.requests.query("rid == 'a2'").iloc[-1]
    assert a2.cached_tokens == final.kv_committed_len < final.kv_computed


# -- unclamped-sync: the damage, and the silent wrong output --------------------------------


def test_unclamped_sync_writes_decode_kv_into_slot_0(two_turn):
    frames = two_turn["unclamped"]
    into_zero = _writes(frames, "slot 0")
    # a's first extend-time flush (c's prefill) syncs a's chained positions 17..19, whose
    # entries were never recorded, into the padding slot.
    flush = into_zero.query("rid == 'a' and kind == 'flush'")
    assert flush.position.tolist() == [17, 18, 19]
    assert frames.meta["kv_pool"]["slot0_nonzero"] is True


def test_unclamped_sync_writes_into_another_live_requests_slots(two_turn):
    frames = two_turn["unclamped"]
    requests = frames.requests
    a_row = requests.query("rid == 'a' and not finished").req_pool_idx.iloc[0]
    a2 = requests.query("rid == 'a2' and not finished")
    assert (a2.req_pool_idx == a_row).all()  # the second turn reuses a's row
    assert a2.cached_tokens.iloc[-1] > 0     # and hits the radix cache
    hits = _writes(frames, "other live request")
    assert not hits.empty
    assert set(hits.rid) == {"a"} and set(hits.owner) == {"a2"}
    # Those slots are a2's own, at the same positions of the shared row.
    step = int(hits.step.iloc[0]) + 1
    slots = frames.slots.query("rid == 'a2' and step == @step").set_index("position").slot
    assert all(slots[p] == s for p, s in zip(hits.position, hits.slot))


def test_second_turn_emits_different_tokens_than_the_fixed_path(two_turn, reference):
    damaged = two_turn["unclamped"].output_tokens()
    fixed = two_turn["fixed"].output_tokens()
    assert damaged["a2"] != fixed["a2"] == reference["a2"]
    assert {rid: damaged[rid] for rid in "abc"} == {rid: fixed[rid] for rid in "abc"}
    # The reason, in the pool: a2's radix-matched prefix has slots that were never
    # written (zero) and KV computed over them (wrong).
    a2 = two_turn["unclamped"].kv_pool.query("rid == 'a2'")
    assert set(a2.verdict) == {"ok", "zero", "wrong"}
    first_bad = a2[a2.verdict != "ok"].position.min()
    assert (a2[a2.position < first_bad].verdict == "ok").all()
    assert not kv_damage.damaged(two_turn["fixed"])
    assert (two_turn["fixed"].kv_pool.verdict == "ok").all()


def test_kv_pool_summary_table(two_turn):
    table = kv_damage.summary_table(two_turn["unclamped"]).set_index("rid")
    assert table.loc["a", "into slot 0"] > 0
    assert table.loc["a", "into another live request"] > 0
    assert table.loc["a2", "wrong"] > 0
    assert "holds KV" in kv_damage.pool_table(two_turn["unclamped"])
    assert "untouched" in kv_damage.pool_table(two_turn["shipped"])


def test_model_free_mlx_runs_keep_a_pool_and_the_torch_loops_none(run_cached):
    frames = run_cached("two-turn", "mlx")
    assert frames.meta["runner"] == "model-free"
    assert not frames.kv_syncs.empty and not frames.kv_pool.empty
    assert frames.meta["kv_pool"]["model"] == "model-free"
    assert frames.kv_pool["max_abs_diff"].isna().all()
    torch = run_cached("two-turn", "normal")
    assert torch.kv_syncs.empty and torch.kv_pool.empty


# -- the notebook's views ---------------------------------------------------------------------


def test_kv_figures_and_token_table(two_turn, reference):
    import matplotlib

    from contract_lib import views

    matplotlib.use("Agg")
    runs = (two_turn["unclamped"], two_turn["shipped"], two_turn["fixed"])
    for fig, panels in ((views.kv_writes(*runs, rid="a"), 3),
                        (views.kv_pool_verdicts(*runs, rid="a2"), 1)):
        assert fig.texts[0].get_text() and fig.legends
        assert len([ax for ax in fig.axes if ax.get_xlabel()]) == panels
        fig.canvas.draw()
    fig = views.kv_writes(*runs, rid="a")
    assert "3 into slot 0, 8 into another live request (a2)" in fig.axes[0].get_title()
    table = views.token_table(*runs, reference=reference).set_index(["request", "run"])
    assert table.loc[("a2", "mlx real + unclamped-sync"), "matches"] == "NO"
    assert table.loc[("a2", "mlx real + unclamped-sync"), "tokens"].count("[") == 3
    assert table.loc[("a2", "mlx real + fix-chained-accounting"), "matches"] == "yes"
    damage = views.damage_table(two_turn["unclamped"])
    assert set(damage["target"]) == {"slot 0", "other live request"}
    assert "a2" in set(damage["owner"]) and views.damage_table(two_turn["fixed"]).empty
    same = views.same_tables(two_turn["unclamped"], two_turn["unclamped"])
    assert all(same.values())
    assert not views.same_tables(two_turn["unclamped"], two_turn["fixed"])["kv_syncs"]
    summary = views.damage_summary(two_turn["unclamped"], reference)
    assert summary["wrong output"] == "a2" and summary["into another live request"] == 8


def test_a_damaged_kv_pool_fails_the_python_check_too(run_cached):
    """A release that skips the runner's sync (SGLang before #30147's fix) leaves the
    decode KV out of the pool: every clause holds, and the command line failed the run
    on the damaged pool while ``check(frames).ok`` said pass. The report carries the
    pool's verdict."""
    frames = run_cached("two-turn", "mlx", "fix-chained-accounting+user_patches:"
                        "mlx_release_skips_the_sync", runner=REAL)
    report = check(frames)
    assert report.kv_damaged and not report.ok
    assert "the MLX KV pool was damaged" in report.verdict().line()
    assert not check(run_cached("two-turn", "mlx", "fix-chained-accounting",
                                runner=REAL)).kv_damaged


def test_a_refused_run_earns_no_kv_pool_verdict():
    """A run the loop refused in set-up never wrote the pool: it is not `intact`. The KV
    row of `status` counts only runs that finished (or show damage)."""
    from contract_lib.campaigns.status import releases_status

    refused = contract_lib.run("page-size-4", "mlx", runner=REAL)
    assert refused.status != "finished" and kv_damage.kv_verdict(refused) is None
    table = releases_status([None], workloads=["page-size-4", "single-decode"],
                            loops=("mlx",), runner=REAL, progress=False)
    kv_row = table.statuses[0].table().loc[next(
        c for c in table.statuses[0].table().index if "KV pool" in c), "mlx"]
    assert kv_row == "intact (1/1)"


# -- the model-free runner's pool: the same writes and verdicts, without a model ------------


@pytest.mark.parametrize("patch", [
    "", "fix-chained-accounting", "unclamped-sync", "fix-chained-accounting+unclamped-sync",
    "fix-chained-accounting+user_patches:mlx_release_skips_the_sync"])
def test_the_model_free_pool_agrees_with_the_real_one(run_cached, patch):
    """The model-free runner keeps, per slot, a digest of the tokens the KV there was
    computed from, and runs SGLang's own sync methods: every write (kind, slot, target)
    and every end verdict (ok, zero, wrong) equals the real runner's, damage or none."""
    real = run_cached("two-turn", "mlx", patch or None, runner=REAL)
    free = run_cached("two-turn", "mlx", patch or None)
    assert (real.status, free.status) == ("finished", "finished")
    pd.testing.assert_frame_equal(kv_damage.summary_table(free), kv_damage.summary_table(real))
    columns = ["step", "rid", "kind", "position", "slot", "target", "owner"]
    pd.testing.assert_frame_equal(free.kv_syncs[columns], real.kv_syncs[columns])
    pd.testing.assert_frame_equal(free.kv_pool.drop(columns="max_abs_diff"),
                                  real.kv_pool.drop(columns="max_abs_diff"))


def test_a_release_without_its_sync_fails_a_model_free_run(run_cached):
    """The MLX worker that frees a finished request's row without the runner's release
    sync (SGLang before #30147's fix) passed every clause on the model-free runner, exit
    0: its runner kept no pool. A later radix hit now reads slots nothing wrote."""
    frames = run_cached("two-turn", "mlx", "fix-chained-accounting+user_patches:"
                        "mlx_release_skips_the_sync")
    report = check(frames)
    assert report.kv_damaged and not report.ok
    assert (frames.kv_pool.verdict == "zero").any()
    assert not check(run_cached("two-turn", "mlx", "fix-chained-accounting")).kv_damaged
