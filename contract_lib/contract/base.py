"""What every clause check shares: statuses, the result record, violation tables."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any, Callable, Iterator, TypeVar

import numpy as np
import pandas as pd

from contract_lib.contract.registry import CLAUSES

HOLDS, VIOLATED, MASKED, NOT_EXERCISED = "holds", "violated", "violated-masked", "not-exercised"
# The release has none of the clause's fields, and nothing in it reads them.
NOT_PRESENT = "not-present"

VIOLATION_COLUMNS = ["clause", "name", "field", "loop", "step", "launch", "rid", "expected",
                     "actual", "explanation"]


# What the rules of one check derive from the run's frames (:func:`derived`), by
# (function, frames); None outside :func:`one_check`.
_ONE_CHECK: contextvars.ContextVar[dict | None] = contextvars.ContextVar("_ONE_CHECK",
                                                                         default=None)
_Derived = TypeVar("_Derived")


@contextlib.contextmanager
def one_check() -> Iterator[None]:
    """Within one check of one run (:func:`~contract_lib.contract.report.check`), what
    several rules derive from its frames (:func:`derived`) is computed once, not two to
    five times. The frames cannot change meanwhile; nothing is kept after it."""
    token = _ONE_CHECK.set({})
    try:
        yield
    finally:
        _ONE_CHECK.reset(token)


def derived(function: Callable[[Any], _Derived]) -> Callable[[Any], _Derived]:
    """A function of a run's frames whose result the rules share within
    :func:`one_check`, read-only; outside one it is computed at every call."""
    @functools.wraps(function)
    def shared(frames) -> _Derived:
        memo = _ONE_CHECK.get()
        if memo is None:
            return function(frames)
        key = (function, id(frames))
        if key not in memo:  # kept with its frames: no other frames can take that id
            memo[key] = (frames, function(frames))
        return memo[key][1]

    return shared


class NotExercised(Exception):
    """Raised by a clause check: the run gave the clause nothing to check (the message
    says why); the checker records ``not-exercised``."""


@dataclasses.dataclass
class ClauseResult:
    clause: int
    status: str
    note: str
    violations: pd.DataFrame
    # The clause's fields the run's SGLang does not have -> why that is no violation.
    absent: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        return CLAUSES[self.clause]

    def first(self) -> dict[str, Any] | None:
        if self.violations.empty:
            return None
        return self.violations.iloc[0].to_dict()


def no_rows(**dtypes: Any) -> pd.DataFrame:
    """The rows a clause check builds, with no row: empty columns of the dtypes its
    table-building code gives an empty selection, so a check with nothing to report
    skips that code (~3 ms of pandas) and returns the same empty violation table."""
    return pd.DataFrame({name: pd.Series(dtype=dtype) for name, dtype in dtypes.items()})


def violations(clause: int, loop: str, rows: pd.DataFrame | list[dict[str, Any]]
               ) -> pd.DataFrame:
    """A clause's violation records in schema order, sorted by step (then launch)."""
    if len(rows) == 0:  # a clause that holds: ~3 ms of pandas calls, the same every time
        shape = None if isinstance(rows, list) else tuple(map(str, rows.dtypes.items()))
        return _no_violations(clause, loop, shape, rows).copy()
    return _violations(clause, loop, rows)


_EMPTY: dict[tuple, pd.DataFrame] = {}


def _no_violations(clause: int, loop: str, shape: tuple | None, rows) -> pd.DataFrame:
    """The empty table :func:`_violations` makes from ``rows`` (no rows, these columns
    and dtypes), made once per clause, loop and shape."""
    key = (clause, loop, shape)
    if key not in _EMPTY:
        _EMPTY[key] = _violations(clause, loop, rows)
    return _EMPTY[key]


def _violations(clause: int, loop: str, rows: pd.DataFrame | list[dict[str, Any]]
                ) -> pd.DataFrame:
    """The table of ``rows``: each column as built (``launch`` and ``rid`` as objects), a
    column with missing values as objects with None for them (a column not built: all
    None). Built column by column (a frame-wide reindex and astype cost ~1 ms more)."""
    table = pd.DataFrame(rows) if isinstance(rows, list) else rows
    index = table.index
    columns = {"clause": pd.Series(clause, index=index, dtype="int64"),
               "name": pd.Series(CLAUSES[clause], index=index),
               "loop": pd.Series(loop, index=index)}
    for name in VIOLATION_COLUMNS:
        if name in columns:
            continue
        column = (table[name] if name in table
                  else pd.Series(float("nan"), index=index, dtype="float64"))
        missing = column.isna()
        if name in ("launch", "rid") or missing.any():
            column = column.astype(object)
        if missing.any():
            column = column.where(~missing, None)
        columns[name] = column
    table = pd.DataFrame({name: columns[name] for name in VIOLATION_COLUMNS})
    # By step, then launch, a missing one first (stable): a numpy sort, and no copy of
    # the columns when they already are in that order (as most rules build them).
    keys = [columns[name].to_numpy(dtype="float64", na_value=np.nan)
            for name in ("launch", "step")]
    order = np.lexsort([np.where(np.isnan(key), -np.inf, key) for key in keys])
    if (order != np.arange(len(order))).any():
        table = table.take(order)
    return table.reset_index(drop=True)


def result(clause: int, loop: str, rows: pd.DataFrame | list[dict[str, Any]], note: str,
           masked: bool = False) -> ClauseResult:
    """``violated`` (``violated-masked`` when ``masked``) if there are rows, else ``holds``."""
    status = (MASKED if masked else VIOLATED) if len(rows) else HOLDS
    return ClauseResult(clause, status, note, violations(clause, loop, rows))


def ordered_by(table: pd.DataFrame, column: str) -> pd.DataFrame:
    """``table`` stably sorted by ``column``: the table itself when it already is (the
    capture records steps, launches and request rows in step order, and a sort copies
    every column). Read the result, do not edit it."""
    if table[column].is_monotonic_increasing:
        return table
    return table.sort_values(column, kind="stable")


def live_mask(requests: pd.DataFrame) -> pd.Series:
    """Live request rows: holding a ``req_to_token`` row, not finished, launched."""
    return pd.Series(_live({name: requests[name].to_numpy() for name in
                            ("finished", "req_pool_idx", "kv_computed")}),
                     index=requests.index)


def _live(columns: dict[str, np.ndarray]) -> np.ndarray:
    """:func:`live_mask` of these requests columns."""
    return (~columns["finished"].astype(bool) & pd.notna(columns["req_pool_idx"])
            & pd.notna(columns["kv_computed"]))


@derived
def request_columns(frames) -> dict[str, np.ndarray]:
    """The requests table's columns as numpy arrays (strings, and bools with a missing
    value, as objects), shared within a check: read, do not edit. The rules compute
    their masks on these (two columns compared, missing values masked: ~2 us; ~90 us in
    pandas, on a fixture's 63 rows) and build violation rows from the table."""
    return {name: column.to_numpy() for name, column in frames.requests.items()}


@derived
def live_rows(frames) -> np.ndarray:
    """:func:`live_mask` of the run's requests table, as a numpy array shared within a
    check."""
    return _live(request_columns(frames))


@derived
def live_requests(frames) -> pd.DataFrame:
    """The run's live request rows (:func:`live_mask`), shared within a check."""
    return frames.requests[live_rows(frames)]


@derived
def in_step_order(frames) -> np.ndarray:
    """The requests table's row positions in step order (stable), shared within a check."""
    return np.argsort(request_columns(frames)["step"], kind="stable")


def first_of_each(rids: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Of ``rows`` (row positions in the order they count), each request's first, in
    that order (``drop_duplicates("rid")`` of those rows)."""
    if not len(rows):
        return rows
    _, first = np.unique(rids[rows], return_index=True)
    return rows[np.sort(first)]


@derived
def emitted_tokens(frames) -> dict[str, list[int]]:
    """The run's emitted token ids per request (``Frames.output_tokens``), shared within a
    check: read, do not edit."""
    return frames.output_tokens()


@derived
def by_request(frames) -> np.ndarray:
    """The requests table's row positions sorted by request, then step (stable), shared
    within a check."""
    columns = request_columns(frames)
    codes, _ = pd.factorize(columns["rid"], sort=True, use_na_sentinel=False)
    return np.lexsort((columns["step"], codes))


@derived
def retractions(frames) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The requests table's row positions sorted by request then step
    (:func:`by_request`), and in that order: whether each row is the same request as
    the row before, and whether the request gave its ``req_to_token`` row back
    unfinished at that step (retracted or preempted)."""
    order, columns = by_request(frames), request_columns(frames)
    rid, held = columns["rid"][order], pd.notna(columns["req_pool_idx"][order])
    same = np.zeros(len(order), dtype=bool)
    same[1:] = rid[1:] == rid[:-1]
    gave_back = np.zeros(len(order), dtype=bool)
    gave_back[1:] = same[1:] & held[:-1] & ~held[1:]
    gave_back &= ~columns["finished"][order].astype(bool)
    return order, same, gave_back


def first_step_showing(requests: pd.DataFrame, index_by_rid: dict[str, int]
                       ) -> dict[str, int]:
    """Per request of ``index_by_rid``, the first step at which it had emitted more than
    that many tokens (its token at that index shown); absent where no step shows it
    (outputs are read after the last step). One pass over the table."""
    if not index_by_rid:
        return {}
    index = requests["rid"].map(index_by_rid)
    shown = requests[index.notna() & (requests["emitted"] > index)]
    return {rid: int(step) for rid, step in shown.groupby("rid")["step"].min().items()}


def handoffs(frames) -> dict[str, int]:
    """The requests whose prompt was prefilled elsewhere (a PD-disaggregation decode
    side: their prompt KV and first token arrived by transfer, ``prebuilt`` rows with
    ``transfer``): rid -> the hand-off token. Empty on every other loop."""
    prebuilt = frames.tables.get("prebuilt")
    if prebuilt is None or prebuilt.empty:
        return {}
    first = prebuilt[prebuilt["transfer"].astype(bool)]
    return dict(zip(first["rid"], first["token"].astype("int64").tolist()))


def ints(series: pd.Series) -> pd.Series:
    return series.astype("int64").astype(str)
