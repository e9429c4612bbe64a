"""``benchmarks/bench.py --write`` puts its table at the head of RESULTS.md and keeps the
sections written after it (each pass's notes)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench.py"


@pytest.fixture
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "machine", lambda: "this machine")
    return module


def test_write_results_replaces_the_table_and_keeps_the_sections(bench, tmp_path):
    path = tmp_path / "RESULTS.md"
    sections = "## Against the targets\n\nkept\n\n## Issue #15\n\nkept too\n"
    path.write_text("# Benchmark results\n\nMeasured on that machine.\n\n| old |\n\n" + sections)
    bench.write_results(path, "--repeat 3 --pairs 8", "| new |")
    text = path.read_text()
    assert "| old |" not in text and "that machine" not in text
    assert "--repeat 3 --pairs 8` on this machine" in text and "| new |\n" in text
    assert text.endswith("\n\n" + sections)


def test_write_results_starts_a_missing_file(bench, tmp_path):
    path = tmp_path / "RESULTS.md"
    bench.write_results(path, "--repeat 5", "| new |")
    assert path.read_text().startswith("# Benchmark results") and "## " not in path.read_text()


def test_write_results_keeps_a_file_of_sections_only(bench, tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text("## Notes\n\nkept\n")
    bench.write_results(path, "--repeat 5", "| new |")
    assert path.read_text().endswith("| new |\n\n## Notes\n\nkept\n")


@pytest.mark.parametrize("part", [["--only", "checker"], ["--notebook", "00-overview"],
                                  ["--quick"]])
def test_write_refuses_a_partial_benchmark(bench, monkeypatch, capsys, tmp_path, part):
    # Nothing to measure and nowhere real to write, should the refusal ever go.
    monkeypatch.setattr(bench, "ROOT", tmp_path)
    monkeypatch.setattr(bench, "SECTIONS", {"checker": None})
    monkeypatch.setattr("sys.argv", ["bench.py", "--write", *part])
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    assert exit_.value.code == 2
    assert "--write records the whole benchmark" in capsys.readouterr().err


def test_the_median_interval_is_seeded_and_brackets_the_median(bench):
    ratios = [1.13, 1.43, 1.33, 1.2, 1.29, 1.5, 1.31, 1.25, 1.38, 1.1, 1.36, 1.27, 1.4, 1.22, 1.34]
    low, high = bench.median_interval(ratios)
    assert (low, high) == bench.median_interval(ratios)
    assert min(ratios) <= low < 1.31 < high <= max(ratios)
    assert bench.median_interval([1.2] * 9) == (1.2, 1.2)
