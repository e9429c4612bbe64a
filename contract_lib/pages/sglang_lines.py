"""SGLang file:line references in the docs, resolved against the installed source.

Every ``path.py:N`` (or ``:N-M``, or a bare ``:N`` after one in the same paragraph, list
item or table row) in the prose must be an entry of ``docs/sglang-lines.toml``: its file
(under a root: the venv's site-packages, an installed release, sglang-omni), its line and
the code that line holds. A check finds the code at the line, or elsewhere in the file
(the line moved: :func:`write` moves the number in the table and every doc), or nowhere.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import tomllib
from pathlib import Path

from contract_lib.pages.prose import line_of, units
from contract_lib.paths import PROJECT_ROOT

TABLE = PROJECT_ROOT / "docs" / "sglang-lines.toml"
VENV = "venv"

_FULL = re.compile(r"(?<![\w/.-])(?P<path>(?:[\w.-]+/)*[\w-]+\.py):(?P<line>\d+)"
                   r"(?:-(?P<end>\d+))?(?![\d.])")
_BARE = re.compile(r"(?<=[\s(/,;`]):(?P<line>\d+)(?:-(?P<end>\d+))?(?![\d.])")


@dataclasses.dataclass
class Entry:
    """One line a doc names: where it is, and the code it holds."""

    file: str  # relative to the root: "sglang/srt/managers/scheduler.py"
    line: int
    code: str
    root: str = VENV  # VENV, "sglang==VERSION" or "sglang-omni"

    def matches(self, written: str, line: int) -> bool:
        return line == self.line and (self.file == written or self.file.endswith("/" + written))


@dataclasses.dataclass
class Ref:
    """A reference in a doc: the number's offsets, the path as written (or inherited)."""

    doc: Path
    line_in_doc: int
    path: str
    line: int
    span: tuple[int, int]  # offsets of the line number (and of a range's end) in the doc
    end: int | None = None


@dataclasses.dataclass
class Finding:
    ref: Ref | None
    entry: Entry | None
    problem: str  # "unknown", "ambiguous", "moved", "gone", "not installed", "no file"
    detail: str = ""
    moved_to: int | None = None

    def line(self, root: Path) -> str:
        doc = self.ref.doc if self.ref else TABLE
        where = doc.relative_to(root) if doc.is_relative_to(root) else doc
        where = f"{where}:{self.ref.line_in_doc}" if self.ref else f"{where}"
        said = (f"{self.ref.path}:{self.ref.line}" if self.ref
                else f"{self.entry.file}:{self.entry.line}")
        return f"{where}: SGLang reference `{said}`: {self.problem}: {self.detail}"


def load(table: Path | None = None) -> list[Entry]:
    return [Entry(**e) for e in tomllib.loads((table or TABLE).read_text()).get("line", [])]


def save(entries: list[Entry], table: Path | None = None) -> None:
    table = table or TABLE
    head = table.read_text().split("[[line]]", 1)[0]
    body = "".join(f'[[line]]\nroot = "{e.root}"\nfile = "{e.file}"\nline = {e.line}\n'
                   f"code = {_toml_string(e.code)}\n\n"
                   for e in sorted(entries, key=lambda e: (e.root, e.file, e.line)))
    table.write_text(head + body.rstrip("\n") + "\n")


def _toml_string(text: str) -> str:
    if "'" not in text:
        return f"'{text}'"
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def refs(doc: Path) -> list[Ref]:
    """Every file:line reference of a doc's prose, a bare ``:N`` taking the file of the
    last full reference of its paragraph, list item or table row."""
    text = doc.read_text()
    found = []
    for start, end in units(doc, text):
        unit, current = text[start:end], None
        matches = sorted([(m.start(), "full", m) for m in _FULL.finditer(unit)]
                         + [(m.start(), "bare", m) for m in _BARE.finditer(unit)])
        for _, kind, match in matches:
            if kind == "full":
                current = match["path"]
            span = (start + match.start("line"), start + match.end())
            found.append(Ref(doc, line_of(text, span[0]), current or "", int(match["line"]),
                             span, int(match["end"]) if match["end"] else None))
    return found


def root_dir(root: str, install: bool = False, package: str = "sglang") -> Path | None:
    """The folder a root's files (of top-level ``package``) are relative to; None when it
    is not installed (and ``install`` is false)."""
    if root == VENV:
        spec = importlib.util.find_spec(package)
        return Path(spec.submodule_search_locations[0]).parent if spec else None
    if root.startswith("sglang=="):
        from contract_lib.sources import versions

        version = root.split("==", 1)[1]
        if install:
            return versions.sglang_path(version) or root_dir(VENV)
        folder = versions.release_folder(version)
        return folder if (folder / "sglang").is_dir() else None
    if root == "sglang-omni":
        from contract_lib.sources import omni_release

        folder = omni_release.omni_path() if install else omni_release.omni_folder()
        return folder if (folder / "sglang_omni").is_dir() else None
    raise ValueError(f"{TABLE.name}: unknown root {root!r}")


def locate(entry: Entry, folder: Path) -> tuple[str, int | None]:
    """("ok", line), ("moved", new line), ("gone", None) or ("no file", None)."""
    path = folder / entry.file
    if not path.is_file():
        return "no file", None
    lines = path.read_text().splitlines()
    if entry.line <= len(lines) and entry.code in lines[entry.line - 1]:
        return "ok", entry.line
    hits = [i + 1 for i, text in enumerate(lines) if entry.code in text]
    if not hits:
        return "gone", None
    return "moved", min(hits, key=lambda n: abs(n - entry.line))


def check(docs: list[Path], entries: list[Entry], install: bool = False) -> list[Finding]:
    """What is wrong with each reference of ``docs`` and each entry they use."""
    findings, used = [], {}
    for ref in (r for doc in docs for r in refs(doc)):
        if not ref.path:
            findings.append(Finding(ref, None, "no file", "a bare line number with no "
                                    "file:line before it in its paragraph; name the file"))
            continue
        hits = [e for e in entries if e.matches(ref.path, ref.line)]
        if len(hits) != 1:
            problem = "unknown" if not hits else "ambiguous"
            findings.append(Finding(ref, None, problem, f"{len(hits)} entries of "
                                    f"{TABLE.name} match; name the file fully, or add the "
                                    "line with `scripts/check-docs --add-references`"))
            continue
        used.setdefault(id(hits[0]), (hits[0], []))[1].append(ref)
    folders: dict[tuple[str, str], Path | None] = {}
    for entry, where in used.values():
        key = (entry.root, entry.file.split("/", 1)[0])
        if key not in folders:
            folders[key] = root_dir(entry.root, install, package=key[1])
        folder = folders[key]
        if folder is None:
            findings.append(Finding(where[0], entry, "not installed",
                                    f"{entry.root} (scripts/check-docs installs it)"))
            continue
        state, line = locate(entry, folder)
        if state != "ok":
            detail = {"moved": f"`{entry.code}` is now at line {line}",
                      "gone": f"`{entry.code}` is no longer in {entry.file}",
                      "no file": f"{entry.file} is not in {entry.root}"}[state]
            findings += [Finding(ref, entry, state, detail, line) for ref in where]
    return findings


def write(findings: list[Finding], entries: list[Entry], table: Path | None = None
          ) -> list[Path]:
    """Move every moved line's number in the docs and the table; the docs changed."""
    edits: dict[Path, list[tuple[tuple[int, int], str]]] = {}
    for finding in (f for f in findings if f.problem == "moved"):
        ref, delta = finding.ref, finding.moved_to - finding.entry.line
        number = f"{ref.line + delta}" + (f"-{ref.end + delta}" if ref.end else "")
        edits.setdefault(ref.doc, []).append((ref.span, number))
    moves = {(f.entry.root, f.entry.file, f.entry.line): f.moved_to
             for f in findings if f.problem == "moved"}
    for entry in entries:
        entry.line = moves.get((entry.root, entry.file, entry.line), entry.line)
    for doc, changes in edits.items():
        text = doc.read_text()
        for (start, end), number in sorted(set(changes), reverse=True):
            text = text[:start] + number + text[end:]
        doc.write_text(text)
    save(entries, table)
    return sorted(edits)


def _venv_file(folder: Path, written: str) -> Path | None:
    """The venv file a written path names: under ``sglang/srt/`` (the docs' convention),
    ``sglang/`` or ``torch/``, else the one file of ``sglang/srt`` (then of ``sglang``,
    ``torch``) it is a suffix of."""
    for base in ("sglang/srt", "sglang", "torch"):
        if (folder / base / written).is_file():
            return folder / base / written
    for base in ("sglang/srt", "sglang", "torch"):
        files = [p for p in (folder / base).rglob(Path(written).name)
                 if p.as_posix().endswith("/" + written)]
        if files:
            return files[0] if len(files) == 1 else None
    return None


def add_unknown(findings: list[Finding], entries: list[Entry]) -> list[Entry]:
    """Entries for the unknown references whose path names one file of the venv's SGLang
    or torch, holding the line's current code (to be reviewed: is it the line meant?)."""
    folder = root_dir(VENV)
    added = []
    for finding in (f for f in findings if f.problem == "unknown"):
        ref = finding.ref
        path = _venv_file(folder, ref.path)
        lines = path.read_text().splitlines() if path else []
        if ref.line > len(lines) or not lines[ref.line - 1].strip():
            continue
        entry = Entry(path.relative_to(folder).as_posix(), ref.line, lines[ref.line - 1].strip())
        if not any(e.file == entry.file and e.line == entry.line for e in entries + added):
            added.append(entry)
    save(entries + added)
    return added
