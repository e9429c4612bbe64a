"""Per-step frames of one run: SGLang's own state at every step boundary and launch.

**Step boundary.** Step ``k`` is the top of the scheduler loop's ``k``-th iteration: the
entry of ``Scheduler.ingest_requests`` (the first call every loop makes), before that
iteration's requests are fed in. The frame of step ``k`` therefore shows the state that
iterations ``0..k-1`` left behind. The last step of a finished run is the first boundary
at which every request has finished and nothing is in flight (``result_queue`` empty).

Tables (pandas DataFrames; the column lists below are the schema):

- ``steps``: one row per step boundary.
- ``launches``: one row per forward launch (a ``run_batch`` forward, an MLX fresh or
  chained launch), completed when ``process_batch_result`` receives that launch's batch.
- ``requests``: per step and request that SGLang knows about.
- ``slots``: per step, live request and position, the ``req_to_token`` entry over every
  position the request has or should have (``max(kv_computed, kv_allocated_len)``).
- ``relay``: every read of ``future_map.output_tokens_buf`` by ``resolve_forward_inputs``
  and every write to it. The buffer is poisoned with -1 at construction.
- ``outputs``: the emitted token ids per request, at the end of the run.
- ``effects`` (audit runs only): per step, every attribute written on the contract's
  objects, with the SGLang code location that wrote it and how often
  (:mod:`contract_lib.effects`).
- ``backend_state``: per step, every entry of the backend's per-request structures
  (the MLX worker's and runner's dicts and sets keyed by request id): request id,
  ``structure`` (``tp_worker._mlx_active_rids``, ``tp_worker._mlx_runner._req_caches``,
  ...) and, for a structure that maps the request to a ``req_to_token`` row, that
  ``row`` (:class:`contract_lib.capture.BackendStateRecorder`; clause 7).
- ``kv_syncs`` (``runner="real"`` only): every position written into the MLX attention
  KV pool: step, request, kind (``prefill``, ``extend``, ``release``, ``flush``,
  ``remove``; ``dropped`` for positions a clamped release leaves out), position, slot,
  and whose slot it was (``target``: ``own``, ``slot 0``, ``other live request`` with
  its ``owner``, ``shared prefix``, ``free``, ``cached``) (:mod:`contract_lib.kvpool`).
- ``kv_pool`` (``runner="real"`` only): at the end of the run, per request and
  radix-matched position, its pool slot's KV against mlx-lm's own KV for that request's
  tokens: ``verdict`` ``ok`` / ``zero`` / ``wrong`` and ``max_abs_diff``.

Model-free runs leave ``kv_syncs`` and ``kv_pool`` empty (the model-free runner has no
KV pool).

``WALL_CLOCK_COLUMNS`` are kept out of every comparison between runs.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pandas as pd

SCHEMA_VERSION = 4

COLUMNS: dict[str, list[str]] = {
    "steps": [
        "step", "loop", "forward_ct", "result_queue_len", "is_fully_idle", "idle_probe",
        "enable_overlap", "enable_overlap_mlx", "running_bs", "running_mode",
        "last_batch_mode", "waiting_len", "kv_total", "kv_available", "kv_evictable",
        "kv_protected", "kv_uncached", "pool_leak", "wall_time",
        "processed_tokens_counter",
    ],
    "launches": [
        "launch", "step", "loop", "forward_ct", "forward_iter", "launch_ts", "mode",
        "chained", "rids", "processed_step", "processed_forward_iter",
        "processed_launch_ts", "prefilled_tokens",
    ],
    "requests": [
        "step", "rid", "prompt_len", "emitted", "finished", "req_pool_idx", "seq_len",
        "kv_computed", "kv_committed_len", "kv_allocated_len", "cache_protected_len",
        "cached_tokens", "decode_batch_idx", "kv_prefilled",
    ],
    "slots": ["step", "rid", "req_pool_idx", "position", "slot", "slot_free"],
    "relay": [
        "event", "step", "launch", "loop", "kind", "row", "rid", "value",
        "last_published", "published_for_rid",
    ],
    "outputs": ["rid", "index", "token"],
    "effects": ["step", "loop", "object", "field", "location", "count", "changed"],
    "kv_syncs": ["step", "rid", "kind", "position", "slot", "target", "owner"],
    "kv_pool": ["rid", "position", "slot", "verdict", "max_abs_diff"],
    "backend_state": ["step", "rid", "structure", "row"],
}

WALL_CLOCK_COLUMNS: dict[str, list[str]] = {
    "steps": ["wall_time"],
    "launches": ["launch_ts", "processed_launch_ts"],
}

STATUSES = ("finished", "crashed", "timeout", "died")


def run_title(meta: dict[str, Any]) -> str:
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
    """Everything one run recorded: its tables and what happened to it (``meta``).

    ``meta`` holds ``workload``, ``loop``, ``patch``, ``runner`` (``model-free`` or
    ``real``), ``sglang_version``, ``status`` (one of ``STATUSES``), ``error`` (type,
    message, traceback, signal; None when finished), ``shims`` (the shims applied) and
    ``server_args`` (the overrides used); real-runner runs add ``kv_pool``.
    """

    tables: dict[str, pd.DataFrame]
    meta: dict[str, Any]

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

    def output_tokens(self) -> dict[str, list[int]]:
        """Emitted token ids per request id."""
        out = self.tables["outputs"].sort_values(["rid", "index"])
        return {rid: group["token"].tolist() for rid, group in out.groupby("rid", sort=True)}

    def comparable(self) -> dict[str, pd.DataFrame]:
        """The tables without wall-clock columns: equal for two runs of the same input."""
        return {
            name: table.drop(columns=WALL_CLOCK_COLUMNS.get(name, []))
            for name, table in self.tables.items()
        }

    def save(self, path: str | Path) -> Path:
        """Write one JSON file: ``{"schema_version", "meta", "tables": {name: {columns,
        data}}}`` (pandas "split" orientation without the index)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "schema_version": SCHEMA_VERSION,
            "meta": self.meta,
            "tables": {
                name: json.loads(table.to_json(orient="split", index=False))
                for name, table in self.tables.items()
            },
        }
        path.write_text(json.dumps(payload, indent=1, sort_keys=False) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Frames":
        path = Path(path)
        try:
            payload = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise FramesFormatError(f"{path}: not a frames file ({exc})") from exc
        version = payload.get("schema_version")
        if version != SCHEMA_VERSION:
            raise FramesFormatError(
                f"{path}: frames schema version {version!r}, this contract_lib reads "
                f"version {SCHEMA_VERSION}; re-record the run with this version")
        tables = {
            name: pd.DataFrame(body["data"], columns=body["columns"])
            for name, body in payload["tables"].items()
        }
        return cls(tables=tables, meta=payload["meta"])

    @classmethod
    def from_rows(cls, rows: dict[str, list[dict[str, Any]]], meta: dict[str, Any]) -> "Frames":
        """Build the tables from the row dicts the capture streamed, in schema order."""
        tables = {
            name: pd.DataFrame(rows.get(name, []), columns=columns)
            for name, columns in COLUMNS.items()
        }
        return cls(tables=tables, meta=meta)
