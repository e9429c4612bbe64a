"""Text tables for notebooks and terminals: clause table, frames around a step, how a
run ended, the catalogued bugs of a clause."""

from __future__ import annotations

import re
import textwrap

import pandas as pd

from contract_lib.contract import Report
from contract_lib.frames import Frames
from contract_lib.views.style import run_label


def report_table(report: Report) -> pd.DataFrame:
    """:meth:`Report.table <contract_lib.contract.Report.table>` for reading: one row per
    clause with its status, violation count and where the first violation is."""
    table = report.table()
    where = [("-" if pd.isna(step) else f"{field} at step {int(step)}"
              + ("" if rid is None or pd.isna(rid) else f", request {rid}"))
             for step, field, rid in zip(table["first_step"], table["first_field"],
                                         table["first_rid"])]
    return pd.DataFrame({"clause": table["clause"].astype(str) + " " + table["name"],
                         "status": table["status"], "violations": table["violations"],
                         "first violation": where})


def text_table(table: pd.DataFrame) -> str:
    """A DataFrame as plain text with text columns left-aligned and numbers
    right-aligned (``DataFrame.to_string`` right-aligns everything)."""
    def cell(value) -> str:
        return "-" if value is None or (not isinstance(value, str) and pd.isna(value)) \
            else str(value)

    columns = list(table.columns)
    cells = [[cell(v) for v in table[c]] for c in columns]
    numeric = [pd.api.types.is_numeric_dtype(table[c]) and not
               pd.api.types.is_bool_dtype(table[c]) for c in columns]
    widths = [max([len(str(c))] + [len(v) for v in col]) for c, col in zip(columns, cells)]
    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, widths, numeric)).rstrip()
    return "\n".join([line([str(c) for c in columns])]
                     + [line(row) for row in zip(*cells)])


def catalog_table(catalog: list[dict]) -> pd.DataFrame:
    """One row per catalogued bug (``bug_catalog()``): its id, clause, field and PRs."""
    return pd.DataFrame([{"bug": b["id"], "clause": b["clause"], "field": b["field"],
                          "upstream": ", ".join(b["prs"])} for b in catalog])


def _card_lines(label: str, text: str) -> list[str]:
    """``label: text`` wrapped at 92 columns, never inside a word or a hyphenated path."""
    return textwrap.wrap(f"{label}: {text}", 92, subsequent_indent="  ",
                         break_on_hyphens=False)


def bug_card(clause: int) -> str:
    """The July bugs of one clause from ``data/bugs.toml``: PRs, symptom, the flags that
    expose it, the releases affected as read and as measured, and how contract_lib
    replays it."""
    from contract_lib.patches.catalog import bug_catalog

    cards = []
    for bug in bug_catalog():
        if bug["clause"] != clause:
            continue
        cards.append("\n".join([
            f"{bug['id']} (clause {bug['clause']}, field {bug['field']}): "
            f"{', '.join(bug['prs'])}",
            *(line for field in ("symptom", "flags", "affected (read)", "measured", "replay")
              for line in _card_lines(field, bug[field.split(" ")[0]])),
        ]))
    return "\n\n".join(cards) or f"no catalogued bug for clause {clause}"


_AROUND_COLUMNS = ["step", "rid", "emitted", "finished", "req_pool_idx", "kv_computed",
                   "seq_len", "kv_committed_len", "kv_allocated_len", "cache_protected_len",
                   "cached_tokens"]


def frames_around(frames: Frames, step: int, *, before: int = 1, after: int = 1,
                  rid: str | None = None) -> pd.DataFrame:
    """The ``requests`` rows of steps ``step - before .. step + after`` (one request's
    when ``rid`` is given), integer columns shown as integers."""
    requests = frames.requests
    mask = requests["step"].between(step - before, step + after)
    if rid is not None:
        mask &= requests["rid"] == rid
    table = requests.loc[mask, _AROUND_COLUMNS].copy()
    for column in _AROUND_COLUMNS[4:]:
        table[column] = table[column].astype("Int64")
    return table.sort_values(["step", "rid"]).reset_index(drop=True)


_FRAME_LINE = re.compile(r'File "(?:[^"]*/)?(sglang/[^"]+)", line (\d+), in (\S+)')


def crash_summary(frames: Frames) -> str:
    """How a run ended: ``finished``, or the error and the SGLang call chain that raised
    it (paths relative to the installed package, so the text is machine-independent)."""
    error = frames.error
    if not error:
        return f"{run_label(frames)}: {frames.status} after {frames.meta['steps']} steps"
    lines = [f"{run_label(frames)}: {frames.status} during {error['phase']} after "
             f"{frames.meta['steps']} steps",
             f"  {error['type']}: {error['message']}"]
    chain = [frame for frame in _FRAME_LINE.findall(error.get("traceback") or "")
             if frame[2] != "wrapper"]
    if chain:
        lines.append("  raised in SGLang code:")
        lines += [f"    {path}:{line} {function}" for path, line, function in chain[-4:]]
    return "\n".join(lines)

