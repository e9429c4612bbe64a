"""The dtype of every frame column, the same on every path: a fresh run, a frames file,
the frame cache.

A column's kind is declared by its name (a name has one kind in every table of
:data:`contract_lib.frames.COLUMNS`); its dtype then depends only on which values are
missing, never on their Python types, because JSON has no NaN: a run and the same run
read back from a file (None where it had NaN) get equal tables, dtypes included.

- ``int``: int64; float64 with NaN when a value is missing (int64 has no missing value).
- ``float``: float64, NaN for a missing value.
- ``bool``: bool; object with None for a missing value when one is.
- ``str``: pandas' ``str``, NaN for a missing value.
"""

from __future__ import annotations

import functools

import pandas as pd

KINDS: dict[str, tuple[str, ...]] = {
    "int": ("step", "forward_ct", "result_queue_len", "running_bs", "waiting_len",
            "kv_total", "kv_available", "kv_evictable", "kv_protected", "kv_uncached",
            "rows_free", "rows_total", "processed_tokens_counter", "launch", "forward_iter",
            "processed_step", "processed_forward_iter", "prefilled_tokens", "prompt_len",
            "emitted", "req_pool_idx", "seq_len", "kv_computed", "kv_committed_len",
            "kv_allocated_len", "cache_protected_len", "cached_tokens", "retractions",
            "decode_batch_idx", "kv_prefilled", "max_new_tokens", "finish_matched",
            "position", "slot", "row", "value", "last_published", "index", "token", "count",
            "changed", "need", "available", "asked", "evictable_before", "evictable_after",
            "extend_num_tokens", "disagg_queued"),
    "float": ("wall_time", "launch_ts", "processed_launch_ts", "max_abs_diff"),
    "bool": ("is_fully_idle", "idle_probe", "enable_overlap", "enable_overlap_mlx",
             "pool_leak", "chained", "processed_after_idle_gap", "finished", "slot_free",
             "written", "published_for_rid", "transfer", "end_sent"),
    "str": ("loop", "running_mode", "last_batch_mode", "mode", "rids", "tokens", "rid",
            "finish_reason", "finish_message", "event", "kind", "object", "field",
            "location", "target", "owner", "structure", "verdict"),
}
KIND_OF: dict[str, str] = {column: kind for kind, names in KINDS.items() for column in names}

# Each kind's dtype when no value is missing (and ``float``'s, ``str``'s always).
_DTYPE = {"int": "int64", "float": "float64", "bool": "bool", "str": "str"}
# What pandas' ``infer_dtype`` (missing values skipped) may call each kind's values.
_NUMBERS = {"integer", "floating", "mixed-integer-float", "empty"}
_INFERRED = {"int": _NUMBERS, "float": _NUMBERS, "bool": {"boolean", "empty"},
             "str": {"string", "empty"}}


def typed(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` with every column in its kind's dtype (module docstring). Values of
    another kind (a string in an int column, a fraction in an int column) raise
    ValueError naming the column."""
    if table.empty:
        return _empty(tuple(table.columns)).copy()
    fixed = {}
    for column in table.columns:
        kind, values = KIND_OF[column], table[column]
        if values.dtype != _DTYPE[kind]:  # else what pandas inferred (the common case)
            fixed[column] = _converted(column, kind, values)
    return table.assign(**fixed) if fixed else table


@functools.lru_cache(maxsize=None)
def _empty(columns: tuple[str, ...]) -> pd.DataFrame:
    """A table of no rows, each column in its kind's dtype (copied by each caller)."""
    return pd.DataFrame({column: pd.Series(dtype=_DTYPE[KIND_OF[column]])
                         for column in columns})


def _converted(column: str, kind: str, values: pd.Series) -> pd.Series:
    """``values`` (a column pandas gave another dtype) in its kind's dtype."""
    missing = values.isna().to_numpy()
    inferred = pd.api.types.infer_dtype(values, skipna=True)
    present = values.to_numpy()[~missing]
    if inferred not in _INFERRED[kind] or (
            kind == "int" and inferred != "integer" and (present.astype(float) % 1).any()):
        raise ValueError(f"column {column!r} holds {inferred} values, not {kind}")
    if kind == "float" or (kind == "int" and missing.any()):
        return values.astype("float64")
    if kind == "int":
        return values.astype("int64")
    if kind == "str":
        return values.astype("str")
    if missing.any():  # bool with a missing value: object, None for it
        return values.astype(object).where(~missing, None)
    return values.astype(bool)
