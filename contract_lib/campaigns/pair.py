"""A pair run: one workload through a PD-disaggregation prefill side, then through a decode
side that receives the requests already prefilled, against ``event_loop_normal``.

The two sides are two runs (two Schedulers, as a PD deployment has two servers) on
SGLang's fake KV transfer backend, which completes a transfer at once and moves nothing.
What connects them, and what does not:

- **shared**: the requests (id, prompt, sampling; the same bootstrap room on both sides,
  the order each side was fed them) and each **hand-off token**: the decode side's first
  token is the token the prefill run emitted for the request (its prefill's sample, what
  a real transfer carries in its metadata buffer). It reaches the decode run as the
  workload's scripted first token (``emit = {0 = token}``), which the decode side's
  hand-off shim commits (:mod:`contract_lib.child.shims.disaggregation`); a prefill side
  that emits another first token is continued from by the decode side.
- **not shared**: the KV (both caches are zero-byte; the decode side's prompt slots are
  its own preallocation, which clause 1 reads as the transfer's write); the prefill
  side's ``cached_tokens`` (the fake receiver leaves the metadata buffer unread: the
  decode side reports 0); the clock (each side steps on its own: the decode side receives
  a request at its arrival step and the fake transfer completes at once, whether or not
  the prefill side has handed it off yet).

A request the prefill side did not hand off (aborted first) still reaches the decode side,
as a router sends it to both; it has no hand-off token to carry (:meth:`Pair.text` names
it). The pair's verdict is the worse of the two sides' (:meth:`Report.verdict
<contract_lib.contract.Report.verdict>`) and, for every request that finished on the
decode side and on ``event_loop_normal``, equal tokens (:func:`same_tokens`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pandas as pd

from contract_lib import loops
from contract_lib.contract import Report, check
from contract_lib.contract.outputs import same_tokens
from contract_lib.frames import Frames
from contract_lib.patches.builtin import PatchArg, patch_spec
from contract_lib.runs.harness import frames_or_raise, run, run_many
from contract_lib.runs.loop_choice import runnable
from contract_lib.verdict import Outcome, Verdict, setup_failed, worst
from contract_lib.workloads import RequestSpec, Workload, load_workload

PREFILL_LOOP, DECODE_LOOP = "disagg-prefill-normal", "disagg-decode-overlap"
REFERENCE = loops.reference_names()[0]  # event_loop_normal
SIDES = ("prefill", "decode")
SHARED = ("shared: the requests and each hand-off token (the prefill side's first token is "
          "the decode side's first); not shared: the KV (the fake transfer moves none), "
          "the prefill side's cached_tokens (the decode side reads 0), the clock (each side "
          "steps on its own)")


@dataclasses.dataclass
class Pair:
    """The two sides' runs of one workload, ``event_loop_normal``'s, and their checks."""

    workload: Workload
    prefill: Frames
    decode: Frames | None  # None: the prefill side did not finish, nothing to hand off
    normal: Frames
    reports: dict[str, Report]  # by side

    def handoffs(self) -> dict[str, int]:
        """Each request the prefill side handed off: its first token (the hand-off)."""
        ends = _last_rows(self.prefill)
        return {rid: tokens[0] for rid, tokens in self.prefill.output_tokens().items()
                if tokens and ends.at[rid, "finish_reason"] == "length"}

    def mismatches(self) -> dict[str, tuple[list[int], list[int]]]:
        """Requests that finished on the decode side and on ``event_loop_normal`` with
        other tokens: rid -> (the pair's, normal's)."""
        if self.decode is None or self.normal.status != "finished":
            return {}
        ours, theirs = self.decode.output_tokens(), self.normal.output_tokens()
        return {rid: (ours.get(rid, []), theirs.get(rid, []))
                for rid, same in same_tokens(self.decode, self.normal).items() if not same}

    def verdict(self) -> Verdict:
        """The worse of the two sides' verdicts, and unequal tokens as a violation."""
        if setup_failed(self.prefill.meta) or self.decode is None:
            found = self.reports["prefill"].verdict()
            why = "failed in set-up" if setup_failed(self.prefill.meta) else (
                f"{self.prefill.status}: nothing was handed off")
            return Verdict(found.outcome if found.outcome != Outcome.PASS
                           else Outcome.NOT_FINISHED, f"the prefill side {why} "
                           f"({found.reason})")
        sides = {side: self.reports[side].verdict() for side in SIDES}
        outcomes = [v.outcome for v in sides.values()]
        parts = [f"{side} side {v.outcome.label}" for side, v in sides.items()]
        wrong = self.mismatches()
        if self.normal.status != "finished":
            outcomes.append(Outcome.NOT_FINISHED)
            parts.append(f"event_loop_normal's run {self.normal.status}: no tokens compared")
        elif wrong:
            outcomes.append(Outcome.VIOLATED)
            rid, (ours, theirs) = next(iter(wrong.items()))
            parts.append(f"{len(wrong)} request(s) emit other tokens than event_loop_normal "
                         f"(first: {rid}: {ours}, normal {theirs})")
        else:
            compared = len(same_tokens(self.decode, self.normal))
            parts.append(f"{compared} finished request(s) emit event_loop_normal's tokens")
        reasons = [f"{side}: {v.reason}" for side, v in sides.items()
                   if v.outcome != Outcome.PASS]
        return Verdict(worst(outcomes), "; ".join(parts + reasons))

    def requests(self) -> pd.DataFrame:
        """One row per request: its hand-off (prefill step and token), its admission on
        the decode side, how it ended there, and whether its tokens are normal's."""
        handed = self.handoffs()
        ends = _last_rows(self.prefill)
        if self.decode is not None:
            last, emitted = _last_rows(self.decode), self.decode.output_tokens()
        rows = []
        for spec in self.workload.requests:
            row = {"rid": spec.rid, "prompt": len(spec.prompt),
                   "handed off at": _first_step(self.prefill, spec.rid, finished=True)
                   if spec.rid in handed else None,
                   "hand-off token": handed.get(spec.rid),
                   "prefill end": ends.at[spec.rid, "finish_reason"]
                   if spec.rid in ends.index else None}
            if self.decode is not None:
                admitted = self.decode.prebuilt[self.decode.prebuilt["rid"] == spec.rid]
                row["admitted at"] = int(admitted["step"].min()) if len(admitted) else None
                row["decode end"] = (last.at[spec.rid, "finish_reason"]
                                     if spec.rid in last.index else None)
                row["ended at"] = _first_step(self.decode, spec.rid, finished=True)
                row["tokens"] = len(emitted.get(spec.rid, []))
            rows.append(row)
        table = pd.DataFrame(rows, dtype=object)
        if self.decode is not None:
            same = same_tokens(self.decode, self.normal) if self.normal.status == "finished" \
                else {}
            table["normal's tokens"] = table["rid"].map(
                lambda rid: {True: "yes", False: "NO"}.get(same.get(rid), "-"))
        return table

    def journey(self, rid: str) -> pd.DataFrame:
        """One request across both sides, step by step: its state at each step boundary
        (``emitted``, ``kv_computed``, ``seq_len``, how it ended) and what the iteration
        from that boundary did to it (``then``: its launch and the token produced, the
        prebuilt batch that admitted it with the hand-off token)."""
        if rid not in {r.rid for r in self.workload.requests}:
            raise ValueError(f"request {rid!r} is not in workload {self.workload.name!r} "
                             f"(requests: {', '.join(r.rid for r in self.workload.requests)})")
        parts = [_side_journey(frames, side, rid) for side, frames in
                 (("prefill", self.prefill), ("decode", self.decode)) if frames is not None]
        return pd.concat(parts, ignore_index=True)

    def text(self) -> str:
        """The summary, one table per request across both sides, and the verdict."""
        lines = [f"pair {self.workload.name}: {self.prefill.loop} hands off, "
                 + (f"{self.decode.loop} decodes" if self.decode is not None
                    else "no decode side") + f" (sglang {self.prefill.meta['sglang_version']})",
                 SHARED, ""]
        for side in SIDES:
            if side in self.reports:
                lines.append(f"{side} side: {self.reports[side].verdict().line()}")
        requests = self.requests()
        lines += ["", _left(requests)]
        missing = [r.rid for r in self.workload.requests if r.rid not in self.handoffs()]
        if missing and self.decode is not None:
            lines.append(f"not handed off by the prefill side (no hand-off token to carry): "
                         f"{', '.join(missing)}")
        for spec in self.workload.requests:
            lines += ["", f"request {spec.rid}", _left(self.journey(spec.rid))]
        lines += ["", self.verdict().line()]
        return "\n".join(lines)


def decode_workload(workload: Workload, handoffs: dict[str, int]) -> Workload:
    """``workload`` as the decode side receives it: each handed-off request's first
    output token scripted to its hand-off token (the prefill side's sample)."""
    def carried(spec: RequestSpec) -> RequestSpec:
        if spec.rid not in handoffs:
            return spec
        emit = dict(spec.emit)
        emit[0] = handoffs[spec.rid]
        return dataclasses.replace(spec, emit=tuple(sorted(emit.items())))

    return dataclasses.replace(workload, requests=tuple(map(carried, workload.requests)))


def pair(workload: str | Path | Workload, prefill: str = PREFILL_LOOP,
         decode: str = DECODE_LOOP, *, patch: PatchArg = None, clauses: str = "all",
         strict_known: bool = False, cache: bool = True, warm: bool = True,
         sglang: str | Path | None = None, diff: list[str | Path] | None = None,
         progress: bool = False) -> Pair:
    """Run ``workload`` through the ``prefill`` side and ``event_loop_normal`` (in
    parallel), then the requests the prefill side handed off through the ``decode``
    side; ``patch`` applies to both sides. Bad loops or input raise their one-line
    set-up error before any run."""
    runnable([prefill], role=loops.PREFILL)
    runnable([decode], role=loops.DECODE)
    spec = patch_spec(patch)
    if not isinstance(workload, Workload):
        workload = load_workload(workload)
    common = {"cache": cache, "warm": warm, "sglang": sglang, "diff": diff}
    first, normal = frames_or_raise(run_many(
        [{"workload": workload, "loop": prefill, "patch": spec, **common},
         {"workload": workload, "loop": REFERENCE, **common}], progress=progress))
    reports = {"prefill": check(first, clauses, strict_known)}
    result = Pair(workload, first, None, normal, reports)
    if first.status != "finished":
        return result
    second = run(decode_workload(workload, result.handoffs()), decode, patch=spec, **common)
    reports["decode"] = check(second, clauses, strict_known)
    return dataclasses.replace(result, decode=second)


def _last_rows(frames: Frames) -> pd.DataFrame:
    """Each request's last ``requests`` row, by request id."""
    return frames.requests.drop_duplicates("rid", keep="last").set_index("rid")


def _first_step(frames: Frames, rid: str, finished: bool) -> int | None:
    rows = frames.requests[(frames.requests["rid"] == rid)
                           & (frames.requests["finished"].astype(bool) == finished)]
    return int(rows["step"].min()) if len(rows) else None


def _side_journey(frames: Frames, side: str, rid: str) -> pd.DataFrame:
    """One side's rows of :meth:`Pair.journey`: from the step the request was fed (it
    shows from the next boundary on) to the first boundary that shows it ended."""
    rows = frames.requests[frames.requests["rid"] == rid].sort_values("step")
    ended = rows[rows["finished"].astype(bool)]
    if len(ended):
        rows = rows[rows["step"] <= int(ended["step"].min())]
    then: dict[int, list[str]] = {}
    if len(rows):  # fed at the boundary before the first that shows it
        then[int(rows["step"].min()) - 1] = ["arrives"]
    for launch in frames.launches.sort_values("launch").itertuples(index=False):
        lanes = str(launch.rids).split(",")
        if rid not in lanes:
            continue
        tokens = str(launch.tokens).split(",") if isinstance(launch.tokens, str) else []
        token = tokens[lanes.index(rid)] if len(tokens) == len(lanes) else ""
        then.setdefault(int(launch.step), []).append(
            f"{launch.mode} launch" + (f" -> {token}" if token else ""))
    for admitted in frames.prebuilt[frames.prebuilt["rid"] == rid].itertuples(index=False):
        what = "hand-off" if admitted.transfer else "restored"
        events = then.setdefault(int(admitted.step), [])
        events.insert(len(events[:1]) if events[:1] == ["arrives"] else 0,
                      f"prebuilt batch: {what} token {int(admitted.token)}")
    state = rows.set_index("step")
    last = int(rows["step"].max()) if len(rows) else max(then, default=-1)
    steps = sorted({*state.index.astype(int), *(s for s in then if s <= last)})
    return pd.DataFrame({
        "side": side, "step": steps,
        "emitted": [_cell(state, step, "emitted") for step in steps],
        "kv_computed": [_cell(state, step, "kv_computed") for step in steps],
        "seq_len": [_cell(state, step, "seq_len") for step in steps],
        "ended": [state.at[step, "finish_reason"] if step in state.index
                  and state.at[step, "finished"] else "" for step in steps],
        "then": ["; ".join(then.get(step, [])) for step in steps]})


def _cell(state: pd.DataFrame, step: int, column: str) -> str:
    """A request's ``column`` at ``step`` as text (``-``: not known then, or None)."""
    return "-" if step not in state.index else _int(state.at[step, column])


def _int(value) -> str:
    return "-" if pd.isna(value) else str(int(value))


def _left(table: pd.DataFrame) -> str:
    """A table as left-aligned text columns (None as ``-``)."""
    cells = [[str(c) for c in table]] + [["-" if pd.isna(v) else str(v) for v in row]
                                          for row in table.itertuples(index=False)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(table.columns))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip()
                     for row in cells)
