"""The project's folders, computed once (bottom floor: imports nothing from the package)."""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent  # contract_lib/
PROJECT_ROOT = PACKAGE_DIR.parent  # the checkout (or the install's parent folder)
DATA_DIR = PROJECT_ROOT / "data"
MODEL_DIR = DATA_DIR / "model"  # the model-free runs' config-only model folder
WORKLOAD_DIR = DATA_DIR / "workloads"
FRAMES_DIR = DATA_DIR / "frames"  # where the CLI saves frames and traces by default
BUG_CATALOG = DATA_DIR / "bugs.toml"
