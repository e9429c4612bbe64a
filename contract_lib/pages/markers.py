"""Generated blocks in Markdown: found between markers, each with the digest of its text.

A block is ``<!-- begin generated: NAME key=value ... digest=D -->`` then the text its
generator wrote, then ``<!-- end generated -->``; on its own lines (a table) or inline in
a sentence (a number). ``D`` is the digest of the text as written: a block whose text no
longer has it was edited by hand, which shows without running anything.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re

_BEGIN = re.compile(r"<!-- begin generated: (?P<spec>[^>]*?) digest=(?P<digest>[0-9a-f]*) -->")
_END = "<!-- end generated -->"


class MarkerError(ValueError):
    """A begin marker without its end, or a spec that is not ``NAME key=value ...``."""


@dataclasses.dataclass(frozen=True)
class Block:
    """One generated block of a file: where its text starts and ends, and its spec."""

    line: int  # 1-based line of the begin marker
    spec: str  # "NAME key=value ..."
    digest: str  # as written in the marker
    start: int  # offset of the begin marker
    end: int  # offset just after the end marker
    text: str  # what sits between the markers, without the surrounding newlines
    inline: bool  # the markers sit inside a line

    @property
    def name(self) -> str:
        return self.spec.split(" ", 1)[0]

    @property
    def args(self) -> dict[str, str]:
        """The spec's ``key=value`` words."""
        words = self.spec.split()[1:]
        bad = [w for w in words if "=" not in w]
        if bad:
            raise MarkerError(f"block {self.spec!r}: {bad[0]!r} is not key=value")
        return dict(w.split("=", 1) for w in words)

    def edited(self) -> bool:
        """Whether the text differs from what the digest says was generated."""
        return digest(self.text) != self.digest


def digest(text: str) -> str:
    """The first 12 hex digits of the text's sha256."""
    return hashlib.sha256(text.strip().encode()).hexdigest()[:12]


def blocks(text: str) -> list[Block]:
    """Every generated block of ``text``, in order (a begin marker without ``digest=``,
    which would otherwise be skipped silently, is a :class:`MarkerError`)."""
    begins = [m.start() for m in re.finditer(re.escape("<!-- begin generated:"), text)]
    well_formed = {m.start() for m in _BEGIN.finditer(text)}
    for start in begins:
        if start not in well_formed:
            raise MarkerError(f"line {text.count(chr(10), 0, start) + 1}: a begin marker "
                              "without ' digest=... -->' (write 'digest=' to have it made)")
    found = []
    for match in _BEGIN.finditer(text):
        close = text.find(_END, match.end())
        nested = _BEGIN.search(text, match.end())
        line = text.count("\n", 0, match.start()) + 1
        if close < 0 or (nested and nested.start() < close):
            raise MarkerError(f"line {line}: block {match['spec']!r} has no {_END}")
        inner = text[match.end():close]
        inline = "\n" not in inner
        found.append(Block(line, match["spec"].strip(), match["digest"], match.start(),
                           close + len(_END), inner.strip("\n") if not inline else inner,
                           inline))
    return found


def render(block: Block, text: str) -> str:
    """The block's markers around ``text``, with its digest."""
    head = f"<!-- begin generated: {block.spec} digest={digest(text)} -->"
    if block.inline:
        return f"{head}{text}{_END}"
    return f"{head}\n{text.strip(chr(10))}\n{_END}"


def replace(text: str, updates: dict[Block, str]) -> str:
    """``text`` with each block's text replaced (blocks from :func:`blocks` of ``text``)."""
    for block in sorted(updates, key=lambda b: b.start, reverse=True):
        text = text[:block.start] + render(block, updates[block]) + text[block.end:]
    return text
