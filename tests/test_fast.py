"""The fast tier: the checker, the report and the status table on committed frame
fixtures (``tests/fixtures``: real runs saved with ``Frames.save`` by
``scripts/make-fixtures``). Pure pandas, no Scheduler: ``pytest -m fast``.

The expectations are the measured facts the real-loop tests assert on fresh runs
(``tests/test_contract.py``, ``tests/test_extensions.py``); here they pin the checker
against frames that do not change under it.
"""

from __future__ import annotations

import pytest

from conftest import saved_frames
from contract_lib.campaigns.status import Status
from contract_lib.contract import (
    HOLDS,
    MASKED,
    NOT_EXERCISED,
    VIOLATED,
    ContractViolation,
    assert_contract,
    check,
)
from contract_lib.contract.outputs import same_tokens
from contract_lib.verdict import Outcome

pytestmark = pytest.mark.fast


def fixture(name: str):
    """The committed frames named ``workload.loop[.patch]``."""
    return saved_frames(*name.split(".", 2))


def _statuses(name: str, clauses: str = "all") -> dict[int, str]:
    return {n: r.status for n, r in check(fixture(name), clauses).clauses.items()}


def test_the_torch_loops_hold_the_rfc_clauses():
    assert _statuses("single-decode.normal", "rfc") == {
        1: HOLDS, 2: HOLDS, 3: HOLDS, 4: HOLDS, 5: NOT_EXERCISED}
    assert _statuses("single-decode.overlap", "rfc") == {
        1: HOLDS, 2: HOLDS, 3: HOLDS, 4: HOLDS, 5: HOLDS}


def test_the_mlx_loop_violates_slots_counters_and_masks_the_idle_predicate():
    statuses = _statuses("two-turn.mlx")
    assert statuses[1] == VIOLATED and statuses[2] == VIOLATED and statuses[5] == MASKED
    assert statuses[3] == HOLDS and statuses[4] == HOLDS


def test_breaking_patches_violate_their_clause():
    assert _statuses("two-turn.overlap.skip-relay-publish")[4] == VIOLATED
    assert _statuses("single-decode.mlx.no-forward-ct")[3] == VIOLATED
    assert _statuses("single-decode.mlx")[3] == HOLDS


def test_the_extensions_find_the_known_clock_bug_on_the_torch_loops():
    report = check(fixture("single-decode.normal"))
    assert report.clauses[6].status == VIOLATED
    status = Status({("single-decode", "normal"): report})
    assert status.table().loc["6 scheduling clocks advanced", "normal"].startswith(
        "known upstream")
    assert status.reference_violations().empty


def test_a_pool_leak_on_a_reference_loop_fails_status_and_shows_in_compare():
    """A leak shows as a row of the status table and fails ``status`` on a torch loop; in
    a comparison the row is on both sides, judged like a clause."""
    from contract_lib.campaigns.compare import classify

    frames = fixture("single-decode.overlap")
    frames.steps.loc[len(frames.steps) - 1, "pool_leak"] = True
    leaked = check(frames, "rfc")
    clean = check(fixture("single-decode.normal"), "rfc")
    status = Status({("single-decode", "overlap"): leaked,
                     ("single-decode", "normal"): clean})
    row = "- KV pool conservation (SGLang InvariantChecker)"
    assert status.table().loc[row].to_dict() == {"normal": "balanced (1/1)",
                                                 "overlap": "leak (1/1)"}
    assert status.outcome() == Outcome.VIOLATED
    assert row not in Status({("single-decode", "normal"): clean}).table().index
    assert classify("balanced", "leak").label == "broke"
    assert classify("leak", "balanced").label == "fixed"


def test_assert_contract_names_the_lowest_violated_clause():
    with pytest.raises(ContractViolation, match=r"^clause 4 \(relays published"):
        assert_contract(fixture("two-turn.overlap.skip-relay-publish"), "rfc")
    assert assert_contract(fixture("single-decode.overlap"), "rfc").verdict().outcome == (
        Outcome.PASS)


def test_the_status_table_has_one_column_per_loop_in_registry_order():
    reports = {("single-decode", loop): check(fixture(f"single-decode.{loop}"))
               for loop in ("mlx", "normal", "overlap")}
    assert list(Status(reports).table().columns) == ["normal", "overlap", "mlx"]


def test_same_tokens_compares_every_request_that_finished_on_both_runs():
    normal, mlx = fixture("two-turn.normal"), fixture("two-turn.mlx")
    assert same_tokens(normal, mlx) == {"a": True, "b": True, "c": True, "a2": True}
    crashed = fixture("two-turn.mlx.no-launch-ts")  # stopped before any request finished
    assert crashed.status == "crashed" and same_tokens(crashed, normal) == {}
    outputs = mlx.outputs
    mlx.tables["outputs"] = outputs.drop(outputs.index[outputs["rid"] == "b"][-1:])
    assert same_tokens(normal, mlx)["b"] is False  # b finished by length: a token short
