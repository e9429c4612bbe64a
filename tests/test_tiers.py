"""The fast tier is what it says: it passes in a process where SGLang (and torch, MLX,
triton) cannot be imported, and collects the same tests as without the block; and its
committed frames are those the real runs give today."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from conftest import FIXTURES, saved_frames

TESTS = Path(__file__).resolve().parent


def _fast_tier(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "fast", str(TESTS), "-q", *args],
        cwd=TESTS.parent, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(TESTS)})


def _passed(proc: subprocess.CompletedProcess) -> int:
    found = re.search(r"(\d+) passed", proc.stdout)
    return int(found.group(1)) if found else 0


def _fast_tests_collected(session: pytest.Session) -> int:
    """The fast tier's size without the block: counted in this session when it collected
    every test of tests/ (no ``-k``, no ``-m``, every module), else by a collection."""
    option = session.config.option
    items = [item for item in session.items if item.path.parent == TESTS]
    if (not option.keyword and not option.markexpr
            and {item.path for item in items} == set(TESTS.glob("test_*.py"))):
        return sum(item.get_closest_marker("fast") is not None for item in items)
    listed = _fast_tier("--collect-only")
    return int(re.search(r"(\d+)/\d+ tests collected", listed.stdout).group(1))


def test_the_fast_tier_passes_without_sglang_or_torch(request):
    blocked = _fast_tier("-p", "no_sglang")
    assert blocked.returncode == 0, blocked.stdout[-3000:]
    assert _passed(blocked) == _fast_tests_collected(request.session) > 50


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "two workers"])
def test_a_fast_test_that_imports_sglang_fails_the_tier(tmp_path, workers):
    """The tier's purity guard (conftest.py) fails it in one process and under xdist,
    whose workers' session status never reaches the controller."""
    (tmp_path / "stand_in" / "sglang").mkdir(parents=True)
    (tmp_path / "stand_in" / "sglang" / "__init__.py").write_text("")
    (tmp_path / "test_impure.py").write_text(
        "import pytest\n\n\n@pytest.mark.fast\ndef test_impure():\n"
        "    import sglang  # noqa: F401\n")
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conftest", "-m", "fast", "-q",
         "-p", "no:cacheprovider", str(tmp_path / "test_impure.py"), *workers],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{tmp_path / 'stand_in'}"})
    assert ran.returncode == 1, ran.stdout[-3000:]
    assert "the fast tier imported sglang" in ran.stdout + ran.stderr


_IRIS = ["https://example.com/a?b#c", "http://例え.jp/パス", "not an iri", "//no-scheme",
         "http://[::1]:80/", "mailto:a@b", "", 7]


def _iri_answers(deferred: bool) -> tuple[bool, list[bool], bool]:
    """In a fresh process (with tests/pytest_startup.py's stand-in first when
    ``deferred``): whether importing jsonschema built the IRI grammar, jsonschema's
    ``iri`` answers for :data:`_IRIS`, and whether answering built it."""
    probe = ("import sys\n"
             f"sys.path.insert(0, {str(TESTS)!r})\n"
             + ("import pytest_startup\n" if deferred else "")
             + "import jsonschema\n"
             "built = 'rfc3987_syntax.syntax_helpers' in sys.modules\n"
             "checker = jsonschema.FormatChecker()\n"
             f"answers = [checker.conforms(value, 'iri') for value in {_IRIS!r}]\n"
             "print(repr((built, answers, 'rfc3987_syntax.syntax_helpers' in sys.modules)))")
    ran = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    return eval(ran.stdout)


def test_pytest_start_up_defers_the_iri_grammar_and_keeps_its_answers():
    """Every pytest process loads tests/pytest_startup.py first: jsonschema (nbval's
    import) then builds no IRI grammar until an ``iri`` check needs it (~0.8 s per
    process), and its answers are the real module's."""
    built, deferred, used = _iri_answers(deferred=True)
    real_built, real, _ = _iri_answers(deferred=False)
    assert real_built and not built and used
    assert deferred == real and True in real and False in real


@pytest.mark.parametrize("name", sorted(p.stem for p in FIXTURES.glob("*.json")))
def test_the_committed_frames_are_todays_runs(run_cached, name):
    """Else re-run ``scripts/make-fixtures`` (a change in what runs record, or in SGLang)."""
    saved = saved_frames(*name.split(".", 2))
    fresh = run_cached(*name.split(".", 2))  # a file's dtypes are a run's (dtypes.py)
    assert (saved.status, saved.meta["steps"]) == (fresh.status, fresh.meta["steps"])
    for table, frame in fresh.comparable().items():
        pd.testing.assert_frame_equal(saved.comparable()[table], frame, obj=f"{name} {table}")
