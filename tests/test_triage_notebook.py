"""06-triage run as its users run it: papermill with parameters.

A held-out workload given as a ``.toml`` path (named like a shipped workload, with a
later turn the shipped one does not have), a patch, a run that crashes, and bad
parameters that must stop at the first cell with the library's one-line message.
Each test executes the notebook once (~20-60 s).
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

import contract_lib

papermill = pytest.importorskip("papermill")

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "06-triage.ipynb"

HELD_OUT = """name = "two-turn"
description = "held out: shares a shipped name, but its later turn is y2 of y"
max_steps = 90

[[requests]]
rid = "y"
prompt_range = [30, 44]
max_new_tokens = 9
arrival = 0

[[requests]]
rid = "z"
prompt_range = [70, 80]
max_new_tokens = 4
arrival = 3

[[requests]]
rid = "y2"
turn_of = "y"
prompt_range = [100, 103]
max_new_tokens = 3
arrival = 14
"""


THREE_TURNS = """name = "three-turn"
description = "held out: a three-turn chain a, a2 (a turn of a), a3 (a turn of a2)"
max_steps = 150

[[requests]]
rid = "a"
prompt_range = [20, 36]
max_new_tokens = 8

[[requests]]
rid = "b"
prompt_range = [40, 50]
max_new_tokens = 6
arrival = 2

[[requests]]
rid = "a2"
turn_of = "a"
prompt_range = [60, 64]
max_new_tokens = 5
arrival = 14

[[requests]]
rid = "a3"
turn_of = "a2"
prompt_range = [70, 73]
max_new_tokens = 4
arrival = 26
"""


def _execute(tmp_path: Path, **parameters):
    """Run the notebook as the README does (``explore False``: no widget, on which
    nbclient can wait for good); a cell still running after 10 minutes fails the test."""
    out = tmp_path / "out.ipynb"
    error = None
    try:
        papermill.execute_notebook(str(NOTEBOOK), str(out),
                                   parameters={"explore": False, **parameters},
                                   kernel_name="python3", progress_bar=False,
                                   cwd=str(NOTEBOOK.parent), execution_timeout=600)
    except papermill.PapermillExecutionError as raised:
        error = raised
    return nbformat.read(out, as_version=4), error


def _text(notebook) -> list[str]:
    """Each code cell's text outputs (streams, text/plain, errors), in order."""
    texts = []
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        parts = []
        for output in cell.get("outputs", []):
            if output.output_type == "stream":
                parts.append(output.text)
            elif output.output_type == "error":
                parts.append(f"{output.ename}: {output.evalue}\n" + "\n".join(output.traceback))
            else:
                parts.append(output.get("data", {}).get("text/plain", ""))
        texts.append("".join(parts))
    return texts


def test_a_toml_workload_with_a_patch(tmp_path):
    path = tmp_path / "held-out.toml"
    path.write_text(HELD_OUT)
    notebook, error = _execute(tmp_path, workload=str(path), loop="mlx",
                               patch="fix-chained-accounting")
    assert error is None, error
    text = "\n".join(_text(notebook))
    assert "verdict: " in text
    # The comparison holds the unpatched run and both torch loops.
    assert "mlx + fix-chained-accounting" in text and "overlap" in text
    # The later turn of the .toml file, not the shipped two-turn's a2.
    assert "y2, a later turn of y: cached_tokens against the ideal" in text
    assert "a2, a later turn" not in text


@pytest.mark.parametrize("parameters, message", [
    (dict(loop="gpu"), "stopped: RunSetupError: unknown loop 'gpu'"),
    (dict(workload="no-such-workload"), "stopped: WorkloadError: unknown workload"),
    (dict(patch="no-such-patch"), "stopped: PatchError: unknown patch"),
    (dict(server_args={"bogus_arg": 1}), "stopped: RunSetupError: unknown server arg"),
    (dict(explore="false"), "stopped: explore must be True or False"),
])
def test_bad_parameters_stop_at_the_first_cell(tmp_path, parameters, message):
    notebook, error = _execute(tmp_path, compare=False, **parameters)
    assert error is not None, "the notebook ran on past a bad parameter"
    texts = _text(notebook)
    failed = [i for i, t in enumerate(texts) if "stopped:" in t]
    # The first code cell after the parameters (papermill inserts one cell).
    assert failed == [2], texts[:4]
    assert message in texts[2]
    assert "Traceback" not in texts[2] and len(texts[2].strip().splitlines()) <= 2
    assert not any(texts[3:]), "cells after the failure ran"


def test_a_crashed_run_gets_its_verdict_not_every_clause_holds(tmp_path):
    notebook, error = _execute(tmp_path, loop="mlx", patch="no-launch-ts", compare=False)
    assert error is None, error
    text = "\n".join(_text(notebook))
    assert "every clause holds" not in text
    assert "verdict: violated" in text and "crashed" in text
    assert "TypeError" in text  # the crash's location is shown


def test_a_run_that_crashed_before_the_later_turns_runs_every_cell(tmp_path):
    """mlx + no-launch-ts crashes at its first processed launch, before a2 and a3 arrive:
    the notebook shows what the run recorded and the crash, runs every later cell, and
    measures each later turn's ideal reuse on the torch reference (no run beats it)."""
    path = tmp_path / "three-turn.toml"
    path.write_text(THREE_TURNS)
    notebook, error = _execute(tmp_path, workload=str(path), loop="mlx",
                               patch="no-launch-ts")
    assert error is None, error
    errors = [o for cell in notebook.cells for o in cell.get("outputs", [])
              if o.output_type == "error"]
    assert not errors
    texts = _text(notebook)
    text = "\n".join(texts)
    assert "crashed during loop" in text and "TypeError" in text
    recorded = " ".join(re.search(r"recorded before it stopped:.*?\n\n", text, re.S)
                        .group(0).split())
    assert recorded.endswith("a2, a3")  # never known to the scheduler
    assert texts[-1].startswith("<Figure")  # the last cell ran
    # No request finished on the crashed run, so no token is compared with it.
    assert re.search(r"same tokens as the first run( +-){4}\n", text)
    reference = contract_lib.run(str(path), "normal")
    for turn, parent in (("a2", "a"), ("a3", "a2")):
        end = reference.requests.query(f"rid == '{parent}'").iloc[-1]
        ideal = int(end["prompt_len"]) + int(end["emitted"]) - 1
        block = text.split(f"{turn}, a later turn of {parent}: cached_tokens against the "
                           "ideal (measured on normal)\n")[1]
        rows = {line.split()[-4]: line.split()[-3:] for line in block.splitlines()[1:5]}
        assert rows["no-launch-ts"] == ["-", str(ideal), "-"]  # the crashed run
        assert rows["normal"] == [str(ideal), str(ideal), "0"]
        assert all(int(diff) <= 0 for _, _, diff in rows.values() if diff != "-")
