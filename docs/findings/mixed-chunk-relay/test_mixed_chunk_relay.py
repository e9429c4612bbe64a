"""[MLX] A mixed-chunk batch reads output_tokens_buf rows the MLX loop never published (--enable-mixed-chunk)

Clause 4 (relays published or provably unread) of the per-step contract (RFC #32833 and its
extensions), checked with contract_lib: it drives the workload below through this
SGLang's real scheduler loop (mlx), replacing only the model forward, records the
scheduler's state at every step boundary and checks the clause there. On SGLang as
released it fails with:

    clause 4 (relays published or provably unread): field output_tokens_buf at step 1 (launch 2), request b on mlx: expected the token last published for this request, got -1 (never written). row 8 (last published: nothing) read unpublished; the value reached batch.input_ids of a mixed batch (torch.cat with the prefill ids; on MPS this is the #32591 segfault); the MLX decode lane then takes its token from the runner, so the model discarded the value

It passes with the fix (fix.diff). Without contract_lib this module is skipped.

Run: `pytest test/registered/unit/hardware_backend/mlx/test_mixed_chunk_relay.py` (needs `pip install -e <contract_lib checkout>`).
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
# The smallest workload violating clause 4 that the search found from mixed-chunk's loop and patches:
# python -m contract_lib search --loop mlx --clause 4 --strict-known --no-database --budget 100 --seed 0: 6 examples tried, 90 workloads run in all
name = "mixed-chunk.minimal"
max_steps = 236

[server_args]
enable_mixed_chunk = true

[[requests]]
rid = "a"
prompt = [100]
max_new_tokens = 1
arrival = 1

[[requests]]
rid = "b"
prompt = [148]
max_new_tokens = 2
arrival = 0
"""


def test_mlx_loop_keeps_clause_4_relays_published_or_provably_unread(contract_run, tmp_path):
    workload = tmp_path / "workload.toml"
    workload.write_text(WORKLOAD)
    frames = contract_run(workload, loop="mlx")
    # The loop still breaks clauses 5, 6, 7 (other reports): only this one is pinned here.
    report = check(frames, strict_known=True)
    assert frames.status == "finished", report.verdict().line()
    result = report.clauses[4]
    assert result.status == "holds", (
        violation_message(result.first()) if result.first() else result.note)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
