"""The package's floors (docs/architecture.md): a module imports only its own room or rooms
on lower floors, at module level or inside a function, so the house has no circle and no
import running back up. A new module lands in its folder's room; a new top-level module
needs a floor here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from contract_lib.paths import PACKAGE_DIR

pytestmark = pytest.mark.fast

FLOORS = {
    1: ("paths", "loops", "dtypes", "trust", "atomic", "lazy"),
    2: ("workloads", "frames", "verdict", "patches"),
    3: ("sources",),
    4: ("wire",),
    5: ("child", "runs"),
    6: ("contract", "pytest_plugin", "__init__"),
    7: ("campaigns",),
    8: ("views",),
    9: ("cli", "pages"),
    10: ("__main__",),
}
FLOOR_OF = {room: floor for floor, rooms in FLOORS.items() for room in rooms}
# Rooms on one floor that must not import each other: the parent starts a run by naming
# ``contract_lib.child.main``, never by importing it.
APART = {frozenset({"child", "runs"})}


def room_of(module: str) -> str:
    """``contract_lib.a.b`` -> ``a`` (a folder is one room); ``contract_lib`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(module: str, source: str, is_package: bool = False) -> list[tuple[int, str]]:
    """Every ``contract_lib`` module ``module`` (its text ``source``) imports, as (line,
    module), at module level or inside a function."""
    found = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            found += [(node.lineno, f"{base}.{a.name}" if base == "contract_lib" else base)
                      for a in node.names]
    return [(line, m) for line, m in found if m == "contract_lib" or m.startswith("contract_lib.")]


def wrong_imports(module: str, source: str, is_package: bool = False) -> list[str]:
    """Each import of ``module`` that runs up a floor, or across to a room kept apart."""
    here, wrong = room_of(module), []
    for line, imported in imports(module, source, is_package):
        there = room_of(imported)
        if there == here:
            continue
        if FLOOR_OF[there] > FLOOR_OF[here] or (
                FLOOR_OF[there] == FLOOR_OF[here] and frozenset({here, there}) in APART):
            wrong.append(f"{module}:{line}: {here} (floor {FLOOR_OF[here]}) imports "
                         f"{imported} (floor {FLOOR_OF[there]})")
    return wrong


def test_every_room_has_a_floor():
    rooms = {room_of(module_of(p)) for p in PACKAGE_DIR.rglob("*.py")}
    assert rooms <= set(FLOOR_OF), f"rooms without a floor: {sorted(rooms - set(FLOOR_OF))}"


def test_no_import_runs_back_up_or_across():
    wrong = [problem for path in sorted(PACKAGE_DIR.rglob("*.py"))
             for problem in wrong_imports(module_of(path), path.read_text(),
                                          path.name == "__init__.py")]
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_an_import_running_up_or_across():
    """The check can fail: a campaign importing a view inside a function, and the parent's
    harness importing the run's process, are each named with their line."""
    status = (PACKAGE_DIR / "campaigns" / "status.py").read_text()
    drawn = status + "\n\ndef _draw():\n    from contract_lib.views import style\n"
    line = drawn.count("\n")
    assert wrong_imports("contract_lib.campaigns.status", drawn) == [
        f"contract_lib.campaigns.status:{line}: campaigns (floor 7) imports "
        "contract_lib.views (floor 8)"]
    harness = "from ..child import main\n"
    assert wrong_imports("contract_lib.runs.harness", harness) == [
        "contract_lib.runs.harness:1: runs (floor 5) imports contract_lib.child (floor 5)"]


def twice_named(paths: list[Path]) -> dict[str, list[str]]:
    """Module file names (``__init__`` and ``__main__`` aside) that occur in two rooms."""
    rooms: dict[str, list[str]] = {}
    for path in paths:
        if path.stem not in ("__init__", "__main__"):
            rooms.setdefault(path.name, []).append(module_of(path))
    return {name: sorted(where) for name, where in rooms.items() if len(where) > 1}


def test_a_file_name_says_which_module_it_is():
    """At most 12 modules at the top level, and no file name twice in the package (a
    reader who sees ``report.py`` knows which report); the check names a twin it sees."""
    paths = sorted(PACKAGE_DIR.rglob("*.py"))
    assert len([p for p in paths if p.parent == PACKAGE_DIR]) <= 12
    assert twice_named(paths) == {}
    twin = PACKAGE_DIR / "pages" / "frames.py"
    assert twice_named(paths + [twin]) == {
        "frames.py": ["contract_lib.frames", "contract_lib.pages.frames"]}
