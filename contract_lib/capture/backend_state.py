"""Clause 7's table: the backend's per-request dicts and sets at every step boundary."""

from __future__ import annotations

import functools
import itertools
import operator
import types
from typing import Any

# Values whose attributes are code or a namespace, not state the backend keeps.
_NOT_STATE = (types.FunctionType, types.MethodType, types.BuiltinFunctionType,
              types.ModuleType, type)


@functools.lru_cache(maxsize=None)
def _is_container(kind: type) -> bool:
    """A dict or set type (subclasses too), asked once per type."""
    return issubclass(kind, (dict, set, frozenset))


def _holds_state(value) -> bool:
    """An object the backend may keep state in: one with a ``__dict__``, not code."""
    return hasattr(value, "__dict__") and not isinstance(value, _NOT_STATE)


class _Layout:
    """The worker and the objects it holds, as last read: their dict and set attributes
    (``structures``, each read from ``sources[i][names[i]]`` at every step), and the keys
    a step compares, in C, to know them unchanged.

    The worker's key is its attribute names and their types. The held objects' key is
    which objects they are, how many attributes each has, and which of those are still
    None, read without touching the attributes' values (``itemgetter``, then identity): a
    structure added, or bound where None was (a lazy ``self._caches = None`` ...
    ``self._caches = {}``), changes it. An attribute of a held object rebound from
    another non-container value to a dict is not seen."""

    def __init__(self, worker, scheduler) -> None:
        self.worker = worker  # kept alive, as the held objects are
        attributes = vars(worker)
        self.held_names = tuple(name for name in sorted(attributes)
                                if attributes[name] is not scheduler
                                and _holds_state(attributes[name]))
        self.held = tuple(attributes[name] for name in self.held_names)
        self.held_dicts = tuple(vars(obj) for obj in self.held)
        self.nones = tuple(_none_getter(d) for d in self.held_dicts)
        self.structures: list[str] = []
        self.sources: list[dict[str, Any]] = []
        self.names: list[str] = []
        owners = [("tp_worker", attributes)] + [
            (f"tp_worker.{name}", d) for name, d in zip(self.held_names, self.held_dicts)]
        for owner, found in owners:
            for name in sorted(found):
                if _is_container(type(found[name])):
                    self.structures.append(f"{owner}.{name}")
                    self.sources.append(found)
                    self.names.append(name)
        self.key = self._key(attributes)

    def _key(self, attributes: dict[str, Any]) -> tuple:
        return (tuple(attributes), tuple(map(type, attributes.values())),
                tuple(map(attributes.get, self.held_names)),
                tuple(map(len, self.held_dicts)),
                tuple(map(operator.call, self.nones, self.held_dicts)))

    def matches(self, worker) -> bool:
        try:
            return worker is self.worker and self._key(vars(worker)) == self.key
        except KeyError:  # an attribute a None getter reads was deleted
            return False


def _none_getter(attributes: dict[str, Any]):
    """Reads the attributes that are None now (``len`` where there are none)."""
    nones = [name for name, value in attributes.items() if value is None]
    return operator.itemgetter(*nones) if nones else len


class BackendStateRecorder:
    """Records the backend's per-request structures at every step boundary.

    The backend is the scheduler's ``tp_worker`` and every object it holds (MLX:
    ``MlxTpModelWorker``, its ``MlxModelRunner``, the bookkeeping stub, its configs;
    torch: ``TpModelWorker``, its runner and configs), found by what they are, not by
    name: a runner held as ``_mlx_engine`` is looked at as ``_mlx_runner`` is. A
    structure is per-request when it is a dict or set attribute of one of them that has
    ever been keyed by a request id the scheduler knows; from then on every string key
    it holds is recorded, known or not. No names are assumed, so a release or a
    replacement loop that renames them is still covered.
    """

    def __init__(self, scheduler) -> None:
        self.s = scheduler
        self.per_request: set[str] = set()  # "object.attribute" found keyed by request ids
        self._layout: _Layout | None = None
        self._current()  # read once when the hooks go in: set-up work, not a step's

    def _current(self) -> _Layout | None:
        """The backend's layout, read again only when its key changed."""
        worker = getattr(self.s, "tp_worker", None)
        if worker is None:
            return None
        if self._layout is None or not self._layout.matches(worker):
            self._layout = _Layout(worker, self.s)
        return self._layout

    def rows(self, step: int, reqs: dict[str, Any]) -> list[tuple]:
        """``(step, rid, structure, row)`` per request key held, in a stable order."""
        layout = self._current()
        if layout is None:
            return []
        values = tuple(map(dict.get, layout.sources, layout.names))
        rows = []
        # Only the structures holding keys (the others are looked at again next step).
        for index in itertools.compress(range(len(values)), values):
            value = values[index]
            if not _is_container(type(value)):  # rebound on a held object
                continue
            structure = layout.structures[index]
            if structure not in self.per_request:
                held = value.keys() if isinstance(value, dict) else value
                if held.isdisjoint(reqs):  # in C: no known request id among its keys
                    continue
                self.per_request.add(structure)
            keys = [k for k in value if isinstance(k, str)]
            maps_row = isinstance(value, dict) and "pool_idx" in layout.names[index]
            for key in sorted(keys):
                row = value[key] if maps_row else None
                rows.append((step, key, structure, int(row) if isinstance(row, int) else None))
        return rows
