"""Where a run's SGLang comes from: a release, a source tree, or a scratch copy with diffs.

Every source is one ``sglang_dir`` (the folder put first on the run's ``PYTHONPATH``,
holding the ``sglang`` package; None: the venv's own) with an identity that goes into the
run spec, hence the frame-cache key:

- a **release** (``sglang="0.5.22"`` / ``--sglang 0.5.22``): :mod:`contract_lib.sources.versions`;
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

Trees are :mod:`contract_lib.sources.trees`, diffs :mod:`contract_lib.sources.diffs`; this module picks.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Sequence

from contract_lib import loops
from contract_lib.sources.diffs import COMPLETE, DIFFS_DIR_ENV, with_diffs
from contract_lib.sources.trees import Source, SourceError, tree_digest, tree_source
from contract_lib.sources.versions import (
    SUPPORTED_SGLANG_VERSIONS,
    require_supported_sglang,
    sglang_path,
)

__all__ = ["COMPLETE", "DIFFS_DIR_ENV", "Source", "SourceError", "file_part", "is_path",
           "resolve", "run_sglang", "tree_digest"]


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


def run_sglang(loop: str, source: Source, sglang: str | Path | None,
               diffs: Sequence[str | Path] | None) -> dict[str, Any]:
    """The :func:`contract_lib.run` keywords that put ``loop`` on the SGLang chosen as
    ``sglang`` and ``diffs``: their ``source`` (resolved once, by :func:`resolve`); for a
    loop pinned to a release (``omni``), the choice as given, so that none lets it run on
    its own release."""
    if loops.spec(loop).sglang:
        return {"sglang": sglang, "diff": list(diffs or ()) or None}
    return {"sglang": source}


def file_part(sglang: str | Path | None, diffs: Sequence[str | Path] | None) -> str:
    """``.sglang-<release or folder name>[.diff-<file stem>...]``: the chosen SGLang in an
    output file's name ('' for the venv's)."""
    name = ""
    if sglang:
        name += f".sglang-{Path(sglang).name if is_path(sglang) else sglang}"
    return name + "".join(f".diff-{Path(diff).stem}" for diff in diffs or ())


def _base(sglang: str | Path | None) -> Source:
    if not is_path(sglang):
        version = require_supported_sglang(sglang)
        return Source(sglang_path(version), version, version, {}, release=version)
    return tree_source(Path(sglang))
