"""Run a workload through one of SGLang's real scheduler loops, in a child process.

One run = one child process = one real ``Scheduler`` built by its own ``__init__`` and
entered through ``run_event_loop()``. The child streams every frame row to the parent as
it is taken, so a crash, a hang or a dying child loses nothing already captured.

Each run chooses its SGLang release (``sglang=``: the venv's, or a supported release
from its own install folder first on the child's ``PYTHONPATH``) and, on the MLX loop,
its runner (``runner=``: the model-free next-token function, or SGLang's real
``MlxModelRunner`` with a tiny random-weight mlx-lm model built locally).

Nothing outlives the parent: children run in their own session (a terminal's Ctrl-C is
the parent's to handle: it kills them and keeps the frames, :class:`RunInterrupted`),
die with the parent if it is killed (:func:`contract_lib.pool.die_with_parent`, and the
fork servers' lifeline), and a run's log is an unnamed temporary file of which the
parent reads only the tail.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from contract_lib import cache as frame_cache
from contract_lib.frames import Frames, run_title
from contract_lib.patches import PatchArg, patch_spec
from contract_lib.pool import POOL, child_env, die_with_parent
from contract_lib.serverargs import accepted_kinds, problems
from contract_lib.verdict import LOOP_FUNCTIONS
from contract_lib.versions import require_supported_sglang, sglang_path
from contract_lib.workloads import Workload, load_workload

LOOPS = ("normal", "overlap", "mlx", "omni")
# SGLang's own loops: what ``status`` and ``audit`` run by default. ``omni`` is
# sglang-omni's ``OmniScheduler`` (:mod:`contract_lib.omni`), pinned to SGLang 0.5.22.
SGLANG_LOOPS = ("normal", "overlap", "mlx")
# ``model-free``: every loop's forward is a deterministic next-token function
# (:mod:`contract_lib.shims`). ``real`` (MLX loop only): SGLang's own ``MlxModelRunner``
# runs the tiny mlx-lm model of :mod:`contract_lib.tiny_model` on MLX's CPU backend, so
# its KV pool syncs and radix reads are real (tables ``kv_syncs`` and ``kv_pool``).
RUNNERS = ("model-free", "real")
MODEL_DIR = Path(__file__).resolve().parent.parent / "data" / "model"

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

# Extra patches applied to *every* run, after the run's own (``+``-separated): a way to
# break or fix a clause across a whole suite, e.g. to see that the notebooks' compared
# outputs change when a clause breaks.
EXTRA_PATCH_ENV = "CONTRACT_LIB_EXTRA_PATCH"

# Seconds without any message from the child before the run is declared hung.
DEFAULT_HANG_TIMEOUT_S = 300.0


# The log of a run is read back only as its last ``LOG_TAIL_BYTES`` (a child may print
# gigabytes); the tail shown in an error is at most ``LOG_TAIL_LINES`` lines of that.
LOG_TAIL_BYTES = 64 * 1024
LOG_TAIL_LINES = 40
# Seconds between checks for a cancel (or a hang) while waiting for the child.
_POLL_S = 0.25


class RunSetupError(ValueError):
    """Bad input to :func:`run`: an unknown loop, workload, patch or server arg."""


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C (a KeyboardInterrupt in the waiting thread) or a set ``cancel`` event stopped
    the run, and its child was killed. A KeyboardInterrupt, so ``except Exception`` does
    not swallow it.

    ``frames``: from :func:`run`, what the run captured until then (status
    ``interrupted``). ``results``: from :func:`run_many`, one entry per job as it returns
    them (a job that never started holds a ``concurrent.futures.CancelledError``).
    """

    def __init__(self, message: str, frames: Frames | None = None,
                 results: list[Frames | BaseException] | None = None) -> None:
        super().__init__(message)
        self.frames = frames
        self.results = results


class LoopMismatch(RuntimeError):
    """(In the child.) The server args make SGLang enter another event loop than the one
    asked for; the run stops in set-up, before the loop, naming the argument."""


def run(
    workload: str | Workload,
    loop: str,
    *,
    patch: PatchArg = None,
    server_args: dict[str, Any] | None = None,
    hang_timeout: float = DEFAULT_HANG_TIMEOUT_S,
    cache: bool = True,
    warm: bool = True,
    capture: bool = True,
    audit: bool = False,
    runner: str = "model-free",
    sglang: str | None = None,
    cancel: threading.Event | None = None,
) -> Frames:
    """Drive ``workload`` through ``loop`` and return its frames, whatever happened.

    ``patch`` is a built-in patch name, ``"module:callable"``, an importable callable, or
    several of these (a list, or names joined with ``+``); see :mod:`contract_lib.patches`.
    Patches run in the child before the Scheduler is built.
    The returned frames carry ``status`` (``finished``, ``crashed``, ``timeout``, ``died``)
    and, unless finished, ``error``.

    ``cache``: serve and store finished runs from the frame cache (:mod:`contract_lib.cache`).
    ``warm``: fork the run from a warm server that has SGLang imported
    (:mod:`contract_lib.pool`) instead of starting a cold interpreter; same frames.
    ``capture=False`` records nothing but the run's fate and timing (for measuring the
    capture overhead); such runs are never cached. ``audit=True`` also records every
    write to the contract's objects into the ``effects`` table (slow; see
    :mod:`contract_lib.audit`).

    ``runner``: ``"model-free"`` (default) or ``"real"`` (MLX loop only; see
    :data:`RUNNERS`). ``sglang``: a supported release (``"0.5.21"``, ``"0.5.22"``,
    ``"0.5.23"``), installed into its own folder on first use; None is the venv's.
    Both are part of the run spec, hence of the cache key.

    Bad input raises before any run child starts: :class:`WorkloadError` (e.g. a token id
    outside the model's vocabulary), :class:`RunSetupError` (e.g. a server arg of the
    wrong type, checked against the release's ``ServerArgs`` field types; cold runs check
    it in the child, as a set-up error).

    Ctrl-C while the run is in progress (or setting ``cancel`` from another thread) kills
    the child and raises :class:`RunInterrupted` carrying the frames captured so far.
    """
    if loop not in LOOPS:
        raise RunSetupError(f"unknown loop {loop!r}; valid loops: {', '.join(LOOPS)}")
    if runner not in RUNNERS:
        raise RunSetupError(f"unknown runner {runner!r}; valid runners: {', '.join(RUNNERS)}")
    if runner == "real" and loop != "mlx":
        raise RunSetupError(
            "runner 'real' is SGLang's MlxModelRunner, which only the mlx loop uses; the "
            "torch loops stay model-free (compare a real run with "
            "contract_lib.tiny_model.reference_outputs or with the MLX fixed path)")
    if loop == "omni":
        from contract_lib.omni import OMNI_SGLANG, OMNI_VERSION

        if sglang not in (None, OMNI_SGLANG):
            raise RunSetupError(f"loop 'omni' is sglang-omni {OMNI_VERSION}, built on sglang "
                                f"{OMNI_SGLANG}; it cannot run on sglang {sglang}")
        sglang = OMNI_SGLANG
    version = require_supported_sglang(sglang)
    if not isinstance(workload, Workload):
        workload = load_workload(workload)
    workload.validate(f"workload {workload.name!r}")
    model_dir = _model_dir(runner)
    workload.check_vocabulary(_vocab_size(model_dir), f"workload {workload.name!r}")
    patches = [p for p in (patch_spec(patch), os.environ.get(EXTRA_PATCH_ENV)) if p]
    spec = {
        "workload": workload.to_dict(),
        "loop": loop,
        "patch": patch_spec("+".join(patches)) if patches else None,
        "server_args": dict(server_args or {}),
        "capture": capture,
        "audit": audit,
        "runner": runner,
        "sglang": version,
    }
    meta = {
        "workload": workload.name,
        "loop": loop,
        "patch": spec["patch"],
        "server_args": {**workload.server_args, **spec["server_args"]},
        "sglang_version": version,
        "runner": runner,
    }
    sglang_dir = sglang_path(version)  # installs the release on first use
    omni_dir = None
    if loop == "omni":
        from contract_lib import omni

        omni_dir = omni.omni_path()  # installs sglang-omni on first use
        spec["omni"] = {"version": omni.OMNI_VERSION, "files": omni.install_stamp(omni_dir)}
        meta["omni_version"] = omni.OMNI_VERSION
    use_cache = cache and capture and frame_cache.enabled()
    if use_cache:
        run_key = frame_cache.key(spec, sglang_dir)
        hit = frame_cache.load(run_key, meta)
        if hit is not None:
            return hit
    child_spec = {**spec, "sglang_dir": None if sglang_dir is None else str(sglang_dir),
                  "omni_dir": None if omni_dir is None else str(omni_dir)}
    if runner == "real":
        child_spec["model_dir"] = str(model_dir)
    frames = _execute(child_spec, meta, hang_timeout, warm, sglang_dir, cancel)
    if frames.status == "interrupted":
        raise RunInterrupted(f"{run_title(meta)} stopped after {meta['steps']} steps",
                             frames=frames)
    if use_cache:
        frame_cache.store(run_key, frames)
    return frames


def _model_dir(runner: str) -> Path:
    """The model folder a run's Scheduler loads (the real runner's tiny model is built
    on first use)."""
    if runner == "real":
        from contract_lib.tiny_model import tiny_model_dir

        return tiny_model_dir()
    return MODEL_DIR


def _vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def run_many(jobs: list[dict[str, Any]], *, workers: int | None = None,
             progress: bool = True) -> list[Frames | BaseException]:
    """Run several jobs (each a dict of :func:`run` keyword arguments) in parallel, one
    child process per job, ``workers`` at a time (default: the machine's cores). Returns
    one entry per job, in job order: its Frames, or the exception its :func:`run` raised
    (e.g. a :class:`RunSetupError`); one failing job loses nothing of the others. A tqdm
    bar on stderr shows progress.

    Ctrl-C cancels the queued jobs, kills the running ones' children and raises
    :class:`RunInterrupted` whose ``results`` hold every job's entry."""
    from concurrent.futures import CancelledError, ThreadPoolExecutor, as_completed

    from tqdm.auto import tqdm

    cancel = threading.Event()
    executor = ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1)
    bar = tqdm(total=len(jobs), desc="runs", unit="run", disable=not progress,
               file=sys.stderr, leave=False)
    futures = []
    try:
        futures += [executor.submit(run, **job, cancel=cancel) for job in jobs]
        for _ in as_completed(futures):
            bar.update(1)
    except KeyboardInterrupt:
        cancel.set()
        executor.shutdown(wait=True, cancel_futures=True)
        results = [CancelledError() if f.cancelled() else f.exception() or f.result()
                   for f in futures] + [CancelledError()] * (len(jobs) - len(futures))
        done = sum(isinstance(r, Frames) for r in results)
        cancelled = sum(isinstance(r, CancelledError) for r in results)
        raise RunInterrupted(
            f"{done} of {len(jobs)} runs done, {len(jobs) - done - cancelled} stopped, "
            f"{cancelled} cancelled", results=results) from None
    finally:
        bar.close()
        executor.shutdown(wait=True)
    return [future.exception() or future.result() for future in futures]


def frames_or_raise(results: list[Frames | BaseException]) -> list[Frames]:
    """:func:`run_many`'s results when every job returned frames; else its first error,
    raised (for callers whose output needs every run)."""
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def _execute(spec: dict[str, Any], meta: dict[str, Any], hang_timeout: float,
             warm: bool, sglang_dir: Path | None = None,
             cancel: threading.Event | None = None) -> Frames:
    """Start the child (forked from a warm server of the run's SGLang release, or a cold
    interpreter with the same ``PYTHONPATH``) and collect. Whatever ends the wait (the
    child, a hang, Ctrl-C, ``cancel``, an error here), the child is dead on return; the
    log is an unnamed temporary file, so nothing is left on disk even if this process
    is killed."""
    with tempfile.TemporaryFile(prefix="contract_lib-", suffix=".log") as log:
        read_fd, write_fd = os.pipe()
        receiver = Connection(read_fd, writable=False)
        server = child = None
        try:
            try:
                server, child = _start(spec, write_fd, log.fileno(), warm, sglang_dir,
                                       cancel)
            finally:
                os.close(write_fd)
            return _collect(receiver, child, meta, hang_timeout, log.fileno(), cancel)
        except KeyboardInterrupt:
            if child is not None:
                raise
            return _frames({}, meta, "interrupted", _interrupted_error("setup"))
        finally:
            receiver.close()
            if child is not None and child.returncode is None:
                child.kill()
                child.wait()
            if server is not None:
                clean = child is not None and not getattr(child, "server_lost", False)
                (POOL.release if clean else POOL.discard)(server)


def _start(spec: dict[str, Any], write_fd: int, log_fd: int, warm: bool,
           sglang_dir: Path | None, cancel: threading.Event | None):
    """The run's child, and the fork server it came from (None for a cold child). Warm:
    the run's server args are checked against the release's ``ServerArgs`` first."""
    server = POOL.acquire(sglang_dir) if warm else None
    if server is not None:
        try:
            found = problems(_user_server_args(spec), server.server_arg_kinds(cancel))
            child = None if found else server.start_run(spec, write_fd, log_fd, cancel)
        except (EOFError, OSError):  # the server died before the run started: go cold
            POOL.discard(server)
        except BaseException:  # interrupted mid-request: the server's state is unknown
            POOL.discard(server)
            raise
        else:
            if found:
                POOL.release(server)
                raise RunSetupError("; ".join(found))
            return server, child
    child = subprocess.Popen(
        [sys.executable, "-c",
         "from contract_lib.harness import _child_entry; _child_entry()",
         str(write_fd), str(os.getpid())],
        stdin=subprocess.PIPE, stdout=log_fd, stderr=log_fd, pass_fds=(write_fd,),
        env=child_env(sglang_dir), start_new_session=True)
    try:
        child.stdin.write(pickle.dumps(spec))
        child.stdin.close()
    except BaseException:
        child.kill()
        child.wait()
        raise
    return None, child


def _user_server_args(spec: dict[str, Any]) -> dict[str, Any]:
    """The server args the workload and the caller set (the base ones are known good)."""
    return {**spec["workload"]["server_args"], **spec["server_args"]}


def _collect(receiver: Connection, child, meta: dict[str, Any], hang_timeout: float,
             log_fd: int, cancel: threading.Event | None = None) -> Frames:
    """Read the child's messages until it ends; turn them and its fate into Frames.
    A KeyboardInterrupt here (Ctrl-C, a notebook interrupt) or a set ``cancel`` kills
    the child: the frames are then those captured so far, status ``interrupted``."""
    rows: dict[str, list[dict[str, Any]]] = {}
    index: dict[tuple[str, Any], dict[str, Any]] = {}
    end: tuple | None = None
    last_message = time.monotonic()
    hung = interrupted = False
    try:
        while True:
            if cancel is not None and cancel.is_set():
                raise KeyboardInterrupt("cancelled")
            if receiver.poll(_POLL_S):
                try:
                    message = receiver.recv()
                except EOFError:
                    break
                last_message = time.monotonic()
                kind = message[0]
                if kind == "row":
                    _, table, row = message
                    rows.setdefault(table, []).append(row)
                    if table == "launches":
                        index[(table, row["launch"])] = row
                elif kind == "rows":
                    for table, row in message[1]:
                        rows.setdefault(table, []).append(row)
                    rows.setdefault("slots", []).extend(_slot_rows(message[2]))
                elif kind == "update":
                    _, table, _key, value, fields = message
                    index[(table, value)].update(fields)
                elif kind == "meta":
                    meta.update(message[1])
                elif kind == "end":
                    end = message
            elif child.poll() is not None:
                break
            elif time.monotonic() - last_message > hang_timeout:
                hung = True
                break
    except KeyboardInterrupt:
        interrupted = True
    if hung or interrupted:
        child.kill()
    child.wait(timeout=30)
    log_tail = _tail(log_fd)
    phase = "loop" if rows.get("steps") else "setup"

    if interrupted:
        status, error = "interrupted", _interrupted_error(phase)
    elif end is not None:
        _, status, error = end
    elif hung:
        status, error = "timeout", {
            "type": "Hang", "phase": "loop",
            "message": f"no frame from the child for {hang_timeout:.0f} s; killed it",
            "traceback": None, "signal": None, "log_tail": log_tail}
    elif getattr(child, "server_lost", False):
        status, error = "died", {
            "type": "ForkServerDied", "phase": phase,
            "message": "the warm fork server died during the run, so the run's exit status "
                       "is unknown; its process was killed (rerun, or use warm=False)",
            "traceback": None, "signal": None, "exit_code": None, "log_tail": log_tail}
    else:
        code = child.returncode
        signame = signal.Signals(-code).name if code is not None and code < 0 else None
        status, error = "died", {
            "type": "ChildDied", "phase": phase,
            "message": (f"the child process died with {signame}" if signame
                        else f"the child process exited with code {code}"),
            "traceback": None, "signal": signame, "exit_code": code, "log_tail": log_tail}
    if error is not None and "log_tail" not in error:
        error["log_tail"] = log_tail
    return _frames(rows, meta, status, error)


def _frames(rows: dict[str, list[dict[str, Any]]], meta: dict[str, Any], status: str,
            error: dict[str, Any] | None) -> Frames:
    meta.update({"status": status, "error": error, "steps": len(rows.get("steps", []))})
    return Frames.from_rows(rows, meta)


def _interrupted_error(phase: str) -> dict[str, Any]:
    return {"type": "KeyboardInterrupt", "phase": phase,
            "message": "interrupted (Ctrl-C, a kernel interrupt or a cancelled batch); "
                       "the child was killed, the frames are those captured until then",
            "traceback": None, "signal": None}


def _slot_rows(per_request: list[tuple]) -> list[dict[str, Any]]:
    """Expand the column-wise slot message into one row per (step, request, position)."""
    return [
        {"step": step, "rid": rid, "req_pool_idx": row, "position": position,
         "slot": slot, "slot_free": free, "written": written}
        for step, rid, row, slots, frees, writtens in per_request
        for position, (slot, free, written) in enumerate(zip(slots, frees, writtens))
    ]


def _tail(log_fd: int) -> str:
    """The last :data:`LOG_TAIL_LINES` lines of the log, reading at most its last
    :data:`LOG_TAIL_BYTES` (a partial first line dropped)."""
    try:
        size = os.fstat(log_fd).st_size
        start = max(0, size - LOG_TAIL_BYTES)
        data = os.pread(log_fd, size - start, start)
    except OSError:
        return ""
    lines = data.decode(errors="replace").splitlines()
    if start > 0 and lines:
        lines = lines[1:]
    return "\n".join(lines[-LOG_TAIL_LINES:])


# ------------------------------------------------------------------------------------------
# The child.
# ------------------------------------------------------------------------------------------


def _child_entry() -> None:
    """Entry point of a cold child process: the run spec arrives pickled on stdin,
    messages go back on the pipe whose fd is ``argv[1]``; stdout and stderr go to the
    run's log."""
    die_with_parent(int(sys.argv[2]))
    spec = pickle.loads(sys.stdin.buffer.read())
    child_run(spec, Connection(int(sys.argv[1]), readable=False))
    os._exit(0)  # skip SGLang's atexit teardown; everything was sent


def child_run(spec: dict[str, Any], conn: Connection) -> None:
    """One run inside its own process (cold or forked): build, loop, report the end."""
    emit = conn.send
    recorder = kv_recorder = None
    phase = "setup"
    status, error = "finished", None
    timing: dict[str, float] = {}
    started = time.perf_counter()
    try:
        scheduler, recorder, kv_recorder = _build(spec, emit, timing)
        phase = "loop"
        loop_started = time.perf_counter()
        try:
            # OmniScheduler's entry; ``run_event_loop`` would be SGLang's, bound to it.
            (scheduler.start if spec["loop"] == "omni" else scheduler.run_event_loop)()
        finally:
            timing["loop_s"] = time.perf_counter() - loop_started
        status, error = "crashed", _error("loop returned without finishing the workload")
    except BaseException as exc:  # noqa: BLE001 - every fault is reported, not raised
        from contract_lib.capture import StepBudgetExceeded, StopRun

        if isinstance(exc, StopRun):
            status, error = "finished", None
        elif isinstance(exc, StepBudgetExceeded):
            status, error = "timeout", _error(str(exc), exc, phase)
        elif isinstance(exc, LoopMismatch):  # raised at loop entry, before any step
            status, error = "crashed", _error(str(exc), exc, "setup")
        else:
            status, error = "crashed", _error(str(exc), exc, phase)
    if recorder is not None:
        recorder.finish()
    if kv_recorder is not None:
        try:
            kv_recorder.finish()
        except Exception as exc:  # noqa: BLE001 - the inspection failing is a crash
            if status == "finished":
                status, error = "crashed", _error(str(exc), exc, "kv-pool-inspection")
    timing["total_s"] = time.perf_counter() - started
    emit(("meta", {"user_modules": frame_cache.user_modules()}))  # the cache verifies them
    emit(("meta", {"timing": timing}))
    emit(("end", status, error))
    conn.close()


def _error(message: str, exc: BaseException | None = None, phase: str = "loop") -> dict:
    return {
        "type": type(exc).__name__ if exc else "RuntimeError",
        "phase": phase,
        "message": message,
        "traceback": "".join(traceback.format_exception(exc)) if exc else None,
        "signal": None,
    }


def _build(spec: dict[str, Any], emit, timing: dict[str, float]):
    """Shims, patch, a real Scheduler and the capture hooks (wall times into ``timing``).
    Returns the scheduler, the frame recorder and the KV pool recorder (real runner)."""
    started = time.perf_counter()
    loop = spec["loop"]
    runner = spec.get("runner", "model-free")
    if loop == "mlx":
        os.environ["SGLANG_USE_MLX"] = "1"
    from contract_lib import shims

    applied = shims.install_import_shims()
    _check_sglang_release(spec)
    from sglang.srt import runtime_context
    from sglang.srt.managers import scheduler as _scheduler_module  # noqa: F401
    from sglang.srt.server_args import PortArgs, ServerArgs

    timing["import_s"] = time.perf_counter() - started
    applied += shims.install_release_compat()

    from contract_lib.capture import Recorder
    from contract_lib.patches import apply_patch

    holder: dict[str, Recorder] = {}

    def on_launch(batch, tokens: list[int]) -> None:
        holder["recorder"].on_torch_launch(batch, tokens)

    if loop == "omni":
        from contract_lib import omni

        applied += omni.install_shims(spec["omni_dir"], on_launch)
    else:
        shims.install_torch_model_free_forward(on_launch)
        applied.append("torch-model-free-forward")
    if loop == "mlx":
        if shims.install_mlx_runtime_gate_shim():
            applied.append("mlx-runtime-gate")
        if runner == "real":
            applied += shims.install_mlx_real_runner()
        else:
            shims.install_mlx_model_free_runner()
            applied.append("mlx-model-free-runner")
    apply_patch(spec["patch"])

    workload = Workload.from_dict(spec["workload"])
    model_dir = spec["model_dir"] if runner == "real" else str(MODEL_DIR)
    args = {**BASE_SERVER_ARGS, "model_path": model_dir,
            "disable_overlap_schedule": loop == "normal",
            **workload.server_args, **spec["server_args"]}
    if found := problems(_user_server_args(spec), accepted_kinds(ServerArgs)):
        raise RunSetupError("; ".join(found))  # a cold run's parent could not check them
    server_args = ServerArgs(**args)
    if loop == "omni":  # its ModelWorker publishes the runtime context itself
        built = time.perf_counter()
        scheduler = omni.build_scheduler(server_args)
        timing["build_s"] = time.perf_counter() - built
    else:
        _check_overlap_arg(loop, server_args, args, workload.server_args,
                           spec["server_args"], ServerArgs)
        port_args = PortArgs.init_new(server_args)
        runtime_context.publish(server_args, role="scheduler",
                                ranks=runtime_context.SpawnRanks(world_rank=0, dp_rank=None,
                                                                 gpu_id=0))
        scheduler_class = shims.scheduler_class_for(loop)
        if scheduler_class.__name__ != "Scheduler":
            applied.append("mlx-overlap-mixin")
        built = time.perf_counter()
        scheduler = scheduler_class(server_args, port_args)
        timing["build_s"] = time.perf_counter() - built
        scheduler.request_receiver = shims.ScriptedReceiver()
        applied.append("scripted-ingress")
    emit(("meta", {"shims": applied, "expect": workload.expect,
                   "enable_overlap": bool(scheduler.enable_overlap),
                   "enable_overlap_mlx": bool(scheduler.enable_overlap_mlx)}))
    _record_loop_entry(scheduler, loop, emit)
    recorder = Recorder(scheduler, loop, workload, emit, capture=spec.get("capture", True),
                        audit=spec.get("audit", False))
    holder["recorder"] = recorder
    recorder.install()
    kv_recorder = None
    if runner == "real" and spec.get("capture", True):
        from contract_lib.kvpool import KvPoolRecorder

        kv_recorder = KvPoolRecorder(scheduler, recorder, emit, model_dir)
        kv_recorder.install()
    return scheduler, recorder, kv_recorder


def _check_overlap_arg(loop: str, server_args, args: dict[str, Any],
                       workload_args: dict[str, Any], cli_args: dict[str, Any],
                       server_args_class) -> None:
    """Refuse, before the Scheduler is built, server args that turn the requested loop
    into another: SGLang picks the loop from ``disable_overlap_schedule`` (the normal loop
    when set, else the overlap or MLX overlap loop). Names the argument responsible: the
    override that sets it, or the one whose removal restores the loop (ServerArgs' own
    post-init hooks can set it from other arguments)."""
    wanted = loop == "normal"
    actual = bool(server_args.disable_overlap_schedule)
    if actual == wanted:
        return
    sources = [("--server-arg", cli_args), ("workload [server_args]", workload_args)]
    culprit = next((f"{where} disable_overlap_schedule={given['disable_overlap_schedule']!r}"
                    for where, given in sources if "disable_overlap_schedule" in given), None)
    if culprit is None:
        for where, given in sources:
            for key in given:
                trial = {k: v for k, v in args.items() if k != key}
                trial["disable_overlap_schedule"] = wanted
                try:
                    restored = bool(server_args_class(**trial).disable_overlap_schedule)
                except Exception:  # noqa: BLE001 - a trial that does not build proves nothing
                    continue
                if restored == wanted:
                    culprit = f"{where} {key}={given[key]!r}"
                    break
            if culprit:
                break
    entered = (LOOP_FUNCTIONS["normal"] if actual else
               LOOP_FUNCTIONS["mlx" if loop == "mlx" else "overlap"])
    raise LoopMismatch(
        f"--loop {loop} needs disable_overlap_schedule={wanted}, but "
        f"{culprit or 'the server args'} make(s) it {actual}: SGLang would run {entered} "
        f"instead of {LOOP_FUNCTIONS[loop]}; remove that argument or choose that loop")


def _record_loop_entry(scheduler, loop: str, emit) -> None:
    """Wrap every ``event_loop_*`` method of the instance: the one SGLang's dispatch
    enters is recorded in the run's meta (``loop_function``), and one that is not the
    requested loop's stops the run before its first step (:class:`LoopMismatch`)."""
    wanted = LOOP_FUNCTIONS[loop]
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


def _check_sglang_release(spec: dict[str, Any]) -> None:
    """The child imports the SGLang release the run asked for (its folder first on
    ``PYTHONPATH``), not the venv's: checked before anything is built."""
    from importlib import metadata

    import sglang

    expected, folder = spec.get("sglang"), spec.get("sglang_dir")
    actual = metadata.version("sglang")
    location = Path(sglang.__file__).resolve()
    if (expected is not None and actual != expected) or (
            folder is not None and Path(folder).resolve() not in location.parents):
        raise RuntimeError(
            f"the run asked for sglang {expected} from {folder or 'the venv'}, but the "
            f"child imported sglang {actual} from {location.parent}")
