"""The loops SGLang dispatches to besides its three: MLX without overlap and the four
PD-disaggregation loops (fake transfer backend). Fast: what the checker reads on a
decode side's committed frames, and each disaggregation-path reading shown to matter
by removing it. Real loop: each loop runs, emits event_loop_normal's tokens, refuses
what it cannot take, and a mutant of its batch builders turns a clause red."""

from __future__ import annotations

from pathlib import Path

import pytest

import contract_lib
from contract_lib import loops
from contract_lib.cli import main
from contract_lib.contract import HOLDS, MASKED, NOT_EXERCISED, VIOLATED, check
from contract_lib.verdict import Outcome

WORKLOADS = Path(__file__).parent / "workloads"

DISAGG = ("disagg-prefill-normal", "disagg-prefill-overlap", "disagg-decode-normal",
          "disagg-decode-overlap")


@pytest.mark.fast
def test_every_loop_sglang_dispatches_to_is_registered():
    """SGLang 0.5.23's dispatch (``_dispatch_event_loop_once``) enters eleven loops."""
    assert {spec.function for spec in loops.LOOP_SPECS.values()} >= {
        "event_loop_normal", "event_loop_overlap", "event_loop_overlap_mlx",
        "event_loop_pp", "event_loop_pdmux", "event_loop_normal_disagg_prefill",
        "event_loop_overlap_disagg_prefill", "event_loop_pp_disagg_prefill",
        "event_loop_normal_disagg_decode", "event_loop_overlap_disagg_decode",
        "event_loop_pp_disagg_decode"}


@pytest.mark.fast
def test_each_loop_names_the_function_sglang_dispatches_to():
    assert {name: loops.spec(name).function for name in ("mlx-normal", *DISAGG)} == {
        "mlx-normal": "event_loop_normal",
        "disagg-prefill-normal": "event_loop_normal_disagg_prefill",
        "disagg-prefill-overlap": "event_loop_overlap_disagg_prefill",
        "disagg-decode-normal": "event_loop_normal_disagg_decode",
        "disagg-decode-overlap": "event_loop_overlap_disagg_decode"}
    assert not set(DISAGG) & set(loops.default_names())
    with pytest.raises(ValueError, match="disaggregation must be"):
        loops.register(loops.LoopSpec("toy", loops.CANDIDATE, "event_loop_normal",
                                      mlx=True, disaggregation=loops.DECODE))


@pytest.mark.fast
@pytest.mark.parametrize("workload, loop", [("priority", "disagg-decode-normal"),
                                            ("memory-pressure", "disagg-decode-overlap")])
def test_a_decode_side_holds_the_rfc_clauses(saved, workload, loop):
    """Requests admitted already prefilled (and, under memory pressure, retracted and
    restored through a prebuilt batch): clauses 1-5 hold; clause 6 is the known
    upstream clock bug, reached through the prebuilt batch's extend_num_tokens."""
    report = check(saved(workload, loop))
    assert {n: r.status for n, r in report.clauses.items() if n <= 5} == dict.fromkeys(
        range(1, 6), HOLDS)
    assert report.clauses[6].status == VIOLATED
    assert [m.bug for m in report.known[6]] == ["processed-tokens-counter"]


@pytest.mark.fast
def test_the_hand_off_is_what_clause_2_reads(saved):
    """Without the prebuilt records, the hand-off token reads as a token no forward
    produced and the transferred prompt as an uncounted cache hit: the false reds the
    checker gave before it knew the path."""
    frames = saved("priority", "disagg-decode-normal")
    frames.tables["prebuilt"] = frames.prebuilt.iloc[0:0]
    violations = check(frames).clauses[2].violations
    assert {"cached_tokens", "output_ids"} <= set(violations["field"])


@pytest.mark.fast
def test_restored_kv_is_a_write_of_its_slots(saved):
    """A retracted request's KV restored by a prebuilt batch lands in new slots without
    a forward; without those writes, clause 1 reads the slots as another position's."""
    frames = saved("memory-pressure", "disagg-decode-overlap")
    assert not frames.prebuilt["transfer"].all()  # the run restored requests
    frames.tables["prebuilt"] = frames.prebuilt[frames.prebuilt["transfer"].astype(bool)]
    first = check(frames).clauses[1].first()
    assert first["rid"] == "c" and "holds the KV of position" in first["actual"]


@pytest.mark.fast
def test_queued_requests_are_in_flight_work(saved):
    """On the normal decode loop the preallocation queue holds requests at step
    boundaries: clause 5 is exercised there, and a probe that says idle is a red."""
    frames = saved("priority", "disagg-decode-normal")
    queued = frames.steps["disagg_queued"] > 0
    assert queued.any() and check(frames).clauses[5].status == HOLDS
    frames.steps.loc[queued, "idle_probe"] = True
    result = check(frames).clauses[5]
    assert result.status == MASKED
    assert "request(s) in the disaggregation queues" in result.first()["actual"]
    frames.steps["disagg_queued"] = 0
    assert check(frames).clauses[5].status == NOT_EXERCISED


@pytest.mark.fast
def test_an_ended_request_never_answered_is_clause_2(saved):
    """``finished_output`` (this project's extension of clause 2): a request that ended
    has had its final output sent by the boundary that first shows it ended."""
    frames = saved("priority", "disagg-decode-normal")
    assert check(frames).clauses[2].status == HOLDS
    requests = frames.requests
    ended = requests[requests["finished"].astype(bool)].sort_values("step")
    rid, step = ended["rid"].iloc[0], int(ended["step"].iloc[0])
    requests.loc[requests["rid"] == rid, "end_sent"] = False
    result = check(frames).clauses[2]
    assert result.status == VIOLATED
    assert (result.first()["field"], result.first()["rid"], result.first()["step"]) == (
        "finished_output", rid, step)
    assert check(frames, "rfc").clauses[2].status == HOLDS  # an extension, not the RFC's


# -- real loops ------------------------------------------------------------------------------


def _finished_tokens(frames) -> dict[str, list[int]]:
    ends = frames.requests.drop_duplicates("rid", keep="last").set_index("rid")
    return {rid: tokens for rid, tokens in frames.output_tokens().items()
            if ends.at[rid, "finish_reason"] in ("length", "stop")}


@pytest.mark.parametrize("loop", ("mlx-normal", *DISAGG))
def test_each_loop_runs_and_emits_event_loop_normals_tokens(run_cached, loop):
    """A decode side emits the normal loop's tokens, its first (the remote prefill's
    hand-off) included; a prefill side emits each request's first token."""
    frames = run_cached("stop-tokens", loop)
    normal = _finished_tokens(run_cached("stop-tokens", "normal"))
    assert frames.status == "finished"
    assert frames.meta["loop_function"] == loops.spec(loop).function
    tokens = frames.output_tokens()
    if loops.spec(loop).disaggregation == loops.PREFILL:
        assert tokens == {rid: emitted[:1] for rid, emitted in normal.items()}
    else:
        assert tokens == normal
    assert check(frames, "rfc").verdict().outcome == Outcome.PASS


def test_a_prefill_loop_refuses_a_later_turn(capsys):
    assert main(["check", "--loop", "disagg-prefill-normal", "--workload", "two-turn",
                 "--out", "/dev/null"]) == 2
    assert "does not take turn_of (request 'a2')" in capsys.readouterr().out


@pytest.mark.parametrize("loop, requirement", [
    ("pp", "distributed/parallel_state.py:2517"), ("pp-disagg-decode", "PPProxyTensors"),
    ("pdmux", "No module named 'sgl_kernel'")])
def test_a_loop_sglang_cannot_run_here_is_refused_naming_why(capsys, loop, requirement):
    assert main(["check", "--loop", loop, "--workload", "single-decode",
                 "--out", "/dev/null"]) == 2
    out = capsys.readouterr().out
    assert f"Unsupported: loop {loop} ({loops.spec(loop).function}) cannot run here" in out
    assert requirement in out


def test_a_server_arg_that_makes_another_loop_is_named(capsys):
    assert main(["check", "--loop", "normal", "--workload", "single-decode",
                 "--server-arg", "disaggregation_mode=decode", "--out", "/dev/null"]) == 2
    out = capsys.readouterr().out
    assert "--server-arg disaggregation_mode='decode'" in out
    assert "SGLang would run event_loop_normal_disagg_decode" in out


@pytest.mark.parametrize("workload, loop, mutant, clause, status", [
    ("staggered", "disagg-decode-normal", "prebuilt_skips_the_relay_stash", 4, VIOLATED),
    ("staggered", "disagg-decode-overlap", "prebuilt_seq_lens_one_high", 2, VIOLATED),
    ("priority", "disagg-decode-overlap", "idle_ignores_the_prealloc_queue", 5, MASKED),
])
def test_a_mutant_of_the_decode_side_turns_its_clause_red(workload, loop, mutant, clause,
                                                          status):
    frames = contract_lib.run(workload, loop, patch=[
        "fix-processed-tokens-counter", f"user_patches:{mutant}"])
    assert frames.status == "finished"
    report = check(frames)
    assert report.clauses[clause].status == status
    assert check(contract_lib.run(workload, loop, patch="fix-processed-tokens-counter")
                 ).clauses[clause].status == HOLDS


# -- the disaggregation paths' history (data/bugs.toml) ---------------------------------------


@pytest.mark.parametrize("loop", ["disagg-decode-normal", "disagg-decode-overlap"])
def test_12839s_kind_is_found_by_clause_2_finished_output(loop):
    """The prebuilt batch processed without ``stream_output``: the requests that end at
    their hand-off token (a: max_new_tokens 1, b: EOS first) are never answered."""
    workload = str(WORKLOADS / "first-token-finish.toml")
    assert check(contract_lib.run(workload, loop)).clauses[2].status == HOLDS
    report = check(contract_lib.run(workload, loop, patch="prebuilt-skips-stream-output"))
    result = report.clauses[2]
    assert result.status == VIOLATED
    assert set(result.violations["field"]) == {"finished_output"}
    assert set(result.violations["rid"]) == {"a", "b"}
    assert (result.first()["step"], result.first()["rid"]) == (1, "a")
    assert report.verdict().outcome == Outcome.VIOLATED


def test_30175_replays_but_nothing_here_can_show_it():
    """Without the n-gram hook in the disaggregation paths, every table a run records,
    the effects included, is the unpatched run's: the hook writes nothing for a model
    without n-gram embedding (the patched loop functions did run)."""
    for loop in ("disagg-prefill-normal", "disagg-decode-overlap"):
        plain = contract_lib.run("staggered", loop, audit=True)
        replay = contract_lib.run("staggered", loop, audit=True,
                                  patch="disagg-skips-ngram-embedding")
        assert replay.status == "finished"
        assert replay.effects["location"].str.contains(
            "patch disagg-skips-ngram-embedding", regex=False).any()
        ours, theirs = plain.comparable(), replay.comparable()
        ours["effects"], theirs["effects"] = (t.drop(columns="location")
                                              for t in (ours["effects"], theirs["effects"]))
        for name in ours:
            assert ours[name].equals(theirs[name]), (loop, name)
