"""The harness drives SGLang's real loops and its frames show the real code's behaviour."""

from __future__ import annotations

import copy
import socket

import pandas as pd
import pytest

import contract_lib
from contract_lib import loops
from contract_lib.contract.outputs import same_tokens
from contract_lib.runs import harness
from contract_lib.verdict import unsupported
from contract_lib.wire.protocol import frames_of
from contract_lib.workloads import Workload

WORKLOADS = contract_lib.workload_names()


def test_every_required_workload_is_shipped():
    assert {"single-decode", "two-turn", "staggered", "finish-mid-chain",
            "mixed-chunk"} <= set(WORKLOADS)


@pytest.mark.parametrize("workload", WORKLOADS)
def test_every_finished_request_emits_the_same_tokens_on_every_loop(run_cached, workload):
    """Every loop that takes the workload (a loop may refuse it as unsupported, e.g.
    page_size > 1 on MLX) emits the normal loop's tokens for every request (same_tokens:
    a request the workload aborts emits a prefix of them, where the abort lands
    following the loop's step cadence); a request that is neither scripted nor aborted
    emits max_new_tokens."""
    # The loops on the venv's SGLang (a loop pinned to another release, omni, is compared
    # with its own release's torch loops in tests/test_omni.py, in the releases tier).
    outputs = {loop: run_cached(workload, loop) for loop in contract_lib.LOOPS
               if loops.spec(loop).sglang is None}
    outputs = {loop: f for loop, f in outputs.items() if not unsupported(f.meta)}
    for loop, frames in outputs.items():
        assert frames.status == "finished", (loop, frames.error)
    spec = contract_lib.load_workload(workload)
    reference = outputs["normal"]
    emitted = reference.output_tokens()
    assert {r.rid: len(emitted.get(r.rid, ())) for r in spec.requests
            if not r.emit and r.abort_at is None} == {
        r.rid: r.max_new_tokens for r in spec.requests if not r.emit and r.abort_at is None}
    for loop in set(outputs) - {"normal"}:
        same = same_tokens(reference, outputs[loop])
        assert set(same) == {r.rid for r in spec.requests} and all(same.values()), (loop, same)


def test_an_abort_races_a_step_so_only_its_prefix_is_shared(run_cached):
    """On ``abort``, request a is aborted while decoding: normal emits one token more
    than overlap and mlx (the abort lands a step later on its cadence). Its tokens are
    not equal across loops, only a prefix; every request that finished otherwise is."""
    normal, overlap, mlx = (run_cached("abort", loop) for loop in ("normal", "overlap", "mlx"))
    lengths = [len(run.output_tokens()["a"]) for run in (normal, overlap, mlx)]
    assert lengths == [9, 8, 8]  # as README.md states; "identical tokens" would be wrong
    assert same_tokens(normal, overlap) == {"a": True, "b": True, "c": True}
    lying = copy.deepcopy(overlap)
    rows = lying.outputs.index[(lying.outputs["rid"] == "a")]
    lying.outputs.loc[rows[0], "token"] += 1  # not a prefix any more
    assert same_tokens(normal, lying)["a"] is False


@pytest.mark.parametrize("loop", ["overlap", "mlx"])
def test_same_run_twice_gives_identical_frames(run_cached, loop):
    first = run_cached("two-turn", loop)
    second = contract_lib.run("two-turn", loop, cache=False)
    a, b = first.comparable(), second.comparable()
    assert a.keys() == b.keys()
    for name in a:
        pd.testing.assert_frame_equal(a[name], b[name], obj=name)


def _chained_step_counters(frames):
    """(emitted, seq_len, kv_committed_len) of request 'a' at consecutive steps."""
    r = frames.requests
    a = r[(r.rid == "a") & ~r.finished].set_index("step")
    return a[["emitted", "seq_len", "kv_committed_len", "kv_computed"]]


def test_mlx_counters_stay_put_across_chained_decode(run_cached):
    frames = run_cached("single-decode", "mlx")
    chained_steps = frames.launches.loc[frames.launches.chained, "step"]
    assert len(chained_steps) >= 10
    a = _chained_step_counters(frames)
    window = a.loc[3:12]
    assert window["emitted"].is_monotonic_increasing and window["emitted"].nunique() == 10
    assert window["seq_len"].nunique() == 1
    assert window["kv_committed_len"].nunique() == 1
    assert (window["kv_computed"] > window["kv_committed_len"]).all()


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_torch_counters_advance_every_step(run_cached, loop):
    a = _chained_step_counters(run_cached("single-decode", loop)).dropna()
    decoding = a[a.emitted >= 1]
    assert decoding["kv_committed_len"].diff().dropna().eq(1).all()
    assert (decoding["kv_committed_len"] == decoding["kv_computed"]).all()
    assert (decoding["seq_len"] == decoding["kv_committed_len"]).all()


def test_second_turn_reuses_fewer_tokens_on_mlx(run_cached):
    def cached(loop):
        r = run_cached("two-turn", loop).requests
        return int(r[r.rid == "a2"].cached_tokens.max())

    ideal = 16 + 12 - 1  # a's prompt + output, less the last token (never fed back)
    assert cached("normal") == cached("overlap") == ideal
    assert cached("mlx") < ideal


def test_relay_buffer_is_poisoned_and_read_on_torch_only(run_cached):
    torch_reads = run_cached("two-turn", "normal").relay.query("event == 'read'")
    assert len(torch_reads) > 0 and (torch_reads.value >= 10).all()
    assert torch_reads.published_for_rid.all()
    mlx = run_cached("two-turn", "mlx").relay
    assert mlx.empty  # pure decode on MLX never reads or writes the relay


def test_frames_save_and_load_roundtrip(run_cached, tmp_path):
    frames = run_cached("single-decode", "overlap")
    path = frames.save(tmp_path / "f.json")
    loaded = contract_lib.Frames.load(path)
    assert loaded.meta == frames.meta
    for name, table in frames.tables.items():
        pd.testing.assert_frame_equal(loaded.tables[name], table, check_dtype=False, obj=name)


def test_loading_another_schema_version_is_a_clear_error(run_cached, tmp_path):
    import json

    path = run_cached("single-decode", "overlap").save(tmp_path / "f.json")
    payload = json.loads(path.read_text())
    payload["schema_version"] = 999
    path.write_text(json.dumps(payload))
    with pytest.raises(contract_lib.FramesFormatError, match="schema version 999"):
        contract_lib.Frames.load(path)


# -- bad input -------------------------------------------------------------------------------


def test_unknown_loop_lists_valid_loops():
    with pytest.raises(contract_lib.RunSetupError, match="normal, overlap, mlx"):
        contract_lib.run("two-turn", "cuda")


def test_unknown_workload_lists_shipped_ones():
    with pytest.raises(contract_lib.WorkloadError, match="two-turn"):
        contract_lib.run("no-such-workload", "mlx")


def test_unknown_patch_lists_builtins():
    with pytest.raises(contract_lib.PatchError, match="fix-chained-accounting"):
        contract_lib.run("two-turn", "mlx", patch="no-such-patch")


def test_unsupported_sglang_version_fails_before_anything_runs(monkeypatch):
    from contract_lib.sources import versions

    monkeypatch.setattr(versions, "installed_sglang_version", lambda: "0.4.0")
    with pytest.raises(contract_lib.UnsupportedSGLangError,
                       match=r"installed sglang: 0\.4\.0.*supports sglang 0\.5\.23"):
        contract_lib.run("two-turn", "mlx")


def test_invalid_workloads_are_rejected():
    base = {"name": "w", "requests": [{"rid": "a", "prompt": [20, 21], "max_new_tokens": 2}]}
    Workload.from_dict(base)
    with pytest.raises(contract_lib.WorkloadError, match="reserved"):
        Workload.from_dict({**base, "requests": [{"rid": "a", "prompt": [1],
                                                  "max_new_tokens": 2}]})
    with pytest.raises(contract_lib.WorkloadError, match="earlier request"):
        Workload.from_dict({**base, "requests": [{"rid": "b", "turn_of": "a",
                                                  "max_new_tokens": 2}]})
    with pytest.raises(contract_lib.WorkloadError, match="duplicate"):
        Workload.from_dict({**base, "requests": base["requests"] * 2})


# -- faults ----------------------------------------------------------------------------------


def _frames_kept(frames, at_least_steps=3):
    assert len(frames.steps) >= at_least_steps
    assert frames.steps.step.tolist() == list(range(len(frames.steps)))
    assert len(frames.launches) >= 1


@pytest.mark.parametrize("loop", ["overlap", "mlx"])
def test_exception_inside_the_loop_is_a_crash_with_frames(loop):
    frames = contract_lib.run("two-turn", loop, patch="user_patches:raise_in_loop")
    assert frames.status == "crashed"
    assert frames.error["type"] == "RuntimeError"
    assert frames.error["phase"] == "loop"
    assert "injected fault" in frames.error["message"]
    assert "get_next_batch_to_run" in frames.error["traceback"]
    _frames_kept(frames)


def test_a_set_up_that_lost_the_port_race_starts_again(monkeypatch, tmp_path):
    """SGLang draws a free port and binds it later: a concurrent run can take it first
    (EADDRINUSE in set-up). The run starts again in a new child: here two real starts
    lose the race to a port this test holds, the third runs."""
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    marker = tmp_path / "starts"
    monkeypatch.setenv("CONTRACT_LIB_TEST_TAKEN_PORT", str(taken.getsockname()[1]))
    monkeypatch.setenv("CONTRACT_LIB_TEST_PORT_MARKER", str(marker))
    monkeypatch.setenv("CONTRACT_LIB_TEST_PORT_LOSSES", "2")
    with taken:  # each start forked from the warm server, in this environment
        frames = contract_lib.run("two-turn", "normal", cache=False,
                                  patch="user_patches:lose_the_port_race_until_the_marker")
    assert frames.status == "finished", frames.error
    assert len(marker.read_text().splitlines()) == 2 and frames.meta["steps"] > 0


@pytest.mark.fast
def test_the_third_lost_port_race_is_the_runs_crash(monkeypatch):
    """After three starts that each lost the race, the crash stands (with its error)."""
    error = {"type": "DistNetworkError", "phase": "setup", "message": "The server socket "
             "has failed to listen on any local network address. port: 1, code: -98, "
             "name: EADDRINUSE, message: address already in use"}
    starts = []

    def execute(spec, meta, *_args):
        starts.append(meta)
        return frames_of({}, meta, "crashed", dict(error))

    monkeypatch.setattr(harness, "_execute", execute)
    frames = contract_lib.run("two-turn", "normal", cache=False)
    assert len(starts) == harness.PORT_RACE_STARTS == 3
    assert frames.status == "crashed" and harness.lost_port_race(frames)
    assert frames.error["message"] == error["message"]
    starts.clear()
    error["message"] = "a set-up crash of another kind"  # never started again
    assert contract_lib.run("two-turn", "normal", cache=False).status == "crashed"
    assert len(starts) == 1


def test_child_killed_by_a_signal_is_died_with_frames():
    frames = contract_lib.run("two-turn", "mlx", patch="user_patches:segfault_in_loop")
    assert frames.status == "died"
    assert frames.error["signal"] == "SIGSEGV"
    _frames_kept(frames)


def test_hang_inside_the_loop_is_a_timeout_with_frames():
    frames = contract_lib.run("two-turn", "normal", patch="user_patches:hang_in_loop",
                              hang_timeout=10)
    assert frames.status == "timeout"
    assert "no frame" in frames.error["message"]
    _frames_kept(frames)


def test_step_budget_is_a_timeout_with_frames():
    workload = contract_lib.load_workload("single-decode")
    short = Workload.from_dict({**workload.to_dict(), "max_steps": 6})
    frames = contract_lib.run(short, "mlx")
    assert frames.status == "timeout"
    assert "step budget of 6" in frames.error["message"]
    assert len(frames.steps) == 7  # steps 0..6, the last one over budget
