"""The committed runs of every supported release (``data/history/<release>/``, written by
``scripts/make-history-fixtures``): the contract's history read without installing a
release. Each file is one run's :meth:`Frames.to_payload` as compact JSON, gzipped
(deterministically: no timestamp), named like the CLI's frames files
(``two-turn.mlx.real.json.gz``)."""

from __future__ import annotations

import copy
import functools
import gzip
import json
from pathlib import Path

from contract_lib.campaigns.status import ReleasesStatus, checked_releases
from contract_lib.frames import Frames, parse_payload
from contract_lib.paths import HISTORY_DIR
from contract_lib.sources.versions import SUPPORTED_SGLANG_VERSIONS

SUFFIX = ".json.gz"


def run_name(workload: str, loop: str, patch: str | None = None,
             runner: str = "model-free") -> str:
    """``workload.loop[.real][.patch]``: a saved run's file name without the suffix."""
    name = f"{workload}.{loop}" + (".real" if runner == "real" else "")
    return name + (f".{patch.replace(':', '-').replace('/', '-')}" if patch else "")


def save_run(frames: Frames, directory: Path = HISTORY_DIR) -> Path:
    """Write ``frames`` to ``directory/<release>/<run_name>.json.gz``; the path."""
    meta = frames.meta
    path = (directory / meta["sglang_version"]
            / f"{run_name(meta['workload'], meta['loop'], meta['patch'], meta['runner'])}{SUFFIX}")
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(frames.to_payload(), separators=(",", ":")) + "\n"
    path.write_bytes(gzip.compress(text.encode(), compresslevel=9, mtime=0))
    return path


@functools.lru_cache(maxsize=None)
def _payload(path: Path) -> dict:
    return parse_payload(gzip.decompress(path.read_bytes()).decode(), path)


def load_file(path: Path) -> Frames:
    """A saved run (a fresh copy, free to edit); a file of another schema or shape is a
    :class:`~contract_lib.frames.FramesFormatError` naming it."""
    payload = _payload(Path(path))
    return Frames.from_payload({**payload, "meta": copy.deepcopy(payload["meta"])}, path)


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
