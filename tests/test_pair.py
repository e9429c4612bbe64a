"""The pair run: a workload through a PD prefill side, its handed-off requests through a
decode side, against event_loop_normal (real loops)."""

from __future__ import annotations

import pytest

from contract_lib.campaigns.pair import SHARED, decode_workload, pair
from contract_lib.cli import main
from contract_lib.contract import VIOLATED
from contract_lib.verdict import Outcome
from contract_lib.workloads import load_workload


@pytest.mark.fast
def test_the_decode_side_receives_each_hand_off_as_its_first_token():
    workload = load_workload("stop-tokens")
    carried = decode_workload(workload, {"a": 123, "b": 45})
    assert carried.scripted_tokens() == {"a": {0: 123, 5: 7}, "b": {0: 45, 3: 2},
                                         "c": {2: 2}, "d": {4: 9}}
    assert [r.rid for r in carried.requests] == ["a", "b", "c", "d"]  # none dropped


@pytest.mark.parametrize("prefill", ["disagg-prefill-normal", "disagg-prefill-overlap"])
@pytest.mark.parametrize("decode", ["disagg-decode-normal", "disagg-decode-overlap"])
def test_a_pair_emits_event_loop_normals_tokens(prefill, decode):
    result = pair("stop-tokens", prefill, decode)
    assert result.verdict().outcome == Outcome.PASS, result.verdict().reason
    assert not result.mismatches()
    handed = result.handoffs()
    assert set(handed) == {"a", "b", "c", "d"}
    # the decode side's first token is the prefill side's, admitted by a prebuilt batch
    assert {rid: tokens[0] for rid, tokens in result.decode.output_tokens().items()} == handed
    table = result.requests()
    assert list(table["normal's tokens"]) == ["yes"] * 4
    assert list(table["decode end"]) == ["stop", "stop", "length", "stop"]


def test_one_request_is_followed_across_both_sides(capsys):
    assert main(["pair", "--workload", "staggered"]) == 0
    out = capsys.readouterr().out
    assert SHARED in out
    result = pair("staggered")
    journey = result.journey("b")
    prefill, decode = (journey[journey["side"] == side] for side in ("prefill", "decode"))
    token = result.handoffs()["b"]
    assert prefill["then"].iloc[0] == f"arrives; extend launch -> {token}"
    assert prefill["ended"].iloc[-1] == "length"
    assert decode["then"].iloc[0].startswith(f"arrives; prebuilt batch: hand-off token {token}")
    assert decode["ended"].iloc[-1] == "length"
    assert decode["emitted"].iloc[-1] == "8"
    with pytest.raises(ValueError, match="request 'z' is not in workload 'staggered'"):
        result.journey("z")


def test_a_wrong_hand_off_crosses_to_the_decode_side():
    """The prefill side commits another first token than its forward sampled: clause 2
    there (a token the forward did not produce), and the decode side, which continues
    from what it received, emits other tokens than event_loop_normal."""
    result = pair("staggered", patch="user_patches:prefill_first_token_shifted")
    first = result.reports["prefill"].clauses[2]
    assert first.status == VIOLATED and first.first()["field"] == "output_ids"
    assert result.reports["decode"].verdict().outcome == Outcome.PASS
    assert result.verdict().outcome == Outcome.VIOLATED
    assert "request(s) emit other tokens than event_loop_normal" in result.verdict().reason
    decode = result.decode.output_tokens()
    assert {rid: tokens[0] for rid, tokens in decode.items()} == result.handoffs()
    assert set(result.mismatches()) == {"a", "b", "c", "d", "e"}


def test_a_workload_the_prefill_side_refuses_is_a_set_up_error(capsys):
    assert main(["pair", "--workload", "two-turn"]) == 2
    out = capsys.readouterr().out
    assert "does not take turn_of (request 'a2')" in out
    assert "no decode side" in out


def test_the_audit_compares_a_disaggregation_loop_with_event_loop_normal():
    """A decode side at its decode launches, a prefill side at its extend launches (it
    launches no decode): on staggered neither forgets a write both torch loops make."""
    from contract_lib.campaigns.audit import audit

    for loop, mode in (("disagg-decode-normal", "decode"), ("disagg-prefill-normal", "extend")):
        result = audit("staggered", loop=loop, progress=False)
        assert (result.candidate, result.mode) == (loop, mode)
        assert result.loops == ("normal", "overlap", loop)
        assert result.findings.empty, result.text()
        assert result.text().startswith(f"effects audit: staggered: fields both torch loops "
                                        f"write at every {mode} launch that {loop} writes")
