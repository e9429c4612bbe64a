"""``environment.yml`` generated from ``pyproject.toml``: the conda/mamba environment for
Apple Silicon holds exactly the project's pinned dependencies (its markers read for macOS
on arm64) and the dev extras, and names the SGLang release ``scripts/setup-env`` installs."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement

from contract_lib.paths import PROJECT_ROOT

ENVIRONMENT = PROJECT_ROOT / "environment.yml"
# Where environment.yml is for: SGLang's MLX gate passes there, so no platform shim runs.
_APPLE = {"sys_platform": "darwin", "platform_machine": "arm64", "platform_system": "Darwin",
          "os_name": "posix", "python_version": "3.11", "python_full_version": "3.11.0",
          "implementation_name": "cpython", "platform_python_implementation": "CPython",
          "platform_release": "", "platform_version": "", "extra": ""}


def sglang_version(root: Path = PROJECT_ROOT) -> str:
    """The release ``scripts/setup-env`` installs (its ``SGLANG_VERSION=``)."""
    text = (root / "scripts" / "setup-env").read_text()
    return re.search(r"^SGLANG_VERSION=(\S+)$", text, re.MULTILINE).group(1)


def requirements(root: Path = PROJECT_ROOT) -> list[str]:
    """The dependencies and dev extras of ``pyproject.toml`` that apply on Apple Silicon,
    each as written there without its marker."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    out = []
    for line in [*project["dependencies"], *project["optional-dependencies"]["dev"]]:
        requirement = Requirement(line)
        if requirement.marker is None or Marker(str(requirement.marker)).evaluate(_APPLE):
            requirement.marker = None
            out.append(str(requirement))
    return out


def render(root: Path = PROJECT_ROOT) -> str:
    """The text of ``environment.yml``."""
    python = tomllib.loads((root / "pyproject.toml").read_text())["project"]["requires-python"]
    minor = re.search(r">=\s*(\d+\.\d+)", python).group(1)
    head = [
        "# Generated from pyproject.toml by `scripts/check-docs --write`: do not edit (the",
        "# check fails when the two differ). A conda/mamba environment for Apple Silicon",
        "# (where SGLang's own MLX gate passes and no platform shim is applied) holding the",
        "# dependencies and dev extras of pyproject.toml, pinned as there. On Linux use",
        "# scripts/setup-env.",
        "#   mamba env create -f environment.yml && conda activate contract-lib",
        f"#   pip install --no-deps sglang=={sglang_version(root)} && pip install --no-deps -e .",
        "name: contract-lib",
        "channels:",
        "  - conda-forge",
        "dependencies:",
        f"  - python={minor}",
        "  - pip",
        "  - pip:",
    ]
    return "\n".join(head + [f"      - {r}" for r in requirements(root)]) + "\n"
