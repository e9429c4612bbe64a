"""[MLX] Chained decode skips prepare_for_decode: seq_lens and kv_committed_len lag the KV computed, so radix insertion loses the chained tokens

Clause 2 (counters advanced) of the per-step contract (RFC #32833 and its
extensions), checked with contract_lib: it drives the workload below through this
SGLang's real scheduler loop (mlx), replacing only the model forward, records the
scheduler's state at every step boundary and checks the clause there. On SGLang as
released it fails with:

    clause 2 (counters advanced): field seq_lens at step 3, request a on mlx: expected 3, got 2. seq_lens lags the 3 positions the forward computed by 1; radix insertion and release stop at the committed bound

It passes with the fix (fix.diff). Without contract_lib this module is skipped.

Run: `pytest test/registered/unit/hardware_backend/mlx/test_chained_accounting.py` (needs `pip install -e <contract_lib checkout>`).
"""

import sys

import pytest

from sglang.test.ci.ci_register import register_cpu_ci, register_mlx_ci

register_cpu_ci(est_time=60, suite="base-a-test-cpu")
register_mlx_ci(est_time=60, suite="stage-a-unit-test-mlx")

contract_lib = pytest.importorskip(
    "contract_lib", reason="contract_lib (the per-step contract checker) is not installed")

from contract_lib.contract import check, violation_message  # noqa: E402

WORKLOAD = r"""
# The smallest workload violating clause 2 that the search found from two-turn's loop and patches:
# python -m contract_lib search --loop mlx --clause 2 --strict-known --no-database --budget 100 --seed 0: 2 examples tried, 18 workloads run in all
name = "two-turn.minimal"
max_steps = 216

[[requests]]
rid = "a"
prompt = [100]
max_new_tokens = 3
arrival = 0
"""


def test_mlx_loop_keeps_clause_2_counters_advanced(contract_run, tmp_path):
    workload = tmp_path / "workload.toml"
    workload.write_text(WORKLOAD)
    frames = contract_run(workload, loop="mlx")
    # The loop still breaks clauses 5, 6, 7 (other reports): only this one is pinned here.
    report = check(frames, strict_known=True)
    assert frames.status == "finished", report.verdict().line()
    result = report.clauses[2]
    assert result.status == "holds", (
        violation_message(result.first()) if result.first() else result.note)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
