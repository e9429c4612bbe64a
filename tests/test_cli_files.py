"""The command line's own output files: names that do not collide, and an unwritable
path that costs the file, never the verdict."""

from __future__ import annotations

from contract_lib.cli import main, run_commands as cli_runs


def test_trace_file_names_carry_the_patch_and_the_clock(tmp_path, monkeypatch):
    """A patched or wall-clock trace must not silently overwrite the plain one."""
    monkeypatch.setattr(cli_runs, "FRAMES_DIR", tmp_path)
    base = ["trace", "--workload", "single-decode", "--loop", "normal"]
    assert main(base) == 0
    assert main([*base, "--patch", "no-forward-ct"]) == 0
    assert main([*base, "--wall-clock"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "single-decode.normal.no-forward-ct.trace.json",
        "single-decode.normal.trace.json",
        "single-decode.normal.wall-clock.trace.json"]


def test_an_unwritable_frames_path_keeps_the_verdict(tmp_path, capsys):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    code = main(["check", "--workload", "single-decode", "--loop", "normal", "--clauses",
                 "rfc", "--out", str(blocker / "frames.json")])
    captured = capsys.readouterr()
    assert code == 0
    assert "warning: could not write the frames to" in captured.err
    assert "run finished" in captured.out and "1 slots recorded" in captured.out


def test_an_unwritable_trace_path_is_one_line_and_exit_2(tmp_path, capsys):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    code = main(["trace", "--workload", "single-decode", "--loop", "normal",
                 "--out", str(blocker / "t.json")])
    assert code == 2
    assert capsys.readouterr().err.startswith("error: could not write the trace to")
