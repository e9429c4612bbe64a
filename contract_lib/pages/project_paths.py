"""The project's own names in the prose: every path, module and test a doc or notebook
names in backticks must exist (a file moved or renamed leaves no stale name behind)."""

from __future__ import annotations

import re
from pathlib import Path

from contract_lib.pages.prose import line_of, regions
from contract_lib.paths import PROJECT_ROOT

_CODE = re.compile(r"`([^`\n]+)`")
_PATH = re.compile(r"(?<![\w./-])((?:contract_lib|tests|scripts|data|docs|benchmarks|notebooks"
                   r"|contrib)/[\w./-]*\w/?)")
_MODULE = re.compile(r"(?<![\w./])(contract_lib(?:\.\w+)+)")
_TEST = re.compile(r"(?<![\w./])(test_\w+)")
_TEMPLATE = ("<", "*", "{", "...", "[")


def _defined_tests(root: Path) -> set[str]:
    return {m for path in (root / "tests").rglob("*.py")
            for m in re.findall(r"^\s*def (test_\w+)", path.read_text(), re.MULTILINE)}


def _module_problem(dotted: str, root: Path) -> str | None:
    """Why ``dotted`` names no module (and attributes of it) of the package, or None."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = root.joinpath(*parts[:cut])
        source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if source.is_file():
            text = source.read_text()
            missing = [p for p in parts[cut:] if not re.search(rf"\b{p}\b", text)]
            return f"{'.'.join(parts[:cut])} has no {missing[0]}" if missing else None
    return "no such module"


def _shown(path: Path, root: Path) -> Path:
    return path.relative_to(root) if path.is_relative_to(root) else path


def check(files: list[Path], root: Path = PROJECT_ROOT) -> list[str]:
    """A line per name that does not exist: ``FILE:LINE: `name`: why``."""
    tests = _defined_tests(root)
    problems = []
    for path in files:
        text = path.read_text()
        for start, end in regions(path, text):
            for span in _CODE.finditer(text, start, end):
                code, where = span.group(1), f"{_shown(path, root)}:{line_of(text, span.start())}"
                for name in _PATH.findall(code):
                    if not any(t in code for t in _TEMPLATE) and not (root / name).exists():
                        problems.append(f"{where}: `{name}`: no such file or folder")
                for dotted in _MODULE.findall(code):
                    why = _module_problem(dotted, root)
                    if why:
                        problems.append(f"{where}: `{dotted}`: {why}")
                for name in _TEST.findall(code):
                    if name not in tests and not (root / "tests" / f"{name}.py").exists():
                        problems.append(f"{where}: `{name}`: no such test in tests/")
    return problems
