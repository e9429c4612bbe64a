"""The effects audit finds what the clauses know and what they do not; traces are valid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contract_lib.campaigns.audit import audit, readers
from contract_lib.campaigns.trace import build_trace
from contract_lib.cli import main
from contract_lib.contract import check

FIX_BACKEND_STATE = (Path(__file__).resolve().parent.parent / "data" / "diffs"
                     / "fix-backend-state.diff")


def _fields(result):
    return {f"{o}.{f}" for o, f in zip(result.findings.object, result.findings.field)}


@pytest.fixture(scope="module")
def two_turn_audit():
    return audit("two-turn", progress=False)


def test_audit_names_the_fields_mlx_does_not_write(two_turn_audit):
    fields = _fields(two_turn_audit)
    # covered by clauses 1 and 2
    assert {"ReqKvInfo.kv_committed_len", "ScheduleBatch.seq_lens",
            "ReqToTokenPool.req_to_token[]", "allocator.free_pages"} <= fields
    # the run_batch bookkeeping the MLX loop never mirrors: the audit's finding that
    # became clause 6 (this project's extensions)
    row = two_turn_audit.findings.set_index("field").loc["processed_tokens_counter"]
    assert row["clause"] == 6
    assert (row["normal"], row["mlx"]) == ("every decode launch", "never")
    assert row["readers"] >= 1 and row["written_by"] == ["managers/scheduler.py:run_batch"]


def test_audit_sees_forward_ct_only_when_it_is_broken(two_turn_audit):
    assert "Scheduler.forward_ct" not in _fields(two_turn_audit)
    broken = audit("two-turn", patch="no-forward-ct", progress=False)
    assert "Scheduler.forward_ct" in _fields(broken)
    row = broken.findings.set_index("field").loc["forward_ct"]
    assert row["mlx"] == "never" and row["clause"] == 3


def test_readers_finds_real_read_sites_and_skips_assignments():
    count, sites = readers("processed_tokens_counter", limit=50)
    assert count >= 1
    assert any(site.startswith("managers/scheduler.py:") for site in sites)


@pytest.mark.fast
def test_readers_are_looked_up_in_the_runs_sglang(tmp_path):
    managers = tmp_path / "sglang" / "srt" / "managers"
    managers.mkdir(parents=True)
    (managers / "x.py").write_text("a = batch.only_here\nbatch.only_here = 3\n")
    assert readers("only_here", sglang_dir=tmp_path) == (1, ["managers/x.py:1"])


def test_audit_and_trace_run_on_the_sglang_a_diff_makes(tmp_path, capsys):
    """fix-backend-state.diff fixes clause 7 on MLX: the audit says which SGLang it
    audited, and the trace of the MLX loop has no clause 7 track (the unpatched one
    has, test_trace_is_valid_nested_and_byte_stable)."""
    assert main(["audit", "--diff", str(FIX_BACKEND_STATE)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("effects audit: two-turn on sglang ")
    assert first.split(":")[1].endswith("+fix-backend-state.diff")
    out = tmp_path / "t.json"
    assert main(["trace", "--workload", "two-turn", "--loop", "mlx", "--diff",
                 str(FIX_BACKEND_STATE), "--out", str(out)]) == 0
    clauses = {e["args"]["clause"] for e in json.loads(out.read_text())["traceEvents"]
               if e.get("cat") == "violation"}
    assert 1 in clauses and 7 not in clauses


@pytest.mark.parametrize("command", [["trace", "--workload", "two-turn"], ["audit"]])
@pytest.mark.parametrize("option, message", [
    (["--sglang", "/nonexistent"], "error: --sglang /nonexistent: no such directory"),
    (["--diff", "/nonexistent.diff"], "error: --diff /nonexistent.diff: cannot read it"),
])
def test_audit_and_trace_refuse_a_bad_sglang_or_diff_on_one_line(command, option, message,
                                                                 capsys):
    assert main([*command, *option]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(message) and len(err.splitlines()) == 1


def _check_trace(trace):
    events = trace["traceEvents"]
    assert json.loads(json.dumps(trace)) == trace
    for event in events:
        assert {"ph", "pid", "name"} <= set(event)
        if event["ph"] in ("X", "i", "C"):
            assert isinstance(event["ts"], (int, float))
        if event["ph"] == "X":
            assert event["dur"] > 0 and "tid" in event
    tracks = {}
    for event in events:
        if event["ph"] == "X":
            tracks.setdefault((event["pid"], event["tid"]), []).append(
                (event["ts"], event["ts"] + event["dur"]))
    for spans in tracks.values():
        spans.sort()
        stack = []
        for begin, end in spans:
            while stack and stack[-1] <= begin:
                stack.pop()
            assert not stack or end <= stack[-1], "slices on one track must nest"
            stack.append(end)
    return events


def test_trace_is_valid_nested_and_byte_stable(run_cached):
    runs = [run_cached("two-turn", "normal"), run_cached("two-turn", "mlx")]
    trace = build_trace(runs)
    events = _check_trace(trace)
    assert {e["pid"] for e in events} == {1, 2}
    names = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"scheduler step", "launches: fresh #0", "launches: chained #0",
            "request a2"} <= names
    violations = [e for e in events if e.get("cat") == "violation"]
    # the torch loop violates only clause 6, the known upstream HRRN clock bug
    assert violations and all(e["pid"] == 2 or e["args"]["clause"] == 6 for e in violations)
    assert {e["args"]["clause"] for e in violations if e["pid"] == 2} >= {1, 2, 6, 7}
    assert {"clause", "field", "expected", "actual", "count"} <= set(violations[0]["args"])
    # Violations sit on their own per-clause tracks, never two at one time on a track
    # (a viewer would nest them into rows and push the other tracks off the screen).
    track_names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
                   if e["name"] == "thread_name"}
    assert all(track_names[(e["pid"], e["tid"])].startswith("violations: clause ")
               for e in violations)
    stamps = [(e["tid"], e["ts"]) for e in violations]
    assert len(stamps) == len(set(stamps))
    assert sum(e["args"]["count"] for e in violations if e["pid"] == 2) == len(
        check(runs[1]).violations)
    assert json.dumps(build_trace(runs)) == json.dumps(trace)


def test_wall_clock_trace_is_valid_too(run_cached):
    _check_trace(build_trace([run_cached("mixed-chunk", "mlx")], wall_clock=True))
