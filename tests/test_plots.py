"""The notebook figures and tables, built on real runs (shared with the other tests)."""

from __future__ import annotations

import matplotlib
import pytest
from matplotlib.figure import Figure

from contract_lib import plots
from contract_lib.contract import check

matplotlib.use("Agg")


def _texts(fig: Figure) -> list[str]:
    return [t.get_text() for t in fig.texts]


def assert_readable(fig: Figure, panels: int) -> None:
    """A title and a subtitle, ``panels`` labelled data axes, and a legend."""
    assert isinstance(fig, Figure)
    title, subtitle = _texts(fig)[:2]
    assert title and subtitle and title != subtitle
    data_axes = [ax for ax in fig.axes if ax.get_xlabel()]
    assert len(data_axes) >= panels
    for ax in data_axes:
        assert ax.get_xlabel()
    assert any(ax.get_ylabel() or ax.get_yticklabels() for ax in fig.axes)
    assert fig.legends, "the figure needs a legend a reader understands without the code"
    assert all(t.get_text() for t in fig.legends[0].get_texts())
    fig.canvas.draw()  # the layout engine must succeed (Agg)


@pytest.fixture()
def two_turn(run_cached):
    return {loop: run_cached("two-turn", loop) for loop in ("normal", "overlap", "mlx")}


def test_launch_timeline_counts_chained_launches(two_turn):
    fig = plots.launch_timeline(two_turn["overlap"], two_turn["mlx"])
    assert_readable(fig, 2)
    kinds = plots.launch_kinds(two_turn["mlx"])
    assert kinds[["prefill", "fresh", "chained"]].to_numpy().sum() == len(
        two_turn["mlx"].launches)
    assert kinds["chained"].sum() > 0
    assert plots.launch_kinds(two_turn["overlap"])["chained"].sum() == 0
    assert "mlx" in fig.axes[1].get_title()


def test_slot_states_agree_with_clause_1(two_turn, run_cached):
    for frames in (*two_turn.values(), run_cached("two-turn", "mlx", "fix-chained-accounting")):
        states = plots.slot_states(frames)
        bad = states["state"].isin(["slot 0", "free", "shared", "stale"]).sum()
        assert bad == len(check(frames).clauses[1].violations)
    assert (plots.slot_states(two_turn["mlx"])["state"] == "slot 0").any()


def test_slot_grid(two_turn):
    fig = plots.slot_grid(two_turn["normal"], two_turn["mlx"], rid="a")
    assert_readable(fig, 2)
    assert "0 of" in fig.axes[0].get_title() and "unrecorded" in fig.axes[1].get_title()
    assert not fig.axes[1].get_title().split("\n")[1].startswith("0 of")


def test_counter_drift(two_turn, run_cached):
    fixed = run_cached("two-turn", "mlx", "fix-chained-accounting")
    fig = plots.counter_drift(two_turn["normal"], two_turn["mlx"], fixed, rid="a")
    assert_readable(fig, 3)
    assert "lag behind kv_computed: 0" in fig.axes[0].get_title()
    assert "lag behind kv_computed: 0" not in fig.axes[1].get_title()


def test_radix_reuse_against_the_ideal(two_turn, run_cached):
    fixed = run_cached("two-turn", "mlx", "fix-chained-accounting")
    runs = (two_turn["normal"], two_turn["overlap"], two_turn["mlx"], fixed)
    table = plots.radix_reuse_table(*runs)
    assert list(table["ideal"].unique()) == [27]
    cached = dict(zip(table["run"], table["cached_tokens"]))
    assert cached["normal"] == cached["overlap"] == 27
    assert cached["mlx"] < 27 <= cached["mlx + fix-chained-accounting"]
    assert_readable(plots.radix_reuse(*runs), 1)


def test_step_stamps_replays(two_turn, run_cached):
    no_ct = run_cached("two-turn", "mlx", "no-forward-ct")
    no_ts = run_cached("two-turn", "mlx", "no-launch-ts")
    fig = plots.step_stamps(two_turn["mlx"], no_ct, no_ts)
    assert_readable(fig, 3)
    ok = plots.stamps_table(two_turn["mlx"])
    assert (ok["forward_ct"] == ok["expected_ct"]).all() and set(ok["launch_ts"]) == {"set"}
    assert (plots.stamps_table(no_ct)["forward_ct"] == 0).all()
    assert "None" in set(plots.stamps_table(no_ts)["launch_ts"])
    summary = plots.crash_summary(no_ts)
    assert "TypeError" in summary and "_record_step_counters" in summary
    assert "/work" not in summary and "site-packages" not in summary


def test_relay_events(run_cached):
    torch, mlx = run_cached("mixed-chunk", "overlap"), run_cached("mixed-chunk", "mlx")
    fig = plots.relay_events(torch, mlx)
    assert_readable(fig, 2)
    assert "0 unpublished" in fig.axes[0].get_title()
    assert "0 unpublished" not in fig.axes[1].get_title()


def test_idle_predicate(two_turn, run_cached):
    fixed = run_cached("two-turn", "mlx", "fix-idle-predicate")
    fig = plots.idle_predicate(two_turn["overlap"], two_turn["mlx"], fixed)
    assert_readable(fig, 3)
    assert "idle at 0 of" in fig.axes[0].get_title()
    assert "idle at 0 of" not in fig.axes[1].get_title()
    assert "idle at 0 of" in fig.axes[2].get_title()


def test_triage_tables(two_turn):
    frames = two_turn["mlx"]
    report = check(frames)
    table = plots.report_table(report)
    assert list(table["status"]) == [r.status for r in report.clauses.values()]
    first = plots.first_violation(report)
    assert first["clause"] == 1 and first["field"] == "req_to_token"
    around = plots.frames_around(frames, first["step"], rid="a")
    assert list(around["step"]) == [first["step"] - 1, first["step"], first["step"] + 1]
    assert plots.first_violation(check(two_turn["normal"], clauses="rfc")) is None


def test_step_snapshot_and_figure(two_turn):
    frames = two_turn["mlx"]
    text = plots.step_snapshot(frames, 7, "a")
    assert text.startswith("step 7 of two-turn on mlx")
    assert "slot 0!" in text and "clause 1 (slots recorded)" in text
    rfc = check(two_turn["normal"], clauses="rfc")  # torch breaks only clause 6 (SGLang-wide)
    assert plots.step_snapshot(two_turn["normal"], 7, "a", rfc).endswith("violations here: none")
    assert "not known" in plots.step_snapshot(frames, 0, "a")
    fig = plots.step_figure(frames, 7, "a")
    assert _texts(fig)[0] and len(fig.axes) == 2
    fig.canvas.draw()
    with pytest.raises(ValueError, match="not in the"):
        plots.step_figure(frames, 7, "zz")


def test_step_explorer_builds_widgets(two_turn):
    pytest.importorskip("ipywidgets")
    view = plots.step_explorer(two_turn["mlx"], step=7, rid="a")
    slider, dropdown = view.children[0].children
    assert (slider.value, dropdown.value) == (7, "a")
    slider.value = 8  # re-renders without a frontend


def test_figures_survive_a_run_that_recorded_nothing(two_turn):
    """A run that died in setup has no frames; its panel says so instead of raising."""
    dead = plots.Frames.from_rows({}, {
        "workload": "two-turn", "loop": "mlx", "patch": "bad", "status": "crashed",
        "steps": 0, "sglang_version": "0.5.23", "error": {
            "type": "OSError", "message": "could not get source code", "phase": "setup",
            "traceback": None}})
    ok = two_turn["normal"]
    for build in (plots.launch_timeline, plots.relay_events, plots.idle_predicate,
                  plots.step_stamps):
        fig = build(ok, dead)
        fig.canvas.draw()
        assert any("no frames recorded" in t.get_text() for ax in fig.axes for t in ax.texts)
    plots.slot_grid(ok, dead, rid="a").canvas.draw()
    plots.counter_drift(ok, dead, rid="a").canvas.draw()
    table = plots.radix_reuse_table(ok, dead)
    assert table["cached_tokens"].isna().tolist() == [False, True]
    plots.radix_reuse(ok, dead).canvas.draw()
    assert "OSError" in plots.crash_summary(dead)


def test_audit_figure_and_table():
    from contract_lib.audit import audit

    result = audit("two-turn", progress=False)
    table = plots.audit_table(result)
    assert "Scheduler.processed_tokens_counter" in set(table["field"])
    fig = plots.audit_cadences(result)
    ax = fig.axes[0]
    assert ax.get_xlabel() == "loop" and len(ax.get_yticklabels()) == len(table)
    assert any("Effects audit" in t.get_text() for t in fig.texts)
