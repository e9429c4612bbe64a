"""Measure what one ``check`` costs, on the saved history (``data/history``,
``data/history-sweep``) and on the fast tier's fixture runs (``tests/fixtures``): three
passes over each set after a warm-up, then one more pass timing each clause.

    .venv/bin/python benchmarks/check_cost.py

Prints, per set, the runs, each pass's seconds, the milliseconds per check of the best
pass, and the milliseconds per check each clause takes. Run it beside an older checkout
(``PYTHONPATH=<checkout>`` from that folder) for a ratio.
"""

from __future__ import annotations

import collections
import time

from contract_lib.campaigns.saved_history import load_file, saved_files
from contract_lib.contract import check, report
from contract_lib.frames import Frames
from contract_lib.paths import PROJECT_ROOT, SWEEP_DIR

FIXTURES = PROJECT_ROOT / "tests" / "fixtures"  # of the checkout contract_lib comes from


def measure(label: str, runs: list[Frames]) -> None:
    if not runs:
        raise SystemExit(f"{label}: no runs to check (is this a checkout with its data?)")
    for frames in runs[:20]:  # imports and first-call set-up
        check(frames)
    passes = []
    for _ in range(3):
        start = time.perf_counter()
        for frames in runs:
            check(frames)
        passes.append(time.perf_counter() - start)
    print(f"{label}: {len(runs)} runs; seconds per pass: "
          f"{', '.join(f'{s:.1f}' for s in passes)}; "
          f"{min(passes) / len(runs) * 1000:.1f} ms per check (best pass)")
    print("  by clause (ms per check):", ", ".join(
        f"{number}: {seconds / len(runs) * 1000:.1f}"
        for number, seconds in sorted(_by_clause(runs).items())))


def _by_clause(runs: list[Frames]) -> dict[int, float]:
    """Seconds each clause took over one pass (``report.evaluate`` timed, then restored)."""
    spent: collections.Counter = collections.Counter()
    evaluate = report.evaluate

    def timed(number, check_, frames):
        start = time.perf_counter()
        try:
            return evaluate(number, check_, frames)
        finally:
            spent[number] += time.perf_counter() - start

    report.evaluate = timed
    try:
        for frames in runs:
            check(frames)
    finally:
        report.evaluate = evaluate
    return spent


def main() -> None:
    measure("saved history", [load_file(path) for path in
                              saved_files(SWEEP_DIR) + saved_files()])
    measure("fast-tier fixtures", [Frames.load(path) for path in
                                   sorted(FIXTURES.glob("*.json"))])


if __name__ == "__main__":
    main()
