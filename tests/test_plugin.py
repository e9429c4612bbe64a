"""The pytest plugin (``contract_lib.pytest_plugin``, entry point ``pytest11``) and the test file
it is for: ``contrib/sglang/.../mlx/test_per_step_contract.py``, run here with pytest in
a subprocess against the installed SGLang, as SGLang's CI would run it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SGLANG_TEST = (ROOT / "contrib" / "sglang" / "test" / "registered" / "unit"
               / "hardware_backend" / "mlx" / "test_per_step_contract.py")
CANDIDATE_FIXES = "fix-chained-accounting+fix-idle-predicate"


def _pytest(*args: str, cwd: Path, env: dict[str, str] | None = None,
            timeout: float = 900) -> subprocess.CompletedProcess:
    """``python -m pytest ARGS`` in a fresh process started in ``cwd`` (outside this
    checkout, so only installed plugins load), without pytest's cache."""
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
                          cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True,
                          text=True, timeout=timeout)


def _run_sglang_test(tmp_path: Path, *args: str, **env: str) -> tuple[
        subprocess.CompletedProcess, dict[str, str]]:
    """Run the shipped SGLang-tree test file, copied into an empty tree (no
    configuration of this checkout applies); its outcome per test id (``-rA``).

    ``sglang_import_shims`` (tests/) lets the test process import ``sglang`` in this
    CPU-only venv (SGLang's Triton stand-in, as every run's process has it)."""
    test = tmp_path / SGLANG_TEST.relative_to(ROOT / "contrib" / "sglang")
    test.parent.mkdir(parents=True)
    test.write_text(SGLANG_TEST.read_text())
    env = {"PYTHONPATH": str(ROOT / "tests"), **env}
    proc = _pytest("-p", "sglang_import_shims", str(test), "-rA", *args, cwd=tmp_path,
                   env=env)
    outcomes = dict((test, outcome) for outcome, test in re.findall(
        r"^(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED)\S* \S*::(\S+)", proc.stdout, re.M))
    return proc, outcomes


def _ids(outcomes: dict[str, str], test: str) -> dict[str, str]:
    return {t.split("[", 1)[1][:-1]: o for t, o in outcomes.items() if t.startswith(test + "[")}


@pytest.mark.fast
def test_the_plugin_module_imports_nothing_heavy():
    """pytest imports it in every session of every project where contract_lib is installed."""
    code = ("import sys, contract_lib.pytest_plugin; "
            "print(sorted({'contract_lib.runs.harness', 'pandas', 'numpy', 'sglang', 'torch'} "
            "& set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_the_fixture_comes_from_the_installed_entry_point(tmp_path):
    """Three pytest start-ups (seconds each): not in the fast tier."""
    listed = _pytest("--fixtures", cwd=tmp_path)
    assert re.search(r"^contract_run -- .*contract_lib/pytest_plugin\.py", listed.stdout, re.M), (
        listed.stdout[-2000:])
    assert "contract_run(workload, loop=\"mlx\", patch=None" in listed.stdout
    without = _pytest("--fixtures", "-p", "no:contract_lib", cwd=tmp_path)
    assert without.returncode == 0 and "contract_run" not in without.stdout
    assert "@pytest.mark.contract:" in _pytest("--markers", cwd=tmp_path).stdout


def test_a_known_upstream_bug_is_an_xfail_and_strict_makes_it_a_failure(tmp_path):
    """The torch loops' own HRRN clock (processed-tokens-counter, reproduced exactly):
    xfail naming the bug, as ``check`` exits 0; ``--contract-strict-known`` fails it."""
    (tmp_path / "test_known.py").write_text(
        "from contract_lib.contract import assert_contract\n\n"
        "def test_normal(contract_run):\n"
        "    assert_contract(contract_run('single-decode', loop='normal'))\n")
    proc = _pytest("test_known.py", "-rA", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert re.search(r"^XFAIL test_known.py::test_normal - known upstream: "
                     r"processed-tokens-counter", proc.stdout, re.M), proc.stdout[-3000:]
    strict = _pytest("test_known.py", "-rA", "--contract-strict-known", cwd=tmp_path)
    assert strict.returncode == 1
    assert "KnownUpstreamBug: known upstream: processed-tokens-counter" in strict.stdout


def test_the_sglang_tree_test_passes_against_the_installed_sglang(tmp_path):
    """Torch loops green on every shipped workload; the MLX loop's known violations are
    strict xfails; with the candidate fixes green, except mixed-chunk's clause 4."""
    proc, outcomes = _run_sglang_test(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    torch = _ids(outcomes, "test_torch_loops_keep_the_per_step_contract")
    workloads = {case.rsplit("-", 1)[0] for case in torch}
    assert "two-turn" in workloads and "mixed-chunk" in workloads
    assert torch == {f"{w}-{loop}": "PASSED" for w in workloads
                     for loop in ("normal", "overlap")}
    assert _ids(outcomes, "test_mlx_overlap_loop_keeps_the_per_step_contract") == {
        w: "XFAIL" for w in workloads}
    fixed = _ids(outcomes, "test_mlx_overlap_loop_with_the_candidate_fixes")
    assert fixed == {w: "XFAIL" if w == "mixed-chunk" else "PASSED" for w in workloads}
    assert "contract_lib runs" not in proc.stdout  # only failed tests get the section


def test_a_broken_loop_fails_the_sglang_tree_test_and_names_the_frames(tmp_path):
    """A loop that skips the relay publish (a breaking patch added to every run) fails
    the torch cases with clause 4, and each failure names its run's saved frames."""
    proc, outcomes = _run_sglang_test(
        tmp_path, "-k", "torch_loops and two-turn", CONTRACT_LIB_EXTRA_PATCH="skip-relay-publish")
    assert proc.returncode == 1
    assert set(outcomes.values()) == {"FAILED"} and len(outcomes) == 2
    assert re.search(r"ContractViolation: clause 4 \(relays published[^)]*\): field "
                     r"output_tokens_buf at step \d+", proc.stdout)
    sections = re.findall(r"contract_lib runs -+\n(.*?): (\w+); frames: (\S+)", proc.stdout)
    assert len(sections) == 2
    for title, status, path in sections:
        assert title.startswith("two-turn on ") and "patch skip-relay-publish" in title
        assert status == "finished" and Path(path).is_file()


def test_a_fixed_mlx_loop_turns_the_strict_xfails_red(tmp_path):
    """When SGLang's loop is fixed (here: the candidate fixes applied to every run), the
    unpatched MLX cases pass, and ``strict`` reports that as a failure: the change that
    fixes the loop must remove the marker."""
    proc, outcomes = _run_sglang_test(
        tmp_path, "-k", "mlx_overlap_loop_keeps and (two-turn or mixed-chunk)",
        CONTRACT_LIB_EXTRA_PATCH=CANDIDATE_FIXES)
    assert proc.returncode == 1
    assert outcomes == {
        "test_mlx_overlap_loop_keeps_the_per_step_contract[two-turn]": "FAILED",
        "test_mlx_overlap_loop_keeps_the_per_step_contract[mixed-chunk]": "XFAIL"}
    assert "[XPASS(strict)]" in proc.stdout


def test_sglang_ci_finds_and_runs_the_file_as_it_runs_its_own(tmp_path):
    """SGLang's CI parses each file for its registrations (``ut_parse_one_file``) and
    runs it as ``python3 FILE``: both suites are found, and the main entry runs the
    file's tests through pytest (the plugin included) with a passing exit code."""
    parse = ("import sglang_import_shims; "
             "from sglang.test.ci.ci_register import ut_parse_one_file; "
             f"regs, main = ut_parse_one_file({str(SGLANG_TEST)!r}); "
             "print(main, sorted((r.backend.name, r.effective_suite) for r in regs))")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    parsed = subprocess.run([sys.executable, "-c", parse], capture_output=True, text=True,
                            env=env, check=True).stdout
    assert parsed.strip() == ("True [('CPU', 'base-a-test-cpu'), "
                              "('MLX', 'stage-a-unit-test-mlx')]")
    as_script = ("import runpy, sglang_import_shims; "
                 f"runpy.run_path({str(SGLANG_TEST)!r}, run_name='__main__')")
    ran = subprocess.run([sys.executable, "-c", as_script], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=900)
    assert ran.returncode == 0, ran.stdout[-3000:]
    assert re.search(r"\b\d+ passed, \d+ xfailed\b", ran.stdout), ran.stdout[-1000:]
