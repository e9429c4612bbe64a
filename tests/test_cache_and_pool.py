"""Warm workers give a cold run's frames; the frame cache never serves a stale entry."""

from __future__ import annotations

import pandas as pd
import pytest

import contract_lib
from contract_lib import loops
from contract_lib.runs import cache, fingerprint
from contract_lib.wire import serverdir
from contract_lib.wire.spec import RunSpec
from contract_lib.workloads import Workload


def _assert_same_frames(a, b):
    a, b = a.comparable(), b.comparable()
    for name in a:
        pd.testing.assert_frame_equal(a[name], b[name], obj=name)


@pytest.mark.parametrize("loop", ["normal", "mlx"])
def test_warm_run_equals_cold_run(loop):
    cold = contract_lib.run("two-turn", loop, warm=False, cache=False)
    warm = contract_lib.run("two-turn", loop, warm=True, cache=False)
    assert cold.meta["shims"] == warm.meta["shims"]
    _assert_same_frames(cold, warm)


def test_runs_do_not_leak_state_between_forked_children():
    patched = contract_lib.run("two-turn", "mlx", patch="fix-idle-predicate", cache=False)
    plain = contract_lib.run("two-turn", "mlx", cache=False)
    def probe_idle_in_flight(frames):
        steps = frames.steps
        return bool(steps[steps.result_queue_len > 0].idle_probe.any())

    assert not probe_idle_in_flight(patched)
    assert probe_idle_in_flight(plain)  # the patch did not survive into this run


def _spec(**changes):
    """A run spec of two-turn on mlx, with ``changes`` (a workload as its dict, a loop
    by name)."""
    fields = {"workload": contract_lib.load_workload("two-turn"), "loop": loops.spec("mlx"),
              **changes}
    if isinstance(fields["workload"], dict):
        fields["workload"] = Workload.from_dict(fields["workload"])
    if isinstance(fields["loop"], str):
        fields["loop"] = loops.spec(fields["loop"])
    return RunSpec(**fields)


def test_cache_serves_a_finished_run_and_can_be_bypassed_and_cleared(private_cache):
    first = contract_lib.run("single-decode", "normal")
    assert "cached" not in first.meta and len(list(private_cache.glob("*.json"))) == 1
    second = contract_lib.run("single-decode", "normal")
    assert second.meta["cached"] is True
    _assert_same_frames(first, second)
    assert "cached" not in contract_lib.run("single-decode", "normal", cache=False).meta
    assert cache.clear() == 1
    assert "cached" not in contract_lib.run("single-decode", "normal").meta


def test_faults_are_never_cached(private_cache):
    contract_lib.run("two-turn", "normal", patch="user_patches:raise_in_loop")
    assert not list(private_cache.glob("*.json"))


def test_key_changes_with_everything_that_determines_a_run(monkeypatch, tmp_path):
    base = fingerprint.key(_spec())
    workload = contract_lib.load_workload("two-turn").to_dict()
    workload["requests"][0]["max_new_tokens"] += 1
    assert fingerprint.key(_spec(workload=workload)) != base
    assert fingerprint.key(_spec(loop="overlap")) != base
    assert fingerprint.key(_spec(patch="fix-idle-predicate")) != base
    assert fingerprint.key(_spec(server_args={"max_running_requests": 4})) != base
    # an SGLang reinstall or another version
    stamp = fingerprint.install_stamp()
    monkeypatch.setattr(fingerprint, "install_stamp",
                        lambda: (("sglang", "0.5.24", 1),) + stamp[1:])
    assert fingerprint.key(_spec()) != base
    monkeypatch.undo()
    assert fingerprint.key(_spec()) == base
    # the contents of a folder a server arg names (SGLang reads the model's config there)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"max_position_embeddings": 1024}')
    named = fingerprint.key(_spec(server_args={"model_path": str(model)}))
    (model / "config.json").write_text('{"max_position_embeddings": 20}')
    assert fingerprint.key(_spec(server_args={"model_path": str(model)})) != named
    # an environment variable SGLang reads (its server is another one too)
    server = serverdir.server_key(None)
    monkeypatch.setenv("SGLANG_IS_IN_CI", "contract-lib-test")
    assert fingerprint.key(_spec()) != base and serverdir.server_key(None) != server
    monkeypatch.undo()
    monkeypatch.setenv("IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD", "1000")  # no SGL
    assert fingerprint.key(_spec()) != base and serverdir.server_key(None) != server
    monkeypatch.undo()
    # the library's own source
    monkeypatch.setattr(fingerprint, "_library_fingerprint", lambda: "edited")
    assert fingerprint.key(_spec()) != base


def test_key_changes_with_a_user_patch_module_source(monkeypatch, tmp_path):
    module = tmp_path / "my_triage_patch.py"
    module.write_text("def apply():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = fingerprint.key(_spec(patch="my_triage_patch:apply"))
    module.write_text("def apply():\n    print('changed')\n")
    assert fingerprint.key(_spec(patch="my_triage_patch:apply")) != before


def test_a_fork_server_dying_mid_run_is_reported_with_frames(servers):
    """(In a server directory of its own: the session's servers serve the other xdist
    worker's runs too.)"""
    import os
    import signal
    import threading
    import time

    from contract_lib.runs import pool

    contract_lib.run("single-decode", "normal", cache=False)  # a warm, idle server
    server = pool.POOL.acquire(None).ask(("status",))  # the venv's SGLang's server

    def kill_server():
        time.sleep(3)
        os.kill(server["pid"], signal.SIGKILL)

    threading.Thread(target=kill_server, daemon=True).start()
    frames = contract_lib.run("two-turn", "normal", patch="user_patches:hang_in_loop",
                              cache=False, hang_timeout=60)
    assert frames.status == "died" and frames.error["type"] == "ForkServerDied"
    assert len(frames.steps) >= 3
    assert contract_lib.run("single-decode", "normal", cache=False).status == "finished"


# Between them, every table gets rows: NaN (kv_pool.max_abs_diff on the model-free MLX
# runner), None, finish messages and matched stop tokens, retractions and evictions.
CACHED_WORKLOADS = ("two-turn", "abort", "stop-tokens", "memory-pressure")


@pytest.mark.parametrize("loop, runner, workloads, audit", [
    ("normal", "model-free", CACHED_WORKLOADS, False),
    ("overlap", "model-free", CACHED_WORKLOADS, False),
    ("mlx", "model-free", CACHED_WORKLOADS, False),
    ("mlx", "real", ("two-turn",), False),  # real KV: max_abs_diff a number
    ("mlx", "model-free", ("two-turn",), True),  # the effects table
], ids=["normal", "overlap", "mlx", "mlx-real", "mlx-audit"])
def test_a_cached_run_is_the_fresh_run_table_by_table(private_cache, loop, runner,
                                                      workloads, audit):
    """Every table, dtypes and wall-clock columns included, read back from the frame
    cache equals the run that was stored."""
    for workload in workloads:
        fresh = contract_lib.run(workload, loop, runner=runner, audit=audit)
        cached = contract_lib.run(workload, loop, runner=runner, audit=audit)
        assert "cached" not in fresh.meta and cached.meta["cached"] is True
        assert fresh.tables.keys() == cached.tables.keys()
        for name, table in fresh.tables.items():
            pd.testing.assert_frame_equal(cached.tables[name], table, check_exact=True,
                                          obj=f"{workload} {loop} {runner} {name}")
