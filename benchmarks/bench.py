"""Benchmark: what a run costs, cold, warm and cached; capture overhead; checker speed;
notebook and test-suite times. Prints medians; ``--write`` also writes RESULTS.md.

    .venv/bin/python benchmarks/bench.py [--repeat 5] [--quick] [--write]

Targets (issue "make a run cost its loop"): warm run <= 1.5 s for two-turn on any loop,
cached run <= 50 ms, capture overhead <= 1.3x, checker >= 1e6 frame rows/s, the notebook
suite <= 90 s under pytest --nbval, the README test command <= 5 min after set-up.
Nothing here is asserted: these are measurements, not tests.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

import contract_lib
from contract_lib import cache
from contract_lib.contract import check
from contract_lib.frames import Frames

ROOT = Path(__file__).resolve().parent.parent


def median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def run_costs(repeat: int) -> list[dict]:
    rows = []
    cold = [contract_lib.run("two-turn", "mlx", warm=False, cache=False)
            for _ in range(max(1, repeat // 2))]
    timing = pd.DataFrame([f.meta["timing"] for f in cold]).median()
    rows.append({"measure": "cold run, two-turn/mlx: total wall", "value": median_time(
        lambda: contract_lib.run("two-turn", "mlx", warm=False, cache=False), 2), "unit": "s"})
    for part in ("import_s", "build_s", "loop_s"):
        rows.append({"measure": f"cold run, in the child: {part[:-2]}", "value": timing[part],
                     "unit": "s"})
    for loop in contract_lib.LOOPS:
        contract_lib.run("two-turn", loop, cache=False)  # start the warm servers
        rows.append({"measure": f"warm run, two-turn/{loop}", "unit": "s", "value": median_time(
            lambda: contract_lib.run("two-turn", loop, cache=False), repeat)})
    with tempfile.TemporaryDirectory() as directory:
        os.environ["CONTRACT_LIB_CACHE_DIR"] = directory
        contract_lib.run("two-turn", "mlx")
        rows.append({"measure": "cached run, two-turn/mlx", "unit": "s", "value": median_time(
            lambda: contract_lib.run("two-turn", "mlx"), repeat)})
        del os.environ["CONTRACT_LIB_CACHE_DIR"]
    return rows


def capture_overhead(repeat: int) -> list[dict]:
    rows = []
    for loop in contract_lib.LOOPS:
        loops = {True: [], False: []}
        for _ in range(repeat):
            for capture in (True, False):
                frames = contract_lib.run("two-turn", loop, cache=False, capture=capture)
                loops[capture].append(frames.meta["timing"]["loop_s"])
        with_, without = statistics.median(loops[True]), statistics.median(loops[False])
        rows.append({"measure": f"capture overhead, two-turn/{loop} "
                                f"({with_ * 1e3:.1f} ms vs {without * 1e3:.1f} ms loop)",
                     "value": with_ / without, "unit": "x"})
    return rows


def synthetic_frames(base: Frames, copies: int) -> Frames:
    """``copies`` back-to-back replicas of a run, renumbered into one long run."""
    steps_per = int(base.steps["step"].max()) + 1
    launches_per = int(base.launches["launch"].max())
    ct_per = int(base.steps["forward_ct"].max())
    tables = {}
    for name, table in base.tables.items():
        parts = []
        for i in range(copies):
            part = table.copy()
            for column in ("step", "processed_step"):
                if column in part:
                    part[column] = part[column] + i * steps_per
            if "launch" in part:
                part["launch"] = part["launch"] + i * launches_per
            for column in ("forward_ct", "forward_iter", "processed_forward_iter"):
                if column in part:
                    part[column] = part[column] + i * ct_per
            if "rid" in part and name != "steps":
                part["rid"] = part["rid"] + f"#{i}"
            for column in ("launch_ts", "processed_launch_ts", "wall_time"):
                if column in part:
                    part[column] = pd.to_numeric(part[column]) + i * 1000.0
            parts.append(part)
        tables[name] = pd.concat(parts, ignore_index=True)
    return Frames(tables=tables, meta=dict(base.meta))


def checker_throughput(repeat: int) -> list[dict]:
    base = contract_lib.run("two-turn", "mlx")
    per_copy = sum(len(t) for t in base.tables.values())
    frames = synthetic_frames(base, max(1, 1_000_000 // per_copy))
    total = sum(len(t) for t in frames.tables.values())
    seconds = median_time(lambda: check(frames), max(1, repeat // 2))
    violations = len(check(frames).violations)
    return [{"measure": f"checker on {total:,} frame rows ({violations:,} violations)",
             "value": total / seconds, "unit": "rows/s"}]


def _pytest_seconds(target: str | None, env: dict[str, str] | None = None) -> float:
    """Wall time of ``pytest -q [target]`` in the project (None: the whole suite)."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pytest", "-q", *([target] if target else [])],
                   cwd=ROOT, env=env, check=False, capture_output=True)
    return time.perf_counter() - started


def notebook_times() -> list[dict]:
    """Each notebook and the whole suite under nbval, with the frame cache as it is
    (warm after the runs above), then the whole suite once more with an empty cache."""
    rows = [{"measure": f"pytest --nbval {notebook.name} (frame cache warm)", "unit": "s",
             "value": _pytest_seconds(str(notebook))}
            for notebook in sorted((ROOT / "notebooks").glob("*.ipynb"))]
    rows.append({"measure": "pytest --nbval notebooks/ (frame cache warm)", "unit": "s",
                 "value": _pytest_seconds("notebooks")})
    with tempfile.TemporaryDirectory() as directory:
        env = {**os.environ, "CONTRACT_LIB_CACHE_DIR": directory}
        rows.append({"measure": "pytest --nbval notebooks/ (frame cache empty)", "unit": "s",
                     "value": _pytest_seconds("notebooks", env)})
    return rows


def test_command_time() -> list[dict]:
    with tempfile.TemporaryDirectory() as directory:
        env = {**os.environ, "CONTRACT_LIB_CACHE_DIR": directory}
        seconds = _pytest_seconds(None, env)
    return [{"measure": "README test command after set-up (pytest, frame cache empty)",
             "unit": "s", "value": seconds}]


def machine() -> str:
    import torch

    return (f"{platform.platform()}, {os.cpu_count()} cores, Python "
            f"{platform.python_version()}, sglang {contract_lib.versions.installed_sglang_version()}, "
            f"torch {torch.__version__}")


def render(rows: list[dict]) -> str:
    lines = ["| measure | median | unit |", "|---|---|---|"]
    for row in rows:
        value = row["value"]
        text = f"{value:,.0f}" if value >= 1000 else f"{value:.3f}"
        lines.append(f"| {row['measure']} | {text} | {row['unit']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--quick", action="store_true",
                        help="skip the notebook and test-suite timings")
    parser.add_argument("--write", action="store_true", help="write benchmarks/RESULTS.md")
    args = parser.parse_args()
    rows = run_costs(args.repeat) + capture_overhead(args.repeat) + checker_throughput(
        args.repeat)
    if not args.quick:
        rows += notebook_times() + test_command_time()
    table = render(rows)
    print(machine())
    print(table)
    if args.write:
        (ROOT / "benchmarks" / "RESULTS.md").write_text(
            "# Benchmark results\n\nMeasured by `benchmarks/bench.py "
            f"--repeat {args.repeat}` on {machine()}, {time.strftime('%Y-%m-%d')}.\n\n"
            + table + "\n")


if __name__ == "__main__":
    main()
