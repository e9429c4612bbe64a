"""Adding a loop or a clause is one registration: a toy loop variant reaches the harness,
the child, the verdict and the status table through :mod:`contract_lib.loops` alone; a
toy clause reaches the report, ``assert_contract`` and the status table through the
clause registry (:mod:`contract_lib.contract.registry`) alone."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import contract_lib
from contract_lib import contract, loops
from contract_lib.campaigns.status import Status
from contract_lib.contract import HOLDS, NOT_EXERCISED, VIOLATED, check
from contract_lib.contract.base import NotExercised, result
from contract_lib.contract.report import evaluate
from contract_lib.runs import fingerprint
from contract_lib.verdict import Outcome

TOY = "toy-normal"
FIXTURES = Path(__file__).parent / "fixtures"
TOY_CLAUSE = max(contract.REGISTRY) + 1  # the next number: no real clause is replaced


@pytest.fixture()
def toy_loop():
    """SGLang's normal loop registered again under another name, as a reference loop
    that status does not run by default."""
    loops.register(loops.LoopSpec(TOY, loops.REFERENCE, "event_loop_normal",
                                  disable_overlap_schedule=True, default=False,
                                  note="a toy variant of the normal loop"))
    yield TOY
    loops.unregister(TOY)


@pytest.mark.real_loop
def test_a_registered_loop_runs_and_shows_in_the_status_table(toy_loop):
    frames = contract_lib.run("single-decode", toy_loop, cache=False)
    assert frames.status == "finished"
    assert frames.meta["loop_function"] == "event_loop_normal"
    report = check(frames, "rfc")  # on "all", clause 6 is the torch loops' known upstream bug
    assert report.verdict().outcome == Outcome.PASS
    status = Status({("single-decode", toy_loop): report})
    assert list(status.table().columns) == [toy_loop]
    assert toy_loop in status.text().splitlines()[0]
    assert toy_loop not in contract_lib.campaigns.status.default_loops()


@pytest.mark.real_loop
def test_a_registered_loops_function_is_what_the_run_must_enter(toy_loop):
    """The toy loop declares the overlap loop's function but the normal loop's flag: the
    run is refused at loop entry, naming both (the registry is the only source)."""
    loops.register(loops.LoopSpec(toy_loop, loops.REFERENCE, "event_loop_overlap",
                                  disable_overlap_schedule=True, default=False), replace=True)
    frames = contract_lib.run("single-decode", toy_loop, cache=False)
    assert frames.status == "crashed"
    assert frames.error["type"] == "LoopMismatch"
    assert "asked for event_loop_overlap" in frames.error["message"]


@pytest.mark.fast
def test_an_unregistered_loop_is_a_setup_error():
    with pytest.raises(contract_lib.RunSetupError, match="unknown loop 'toy-normal'"):
        contract_lib.run("single-decode", TOY)


# -- a toy clause ----------------------------------------------------------------------------


@pytest.fixture()
def toy_clause():
    """Clause :data:`TOY_CLAUSE`, "steps numbered": step boundaries are numbered 0, 1, 2... with no gap
    (a toy: every real run holds it; a frame with a step removed violates it)."""

    def no_steps(frames):
        return "no step boundary was recorded" if frames.steps.empty else None

    @contract.clause(TOY_CLAUSE, "steps numbered", fields=("step",),
                     origin=contract.EXTENSIONS, unexercised=no_steps)
    def check_numbered(frames):
        steps = frames.steps["step"].astype("int64").reset_index(drop=True)
        if len(steps) < 2:
            raise NotExercised("a single step boundary")
        gaps = steps[steps.diff().fillna(1) != 1]
        rows = [{"field": "step", "step": int(s), "expected": "the previous step + 1",
                 "actual": str(s), "explanation": "a step boundary went unrecorded"}
                for s in gaps]
        return result(TOY_CLAUSE, frames.loop, rows, f"{len(steps)} step numbers checked")

    yield TOY_CLAUSE
    contract.unregister(TOY_CLAUSE)


@pytest.mark.fast
def test_a_registered_clause_is_in_the_report_and_the_status_table(toy_clause):
    frames = contract_lib.Frames.load(FIXTURES / "single-decode.overlap.json")
    report = check(frames)
    assert report.clauses[toy_clause].status == HOLDS
    assert toy_clause not in check(frames, "rfc").clauses  # an extension, not the RFC's
    assert f"{toy_clause} steps numbered" in report.text()
    assert report.table().set_index("clause").loc[toy_clause, "origin"] == contract.EXTENSIONS
    status = Status({("single-decode", "overlap"): report})
    assert status.table().loc[f"{toy_clause} steps numbered", "overlap"] == "holds (1/1)"


@pytest.mark.fast
def test_a_registered_clause_can_fail_and_be_not_exercised(toy_clause):
    frames = contract_lib.Frames.load(FIXTURES / "single-decode.overlap.json")
    gap = frames.steps["step"].iloc[3]
    frames.tables["steps"] = frames.steps[frames.steps["step"] != gap].reset_index(drop=True)
    violated = check(frames).clauses[toy_clause]
    assert violated.status == VIOLATED
    assert contract.violation_message(violated.first()).startswith(
        f"clause {toy_clause} (steps numbered): field step at step ")
    frames.tables["steps"] = frames.steps.iloc[:1]  # the check's own reason
    single = check(frames).clauses[toy_clause]
    assert (single.status, single.note) == (NOT_EXERCISED, "a single step boundary")
    frames.tables["steps"] = frames.steps.iloc[:0]  # the declared condition (before the check)
    empty = evaluate(toy_clause, contract.REGISTRY[toy_clause].check, frames)
    assert (empty.status, empty.note) == (NOT_EXERCISED, "no step boundary was recorded")


# -- a registered number or name is refused unless replaced on purpose ------------------------


@pytest.mark.fast
def test_a_clause_number_taken_is_refused_unless_replaced_and_extend_survives():
    real = contract.REGISTRY[2]  # extended by @extend (decode_batch_idx)
    views = (dict(contract.CLAUSES), dict(contract.EXTENDED_FIELDS))
    assert real.extended is not None
    try:
        with pytest.raises(ValueError, match="clause 2 is already registered .*replace=True"):
            contract.clause(2, "a toy", fields=("step",))(lambda frames: None)
        assert contract.REGISTRY[2] is real
        assert (dict(contract.CLAUSES), dict(contract.EXTENDED_FIELDS)) == views
        toy = contract.clause(2, "a toy", fields=("step",), replace=True)(lambda f: None)
        assert contract.REGISTRY[2].check is toy and contract.CLAUSES[2] == "a toy"
        assert contract.REGISTRY[2].extended is real.extended  # the extension is kept
    finally:
        contract.registry.register(real, replace=True)
    assert (dict(contract.CLAUSES), dict(contract.EXTENDED_FIELDS)) == views


@pytest.mark.fast
def test_a_loop_name_taken_is_refused_unless_replaced():
    real, order = loops.spec("normal"), loops.names()
    try:
        with pytest.raises(ValueError, match="loop 'normal' is already registered"):
            loops.register(loops.LoopSpec("normal", loops.CANDIDATE, "event_loop_overlap"))
        assert loops.spec("normal") is real
        toy = loops.register(dataclasses.replace(real, note="a toy"), replace=True)
        assert loops.spec("normal") is toy and loops.names() == order
    finally:
        loops.register(real, replace=True)


# -- the cache key covers what shapes a run, and only that -------------------------------------


@pytest.mark.fast
def test_every_run_side_module_is_in_the_cache_key_and_nothing_else():
    """A module added to the run side (a new shim, a loop family's build, a frame table
    recorder) changes the frame cache's key without being listed anywhere; the checker,
    the views, the campaigns and the command line are not in it."""
    package = Path(contract_lib.__file__).resolve().parent
    keyed = {p.resolve() for p in fingerprint.LIBRARY_FILES}
    for part in ("child", "wire", "sources", "patches"):
        assert set((package / part).rglob("*.py")) <= keyed, part
    for part in ("contract", "views", "campaigns", "cli", "runs"):
        assert not set((package / part).rglob("*.py")) & keyed, part


EDITS = {"views/triage.py": False, "cli/options.py": False, "campaigns/status.py": False,
         "contract/slots.py": False, "runs/harness.py": False,
         "child/capture/snapshot.py": True, "wire/protocol.py": True, "frames.py": True,
         "patches/builtin.py": True}


@pytest.mark.fast
def test_an_edit_reruns_only_when_it_shapes_a_run(tmp_path):
    """The frame cache key and the warm server's fingerprint before and after a comment
    is appended to one module, in a copy of the package: an edit to the checker, views,
    campaigns or command line kept neither (it re-ran every cached run and restarted
    the server); an edit to what runs in the run's process changes both."""
    import json
    import shutil
    import subprocess
    import sys

    copy = tmp_path / "checkout"
    root = Path(contract_lib.__file__).resolve().parent
    shutil.copytree(root, copy / "contract_lib", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(root.parent / "data" / "model", copy / "data" / "model")
    code = f"""
import json
from contract_lib import loops
from contract_lib.runs import fingerprint as f
from contract_lib.wire.spec import RunSpec
from contract_lib.workloads import Workload
spec = RunSpec(Workload.from_dict({{"name": "w", "requests": [{{"rid": "a", "prompt": [20],
                                                             "max_new_tokens": 1}}]}}),
               loops.spec("normal"))
seen = {{}}
for edited in {list(EDITS)!r}:
    before = (f.key(spec), f.code_fingerprint())
    with open('contract_lib/' + edited, 'a') as handle:
        handle.write('# an edit\\n')
    after = (f.key(spec), f.code_fingerprint())
    seen[edited] = [a != b for a, b in zip(before, after)]
print(json.dumps(seen))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=copy, check=True, text=True,
                         capture_output=True, env={"PYTHONPATH": str(copy)}).stdout
    assert json.loads(out) == {edited: [changes, changes] for edited, changes in EDITS.items()}
