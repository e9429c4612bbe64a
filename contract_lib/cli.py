"""Command line: ``python -m contract_lib {run,check,status,...} ...``.

``--runner {model-free,real}`` and ``--sglang VERSION|PATH`` choose the MLX runner and the
SGLang of ``run``, ``check`` and ``status`` (a release, or a source tree), ``--diff FILE``
applies upstream diffs to it (:mod:`contract_lib.sources`); ``status`` takes ``--sglang``
several times to print the tables side by side. ``compare`` runs the same workloads
through a base and a head SGLang (:mod:`contract_lib.compare`).

Exit codes (one per outcome, :mod:`contract_lib.verdict`): 0 pass, 1 a clause violated
(or the MLX KV pool damaged), 2 a usage or set-up error (unknown name, unsupported SGLang,
bad patch, a release that could not be installed, a run that failed before its loop or
would enter another loop), 3 the run did not finish (crashed, died, timeout), 4 vacuous
(no clause exercised, or a request SGLang aborted that the workload does not expect),
130 interrupted. ``run`` and ``trace`` judge only the runs' fate (0, 2, 3); ``status``
exits 1 only for a violation on a torch reference loop.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

from contract_lib.contract import CLAUSE_SETS, CLAUSES
from contract_lib.frames import Frames
from contract_lib import loops
from contract_lib.harness import RUNNERS, RunInterrupted, RunSetupError, run
from contract_lib.patches import BUILTIN_PATCHES, PatchError, patch_spec
from contract_lib.report import run_summary, step_table
from contract_lib.sources import is_path
from contract_lib.verdict import Outcome, setup_failed, worst
from contract_lib.versions import (SUPPORTED_SGLANG_VERSIONS, SGLangInstallError,
                                   UnsupportedSGLangError)
from contract_lib.workloads import WorkloadError

from contract_lib.paths import FRAMES_DIR
USAGE_ERRORS = (RunSetupError, WorkloadError, PatchError, UnsupportedSGLangError,
                SGLangInstallError)
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C


def _server_arg(text: str) -> tuple[str, object]:
    """``KEY=VALUE``: VALUE as a Python literal (``8``, ``0.5``, ``None``, ``True``), TOML's
    ``true``/``false``, else the string; the run checks it against ServerArgs' types."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    if raw.strip() in ("true", "false"):
        return key.strip(), raw.strip() == "true"
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw
    return key.strip(), value


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--loop", required=True, help=f"one of: {', '.join(loops.names())}")
    parser.add_argument("--workload", required=True,
                        help="a shipped workload name or a path to a .toml workload")
    parser.add_argument("--patch", action="append", help="a built-in patch "
                        f"({', '.join(BUILTIN_PATCHES)}) or 'package.module:callable'; "
                        "repeat to combine")
    parser.add_argument("--server-arg", action="append", type=_server_arg, default=[],
                        metavar="KEY=VALUE", help="a ServerArgs override (repeatable)")
    parser.add_argument("--out", type=Path, help="where to write the frames (default: "
                        "data/frames/<workload>.<loop>[.real][.sglang-<version>]"
                        "[.<patch>].json)")
    _add_release_options(parser)
    _add_speed_options(parser)


def _add_release_options(parser: argparse.ArgumentParser, repeat: bool = False) -> None:
    parser.add_argument("--runner", choices=RUNNERS, default="model-free",
                        help="mlx loop: the model-free next-token function (default) or "
                        "SGLang's real MlxModelRunner with a tiny local mlx-lm model")
    versions = ", ".join(SUPPORTED_SGLANG_VERSIONS)
    what = (f"the SGLang release ({versions}; default: the venv's; others install into "
            ".cache/sglang/<version> on first use) or a path to an SGLang source tree (a "
            "checkout's root or its python/ folder)")
    if repeat:
        parser.add_argument("--sglang", action="append", metavar="VERSION|PATH",
                            help=f"{what}; repeat to print the tables side by side")
    else:
        parser.add_argument("--sglang", metavar="VERSION|PATH", help=what)
    parser.add_argument("--diff", action="append", metavar="FILE",
                        help="a unified diff in SGLang's repository layout "
                        "(a/python/sglang/..., as `git diff` or a pull request's .diff "
                        "writes it), applied with `git apply` to a scratch copy of that "
                        "SGLang; repeat to apply several in order")


def _add_clauses_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clauses", choices=CLAUSE_SETS, default="all",
                        help="all: RFC #32833's five clauses and this project's extensions "
                        "(decode_batch_idx in clause 2, clauses 6 and 7; default); rfc: the "
                        "RFC's five only")


def _add_speed_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-cache", action="store_true",
                        help="neither serve nor store this run in the frame cache")
    parser.add_argument("--cold", action="store_true", help="start a fresh interpreter "
                        "instead of forking from a warm server (same frames, slower)")


def _default_out(args) -> Path:
    name = f"{Path(args.workload).stem}.{args.loop}"
    if args.runner == "real":
        name += ".real"
    if args.sglang:
        name += f".sglang-{Path(args.sglang).name if is_path(args.sglang) else args.sglang}"
    for diff in args.diff or ():
        name += f".diff-{Path(diff).stem}"
    if args.patch:
        name += "." + _file_part(patch_spec(args.patch))
    return FRAMES_DIR / f"{name}.json"


def _file_part(patch: str) -> str:
    """A patch spec as part of a file name."""
    return patch.replace(":", "-").replace("/", "-")


def _run(args) -> Frames:
    try:
        frames = run(args.workload, args.loop, patch=args.patch,
                     server_args=dict(args.server_arg), cache=not args.no_cache,
                     warm=not args.cold, runner=args.runner, sglang=args.sglang,
                     diff=args.diff)
    except RunInterrupted as exc:  # keep what the run captured
        out = _save_frames(exc.frames, args.out or _default_out(args))
        raise RunInterrupted(f"{exc}; the frames so far are in {out}", exc.frames) from None
    out = _save_frames(frames, args.out or _default_out(args))
    if out is not None:
        cached = " (from the frame cache)" if frames.meta.get("cached") else ""
        print(f"frames written to {out}{cached}")
    return frames


def _save_frames(frames: Frames, path: Path) -> Path | None:
    """Write the frames; an unwritable path costs the file, never the verdict (one line
    on stderr, None returned)."""
    try:
        return frames.save(path)
    except OSError as exc:
        print(f"warning: could not write the frames to {path}: {exc}", file=sys.stderr)
        return None


def _fate(frames: Frames) -> Outcome:
    """A run's fate alone: set-up error (2), did not finish (3), else 0."""
    if setup_failed(frames.meta):
        return Outcome.USAGE
    return Outcome.PASS if frames.status == "finished" else Outcome.NOT_FINISHED


def cmd_run(args) -> int:
    frames = _run(args)
    print(run_summary(frames))
    if setup_failed(frames.meta):
        return Outcome.USAGE
    print()
    print(step_table(frames))
    if frames.meta.get("runner") == "real" and not frames.kv_pool.empty:
        from contract_lib.kvpool import pool_table

        print()
        print(pool_table(frames))
    return _fate(frames)


def cmd_check(args) -> int:
    from contract_lib.contract import check

    frames = _run(args)
    report = check(frames, args.clauses)
    if setup_failed(frames.meta):
        print(run_summary(frames))
        print(report.verdict().line())
        return report.verdict().code
    print()
    print(report.text())
    kv_damaged = False
    if frames.meta.get("runner") == "real" and frames.status == "finished":
        from contract_lib import kvpool

        kv_damaged = kvpool.damaged(frames)
        print()
        print(f"KV pool (real MlxModelRunner): {'DAMAGED' if kv_damaged else 'intact'}")
        print(kvpool.pool_table(frames))
    return report.verdict(kv_damaged).code


def cmd_status(args) -> int:
    from contract_lib.status import releases_status

    result = releases_status(list(dict.fromkeys(args.sglang or [None])),
                             workloads=args.workload or None,
                             loops=tuple(args.loop) if args.loop else None,
                             patch=patch_spec(args.patch),
                             cache=not args.no_cache, warm=not args.cold,
                             runner=args.runner, clauses=args.clauses,
                             diffs=args.diff)
    print(result.text())
    reference = result.reference_violations()
    if not reference.empty:
        print("\nthe torch reference loops violate the contract (a checker bug or an "
              "SGLang finding):")
        print(reference.to_string(index=False))
    return result.outcome()


def cmd_audit(args) -> int:
    from contract_lib.audit import AuditRunFailed, audit

    try:
        result = audit(args.workload, patch=patch_spec(args.patch))
    except AuditRunFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.outcome
    print(result.text())
    return Outcome.PASS


def cmd_trace(args) -> int:
    from contract_lib.trace import write_trace

    # Default: the first reference loop beside the first candidate.
    chosen = args.loop or [loops.reference_names()[0],
                           next(n for n in loops.default_names() if not loops.spec(n).reference)]
    patch = patch_spec(args.patch)
    runs = [run(args.workload, loop, patch=patch, cache=not args.no_cache,
                warm=not args.cold) for loop in chosen]
    name = f"{Path(args.workload).stem}.{'-'.join(chosen)}"
    if patch:
        name += "." + _file_part(patch)
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
    return worst(_fate(frames) for frames in runs)


def cmd_search(args) -> int:
    from contract_lib.search import (FOUND_DIR, Campaign, SearchSetupError, search_many,
                                     workload_size, write_found)

    from tqdm.auto import tqdm

    if args.loop not in loops.names():
        raise RunSetupError(f"unknown loop {args.loop!r}; valid loops: "
                            f"{', '.join(loops.names())}")
    if args.budget < 1 or args.seeds < 1:
        raise RunSetupError("--budget and --seeds must be at least 1")
    patch = patch_spec(args.patch)
    campaigns = [Campaign(args.loop, patch, args.clause, args.budget, args.seed + k,
                          clauses=args.clauses, shrink_budget=args.shrink_budget, database=not args.no_database,
                          cache=not args.no_cache) for k in range(args.seeds)]
    bar = tqdm(total=args.budget * args.seeds, desc=f"search {args.loop}", unit="run",
               file=sys.stderr, leave=False)

    def progress(phase: str, _runs: int) -> None:
        bar.set_description(f"search {args.loop} ({phase})")
        bar.update(1)

    client = None
    try:
        executor = None
        if args.dask:
            from distributed import Client

            client = Client(args.dask)
            executor = client.get_executor()
        done = search_many(campaigns, executor, progress)
    except SearchSetupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return Outcome.USAGE
    finally:
        bar.close()
        if client is not None:
            client.close()
    found = [c for c in done if c.found]
    for campaign in done:
        print(f"seed {campaign.seed}: {campaign.examples} examples, {campaign.runs} runs, "
              f"{campaign.rejected} discarded: "
              f"{'found ' + campaign.found[1].kind if campaign.found else 'nothing found'}")
    if not found:
        print(f"no finding on --loop {args.loop}"
              f"{' --patch ' + patch if patch else ''} within {args.budget} examples")
        return Outcome.PASS
    best = min(found, key=lambda c: tuple(workload_size(c.found[0]).values()))
    path = write_found(best, args.out or FOUND_DIR)
    print(best.found[1].line)
    print(f"minimal workload written to {path}")
    return Outcome.VIOLATED


def cmd_compare(args) -> int:
    from contract_lib.compare import compare

    result = compare(args.base, args.head, workloads=args.workloads or None,
                     loops=args.loop or None, clauses=args.clauses, runner=args.runner,
                     cache=not args.no_cache, warm=not args.cold)
    print(result.text())
    return result.outcome()


def cmd_cache(args) -> int:
    from contract_lib import cache

    if args.action == "clear":
        try:
            removed = cache.clear()
        except cache.CacheDirError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"removed {removed} cached runs from {cache.cache_dir()}")
    else:
        print(cache.cache_dir())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m contract_lib",
        description="Run SGLang's real scheduler loops model-free and check the per-step "
                    "contract (see README.md).")
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser(
        "run", help="run a workload through a loop; print the per-step table, save frames")
    _add_run_options(run_parser)
    run_parser.set_defaults(handler=cmd_run)
    check_parser = commands.add_parser(
        "check", help="run, then check the clauses (--clauses); exit 0 pass, 1 a clause violated, "
        "2 set-up error, 3 the run did not finish, 4 vacuous (see README)")
    _add_run_options(check_parser)
    _add_clauses_option(check_parser)
    check_parser.set_defaults(handler=cmd_check)
    status_parser = commands.add_parser(
        "status", help="the measured clause x loop table over the shipped workloads")
    status_parser.add_argument("--workload", action="append",
                               help="restrict to these workloads (repeatable)")
    status_parser.add_argument("--loop", action="append", choices=loops.names(),
                               help="restrict to these loops (repeatable)")
    status_parser.add_argument("--patch", action="append",
                               help="apply this patch to every run (repeatable)")
    _add_release_options(status_parser, repeat=True)
    _add_speed_options(status_parser)
    _add_clauses_option(status_parser)
    status_parser.set_defaults(handler=cmd_status)
    audit_parser = commands.add_parser(
        "audit", help="effects audit: what the torch loops' steps write that mlx does not")
    audit_parser.add_argument("--workload", default="two-turn")
    audit_parser.add_argument("--patch", action="append", help="apply to every loop's run")
    audit_parser.set_defaults(handler=cmd_audit)
    trace_parser = commands.add_parser(
        "trace", help="write a Chrome/Perfetto trace of one or more loops on a workload")
    trace_parser.add_argument("--loop", action="append", choices=loops.names(),
                              help="a loop to include, one process each (repeatable; "
                                   "default: normal and mlx)")
    trace_parser.add_argument("--workload", required=True)
    trace_parser.add_argument("--patch", action="append")
    trace_parser.add_argument("--out", type=Path, help="default: data/frames/"
                              "<workload>.<loops>.trace.json")
    trace_parser.add_argument("--wall-clock", action="store_true",
                              help="real step times instead of synthetic, byte-stable ones")
    _add_speed_options(trace_parser)
    trace_parser.set_defaults(handler=cmd_trace)
    search_parser = commands.add_parser(
        "search", help="generate workloads until one breaks the contract, shrink it, write "
        "it to data/workloads/found/; exit 1 found, 0 none within the budget, 2 set-up error")
    search_parser.add_argument("--loop", required=True,
                               help=f"one of: {', '.join(loops.names())}")
    search_parser.add_argument("--patch", action="append", help="apply to the searched "
                               "loop's runs (repeatable); the torch reference stays unpatched")
    search_parser.add_argument("--clause", type=int, choices=sorted(CLAUSES), metavar="N",
                               help="count only violations of clause N (crashes and unequal "
                               "tokens still count)")
    search_parser.add_argument("--clauses", choices=CLAUSE_SETS, default="all",
                               help="the clause set checked, as for check (a catalogued "
                               "SGLang-wide violation the torch loops share is no finding)")
    search_parser.add_argument("--budget", type=int, default=100,
                               help="examples to generate before giving up (default 100)")
    search_parser.add_argument("--shrink-budget", type=int, default=150,
                               help="runs allowed for shrinking a finding (default 150)")
    search_parser.add_argument("--seed", type=int, default=0, help="Hypothesis seed")
    search_parser.add_argument("--seeds", type=int, default=1, help="independent campaigns "
                               "(seeds SEED, SEED+1, ...) run side by side")
    search_parser.add_argument("--dask", metavar="ADDRESS", help="run on this Dask "
                               "distributed scheduler (Client(ADDRESS).get_executor())")
    search_parser.add_argument("--no-database", action="store_true", help="ignore "
                               "Hypothesis' example database (.cache/hypothesis-search)")
    search_parser.add_argument("--out", type=Path, help="the folder to write the minimal "
                               "workload to (default: data/workloads/found)")
    search_parser.add_argument("--no-cache", action="store_true",
                               help="neither serve nor store runs in the frame cache")
    search_parser.set_defaults(handler=cmd_search)
    compare_parser = commands.add_parser(
        "compare", help="the same workloads through a base and a head SGLang, side by side; "
        "exit 0 the head fixed a clause and broke none, 1 it broke one, 5 nothing changed, "
        "2 set-up error, 3 a run did not finish, 4 vacuous (see contract_lib/compare.py)")
    side = ("comma-separated KEY=VALUE: release=VERSION or path=TREE, then any diff=FILE "
            "and patch=NAME (repeatable, applied in order)")
    compare_parser.add_argument("--base", default="", help=f"{side}; default: the venv's "
                                "SGLang, unpatched")
    compare_parser.add_argument("--head", required=True, help=side)
    compare_parser.add_argument("--loop", action="append", choices=loops.names(),
                                help="restrict to these loops (repeatable; default: "
                                "SGLang's loops)")
    compare_parser.add_argument("workloads", nargs="*", metavar="WORKLOAD",
                                help="shipped workload names or .toml paths (default: all "
                                "shipped)")
    compare_parser.add_argument("--runner", choices=RUNNERS, default="model-free",
                                help="the mlx loop's runner, as for check")
    _add_clauses_option(compare_parser)
    _add_speed_options(compare_parser)
    compare_parser.set_defaults(handler=cmd_compare)
    cache_parser = commands.add_parser("cache", help="manage the frame cache")
    cache_parser.add_argument("action", choices=["clear", "path"])
    cache_parser.set_defaults(handler=cmd_cache)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; a usage error is one ``error:`` line on stderr and exit 2. Ctrl-C
    is one ``interrupted:`` line and exit 130: queued runs are cancelled and children
    killed; ``run``/``check`` first write the frames captured so far (status
    ``interrupted``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except USAGE_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        print(f"interrupted: {exc}" if str(exc) else "interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
