"""A verdict is earned: no pass from a run that did not finish, was vacuous or ran
another loop, and clause 1 sees a stale entry in a reused row (issue #10, Verdicts)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

import contract_lib
from contract_lib.campaigns.status import status
from contract_lib.cli import main
from contract_lib.contract import (
    HOLDS,
    VIOLATED,
    RunDidNotFinish,
    VacuousRun,
    assert_contract,
    check,
)
from contract_lib.verdict import Outcome

TESTS = Path(__file__).resolve().parent
REUSED_ROW = str(TESTS / "workloads" / "reused-row.toml")
RETRACTION = str(TESTS / "workloads" / "retraction.toml")
RAISE = "user_patches:raise_in_loop"


def _workload(tmp_path, text: str, name: str = "w") -> str:
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return str(path)


def _check(*args: str) -> int:
    """``check`` on the RFC's five clauses: these tests are about a run's fate, and the
    torch loops violate clause 6 (the known upstream HRRN clock bug) on every run."""
    return main(["check", *args, "--clauses", "rfc", "--out", "/dev/null"])


@pytest.mark.fast
def test_exit_codes_are_the_documented_ones():
    assert {o.name: int(o) for o in Outcome} == {
        "PASS": 0, "VIOLATED": 1, "USAGE": 2, "NOT_FINISHED": 3, "VACUOUS": 4,
        "INTERRUPTED": 130}


# -- a run that did not finish is never a pass ------------------------------------------------


@pytest.mark.fast
def test_crafted_frames_of_a_crashed_run_are_not_ok(saved):
    good = saved("two-turn", "overlap")
    crashed = contract_lib.Frames(tables=good.tables, meta={
        **copy.deepcopy(good.meta), "status": "crashed",
        "error": {"type": "RuntimeError", "phase": "loop", "message": "boom"}})
    report = check(crashed, clauses="rfc")
    assert all(r.status != VIOLATED for r in report.clauses.values())
    assert not report.ok and report.verdict().outcome == Outcome.NOT_FINISHED
    with pytest.raises(RunDidNotFinish) as raised:
        assert_contract(crashed, clauses="rfc")
    assert (raised.value.status, raised.value.type, raised.value.message) == (
        "crashed", "RuntimeError", "boom")
    assert "verdict: not-finished (exit 3)" in report.text()


def test_a_patch_that_raises_in_the_loop_exits_3(capsys):
    assert _check("--loop", "normal", "--workload", "single-decode", "--patch", RAISE) == 3
    out = capsys.readouterr().out
    assert "run crashed: RuntimeError: injected fault" in out
    assert "verdict: not-finished (exit 3)" in out


@pytest.mark.parametrize("loop", ["overlap", "mlx"])
def test_a_patch_that_rebinds_the_relay_reader_is_the_code_that_runs(capsys, loop):
    """The capture wraps each module's own ``resolve_forward_inputs`` binding: a patch
    that rebound it is not undone (it was, and this check passed on SGLang's reader)."""
    assert _check("--loop", loop, "--workload", "two-turn",
                  "--patch", "user_patches:relay_reader_raises") == 3
    assert "run crashed: RuntimeError: the patched relay reader ran" in capsys.readouterr().out


def test_a_loop_that_survives_its_steps_errors_still_ends(capsys):
    """The run's end is raised at a step boundary through the loop; a loop that logs and
    survives every ``Exception`` of an iteration used to swallow it and never end."""
    assert _check("--loop", "normal", "--workload", "single-decode",
                  "--patch", "user_patches:survive_exceptions") == 0
    assert "run finished" in capsys.readouterr().out


def test_a_loop_that_survives_even_its_end_is_stopped_by_the_hang_check():
    """``except BaseException`` swallows the end too: it is raised again at every later
    boundary, recording nothing more, and the hang check stops the run."""
    frames = contract_lib.run("single-decode", "normal", cache=False, hang_timeout=5,
                              patch="user_patches:survive_everything")
    assert frames.status == "timeout" and "no frame from the child" in frames.error["message"]
    assert frames.steps["step"].is_unique and frames.requests["finished"].any()


def test_a_leak_only_the_frames_see_fails_the_check(capsys):
    """The last request's KV is never released: SGLang's idle self-check would raise, but
    the workload is done first; the frames' conservation terms leak at the last step, and
    that is a finding (the run passed with the leak printed in its table)."""
    assert _check("--loop", "overlap", "--workload", "single-decode",
                  "--patch", "user_patches:leak_on_finish") == 1
    out = capsys.readouterr().out
    assert "- KV pool conservation (SGLang InvariantChecker) leak" in out
    assert "KV pool: first leak at step 25" in out


def test_a_req_to_token_row_never_returned_fails_the_check(capsys):
    """The last request's row is forgotten by ``ReqToTokenPool.free``: it looks released,
    the KV pool balances, and SGLang's idle check (which would raise) never runs: the
    run passed. The row law is checked at every step boundary."""
    assert _check("--loop", "overlap", "--workload", "two-turn", "--patch",
                  "fix-processed-tokens-counter+user_patches:row_kept_on_last_finish") == 1
    out = capsys.readouterr().out
    assert ("KV pool: first leak at step 21: req_to_token rows: free 7 + held by requests "
            "0 != total 8") in out


def test_a_runner_held_under_another_name_is_still_the_backend(capsys):
    """The MLX worker holds its runner as ``_mlx_engine`` and the runner keeps a removed
    request's cache; the worker's own structures are retired (fix-backend-state). Found
    by name, the runner was not looked at and clause 7 held."""
    assert main(["check", "--loop", "mlx", "--workload", "two-turn", "--out", "/dev/null",
                 "--patch", "fix-backend-state+user_patches:renamed_runner_keeps_caches"]) == 1
    out = capsys.readouterr().out
    assert "clause 7 (request state retired): field tp_worker._mlx_engine._req_caches" in out


def test_state_one_object_below_the_runner_is_still_the_backend(capsys):
    """The MLX runner keeps an aborted request's entry in an object it holds
    (``_penalty.by_rid``); the worker's and the runner's own structures are retired.
    Read one level below the worker only, clause 7 held."""
    assert main(["check", "--loop", "mlx", "--workload", "abort", "--out", "/dev/null",
                 "--patch", "fix-backend-state+user_patches:nested_state_kept_on_abort"]) == 1
    out = capsys.readouterr().out
    assert ("clause 7 (request state retired): field tp_worker._mlx_runner._penalty.by_rid"
            " at step 10, request a") in out


@pytest.mark.parametrize("loop, patch, expected", [
    ("normal", "fix-processed-tokens-counter", 0),
    ("mlx", "fix-chained-accounting+fix-idle-predicate+fix-processed-tokens-counter"
            "+fix-backend-state", 0),
    ("mlx", "fix-chained-accounting+fix-idle-predicate+fix-processed-tokens-counter", 1)])
def test_request_ids_equal_to_config_keys_are_not_backend_state(capsys, loop, patch, expected):
    """Requests named "decode" and "type" matched keys of the runner's and the model
    config's own dicts, which then counted as per-request state the scheduler did not
    hold (clause 7 violated on every loop); the MLX worker's real leftovers still show."""
    workload = str(TESTS / "workloads" / "config-named-rids.toml")
    assert main(["check", "--loop", loop, "--workload", workload, "--out", "/dev/null",
                 "--patch", patch]) == expected
    out = capsys.readouterr().out
    assert ("graph_memory_usage" not in out and "rope_parameters" not in out
            and ("clause 7 (request state retired): field tp_worker." in out) == bool(expected))


def test_max_steps_reached_exits_3(tmp_path, capsys):
    workload = contract_lib.load_workload("single-decode").to_dict()
    workload["max_steps"] = 4
    path = tmp_path / "short.toml"
    path.write_text(_toml(workload))
    assert _check("--loop", "overlap", "--workload", str(path)) == 3
    assert "run timeout" in capsys.readouterr().out


def test_a_segfault_in_the_loop_exits_3(capsys):
    assert _check("--loop", "normal", "--workload", "single-decode",
                  "--patch", "user_patches:segfault_in_loop") == 3
    assert "SIGSEGV" in capsys.readouterr().out


def test_status_cells_show_crashed_runs_and_exit_3(capsys):
    result = status(["single-decode"], ("normal", "overlap"), patch=RAISE, progress=False,
                    clauses="rfc")
    table = result.table()
    assert set(table["normal"]) == {"crashed (1/1)"}
    assert set(table["overlap"]) == {"crashed (1/1)"}
    assert result.outcome() == Outcome.NOT_FINISHED
    assert "run single-decode on normal: crashed" in result.text()
    assert main(["status", "--workload", "single-decode", "--loop", "normal",
                 "--patch", RAISE, "--clauses", "rfc"]) == 3


def test_trace_of_a_crashed_run_exits_3_and_keeps_what_it_has(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert main(["trace", "--workload", "single-decode", "--loop", "normal",
                 "--patch", RAISE, "--out", str(out)]) == 3
    events = json.loads(out.read_text())["traceEvents"]
    assert any(e.get("cat") == "step" for e in events)
    assert "crashed" in capsys.readouterr().out


def test_audit_of_a_crashed_run_is_one_line_and_exit_3(capsys):
    assert main(["audit", "--workload", "single-decode", "--patch", RAISE]) == 3
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err
    assert errors[0].startswith("error: audit run single-decode on ")
    assert "injected fault" in errors[0]


# -- a vacuous run says so --------------------------------------------------------------------

LONG_PROMPT = """
name = "long-prompt"
max_steps = 60
{expect}
[[requests]]
rid = "long"
prompt = """ + str([10 + i % 500 for i in range(1190)]) + """  # past the 1024-token context
max_new_tokens = 4

[[requests]]
rid = "short"
prompt_range = [20, 30]
max_new_tokens = 4
"""


def test_an_aborted_request_is_recorded_and_exits_4(tmp_path, capsys):
    path = _workload(tmp_path, LONG_PROMPT.format(expect=""))
    frames = contract_lib.run(path, "normal")
    last = frames.requests.groupby("rid").tail(1).set_index("rid")
    assert last.loc["long", "finish_reason"] == "abort"
    assert "exceeds the maximum allowed length" in last.loc["long", "finish_message"]
    assert last.loc["short", "finish_reason"] == "length"
    assert (frames.requests["retractions"] == 0).all()
    report = check(frames, clauses="rfc")
    assert report.verdict().outcome == Outcome.VACUOUS and not report.ok
    with pytest.raises(VacuousRun, match="aborted request long"):
        assert_contract(frames, clauses="rfc")
    assert _check("--loop", "normal", "--workload", path) == 4
    out = capsys.readouterr().out
    assert "request long aborted by SGLang: Input length (1190 tokens)" in out


@pytest.mark.parametrize("loop", ["normal", "overlap"])
def test_retractions_are_recorded_and_keep_the_torch_loops_green(run_cached, loop):
    """SGLang's own per-request counter; a retracted request frees its row and takes one
    again, and every entry it then uses is one it wrote (no false ``stale``)."""
    frames = run_cached(RETRACTION, loop)
    assert frames.requests.groupby("rid")["retractions"].max().to_dict() == {"a": 0, "b": 1}
    assert assert_contract(frames, clauses="rfc").verdict().outcome == Outcome.PASS


def test_a_declared_abort_is_not_vacuous(tmp_path):
    path = _workload(tmp_path, LONG_PROMPT.format(expect='[expect]\naborted = ["long"]\n'))
    assert _check("--loop", "normal", "--workload", path) == 0


def test_a_declared_abort_that_does_not_happen_is_vacuous(tmp_path, capsys):
    """``[expect] aborted`` names requests SGLang must abort: one it runs to the end
    means the workload did not produce what it declares (it passed silently)."""
    path = _workload(tmp_path, LONG_PROMPT.format(
        expect='[expect]\naborted = ["long", "short"]\n'))
    assert _check("--loop", "normal", "--workload", path) == 4
    assert ("request short is declared aborted ([expect] aborted), but SGLang did not "
            "abort it") in capsys.readouterr().out


def test_a_later_turn_of_a_rejected_request_keeps_its_parents_prompt(tmp_path):
    """SGLang replaces a rejected request's ``origin_input_ids`` with a placeholder; the
    next turn is built from the prompt the parent was fed (it ran a 3-token prompt and
    passed, instead of being rejected too)."""
    path = _workload(tmp_path, LONG_PROMPT.format(expect='[expect]\naborted = ["long", '
                                                         '"long2"]\n') + """
[[requests]]
rid = "long2"
turn_of = "long"
prompt = [17]
max_new_tokens = 2
arrival = 1
""")
    frames = contract_lib.run(path, "normal")
    last = frames.requests.groupby("rid").tail(1).set_index("rid")
    assert last.loc["long2", "finish_reason"] == "abort"  # parent's prompt, output, own:
    assert "Input length (1192 tokens)" in last.loc["long2", "finish_message"]


@pytest.mark.fast
def test_no_clause_exercised_is_vacuous_unless_declared(saved):
    """Crafted: the frames of a finished run in which nothing launched (a real run that
    launches nothing never ends: the capture stops a run only when its requests finish;
    even an aborted-only workload launches SGLang's one-token abort prefill)."""
    frames = saved("single-decode", "normal")
    tables = {name: table.iloc[0:0] for name, table in frames.tables.items()}
    tables["steps"] = frames.steps.iloc[:1]
    idle = contract_lib.Frames(tables=tables, meta=copy.deepcopy(frames.meta))
    report = check(idle)
    assert report.vacuity() == ["no clause was exercised"] and not report.ok
    assert report.verdict().outcome == Outcome.VACUOUS
    idle.meta["expect"] = {"vacuous": True}
    assert check(idle).verdict().outcome == Outcome.PASS


@pytest.mark.parametrize("expect, error", [
    ('aborted = ["nope"]', "unknown request"), ("vacuous = 1", "true or false"),
    ("surprise = true", "unknown [expect] key")])
@pytest.mark.fast
def test_the_expect_table_is_validated(tmp_path, expect, error):
    path = _workload(tmp_path, LONG_PROMPT.format(expect=f"[expect]\n{expect}\n"))
    with pytest.raises(contract_lib.WorkloadError, match=error.replace("[", r"\[")):
        contract_lib.load_workload(path)


# -- the loop that ran is the loop that was asked for ------------------------------------------


@pytest.mark.parametrize("loop", ["normal", "overlap", "mlx"])
def test_the_loop_entered_is_recorded(run_cached, loop):
    meta = run_cached("single-decode", loop).meta
    assert meta["loop_function"] == {"normal": "event_loop_normal",
                                     "overlap": "event_loop_overlap",
                                     "mlx": "event_loop_overlap_mlx"}[loop]
    assert (meta["enable_overlap"], meta["enable_overlap_mlx"]) == {
        "normal": (False, False), "overlap": (True, False), "mlx": (False, True)}[loop]


def test_a_workload_server_arg_that_changes_the_loop_is_a_setup_error(tmp_path, capsys):
    text = Path(contract_lib.workloads.WORKLOAD_DIR / "single-decode.toml").read_text()
    path = _workload(tmp_path, text.replace("[[requests]]", "[server_args]\n"
                                            "disable_overlap_schedule = true\n\n[[requests]]", 1))
    assert _check("--loop", "mlx", "--workload", path) == 2
    out = capsys.readouterr().out
    assert "workload [server_args] disable_overlap_schedule=True" in out
    assert "event_loop_normal instead of event_loop_overlap_mlx" in out


@pytest.mark.parametrize("loop, value", [("overlap", "True"), ("normal", "False")])
def test_a_cli_server_arg_that_changes_the_loop_is_a_setup_error(capsys, loop, value):
    assert _check("--loop", loop, "--workload", "single-decode",
                  "--server-arg", f"disable_overlap_schedule={value}") == 2
    assert f"--server-arg disable_overlap_schedule={value}" in capsys.readouterr().out


@pytest.mark.fast
def test_an_argument_that_turns_overlap_off_indirectly_is_named():
    """ServerArgs' post-init hooks can set disable_overlap_schedule from another argument
    (e.g. speculative decoding, the MPS backend): the one whose removal restores the
    loop is named. A stand-in ServerArgs with such a hook:"""
    from contract_lib import loops
    from contract_lib.child.refusals import check_loop_args
    from contract_lib.wire.protocol import LoopMismatch

    class Args:
        def __init__(self, **kwargs):
            self.disable_overlap_schedule = (kwargs["disable_overlap_schedule"]
                                             or kwargs.get("speculative") is not None)

    given = {"speculative": "eagle", "chunked_prefill_size": 16}
    args = {"disable_overlap_schedule": False, "max_total_tokens": 2048, **given}
    with pytest.raises(LoopMismatch, match=r"workload \[server_args\] speculative='eagle' "
                                           r"make\(s\) it True: SGLang would run "
                                           r"event_loop_normal instead of event_loop_overlap_mlx"):
        check_loop_args(loops.spec("mlx"), Args(**args), args, given, {}, Args)


def test_a_loop_changed_after_the_build_is_refused_at_loop_entry(capsys):
    assert _check("--loop", "overlap", "--workload", "single-decode",
                  "--patch", "user_patches:overlap_off_after_build") == 2
    out = capsys.readouterr().out
    assert "asked for event_loop_overlap, but SGLang's dispatch entered event_loop_normal" in out


def test_an_overlap_loop_whose_body_never_overlaps_is_another_loop(capsys):
    """``event_loop_overlap`` bound to the normal loop's body: the dispatch enters it by
    name with overlap on, nothing is ever in flight, clause 5 is not exercised and every
    other clause held: it passed as the overlap loop."""
    assert _check("--loop", "overlap", "--workload", "two-turn", "--patch",
                  "fix-processed-tokens-counter+user_patches:overlap_body_is_normal") == 2
    assert ("none of its 17 launches was still in flight at a step boundary"
            in capsys.readouterr().out)


@pytest.mark.fast
def test_a_recorded_loop_mismatch_is_a_setup_error(saved):
    frames = saved("two-turn", "overlap")
    other = contract_lib.Frames(tables=frames.tables, meta={
        **copy.deepcopy(frames.meta), "loop_function": "event_loop_normal"})
    assert check(other).verdict().outcome == Outcome.USAGE


@pytest.mark.fast
def test_a_finished_run_that_entered_no_event_loop_is_a_setup_error(saved):
    """No ``loop_function``: the run's loop was not SGLang's dispatch target at all."""
    frames = saved("two-turn", "overlap")
    meta = copy.deepcopy(frames.meta)
    del meta["loop_function"]
    judged = check(contract_lib.Frames(tables=frames.tables, meta=meta), "rfc").verdict()
    assert judged.outcome == Outcome.USAGE
    assert "finished without entering it or any other event_loop_* method" in judged.reason
    crashed = {**meta, "status": "crashed", "error": {"type": "RuntimeError",
                                                      "message": "x", "phase": "loop"}}
    judged = check(contract_lib.Frames(tables=frames.tables, meta=crashed), "rfc").verdict()
    assert judged.outcome == Outcome.NOT_FINISHED


def test_a_patch_that_bypasses_the_dispatch_is_a_setup_error(capsys):
    """A patch whose ``run_event_loop`` runs a loop body through the class enters no
    ``event_loop_*`` method: the workload finishes, every RFC clause holds, and the loop
    asked for never ran."""
    assert _check("--loop", "overlap", "--workload", "single-decode",
                  "--patch", "user_patches:own_loop") == 2
    out = capsys.readouterr().out
    assert "asked for event_loop_overlap, but the run finished without entering it" in out
    assert main(["run", "--loop", "overlap", "--workload", "single-decode",
                 "--patch", "user_patches:own_loop", "--out", "/dev/null"]) == 2
    assert "replaced SGLang's dispatch" in capsys.readouterr().err


# -- clause 1: a stale entry in a reused row ---------------------------------------------------


def test_writes_are_attributed_to_the_row_holder_even_when_values_repeat():
    """The allocator can hand the same slot back at the same position after a free: the
    new holder's write makes it its own, whatever the value."""
    from types import SimpleNamespace

    import torch

    from contract_lib.child.capture.row_writes import RowWrites

    class Kv:
        def __init__(self, row):
            self.req_pool_idx = row

    class Req:
        def __init__(self, row):
            self.kv = Kv(row)

    first, second = Req(1), Req(None)
    rows = RowWrites(SimpleNamespace(reqs={"first": first, "second": second}), (3, 8))
    rows.on_write((1, slice(0, 4)))
    first.kv.req_pool_idx, second.kv.req_pool_idx = None, 1  # row 1 freed and reused
    rows.on_write((torch.tensor([1, 1]), torch.tensor([0, 1])))
    assert rows.written_by[1, :5].tolist() == [1, 1, 0, 0, -1]
    # rows broadcast against positions: each entry is its row's holder's (row 2: none)
    rows.on_write((torch.tensor([[1], [2]]), torch.tensor([[6, 7], [6, 7]])))
    assert rows.written_by[1:, 6:].tolist() == [[1, 1], [-1, -1]]


def test_numpy_view_follows_a_rebound_or_resized_tensor():
    """The recorder's cached numpy view of ``req_to_token`` must never read a tensor the
    scheduler let go of: a new tensor bound in its place, or the same one given new
    storage (torch refuses ``resize_`` while a numpy view of the storage exists)."""
    import torch

    from contract_lib.child.capture.batches import NumpyView

    view, table = NumpyView(), torch.zeros((2, 4), dtype=torch.int32)
    assert view.of(table) is view.of(table)  # cached while nothing changed
    table[1, 2] = 7  # a write in place is seen through the view
    assert view.of(table)[1, 2] == 7
    rebound = torch.full((2, 4), 5, dtype=torch.int32)
    assert view.of(rebound).tolist() == [[5] * 4] * 2
    rebound.set_(torch.ones((8, 16), dtype=torch.int32))  # the same tensor, new storage
    assert view.of(rebound).shape == (8, 16) and view.of(rebound).sum() == 128


def test_reused_row_leaves_stale_entries_on_mlx_only(run_cached):
    mlx = check(run_cached(REUSED_ROW, "mlx")).clauses[1]
    stale = mlx.violations[mlx.violations["actual"].str.contains("never written for b")]
    assert mlx.status == VIOLATED and len(stale) > 0
    assert "previous holder" in stale.iloc[0]["explanation"]
    for loop in ("normal", "overlap"):
        assert check(run_cached(REUSED_ROW, loop)).clauses[1].status == HOLDS, loop
    # Recording the chained positions (the candidate fix) makes every entry b's own.
    fixed = check(run_cached(REUSED_ROW, "mlx", "fix-chained-accounting")).clauses[1]
    assert fixed.status == HOLDS


def _toml(workload: dict) -> str:
    """A workload dict (``Workload.to_dict``) back as TOML."""
    lines = [f'name = "{workload["name"]}"', f'max_steps = {workload["max_steps"]}']
    for key, value in workload["server_args"].items():
        lines.append(f"server_args.{key} = {json.dumps(value)}")
    for r in workload["requests"]:
        lines += ["", "[[requests]]", f'rid = "{r["rid"]}"', f"prompt = {list(r['prompt'])}",
                  f"max_new_tokens = {r['max_new_tokens']}", f"arrival = {r['arrival']}"]
        if r["turn_of"]:
            lines.append(f'turn_of = "{r["turn_of"]}"')
    return "\n".join(lines) + "\n"
