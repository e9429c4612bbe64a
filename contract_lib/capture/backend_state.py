"""Clause 7's table: the backend's per-request dicts and sets at every step boundary."""

from __future__ import annotations

from typing import Any


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

    def _objects(self) -> dict[str, Any]:
        worker = getattr(self.s, "tp_worker", None)
        if worker is None:
            return {}
        objects = {"tp_worker": worker}
        for name, value in vars(worker).items():
            if name.endswith("runner") and value is not None and hasattr(value, "__dict__"):
                objects[f"tp_worker.{name}"] = value
        return objects

    def rows(self, step: int, reqs: dict[str, Any]) -> list[dict[str, Any]]:
        """``(step, rid, structure, row)`` per request key held, in a stable order."""
        rows = []
        for owner, obj in self._objects().items():
            attributes = vars(obj)
            # The non-empty containers only, then sorted: an empty one holds no key and
            # cannot be found per-request yet (it is looked at again every step).
            for name in sorted(name for name, value in attributes.items()
                               if isinstance(value, (dict, set, frozenset)) and value):
                value = attributes[name]
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
