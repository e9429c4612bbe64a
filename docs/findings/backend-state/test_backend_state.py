"""[MLX] MlxTpModelWorker keeps released requests' state (KV caches, token lists) until the next decode launch: never under prefill-only traffic, never at idle

Clause 7 (request state retired) of the per-step contract (RFC #32833 and its
extensions), checked with contract_lib: it drives the workload below through this
SGLang's real scheduler loop (mlx), replacing only the model forward, records the
scheduler's state at every step boundary and checks the clause there. On SGLang as
released it fails with:

    clause 7 (request state retired): field tp_worker._mlx_active_rids at step 2, request a on mlx: expected no state (released), got tp_worker._mlx_active_rids['a']. kept while the loop is idle (released, seen at step 2): a re-admitted id routes as a continuation, a pool flush syncs through the stale row, and the cache's arrays stay allocated

It passes with the fix (fix.diff). Without contract_lib this module is skipped.

Run: `pytest test/registered/unit/hardware_backend/mlx/test_backend_state.py` (needs `pip install -e <contract_lib checkout>`).
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
# The workload of this report: data/workloads/findings/prefill-only.toml
name = "prefill-only"
max_steps = 80
description = "Prefill-only traffic (scoring, classification, time-to-first-token benchmarks): ten\nrequests of one new token each, one arriving every two loop iterations, so no request\never joins a decode batch. The MLX worker drops a request's state only when a decode\nlaunch no longer carries it; here no decode launch ever comes."

[[requests]]
rid = "a"
prompt = [20, 21, 22, 23, 24, 25, 26, 27]
max_new_tokens = 1
arrival = 0

[[requests]]
rid = "b"
prompt = [32, 33, 34, 35, 36, 37, 38, 39]
max_new_tokens = 1
arrival = 2

[[requests]]
rid = "c"
prompt = [44, 45, 46, 47, 48, 49, 50, 51]
max_new_tokens = 1
arrival = 4

[[requests]]
rid = "d"
prompt = [56, 57, 58, 59, 60, 61, 62, 63]
max_new_tokens = 1
arrival = 6

[[requests]]
rid = "e"
prompt = [68, 69, 70, 71, 72, 73, 74, 75]
max_new_tokens = 1
arrival = 8

[[requests]]
rid = "f"
prompt = [80, 81, 82, 83, 84, 85, 86, 87]
max_new_tokens = 1
arrival = 10

[[requests]]
rid = "g"
prompt = [92, 93, 94, 95, 96, 97, 98, 99]
max_new_tokens = 1
arrival = 12

[[requests]]
rid = "h"
prompt = [104, 105, 106, 107, 108, 109, 110, 111]
max_new_tokens = 1
arrival = 14

[[requests]]
rid = "i"
prompt = [116, 117, 118, 119, 120, 121, 122, 123]
max_new_tokens = 1
arrival = 16

[[requests]]
rid = "j"
prompt = [128, 129, 130, 131, 132, 133, 134, 135]
max_new_tokens = 1
arrival = 18
"""


def test_mlx_loop_keeps_clause_7_request_state_retired(contract_run, tmp_path):
    workload = tmp_path / "workload.toml"
    workload.write_text(WORKLOAD)
    frames = contract_run(workload, loop="mlx")
    # The loop still breaks clauses 5, 6 (other reports): only this one is pinned here.
    report = check(frames, strict_known=True)
    assert frames.status == "finished", report.verdict().line()
    result = report.clauses[7]
    assert result.status == "holds", (
        violation_message(result.first()) if result.first() else result.note)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
