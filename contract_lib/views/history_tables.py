"""The contract's history, bug by bug: per-release tables of the runs that show each
July bug (notebook 12), every number read from the runs."""

from __future__ import annotations

import re

import pandas as pd

from contract_lib.campaigns.history import KV_POOL, history_cells
from contract_lib.campaigns.status import KNOWN_UPSTREAM, ReleasesStatus
from contract_lib.contract import MASKED, VIOLATED, check, kv_damage
from contract_lib.frames import Frames
from contract_lib.sources.versions import release_spans

Runs = dict[str, Frames]  # release -> one run of it


def _count(frames: Frames, clause: int, field: str) -> int:
    found = check(frames).clauses[clause].violations
    return int((found["field"] == field).sum())


def stamp_history(runs: Runs) -> pd.DataFrame:
    """Clause 3 per release: launches, ``forward_ct`` at the end, launches that did not
    see it advanced by one at launch, launches processed without their ``forward_iter``
    stamp, launches whose ``after_idle_gap`` was wrong (``-``: the release has no such
    field), and the clause's status."""
    rows = []
    for version, frames in runs.items():
        report = check(frames)
        rows.append({
            "release": version, "launches": len(frames.launches),
            "forward_ct at the end": int(frames.steps["forward_ct"].iloc[-1]),
            "forward_ct not advanced at launch": _count(frames, 3, "forward_ct"),
            "forward_iter not stamped": _count(frames, 3, "forward_iter"),
            "after_idle_gap wrong": ("-" if "after_idle_gap" in frames.absent
                                     else str(_count(frames, 3, "after_idle_gap"))),
            "clause 3": report.clauses[3].status})
    return pd.DataFrame(rows)


def kv_history(real: Runs, model_free: Runs) -> pd.DataFrame:
    """Clause 1's reader per release, with the real MlxModelRunner: positions whose KV was
    written through slot 0 or into another live request's slots, radix-matched slots
    left zero or wrong at the end; the pool's verdict with either runner; and the requests
    whose tokens differ from the newest release's (the real runner's)."""
    newest = real[list(real)[-1]].output_tokens()
    rows = []
    for version, frames in real.items():
        table = kv_damage.summary_table(frames)
        tokens = frames.output_tokens()
        rows.append({
            "release": version,
            "into slot 0": int(table["into slot 0"].sum()),
            "into another live request": int(table["into another live request"].sum()),
            "radix-matched zero": int(table["zero"].sum()),
            "radix-matched wrong": int(table["wrong"].sum()),
            "real runner": "damaged" if kv_damage.damaged(frames) else "intact",
            "model-free runner": "damaged" if kv_damage.damaged(model_free[version])
            else "intact",
            "tokens unlike the newest's": ", ".join(
                rid for rid in tokens if tokens[rid] != newest.get(rid)) or "-"})
    return pd.DataFrame(rows)


def shutdown_history(runs: dict[str, Runs]) -> pd.DataFrame:
    """The graceful exit per release (``runs``: loop -> release -> the run in which
    ``gracefully_exit`` was set after the third result): how each loop's run ended and
    after how many steps."""
    rows = {}
    for loop, by_release in runs.items():
        for version, frames in by_release.items():
            ended = ("returned" if frames.error and "loop returned without finishing"
                     in frames.error["message"] else frames.status)
            rows.setdefault(version, {"release": version})[loop] = (
                f"{ended} after {frames.meta['steps']} steps")
    return pd.DataFrame(list(rows.values()))


def _last_parts(fields: str) -> set[str]:
    """``tp_worker._mlx_runner._req_caches, seq_lens`` -> {``_req_caches``, ``seq_lens``}."""
    return {field.rsplit(".", 1)[-1] for field in fields.split(", ") if field}


def _spans(cells: pd.DataFrame, mask: pd.Series) -> str:
    return release_spans(list(dict.fromkeys(cells.loc[mask, "sglang"]))) or "none"


def read_against_measured(bugs: list[dict], result: ReleasesStatus,
                          real: ReleasesStatus, shutdown: Runs) -> pd.DataFrame:
    """Each catalogued bug: the releases affected as read (``data/bugs.toml``) beside the
    releases whose saved runs show it: a field it names (its last dotted part) violated
    in its clause on its first loop (``loops``, else mlx); for clause 1's reader, the
    real runner's KV pool damaged; for the graceful exit, the MLX run that went on after
    ``gracefully_exit`` was set."""
    cells, pool = history_cells(result), history_cells(real)
    red = cells["status"].isin([VIOLATED, MASKED, KNOWN_UPSTREAM])
    rows = []
    for bug in bugs:
        loop = bug.get("loops", ["mlx"])[0]
        names = set(re.findall(r"\w+", bug["field"]))
        shown = (cells["loop"] == loop) & (cells["clause"] == bug["clause"]) & red \
            & cells["fields"].map(lambda f: bool(names & _last_parts(f)))
        measured = _spans(cells, shown)
        if bug["id"] == "decode-kv-slots":
            damaged = (pool["clause"] == KV_POOL) & (pool["status"] == "damaged")
            measured = f"{measured}; KV pool damaged: {_spans(pool, damaged)}"
        if bug["id"] == "graceful-exit":
            measured = release_spans([v for v, f in shutdown.items()
                                      if f.status == "finished"]) or "none"
        rows.append({"bug": bug["id"], "clause": bug["clause"], "loop": loop,
                     "read (affected)": bug["affected"], "red in the saved runs": measured})
    return pd.DataFrame(rows)
