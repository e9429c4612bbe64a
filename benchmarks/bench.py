"""Benchmark: what a run costs, cold, warm and cached; capture overhead; checker speed;
notebook and test-suite times. Prints medians; ``--write`` also puts them at the head of
RESULTS.md (the sections after that table are kept; only a whole run writes).

    .venv/bin/python benchmarks/bench.py [--repeat 5] [--pairs 60] [--quick] [--only SECTION]
                                         [--write]

Targets (issue "make a run cost its loop"): warm run <= 1.5 s for two-turn on any loop,
cached run <= 50 ms, capture overhead <= 1.3x, checker >= 1e6 frame rows/s, the notebook
suite <= 90 s under pytest --nbval, the README test command <= 5 min after set-up.
Issue #15 (one warm server per release): `check` after editing a user patch <= 1.5 s on
the command line and <= 3x a cached `check`, the notebook suite from an empty frame cache
<= 90 s, one server for 8 concurrent API runs. The runs use warm servers of their own
(a temporary server directory), stopped at the end.
Nothing here is asserted: these are measurements, not tests.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pandas as pd

import contract_lib
from contract_lib.contract import check
from contract_lib.frames import Frames
from contract_lib.runs import pool, servers

ROOT = Path(__file__).resolve().parent.parent


def median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def median_interval(values: list[float], level: float = 0.9, resamples: int = 2000
                    ) -> tuple[float, float]:
    """A bootstrap interval of the median of ``values`` (percentile method, seeded: the
    same values give the same interval): how far another sitting's median may land."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values)))
                     for _ in range(resamples))
    tail = (1 - level) / 2
    return medians[int(tail * resamples)], medians[int((1 - tail) * resamples) - 1]


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


# The capture costs about the same per step on every workload, so a workload whose loop
# does less per step shows a larger ratio: two-turn (21 steps) is the measure,
# memory-pressure (59 cheaper steps) the spread beside it.
CAPTURE_WORKLOADS = ("two-turn", "memory-pressure")


def capture_overhead(pairs: int) -> list[dict]:
    """The loop's wall time and its process's CPU time with the recorder on against off,
    and the capture's CPU per step (µs). Runs go in pairs (on then off, then off then
    on), so a busy spell of this shared machine slows both halves of a pair: besides the
    ratio of the medians, the median of the pairs' own ratios, the steadier figure (CPU
    medians move by +-0.2x between sittings otherwise), with its quartiles (the spread
    one sitting shows) and a bootstrap interval of that median (where another sitting's
    may land: a target inside it is neither met nor missed by this sitting)."""
    rows = []
    for workload in CAPTURE_WORKLOADS:
        for loop in contract_lib.LOOPS:
            times = {(kind, capture): [] for kind in ("wall", "CPU")
                     for capture in (True, False)}
            steps = 0
            for index in range(pairs):
                for capture in ((True, False) if index % 2 == 0 else (False, True)):
                    frames = contract_lib.run(workload, loop, cache=False, capture=capture)
                    timing = frames.meta["timing"]
                    times[("wall", capture)].append(timing["loop_s"])
                    times[("CPU", capture)].append(timing["loop_cpu_s"])
                    if capture:
                        steps = len(frames.steps)
            for kind in ("wall", "CPU"):
                on, off = times[(kind, True)], times[(kind, False)]
                with_, without = statistics.median(on), statistics.median(off)
                rows.append({"measure": f"capture overhead ({kind}), {workload}/{loop} "
                                        f"({with_ * 1e3:.1f} ms vs {without * 1e3:.1f} ms "
                                        f"loop, {steps} steps: "
                                        f"{(with_ - without) / steps * 1e6:.0f} µs a step)",
                             "value": with_ / without, "unit": "x"})
                ratios = [a / b for a, b in zip(on, off)]
                quartiles = (statistics.quantiles(ratios, n=4) if len(ratios) > 1
                             else ratios * 3)
                low, high = median_interval(ratios)
                rows.append({"measure": f"capture overhead ({kind}), {workload}/{loop}, "
                                        f"median of {pairs} paired ratios (quartiles "
                                        f"{quartiles[0]:.2f}-{quartiles[2]:.2f}; 90% "
                                        f"interval of the median {low:.2f}-{high:.2f})",
                             "value": statistics.median(ratios), "unit": "x"})
    return rows


# A user patch a triager edits between checks: each edit changes its source, so the next
# check misses the frame cache and runs (the "edit -> verdict" loop).
EDITED_PATCH = """def apply():
    from sglang.srt.managers.scheduler import Scheduler
    Scheduler.bench_edit = {edit}  # the triager's change of the moment
"""


def _cli_seconds(args: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "contract_lib", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode not in (0, 1):
        raise RuntimeError(f"{' '.join(args)} exited {done.returncode}: {done.stderr}")
    return seconds


def edit_check(repeat: int) -> list[dict]:
    """``check`` on the command line after editing a user patch (a cache miss), with the
    warm server (one per release, shared by commands) and with servers switched off
    (every command imports SGLang, as before the server), beside a cached ``check``."""
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        folder = Path(directory)
        (folder / "frames").mkdir()
        patch = folder / "bench_edit_patch.py"
        env = {**os.environ, "CONTRACT_LIB_CACHE_DIR": str(folder / "frames"),
               pool.SERVER_DIR_ENV: str(folder / "servers"),
               "PYTHONPATH": os.pathsep.join([str(folder), str(ROOT)])}
        env.pop("CONTRACT_LIB_NO_CACHE", None)
        args = ["check", "--loop", "mlx", "--workload", "two-turn", "--patch",
                "bench_edit_patch:apply", "--out", str(folder / "frames.json")]
        edits = iter(range(10 ** 6))

        def edited(extra_env=None):
            patch.write_text(EDITED_PATCH.format(edit=next(edits)))
            return _cli_seconds(args, {**env, **(extra_env or {})})

        try:
            edited()  # starts the server
            warm = [edited() for _ in range(repeat)]
            cached = [_cli_seconds(args, env) for _ in range(repeat)]
            cold = [edited({pool.SERVER_SWITCH_ENV: "off"}) for _ in range(max(2, repeat // 2))]
        finally:
            servers.stop_all(folder / "servers")
    warm_s, cached_s, cold_s = map(statistics.median, (warm, cached, cold))
    rows.append({"measure": "`check` after editing a user patch, command line, warm server",
                 "value": warm_s, "unit": "s"})
    rows.append({"measure": "`check`, cached (same command, patch unchanged)",
                 "value": cached_s, "unit": "s"})
    rows.append({"measure": "edited `check` / cached `check`", "value": warm_s / cached_s,
                 "unit": "x"})
    rows.append({"measure": "`check` after editing a user patch, CONTRACT_LIB_SERVER=off "
                            "(imports SGLang, as before the server)",
                 "value": cold_s, "unit": "s"})
    return rows


def concurrent_memory(runs: int = 8) -> list[dict]:
    """``runs`` concurrent API runs (``run_many`` with as many threads): how many warm
    servers serve them, and the peak proportional memory (PSS) of servers and runs."""
    import psutil

    from contract_lib.runs.harness import run_many

    with tempfile.TemporaryDirectory() as directory:
        saved = os.environ.get(pool.SERVER_DIR_ENV)
        os.environ[pool.SERVER_DIR_ENV] = directory
        peak = {"pss": 0}
        done = threading.Event()

        def sample():
            while not done.wait(0.05):
                total = 0
                for status in servers.statuses(Path(directory)):
                    try:
                        server = psutil.Process(status["pid"])
                        for process in [server, *server.children()]:
                            total += process.memory_full_info().pss
                    except psutil.Error:
                        continue
                peak["pss"] = max(peak["pss"], total)

        try:
            contract_lib.run("two-turn", "mlx", cache=False)  # the server, started
            sampler = threading.Thread(target=sample)
            sampler.start()
            results = run_many([{"workload": "two-turn", "loop": "mlx", "cache": False}] * runs,
                               workers=runs, progress=False)
            done.set()
            sampler.join()
            serving = servers.statuses(Path(directory))
        finally:
            servers.stop_all(Path(directory))
            if saved is None:
                del os.environ[pool.SERVER_DIR_ENV]
            else:
                os.environ[pool.SERVER_DIR_ENV] = saved
    assert all(r.status == "finished" for r in results), results
    return [{"measure": f"warm servers serving {runs} concurrent API runs", "unit": "servers",
             "value": len(serving)},
            {"measure": f"peak PSS of the server and its {runs} concurrent runs", "unit": "GB",
             "value": peak["pss"] / 1e9}]


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
            if "rids" in part:  # a launch's lanes name the same renumbered requests
                part["rids"] = part["rids"].map(
                    lambda rids, i=i: ",".join(f"{rid}#{i}" for rid in rids.split(",")))
            for column in ("launch_ts", "processed_launch_ts", "wall_time"):
                if column in part:
                    part[column] = pd.to_numeric(part[column]) + i * 1000.0
            parts.append(part)
        tables[name] = pd.concat(parts, ignore_index=True)
    meta = dict(base.meta)
    for key in ("prompts", "script"):  # per request: each copy's requests have theirs
        meta[key] = {f"{rid}#{i}": value for i in range(copies)
                     for rid, value in (base.meta.get(key) or {}).items()}
    return Frames(tables=tables, meta=meta)


def checker_throughput(repeat: int) -> list[dict]:
    base = contract_lib.run("two-turn", "mlx")
    per_copy = sum(len(t) for t in base.tables.values())
    frames = synthetic_frames(base, max(1, 1_000_000 // per_copy))
    total = sum(len(t) for t in frames.tables.values())
    seconds = median_time(lambda: check(frames), max(1, repeat // 2))
    violations = len(check(frames).violations)
    return [{"measure": f"checker on {total:,} frame rows ({violations:,} violations)",
             "value": total / seconds, "unit": "rows/s"}]


def _pytest_seconds(targets: list[str], env: dict[str, str] | None = None) -> float:
    """Wall time of ``pytest -q [targets]`` in the project (none: the whole suite)."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", *targets], cwd=ROOT, env=env,
                          check=False, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    print(f"pytest {' '.join(targets) or '(all)'}: {done.stdout.strip().splitlines()[-1:]} "
          f"in {seconds:.0f} s", file=sys.stderr)
    return seconds


def notebook_times(names: list[str] | None = None) -> list[dict]:
    """Each notebook and the whole suite under nbval, with the frame cache as it is
    (warm after the runs above), then the whole suite once more with an empty cache.
    ``names``: only these notebooks, and the suite of them from an empty cache."""
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    if names:
        notebooks = [n for n in notebooks if n.stem in names or n.name in names]
        with tempfile.TemporaryDirectory() as directory:
            env = {**os.environ, "CONTRACT_LIB_CACHE_DIR": directory}
            seconds = _pytest_seconds([str(n) for n in notebooks], env)
        return [{"measure": f"pytest --nbval {' '.join(n.stem for n in notebooks)} "
                            "(frame cache empty)", "unit": "s", "value": seconds}]
    rows = [{"measure": f"pytest --nbval {notebook.name} (frame cache warm)", "unit": "s",
             "value": _pytest_seconds([str(notebook)])} for notebook in notebooks]
    rows.append({"measure": "pytest --nbval notebooks/ (frame cache warm)", "unit": "s",
                 "value": _pytest_seconds(["notebooks"])})
    with tempfile.TemporaryDirectory() as directory:
        env = {**os.environ, "CONTRACT_LIB_CACHE_DIR": directory}
        rows.append({"measure": "pytest --nbval notebooks/ (frame cache empty)", "unit": "s",
                     "value": _pytest_seconds(["notebooks"], env)})
    return rows


def test_command_time() -> list[dict]:
    with tempfile.TemporaryDirectory() as directory:
        env = {**os.environ, "CONTRACT_LIB_CACHE_DIR": directory}
        seconds = _pytest_seconds([], env)
    return [{"measure": "README test command after set-up (pytest, frame cache empty)",
             "unit": "s", "value": seconds}]


def machine() -> str:
    import torch

    return (f"{platform.platform()}, {os.cpu_count()} cores, Python "
            f"{platform.python_version()}, sglang {contract_lib.sources.versions.installed_sglang_version()}, "
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
    parser.add_argument("--only", action="append", choices=list(SECTIONS),
                        help="measure only these sections (repeatable)")
    parser.add_argument("--notebook", action="append", metavar="NAME",
                        help="time only these notebooks, from an empty frame cache")
    parser.add_argument("--pairs", type=int, default=60,
                        help="on/off run pairs per loop and workload for the capture "
                             "overhead (a sitting's median moved by +-0.15x with 15)")
    parser.add_argument("--write", action="store_true", help="write benchmarks/RESULTS.md")
    args = parser.parse_args()
    if args.repeat < 1 or args.pairs < 1:
        parser.error("--repeat and --pairs take a count of at least 1")
    if args.write and (args.only or args.notebook or args.quick):
        # RESULTS.md's head is one sitting's whole table; a part would drop the rest.
        parser.error("--write records the whole benchmark: drop --only, --notebook and --quick")
    chosen = args.only or [name for name in SECTIONS
                           if not (args.quick and name in ("notebooks", "tests"))]
    rows = []
    with tempfile.TemporaryDirectory() as directory:  # this run's warm servers, stopped
        os.environ[pool.SERVER_DIR_ENV] = directory
        try:
            for name in chosen:
                section = SECTIONS[name]
                arguments = {"notebooks": (args.notebook,), "tests": (),
                             "capture": (args.pairs,)}.get(name, (args.repeat,))
                rows += section(*arguments)
        finally:
            servers.stop_all(Path(directory))
    table = render(rows)
    print(machine())
    print(table)
    if args.write:
        write_results(ROOT / "benchmarks" / "RESULTS.md", f"--repeat {args.repeat} "
                      f"--pairs {args.pairs}", table)


def write_results(path: Path, options: str, table: str) -> None:
    """Replace the measured table at the head of RESULTS.md (everything before its first
    ``## `` section); the sections after it (targets, each pass's notes) are kept."""
    old = path.read_text() if path.exists() else ""
    section = re.search(r"^## ", old, re.MULTILINE)
    kept = old[section.start():] if section else ""
    head = ("# Benchmark results\n\nMeasured by `benchmarks/bench.py "
            f"{options}` on {machine()}, {time.strftime('%Y-%m-%d')}.\n\n"
            + table + "\n")
    path.write_text(head + ("\n" + kept if kept else ""))


SECTIONS = {"runs": run_costs, "edit": edit_check, "capture": capture_overhead,
            "checker": checker_throughput, "memory": lambda repeat: concurrent_memory(),
            "notebooks": notebook_times, "tests": test_command_time}


if __name__ == "__main__":
    main()
