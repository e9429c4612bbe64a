"""The project's folders, computed once (bottom floor: imports nothing from the package)."""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent  # contract_lib/
PROJECT_ROOT = PACKAGE_DIR.parent  # the checkout (or the install's parent folder)
DATA_DIR = PROJECT_ROOT / "data"
MODEL_DIR = DATA_DIR / "model"  # the model-free runs' config-only model folder
WORKLOAD_DIR = DATA_DIR / "workloads"
FRAMES_DIR = DATA_DIR / "frames"  # where the CLI saves frames and traces by default
HISTORY_DIR = DATA_DIR / "history"  # the saved runs of every supported release
# Every shipped workload through each loop of every supported release (docs/history.md)
SWEEP_DIR = DATA_DIR / "history-sweep"
BUG_CATALOG = DATA_DIR / "bugs.toml"

# What runs in the run's process (the warm server's and a run's imports), hence all of
# this library that shapes a run's frames: the frame cache key and the warm servers'
# fingerprint cover these files and nothing else of the package, so an edit to the
# checker, the views, the campaigns or the command line neither re-runs a cached run nor
# restarts a server (tests/test_cache_files.py checks it against a warm server's imports).
RUN_SIDE = ("child", "wire", "sources", "patches", "__init__.py", "atomic.py", "dtypes.py",
            "frames.py", "lazy.py", "loops.py", "paths.py", "trust.py", "workloads.py")


def run_side_files() -> list[Path]:
    """The files of :data:`RUN_SIDE` (every ``.py`` of its folders) and the model-free
    model's config, sorted."""
    files = [MODEL_DIR / "config.json"]
    for part in RUN_SIDE:
        path = PACKAGE_DIR / part
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return sorted(files)
