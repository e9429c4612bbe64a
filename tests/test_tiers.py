"""The fast tier is what it says: it passes in a process where SGLang (and torch, MLX,
triton) cannot be imported, and collects the same tests as without the block."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _fast_tier(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "fast", str(TESTS), "-q", *args],
        cwd=TESTS.parent, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(TESTS)})


def _passed(proc: subprocess.CompletedProcess) -> int:
    found = re.search(r"(\d+) passed", proc.stdout)
    return int(found.group(1)) if found else 0


def test_the_fast_tier_passes_without_sglang_or_torch():
    blocked = _fast_tier("-p", "no_sglang")
    assert blocked.returncode == 0, blocked.stdout[-3000:]
    listed = _fast_tier("--collect-only")
    collected = int(re.search(r"(\d+)/\d+ tests collected", listed.stdout).group(1))
    assert _passed(blocked) == collected > 50
