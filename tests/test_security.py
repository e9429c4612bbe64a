"""Security and exit codes (issue #35): nobody else's code runs as you, and every exit
code means one thing.

The threat model is docs/reliability.md's "Security" section: another local user of a
shared machine. Where the tests run as root they act as that user for real (uid 65534,
``nobody``, by ``setuid`` in a forked process); elsewhere the foreign peer is simulated
by the kernel's answer about it (``trust.peer_credentials``).

The wire tests start :class:`contract_lib.child.server.WarmServer` itself (its listening,
reading and answering) without SGLang: nothing here imports it, so they are ``fast``.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from contract_lib import trust
from contract_lib.cli import main
from contract_lib.runs import pool, servers
from contract_lib.wire import framing as serverwire
from contract_lib.workloads import MAX_WORKLOAD_BYTES, WorkloadError, load_workload

pytestmark = pytest.mark.fast

NOBODY = 65534
AS_ROOT = os.getuid() == 0
PROJECT_ROOT = Path(__file__).resolve().parent.parent
# What a planted server would make the victim run if its reply were unpickled.
PAYLOAD_MARK = "contract_lib-pwned"


class _Pwn:
    def __init__(self, mark: Path) -> None:
        self.mark = mark

    def __reduce__(self):
        return (os.system, (f"touch {self.mark}",))


def _private(tmp_path: Path, name: str = "servers") -> Path:
    directory = tmp_path / name
    directory.mkdir(mode=0o700)
    return directory


def _as_nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


# -- the server directory ------------------------------------------------------------------


def test_the_server_directory_is_private_and_never_chmodded(tmp_path):
    fresh = pool.private_dir(tmp_path / "a" / "b")
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700
    for mode in (0o755, 0o1777, 0o770):
        shared = tmp_path / f"shared-{mode:o}"
        shared.mkdir()
        os.chmod(shared, mode)
        with pytest.raises(pool.ServerUnavailable, match=f"mode {oct(mode)}.*left as it is"):
            pool.private_dir(shared)
        assert stat.S_IMODE(shared.stat().st_mode) == mode  # the sticky bit too
    link = tmp_path / "link"
    link.symlink_to(fresh)
    with pytest.raises(pool.ServerUnavailable, match="symbolic link"):
        pool.private_dir(link)


@pytest.mark.skipif(not AS_ROOT, reason="needs a second uid to own the directory")
def test_a_directory_another_user_owns_is_refused(tmp_path):
    theirs = _private(tmp_path, "theirs")
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(pool.ServerUnavailable, match=f"belongs to uid {NOBODY}"):
        pool.private_dir(theirs)


def test_a_shared_server_directory_runs_cold_with_one_warning(tmp_path, monkeypatch):
    shared = tmp_path / "tmp-like"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    monkeypatch.setenv(pool.SERVER_DIR_ENV, str(shared))
    monkeypatch.delenv(pool.SERVER_SWITCH_ENV, raising=False)
    monkeypatch.setattr(pool, "_warned", set())
    with pytest.warns(pool.ServerWarning, match="other users can enter it"):
        assert pool.POOL.acquire(None) is None
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
    assert main(["server", "status"]) == 2


# -- peers ---------------------------------------------------------------------------------


def _planted_server(directory: Path, mark: Path, as_nobody: bool) -> int:
    """Fork a process listening on ``directory/<key>.sock`` that answers every
    connection with a pickle which would run ``touch mark``; returns its pid. Bound by
    this process (the directory is private), listening as ``nobody`` when asked: the
    kernel records a listener's credentials when it calls ``listen``."""
    path = directory / f"{pool.server_key(None)}.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    os.chmod(path, 0o666)
    ready_read, ready_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            if as_nobody:
                _as_nobody()
            listener.listen(8)
            os.write(ready_write, b"listening")
            payload = pickle.dumps(_Pwn(mark))
            while True:
                conn, _ = listener.accept()
                with conn:
                    try:
                        conn.sendall(struct.pack("!I", len(payload)) + payload)
                    except OSError:  # the client refused us and hung up first (under
                        pass  # load it can): a planted server keeps serving, as a real one
        finally:
            os._exit(0)
    listener.close()
    os.close(ready_write)
    assert os.read(ready_read, 16) == b"listening"
    os.close(ready_read)
    return pid


@pytest.mark.parametrize("who", ["another user", "simulated"])
def test_a_server_of_another_user_is_never_read_nor_signalled(tmp_path, monkeypatch, who):
    if who == "another user" and not AS_ROOT:
        pytest.skip("needs root to act as a second uid")
    directory = _private(tmp_path)
    mark = tmp_path / PAYLOAD_MARK
    planted = _planted_server(directory, mark, as_nobody=who == "another user")
    if who == "simulated":
        monkeypatch.setattr(trust, "peer_credentials", lambda sock: (planted, NOBODY))
    monkeypatch.setattr(pool, "_warned", set())
    try:
        server = pool.Server(directory, None)
        with pytest.raises(pool.ServerUnavailable, match=f"served by uid {NOBODY}"):
            server.connect()
        with pytest.warns(pool.ServerWarning, match=f"served by uid {NOBODY}"):
            assert servers.statuses(directory) == []
        assert servers.stop_all(directory) == []
        assert servers._alive(planted), "a foreign server was signalled"
        assert not mark.exists(), "a foreign payload ran"
    finally:
        os.kill(planted, signal.SIGKILL)
        os.waitpid(planted, 0)


@pytest.mark.skipif(not AS_ROOT, reason="needs root to act as a second uid")
def test_a_socket_file_another_user_owns_is_refused_before_connecting(tmp_path):
    directory = _private(tmp_path)
    mark = tmp_path / PAYLOAD_MARK
    planted = _planted_server(directory, mark, as_nobody=False)
    try:
        os.chown(directory / f"{pool.server_key(None)}.sock", NOBODY, NOBODY)
        with pytest.raises(pool.ServerUnavailable, match=f"belongs to uid {NOBODY}"):
            pool.Server(directory, None).connect()
    finally:
        os.kill(planted, signal.SIGKILL)
        os.waitpid(planted, 0)


# -- a server that survives bad input --------------------------------------------------------


@pytest.fixture()
def wire_server(tmp_path):
    """A WarmServer (no SGLang: only its wire) on a socket of the test's own; yields
    (socket path, log path, pid); killed at the end."""
    # Others may reach the socket here (a folder they can traverse, the socket opened up
    # below): the server itself must refuse them.
    directory = Path(tempfile.mkdtemp(prefix="contract_lib-wire-"))
    os.chmod(directory, 0o711)
    socket_path, log_path = directory / "s.sock", tmp_path / "server.log"
    ready_read, ready_write = os.pipe()
    code = ("import sys; from pathlib import Path; from contract_lib.child.server import WarmServer; "
            "WarmServer(Path(sys.argv[1]), 'fp', 120.0, None, None, message_timeout=0.5)"
            ".serve(int(sys.argv[2]))")
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-c", code, str(socket_path),
                                    str(ready_write)], pass_fds=(ready_write,),
                                   stdout=log, stderr=log, cwd=PROJECT_ROOT)
    os.close(ready_write)
    assert os.read(ready_read, 64).startswith(b"ready"), log_path.read_text()
    os.close(ready_read)
    os.chmod(socket_path, 0o666)
    yield socket_path, log_path, process.pid
    process.kill()
    process.wait()
    shutil.rmtree(directory)


def _connect(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(path))
    return sock


def _status(path: Path) -> dict:
    with _connect(path) as sock:
        serverwire.send(sock, ["status"])
        return serverwire.recv(sock)


def _closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(30)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("message", [
    struct.pack("!I", 5) + b"\x80\x04K\x05.",  # a pickled 5
    struct.pack("!I", 3) + b"5\n ",  # JSON, but not a request
    struct.pack("!I", 4) + b"[{}]",  # a list whose kind is not a name
    struct.pack("!I", 9) + b"not json!",
    struct.pack("!I", serverwire.MAX_MESSAGE + 1),  # announced over the limit
    struct.pack("!I", 18) + b'["run",{},{},"fp"]',  # a run without its fds
], ids=["pickle", "number", "bad-kind", "not-json", "too-long", "run-without-fds"])
def test_a_malformed_message_closes_only_its_connection(wire_server, message):
    path, log, pid = wire_server
    with _connect(path) as sock:
        sock.sendall(message)
        assert _closed_by_peer(sock)
    assert _status(path)["pid"] == pid  # the server still serves
    assert "closed a connection" in log.read_text()


def test_a_stalled_client_blocks_no_other(wire_server):
    path, log, pid = wire_server
    with _connect(path) as stalled:
        stalled.sendall(b"\x00\x00")  # two bytes of a header, then nothing
        # Another client is served while the stalled one is still connected: its
        # connection is open (not closed by the server) after the reply came.
        assert _status(path)["pid"] == pid
        stalled.setblocking(False)
        with pytest.raises(BlockingIOError):
            stalled.recv(1)
        stalled.setblocking(True)
        assert _closed_by_peer(stalled)  # then dropped (after message_timeout=0.5 s)
    assert "not finished within" in log.read_text()


@pytest.mark.skipif(not AS_ROOT, reason="needs root to act as a second uid")
def test_the_server_refuses_a_client_of_another_user(wire_server):
    path, log, pid = wire_server
    child = os.fork()
    if child == 0:
        code = 2  # could not connect
        try:
            _as_nobody()
            with _connect(path) as sock:
                code = 1  # answered
                try:
                    serverwire.send(sock, ["status"])
                except (BrokenPipeError, ConnectionResetError):
                    code = 0  # closed before the request was sent whole
                else:
                    code = 0 if _closed_by_peer(sock) else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the server answered another user"
    assert f"refused a connection from uid {NOBODY}" in log.read_text()
    assert _status(path)["pid"] == pid


# -- signals only to your own processes ------------------------------------------------------


def _forging_server(directory: Path, victim: int) -> subprocess.Popen:
    """A same-user process on ``<key>.sock`` whose status names ``victim`` as its pid and
    which says ``stopped`` but never exits."""
    code = f"""
import json, socket, struct, sys
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(sys.argv[1]); listener.listen(8)
print("ready", flush=True)
def reply(conn, obj):
    data = json.dumps(obj).encode(); conn.sendall(struct.pack("!I", len(data)) + data)
while True:
    conn, _ = listener.accept()
    size = struct.unpack("!I", conn.recv(4))[0]
    kind = json.loads(conn.recv(size))[0]
    reply(conn, {{"pid": {victim}, "socket": sys.argv[1], "runs_served": 0}}
          if kind == "status" else ["stopped"])
    conn.close()
"""
    process = subprocess.Popen([sys.executable, "-c", code,
                                str(directory / f"{pool.server_key(None)}.sock")],
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"
    return process


def test_server_stop_signals_the_verified_peer_never_a_pid_it_names(tmp_path):
    directory = _private(tmp_path)
    victim = subprocess.Popen(["sleep", "600"])
    forger = _forging_server(directory, victim.pid)
    try:
        found = servers.statuses(directory)
        assert [s["pid"] for s in found] == [forger.pid]  # the kernel's pid, not the reply's
        servers.stop_all(directory, timeout=0.2)
        assert forger.wait(timeout=30) == -signal.SIGKILL  # the peer, proven, is killed
        assert victim.poll() is None, "server stop killed the pid a reply named"
    finally:
        for process in (victim, forger):
            process.kill()
            process.wait()


def test_a_run_whose_server_is_gone_signals_nothing(tmp_path):
    victim = subprocess.Popen(["sleep", "600"])
    ours, theirs = socket.socketpair()
    try:
        child = pool.WarmChild(ours, victim.pid)  # a pid a (gone) server once named
        theirs.close()
        assert child.wait() == -9 and child.server_lost
        time.sleep(0.2)
        assert victim.poll() is None, "a pid was signalled after its server was gone"
    finally:
        victim.kill()
        victim.wait()


# -- exit codes ------------------------------------------------------------------------------


@pytest.mark.parametrize("error", [TypeError("a bug"), MemoryError()])
def test_a_crash_of_the_tool_exits_70_with_its_traceback_in_a_file(monkeypatch, capsys,
                                                                   error):
    from contract_lib.cli import tool_commands as tools

    def crash(args):
        raise error

    monkeypatch.setattr(tools, "cmd_cache", crash)
    assert main(["cache", "path"]) == 70
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"failed with {type(error).__name__}" in err and "bug of contract_lib" in err
    written = Path(err.rsplit("traceback: ", 1)[1].rstrip(")"))
    assert "in crash" in written.read_text()
    written.unlink()


# -- files ---------------------------------------------------------------------------------


def _fifo(tmp_path: Path) -> Path:
    path = tmp_path / "w.toml"
    os.mkfifo(path)
    return path


def _zero(tmp_path: Path) -> Path:
    path = tmp_path / "w.toml"
    path.symlink_to("/dev/zero")
    return path


def _directory(tmp_path: Path) -> Path:
    path = tmp_path / "w.toml"
    path.mkdir()
    return path


def _oversized(tmp_path: Path) -> Path:
    path = tmp_path / "w.toml"
    with open(path, "wb") as handle:
        handle.truncate(1 << 30)  # sparse: 1 GB, nothing written
    return path


@pytest.mark.parametrize("make, says", [
    (_fifo, "is a FIFO, not a regular file"),
    (_zero, "is a device, not a regular file"),
    (_directory, "a directory"),
    (_oversized, f"is 1073741824 bytes; the limit is {MAX_WORKLOAD_BYTES} bytes"),
], ids=["fifo", "dev-zero", "directory", "1GB"])
def test_a_workload_file_of_the_wrong_kind_or_size_is_one_line(tmp_path, capsys, make, says):
    path = make(tmp_path)
    with pytest.raises(WorkloadError, match=says):
        load_workload(path)
    assert main(["check", "--loop", "normal", "--workload", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and says in err and len(err.splitlines()) == 1


def test_a_diff_of_the_wrong_kind_is_one_line(tmp_path):
    from contract_lib.sources.diffs import read_diff
    from contract_lib.sources.trees import SourceError

    with pytest.raises(SourceError, match="is a FIFO"):
        read_diff(_fifo(tmp_path))


def test_the_hang_limit_is_validated(tmp_path):
    path = tmp_path / "w.toml"
    for value in ("0", "-1", "true", '"60"'):
        path.write_text(f'name = "w"\nmax_seconds = {value}\n[[requests]]\nrid = "a"\n'
                        "prompt = [20, 21]\nmax_new_tokens = 2\n")
        with pytest.raises(WorkloadError, match="max_seconds must be a positive number"):
            load_workload(path)
    path.write_text(path.read_text().replace('"60"', "2.5"))
    assert load_workload(path).max_seconds == 2.5


@pytest.mark.skipif(not AS_ROOT, reason="needs a second uid to own the entry")
def test_a_frame_cache_entry_of_another_user_is_never_believed(tmp_path, monkeypatch):
    from contract_lib.runs import cache

    monkeypatch.setenv("CONTRACT_LIB_CACHE_DIR", str(tmp_path))
    entry = tmp_path / ("0" * 64 + ".json")
    entry.write_text(json.dumps({"schema_version": 0}))
    os.chown(entry, NOBODY, NOBODY)
    with pytest.warns(cache.CacheWarning, match=f"belongs to uid {NOBODY}"):
        assert cache.load("0" * 64, {}) is None
    assert entry.exists()  # left to its owner
    (tmp_path / cache.MARKER).write_text("")
    assert cache.clear() == 0 and entry.exists()


@pytest.mark.skipif(not AS_ROOT, reason="needs a second uid to own the folder")
def test_an_install_folder_another_user_can_write_is_never_imported(tmp_path, monkeypatch):
    from contract_lib.sources import versions

    monkeypatch.setenv(versions.RELEASES_DIR_ENV, str(tmp_path / "releases"))
    (tmp_path / "releases").mkdir()
    os.chown(tmp_path / "releases", NOBODY, NOBODY)
    with pytest.raises(versions.SGLangInstallError, match=f"belongs to uid {NOBODY}"):
        versions.sglang_path("0.5.21")
