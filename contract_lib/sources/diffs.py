"""Upstream diffs (``--diff FILE``) applied with ``git apply`` to a hard-linked scratch copy
of a release or a source tree, built atomically and reused by digest.

``git apply`` rather than ``patch``: git is there wherever the project was cloned, and it
refuses fuzzy matches (``patch`` applies a hunk at a shifted offset with fuzz, which could
change a different function than the one reviewed).
"""

from __future__ import annotations

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
from typing import Any

from contract_lib.paths import PROJECT_ROOT
from contract_lib.sources.trees import Source, SourceError
from contract_lib.trust import UntrustedError, own_directory, read_user_file

DIFFS_DIR_ENV = "CONTRACT_LIB_DIFFS_DIR"
# The prefix of the package's files in the upstream repository's layout.
UPSTREAM_PACKAGE = "python/sglang/"
GIT_TIMEOUT_S = 120
# A diff is read only if it is a regular file of at most this many bytes (SGLang's
# largest pull requests are a few MB).
MAX_DIFF_BYTES = 64 << 20

_BUILD_LOCK = threading.Lock()




def diffs_dir() -> Path:
    return Path(os.environ.get(DIFFS_DIR_ENV) or PROJECT_ROOT / ".cache" / "sglang-diffs")


@dataclasses.dataclass(frozen=True)
class Diff:
    """One diff file: its name, text, and the hunks per file it changes (in the
    upstream layout, ``python/sglang/...``)."""

    path: Path
    text: str
    hunks: dict[str, list[str]]  # file -> its hunks' @@ header lines, in order
    strip: int = 1  # leading path parts its headers carry (a/, b/: 1; --no-prefix: 0)

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
        text = read_user_file(path, "--diff", MAX_DIFF_BYTES).decode("utf-8")
    except UntrustedError as exc:
        raise SourceError(str(exc)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SourceError(f"--diff {path}: cannot read it ({exc})") from None
    hunks: dict[str, list[str]] = {}
    prefixed: set[bool] = set()  # per file header: whether it carries a/ and b/
    current = None
    lines = text.splitlines()
    for line, following in zip(lines, lines[1:] + [""]):
        if line.startswith("--- ") and following.startswith("+++ "):
            old, new = _FILE_HEADER.match(line).group(2), _FILE_HEADER.match(following).group(1)
            current = old if new == "/dev/null" else new
            hunks.setdefault(current, [])
            prefixed.add(any(header[4:].startswith(prefix) for header, prefix in (
                (line, "a/"), (following, "b/"))))
        elif line.startswith("@@") and current is not None:
            hunks[current].append(line)
    if not any(hunks.values()):
        raise SourceError(f"--diff {path}: no unified-diff hunk in it (expected "
                          "'--- a/python/sglang/...', '+++ b/...', '@@ ... @@' as `git diff` "
                          "writes them)")
    if len(prefixed) > 1:
        raise SourceError(f"--diff {path}: some file headers carry the a/ and b/ prefixes "
                          "and some do not; write it with one `git diff` (or `diff -u`)")
    diff = Diff(path, text, hunks, strip=int(prefixed.pop()))
    if not diff.package_files():
        raise SourceError(f"--diff {path}: it changes no file under {UPSTREAM_PACKAGE} "
                          f"(files: {', '.join(hunks)}); is it in the upstream repository's "
                          "layout?")
    return diff


# Code of the package the model-free runs do not execute: on the mlx loop the model-free
# runner (contract_lib/child/shims/mlx_runner.py) stands in for SGLang's MlxModelRunner.
MODEL_FREE_STAND_INS = {
    "python/sglang/srt/hardware_backend/mlx/model_runner.py": "MlxModelRunner"}


def model_free_notes(paths: list[str | Path]) -> list[str]:
    """One line per diff that changes code a model-free mlx run does not execute."""
    notes = []
    for path in paths:
        for file in read_diff(path).package_files():
            if file in MODEL_FREE_STAND_INS:
                notes.append(f"note: --diff {path} changes {file}; on the mlx loop the "
                             f"model-free runner stands in for its "
                             f"{MODEL_FREE_STAND_INS[file]}, so that change runs only with "
                             "--runner real")
    return notes


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
    try:  # its code is imported: never a folder another user owns or can write to
        own_directory(folder.parent, 0o022, "the diff copies' folder")
    except UntrustedError as exc:
        raise SourceError(f"{exc}; nothing is imported from it") from None
    if (folder / COMPLETE).is_file():
        return
    with _BUILD_LOCK, open(folder.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (folder / COMPLETE).is_file():
            return
        tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            touched = {f.removeprefix("python/") for d in diffs for f in d.package_files()}
            _copy_base(_base_folder(base), tmp / "python", touched)
            for index, diff in enumerate(diffs):
                _apply(diff, tmp, "+".join([base.label, *(d.path.name for d in diffs[:index])]))
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


def _apply(diff: Diff, folder: Path, onto: str) -> None:
    """``git apply`` one diff's hunks under ``python/sglang/`` in ``folder`` (``onto``:
    the SGLang it applies to, for messages); a hunk that does not apply, or a file of
    the diff left unchanged, is a :class:`SourceError` naming each rejected hunk and
    file."""
    command = ["git", "apply", "--verbose", "--reject", "--whitespace=nowarn",
               f"-p{diff.strip}", f"--include={UPSTREAM_PACKAGE}*", str(diff.path.resolve())]
    before = {f: _content(folder / f) for f in diff.package_files()}
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
    if done.returncode != 0:
        crlf = (" (its lines end in CRLF, SGLang's in LF: convert it, e.g. with dos2unix)"
                if b"\r\n" in diff.path.read_bytes() else "")
        raise SourceError(f"--diff {diff.path} does not apply to sglang {onto}: "
                          f"{rejected(diff, done.stdout + done.stderr)}{crlf}")
    unchanged = [f for f, content in before.items() if _content(folder / f) == content]
    if unchanged:  # git skips a path --include does not match, and succeeds
        raise SourceError(f"--diff {diff.path}: git apply changed nothing in "
                          f"{', '.join(unchanged)} (are its paths 'a/python/sglang/...' "
                          "or 'python/sglang/...'?)")


def _content(path: Path) -> bytes | None:
    """A file's bytes (None: no such file)."""
    try:
        return path.read_bytes()
    except (FileNotFoundError, IsADirectoryError):
        return None


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
