"""Measure the fast tier as a newcomer runs it (the README's ``pytest -m fast tests -n 2``,
and in one process): wall time and the time pytest reports, over several runs of each,
with the machine and its load.

    .venv/bin/python benchmarks/fast_tier.py [--runs 3]

Writes ``benchmarks/fast-tier.json``; the README quotes it (``scripts/check-docs``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "benchmarks" / "fast-tier.json"


def machine() -> str:
    """Platform, cores and CPU model, as the result's label."""
    cpuinfo = Path("/proc/cpuinfo")
    model = next((line.split(":", 1)[1].strip() for line in
                  (cpuinfo.read_text().splitlines() if cpuinfo.exists() else [])
                  if line.startswith("model name")), platform.processor() or "unknown CPU")
    return (f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores ({model}), "
            f"Python {platform.python_version()}")


# The README's command (two xdist workers), and the same tier in one process.
WORKERS = ["-n", "2"]


def one_run(workers: list[str]) -> dict:
    load = os.getloadavg()[0]
    start = time.monotonic()
    ran = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "fast", "tests",
                          *workers], cwd=ROOT, capture_output=True, text=True, check=False)
    wall = time.monotonic() - start
    summary = re.search(r"(\d+) passed.* in ([\d.]+)s", ran.stdout.splitlines()[-1])
    if ran.returncode != 0 or not summary:
        raise SystemExit(f"the fast tier failed (exit {ran.returncode}):\n{ran.stdout[-2000:]}")
    return {"tests": int(summary.group(1)), "pytest_s": float(summary.group(2)),
            "wall_s": round(wall, 1), "load_before": round(load, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    count = parser.parse_args().runs
    runs = [one_run(WORKERS) for _ in range(count)]
    single = [one_run([]) for _ in range(count)]
    RESULT.write_text(json.dumps({
        "tests": runs[-1]["tests"], "date": datetime.date.today().isoformat(),
        "machine": machine(), "command": " ".join(["pytest -m fast tests", *WORKERS]),
        "runs": runs, "one_process_runs": single}, indent=2) + "\n")
    print(RESULT.read_text())


if __name__ == "__main__":
    main()
