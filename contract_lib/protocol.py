"""What the run's process and the parent say to each other, and the run's typed errors.

Messages (tuples on a one-way pipe, child -> parent), in the order a run sends them:

- ``("meta", dict)``: run metadata (shims applied, the loop function entered, timing...);
- ``("row", table, row)``: one frame row (``launches`` rows are indexed for updates);
- ``("update", table, key, value, fields)``: fields of an earlier ``launches`` row;
- ``("rows", [(table, row), ...], slot_rows)``: one step's rows, slots column-wise;
- ``("end", status, error)``: the run's fate (``finished``, ``crashed``, ``timeout``).

An ``error`` is a dict: ``type``, ``phase`` (``setup``, ``loop``...), ``message``,
``traceback``, ``signal`` (and, added by the parent, ``log_tail``).
Bottom floor: imports nothing from the package.
"""

from __future__ import annotations

import traceback
from typing import Any

META, ROW, UPDATE, ROWS, END = "meta", "row", "update", "rows", "end"


class RunSetupError(ValueError):
    """Bad input to :func:`contract_lib.harness.run`: an unknown loop, workload, patch or
    server arg."""


class LoopMismatch(RuntimeError):
    """(In the child.) The server args make SGLang enter another event loop than the one
    asked for; the run stops in set-up, before the loop, naming the argument."""


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
    """The ``error`` of a run the parent stopped (Ctrl-C, a cancelled batch)."""
    return {"type": "KeyboardInterrupt", "phase": phase,
            "message": "interrupted (Ctrl-C, a kernel interrupt or a cancelled batch); "
                       "the child was killed, the frames are those captured until then",
            "traceback": None, "signal": None}
