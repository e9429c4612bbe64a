"""Warm servers, where they live and what they are called (shared by every client).

Where: one UNIX socket per server in :func:`server_dir` (``$CONTRACT_LIB_SERVER_DIR``,
else ``$XDG_RUNTIME_DIR/contract_lib``, else ``.cache/servers`` in the checkout), a
directory only the user can enter (0700, owned by the user; anything else is refused).
An existing directory is never chmodded: one that others can enter (``/tmp``, say) is
refused with one warning, and runs go cold. A server is named by a key of the interpreter, this library's folder, the SGLang folder
first on the run's ``PYTHONPATH`` (``sglang_dir``; None: the venv's) and the ``SGLANG*``
environment variables (read by SGLang at import), so every thread and process asking for
the same release finds the same server. ``<key>.sock`` is the socket, ``<key>.lock``
serialises starts (two processes starting at once: one starts, the other connects;
:func:`locked`), ``<key>.log`` is the server's own output.

Switches: ``CONTRACT_LIB_SERVER=off`` (:func:`enabled`) starts a cold interpreter per
run. Idle time before a server exits: ``$CONTRACT_LIB_SERVER_IDLE_S`` (default
:data:`DEFAULT_IDLE_S`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import sys
from pathlib import Path

from contract_lib.paths import PACKAGE_DIR, PROJECT_ROOT
from contract_lib.sources.installs import sglang_environment
from contract_lib.trust import UntrustedError, open_owned, own_directory

SERVER_DIR_ENV = "CONTRACT_LIB_SERVER_DIR"
SERVER_SWITCH_ENV = "CONTRACT_LIB_SERVER"  # "off": cold children only
IDLE_ENV = "CONTRACT_LIB_SERVER_IDLE_S"
DEFAULT_IDLE_S = 900.0  # a server exits after 15 minutes without a request or a run


class ServerUnavailable(RuntimeError):
    """No warm server can be used (directory, socket or start failed); runs go cold."""


def enabled() -> bool:
    return os.environ.get(SERVER_SWITCH_ENV, "").lower() not in ("off", "0", "no", "false")


def idle_seconds() -> float:
    try:
        return float(os.environ.get(IDLE_ENV) or DEFAULT_IDLE_S)
    except ValueError:
        return DEFAULT_IDLE_S


def server_dir() -> Path:
    """``$CONTRACT_LIB_SERVER_DIR``, else ``$XDG_RUNTIME_DIR/contract_lib``, else
    ``.cache/servers`` in the project checkout."""
    if os.environ.get(SERVER_DIR_ENV):
        return Path(os.environ[SERVER_DIR_ENV])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "contract_lib"
    return PROJECT_ROOT / ".cache" / "servers"


def private_dir(directory: Path) -> Path:
    """``directory``, created 0700 if missing; refused (:class:`ServerUnavailable`) unless
    it is a real directory owned by this user that no one else can enter (an existing
    one is never chmodded)."""
    try:
        own_directory(directory, 0o077, "server directory")
        if not os.access(directory, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "not writable", str(directory))
    except UntrustedError as exc:
        raise ServerUnavailable(f"{exc}; refused") from exc
    except OSError as exc:
        raise ServerUnavailable(f"server directory {directory} cannot be used ({exc})") \
            from exc
    return directory


def server_key(sglang_dir) -> str:
    """The name of the server for ``sglang_dir`` (see the module docstring)."""
    return hashlib.sha256(json.dumps(
        [sys.executable, str(PACKAGE_DIR), None if sglang_dir is None else str(sglang_dir),
         sglang_environment()]).encode()).hexdigest()[:16]


@contextlib.contextmanager
def locked(lock_path: Path):
    """Hold the exclusive lock of ``lock_path`` (a server's ``<key>.lock``)."""
    fd = open_owned(lock_path, os.O_RDWR | os.O_CREAT, "server lock")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
