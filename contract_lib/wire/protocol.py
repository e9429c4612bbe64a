"""What the run's process and the parent say to each other, and the run's typed errors.

Messages (tuples, child -> parent, stored in the run's journal, :mod:`contract_lib.wire.journal`,
whose notes on a one-way pipe say what to read; on the pipe itself once the journal is
full), in the order a run sends them:

- ``("meta", dict)``: run metadata (shims applied, the loop function entered, timing...);
- ``("rows", [(table, row), ...], slot_rows)``: rows taken together (a step's frame,
  its slots column-wise; the relay rows of one read or write; a launch's row and its
  forward slots); a row is a tuple in the table's column order
  (:data:`~contract_lib.frames.COLUMNS`; the recorder's: cheaper to build and pickle)
  or a dict (the audit's and the real runner's); ``launches`` rows are indexed for
  updates;
- ``("update", table, key, value, fields)``: fields of an earlier ``launches`` row;
- ``("end", status, error)``: the run's fate (``finished``, ``crashed``, ``timeout``).

An ``error`` is a dict: ``type``, ``phase`` (``setup``, ``loop``...), ``message``,
``traceback``, ``signal`` (and, added by the parent, ``log_tail``).
The parent collects them with :func:`collect` into :class:`~contract_lib.frames.Frames`.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from contract_lib.frames import COLUMNS, Frames
from contract_lib.wire import journal

META, UPDATE, ROWS, END = "meta", "update", "rows", "end"


class RunSetupError(ValueError):
    """Bad input to :func:`contract_lib.runs.harness.run`: an unknown loop, workload, patch or
    server arg."""


class LoopMismatch(RuntimeError):
    """(In the child.) The server args make SGLang enter another event loop than the one
    asked for; the run stops in set-up, before the loop, naming the argument."""


class Unsupported(RunSetupError):
    """(In the child.) What the workload asks cannot run on this loop or runner as SGLang
    built it (e.g. a page size the MLX backend's KV allocator cannot serve); the run stops
    in set-up with one line saying why."""


def error_record(message: str, exc: BaseException | None = None,
                 phase: str = "loop") -> dict[str, Any]:
    """The ``error`` of a run that ended on ``exc`` (or on a plain message)."""
    return {
        "type": type(exc).__name__ if exc else "RuntimeError",
        "phase": phase,
        "message": message,
        "traceback": "".join(traceback.format_exception(exc)) if exc else None,
        "signal": None,
    }


def interrupted_error(phase: str) -> dict[str, Any]:
    """The ``error`` of a run the parent stopped (Ctrl-C, SIGTERM, a cancelled batch)."""
    return {"type": "KeyboardInterrupt", "phase": phase,
            "message": "interrupted (Ctrl-C, SIGTERM, a kernel interrupt or a cancelled "
                       "batch); "
                       "the child was killed, the frames are those captured until then",
            "traceback": None, "signal": None}


# The log of a run is read back only as its last ``LOG_TAIL_BYTES`` (a child may print
# gigabytes); the tail shown in an error is at most ``LOG_TAIL_LINES`` lines of that.
LOG_TAIL_BYTES = 64 * 1024
LOG_TAIL_LINES = 40
# Seconds between checks for a cancel (or a hang) while waiting for the child.
_POLL_S = 0.25
# Seconds the parent lets the child's notes gather in the pipe after draining it. A
# parent blocked on the pipe is woken by every write, and on a 2-core machine that wake-up
# is paid inside the child's loop. The child still stores each row as it is taken, so a
# child that dies loses nothing already stored.
_GATHER_S = 0.002


def collect(receiver: Connection, stored: journal.Reader, child, meta: dict[str, Any],
            hang_timeout: float, log_fd: int,
            cancel: threading.Event | None = None) -> Frames:
    """Read the child's messages (the journal ``stored`` up to each note on the pipe,
    and the pipe's own) until it ends, then what the journal holds past the last note;
    turn them and the child's fate into Frames. A KeyboardInterrupt here (Ctrl-C, a
    notebook interrupt) or a set ``cancel`` kills the child: the frames are then those
    captured so far, status ``interrupted``."""
    rows: dict[str, list[dict[str, Any]]] = {}
    index: dict[tuple[str, Any], dict[str, Any]] = {}
    end: tuple | None = None

    def take(message: tuple) -> None:
        nonlocal end
        kind = message[0]
        if kind == ROWS:
            for table, row in message[1]:
                if table == "launches":  # updated later: a dict, keyed by its launch
                    row = row if isinstance(row, dict) else dict(zip(COLUMNS[table], row))
                    index[(table, row["launch"])] = row
                rows.setdefault(table, []).append(row)
            rows.setdefault("slots", []).extend(slot_rows(message[2]))
        elif kind == UPDATE:
            _, table, _key, value, fields = message
            index[(table, value)].update(fields)
        elif kind == META:
            meta.update(message[1])
        elif kind == END:
            end = message

    last_message = time.monotonic()
    hung = interrupted = False
    try:
        while True:
            if cancel is not None and cancel.is_set():
                raise KeyboardInterrupt("cancelled")
            if not receiver.poll(0):
                time.sleep(_GATHER_S)
            if receiver.poll(_POLL_S):
                try:
                    message = receiver.recv()
                except EOFError:
                    break
                last_message = time.monotonic()
                if message[0] == journal.NOTE:
                    for stored_message in stored.read(message[1]):
                        take(stored_message)
                else:
                    take(message)
            elif child.poll() is not None:
                break
            elif time.monotonic() - last_message > hang_timeout:
                hung = True
                break
    except KeyboardInterrupt:
        interrupted = True
    if hung or interrupted:
        child.kill()
    if end is not None and not (hung or interrupted) and hasattr(child, "release"):
        child.release()  # a warm run that sent its end: its server reaps it
    else:
        child.wait(timeout=30)
    for message in stored.read():  # stored after the last note (a dead child: all it did)
        take(message)
    tail = log_tail(log_fd)
    phase = "loop" if rows.get("steps") else "setup"

    if interrupted:
        status, error = "interrupted", interrupted_error(phase)
    elif end is not None:
        _, status, error = end
    elif hung:
        status, error = "timeout", {
            "type": "Hang", "phase": "loop",
            "message": f"no frame from the child for {hang_timeout:g} s (the hang limit: "
                       "--max-seconds, or max_seconds in the workload); killed it",
            "traceback": None, "signal": None, "log_tail": tail}
    elif getattr(child, "server_lost", False):
        status, error = "died", {
            "type": "ForkServerDied", "phase": phase,
            "message": "the warm server died or was stopped during the run, so the run's "
                       "exit status is unknown; its process was killed (rerun: a new "
                       "server starts; or use warm=False)",
            "traceback": None, "signal": None, "exit_code": None, "log_tail": tail}
    else:
        code = child.returncode
        signame = signal.Signals(-code).name if code is not None and code < 0 else None
        status, error = "died", {
            "type": "ChildDied", "phase": phase,
            "message": (f"the child process died with {signame}" if signame
                        else f"the child process exited with code {code}"),
            "traceback": None, "signal": signame, "exit_code": code, "log_tail": tail}
    if error is not None and "log_tail" not in error:
        error["log_tail"] = tail
    return frames_of(rows, meta, status, error)


def frames_of(rows: dict[str, list[dict[str, Any]]], meta: dict[str, Any], status: str,
            error: dict[str, Any] | None) -> Frames:
    meta.update({"status": status, "error": error, "steps": len(rows.get("steps", []))})
    return Frames.from_rows(rows, meta)


def slot_rows(per_request: list[tuple]) -> list[dict[str, Any]]:
    """Expand the column-wise slot message into one row per (step, request, position)."""
    return [
        {"step": step, "rid": rid, "req_pool_idx": row, "position": position,
         "slot": slot, "slot_free": free, "written": written}
        for step, rid, row, slots, frees, writtens in per_request
        for position, (slot, free, written) in enumerate(zip(slots, frees, writtens))
    ]


def log_tail(log_fd: int) -> str:
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
