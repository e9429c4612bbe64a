"""Server args checked against the field types of SGLang's own ``ServerArgs``.

``ServerArgs`` builds from any values (a msgspec struct in the supported releases, a
dataclass before; neither checks types), so ``max_running_requests = "eight"`` would fail deep
inside a run, or not at all. :func:`accepted_kinds` reads the field types where SGLang is
imported (a fork server, a cold child); :func:`problems` checks values against them
anywhere, so the parent refuses a bad argument before any run child starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any

# The kinds of value a TOML workload or ``--server-arg`` can hold, in display order.
_KIND_ORDER = ("bool", "int", "float", "str", "list", "dict", "None")
_KINDS = {bool: "bool", int: "int", float: "float", str: "str", list: "list",
          tuple: "list", dict: "dict", type(None): "None"}

# Field name -> the kinds of value it accepts (None: not checked, e.g. an enum or Any).
Kinds = dict[str, "tuple[str, ...] | None"]


def accepted_kinds(server_args_class: type) -> Kinds:
    """The kinds each field of ``server_args_class`` accepts (run where SGLang is imported)."""
    return {name: _accepted(tp) for name, tp in _field_types(server_args_class).items()}


def problems(args: dict[str, Any], kinds: Kinds) -> list[str]:
    """One line per argument that is not a ``ServerArgs`` field, or whose value has the
    wrong type."""
    found = []
    for name, value in args.items():
        if name not in kinds:
            close = difflib.get_close_matches(name, kinds, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            found.append(f"unknown server arg {name!r} (not a field of SGLang's "
                         f"ServerArgs){hint}")
            continue
        accepted = kinds[name]
        kind = _kind(value)
        if accepted is None or kind in accepted or (kind == "int" and "float" in accepted):
            continue
        found.append(f"server arg {name} wants {' or '.join(accepted)}, got {value!r} "
                     f"({kind})")
    return found


def _field_types(cls: type) -> dict[str, Any]:
    try:
        import msgspec
    except ImportError:
        msgspec = None
    if msgspec is not None and isinstance(cls, type) and issubclass(cls, msgspec.Struct):
        return {field.name: field.type for field in msgspec.structs.fields(cls)}
    try:
        hints = typing.get_type_hints(cls, include_extras=True)
    except Exception:  # noqa: BLE001 - an unresolvable annotation: check what resolves
        hints = {}
    return {field.name: hints.get(field.name, Any) for field in dataclasses.fields(cls)}


def _accepted(tp: Any) -> tuple[str, ...] | None:
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _accepted(typing.get_args(tp)[0])
    if origin in (typing.Union, types.UnionType):
        parts = [_accepted(arg) for arg in typing.get_args(tp)]
        if any(part is None for part in parts):
            return None
        return _ordered({kind for part in parts for kind in part})
    if origin is typing.Literal:
        return _ordered({_kind(value) for value in typing.get_args(tp)})
    base = origin if origin is not None else tp
    return (_KINDS[base],) if base in _KINDS else None


def _ordered(kinds: set[str]) -> tuple[str, ...]:
    return tuple(kind for kind in _KIND_ORDER if kind in kinds)


def _kind(value: Any) -> str:
    return _KINDS.get(type(value), type(value).__name__)
