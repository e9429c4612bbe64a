"""The committed runs of every supported release, written by
``scripts/make-history-fixtures``: the contract's history read without installing a
release. ``data/history/<release>/`` holds the runs that show each July bug;
``data/history-sweep/<release>/`` every shipped workload through each loop the release
tables of docs/history.md show. Each file is one run's :meth:`Frames.to_payload` as
compact JSON, gzipped (deterministically: no timestamp), named like the CLI's frames
files (``two-turn.mlx.real.json.gz``)."""

from __future__ import annotations

import functools
import gzip
import json
import zlib
from pathlib import Path

from contract_lib.campaigns.run_diff import first_difference
from contract_lib.campaigns.status import ReleasesStatus, checked_releases
from contract_lib.frames import Frames, FramesFormatError, parse_payload
from contract_lib.paths import HISTORY_DIR, SWEEP_DIR
from contract_lib.sources.versions import SUPPORTED_SGLANG_VERSIONS
from contract_lib.workloads import workload_names

SUFFIX = ".json.gz"


def run_name(workload: str, loop: str, patch: str | None = None,
             runner: str = "model-free") -> str:
    """``workload.loop[.real][.patch]``: a saved run's file name without the suffix."""
    name = f"{workload}.{loop}" + (".real" if runner == "real" else "")
    return name + (f".{patch.replace(':', '-').replace('/', '-')}" if patch else "")


def save_run(frames: Frames, directory: Path = HISTORY_DIR) -> tuple[Path, bool]:
    """Write ``frames`` to ``directory/<release>/<run_name>.json.gz``, unless the file
    there holds the same run (wall-clock columns aside), so a re-made history changes
    only the runs that changed; the path, and whether it was written."""
    meta = frames.meta
    name = run_name(meta["workload"], meta["loop"], meta["patch"], meta["runner"])
    path = directory / meta["sglang_version"] / f"{name}{SUFFIX}"
    if path.is_file() and _same_run(load_file(path), frames):
        return path, False
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(frames.to_payload(), separators=(",", ":")) + "\n"
    path.write_bytes(gzip.compress(text.encode(), compresslevel=9, mtime=0))
    _parsed.cache_clear()
    return path, True


def _same_run(saved: Frames, frames: Frames) -> bool:
    """Same fate, shims and tables (an error by its type, phase and message: its log
    tail has timestamps)."""
    def fate(run: Frames) -> tuple:
        error = run.meta.get("error") or {}
        return (run.status, run.meta["steps"], run.meta.get("shims"),
                *(error.get(key) for key in ("type", "phase", "message")))

    return (fate(saved) == fate(frames) and saved.tables.keys() == frames.tables.keys()
            and first_difference(saved, frames) == "none")


@functools.lru_cache(maxsize=None)
def _parsed(path: Path) -> Frames:
    """The run a file holds, parsed and typed once (:func:`save_run` forgets them all)."""
    try:
        text = gzip.decompress(path.read_bytes()).decode()
    except (gzip.BadGzipFile, EOFError, zlib.error, UnicodeDecodeError) as exc:
        raise FramesFormatError(f"{path}: not a gzipped frames file ({exc})") from None
    return Frames.from_payload(parse_payload(text, path), path)


def load_file(path: Path) -> Frames:
    """A saved run (a fresh copy, free to edit); a file of another schema or shape is a
    :class:`~contract_lib.frames.FramesFormatError` naming it."""
    return _parsed(Path(path)).copy()


def saved_releases(directory: Path = HISTORY_DIR) -> list[str]:
    """The supported releases with saved runs, oldest first."""
    return [v for v in SUPPORTED_SGLANG_VERSIONS if (directory / v).is_dir()]


def saved_files(directory: Path = HISTORY_DIR) -> list[Path]:
    """Every saved run, by release (oldest first), then name."""
    return [path for version in saved_releases(directory)
            for path in sorted((directory / version).glob(f"*{SUFFIX}"))]


def saved_run(version: str, workload: str, loop: str, patch: str | None = None,
              runner: str = "model-free", directory: Path = HISTORY_DIR) -> Frames:
    """The saved run of ``version``; a missing one is a one-line FileNotFoundError."""
    path = directory / version / f"{run_name(workload, loop, patch, runner)}{SUFFIX}"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no saved history run; add it to "
                                "scripts/make-history-fixtures and run it")
    return load_file(path)


def saved_status(runner: str = "model-free", patch: str | None = None,
                 directory: Path = HISTORY_DIR) -> ReleasesStatus:
    """The clause tables of the saved runs of every release (those of ``runner`` and
    ``patch``), side by side: what ``status --sglang 0.5.14..0.5.23`` measures, over the
    saved workloads only."""
    runs: dict[str, dict[tuple[str, str], Frames]] = {}
    for path in saved_files(directory):
        frames = load_file(path)
        if frames.meta["runner"] == runner and frames.meta["patch"] == patch:
            runs.setdefault(frames.meta["sglang_version"], {})[
                (frames.meta["workload"], frames.loop)] = frames
    if not runs:
        raise FileNotFoundError(f"{directory}: no saved {runner} run"
                                + (f" with patch {patch}" if patch else ""))
    return checked_releases(runs, runner)


def swept_status(versions: list[str], loops: list[str], runner: str = "model-free",
                 directory: Path = SWEEP_DIR) -> ReleasesStatus:
    """What ``status --sglang V ... --loop L ...`` measures over every shipped workload,
    read from the saved sweep: each (release, workload, loop) run must be there (a
    workload added since, or a loop not swept, is a FileNotFoundError naming the
    script), and is checked by today's code."""
    return checked_releases({
        version: {(workload, loop): saved_run(version, workload, loop, runner=runner,
                                              directory=directory)
                  for workload in workload_names() for loop in loops}
        for version in versions}, runner)
