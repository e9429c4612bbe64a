"""Source patches: change an installed SGLang function by exact snippets, as a diff would.

:func:`patch_source` takes the function's source, replaces exact snippets and recompiles
it in its own module, so each patch reads like a diff against SGLang and fails loudly when
the code it expects has moved (an unsupported release).
"""

from __future__ import annotations
import __future__

import inspect
import re
import textwrap


class PatchError(ValueError):
    """An unknown patch, or a source patch whose anchor is not in the installed code."""


def patch_source(owner: object, name: str, replacements: list[tuple[str, str]],
                 label: str) -> None:
    """Replace exact snippets in the source of ``owner.name`` and install the result.

    Each ``(old, new)`` pair is a snippet of whole lines written without its indentation;
    ``old`` must occur exactly once. The new function is compiled with the original's
    module globals, its decorators re-applied from the source.
    """
    try:
        original = inspect.getattr_static(owner, name)
    except AttributeError:
        from importlib import metadata

        raise PatchError(
            f"patch {label!r}: sglang {metadata.version('sglang')} has no "
            f"{owner.__name__}.{name}, the code this patch changes") from None
    function = inspect.unwrap(original)
    try:
        source = textwrap.dedent(inspect.getsource(function))
    except OSError as exc:
        raise PatchError(f"patch {label!r}: no source for {owner.__name__}.{name}: it was "
                         "already patched in this run (each patch applies once)") from exc
    for old, new in replacements:
        source = _replace_once(source, old, new, label, function.__qualname__)
    if "super()" in source:
        raise PatchError(f"patch {label!r}: cannot recompile {name} (uses super())")
    module = inspect.getmodule(function)
    flags = 0
    if getattr(module, "annotations", None) is __future__.annotations:
        flags |= __future__.annotations.compiler_flag
    code = compile(source, f"<patch {label}: {function.__code__.co_filename}>", "exec",
                   flags=flags, dont_inherit=True)
    # The module's own globals (not a copy), so later rebinding of a module name, e.g. a
    # capture hook, is seen by the patched function exactly as by the original.
    defined: dict[str, object] = {}
    exec(code, module.__dict__, defined)  # noqa: S102 - a reviewed patch of SGLang code
    setattr(owner, name, defined[name])


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
