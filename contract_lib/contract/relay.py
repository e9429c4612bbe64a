"""Clause 4, relays published or provably unread (field ``output_tokens_buf``).

Every read of ``future_map.output_tokens_buf`` by ``resolve_forward_inputs`` feeds each
lane (``batch.input_ids``) the value the loop last published to that lane's row for that
request's latest token (published: as the row held it after the stash, and unchanged
since). A loop that never reads the relay satisfies the clause (provably unread).
"""

from __future__ import annotations

import pandas as pd

from contract_lib import loops
from contract_lib.contract.base import ClauseResult, HOLDS, ints, result, violations
from contract_lib.contract.registry import clause
from contract_lib.frames import Frames


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
    reads = frames.relay[frames.relay["event"] == "read"]
    if reads.empty:
        return ClauseResult(4, HOLDS, f"relay never read over {_decode_launches(frames)} "
                            "decode/mixed launches (provably unread)", violations(4, loop, []))
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
    note = f"{len(reads)} relay reads checked"
    return result(4, loop, rows, note)
