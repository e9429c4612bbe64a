"""Everywhere a loop is a choice: every command that takes ``--loop`` (and the plugin's
``contract_run(..., loop=...)``) accepts the PD-disaggregation loops and MLX without
overlap, and refuses a loop SGLang cannot run here with one line and exit 2, before any
run starts."""

from __future__ import annotations

import json
import re

import pytest
from test_plugin import _pytest

from contract_lib import loops
from contract_lib.cli import main
from contract_lib.runs.loop_choice import runnable
from contract_lib.wire.protocol import RunSetupError

REFUSED = ("pp", "pp-disagg-prefill", "pp-disagg-decode", "pdmux")


@pytest.mark.fast
@pytest.mark.parametrize("argv", [
    ["status", "--loop", "normal", "--loop", "{loop}"],
    ["compare", "--head", "release=0.5.23", "--loop", "{loop}", "single-decode"],
    ["search", "--loop", "{loop}", "--budget", "1"],
    ["trace", "--workload", "single-decode", "--loop", "{loop}"],
    ["audit", "--workload", "single-decode", "--loop", "{loop}"],
    ["pair", "--workload", "single-decode", "--prefill", "{loop}"],
    ["pair", "--workload", "single-decode", "--decode", "{loop}"],
], ids=lambda argv: argv[0] + ("-decode" if "--decode" in argv else ""))
@pytest.mark.parametrize("loop", REFUSED)
def test_a_loop_that_cannot_run_here_is_one_line_and_exit_2(capsys, argv, loop):
    assert main([part.format(loop=loop) for part in argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1, err
    assert err.startswith(f"error: loop {loop} ({loops.spec(loop).function}) cannot run "
                          "here: ")


@pytest.mark.fast
def test_the_new_loops_are_choices_of_every_command():
    """argparse takes them (a run then decides); the plugin and the API check the same."""
    new = ("mlx-normal", "disagg-prefill-normal", "disagg-prefill-overlap",
           "disagg-decode-normal", "disagg-decode-overlap")
    assert runnable(new) == new
    from contract_lib.cli import build_parser

    parser = build_parser()
    for command in ("status", "compare", "trace"):
        for loop in new:
            extra = {"status": [], "compare": ["--head", "release=0.5.23"],
                     "trace": ["--workload", "single-decode"]}[command]
            assert parser.parse_args([command, *extra, "--loop", loop]).loop == [loop]
    for loop in new:
        for command, extra in (("search", []), ("audit", [])):
            assert parser.parse_args([command, *extra, "--loop", loop]).loop == loop
    with pytest.raises(RunSetupError, match="is a reference of the audit"):
        from contract_lib.campaigns.audit import audit

        audit("single-decode", loop="normal")
    with pytest.raises(RunSetupError, match="unknown loop 'nope'"):
        runnable(["nope"])


@pytest.mark.fast
def test_a_pair_side_must_be_a_disaggregation_loop_of_its_role(capsys):
    assert main(["pair", "--workload", "single-decode", "--prefill",
                 "disagg-decode-normal"]) == 2
    err = capsys.readouterr().err
    assert err == ("error: loop disagg-decode-normal is not a PD-disaggregation prefill "
                   "loop; prefill loops: disagg-prefill-normal, disagg-prefill-overlap\n")


def test_the_new_loops_run_under_status_trace_compare_and_search(tmp_path, capsys):
    """One workload through each command with a disaggregation loop (frames cached)."""
    assert main(["status", "--workload", "single-decode", "--loop", "mlx-normal",
                 "--loop", "disagg-prefill-overlap", "--loop", "disagg-decode-normal"]) == 0
    header = capsys.readouterr().out.splitlines()[0].split()
    assert header[1:] == ["mlx-normal", "disagg-prefill-overlap", "disagg-decode-normal"]
    out = tmp_path / "t.trace.json"
    assert main(["trace", "--workload", "single-decode", "--loop", "normal", "--loop",
                 "disagg-decode-overlap", "--out", str(out)]) == 0
    processes = {e["args"]["name"] for e in json.loads(out.read_text())["traceEvents"]
                 if e.get("name") == "process_name"}
    assert any("disagg-decode-overlap" in name for name in processes)
    assert main(["compare", "--head", "release=0.5.23", "--loop", "disagg-prefill-normal",
                 "single-decode"]) == 5  # kept: the same SGLang on both sides
    assert re.search(r"disagg-prefill-normal\s+yes", capsys.readouterr().out)
    assert main(["search", "--loop", "disagg-prefill-overlap", "--budget", "2",
                 "--seed", "3", "--no-database"]) == 0
    assert "no finding on --loop disagg-prefill-overlap" in capsys.readouterr().out


def test_a_compare_of_refused_runs_only_is_a_usage_error(capsys):
    assert main(["compare", "--head", "release=0.5.23", "--loop", "mlx", "page-size-4"]) == 2
    out = capsys.readouterr().out
    assert "run page-size-4 on mlx (head): unsupported" in out
    assert out.rstrip().endswith("compare: usage (exit 2)")


def test_the_plugin_runs_a_disaggregation_loop_and_refuses_one_that_cannot_run(tmp_path):
    (tmp_path / "test_loops.py").write_text(
        "import pytest\n"
        "from contract_lib.contract import assert_contract\n"
        "from contract_lib.wire.protocol import RunSetupError\n\n"
        "def test_decode_side(contract_run):\n"
        "    assert_contract(contract_run('single-decode', loop='disagg-decode-overlap'),\n"
        "                    clauses='rfc')\n\n"
        "def test_refused(contract_run):\n"
        "    with pytest.raises(RunSetupError, match=r'^loop pp \\(event_loop_pp\\) cannot'):\n"
        "        contract_run('single-decode', loop='pp')\n")
    proc = _pytest("test_loops.py", "-rA", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "2 passed" in proc.stdout
