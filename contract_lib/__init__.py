"""contract_lib: does a replacement scheduler loop still do everything ``run_batch`` did?

Runs short workloads through real scheduler loops (SGLang's ``normal``, ``overlap`` and
``mlx``, and sglang-omni's ``omni``; see :mod:`contract_lib.loops`) with only the model
forward replaced (or, on MLX, SGLang's real ``MlxModelRunner`` with a tiny local model),
on SGLang 0.5.21, 0.5.22 or 0.5.23, records per-step frames, and checks the per-step
contract at every step boundary: the RFC's five clauses and this project's extensions
(:mod:`contract_lib.contract`), with one verdict per run (:mod:`contract_lib.verdict`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Public names and the module each comes from: imported on first access, so ``import
# contract_lib`` costs milliseconds (no pandas, numpy, matplotlib or SGLang until a name
# that needs them is used; measured with ``python -X importtime -c 'import contract_lib'``).
_EXPORTS = {
    "Frames": "frames", "FramesFormatError": "frames",
    "LOOPS": "runs.harness", "RUNNERS": "runs.harness", "RunSetupError": "runs.harness",
    "run": "runs.harness",
    "BUILTIN_PATCHES": "patches.builtin", "PatchError": "patches.builtin",
    "SUPPORTED_SGLANG_VERSIONS": "sources.versions", "SGLangInstallError": "sources.versions",
    "UnsupportedSGLangError": "sources.versions",
    "Workload": "workloads", "WorkloadError": "workloads", "load_workload": "workloads",
    "workload_names": "workloads",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from contract_lib.frames import Frames, FramesFormatError
    from contract_lib.patches.builtin import BUILTIN_PATCHES, PatchError
    from contract_lib.runs.harness import LOOPS, RUNNERS, RunSetupError, run
    from contract_lib.sources.versions import (
        SUPPORTED_SGLANG_VERSIONS,
        SGLangInstallError,
        UnsupportedSGLangError,
    )
    from contract_lib.workloads import Workload, WorkloadError, load_workload, workload_names


def __getattr__(name: str) -> Any:
    """A public name (imported from its module on first use) or a submodule."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"contract_lib.{_EXPORTS[name]}"), name)
    else:
        try:
            value = importlib.import_module(f"contract_lib.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"contract_lib.{name}":
                raise
            raise AttributeError(f"module 'contract_lib' has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
