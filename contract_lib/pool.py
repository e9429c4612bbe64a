"""Warm workers: fork servers that import SGLang once and fork a fresh child per run.

A cold run spends ~5 s importing SGLang before a ~1 s Scheduler build and a ~20 ms loop.
A :class:`ForkServer` pays the import once; every run is still its own process (forked
from the server, so nothing one run does to SGLang's classes or modules reaches the
next), builds its own Scheduler, and streams its frames exactly as a cold child does.

Protocol (one request at a time per server, over a UNIX socket pair): ``("run", spec)``
with two file descriptors (``socket.send_fds``): the write end of the run's message pipe
and the run's log file. The server forks; it replies with the child's pid, then, after
``waitpid``, with the child's return code (negative: signal). ``("server-arg-types",)``:
the server replies with the kinds of value each ``ServerArgs`` field accepts
(:mod:`contract_lib.serverargs`), so the client checks a run's server args before any
child starts.

Nothing outlives the client: a server runs in its own session (a terminal's Ctrl-C is
the client's to handle), holds the read end of a *lifeline* pipe whose write end only the
client has, and a thread that sees the lifeline close (the client exited or was killed)
kills the current run and exits. Every run child dies with its server
(:func:`contract_lib.child.die_with_parent`).
"""

from __future__ import annotations

import atexit
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading

from contract_lib.child import child_run, die_with_parent

_HEADER = struct.Struct("!I")
# Seconds between checks of a cancel event while waiting for a server's reply.
_WAIT_STEP_S = 0.25


def _send(sock: socket.socket, obj, fds: list[int] = ()) -> None:
    payload = pickle.dumps(obj)
    data = _HEADER.pack(len(payload)) + payload
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def _recv(sock: socket.socket, with_fds: int = 0):
    if with_fds:
        data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 20, with_fds)
    else:
        data, fds = sock.recv(_HEADER.size), []
    if not data:
        raise EOFError("fork server closed the connection")
    while len(data) < _HEADER.size:
        data += sock.recv(_HEADER.size - len(data))
    (size,) = _HEADER.unpack(data[:_HEADER.size])
    payload = data[_HEADER.size:]
    while len(payload) < size:
        chunk = sock.recv(size - len(payload))
        if not chunk:
            raise EOFError("fork server closed the connection")
        payload += chunk
    return pickle.loads(payload), fds


def child_env(sglang_dir=None) -> dict[str, str]:
    """The environment of a run's process (cold child or fork server): this process's
    ``sys.path`` as ``PYTHONPATH``, with the SGLang release folder first when given, and
    a fixed ``PYTHONHASHSEED``: SGLang iterates sets of request ids (e.g. 0.5.21's
    ``_cleanup_stale_rids`` removes stale requests, syncing their KV, in set order), so
    without it two processes could order the same writes differently."""
    paths = [str(sglang_dir)] if sglang_dir is not None else []
    paths += [p for p in sys.path if p and p != str(sglang_dir)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONHASHSEED": "0"}


class ForkServer:
    """A server process with SGLang imported; :meth:`start_run` forks one child per run.
    ``sglang_dir``: the release folder first on its ``PYTHONPATH`` (None: the venv's)."""

    def __init__(self, sglang_dir=None) -> None:
        self.sglang_dir = sglang_dir
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        lifeline, write_end = os.pipe()  # only this process holds the write end
        self.lifeline: int | None = write_end
        env = child_env(sglang_dir)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", "from contract_lib.pool import serve; serve()",
                 str(child_end.fileno()), str(lifeline)],
                pass_fds=(child_end.fileno(), lifeline), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                start_new_session=True)
        finally:
            child_end.close()
            os.close(lifeline)
        self.sock = parent_end
        self.arg_kinds: dict | None = None

    def alive(self) -> bool:
        return self.process.poll() is None

    def server_arg_kinds(self, cancel: threading.Event | None = None) -> dict:
        """The kinds of value each ``ServerArgs`` field accepts, asked once per server."""
        if self.arg_kinds is None:
            _send(self.sock, ("server-arg-types",))
            (kind, self.arg_kinds), _ = self._reply(cancel)
            assert kind == "server-arg-types", kind
        return self.arg_kinds

    def start_run(self, spec: dict, write_fd: int, log_fd: int,
                  cancel: threading.Event | None = None) -> "WarmChild":
        _send(self.sock, ("run", spec), [write_fd, log_fd])
        (kind, pid), _ = self._reply(cancel)
        assert kind == "pid", kind
        return WarmChild(self, pid)

    def _reply(self, cancel: threading.Event | None):
        """The server's next message; a set ``cancel`` raises KeyboardInterrupt (the
        server, in an unknown state, is then the caller's to discard)."""
        while not select.select([self.sock], [], [], _WAIT_STEP_S)[0]:
            if cancel is not None and cancel.is_set():
                raise KeyboardInterrupt("cancelled")
        return _recv(self.sock)

    def close(self) -> None:
        """Close the socket and the lifeline (the server exits) and make sure it is gone."""
        try:
            self.sock.close()
            if self.lifeline is not None:
                os.close(self.lifeline)
                self.lifeline = None
        finally:
            if self.alive():
                self.process.kill()
                self.process.wait()


class WarmChild:
    """The client's handle on one forked run (the interface of ``subprocess.Popen`` that
    the harness uses: ``poll``, ``kill``, ``wait``, ``returncode``)."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.server = server
        self.pid = pid
        self.returncode: int | None = None
        # True when the fork server itself died during the run: the run's exit status is
        # then unknown, and its process (the server's child) is killed.
        self.server_lost = False

    def poll(self) -> int | None:
        if self.returncode is None:
            readable, _, _ = select.select([self.server.sock], [], [], 0)
            if readable:
                self.wait()
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, 9)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.server.sock.settimeout(timeout)
            try:
                (kind, code), _ = _recv(self.server.sock)
            except (EOFError, ConnectionError):
                self.server_lost = True
                self.kill()
                self.returncode = -9
                return self.returncode
            finally:
                self.server.sock.settimeout(None)
            assert kind == "exit", kind
            self.returncode = code
        return self.returncode


class Pool:
    """Idle fork servers per SGLang release folder, started on demand and reused; closed
    at interpreter exit."""

    def __init__(self) -> None:
        self.idle: dict[str | None, list[ForkServer]] = {}
        self.lock = threading.Lock()
        atexit.register(self.close)

    @staticmethod
    def _key(sglang_dir) -> str | None:
        return None if sglang_dir is None else str(sglang_dir)

    def acquire(self, sglang_dir=None) -> ForkServer:
        with self.lock:
            idle = self.idle.setdefault(self._key(sglang_dir), [])
            while idle:
                server = idle.pop()
                if server.alive():
                    return server
                server.close()
        return ForkServer(sglang_dir)

    def release(self, server: ForkServer) -> None:
        with self.lock:
            if server.alive():
                self.idle.setdefault(self._key(server.sglang_dir), []).append(server)

    def discard(self, server: ForkServer) -> None:
        server.close()

    def close(self) -> None:
        with self.lock:
            servers = [server for idle in self.idle.values() for server in idle]
            self.idle = {}
        for server in servers:
            server.close()


POOL = Pool()


# ------------------------------------------------------------------------------------------
# The server side.
# ------------------------------------------------------------------------------------------


def preload() -> None:
    """Import what every run imports (with the import-time shims), nothing run-specific:
    per-loop shims and patches are applied in each forked child, never in the server."""
    from contract_lib import shims

    shims.install_import_shims()
    import sglang.srt.hardware_backend.mlx.model_runner  # noqa: F401
    import sglang.srt.hardware_backend.mlx.model_runner_stub  # noqa: F401
    import sglang.srt.hardware_backend.mlx.runtime  # noqa: F401
    import sglang.srt.hardware_backend.mlx.scheduler_mixin  # noqa: F401
    import sglang.srt.hardware_backend.mlx.tp_worker  # noqa: F401
    import sglang.srt.managers.scheduler  # noqa: F401
    import sglang.srt.server_args  # noqa: F401
    import mlx_lm.models.llama  # noqa: F401  (the tiny model of the real MLX runner)


def serve() -> None:
    """Server main loop: one request at a time; exits when the client closes the socket
    or its lifeline (then killing the run in progress)."""
    from multiprocessing.connection import Connection

    from contract_lib.serverargs import accepted_kinds

    sock = socket.socket(fileno=int(sys.argv[1]))
    current: dict[str, int] = {}
    threading.Thread(target=_watch_lifeline, args=(int(sys.argv[2]), current),
                     daemon=True).start()
    preload()
    server_pid = os.getpid()
    while True:
        try:
            request, fds = _recv(sock, with_fds=2)
        except (EOFError, ConnectionError):
            return
        if request[0] == "server-arg-types":
            from sglang.srt.server_args import ServerArgs

            _send(sock, ("server-arg-types", accepted_kinds(ServerArgs)))
            continue
        spec = request[1]
        write_fd, log_fd = fds
        pid = os.fork()
        if pid == 0:
            die_with_parent(server_pid)
            sock.close()
            os.dup2(log_fd, 1)
            os.dup2(log_fd, 2)
            child_run(spec, Connection(write_fd, readable=False))
            os._exit(0)
        current["pid"] = pid
        os.close(write_fd)
        os.close(log_fd)
        _send(sock, ("pid", pid))
        _, status = os.waitpid(pid, 0)
        current.pop("pid", None)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        _send(sock, ("exit", code))


def _watch_lifeline(fd: int, current: dict[str, int]) -> None:
    """Block until the client's end of the lifeline closes (nothing is ever written to
    it), then kill the run in progress and exit."""
    while os.read(fd, 1):
        pass
    pid = current.get("pid")
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os._exit(0)
