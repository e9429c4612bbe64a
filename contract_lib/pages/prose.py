"""The prose of the docs and notebooks a reader sees, as text with offsets: which files
are checked, where their prose is (not code), and its units (a paragraph, a list item,
a table row)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

from contract_lib.paths import PROJECT_ROOT


def doc_files(root: Path = PROJECT_ROOT) -> list[Path]:
    """README.md and docs/*.md, the Markdown a reader opens."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def notebook_sources(root: Path = PROJECT_ROOT) -> list[Path]:
    """The notebooks' py:percent sources (their Markdown cells are prose)."""
    return sorted((root / "notebooks").glob("[0-9][0-9]-*.py"))


def regions(path: Path, text: str) -> list[tuple[int, int]]:
    """(start, end) offsets of the prose of ``text``: a Markdown file outside fenced code;
    a notebook source's Markdown cells."""
    out, start, offset = [], 0, 0
    in_prose = path.suffix == ".md"
    for line in text.splitlines(keepends=True):
        if path.suffix == ".md" and line.lstrip().startswith("```"):
            if in_prose:
                out.append((start, offset))
            in_prose, start = not in_prose, offset + len(line)
        elif path.suffix == ".py" and line.startswith("# %%"):
            if in_prose:
                out.append((start, offset))
            in_prose, start = "[markdown]" in line, offset + len(line)
        offset += len(line)
    if in_prose:
        out.append((start, offset))
    return out


_ITEM = re.compile(r"^\s*(?:[-*]|\d+\.)\s")


def units(path: Path, text: str) -> Iterator[tuple[int, int]]:
    """(start, end) of each paragraph, list item and table row of the prose."""
    for begin, finish in regions(path, text):
        start = offset = begin
        for line in text[begin:finish].splitlines(keepends=True):
            body = line[1:] if path.suffix == ".py" and line.startswith("#") else line
            blank, row = not body.strip(), body.lstrip().startswith("|")
            if blank or row or _ITEM.match(body):  # a unit ends before this line
                if offset > start:
                    yield start, offset
                start = offset
            offset += len(line)
            if blank or row:  # a blank line is no unit; a row is one
                if row:
                    yield start, offset
                start = offset
        if offset > start:
            yield start, offset


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1
