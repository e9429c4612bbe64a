"""What the commands share: the run options, the SGLang options, saving frames, a run's fate."""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

from contract_lib import loops
from contract_lib.contract import CLAUSE_SETS
from contract_lib.frames import Frames
from contract_lib.patches.builtin import BUILTIN_PATCHES, PatchError, patch_spec
from contract_lib.paths import FRAMES_DIR
from contract_lib.runs.harness import RUNNERS, RunInterrupted, RunSetupError, run
from contract_lib.sources.origin import file_part as sglang_file_part
from contract_lib.sources.versions import (
    SUPPORTED_SGLANG_VERSIONS,
    SGLangInstallError,
    UnsupportedSGLangError,
)
from contract_lib.verdict import Outcome, loop_mismatch, setup_failed
from contract_lib.workloads import WorkloadError

USAGE_ERRORS = (RunSetupError, WorkloadError, PatchError, UnsupportedSGLangError,
                SGLangInstallError)
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM: stopped like a Ctrl-C, the frames kept
EXIT_SOFTWARE = 70  # sysexits' EX_SOFTWARE: contract_lib itself failed (a bug), not a run


def server_arg(text: str) -> tuple[str, object]:
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


def add_run_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--loop", required=True, help=f"one of: {', '.join(loops.names())}")
    parser.add_argument("--workload", required=True,
                        help="a shipped workload name or a path to a .toml workload")
    parser.add_argument("--patch", action="append", help="a built-in patch "
                        f"({', '.join(BUILTIN_PATCHES)}) or 'package.module:callable'; "
                        "repeat to combine")
    parser.add_argument("--server-arg", action="append", type=server_arg, default=[],
                        metavar="KEY=VALUE", help="a ServerArgs override (repeatable)")
    parser.add_argument("--out", type=Path, help="where to write the frames (default: "
                        "data/frames/<workload>.<loop>[.real][.sglang-<version>]"
                        "[.<patch>].json); a run that fails before its loop keeps the "
                        "file as it was")
    parser.add_argument("--max-seconds", type=float, metavar="S",
                        help="the hang limit: seconds without a sign of progress from the "
                        "run before it is stopped as hung (status timeout, exit 3; "
                        "default: the workload's max_seconds, else 300)")
    add_release_options(parser)
    add_speed_options(parser)


def add_release_options(parser: argparse.ArgumentParser, repeat: bool = False) -> None:
    parser.add_argument("--runner", choices=RUNNERS, default="model-free",
                        help="mlx loop: the model-free next-token function (default) or "
                        "SGLang's real MlxModelRunner with a tiny local mlx-lm model")
    add_sglang_options(parser, repeat)


def add_sglang_options(parser: argparse.ArgumentParser, repeat: bool = False) -> None:
    """``--sglang VERSION|PATH`` (repeatable with ``repeat``) and ``--diff FILE``."""
    versions = ", ".join(SUPPORTED_SGLANG_VERSIONS)
    what = (f"the SGLang release ({versions}; default: the venv's; others install into "
            ".cache/sglang/<version> on first use) or a path to an SGLang source tree (a "
            "checkout's root or its python/ folder)")
    if repeat:
        parser.add_argument("--sglang", action="append", metavar="VERSION|PATH|RANGE",
                            help=f"{what}, or a range OLDEST..NEWEST of releases (e.g. "
                            "0.5.14..0.5.23); repeat to print the tables side by side "
                            "(more than three: a row per release, a block per loop)")
    else:
        parser.add_argument("--sglang", metavar="VERSION|PATH", help=what)
    parser.add_argument("--diff", action="append", metavar="FILE",
                        help="a unified diff in SGLang's repository layout "
                        "(a/python/sglang/..., as `git diff` or a pull request's .diff "
                        "writes it), applied with `git apply` to a scratch copy of that "
                        "SGLang; repeat to apply several in order")


def add_clauses_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clauses", choices=CLAUSE_SETS, default="all",
                        help="all: RFC #32833's five clauses and this project's extensions "
                        "(decode_batch_idx in clause 2, clauses 6 and 7; default); rfc: the "
                        "RFC's five only")


def add_strict_known_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--strict-known", action="store_true",
                        help="fail on catalogued upstream bugs too: a clause whose "
                        "violations are exactly what a bug of data/bugs.toml predicts is "
                        "reported as 'known upstream' and, by default, not a failure")


def add_speed_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-cache", action="store_true",
                        help="neither serve nor store this run in the frame cache")
    parser.add_argument("--cold", action="store_true", help="start a fresh interpreter "
                        "instead of forking from a warm server (same frames, slower)")


def default_out(args) -> Path:
    name = f"{Path(args.workload).stem}.{args.loop}"
    if args.runner == "real":
        name += ".real"
    name += sglang_file_part(args.sglang, args.diff)
    if args.patch:
        name += "." + file_part(patch_spec(args.patch))
    return FRAMES_DIR / f"{name}.json"


def file_part(patch: str) -> str:
    """A patch spec as part of a file name."""
    return patch.replace(":", "-").replace("/", "-")


def run_and_save(args) -> Frames:
    try:
        frames = run(args.workload, args.loop, patch=args.patch,
                     server_args=dict(args.server_arg), cache=not args.no_cache,
                     warm=not args.cold, runner=args.runner, sglang=args.sglang,
                     diff=args.diff, hang_timeout=args.max_seconds)
    except RunInterrupted as exc:  # keep what the run captured
        if exc.frames is None or setup_failed(exc.frames.meta):
            raise
        out = save_frames(exc.frames, args.out or default_out(args))
        raise RunInterrupted(f"{exc}; the frames so far are in {out}", exc.frames) from None
    if setup_failed(frames.meta):  # no step to keep: a good file there stays as it was
        print(f"frames not written to {args.out or default_out(args)}: the run failed "
              "before its loop", file=sys.stderr)
        return frames
    out = save_frames(frames, args.out or default_out(args))
    if out is not None:
        cached = " (from the frame cache)" if frames.meta.get("cached") else ""
        print(f"frames written to {out}{cached}")
    return frames


def save_frames(frames: Frames, path: Path) -> Path | None:
    """Write the frames; an unwritable path costs the file, never the verdict (one line
    on stderr, None returned)."""
    try:
        return frames.save(path)
    except OSError as exc:
        print(f"warning: could not write the frames to {path}: {exc}", file=sys.stderr)
        return None


def fate(frames: Frames) -> Outcome:
    """A run's fate alone: set-up error or not the loop asked for (2, the reason on
    stderr), did not finish (3), else 0."""
    if setup_failed(frames.meta):
        return Outcome.USAGE
    mismatch = loop_mismatch(frames.meta)
    if mismatch:
        print(f"error: {mismatch}", file=sys.stderr)
        return Outcome.USAGE
    return Outcome.PASS if frames.status == "finished" else Outcome.NOT_FINISHED
