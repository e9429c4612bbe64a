"""A report's regression test, in SGLang's test layout, and its run with and without a fix.

The test follows ``contrib/sglang/test/registered/unit/hardware_backend/mlx/
test_per_step_contract.py``: it registers its CI suites, skips without contract_lib, runs
the report's workload (inline TOML) through the loop with the plugin's ``contract_run``
fixture and asserts the contract. When the fixed run passes every clause it is
``assert_contract(..., strict_known=True)``; otherwise (the loop still breaks other
clauses) it pins the reported clause alone. :func:`run_test` runs it with pytest in a
fresh folder, with the fix given as ``--contract-diff`` (the plugin applies it to every
run's SGLang), as a maintainer runs it in a checkout with and without the fix applied.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from contract_lib.contract import CLAUSES

TEST_TIMEOUT_S = 900
# pytest in a process that can import SGLang here: the import shims every run's process
# installs (SGLang's Triton stand-in on a machine without triton; nothing on Apple Silicon).
_BOOT = ("import sys; from contract_lib.child.shims import install_import_shims; "
         "install_import_shims(); import pytest; sys.exit(pytest.main(sys.argv[1:]))")


@dataclasses.dataclass(frozen=True)
class PytestRun:
    """One pytest run of the test: its exit code and what it said."""

    code: int
    summary: str  # e.g. "1 failed"
    failure: str  # the failed test's short summary (empty when it passed)


def destination(loop_is_mlx: bool, slug: str) -> str:
    """Where the test goes in SGLang's repository."""
    folder = "hardware_backend/mlx" if loop_is_mlx else "managers"
    return f"test/registered/unit/{folder}/test_{slug}.py"


def render_test(*, title: str, slug: str, loop: str, mlx: bool, clause: int, workload: str,
              patch: str | None, failure_line: str, whole: bool, others: list[int],
              fix_name: str | None) -> str:
    """The test module's source."""
    name = re.sub(r"\W+", "_", CLAUSES[clause]).strip("_")
    registrations = ['register_cpu_ci(est_time=60, suite="base-a-test-cpu")']
    imports = "register_cpu_ci"
    if mlx:
        registrations.append('register_mlx_ci(est_time=60, suite="stage-a-unit-test-mlx")')
        imports = "register_cpu_ci, register_mlx_ci"
    patch_arg = f", patch={patch!r}" if patch else ""
    fixed = (f"It passes with the fix ({fix_name})." if fix_name else
             "No fix is proposed yet: it fails until one lands.")
    if whole:
        body = "    assert_contract(frames, strict_known=True)\n"
        names = "assert_contract"
    else:
        other = ", ".join(str(n) for n in others)
        body = (f"    # The loop still breaks clause{'s' if len(others) > 1 else ''} {other} "
                "(other reports): only this one is pinned here.\n"
                if others else "") + (
                "    report = check(frames, strict_known=True)\n"
                "    assert frames.status == \"finished\", report.verdict().line()\n"
                f"    result = report.clauses[{clause}]\n"
                "    assert result.status == \"holds\", (\n"
                "        violation_message(result.first()) if result.first() else result.note)\n")
        names = "check, violation_message"
    return f'''"""{title}

Clause {clause} ({CLAUSES[clause]}) of the per-step contract (RFC #32833 and its
extensions), checked with contract_lib: it drives the workload below through this
SGLang's real scheduler loop ({loop}), replacing only the model forward, records the
scheduler's state at every step boundary and checks the clause there. On SGLang as
released it fails with:

    {failure_line}

{fixed} Without contract_lib this module is skipped.

Run: `pytest {destination(mlx, slug)}` (needs `pip install -e <contract_lib checkout>`).
"""

import sys

import pytest

from sglang.test.ci.ci_register import {imports}

{chr(10).join(registrations)}

contract_lib = pytest.importorskip(
    "contract_lib", reason="contract_lib (the per-step contract checker) is not installed")

from contract_lib.contract import {names}  # noqa: E402

WORKLOAD = r"""
{workload.rstrip()}
"""


def test_{loop}_loop_keeps_clause_{clause}_{name}(contract_run, tmp_path):
    workload = tmp_path / "workload.toml"
    workload.write_text(WORKLOAD)
    frames = contract_run(workload, loop="{loop}"{patch_arg})
{body}

if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
'''


def run_test(test: Path, destination_path: str, diff: Path | None = None) -> PytestRun:
    """Run ``test`` with pytest from a fresh folder (at its place in SGLang's layout,
    no configuration of this checkout), with ``diff`` applied to every run's SGLang."""
    with tempfile.TemporaryDirectory(prefix="contract_lib-test-") as tmp:
        target = Path(tmp) / destination_path
        target.parent.mkdir(parents=True)
        shutil.copy(test, target)
        command = [sys.executable, "-c", _BOOT, "-p", "no:cacheprovider", "-q", "-rf",
                   str(target.relative_to(tmp))]
        if diff is not None:
            command += ["--contract-diff", str(Path(diff).resolve())]
        done = subprocess.run(command, cwd=tmp, capture_output=True, text=True,
                              timeout=TEST_TIMEOUT_S, env={**os.environ, "COLUMNS": "1000"})
    lines = done.stdout.splitlines()
    counts = re.findall(r"(\d+ (?:passed|failed|xfailed|xpassed|skipped|errors?))",
                        lines[-1] if lines else "")
    failure = next((line for line in lines if line.startswith(("FAILED ", "ERROR "))), "")
    return PytestRun(done.returncode, ", ".join(counts) or "no summary", failure)
