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
die with the parent if it is killed (a cold child by
:func:`contract_lib.child.main.die_with_parent`, a warm one because the warm server kills a
run whose requester's connection closed), and a run's log is an unnamed temporary file
of which the parent reads only the tail. The warm servers themselves outlive the parent
(:mod:`contract_lib.runs.pool`): they exit when idle or on ``server stop``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from contract_lib import loops
from contract_lib.frames import Frames, run_title
from contract_lib.patches.builtin import PatchArg, patch_spec
from contract_lib.paths import MODEL_DIR
from contract_lib.runs import cache as frame_cache, fingerprint
from contract_lib.runs.pool import POOL, ServerUnavailable, child_env
from contract_lib.sources.omni_release import companion
from contract_lib.sources.origin import Source, is_path, resolve as resolve_sglang
from contract_lib.sources.versions import require_supported_sglang
from contract_lib.wire import journal
from contract_lib.wire.protocol import RunSetupError, collect, frames_of, interrupted_error
from contract_lib.wire.serverargs import problems
from contract_lib.wire.spec import REAL, RUNNERS, RunSpec
from contract_lib.workloads import Workload, load_workload, require_seconds

# The registered loops (:mod:`contract_lib.loops`), and those ``status`` and ``audit``
# run by default (SGLang's own); kept as names for callers of the public API.
LOOPS = loops.names()
SGLANG_LOOPS = loops.default_names()

# Extra patches applied to *every* run, after the run's own (``+``-separated): a way to
# break or fix a clause across a whole suite, e.g. to see that the notebooks' compared
# outputs change when a clause breaks.
EXTRA_PATCH_ENV = "CONTRACT_LIB_EXTRA_PATCH"

# Seconds without any message from the child before the run is declared hung.
DEFAULT_HANG_TIMEOUT_S = 300.0

# Starts of a run whose set-up lost SGLang's port race (below) before its crash stands.
PORT_RACE_STARTS = 3


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


def run(
    workload: str | Workload,
    loop: str,
    *,
    patch: PatchArg = None,
    server_args: dict[str, Any] | None = None,
    hang_timeout: float | None = None,
    cache: bool = True,
    warm: bool = True,
    capture: bool = True,
    audit: bool = False,
    runner: str = "model-free",
    sglang: str | Path | Source | None = None,
    diff: str | Path | list | tuple | None = None,
    cancel: threading.Event | None = None,
) -> Frames:
    """Drive ``workload`` through ``loop`` and return its frames, whatever happened.

    ``patch`` is a built-in patch name, ``"module:callable"``, an importable callable, or
    several of these (a list, or names joined with ``+``); see
    :mod:`contract_lib.patches.builtin`. Patches run in the child before the Scheduler is
    built.
    The returned frames carry ``status`` (``finished``, ``crashed``, ``timeout``, ``died``)
    and, unless finished, ``error``.

    ``hang_timeout``: seconds without a message from the run's child before it is
    stopped as hung (status ``timeout``); None: the workload's ``max_seconds``, else
    :data:`DEFAULT_HANG_TIMEOUT_S`.
    ``cache``: serve and store finished runs from the frame cache
    (:mod:`contract_lib.runs.cache`).
    ``warm``: fork the run from a warm server that has SGLang imported
    (:mod:`contract_lib.runs.pool`) instead of starting a cold interpreter; same frames.
    ``capture=False`` records nothing but the run's fate and timing (for measuring the
    capture overhead); such runs are never cached. ``audit=True`` also records every
    write to the contract's objects into the ``effects`` table (slow; see
    :mod:`contract_lib.campaigns.audit`).

    ``runner``: ``"model-free"`` (default) or ``"real"`` (MLX loop only; see
    :data:`RUNNERS`). ``sglang``: a supported release (``"0.5.21"``, ``"0.5.22"``,
    ``"0.5.23"``), installed into its own folder on first use; None is the venv's; or a
    path to an SGLang source tree (a checkout's root or its ``python/`` folder).
    ``diff``: one or several unified diffs in the upstream layout, applied in order to a
    scratch copy of that SGLang (:mod:`contract_lib.sources.origin`). All are part of the run
    spec, hence of the cache key (a tree and a diff by their contents).

    Bad input raises before any run child starts: :class:`WorkloadError` (e.g. a token id
    outside the model's vocabulary), :class:`RunSetupError` (e.g. a server arg of the
    wrong type, checked against the release's ``ServerArgs`` field types; cold runs check
    it in the child, as a set-up error).

    Ctrl-C while the run is in progress (or setting ``cancel`` from another thread) kills
    the child and raises :class:`RunInterrupted` carrying the frames captured so far.
    """
    spec, meta, hang_timeout = _run_spec(workload, loop, patch, server_args, hang_timeout,
                                         capture, audit, runner, sglang, diff)
    use_cache = cache and capture and frame_cache.enabled()
    if use_cache:
        run_key = fingerprint.key(spec)
        hit = frame_cache.load(run_key, meta)
        if hit is not None:
            return hit
    for _ in range(PORT_RACE_STARTS):
        frames = _execute(spec, dict(meta), hang_timeout, warm, cancel)
        if not lost_port_race(frames):
            break
    if frames.status == "interrupted":
        raise RunInterrupted(f"{run_title(frames.meta)} stopped after "
                             f"{frames.meta['steps']} steps",
                             frames=frames)
    if use_cache:
        frame_cache.store(run_key, frames)
    return frames


def lost_port_race(frames: Frames) -> bool:
    """Whether the run crashed in set-up binding a port another process took first.
    SGLang's ``PortArgs.init_new`` picks a free port (``get_free_port``) that
    ``Scheduler.__init__`` binds only later (torch's TCPStore), so concurrent runs on one
    machine can draw the same one: a crash of the machine, not of the run, which
    :func:`run` starts again in a new child (nothing was captured before the loop)."""
    error = frames.meta.get("error") or {}
    return (frames.status == "crashed" and error.get("phase") == "setup"
            and "EADDRINUSE" in str(error.get("message", "")))


def _run_spec(workload: str | Workload, loop: str, patch: PatchArg,
              server_args: dict[str, Any] | None, hang_timeout: float | None, capture: bool,
              audit: bool, runner: str, sglang, diff) -> tuple[RunSpec, dict[str, Any], float]:
    """The run's spec (validated once: the loop, runner, release, workload, hang limit,
    patches; the release installed and a source tree checked or a diff copy built on
    first use), its meta before it runs, and its hang limit in seconds."""
    if loop not in loops.LOOP_SPECS:
        raise RunSetupError(f"unknown loop {loop!r}; valid loops: {', '.join(loops.names())}")
    loop_spec = loops.spec(loop)
    if runner not in RUNNERS:
        raise RunSetupError(f"unknown runner {runner!r}; valid runners: {', '.join(RUNNERS)}")
    if runner == REAL and not loop_spec.mlx:
        raise RunSetupError(
            "runner 'real' is SGLang's MlxModelRunner, which only the mlx loop uses; the "
            "torch loops stay model-free (compare a real run with "
            "contract_lib.sources.tiny_model.reference_outputs or with the MLX fixed path)")
    if loop_spec.sglang is not None:
        if sglang not in (None, loop_spec.sglang) and getattr(
                sglang, "release", None) != loop_spec.sglang:
            raise RunSetupError(f"loop {loop!r} is {loop_spec.note}; it cannot run on "
                                f"sglang {getattr(sglang, 'label', sglang)}")
        sglang = sglang or loop_spec.sglang
    if not isinstance(sglang, Source) and not is_path(sglang):
        require_supported_sglang(sglang)  # fail fast, before the workload is read
    if isinstance(workload, Workload):  # made in Python: validated here
        workload.validate(f"workload {workload.name!r}")
    else:  # read from a file: validated as it is read
        workload = load_workload(workload)
    if hang_timeout is not None:
        hang_timeout = require_seconds(hang_timeout, "the hang limit (max seconds)")
    hang_timeout = hang_timeout or workload.max_seconds or DEFAULT_HANG_TIMEOUT_S
    model_dir = _model_dir(runner)
    workload.check_vocabulary(_vocab_size(model_dir), f"workload {workload.name!r}")
    source = resolve_sglang(sglang, diff)  # installs a release / builds a copy on first use
    omni, omni_dir = companion(loop_spec)  # loop omni: sglang-omni, installed on first use
    spec = RunSpec(
        workload=workload, loop=loop_spec,
        patch=patch_spec([patch, os.environ.get(EXTRA_PATCH_ENV)]),
        server_args=dict(server_args or {}), runner=runner, capture=capture, audit=audit,
        sglang=source.version, sglang_source=source.identity or None, omni=omni,
        sglang_dir=None if source.sglang_dir is None else str(source.sglang_dir),
        omni_dir=None if omni_dir is None else str(omni_dir),
        model_dir=str(model_dir) if runner == REAL else None)
    meta = {"workload": workload.name, "loop": loop, "patch": spec.patch,
            "server_args": spec.user_server_args(), "sglang_version": source.label,
            "runner": runner}
    if omni is not None:
        meta["omni_version"] = omni["version"]
    return spec, meta, hang_timeout


def _model_dir(runner: str) -> Path:
    """The model folder a run's Scheduler loads (the real runner's tiny model is built
    on first use)."""
    if runner == REAL:
        from contract_lib.sources.tiny_model import tiny_model_dir

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


def _execute(spec: RunSpec, meta: dict[str, Any], hang_timeout: float, warm: bool,
             cancel: threading.Event | None = None) -> Frames:
    """Start the child (forked from a warm server of the run's SGLang release, or a cold
    interpreter with the same ``PYTHONPATH``) and collect. Whatever ends the wait (the
    child, a hang, Ctrl-C, ``cancel``, an error here), the child is dead on return (a
    warm run that sent its end is let go as it exits; its server kills and reaps it); the
    log is an unnamed temporary file and the journal unnamed shared memory, so nothing
    is left behind even if this process is killed."""
    with (tempfile.TemporaryFile(prefix="contract_lib-", suffix=".log") as log,
          journal.created() as journal_fd,
          contextlib.closing(journal.Reader(journal_fd)) as stored):
        read_fd, write_fd = os.pipe()
        receiver = Connection(read_fd, writable=False)
        child = None
        try:
            try:
                child = _start(spec, write_fd, log.fileno(), journal_fd, warm, cancel)
            finally:
                os.close(write_fd)
            return collect(receiver, stored, child, meta, hang_timeout, log.fileno(),
                           cancel)
        except KeyboardInterrupt:
            if child is not None:
                raise
            return frames_of({}, meta, "interrupted", interrupted_error("setup"))
        finally:
            receiver.close()
            if child is not None and child.returncode is None:
                child.kill()
                child.wait()


def _start(spec: RunSpec, write_fd: int, log_fd: int, journal_fd: int, warm: bool,
           cancel: threading.Event | None):
    """The run's child: forked by the warm server of the run's SGLang folder
    (:mod:`contract_lib.runs.pool`; started on first use), else a cold interpreter (``warm``
    false, servers switched off, or no server could be used: one warning). Warm: the
    run's server args are checked against the release's ``ServerArgs`` first."""
    sglang_dir = None if spec.sglang_dir is None else Path(spec.sglang_dir)
    server = POOL.acquire(sglang_dir, spec.sglang_source) if warm else None
    if server is not None:
        try:
            found = problems(spec.user_server_args(), server.server_arg_kinds(cancel))
            if found:
                raise RunSetupError("; ".join(found))
            return server.start_run(spec, write_fd, log_fd, journal_fd, cancel)
        except (ServerUnavailable, EOFError, OSError) as exc:  # go cold
            POOL.unavailable(exc)
    child = subprocess.Popen(
        [sys.executable, "-c",
         "from contract_lib.child.main import _child_entry; _child_entry()",
         str(write_fd), str(os.getpid()), str(journal_fd)],
        stdin=subprocess.PIPE, stdout=log_fd, stderr=log_fd, pass_fds=(write_fd, journal_fd),
        env=child_env(sglang_dir), start_new_session=True)
    try:
        child.stdin.write(json.dumps(spec.to_json()).encode())
        child.stdin.close()
    except BaseException:
        child.kill()
        child.wait()
        raise
    return child
