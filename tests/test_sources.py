"""SGLang from anywhere: a source tree (``--sglang PATH``) and upstream diffs (``--diff``).

The ``fast`` tests check and hash small trees made here; the others build scratch copies
of the installed SGLang (thousands of files) or drive a real loop from a git checkout built
here from the installed package (no network).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import contract_lib
from contract_lib import loops
from contract_lib.cli import main
from contract_lib.paths import DATA_DIR
from contract_lib.runs import cache, fingerprint
from contract_lib.sources import origin as sources, trees
from contract_lib.wire.spec import RunSpec

GOOD = DATA_DIR / "diffs" / "fix-backend-state.diff"
BAD = DATA_DIR / "diffs" / "stale-context.diff"
INSTALLED = Path(list(importlib.util.find_spec("sglang").submodule_search_locations)[0])


@pytest.fixture()
def diffs_dir(tmp_path, monkeypatch):
    """Scratch copies of the test's own."""
    monkeypatch.setenv(sources.DIFFS_DIR_ENV, str(tmp_path / "diffs"))
    return tmp_path / "diffs"


@pytest.fixture(scope="session")
def checkout(tmp_path_factory) -> Path:
    """A git checkout in the upstream layout: the installed package copied into
    ``python/sglang`` of a fresh repository (with its byte code, so the runs skip
    compiling it)."""
    root = tmp_path_factory.mktemp("sglang-checkout")
    shutil.copytree(INSTALLED, root / "python" / "sglang")
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    return root


def _edit(path: Path, text: str) -> None:
    """Rewrite a file as a new inode (so a hard-linked original is never touched)."""
    old = path.read_text()
    path.unlink()
    path.write_text(old + text)


# -- diffs -------------------------------------------------------------------------------------


def test_a_diff_applies_to_a_hard_linked_scratch_copy_reused_by_digest(diffs_dir):
    source = sources.resolve(None, [GOOD])
    package = source.sglang_dir / "sglang"
    worker = "srt/hardware_backend/mlx/tp_worker.py"
    assert "def retire_released_requests" in (package / worker).read_text()
    assert "def retire_released_requests" not in (INSTALLED / worker).read_text()
    untouched = "srt/managers/schedule_batch.py"
    assert (package / untouched).stat().st_ino == (INSTALLED / untouched).stat().st_ino
    assert (package / worker).stat().st_ino != (INSTALLED / worker).stat().st_ino
    assert list(source.sglang_dir.glob("sglang-*.dist-info")), "the release's metadata"
    assert source.version == contract_lib.sources.versions.installed_sglang_version()
    assert source.label.endswith("+fix-backend-state.diff")
    marker = source.sglang_dir.parent / sources.COMPLETE
    built = marker.stat().st_mtime_ns
    again = sources.resolve(None, [GOOD])
    assert again == source and marker.stat().st_mtime_ns == built  # reused, not rebuilt
    assert [p.name for p in diffs_dir.iterdir() if not p.name.startswith(".build")] == [
        source.sglang_dir.parent.name]


def test_concurrent_builds_of_one_copy_all_get_it(diffs_dir):
    """Processes building the same scratch copy at once: one builds, all get it."""
    code = ("import sys; from contract_lib.sources import origin as sources; "
            f"print(sources.resolve(None, [{str(GOOD)!r}]).sglang_dir)")
    env = {**os.environ, sources.DIFFS_DIR_ENV: str(diffs_dir)}
    children = [subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                for _ in range(4)]
    results = [child.communicate(timeout=120) + (child.returncode,) for child in children]
    assert all(code == 0 for _, _, code in results), [err for _, err, _ in results]
    assert len({out for out, _, _ in results}) == 1
    assert sorted(p.name for p in diffs_dir.iterdir()) == [
        ".build.lock", Path(results[0][0].strip()).parent.name]


def test_a_diff_that_does_not_apply_names_its_hunk_and_leaves_nothing(diffs_dir):
    with pytest.raises(sources.SourceError) as error:
        sources.resolve(None, [BAD])
    message = str(error.value)
    assert "\n" not in message
    assert ("rejected python/sglang/srt/managers/scheduler.py hunk #1 "
            "[@@ -5240,6 +5240,9 @@ class Scheduler(]") in message
    assert "tp_worker.py" not in message  # its hunks applied
    assert [p.name for p in diffs_dir.iterdir()] == [".build.lock"]


def test_cli_bad_diff_is_one_line_and_exit_2(diffs_dir, capsys):
    code = main(["check", "--loop", "mlx", "--workload", "two-turn", "--diff", str(BAD)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "scheduler.py hunk #1" in err


@pytest.mark.fast
@pytest.mark.parametrize("text, expected", [
    ("not a diff\n", "no unified-diff hunk"),
    ("--- a/docs/x.md\n+++ b/docs/x.md\n@@ -1 +1 @@\n-a\n+b\n", "changes no file under python/sglang/"),
])
def test_a_diff_in_another_layout_is_refused(tmp_path, diffs_dir, text, expected):
    path = tmp_path / "x.diff"
    path.write_text(text)
    with pytest.raises(sources.SourceError, match=expected):
        sources.resolve(None, [path])
    with pytest.raises(sources.SourceError, match="cannot read it"):
        sources.resolve(None, [tmp_path / "missing.diff"])


def test_a_pull_requests_files_outside_the_package_are_ignored(tmp_path, diffs_dir):
    """A pull request's diff also changes tests and docs: only python/sglang/ applies."""
    mixed = tmp_path / "pr.diff"
    mixed.write_text("--- a/docs/x.md\n+++ b/docs/x.md\n@@ -1 +1 @@\n-a\n+b\n"
                     + GOOD.read_text())
    source = sources.resolve(None, [mixed])
    assert "retire_released_requests" in (
        source.sglang_dir / "sglang/srt/managers/scheduler.py").read_text()
    assert not (source.sglang_dir.parent / "docs").exists()


def test_diffs_apply_in_order_and_their_text_is_the_identity(tmp_path, diffs_dir):
    """A second diff that builds on the first applies only after it; editing a diff's
    text gives another scratch copy and identity (hence another cache key)."""
    first = sources.resolve(None, [GOOD])
    target = first.sglang_dir / "sglang/srt/hardware_backend/mlx/tp_worker.py"
    follow = tmp_path / "follow.diff"
    lines = target.read_text().splitlines(keepends=True)
    at = next(i for i, l in enumerate(lines) if "def retire_released_requests" in l)
    follow.write_text(
        "--- a/python/sglang/srt/hardware_backend/mlx/tp_worker.py\n"
        "+++ b/python/sglang/srt/hardware_backend/mlx/tp_worker.py\n"
        f"@@ -{at + 1},2 +{at + 1},3 @@\n {lines[at]}+        # follow-up\n {lines[at + 1]}")
    both = sources.resolve(None, [GOOD, follow])
    assert "# follow-up" in (both.sglang_dir / "sglang/srt/hardware_backend/mlx/"
                             "tp_worker.py").read_text()
    with pytest.raises(sources.SourceError, match="does not apply"):
        sources.resolve(None, [follow, GOOD])
    edited = tmp_path / "fix-backend-state.diff"
    edited.write_text(GOOD.read_text().replace("# rid -> Req of every", "# rid -> Req, every"))
    other = sources.resolve(None, [edited])
    assert other.sglang_dir != first.sglang_dir and other.identity != first.identity
    spec = RunSpec(contract_lib.load_workload("two-turn"), loops.spec("mlx"))

    def keyed(source) -> str:
        return fingerprint.key(dataclasses.replace(
            spec, sglang_source=source.identity, sglang_dir=str(source.sglang_dir)))

    assert keyed(first) != keyed(other)


def _without_prefixes(text: str) -> str:
    """A ``git diff`` as ``git diff --no-prefix`` (or ``diff -u`` from the root) writes it."""
    return "".join(line.replace(" a/python/", " python/").replace(" b/python/", " python/")
                   if line.startswith(("--- ", "+++ ", "diff --git ")) else line
                   for line in text.splitlines(keepends=True))


def test_a_diff_without_path_prefixes_applies(tmp_path, diffs_dir):
    """``--no-prefix`` headers (``--- python/sglang/...``) were stripped of ``python/`` by
    git apply's default -p1, skipped by its --include, and reported as applied: the run
    then passed on unchanged SGLang."""
    bare = tmp_path / "bare.diff"
    bare.write_text(_without_prefixes(GOOD.read_text()))
    source = sources.resolve(None, [bare])
    assert "retire_released_requests" in (
        source.sglang_dir / "sglang/srt/managers/scheduler.py").read_text()


def test_a_diff_git_applies_to_nothing_is_refused(tmp_path, diffs_dir):
    """Whatever makes git apply skip a file and succeed (here a wrong strip level), a
    file of the diff left unchanged is an error, not a pass on unchanged SGLang."""
    from contract_lib.sources import diffs

    bare = tmp_path / "bare.diff"
    bare.write_text(_without_prefixes(GOOD.read_text()))
    wrong = dataclasses.replace(diffs.read_diff(bare), strip=1)
    with pytest.raises(sources.SourceError, match="git apply changed nothing in "
                       "python/sglang/srt/"):
        diffs._build(diffs_dir / "x", sources.resolve(None, []), [wrong])


def test_a_second_diff_that_does_not_apply_names_what_it_met(tmp_path, diffs_dir):
    """The second of two diffs applies to the release plus the first, and says so; a
    diff saved with CRLF line endings says that too."""
    with pytest.raises(sources.SourceError, match=r"does not apply to sglang [^ ]+\+"
                       "fix-backend-state.diff: rejected"):
        sources.resolve(None, [GOOD, GOOD])
    crlf = tmp_path / "crlf.diff"
    crlf.write_bytes(GOOD.read_bytes().replace(b"\n", b"\r\n"))
    with pytest.raises(sources.SourceError, match="CRLF"):
        sources.resolve(None, [crlf])


@pytest.mark.fast
def test_a_diff_to_code_the_model_free_runner_stands_in_for_is_noted(tmp_path):
    """A diff to the MLX MlxModelRunner changes nothing a model-free mlx run executes:
    compare said "kept" with no hint; it is noted (use --runner real)."""
    from contract_lib.sources.diffs import model_free_notes

    runner = tmp_path / "runner.diff"
    runner.write_text("--- a/python/sglang/srt/hardware_backend/mlx/model_runner.py\n"
                      "+++ b/python/sglang/srt/hardware_backend/mlx/model_runner.py\n"
                      "@@ -1 +1 @@ class MlxModelRunner:\n-a\n+b\n")
    [note] = model_free_notes([runner, GOOD])
    assert "model_runner.py" in note and note.endswith("runs only with --runner real")


# -- source trees ------------------------------------------------------------------------------


@pytest.mark.fast
def test_a_tree_missing_pieces_says_what_in_one_line(tmp_path):
    package = tmp_path / "python" / "sglang"
    (package / "srt" / "managers").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "srt/managers/scheduler.py").write_text(
        "class Scheduler:\n    def run_batch(self):\n        pass\n")
    with pytest.raises(sources.SourceError) as error:
        sources.resolve(str(tmp_path))
    message = str(error.value)
    assert "\n" not in message and "not an SGLang contract_lib can drive" in message
    assert "sglang/srt/managers/scheduler.py (Scheduler.event_loop_normal, " in message
    assert "Scheduler.run_batch" not in message  # present
    assert "sglang/srt/hardware_backend/mlx/scheduler_mixin.py (no such file)" in message
    with pytest.raises(sources.SourceError, match="no sglang package there"):
        sources.resolve(str(tmp_path / "python" / "sglang" / "srt"))
    with pytest.raises(sources.SourceError, match="no such directory"):
        sources.resolve(str(tmp_path / "nowhere"))


def test_a_checkout_is_accepted_at_its_root_or_python_folder(checkout):
    by_root, by_python = sources.resolve(str(checkout)), sources.resolve(checkout / "python")
    assert by_root == by_python
    assert by_root.sglang_dir == (checkout / "python").resolve()
    assert by_root.version is None  # a tree's metadata may be the venv's: not checked
    assert by_root.label.startswith(f"{contract_lib.sources.versions.installed_sglang_version()} "
                                    "(tree ")


@pytest.mark.fast
def test_a_tree_digest_follows_its_contents(tmp_path, monkeypatch):
    monkeypatch.setattr(trees, "TREE_HASHES_DIR", tmp_path / "hashes")
    root = tmp_path / "tree"
    (root / "sglang").mkdir(parents=True)
    module = root / "sglang" / "a.py"
    module.write_text("x = 1\n")
    (root / "sglang" / "data.json").write_text("{}")
    first = sources.tree_digest(root)
    assert sources.tree_digest(root) == first
    module.write_text("x = 2\n")
    os.utime(module, ns=(1, 1))  # a new mtime: the file is hashed again
    second = sources.tree_digest(root)
    assert second != first
    (root / "sglang" / "b.py").write_text("")
    assert sources.tree_digest(root) not in (first, second)


def test_a_git_checkout_runs_and_is_keyed_by_its_contents(checkout, private_cache,
                                                           run_cached):
    frames = contract_lib.run("two-turn", "normal", sglang=str(checkout))
    assert frames.status == "finished", frames.error
    assert "(tree " in frames.meta["sglang_version"]
    assert frames.output_tokens() == run_cached("two-turn", "normal").output_tokens()
    assert contract_lib.run("two-turn", "normal", sglang=str(checkout)).meta.get("cached")
    _edit(checkout / "python/sglang/srt/managers/scheduler.py", "\n# an edit\n")
    with warnings.catch_warnings():  # a new key: a plain miss, not a discarded entry
        warnings.simplefilter("error", cache.CacheWarning)
        again = contract_lib.run("two-turn", "normal", sglang=str(checkout))
    assert not again.meta.get("cached") and again.status == "finished"


def test_cli_check_on_a_checkout_with_a_diff(checkout, capsys, diffs_dir):
    code = main(["check", "--loop", "mlx", "--workload", "two-turn", "--sglang",
                 str(checkout), "--diff", str(GOOD), "--no-cache", "--out",
                 str(diffs_dir.parent / "out.json")])
    out = capsys.readouterr().out
    assert "7 request state retired" in out
    line = next(l for l in out.splitlines() if l.strip().startswith("7 request state"))
    assert line.split()[4] == "holds"
    assert code == 1  # clauses 1, 2, 5 and 6 stay violated on mlx


def test_cli_status_of_a_release_and_a_checkout_with_a_diff_side_by_side(checkout, capsys,
                                                                         diffs_dir):
    version = contract_lib.sources.versions.installed_sglang_version()
    code = main(["status", "--sglang", version, "--sglang", str(checkout), "--loop", "mlx",
                 "--workload", "two-turn", "--diff", str(GOOD)])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0
    assert f"sglang {version}+fix-backend-state.diff" in lines[0]
    assert "(tree " in lines[0] and lines[0].rstrip().endswith("+fix-backend-state.diff")
    row = next(line for line in lines if line.startswith("7 request state retired"))
    assert row.split()[-4:] == ["holds", "(1/1)", "holds", "(1/1)"]
