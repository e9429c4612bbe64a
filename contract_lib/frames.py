"""Per-step frames of one run: SGLang's own state at every step boundary and launch.

**Step boundary.** Step ``k`` is the top of the scheduler loop's ``k``-th iteration: the
entry of ``Scheduler.ingest_requests`` (the first call every loop makes; <= 0.5.19,
``request_receiver.recv_requests``), before that iteration's requests are fed in. The
frame of step ``k`` therefore shows the state that iterations ``0..k-1`` left behind. The
last step of a finished run is the first boundary at which every request has finished
and nothing is in flight (``result_queue`` empty).

Tables (pandas DataFrames; the column lists below are the schema):

- ``steps``: one row per step boundary.
- ``launches``: one row per forward launch (a ``run_batch`` forward, an MLX fresh or
  chained launch), completed when ``process_batch_result`` receives that launch's batch;
  ``tokens`` what the model produced for each of its ``rids`` (comma-joined, in order);
  ``processed_*`` the batch's stamps as ``process_batch_result`` received it;
  ``extend_num_tokens`` the batch's own field at its launch (what ``run_batch`` adds to
  the HRRN clock; None where the launch had no batch, an MLX chained launch).
- ``requests``: per step and request that SGLang knows about; ``finish_reason`` is the
  ``type`` of SGLang's ``req.finished_reason`` (``length``, ``stop``, ``abort``; None
  while running), ``finish_message`` its message (an abort's reason),
  ``finish_matched`` the token id a stop matched (None otherwise), ``retractions``
  SGLang's own ``req.retraction_count``, ``end_sent`` whether the request's end has
  reached the client: SGLang's ``req.finished_output`` (set when ``stream_output``
  sends its final output), or an ``AbortReq`` output sent for it (an abort while
  queued); None where the release has no ``finished_output``.
- ``slots``: per step, live request and position, the ``req_to_token`` entry over every
  position the request has or should have (``max(kv_computed, kv_allocated_len)``);
  ``written`` is True when that entry was written into the row while this request held
  it (by ``ReqToTokenPool.write``: the allocator's slots and its own radix-matched
  prefix), False when it is left over from the row's previous holder or never written.
- ``forward_slots``: per torch launch (the model-free forward), lane and position it
  computes, the pool slot the forward writes that position's KV to (``out_cache_loc``):
  the slot ``req_to_token`` must record for it (clause 1).
- ``relay``: every read of ``future_map.output_tokens_buf`` by ``resolve_forward_inputs``
  (``value``: what the row held) and every stash into it (``value``: what the row holds
  after the stash, read back). The buffer is poisoned with -1 at construction. A read is
  ``published_for_rid`` when the row's last stash was by this request's holder, of its
  latest token, and the row still holds it. Rows of ``event`` ``fed`` (torch forwards):
  each decode lane's input id as the forward got it (``row``: the request's
  ``req_to_token`` row; ``last_published``: the request's latest token;
  ``published_for_rid``: the two agree).
- ``outputs``: the emitted token ids per request, at the end of the run.
- ``effects`` (audit runs only): per step, every attribute written on the contract's
  objects, with the SGLang code location that wrote it and how often
  (:mod:`contract_lib.child.effects`).
- ``backend_state``: per step, every entry of the backend's per-request structures
  (the MLX worker's and runner's dicts and sets keyed by request id): request id,
  ``structure`` (``tp_worker._mlx_active_rids``, ``tp_worker._mlx_runner._req_caches``,
  ...) and, for a structure that maps the request to a ``req_to_token`` row, that
  ``row`` (:class:`contract_lib.child.capture.BackendStateRecorder`; clause 7).
- ``evictions``: every call of the KV allocator's ``evict_to_free_tokens`` that asked the
  radix tree to evict or changed it: the tokens the allocation needed (``need``), those
  free then (``available``), the most it ``asked`` the tree for, and the tree's
  evictable tokens before and after (:mod:`contract_lib.child.capture.evictions`; clause 2).
- ``kv_syncs`` (MLX, radix cache on): every position written into the MLX attention
  KV pool: step, request, kind (``prefill``, ``extend``, ``release``, ``flush``,
  ``remove``; ``dropped`` for positions a clamped release leaves out), position, slot,
  and whose slot it was (``target``: ``own``, ``slot 0``, ``other live request`` with
  its ``owner``, ``shared prefix``, ``free``, ``cached``) (:mod:`contract_lib.child.kvpool`).
- ``kv_pool`` (MLX, radix cache on): at the end of the run, per request and
  radix-matched position, its pool slot's KV against mlx-lm's own KV for that request's
  tokens: ``verdict`` ``ok`` / ``zero`` / ``wrong`` and ``max_abs_diff``. The model-free
  runner's pool holds contents, not KV (per slot, a digest of the tokens it was computed
  from, :class:`contract_lib.child.shims.mlx_runner.ModelFreeKvPool`): the same verdicts,
  ``max_abs_diff`` NaN. The torch loops and omni leave ``kv_syncs`` and ``kv_pool`` empty.
- ``prebuilt`` (PD-disaggregation decode side): every request a prebuilt batch admitted
  (``get_new_prebuilt_batch``: no forward; its KV arrived by transfer, or was restored
  after a retraction): ``kv_computed`` the positions whose KV it put in place (the
  prompt fed and the tokens emitted, less the last), ``token`` its latest
  token (the one the first decode is fed), ``transfer`` True for the admission of the
  transferred KV (``token`` is then the remote prefill's first token, the hand-off),
  False for a re-admission after a retraction.

``steps.disagg_queued`` counts the requests in the PD-disaggregation queues (prefill:
bootstrap and inflight; decode: preallocation, retracted and transfer), None on other
loops. Each column's dtype is declared by its name in :data:`contract_lib.dtypes.KINDS`, and is
the same whether the run is fresh or read back from a file or the frame cache.
``WALL_CLOCK_COLUMNS`` are kept out of every comparison between runs.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import types
import typing
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
import pandas as pd

from contract_lib.atomic import atomic_write
from contract_lib.dtypes import typed

SCHEMA_VERSION = 11

COLUMNS: dict[str, list[str]] = {
    "steps": [
        "step", "loop", "forward_ct", "result_queue_len", "is_fully_idle", "idle_probe",
        "enable_overlap", "enable_overlap_mlx", "running_bs", "running_mode",
        "last_batch_mode", "waiting_len", "kv_total", "kv_available", "kv_evictable",
        "kv_protected", "kv_uncached", "pool_leak", "rows_free", "rows_total",
        "wall_time", "processed_tokens_counter", "disagg_queued",
    ],
    "launches": [
        "launch", "step", "loop", "forward_ct", "forward_iter", "launch_ts", "mode",
        "chained", "rids", "processed_step", "processed_forward_iter",
        "processed_launch_ts", "prefilled_tokens", "tokens", "processed_after_idle_gap",
        "extend_num_tokens",
    ],
    "requests": [
        "step", "rid", "prompt_len", "emitted", "finished", "req_pool_idx", "seq_len",
        "kv_computed", "kv_committed_len", "kv_allocated_len", "cache_protected_len",
        "cached_tokens", "finish_reason", "finish_message", "retractions",
        "decode_batch_idx", "kv_prefilled", "max_new_tokens", "finish_matched", "end_sent",
    ],
    "slots": ["step", "rid", "req_pool_idx", "position", "slot", "slot_free", "written"],
    "forward_slots": ["launch", "step", "rid", "position", "slot"],
    "relay": [
        "event", "step", "launch", "loop", "kind", "row", "rid", "value",
        "last_published", "published_for_rid",
    ],
    "outputs": ["rid", "index", "token"],
    "effects": ["step", "loop", "object", "field", "location", "count", "changed"],
    "kv_syncs": ["step", "rid", "kind", "position", "slot", "target", "owner"],
    "kv_pool": ["rid", "position", "slot", "verdict", "max_abs_diff"],
    "backend_state": ["step", "rid", "structure", "row"],
    "evictions": ["step", "need", "available", "asked", "evictable_before",
                  "evictable_after"],
    "prebuilt": ["step", "rid", "kv_computed", "token", "transfer"],
}

KV_VERDICTS = ("ok", "zero", "wrong")  # ``kv_pool.verdict``: as computed, unwritten, another's

WALL_CLOCK_COLUMNS: dict[str, list[str]] = {
    "steps": ["wall_time"],
    "launches": ["launch_ts", "processed_launch_ts"],
}

# ``interrupted``: Ctrl-C or a cancelled batch stopped the run and killed its child
# (contract_lib.runs.harness.RunInterrupted carries such frames).
STATUSES = ("finished", "crashed", "timeout", "died", "interrupted")

class RequiredMeta(TypedDict):
    """The meta entries every frames file has (checked on load)."""

    workload: str
    loop: str
    patch: str | None  # a PatchSpec's text: patches joined with "+", in order
    runner: str  # "model-free" or "real" (SGLang's own MlxModelRunner)
    sglang_version: str
    status: str  # one of STATUSES
    error: dict[str, Any] | None  # type, message, traceback, signal, phase; None: finished
    server_args: dict[str, Any]  # the overrides used (the workload's and the run's)


class RunMeta(RequiredMeta, total=False):
    """What happened to one run, beside its tables (``Frames.meta``)."""

    steps: int  # step boundaries recorded
    shims: list[str]  # the shims and release backports applied
    expect: dict[str, Any]  # the workload's declared expected outcomes
    loop_function: str  # the SGLang event-loop function the run entered
    enable_overlap: bool  # the scheduler's flags after construction
    enable_overlap_mlx: bool
    resolved_args: dict[str, Any]  # page_size, disable_radix_cache as the scheduler runs
    # contract fields the release does not have (compat.absent_fields) -> why no violation
    absent_fields: dict[str, str]
    timing: dict[str, float]  # the child's wall times (s): import, build, loop, total; loop CPU
    prompts: dict[str, list[int]]  # rid -> the prompt token ids it was fed with
    user_modules: dict[str, str | None]  # user modules the run loaded -> sha256
    user_module_names: dict[str, str]  # their module names -> the file each was loaded from
    omni_version: str  # loop omni: the sglang-omni release
    kv_pool: dict[str, Any]  # real MLX runner: the pool's verdict inputs
    cached: bool  # served from the frame cache
    cache_key: str  # stored entries only
    tables_sha256: str


def _json_types(annotation: Any) -> tuple[type, ...]:
    """The ``isinstance`` types of a meta annotation (``str | None`` -> (str, NoneType))."""
    union = isinstance(annotation, types.UnionType)
    members = typing.get_args(annotation) if union else (annotation,)
    return tuple(typing.get_origin(a) or a for a in members)


# The meta entries every frames file has, with their JSON types.
META_TYPES: dict[str, tuple[type, ...]] = {
    name: _json_types(annotation)
    for name, annotation in typing.get_type_hints(RequiredMeta).items()
}


def run_title(meta: RunMeta) -> str:
    """``workload on loop[, real MlxModelRunner][, patch P] (sglang V)`` for headings."""
    parts = [f"{meta['workload']} on {meta['loop']}"]
    if meta.get("runner") == "real":
        parts.append("real MlxModelRunner")
    if meta.get("patch"):
        parts.append(f"patch {meta['patch']}")
    return f"{', '.join(parts)} (sglang {meta['sglang_version']})"


class FramesFormatError(ValueError):
    """A frames file is unreadable or written in another schema version."""


@dataclasses.dataclass
class Frames:
    """Everything one run recorded: its tables and what happened to it (``meta``, a
    :class:`RunMeta`)."""

    tables: dict[str, pd.DataFrame]
    meta: RunMeta

    def __getattr__(self, name: str) -> pd.DataFrame:
        tables = self.__dict__.get("tables", {})
        if name in tables:
            return tables[name]
        raise AttributeError(name)

    @property
    def status(self) -> str:
        return self.meta["status"]

    @property
    def error(self) -> dict[str, Any] | None:
        return self.meta.get("error")

    @property
    def loop(self) -> str:
        return self.meta["loop"]

    @property
    def absent(self) -> dict[str, str]:
        """The contract fields the run's SGLang does not have, each with why that is no
        violation (meta ``absent_fields``; none in frames recorded without it)."""
        return self.meta.get("absent_fields") or {}

    def output_tokens(self) -> dict[str, list[int]]:
        """Emitted token ids per request id."""
        out = self.tables["outputs"].sort_values(["rid", "index"])
        return {rid: tokens.tolist() for rid, tokens in out.groupby("rid", sort=True)["token"]}

    def copy(self) -> "Frames":
        """A copy free to edit (tables copied, meta deep-copied; cells hold scalars): 0.5
        ms for a fixture run, 6.4 ms to type its payload again (:meth:`from_payload`)."""
        return Frames(tables={name: table.copy(deep=True) for name, table in
                              self.tables.items()}, meta=copy.deepcopy(self.meta))

    def comparable(self) -> dict[str, pd.DataFrame]:
        """The tables without wall-clock columns: equal for two runs of the same input."""
        return {name: table.drop(columns=WALL_CLOCK_COLUMNS.get(name, []))
                for name, table in self.tables.items()}

    def to_payload(self) -> dict[str, Any]:
        """The JSON-native content of a frames file: ``{"schema_version", "meta",
        "tables": {name: {columns, data}}}`` (pandas "split" orientation without the
        index)."""
        return {"schema_version": SCHEMA_VERSION, "meta": self.meta,
                "tables": {name: _json_table(table) for name, table in self.tables.items()}}

    def save(self, path: str | Path) -> Path:
        """Write one JSON file (:meth:`to_payload`). Atomic: a failed or interrupted save
        leaves the previous file as it was."""
        return write_payload(path, self.to_payload())

    @classmethod
    def from_payload(cls, payload: dict[str, Any], path: str | Path = "payload") -> "Frames":
        """Frames from a payload :func:`read_payload` accepted, each column in its dtype
        (:mod:`contract_lib.dtypes`); values of another kind raise
        :class:`FramesFormatError` naming ``path``, the table and the column."""
        tables = {}
        for name, columns in COLUMNS.items():
            try:
                tables[name] = typed(pd.DataFrame(payload["tables"][name]["data"],
                                                  columns=columns))
            except ValueError as exc:
                raise FramesFormatError(f"{path}: not a frames file of schema version "
                                        f"{SCHEMA_VERSION}: table {name!r}: {exc}") from None
        return cls(tables=tables, meta=payload["meta"])

    @classmethod
    def load(cls, path: str | Path) -> "Frames":
        """Read a file written by :meth:`save`; anything else raises
        :class:`FramesFormatError` (see :func:`read_payload`)."""
        return cls.from_payload(read_payload(path), path)

    @classmethod
    def from_rows(cls, rows: dict[str, list[dict[str, Any]]], meta: dict[str, Any]) -> "Frames":
        """Build the tables from the row dicts the capture streamed, in schema order and
        in the dtypes a file of them reads back with."""
        tables = {name: typed(pd.DataFrame(rows.get(name, []), columns=columns))
                  for name, columns in COLUMNS.items()}
        return cls(tables=tables, meta=meta)


def _json_table(table: pd.DataFrame) -> dict[str, list]:
    """``{"columns", "data"}`` of ``table`` in JSON-native values (missing ones None): what
    ``json.loads(table.to_json(orient="split", index=False))`` gives, but floats at full
    precision (``to_json`` keeps 10 decimals), in a fifth of the time."""
    columns = []
    for name in table.columns:
        values = table[name].tolist()  # Python scalars, NaN for missing floats
        columns.append(values if table[name].dtype.kind in "biu"
                       else [_json_value(value) for value in values])
    return {"columns": list(table.columns), "data": [list(row) for row in zip(*columns)]}


def _json_value(value: Any) -> Any:
    if value is None or value is pd.NA or value is pd.NaT:
        return None
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else value
    if isinstance(value, np.generic):
        return _json_value(value.item())
    return value


def write_payload(path: str | Path, payload: dict[str, Any], compact: bool = False) -> Path:
    """Write a frames payload as JSON, atomically (:func:`contract_lib.atomic.atomic_write`):
    indented for files people read and diff, ``compact`` (no whitespace; a fifth of the
    time, since ``json`` indents in Python) for the frame cache."""
    path = Path(path)
    text = (json.dumps(payload, separators=(",", ":")) if compact
            else json.dumps(payload, indent=1, sort_keys=False))
    with atomic_write(path) as handle:
        handle.write(text + "\n")
    return path


def read_payload(path: str | Path) -> dict[str, Any]:
    """The payload of a frames file, checked against this schema. Anything else
    (unreadable, not JSON, another schema version, missing or extra tables or columns,
    rows of the wrong length, meta of the wrong shape) raises :class:`FramesFormatError`
    naming the file and the problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:  # ValueError: UTF-8
        raise FramesFormatError(f"{path}: not a frames file ({exc})") from exc
    return parse_payload(text, path)


def parse_payload(text: str, path: str | Path) -> dict[str, Any]:
    """:func:`read_payload` of text already read (``path`` names it in errors)."""
    try:
        payload = json.loads(text)
    except (ValueError, RecursionError) as exc:  # ValueError: JSON
        raise FramesFormatError(f"{path}: not a frames file ({exc})") from exc
    if not isinstance(payload, dict):
        raise FramesFormatError(f"{path}: not a frames file (a JSON "
                                f"{type(payload).__name__}, not an object)")
    version = payload.get("schema_version")
    if version != SCHEMA_VERSION:
        raise FramesFormatError(
            f"{path}: frames schema version {version!r}, this contract_lib reads "
            f"version {SCHEMA_VERSION}; re-record the run with this version")
    problem = _meta_problem(payload.get("meta")) or _tables_problem(payload.get("tables"))
    if problem:
        raise FramesFormatError(f"{path}: not a frames file of schema version "
                                f"{SCHEMA_VERSION}: {problem}")
    return payload


def _meta_problem(meta: Any) -> str | None:
    """What is wrong with a loaded ``meta`` (None: nothing)."""
    if not isinstance(meta, dict):
        return f"meta is a {type(meta).__name__}, not an object"
    for name, wanted in META_TYPES.items():
        if name not in meta:
            return f"meta has no {name!r}"
        if not isinstance(meta[name], wanted):
            return f"meta {name!r} is a {type(meta[name]).__name__}"
    if meta["status"] not in STATUSES:
        return f"meta 'status' is {meta['status']!r}, not one of {', '.join(STATUSES)}"
    return None


def _tables_problem(tables: Any) -> str | None:
    """What is wrong with loaded ``tables`` against :data:`COLUMNS` (None: nothing)."""
    if not isinstance(tables, dict):
        return f"tables is a {type(tables).__name__}, not an object"
    if set(tables) != set(COLUMNS):
        missing, extra = sorted(set(COLUMNS) - set(tables)), sorted(set(tables) - set(COLUMNS))
        return f"tables missing {missing}, unknown {extra}"
    for name, columns in COLUMNS.items():
        body = tables[name]
        if not isinstance(body, dict) or body.get("columns") != columns:
            found = body.get("columns") if isinstance(body, dict) else body
            return f"table {name!r} has columns {found!r}, expected {columns}"
        data = body.get("data")
        if not isinstance(data, list) or not all(
                isinstance(row, list) and len(row) == len(columns) for row in data):
            return f"table {name!r}: data is not a list of rows of {len(columns)} values"
    return None
