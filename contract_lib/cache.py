"""A frame cache: a finished run is never executed twice with the same inputs.

The key hashes everything that determines a run: the run spec (workload contents, loop,
runner, SGLang release, patch spec, server-arg overrides, and for a source tree or a copy
with diffs its identity from :mod:`contract_lib.sources`: the tree's per-file content
digest, the diffs' text), the SGLang the run imports (the venv's, or the folder chosen
with ``sglang=`` / ``diff=``: version, and the path, size and mtime of every file of the
package, so an edited install is a different key), the
versions of torch, mlx, mlx-lm and Python, this library's own source and data files, the
source of any user patch module, the ``SGL*`` environment variables SGLang reads, and the
files of any folder or file a server arg names (``model_path``: the model's config).
Only ``finished`` runs are stored; faults always rerun.

What the key cannot know in advance, the entry records: the file and sha256 of every
module the run loaded from outside the installed code (a user patch and the helper
modules it imports; reported by the run's child, :func:`user_modules`), and the file each
of their names was imported from. An entry is served only while those files are
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
import functools
import hashlib
import importlib.util
import json
import os
import platform
import re
import stat
import warnings
from pathlib import Path
from typing import Any

from contract_lib.atomic import temporary_name_pattern
from contract_lib.frames import (SCHEMA_VERSION, Frames, FramesFormatError, parse_payload,
                                 write_payload)
from contract_lib.installs import install_stamp, python_files, sglang_environment
from contract_lib.patches import PatchSpec
from contract_lib.paths import MODEL_DIR, PACKAGE_DIR, PROJECT_ROOT
from contract_lib.trust import UntrustedError, open_owned

# In the key: the whole package's source (a new module cannot be forgotten; an edit to the
# checker or the views re-runs too, which costs seconds) and the model-free model config.
LIBRARY_FILES = sorted([*PACKAGE_DIR.rglob("*.py"), MODEL_DIR / "config.json"])
DEFAULT_DIR = PROJECT_ROOT / ".cache" / "frames"


def cache_dir() -> Path:
    """``$CONTRACT_LIB_CACHE_DIR`` when set and not empty, else :data:`DEFAULT_DIR`."""
    return Path(os.environ.get("CONTRACT_LIB_CACHE_DIR") or DEFAULT_DIR)


def enabled() -> bool:
    return os.environ.get("CONTRACT_LIB_NO_CACHE", "") in ("", "0")


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
    server started from other files is stale (:mod:`contract_lib.pool`)."""
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


def key(spec: dict[str, Any], sglang_dir: Path | None = None) -> str:
    """The cache key of a run spec (see the module docstring for what goes in);
    ``sglang_dir`` is the folder the run imports SGLang from (None: the venv): a release
    folder, a source tree or a scratch copy with diffs, whose content identity the spec
    carries (``sglang_source``)."""
    return _digest([SCHEMA_VERSION, spec, _environment_fingerprint(sglang_dir),
                    _library_fingerprint(), _patch_sources(spec.get("patch")),
                    sglang_environment(), _named_paths(spec)])


_SMALL_FILE = 1 << 20  # bytes: a named folder's larger files count by size and mtime


def _named_paths(spec: dict[str, Any]) -> list[tuple[str, list]]:
    """What each server arg that names an existing file or folder holds (``model_path``:
    SGLang reads the model's config there): per file (a folder's own files, not its
    subfolders), its name, size and sha256 (mtime past :data:`_SMALL_FILE`)."""
    workload = spec.get("workload")
    args = {**(workload.get("server_args") or {} if isinstance(workload, dict) else {}),
            **(spec.get("server_args") or {})}
    found = []
    for name, value in sorted(args.items()):
        if isinstance(value, str) and value and os.path.exists(value):
            path = Path(value)
            files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
            found.append((name, [(f.name, st.st_size, _file_hash(str(f)) if st.st_size
                                  <= _SMALL_FILE else st.st_mtime_ns)
                                 for f in files for st in [f.stat()]]))
    return found


# -- user modules (what the key cannot know before the run) --------------------------------


def _installed_roots() -> tuple[str, ...]:
    """Where installed code lives (absolute and real paths, each ending in a separator): the
    interpreter's prefixes (stdlib, the venv's site-packages), the site directories, the
    SGLang release folders and the SGLang the run imported."""
    import site
    import sys

    from contract_lib.omni import omni_root
    from contract_lib.versions import releases_dir

    roots = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
             *site.getsitepackages(), site.getusersitepackages(), str(releases_dir()),
             str(omni_root())}  # sglang-omni's folder is keyed by its install stamp
    sglang = sys.modules.get("sglang")
    if getattr(sglang, "__file__", None):  # the package itself: a module beside it in a
        roots.add(str(Path(sglang.__file__).parent))  # source tree's python/ is a user's
    return tuple({os.path.join(resolve(root), "")
                  for root in roots if root for resolve in (os.path.abspath, os.path.realpath)})


def _file_hash(path: str) -> str | None:
    """sha256 of a file's bytes; None when it cannot be read."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


# (In a warm server's forked run.) The modules the server had loaded, by identity, and
# what :func:`user_modules` found among them (see :func:`remember_loaded_modules`).
_LOADED_BEFORE: tuple[dict[str, int], dict[str, str | None], dict[str, str]] = ({}, {}, {})


def remember_loaded_modules() -> None:
    """Called in the warm server before it forks runs: looks at the ~6000 modules loaded
    so far once, so each forked run's :func:`user_modules` looks only at those it loaded
    itself."""
    import sys

    global _LOADED_BEFORE
    _LOADED_BEFORE = ({}, {}, {})
    files, names = user_modules()
    _LOADED_BEFORE = ({name: id(module) for name, module in list(sys.modules.items())},
                      files, names)


def _modules_since_fork() -> list[tuple[str, Any]]:
    """``sys.modules`` entries added since :func:`remember_loaded_modules` (all of them
    outside a warm server's run), read from the newest back to the server's last one.

    Why not all ~6700: reading an entry writes its module's reference count, so in a
    forked run every module object's page is copied (~18 ms of every run). Entries are in
    insertion order, so new ones are at the end. Not seen: a module object put in place
    of one the server had loaded under the same name (``sys.modules[name] = other``);
    a module imported the usual way gets its own entry, at the end."""
    import sys

    before = _LOADED_BEFORE[0]
    if not before:
        return list(sys.modules.items())
    added = len(sys.modules) - len(before)  # the entries to read at least
    last = next(reversed(before))
    try:
        taken = []
        for name, module in reversed(sys.modules.items()):
            taken.append((name, module))
            if name == last and before[name] == id(module) and len(taken) > added:
                return taken
    except RuntimeError:  # another thread imported meanwhile
        pass
    return list(sys.modules.items())


def user_modules() -> tuple[dict[str, str | None], dict[str, str]]:
    """Called in the run's child at the end of the run: ``{file: sha256}`` of every
    loaded module whose file lies outside the installed code (:func:`_installed_roots`)
    and is not one of this library's modules (those are in the key): a user patch,
    every module of the user's own that it imported, and any other module of this
    checkout. None for a file that cannot be read (such a run is not cached). And
    ``{module name: file}`` of the same modules (files as real paths)."""
    roots = _installed_roots()
    keyed: set[str] | None = None  # this library's files (~1 ms of realpath): when needed
    loaded_before = _LOADED_BEFORE[0]
    found, names = dict(_LOADED_BEFORE[1]), dict(_LOADED_BEFORE[2])
    for name, module in _modules_since_fork():
        if loaded_before.get(name) == id(module):
            continue  # the warm server's, looked at before the fork
        try:
            spec = vars(module).get("__spec__")
        except TypeError:  # not a module object
            continue
        if not getattr(spec, "has_location", False) or not isinstance(spec.origin, str):
            continue  # built-in, frozen, namespace or made up: no file of its own
        if spec.origin.startswith(roots):  # the common case: no stat
            continue
        path = os.path.realpath(spec.origin)
        if keyed is None:
            keyed = {os.path.realpath(file) for file in LIBRARY_FILES}
        if not path.startswith(roots) and path not in keyed:
            found[path] = _file_hash(path)
            names[name] = path
    return dict(sorted(found.items())), dict(sorted(names.items()))


def _module_file(name: str) -> str | None:
    """The real path of the file ``name`` would be imported from now (``sys.path`` as it
    is, the parent packages' folders), found without importing anything; None when
    no file would be found."""
    from importlib.machinery import PathFinder

    parts, search, spec = name.split("."), None, None
    for depth in range(1, len(parts) + 1):
        if depth > 1 and search is None:
            return None  # the parent is not a package
        spec = PathFinder.find_spec(".".join(parts[:depth]), search)
        if spec is None:
            return None
        search = spec.submodule_search_locations
    return os.path.realpath(spec.origin) if isinstance(spec.origin, str) else None


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
    if any(_file_hash(p) != h for p, h in meta["user_modules"].items()):
        return None
    names = meta.get("user_module_names", {})
    if names:
        importlib.invalidate_caches()  # a file or folder created since the last import
        if any(_module_file(name) != path for name, path in names.items()):
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
