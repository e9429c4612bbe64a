"""The warm server's lifecycle as a user meets it (issue #15): shared by processes and
threads, idle exit, ``server stop``/``status``, stale-file restart, a killed requester,
two processes starting it at once, and the cold fallbacks.

Each test that starts, stops or replaces a server uses a server directory of its own
(``CONTRACT_LIB_SERVER_DIR``), stopped at its end, so no test sees another's server and
none is left behind; the tests that only run on one share a directory of their class's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

import contract_lib
from contract_lib.runs import fingerprint, pool, servers as warm
from contract_lib.runs.harness import run_many

TESTS_DIR = Path(__file__).resolve().parent
PROJECT_ROOT = TESTS_DIR.parent
HANG = "user_patches:hang_in_loop"


def _alive(pid: int) -> bool:
    return warm._alive(pid)


def _wait_until(predicate, timeout: float, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(interval)
    return predicate()


def _env(directory: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, pool.SERVER_DIR_ENV: str(directory), "CONTRACT_LIB_NO_CACHE": "1",
            "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), str(PROJECT_ROOT)]), **extra}


def _api_run(directory: Path, code: str, **extra: str) -> subprocess.Popen:
    """A separate Python process calling the API (as a notebook kernel would)."""
    return subprocess.Popen([sys.executable, "-c", f"import contract_lib\n{code}"],
                            cwd=PROJECT_ROOT, env=_env(directory, **extra),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _hung_run(directory: Path) -> int:
    """The pid of the run the directory's one server is running, once it hangs."""
    def running():
        found = warm.statuses(directory)
        return found and found[0]["running"] and found[0]["running"][0]

    pid = _wait_until(running, 180, 0.5)
    assert pid, "the hanging run never started"
    time.sleep(2)  # well inside its injected sleep
    return pid


# -- shared by processes and threads -------------------------------------------------------


def test_server_start_warms_the_server_the_next_run_forks_from(servers):
    """``server start`` returns once the server listens; the next command's run is
    forked from it (the same pid), not from a replacement."""
    started = subprocess.run([sys.executable, "-m", "contract_lib", "server", "start"],
                             cwd=PROJECT_ROOT, env=_env(servers), capture_output=True,
                             text=True)
    assert started.returncode == 0, started.stderr
    (status,) = warm.statuses(servers)
    assert status["runs_served"] == 0 and "current" in started.stdout
    done = subprocess.run([sys.executable, "-m", "contract_lib", "check", "--loop", "normal",
                           "--workload", "single-decode", "--no-cache", "--clauses", "rfc"],
                          cwd=PROJECT_ROOT, env=_env(servers), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    (after,) = warm.statuses(servers)
    assert after["pid"] == status["pid"] and after["runs_served"] == 1
    refused = subprocess.run([sys.executable, "-m", "contract_lib", "server", "start",
                              "--sglang", "0.9"], cwd=PROJECT_ROOT, env=_env(servers),
                             capture_output=True, text=True)
    assert refused.returncode == 2 and "supports sglang" in refused.stderr
    off = subprocess.run([sys.executable, "-m", "contract_lib", "server", "start"],
                         cwd=PROJECT_ROOT, env=_env(servers, **{pool.SERVER_SWITCH_ENV: "off"}),
                         capture_output=True, text=True)
    assert off.returncode == 2 and "switched off" in off.stderr


def test_two_processes_starting_a_server_at_once_share_it(servers):
    processes = [_api_run(servers, "print(contract_lib.run('single-decode', 'normal', "
                                   "cache=False).status)") for _ in range(2)]
    outputs = [p.communicate(timeout=300) for p in processes]
    assert [out.strip() for out, _ in outputs] == ["finished", "finished"], outputs
    assert not any("ServerWarning" in err for _, err in outputs), outputs
    (status,) = warm.statuses(servers)
    assert status["runs_served"] == 2


# -- lifecycle ------------------------------------------------------------------------------


def test_an_idle_server_exits_and_removes_its_socket(servers, monkeypatch):
    monkeypatch.setenv(pool.IDLE_ENV, "3")
    assert contract_lib.run("single-decode", "normal", cache=False).status == "finished"
    (status,) = warm.statuses(servers)
    assert status["idle_s"] == 3
    assert _wait_until(lambda: not _alive(status["pid"]), 20)
    assert not list(servers.glob("*.sock"))
    # the next run starts a new one
    assert contract_lib.run("single-decode", "normal", cache=False).status == "finished"
    assert warm.statuses(servers)[0]["pid"] != status["pid"]


def test_server_stop_kills_its_runs_and_the_run_keeps_its_frames(servers):
    result: dict = {}

    def hung():
        result["frames"] = contract_lib.run("two-turn", "normal", patch=HANG, cache=False,
                                            hang_timeout=120)

    thread = threading.Thread(target=hung)
    thread.start()
    run_pid = _hung_run(servers)
    (status,) = warm.statuses(servers)
    busy = subprocess.run([sys.executable, "-m", "contract_lib", "server", "status"],
                          cwd=PROJECT_ROOT, env=_env(servers), capture_output=True, text=True)
    assert f"busy, 1 running (asked by pid {os.getpid()})" in busy.stdout, busy.stdout
    stopped = subprocess.run([sys.executable, "-m", "contract_lib", "server", "stop"],
                             cwd=PROJECT_ROOT, env=_env(servers), capture_output=True,
                             text=True, timeout=60)
    assert stopped.returncode == 0 and "stopped 1 warm server" in stopped.stdout
    thread.join(30)
    frames = result["frames"]
    assert frames.status == "died" and frames.error["type"] == "ForkServerDied"
    assert len(frames.steps) >= 3
    assert not _alive(status["pid"]) and not _alive(run_pid)
    assert not list(servers.glob("*.sock"))
    shown = subprocess.run([sys.executable, "-m", "contract_lib", "server", "status"],
                           cwd=PROJECT_ROOT, env=_env(servers), capture_output=True, text=True)
    assert "no warm server running" in shown.stdout


def test_a_server_of_other_library_files_is_replaced(servers, monkeypatch, tmp_path):
    extra = tmp_path / "edited_module.py"
    extra.write_text("x = 1\n")
    monkeypatch.setattr(fingerprint, "LIBRARY_FILES", [*fingerprint.LIBRARY_FILES, extra])
    monkeypatch.setattr(fingerprint, "PROJECT_ROOT", Path("/"))  # the names the digest holds
    before = contract_lib.run("single-decode", "normal", cache=False)
    (old,) = warm.statuses(servers)
    extra.write_text("x = 2\n")  # a library file edited
    after = contract_lib.run("single-decode", "normal", cache=False)
    (new,) = warm.statuses(servers)
    assert new["pid"] != old["pid"] and new["fingerprint"] != old["fingerprint"]
    assert _wait_until(lambda: not _alive(old["pid"]), 10), "the stale server stayed"
    assert before.status == after.status == "finished"


def test_a_server_of_an_edited_source_tree_is_replaced(servers):
    """A source tree or diff copy (contract_lib.sources.origin) is judged by its content
    identity, which the run spec carries: an edit makes its server stale at once."""
    handle = pool.POOL.acquire(None, {"sha256": "tree before the edit"})
    handle.arg_kinds = None
    handle.server_arg_kinds()
    (old,) = warm.statuses(servers)
    assert old["identity"] == {"sha256": "tree before the edit"}
    handle = pool.POOL.acquire(None, {"sha256": "tree after the edit"})
    handle.arg_kinds = None
    handle.server_arg_kinds()
    (new,) = warm.statuses(servers)
    assert new["pid"] != old["pid"] and new["identity"] == {"sha256": "tree after the edit"}
    assert _wait_until(lambda: not _alive(old["pid"]), 10), "the stale server stayed"


# -- cold fallbacks ---------------------------------------------------------------------------


def test_an_unusable_server_directory_warns_once_and_runs_cold(servers, monkeypatch):
    servers.parent.mkdir(parents=True, exist_ok=True)
    servers.write_text("a file where the server directory should be\n")
    monkeypatch.setattr(pool, "_warned", set())
    with pytest.warns(pool.ServerWarning, match="not a directory.*runs start cold"):
        frames = contract_lib.run("single-decode", "normal", cache=False)
    assert frames.status == "finished"
    servers.unlink()


@pytest.mark.fast
def test_the_server_key_separates_releases_and_sglang_environments(monkeypatch):
    venv = pool.server_key(None)
    assert pool.server_key("/x/0.5.21") != venv
    monkeypatch.setenv("SGLANG_SOME_FLAG", "1")
    assert pool.server_key(None) != venv


# -- runs on one private server: started once for the class, never stopped by a test ------


def _served(directory: Path) -> int:
    """The runs the directory's one server has served so far (0: none runs yet)."""
    found = warm.statuses(directory)
    return found[0]["runs_served"] if found else 0


_FAILING_BUILD = """def apply():
    from sglang.srt.managers.scheduler import Scheduler
    built = Scheduler.__init__

    def __init__(self, *args, **kwargs):
        built(self, *args, **kwargs)  # its sockets are bound, then the build fails
        raise RuntimeError("the build failed")

    Scheduler.__init__ = __init__
"""


class TestOnePrivateServer:
    """Runs on a warm server that none of these tests starts, stops or replaces: they
    share one server directory of their own (``class_servers``; the class runs whole on
    one worker), each counting the runs it adds."""

    def test_later_processes_and_the_cli_fork_from_the_same_server(self, class_servers):
        servers, before = class_servers, _served(class_servers)
        first = contract_lib.run("single-decode", "normal", cache=False)
        (status,) = warm.statuses(servers)
        assert first.status == "finished" and status["runs_served"] == before + 1
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "contract_lib", "check", "--loop",
                               "normal", "--workload", "single-decode", "--no-cache",
                               "--clauses", "rfc"], cwd=PROJECT_ROOT, env=_env(servers),
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert time.monotonic() - started < 15  # no SGLang import in the command
        (after,) = warm.statuses(servers)
        assert after["pid"] == status["pid"] and after["runs_served"] == before + 2
        shown = subprocess.run([sys.executable, "-m", "contract_lib", "server", "status"],
                               cwd=PROJECT_ROOT, env=_env(servers), capture_output=True,
                               text=True)
        assert f"pid {status['pid']}: sglang" in shown.stdout
        assert f"{before + 2} runs served" in shown.stdout
        assert "current" in shown.stdout and "exits in" in shown.stdout

    def test_concurrent_threads_share_one_server(self, class_servers):
        before = _served(class_servers)
        results = run_many([{"workload": "two-turn", "loop": loop, "cache": False}
                            for loop in ("normal", "overlap", "mlx") for _ in range(3)],
                           workers=8, progress=False)
        assert [r.status for r in results] == ["finished"] * 9
        (status,) = warm.statuses(class_servers)
        assert status["runs_served"] == before + 9
        assert len(list(class_servers.glob("*.sock"))) == 1

    def test_a_run_that_sent_its_end_is_let_go_and_reaped_by_its_server(
            self, class_servers, monkeypatch):
        """``run`` returns once the run sent its end, without waiting for its exit; the
        server kills (if need be) and reaps the process, so none is left behind."""
        released = []
        real_release = pool.WarmChild.release
        monkeypatch.setattr(pool.WarmChild, "release",
                            lambda child: released.append(child.pid) or real_release(child))
        frames = contract_lib.run("two-turn", "normal", cache=False)
        assert frames.status == "finished" and released
        assert _wait_until(lambda: not _alive(released[0])
                           and not warm.statuses(class_servers)[0]["running"], 5)

    def test_a_run_dies_with_the_process_that_asked_for_it(self, class_servers):
        before = _served(class_servers)
        requester = _api_run(class_servers, f"contract_lib.run('two-turn', 'normal', "
                                            f"patch={HANG!r}, cache=False)")
        run_pid = _hung_run(class_servers)
        (status,) = warm.statuses(class_servers)
        assert status["runs_served"] == before + 1
        os.kill(requester.pid, signal.SIGKILL)
        requester.communicate()
        assert _wait_until(lambda: not _alive(run_pid)
                           and not warm.statuses(class_servers)[0]["running"], 5), (
            "the run outlived its requester")
        (after,) = warm.statuses(class_servers)  # the server stays, idle, for the next
        assert after["pid"] == status["pid"] and after["runs_served"] == before + 1

    def test_a_warm_run_imports_a_patch_from_the_requesters_path(self, class_servers,
                                                                 tmp_path, monkeypatch):
        contract_lib.run("single-decode", "normal", cache=False)  # the server runs first
        before = _served(class_servers)
        folder = tmp_path / "late"
        folder.mkdir()
        (folder / "late_patch.py").write_text(
            "def apply():\n    raise RuntimeError('the late patch ran')\n")
        monkeypatch.syspath_prepend(str(folder))  # as a notebook adding a folder later
        frames = contract_lib.run("single-decode", "normal", patch="late_patch:apply",
                                  cache=False)
        assert "the late patch ran" in frames.error["message"]
        assert _served(class_servers) == before + 1

    @pytest.mark.parametrize("build", ["built", "failed"])
    @pytest.mark.parametrize("switch", ["on", "off"])
    def test_a_run_leaves_nothing_in_the_temporary_folder(self, class_servers, monkeypatch,
                                                          tmp_path, switch, build):
        """SGLang's ``PortArgs.init_new`` takes five IPC names with
        ``NamedTemporaryFile(delete=False)`` per Scheduler and never removes them (154,000
        such files had piled up in this machine's /tmp): the run removes them once its
        Scheduler is built or its build failed, warm (forked: it follows the requester's
        ``TMPDIR``) or cold. Switched off, a run goes cold: no server starts or is asked."""
        monkeypatch.setenv(pool.SERVER_SWITCH_ENV, switch)
        scratch = tmp_path / "tmp"
        scratch.mkdir()
        monkeypatch.setenv("TMPDIR", str(scratch))  # the requester's and a cold child's
        monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # this process's
        patch = None
        if build == "failed":
            folder = tmp_path / "patches"
            folder.mkdir()
            (folder / "failing_build.py").write_text(_FAILING_BUILD)
            monkeypatch.syspath_prepend(str(folder))
            patch = "failing_build:apply"
        before = _served(class_servers), sorted(class_servers.glob("*.sock"))
        frames = contract_lib.run("single-decode", "normal", patch=patch, cache=False)
        if switch == "off":  # the run went cold: no server started or asked
            assert (_served(class_servers), sorted(class_servers.glob("*.sock"))) == before
        if build == "failed":
            assert "the build failed" in frames.error["message"]
        else:
            assert frames.status == "finished"
        assert sorted(path.name for path in scratch.iterdir()) == []


# -- import cost ------------------------------------------------------------------------------


@pytest.mark.fast
def test_importing_the_package_loads_no_heavy_library():
    code = ("import sys, contract_lib\n"
            "print(sorted(m for m in ('pandas', 'numpy', 'matplotlib', 'torch', 'sglang') "
            "if m in sys.modules))\n"
            "contract_lib.Frames\n"
            "print('pandas' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True,
                          text=True, check=True)
    assert done.stdout.split("\n")[:2] == ["[]", "True"], done.stdout


@pytest.mark.fast
def test_checking_recorded_frames_loads_none_of_the_hooks():
    """A process that reads and checks frames (a command, a notebook kernel) imports
    none of the run's process: no hook, no platform gate they pull in
    (``unittest.mock``, asyncio), no recorder: they load in a run's process. An MLX
    run's check reads its KV pool verdict off the frames (``contract.kv_damage``); the
    outputs check reads the fake model's next-token function (``shims.model``)."""
    fixture = PROJECT_ROOT / "tests" / "fixtures" / "memory-pressure.mlx.json"
    code = ("import sys\n"
            "from contract_lib import Frames\n"
            "from contract_lib.contract import check\n"
            f"check(Frames.load({str(fixture)!r}))\n"
            "print(sorted(m for m in sys.modules if m.startswith('contract_lib.child.') "
            "and m not in ('contract_lib.child.shims', 'contract_lib.child.shims.model') "
            "or m in ('unittest.mock', 'asyncio')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True,
                          text=True, check=True)
    assert done.stdout.split() == ["[]"], done.stdout
