"""contract_lib: does a replacement scheduler loop still do everything ``run_batch`` did?

Runs short workloads through real scheduler loops (SGLang's ``normal``, ``overlap`` and
``mlx``, and sglang-omni's ``omni``; see :mod:`contract_lib.loops`) with only the model
forward replaced (or, on MLX, SGLang's real ``MlxModelRunner`` with a tiny local model),
on SGLang 0.5.21, 0.5.22 or 0.5.23, records per-step frames, and checks the per-step
contract at every step boundary: the RFC's five clauses and this project's extensions
(:mod:`contract_lib.contract`), with one verdict per run (:mod:`contract_lib.verdict`).
"""

from contract_lib.frames import Frames, FramesFormatError
from contract_lib.harness import LOOPS, RUNNERS, RunSetupError, run
from contract_lib.patches import BUILTIN_PATCHES, PatchError
from contract_lib.versions import (SUPPORTED_SGLANG_VERSIONS, SGLangInstallError,
                                   UnsupportedSGLangError)
from contract_lib.workloads import Workload, WorkloadError, load_workload, workload_names

__all__ = [
    "BUILTIN_PATCHES", "Frames", "FramesFormatError", "LOOPS", "PatchError", "RUNNERS",
    "RunSetupError", "SGLangInstallError", "SUPPORTED_SGLANG_VERSIONS",
    "UnsupportedSGLangError", "Workload", "WorkloadError", "load_workload", "run",
    "workload_names",
]
