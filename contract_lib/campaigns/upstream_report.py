"""From a violated clause to the evidence of an upstream report (``python -m
contract_lib report``).

One run of a workload through a loop (with its patches) is checked with known upstream
bugs counted as failures (``strict_known``); the reported clause is the first it
violates (or ``--clause N``). :func:`measure` gathers, each measured now:

- the minimal workload (``--shrink``: :mod:`contract_lib.campaigns.search` for the clause, seed 0,
  no example database, so a regenerated report finds the same one);
- the same check on every supported release (the releases affected);
- the SGLang lines that write and read the violated fields (:mod:`contract_lib.sources.sites`);
- the fix as a diff (``--fix-diff``, or ``--fix NAME`` exported by
  :mod:`contract_lib.campaigns.export`) judged by :func:`contract_lib.campaigns.compare.compare`.

:mod:`contract_lib.campaigns.issue` writes them as Markdown with the frames, the figure and the
regression test (:mod:`contract_lib.campaigns.regression`); ``issue.write_report`` runs both.
Nothing here reads a clock or an absolute path into the files, so a report regenerated
gives the same bytes.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from contract_lib import loops
from contract_lib.campaigns.compare import Comparison, compare
from contract_lib.campaigns.found import to_toml
from contract_lib.contract import ClauseResult, Report, check
from contract_lib.frames import WALL_CLOCK_COLUMNS, Frames, write_payload
from contract_lib.patches.builtin import patch_spec
from contract_lib.patches.catalog import bug_catalog
from contract_lib.runs.harness import run, run_many
from contract_lib.sources.diffs import read_diff
from contract_lib.sources.sites import Site, definition, field_sites, sglang_root
from contract_lib.sources.versions import (
    SUPPORTED_SGLANG_VERSIONS,
    require_supported_sglang,
)
from contract_lib.verdict import setup_failed
from contract_lib.wire.protocol import RunSetupError
from contract_lib.workloads import Workload, load_workload

# Violated fields whose SGLang lines a report lists (in order of first violation).
MAX_FIELDS = 4
# Meta entries that differ between two runs of the same input.
_UNSTABLE_META = ("timing", "cached", "cache_key")


class NothingToReport(RunSetupError):
    """The run violates no clause (or not the one asked for): there is nothing to report."""


@dataclasses.dataclass(frozen=True)
class ReportRequest:
    """What ``report`` was asked for (the command line's arguments)."""

    loop: str
    workload: str
    out: Path
    patch: list[str] | None = None
    fix: str | None = None
    fix_diff: Path | None = None
    shrink: bool = False
    clause: int | None = None
    cache: bool = True
    # The releases of the *Releases affected* table (None: every supported one).
    releases: tuple[str, ...] | None = None


@dataclasses.dataclass
class ReleaseRow:
    """The same check on one supported release."""

    version: str
    status: str
    line: str


@dataclasses.dataclass
class Fix:
    """The fix's diff and what ``compare`` made of it."""

    diff: str  # its text
    origin: str  # "patch NAME, exported" or the file it was read from
    comparison: Comparison
    fixed: bool  # the reported clause went from violated to holds on the loop


@dataclasses.dataclass
class Finding:
    """Everything a report says, measured."""

    request: ReportRequest
    workload: Workload
    shrunk: str | None  # how the minimal workload was found, or None
    frames: Frames
    report: Report
    clause: int
    bug: dict[str, Any] | None
    releases: list[ReleaseRow] = dataclasses.field(default_factory=list)
    sites: dict[str, list[Site]] = dataclasses.field(default_factory=dict)
    loop_site: Site | None = None
    fix: Fix | None = None

    @property
    def result(self) -> ClauseResult:
        return self.report.clauses[self.clause]

    @property
    def patch(self) -> str | None:
        return patch_spec(self.request.patch)


def display(path: Path) -> str:
    """A path as a report shows it: relative to the working directory when inside it."""
    relative = os.path.relpath(Path(path).resolve(), Path.cwd())
    return str(path) if relative.startswith("..") else relative


def _validate(request: ReportRequest) -> None:
    """One-line errors, before anything runs."""
    if request.loop not in loops.names():
        raise RunSetupError(f"unknown loop {request.loop!r}; valid loops: "
                            f"{', '.join(loops.names())}")
    load_workload(request.workload)
    patch_spec(request.patch)
    patch_spec(request.fix)
    if request.fix_diff is not None:
        read_diff(request.fix_diff)
    for version in request.releases or ():
        require_supported_sglang(version)
    if request.out.exists() and not request.out.is_dir():
        raise RunSetupError(f"--out {request.out}: not a folder")


def measure(request: ReportRequest) -> Finding:
    """Check the request (one-line errors before anything runs), then run, check, shrink
    and gather the report's evidence into ``request.out`` (the issue and the test are
    written by :func:`contract_lib.campaigns.issue.write_files`)."""
    _validate(request)
    request.out.mkdir(parents=True, exist_ok=True)
    workload = load_workload(request.workload)
    fix = _fix_diff(request)  # a fix that cannot be exported fails before any run
    frames, report = _checked(request, workload)
    clause = _reported(report, request.clause, frames)
    shrunk = None
    header = [f"The workload of this report: {request.workload}"]
    if request.shrink:
        workload, shrunk = _shrink(request, workload, clause)
        if shrunk is not None:
            header = [f"The smallest workload violating clause {clause} that the search "
                      f"found from {request.workload}'s loop and patches:", shrunk]
            frames, report = _checked(request, workload)
    (request.out / "workload.toml").write_text(to_toml(workload, header))
    finding = Finding(request, workload, shrunk, frames, report, clause,
                      matching_bug(report, clause, request.loop))
    finding.releases = _releases(request, workload, clause)
    root = sglang_root()
    fields = list(dict.fromkeys(finding.result.violations["field"]))[:MAX_FIELDS]
    finding.sites = {field: field_sites(field, root) for field in fields}
    finding.loop_site = definition(loops.spec(request.loop).function, root)
    finding.fix = _fix(request, finding, *fix) if fix else None
    return finding


def _checked(request: ReportRequest, workload: Workload) -> tuple[Frames, Report]:
    frames = run(workload, request.loop, patch=request.patch, cache=request.cache)
    if setup_failed(frames.meta):
        error = frames.error or {}
        raise RunSetupError(f"the run failed in set-up: {error.get('type')}: "
                            f"{error.get('message')}")
    return frames, check(frames, strict_known=True)


def _reported(report: Report, asked: int | None, frames: Frames) -> int:
    """The clause to report: ``asked``, or the first the run violates."""
    failing = report.failing()
    if (asked in failing) if asked is not None else failing:
        return asked if asked is not None else min(failing)
    what = (f"clause {asked} is {report.clauses[asked].status}" if asked in report.clauses
            else f"no clause {asked}" if asked is not None else "no clause is violated")
    raise NothingToReport(f"nothing to report on {frames.meta['workload']} on "
                          f"{frames.loop}: {what} ({report.verdict().line()})")


def _shrink(request: ReportRequest, workload: Workload,
            clause: int) -> tuple[Workload, str | None]:
    """The smallest workload the search finds violating ``clause`` (or ``workload`` and
    None when it finds none, or only a crash)."""
    from contract_lib.campaigns.search import Campaign, search

    campaign = Campaign(request.loop, patch_spec(request.patch), clause, budget=100,
                        seed=0, strict_known=True, database=False, cache=request.cache)
    search(campaign)
    if campaign.found is None or campaign.found[1].kind != "violation":
        return workload, None
    found = dataclasses.replace(campaign.found[0], name=f"{workload.name}.minimal")
    return found, (f"{campaign.command()}: {campaign.examples} examples tried, "
                   f"{campaign.runs} workloads run in all")


def matching_bug(report: Report, clause: int, loop: str) -> dict[str, Any] | None:
    """The catalogued bug of ``data/bugs.toml`` this clause's violations are: the one of
    that clause on that loop whose field the first violation names (a bug without
    ``loops`` is an MLX one), whose fix the run did not apply."""
    first = report.clauses[clause].first() or {}
    field = str(first.get("field", ""))
    applied = set(patch_spec(report.meta.get("patch")).parts if report.meta.get("patch")
                  else ())
    candidates = [bug for bug in bug_catalog() if bug["clause"] == clause
                  and loop in bug.get("loops", [l for l in loops.names()
                                                if loops.spec(l).mlx])
                  and bug.get("fix") not in applied]
    named = [bug for bug in candidates if field.rsplit(".", 1)[-1] in bug["field"]]
    chosen = named or candidates
    return chosen[0] if len(chosen) == 1 else None


def _releases(request: ReportRequest, workload: Workload, clause: int) -> list[ReleaseRow]:
    """The same run and check on every supported release, or those asked for (the
    loop's own when pinned)."""
    pinned = loops.spec(request.loop).sglang
    versions = [pinned] if pinned else list(request.releases or SUPPORTED_SGLANG_VERSIONS)
    jobs = [{"workload": workload, "loop": request.loop, "patch": request.patch,
             "sglang": version, "cache": request.cache} for version in versions]
    rows = []
    for version, result in zip(versions, run_many(jobs, progress=False)):
        if isinstance(result, BaseException):
            rows.append(ReleaseRow(version, "set-up error", str(result)))
        elif setup_failed(result.meta):
            rows.append(ReleaseRow(version, "set-up error", (result.error or {}).get(
                "message", "")))
        else:
            checked = check(result, strict_known=True).clauses[clause]
            first = checked.first()
            line = (f"step {first['step']}, field {first['field']}"
                    + (f", request {first['rid']}" if first.get("rid") is not None else "")
                    + f": expected {first['expected']}, got {first['actual']}"
                    if first else checked.note or "")
            status = checked.status if result.status == "finished" else (
                f"{checked.status} (run {result.status})")
            rows.append(ReleaseRow(version, status, line))
    return rows


def _fix_diff(request: ReportRequest) -> tuple[str, str] | None:
    """The fix's diff text and where it comes from (None: no fix asked for)."""
    if request.fix_diff is not None:
        return Path(request.fix_diff).read_text(), display(request.fix_diff)
    if request.fix is not None:
        from contract_lib.campaigns.export import export_patch

        return export_patch(request.fix), f"patch {request.fix}, exported"
    return None


def _fix(request: ReportRequest, finding: Finding, text: str, origin: str) -> Fix:
    """Write the fix's diff into the report folder and judge it with ``compare`` on the
    report's workload and loop (the run's patches on both sides)."""
    path = request.out / "fix.diff"
    path.write_text(text)
    patches = [f"patch={p}" for p in patch_spec(request.patch).parts] if request.patch else []
    base = ",".join(patches)
    head = ",".join([f"diff={display(path)}", *patches])
    comparison = compare(base, head, [display(request.out / "workload.toml")],
                         [request.loop], cache=request.cache, progress=False)
    table = comparison.clause_table()
    row = table[table["clause"].str.startswith(f"{finding.clause} ")
                & (table["loop"] == request.loop)]
    return Fix(text, origin, comparison, bool(len(row)) and row["change"].iloc[0] == "fixed")


def stable_frames(frames: Frames, path: Path) -> Path:
    """Save ``frames`` with wall-clock columns blanked and per-run meta (timings, cache)
    left out: the same bytes for two runs of the same input; still loadable."""
    payload = frames.to_payload()
    payload["meta"] = {k: v for k, v in payload["meta"].items() if k not in _UNSTABLE_META}
    for name, columns in WALL_CLOCK_COLUMNS.items():
        table = payload["tables"][name]
        blank = [table["columns"].index(c) for c in columns]
        table["data"] = [[None if i in blank else v for i, v in enumerate(row)]
                         for row in table["data"]]
    return write_payload(path, payload, compact=True)
