"""The contract's history: several releases' clause tables read as one view
(``status --sglang 0.5.14..0.5.23``), a block per loop with a row per release and a
column per clause, the fields each clause violated on which releases, and the fields a
release does not have."""

from __future__ import annotations

import textwrap
from typing import Callable, Iterable

import pandas as pd

from contract_lib import loops as registry
from contract_lib.campaigns.status import (
    KNOWN_UPSTREAM,
    KV_POOL_NOTE,
    POOL_NOTE,
    ReleasesStatus,
    Status,
    worst_cell,
)
from contract_lib.contract import CLAUSES, MASKED, VIOLATED
from contract_lib.sources.versions import release_spans

# More releases than this print as a history (:func:`history_text`): side by side
# (:meth:`ReleasesStatus.text`), each release is a column ~24 characters wide.
SIDE_BY_SIDE_MAX = 3
WIDTH = 100  # notes and field lists wrap here
KV_POOL, POOL = "KV pool", "pool conservation"
CELL_COLUMNS = ["loop", "clause", "sglang", "status", "count", "total", "fields"]


def release_label(status: Status) -> str:
    """A column's release: its version, or the venv's SGLang's (``sglang`` None)."""
    if status.sglang is not None:
        return status.sglang
    versions = {r.meta["sglang_version"] for r in status.reports.values()}
    return versions.pop() if len(versions) == 1 else "venv"


def _fields(status: Status, loop: str, number: int) -> str:
    """The fields ``number`` violated on ``loop`` over the runs (sorted, comma-separated)."""
    found = set()
    for (_, run_loop), report in status.reports.items():
        result = report.clauses.get(number)
        if run_loop == loop and result is not None and result.status in (VIOLATED, MASKED):
            found.update(str(field) for field in result.violations["field"].dropna())
    return ", ".join(sorted(found))


def history_cells(result: ReleasesStatus) -> pd.DataFrame:
    """One row per (loop, clause, release): the worst status over the workloads, in how
    many runs it shows and of how many, and the fields violated; and as clauses
    ``pool conservation`` (SGLang's law: ``leak`` / ``balanced``, where a run of any
    release leaked) and ``KV pool`` (the MLX KV pool: ``damaged`` / ``intact``)."""
    rows = []
    pooled = any(status.shows_pool_row() for status in result.statuses)
    for status in result.statuses:
        version = release_label(status)
        per_run = status.per_run()
        for (loop, number), cell in per_run.groupby(["loop", "clause"], sort=False):
            worst, count, total = worst_cell(cell)
            rows.append({"loop": loop, "clause": number, "sglang": version, "status": worst,
                         "count": count, "total": total,
                         "fields": _fields(status, loop, number)})
        for loop in dict.fromkeys(per_run["loop"]):
            extra = {POOL: status.pool_cell(loop) if pooled else None,
                     KV_POOL: status.kv_cell(loop)}
            rows += [{"loop": loop, "clause": name, "sglang": version, "status": cell[0],
                      "count": cell[1], "total": cell[2], "fields": ""}
                     for name, cell in extra.items() if cell is not None]
    cells = pd.DataFrame(rows, columns=CELL_COLUMNS)
    order = {name: i for i, name in enumerate(registry.names())}
    return cells.sort_values("loop", key=lambda s: s.map(order), kind="stable") \
        .reset_index(drop=True)


def _block(cells: pd.DataFrame, loop: str) -> list[str]:
    """One loop's rows: a release per row, a clause per column (``status n/m``)."""
    mine = cells[cells["loop"] == loop]
    clauses = list(dict.fromkeys(mine["clause"]))
    releases = list(dict.fromkeys(mine["sglang"]))
    text = {(c, v): f"{s} {n}/{m}" for c, v, s, n, m in
            mine[["clause", "sglang", "status", "count", "total"]].itertuples(index=False)}
    heads = [str(c) for c in clauses]
    widths = [max([len(h)] + [len(text.get((c, v), "-")) for v in releases])
              for c, h in zip(clauses, heads)]
    first = max(len("release"), *(len(v) for v in releases))
    lines = [f"loop {loop}", "  ".join(["release".ljust(first)]
                                       + [h.ljust(w) for h, w in zip(heads, widths)])]
    for version in releases:
        lines.append("  ".join([version.ljust(first)] + [
            text.get((c, version), "-").ljust(w) for c, w in zip(clauses, widths)]))
    for number in clauses:
        by_fields: dict[str, list[str]] = {}
        for version, fields in mine[(mine["clause"] == number) & (mine["fields"] != "")][
                ["sglang", "fields"]].itertuples(index=False):
            by_fields.setdefault(fields, []).append(version)
        if by_fields:
            lines += textwrap.wrap(f"clause {number} violated " + "; ".join(
                f"{fields} ({release_spans(versions)})"
                for fields, versions in by_fields.items()), WIDTH,
                initial_indent="  ", subsequent_indent="    ", break_on_hyphens=False)
    return lines


def _by_release(result: ReleasesStatus,
                items: Callable[[Status], Iterable[tuple]]) -> dict[tuple, list[str]]:
    """``items(status)``'s tuples over the releases, each with the releases it shows on
    (its text's ``sglang <release>`` read as ``the release``, so one line covers many)."""
    grouped: dict[tuple, list[str]] = {}
    for status in result.statuses:
        version = release_label(status)
        for item in items(status):
            key = tuple(part.replace(f"sglang {version}", "the release")
                        if isinstance(part, str) else part for part in item)
            grouped.setdefault(key, []).append(version)
    return grouped


def _notes(result: ReleasesStatus) -> list[str]:
    """A line per field some releases do not have (not checked there, and why), and per
    run that did not earn its clause statuses (refused, failed, vacuous)."""
    absent = _by_release(result, Status.absent)
    fates = _by_release(result, Status.runs_not_finished)
    return ([f"(not present in {release_spans(v)}, not checked: clause {number} {name}: "
             f"{why})" for (number, name, why), v in absent.items()]
            + [f"run {workload} on {loop} ({release_spans(v)}): {state}"
               for (workload, loop, state), v in fates.items()])


def history_text(result: ReleasesStatus) -> str:
    """The releases' tables as a history: a block per loop, a row per release, a column
    per clause; under each block, the fields each clause violated on which releases; then
    the notes (what the cells mean, fields a release does not have, runs that did not
    earn their statuses)."""
    cells = history_cells(result)
    runner = result.statuses[0].runner
    lines = _wrapped(["clauses: " + ", ".join(f"{n} {name}" for n, name in CLAUSES.items())
                      + ("; MLX with the real MlxModelRunner" if runner == "real" else "")])
    for loop in dict.fromkeys(cells["loop"]):
        lines += ["", *_block(cells, loop)]
    notes = ["(worst status over the workloads, n/m: in how many of them it shows)"]
    if (cells["status"] == KNOWN_UPSTREAM).any():
        notes.append(f"({KNOWN_UPSTREAM} = violated exactly as a catalogued upstream bug "
                     "predicts, see data/bugs.toml; not a failure unless --strict-known)")
    if (cells["clause"] == POOL).any():
        notes.append(POOL_NOTE)
    if (cells["clause"] == KV_POOL).any():
        notes.append(KV_POOL_NOTE)
    lines += ["", *_wrapped(notes + _notes(result))]
    return "\n".join(line.rstrip() for line in lines)


def _wrapped(lines: list[str]) -> list[str]:
    return [part for line in lines for part in textwrap.wrap(
        line, WIDTH, subsequent_indent="  ", break_on_hyphens=False)]
