"""sglang-omni's ``OmniScheduler`` as a loop (``omni``): its install and its build.

sglang-omni (PyPI ``sglang-omni``) runs SGLang's scheduling methods on its own class by
composition (``OmniScheduler.__getattr__`` binds upstream ``Scheduler`` methods to an
``OmniScheduler``) and owns its decode loop, ``event_loop_async_decode``: each iteration
launches the current decode step and then resolves the previous one (a one-step
lookahead), with its own per-forward bookkeeping (``stamp_batch_launch``). Findings and
figures: ``docs/omni.md``.

The release is pinned: sglang-omni 0.1.9 is built on SGLang 0.5.22 (its declared
dependency), so an ``omni`` run always imports SGLang 0.5.22 from that release's folder.
sglang-omni is installed on first use into ``.cache/omni/<version>`` (or
``$CONTRACT_LIB_OMNI_DIR/<version>``) with ``pip install --no-deps --target``, together
with the one module its scheduler path imports that the venv lacks (``msgpack``); its
declared set is the CUDA serving stack (flashinfer, flash-attn, nixl, onnxruntime-gpu...)
and none of it is imported on that path. The child puts the folder on ``sys.path``
before the build; the venv is never modified.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
from pathlib import Path
from typing import Any, Callable

from contract_lib.installs import python_files
from contract_lib.loops import spec as loop_spec
from contract_lib.paths import PROJECT_ROOT
from contract_lib.versions import install_target, trusted_install

OMNI_VERSION = "0.1.9"
OMNI_SGLANG = loop_spec("omni").sglang  # sglang-omni 0.1.9 pins sglang==0.5.22
# sglang-omni itself, and what its scheduler path imports beyond the project's venv.
OMNI_REQUIREMENTS = (f"sglang-omni=={OMNI_VERSION}", "msgpack==1.2.4")
OMNI_DIR_ENV = "CONTRACT_LIB_OMNI_DIR"


def omni_root() -> Path:
    """Where sglang-omni releases are installed (one folder per version)."""
    return Path(os.environ.get(OMNI_DIR_ENV, PROJECT_ROOT / ".cache" / "omni"))


def omni_folder(version: str = OMNI_VERSION) -> Path:
    return omni_root() / version


def _complete(folder: Path) -> bool:
    return ((folder / "sglang_omni" / "scheduling" / "omni_scheduler.py").is_file()
            and (folder / f"sglang_omni-{OMNI_VERSION}.dist-info").is_dir()
            and (folder / "msgpack").is_dir())


def omni_path() -> Path:
    """The folder holding sglang-omni (installed on first use: ~3 s, 29 MB)."""
    folder = omni_folder()
    if trusted_install(folder, f"sglang-omni {OMNI_VERSION}") and _complete(folder):
        return folder
    return install_target(folder, list(OMNI_REQUIREMENTS), complete=_complete,
                          label=f"sglang-omni {OMNI_VERSION}", size_hint="~3 MB download")


def install_stamp(folder: Path) -> str:
    """A digest of every source file's path, size and mtime under ``folder``: part of
    an ``omni`` run's cache key, so an edited or reinstalled sglang-omni is a new key."""
    digest = hashlib.sha256()
    for relative, stat in python_files(folder):
        digest.update(f"{relative}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


# ------------------------------------------------------------------------------------------
# In the run's child process.
# ------------------------------------------------------------------------------------------


def install_shims(folder: str, on_launch: Callable[[Any, list[int]], None]) -> list[str]:
    """Put sglang-omni on ``sys.path`` and install its shims (``contract_lib.shims``
    section 6: platform gates, the model, the request builder) before any patch runs,
    as for the torch loops; returns their names."""
    if folder not in sys.path:
        sys.path.insert(0, folder)
    from contract_lib import shims

    applied = shims.install_omni_platform()  # before sglang_omni is first imported
    applied += shims.install_omni_unpinned_staging()
    shims.install_omni_model_free_worker()
    shims.install_omni_model_free_runner(on_launch)
    return applied + ["omni-model-free-worker", "omni-model-free-forward",
                      "omni-scripted-request-builder"]


def build_scheduler(server_args):
    """Build an ``OmniScheduler`` as sglang-omni's engine builder does for a plain-LM
    stage (``AsrEngineBuilder``): ``create_sglang_infrastructure`` (its ``ModelWorker``,
    SGLang's pools and its tree cache), the plain-LM ``ModelRunner`` with its
    ``SGLangExecutionBridge``, and the scheduler with ``enable_async_decode`` (the
    one-step-lookahead loop). Call :func:`install_shims` first."""
    from sglang_omni.model_runner.base import ModelRunner
    from sglang_omni.scheduling import bootstrap, omni_scheduler
    from sglang_omni.scheduling.sglang_backend import SGLangOutputProcessor

    from contract_lib import shims

    _want_cuda_graph, (worker, tree_cache, req_to_token_pool, allocator, model_config) = (
        bootstrap.create_sglang_infrastructure_defer_cuda_graph(server_args, 0))
    return omni_scheduler.OmniScheduler(
        tp_worker=worker, tree_cache=tree_cache, req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=allocator, server_args=server_args,
        model_config=model_config, model_runner=ModelRunner(worker, SGLangOutputProcessor()),
        request_builder=functools.partial(shims.omni_request_builder,
                                          eos_token_ids=model_config.hf_eos_token_id),
        result_adapter=shims.omni_result_adapter, enable_async_decode=True)
