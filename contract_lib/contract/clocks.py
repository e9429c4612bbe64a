"""Clause 6, scheduling clocks advanced (field ``processed_tokens_counter``; this
project's extension).

Between two step boundaries the HRRN policy's clock advances by exactly the tokens the
launches of that iteration prefilled (the prefill lanes' ``extend_lens``; decode lanes,
decode and chained launches prefill none).
"""

from __future__ import annotations

import pandas as pd

from contract_lib.contract.base import ClauseResult, NotExercised, ordered_by, result
from contract_lib.contract.known import PREDICTION_COLUMNS, known_bug, no_prediction
from contract_lib.contract.registry import EXTENSIONS, clause
from contract_lib.frames import Frames


def _advances(frames: Frames, added: dict[int, int]) -> pd.DataFrame:
    """A prediction of the clock: between each two step boundaries, ``added[step]``
    tokens (0 where absent) against the tokens the step's launches prefilled."""
    steps = frames.steps["step"].sort_values().tolist()
    prefilled = frames.launches.groupby("step")["prefilled_tokens"].sum()
    rows = [{"field": "processed_tokens_counter", "step": after, "rid": None,
             "expected": f"+{int(prefilled.get(before, 0))}",
             "predicted": f"+{int(added.get(before, 0))}"}
            for before, after in zip(steps[:-1], steps[1:])]
    return pd.DataFrame(rows, columns=PREDICTION_COLUMNS)


@known_bug("processed-tokens-counter")
def stale_extend_num_tokens(frames: Frames) -> pd.DataFrame:
    """``run_batch`` adds every launched batch's ``extend_num_tokens`` when it is not
    zero, and ``prepare_for_decode`` never resets it: a decode batch adds the last
    prefill's size again. Predicted from what each launch's batch carried."""
    launches = frames.launches
    if "extend_num_tokens" not in launches or launches["extend_num_tokens"].isna().all():
        return no_prediction()  # frames recorded before the column: nothing to match
    carried = pd.to_numeric(launches["extend_num_tokens"], errors="coerce").fillna(0)
    added = carried.groupby(launches["step"]).sum().astype("int64")
    return _advances(frames, added.to_dict())


@known_bug("mlx-clock")
def clock_never_advances(frames: Frames) -> pd.DataFrame:
    """The MLX loop's launches bypass ``run_batch``, the only writer: the clock stays."""
    return _advances(frames, {})


def _no_clock(frames: Frames) -> str | None:
    """(A release without the clock has the clause ``not-present``, checked first.)"""
    if "processed_tokens_counter" not in frames.steps:
        return "the frames were recorded without processed_tokens_counter"
    return "no forward was launched" if frames.launches.empty else None


@clause(6, "scheduling clocks advanced", fields=("processed_tokens_counter",),
        audit_fields=("processed_tokens_counter",), origin=EXTENSIONS,
        readers=("calc_priority (HRRN)", "every new arrival's snapshot"),
        unexercised=_no_clock)
def check_clocks(frames: Frames) -> ClauseResult:
    """Clause 6: ``processed_tokens_counter`` advances by the tokens each step prefilled."""
    loop = frames.loop
    steps = ordered_by(frames.steps, "step")
    launches = frames.launches
    counter = dict(zip(steps["step"].tolist(),
                       steps["processed_tokens_counter"].astype("int64").tolist()))
    prefilled: dict[int, int] = {}  # step -> tokens its launches prefilled
    first_launch: dict[int, int] = {}  # step -> its first launch
    modes: dict[int, dict[str, None]] = {}  # step -> its launches' modes, in order
    for step, launch, tokens, mode in zip(
            launches["step"].tolist(), launches["launch"].tolist(),
            launches["prefilled_tokens"].tolist(), launches["mode"].tolist()):
        prefilled[step] = prefilled.get(step, 0) + tokens
        first_launch[step] = min(first_launch.get(step, launch), launch)
        modes.setdefault(step, {})[str(mode)] = None
    rows, checked = [], 0
    order = list(counter)
    for before, after in zip(order[:-1], order[1:]):
        expected = int(prefilled.get(before, 0))
        actual = int(counter[after] - counter[before])
        checked += before in first_launch
        if actual == expected:
            continue
        launch = first_launch.get(before)
        what = (f"the {'/'.join(modes[before])} launch(es) of step {before}"
                if launch is not None
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
        raise NotExercised("no launch was followed by a step boundary")
    note = f"{checked} launching steps checked"
    return result(6, loop, rows, note)
