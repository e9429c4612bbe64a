"""The commands over many runs: ``status`` (the clause x loop table), ``audit`` (the
effects audit), ``compare`` (a base and a head SGLang side by side), ``pair`` (a PD
prefill side, then a decode side)."""

from __future__ import annotations

import sys

from contract_lib import loops
from contract_lib.cli.options import (
    add_clauses_option,
    add_release_options,
    add_sglang_options,
    add_speed_options,
    add_strict_known_option,
)
from contract_lib.patches.builtin import patch_spec
from contract_lib.runs.harness import RUNNERS
from contract_lib.sources.versions import release_range
from contract_lib.verdict import Outcome


def cmd_status(args) -> int:
    from contract_lib.campaigns.history import SIDE_BY_SIDE_MAX, history_text
    from contract_lib.campaigns.status import releases_status

    chosen = [version for value in args.sglang or [None]
              for version in ([None] if value is None else release_range(value))]
    result = releases_status(list(dict.fromkeys(chosen)),
                             workloads=args.workload or None,
                             loops=tuple(args.loop) if args.loop else None,
                             patch=patch_spec(args.patch),
                             cache=not args.no_cache, warm=not args.cold,
                             runner=args.runner, clauses=args.clauses,
                             diffs=args.diff, strict_known=args.strict_known)
    print(history_text(result) if len(result.statuses) > SIDE_BY_SIDE_MAX
          else result.text())
    reference = result.reference_violations()
    if not reference.empty:
        print("\nthe torch reference loops violate the contract (a checker bug or an "
              "SGLang finding):")
        print(reference.to_string(index=False))
    return result.outcome()


def cmd_audit(args) -> int:
    from contract_lib.campaigns.audit import AuditRunFailed, audit

    try:
        result = audit(args.workload, patch=patch_spec(args.patch), sglang=args.sglang,
                       diff=args.diff, loop=args.loop)
    except AuditRunFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.outcome
    print(result.text())
    return Outcome.PASS


def cmd_compare(args) -> int:
    from contract_lib.campaigns.compare import compare

    result = compare(args.base, args.head, workloads=args.workloads or None,
                     loops=args.loop or None, clauses=args.clauses, runner=args.runner,
                     cache=not args.no_cache, warm=not args.cold)
    print(result.text())
    return result.outcome()


def cmd_pair(args) -> int:
    from contract_lib.campaigns.pair import pair

    result = pair(args.workload, args.prefill, args.decode, patch=patch_spec(args.patch),
                  clauses=args.clauses, strict_known=args.strict_known,
                  cache=not args.no_cache, warm=not args.cold, sglang=args.sglang,
                  diff=args.diff, progress=True)
    print(result.text())
    return result.verdict().code


def _register_pair(commands) -> None:
    pair_parser = commands.add_parser(
        "pair", help="one workload through a PD prefill side, then its handed-off requests "
        "through a decode side; one table per request across both sides; exit codes as check")
    pair_parser.add_argument("--workload", required=True,
                             help="a shipped workload name or a path to a .toml workload")
    pair_parser.add_argument("--prefill", default="disagg-prefill-normal",
                             help="the prefill side's loop (default disagg-prefill-normal)")
    pair_parser.add_argument("--decode", default="disagg-decode-overlap",
                             help="the decode side's loop (default disagg-decode-overlap)")
    pair_parser.add_argument("--patch", action="append", help="apply to both sides' runs "
                             "(repeatable); event_loop_normal stays unpatched")
    add_clauses_option(pair_parser)
    add_strict_known_option(pair_parser)
    add_sglang_options(pair_parser)
    add_speed_options(pair_parser)
    pair_parser.set_defaults(handler=cmd_pair)


def register(commands) -> None:
    """Add ``status``, ``audit``, ``compare`` and ``pair`` to the subcommands."""
    status_parser = commands.add_parser(
        "status", help="the measured clause x loop table over the shipped workloads")
    status_parser.add_argument("--workload", action="append",
                               help="restrict to these workloads (repeatable)")
    status_parser.add_argument("--loop", action="append", choices=loops.names(),
                               help="restrict to these loops (repeatable)")
    status_parser.add_argument("--patch", action="append",
                               help="apply this patch to every run (repeatable)")
    add_release_options(status_parser, repeat=True)
    add_speed_options(status_parser)
    add_clauses_option(status_parser)
    add_strict_known_option(status_parser)
    status_parser.set_defaults(handler=cmd_status)
    audit_parser = commands.add_parser(
        "audit", help="effects audit: what the torch loops' steps write that a candidate "
        "loop (--loop, default mlx) does not")
    audit_parser.add_argument("--workload", default="two-turn")
    candidate = next(n for n in loops.default_names() if not loops.spec(n).reference)
    audit_parser.add_argument("--loop", default=candidate, choices=[
        n for n in loops.names() if not loops.spec(n).reference],
        help=f"the candidate loop compared with both torch loops (default {candidate}; a "
             "PD prefill side is compared at extend launches: it launches no decode)")
    audit_parser.add_argument("--patch", action="append", help="apply to every loop's run")
    add_sglang_options(audit_parser)
    audit_parser.set_defaults(handler=cmd_audit)
    compare_parser = commands.add_parser(
        "compare", help="the same workloads through a base and a head SGLang, side by side; "
        "exit 0 the head fixed a clause and broke none, 1 it broke one or made one worse, "
        "5 nothing changed, "
        "2 set-up error, 3 a run did not finish, 4 vacuous (see contract_lib/campaigns/compare.py)")
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
    add_clauses_option(compare_parser)
    add_speed_options(compare_parser)
    compare_parser.set_defaults(handler=cmd_compare)
    _register_pair(commands)
