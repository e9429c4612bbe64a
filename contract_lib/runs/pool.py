"""Warm servers, client side: find (or start) the one server per SGLang folder and ask it
to fork a run.

A cold run spends ~5 s importing SGLang before a ~0.5 s Scheduler build and a ~20 ms
loop. A warm server (:mod:`contract_lib.child.server`) pays the import once and outlives the
command that started it, so the next command, notebook kernel or thread forks its run
from it. Every run is still its own process, forked per run, with its own Scheduler.
Where servers live and what they are called: :mod:`contract_lib.wire.serverdir`; what client
and server say: :mod:`contract_lib.wire.framing`.

Trust: a socket is used only if it is this user's, and a connection only once the
kernel says (``SO_PEERCRED``) the process serving it runs as this user; nothing is read
from it before. ``server stop`` signals only the verified peer (by pidfd, Linux), never
a pid a reply names.

Staleness: each run request carries the client's fingerprint of the SGLang files and
this library's source (:func:`contract_lib.runs.fingerprint.code_fingerprint`); a server started
from other files answers ``stale`` and the client retires it (it exits once its runs
end) and starts a fresh one.

Switches: ``CONTRACT_LIB_SERVER=off`` (or ``--cold`` / ``warm=False``) starts a cold
interpreter per run; a server directory that cannot be used, or a server that cannot
start, costs one :class:`ServerWarning` and the run goes cold. Idle time before a
server exits: ``$CONTRACT_LIB_SERVER_IDLE_S`` (default
:data:`~contract_lib.wire.serverdir.DEFAULT_IDLE_S`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

from contract_lib.trust import UntrustedError, check_owned, open_owned, require_same_user
from contract_lib.wire.framing import WireError, recv, send
from contract_lib.wire.serverdir import (  # noqa: F401  (IDLE_ENV, SERVER_*_ENV: re-exported)
    IDLE_ENV,
    SERVER_DIR_ENV,
    SERVER_SWITCH_ENV,
    ServerUnavailable,
    enabled,
    idle_seconds,
    locked,
    private_dir,
    server_dir,
    server_key,
)
from contract_lib.wire.spec import RunSpec

START_TIMEOUT_S = 180.0  # importing SGLang takes 5-6 s; under load much longer
# Seconds between checks of a cancel event while waiting for a server's reply.
_WAIT_STEP_S = 0.25


class ServerWarning(UserWarning):
    """A warm server could not be used; the run went cold (slower, same frames)."""


_warned: set[str] = set()


def _warn(message: str) -> None:
    """One line, once per process and message."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn_explicit(message, ServerWarning, filename=__name__, lineno=0)


def child_env(sglang_dir=None) -> dict[str, str]:
    """The environment of a run's process (cold child or warm server): this process's
    ``sys.path`` as ``PYTHONPATH``, with the SGLang release folder first when given, and
    a fixed ``PYTHONHASHSEED``: SGLang iterates sets of request ids (e.g. 0.5.21's
    ``_cleanup_stale_rids`` removes stale requests, syncing their KV, in set order), so
    without it two processes could order the same writes differently."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(_child_path(sglang_dir)),
            "PYTHONHASHSEED": "0"}


def _child_path(sglang_dir) -> list[str]:
    paths = [str(sglang_dir)] if sglang_dir is not None else []
    return paths + [p for p in sys.path if p and p != str(sglang_dir)]


# -- one server, from the client ----------------------------------------------------------


class Server:
    """The client's handle on the server of one key: requests open a connection each."""

    def __init__(self, directory: Path, sglang_dir) -> None:
        self.directory = directory
        self.sglang_dir = sglang_dir
        self.key = server_key(sglang_dir)
        self.socket_path = directory / f"{self.key}.sock"
        self.lock_path = directory / f"{self.key}.lock"
        self.log_path = directory / f"{self.key}.log"
        self.arg_kinds: dict | None = None
        # The content identity of a source tree or diff copy (contract_lib.sources.origin), as
        # the latest run asked for it: an edited tree makes the server stale at once.
        self.identity: dict | None = None

    def fingerprint(self) -> str:
        from contract_lib.runs.fingerprint import code_fingerprint

        code = code_fingerprint(None if self.sglang_dir is None else Path(self.sglang_dir))
        if self.identity is None:
            return code
        return hashlib.sha256(json.dumps([code, self.identity], sort_keys=True,
                                         default=str).encode()).hexdigest()

    # connections

    def connect(self) -> socket.socket | None:
        """A connection to the running server, or None when none listens. Raises
        :class:`ServerUnavailable` for a socket file or a server that is not this
        user's (checked before a byte is read)."""
        try:
            check_owned(os.lstat(self.socket_path), self.socket_path, "warm server socket")
        except FileNotFoundError:
            return None
        except UntrustedError as exc:
            raise ServerUnavailable(f"{exc}; refused") from exc
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(self.socket_path))
            require_same_user(sock, f"the warm server socket {self.socket_path}")
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            return None
        except UntrustedError as exc:
            sock.close()
            raise ServerUnavailable(str(exc)) from exc
        except OSError as exc:  # e.g. a path too long for a UNIX socket
            sock.close()
            raise ServerUnavailable(f"cannot reach {self.socket_path} ({exc})") from exc
        return sock

    def ask(self, request: tuple):
        """A request without fds to the running server; None when none listens or it
        does not answer in the protocol."""
        sock = self.connect()
        if sock is None:
            return None
        with sock:
            try:
                send(sock, request)
                return recv(sock)
            except (EOFError, OSError, WireError):
                return None

    def open(self, request: tuple, fds: list[int] = (),
             cancel: threading.Event | None = None) -> tuple[socket.socket, tuple]:
        """Send ``request + (fingerprint,)`` to a current server, starting (or
        replacing a stale) one first when needed; returns the connection and the reply."""
        fingerprint = self.fingerprint()
        for _ in range(3):
            sock = self.connect()
            if sock is None:
                self.start(fingerprint)
                continue
            try:
                send(sock, (*request, fingerprint), fds)
                reply = _reply(sock, cancel)
            except WireError as exc:
                sock.close()
                raise ServerUnavailable(f"the warm server {self.socket_path} broke the "
                                        f"protocol ({exc})") from exc
            except BaseException:
                sock.close()
                raise
            if reply[0] != "stale":
                return sock, reply
            sock.close()
            self.start(fingerprint)
        raise ServerUnavailable(f"the warm server {self.socket_path} kept refusing runs")

    def server_arg_kinds(self, cancel: threading.Event | None = None) -> dict:
        """The kinds of value each ``ServerArgs`` field accepts, asked once per handle."""
        if self.arg_kinds is None:
            sock, (kind, self.arg_kinds) = self.open(("server-arg-types",), cancel=cancel)
            sock.close()
            assert kind == "server-arg-types", kind
        return self.arg_kinds

    def start_run(self, spec: RunSpec, write_fd: int, log_fd: int, journal_fd: int,
                  cancel: threading.Event | None = None) -> "WarmChild":
        context = {"cwd": os.getcwd(), "path": _child_path(self.sglang_dir),
                   "env": child_env(self.sglang_dir)}
        sock, (kind, pid) = self.open(("run", spec.to_json(), context),
                                      [write_fd, log_fd, journal_fd], cancel)
        assert kind == "pid", kind
        return WarmChild(sock, pid)

    # lifecycle

    def start(self, fingerprint: str) -> None:
        """Make a server of ``fingerprint`` listen on the socket: one already does (another
        process started it meanwhile), or retire a stale one and start a new one."""
        with locked(self.lock_path):
            status = self.ask(("status",))
            if status is not None and status["fingerprint"] == fingerprint:
                return
            if status is not None:
                self.ask(("retire",))  # removes its socket; exits once its runs end
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()  # a dead server's (connection refused)
            self._spawn(fingerprint)

    def _spawn(self, fingerprint: str) -> None:
        ready_read, ready_write = os.pipe()
        try:
            log_fd = open_owned(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                                "warm server log")
            with os.fdopen(log_fd, "wb") as log:
                starter = subprocess.Popen(
                    [sys.executable, "-c", "from contract_lib.child.server import main; main()",
                     str(self.socket_path), fingerprint, str(idle_seconds()),
                     str(ready_write), "" if self.sglang_dir is None else str(self.sglang_dir),
                     json.dumps(self.identity)],
                    pass_fds=(ready_write,), stdin=subprocess.DEVNULL, stdout=log,
                    stderr=log, env=child_env(self.sglang_dir), start_new_session=True)
            os.close(ready_write)
            ready_write = None
            starter.wait()  # the server forks itself away from this process at once
            deadline = time.monotonic() + START_TIMEOUT_S
            answer = b""
            while not answer.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([ready_read], [], [], left)[0]:
                    raise ServerUnavailable(self._failed("did not start in "
                                                         f"{START_TIMEOUT_S:.0f} s"))
                chunk = os.read(ready_read, 64)
                if not chunk:
                    raise ServerUnavailable(self._failed("exited while starting"))
                answer += chunk
        finally:
            os.close(ready_read)
            if ready_write is not None:
                os.close(ready_write)

    def _failed(self, what: str) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            lines = []
        last = f": {lines[-1]}" if lines else ""
        return f"the warm server for {self.label()} {what} (log: {self.log_path}){last}"

    def label(self) -> str:
        return "the venv's SGLang" if self.sglang_dir is None else str(self.sglang_dir)


def _reply(sock: socket.socket, cancel: threading.Event | None) -> list:
    """The server's next message, a non-empty list; a set ``cancel`` raises
    KeyboardInterrupt."""
    while not select.select([sock], [], [], _WAIT_STEP_S)[0]:
        if cancel is not None and cancel.is_set():
            raise KeyboardInterrupt("cancelled")
    reply = recv(sock)
    if not isinstance(reply, list) or not reply:
        raise WireError(f"not a reply: {str(reply)[:80]!r}")
    return reply


class WarmChild:
    """The client's handle on one forked run (the interface of ``subprocess.Popen`` that
    the harness uses: ``poll``, ``kill``, ``wait``, ``returncode``)."""

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self.sock = sock
        self.pid = pid
        self.returncode: int | None = None
        # True when the server died (or was stopped) during the run: the run's exit
        # status is then unknown, and its process (the server's child) is killed.
        self.server_lost = False
        self.released = False  # let go after its end (:meth:`release`)

    def poll(self) -> int | None:
        if self.released:
            return None
        if self.returncode is None and select.select([self.sock], [], [], 0)[0]:
            self.wait()
        return self.returncode

    def kill(self) -> None:
        """Ask the server to kill the run (it does so when this side of the connection
        closes for writing); the exit code follows."""
        if self.returncode is None and not self.released:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_WR)

    def release(self) -> None:
        """Let go of a run that has sent its end, without waiting for its exit: the
        connection closes, so the server kills the process if it has not exited yet
        and reaps it (a run's exit, tearing down its copy of the server's memory, takes
        ~20 ms). Its exit status stays unknown (None); nothing reads it after an end."""
        if self.returncode is None:
            self.sock.close()
            self.released = True

    def wait(self, timeout: float | None = None) -> int | None:
        if self.released:
            return None
        if self.returncode is None:
            self.sock.settimeout(timeout)
            try:
                kind, code = recv(self.sock)
                if kind != "exit" or not isinstance(code, int):
                    raise WireError(f"not an exit reply: {kind!r}")
                self.returncode = code
            except (EOFError, OSError, ValueError, WireError):
                # The server is gone or does not answer: closing the connection makes a
                # live server kill the run, and a dead server's runs died with it
                # (PR_SET_PDEATHSIG). No pid is signalled from here: it may be reused.
                self.server_lost = True
                self.returncode = -9
            finally:
                self.sock.close()
        return self.returncode


class Pool:
    """The warm server of each SGLang folder, for this process's threads."""

    def __init__(self) -> None:
        self.servers: dict[tuple[str, str], Server] = {}
        self.lock = threading.Lock()

    def acquire(self, sglang_dir=None, identity: dict | None = None) -> Server | None:
        """The handle on ``sglang_dir``'s server (started on the first request), or None
        when servers are switched off or their directory cannot be used (one warning).
        ``identity``: the content identity of a source tree or diff copy, if it is one."""
        if not enabled():
            return None
        try:
            directory = private_dir(server_dir())
        except ServerUnavailable as exc:
            _warn(f"{exc}; runs start cold")
            return None
        key = (str(directory), server_key(sglang_dir))
        with self.lock:
            if key not in self.servers:
                self.servers[key] = Server(directory, sglang_dir)
            server = self.servers[key]
            server.identity = identity
            return server

    def unavailable(self, exc: BaseException) -> None:
        _warn(f"{exc}; this run starts cold")


POOL = Pool()


def prestart(sglang_dirs: list, identities: list | None = None) -> list[threading.Thread]:
    """Start the warm server of each SGLang folder (None: the venv's; ``identities``: a
    source tree's or diff copy's, as :func:`contract_lib.sources.origin.resolve` gives it) now,
    side by side in background threads, so that the first run on each does not wait ~6 s
    for its import; returns the threads (join them before stopping the servers). A run
    that needs a server meanwhile waits for it: a start holds the server's lock. A
    server that cannot start is left to the first run to report."""
    threads = []
    for sglang_dir, identity in zip(sglang_dirs, identities or [None] * len(sglang_dirs)):
        server = POOL.acquire(sglang_dir, identity)
        if server is None:
            break
        thread = threading.Thread(target=_start_quietly, args=(server,), daemon=True,
                                  name=f"contract_lib-prestart {server.label()}")
        thread.start()
        threads.append(thread)
    return threads


def _start_quietly(server: "Server") -> None:
    with contextlib.suppress(ServerUnavailable, OSError):
        server.start(server.fingerprint())
