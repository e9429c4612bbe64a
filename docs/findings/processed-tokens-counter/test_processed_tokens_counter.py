"""run_batch re-adds the last prefill to processed_tokens_counter at every decode step (HRRN clock runs ahead)

Clause 6 (scheduling clocks advanced) of the per-step contract (RFC #32833 and its
extensions), checked with contract_lib: it drives the workload below through this
SGLang's real scheduler loop (normal), replacing only the model forward, records the
scheduler's state at every step boundary and checks the clause there. On SGLang as
released it fails with:

    clause 6 (scheduling clocks advanced): field processed_tokens_counter at step 2 (launch 2) on normal: expected +0, got +1. the HRRN clock ran ahead by 1 tokens the decode launch(es) of step 1 did not prefill; calc_priority and every new arrival's snapshot read the clock

It passes with the fix (fix.diff). Without contract_lib this module is skipped.

Run: `pytest test/registered/unit/managers/test_processed_tokens_counter.py` (needs `pip install -e <contract_lib checkout>`).
"""

import sys

import pytest

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=60, suite="base-a-test-cpu")

contract_lib = pytest.importorskip(
    "contract_lib", reason="contract_lib (the per-step contract checker) is not installed")

from contract_lib.contract import assert_contract  # noqa: E402

WORKLOAD = r"""
# The smallest workload violating clause 6 that the search found from two-turn's loop and patches:
# python -m contract_lib search --loop normal --clause 6 --strict-known --no-database --budget 100 --seed 0: 2 examples tried, 17 workloads run in all
name = "two-turn.minimal"
max_steps = 212

[[requests]]
rid = "a"
prompt = [100]
max_new_tokens = 2
arrival = 0
"""


def test_normal_loop_keeps_clause_6_scheduling_clocks_advanced(contract_run, tmp_path):
    workload = tmp_path / "workload.toml"
    workload.write_text(WORKLOAD)
    frames = contract_run(workload, loop="normal")
    assert_contract(frames, strict_known=True)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
