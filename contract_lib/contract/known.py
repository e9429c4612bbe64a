"""Catalogued upstream bugs, matched exactly: a known bug behaves like a strict xfail.

A bug of ``data/bugs.toml`` that has a *signature* here is predicted, step by step, from
the run's own frames: :func:`known_bug` registers a function that returns, for every
place the clause checks, the value the clause expects and the value the bug would
produce (for the HRRN clock, the stale ``extend_num_tokens`` each launch's batch
carries). A clause whose violations on the run's loop are **exactly** the rows where a
catalogued bug's prediction differs from the expectation, each with the predicted
value, is ``known upstream``: reported in its own section, not a failure unless asked
(``--strict-known``). Anything else stays a plain violation:

- a violation the bug does not predict, or a value other than the predicted one (a
  loop-local bug on the same field that runs ahead by another amount, lags or skips);
- a predicted deviation that did not happen in part (a bug of another shape);
- a run with the bug's fix applied (``fix`` in the catalogue: that patch is in the run's
  patches): the bug cannot be there, so whatever shows is something else.

A bug whose prediction deviates somewhere, where the clause held at every one of those
places, *no longer reproduces* (how ``compare`` reads a diff that fixes an upstream bug).
Catalogued bugs without a signature are reported as plain violations.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import pandas as pd

from contract_lib.contract.base import NOT_EXERCISED, NOT_PRESENT
from contract_lib.patches.catalog import bug as catalogued
from contract_lib.paths import BUG_CATALOG

# Frames -> one row per place the clause checks: field, step, rid (None for a per-step
# field), expected (as the clause writes it), predicted (what the bug gives there).
Prediction = Callable[[object], pd.DataFrame]
PREDICTION_COLUMNS = ["field", "step", "rid", "expected", "predicted"]


@dataclasses.dataclass(frozen=True)
class KnownBug:
    """A catalogued upstream bug with a signature."""

    id: str
    clause: int
    field: str
    loops: tuple[str, ...]  # the loops that show it (the catalogue's ``loops``)
    fix: str | None  # the built-in patch that fixes it (the catalogue's ``fix``)
    predict: Prediction


@dataclasses.dataclass(frozen=True)
class KnownMatch:
    """What a run shows of one catalogued bug."""

    bug: str
    clause: int
    field: str
    reproduced: bool  # True: exactly as catalogued; False: no longer reproduces
    places: int  # rows where the bug's prediction differs from the expectation
    summary: str  # e.g. "+28 where +0 at 12 steps"
    fix_applied: str | None = None  # the bug's fix, when the run applied it

    def line(self) -> str:
        where = f"clause {self.clause} field {self.field}"
        if self.reproduced:
            return (f"{self.bug} ({BUG_CATALOG.parent.name}/{BUG_CATALOG.name}), {where}: "
                    f"reproduced exactly as catalogued: {self.summary}")
        why = f" (its fix, patch {self.fix_applied}, is applied)" if self.fix_applied else ""
        return (f"{self.bug}, {where}: no longer reproduces{why}: the catalogue predicts "
                f"{self.summary}; the clause held there")


SIGNATURES: dict[str, KnownBug] = {}


def known_bug(bug_id: str) -> Callable[[Prediction], Prediction]:
    """Decorator: the decorated function is ``bug_id``'s signature (its clause, field,
    loops and fix are the catalogue's)."""
    def declare(predict: Prediction) -> Prediction:
        entry = catalogued(bug_id)
        SIGNATURES[bug_id] = KnownBug(bug_id, int(entry["clause"]), entry["field"],
                                      tuple(entry.get("loops", ())), entry.get("fix"),
                                      predict)
        return predict
    return declare


def _patches(meta: dict) -> set[str]:
    return set(filter(None, str(meta.get("patch") or "").split("+")))


def _keyed(table: pd.DataFrame, value: str) -> set[tuple]:
    rids = table["rid"].astype(object).where(table["rid"].notna(), None)
    return set(zip(table["field"], table["step"].astype("int64"), rids,
                   table["expected"].astype(str), table[value].astype(str)))


def _summary(deviating: pd.DataFrame) -> str:
    """The predicted deviations in a few words: ``+28 where +0 at 12 steps, ...``."""
    counts = deviating.groupby(["predicted", "expected"], sort=False).size()
    parts = [f"{predicted} where {expected} at {n} step{'s' if n > 1 else ''}"
             for (predicted, expected), n in counts.items()]
    return ", ".join(parts[:3]) + (f" and {len(parts) - 3} more" if len(parts) > 3 else "")


def judge(frames, results: dict) -> tuple[dict[int, list[KnownMatch]], list[KnownMatch]]:
    """The catalogued bugs a run reproduces exactly, per clause (only where they explain
    every violation of that clause), and those that no longer reproduce."""
    known: dict[int, list[KnownMatch]] = {}
    gone: list[KnownMatch] = []
    explained: dict[int, set[tuple]] = {}
    patches = _patches(frames.meta)
    for bug in SIGNATURES.values():
        result = results.get(bug.clause)
        if (frames.loop not in bug.loops or result is None
                or result.status in (NOT_EXERCISED, NOT_PRESENT)):
            continue
        predicted = bug.predict(frames)
        deviating = predicted[predicted["expected"].astype(str)
                              != predicted["predicted"].astype(str)]
        if deviating.empty:
            continue  # nothing in this run for the bug to show
        fix_applied = bug.fix in patches
        wanted = _keyed(deviating, "predicted")
        recorded = _keyed(result.violations, "actual")
        places = {key[:4] for key in recorded}
        match = KnownMatch(bug.id, bug.clause, bug.field, True, len(deviating),
                           _summary(deviating), bug.fix if fix_applied else None)
        if not any(key[:4] in places for key in wanted):
            gone.append(dataclasses.replace(match, reproduced=False))
        elif wanted <= recorded and not fix_applied:
            known.setdefault(bug.clause, []).append(match)
            explained.setdefault(bug.clause, set()).update(wanted)
    # A clause is known upstream only when its bugs explain each of its violations.
    for number in list(known):
        if explained[number] != _keyed(results[number].violations, "actual"):
            del known[number]
    return known, gone


def no_prediction() -> pd.DataFrame:
    return pd.DataFrame(columns=PREDICTION_COLUMNS)
