"""sglang-omni's release, as a run's source: installed on first use, pinned to SGLang 0.5.22.

What sglang-omni (PyPI ``sglang-omni``) is and how its loop runs:
:mod:`contract_lib.child.omni_build`; findings and figures: ``docs/omni.md``.

The release is pinned: sglang-omni 0.1.9 is built on SGLang 0.5.22 (its declared
dependency), so an ``omni`` run always imports SGLang 0.5.22 from that release's folder.
sglang-omni is installed on first use into ``.cache/omni/<version>`` (or
``$CONTRACT_LIB_OMNI_DIR/<version>``) with ``pip install --no-deps --target``, together
with the one module its scheduler path imports that the venv lacks (``msgpack``); its
declared set is the CUDA serving stack (flashinfer, flash-attn, nixl, onnxruntime-gpu...)
and none of it is imported on that path. The child puts the folder on ``sys.path``
before the build (:mod:`contract_lib.child.omni_build`); the venv is never modified.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from contract_lib.loops import OMNI, LoopSpec, spec as loop_spec
from contract_lib.paths import PROJECT_ROOT
from contract_lib.sources.installs import python_files
from contract_lib.sources.versions import install_target, trusted_install

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


def companion(loop: LoopSpec) -> tuple[dict[str, str] | None, Path | None]:
    """What a run of ``loop`` imports beside SGLang: for sglang-omni's loop, its release
    (version and install stamp, part of the run's identity) and folder, installed on
    first use; (None, None) for every other loop."""
    if loop.family != OMNI:
        return None, None
    folder = omni_path()
    return {"version": OMNI_VERSION, "files": install_stamp(folder)}, folder
