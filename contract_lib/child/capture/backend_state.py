"""Clause 7's table: the backend's per-request dicts and sets at every step boundary."""

from __future__ import annotations

import functools
import itertools
import operator
import types
from typing import Any

# How many levels below the worker held objects are read (2: the worker's runner, and
# what the runner holds, e.g. a cache manager keeping its own per-request dict).
DEPTH = 2
# Values whose attributes are code or a namespace, not state the backend keeps.
_NOT_STATE = (types.FunctionType, types.MethodType, types.BuiltinFunctionType,
              types.ModuleType, type)
_NONE_HELD: frozenset = frozenset()  # a structure's keys before any request, when it had none


@functools.lru_cache(maxsize=None)
def _is_container(kind: type) -> bool:
    """A dict or set type (subclasses too), asked once per type."""
    return issubclass(kind, (dict, set, frozenset))


def _holds_state(value) -> bool:
    """An object the backend may keep state in: one with a ``__dict__``, not code."""
    return hasattr(value, "__dict__") and not isinstance(value, _NOT_STATE)


class _Layout:
    """The worker and the objects it holds, to :data:`DEPTH` levels, as last read: their
    dict and set attributes (``structures``, each read from ``sources[i][names[i]]`` at
    every step), and the keys a step compares, in C, to know them unchanged.

    The worker's key is its attribute names and their types. The held objects' key is
    which objects they are (each read from its holder's attributes, compared by
    identity), how many attributes each has, and which of those are still None, read
    without touching the attributes' values (``itemgetter``): a structure added, an
    object replaced, or a structure bound where None was (a lazy ``self._caches = None``
    ... ``self._caches = {}``) changes it. An attribute of a held object rebound from
    another non-container value to a dict is not seen."""

    def __init__(self, worker, scheduler) -> None:
        self.worker = worker  # kept alive, as the held objects are (their ids stay theirs)
        attributes = vars(worker)
        # (path, holder's attributes, name, object) per held object, breadth first; each
        # object once
        found: list[tuple[str, dict[str, Any], str, Any]] = []
        # What the scheduler holds itself (its pools, configs) is its state, not the
        # backend's, however the worker reaches it.
        seen = {id(worker), id(scheduler), *map(id, vars(scheduler).values())}
        level = [("tp_worker", attributes)]
        for _depth in range(DEPTH):
            next_level = []
            for path, holder in level:
                for name in sorted(holder):
                    value = holder[name]
                    if id(value) not in seen and _holds_state(value):
                        seen.add(id(value))
                        found.append((f"{path}.{name}", holder, name, value))
                        next_level.append((f"{path}.{name}", vars(value)))
            level = next_level
        self.held = tuple(value for *_, value in found)
        self.holders = tuple(holder for _, holder, _, _ in found)
        self.held_names = tuple(name for _, _, name, _ in found)
        self.held_dicts = tuple(vars(value) for value in self.held)
        self.nones = tuple(_none_getter(d) for d in self.held_dicts)
        self.structures: list[str] = []
        self.sources: list[dict[str, Any]] = []
        self.names: list[str] = []
        owners = [("tp_worker", attributes)] + [(path, vars(value))
                                                for path, _, _, value in found]
        for owner, holder in owners:
            for name in sorted(holder):
                if _is_container(type(holder[name])):
                    self.structures.append(f"{owner}.{name}")
                    self.sources.append(holder)
                    self.names.append(name)
        self.key = self._key(attributes)

    def _key(self, attributes: dict[str, Any]) -> tuple:
        return (tuple(attributes), tuple(map(type, attributes.values())),
                tuple(map(id, map(dict.get, self.holders, self.held_names))),
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

    The backend is the scheduler's ``tp_worker``, every object it holds and every
    object those hold (MLX: ``MlxTpModelWorker``, its ``MlxModelRunner``, the
    bookkeeping stub, its configs, and what the runner holds; torch: ``TpModelWorker``,
    its runner and configs, and theirs), except what the scheduler holds itself (its
    pools and configs: its state), found by what they are, not by name: a runner held
    as ``_mlx_engine`` is looked at as ``_mlx_runner`` is. A structure is per-request
    when it is a dict or set attribute of one of them that has been keyed by a request
    id the scheduler knows, a key it did not hold when the hooks went in (a config
    keyed "decode" is not per-request for a request named "decode": a request id is
    free text); from then on every string key it holds is recorded, known or not,
    except those it held then. No names are assumed, so a release or a replacement
    loop that renames them is still covered.
    """

    def __init__(self, scheduler) -> None:
        self.s = scheduler
        self.per_request: set[str] = set()  # "object.attribute" found keyed by request ids
        self._layout: _Layout | None = None
        layout = self._current()  # read once when the hooks go in: set-up work, not a step's
        # The keys each structure held before any request (a config's "decode", "type"):
        # a request id is free text, so one equal to such a key is no evidence.
        self.preexisting: dict[str, frozenset] = {} if layout is None else {
            structure: frozenset(value)
            for structure, value in zip(layout.structures,
                                        map(dict.get, layout.sources, layout.names))
            if _is_container(type(value))}

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
        per_request, preexisting = self.per_request, self.preexisting
        # Only the structures holding keys (the others are looked at again next step).
        for index in itertools.compress(range(len(values)), values):
            value = values[index]
            if isinstance(value, dict):
                held = value.keys()
            elif isinstance(value, (set, frozenset)):
                held = value
            else:  # rebound on a held object
                continue
            structure = layout.structures[index]
            if structure not in per_request:
                if held.isdisjoint(reqs):  # in C: no known request id among its keys
                    continue
                before = preexisting.get(structure, _NONE_HELD)
                if all(rid in before for rid in reqs if rid in held):
                    continue
                per_request.add(structure)
            else:
                before = preexisting.get(structure, _NONE_HELD)
            keys = [k for k in held if isinstance(k, str) and k not in before]
            maps_row = isinstance(value, dict) and "pool_idx" in layout.names[index]
            for key in sorted(keys):
                row = value[key] if maps_row else None
                rows.append((step, key, structure, int(row) if isinstance(row, int) else None))
        return rows
