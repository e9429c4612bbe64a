"""The notebook figures and tables (contract_lib.views), built on the committed frames
of real runs (``tests/fixtures``; the fast tier), except those that need a run of
their own (the effects audit, a held-out workload)."""

from __future__ import annotations

import matplotlib
import pytest
from matplotlib.figure import Figure

from contract_lib import views
from contract_lib.contract import SLOT_STATES, check, slot_states
from contract_lib.frames import Frames
from contract_lib.views import style

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
def two_turn(saved):
    return {loop: saved("two-turn", loop) for loop in ("normal", "overlap", "mlx")}


@pytest.mark.fast
def test_launch_timeline_counts_chained_launches(two_turn):
    fig = views.launch_timeline(two_turn["overlap"], two_turn["mlx"])
    assert_readable(fig, 2)
    kinds = views.launch_kinds(two_turn["mlx"])
    assert kinds[["prefill", "fresh", "chained"]].to_numpy().sum() == len(
        two_turn["mlx"].launches)
    assert kinds["chained"].sum() > 0
    assert views.launch_kinds(two_turn["overlap"])["chained"].sum() == 0
    assert "mlx" in fig.axes[1].get_title()


@pytest.mark.fast
def test_slot_colours_name_every_clause_1_state(two_turn):
    """The grid draws the checker's states; it classifies nothing itself."""
    assert set(views.SLOT_COLOURS) == set(SLOT_STATES)
    rows = views.slot_rows(two_turn["mlx"])
    assert len(rows) == len(slot_states(two_turn["mlx"]))
    assert (rows["state"] == "slot 0").any()


@pytest.mark.fast
def test_slot_grid(two_turn):
    fig = views.slot_grid(two_turn["normal"], two_turn["mlx"], rid="a")
    assert_readable(fig, 2)
    assert "0 of" in fig.axes[0].get_title() and "unrecorded" in fig.axes[1].get_title()
    assert not fig.axes[1].get_title().split("\n")[1].startswith("0 of")


@pytest.mark.fast
def test_counter_drift(two_turn, saved):
    fixed = saved("two-turn", "mlx", "fix-chained-accounting")
    fig = views.counter_drift(two_turn["normal"], two_turn["mlx"], fixed, rid="a")
    assert_readable(fig, 3)
    assert "lag behind kv_computed: 0" in fig.axes[0].get_title()
    assert "lag behind kv_computed: 0" not in fig.axes[1].get_title()


@pytest.mark.fast
def test_radix_reuse_against_the_ideal(two_turn, saved):
    fixed = saved("two-turn", "mlx", "fix-chained-accounting")
    runs = (two_turn["normal"], two_turn["overlap"], two_turn["mlx"], fixed)
    table = views.radix_reuse_table(*runs)
    assert list(table["ideal"].unique()) == [27]
    cached = dict(zip(table["run"], table["cached_tokens"]))
    assert cached["normal"] == cached["overlap"] == 27
    assert cached["mlx"] < 27 <= cached["mlx + fix-chained-accounting"]
    assert_readable(views.radix_reuse(*runs), 1)


@pytest.mark.fast
def test_step_stamps_replays(two_turn, saved):
    no_ct = saved("two-turn", "mlx", "no-forward-ct")
    no_ts = saved("two-turn", "mlx", "no-launch-ts")
    fig = views.step_stamps(two_turn["mlx"], no_ct, no_ts)
    assert_readable(fig, 3)
    ok = views.stamps_table(two_turn["mlx"])
    assert (ok["forward_ct"] == ok["expected_ct"]).all() and set(ok["launch_ts"]) == {"set"}
    assert (views.stamps_table(no_ct)["forward_ct"] == 0).all()
    assert "None" in set(views.stamps_table(no_ts)["launch_ts"])
    summary = views.crash_summary(no_ts)
    assert "TypeError" in summary and "_record_step_counters" in summary
    assert "/work" not in summary and "site-packages" not in summary


@pytest.mark.fast
def test_relay_events(saved):
    torch, mlx = saved("mixed-chunk", "overlap"), saved("mixed-chunk", "mlx")
    fig = views.relay_events(torch, mlx)
    assert_readable(fig, 2)
    assert "0 unpublished" in fig.axes[0].get_title()
    assert "0 unpublished" not in fig.axes[1].get_title()


@pytest.mark.fast
def test_idle_predicate(two_turn, saved):
    fixed = saved("two-turn", "mlx", "fix-idle-predicate")
    fig = views.idle_predicate(two_turn["overlap"], two_turn["mlx"], fixed)
    assert_readable(fig, 3)
    assert "idle at 0 of" in fig.axes[0].get_title()
    assert "idle at 0 of" not in fig.axes[1].get_title()
    assert "idle at 0 of" in fig.axes[2].get_title()


@pytest.mark.fast
def test_triage_tables(two_turn):
    frames = two_turn["mlx"]
    report = check(frames)
    table = views.report_table(report)
    assert list(table["status"]) == [r.status for r in report.clauses.values()]
    first = views.first_violation(report)
    assert first["clause"] == 1 and first["field"] == "req_to_token"
    around = views.frames_around(frames, first["step"], rid="a")
    assert list(around["step"]) == [first["step"] - 1, first["step"], first["step"] + 1]
    assert views.first_violation(check(two_turn["normal"], clauses="rfc")) is None


@pytest.mark.fast
def test_step_snapshot_and_figure(two_turn):
    frames = two_turn["mlx"]
    text = views.step_snapshot(frames, 7, "a")
    assert text.startswith("step 7 of two-turn on mlx")
    assert "slot 0!" in text and "clause 1 (slots recorded)" in text
    rfc = check(two_turn["normal"], clauses="rfc")  # torch breaks only clause 6 (known upstream)
    assert views.step_snapshot(two_turn["normal"], 7, "a", rfc).endswith("violations here: none")
    assert "not known" in views.step_snapshot(frames, 0, "a")
    fig = views.step_figure(frames, 7, "a")
    assert _texts(fig)[0] and len(fig.axes) == 2
    fig.canvas.draw()
    with pytest.raises(ValueError, match="not in the"):
        views.step_figure(frames, 7, "zz")


@pytest.mark.fast
def test_step_explorer_builds_widgets(two_turn):
    pytest.importorskip("ipywidgets")
    view = views.step_explorer(two_turn["mlx"], step=7, rid="a")
    slider, dropdown = view.children[0].children
    assert (slider.value, dropdown.value) == (7, "a")
    slider.value = 8  # re-renders without a frontend


@pytest.mark.fast
def test_figures_survive_a_run_that_recorded_nothing(two_turn):
    """A run that died in setup has no frames; its panel says so instead of raising."""
    dead = Frames.from_rows({}, {
        "workload": "two-turn", "loop": "mlx", "patch": "bad", "status": "crashed",
        "steps": 0, "sglang_version": "0.5.23", "error": {
            "type": "OSError", "message": "could not get source code", "phase": "setup",
            "traceback": None}})
    ok = two_turn["normal"]
    for build in (views.launch_timeline, views.relay_events, views.idle_predicate,
                  views.step_stamps):
        fig = build(ok, dead)
        fig.canvas.draw()
        assert any("no frames recorded" in t.get_text() for ax in fig.axes for t in ax.texts)
    views.slot_grid(ok, dead, rid="a").canvas.draw()
    views.counter_drift(ok, dead, rid="a").canvas.draw()
    table = views.radix_reuse_table(ok, dead)
    assert table["cached_tokens"].isna().tolist() == [False, True]
    views.radix_reuse(ok, dead).canvas.draw()
    assert "OSError" in views.crash_summary(dead)


@pytest.mark.fast
def test_triage_views_of_a_run_that_stopped_early(two_turn, saved):
    """A crashed run (two-turn on mlx + no-launch-ts stops at step 1, before a2) and the
    same run with no request known yet: each triage view says what there is, and the
    ideal reuse of a2 comes from the finished torch run, never from the crashed one."""
    crashed = saved("two-turn", "mlx", "no-launch-ts")
    assert crashed.status == "crashed"
    summary = views.recorded_summary(crashed, "two-turn")
    assert summary.startswith("recorded before it stopped: steps 0-") and "a2" in summary
    table = views.radix_reuse_table(crashed, two_turn["normal"], rid="a2")
    a_end = two_turn["normal"].requests.query("rid == 'a'").iloc[-1]
    assert table["ideal"].tolist() == [int(a_end["prompt_len"]) + int(a_end["emitted"]) - 1] * 2
    assert table.attrs["ideal_from"] == "normal" and table["difference"].tolist()[1] == 0
    alone = views.radix_reuse_table(crashed, rid="a2")
    assert alone["ideal"].isna().all() and alone.attrs["ideal_from"] is None
    with pytest.raises(ValueError, match="no run finished with a in it"):
        views.radix_reuse(crashed, rid="a2")
    crashed.tables["requests"] = crashed.requests.iloc[:0]  # before any request arrived
    step, rid = views.triage_focus(crashed, check(crashed))
    assert rid is None
    assert "no request known to the scheduler" in views.step_snapshot(crashed, step, rid)
    views.step_figure(crashed, step, rid).canvas.draw()
    summary = " ".join(views.recorded_summary(crashed, "two-turn").split())
    assert summary.endswith("requests none; never known to the scheduler: a, b, c, a2")


def test_audit_figure_and_table():
    from contract_lib.campaigns.audit import audit

    result = audit("two-turn", progress=False)
    table = views.audit_table(result)
    assert "Scheduler.processed_tokens_counter" in set(table["field"])
    fig = views.audit_cadences(result)
    ax = fig.axes[0]
    assert ax.get_xlabel() == "loop" and len(ax.get_yticklabels()) == len(table)
    assert any("Effects audit" in t.get_text() for t in fig.texts)


@pytest.mark.fast
def test_one_meaning_per_colour():
    palette = {name: value for name, value in vars(style).items()
               if name.isupper() and isinstance(value, str) and value.startswith("#")}
    assert len(set(palette.values())) == len(palette), "two names for one colour"


@pytest.mark.fast
def test_panels_skip_runs_without_frames(two_turn):
    dead = Frames.from_rows({}, {"workload": "two-turn", "loop": "mlx", "status": "crashed",
                                 "steps": 0, "error": None})
    view = style.panels([two_turn["normal"], dead])
    assert [name for _, _, name in view] == ["normal"]
    assert view.summary == ["mlx: no frames"]
    with pytest.raises(ValueError, match="1 labels for 2 runs"):
        style.panels([two_turn["normal"], dead], labels=["x"])


@pytest.mark.fast
def test_counter_drift_lines_end_at_the_finish_values(two_turn):
    frames = two_turn["mlx"]
    rows = frames.requests[frames.requests["rid"] == "a"]
    end = rows[rows["finished"].astype(bool)].iloc[0]
    for x in ("step", "emitted"):
        fig = views.counter_drift(frames, rid="a", x=x)
        computed, _, committed, _ = fig.axes[0].lines[:4]  # in COUNTER_STYLES order
        assert computed.get_ydata()[-1] == end["kv_computed"]  # lines[0]: 27 before
        assert committed.get_ydata()[-1] == end["kv_committed_len"]
        assert committed.get_xdata()[-2] == end[x]
    assert "tokens emitted" in views.counter_drift(frames, rid="a", x="emitted").axes[0].get_xlabel()
    with pytest.raises(ValueError, match="x must be one of"):
        views.counter_drift(frames, rid="a", x="time")


@pytest.mark.fast
def test_slot_ids_written_only_where_they_break_the_clause(two_turn):
    fig = views.slot_grid(two_turn["mlx"], rid="a")
    bad = len(check(two_turn["mlx"]).clauses[1].violations.query("rid == 'a'"))
    assert len(fig.axes[0].texts) == bad > 0
    assert len(views.slot_grid(two_turn["mlx"], rid="a", annotate="none").axes[0].texts) == 0
    with pytest.raises(ValueError, match="annotate"):
        views.slot_grid(two_turn["mlx"], rid="a", annotate="some")


def test_radix_reuse_of_a_workload_given_as_a_toml_path(tmp_path, run_cached):
    """A held-out workload that shares a shipped workload's name: the ideal comes from
    the file, not from the shipped two-turn (which has no request x2)."""
    path = tmp_path / "two-turn.toml"
    path.write_text('name = "two-turn"\nmax_steps = 80\n\n'
                    '[[requests]]\nrid = "x"\nprompt_range = [30, 45]\nmax_new_tokens = 5\n'
                    'arrival = 0\n\n[[requests]]\nrid = "x2"\nturn_of = "x"\n'
                    'prompt_range = [90, 93]\nmax_new_tokens = 3\narrival = 10\n')
    import contract_lib

    frames = contract_lib.run(str(path), "normal")
    table = views.radix_reuse_table(frames, rid="x2", workload=path)
    assert table["ideal"].tolist() == [15 + 5 - 1]
    assert table["cached_tokens"].tolist() == [19]


@pytest.mark.fast
def test_clause_view_follows_the_violated_clause(two_turn, saved):
    cases = {1: two_turn["mlx"],
             3: saved("two-turn", "mlx", "fix-chained-accounting+no-forward-ct"),
             4: saved("mixed-chunk", "overlap", "skip-relay-publish")}
    titles = {1: "Clause 1", 3: "Clause 3", 4: "Clause 4"}
    for clause, frames in cases.items():
        report = check(frames)
        assert int(views.first_violation(report)["clause"]) == clause
        fig = views.clause_view(frames, report, two_turn["normal"])
        assert fig.texts[0].get_text().startswith(titles[clause])
    rfc = check(two_turn["normal"], clauses="rfc")  # torch breaks clause 6 (known upstream)
    assert views.clause_view(two_turn["normal"], rfc) is None


@pytest.mark.fast
def test_verdict_line_of_a_crashed_run(saved):
    crashed = saved("two-turn", "mlx", "no-launch-ts")
    line = views.verdict_line(crashed)
    assert line.startswith("verdict: ") and "every clause holds" not in line
    assert all(len(part) <= 100 for part in line.splitlines())


def test_findings_beyond_the_rfc_text():
    from contract_lib.campaigns.audit import audit

    text = views.beyond_rfc_text(audit("two-turn", progress=False))
    assert "Scheduler.processed_tokens_counter" in text and "Req.decode_batch_idx" in text
    assert "req_to_token" not in text and "kv_committed_len" not in text


@pytest.mark.fast
def test_memory_pressure_and_extension_views(saved):
    runs = [saved("memory-pressure", "normal"), saved("memory-pressure", "mlx"),
            saved("memory-pressure", "mlx", "fix-chained-accounting")]
    torch, mlx, fixed = (views.memory_table(f) for f in runs)
    assert torch["retractions"].iloc[-1] > 0 and mlx["retractions"].iloc[-1] == 0
    assert fixed["retractions"].iloc[-1] == torch["retractions"].iloc[-1]
    assert (mlx["computed"] > mlx["pool"]).any() and (torch["computed"] <= torch["pool"]).all()
    assert_readable(views.memory_pressure(*runs), 3)
    clock = views.clock_table(runs[1])
    assert (clock["processed_tokens_counter"] == 0).all() and clock["prefilled"].sum() > 0
    assert_readable(views.scheduling_clock(*runs), 3)
    fig = views.retired_lanes(*runs)
    assert_readable(fig, 3)
    bad = len(check(runs[1]).clauses[7].violations)
    assert f"{bad} violations" in fig.axes[1].get_title() and bad > 0


@pytest.mark.fast
@pytest.mark.parametrize("clause", range(1, 8))
def test_bug_cards_print_what_was_read_and_what_was_measured(clause):
    """Every catalogued bug of the clause, with its ``affected`` (read) and ``measured``
    fields from data/bugs.toml, each wrapped at 92 columns."""
    from contract_lib.patches.catalog import bug_catalog

    card = views.bug_card(clause)
    flat = " ".join(card.split())
    for bug in (b for b in bug_catalog() if b["clause"] == clause):
        assert " ".join(f"affected (read): {bug['affected']}".split()) in flat
        assert " ".join(f"measured: {bug['measured']}".split()) in flat
    assert max(len(line) for line in card.splitlines()[1:] if line.startswith("  ")) <= 92
