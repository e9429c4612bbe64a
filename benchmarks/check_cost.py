"""Measure what one ``check`` costs: every saved run of the history (``data/history``,
``data/history-sweep``) checked in a row, three passes, after a warm-up.

    .venv/bin/python benchmarks/check_cost.py

Prints the runs, each pass's seconds and the milliseconds per check of the best pass.
Run it beside an older checkout (``PYTHONPATH=<checkout>`` from that folder) for a ratio.
"""

from __future__ import annotations

import time

from contract_lib.campaigns.saved_history import load_file, saved_files
from contract_lib.contract import check
from contract_lib.paths import SWEEP_DIR


def main() -> None:
    runs = [load_file(path) for path in saved_files(SWEEP_DIR) + saved_files()]
    for frames in runs[:20]:  # imports and first-call set-up
        check(frames)
    passes = []
    for _ in range(3):
        start = time.perf_counter()
        for frames in runs:
            check(frames)
        passes.append(time.perf_counter() - start)
    print(f"{len(runs)} runs; seconds per pass: {', '.join(f'{s:.1f}' for s in passes)}; "
          f"{min(passes) / len(runs) * 1000:.1f} ms per check (best pass)")


if __name__ == "__main__":
    main()
