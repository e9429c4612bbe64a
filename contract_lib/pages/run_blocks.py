"""Generated blocks that drive SGLang's loops: clause tables, per-run figures, messages.

A run is named ``loop[:patch][@sglang]`` (``mlx:fix-chained-accounting``,
``normal@0.5.22``); lists are comma-separated. Every generator states the command that
reproduces it where a command exists.
"""

from __future__ import annotations

import functools

from contract_lib.pages.generators import generator, md_table


def _runs(names: str, workload: str):
    """The frames of each ``loop[:patch][@sglang]`` in ``names`` on ``workload``, and
    their labels."""
    import contract_lib

    frames, labels = [], []
    for name in names.split(","):
        loop_patch, _, sglang = name.partition("@")
        loop, _, patch = loop_patch.partition(":")
        frames.append(contract_lib.run(workload, loop, patch=patch or None,
                                       sglang=sglang or None))
        labels.append(loop_patch.replace(":", " + ") + (f" (sglang {sglang})" if sglang else ""))
    return frames, labels


@functools.lru_cache(maxsize=None)
def _measured(loops: str, patch: str, runner: str, sglang: str, clauses: str):
    """``status`` over the shipped workloads (``loops`` comma-separated, "" the default
    ones), once per argument set in a process: the docs show a table in one block and
    quote its cells in others."""
    from contract_lib.campaigns.status import status

    return status(loops=tuple(loops.split(",")) if loops else None, patch=patch or None,
                  progress=False, runner=runner, sglang=sglang or None, clauses=clauses)


def _command(loops: list[str], sglang: list[str], patch: str, runner: str,
             clauses: str) -> str:
    words = ["python -m contract_lib status"]
    words += [f"--sglang {v}" for v in sglang] + [f"--loop {loop}" for loop in loops]
    words += [f"--patch {p}" for p in patch.split("+") if p]
    words += [f"--runner {runner}"] if runner != "model-free" else []
    words += [f"--clauses {clauses}"] if clauses != "all" else []
    return " ".join(words)


def _section_rows(labels: list[str], width: int) -> list[list[str]]:
    """Rows with a bold section heading before the first clause of each origin."""
    from contract_lib.contract import origin

    rows, last = [], None
    for label in labels:
        number = label.split(" ", 1)[0]
        if number.isdigit() and origin(int(number)) != last:
            last = origin(int(number))
            rows.append([f"**{last}**"] + [""] * (width - 1))
        rows.append([label])
    return rows


def _refused(statuses) -> list[str]:
    """A sentence per kind of run that earned no clause status (releases named only when
    they differ)."""
    from contract_lib.campaigns.status import UNSUPPORTED

    refused: dict[str, dict[str, list[str]]] = {}  # loop -> workload -> releases
    other = []
    for status in statuses:
        where = f" (sglang {status.sglang})" if len(statuses) > 1 else ""
        for workload, loop, fate in status.runs_not_finished():
            if fate.startswith(UNSUPPORTED):
                refused.setdefault(loop, {}).setdefault(workload, []).append(status.sglang)
            else:
                other.append(f"`{workload}` on `{loop}`{where}: {fate}")
    parts = []
    for loop, workloads in refused.items():
        for workload, releases in workloads.items():
            every = len(releases) == len(statuses)
            parts.append(f"`{workload}` on `{loop}`" + ("" if every else
                         " (sglang " + ", ".join(map(str, releases)) + ")"))
    lines = ["Refused in set-up as unsupported, so counted in no cell: "
             + "; ".join(parts) + "."] if parts else []
    return lines + [f"Did not earn its clause statuses: {line}." for line in other]


@generator("status", needs="runs")
def status_block(loops: str = "", sglang: str = "", patch: str = "",
                 runner: str = "model-free", clauses: str = "all") -> str:
    """The clause x loop table of ``status`` over the shipped workloads."""
    measured = _measured(loops, patch, runner, sglang, clauses)
    table = measured.table()
    rows = _section_rows(list(table.index), len(table.columns) + 1)
    for row in rows:
        if len(row) == 1:
            row += [table.loc[row[0], loop] for loop in table.columns]
    command = _command(list(table.columns) if loops else [], [sglang] if sglang else [],
                       patch, runner, clauses)
    head = f"`{command}` (exit {int(measured.outcome())}):"
    notes = _refused([measured]) + [line.strip("()") + "." for line in measured.absent_note()]
    return "\n\n".join([head, md_table(["clause", *table.columns], rows), *notes])


@generator("cell-workloads", needs="runs")
def cell_workloads_phrase(loops: str, loop: str, clause: str, status: str,
                          patch: str = "") -> str:
    """The workloads on which ``clause`` shows ``status`` on ``loop`` in the ``status``
    table of ``loops`` (a phrase: `a`, `b`)."""
    cells = _measured(loops, patch, "model-free", "", "all").per_run()
    hits = cells[(cells["loop"] == loop) & (cells["clause"] == int(clause))
                 & (cells["status"] == status.replace("_", " "))]
    return ", ".join(f"`{w}`" for w in hits["workload"]) or "none"


def _violated_fields(status, loop: str, clause: int) -> list[str]:
    fields: set[str] = set()
    for (_, run_loop), report in status.reports.items():
        result = report.clauses.get(clause)
        if run_loop == loop and result is not None and len(result.violations):
            fields |= set(result.violations["field"])
    return sorted(fields)


@generator("releases", needs="saved")
def releases_block(versions: str, loops: str, runner: str = "model-free",
                   fields: str = "") -> str:
    """Clause x release over the shipped workloads (rows per loop when several), read
    from the saved sweep of every release (``data/history-sweep``; checked against live
    runs of some releases by tests/test_history.py); the violated fields written in the
    cells of the clauses listed in ``fields``."""
    from contract_lib.campaigns.saved_history import swept_status
    from contract_lib.contract import origin

    names, loop_names = versions.split(","), loops.split(",")
    measured = swept_status(names, loop_names, runner)
    table = measured.table()
    shown = {int(n) for n in fields.split(",") if n}
    rows, last = [], None
    for clause, loop in table.index:
        number = clause.split(" ", 1)[0]
        if number.isdigit() and origin(int(number)) != last:
            last = origin(int(number))
            rows.append([f"**{last}**"] + [""] * len(names))
        cells = []
        for status, version in zip(measured.statuses, names):
            cell = table.loc[(clause, loop), version]
            if number.isdigit() and int(number) in shown and cell.startswith("violated"):
                fields_ = ", ".join(_violated_fields(status, loop, int(number)))
                cell = cell.replace(")", f": {fields_})")
            cells.append(cell)
        rows.append([clause if len(loop_names) == 1 else f"{clause}: {loop}", *cells])
    command = _command(loop_names, names, "", runner, "all")
    return "\n\n".join([f"`{command}` (exit {int(measured.outcome())}; read from "
                        "`data/history-sweep`, saved by `scripts/make-history-fixtures`):",
                        md_table(["clause", *names], rows), *_refused(measured.statuses)])


@generator("saved-stamp-violations", needs="saved")
def saved_stamp_violations_phrase(workload: str, loop: str, release: str,
                                  field: str) -> str:
    """``N of M launches``: the launches whose clause-3 ``field`` is violated on the saved
    run of ``release`` (``data/history-sweep``)."""
    from contract_lib.campaigns.saved_history import saved_run
    from contract_lib.contract import check
    from contract_lib.paths import SWEEP_DIR

    frames = saved_run(release, workload, loop, directory=SWEEP_DIR)
    found = check(frames).clauses[3].violations
    return f"{int((found['field'] == field).sum())} of {len(frames.launches)} launches"


@generator("memory-pressure", needs="runs")
def memory_block(runs: str = "normal,overlap,mlx,mlx:fix-chained-accounting") -> str:
    """Retractions, peak computed positions and pool size of ``memory-pressure``."""
    from contract_lib.views import memory_table

    frames, labels = _runs(runs, "memory-pressure")
    rows = []
    for run, label in zip(frames, labels):
        table = memory_table(run)
        same = run.output_tokens() == frames[0].output_tokens()
        rows.append([label, int(table["retractions"].iloc[-1]), int(table["computed"].max()),
                     int(table["accounted"].max()), int(table["pool"].iloc[0]),
                     "yes" if same else "no"])
    return md_table(["run", "retractions", "peak computed positions",
                     "peak accounted (kv_committed_len)", "pool slots",
                     f"tokens as on {labels[0]}"], rows)


@generator("reuse", needs="runs")
def reuse_block(workload: str, rid: str, runs: str) -> str:
    """A later turn's ``cached_tokens`` per run against the ideal reuse."""
    from contract_lib.views import radix_reuse_table

    frames, labels = _runs(runs, workload)
    table = radix_reuse_table(*frames, rid=rid, labels=labels)
    return md_table(["run", f"cached_tokens of {rid}", "ideal", "difference"],
                    table[["run", "cached_tokens", "ideal", "difference"]].values.tolist())


@generator("tokens", needs="runs")
def tokens_phrase(workload: str, rid: str, runs: str) -> str:
    """How many tokens request ``rid`` emits on each run (a phrase)."""
    frames, labels = _runs(runs, workload)
    counts = [f"{len(run.output_tokens().get(rid, []))} on `{label}`"
              for run, label in zip(frames, labels)]
    return counts[0].replace(" on", " tokens on", 1) + "".join(f", {c}" for c in counts[1:])


@generator("violation", needs="runs")
def violation_phrase(workload: str, loop: str, clause: str) -> str:
    """The first violation message of a clause on one run (``loop`` as in ``runs``)."""
    from contract_lib.contract import check, violation_message

    frames, _ = _runs(loop, workload)
    return f"`{violation_message(check(frames[0]).clauses[int(clause)].first())}`"


@generator("known", needs="runs")
def known_phrase(workload: str, loop: str) -> str:
    """The known-upstream lines ``check`` prints for one run."""
    from contract_lib.contract import check

    frames, _ = _runs(loop, workload)
    return "; ".join(f"`{m.line()}`" for ms in check(frames[0]).known.values() for m in ms)


def _shape(frames) -> str:
    """steps / launches / launches never processed / relay reads of a run."""
    launches = frames.launches
    reads = int((frames.relay["event"] == "read").sum())
    return (f"{len(frames.steps)} / {len(launches)} / "
            f"{int(launches['processed_step'].isna().sum())} / {reads}")


def _final(frames) -> dict:
    last = frames.requests.sort_values("step").groupby("rid").last()
    return last[["emitted", "kv_committed_len", "cached_tokens"]].to_dict("index")


@generator("omni-frames", needs="releases")
def omni_frames_block(sglang: str = "0.5.22") -> str:
    """Per shipped workload ``omni`` takes: the frames' shape on the torch loops and on
    ``omni``, whether the tokens and each request's final counters equal ``normal``'s."""
    from contract_lib.verdict import unsupported
    from contract_lib.workloads import workload_names

    rows = []
    for workload in workload_names():
        frames, _ = _runs(f"normal@{sglang},overlap@{sglang},omni", workload)
        normal, overlap, omni = frames
        if unsupported(omni.meta):
            continue
        same = omni.output_tokens() == normal.output_tokens()
        ahead = {rid: row["kv_committed_len"] - _final(normal)[rid]["kv_committed_len"]
                 for rid, row in _final(omni).items()}
        rows.append([workload, _shape(normal), _shape(overlap), _shape(omni),
                     "equal" if same else "differ",
                     f"+1 each ({len(ahead)})" if set(ahead.values()) == {1}
                     else ", ".join(f"{r} {d:+d}" for r, d in ahead.items())])
    return md_table(["workload", f"normal ({sglang})", f"overlap ({sglang})", "omni",
                     "tokens", "final kv_committed_len, omni - normal"], rows)


@generator("omni-overrun", needs="releases")
def omni_overrun_phrase(workload: str) -> str:
    """When each request finishes on ``omni`` and which launches it drops."""
    frames, _ = _runs("omni", workload)
    done = frames[0].requests[frames[0].requests["finished"].astype(bool)]
    finished = done.groupby("rid")["step"].min().reset_index().sort_values(["step", "rid"])
    finished = dict(zip(finished["rid"], finished["step"]))
    dropped = frames[0].launches[frames[0].launches["processed_step"].isna()]
    return (f"{len(finished)} requests finish ("
            + ", ".join(f"`{rid}` at step {step}" for rid, step in finished.items())
            + f") and {len(dropped)} launches are dropped ("
            + ", ".join(f"`{r.rids}`'s, launched at step {r.step}"
                        for r in dropped.itertuples()) + ")")

