"""Source patches: change an installed SGLang function by exact snippets, as a diff would.

:func:`patch_source` takes the function's source, replaces exact snippets and recompiles
it in its own module, so each patch reads like a diff against SGLang and fails loudly when
the code it expects has moved (an unsupported release). A replacement may add a function
beside the one it edits (a new method, as a diff adds one). The patched source stays
readable (``inspect.getsource``), so a later patch can edit it again, and
:mod:`contract_lib.campaigns.export` can write the same edits as an upstream diff.
"""

from __future__ import annotations
import __future__

import ast
import inspect
import linecache
import re
import textwrap
from typing import Callable


class PatchError(ValueError):
    """An unknown patch, or a source patch whose anchor is not in the installed code."""


def patch_source(owner: object, name: str, replacements: list[tuple[str, str]],
                 label: str) -> None:
    """Replace exact snippets in the source of ``owner.name`` and install the result.

    Each ``(old, new)`` pair is a snippet of whole lines written without its indentation;
    ``old`` must occur exactly once. The new function is compiled with the original's
    module globals, its decorators re-applied from the source; a function the new source
    adds beside it is installed on ``owner`` too (one ``owner`` already has is an error).
    """
    function, source = function_source(owner, name, label)
    source = edited(source, replacements, label, function.__qualname__)
    added = added_names(source, owner, name, label)
    module = inspect.getmodule(function)
    flags = 0
    if getattr(module, "annotations", None) is __future__.annotations:
        flags |= __future__.annotations.compiler_flag
    filename = f"<patch {label}: {function.__code__.co_filename} ({function.__qualname__})>"
    code = compile(source, filename, "exec", flags=flags, dont_inherit=True)
    # Readable by inspect (a later patch edits the patched text); never checked against disk.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    # The module's own globals (not a copy), so later rebinding of a module name, e.g. a
    # capture hook, is seen by the patched function exactly as by the original.
    defined: dict[str, object] = {}
    exec(code, module.__dict__, defined)  # noqa: S102 - a reviewed patch of SGLang code
    for key in (name, *added):
        setattr(owner, key, defined[key])


def function_source(owner: object, name: str, label: str) -> tuple[Callable, str]:
    """``owner.name`` unwrapped, and its source without its common indentation."""
    try:
        original = inspect.getattr_static(owner, name)
    except AttributeError:
        from importlib import metadata

        raise PatchError(
            f"patch {label!r}: sglang {metadata.version('sglang')} has no "
            f"{owner.__name__}.{name}, the code this patch changes") from None
    function = inspect.unwrap(original)
    try:
        return function, textwrap.dedent(inspect.getsource(function))
    except OSError as exc:
        raise PatchError(f"patch {label!r}: no source for {owner.__name__}.{name}") from exc


def edited(source: str, replacements: list[tuple[str, str]], label: str, where: str) -> str:
    """``source`` with each ``(old, new)`` replaced once (see :func:`patch_source`)."""
    for old, new in replacements:
        source = _replace_once(source, old, new, label, where)
    if "super()" in source:
        raise PatchError(f"patch {label!r}: cannot recompile {where} (uses super())")
    return source


def added_names(source: str, owner: object, name: str, label: str) -> list[str]:
    """The functions ``source`` defines besides ``name``, none of which ``owner`` has."""
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise PatchError(f"patch {label!r}: {name} does not compile after the patch "
                         f"({exc.msg}, line {exc.lineno})") from None
    names = [node.name for node in tree.body
             if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if name not in names:
        raise PatchError(f"patch {label!r}: the patched source no longer defines {name}")
    added = [n for n in names if n != name]
    taken = [n for n in added if hasattr(owner, n)]
    if taken:
        raise PatchError(f"patch {label!r}: adds {', '.join(taken)}, which "
                         f"{owner.__name__} already has")
    return added


def _replace_once(source: str, old: str, new: str, label: str, where: str) -> str:
    """Replace the one occurrence of ``old`` in ``source``. A snippet of whole lines
    (ending in a newline) is written without its indentation and matched at whatever
    indentation it sits, ``new`` taking the same; any other snippet matches verbatim."""
    if old.endswith("\n"):
        common = min(len(line) - len(line.lstrip(" "))
                     for line in old.splitlines() if line.strip())
        old, new = (
            "".join(line[common:] for line in text.splitlines(keepends=True))
            for text in (old, new))
        hits = []
        for width in range(0, 41, 4):
            candidate = textwrap.indent(old, " " * width)
            for match in re.finditer("(?m)^" + re.escape(candidate), source):
                hits.append((match.start(), match.end(), textwrap.indent(new, " " * width)))
    else:
        hits = [(m.start(), m.end(), new) for m in re.finditer(re.escape(old), source)]
    if len(hits) != 1:
        raise PatchError(
            f"patch {label!r}: expected one occurrence of {old.strip()[:60]!r} in {where}, "
            f"found {len(hits)}; the installed SGLang differs from the release this patch "
            "was written for")
    start, end, replacement = hits[0]
    return source[:start] + replacement + source[end:]
