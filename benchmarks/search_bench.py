"""Measure ``search``: each built-in bug found and shrunk (budget, examples, runs, minimal
size against the smallest shipped workload showing the same clause), the search's own
time per example, and what running independent seeds side by side buys.

    .venv/bin/python benchmarks/search_bench.py > benchmarks/search.md

Writes each minimal workload to data/workloads/found/. Timed campaigns run with the frame
cache off; the per-bug table uses the cache (its counts do not depend on it).
"""

from __future__ import annotations

import time

import contract_lib
from contract_lib.campaigns.search import (
    Campaign,
    search,
    search_many,
    workload_size,
    write_found,
)
from contract_lib.contract import check
from contract_lib.workloads import load_workload, workload_names

BUDGET = 100
# (loop, patch, clause): every built-in patch that breaks a clause, the MLX loop as
# shipped for its clauses, and sglang-omni's loop (clause 5 masked, docs/omni.md).
BUGS = [
    ("mlx", None, 1), ("mlx", None, 2), ("mlx", None, 4), ("mlx", None, 5),
    ("mlx", "no-forward-ct", 3), ("mlx", "no-launch-ts", 3),
    ("mlx", "unclamped-sync", 1), ("overlap", "skip-relay-publish", 4),
    ("normal", "skip-relay-publish", 4), ("omni", None, 5),
]


def size_text(workload) -> str:
    size = workload_size(workload)
    return (f"{size['requests']} req, {size['prompt_tokens']}+{size['new_tokens']} tok, "
            f"{size['server_args']} args")


def smallest_shipped(loop: str, patch: str | None, clause: int) -> str:
    """The smallest shipped workload whose run violates ``clause``."""
    hits = []
    for name in workload_names():
        report = check(contract_lib.run(name, loop, patch=patch))
        if not report.clauses[clause].violations.empty:
            workload = load_workload(name)
            hits.append((tuple(workload_size(workload).values()), name, workload))
    if not hits:
        return "none"
    _, name, workload = min(hits)
    return f"`{name}` ({size_text(workload)})"


def main() -> None:
    print("# `search`: measured\n")
    print(f"Seed 0, budget {BUDGET} examples, shrink budget 150 runs, no example database.\n")
    print("| loop | patch | clause | examples to find | runs (find + shrink) | minimal "
          "workload | smallest shipped workload with the clause |")
    print("|---|---|---|---|---|---|---|")
    for loop, patch, clause in BUGS:
        campaign = search(Campaign(loop, patch, clause, BUDGET, seed=0, database=False))
        if campaign.found is None:
            print(f"| {loop} | {patch or '-'} | {clause} | not found | {campaign.runs} | - | "
                  f"{smallest_shipped(loop, patch, clause)} |")
            continue
        write_found(campaign)
        workload, finding = campaign.found
        print(f"| {loop} | {patch or '-'} | {clause} ({finding.field}) | {campaign.examples} "
              f"| {campaign.runs} | `found/{campaign.slug}` ({size_text(workload)}) | "
              f"{smallest_shipped(loop, patch, clause)} |")

    print("\n## Time per example and independent seeds (frame cache off)\n")
    for loop in ("normal", "overlap"):
        start = time.perf_counter()
        done = search(Campaign(loop, budget=20, seed=0, database=False, cache=False))
        took = time.perf_counter() - start
        print(f"- reference campaign `--loop {loop}`, 20 examples: {took:.1f} s, "
              f"{took / done.runs:.2f} s per example ("
              + ("2 runs each: the loop and its torch reference, concurrently)"
                 if loop != "normal" else "1 run each: normal is its own reference)"))
    timings = {}
    for seeds in (1, 2):
        start = time.perf_counter()
        search_many([Campaign("normal", budget=10, seed=s, database=False, cache=False)
                     for s in range(seeds)])
        timings[seeds] = time.perf_counter() - start
    print(f"- `--seeds 1` (10 examples): {timings[1]:.1f} s; `--seeds 2` (2 x 10 examples, "
          f"side by side): {timings[2]:.1f} s, i.e. {2 * timings[1] / timings[2]:.2f}x the "
          "examples per second")


if __name__ == "__main__":
    main()
