"""The run's message journal: shared memory the run's process appends its pickled
messages to, read by the process that asked for the run.

Why: a pipe carries a message with a system call, and on a 2-core virtual machine that
call was ~4% of a short loop's CPU; storing into shared memory is not a call at all.
Nothing is lost when the run's process dies: what it stored is in the shared file,
which the reader reads to the end once the process is gone. The pipe still says when
to read (:data:`NOTE`, ``(NOTE, offset)``: everything before ``offset`` is stored; sent
within :data:`NOTE_S` seconds of a store, and at once after the run's end) and carries
every message once the journal is full, after a last note.

Layout: records at 8-byte aligned offsets, each a little-endian u32 length and that
many bytes of pickle; the length is stored after the bytes, so a zero length ends what
was stored (a process that died mid-record left a zero there).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import struct
import tempfile
from typing import Any, Iterator

NOTE = "journal"  # the pipe message: (NOTE, offset)
NOTE_S = 0.25  # seconds a stored message waits for its note at most (the hang check reads notes)
SIZE = 256 << 20  # bytes of (sparse) shared memory per run; past it, the pipe
PREFAULT = 256 << 10  # bytes of it a writer allocates up front (a short run's ~40 KB fit)
_LENGTH = struct.Struct("<I")


def create() -> int:
    """A fresh journal's file descriptor: an anonymous shared-memory file (Linux
    ``memfd``; an unlinked temporary file elsewhere) of :data:`SIZE` bytes, none of
    them allocated until written."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("contract_lib-journal", os.MFD_CLOEXEC)
    else:
        handle = tempfile.TemporaryFile(prefix="contract_lib-journal-")
        fd = os.dup(handle.fileno())
        handle.close()
    try:
        os.ftruncate(fd, SIZE)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def created() -> Iterator[int]:
    """:func:`create`, closed on leaving (the memory goes with the last mapping)."""
    fd = create()
    try:
        yield fd
    finally:
        os.close(fd)


def _aligned(offset: int) -> int:
    return (offset + 7) & ~7


class Writer:
    """(In the run's process.) Appends records; ``append`` is False once one does not fit."""

    def __init__(self, fd: int) -> None:
        self._map = mmap.mmap(fd, os.fstat(fd).st_size)
        self.offset = 0  # where the next record goes; everything before it is stored
        # Allocate the first pages now, before the loop runs (zeros: nothing stored):
        # each fresh page's first write would otherwise fault inside the loop.
        self._map[:PREFAULT] = bytes(min(PREFAULT, len(self._map)))

    def append(self, data: bytes) -> bool:
        start, end = self.offset, self.offset + _LENGTH.size + len(data)
        if end > len(self._map):
            return False
        self._map[start + _LENGTH.size:end] = data
        self._map[start:start + _LENGTH.size] = _LENGTH.pack(len(data))  # then the length
        self.offset = _aligned(end)
        return True


class Reader:
    """(In the requesting process.) Reads the records in order, each once."""

    def __init__(self, fd: int) -> None:
        self._map = mmap.mmap(fd, os.fstat(fd).st_size, access=mmap.ACCESS_READ)
        self.offset = 0

    def read(self, upto: int | None = None) -> list[Any]:
        """The messages stored before ``upto`` (a note's offset), or, with None (the
        writer is dead), every whole record left: a record cut short by its writer's
        death is not one."""
        messages = []
        limit = len(self._map) if upto is None else upto
        while self.offset + _LENGTH.size <= limit:
            (length,) = _LENGTH.unpack_from(self._map, self.offset)
            end = self.offset + _LENGTH.size + length
            if length == 0 or end > len(self._map):
                break
            try:
                messages.append(pickle.loads(self._map[self.offset + _LENGTH.size:end]))
            except Exception:  # noqa: BLE001 - only a dead writer's last, torn record
                if upto is not None:
                    raise
                break
            self.offset = _aligned(end)
        return messages

    def close(self) -> None:
        self._map.close()
