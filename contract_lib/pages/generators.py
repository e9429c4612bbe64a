"""The generators of the docs' generated blocks: a name, what running it needs, a function.

``needs`` orders them by cost, so a test can check the cheap ones on every commit:
``files`` reads committed files only, ``saved`` checks the saved runs of every release
with today's code (``data/history-sweep``, tens of seconds), ``pytest`` collects the
test suite, ``runs`` drives the venv's SGLang, ``releases`` installs and drives other
releases or sglang-omni.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from contract_lib.pages.markers import Block, MarkerError

NEEDS = ("files", "saved", "pytest", "runs", "releases")


@dataclasses.dataclass(frozen=True)
class Generator:
    name: str
    needs: str
    func: Callable[..., str]


GENERATORS: dict[str, Generator] = {}


def generator(name: str, needs: str) -> Callable:
    """Register ``func(**args) -> str`` as the generator of blocks named ``name``."""
    if needs not in NEEDS:
        raise ValueError(f"needs must be one of {NEEDS}, not {needs!r}")

    def register(func: Callable[..., str]) -> Callable[..., str]:
        if name in GENERATORS:
            raise ValueError(f"generator {name!r} registered twice")
        GENERATORS[name] = Generator(name, needs, func)
        return func
    return register


def generator_of(block: Block) -> Generator:
    """The block's generator; a :class:`MarkerError` naming the known ones if none."""
    if block.name not in GENERATORS:
        raise MarkerError(f"block {block.spec!r}: no generator {block.name!r} "
                          f"(known: {', '.join(sorted(GENERATORS))})")
    return GENERATORS[block.name]


def generate(block: Block) -> str:
    """The text the block's generator writes for its arguments."""
    try:
        return generator_of(block).func(**block.args)
    except TypeError as error:  # an argument the generator does not take
        raise MarkerError(f"block {block.spec!r}: {error}") from None


def md_table(header: list[str], rows: list[list[object]]) -> str:
    """A Markdown table (``|`` in a cell escaped)."""
    def line(cells: list[object]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"
    return "\n".join([line(header), "|" + "---|" * len(header), *map(line, rows)])
