"""Catalogued upstream bugs behave like strict xfail, and match exactly (issue #36).

A clause whose violations are exactly what a catalogued bug predicts, step by step from
the run's own frames, is ``known upstream``: reported, not a failure unless
``strict_known``. Loop-local bugs on the same field (ahead by another amount, lagging,
skipping a step) and runs with the bug's fix applied never match. The crafted frames
are committed real runs (``saved``) with one thing changed.
"""

from __future__ import annotations

import pytest

from contract_lib.campaigns.status import KNOWN_UPSTREAM, Status
from contract_lib.contract import VIOLATED, check
from contract_lib.verdict import Outcome

pytestmark = pytest.mark.fast

CLOCK = "processed_tokens_counter"


def _known(report, clause: int = 6) -> list[str]:
    return [m.bug for m in report.known.get(clause, [])]


def _shift_from(frames, step: int, by: int) -> None:
    """The clock reads ``by`` more from ``step`` on (one advance changed by ``by``)."""
    steps = frames.steps.copy()
    steps.loc[steps.step >= step, CLOCK] += by
    frames.tables["steps"] = steps


def _first_decode_step(frames) -> int:
    """The boundary after the first decode launch (where the bug adds a stale size)."""
    return int(frames.launches.loc[frames.launches["mode"] == "decode", "step"].min()) + 1


def test_the_torch_clock_bug_is_known_upstream_and_fails_only_when_strict(saved):
    frames = saved("two-turn", "normal")
    report = check(frames)
    assert report.clauses[6].status == VIOLATED and _known(report) == [
        "processed-tokens-counter"]
    assert report.verdict().outcome == Outcome.PASS
    assert "known upstream bugs reproduced exactly as catalogued: processed-tokens-" \
        "counter (clause 6)" in report.verdict().reason
    (match,) = report.known[6]
    assert match.summary == "+28 where +0 at 11 steps, +5 where +0 at 3 steps"
    strict = check(frames, strict_known=True)
    assert strict.verdict().outcome == Outcome.VIOLATED and not strict.ok


@pytest.mark.parametrize("change", ["ahead-by-another-amount", "skips-a-step", "lags"])
def test_a_loop_local_clock_bug_is_never_the_catalogued_one(saved, change):
    frames = saved("two-turn", "normal")
    step = _first_decode_step(frames)
    if change == "ahead-by-another-amount":
        _shift_from(frames, step, 1)  # +29 where the batch carried 28
    elif change == "skips-a-step":
        _shift_from(frames, step, -28)  # that decode step added nothing
    else:
        _shift_from(frames, 1, -3)  # the prefill counted 3 short
    report = check(frames)
    assert report.clauses[6].status == VIOLATED and _known(report) == []
    assert report.verdict().outcome == Outcome.VIOLATED


def test_a_run_with_the_fix_applied_never_matches(saved):
    frames = saved("two-turn", "normal")
    frames.meta["patch"] = "fix-processed-tokens-counter"  # yet the bug's values show
    report = check(frames)
    assert report.clauses[6].status == VIOLATED and _known(report) == []
    assert report.verdict().outcome == Outcome.VIOLATED


def test_a_fixed_run_says_the_bug_no_longer_reproduces(saved):
    fixed = check(saved("two-turn", "normal", "fix-processed-tokens-counter"))
    assert fixed.ok and not fixed.known
    (gone,) = fixed.gone
    assert (gone.bug, gone.reproduced, gone.fix_applied) == (
        "processed-tokens-counter", False, "fix-processed-tokens-counter")
    assert "no longer reproduces (its fix, patch fix-processed-tokens-counter, is " \
        "applied)" in fixed.text()
    # the same clock without the patch named: a diff that fixed it upstream
    frames = saved("two-turn", "normal", "fix-processed-tokens-counter")
    frames.meta["patch"] = None
    (gone,) = check(frames).gone
    assert gone.fix_applied is None and gone.bug == "processed-tokens-counter"


def test_the_mlx_clock_that_never_advances_is_known_and_an_advance_breaks_it(saved):
    frames = saved("two-turn", "mlx")
    assert _known(check(frames)) == ["mlx-clock"]
    _shift_from(frames, 1, 28)  # the first prefill counted: no longer "never advances"
    report = check(frames)
    assert report.clauses[6].status == VIOLATED and _known(report) == []


def test_frames_without_the_batch_field_match_nothing(saved):
    frames = saved("two-turn", "normal")
    frames.tables["launches"] = frames.launches.assign(extend_num_tokens=None)
    assert _known(check(frames)) == []


def test_status_shows_known_upstream_and_strict_fails_the_gate(saved):
    runs = {("two-turn", "normal"): saved("two-turn", "normal"),
            ("two-turn", "mlx"): saved("two-turn", "mlx")}
    status = Status({key: check(f) for key, f in runs.items()})
    assert status.table().loc["6 scheduling clocks advanced", "normal"] == \
        f"{KNOWN_UPSTREAM} (1/1)"
    assert status.outcome() == Outcome.PASS
    strict = Status({key: check(f, strict_known=True) for key, f in runs.items()})
    assert strict.table().loc["6 scheduling clocks advanced", "normal"] == "violated (1/1)"
    assert strict.outcome() == Outcome.VIOLATED
    assert list(strict.reference_violations().clause) == [6]
