"""The commands of one run: ``run`` (the per-step table), ``check`` (the clauses),
``trace`` (a Chrome/Perfetto trace of loops side by side)."""

from __future__ import annotations

import sys
from pathlib import Path

from contract_lib import loops
from contract_lib.cli.options import (
    add_clauses_option,
    add_run_options,
    add_sglang_options,
    add_speed_options,
    add_strict_known_option,
    fate,
    file_part,
    run_and_save,
    sglang_file_part,
)
from contract_lib.patches.builtin import patch_spec
from contract_lib.paths import FRAMES_DIR
from contract_lib.runs.harness import run
from contract_lib.runs.loop_choice import runnable
from contract_lib.verdict import Outcome, setup_failed, worst
from contract_lib.views.text import run_summary, step_table


def cmd_run(args) -> int:
    frames = run_and_save(args)
    print(run_summary(frames))
    if setup_failed(frames.meta):
        return Outcome.USAGE
    print()
    print(step_table(frames))
    if frames.meta.get("runner") == "real" and not frames.kv_pool.empty:
        from contract_lib.contract.kv_damage import pool_table

        print()
        print(pool_table(frames))
    return fate(frames)


def cmd_check(args) -> int:
    from contract_lib.contract import check

    frames = run_and_save(args)
    report = check(frames, args.clauses, args.strict_known)
    if setup_failed(frames.meta):
        print(run_summary(frames))
        print(report.verdict().line())
        return report.verdict().code
    print()
    print(report.text())
    if args.diff and args.runner == "model-free" and loops.known(args.loop).mlx:
        from contract_lib.sources.diffs import model_free_notes

        for note in model_free_notes(args.diff):
            print(note)
    real = frames.meta.get("runner") == "real"
    # The real runner's pool always; the model-free runner's contents when damaged.
    if (real and frames.status == "finished") or report.kv_damaged:
        from contract_lib.contract import kv_damage

        runner = "real MlxModelRunner" if real else "model-free MlxModelRunner's contents"
        print()
        print(f"KV pool ({runner}): {'DAMAGED' if report.kv_damaged else 'intact'}")
        print(kv_damage.pool_table(frames))
    return report.verdict().code


def cmd_trace(args) -> int:
    from contract_lib.campaigns.trace import write_trace
    from contract_lib.sources.origin import resolve, run_sglang

    # Default: the first reference loop beside the first candidate.
    chosen = runnable(args.loop or [
        loops.reference_names()[0],
        next(n for n in loops.default_names() if not loops.spec(n).reference)])
    patch = patch_spec(args.patch)
    source = resolve(args.sglang, args.diff)  # a bad tree or diff: exit 2 before any run
    runs = [run(args.workload, loop, patch=patch, cache=not args.no_cache,
                warm=not args.cold, **run_sglang(loop, source, args.sglang, args.diff))
            for loop in chosen]
    name = f"{Path(args.workload).stem}.{'-'.join(chosen)}"
    name += sglang_file_part(args.sglang, args.diff)
    if patch:
        name += "." + file_part(patch)
    if args.wall_clock:
        name += ".wall-clock"
    out = args.out or FRAMES_DIR / f"{name}.trace.json"
    try:
        path = write_trace(runs, out, wall_clock=args.wall_clock)
    except OSError as exc:
        print(f"error: could not write the trace to {out}: {exc}", file=sys.stderr)
        return Outcome.USAGE
    print(f"trace of {', '.join(chosen)} on {args.workload} written to {path}; open it in "
          "https://ui.perfetto.dev (Open trace file) or chrome://tracing")
    for frames in runs:
        if frames.status != "finished":
            print(run_summary(frames))
    return worst(fate(frames) for frames in runs)


def register(commands) -> None:
    """Add ``run``, ``check`` and ``trace`` to the subcommands."""
    run_parser = commands.add_parser(
        "run", help="run a workload through a loop; print the per-step table, save frames")
    add_run_options(run_parser)
    run_parser.set_defaults(handler=cmd_run)
    check_parser = commands.add_parser(
        "check", help="run, then check the clauses (--clauses); exit 0 pass, 1 a clause violated, "
        "2 set-up error, 3 the run did not finish, 4 vacuous (see README)")
    add_run_options(check_parser)
    add_clauses_option(check_parser)
    add_strict_known_option(check_parser)
    check_parser.set_defaults(handler=cmd_check)
    trace_parser = commands.add_parser(
        "trace", help="write a Chrome/Perfetto trace of one or more loops on a workload")
    trace_parser.add_argument("--loop", action="append", choices=loops.names(),
                              help="a loop to include, one process each (repeatable; "
                                   "default: normal and mlx)")
    trace_parser.add_argument("--workload", required=True)
    trace_parser.add_argument("--patch", action="append")
    trace_parser.add_argument("--out", type=Path, help="default: data/frames/"
                              "<workload>.<loops>[.sglang-<version>][.diff-<name>]"
                              "[.<patch>][.wall-clock].trace.json")
    trace_parser.add_argument("--wall-clock", action="store_true",
                              help="real step times instead of synthetic, byte-stable ones")
    add_sglang_options(trace_parser)
    add_speed_options(trace_parser)
    trace_parser.set_defaults(handler=cmd_trace)
