"""The notebook suite: paired with its py:percent sources, executed, and a real test.

nbval (``pytest notebooks/``, strict mode) re-runs every notebook and compares every
stored output. The tests here check what nbval does not: that each ``.ipynb`` holds the
cells of its ``.py`` pair, that the stored notebooks were executed top to bottom without
errors, and that the suite fails when a clause breaks (one notebook re-executed with
``CONTRACT_LIB_EXTRA_PATCH=skip-relay-publish`` gives different compared outputs).

To regenerate notebooks after editing their ``.py`` sources (executes them with the
current environment's kernel and writes the ``.ipynb`` with outputs)::

    .venv/bin/python tests/test_notebooks.py                 # every notebook
    .venv/bin/python tests/test_notebooks.py 04-relay        # some of them
"""

from __future__ import annotations

import configparser
import re
import sys
from pathlib import Path

import jupytext
import nbformat
import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
SOURCES = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]-*.py"))
KERNEL = "python3"


def _cells(notebook) -> list[tuple[str, str, tuple[str, ...]]]:
    return [(cell.cell_type, cell.source.strip(), tuple(cell.metadata.get("tags", ())))
            for cell in notebook.cells]


def _is_skipped(cell) -> bool:
    return cell.cell_type == "code" and cell.source.lstrip().startswith("# NBVAL_SKIP")


# -- building and executing ---------------------------------------------------------------


def build(source: Path):
    """The notebook of a py:percent source: its cells, deterministic cell ids and the
    pairing and kernel metadata."""
    notebook = jupytext.read(source)
    for index, cell in enumerate(notebook.cells):
        cell.id = f"cell-{index:02d}"
    notebook.metadata["jupytext"] = {"formats": "ipynb,py:percent"}
    notebook.metadata["kernelspec"] = {"display_name": "Python 3 (ipykernel)",
                                       "language": "python", "name": KERNEL}
    return notebook


def execute(notebook, *, allow_errors: bool = False, timeout: int = 900):
    """Run every cell top to bottom in a fresh kernel of the current environment."""
    from nbclient import NotebookClient

    client = NotebookClient(notebook, kernel_name=KERNEL, timeout=timeout,
                            allow_errors=allow_errors, record_timing=False,
                            resources={"metadata": {"path": str(NOTEBOOK_DIR)}})
    client.execute()
    return notebook


def clean(notebook):
    """What a stored notebook keeps: no widget state (it renders nowhere without a live
    kernel and nbval never compares it), no outputs in cells nbval skips."""
    notebook.metadata.pop("widgets", None)
    for cell in notebook.cells:
        if _is_skipped(cell):
            cell.outputs = []
    return notebook


def regenerate(source: Path) -> Path:
    target = source.with_suffix(".ipynb")
    notebook = clean(execute(build(source)))
    nbformat.write(notebook, target)
    return target


# -- comparing outputs as nbval does --------------------------------------------------------


def _sanitizers() -> list[tuple[re.Pattern, str]]:
    parser = configparser.ConfigParser()
    parser.read(NOTEBOOK_DIR / "sanitize.cfg")
    return [(re.compile(parser[s]["regex"]), parser[s]["replace"]) for s in parser.sections()]


def compared_text(cell) -> str:
    """A code cell's text outputs, sanitized as nbval sanitizes them (streams and
    ``text/plain``; images and widget views are not compared)."""
    parts = []
    for output in cell.get("outputs", []):
        if output.output_type == "stream":
            parts.append(f"[{output.name}] {output.text}")
        elif output.output_type in ("execute_result", "display_data"):
            parts.append(output.get("data", {}).get("text/plain", ""))
        elif output.output_type == "error":
            parts.append(f"[error] {output.ename}: {output.evalue}")
    text = "".join(parts)
    for pattern, replacement in _sanitizers():
        text = pattern.sub(replacement, text)
    return text


# -- tests ----------------------------------------------------------------------------------


def test_every_notebook_has_its_py_pair():
    assert NOTEBOOKS, "no notebooks found"
    assert [p.stem for p in NOTEBOOKS] == [p.stem for p in SOURCES]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_matches_its_py_source(path):
    stored = jupytext.read(path)
    paired = jupytext.read(path.with_suffix(".py"))
    assert _cells(stored) == _cells(paired), (
        f"{path.name} and {path.with_suffix('.py').name} differ; edit the .py and "
        "regenerate with `python tests/test_notebooks.py`")
    assert stored.metadata.get("jupytext", {}).get("formats") == "ipynb,py:percent"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_was_executed_cleanly(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    counts = [cell.execution_count for cell in code]
    assert all(count is not None for count in counts), "a code cell was never executed"
    assert counts == list(range(1, len(code) + 1)), f"executed out of order: {counts}"
    for cell in code:
        for output in cell.outputs:
            assert output.output_type != "error", f"stored error in {cell.source[:60]!r}"
            assert not (output.output_type == "stream" and output.name == "stderr"), (
                f"stderr stored in {cell.source[:60]!r}: {output.text[:200]}")
        if not _is_skipped(cell):
            data = [o.get("data", {}) for o in cell.outputs]
            assert not any("application/vnd.jupyter.widget-view+json" in d for d in data)
    assert "widgets" not in notebook.metadata
    assert any(cell.outputs for cell in code), "no stored outputs to compare"


def test_overview_reading_order_links_every_notebook():
    """00's reading order names every notebook of the suite (a newcomer starts there)."""
    overview = (NOTEBOOK_DIR / "00-overview.py").read_text()
    order = overview[overview.index("## Reading order"):]
    missing = [p.name for p in NOTEBOOKS if p.stem != "00-overview" and f"({p.name})" not in order]
    assert not missing, f"00-overview's reading order does not link {missing}"


def test_suite_fails_when_a_clause_breaks(monkeypatch):
    """Re-execute 04-relay with the relay publish removed from every run (the harness
    applies ``CONTRACT_LIB_EXTRA_PATCH`` to each run): its compared outputs must change,
    so ``pytest notebooks/`` would fail. Executes one notebook (~10-40 s)."""
    path = NOTEBOOK_DIR / "04-relay.ipynb"
    stored = nbformat.read(path, as_version=4)
    monkeypatch.setenv("CONTRACT_LIB_EXTRA_PATCH", "skip-relay-publish")
    fresh = execute(build(path.with_suffix(".py")), allow_errors=True)
    pairs = [(old, new) for old, new in zip(stored.cells, fresh.cells)
             if old.cell_type == "code" and not _is_skipped(old)]
    differ = [(compared_text(old), compared_text(new)) for old, new in pairs
              if compared_text(old) != compared_text(new)]
    assert differ, "no compared output changed although clause 4 broke on every run"
    # Not only labels: a verdict printed as "holds" now reads "violated".
    flipped = [(old, new) for old, new in differ
               if "clause 4" in old and "holds" in old and "violated" in new]
    assert flipped, "no stored clause-4 verdict changed: " + repr(differ[:2])


if __name__ == "__main__":
    names = sys.argv[1:]
    chosen = [s for s in SOURCES if not names or s.stem in names or s.name in names]
    for source in chosen:
        print(f"executing {source.name} ...", flush=True)
        print(f"  wrote {regenerate(source).relative_to(NOTEBOOK_DIR.parent)}")
