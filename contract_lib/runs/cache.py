"""A frame cache: a finished run is never executed twice with the same inputs.

Entries are keyed by :func:`contract_lib.runs.fingerprint.key` (everything that shapes a
run). Only ``finished`` runs are stored; faults always rerun.

What the key cannot know in advance, the entry records: the file and sha256 of every
module the run loaded from outside the installed code (a user patch and the helper
modules it imports; reported by the run's child,
:func:`contract_lib.sources.user_modules.user_modules`), and the file each of their names
was imported from. An entry is served only while those files are
unchanged and each name would still be imported from the same file (``sys.path`` and the
working directory as they are now; a package or a symlink put in its way is another
file), and only if it is a frames file of this
schema whose meta matches the run asked for; anything else is deleted with a one-line
:class:`CacheWarning` and the run executes again. Storing is best effort: an unwritable
or full directory costs one warning, never the run. Entries are written atomically.

Bypass with ``run(..., cache=False)``, ``--no-cache`` or ``CONTRACT_LIB_NO_CACHE=1``;
clear with :func:`clear` or ``python -m contract_lib cache clear``. The cache lives in
``$CONTRACT_LIB_CACHE_DIR`` (when set and not empty), else ``.cache/frames`` in the project
checkout. A directory the cache creates or finds empty (and the default one) gets a marker
file; :func:`clear` only touches a marked directory, and there only the ``<sha256>.json``
entries and their temporaries.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import stat
import warnings
from pathlib import Path
from typing import Any

from contract_lib.atomic import temporary_name_pattern
from contract_lib.frames import (
    Frames,
    FramesFormatError,
    parse_payload,
    write_payload,
)
from contract_lib.paths import PROJECT_ROOT
from contract_lib.sources.user_modules import file_hash, module_file
from contract_lib.trust import UntrustedError, open_owned

DEFAULT_DIR = PROJECT_ROOT / ".cache" / "frames"


def cache_dir() -> Path:
    """``$CONTRACT_LIB_CACHE_DIR`` when set and not empty, else :data:`DEFAULT_DIR`."""
    return Path(os.environ.get("CONTRACT_LIB_CACHE_DIR") or DEFAULT_DIR)


def enabled() -> bool:
    return os.environ.get("CONTRACT_LIB_NO_CACHE", "") in ("", "0")


# -- entries ----------------------------------------------------------------------------------


class CacheWarning(UserWarning):
    """A cache entry was discarded, or a run could not be stored (the run is unaffected)."""


class CacheDirError(ValueError):
    """``cache clear`` on a directory the frame cache did not create."""


MARKER = ".contract_lib-frame-cache"
_ENTRY = r"[0-9a-f]{64}\.json"
_OWN_NAME = re.compile(rf"{_ENTRY}|{temporary_name_pattern(_ENTRY)}")
# The spec entries of ``meta`` an entry must match (what :func:`contract_lib.run` asked for).
SPEC_META = ("workload", "loop", "patch", "runner", "sglang_version", "server_args")
_warned: set[str] = set()


def _warn(message: str, once: str | None = None) -> None:
    """A one-line :class:`CacheWarning` (attributed to this module, not to a source line,
    so it prints as one line); with ``once``, only the first time per process."""
    if once is not None:
        if once in _warned:
            return
        _warned.add(once)
    warnings.warn_explicit(message, CacheWarning, filename=__name__, lineno=0)


def _entry_path(run_key: str) -> Path:
    return cache_dir() / f"{run_key}.json"


def _mismatch(meta: dict[str, Any], run_key: str, expected: dict[str, Any]) -> str | None:
    """Why an entry's meta does not belong to this run (None: it does)."""
    wanted = json.loads(json.dumps({name: expected.get(name) for name in SPEC_META},
                                   default=str))
    for name, value in wanted.items():
        if meta.get(name) != value:
            return f"its {name} is {meta.get(name)!r}, the run asks for {value!r}"
    if meta["status"] != "finished":
        return f"its run is {meta['status']}, only finished runs are cached"
    if meta.get("cache_key") != run_key:
        return "it was stored under another key"
    modules = meta.get("user_modules")
    if not isinstance(modules, dict) or not all(
            isinstance(p, str) and isinstance(h, str) for p, h in modules.items()):
        return "it has no valid user_modules record"
    return None


def _discard(path: Path, reason: str) -> None:
    _warn(f"frame cache: discarded {path} ({reason}); running again")
    with contextlib.suppress(OSError):
        path.unlink()


def _tables_digest(tables: dict[str, Any]) -> str:
    """sha256 of a payload's tables (JSON-native, so the same before and after a save)."""
    return hashlib.sha256(json.dumps(tables, sort_keys=True).encode()).hexdigest()


def load(run_key: str, expected: dict[str, Any]) -> Frames | None:
    """The cached frames of ``run_key``, or None. ``expected``: the run's meta before it
    runs (workload, loop, patch, runner, sglang_version, server_args). An entry that is
    unreadable, of another schema or shape, edited since it was stored, or whose meta does
    not match ``expected`` is deleted with a :class:`CacheWarning`; one whose user modules
    changed since it was stored is a plain miss (the new run replaces it)."""
    path = _entry_path(run_key)
    try:  # only this user's entries are believed (the directory may be shared)
        with open(open_owned(path, os.O_RDONLY, "frame cache entry"), encoding="utf-8",
                  closefd=True) as handle:
            text = handle.read()
        payload = parse_payload(text, path)
        frames = Frames.from_payload(payload, path)  # FramesFormatError: a value's type
    except FileNotFoundError:
        return None
    except UntrustedError as exc:
        _warn(f"frame cache: ignored {exc}; running again", once=f"untrusted {path}")
        return None
    except FramesFormatError as exc:
        _discard(path, str(exc).removeprefix(f"{path}: "))
        return None
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8
        _discard(path, f"unreadable: {exc}")
        return None
    meta = payload["meta"]
    problem = _mismatch(meta, run_key, expected)
    if problem is None and meta.get("tables_sha256") != _tables_digest(payload["tables"]):
        problem = "its tables changed after it was stored"
    if problem is not None:
        _discard(path, problem)
        return None
    if any(file_hash(p) != h for p, h in meta["user_modules"].items()):
        return None
    names = meta.get("user_module_names", {})
    if names:
        importlib.invalidate_caches()  # a file or folder created since the last import
        if any(module_file(name) != path for name, path in names.items()):
            return None  # a name would now be imported from another file: run it
    for name in ("cache_key", "tables_sha256"):
        del frames.meta[name]
    frames.meta["cached"] = True
    return frames


def store(run_key: str, frames: Frames) -> None:
    """Store a finished run (best effort: a failure is one :class:`CacheWarning` per
    directory and process, and the run is unaffected). Runs that loaded a user module
    whose file could not be read are not stored (they cannot be keyed)."""
    if frames.status != "finished":
        return
    modules = frames.meta.get("user_modules")
    if not isinstance(modules, dict) or None in modules.values():
        unreadable = [p for p, h in (modules or {}).items() if h is None]
        _warn(f"frame cache: not storing the run: it loaded modules whose source cannot "
              f"be read ({', '.join(unreadable) or 'no module record'})",
              once=f"unkeyable {unreadable}")
        return
    directory = cache_dir()
    try:
        payload = frames.to_payload()
        payload["meta"] = {**payload["meta"], "cache_key": run_key,
                           "tables_sha256": _tables_digest(payload["tables"])}
        _claim(directory)
        write_payload(directory / f"{run_key}.json", payload, compact=True)
    except (OSError, TypeError, ValueError) as exc:
        _warn(f"frame cache: could not store runs in {directory} ({exc}); they will run "
              "again next time", once=f"store {directory}")


def _is_default(directory: Path) -> bool:
    return directory.resolve() == DEFAULT_DIR.resolve()


def _claim(directory: Path) -> None:
    """Create the cache directory and mark it as the cache's own, only when the cache
    creates it, finds it empty, or it is the default one in the project checkout (a
    directory of the user's keeps no marker, so :func:`clear` leaves it alone)."""
    marker = directory / MARKER
    if marker.exists():
        return
    directory.mkdir(parents=True, exist_ok=True)
    if _is_default(directory) or not any(directory.iterdir()):
        marker.write_text("contract_lib frame cache: `python -m contract_lib cache clear` "
                          "deletes the <sha256>.json entries in this directory\n")


def _owned_file(path: Path) -> bool:
    """A regular file (not a link) of this user: the only kind :func:`clear` deletes."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid()


def clear() -> int:
    """Delete every cached run (and temporaries the cache left); returns how many runs
    there were. Deletes only the cache's own file names, and only in a directory that
    carries the cache's marker (or is the default one); raises :class:`CacheDirError` for
    any other directory."""
    directory = cache_dir()
    if not directory.exists():
        return 0
    if not (directory / MARKER).is_file() and not _is_default(directory):
        raise CacheDirError(
            f"{directory} is not a frame cache directory (no {MARKER} file): nothing "
            "removed; delete its <sha256>.json files yourself if they are cache entries")
    own = [path for path in directory.iterdir()
           if _OWN_NAME.fullmatch(path.name) and _owned_file(path)]
    for path in own:
        path.unlink(missing_ok=True)
    return sum(not path.name.startswith(".") for path in own)  # temporaries are not runs
