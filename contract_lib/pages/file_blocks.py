"""Generated blocks read from committed files or the test suite: the fixtures, the fast
tier's size and measured time, the search campaigns' table."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from contract_lib.pages.generators import generator
from contract_lib.paths import PROJECT_ROOT

FIXTURES = PROJECT_ROOT / "tests" / "fixtures"
FAST_TIER_RESULT = PROJECT_ROOT / "benchmarks" / "fast-tier.json"
SEARCH_RESULT = PROJECT_ROOT / "benchmarks" / "search.md"


@generator("fixtures", needs="files")
def fixtures_phrase() -> str:
    """How many committed runs the fast tier reads, and their size."""
    files = sorted(FIXTURES.glob("*.json"))
    size = sum(f.stat().st_size for f in files) / 1e6
    return f"{len(files)} runs saved by `scripts/make-fixtures`, {size:.1f} MB of compact JSON"


@generator("history-fixtures", needs="files")
def history_fixtures_phrase(folder: str = "history") -> str:
    """How many saved runs of the contract's history there are in ``data/<folder>``
    (``history``: the bug runs; ``history-sweep``: every shipped workload), per release,
    and their size."""
    history = PROJECT_ROOT / "data" / folder
    releases = sorted((d for d in history.iterdir() if d.is_dir()),
                      key=lambda d: tuple(int(part) for part in d.name.split(".")))
    files = sorted(history.rglob("*.json.gz"))
    per_release = {len(list(d.glob("*.json.gz"))) for d in releases}
    each = (f"{per_release.pop()} per release" if len(per_release) == 1
            else "per release: " + ", ".join(f"{d.name} {len(list(d.glob('*.json.gz')))}"
                                             for d in releases))
    size = sum(f.stat().st_size for f in files) / 1e3
    return (f"{len(files)} runs, {each} {releases[0].name}-{releases[-1].name}, saved by "
            f"`scripts/make-history-fixtures`, {size:.0f} KB of gzipped compact JSON")


def collected(marker: str) -> int:
    """How many tests ``pytest --collect-only -q -m MARKER tests`` selects."""
    ran = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", marker,
                          "tests"], cwd=PROJECT_ROOT, capture_output=True, text=True,
                         check=False)
    found = re.search(r"^(\d+)(?:/\d+)? tests? collected", ran.stdout, re.MULTILINE)
    if ran.returncode != 0 or not found:
        raise RuntimeError(f"pytest --collect-only -m {marker}: exit {ran.returncode}\n"
                           + ran.stdout[-2000:])
    return int(found.group(1))


@generator("test-count", needs="pytest")
def test_count_phrase(marker: str = "fast") -> str:
    """``N tests``: what ``pytest -m MARKER tests`` selects."""
    return f"{collected(marker)} tests"


@generator("fast-tier-time", needs="files")
def fast_tier_time_phrase() -> str:
    """The fast tier's time as ``benchmarks/fast_tier.py`` measured it, with the machine."""
    result = json.loads(FAST_TIER_RESULT.read_text())
    runs = result["runs"]

    def spread(key: str, of: list[dict] = runs) -> str:
        low, high = min(r[key] for r in of), max(r[key] for r in of)
        return f"{low:.0f}" if round(low) == round(high) else f"{low:.0f}-{high:.0f}"
    loads = ", ".join(f"{r['load_before']:.1f}" for r in runs)
    return (f"{result['tests']} tests in {spread('pytest_s')} s as pytest reports it "
            f"({spread('wall_s')} s wall) as `{result['command']}`, "
            f"{spread('pytest_s', result['one_process_runs'])} s in one process, over "
            f"{len(runs)} runs each on {result['machine']}, load average {loads} at the "
            f"start of the first command's runs (`benchmarks/fast_tier.py`, {result['date']})")


@generator("search-table", needs="files")
def search_table() -> str:
    """The first table of ``benchmarks/search.md`` (written by ``search_bench.py``)."""
    lines = SEARCH_RESULT.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(lines[start:end])
