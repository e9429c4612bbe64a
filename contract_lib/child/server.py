"""Warm server, server side: SGLang imported once, one forked child per run.

Started by :meth:`contract_lib.runs.pool.Server.start` (protocol: :mod:`contract_lib.wire.framing`;
naming: :mod:`contract_lib.wire.serverdir`). The process forks itself away from its starter
(so it outlives the command that started it, in its own session: a terminal's Ctrl-C
never reaches it), imports SGLang, listens on its socket (only the user can enter its
directory; the socket itself is 0600), tells the starter it is ready, and serves any
number of clients at once from one thread (a selector over the listening socket, the
clients' connections and a signal wake-up pipe), so every fork happens from that one
thread. It reads every connection without blocking and serves only peers of its own
uid (``SO_PEERCRED``, checked at accept); a message it cannot read (not JSON, not a
request, too long, stalled) closes that connection only, with a line in its log.

Lifetime: it exits after ``idle_s`` seconds without a request or a running run, on
``stop`` or SIGTERM (killing its runs), or, on ``retire`` (its files went stale), once
its runs end; it removes its own socket file when it goes.

A run child dies with the process that asked for it (the server kills it when that
connection closes, however the requester ended) and with the server
(:func:`contract_lib.child.main.die_with_parent`: ``PR_SET_PDEATHSIG``, which follows the
forking thread, here the server's only one).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

from contract_lib.trust import peer_credentials
from contract_lib.wire.framing import MESSAGE_TIMEOUT_S, Incoming, WireError, close_fds, send


def main() -> None:
    """``argv``: socket path, fingerprint, idle seconds, ready fd, sglang_dir ('' none),
    the JSON identity of a source tree or diff copy (``null`` none)."""
    socket_path, fingerprint, idle_s, ready_fd, sglang_dir, identity = sys.argv[1:7]
    if os.fork():
        os._exit(0)  # the starter reaps this; the server is nobody's child
    from contract_lib.child.preload import preload

    preload()
    WarmServer(Path(socket_path), fingerprint, float(idle_s), sglang_dir or None,
               json.loads(identity)).serve(int(ready_fd))


class WarmServer:
    def __init__(self, socket_path: Path, fingerprint: str, idle_s: float,
                 sglang_dir: str | None, identity: dict | None,
                 message_timeout: float = MESSAGE_TIMEOUT_S) -> None:
        from importlib import metadata

        self.socket_path = socket_path
        self.fingerprint = fingerprint
        self.identity = identity
        self.idle_s = idle_s
        self.sglang_dir = sglang_dir
        self.sglang_version = metadata.version("sglang")
        self.started = time.time()
        self.last_active = time.monotonic()
        self.runs_served = 0
        self.runs: dict[int, socket.socket] = {}  # run pid -> its requester's connection
        self.requesters: dict[int, int] = {}  # run pid -> its requester's pid (SO_PEERCRED)
        self.arg_kinds: dict | None = None
        self.retiring = False
        self.selector = selectors.DefaultSelector()
        self.listener: socket.socket | None = None
        self.socket_inode: int | None = None
        self.incoming: dict[socket.socket, Incoming] = {}  # each client's pending bytes
        self.log_fd = -1  # the server's log (its starter's output file), for refusals
        self.message_timeout = message_timeout  # seconds a client may take to send one

    # -- set-up ---------------------------------------------------------------------------

    def _listen(self) -> None:
        """Bind a temporary name, then rename it into place: a client never connects to
        a server that is not ready."""
        temporary = self.socket_path.with_name(f".{self.socket_path.name}.{os.getpid()}")
        temporary.unlink(missing_ok=True)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(temporary))
        os.chmod(temporary, 0o600)
        self.listener.listen(64)
        os.rename(temporary, self.socket_path)
        self.socket_inode = os.stat(self.socket_path).st_ino
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")

    def _signals(self) -> None:
        wake_read, wake_write = os.pipe()
        os.set_blocking(wake_read, False)
        os.set_blocking(wake_write, False)
        signal.set_wakeup_fd(wake_write)
        for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, lambda *_: None)  # handled in the loop, via the pipe
        self.wake = (wake_read, wake_write)
        self.selector.register(wake_read, selectors.EVENT_READ, "signal")

    def serve(self, ready_fd: int) -> None:
        self._listen()
        self._signals()
        os.write(ready_fd, f"ready {os.getpid()}\n".encode())
        os.close(ready_fd)
        with contextlib.suppress(OSError):  # nothing but refusals is written after start-up
            self.log_fd = os.dup(2)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
        while True:
            timeout = None
            if not self.runs:
                if self.retiring:
                    self._exit()
                idle_left = self.idle_s - (time.monotonic() - self.last_active)
                if idle_left <= 0:
                    self._exit()
                timeout = max(idle_left, 0.0)
            begun = [r.started for r in self.incoming.values() if r.started is not None]
            if begun:  # wake when the oldest unfinished message is overdue (a stalled
                # client): just past its timeout, as ``overdue`` wants more than it
                due = max(min(begun) + self.message_timeout - time.monotonic(), 0.0) + 0.01
                timeout = due if timeout is None else min(timeout, due)
            for key, _ in self.selector.select(timeout):
                if key.data == "accept":
                    self._accept()
                elif key.data == "signal":
                    self._on_signals()
                else:
                    self._on_readable(key.fileobj)
            self._drop_stalled()

    # -- events ---------------------------------------------------------------------------

    def _log(self, line: str) -> None:
        with contextlib.suppress(OSError):
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            os.write(self.log_fd, f"{stamp} contract_lib server {os.getpid()}: {line}\n"
                     .encode(errors="replace"))

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        pid, uid = peer_credentials(conn)
        if uid != os.getuid():
            self._log(f"refused a connection from uid {uid} (pid {pid}): not this user")
            conn.close()
            return
        conn.setblocking(False)
        self.incoming[conn] = Incoming()
        self.selector.register(conn, selectors.EVENT_READ, "client")

    def _on_signals(self) -> None:
        try:
            received = os.read(self.wake[0], 512)
        except BlockingIOError:
            received = b""
        if any(signum != signal.SIGCHLD for signum in received):
            self._exit()
        self._reap()

    def _reap(self) -> None:
        while self.runs:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.runs.pop(pid, None)
            self.requesters.pop(pid, None)
            self.last_active = time.monotonic()
            if conn is None:
                continue
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            with contextlib.suppress(OSError):
                self._reply(conn, ("exit", code))
            self._close(conn)

    def _close(self, conn: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(conn)
        reader = self.incoming.pop(conn, None)
        if reader is not None:
            reader.close()
        conn.close()

    def _on_readable(self, conn: socket.socket) -> None:
        self.last_active = time.monotonic()
        reader = self.incoming.get(conn)
        if reader is None:
            return
        try:
            if not reader.feed(conn):
                self._on_hang_up(conn)
                return
            while (message := reader.message()) is not None:
                request, fds = message
                try:
                    self._handle(conn, request, fds)
                finally:
                    close_fds(fds)
        except BlockingIOError:
            return
        except WireError as exc:
            self._log(f"closed a connection: {exc}")
            self._on_hang_up(conn)
        except OSError:  # the client went away while we read or answered
            self._on_hang_up(conn)

    def _drop_stalled(self) -> None:
        now = time.monotonic()
        for conn, reader in list(self.incoming.items()):
            if reader.overdue(now, self.message_timeout):
                self._log("closed a connection: a message not finished within "
                          f"{now - reader.started:.1f} s")
                self._on_hang_up(conn)

    def _on_hang_up(self, conn: socket.socket) -> None:
        """The requester closed its connection (it finished, was interrupted, or died),
        or broke the protocol: its run, if still going, is killed; the exit code goes
        back on that connection (a half-closed one still reads it)."""
        pid = next((pid for pid, c in self.runs.items() if c is conn), None)
        if pid is None:
            self._close(conn)
            return
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(conn)
        reader = self.incoming.pop(conn, None)
        if reader is not None:
            reader.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def _reply(self, conn: socket.socket, message) -> None:
        """Send a (small) reply; blocking for at most a few seconds."""
        conn.settimeout(5.0)
        try:
            send(conn, message)
        finally:
            conn.setblocking(False)

    def _handle(self, conn: socket.socket, request, fds: list[int]) -> None:
        if not (isinstance(request, list) and request and isinstance(request[0], str)):
            raise WireError(f"not a request: {str(request)[:80]!r}")
        if conn in self.runs.values():
            raise WireError("a second request on a run's connection")
        kind = request[0]
        if kind == "status":
            self._reply(conn, self.status())
        elif kind == "stop":
            self._reply(conn, ("stopped",))
            self._exit()
        elif kind == "retire":
            self._retire()
            self._reply(conn, ("retired",))
        elif request[-1] != self.fingerprint or self.retiring:
            self._reply(conn, ("stale", self.fingerprint))
        elif kind == "server-arg-types":
            self._reply(conn, ("server-arg-types", self._arg_kinds()))
        elif kind == "run":
            if len(request) != 4 or len(fds) != 3 or not all(
                    isinstance(part, dict) for part in request[1:3]):
                raise WireError("a run request needs a spec, a context and three fds")
            _, spec, context, _fingerprint = request
            pid = self._fork(spec, context, fds)  # the caller closes this side's fds
            self.runs[pid] = conn
            self.requesters[pid] = peer_credentials(conn)[0]
            self.runs_served += 1
            self._reply(conn, ("pid", pid))
        else:
            self._reply(conn, ("error", f"unknown request {kind!r}"))

    def _arg_kinds(self) -> dict:
        if self.arg_kinds is None:
            from sglang.srt.server_args import ServerArgs

            from contract_lib.wire.serverargs import accepted_kinds

            self.arg_kinds = accepted_kinds(ServerArgs)
        return self.arg_kinds

    def _fork(self, spec: dict, context: dict, fds: list[int]) -> int:
        write_fd, log_fd, journal_fd = fds
        server_pid = os.getpid()
        pid = os.fork()
        if pid:
            return pid
        try:
            from contract_lib.child.main import child_run, die_with_parent
            from contract_lib.wire.spec import RunSpec

            die_with_parent(server_pid)
            self._forget_in_child()
            os.dup2(log_fd, 1)
            os.dup2(log_fd, 2)
            os.chdir(context["cwd"])
            os.environ.clear()
            os.environ.update(context["env"])
            tempfile.tempdir = None  # the requester's TMPDIR, not the one the server cached
            sys.path[:] = context["path"]
            child_run(RunSpec.from_json(spec), Connection(write_fd, readable=False),
                      journal_fd)
        finally:
            os._exit(0)

    def _forget_in_child(self) -> None:
        """(In a run child.) Drop the server's sockets, pipes and signal handlers."""
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for key in list(self.selector.get_map().values()):
            with contextlib.suppress(OSError):
                os.close(key.fd)
        for fd in (*self.wake, self.log_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        for reader in self.incoming.values():
            reader.close()

    # -- status and exit ------------------------------------------------------------------

    def status(self) -> dict:
        self._reap()  # a run that just ended is not reported running
        idle_left = (self.idle_s if self.runs
                     else self.idle_s - (time.monotonic() - self.last_active))
        return {"pid": os.getpid(), "socket": str(self.socket_path),
                "sglang_dir": self.sglang_dir, "sglang_version": self.sglang_version,
                "fingerprint": self.fingerprint, "identity": self.identity,
                "started": self.started,
                "uptime_s": time.time() - self.started, "idle_left_s": max(idle_left, 0.0),
                "idle_s": self.idle_s, "runs_served": self.runs_served,
                "running": sorted(self.runs), "retiring": self.retiring,
                # which process asked for each run (JSON keys are strings)
                "requesters": {str(pid): self.requesters.get(pid)
                               for pid in sorted(self.runs)}}

    def _retire(self) -> None:
        self.retiring = True
        self._unlink_socket()
        if self.listener is not None:
            self.selector.unregister(self.listener)
            self.listener.close()
            self.listener = None

    def _unlink_socket(self) -> None:
        """Remove the socket file if it is still this server's (not a successor's)."""
        with contextlib.suppress(OSError):
            if os.stat(self.socket_path).st_ino == self.socket_inode:
                self.socket_path.unlink()

    def _exit(self) -> None:
        """Kill the runs, remove the socket, exit (their requesters see the connection
        close: the run is reported as lost with the server)."""
        self._unlink_socket()
        for pid in list(self.runs):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in list(self.runs):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        os._exit(0)
