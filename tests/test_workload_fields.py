"""Workloads that say what bug reports say: stop tokens and EOS, aborts, priorities and
``page_size`` above 1, on every loop they apply to (``data/workloads/stop-tokens``,
``abort``, ``priority``, ``page-size-4``), each new field's validation error, and a
workload written as TOML (``found.to_toml``) reads back equal, every field included."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pandas as pd
import pytest

import contract_lib
from contract_lib.campaigns.found import to_toml
from contract_lib.campaigns.status import Status
from contract_lib.contract import HOLDS, check
from contract_lib.verdict import Outcome, unsupported
from contract_lib.workloads import (
    WORKLOAD_DIR,
    RequestSpec,
    Workload,
    WorkloadError,
    load_workload,
)

LOOPS = ("normal", "overlap", "mlx")
TORCH = ("normal", "overlap")


def _last(frames: contract_lib.Frames) -> dict[str, dict]:
    """Each request's last recorded row of the ``requests`` table."""
    rows = frames.requests.sort_values("step", kind="stable").groupby("rid").tail(1)
    return {r["rid"]: r for r in rows.to_dict("records")}


def _finished(frames: contract_lib.Frames) -> contract_lib.Frames:
    assert frames.status == "finished", (frames.meta.get("loop"), frames.error)
    return frames


def _assert_torch_contract(frames: contract_lib.Frames) -> None:
    """The torch loops hold RFC #32833's clauses on the workload (no false positive) and
    the run earns a pass."""
    report = check(frames, "rfc")
    assert report.verdict().outcome == Outcome.PASS, report.text()
    assert all(r.status in (HOLDS, "not-exercised") for r in report.clauses.values())
    assert report.clauses[1].status == HOLDS and report.clauses[2].status == HOLDS


# -- stop tokens and EOS -------------------------------------------------------------------


@pytest.mark.parametrize("loop", LOOPS)
def test_stop_tokens_finish_where_the_forward_emits_them(run_cached, loop):
    frames = _finished(run_cached("stop-tokens", loop))
    tokens, last = frames.output_tokens(), _last(frames)
    # a: its stop token 7, emitted as output 5, ends it there (6 tokens).
    assert tokens["a"][5] == 7 and len(tokens["a"]) == 6
    assert last["a"]["finish_reason"] == "stop"
    # b: the model's EOS (2) as output 3.
    assert tokens["b"][3] == 2 and len(tokens["b"]) == 4
    assert last["b"]["finish_reason"] == "stop"
    # c: EOS emitted, ignore_eos: decodes to max_new_tokens.
    assert tokens["c"][2] == 2 and len(tokens["c"]) == 10
    assert last["c"]["finish_reason"] == "length"
    # d: the second of its stop tokens, as output 4.
    assert tokens["d"][4] == 9 and len(tokens["d"]) == 5
    assert last["d"]["finish_reason"] == "stop"


def test_stop_tokens_identical_across_loops(run_cached):
    tokens = {loop: run_cached("stop-tokens", loop).output_tokens() for loop in LOOPS}
    assert tokens["normal"]["a"][-1] == 7 and tokens["normal"]["b"][-1] == 2  # scripted
    assert tokens["overlap"] == tokens["normal"] and tokens["mlx"] == tokens["normal"]


def test_scripted_tokens_survive_retraction_and_chunked_prefill():
    """The script is keyed by output position (``seq_len`` minus the prompt), not by
    launch: a request the torch loops retract and re-prefill in chunks of 4 still stops
    at its scripted position, with the MLX loop's tokens (which never retracts)."""
    raw = load_workload("memory-pressure").to_dict()
    raw["server_args"]["chunked_prefill_size"] = 4
    for request in raw["requests"]:
        request.update(emit=[[30, 2]] if request["rid"] in "ac" else [[35, 7]],
                       stop_token_ids=[7])
    workload = Workload.from_dict(raw)
    runs = {loop: _finished(contract_lib.run(workload, loop)) for loop in LOOPS}
    assert max(_last(runs["normal"])[r]["retractions"] for r in "abcd") >= 1
    tokens = runs["normal"].output_tokens()
    assert {rid: (len(t), t[-1]) for rid, t in tokens.items()} == {
        "a": (31, 2), "b": (36, 7), "c": (31, 2), "d": (36, 7)}
    assert runs["overlap"].output_tokens() == tokens == runs["mlx"].output_tokens()


@pytest.mark.parametrize("loop", TORCH)
def test_stop_tokens_torch_loops_hold_the_contract(run_cached, loop):
    frames = run_cached("stop-tokens", loop)
    assert set(_last(frames)[r]["finish_reason"] for r in "abd") == {"stop"}
    _assert_torch_contract(frames)


# -- aborts ----------------------------------------------------------------------------------


@pytest.mark.parametrize("loop", LOOPS)
def test_scripted_aborts(run_cached, loop):
    frames = _finished(run_cached("abort", loop))
    tokens, last = frames.output_tokens(), _last(frames)
    spec = load_workload("abort")
    # a: aborted while decoding, after some tokens and well before max_new_tokens.
    assert last["a"]["finish_reason"] == "abort"
    assert 0 < len(tokens["a"]) < spec.request("a").max_new_tokens
    # b: aborted in the step it arrived, from the waiting queue: nothing computed.
    assert last["b"]["finish_reason"] == "abort" and not tokens.get("b")
    assert last["b"]["req_pool_idx"] is None or last["b"]["kv_allocated_len"] == 0
    assert last["c"]["finish_reason"] == "length" and len(tokens["c"]) == 16
    # Scripted aborts are expected: the run is not vacuous for them.
    report = check(frames)
    assert set(report.aborted["rid"]) == {"a", "b"} and report.aborted["expected"].all()
    assert not report.vacuity()


def test_aborts_emit_the_same_tokens_on_every_loop(run_cached):
    """Requests that run to the end emit identical tokens; an aborted one emits a prefix
    of the same sequence (where the abort lands depends on the loop's step cadence)."""
    tokens = {loop: run_cached("abort", loop).output_tokens() for loop in LOOPS}
    for loop in LOOPS:
        assert tokens[loop]["c"] == tokens["normal"]["c"]
        assert len(tokens[loop]["a"]) < 24 and "b" not in tokens[loop]  # aborted
    longest = max((t["a"] for t in tokens.values()), key=len)
    for loop in LOOPS:
        assert longest[:len(tokens[loop]["a"])] == tokens[loop]["a"]


@pytest.mark.parametrize("loop", TORCH)
def test_aborts_torch_loops_hold_the_contract(run_cached, loop):
    frames = run_cached("abort", loop)
    assert {_last(frames)[r]["finish_reason"] for r in "ab"} == {"abort"}
    _assert_torch_contract(frames)


# -- priorities ------------------------------------------------------------------------------


@pytest.mark.parametrize("loop", LOOPS)
def test_priority_preempts_and_orders(run_cached, loop):
    frames = _finished(run_cached("priority", loop))
    last, spec = _last(frames), load_workload("priority")
    tokens = frames.output_tokens()
    assert {rid: len(t) for rid, t in tokens.items()} == {
        r.rid: r.max_new_tokens for r in spec.requests}
    finished_at = frames.requests[frames.requests["finished"]].groupby("rid")["step"].min()
    # The high-priority newcomer finishes before the low-priority one it arrived with.
    assert finished_at["c"] < finished_at["d"]
    # It preempted the lowest-priority running request (retracted, re-prefilled).
    assert last["a"]["retractions"] >= 1 and last["b"]["retractions"] == 0


def test_priority_identical_across_loops(run_cached):
    for loop in LOOPS:  # the preemption happened everywhere
        assert _last(run_cached("priority", loop))["a"]["retractions"] >= 1, loop
    tokens = {loop: run_cached("priority", loop).output_tokens() for loop in LOOPS}
    assert tokens["overlap"] == tokens["normal"] and tokens["mlx"] == tokens["normal"]


@pytest.mark.parametrize("loop", TORCH)
def test_priority_torch_loops_hold_the_contract(run_cached, loop):
    frames = run_cached("priority", loop)
    assert _last(frames)["a"]["retractions"] >= 1  # a preemption, then re-prefill
    _assert_torch_contract(frames)


@pytest.mark.parametrize("workload, loop", [("priority", "overlap"), ("abort", "mlx")])
def test_priorities_and_aborts_give_deterministic_frames(run_cached, workload, loop):
    """A preemption (whose order SGLang breaks by queue time only between equal
    priorities) and an abort land at the same step in every run."""
    first, second = run_cached(workload, loop).comparable(), contract_lib.run(
        workload, loop, cache=False).comparable()
    for name in first:
        pd.testing.assert_frame_equal(first[name], second[name], obj=name)


# -- page_size 4 -----------------------------------------------------------------------------


@pytest.mark.parametrize("loop", TORCH)
def test_page_size_4_runs_on_the_torch_loops(run_cached, loop):
    frames = _finished(run_cached("page-size-4", loop))
    _assert_torch_contract(frames)
    # The second turn's radix match is whole pages.
    cached = int(_last(frames)["a2"]["cached_tokens"])
    assert cached > 0 and cached % 4 == 0
    # Every slot handed to a request is in a page that request holds from its start.
    slots = frames.slots[frames.slots["written"].astype(bool)]
    for (_, _rid), group in slots.groupby(["step", "rid"]):
        ordered = group.sort_values("position")
        assert ((ordered["slot"] % 4) == (ordered["position"] % 4)).all()


def test_page_size_4_same_tokens_as_page_size_1(run_cached):
    paged = run_cached("page-size-4", "normal").output_tokens()
    assert run_cached("page-size-4", "overlap").output_tokens() == paged
    unpaged = load_workload("page-size-4")
    unpaged = contract_lib.run(Workload.from_dict({**unpaged.to_dict(), "server_args": {}}),
                               "normal")
    assert unpaged.output_tokens() == paged
    # The second turn's radix match is the unpaged one rounded down to whole pages.
    paged_reuse, unpaged_reuse = (int(_last(f)["a2"]["cached_tokens"])
                                  for f in (run_cached("page-size-4", "normal"), unpaged))
    assert unpaged_reuse % 4  # this workload's match does end inside a page
    assert paged_reuse == unpaged_reuse // 4 * 4


def test_page_size_4_is_refused_on_mlx(run_cached):
    frames = run_cached("page-size-4", "mlx")
    reason = unsupported(frames.meta)
    assert reason is not None and "page_size=4" in reason and "\n" not in reason
    report = check(frames)
    assert report.verdict().outcome == Outcome.USAGE  # exit 2


def test_status_lists_an_unsupported_run_and_does_not_fail_on_it(run_cached):
    refused = check(run_cached("page-size-4", "mlx"))
    alone = Status({("page-size-4", "mlx"): refused})
    assert alone.outcome() == Outcome.USAGE  # nothing ran: no verdict earned
    assert "run page-size-4 on mlx: unsupported: " in alone.text()
    both = Status({("page-size-4", "mlx"): refused,
                   ("page-size-4", "normal"): check(run_cached("page-size-4", "normal"))})
    assert both.outcome() == Outcome.PASS
    assert set(both.per_run()["loop"]) == {"normal"}  # no clause cell counts the refusal
    assert list(both.table().columns) == ["normal"]


@pytest.mark.releases
def test_page_size_4_on_0_5_21_is_refused_not_crashed(run_cached):
    """0.5.21's paged allocator has no native path (Triton kernels only): a set-up
    refusal naming the release, not a crash at the first prefill; 0.5.22 runs it."""
    reason = unsupported(run_cached("page-size-4", "normal", sglang="0.5.21").meta)
    assert reason is not None and "sglang 0.5.21" in reason and "Triton" in reason
    paged = _finished(run_cached("page-size-4", "overlap", sglang="0.5.22"))
    assert paged.output_tokens() == run_cached("page-size-4", "normal").output_tokens()


# -- sglang-omni and the real runner ---------------------------------------------------------


@pytest.mark.releases
@pytest.mark.parametrize("workload", ["stop-tokens", "page-size-4"])
def test_omni_runs_stop_tokens_and_page_size_4(run_cached, workload):
    """sglang-omni (SGLang 0.5.22) emits the torch loops' tokens, the scripted stop token
    and EOS finishes included, and runs a paged pool."""
    frames = _finished(run_cached(workload, "omni"))
    torch = run_cached(workload, "normal", sglang="0.5.22")
    if workload == "stop-tokens":  # the scripted stop token, and EOS ends a request
        assert frames.output_tokens()["a"][-1] == 7 and frames.output_tokens()["b"][-1] == 2
    assert frames.output_tokens() == torch.output_tokens()
    assert {r["finish_reason"] for r in _last(frames).values()} == {
        r["finish_reason"] for r in _last(torch).values()}


@pytest.mark.releases
@pytest.mark.parametrize("workload", ["abort", "priority"])
def test_omni_refuses_aborts_and_priorities(run_cached, workload):
    frames = run_cached(workload, "omni")
    reason = unsupported(frames.meta)
    assert reason is not None and "loop omni" in reason and "\n" not in reason
    assert check(frames).verdict().outcome == Outcome.USAGE


def test_real_runner_refuses_a_scripted_forward(run_cached):
    frames = run_cached("stop-tokens", "mlx", runner="real")
    assert "emit" in (unsupported(frames.meta) or "")


# -- validation ------------------------------------------------------------------------------

BASE = {"name": "w", "requests": [{"rid": "a", "prompt": [20, 21], "max_new_tokens": 4}]}


def _with(request: dict | None = None, **top) -> dict:
    return {**BASE, **top, "requests": [{**BASE["requests"][0], **(request or {})}]}


@pytest.mark.fast
@pytest.mark.parametrize("raw, message", [
    (_with({"stop_token_ids": 7}), "stop_token_ids must be a list"),
    (_with({"stop_token_ids": [-1]}), "stop_token_ids entry must be >= 0"),
    (_with({"stop_token_ids": ["7"]}), "stop_token_ids entry must be an integer"),
    (_with({"emit": {"x": 2}}), "emit position must be an integer"),
    (_with({"emit": {"-1": 2}}), "emit position must be >= 0, got -1"),
    (_with({"emit": {"4": 2}}), "emit position 4 is past the request's output"),
    (_with({"emit": {"1": 2.0}}), "emit token (position 1) must be an integer"),
    (_with({"emit": {"1": -3}}), "emit token (position 1) must be >= 0"),
    (_with({"emit": [1, 2]}), "emit must be a table of output position = token"),
    (_with({"emit": [[1, 2], [1, 3]]}), "emit names a position twice"),
    (_with({"ignore_eos": "yes"}), "ignore_eos must be true or false"),
    (_with({"min_new_tokens": 1}),
     "unknown field 'min_new_tokens'; did you mean 'max_new_tokens'?"),
    (_with({"abort_at": 2, "arrival": 3}), "abort_at must be >= 3"),
    (_with({"abort_at": True}), "abort_at must be an integer"),
    (_with({"priority": "high"}, server_args={"enable_priority_scheduling": True}),
     "priority must be an integer"),
    (_with({"priority": 3}), "enable_priority_scheduling = true"),
    (_with({"stop_tokens": [7]}),
     "unknown field 'stop_tokens'; did you mean 'stop_token_ids'?"),
    # shapes a typo or a slip gives, each named (they ran on a default, or failed inside
    # Python with "'int' object is not iterable")
    (_with(max_step=10), "the workload: unknown key 'max_step'; did you mean 'max_steps'?"),
    (_with({"prompt_range": [20, 30]}), "has both prompt and prompt_range"),
    (_with({"prompt": 42}), "prompt must be a list of token ids, got 42"),
    ({**BASE, "requests": [{"rid": "a", "prompt_range": [20, 30, 40], "max_new_tokens": 4}]},
     "prompt_range must be [start, stop]"),
    (_with({"rid": ""}), "rid must be a non-empty string"),
    ({**BASE, "requests": 5}, "requests must be a list of [[requests]] tables, got 5"),
    ({**BASE, "requests": [1, 2]}, "requests must be a list of [[requests]] tables"),
    (_with(server_args=5), "[server_args] must be a table"),
    (_with(name={"x": 1}), "name must be a string"),
])
def test_each_new_field_is_validated(raw, message):
    with pytest.raises(WorkloadError) as caught:
        Workload.from_dict(raw, source="w.toml")
    assert message in str(caught.value) and str(caught.value).startswith("w.toml: ")


@pytest.mark.fast
def test_an_abort_that_sglang_would_match_by_prefix_is_refused():
    raw = {"name": "w", "requests": [
        {"rid": "a", "prompt": [20], "max_new_tokens": 2, "abort_at": 1},
        {"rid": "a2", "prompt": [21], "max_new_tokens": 2}]}
    with pytest.raises(WorkloadError, match=r"prefix, so it would also abort \['a2'\]"):
        Workload.from_dict(raw)


@pytest.mark.fast
def test_stop_and_scripted_tokens_must_be_in_the_vocabulary():
    for field, value in (("stop_token_ids", [600]), ("emit", {"0": 600})):
        workload = Workload.from_dict(_with({field: value}))
        with pytest.raises(WorkloadError, match="outside the model's vocabulary"):
            workload.check_vocabulary(512)


@pytest.mark.fast
def test_new_fields_round_trip_and_scripted_aborts_are_expected():
    workload = Workload.from_dict(_with(
        {"stop_token_ids": [7], "emit": {"2": 7, "0": 2}, "ignore_eos": True,
         "abort_at": 3, "priority": 4},
        server_args={"enable_priority_scheduling": True}))
    assert Workload.from_dict(workload.to_dict()) == workload
    assert workload.scripted_tokens() == {"a": {0: 2, 2: 7}}
    assert workload.expected_outcomes() == {"aborted": ["a"]}
    for name in ("stop-tokens", "abort", "priority", "page-size-4"):
        assert name in contract_lib.workload_names()


# -- a workload as TOML (found.to_toml) ----------------------------------------------------

ALL_FIELDS = Workload.from_dict({
    "name": "every \"field\"", "description": "line one\nline \\two\\ \u00e9 \U0001f600 \x7f",
    "max_steps": 90, "max_seconds": 12.5,
    "server_args": {"enable_priority_scheduling": True, "schedule_conservativeness": 0.01,
                    "schedule_policy": "lpm", "chunked_prefill_size": 16},
    "expect": {"aborted": ["b"], "vacuous": True},
    "requests": [
        {"rid": "a", "prompt": [20, 21, 22], "max_new_tokens": 6, "arrival": 1,
         "stop_token_ids": [7, 8], "emit": {"0": 7, "4": 2}, "ignore_eos": True,
         "abort_at": 3, "priority": -5},
        {"rid": "b", "prompt": [30], "max_new_tokens": 2, "turn_of": "a", "priority": 4},
    ]})
WORKLOAD_FILES = sorted([*WORKLOAD_DIR.glob("*.toml"), *(WORKLOAD_DIR / "found").glob("*.toml"),
                         *(Path(__file__).parent / "workloads").glob("*.toml")])


@pytest.mark.fast
def test_the_all_fields_workload_sets_every_field():
    """A field added to Workload or RequestSpec must be set here (and written by
    to_toml) for the round trip below to cover it."""
    for cls, values in ((Workload, [ALL_FIELDS]), (RequestSpec, ALL_FIELDS.requests)):
        for field in dataclasses.fields(cls):
            default = (field.default_factory() if callable(field.default_factory)
                       else field.default)
            assert any(getattr(v, field.name) != default for v in values), field.name


@pytest.mark.fast
@pytest.mark.parametrize("workload", [ALL_FIELDS, *WORKLOAD_FILES],
                         ids=lambda w: w.stem if isinstance(w, Path) else "all-fields")
def test_to_toml_round_trips_every_workload_field(workload):
    workload = workload if isinstance(workload, Workload) else load_workload(workload)
    text = to_toml(workload, ["a header", "", "line"])
    assert Workload.from_dict(tomllib.loads(text), source="to_toml") == workload


@pytest.mark.fast
def test_to_toml_header_lines_are_comments_and_none_is_none():
    assert to_toml(ALL_FIELDS, []).startswith("name = ")
    text = to_toml(ALL_FIELDS, ["found by: x", "a line\nwith a newline", ""])
    assert text.startswith("# found by: x\n# a line\n# with a newline\n#\nname = ")
