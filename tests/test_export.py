"""``patch export``: a source patch written as an upstream diff, applied with ``git apply``
to a clean upstream-layout tree, and judged by ``compare`` exactly as the patch, on every
release that patch supports; a patch that is not only source edits is refused."""

from __future__ import annotations

import functools
import importlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from contract_lib.campaigns.compare import compare, first_difference
from contract_lib.campaigns.export import (
    Edit,
    ExportError,
    Recorder,
    _diff,
    _reindented,
    export_patches,
)
from contract_lib.patches.builtin import BUILTIN_PATCHES
from contract_lib.sources.versions import sglang_path

ROOT = Path(__file__).resolve().parent.parent
LOOPS = ["normal", "overlap", "mlx"]
# Measured: what each built-in does on each supported release (None: exports).
REFUSED = {
    ("unclamped-sync", "0.5.21"): "this SGLang already has flush_all_decode_kv",
    ("unclamped-sync", "0.5.22"): "is not only a source patch (patch_source edits): it "
                                  "also adds sglang.srt.hardware_backend.mlx.model_runner."
                                  "MlxModelRunner.flush_all_decode_kv",
    ("unclamped-sync", "0.5.23"): "is not only a source patch (patch_source edits): it "
                                  "also adds sglang.srt.hardware_backend.mlx.model_runner."
                                  "MlxModelRunner.flush_all_decode_kv",
}


@pytest.fixture()
def module(module_on_disk):
    """A tiny module on disk inside a method of a class, fresh for every test."""
    return module_on_disk("fake_loop",
                          "class Loop:\n"
                          "    def step(self):\n"
                          "        x = 1\n"
                          "\n"
                          "        if x:\n"
                          "            x += 1\n"
                          "        return x\n")


@pytest.mark.fast
def test_an_edit_keeps_unchanged_lines_and_indents_new_ones():
    original = "    def f(self):\n        a = 1\n        \n        return a\n"
    edited = "def f(self):\n    a = 1\n\n    b = 2\n\n    return a + b\n"
    assert "".join(_reindented(original, edited)) == (
        "    def f(self):\n        a = 1\n        \n        b = 2\n\n"
        "        return a + b\n")


@pytest.mark.fast
def test_recorded_edits_install_nothing_and_git_applies_their_diff(module, tmp_path):
    recorder = Recorder(tmp_path)
    recorder(module.Loop, "step", [("x += 1\n", "x += 10\ny = x\n")], "t")
    recorder(module.Loop, "step", [("return x\n", "return y\n")], "t")  # composes
    assert module.Loop().step() == 2  # nothing installed
    diff = _diff(tmp_path, list(recorder.edits.values()), "test")
    assert diff.startswith("diff --git a/python/fake_loop.py b/python/fake_loop.py\n")
    assert diff.endswith("-            x += 1\n-        return x\n+            x += 10\n"
                         "+            y = x\n+        return y\n")
    tree = tmp_path / "tree" / "python"
    tree.mkdir(parents=True)
    shutil.copy(tmp_path / "fake_loop.py", tree)
    (tmp_path / "fix.diff").write_text(diff)
    subprocess.run(["git", "apply", str(tmp_path / "fix.diff")], cwd=tree.parent, check=True)
    assert "        return y\n" in (tree / "fake_loop.py").read_text()


@pytest.mark.fast
def test_an_edit_of_code_that_moved_on_disk_is_refused(tmp_path):
    (tmp_path / "m.py").write_text("def f():\n    return 2\n")
    with pytest.raises(ExportError, match="m.py on disk differs from the code test imported"):
        _diff(tmp_path,
              [Edit("m.py", 1, "def f():\n    return 1\n", "def f():\n    return 3\n")],
              "test")


@pytest.mark.fast
def test_an_edit_re_indented_into_other_code_is_refused(tmp_path, monkeypatch):
    """The diff's text of a function must be, read back dedented, the code the patch
    compiles: a re-indentation that moves lines in or out of a block is refused."""
    from contract_lib.campaigns import export

    (tmp_path / "m.py").write_text("class C:\n    def f(self):\n        a = 1\n"
                                   "        return a\n")
    edit = Edit("m.py", 2, "    def f(self):\n        a = 1\n        return a\n",
                "def f(self):\n    a = 1\n    if a:\n        a += 1\n    return a\n")
    assert "+        if a:\n+            a += 1\n" in _diff(tmp_path, [edit], "test")
    right = export._reindented
    wrong = {"new lines not indented": lambda original, text: [
                 *original.splitlines(True)[:2], "if a:\n", "    a += 1\n",
                 original.splitlines(True)[2]],
             "a block's lines moved out of it": lambda original, text: [
                 *original.splitlines(True)[:2], "        if a:\n", "        a += 1\n",
                 original.splitlines(True)[2]],
             "the function at another margin": lambda original, text: [
                 "    " + line for line in right(original, text)]}
    for mutant in wrong.values():
        monkeypatch.setattr(export, "_reindented", mutant)
        with pytest.raises(ExportError, match="m.py:2: the diff's text of this function is "
                                              "not the code the patch compiles"):
            _diff(tmp_path, [edit], "test")


def _release_folder(version: str) -> Path:
    installed = Path(importlib.util.find_spec("sglang").origin).parent.parent
    return sglang_path(version) or installed


def _applies_to_a_clean_tree(diff: Path, version: str, tmp_path: Path) -> None:
    """``git apply`` in a fresh upstream-layout tree holding the diff's files as the
    release ships them."""
    tree = tmp_path / "upstream"
    files = [line.split(" b/", 1)[1] for line in diff.read_text().splitlines()
             if line.startswith("diff --git ")]
    for file in files:
        target = tree / file
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(_release_folder(version) / file.removeprefix("python/"), target)
    subprocess.run(["git", "init", "-q"], cwd=tree, check=True)
    subprocess.run(["git", "apply", "--check", str(diff)], cwd=tree, check=True)
    subprocess.run(["git", "apply", str(diff)], cwd=tree, check=True)
    assert subprocess.run(["git", "status", "--porcelain"], cwd=tree, capture_output=True,
                          text=True).stdout.count("??") == 1  # the untracked python/


@functools.lru_cache(maxsize=None)
def _exported(version: str) -> dict[str, str | ExportError]:
    """Every built-in patch exported against ``version``, by one export process."""
    return export_patches(list(BUILTIN_PATCHES), version)


def _exports_and_applies(name: str, version: str, tmp_path: Path) -> Path | None:
    """The patch's export on ``version`` (or its refusal, as measured), applied to a
    clean tree of that release; the diff file (None: refused)."""
    exported = _exported(version)[name]
    if (name, version) in REFUSED:
        assert isinstance(exported, ExportError)
        assert re.search(re.escape(REFUSED[name, version]), str(exported))
        return None
    assert isinstance(exported, str), exported
    diff = tmp_path / f"{name}.diff"
    diff.write_text(exported)
    _applies_to_a_clean_tree(diff, version, tmp_path)
    return diff


def _exports_and_judges_as_the_patch(name: str, version: str, tmp_path: Path) -> None:
    diff = _exports_and_applies(name, version, tmp_path)
    if diff is None:
        return
    base = f"release={version}"
    by_diff = compare(base, f"{base},diff={diff}", ["two-turn"], LOOPS, progress=False)
    by_patch = compare(base, f"{base},patch={name}", ["two-turn"], LOOPS, progress=False)
    tables = by_diff.clause_table(), by_patch.clause_table()
    assert tables[0].equals(tables[1]), pd.concat(tables).drop_duplicates(keep=False)
    assert by_diff.outcome() == by_patch.outcome()
    for key, (_, head) in by_diff.runs.items():
        assert first_difference(head, by_patch.runs[key][1]) == "none", key


def test_a_user_source_patch_exports_and_a_wrapper_is_refused_in_one_line():
    """``module:callable`` patches: patch_source edits export (the function patched in
    place); one that replaces a module function, or wraps a method, says what it does
    besides, and the command exits 2 with that line."""
    wrappers = {"leak_on_finish": "replaces sglang.srt.managers.scheduler_components."
                "batch_result_processor.release_kv_cache (user_patches.leak_on_finish."
                "<locals>.<lambda>)",
                "relay_overwritten_after_stash": "replaces sglang.srt.managers.overlap_utils."
                "FutureMap.stash (user_patches.relay_overwritten_after_stash.<locals>.stash)"}
    exported = export_patches(["user_patches:frozen_launch_ts",
                               *(f"user_patches:{name}" for name in wrappers)])
    assert "+        batch.launch_ts = self.__dict__.setdefault(" in (
        exported["user_patches:frozen_launch_ts"])
    refusals = {name: f"patch 'user_patches:{name}' is not only a source patch "
                f"(patch_source edits): it also {what}" for name, what in wrappers.items()}
    for name, refusal in refusals.items():
        assert str(exported[f"user_patches:{name}"]) == refusal
    done = subprocess.run([sys.executable, "-m", "contract_lib", "patch", "export",
                           "user_patches:leak_on_finish"], capture_output=True, text=True,
                          cwd=ROOT / "tests")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"error: {refusals['leak_on_finish']}\n"


class TestTheBuiltinsBatchExport:
    """The tests that read a release's batch export (every built-in, one export process,
    8-12 s a release): a class, so one worker makes each batch once (conftest.py)."""

    @pytest.mark.parametrize("name", list(BUILTIN_PATCHES))
    def test_every_builtin_patch_exports_and_applies_to_a_clean_tree(self, name, tmp_path):
        """Each patch's diff (its every function, read back, the code the patch
        compiles: the export checks it, test_an_edit_re_indented_into_other_code_is_refused)
        applies to the clean tree of the venv's release, or it is refused as measured."""
        _exports_and_applies(name, "0.5.23", tmp_path)

    @pytest.mark.releases
    @pytest.mark.parametrize("version", ["0.5.21", "0.5.22"])
    @pytest.mark.parametrize("name", list(BUILTIN_PATCHES))
    def test_on_older_releases_too(self, name, version, tmp_path):
        """The same on the older releases the suite installs."""
        _exports_and_applies(name, version, tmp_path)

    # That ``compare`` judges a diff exactly as its patch is the export's machinery (a
    # source tree of the diff, a server of its own, the same runs), the same for every
    # patch: what differs between patches is their code, which the export checks for every
    # one (above). Judged here for one patch of each kind of code, each a diff server's cold
    # start and six runs (~10 s); until 2026-12-05 every built-in was judged on 0.5.23 too,
    # which repeated that machinery nine more times.
    @pytest.mark.parametrize("name, version", [
        ("fix-chained-accounting", "0.5.23"),  # the MLX loop's own code
        ("fix-idle-predicate", "0.5.23"),  # Scheduler code every loop runs
        ("fix-backend-state", "0.5.23"),  # four edits in two files, one adding a method
        pytest.param("fix-chained-accounting", "0.5.21", marks=pytest.mark.releases),
        pytest.param("fix-idle-predicate", "0.5.22", marks=pytest.mark.releases),
    ])
    def test_a_diff_judges_as_its_patch(self, name, version, tmp_path):
        _exports_and_judges_as_the_patch(name, version, tmp_path)

    def test_a_patch_that_raises_fails_alone_in_its_batch(self, tmp_path, monkeypatch):
        """A patch that raises while it is recorded is that patch's error, in one line;
        the other patches of the batch still export (each is recorded in a fork of its
        own), each as it exports in any other batch (here: in the batch of every
        built-in). A single patch's export (``export_patch``, what ``patch export`` and
        ``report --fix`` call) is a batch of one: tests/test_report.py."""
        (tmp_path / "raising_patch.py").write_text(
            "def boom():\n    raise RuntimeError('kaboom')\n")
        monkeypatch.syspath_prepend(str(tmp_path))  # a user patch, found on the path
        exported = export_patches(["raising_patch:boom", "no-launch-ts"])
        assert str(exported["raising_patch:boom"]) == (
            "patch 'raising_patch:boom': the export process failed: RuntimeError: kaboom")
        assert exported["no-launch-ts"].startswith("diff --git a/python/sglang/")
        assert exported["no-launch-ts"] == _exported("0.5.23")["no-launch-ts"]
