"""Where a run's SGLang comes from: a release, a source tree, or a scratch copy with diffs.

Every source is one ``sglang_dir`` (the folder put first on the run's ``PYTHONPATH``,
holding the ``sglang`` package; None: the venv's own) with an identity that goes into the
run spec, hence the frame-cache key:

- a **release** (``sglang="0.5.22"`` / ``--sglang 0.5.22``): :mod:`contract_lib.versions`;
  its identity is its version (the cache key adds its files' sizes and mtimes);
- a **source tree** (``sglang=PATH`` / ``--sglang PATH``): a git checkout of upstream
  SGLang (main or a pull request's branch), given as the repository root or its
  ``python/`` folder. It is checked statically before anything runs (:func:`check_tree`:
  the package, and every SGLang class and method the shims and capture hooks hook,
  :data:`ANCHORS`); its identity is a digest of the contents of every ``.py`` file of its
  package (:func:`tree_digest`, per-file hashes cached by size and mtime);
- a **scratch copy with diffs** (``diffs=[FILE, ...]`` / ``--diff FILE``): unified diffs in
  the upstream repository's layout (``a/python/sglang/...``, as ``git diff`` or a pull
  request's ``.diff`` gives them) applied in order with ``git apply`` to a copy of the
  selected release or tree in ``.cache/sglang-diffs/<digest>/python`` (or
  ``$CONTRACT_LIB_DIFFS_DIR``). The copy hard-links every file the diffs do not touch,
  is built in a temporary folder renamed into place (concurrent builds are safe), and is
  reused while its digest (the base's identity and the diffs' text) matches. A hunk
  that does not apply is a :class:`SourceError` naming each rejected hunk and file.

``git apply`` rather than ``patch``: git is there wherever the project was cloned, and it
refuses fuzzy matches (``patch`` applies a hunk at a shifted offset with fuzz, which could
change a different function than the one reviewed).
"""

from __future__ import annotations

import ast
import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any, Sequence

from contract_lib.atomic import atomic_write
from contract_lib.paths import PROJECT_ROOT
from contract_lib.versions import (SUPPORTED_SGLANG_VERSIONS, UnsupportedSGLangError,
                                   require_supported_sglang, sglang_path)

DIFFS_DIR_ENV = "CONTRACT_LIB_DIFFS_DIR"
TREE_HASHES_DIR = PROJECT_ROOT / ".cache" / "sglang-trees"
# The prefix of the package's files in the upstream repository's layout.
UPSTREAM_PACKAGE = "python/sglang/"
GIT_TIMEOUT_S = 120

# What the harness hooks or replaces in SGLang, by file of the package: a class, or a
# method of a class defined in that file (docs/contract.md and contract_lib/shims,
# capture, patches). A tree lacking one cannot be driven.
ANCHORS: dict[str, tuple[str, ...]] = {
    "sglang/srt/managers/scheduler.py": (
        "Scheduler.run_batch", "Scheduler.event_loop_normal", "Scheduler.event_loop_overlap",
        "Scheduler.ingest_requests", "Scheduler.process_batch_result",
        "Scheduler._add_request_to_queue", "Scheduler.is_fully_idle", "Scheduler.on_idle"),
    "sglang/srt/managers/tp_worker.py": ("TpModelWorker._init_model_runner",),
    "sglang/srt/managers/overlap_utils.py": ("FutureMap.stash",),
    "sglang/srt/mem_cache/memory_pool.py": ("ReqToTokenPool.write",),
    "sglang/srt/server_args.py": ("ServerArgs",),
    "sglang/srt/hardware_backend/mlx/scheduler_mixin.py": (
        "SchedulerMlxOverlapMixin.event_loop_overlap_mlx",
        "SchedulerMlxOverlapMixin._prepare_mlx_launch"),
    "sglang/srt/hardware_backend/mlx/tp_worker.py": (
        "MlxTpModelWorker._init_model_runner",
        "MlxTpModelWorker.async_forward_batch_generation_mlx",
        "MlxTpModelWorker.async_chained_decode_mlx"),
    "sglang/srt/hardware_backend/mlx/model_runner.py": (
        "MlxModelRunner", "MlxPendingPrefill", "MlxPendingExtend", "MlxPendingDecode"),
    "sglang/srt/hardware_backend/mlx/model_runner_stub.py": ("MlxModelRunnerStub",),
    "sglang/srt/hardware_backend/mlx/runtime.py": (),
}

_BUILD_LOCK = threading.Lock()
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


def resolve(sglang: str | Path | Source | None = None,
            diffs: Sequence[str | Path] | str | Path | None = ()) -> Source:
    """The source a run asked for: ``sglang`` a supported release, None (the venv's), a
    source-tree path or an already resolved :class:`Source`; then ``diffs`` applied in
    order to a scratch copy of it. Raises :class:`UnsupportedSGLangError` /
    :class:`SourceError` (set-up errors) before anything runs."""
    base = sglang if isinstance(sglang, Source) else _base(sglang)
    if isinstance(diffs, (str, Path)):
        diffs = [diffs]
    return with_diffs(base, list(diffs or ()))


def is_path(sglang: str | Path | None) -> bool:
    """Whether an ``--sglang`` value names a folder rather than a release version."""
    if sglang is None:
        return False
    if isinstance(sglang, Path):
        return True
    return sglang not in SUPPORTED_SGLANG_VERSIONS and (
        os.sep in sglang or sglang.startswith(".") or os.path.isdir(sglang)
        or not re.fullmatch(r"\d+(\.\d+)*\w*", sglang))


def _base(sglang: str | Path | None) -> Source:
    if not is_path(sglang):
        version = require_supported_sglang(sglang)
        return Source(sglang_path(version), version, version, {}, release=version)
    return tree_source(Path(sglang))


# -- source trees ------------------------------------------------------------------------------


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
    text = _read(root / "sglang" / "_version.py")
    found = re.search(r"^__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", text, re.M) or \
        re.search(r"^version\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
    if found:
        return found.group(1)
    try:
        done = subprocess.run(["git", "-C", str(root), "describe", "--tags", "--always",
                               "--dirty"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown version"
    return f"git {done.stdout.strip()}" if done.returncode == 0 and done.stdout.strip() \
        else "unknown version"


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return ""


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
        for path in sorted(package.rglob("*.py")):
            relative = str(path.relative_to(root))
            stat = path.stat()
            stamp = [stat.st_size, stat.st_mtime_ns]
            entry = known.get(relative)
            if not (isinstance(entry, list) and entry[:2] == stamp):
                entry = stamp + [hashlib.sha256(path.read_bytes()).hexdigest()]
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


# -- diffs -------------------------------------------------------------------------------------


def diffs_dir() -> Path:
    return Path(os.environ.get(DIFFS_DIR_ENV) or PROJECT_ROOT / ".cache" / "sglang-diffs")


@dataclasses.dataclass(frozen=True)
class Diff:
    """One diff file: its name, text, and the hunks per file it changes (in the
    upstream layout, ``python/sglang/...``)."""

    path: Path
    text: str
    hunks: dict[str, list[str]]  # file -> its hunks' @@ header lines, in order

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    def package_files(self) -> list[str]:
        return [f for f in self.hunks if f.startswith(UPSTREAM_PACKAGE)]


_FILE_HEADER = re.compile(r"^\+\+\+ (?:b/)?(\S+)|^--- (?:a/)?(\S+)")


def read_diff(path: str | Path) -> Diff:
    """Read a unified diff and list its files and hunks; :class:`SourceError` when the
    file cannot be read, holds no hunk, or changes nothing under ``python/sglang/``."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SourceError(f"--diff {path}: cannot read it ({exc})") from None
    hunks: dict[str, list[str]] = {}
    current = None
    lines = text.splitlines()
    for line, following in zip(lines, lines[1:] + [""]):
        if line.startswith("--- ") and following.startswith("+++ "):
            old, new = _FILE_HEADER.match(line).group(2), _FILE_HEADER.match(following).group(1)
            current = old if new == "/dev/null" else new
            hunks.setdefault(current, [])
        elif line.startswith("@@") and current is not None:
            hunks[current].append(line)
    if not any(hunks.values()):
        raise SourceError(f"--diff {path}: no unified-diff hunk in it (expected "
                          "'--- a/python/sglang/...', '+++ b/...', '@@ ... @@' as `git diff` "
                          "writes them)")
    diff = Diff(path, text, hunks)
    if not diff.package_files():
        raise SourceError(f"--diff {path}: it changes no file under {UPSTREAM_PACKAGE} "
                          f"(files: {', '.join(hunks)}); is it in the upstream repository's "
                          "layout?")
    return diff


def with_diffs(base: Source, paths: list[str | Path]) -> Source:
    """``base`` with the diffs applied in order to a scratch copy (reused while its
    digest matches); ``base`` itself when there are none."""
    if not paths:
        return base
    diffs = [read_diff(p) for p in paths]
    identity = {"base": base.identity or _release_stamp(base),
                "diffs": [{"name": d.path.name, "sha256": d.sha256} for d in diffs]}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    folder = diffs_dir() / digest[:24]
    _build(folder, base, diffs)
    names = "+".join(d.path.name for d in diffs)
    return Source(folder / "python", base.version, f"{base.label}+{names}",
                  {**identity, "sha256": digest},
                  release=base.release)


def _release_stamp(base: Source) -> dict[str, Any]:
    """A release base's identity: its version, folder and install time (the mtime of
    its dist-info ``RECORD``), so a reinstalled or replaced release is a new base."""
    folder = _base_folder(base)
    records = sorted(folder.glob(f"sglang-{base.version}.dist-info/RECORD"))
    return {"release": base.version, "folder": str(folder),
            "installed": records[0].stat().st_mtime_ns if records else None}


def _base_folder(base: Source) -> Path:
    """The folder holding the base's ``sglang/`` (and, for a release, its dist-info)."""
    if base.sglang_dir is not None:
        return base.sglang_dir
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise SourceError("no sglang installed in the venv to apply --diff to")
    return Path(list(spec.submodule_search_locations)[0]).parent


COMPLETE = ".contract_lib-diffs"


def _build(folder: Path, base: Source, diffs: list[Diff]) -> None:
    """Build the scratch copy in a temporary sibling and rename it into place, once;
    serialised across threads and processes by a lock file beside it."""
    if (folder / COMPLETE).is_file():
        return
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _BUILD_LOCK, open(folder.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / COMPLETE).is_file():
            return
        tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            touched = {f.removeprefix("python/") for d in diffs for f in d.package_files()}
            _copy_base(_base_folder(base), tmp / "python", touched)
            for diff in diffs:
                _apply(diff, tmp, base)
            _compile(tmp / "python", touched)
            (tmp / COMPLETE).write_text(json.dumps(
                {"base": base.label, "diffs": [str(d.path) for d in diffs]}, indent=1))
            if folder.exists():  # an incomplete folder left by hand
                shutil.rmtree(folder)
            os.rename(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _copy_base(source: Path, target: Path, touched: set[str]) -> None:
    """``source/sglang`` (and an ``sglang-*.dist-info`` beside it) into ``target``:
    hard links (a real copy across file systems), but real copies of the files the
    diffs change, so applying them can never write into the base."""
    def copy(src: str, dst: str) -> str:
        if os.path.relpath(src, source) in touched:
            return shutil.copy2(src, dst)
        try:
            os.link(src, dst)
            return dst
        except OSError:
            return shutil.copy2(src, dst)

    target.mkdir(parents=True)
    shutil.copytree(source / "sglang", target / "sglang", copy_function=copy)
    for info in source.glob("sglang-*.dist-info"):
        shutil.copytree(info, target / info.name, copy_function=copy)


def _apply(diff: Diff, folder: Path, base: Source) -> None:
    """``git apply`` one diff's hunks under ``python/sglang/`` in ``folder``; a hunk that
    does not apply is a :class:`SourceError` naming each rejected hunk and file."""
    command = ["git", "apply", "--verbose", "--reject", "--whitespace=nowarn",
               f"--include={UPSTREAM_PACKAGE}*", str(diff.path.resolve())]
    # Keep git from finding a repository above the scratch folder (it would apply
    # relative to that repository's root and skip every path outside the folder).
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(folder.parent)}
    try:
        done = subprocess.run(command, cwd=folder, capture_output=True, text=True,
                              timeout=GIT_TIMEOUT_S, env=env)
    except FileNotFoundError:
        raise SourceError("--diff needs git (`git apply`); install git") from None
    except subprocess.TimeoutExpired:
        raise SourceError(f"--diff {diff.path}: git apply timed out") from None
    if done.returncode == 0:
        return
    raise SourceError(f"--diff {diff.path} does not apply to sglang {base.label}: "
                      f"{rejected(diff, done.stdout + done.stderr)}")


def rejected(diff: Diff, output: str) -> str:
    """The rejected hunks and files of a ``git apply --reject --verbose`` run, as
    ``file hunk #N (@@ header @@)``, joined on one line."""
    failures: list[str] = []
    current = None
    for line in output.splitlines():
        applying = re.match(r"Applying patch (\S+) with \d+ reject", line)
        if applying:
            current = applying.group(1)
            continue
        hunk = re.match(r"Rejected hunk #(\d+)\.", line)
        if hunk and current is not None:
            number = int(hunk.group(1))
            headers = diff.hunks.get(current, [])
            header = headers[number - 1] if number <= len(headers) else ""
            failures.append(f"{current} hunk #{number} [{header.strip()}]")
            continue
        missing = re.match(r"error: (\S+): (No such file or directory|does not exist in "
                           r"index|already exists in working directory)", line)
        if missing:
            failures.append(f"{missing.group(1)}: {missing.group(2)}")
    if not failures:
        failures = [" ".join(output.split())[:400] or "git apply failed"]
    return "rejected " + "; ".join(failures)


def _compile(root: Path, touched: set[str]) -> None:
    """Byte-compile the changed files (written atomically, beside hard-linked
    ``__pycache__`` entries of the base), so runs never compile them at import."""
    import py_compile

    for relative in touched:
        path = root / relative
        if path.suffix == ".py" and path.is_file():
            try:
                py_compile.compile(str(path), doraise=True)
            except py_compile.PyCompileError as exc:
                raise SourceError(f"--diff: {relative} does not compile after the diffs: "
                                  f"{exc.msg.strip().splitlines()[-1]}") from None

