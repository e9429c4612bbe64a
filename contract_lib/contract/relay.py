"""Clause 4, relays published or provably unread (field ``output_tokens_buf``).

Every read of ``future_map.output_tokens_buf`` by ``resolve_forward_inputs`` feeds each
lane (``batch.input_ids``) the value the loop last published to that lane's row for that
request's latest token (published: as the row held it after the stash, and unchanged
since). A loop that never reads the relay satisfies the clause (provably unread). And
where the torch forward recorded what it was fed (``fed`` rows: each decode lane's
input id, read at the forward), a decode lane no recorded read fed must still get its
request's latest token: a read the hooks do not see (an inlined gather, a reader
reached another way) is not "unread".
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from contract_lib import loops
from contract_lib.contract.base import HOLDS, ClauseResult, ints, no_rows, result, violations
from contract_lib.contract.registry import clause
from contract_lib.frames import Frames

_NO_ROWS = no_rows(field="str", step="int64", launch="int64", rid="str", expected="str",
                   actual="str", explanation="str")


def _published(value) -> str:
    return "nothing" if pd.isna(value) else str(int(value))


def _decode_launches(frames: Frames) -> int:
    return int(frames.launches["mode"].isin(["decode", "mixed"]).sum())


def _no_decode(frames: Frames) -> str | None:
    reads = frames.relay[frames.relay["event"] == "read"]
    if reads.empty and _decode_launches(frames) == 0:
        return "no decode or mixed batch was launched"
    return None


@clause(4, "relays published or provably unread", fields=("output_tokens_buf",),
        audit_fields=("output_tokens_buf[]", "new_seq_lens_buf[]"),
        readers=("resolve_forward_inputs (decode gather; the decode lanes of a mixed "
                 "batch)",),
        unexercised=_no_decode)
def check_relay(frames: Frames) -> ClauseResult:
    loop = frames.loop
    relay = frames.relay
    event = relay["event"].to_numpy(dtype=object)
    published = relay["published_for_rid"].to_numpy().astype(bool)
    read, unread = event == "read", _fed_unread(relay, event)
    wrong = unread & ~published
    if not read.any() and not wrong.any():
        fed = f"; {unread.sum()} decode lanes fed their latest token" if unread.any() else ""
        return ClauseResult(4, HOLDS, f"relay never read over {_decode_launches(frames)} "
                            f"decode/mixed launches (provably unread){fed}",
                            violations(4, loop, []))
    note = f"{read.sum()} relay reads checked"
    if unread.any():
        note += f", {unread.sum()} decode lanes fed without one"
    if not (read & ~published).any() and not wrong.any():
        return result(4, loop, _NO_ROWS, note)
    reads = relay[read]
    bad = reads[~reads["published_for_rid"].astype(bool)]
    fate = pd.Series("became the decode input id of the forward", index=bad.index)
    mixed_fate = ("reached batch.input_ids of a mixed batch (torch.cat with the prefill ids; "
                  "on MPS this is the #32591 segfault)")
    if loops.known(loop).mlx:
        mixed_fate += ("; the MLX decode lane then takes its token from the runner, so the "
                       "model discarded the value")
    fate = fate.where(bad["kind"] != "mixed", mixed_fate)
    written = pd.Series("stale", index=bad.index).where(bad["value"] != -1, "never written")
    rows = pd.DataFrame({
        "field": "output_tokens_buf", "step": bad["step"].astype("int64"),
        "launch": bad["launch"], "rid": bad["rid"],
        "expected": "the token last published for this request",
        "actual": ints(bad["value"]) + " (" + written + ")",
        "explanation": "row " + ints(bad["row"]) + " (last published: "
                       + bad["last_published"].map(_published) + ") read unpublished; "
                       "the value " + fate})
    if wrong.any():
        rows = pd.concat([rows, _fed_violations(relay[wrong])], ignore_index=True).sort_values(
            ["step", "launch"], kind="stable")
    return result(4, loop, rows, note)


def _fed_violations(wrong: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({
        "field": "output_tokens_buf", "step": wrong["step"].astype("int64"),
        "launch": wrong["launch"], "rid": wrong["rid"],
        "expected": "the request's latest token " + wrong["last_published"].map(_published),
        "actual": ints(wrong["value"]) + " (fed, no recorded read)",
        "explanation": "the forward's decode input id, filled without a read the hooks "
                       "recorded (a gather around resolve_forward_inputs), is not the "
                       "request's latest token: the model decodes from another token"})


def _fed_unread(relay: pd.DataFrame, event: np.ndarray) -> np.ndarray:
    """Which rows are ``fed`` rows (a decode lane's input id at the forward) of lanes no
    recorded read fed: those the read check does not already cover."""
    fed = event == "fed"
    if not fed.any():
        return fed
    launches, rids = relay["launch"].to_numpy(), relay["rid"].to_numpy()
    read = event == "read"
    lanes_read = set(zip(launches[read].tolist(), rids[read].tolist()))
    unread = fed.copy()
    unread[fed] = [lane not in lanes_read for lane in
                   zip(launches[fed].tolist(), rids[fed].tolist())]
    return unread
