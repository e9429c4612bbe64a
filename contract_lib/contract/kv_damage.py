"""The MLX KV pool's verdict, read off a run's frames (``kv_syncs``, ``kv_pool``): was KV
written through slot 0 or into another live request's slots, or a radix-matched slot left
zero or wrong? Recorded in the run's process by :mod:`contract_lib.child.kvpool`; judged
here, beside the clauses (a damaged pool fails a run like a violated clause)."""

from __future__ import annotations

import pandas as pd

from contract_lib.frames import KV_VERDICTS


def summary_table(frames) -> pd.DataFrame:
    """One row per request: the positions its KV was written to through slot 0 or into
    another live request's slots, the positions a clamped release dropped, and the
    ``kv_pool`` verdicts of the slots the radix tree serves for it at the end."""
    syncs, pool = frames.kv_syncs, frames.kv_pool
    written = syncs[syncs["kind"] != "dropped"]
    rows = []
    for rid in dict.fromkeys(list(frames.requests["rid"])):
        mine = written[written["rid"] == rid]
        verdicts = pool[pool["rid"] == rid]["verdict"].value_counts()
        rows.append({
            "rid": rid,
            "written": len(mine),
            "into slot 0": int((mine["target"] == "slot 0").sum()),
            "into another live request": int((mine["target"] == "other live request").sum()),
            "dropped": int(((syncs["rid"] == rid) & (syncs["kind"] == "dropped")).sum()),
            "radix-matched": int(verdicts.sum()),
            **{verdict: int(verdicts.get(verdict, 0)) for verdict in KV_VERDICTS},
        })
    return pd.DataFrame(rows)


def damaged(frames) -> bool:
    """True when an MLX run (either runner) wrote KV through slot 0 or into another live
    request's slots, or left a radix-matched slot zero or wrong."""
    syncs, pool = frames.kv_syncs, frames.kv_pool
    written = syncs[syncs["kind"] != "dropped"]
    return bool(written["target"].isin(["slot 0", "other live request"]).any()
                or (pool["verdict"] != "ok").any())


def kv_verdict(frames) -> bool | None:
    """A run's KV pool verdict for tables: True damaged, False intact, None when the run
    earned none (it did not finish and shows no damage: a set-up it refused, a crash
    before the pool was written). Damage is evidence from any run; intact only from a
    finished one."""
    if damaged(frames):
        return True
    return False if frames.status == "finished" else None


def kv_rows(tables: list[dict], real: bool) -> list[dict]:
    """The KV pool row of clause tables shown side by side (``tables``: per table, key ->
    Frames, keys ending in the loop): per table, key -> damaged over its MLX runs that
    earned a verdict. Always for the real runner; for the model-free one only when a run
    of any table was damaged (its pool is a stand-in, said when it finds something)."""
    from contract_lib import loops

    rows = [{key: bad for key, frames in runs.items()
             if loops.spec(key[-1]).mlx and (bad := kv_verdict(frames)) is not None}
            for runs in tables]
    if real or any(any(row.values()) for row in rows):
        return rows
    return [{} for _ in rows]


def pool_table(frames) -> str:
    """:func:`summary_table` as text, with the slot-0 state, for terminals."""
    table = summary_table(frames)
    pool = frames.meta.get("kv_pool") or {}
    against = ("the contents a correct run computes" if pool.get("model") == "model-free"
               else "mlx-lm's KV")
    head = ("MLX attention KV pool: writes per request (prefill, release, flush, remove) "
            f"and, at the end, the radix-matched slots against {against}; padding slot 0 "
            + ("holds KV" if pool.get("slot0_nonzero") else "is untouched"))
    return head + "\n" + table.to_string(index=False)
