"""The clause registry: each clause of the contract declared once, with everything the
checker, the report, ``status``, ``trace`` and ``audit`` need to know about it.

A clause module declares its check with :func:`clause` (the way Hypothesis' ``@invariant``
records an invariant and its precondition): number, name, the fields it covers, their
SGLang readers, its origin (the RFC or this project's extensions) and, optionally, the
condition under which the run exercised it (``unexercised``: why not, or None). An
extension that adds fields to an existing clause declares its check with :func:`extend`.

Clause sets: ``"rfc"`` (the RFC's clauses, as the RFC states them) and ``"all"`` (every
clause, extended where an extension adds fields).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

RFC = "RFC #32833"
EXTENSIONS = "this project's extensions"
CLAUSE_SETS = ("all", "rfc")

Check = Callable[[Any], Any]  # Frames -> ClauseResult


@dataclasses.dataclass
class Clause:
    """One clause: what it is, where it comes from, how it is checked."""

    number: int
    name: str
    check: Check
    fields: tuple[str, ...] = ()  # the fields the clause states (docs, tables)
    # Every field name the effects audit may report for this clause (pseudo-fields name
    # in-place tensor writes, e.g. ``req_to_token[]``).
    audit_fields: tuple[str, ...] = ()
    readers: tuple[str, ...] = ()  # SGLang code that reads the fields
    origin: str = RFC
    # Frames -> why the run did not exercise the clause, or None (checked before ``check``).
    unexercised: Callable[[Any], str | None] | None = None
    # The ``"all"`` set's check, when an extension adds fields to this clause.
    extended: Check | None = None
    extended_fields: tuple[str, ...] = ()


REGISTRY: dict[int, Clause] = {}
# Derived views, kept up to date by :func:`register` (the same dict objects throughout).
CLAUSES: dict[int, str] = {}  # number -> name
EXTENSION_CLAUSES: dict[int, str] = {}  # number -> name, this project's own clauses
EXTENDED_FIELDS: dict[int, list[str]] = {}  # number -> fields an extension adds
CLAUSE_OF_FIELD: dict[str, int] = {}  # audit field -> clause number


def register(declared: Clause, *, replace: bool = False) -> Clause:
    """Add a clause and refresh the derived views. A number already registered is a
    ValueError unless ``replace`` (then an extension of the replaced clause, declared
    with :func:`extend`, stays unless ``declared`` brings its own)."""
    previous = REGISTRY.get(declared.number)
    if previous is not None and not replace:
        raise ValueError(f"clause {declared.number} is already registered "
                         f"({previous.name!r}); pass replace=True to replace it")
    if previous is not None and declared.extended is None:
        declared.extended, declared.extended_fields = previous.extended, previous.extended_fields
    REGISTRY[declared.number] = declared
    _refresh()
    return declared


def unregister(number: int) -> None:
    """Remove a clause (tests that register a toy one)."""
    REGISTRY.pop(number, None)
    _refresh()


def _refresh() -> None:
    ordered = [REGISTRY[n] for n in sorted(REGISTRY)]
    for view in (CLAUSES, EXTENSION_CLAUSES, EXTENDED_FIELDS, CLAUSE_OF_FIELD):
        view.clear()
    for c in ordered:
        CLAUSES[c.number] = c.name
        if c.origin == EXTENSIONS:
            EXTENSION_CLAUSES[c.number] = c.name
        if c.extended_fields:
            EXTENDED_FIELDS[c.number] = list(c.extended_fields)
        for name in (*c.audit_fields, *c.extended_fields):
            CLAUSE_OF_FIELD.setdefault(name, c.number)


def clause(number: int, name: str, *, fields: tuple[str, ...] = (),
           audit_fields: tuple[str, ...] = (), readers: tuple[str, ...] = (),
           origin: str = RFC, unexercised: Callable[[Any], str | None] | None = None,
           replace: bool = False) -> Callable[[Check], Check]:
    """Decorator: declare ``number`` checked by the decorated function (``replace``: see
    :func:`register`)."""
    def declare(check: Check) -> Check:
        register(Clause(number, name, check, fields, audit_fields, readers, origin,
                        unexercised), replace=replace)
        return check
    return declare


def extend(number: int, fields: tuple[str, ...]) -> Callable[[Check], Check]:
    """Decorator: the ``"all"`` set checks clause ``number`` with the decorated function,
    which adds ``fields`` (declared after the clause itself)."""
    def declare(check: Check) -> Check:
        declared = REGISTRY[number]
        declared.extended, declared.extended_fields = check, tuple(fields)
        _refresh()
        return check
    return declare


def clause_checks(clauses: str = "all") -> dict[int, Check]:
    """The check function per clause number of a clause set (``"rfc"`` or ``"all"``)."""
    if clauses not in CLAUSE_SETS:
        raise ValueError(f"unknown clause set {clauses!r}; one of: {', '.join(CLAUSE_SETS)}")
    if clauses == "rfc":
        return {n: c.check for n, c in sorted(REGISTRY.items()) if c.origin == RFC}
    return {n: c.extended or c.check for n, c in sorted(REGISTRY.items())}


def origin(number: int) -> str:
    """``RFC #32833`` or ``this project's extensions``."""
    return EXTENSIONS if number in EXTENSION_CLAUSES else RFC
