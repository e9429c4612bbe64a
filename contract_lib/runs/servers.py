"""Every warm server of a directory, as the ``server`` command sees them: their status
(each ``pid`` the kernel's, for the socket's peer) and stopping them, which signals only
the verified peer (:mod:`contract_lib.runs.pool` is one server's client)."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from pathlib import Path

from contract_lib.runs.pool import Server, ServerUnavailable, _warn
from contract_lib.trust import peer_credentials
from contract_lib.wire.framing import WireError, recv, send
from contract_lib.wire.serverdir import locked, private_dir, server_dir


def _servers(directory: Path) -> list[Server]:
    return [_by_socket(directory, path) for path in sorted(directory.glob("*.sock"))]


def _by_socket(directory: Path, path: Path) -> Server:
    server = Server.__new__(Server)
    server.directory, server.sglang_dir, server.key = directory, None, path.stem
    server.socket_path, server.lock_path = path, directory / f"{path.stem}.lock"
    server.log_path, server.arg_kinds = directory / f"{path.stem}.log", None
    return server


def statuses(directory: Path | None = None) -> list[dict]:
    """The status of every server listening in ``directory`` (default: :func:`server_dir`),
    its ``pid`` the one the kernel gives for the socket's peer; a dead server's socket
    file is removed. Raises :class:`ServerUnavailable` for a directory that is not this
    user's private one; a socket that is not this user's is skipped with a warning."""
    directory = directory or server_dir()
    if not os.path.lexists(directory):
        return []
    private_dir(directory)
    found = []
    for server in _servers(directory):
        try:
            status = _status_of(server)
            if status is None:
                with locked(server.lock_path):
                    if server.ask(("status",)) is None:
                        server.socket_path.unlink(missing_ok=True)
                continue
        except ServerUnavailable as exc:
            _warn(str(exc))
            continue
        found.append(status)
    return found


def _status_of(server: Server) -> dict | None:
    """``server``'s status with the kernel's pid of its peer, or None if none answers."""
    sock = server.connect()
    if sock is None:
        return None
    with sock:
        pid = peer_credentials(sock)[0]  # the uid was checked by connect
        try:
            send(sock, ("status",))
            status = recv(sock)
        except (EOFError, OSError, WireError):
            return None
    if not isinstance(status, dict):
        return None
    return {**status, "pid": pid}


def stop_all(directory: Path | None = None, timeout: float = 10.0) -> list[dict]:
    """Stop every server in ``directory``: its runs are killed, it exits, its socket is
    removed; returns the statuses of those stopped. A server that does not exit within
    ``timeout`` is killed through a pidfd opened on the verified peer while it still
    served the connection (Linux; elsewhere it is reported and left)."""
    stopped = []
    for status in statuses(directory):
        server = _by_socket(Path(status["socket"]).parent, Path(status["socket"]))
        with contextlib.suppress(ServerUnavailable):
            if _stop(server, timeout):
                stopped.append(status)
    return stopped


def _stop(server: Server, timeout: float) -> bool:
    """Ask ``server`` to stop and wait for it to exit; True once it is gone."""
    sock = server.connect()
    if sock is None:
        return True
    pidfd = None
    with sock:
        pid = peer_credentials(sock)[0]  # the uid was checked by connect
        if hasattr(os, "pidfd_open"):
            with contextlib.suppress(OSError):
                pidfd = os.pidfd_open(pid)
        try:
            send(sock, ("stop",))
            # A reply proves the peer was alive after the pidfd was opened: the pidfd is
            # the server's, not a process that reused its pid.
            proven = recv(sock) == ["stopped"]
        except (EOFError, OSError, WireError):
            proven = False
    try:
        if pidfd is None:
            return _wait_gone(pid, timeout)
        if select.select([pidfd], [], [], timeout)[0]:
            return True
        if proven:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            return bool(select.select([pidfd], [], [], timeout)[0])
        return False
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie (not reaped by its parent) counts as gone
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].startswith("Z"):
            return False
    return True
