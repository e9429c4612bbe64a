"""From a finding to an upstream report: ``patch export`` (a source patch as an upstream
diff) and ``report`` (an issue, its fix and its regression test, for SGLang)."""

from __future__ import annotations

import sys
from pathlib import Path

from contract_lib.atomic import atomic_write
from contract_lib.cli.options import add_speed_options
from contract_lib.patches.builtin import BUILTIN_PATCHES


def cmd_patch_export(args) -> int:
    from contract_lib.campaigns.export import export_patch

    diff = export_patch(args.name, args.sglang)
    if args.out is None:
        sys.stdout.write(diff)
        return 0
    with atomic_write(args.out) as handle:
        handle.write(diff)
    print(f"{args.name}: {diff.count(chr(10) + '@@')} hunks in "
          f"{diff.count('diff --git')} files written to {args.out}")
    return 0


def cmd_report(args) -> int:
    from contract_lib.campaigns.issue import write_report
    from contract_lib.campaigns.upstream_report import ReportRequest
    from contract_lib.views.triage import clause_view

    request = ReportRequest(loop=args.loop, workload=args.workload, patch=args.patch,
                            fix=args.fix, fix_diff=args.fix_diff, shrink=args.shrink,
                            clause=args.clause, out=args.out, cache=not args.no_cache,
                            releases=_releases(args.release))
    written = write_report(request, draw=clause_view)
    for line in written.summary():
        print(line)
    return written.exit_code


def _releases(values: list[str] | None) -> tuple[str, ...] | None:
    """``--release`` values, ranges expanded, each once (as ``status --sglang``); None:
    every supported release. The report checks each is supported."""
    if not values:
        return None
    from contract_lib.sources.versions import release_range

    return tuple(dict.fromkeys(v for value in values for v in release_range(value)))


def register(commands) -> None:
    """Add ``patch`` (``patch export``) and ``report`` to the subcommands."""
    patch_parser = commands.add_parser(
        "patch", help="built-in and user source patches: export one as an upstream diff")
    actions = patch_parser.add_subparsers(dest="action", required=True)
    export = actions.add_parser(
        "export", help="print a source patch as a unified diff in SGLang's repository "
        "layout (a/python/sglang/...), for git apply, --diff and compare --head diff=; "
        "exit 2 when the patch is not only patch_source edits")
    export.add_argument("name", help=f"a built-in patch ({', '.join(BUILTIN_PATCHES)}) or "
                        "'package.module:callable' made of patch_source calls")
    export.add_argument("--sglang", metavar="VERSION|PATH", help="the SGLang to diff "
                        "against: a supported release or a source tree (default: the "
                        "venv's)")
    export.add_argument("--out", type=Path, help="write the diff to this file instead of "
                        "printing it")
    export.set_defaults(handler=cmd_patch_export)

    report = commands.add_parser(
        "report", help="write an upstream-ready issue for the first violated clause of a "
        "run: releases affected, minimal workload, SGLang lines, fix judged by compare, "
        "a regression test; exit 0 written, 1 the fix does not turn it green, 2 bad input "
        "or nothing to report")
    report.add_argument("--loop", required=True)
    report.add_argument("--workload", required=True,
                        help="a shipped workload name or a path to a .toml workload")
    report.add_argument("--patch", action="append", help="patches the run needs (as for "
                        "check; repeatable); the fix goes on top")
    fix = report.add_mutually_exclusive_group()
    fix.add_argument("--fix", metavar="NAME", help="a source patch that fixes it (built-in "
                     "or module:callable), exported as the fix's diff")
    fix.add_argument("--fix-diff", type=Path, metavar="FILE",
                     help="the fix as an upstream diff")
    report.add_argument("--clause", type=int, metavar="N", help="report clause N (default: "
                        "the first clause the run violates)")
    report.add_argument("--shrink", action="store_true", help="search for the smallest "
                        "workload that violates the same clause (contract_lib.campaigns.search, seed "
                        "0) and report that one")
    report.add_argument("--out", type=Path, required=True, help="the folder to write the "
                        "report, its workload, diff, test, frames and figure to")
    report.add_argument("--release", action="append", metavar="VERSION|RANGE",
                        help="a release of the *Releases affected* table, or a range "
                        "OLDEST..NEWEST (repeatable; default: every supported release, "
                        "each installed on first use)")
    add_speed_options(report)
    report.set_defaults(handler=cmd_report)
