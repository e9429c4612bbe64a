"""Text renderings of frames for a terminal: the first screen a triager looks at."""

from __future__ import annotations

import pandas as pd

from contract_lib.frames import Frames, run_title


def _cell(value) -> str:
    if value is None or (isinstance(value, float) and pd.isna(value)):
        return "-"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def step_table(frames: Frames) -> str:
    """One line per step: the loop's counters and, per request, its accounting.

    Per request: ``emitted/computed/seq/committed`` = tokens emitted, KV positions the
    forward has computed or queued, its ``seq_lens`` entry, ``kv_committed_len``; a
    ``*`` marks a finished request.
    """
    steps = frames.steps
    requests = frames.requests
    launches = frames.launches
    rids = list(dict.fromkeys(requests["rid"]))
    header = ["step", "fwd_ct", "q", "idle", "probe", "batch", "launches"] + [
        f"{rid} e/c/s/k" for rid in rids]
    rows = []
    for _, step in steps.iterrows():
        number = int(step["step"])
        launched = launches[launches["step"] == number]
        kinds = " ".join(("chain" if row.chained else row.mode or "?") for row in
                         launched.itertuples())
        batch = (f"{step['running_mode']}x{int(step['running_bs'])}"
                 if step["running_bs"] else "-")
        cells = [str(number), str(int(step["forward_ct"])), str(int(step["result_queue_len"])),
                 "idle" if step["is_fully_idle"] else "busy",
                 "idle" if step["idle_probe"] else "busy", batch, kinds or "-"]
        at_step = requests[requests["step"] == number].set_index("rid")
        for rid in rids:
            if rid not in at_step.index:
                cells.append("")
                continue
            r = at_step.loc[rid]
            mark = "*" if r["finished"] else ""
            cells.append("/".join(_cell(r[c]) for c in (
                "emitted", "kv_computed", "seq_len", "kv_committed_len")) + mark)
        rows.append(cells)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def run_summary(frames: Frames) -> str:
    """Status line(s): what ran, how it ended, and the error if it did not finish."""
    meta = frames.meta
    lines = [f"{run_title(meta)}: {meta['status']} after {meta['steps']} steps, "
             f"{len(frames.launches)} launches"]
    error = frames.error
    if error:
        lines.append(f"  {error['type']} during {error['phase']}: {error['message']}")
        if error.get("traceback"):
            lines.append("  " + error["traceback"].rstrip().splitlines()[-1])
    from contract_lib.contract import aborted_requests

    for r in aborted_requests(frames).itertuples(index=False):
        lines.append(f"  request {r.rid} aborted by SGLang"
                     f"{' (declared expected)' if r.expected else ''}: {r.message}")
    return "\n".join(lines)
