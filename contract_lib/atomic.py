"""Atomic file writes: whoever reads a file sees the old version or the new one, never a
truncated mix (a killed process, a full disk or a failing serializer leave the old file).

Used for frames files, traces and frame-cache entries.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import Iterator, TextIO


def temporary_name_pattern(name_regex: str) -> str:
    """The regex of the temporaries :func:`atomic_write` makes for a file whose name
    matches ``name_regex`` (so a directory's owner can recognise and remove them)."""
    return rf"\.{name_regex}\.\d+\.[0-9a-f]{{8}}\.tmp"


@contextlib.contextmanager
def atomic_write(path: str | Path) -> Iterator[TextIO]:
    """Open a temporary file beside ``path`` (same directory, so the rename is atomic) for
    writing text; when the block ends normally it replaces ``path`` (``os.replace``), when
    it raises the temporary is removed and ``path`` is left as it was. Creates the parent
    directories. No fsync: this guards against a killed process, a full disk or a failing
    serializer, not against a power cut."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        with open(temporary, "x", encoding="utf-8") as handle:
            yield handle
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise
