"""Loop ``omni``: sglang-omni 0.1.9's ``OmniScheduler`` (one-step-lookahead decode loop)
driven model-free on SGLang 0.5.22, against the torch loops of the same release."""

from __future__ import annotations

import subprocess

import pandas as pd
import pytest

import contract_lib
from contract_lib.contract import HOLDS, MASKED, check
from contract_lib.sources import omni_release as omni
from contract_lib.verdict import unsupported
from contract_lib.workloads import workload_names

# Tier: other SGLang releases / sglang-omni, installed from the package index on first use.
pytestmark = pytest.mark.releases

TORCH = ("normal", "overlap")


def _omni_run(run_cached, workload: str):
    """The workload's omni run; skipped where the loop refuses it (aborts, priorities:
    tests/test_workload_fields.py checks the refusal)."""
    frames = run_cached(workload, "omni")
    if unsupported(frames.meta):
        pytest.skip(f"loop omni refuses {workload}")
    return frames


def _tokens(frames) -> dict[str, list[int]]:
    return frames.outputs.groupby("rid")["token"].apply(list).to_dict()


@pytest.mark.parametrize("workload", workload_names())
def test_omni_emits_the_torch_loops_tokens(run_cached, workload):
    frames = _omni_run(run_cached, workload)
    assert frames.status == "finished", frames.error
    assert frames.meta["sglang_version"] == omni.OMNI_SGLANG
    assert frames.meta["omni_version"] == omni.OMNI_VERSION
    emitted = _tokens(frames)
    assert emitted and all(emitted.values())
    for loop in TORCH:
        assert emitted == _tokens(run_cached(workload, loop, sglang=omni.OMNI_SGLANG)), loop


@pytest.mark.parametrize("workload", workload_names())
def test_omni_clauses(run_cached, workload):
    """Clauses 1-4 hold; clause 5 is violated-masked: SGLang's ``is_fully_idle``, bound
    to OmniScheduler, has no term for the lookahead step in flight (``async_pending``)."""
    report = check(_omni_run(run_cached, workload))
    assert {n: report.clauses[n].status for n in range(1, 6)} == {
        1: HOLDS, 2: HOLDS, 3: HOLDS, 4: HOLDS, 5: MASKED}
    assert not report.pool.size
    relay_reads = run_cached(workload, "omni").relay.query("event == 'read'")
    assert len(relay_reads), "the lookahead decode reads its input ids through the relay"


def test_the_lookahead_overrun_launch_is_resolved_and_dropped(run_cached):
    """A request finishing at step S is still in the S+1 launch; OmniScheduler drops it
    from the result (``resolve_and_process``), so that launch is never processed."""
    frames = run_cached("single-decode", "omni")
    torch_frames = run_cached("single-decode", "normal", sglang=omni.OMNI_SGLANG)
    launches = frames.launches
    assert len(launches) == len(torch_frames.launches) + 1
    dropped = launches[launches["processed_step"].isna()]
    assert list(dropped["launch"]) == [launches["launch"].max()]
    assert (launches["processed_forward_iter"].dropna()
            == launches.loc[launches["processed_step"].notna(), "forward_ct"]).all()


@pytest.mark.parametrize("workload", ["two-turn", "memory-pressure"])
def test_every_finish_overruns_and_only_a_launch_of_finished_requests_is_dropped(
        run_cached, workload):
    """Every finishing request is computed one position past its end (its final
    ``kv_committed_len`` is one above the torch loop's), and the lookahead launch is
    dropped exactly when every request it holds had finished at an earlier step: on
    two-turn, ``b`` and ``c`` finish while ``a`` decodes, so only ``a``'s and ``a2``'s
    overrun launches are dropped (docs/omni.md, section 5)."""
    frames = run_cached(workload, "omni")
    torch_frames = run_cached(workload, "normal", sglang=omni.OMNI_SGLANG)
    last = frames.requests.sort_values("step").groupby("rid").last()
    torch_last = torch_frames.requests.sort_values("step").groupby("rid").last()
    assert ((last["kv_committed_len"] - torch_last["kv_committed_len"]) == 1).all()
    finished = (frames.requests[frames.requests["finished"].astype(bool)]
                .groupby("rid")["step"].min())
    all_done = frames.launches.apply(lambda launch: all(
        finished.get(rid, 1 << 30) <= launch["step"] + 1
        for rid in launch["rids"].split(",")), axis=1)
    assert (frames.launches["processed_step"].isna() == all_done).all()
    if workload == "two-turn":
        dropped = frames.launches[frames.launches["processed_step"].isna()]
        assert list(dropped["rids"]) == ["a", "a2"]


def test_omni_frames_are_deterministic_warm_or_cold():
    warm, cold = (contract_lib.run("staggered", "omni", cache=False, warm=w)
                  for w in (True, False))
    a, b = warm.comparable(), cold.comparable()
    assert a.keys() == b.keys()
    for name in a:
        pd.testing.assert_frame_equal(a[name], b[name], obj=name)


def test_omni_runs_with_its_shims_only(run_cached):
    meta = run_cached("two-turn", "omni").meta
    assert meta["loop_function"] == "event_loop_async_decode"
    shims = meta["shims"]
    assert {"omni-cpu-platform", "omni-unpinned-staging", "omni-model-free-worker",
            "omni-model-free-forward", "omni-scripted-request-builder"} <= set(shims)
    assert "torch-model-free-forward" not in shims and "scripted-ingress" not in shims


def test_a_request_error_omni_swallows_ends_the_run():
    frames = contract_lib.run("two-turn", "omni", patch="user_patches:omni_forward_raises")
    assert frames.status == "crashed"
    assert frames.error["type"] == "OmniRequestError"
    assert "injected decode failure" in frames.error["message"]
    assert "sglang-omni reported an error for request" in frames.error["message"]
    assert len(frames.steps) > 0  # the frames taken so far are kept


def test_a_fault_in_the_loop_is_a_crash_with_frames(run_cached):
    frames = contract_lib.run("two-turn", "omni", patch="user_patches:raise_in_loop")
    assert frames.status == "crashed" and "injected" in frames.error["message"].lower()
    assert len(frames.steps) >= 3


def test_omni_is_pinned_to_its_sglang_release():
    with pytest.raises(contract_lib.RunSetupError, match="built on sglang 0.5.22"):
        contract_lib.run("two-turn", "omni", sglang="0.5.23")


def test_status_runs_omni_when_asked(capsys):
    from contract_lib.cli import main

    assert main(["status", "--loop", "omni", "--workload", "two-turn"]) == 0
    out = capsys.readouterr().out
    assert "omni" in out and "violated-masked (1/1)" in out


def test_a_failing_omni_install_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv(omni.OMNI_DIR_ENV, str(tmp_path))

    def failing_pip(command, **_kwargs):
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching "
                                           "distribution found for sglang-omni==0.1.9")

    monkeypatch.setattr(contract_lib.sources.versions.subprocess, "run", failing_pip)
    with pytest.raises(contract_lib.SGLangInstallError,
                       match=r"(?s)could not install sglang-omni 0\.1\.9.*network access"):
        omni.omni_path()
    assert [path.name for path in tmp_path.iterdir()] == [".install.lock"]


def test_the_effects_audit_records_omni(run_cached):
    """OmniScheduler is no ``Scheduler`` and has no profiler manager: its own class is
    hooked as the scheduler's, and the run records its writes."""
    frames = contract_lib.run("two-turn", "omni", audit=True)
    assert frames.status == "finished", frames.error
    written = frames.effects[frames.effects["changed"] > 0]
    assert {("Scheduler", "forward_ct"), ("Scheduler", "_prev_step")} <= set(
        zip(written["object"], written["field"]))
