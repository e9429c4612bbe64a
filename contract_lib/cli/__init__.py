"""Command line: ``python -m contract_lib {run,check,status,...} ...``.

``--runner {model-free,real}`` and ``--sglang VERSION|PATH`` choose the MLX runner and the
SGLang of ``run``, ``check`` and ``status`` (a release, or a source tree), ``--diff FILE``
applies upstream diffs to it (:mod:`contract_lib.sources`); ``status`` takes ``--sglang``
several times to print the tables side by side. ``compare`` runs the same workloads
through a base and a head SGLang (:mod:`contract_lib.compare`). ``server status|stop``
shows or stops the warm servers runs fork from (:mod:`contract_lib.pool`).

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
import sys

from contract_lib.cli import runs, tables, tools
from contract_lib.cli.options import EXIT_INTERRUPTED, USAGE_ERRORS, server_arg

__all__ = ["build_parser", "main", "server_arg"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m contract_lib",
        description="Run SGLang's real scheduler loops model-free and check the per-step "
                    "contract (see README.md).")
    commands = parser.add_subparsers(dest="command", required=True)
    for module in (runs, tables, tools):
        module.register(commands)
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
