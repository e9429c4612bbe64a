"""``scripts/check-docs``: every number a reader sees comes from a run, and every name the
docs give still points at something.

Over README.md, docs/*.md and the notebooks' Markdown it checks (``--write`` fixes what a
command can fix, then checks again):

1. each generated block (:mod:`.markers`): its text still has its digest (else it was
   edited by hand), and its generator (:mod:`.generators`), run again, writes the same
   text (else it is stale); ``--needs`` caps which generators run;
2. each SGLang file:line reference still holds its code (:mod:`.sglang_lines`);
3. each path, module and test named exists (:mod:`.project_paths`);
4. ``environment.yml`` is what ``pyproject.toml`` generates (:mod:`.environment`).

Exit 0 when nothing is wrong, 1 otherwise, each problem a line naming the file and line.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from contract_lib.pages import (  # noqa: F401  (they register)
    environment,
    file_blocks,
    project_paths,
    prose,
    run_blocks,
    sglang_lines,
)
from contract_lib.pages.generators import NEEDS, generate, generator_of
from contract_lib.pages.markers import Block, MarkerError, blocks, replace
from contract_lib.paths import PROJECT_ROOT


def _needs(block: Block) -> str:
    """What running the block's generator needs; a run on another release is ``releases``."""
    needs = generator_of(block).needs
    other = any(k in block.args for k in ("sglang", "versions")) or any(
        "@" in v or "omni" in v.split(",") for v in block.args.values())
    return "releases" if needs == "runs" and other else needs


def _where(path: Path) -> Path:
    return path.relative_to(PROJECT_ROOT) if path.is_relative_to(PROJECT_ROOT) else path


def _diff(old: str, new: str) -> str:
    lines = list(difflib.unified_diff(old.splitlines(), new.splitlines(), "written",
                                      "generated", n=0, lineterm=""))[2:]
    more = "\n    ..." if len(lines) > 12 else ""
    return "\n".join("    " + line for line in lines[:12]) + more


def _check_block(block: Block, label: str, fresh: str) -> str | None:
    if block.edited():
        return (f"{label}: edited by hand (its text no longer has its digest); regenerate "
                "it with scripts/check-docs --write")
    if fresh.strip("\n") != block.text.strip("\n"):
        return f"{label}: stale; scripts/check-docs --write writes:\n" + _diff(block.text, fresh)
    return None


def check_blocks(docs: list[Path], needs: str, write: bool, least: str = "files") -> list[str]:
    """Problems of the generated blocks (and, with ``write``, regenerate them); a block
    whose generator needs more than ``needs``, or less than ``least``, is only checked
    for hand edits."""
    allowed = NEEDS[NEEDS.index(least):NEEDS.index(needs) + 1]
    problems, made = [], {}
    for doc in docs:
        text, where = doc.read_text(), _where(doc)
        updates = {}
        try:
            found = blocks(text)
        except MarkerError as error:
            problems.append(f"{where}: {error}")
            continue
        for block in found:
            label = f"{where}:{block.line}: block `{block.spec}`"
            try:
                if _needs(block) not in allowed:
                    problem = None if write else _check_block(block, label, block.text)
                else:
                    if block.spec not in made:
                        made[block.spec] = generate(block)
                    if write:
                        updates[block] = made[block.spec]
                    problem = None if write else _check_block(block, label, made[block.spec])
            except MarkerError as error:
                problem = f"{label}: {error}"
            if problem:
                problems.append(problem)
        if updates:
            doc.write_text(replace(text, updates))
    return problems


def sync_notebook(source: Path) -> None:
    """Copy a notebook source's Markdown cells into its stored ``.ipynb`` (outputs kept)."""
    import jupytext
    import nbformat

    stored_path = source.with_suffix(".ipynb")
    stored, paired = nbformat.read(stored_path, as_version=4), jupytext.read(source)
    for cell, new in zip(stored.cells, paired.cells):
        if cell.cell_type == new.cell_type == "markdown":
            cell.source = new.source
    nbformat.write(stored, stored_path)


def check_references(files: list[Path], write: bool, install: bool, add: bool) -> list[str]:
    entries = sglang_lines.load()
    findings = sglang_lines.check(files, entries, install)
    if add:
        sglang_lines.add_unknown(findings, entries)
        entries = sglang_lines.load()
        findings = sglang_lines.check(files, entries, install)
    if write and any(f.problem == "moved" for f in findings):
        for changed in sglang_lines.write(findings, entries):
            if changed.suffix == ".py":
                sync_notebook(changed)
        findings = sglang_lines.check(files, sglang_lines.load(), install)
    return [f.line(PROJECT_ROOT) for f in findings
            if install or f.problem != "not installed"]


def check_environment(write: bool) -> list[str]:
    expected = environment.render()
    if environment.ENVIRONMENT.read_text() == expected:
        return []
    if write:
        environment.ENVIRONMENT.write_text(expected)
        return []
    return ["environment.yml: differs from what pyproject.toml generates; "
            "scripts/check-docs --write rewrites it"]


def run(needs: str = "releases", write: bool = False, add: bool = False,
        least: str = "files") -> list[str]:
    """Every problem, a line each (after fixing what ``write`` can); the blocks
    regenerated are those needing from ``least`` to ``needs``."""
    docs, notebooks = prose.doc_files(), prose.notebook_sources()
    problems = check_blocks(docs, needs, write, least)
    problems += check_references(docs + notebooks, write, needs == "releases", add)
    problems += project_paths.check(docs + notebooks)
    problems += check_environment(write)
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/check-docs", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true",
                        help="regenerate blocks, move moved lines, rewrite environment.yml")
    parser.add_argument("--needs", choices=NEEDS, default="releases",
                        help="run generators needing at most this (default: all; files: "
                             "no runs, seconds)")
    parser.add_argument("--add-references", action="store_true", dest="add",
                        help="add unknown SGLang references as the venv's lines read now")
    args = parser.parse_args(argv)
    problems = run(args.needs, args.write, args.add)
    for line in problems:
        print(line)
    print(f"check-docs: {len(problems)} problem(s)" if problems else "check-docs: ok",
          file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
