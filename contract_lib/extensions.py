"""This project's extensions of the per-step contract, beyond RFC #32833's five clauses.

The RFC's clauses stay the RFC's (:mod:`contract_lib.contract`); what this module adds
came from the differential effects audit (:mod:`contract_lib.audit`) and from the
readers of state a replacement loop owns (``docs/contract.md`` names them with file and
line in SGLang 0.5.23):

- Clause 2 gains ``Req.decode_batch_idx``: the number of decode steps a request has
  made since its last prefill/extend lane (read by SWA eviction, the SWA retain window
  and mamba tracking). Expected: ``kv_computed - kv_prefilled`` (every decode launch
  computes exactly one position of each of its requests).
6. **Scheduling clocks advanced** (field ``processed_tokens_counter``). Between two step
   boundaries the HRRN policy's clock advances by exactly the tokens the launches of that
   iteration prefilled (the prefill lanes' ``extend_lens``; decode lanes, decode and
   chained launches prefill none).
7. **Request state retired** (the backend's per-request structures, table
   ``backend_state``). A request the scheduler released (finished, aborted or retracted:
   it holds no ``req_to_token`` row) has no backend state left once a launch that
   follows its release has completed, nor at a step where the loop is idle; and no
   backend state exists for a request the scheduler does not hold, nor one that maps a
   held request to another row than the scheduler's.

Clause sets: ``"rfc"`` (the five as the RFC states them) and ``"all"`` (the default:
the five, clause 2 with ``decode_batch_idx``, and 6 and 7).
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from contract_lib.frames import Frames

RFC = "RFC #32833"
EXTENSIONS = "this project's extensions"
CLAUSE_SETS = ("all", "rfc")

EXTENSION_CLAUSES: dict[int, str] = {
    6: "scheduling clocks advanced",
    7: "request state retired",
}
# The fields an extension adds to an RFC clause.
EXTENDED_FIELDS: dict[int, list[str]] = {2: ["decode_batch_idx"]}

# The bug a reference loop's violation of a clause is, when every violation has the
# catalogued signature (``data/bugs.toml``; see :func:`sglang_finding`).
SGLANG_WIDE = {6: "processed-tokens-counter"}


def _contract():
    from contract_lib import contract  # the RFC module imports this one at its end

    return contract


# -- clause 2: decode_batch_idx ---------------------------------------------------------------


def check_counters_extended(frames: Frames):
    """Clause 2 with ``decode_batch_idx`` added to the RFC's three counters."""
    c = _contract()
    base = c.check_counters(frames)
    requests = frames.requests
    if base.status == c.NOT_EXERCISED or "decode_batch_idx" not in requests:
        return base
    live = requests[c.live_mask(requests) & requests["decode_batch_idx"].notna()
                    & requests["kv_prefilled"].notna()]
    if live.empty:
        return c.ClauseResult(2, base.status, base.note + "; decode_batch_idx not recorded "
                              "by this SGLang", base.violations)
    expected = (live["kv_computed"] - live["kv_prefilled"]).astype("int64")
    value = live["decode_batch_idx"].astype("int64")
    bad = live[value != expected]
    lag = (expected[bad.index] - value[bad.index])
    direction = pd.Series("lags", index=bad.index).where(lag > 0, "leads")
    rows = pd.DataFrame({
        "field": "decode_batch_idx", "step": bad["step"].astype("int64"), "rid": bad["rid"],
        "expected": expected[bad.index].astype(object),
        "actual": value[bad.index].astype(object),
        "explanation": "decode_batch_idx " + direction + " the "
                       + expected[bad.index].astype(str) + " decode steps computed since "
                       "the request's prefill by " + lag.abs().astype(str)
                       + "; SWA eviction, the SWA retain window and mamba tracking "
                       "count decode steps by it"})
    violations = base.violations
    if len(rows):
        extra = c._violations(2, frames.loop, rows)
        violations = pd.concat([base.violations, extra], ignore_index=True).sort_values(
            "step", kind="stable").reset_index(drop=True)
    note = base.note + f"; decode_batch_idx on {len(live)}"
    return c.ClauseResult(2, c.VIOLATED if len(violations) else c.HOLDS, note, violations)


# -- clause 6 -------------------------------------------------------------------------------


def check_clocks(frames: Frames):
    """Clause 6: ``processed_tokens_counter`` advances by the tokens each step prefilled."""
    c = _contract()
    loop = frames.loop
    steps = frames.steps.sort_values("step")
    if "processed_tokens_counter" not in steps or steps["processed_tokens_counter"].isna().all():
        return c.ClauseResult(6, c.NOT_EXERCISED, "this SGLang has no "
                              "processed_tokens_counter", c._violations(6, loop, []))
    launches = frames.launches
    if launches.empty:
        return c.ClauseResult(6, c.NOT_EXERCISED, "no forward was launched",
                              c._violations(6, loop, []))
    counter = steps.set_index("step")["processed_tokens_counter"].astype("int64")
    prefilled = launches.groupby("step")["prefilled_tokens"].sum()
    first_launch = launches.groupby("step")["launch"].min()
    modes = launches.groupby("step")["mode"].agg(lambda m: "/".join(dict.fromkeys(
        str(x) for x in m)))
    rows, checked = [], 0
    for before, after in zip(counter.index[:-1], counter.index[1:]):
        expected = int(prefilled.get(before, 0))
        actual = int(counter[after] - counter[before])
        checked += before in first_launch.index
        if actual == expected:
            continue
        launch = first_launch.get(before)
        what = (f"the {modes[before]} launch(es) of step {before}" if launch is not None
                else f"step {before}, which launched nothing,")
        if actual > expected:
            why = (f"ran ahead by {actual - expected} tokens {what} did not prefill; "
                   "calc_priority and every new arrival's snapshot read the clock")
        else:
            why = (f"missed {expected - actual} of the tokens {what} prefilled; "
                   "calc_priority and every new arrival's snapshot read the clock")
        rows.append({"field": "processed_tokens_counter", "step": int(after),
                     "launch": None if launch is None else int(launch),
                     "expected": f"+{expected}", "actual": f"+{actual}",
                     "explanation": "the HRRN clock " + why})
    if not checked:
        return c.ClauseResult(6, c.NOT_EXERCISED, "no launch was followed by a step "
                              "boundary", c._violations(6, loop, []))
    note = f"{checked} launching steps checked"
    return c.ClauseResult(6, c.VIOLATED if rows else c.HOLDS, note,
                          c._violations(6, loop, rows))


def sglang_finding(clause: int, result) -> str | None:
    """The catalogued SGLang-wide bug a clause's violations are, else None.

    Clause 6's catalogued bug (``processed-tokens-counter``) makes the clock run ahead
    (decode lanes counted as prefill); a clock that lags, or any other clause, is not it.
    """
    if clause not in SGLANG_WIDE or result.violations.empty:
        return None
    v = result.violations
    ahead = [int(a) > int(e) for a, e in zip(v["actual"].str.lstrip("+"),
                                               v["expected"].str.lstrip("+"))]
    return SGLANG_WIDE[clause] if all(ahead) else None


# -- clause 7 -------------------------------------------------------------------------------


def check_retired(frames: Frames):
    """Clause 7: the backend keeps no state for a request the scheduler released."""
    c = _contract()
    loop = frames.loop
    state = frames.tables.get("backend_state", pd.DataFrame())
    if state is None or state.empty:
        return c.ClauseResult(7, c.NOT_EXERCISED, "the loop's backend kept no per-request "
                              "state", c._violations(7, loop, []))
    requests = frames.requests
    released = requests.assign(released=requests["finished"].astype(bool)
                               | requests["req_pool_idx"].isna())
    released = released.set_index(["rid", "step"]).sort_index()
    steps = frames.steps.set_index("step")
    idle = (steps["is_fully_idle"].astype(bool) & (steps["result_queue_len"] == 0))
    launch_steps = sorted(set(frames.launches["step"].astype(int)))
    since: dict[tuple[str, int], int] = {}  # (rid, step) -> step its released streak began
    for rid, group in released.groupby(level="rid"):
        start = None
        had_row = False
        for (_, step), row in group.iterrows():
            had_row |= pd.notna(row["req_pool_idx"])
            if row["released"] and had_row:
                start = step if start is None else start
                since[(rid, step)] = start
            else:
                start = None
    held_rows = requests.set_index(["rid", "step"])["req_pool_idx"]
    rows, released_seen = [], {key[0] for key in since}
    for r in state.itertuples(index=False):
        step, rid = int(r.step), r.rid
        entry = f"{r.structure}[{rid!r}]" + ("" if pd.isna(r.row) else f" -> row {int(r.row)}")
        if (rid, step) not in held_rows.index:
            rows.append({"field": r.structure, "step": step, "rid": rid,
                         "expected": "no state (the scheduler does not hold this request)",
                         "actual": entry, "explanation": "backend state for a request id "
                         "the scheduler never received or no longer knows"})
            continue
        start = since.get((rid, step))
        if start is None:
            held = held_rows[(rid, step)]
            if not pd.isna(r.row) and not pd.isna(held) and int(r.row) != int(held):
                rows.append({"field": r.structure, "step": step, "rid": rid,
                             "expected": f"row {int(held)} (the scheduler's)",
                             "actual": entry, "explanation": "the backend maps the request "
                             "to a row it no longer holds: a sync through it writes KV into "
                             "another request's slots"})
            continue
        after = [s for s in launch_steps if start <= s < step]
        if after:
            why = (f"kept after launch(es) at step {after[0]}"
                   f"{'...' + str(after[-1]) if len(after) > 1 else ''} that followed its "
                   f"release (seen at step {start})")
        elif step in idle.index and idle[step]:
            why = f"kept while the loop is idle (released, seen at step {start})"
        else:
            continue
        rows.append({"field": r.structure, "step": step, "rid": rid,
                     "expected": "no state (released)", "actual": entry,
                     "explanation": why + ": a re-admitted id routes as a continuation, "
                     "a pool flush syncs through the stale row, and the cache's arrays "
                     "stay allocated"})
    if not released_seen and not rows:
        return c.ClauseResult(7, c.NOT_EXERCISED, "no request was released",
                              c._violations(7, loop, []))
    structures = state["structure"].nunique()
    note = (f"{len(state)} backend entries over {structures} per-request structures "
            f"checked; {len(released_seen)} requests released")
    return c.ClauseResult(7, c.VIOLATED if rows else c.HOLDS, note,
                          c._violations(7, loop, rows))


# -- clause sets ------------------------------------------------------------------------------


def clause_checks(clauses: str = "all") -> dict[int, Any]:
    """The check function per clause number of a clause set (``"rfc"`` or ``"all"``)."""
    c = _contract()
    if clauses not in CLAUSE_SETS:
        raise ValueError(f"unknown clause set {clauses!r}; one of: {', '.join(CLAUSE_SETS)}")
    checks = dict(c.CHECKS)
    if clauses == "all":
        checks.update({2: check_counters_extended, 6: check_clocks, 7: check_retired})
    return checks


def origin(clause: int) -> str:
    """``RFC #32833`` or ``this project's extensions``."""
    return EXTENSIONS if clause in EXTENSION_CLAUSES else RFC
