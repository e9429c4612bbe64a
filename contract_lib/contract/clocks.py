"""Clause 6, scheduling clocks advanced (field ``processed_tokens_counter``; this
project's extension).

Between two step boundaries the HRRN policy's clock advances by exactly the tokens the
launches of that iteration prefilled (the prefill lanes' ``extend_lens``; decode lanes,
decode and chained launches prefill none).
"""

from __future__ import annotations

from contract_lib.contract.base import ClauseResult, NotExercised, result
from contract_lib.contract.registry import EXTENSIONS, clause
from contract_lib.frames import Frames


def _clock_ran_ahead(result_) -> str | None:
    """Clause 6's catalogued bug (``processed-tokens-counter``) makes the clock run ahead
    (decode lanes counted as prefill); a clock that lags is not it."""
    v = result_.violations
    ahead = [int(a) > int(e) for a, e in zip(v["actual"].str.lstrip("+"),
                                               v["expected"].str.lstrip("+"))]
    return "processed-tokens-counter" if all(ahead) else None


def _no_clock(frames: Frames) -> str | None:
    """(A release without the clock has the clause ``not-present``, checked first.)"""
    if "processed_tokens_counter" not in frames.steps:
        return "the frames were recorded without processed_tokens_counter"
    return "no forward was launched" if frames.launches.empty else None


@clause(6, "scheduling clocks advanced", fields=("processed_tokens_counter",),
        audit_fields=("processed_tokens_counter",), origin=EXTENSIONS,
        readers=("calc_priority (HRRN)", "every new arrival's snapshot"),
        unexercised=_no_clock, finding=_clock_ran_ahead)
def check_clocks(frames: Frames) -> ClauseResult:
    """Clause 6: ``processed_tokens_counter`` advances by the tokens each step prefilled."""
    loop = frames.loop
    steps = frames.steps.sort_values("step")
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
