"""Interrupts, orphans, chatty children, bad input and partial failures (issue #10).

Process tests run ``python -m contract_lib`` as a subprocess in its own session (so a
signal to its process group never reaches pytest) with a private ``TMPDIR``, find the
run's child among its descendants, hurt the parent, and then check that every process
it started is gone within 10 s and no temporary file is left.
"""

from __future__ import annotations

import _thread
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, List, Literal, Optional

import psutil
import pytest

import contract_lib
from contract_lib.runs import servers
from contract_lib.runs.harness import run_many
from contract_lib.workloads import Workload

TESTS_DIR = Path(__file__).resolve().parent
PROJECT_ROOT = TESTS_DIR.parent
HANG = "user_patches:hang_in_loop"


# -- helpers ---------------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_until(predicate, timeout: float, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def _run_children(root: int) -> list[psutil.Process]:
    """The run processes of ``root``: its cold children and the warm servers' runs."""
    found = []
    try:
        descendants = psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    for process in descendants:
        try:
            if "_child_entry" in " ".join(process.cmdline()):
                found.append(process)
        except (psutil.NoSuchProcess, AttributeError):
            continue
    # warm runs: children of the session's warm servers (not descendants of the parent)
    # that ``root`` or a descendant asked for (another xdist worker shares the servers)
    askers = {root, *(process.pid for process in descendants)}
    for status in servers.statuses():
        for pid in status["running"]:
            if status["requesters"].get(str(pid)) not in askers:
                continue
            try:
                found.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                continue
    return found


def _hung(process: psutil.Process) -> bool:
    """The process has used (almost) no CPU for a second: it sits in the injected sleep."""
    try:
        before = sum(process.cpu_times()[:2])
        time.sleep(1.0)
        return sum(process.cpu_times()[:2]) - before < 0.02
    except psutil.NoSuchProcess:
        return False


def _wait_for_hung_runs(root: int, count: int = 1, timeout: float = 180) -> list[int]:
    def hung_runs():
        runs = [p for p in _run_children(root) if _hung(p)]
        return runs if len(runs) >= count else None

    runs = _wait_until(hung_runs, timeout)
    assert runs, "the hanging run never started"
    return [p.pid for p in runs]


def _all_descendants(root: int) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _ctrl_c_as_at_a_prompt() -> None:
    """SIGINT's default in the command, as a shell's foreground job has it: a test session
    started in the background (``pytest ... &`` without job control) ignores SIGINT, and
    an ignored signal stays ignored across exec, so Ctrl-C would never reach the run."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture()
def cli(tmp_path):
    """Start ``python -m contract_lib ARGS`` in its own session with a private TMPDIR;
    every process it started is killed at the end of the test whatever happened."""
    started: list[subprocess.Popen] = []
    seen: set[int] = set()
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()

    def start(*args: str, path: Path | None = None) -> subprocess.Popen:
        """``path``: a folder put first on the command's Python path (a user patch)."""
        paths = [str(p) for p in (path, TESTS_DIR, PROJECT_ROOT) if p is not None]
        env = {**os.environ, "TMPDIR": str(private_tmp), "CONTRACT_LIB_NO_CACHE": "1",
               "PYTHONPATH": os.pathsep.join(paths)}
        process = subprocess.Popen([sys.executable, "-m", "contract_lib", *args],
                                   cwd=PROJECT_ROOT, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True,
                                   start_new_session=True, preexec_fn=_ctrl_c_as_at_a_prompt)
        started.append(process)
        return process

    start.tmp = private_tmp
    start.seen = seen
    yield start
    for process in started:
        seen.update(_all_descendants(process.pid))
        if process.poll() is None:
            process.kill()
        process.communicate()
    for pid in seen:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _logs_left(directory: Path) -> list[str]:
    """Our run logs left in ``directory`` (a run killed inside its Scheduler's build may
    also leave SGLang's IPC name files there: the run removes them once built)."""
    return [p.name for p in directory.glob("contract_lib-*")]


# -- 1. Ctrl-C -------------------------------------------------------------------------------


@pytest.mark.parametrize("signum, to_group, code, word", [
    (signal.SIGINT, False, 130, "interrupted"), (signal.SIGINT, True, 130, "interrupted"),
    (signal.SIGTERM, False, 143, "terminated (SIGTERM)")],
    ids=["ctrl-c-parent", "ctrl-c-process-group", "sigterm"])
def test_ctrl_c_or_sigterm_during_run_stops_it_and_keeps_the_frames(cli, tmp_path, signum,
                                                                     to_group, code, word):
    out = tmp_path / "frames.json"
    process = cli("run", "--loop", "normal", "--workload", "two-turn", "--patch", HANG,
                  "--out", str(out))
    runs = _wait_for_hung_runs(process.pid)
    cli.seen.update(_all_descendants(process.pid))
    started = time.monotonic()
    if to_group:  # a terminal's Ctrl-C reaches every process of the foreground group
        os.killpg(process.pid, signum)
    else:
        os.kill(process.pid, signum)
    stdout, stderr = process.communicate(timeout=30)
    assert process.returncode == code, stderr
    assert time.monotonic() - started < 10
    assert "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(word), stderr
    frames = contract_lib.Frames.load(out)
    assert frames.status == "interrupted"
    assert frames.error["type"] == "KeyboardInterrupt"
    assert len(frames.steps) >= 3
    assert _wait_until(lambda: not any(map(_alive, cli.seen | set(runs))), 10), \
        [p for p in cli.seen if _alive(p)]
    assert _logs_left(cli.tmp) == []


def test_a_run_that_fails_before_its_loop_keeps_the_out_file(cli, tmp_path):
    out = tmp_path / "frames.json"
    good = contract_lib.run("single-decode", "normal")
    good.save(out)
    before = out.read_bytes()
    (tmp_path / "raises_at_import.py").write_text("raise RuntimeError('broken patch')\n"
                                                   "def apply():\n    pass\n")
    process = cli("check", "--loop", "normal", "--workload", "single-decode", "--patch",
                  "raises_at_import:apply", "--out", str(out), path=tmp_path)
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 2, stdout + stderr
    assert "frames not written" in stderr
    assert out.read_bytes() == before


@pytest.mark.parametrize("where", ["command line", "workload"])
def test_the_hang_limit_is_set_from_the_command_line_or_the_workload(cli, tmp_path, where):
    workload = tmp_path / "hang.toml"
    limit = "max_seconds = 3\n" if where == "workload" else ""
    workload.write_text(f'name = "hang"\n{limit}[[requests]]\nrid = "a"\n'
                        "prompt_range = [20, 30]\nmax_new_tokens = 4\n")
    extra = ["--max-seconds", "3"] if where == "command line" else []
    process = cli("check", "--loop", "normal", "--workload", str(workload), "--patch", HANG,
                  "--clauses", "rfc", "--out", str(tmp_path / "frames.json"), *extra)
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 3, stdout + stderr
    assert "no frame from the child for 3 s (the hang limit" in stdout + stderr


def test_ctrl_c_during_status_cancels_queued_runs_and_exits_130(cli):
    process = cli("status", "--patch", HANG)
    workers = os.cpu_count() or 1
    _wait_for_hung_runs(process.pid)  # others may still be starting: they are stopped too
    cli.seen.update(_all_descendants(process.pid))
    cli.seen.update(p.pid for p in _run_children(process.pid))  # warm runs: the server's
    started = time.monotonic()
    os.kill(process.pid, signal.SIGINT)
    late_runs: set[int] = set()

    def watch():  # no queued run may start after the interrupt
        while process.poll() is None:
            late_runs.update(p.pid for p in _run_children(process.pid))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    stdout, stderr = process.communicate(timeout=60)
    watcher.join()
    assert process.returncode == 130, stderr
    assert time.monotonic() - started < 10
    assert "Traceback" not in stderr
    last = stderr.replace("\r", "\n").strip().splitlines()[-1]
    runs = len(contract_lib.workload_names()) * 3  # every shipped workload, three loops
    counts = re.match(rf"interrupted: (\d+) of {runs} runs done, (\d+) stopped, (\d+) "
                      "cancelled", last)
    assert counts, stderr
    done, stopped, cancelled = map(int, counts.groups())
    assert done == 0 and 1 <= stopped <= workers and done + stopped + cancelled == runs
    assert not late_runs - cli.seen, "a queued run started after the interrupt"
    assert _wait_until(lambda: not any(map(_alive, cli.seen)), 10)
    assert _logs_left(cli.tmp) == []


@pytest.fixture()
def python_handles_sigint():
    """SIGINT raises KeyboardInterrupt here for the test, as in a kernel (interrupt_main
    does nothing in a session started with SIGINT ignored, see _ctrl_c_as_at_a_prompt)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("python_handles_sigint")
def test_keyboard_interrupt_in_the_parent_kills_the_run_child():
    """A notebook kernel interrupt: KeyboardInterrupt raised inside the waiting parent."""
    runs: list[int] = []

    def interrupt_when_hung():
        runs.extend(_wait_for_hung_runs(os.getpid()))
        _thread.interrupt_main()

    threading.Thread(target=interrupt_when_hung, daemon=True).start()
    with pytest.raises(KeyboardInterrupt) as caught:
        contract_lib.run("two-turn", "normal", patch=HANG, cache=False, hang_timeout=600)
    from contract_lib.runs.harness import RunInterrupted

    assert runs
    assert isinstance(caught.value, RunInterrupted), repr(caught.value)
    frames = caught.value.frames
    assert frames.status == "interrupted" and len(frames.steps) >= 3
    assert _wait_until(lambda: not any(map(_alive, runs)), 5)


def test_an_error_in_the_parent_while_collecting_kills_the_run_child(monkeypatch):
    from contract_lib.wire import protocol

    runs: list[int] = []

    def broken_slot_rows(per_request):
        runs.extend(p.pid for p in _run_children(os.getpid()))
        raise RuntimeError("a bug in the parent")

    monkeypatch.setattr(protocol, "slot_rows", broken_slot_rows)
    with pytest.raises(RuntimeError, match="a bug in the parent"):
        contract_lib.run("two-turn", "normal", patch=HANG, cache=False)
    assert runs
    assert _wait_until(lambda: not any(map(_alive, runs)), 5)


# -- 2. a killed parent ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["warm", "cold"])
def test_killing_the_parent_of_a_hung_run_leaves_nothing_behind(cli, mode):
    process = cli("run", "--loop", "normal", "--workload", "two-turn", "--patch", HANG,
                  *(["--cold"] if mode == "cold" else []))
    runs = _wait_for_hung_runs(process.pid)
    started = _all_descendants(process.pid) + runs  # warm: the run is the server's child
    cli.seen.update(started)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    left = _wait_until(lambda: not [p for p in started if _alive(p)], 10)
    assert left, [psutil.Process(p).cmdline() for p in started if _alive(p)]
    # Nothing at all: no log, and none of SGLang's IPC name files (the run hung in its
    # loop, past the build, where it removed them).
    assert sorted(path.name for path in cli.tmp.iterdir()) == []


# -- 3. a chatty child -----------------------------------------------------------------------


def _bytes_read() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def test_a_chatty_child_costs_the_parent_only_a_bounded_tail():
    before = _bytes_read()
    frames = contract_lib.run("two-turn", "normal", patch="user_patches:print_a_lot",
                              cache=False)
    read = _bytes_read() - before
    assert frames.status == "crashed" and "after a lot of output" in frames.error["message"]
    assert frames.error["log_tail"].endswith("the last line of a chatty child")
    assert len(frames.error["log_tail"]) < 64 * 1024
    assert read < 8 * 2**20, f"the parent read {read / 2**20:.0f} MB of a 100 MB log"


# -- 4. bad input ----------------------------------------------------------------------------


def _workload(**request_changes) -> dict:
    """A one-request workload dict; a change to None removes that field."""
    request = {"rid": "a", "prompt": [20, 21, 22], "max_new_tokens": 2, **request_changes}
    return {"name": "w", "requests": [{k: v for k, v in request.items() if v is not None}]}


@pytest.mark.parametrize("field, value", [
    ("max_new_tokens", 1.5), ("max_new_tokens", "3"), ("max_new_tokens", True),
    ("arrival", -1), ("arrival", 0.5), ("prompt", [20, "21"]), ("prompt", [20, 2.0]),
    ("prompt_range", [20, 30.5]),
])
def test_non_integer_or_negative_counts_are_rejected(field, value):
    changes = {field: value, **({"prompt": None} if field == "prompt_range" else {})}
    with pytest.raises(contract_lib.WorkloadError, match=field) as caught:
        Workload.from_dict(_workload(**changes))
    assert "\n" not in str(caught.value)


def test_max_steps_must_be_an_integer_and_requests_are_needed():
    with pytest.raises(contract_lib.WorkloadError, match="max_steps"):
        Workload.from_dict({**_workload(), "max_steps": "120"})
    with pytest.raises(contract_lib.WorkloadError, match="no requests"):
        Workload.from_dict({"name": "w", "requests": []})
    with pytest.raises(contract_lib.WorkloadError, match="missing field 'max_new_tokens'"):
        Workload.from_dict(_workload(max_new_tokens=None))


def _model_vocab() -> int:
    return json.loads((PROJECT_ROOT / "data" / "model" / "config.json").read_text())[
        "vocab_size"]


@pytest.mark.parametrize("runner, loop", [("model-free", "normal"), ("real", "mlx")])
def test_token_ids_outside_the_vocabulary_are_rejected_before_any_child(
        runner, loop, monkeypatch):
    from contract_lib.runs import harness

    monkeypatch.setattr(harness, "_execute", lambda *a, **k: pytest.fail("a run started"))
    if runner == "real":
        from contract_lib.sources.tiny_model import tiny_model_dir

        vocab = json.loads((tiny_model_dir() / "config.json").read_text())["vocab_size"]
    else:
        vocab = _model_vocab()
    workload = Workload.from_dict(_workload(prompt=[20, vocab]))
    with pytest.raises(contract_lib.WorkloadError, match=f"vocabulary.*{vocab}"):
        contract_lib.run(workload, loop, runner=runner, cache=False)
    Workload.from_dict(_workload(prompt=[20, vocab - 1]))  # the last id is fine


def _cli(*args: str, cwd: Path = PROJECT_ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), str(PROJECT_ROOT)]),
           "CONTRACT_LIB_NO_CACHE": "1"}
    return subprocess.run([sys.executable, "-m", "contract_lib", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def _one_line_usage_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_bad_workload_files_are_one_line_usage_errors(tmp_path):
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes('name = "caf\xe9"\n'.encode("latin-1"))
    _one_line_usage_error(_cli("check", "--loop", "normal", "--workload", str(latin1)),
                          "UTF-8")
    directory = tmp_path / "folder.toml"
    directory.mkdir()
    _one_line_usage_error(_cli("check", "--loop", "normal", "--workload", str(directory)),
                          "directory")
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "w"\n[[requests]]\nrid = "a"\nprompt = [20, 21]\n'
                   "max_new_tokens = 1.5\n")
    _one_line_usage_error(_cli("check", "--loop", "normal", "--workload", str(bad)),
                          "max_new_tokens")
    negative = tmp_path / "negative.toml"
    negative.write_text('name = "w"\n[[requests]]\nrid = "a"\nprompt = [20, 21]\n'
                        "max_new_tokens = 2\narrival = -3\n")
    _one_line_usage_error(_cli("check", "--loop", "normal", "--workload", str(negative)),
                          "arrival")


def test_a_wrong_typed_server_arg_names_the_argument_and_the_type(monkeypatch):
    from contract_lib.runs.pool import Server

    started = []
    original = Server.start_run
    monkeypatch.setattr(Server, "start_run",
                        lambda self, *a, **k: started.append(a) or original(self, *a, **k))
    with pytest.raises(contract_lib.RunSetupError,
                       match=r"server arg max_running_requests.*int.*'eight' \(str\)"):
        contract_lib.run("single-decode", "normal", cache=False,
                         server_args={"max_running_requests": "eight"})
    with pytest.raises(contract_lib.RunSetupError, match=r"disable_cuda_graph.*bool"):
        contract_lib.run("single-decode", "normal", cache=False,
                         server_args={"disable_cuda_graph": 1})
    with pytest.raises(contract_lib.RunSetupError, match=r"unknown server arg"):
        contract_lib.run("single-decode", "normal", cache=False,
                         server_args={"no_such_arg": 1})
    assert started == [], "a run child was started for a bad server arg"


@dataclasses.dataclass
class _Args:
    """A ServerArgs-like dataclass (annotations resolved from this module's names)."""

    count: Annotated[Optional[int], "help"] = None
    ratio: float = 0.5
    flag: bool = False
    mode: Literal["a", "b"] = "a"
    ids: List[int] | None = None
    anything: object = None


def test_server_arg_kinds_follow_the_field_annotations():
    from contract_lib.wire.serverargs import accepted_kinds, problems

    kinds = accepted_kinds(_Args)
    assert kinds == {"count": ("int", "None"), "ratio": ("float",), "flag": ("bool",),
                     "mode": ("str",), "ids": ("list", "None"), "anything": None}
    assert problems({"count": 3, "ratio": 1, "flag": True, "mode": "b", "ids": [1],
                     "anything": {}}, kinds) == []
    assert problems({"count": True, "ratio": "0.5", "flag": 1, "cuont": 2}, kinds) == [
        "server arg count wants int or None, got True (bool)",
        "server arg ratio wants float, got '0.5' (str)",
        "server arg flag wants bool, got 1 (int)",
        "unknown server arg 'cuont' (not a field of SGLang's ServerArgs); did you mean "
        "'count'?"]


def test_a_wrong_typed_server_arg_on_the_command_line_exits_2():
    result = _cli("run", "--loop", "normal", "--workload", "single-decode",
                  "--server-arg", "max_running_requests=1.5")
    _one_line_usage_error(result, "max_running_requests", "int", "1.5")


def test_true_and_false_on_the_command_line_are_booleans():
    from contract_lib.cli import server_arg

    assert server_arg("disable_overlap_schedule=true") == ("disable_overlap_schedule", True)
    assert server_arg("disable_overlap_schedule=False") == ("disable_overlap_schedule",
                                                             False)


# -- 5. run_many -----------------------------------------------------------------------------


def test_run_many_returns_every_result_and_every_error():
    results = run_many([
        {"workload": "single-decode", "loop": "normal"},
        {"workload": "single-decode", "loop": "cuda"},
        {"workload": "no-such-workload", "loop": "normal"},
        {"workload": "single-decode", "loop": "overlap"},
    ], progress=False)
    assert len(results) == 4
    assert isinstance(results[0], contract_lib.Frames) and results[0].status == "finished"
    assert isinstance(results[1], contract_lib.RunSetupError)
    assert isinstance(results[2], contract_lib.WorkloadError)
    assert isinstance(results[3], contract_lib.Frames) and results[3].status == "finished"
