"""SGLang source trees (``--sglang PATH``): checked statically before anything runs, and
identified by the contents of their package; and :class:`Source`, what every SGLang a run
can use resolves to (:mod:`contract_lib.sources.origin`)."""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import subprocess
import threading
from pathlib import Path
from typing import Any

from contract_lib.atomic import atomic_write
from contract_lib.paths import PROJECT_ROOT
from contract_lib.sources.compat import package_version
from contract_lib.sources.installs import python_files
from contract_lib.sources.versions import SUPPORTED_SGLANG_VERSIONS, UnsupportedSGLangError

TREE_HASHES_DIR = PROJECT_ROOT / ".cache" / "sglang-trees"

# What the harness hooks or replaces in SGLang, by file of the package: a class, or a
# method of a class defined in that file (docs/contract.md and contract_lib/child/shims,
# capture). A tree lacking one cannot be driven. What only some releases have is probed
# by contract_lib.sources.compat (the step boundary ``ingest_requests``, 0.5.20+; the MLX runtime
# gate ``hardware_backend/mlx/runtime.py``, 0.5.19+) or refused by the patch that needs
# it (``_prepare_mlx_launch``, 0.5.17+).
ANCHORS: dict[str, tuple[str, ...]] = {
    "sglang/srt/managers/scheduler.py": (
        "Scheduler.run_batch", "Scheduler.event_loop_normal", "Scheduler.event_loop_overlap",
        "Scheduler.process_batch_result", "Scheduler._add_request_to_queue",
        "Scheduler.is_fully_idle", "Scheduler.on_idle"),
    "sglang/srt/managers/tp_worker.py": ("TpModelWorker._init_model_runner",),
    "sglang/srt/managers/overlap_utils.py": ("FutureMap.stash",),
    "sglang/srt/mem_cache/memory_pool.py": ("ReqToTokenPool.write",),
    "sglang/srt/server_args.py": ("ServerArgs",),
    "sglang/srt/hardware_backend/mlx/scheduler_mixin.py": (
        "SchedulerMlxOverlapMixin.event_loop_overlap_mlx",),
    "sglang/srt/hardware_backend/mlx/tp_worker.py": (
        "MlxTpModelWorker._init_model_runner",
        "MlxTpModelWorker.async_forward_batch_generation_mlx",
        "MlxTpModelWorker.async_chained_decode_mlx"),
    "sglang/srt/hardware_backend/mlx/model_runner.py": (
        "MlxModelRunner", "MlxPendingPrefill", "MlxPendingExtend", "MlxPendingDecode"),
    "sglang/srt/hardware_backend/mlx/model_runner_stub.py": ("MlxModelRunnerStub",),
}

_HASH_LOCK = threading.Lock()


class SourceError(UnsupportedSGLangError):
    """A source tree the harness cannot drive, or a diff that cannot be applied (a set-up
    error: exit 2)."""


@dataclasses.dataclass(frozen=True)
class Source:
    """One SGLang for a run.

    ``sglang_dir``: the folder holding ``sglang/`` to put first on ``PYTHONPATH`` (None:
    the venv's). ``version``: the release the child must import (checked there against
    its metadata), None for a source tree (its metadata may be the venv's). ``label``:
    how reports name it (the frames' ``sglang_version``). ``identity``: what the run spec
    and the cache key record (JSON; empty for a plain release, whose version the spec
    already holds).
    """

    sglang_dir: Path | None
    version: str | None
    label: str
    identity: dict[str, Any]
    release: str | None = None  # the release this is (or is a copy of), if any



def package_root(path: Path) -> Path:
    """The folder holding ``sglang/__init__.py``: ``path`` itself, its ``python/`` (a
    repository root), or its parent (``path`` is the package)."""
    path = path.expanduser().resolve()
    if not path.is_dir():
        raise SourceError(f"--sglang {path}: no such directory (give a release "
                          f"{', '.join(SUPPORTED_SGLANG_VERSIONS)}, or an SGLang checkout: "
                          "the repository root or its python/ folder)")
    for root in (path / "python", path, path.parent):
        if (root / "sglang" / "__init__.py").is_file():
            return root
    raise SourceError(f"--sglang {path}: no sglang package there (looked for "
                      f"{path / 'python/sglang/__init__.py'} and "
                      f"{path / 'sglang/__init__.py'}); give the repository root or its "
                      "python/ folder")


def missing_anchors(root: Path) -> list[str]:
    """The anchors of :data:`ANCHORS` that the package under ``root`` lacks, one entry
    per file: ``file (Class.method, ...)``; empty when the harness can drive it."""
    missing = []
    for relative, names in ANCHORS.items():
        path = root / relative
        if not path.is_file():
            missing.append(f"{relative} (no such file)")
            continue
        try:
            found = _definitions(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError) as exc:
            missing.append(f"{relative} (unparsable: {exc})")
            continue
        absent = [name for name in names if name not in found]
        if absent:
            missing.append(f"{relative} ({', '.join(absent)})")
    return missing


def _definitions(text: str) -> set[str]:
    """Top-level class names and ``Class.method`` names defined in a module's source."""
    names = set()
    for node in ast.parse(text).body:
        if isinstance(node, ast.ClassDef):
            names.add(node.name)
            names.update(f"{node.name}.{item.name}" for item in node.body
                         if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)))
    return names


def check_tree(path: Path) -> Path:
    """The package root of an SGLang source tree the harness can drive, or a one-line
    :class:`SourceError` saying what is missing."""
    root = package_root(path)
    missing = missing_anchors(root)
    if missing:
        raise SourceError(
            f"--sglang {path}: not an SGLang contract_lib can drive ({tree_version(root)}); "
            f"missing: {'; '.join(missing)}")
    return root


def tree_version(root: Path) -> str:
    """The tree's version: ``sglang/_version.py`` (written by the build), else
    ``git describe`` of its checkout, else ``unknown version``."""
    built = package_version(root / "sglang")
    if built:
        return built
    try:
        done = subprocess.run(["git", "-C", str(root), "describe", "--tags", "--always",
                               "--dirty"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown version"
    return f"git {done.stdout.strip()}" if done.returncode == 0 and done.stdout.strip() \
        else "unknown version"


def tree_source(path: Path) -> Source:
    """A checked source tree as a run's SGLang (see the module docstring)."""
    root = check_tree(path)
    version = tree_version(root)
    digest = tree_digest(root)
    return Source(root, None, f"{version} (tree {root}, {digest[:12]})",
                  {"tree": str(root), "version": version, "sha256": digest})


def tree_digest(root: Path) -> str:
    """sha256 over the relative path and content sha256 of every ``.py`` file under
    ``root/sglang``. Each file's hash is reused while its size and mtime are unchanged
    (kept in ``.cache/sglang-trees/<sha of root>.json``), so a repeat costs one ``stat``
    per file."""
    package = root / "sglang"
    record_path = TREE_HASHES_DIR / f"{hashlib.sha256(str(root).encode()).hexdigest()[:24]}.json"
    with _HASH_LOCK:
        try:
            known = json.loads(record_path.read_text())
        except (OSError, ValueError):
            known = {}
        current, changed = {}, False
        for inside, stat in python_files(package):
            relative = f"sglang/{inside}"
            stamp = [stat.st_size, stat.st_mtime_ns]
            entry = known.get(relative)
            if not (isinstance(entry, list) and entry[:2] == stamp):
                entry = stamp + [hashlib.sha256((package / inside).read_bytes()).hexdigest()]
                changed = True
            current[relative] = entry
        if changed or current.keys() != known.keys():
            try:
                with atomic_write(record_path) as handle:
                    json.dump(current, handle)
            except OSError:
                pass  # best effort: the next process hashes again
    return hashlib.sha256(json.dumps(
        [(relative, entry[2]) for relative, entry in current.items()]).encode()).hexdigest()
