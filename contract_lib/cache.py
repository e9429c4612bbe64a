"""A frame cache: a finished run is never executed twice with the same inputs.

The key hashes everything that determines a run: the run spec (workload contents, loop,
runner, SGLang release, patch spec, server-arg overrides), the SGLang the run imports
(the venv's, or the release folder chosen with ``sglang=``: version, and the path, size
and mtime of every file of the package, so an edited install is a different key), the
versions of torch, mlx, mlx-lm and Python, this library's own source and data files, and
the source of any user patch module. Only ``finished`` runs are stored; faults always rerun.

Bypass with ``run(..., cache=False)``, ``--no-cache`` or ``CONTRACT_LIB_NO_CACHE=1``;
clear with :func:`clear` or ``python -m contract_lib cache clear``. The cache lives in
``$CONTRACT_LIB_CACHE_DIR``, else ``.cache/frames`` in the project checkout.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import platform
import shutil
from importlib import metadata
from pathlib import Path
from typing import Any

from contract_lib.frames import SCHEMA_VERSION, Frames

PROJECT_ROOT = Path(__file__).resolve().parent.parent
# The modules whose code determines a run's frames (not the checker or presentation).
_RUN_MODULES = ("cache", "capture", "effects", "frames", "harness", "kvpool", "patches",
                "pool", "shims", "tiny_model", "versions", "workloads")
LIBRARY_FILES = sorted(
    [*(Path(__file__).parent / f"{name}.py" for name in _RUN_MODULES),
     PROJECT_ROOT / "data" / "model" / "config.json"])


def cache_dir() -> Path:
    return Path(os.environ.get("CONTRACT_LIB_CACHE_DIR", PROJECT_ROOT / ".cache" / "frames"))


def enabled() -> bool:
    return os.environ.get("CONTRACT_LIB_NO_CACHE", "") in ("", "0")


def _digest(parts: list[Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _install_stamp(sglang_dir: Path | None = None) -> tuple:
    """Cheap (~1 ms): changes whenever a distribution is installed or reinstalled.
    ``sglang_dir``: a release folder (:func:`contract_lib.versions.sglang_path`) whose
    SGLang replaces the venv's."""
    stamp = []
    for dist in ("sglang", "torch", "mlx", "mlx-lm", "transformers"):
        if dist == "sglang" and sglang_dir is not None:
            found = list(metadata.distributions(name="sglang", path=[str(sglang_dir)]))
            if found:
                record = found[0].locate_file(f"sglang-{found[0].version}.dist-info/RECORD")
                stamp.append((dist, found[0].version, str(sglang_dir),
                              os.stat(record).st_mtime_ns))
            else:
                stamp.append((dist, None, str(sglang_dir), None))
            continue
        try:
            record = metadata.distribution(dist).locate_file(
                f"{dist.replace('-', '_')}-{metadata.version(dist)}.dist-info/RECORD")
            stamp.append((dist, metadata.version(dist), os.stat(record).st_mtime_ns))
        except (metadata.PackageNotFoundError, OSError):
            stamp.append((dist, None, None))
    return tuple(stamp)


def _environment_fingerprint(sglang_dir: Path | None = None) -> str:
    """The run's SGLang files and the runtime versions (see :func:`_files_fingerprint`)."""
    if sglang_dir is None:
        return _files_fingerprint(_install_stamp())
    return _files_fingerprint(_install_stamp(sglang_dir), str(sglang_dir))


@functools.lru_cache(maxsize=8)
def _files_fingerprint(install_stamp: tuple, sglang_dir: str | None = None) -> str:
    """Path, size and mtime of every SGLang source file (~150 ms, so computed once per
    process and install stamp: an in-place edit of an installed file is seen by the next
    process, a reinstall immediately). ``sglang_dir``: a release folder, else the venv's."""
    if sglang_dir is not None:
        root = Path(sglang_dir) / "sglang"
    else:
        spec = importlib.util.find_spec("sglang")
        root = Path(list(spec.submodule_search_locations)[0]) if spec else None
    files = []
    if root is not None:
        for path in sorted(root.rglob("*.py")):
            stat = path.stat()
            files.append((str(path.relative_to(root)), stat.st_size, stat.st_mtime_ns))
    return _digest([platform.python_version(), install_stamp, files])


def _library_fingerprint() -> str:
    return _digest([(p.name, hashlib.sha256(p.read_bytes()).hexdigest())
                    for p in LIBRARY_FILES])


def _patch_sources(patch: str | None) -> list[Any]:
    """The source of every user patch module named in the spec (built-ins are library)."""
    sources = []
    for part in (patch or "").split("+"):
        module = part.partition(":")[0] if ":" in part else None
        if module is None:
            continue
        found = importlib.util.find_spec(module)
        origin = found.origin if found else None
        content = Path(origin).read_bytes() if origin and Path(origin).is_file() else b""
        sources.append((module, hashlib.sha256(content).hexdigest()))
    return sources


def key(spec: dict[str, Any], sglang_dir: Path | None = None) -> str:
    """The cache key of a run spec (see the module docstring for what goes in);
    ``sglang_dir`` is the release folder the run imports SGLang from (None: the venv)."""
    return _digest([SCHEMA_VERSION, spec, _environment_fingerprint(sglang_dir),
                    _library_fingerprint(), _patch_sources(spec.get("patch"))])


def load(run_key: str) -> Frames | None:
    path = cache_dir() / f"{run_key}.json"
    if not path.exists():
        return None
    try:
        frames = Frames.load(path)
    except ValueError:
        return None
    frames.meta["cached"] = True
    return frames


def store(run_key: str, frames: Frames) -> None:
    if frames.status != "finished":
        return
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{run_key}.{os.getpid()}.tmp"
    frames.save(tmp)
    tmp.replace(directory / f"{run_key}.json")


def clear() -> int:
    """Delete every cached run; returns how many there were."""
    directory = cache_dir()
    count = len(list(directory.glob("*.json"))) if directory.exists() else 0
    shutil.rmtree(directory, ignore_errors=True)
    return count
