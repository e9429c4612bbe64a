"""What a run loaded from outside the installed code: the modules of a user patch and
the helpers it imports, each with its file's sha256 and the file each name was imported
from (what the frame cache key cannot know before the run; the entry records it, and is
served only while those files are unchanged and each name would still be imported from
the same file). Called in the run's process at the end of the run; the warm server looks
at what it loaded once, before it forks runs.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from contract_lib.paths import run_side_files


def _installed_roots() -> tuple[str, ...]:
    """Where installed code lives (absolute and real paths, each ending in a separator): the
    interpreter's prefixes (stdlib, the venv's site-packages), the site directories, the
    SGLang release folders and the SGLang the run imported."""
    import site
    import sys

    from contract_lib.sources.omni_release import omni_root
    from contract_lib.sources.versions import releases_dir

    roots = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
             *site.getsitepackages(), site.getusersitepackages(), str(releases_dir()),
             str(omni_root())}  # sglang-omni's folder is keyed by its install stamp
    sglang = sys.modules.get("sglang")
    if getattr(sglang, "__file__", None):  # the package itself: a module beside it in a
        roots.add(str(Path(sglang.__file__).parent))  # source tree's python/ is a user's
    return tuple({os.path.join(resolve(root), "")
                  for root in roots if root for resolve in (os.path.abspath, os.path.realpath)})


def file_hash(path: str) -> str | None:
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
    and is not one of this library's run-side modules (those are in the key): a user patch,
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
            keyed = {os.path.realpath(file) for file in run_side_files()}
        if not path.startswith(roots) and path not in keyed:
            found[path] = file_hash(path)
            names[name] = path
    return dict(sorted(found.items())), dict(sorted(names.items()))


def module_file(name: str) -> str | None:
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
