"""Who wrote each ``req_to_token`` entry: every entry ``ReqToTokenPool.write`` writes is
attributed to the request holding that row at write time, so a slot a row's previous
holder left shows as not ``written`` (clause 1's ``slots.written``)."""

from __future__ import annotations

import numpy as np

from contract_lib.child.capture.state import RunState
from contract_lib.sources.compat import req_kv

_FEW = 32  # lanes a decode write's index may have to be applied entry by entry


def _numpy_index(indices):
    """The same index for the numpy view of the table (CPU tensors become arrays, no
    copy): numpy indexes a few entries in ~1 µs where torch takes ~10 µs an op. A part
    with a ``numpy`` method is a tensor (numpy's own arrays have none)."""
    if isinstance(indices, tuple):
        return tuple(part.numpy() if hasattr(part, "numpy") else part for part in indices)
    return indices.numpy() if hasattr(indices, "numpy") else indices


class RowWrites:
    """``written_by``: per ``req_to_token`` entry, the registry index (in
    ``RunState.reqs`` order) of the request that held the row when the entry was last
    written; -1 never written."""

    def __init__(self, state: RunState, shape: tuple[int, int]) -> None:
        self.state = state
        self.written_by = np.full(shape, -1, dtype=np.int32)
        # Every entry holds its row number (a broadcast view, no copy): indexed like
        # ``req_to_token``, it gives the row of each entry an index selects.
        self._row_numbers = np.broadcast_to(np.arange(shape[0])[:, None], shape)
        self._holders: tuple[tuple, np.ndarray | None] = ((), None)

    def on_write(self, indices) -> None:
        """Attribute the entries ``req_to_token[indices]`` just written to the request
        holding each row (by index, whatever form ``indices`` takes): the same index
        applied to ``written_by`` and to the row numbers, so it costs the write's size,
        not the table's; a ``(row, span)`` index takes that row's holder directly."""
        if (isinstance(indices, tuple) and len(indices) == 2 and type(indices[0]) is int
                and type(indices[1]) is slice):  # (row, span): the extend path's form
            self.written_by[indices] = self._row_holders()[indices[0]]
            return
        if (isinstance(indices, tuple) and len(indices) == 2
                and all(getattr(part, "ndim", None) == 1  # integer tensors, not masks
                        and getattr(part.dtype, "is_signed", False)
                        and not part.dtype.is_floating_point for part in indices)
                and indices[0].shape[0] == indices[1].shape[0] <= _FEW):
            # (rows, positions) of a few lanes, the decode path's form: entry by entry
            # (~2 µs for four; a tensor's ``numpy()`` alone costs more)
            holders, written_by = self._row_holders(), self.written_by
            for row, position in zip(indices[0].tolist(), indices[1].tolist()):
                written_by[row, position] = holders[row]
            return
        index = _numpy_index(indices)
        if (isinstance(index, tuple) and len(index) == 2 and isinstance(index[1], np.ndarray)
                and isinstance(index[0], (np.ndarray, int))):
            # (rows, positions), the decode path's form: each entry's row is its part of
            # ``rows`` (broadcast like the index), without indexing the row numbers
            self.written_by[index] = self._row_holders()[index[0]]
            return
        self.written_by[index] = self._row_holders()[self._row_numbers[index]]

    def _row_holders(self) -> np.ndarray:
        """Per ``req_to_token`` row: the registry index of the first request whose
        ``req_pool_idx`` it is (-1: none); rebuilt only when a request's row changed."""
        rows_held = tuple(req_kv(req).req_pool_idx for req in self.state.reqs.values())
        if rows_held != self._holders[0] or self._holders[1] is None:
            rows = self.written_by.shape[0]
            holders = np.full(rows, -1, dtype=np.int32)
            for index in reversed(range(len(rows_held))):
                row = rows_held[index]
                if row is not None and 0 <= row < rows:
                    holders[row] = index
            self._holders = (rows_held, holders)
        return self._holders[1]
