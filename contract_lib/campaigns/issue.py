"""A measured finding (:class:`contract_lib.campaigns.upstream_report.Finding`) written as an SGLang
issue: the bug template's sections (checklist, describe the bug, reproduction,
environment), the fix and its judgement, the regression test; and its files.

The report folder holds ``issue.md``, ``workload.toml``, ``fix.diff`` (with a fix),
``test_<slug>.py``, ``frames/`` (the run, and the fixed run) and ``figure.png``. Every
number and line is taken from the finding; paths are relative to the working directory.
"""

from __future__ import annotations

import dataclasses
import platform
import re
import shlex
from importlib import metadata
from pathlib import Path
from typing import Callable

from contract_lib import loops
from contract_lib.campaigns.regression import PytestRun, destination, render_test, run_test
from contract_lib.campaigns.upstream_report import (
    Finding,
    ReportRequest,
    display,
    measure,
    stable_frames,
)
from contract_lib.contract import CLAUSES, check, origin, violation_message
from contract_lib.sources.sites import Site

SHOWN_SITES = 6  # writers and readers listed per field
DETAILED_SITES = 40  # lines on the loop's path listed per field in a <details>
OTHER = 9  # the rank of a line off the loop's path

# Draws a clause's figure: (frames, report, *other frames, labels=...) -> a matplotlib
# Figure or None; the caller passes :func:`contract_lib.views.triage.clause_view` (views sit
# above campaigns, so a campaign takes its drawing rather than importing it).
DrawClause = Callable[..., object]


@dataclasses.dataclass
class Written:
    """The report's files, and what the command says and exits with."""

    issue: Path
    title: str
    lines: list[str]
    exit_code: int

    def summary(self) -> list[str]:
        return self.lines


def write_report(request: ReportRequest, draw: DrawClause) -> Written:
    """Measure the finding (:func:`contract_lib.campaigns.upstream_report.measure`) and write the
    report's files into ``request.out``, its figure drawn by ``draw``."""
    return write_files(measure(request), draw)


def slug_of(finding: Finding) -> str:
    if finding.bug is not None:
        return finding.bug["id"].replace("-", "_")
    return f"clause_{finding.clause}_{finding.request.loop}"


def write_files(finding: Finding, draw: DrawClause) -> Written:
    """Write every file of the report; the exit code is 0 when the clause is red and,
    with a fix, green with it (``compare`` and the test agree), else 1."""
    out = finding.request.out
    slug = slug_of(finding)
    mlx = loops.spec(finding.request.loop).mlx
    fixed = finding.fix.comparison.runs[next(iter(finding.fix.comparison.runs))][1] \
        if finding.fix else None
    (out / "frames").mkdir(exist_ok=True)
    stem = f"{finding.frames.meta['workload']}.{finding.request.loop}"
    frames_files = [stable_frames(finding.frames, out / "frames" / f"{stem}.json")]
    if fixed is not None:
        frames_files.append(stable_frames(fixed, out / "frames" / f"{stem}.fixed.json"))
    figure = _figure(finding, fixed, out / "figure.png", draw)
    test = out / f"test_{slug}.py"
    others = sorted(n for n in check(fixed, strict_known=True).failing()
                    if n != finding.clause) if fixed is not None else []
    whole = fixed is not None and check(fixed, strict_known=True).ok
    test.write_text(render_test(
        title=_title(finding).removeprefix("[Bug] "), slug=slug, loop=finding.request.loop,
        mlx=mlx, clause=finding.clause, workload=(out / "workload.toml").read_text(),
        patch=finding.patch, failure_line=violation_message(finding.result.first()),
        whole=whole, others=others, fix_name="fix.diff" if fixed is not None else None))
    where = destination(mlx, slug)
    red = run_test(test, where)
    green = run_test(test, where, out / "fix.diff") if finding.fix else None
    text = _markdown(finding, slug, where, frames_files, figure, test, red, green)
    issue = out / "issue.md"
    issue.write_text(text)
    ok = red.code == 1 and (finding.fix is None or (finding.fix.fixed and green.code == 0))
    lines = [f"report written to {display(issue)}: clause {finding.clause} "
             f"({CLAUSES[finding.clause]}) on {finding.request.loop}",
             f"regression test {display(test)}: without the fix exit {red.code} "
             f"({red.summary})" + (f", with it exit {green.code} ({green.summary})"
                                   if green else "")]
    if finding.fix:
        lines.append(_compare_line(finding))
    return Written(issue, _title(finding), lines, 0 if ok else 1)


def _title(finding: Finding) -> str:
    if finding.bug is not None and finding.bug.get("title"):
        return finding.bug["title"]
    first = finding.result.first()
    tag = "[MLX] " if loops.spec(finding.request.loop).mlx else ""
    return (f"[Bug] {tag}{first['field']} breaks the per-step contract's clause "
            f"{finding.clause} ({CLAUSES[finding.clause]}) on {finding.request.loop}")


def _figure(finding: Finding, fixed, path: Path, draw: DrawClause) -> Path | None:
    """The reported clause's own view, drawn by ``draw``: the run beside the fixed run."""
    only = dataclasses.replace(finding.report,
                               clauses={finding.clause: finding.result})
    version = finding.frames.meta["sglang_version"]
    runs, labels = ([fixed], [f"sglang {version} + fix.diff"]) if fixed is not None else ([], [])
    figure = draw(finding.frames, only, *runs, labels=[f"sglang {version}", *labels])
    if figure is None:
        return None
    figure.savefig(path, dpi=90, metadata={"Software": None})
    return path


def _command(finding: Finding, *words: str) -> str:
    patches = [w for p in (finding.request.patch or []) for w in ("--patch", p)]
    return shlex.join(["python", "-m", "contract_lib", *words, *patches])


def _compare_line(finding: Finding) -> str:
    return finding.fix.comparison.text().splitlines()[-1]


def _markdown(finding: Finding, slug: str, where: str, frames_files: list[Path],
              figure: Path | None, test: Path, red: PytestRun,
              green: PytestRun | None) -> str:
    request, first = finding.request, finding.result.first()
    out = request.out
    workload = display(out / "workload.toml")
    report_args = ["report", "--loop", request.loop, "--workload", request.workload]
    if request.fix:
        report_args += ["--fix", request.fix]
    if request.fix_diff:
        report_args += ["--fix-diff", display(request.fix_diff)]
    if request.shrink:
        report_args.append("--shrink")
    if request.clause is not None:
        report_args += ["--clause", str(request.clause)]
    for version in request.releases or ():
        report_args += ["--release", version]
    lines = [f"# {_title(finding)}", "",
             f"<!-- written by `{_command(finding, *report_args, '--out', display(out))}`; "
             "regenerated, it gives the same bytes -->", "",
             "## Checklist", "",
             "- [x] I searched related issues (see *Related upstream* below).",
             "- [x] The bug persists in the latest version: measured on "
             f"{_affected_text(finding)} (see *Releases affected*).",
             "- [x] Environment info and a minimal reproducible demo are below.",
             "- [x] Please use English.", "",
             "## Describe the bug", ""]
    if finding.bug is not None:
        lines += [finding.bug["symptom"][0].upper() + finding.bug["symptom"][1:] + ".", ""]
    lines += _violation(finding, first)
    lines += _sites(finding)
    lines += _releases(finding)
    lines += _related(finding)
    check_words = ["check", "--loop", request.loop, "--workload", workload]
    lines += ["## Reproduction", "",
              "The workload (requests, prompts as token ids, the loop iteration each "
              f"arrives at), `{workload}`" + (f", the smallest the search found "
                                              f"(`{finding.shrunk}`)" if finding.shrunk
                                              else "") + ":", "", "```toml",
              (out / "workload.toml").read_text().rstrip(), "```", "",
              "With contract_lib installed (`pip install -e .` in its checkout; it drives "
              "SGLang's real scheduler loops with only the model forward replaced: no "
              "weights, no accelerator):", "", "```bash",
              _command(finding, *check_words, "--strict-known"), "```", "",
              f"exits {finding.report.verdict().code}: "
              f"`{finding.report.verdict().line()}`"]
    lenient = check(finding.frames)
    if finding.clause in lenient.known:
        lines += ["", f"Without `--strict-known` it exits {lenient.verdict().code}: this "
                  "project catalogues the bug and reports it as known upstream "
                  f"(`{lenient.known[finding.clause][0].line()}`)."]
    lines += ["", "Frames of the run (load with `contract_lib.Frames.load`; wall-clock "
              "columns blanked): " + ", ".join(f"`{display(p)}`" for p in frames_files)
              + "."]
    if figure is not None:
        lines += ["", f"![clause {finding.clause} on {request.loop}]({figure.name})"]
    lines += [""]
    lines += _fix(finding)
    lines += _test(finding, where, test, red, green)
    lines += _environment(finding)
    return "\n".join(line.rstrip() for line in lines).rstrip() + "\n"


def _affected_text(finding: Finding) -> str:
    return f"SGLang {finding.frames.meta['sglang_version']}"


def _violation(finding: Finding, first: dict) -> list[str]:
    violations = finding.result.violations
    last_step = int(violations["step"].max())
    at_last = sorted(str(r) for r in violations.loc[violations["step"] == last_step, "rid"]
                     .dropna().unique())
    fields = ", ".join(f"`{f}`" for f in dict.fromkeys(violations["field"]))
    return [f"Clause {finding.clause} (*{CLAUSES[finding.clause]}*, "
            f"{origin(finding.clause)}) of the per-step contract is violated on the "
            f"`{finding.request.loop}` loop "
            f"(`{loops.spec(finding.request.loop).function}`):", "",
            f"> {violation_message(first)}", "",
            "| clause | field | step | request | expected | actual |",
            "|---|---|---|---|---|---|",
            f"| {finding.clause} | `{first['field']}` | {first['step']} | "
            f"{first['rid'] if first['rid'] is not None else '-'} | {first['expected']} | "
            f"{first['actual']} |", "",
            f"{_count(len(violations), 'violation')} at "
            f"{_count(violations['step'].nunique(), 'step')}, "
            f"field{'s' if fields.count('`') > 2 else ''} {fields}; at the last of them "
            f"(step {last_step})"
            + (f", request{'s' if len(at_last) > 1 else ''} {', '.join(at_last)}."
               if at_last else "."), ""]


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _sites(finding: Finding) -> list[str]:
    version = finding.frames.meta["sglang_version"]
    lines = [f"### Where in SGLang {version}", "",
             "Found in the installed source when this report was written:", ""]
    if finding.loop_site is not None:
        lines += [f"- the loop: `{finding.loop_site.path}:{finding.loop_site.line}` "
                  f"(`{finding.loop_site.function}`)"]
    for field, sites in finding.sites.items():
        for kind, chosen in (("writes", [s for s in sites if s.write]),
                             ("reads", [s for s in sites if not s.write])):
            ranked = sorted(chosen, key=lambda s: (_rank(s, finding.request.loop),
                                                   s.path, s.line))
            shown = "; ".join(f"`{s.path}:{s.line}` (`{s.function}`)"
                              for s in ranked[:SHOWN_SITES])
            more = f"; and {len(ranked) - SHOWN_SITES} more" if len(ranked) > SHOWN_SITES else ""
            lines.append(f"- `{field.rsplit('.', 1)[-1]}` {kind} ({len(ranked)}): "
                         f"{shown or 'none'}{more}")
    lines += ["", "<details><summary>the lines on the loop's path</summary>", "", "```"]
    for field, sites in finding.sites.items():
        near = [s for s in sites if _rank(s, finding.request.loop) < OTHER]
        shown = near[:DETAILED_SITES]
        elsewhere = len(sites) - len(near)
        lines += [f"{field}:"] + [f"  {'W' if s.write else 'R'} {s}" for s in shown]
        if len(near) > len(shown):
            lines.append(f"  ... and {len(near) - len(shown)} more there")
        if elsewhere:
            lines.append(f"  ({elsewhere} more elsewhere in srt/: other backends, "
                         "speculative decoding, disaggregation, ...)")
    return lines + ["```", "", "</details>", ""]


def _rank(site: Site, loop: str) -> int:
    """Sites on the loop's own path first: the MLX backend (for an MLX loop), then the
    scheduler's managers and the memory cache; then the rest."""
    first = ("hardware_backend/mlx/",) if loops.spec(loop).mlx else ()
    for rank, part in enumerate((*first, "managers/", "mem_cache/")):
        if f"/srt/{part}" in site.path:
            return rank
    return OTHER


def _releases(finding: Finding) -> list[str]:
    lines = ["### Releases affected", "",
             "The same check (`--strict-known`) on "
             + ("the releases asked for:" if finding.request.releases
                else "every supported release:"),
             "",
             f"| SGLang | clause {finding.clause} | first violation |", "|---|---|---|"]
    lines += [f"| {row.version} | {row.status} | {row.line} |" for row in finding.releases]
    return lines + [""]


def _related(finding: Finding) -> list[str]:
    if finding.bug is None:
        return ["### Related upstream", "", "No catalogued upstream report matches "
                "(`data/bugs.toml`).", ""]
    lines = ["### Related upstream", ""]
    lines += [f"- {_linked(pr)}" for pr in finding.bug["prs"]]
    if finding.bug.get("adds"):
        lines += ["", f"What this report adds: {finding.bug['adds']}"]
    return lines + [""]


def _linked(text: str) -> str:
    """``#40046 (open)`` with the number linked to SGLang's tracker."""
    return re.sub(r"#(\d+)", r"[#\1](https://github.com/sgl-project/sglang/issues/\1)", text)


def _fix(finding: Finding) -> list[str]:
    if finding.fix is None:
        return ["## Proposed fix", "", "None yet.", ""]
    fix, out = finding.fix, finding.request.out
    table = fix.comparison.clause_table()
    row = table[table["clause"].str.startswith(f"{finding.clause} ")
                & (table["loop"] == finding.request.loop)].iloc[0]
    head = ",".join([f"diff={display(out / 'fix.diff')}",
                     *(f"patch={p}" for p in (finding.request.patch or []))])
    command = shlex.join(["python", "-m", "contract_lib", "compare", "--head", head,
                          "--loop", finding.request.loop, display(out / "workload.toml")])
    return ["## Proposed fix", "",
            f"`{display(out / 'fix.diff')}` ({fix.origin}; `git apply` it at the "
            "repository root):", "", "```diff", fix.diff.rstrip(), "```", "",
            "Judged by contract_lib's `compare` (the unpatched release as base, the diff "
            "applied as head, the same workload):", "", "```bash", command, "```", "",
            f"clause {finding.clause} on {finding.request.loop}: {row['base']} -> "
            f"{row['head']} ({row['change']}); `{_compare_line(finding)}`", ""]


def _test(finding: Finding, where: str, test: Path, red: PytestRun,
          green: PytestRun | None) -> list[str]:
    lines = ["## Regression test", "",
             f"`{display(test)}`, to go to `{where}` (SGLang's layout; it uses contract_lib's "
             "pytest plugin, the `contract_run` fixture, and is skipped without it). "
             "Measured with pytest:", "",
             f"- as released: exit {red.code} ({red.summary})"
             + (f": `{red.failure}`" if red.failure else "")]
    if green is not None:
        lines.append(f"- with `{display(finding.request.out / 'fix.diff')}` applied "
                     f"(`pytest {where} --contract-diff fix.diff`): exit {green.code} "
                     f"({green.summary})" + (f": `{green.failure}`" if green.failure else ""))
    return lines + [""]


def _environment(finding: Finding) -> list[str]:
    meta = finding.frames.meta

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    runner = ("the model forward replaced by contract_lib's deterministic next-token "
              "function" + ("; MLX on its CPU backend" if loops.spec(meta["loop"]).mlx else ""))
    return ["## Environment", "",
            "Not `python3 -m sglang.check_env` (this machine has no GPU): measured with "
            "contract_lib, no model weights, no accelerator.", "",
            f"- SGLang {meta['sglang_version']}, loop `{meta['loop']}` "
            f"(`{loops.spec(meta['loop']).function}`), {runner}",
            f"- Python {platform.python_version()}, {platform.system()} "
            f"{platform.machine()}; torch {version('torch')}, mlx {version('mlx')}, "
            f"mlx-lm {version('mlx-lm')}",
            f"- contract_lib {version('contract_lib')}"]
