"""The frame cache key and the warm servers' fingerprint: what shapes a run, in one digest.

The key hashes everything that determines a run: the run spec (workload contents, loop,
runner, SGLang release, patch spec, server-arg overrides, and for a source tree or a copy
with diffs its identity from :mod:`contract_lib.sources.origin`: the tree's per-file
content digest, the diffs' text), the SGLang the run imports (the venv's, or the folder
chosen with ``sglang=`` / ``diff=``: version, and the path, size and mtime of every file
of the package, so an edited install is a different key), the versions of torch, mlx,
mlx-lm and Python, the source of the part of this library that runs in the run's process
(:data:`contract_lib.paths.RUN_SIDE`: an edit to the checker, the views, the campaigns or
the command line neither re-runs a cached run nor restarts a warm server), the source of
any user patch module, the ``SGL*`` environment variables SGLang reads, and the files of
any folder or file a server arg names (``model_path``: the model's config). What the key
cannot know in advance, the run reports: :mod:`contract_lib.sources.user_modules`.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import platform
from pathlib import Path
from typing import Any

from contract_lib.frames import SCHEMA_VERSION
from contract_lib.patches.builtin import PatchSpec
from contract_lib.paths import PROJECT_ROOT, run_side_files
from contract_lib.sources.installs import install_stamp, python_files, sglang_environment
from contract_lib.sources.user_modules import file_hash
from contract_lib.wire.spec import RunSpec

# In the key: the source of what runs in the run's process, and the model-free config.
LIBRARY_FILES = run_side_files()


def _digest(parts: list[Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _environment_fingerprint(sglang_dir: Path | None = None) -> str:
    """The run's SGLang files and the runtime versions (see :func:`_files_fingerprint`)."""
    if sglang_dir is None:
        return _files_fingerprint(install_stamp())
    return _files_fingerprint(install_stamp(sglang_dir), str(sglang_dir))


@functools.lru_cache(maxsize=8)
def _files_fingerprint(install_stamp: tuple, sglang_dir: str | None = None) -> str:
    """Path, size and mtime of every SGLang source file (~70 ms, so computed once per
    process and install stamp: an in-place edit of an installed file is seen by the next
    process, a reinstall immediately). ``sglang_dir``: a release folder, else the venv's."""
    if sglang_dir is not None:
        root = Path(sglang_dir) / "sglang"
    else:
        spec = importlib.util.find_spec("sglang")
        root = Path(list(spec.submodule_search_locations)[0]) if spec else None
    files = [] if root is None else [(relative, stat.st_size, stat.st_mtime_ns)
                                     for relative, stat in python_files(root)]
    return _digest([platform.python_version(), install_stamp, files])


def _library_fingerprint() -> str:
    """This library's source and model config, by content; re-read only when a file's
    size or mtime changed (a stat each)."""
    return _library_digest(tuple(_size_and_mtime(path) for path in LIBRARY_FILES))


def _size_and_mtime(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_size, stat.st_mtime_ns


@functools.lru_cache(maxsize=4)
def _library_digest(stats: tuple) -> str:
    """The files' content digest; ``stats`` (their sizes and mtimes) is only the memo key."""
    return _digest([(str(p.relative_to(PROJECT_ROOT)),
                     hashlib.sha256(p.read_bytes()).hexdigest()) for p in LIBRARY_FILES])


def code_fingerprint(sglang_dir: Path | None = None) -> str:
    """The SGLang files a run imports and this library's source, in one digest: a warm
    server started from other files is stale (:mod:`contract_lib.runs.pool`)."""
    return _digest([_environment_fingerprint(sglang_dir), _library_fingerprint()])


def _patch_sources(patch: str | None) -> list[Any]:
    """The source of every user patch module named in the spec (built-ins are library)."""
    sources = []
    for part in PatchSpec(patch or "").parts:
        module = part.partition(":")[0] if ":" in part else None
        if module is None:
            continue
        found = importlib.util.find_spec(module)
        origin = found.origin if found else None
        content = Path(origin).read_bytes() if origin and Path(origin).is_file() else b""
        sources.append((module, hashlib.sha256(content).hexdigest()))
    return sources


def key(spec: RunSpec) -> str:
    """The cache key of a run spec (see the module docstring for what goes in): its
    identity, the SGLang it imports (its ``sglang_dir``: None the venv's, a release
    folder, a source tree or a scratch copy with diffs, whose content identity the spec
    carries) and the library's run side."""
    identity = spec.identity()
    sglang_dir = None if spec.sglang_dir is None else Path(spec.sglang_dir)
    return _digest([SCHEMA_VERSION, identity, _environment_fingerprint(sglang_dir),
                    _library_fingerprint(), _patch_sources(spec.patch),
                    sglang_environment(), _named_paths(spec.user_server_args())])


_SMALL_FILE = 1 << 20  # bytes: a named folder's larger files count by size and mtime


def _named_paths(args: dict[str, Any]) -> list[tuple[str, list]]:
    """What each server arg that names an existing file or folder holds (``model_path``:
    SGLang reads the model's config there): per file (a folder's own files, not its
    subfolders), its name, size and sha256 (mtime past :data:`_SMALL_FILE`)."""
    found = []
    for name, value in sorted(args.items()):
        if isinstance(value, str) and value and os.path.exists(value):
            path = Path(value)
            files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
            found.append((name, [(f.name, st.st_size, file_hash(str(f)) if st.st_size
                                  <= _SMALL_FILE else st.st_mtime_ns)
                                 for f in files for st in [f.stat()]]))
    return found
