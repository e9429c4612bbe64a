"""Trust only this user: what comes from a shared place is checked for its owner first.

The threat model (docs/reliability.md, "Security"): another local user of a shared
machine who can create files, directories, links and sockets wherever the file system
lets them, and run processes that answer on a socket. Nothing they own is read as data
the library believes, imported as code, connected to as a warm server, or signalled.
What a process of the same user can do is out of scope: it can already run code as you.

- :func:`own_directory`: a directory this library keeps state in (warm servers, the
  frame cache, installed releases and diff copies) is a real directory (no symlink as
  its last part) owned by this user, without the permission bits the caller forbids
  (``0o077`` for the servers' sockets, ``0o022`` where others may read but not write).
  A missing one is created with that mode; an existing one is never chmodded (that
  would take a shared directory such as ``/tmp`` away from its other users).
- :func:`open_owned`: a file opened without following a symlink and refused unless this
  user owns it (the warm servers' locks and logs, cache entries).
- :func:`read_user_file`: a file a user names on the command line (a workload, a diff)
  is read only if it is a regular file no larger than a limit, checked before reading
  (a FIFO, a device, ``/dev/zero`` behind a symlink are one error line, never a hang).
- :func:`peer_credentials`: the pid and uid of the process at the other end of a UNIX
  socket, from the kernel (``SO_PEERCRED``), never from what the peer says.

Bottom floor: imports nothing from the package.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import struct
from pathlib import Path

_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class UntrustedError(PermissionError):
    """A file, directory or peer that is not this user's, or not of the kind expected."""


def _describe_mode(mode: int) -> str:
    return oct(stat.S_IMODE(mode))


def own_directory(path: Path, forbidden_bits: int, what: str) -> Path:
    """``path``, created with mode ``0o777 & ~forbidden_bits`` (parents: the default
    mode) when missing; raises :class:`UntrustedError` unless it is a directory, not a
    symlink, owned by this user, with none of ``forbidden_bits`` set."""
    path = Path(path)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, 0o777 & ~forbidden_bits)
        except FileExistsError:  # made meanwhile by another process: check it below
            pass
        info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise UntrustedError(f"{what} {path} is a symbolic link; give its "
                             "target instead")
    if not stat.S_ISDIR(info.st_mode):
        raise UntrustedError(f"{what} {path} is not a directory")
    if info.st_uid != os.getuid():
        raise UntrustedError(f"{what} {path} belongs to uid {info.st_uid}, "
                             f"not to this user (uid {os.getuid()})")
    if info.st_mode & forbidden_bits:
        raise UntrustedError(f"{what} {path} has mode "
                             f"{_describe_mode(info.st_mode)}: other users can "
                             f"{'write to' if forbidden_bits == 0o022 else 'enter'} it "
                             f"(it needs none of the bits {oct(forbidden_bits)}; it is "
                             "left as it is)")
    return path


def check_owned(info: os.stat_result, path: Path | str, what: str) -> None:
    """Raise :class:`UntrustedError` unless ``info`` (an ``fstat``/``lstat``) is a regular
    file or socket owned by this user."""
    if not (stat.S_ISREG(info.st_mode) or stat.S_ISSOCK(info.st_mode)):
        raise UntrustedError(f"{what} {path} is not a regular file")
    if info.st_uid != os.getuid():
        raise UntrustedError(f"{what} {path} belongs to uid {info.st_uid}, "
                             f"not to this user (uid {os.getuid()})")


def open_owned(path: Path | str, flags: int, what: str, mode: int = 0o600) -> int:
    """``os.open(path, flags | O_NOFOLLOW | O_CLOEXEC, mode)``, refused (the fd closed,
    :class:`UntrustedError`) unless the file is a regular file this user owns."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UntrustedError(f"{what} {path} is a symbolic link") from exc
        raise
    try:
        check_owned(os.fstat(fd), path, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_user_file(path: Path | str, what: str, limit: int) -> bytes:
    """The bytes of a file the user named: a regular file (symlinks followed) of at most
    ``limit`` bytes. Raises :class:`UntrustedError` for anything else, before reading;
    opened non-blocking, so a FIFO never hangs the caller."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = ("a directory" if stat.S_ISDIR(info.st_mode) else
                    "a FIFO" if stat.S_ISFIFO(info.st_mode) else
                    "a device" if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode)
                    else "a socket" if stat.S_ISSOCK(info.st_mode) else "not a file")
            raise UntrustedError(f"{what} {path} is {kind}, not a regular "
                                 "file")
        if info.st_size > limit:
            raise UntrustedError(f"{what} {path} is {info.st_size} bytes; "
                                 f"the limit is {limit} bytes")
        with os.fdopen(fd, "rb", closefd=False) as handle:
            data = handle.read(limit + 1)
        if len(data) > limit:  # grew while being read
            raise UntrustedError(f"{what} {path} is over the limit of "
                                 f"{limit} bytes")
        return data
    finally:
        os.close(fd)


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """The (pid, uid) of the process at the other end of a connected UNIX socket, as
    the kernel recorded them when that process connected or listened."""
    pid, uid, _gid = _PEERCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid, uid


def require_same_user(sock: socket.socket, what: str) -> int:
    """The peer's pid; raises :class:`UntrustedError` unless the peer runs as this user."""
    pid, uid = peer_credentials(sock)
    if uid != os.getuid():
        raise UntrustedError(f"{what} is served by uid {uid} (pid {pid}), "
                             f"not by this user (uid {os.getuid()}); refused")
    return pid
