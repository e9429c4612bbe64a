"""Where SGLang writes and reads a field, and where it defines a function: file and line
found in an SGLang folder's source at run time (never written down), for reports.

A field is matched as an attribute (``.kv_committed_len``; of a dotted field such as
``tp_worker._mlx_runner._req_caches``, its last part) in the package's ``srt/`` tree,
parsed with :mod:`ast`. A *write* assigns, augments or deletes it, assigns or deletes an
item of it (``buf[i] = x``), or calls a mutating method on it (``.pop``, ``.add``, ...);
anything else is a *read*. Paths are in the upstream layout (``python/sglang/srt/...``).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import re
from pathlib import Path

MUTATORS = frozenset({"add", "append", "clear", "discard", "extend", "insert", "pop",
                      "popitem", "remove", "setdefault", "update", "__setitem__",
                      "__delitem__"})


@dataclasses.dataclass(frozen=True)
class Site:
    """One line of SGLang: ``path:line`` in ``function``, and whether it writes."""

    path: str
    line: int
    function: str
    code: str
    write: bool = False

    def __str__(self) -> str:
        return f"{self.path}:{self.line} ({self.function}): {self.code}"


def sglang_root(sglang_dir: Path | None = None) -> Path:
    """The folder holding the ``sglang`` package: ``sglang_dir``, else the venv's."""
    if sglang_dir is not None:
        return Path(sglang_dir)
    spec = importlib.util.find_spec("sglang")
    return Path(list(spec.submodule_search_locations)[0]).parent


def field_sites(field: str, root: Path) -> list[Site]:
    """Every line of ``root``'s ``sglang/srt`` that writes or reads ``field``, in path
    and line order."""
    name = field.rsplit(".", 1)[-1].removesuffix("[]")
    needle = re.compile(rf"\.{re.escape(name)}\b")
    found: dict[tuple[str, int], Site] = {}
    for path, lines, tree in _parsed(str(root), needle.pattern):
        for node, parents, function in _walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == name:
                key = (path, node.lineno)
                write = _writes(node, parents) or (key in found and found[key].write)
                found[key] = Site(path, node.lineno, function,
                                  lines[node.lineno - 1].strip(), write)
    return sorted(found.values(), key=lambda s: (s.path, s.line))


def definition(name: str, root: Path) -> Site | None:
    """Where ``root``'s ``sglang/srt`` defines function ``name`` (the first, in path
    order), or None."""
    for path, lines, tree in _parsed(str(root), rf"def {re.escape(name)}\b"):
        for node, _, function in _walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                qualname = name if function == "<module>" else f"{function}.{name}"
                return Site(path, node.lineno, qualname, lines[node.lineno - 1].strip())
    return None


@functools.lru_cache(maxsize=16)
def _parsed(root: str, pattern: str) -> tuple[tuple[str, list[str], ast.Module], ...]:
    """The files under ``root/sglang/srt`` whose text matches ``pattern``, parsed."""
    needle = re.compile(pattern)
    files = []
    for path in sorted((Path(root) / "sglang" / "srt").rglob("*.py")):
        text = path.read_text(errors="replace")
        if not needle.search(text):
            continue
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        files.append((f"python/{path.relative_to(root).as_posix()}", text.splitlines(), tree))
    return tuple(files)


def _walk(tree: ast.Module):
    """``(node, parents, enclosing function's qualname)`` for every node, depth first."""
    stack: list[tuple[ast.AST, tuple[ast.AST, ...], str]] = [(tree, (), "<module>")]
    while stack:
        node, parents, function = stack.pop()
        yield node, parents, function
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = node.name if function == "<module>" else f"{function}.{node.name}"
        else:
            scope = function
        for child in reversed(list(ast.iter_child_nodes(node))):
            stack.append((child, (node, *parents[:2]), scope))


def _writes(node: ast.Attribute, parents: tuple[ast.AST, ...]) -> bool:
    """Whether the attribute ``node`` is written where it stands (see the module
    docstring); ``parents``: its parent and grandparent first."""
    if isinstance(node.ctx, (ast.Store, ast.Del)):
        return True
    parent = parents[0] if parents else None
    if isinstance(parent, ast.Subscript) and parent.value is node:
        return isinstance(parent.ctx, (ast.Store, ast.Del))
    grandparent = parents[1] if len(parents) > 1 else None
    return (isinstance(parent, ast.Attribute) and parent.value is node
            and parent.attr in MUTATORS and isinstance(grandparent, ast.Call)
            and grandparent.func is parent)
