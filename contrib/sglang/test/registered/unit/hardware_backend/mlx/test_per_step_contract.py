"""The per-step contract of RFC #32833 on the real scheduler loops, checked with contract_lib.

`Scheduler.run_batch` runs the torch forward and the per-step bookkeeping that
backend-neutral readers rely on (radix cache, watchdog, profiler, idle predicate);
`event_loop_overlap_mlx` replaces the forward and must keep that bookkeeping. The RFC
writes it down as five clauses that hold at every step boundary: 1 slots recorded in
`req_to_token`, 2 counters advanced (`kv_committed_len`, `seq_lens`, ...), 3 step
stamps (`forward_ct`, `forward_iter`, `launch_ts`), 4 relays published
(`output_tokens_buf`), 5 the idle predicate sees in-flight work.

contract_lib drives short workloads through this SGLang's real `Scheduler` and its real
loops (`event_loop_normal`, `event_loop_overlap`, `event_loop_overlap_mlx`), replacing
only the model forward (no weights, no server, no accelerator: MLX runs on its CPU
backend), records the scheduler's own state at every step boundary and checks the
clauses there. Its pytest plugin (installed with it) provides the `contract_run`
fixture; without contract_lib this module is skipped. A failure names the clause, the
field, the step and the request, e.g. `clause 1 (slots recorded): field req_to_token at
step 3, request a on mlx: ...`, and the test report names the saved frames.

The MLX loop of today's releases breaks clauses 1, 2 and 5, so its cases are strict
xfails naming the issues: the suite stays green and lists them, and the change that
fixes the loop turns them into XPASS, which `strict` makes a failure until the marker is
removed. The same workloads with contract_lib's candidate fixes applied
(`fix-chained-accounting`, `fix-idle-predicate`; source patches of the loop, in
contract_lib's `patches.py`) show what green looks like; drop those cases once the
fixes are merged (the patches then no longer apply).

Run: `pytest test/registered/unit/hardware_backend/mlx/test_per_step_contract.py -rx`
(needs `pip install -e <contract_lib checkout>`).
"""

import sys

import pytest

from sglang.test.ci.ci_register import register_cpu_ci, register_mlx_ci

register_cpu_ci(est_time=120, suite="base-a-test-cpu")
register_mlx_ci(est_time=120, suite="stage-a-unit-test-mlx")

contract_lib = pytest.importorskip(
    "contract_lib", reason="contract_lib (the per-step contract checker) is not installed")

from contract_lib.contract import ContractViolation, assert_contract  # noqa: E402

# contract_lib's shipped workloads whose outcome on each loop is known (see its README).
WORKLOADS = ["single-decode", "two-turn", "staggered", "finish-mid-chain", "mixed-chunk",
             "memory-pressure"]
CANDIDATE_FIXES = "fix-chained-accounting+fix-idle-predicate"

# What the MLX loop breaks today, as strict expected failures (a crash, a vacuous run or
# another exception is still an error: only a violated clause is expected).
CHAINED_DECODE = pytest.mark.xfail(
    raises=ContractViolation, strict=True,
    reason="chained decode records no req_to_token slot and does not advance "
           "kv_committed_len / seq_lens (clauses 1, 2: #30093, #33874); is_fully_idle "
           "cannot see the loop's pending result (clause 5: #32934)")
MIXED_CHUNK_RELAY = pytest.mark.xfail(
    raises=ContractViolation, strict=True,
    reason="a mixed-chunk batch reads output_tokens_buf rows the MLX loop never "
           "published (clause 4: #32591)")


def _mixed_chunk(workload: str) -> bool:
    return bool(contract_lib.load_workload(workload).server_args.get("enable_mixed_chunk"))


@pytest.mark.parametrize("loop", ["normal", "overlap"])
@pytest.mark.parametrize("workload", WORKLOADS)
def test_torch_loops_keep_the_per_step_contract(contract_run, workload, loop):
    assert_contract(contract_run(workload, loop=loop), clauses="rfc")


@pytest.mark.parametrize("workload", [pytest.param(w, marks=CHAINED_DECODE) for w in WORKLOADS])
def test_mlx_overlap_loop_keeps_the_per_step_contract(contract_run, workload):
    assert_contract(contract_run(workload, loop="mlx"), clauses="rfc")


@pytest.mark.parametrize("workload", [
    pytest.param(w, marks=MIXED_CHUNK_RELAY) if _mixed_chunk(w) else w for w in WORKLOADS])
def test_mlx_overlap_loop_with_the_candidate_fixes(contract_run, workload):
    assert_contract(contract_run(workload, loop="mlx", patch=CANDIDATE_FIXES), clauses="rfc")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-rx"]))
