"""Platform gates: what stops SGLang, or its MLX backend, from loading on a Linux CPU machine.

Section 1 runs at import time (before the first ``import sglang``); section 2 at run
time, for the MLX loop. None is applied where SGLang's own gate passes (Apple Silicon
with MPS and Metal).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import platform
import sys
import types
from pathlib import Path
from typing import Any
from unittest import mock


def on_apple_silicon_with_mlx() -> bool:
    """True where SGLang's own MLX gate would pass (then no gate shim is applied)."""
    if sys.platform != "darwin" or platform.machine() != "arm64":
        return False
    try:
        import mlx.core as mx
        import torch
    except ImportError:
        return False
    return bool(torch.backends.mps.is_available() and mx.metal.is_available())


# --------------------------------------------------------------------------------------
# 1. Import-time platform gates (must run before the first ``import sglang``).
# --------------------------------------------------------------------------------------


_IMPORT_SHIMS: list[str] = []  # in effect in this process (inherited by forked runs)
# SGLang's Triton stand-in, named with the release whose file was loaded.
TRITON_STANDIN_SHIM = "triton-standin"


def install_import_shims() -> list[str]:
    """Make ``import sglang.srt.managers.scheduler`` possible on Linux CPU (idempotent).

    Returns the names of the import shims in effect (empty where none is needed).
    """
    if (not any(name.startswith(TRITON_STANDIN_SHIM) for name in _IMPORT_SHIMS)
            and importlib.util.find_spec("triton") is None
            and not on_apple_silicon_with_mlx()):  # there sglang/__init__ installs it itself
        _IMPORT_SHIMS.append(_install_sglang_triton_standin())
    if ("torchvision-placeholder" not in _IMPORT_SHIMS
            and importlib.util.find_spec("torchvision") is None):
        _install_torchvision_placeholder()
        _IMPORT_SHIMS.append("torchvision-placeholder")
    return list(_IMPORT_SHIMS)


def _install_sglang_triton_standin() -> str:
    """Load SGLang's own Triton stand-in (``sglang/_platform_stubs.py``; which release's:
    :func:`contract_lib.sources.compat.triton_standin`); the shim's name says which
    (``triton-standin-0.5.23``: the venv's stand-in under an older release).

    Why: ``sglang/srt/utils/common.py`` does ``import triton`` unconditionally; real
    triton is ~900 MB and has no use without a GPU. SGLang ships a complete stand-in for
    macOS, but installs it only when ``sys.platform == "darwin"``, the machine is arm64
    and MPS is available. We load that file directly (not through ``sglang/__init__``,
    which would import triton first) and call it with the three gate inputs answering
    "Apple"; its MPS-only patches touch ``torch.mps`` attributes and ``non_blocking``
    copies *to MPS*, neither of which a CPU run uses.
    """
    from contract_lib.sources.compat import TRITON_STANDIN, package_version, triton_standin

    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("sglang is not installed")
    path = triton_standin(Path(list(spec.submodule_search_locations)[0]))
    stub_spec = importlib.util.spec_from_file_location("_contract_lib_sglang_platform_stubs", path)
    module = importlib.util.module_from_spec(stub_spec)
    sys.modules[stub_spec.name] = module
    stub_spec.loader.exec_module(module)
    import torch

    with (
        mock.patch.object(module.sys, "platform", "darwin"),
        mock.patch.object(module.platform, "machine", lambda: "arm64"),
        mock.patch.object(torch.backends.mps, "is_available", lambda: True),
    ):
        getattr(module, TRITON_STANDIN[1])()
    return f"{TRITON_STANDIN_SHIM}-{package_version(path.parent) or 'unknown'}"


class _AnyAttribute(types.ModuleType):
    """A module whose every missing attribute is a further placeholder (a class)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        placeholder = type(name, (), {"__getattr__": lambda self, attr: attr})
        setattr(self, name, placeholder)
        return placeholder


class _InterpolationModeMeta(type):
    def __getattr__(cls, name: str) -> str:
        if name.startswith("__"):
            raise AttributeError(name)
        return name


def _install_torchvision_placeholder() -> None:
    """Register an import-only ``torchvision`` placeholder.

    Why: ``managers/scheduler`` → ``schedule_batch`` → ``configs`` → ``nano_nemotron_vl``
    → ``multimodal/internvl_utils`` does ``import torchvision.transforms as T`` at import
    time. PyPI's torchvision wheels are CUDA builds that fail against CPU torch
    (``operator torchvision::nms does not exist``) or replace torch with a 6 GB CUDA
    stack. A text-only scheduler run never calls torchvision. transformers then sees
    torchvision as present, so ``InterpolationMode`` must answer attribute access.
    """
    names = [
        "torchvision",
        "torchvision.transforms",
        "torchvision.transforms.functional",
        "torchvision.transforms.v2",
        "torchvision.transforms.v2.functional",
        "torchvision.io",
        "torchvision.ops",
        "torchvision.models",
        "torchvision.utils",
    ]
    modules = {}
    for name in names:
        module = _AnyAttribute(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
        module.__path__ = []
        module.__version__ = "0.0.0+contract-lib-placeholder"
        modules[name] = module
        sys.modules[name] = module
    mode = _InterpolationModeMeta("InterpolationMode", (), {})
    for name in ("torchvision.transforms", "torchvision.transforms.functional",
                 "torchvision.transforms.v2", "torchvision.transforms.v2.functional"):
        modules[name].InterpolationMode = mode
    for name in names:
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, modules[name])


# --------------------------------------------------------------------------------------
# 2. Runtime platform gates for the MLX loop.
# --------------------------------------------------------------------------------------


def install_mlx_runtime_gate_shim() -> bool:
    """Let ``use_mlx()`` answer True on Linux with ``SGLANG_USE_MLX=1``.

    Why: ``hardware_backend/mlx/runtime._validate_runtime`` demands an MPS device and a
    Metal device; on Linux MLX runs on its CPU backend (``mlx[cpu]``), which is enough
    for the lazy-graph semantics the loop relies on. Returns False (no shim) where the
    real gate passes, or where the release has none
    (:func:`contract_lib.sources.compat.mlx_runtime_gate`).
    """
    from contract_lib.sources.compat import mlx_runtime_gate

    runtime = mlx_runtime_gate()
    if on_apple_silicon_with_mlx() or runtime is None:
        return False
    runtime._validate_runtime = lambda: None
    runtime.use_mlx.cache_clear()
    return True


def scheduler_class_for(mlx: bool) -> type:
    """SGLang's ``Scheduler``, with the real MLX overlap mixin where the loop needs it.

    Why: ``managers/scheduler.py`` imports ``SchedulerMlxOverlapMixin`` only ``if
    is_mps()`` and otherwise defines an empty placeholder, so on Linux ``Scheduler`` has
    no ``event_loop_overlap_mlx``. The subclass adds the real mixin after the
    placeholder in the MRO; nothing is overridden.
    """
    from sglang.srt.managers.scheduler import Scheduler

    if not mlx or hasattr(Scheduler, "event_loop_overlap_mlx"):
        return Scheduler
    from sglang.srt.hardware_backend.mlx.scheduler_mixin import SchedulerMlxOverlapMixin

    return type("SchedulerWithMlxOverlapMixin", (Scheduler, SchedulerMlxOverlapMixin), {})
