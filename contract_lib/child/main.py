"""What runs in the run's process (a cold child or a fork of a warm server): apply the
shims and the patch, build the loop's real scheduler, enter its event loop, stream the
frames to the parent (:mod:`contract_lib.wire.protocol`) and report the run's end.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import pickle
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from contract_lib import loops
from contract_lib.child.families import SGLangFamily, family_of
from contract_lib.child.refusals import (
    check_page_size,
    refuse_workload,
    resolved_args,
)
from contract_lib.paths import MODEL_DIR
from contract_lib.sources.user_modules import user_modules
from contract_lib.wire import journal
from contract_lib.wire.protocol import END, LoopMismatch, RunSetupError, error_record
from contract_lib.wire.serverargs import accepted_kinds, problems
from contract_lib.wire.spec import REAL, RunSpec

# The server args every run starts from (a CPU, model-free, deterministic scheduler);
# a workload's [server_args] and the caller's overrides are applied on top.
BASE_SERVER_ARGS: dict[str, Any] = {
    "device": "cpu",
    "skip_tokenizer_init": True,
    "load_format": "dummy",
    "max_total_tokens": 2048,
    "max_running_requests": 8,
    "attention_backend": "torch_native",
    "sampling_backend": "pytorch",
    "disable_cuda_graph": True,
    "random_seed": 0,
}
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int) -> None:
    """Make this process get SIGKILL when its parent dies (Linux ``PR_SET_PDEATHSIG``;
    it fires when the *thread* that started this process exits, so a parent starts its
    children from threads that outlive them), and exit now if the parent already died."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def _child_entry() -> None:
    """Entry point of a cold child process: the run spec arrives as JSON on stdin (as a
    warm server receives it), messages go back on the pipe whose fd is ``argv[1]`` and
    the journal whose fd is ``argv[3]``; stdout and stderr go to the run's log."""
    die_with_parent(int(sys.argv[2]))
    spec = RunSpec.from_json(json.loads(sys.stdin.buffer.read()))
    child_run(spec, Connection(int(sys.argv[1]), readable=False), int(sys.argv[3]))
    os._exit(0)  # skip SGLang's atexit teardown; everything was sent


def sender(conn: Connection, journal_fd: int):
    """The run's ``emit``: each message pickled as it is taken and stored in the journal
    (:mod:`contract_lib.wire.journal`); a thread notes on the pipe what is stored at most
    every ``journal.NOTE_S`` seconds, and so does the run's end. Once the journal is
    full, messages go on the pipe itself. Pickled without ``conn.send``'s per-message
    set-up of multiprocessing's pickler (~2 µs): the messages are plain data."""
    send_bytes = conn.send_bytes
    writer: journal.Writer | None = journal.Writer(journal_fd)
    lock = threading.Lock()  # one record or note at a time, whatever thread emits
    noted = 0  # the offset last noted

    def note() -> None:  # (under the lock)
        nonlocal noted
        if writer is not None and writer.offset != noted:
            send_bytes(pickle.dumps((journal.NOTE, writer.offset), pickle.HIGHEST_PROTOCOL))
            noted = writer.offset

    def emit(message: tuple) -> None:
        nonlocal writer
        data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        with lock:
            if writer is not None:
                if writer.append(data):
                    if message[0] == END:
                        note()
                    return
                note()  # full: what it holds comes first, the pipe from here on
                writer = None
            send_bytes(data)

    def keep_noting() -> None:
        """Note new records while the run goes on: the parent reads them, and its hang
        check sees progress (a run that stores nothing new gets no note)."""
        try:
            while True:
                time.sleep(journal.NOTE_S)
                with lock:
                    note()
        except OSError:  # the pipe closed: the run ended
            pass

    threading.Thread(target=keep_noting, name="contract_lib-journal-notes",
                     daemon=True).start()
    return emit


def child_run(spec: RunSpec, conn: Connection, journal_fd: int) -> None:
    """One run inside its own process (cold or forked): build, loop, report the end;
    messages go to the journal ``journal_fd``, its notes on ``conn``."""
    emit = sender(conn, journal_fd)
    recorder = kv_recorder = None
    phase = "setup"
    status, error = "finished", None
    timing: dict[str, float] = {}
    started = time.perf_counter()
    loop_spec = spec.loop
    try:
        family = family_of(loop_spec)
        scheduler, recorder, kv_recorder = _build(spec, family, emit, timing)
        # The build's objects join the permanent generation, as the server's imports did
        # before the fork and as SGLang's own ``freeze_gc`` request does to a serving
        # Scheduler: the loop's collections then walk what the loop made, not the
        # Scheduler's objects (a collection over them took 1-3 ms of a 30-80 ms loop,
        # in whichever run crossed the threshold first: the capture's, or its baseline).
        # Nothing is collected here: the process is short-lived, its garbage goes with it.
        gc.freeze()
        phase = "loop"
        loop_started, loop_cpu = time.perf_counter(), time.process_time()
        try:
            family.enter(scheduler)
        finally:
            timing["loop_s"] = time.perf_counter() - loop_started
            # the CPU the run's process spent in the loop: its cost, whatever else runs
            timing["loop_cpu_s"] = time.process_time() - loop_cpu
        status, error = "crashed", error_record("loop returned without finishing the workload")
    except BaseException as exc:  # noqa: BLE001 - every fault is reported, not raised
        from contract_lib.child.capture import StepBudgetExceeded, StopRun

        if isinstance(exc, StopRun):
            status, error = "finished", None
        elif isinstance(exc, StepBudgetExceeded):
            status, error = "timeout", error_record(str(exc), exc, phase)
        elif isinstance(exc, LoopMismatch):  # raised at loop entry, before any step
            status, error = "crashed", error_record(str(exc), exc, "setup")
        else:
            status, error = "crashed", error_record(str(exc), exc, phase)
    if recorder is not None:
        recorder.finish()
    if kv_recorder is not None:
        try:
            kv_recorder.finish()
        except Exception as exc:  # noqa: BLE001 - the inspection failing is a crash
            if status == "finished":
                status, error = "crashed", error_record(str(exc), exc, "kv-pool-inspection")
    timing["total_s"] = time.perf_counter() - started
    files, names = user_modules()  # the cache verifies them
    emit(("meta", {"user_modules": files, "user_module_names": names}))
    emit(("meta", {"timing": timing}))
    emit(("end", status, error))
    conn.close()


def _build(spec: RunSpec, family: SGLangFamily, emit, timing: dict[str, float]):
    """Shims, patch, a real scheduler of the loop's family and the capture hooks (wall
    times into ``timing``). Returns the scheduler, the frame recorder and the KV pool
    recorder (MLX)."""
    started = time.perf_counter()
    loop_spec, runner = spec.loop, spec.runner
    if loop_spec.mlx:
        os.environ["SGLANG_USE_MLX"] = "1"
    from contract_lib.child import shims
    from contract_lib.sources import backports, compat

    applied = shims.install_import_shims()
    backports.install_import_compat()
    _check_sglang_release(spec)
    from sglang.srt.managers import scheduler as _scheduler_module  # noqa: F401
    from sglang.srt.server_args import ServerArgs

    timing["import_s"] = time.perf_counter() - started
    applied += backports.install_import_compat() + backports.install_release_compat()

    from contract_lib.child.capture import Recorder
    from contract_lib.patches.builtin import apply_patch

    holder: dict[str, Recorder] = {}

    def on_launch(batch, tokens: list[int]) -> None:
        holder["recorder"].on_torch_launch(batch, tokens)

    applied += family.install_shims(spec.omni_dir, on_launch)
    if loop_spec.mlx:
        if shims.install_mlx_runtime_gate_shim():
            applied.append("mlx-runtime-gate")
        if runner == REAL:
            applied += shims.install_mlx_real_runner()
        else:
            shims.install_mlx_model_free_runner()
            applied.append("mlx-model-free-runner")
    apply_patch(spec.patch)

    workload = spec.workload
    refuse_workload(loop_spec, workload, runner)
    family.refuse(workload)
    shims.install_token_script(workload.scripted_tokens())
    model_dir = spec.model_dir if runner == REAL else str(MODEL_DIR)
    user_args = spec.user_server_args()
    args = {**BASE_SERVER_ARGS, "model_path": model_dir,
            "disable_overlap_schedule": loop_spec.disable_overlap_schedule,
            **family.server_args(), **user_args}
    if user_args and (found := problems(user_args, accepted_kinds(ServerArgs))):
        raise RunSetupError("; ".join(found))  # a cold run's parent could not check them
    scheduler = family.build(ServerArgs(**args), args, spec.server_args,
                             workload.server_args, applied, timing)
    check_page_size(scheduler, loop_spec.name,
                    triton=not any(name.startswith("triton-standin") for name in applied))
    emit(("meta", {"shims": applied, "expect": workload.expected_outcomes(),
                   "enable_overlap": bool(scheduler.enable_overlap),
                   "enable_overlap_mlx": bool(scheduler.enable_overlap_mlx),
                   "resolved_args": resolved_args(scheduler),
                   "absent_fields": compat.absent_fields(scheduler),
                   # the fake model's scripted tokens, {rid: [[position, token], ...]}
                   "script": {rid: sorted(tokens.items()) for rid, tokens
                              in workload.scripted_tokens().items()}}))
    _record_loop_entry(scheduler, loop_spec, emit)
    recorder = Recorder(scheduler, loop_spec, workload, emit, capture=spec.capture,
                        audit=spec.audit)
    holder["recorder"] = recorder
    recorder.install()
    kv_recorder = None
    if loop_spec.mlx and spec.capture:  # either runner's pool
        from contract_lib.child.kvpool import KvPoolRecorder

        kv_recorder = KvPoolRecorder(recorder.state, model_dir)
        kv_recorder.install()
    return scheduler, recorder, kv_recorder


def _record_loop_entry(scheduler, loop_spec: loops.LoopSpec, emit) -> None:
    """Wrap every ``event_loop_*`` method of the instance: the one SGLang's dispatch
    enters is recorded in the run's meta (``loop_function``), and one that is not the
    requested loop's stops the run before its first step (:class:`LoopMismatch`)."""
    loop, wanted = loop_spec.name, loop_spec.function
    for name in [n for n in dir(type(scheduler)) if n.startswith("event_loop_")]:
        real = getattr(scheduler, name)

        def entered(*args, _name=name, _real=real, **kwargs):
            emit(("meta", {"loop_function": _name}))
            if _name != wanted:
                raise LoopMismatch(
                    f"--loop {loop} asked for {wanted}, but SGLang's dispatch entered "
                    f"{_name} (enable_overlap={scheduler.enable_overlap}, "
                    f"enable_overlap_mlx={scheduler.enable_overlap_mlx})")
            return _real(*args, **kwargs)

        setattr(scheduler, name, entered)


def _check_sglang_release(spec: RunSpec) -> None:
    """The child imports the SGLang release the run asked for (its folder first on
    ``PYTHONPATH``), not the venv's: checked before anything is built."""
    from importlib import metadata

    import sglang

    expected, folder = spec.sglang, spec.sglang_dir
    actual = metadata.version("sglang")
    location = Path(sglang.__file__).resolve()
    if (expected is not None and actual != expected) or (
            folder is not None and Path(folder).resolve() not in location.parents):
        raise RuntimeError(
            f"the run asked for sglang {expected} from {folder or 'the venv'}, but the "
            f"child imported sglang {actual} from {location.parent}")
