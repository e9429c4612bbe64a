"""Clause 7's table: the backend's per-request dicts and sets at every step boundary."""

from __future__ import annotations

import functools
from typing import Any, Callable


@functools.lru_cache(maxsize=None)
def _is_container(kind: type) -> bool:
    """A dict or set type (subclasses too), asked once per type: a worker holds ~130
    attributes, looked at every step."""
    return issubclass(kind, (dict, set, frozenset))


def _runner_attribute(name: str, kind: type) -> bool:
    return name.endswith("runner")


def _container_attribute(name: str, kind: type) -> bool:
    return _is_container(kind)


class BackendStateRecorder:
    """Records the backend's per-request structures at every step boundary.

    The backend is the scheduler's ``tp_worker`` and every ``*runner`` object it holds
    (MLX: ``MlxTpModelWorker``, its ``MlxModelRunner`` and the bookkeeping stub; torch:
    ``TpModelWorker`` and its runner). A structure is per-request when it is a dict or set
    attribute of one of them that has ever been keyed by a request id the scheduler knows;
    from then on every string key it holds is recorded, known or not. No names are
    assumed, so a release or a replacement loop that renames them is still covered.
    """

    def __init__(self, scheduler) -> None:
        self.s = scheduler
        self.per_request: set[str] = set()  # "object.attribute" found keyed by request ids
        # (id(object), filter) -> (its attribute names and types, the names kept)
        self._layouts: dict[tuple[int, Callable], tuple[tuple, list[str]]] = {}

    def _names(self, obj, wanted: Callable[[str, type], bool]) -> list[str]:
        """The sorted names of ``obj``'s attributes that ``wanted(name, type)`` keeps,
        recomputed only when its attribute names or their types changed: that test runs
        in C (~3 µs for a worker's ~130 attributes; a Python scan takes ~30 µs)."""
        attributes = vars(obj)
        layout = (tuple(attributes), tuple(map(type, attributes.values())))
        known = self._layouts.get((id(obj), wanted))
        if known is None or known[0] != layout:
            known = (layout, sorted(name for name, kind in zip(*layout) if wanted(name, kind)))
            self._layouts[(id(obj), wanted)] = known
        return known[1]

    def _objects(self) -> dict[str, Any]:
        worker = getattr(self.s, "tp_worker", None)
        if worker is None:
            return {}
        objects = {"tp_worker": worker}
        attributes = vars(worker)
        for name in self._names(worker, _runner_attribute):
            value = attributes[name]
            if value is not None and hasattr(value, "__dict__"):
                objects[f"tp_worker.{name}"] = value
        return objects

    def rows(self, step: int, reqs: dict[str, Any]) -> list[dict[str, Any]]:
        """``(step, rid, structure, row)`` per request key held, in a stable order."""
        rows = []
        for owner, obj in self._objects().items():
            attributes = vars(obj)
            for name in self._names(obj, _container_attribute):
                value = attributes[name]
                if not value:  # holds no key: not found per-request yet (looked at again)
                    continue
                structure = f"{owner}.{name}"
                keys = [k for k in value if isinstance(k, str)]
                if structure not in self.per_request:
                    if not any(k in reqs for k in keys):
                        continue
                    self.per_request.add(structure)
                maps_row = isinstance(value, dict) and "pool_idx" in name
                for key in sorted(keys):
                    row = value[key] if maps_row else None
                    rows.append({"step": step, "rid": key, "structure": structure,
                                 "row": int(row) if isinstance(row, int) else None})
        return rows
