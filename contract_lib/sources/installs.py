"""What is installed: the name, version and ``RECORD`` mtime of each distribution a run
depends on (SGLang, torch, mlx, mlx-lm, transformers), read once per process and search
path and revalidated by stat (the frame cache's key and the warm server's fingerprint
use it on every run; reading package metadata costs ~10 ms); and the ``SGL*``
environment SGLang reads; and a source tree's ``.py`` files with their stats."""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

STAMPED = ("sglang", "torch", "mlx", "mlx-lm", "transformers")


def python_files(root: Path) -> list[tuple[str, os.stat_result]]:
    """Every ``.py`` file under ``root`` (path relative to it, and its ``stat``), in
    ``sorted(root.rglob("*.py"))`` order and with its choices (symlinked folders are not
    entered, an unreadable folder is skipped), in about a third of its time: one
    ``scandir`` per folder instead of pathlib's per-entry objects (SGLang's 4,700 files:
    ~70 against ~230 ms on a slow sitting of a 2-core machine; a cache key and a warm
    server's fingerprint walk them once per process)."""
    found: list[tuple[list[str], os.stat_result]] = []
    folders = [(str(root), [])]
    while folders:
        folder, parts = folders.pop()
        try:
            with os.scandir(folder) as entries:
                listed = list(entries)
        except PermissionError:
            continue
        for entry in listed:
            if entry.name.endswith(".py"):
                found.append(([*parts, entry.name], entry.stat()))
            if entry.is_dir() and not entry.is_symlink():
                folders.append((entry.path, [*parts, entry.name]))
    found.sort(key=lambda item: item[0])  # as Paths sort: part by part
    return [("/".join(parts), stat) for parts, stat in found]


# (sglang_dir, sys.path) -> (stamp, the files and directories it depends on, their mtimes)
_STAMPS: dict[tuple, tuple[tuple, tuple[str, ...], tuple]] = {}


def _mtimes(paths: tuple[str, ...]) -> tuple:
    found = []
    for path in paths:
        try:
            found.append(os.stat(path).st_mtime_ns)
        except OSError:
            found.append(None)
    return tuple(found)


def install_stamp(sglang_dir: Path | None = None) -> tuple:
    """Changes whenever a distribution is installed or reinstalled. ``sglang_dir``: a
    release folder (:func:`contract_lib.sources.versions.sglang_path`) whose SGLang replaces the
    venv's. Read once per process and search path (~10 ms of package metadata), then
    reused while every ``RECORD`` file it read and every directory on the search path
    keep their mtimes (an install or removal adds or deletes entries there): a stat each."""
    import sys

    memo_key = (str(sglang_dir), tuple(sys.path))
    memo = _STAMPS.get(memo_key)
    if memo is not None and _mtimes(memo[1]) == memo[2]:
        return memo[0]
    stamp, records = _read_install_stamp(sglang_dir)
    watched = (*records, *(path or "." for path in sys.path if os.path.isdir(path or ".")),
               *([str(sglang_dir)] if sglang_dir is not None else []))
    _STAMPS[memo_key] = (stamp, watched, _mtimes(watched))
    return stamp


def _read_install_stamp(sglang_dir: Path | None) -> tuple[tuple, list[str]]:
    """The stamp (name, version, RECORD mtime per distribution) and the RECORD files read."""
    stamp, records = [], []
    for dist in STAMPED:
        if dist == "sglang" and sglang_dir is not None:
            found = list(metadata.distributions(name="sglang", path=[str(sglang_dir)]))
            if found:
                record = found[0].locate_file(f"sglang-{found[0].version}.dist-info/RECORD")
                stamp.append((dist, found[0].version, str(sglang_dir),
                              os.stat(record).st_mtime_ns))
                records.append(str(record))
            else:
                stamp.append((dist, None, str(sglang_dir), None))
            continue
        try:
            found = metadata.distribution(dist)
            version = found.version  # parses its METADATA: read once
            record = found.locate_file(f"{dist.replace('-', '_')}-{version}.dist-info/RECORD")
            stamp.append((dist, version, os.stat(record).st_mtime_ns))
            records.append(str(record))
        except (metadata.PackageNotFoundError, OSError):
            stamp.append((dist, None, None))
    return tuple(stamp), records


def installed_version(dist: str) -> str | None:
    """The venv's version of ``dist`` (one of :data:`STAMPED`), None if not installed."""
    return dict((entry[0], entry[1]) for entry in install_stamp()).get(dist)


# The variables without the SGL prefix that the scheduler's own code reads
# (``managers/schedule_policy.py``, at import: the in-batch prefix caching thresholds of
# ``lpm``), found by scanning ``srt/managers``, ``srt/mem_cache`` and the MLX backend of
# 0.5.21-0.5.23; the others there configure storage backends these runs do not build.
SCHEDULER_ENVIRONMENT = ("IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD",
                         "IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD")


def sglang_environment() -> list[tuple[str, str]]:
    """The ``SGL*`` environment variables and :data:`SCHEDULER_ENVIRONMENT`, sorted:
    SGLang reads them at import and in its code paths (e.g. ``SGLANG_IS_IN_CI`` arms the
    relay's debug asserts), so runs under other values are other runs (the frame cache's
    key) in other servers."""
    return sorted((k, v) for k, v in os.environ.items()
                  if k.startswith("SGL") or k in SCHEDULER_ENVIRONMENT)
