"""Command line: ``python -m contract_lib {run,check,status,...} ...``.

``--runner {model-free,real}`` chooses the MLX runner of ``run``, ``check`` and ``status``;
``--sglang VERSION|PATH`` the SGLang of those and of ``trace``, ``audit`` and ``search`` (a
release, or a source tree), and ``--diff FILE`` applies upstream diffs to it
(:mod:`contract_lib.sources.origin`); ``status`` takes ``--sglang``
several times to print the tables side by side. ``compare`` runs the same workloads
through a base and a head SGLang (:mod:`contract_lib.campaigns.compare`). ``server status|stop``
shows or stops the warm servers runs fork from (:mod:`contract_lib.runs.pool`). ``patch
export`` writes a source patch as an upstream diff, ``report`` an upstream issue with its
fix and regression test (:mod:`contract_lib.cli.report_commands`).

Exit codes (one per outcome, :mod:`contract_lib.verdict`): 0 pass, 1 a clause violated
(or the MLX KV pool damaged), 2 a usage or set-up error (unknown name, unsupported SGLang,
bad patch, a release that could not be installed, a run that failed before its loop or
would enter another loop), 3 the run did not finish (crashed, died, timeout), 4 vacuous
(no clause exercised, or a request SGLang aborted that the workload does not expect),
70 contract_lib itself failed (a bug: one line, the traceback in a file), 130 interrupted
(Ctrl-C), 143 terminated (SIGTERM; the frames kept as on Ctrl-C). ``run`` and ``trace`` judge only the runs' fate (0, 2, 3); ``status``
exits 1 only for a violation on a torch reference loop.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import traceback

from contract_lib.cli import (
    report_commands as report,
    run_commands as runs,
    table_commands as tables,
    tool_commands as tools,
)
from contract_lib.cli.options import (
    EXIT_INTERRUPTED,
    EXIT_SOFTWARE,
    EXIT_TERMINATED,
    USAGE_ERRORS,
    server_arg,
)

__all__ = ["build_parser", "main", "server_arg"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m contract_lib",
        description="Run SGLang's real scheduler loops model-free and check the per-step "
                    "contract (see README.md).")
    commands = parser.add_subparsers(dest="command", required=True)
    for module in (runs, tables, tools, report):
        module.register(commands)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C would be: every run stops the same way and keeps its
    frames."""


_terminated: list[bool] = []  # set once SIGTERM arrived (the exception may be rewrapped)


def _on_sigterm(_signum, _frame) -> None:
    _terminated.append(True)
    raise Terminated("SIGTERM")


def main(argv: list[str] | None = None) -> int:
    """Run one command; a usage error is one ``error:`` line on stderr and exit 2. Ctrl-C
    is one ``interrupted:`` line and exit 130, SIGTERM one ``terminated:`` line and exit
    143: queued runs are cancelled and children killed; ``run``/``check`` first write the
    frames captured so far (status ``interrupted``). An unexpected exception is a bug of
    contract_lib, not a verdict: one line naming the file its traceback was written to,
    and exit 70."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _terminated.clear()
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    try:
        return args.handler(args)
    except USAGE_ERRORS as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        terminated = bool(_terminated)
        word = "terminated (SIGTERM)" if terminated else "interrupted"
        text = str(exc).removeprefix("SIGTERM").lstrip("; ")
        print(f"{word}: {text}" if text else word, file=sys.stderr)
        return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - a bug of the tool: say so, exit 70
        print(f"internal error: contract_lib failed with {type(exc).__name__}: "
              f"{_first_line(exc)}; this is a bug of contract_lib, not a verdict on a loop "
              f"(traceback: {_write_traceback(exc)})", file=sys.stderr)
        return EXIT_SOFTWARE
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else "(no message)"


def _write_traceback(exc: BaseException) -> str:
    """The traceback in a new private file of the temporary folder; its path."""
    try:
        fd, path = tempfile.mkstemp(prefix="contract_lib-crash-", suffix=".txt")
        with os.fdopen(fd, "w") as handle:
            handle.write("".join(traceback.format_exception(exc)))
        return path
    except (OSError, MemoryError):
        return "not written"
