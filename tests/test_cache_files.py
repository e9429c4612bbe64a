"""Faults of the frame cache and of the files contract_lib writes: stale or poisoned
entries, unwritable and full directories, ``cache clear`` on directories that are not the
cache's own, and writes that fail midway."""

from __future__ import annotations

import builtins
import errno
import io
import json
import math
import os
import re
import sys
import warnings
from pathlib import Path

import pandas as pd
import pytest

import contract_lib
from contract_lib.cli import main
from contract_lib.contract import check
from contract_lib.dtypes import KINDS
from contract_lib.frames import COLUMNS, SCHEMA_VERSION, Frames, FramesFormatError
from contract_lib.runs import cache, fingerprint
from contract_lib.sources import installs, user_modules


def _entries(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.json"))


class _FullDisk:
    """A file handle whose first write stores half its data, then fails with ENOSPC."""

    def __init__(self, handle) -> None:
        self.handle = handle

    def write(self, data):
        self.handle.write(data[: len(data) // 2])
        self.handle.flush()
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    def __getattr__(self, name):
        return getattr(self.handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.close()


def _fail_writes(monkeypatch, directory: Path, error: int | None = None) -> None:
    """Every file opened for writing in ``directory`` fails: at open with ``error``
    (e.g. EROFS), else midway through its first write (a full disk). Patches the
    ``open`` every writer goes through (``builtins.open`` and pathlib's ``io.open``)."""
    real_open = builtins.open

    def fake_open(file, mode="r", *args, **kwargs):
        writing = any(flag in mode for flag in "wxa")
        if writing and Path(os.fspath(file)).resolve().parent == directory.resolve():
            if error is not None:
                raise OSError(error, os.strerror(error), os.fspath(file))
            return _FullDisk(real_open(file, mode, *args, **kwargs))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(io, "open", fake_open)


def _meta(**changes) -> dict:
    meta = {"workload": "w", "loop": "normal", "patch": None, "runner": "model-free",
            "sglang_version": "0.5.23", "status": "finished", "error": None,
            "server_args": {}, "user_modules": {}}
    meta.update(changes)
    return meta


# -- 1. stale verdicts: user modules a patch imports -------------------------------------------


PATCH_MODULE = '''
from cf_helper_{tag} import OFFSET
from sglang.srt.managers.scheduler import Scheduler
from contract_lib.patches.builtin import patch_source


def apply():
    """Stamp forward_iter OFFSET behind forward_ct (the helper decides how far)."""
    patch_source(Scheduler, "run_batch", [
        ("batch.forward_iter = self.forward_ct\\n",
         f"batch.forward_iter = self.forward_ct - {{OFFSET}}\\n"),
    ], "helper-offset")
'''


def _offsets(frames: Frames) -> set[int]:
    launches = frames.launches
    return set((launches.forward_ct - launches.processed_forward_iter).astype(int))


def test_editing_a_helper_module_of_a_user_patch_runs_again(private_cache, tmp_path,
                                                            monkeypatch):
    """The key knows the patch module only; the entry records every user module the run
    loaded (here the helper) and is used only while they are unchanged."""
    tag = tmp_path.name.replace("-", "_")
    (tmp_path / f"cf_patch_{tag}.py").write_text(PATCH_MODULE.format(tag=tag))
    helper = tmp_path / f"cf_helper_{tag}.py"
    helper.write_text("OFFSET = 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    patch = f"cf_patch_{tag}:apply"

    def run():  # warm: the run imports with this process's sys.path
        return contract_lib.run("single-decode", "normal", patch=patch)

    first = run()
    assert first.status == "finished" and "cached" not in first.meta
    assert str(helper.resolve()) in first.meta["user_modules"]
    assert _offsets(first) == {0}
    assert run().meta.get("cached") is True  # unchanged: served from the cache
    helper.write_text("OFFSET = 1  # stale stamp\n")  # another size: no stale .pyc
    edited = run()
    assert "cached" not in edited.meta
    assert _offsets(edited) == {1}
    again = run()
    assert again.meta.get("cached") is True and _offsets(again) == {1}
    assert len(_entries(private_cache)) == 1  # the rerun replaced the stale entry


def test_a_helper_shadowed_on_the_path_runs_again(private_cache, tmp_path, monkeypatch):
    """The same helper name found first in another folder (another ``PYTHONPATH`` order,
    another working directory) is another file: the entry, whose recorded files are
    unchanged, must not be served."""
    tag = tmp_path.name.replace("-", "_")
    first_dir, shadow_dir = tmp_path / "a", tmp_path / "b"
    first_dir.mkdir(), shadow_dir.mkdir()
    (first_dir / f"cf_patch_{tag}.py").write_text(PATCH_MODULE.format(tag=tag))
    (first_dir / f"cf_helper_{tag}.py").write_text("OFFSET = 0\n")
    (shadow_dir / f"cf_helper_{tag}.py").write_text("OFFSET = 1\n")
    monkeypatch.syspath_prepend(str(first_dir))

    def run():  # warm: the run imports with this process's sys.path
        return contract_lib.run("single-decode", "normal", patch=f"cf_patch_{tag}:apply")

    assert _offsets(run()) == {0} and run().meta.get("cached") is True
    monkeypatch.syspath_prepend(str(shadow_dir))
    shadowed = run()
    assert "cached" not in shadowed.meta and _offsets(shadowed) == {1}


@pytest.mark.fast
def test_source_files_are_listed_as_sorted_rglob_lists_them(tmp_path):
    """The cache key's walk of a source tree (``installs.python_files``) gives
    ``sorted(rglob("*.py"))``'s files, order and stats: names that sort differently as
    strings and as path parts, a folder named like a module, a symlinked folder (not
    entered) and a symlinked file (listed), non-Python files."""
    for name in ("a/b.py", "a-x.py", "a_x.py", "a/c/d.py", "a/c/notes.txt", "pkg.py/e.py",
                 "z.py", "A.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    (tmp_path / "link").symlink_to(tmp_path / "a", target_is_directory=True)
    (tmp_path / "alias.py").symlink_to(tmp_path / "z.py")
    expected = [(str(path.relative_to(tmp_path)), path.stat())
                for path in sorted(tmp_path.rglob("*.py"))]
    assert installs.python_files(tmp_path) == expected
    assert [name for name, _ in expected][:3] == ["A.py", "a/b.py", "a/c/d.py"]


@pytest.mark.fast
def test_a_module_beside_a_source_trees_sglang_is_a_users(tmp_path, monkeypatch):
    """The SGLang the run imported is installed code; a helper module beside its package
    (a source tree's ``python/``, which the tree digest does not cover) is the user's."""
    import types

    package = tmp_path / "python" / "sglang"
    package.mkdir(parents=True)
    sglang = types.ModuleType("sglang")
    sglang.__file__ = str(package / "__init__.py")
    monkeypatch.setitem(sys.modules, "sglang", sglang)
    roots = user_modules._installed_roots()
    assert str(package.resolve()) + os.sep in roots
    assert not str(tmp_path / "python" / "reviewhelper.py").startswith(roots)


@pytest.mark.fast
def test_a_module_name_is_resolved_again_without_importing(tmp_path, monkeypatch):
    """What the cache compares: the file a name would be imported from now. A package
    of the same name beats the module; a retargeted symlink is its new target."""
    tag = tmp_path.name.replace("-", "_")
    name = f"cf_resolved_{tag}"
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "impl_a.py").write_text("X = 1\n")
    (tmp_path / "impl_b.py").write_text("X = 2\n")
    link = tmp_path / f"{name}.py"
    link.symlink_to("impl_a.py")
    assert user_modules.module_file(name) == str((tmp_path / "impl_a.py").resolve())
    link.unlink()
    link.symlink_to("impl_b.py")
    assert user_modules.module_file(name) == str((tmp_path / "impl_b.py").resolve())
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("X = 3\n")
    import importlib

    importlib.invalidate_caches()
    assert user_modules.module_file(name) == str((tmp_path / name / "__init__.py").resolve())
    assert user_modules.module_file(f"{name}.missing") is None
    assert user_modules.module_file(f"cf_nowhere_{tag}") is None
    assert name not in sys.modules  # nothing was imported


def test_user_modules_lists_only_files_outside_the_installed_code(tmp_path, monkeypatch):
    import importlib

    (tmp_path / "cf_user_module.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("cf_user_module")
    import pandas  # noqa: F401  (site-packages)

    found, names = user_modules.user_modules()
    assert str((tmp_path / "cf_user_module.py").resolve()) in found
    assert names["cf_user_module"] == str((tmp_path / "cf_user_module.py").resolve())
    assert not [path for path in found if "site-packages" in path or "/lib/python3" in path]
    assert not set(found) & {str(path.resolve()) for path in fingerprint.LIBRARY_FILES}
    # The whole package is in the key; this checkout's other modules (the tests) are not.
    assert str(Path(contract_lib.__file__).resolve()) not in found
    assert str(Path(__file__).resolve()) in found


@pytest.mark.fast
def test_a_forked_run_looks_only_at_the_modules_it_loaded(tmp_path, monkeypatch):
    """The warm server looks at its own ~6000 modules once, before it forks runs; a run's
    ``user_modules`` adds what the run loaded itself, and still finds a user module."""
    import importlib

    tag = tmp_path.name.replace("-", "_")
    for name in ("before", "after"):
        (tmp_path / f"cf_{name}_{tag}.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(user_modules, "_LOADED_BEFORE", ({}, {}, {}))
    importlib.import_module(f"cf_before_{tag}")
    user_modules.remember_loaded_modules()  # the server, before its first fork
    importlib.import_module(f"cf_after_{tag}")  # the run's own import
    looked_at = []
    real_file_hash = user_modules.file_hash
    monkeypatch.setattr(user_modules, "file_hash", lambda path: looked_at.append(path)
                        or real_file_hash(path))
    found, _ = user_modules.user_modules()
    before, after = (str((tmp_path / f"cf_{name}_{tag}.py").resolve())
                     for name in ("before", "after"))
    assert {before, after} <= set(found)
    assert after in looked_at and before not in looked_at  # hashed by the server
    # Only the entries added since are read (the others' pages stay shared)...
    assert [name for name, _ in user_modules._modules_since_fork()][:1] == [f"cf_after_{tag}"]
    assert len(user_modules._modules_since_fork()) == 2  # the new one and the server's last
    # ... unless the server's last entry moved to the end: then all of them.
    last = next(reversed(user_modules._LOADED_BEFORE[0]))
    monkeypatch.setitem(sys.modules, last, sys.modules.pop(last))
    assert after in user_modules.user_modules()[0]


@pytest.mark.fast
def test_the_install_stamp_is_read_again_after_an_install(tmp_path, monkeypatch):
    """Read once per search path, then reused while its files and the search path's
    directories keep their mtimes; an install (a new entry in one of them) rereads it."""
    reads = []
    real_read = installs._read_install_stamp
    monkeypatch.setattr(installs, "_read_install_stamp",
                        lambda sglang_dir: reads.append(sglang_dir) or real_read(sglang_dir))
    monkeypatch.syspath_prepend(str(tmp_path))  # a search path of its own: no memo yet
    stamp = fingerprint.install_stamp()
    assert installs.install_stamp() == stamp and len(reads) == 1
    (tmp_path / "newdist-1.0.dist-info").mkdir()  # what pip does to a search path entry
    os.utime(tmp_path, ns=(1, 1))  # a distinct mtime however coarse the filesystem's clock
    assert installs.install_stamp() == stamp and len(reads) == 2


# -- 2. trusted contents: poisoned and malformed entries --------------------------------------


def test_a_poisoned_entry_of_another_loop_is_discarded(private_cache):
    normal = contract_lib.run("single-decode", "normal")
    normal_entry = _entries(private_cache)[0]
    contract_lib.run("single-decode", "mlx")
    (mlx_entry,) = [p for p in _entries(private_cache) if p != normal_entry]
    mlx_entry.write_bytes(normal_entry.read_bytes())  # normal-loop frames under the mlx key
    with pytest.warns(cache.CacheWarning, match="loop is 'normal'.*asks for 'mlx'"):
        frames = contract_lib.run("single-decode", "mlx")
    assert frames.loop == "mlx" and "cached" not in frames.meta
    assert normal.loop == "normal"
    assert contract_lib.run("single-decode", "mlx").meta.get("cached") is True


@pytest.mark.parametrize("value, reason", [
    (7, "its tables changed after it was stored"),
    ("zero", "table 'steps': column 'step' holds mixed-integer values, not int"),
], ids=["same kind", "another kind"])
def test_an_entry_edited_after_it_was_stored_is_discarded(private_cache, value, reason):
    """Well-shaped but changed contents: the entry's tables digest catches any change,
    and a cell of another kind than its column's (which would make every check raise)
    is refused first, naming the table and column."""
    contract_lib.run("single-decode", "normal")
    (entry,) = _entries(private_cache)
    payload = json.loads(entry.read_text())
    payload["tables"]["steps"]["data"][0][0] = value
    entry.write_text(json.dumps(payload))
    with pytest.warns(cache.CacheWarning, match=re.escape(reason)):
        frames = contract_lib.run("single-decode", "normal")
    assert "cached" not in frames.meta and frames.steps.step.iloc[0] == 0
    assert check(contract_lib.run("single-decode", "normal"), clauses="rfc").ok


MALFORMED = {
    "not JSON": b"{\"schema_version\": 3, \"meta\": ",
    "not UTF-8": b"\xff\xfe\x00garbage",
    "a JSON list": b"[]",
    "no tables": json.dumps({"schema_version": SCHEMA_VERSION, "meta": _meta()}).encode(),
    "tables of the wrong type": json.dumps(
        {"schema_version": SCHEMA_VERSION, "meta": _meta(), "tables": [1, 2]}).encode(),
    "meta of the wrong type": json.dumps(
        {"schema_version": SCHEMA_VERSION, "meta": "finished", "tables": {}}).encode(),
}


@pytest.mark.parametrize("content", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_entry_warns_once_and_runs_again(private_cache, content):
    contract_lib.run("single-decode", "normal")
    (entry,) = _entries(private_cache)
    entry.write_bytes(content)
    with pytest.warns(cache.CacheWarning, match="discarded"):
        frames = contract_lib.run("single-decode", "normal")
    assert frames.status == "finished" and "cached" not in frames.meta
    with warnings.catch_warnings():
        warnings.simplefilter("error", cache.CacheWarning)
        assert contract_lib.run("single-decode", "normal").meta.get("cached") is True


def _frames_payload() -> dict:
    return {"schema_version": SCHEMA_VERSION, "meta": _meta(),
            "tables": {name: {"columns": list(columns), "data": []}
                       for name, columns in COLUMNS.items()}}


def _breaks():
    """Each: (what, a function that breaks a valid payload)."""
    def drop_table(p):
        del p["tables"]["steps"]

    def extra_table(p):
        p["tables"]["mine"] = {"columns": [], "data": []}

    def rename_column(p):
        p["tables"]["requests"]["columns"][0] = "stp"

    def short_row(p):
        p["tables"]["outputs"]["data"] = [["a", 0]]

    def data_not_list(p):
        p["tables"]["outputs"]["data"] = {"a": 1}

    def table_not_object(p):
        p["tables"]["slots"] = "slots"

    def meta_without_status(p):
        del p["meta"]["status"]

    def unknown_status(p):
        p["meta"]["status"] = "great"

    def loop_not_string(p):
        p["meta"]["loop"] = 3

    def error_not_object(p):
        p["meta"]["error"] = "boom"

    def meta_list(p):
        p["meta"] = []

    def text_in_an_int_column(p):
        p["tables"]["outputs"]["data"] = [["a", "zero", 1]]

    def fraction_in_an_int_column(p):
        p["tables"]["outputs"]["data"] = [["a", 0.5, 1]]

    def number_in_a_bool_column(p):
        p["tables"]["slots"]["data"] = [[0, "a", 0, 0, 0, 1, True]]

    return [drop_table, extra_table, rename_column, short_row, data_not_list,
            table_not_object, meta_without_status, unknown_status, loop_not_string,
            error_not_object, meta_list, text_in_an_int_column, fraction_in_an_int_column,
            number_in_a_bool_column]


@pytest.mark.parametrize("brk", _breaks(), ids=lambda f: f.__name__)
def test_frames_load_raises_frames_format_error_for_any_wrong_shape(tmp_path, brk):
    payload = _frames_payload()
    path = tmp_path / "f.json"
    path.write_text(json.dumps(payload))
    assert Frames.load(path).status == "finished"  # the valid payload loads
    brk(payload)
    path.write_text(json.dumps(payload))
    with pytest.raises(FramesFormatError, match="f.json"):
        Frames.load(path)


@pytest.mark.fast
def test_every_frame_column_has_one_dtype_kind():
    named = {column for columns in COLUMNS.values() for column in columns}
    declared = [column for names in KINDS.values() for column in names]
    assert len(declared) == len(set(declared))  # one kind each
    assert set(declared) == named  # none missing, none unused


@pytest.mark.fast
def test_frames_read_back_from_json_equal_the_run_dtypes_included():
    """JSON has no NaN: a file holds None where the run held NaN (the model-free MLX
    runner's ``max_abs_diff``), and the tables read back equal the run's all the same."""
    frames = Frames.from_rows({
        "kv_pool": [{"rid": "a", "position": 0, "slot": 3, "verdict": "ok",
                     "max_abs_diff": math.nan}],
        "kv_syncs": [{"step": 1, "rid": "a", "kind": "prefill", "position": 0, "slot": 3,
                      "target": "own", "owner": None}],
        "relay": [{"event": "read", "step": 1, "launch": 0, "loop": "mlx", "kind": "decode",
                   "row": 0, "rid": "a", "value": 5, "last_published": None,
                   "published_for_rid": None},
                  {"event": "read", "step": 2, "launch": 1, "loop": "mlx", "kind": "decode",
                   "row": 0, "rid": "a", "value": 6, "last_published": 6,
                   "published_for_rid": True}],
    }, _meta())
    back = Frames.from_payload(json.loads(json.dumps(frames.to_payload())))
    for name, table in frames.tables.items():
        pd.testing.assert_frame_equal(back.tables[name], table, check_exact=True, obj=name)
    assert frames.kv_pool["max_abs_diff"].dtype == "float64"


@pytest.mark.parametrize("content", [b"", b"\xff\xfe", b"3", b"null", b"[" * 100_000],
                         ids=["empty", "not UTF-8", "a number", "null", "deep"])
def test_frames_load_of_non_frames_files(tmp_path, content):
    path = tmp_path / "f.json"
    path.write_bytes(content)
    with pytest.raises(FramesFormatError):
        Frames.load(path)
    with pytest.raises(FramesFormatError):
        Frames.load(tmp_path)  # a directory


# -- 3. unwritable and full cache directories -------------------------------------------------


@pytest.mark.parametrize("error", [errno.EROFS, errno.EACCES, None],
                         ids=["read-only", "no permission", "full disk"])
def test_a_failing_cache_write_keeps_the_run(private_cache, monkeypatch, error):
    private_cache.mkdir()
    _fail_writes(monkeypatch, private_cache, error)
    monkeypatch.setattr(cache, "_warned", set())
    with pytest.warns(cache.CacheWarning, match="could not store") as caught:
        frames = contract_lib.run("single-decode", "normal")
        again = contract_lib.run("single-decode", "normal")
    assert len([w for w in caught if issubclass(w.category, cache.CacheWarning)]) == 1
    assert frames.status == again.status == "finished" and len(frames.steps) > 0
    assert not _entries(private_cache) and _no_temporaries(private_cache)


def test_check_with_an_unwritable_cache_prints_its_verdict(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    monkeypatch.setenv("CONTRACT_LIB_CACHE_DIR", str(blocker / "frames"))
    monkeypatch.delenv("CONTRACT_LIB_NO_CACHE", raising=False)
    monkeypatch.setattr(cache, "_warned", set())
    with pytest.warns(cache.CacheWarning, match="could not store"):
        code = main(["check", "--loop", "normal", "--workload", "single-decode",
                     "--clauses", "rfc", "--out", str(tmp_path / "out.json")])
    out = capsys.readouterr().out
    assert code == 0 and "clause" in out.lower()
    assert Frames.load(tmp_path / "out.json").status == "finished"


# -- 4. cache clear deletes only its own files ------------------------------------------------


def test_an_empty_cache_variable_is_unset(tmp_path, monkeypatch, capsys):
    default = tmp_path / "default-cache"
    monkeypatch.setattr(cache, "DEFAULT_DIR", default, raising=False)
    work = tmp_path / "work"
    work.mkdir()
    (work / "precious.txt").write_text("user data\n")
    monkeypatch.chdir(work)
    monkeypatch.setenv("CONTRACT_LIB_CACHE_DIR", "")
    assert cache.cache_dir() == default
    assert main(["cache", "clear"]) == 0
    assert (work / "precious.txt").read_text() == "user data\n"


def test_clear_removes_only_the_caches_own_files(private_cache):
    cache.store("a" * 64, Frames.from_rows({}, _meta()))
    assert (private_cache / cache.MARKER).is_file()
    (private_cache / "notes.txt").write_text("mine\n")
    (private_cache / "results.json").write_text("{}\n")
    (private_cache / ("b" * 63 + ".json")).write_text("{}\n")  # not a sha256 name
    (private_cache / "sub").mkdir()
    (private_cache / "sub" / ("c" * 64 + ".json")).write_text("{}\n")
    (private_cache / f".{'a' * 64}.json.123.0badf00d.tmp").write_text("half")
    assert cache.clear() == 1
    left = sorted(p.name for p in private_cache.iterdir())
    assert left == sorted([cache.MARKER, "notes.txt", "results.json", "b" * 63 + ".json",
                           "sub"])
    assert (private_cache / "sub" / ("c" * 64 + ".json")).exists()


def test_clear_refuses_a_directory_without_the_marker(tmp_path, monkeypatch, capsys):
    users = tmp_path / "my-dir"
    users.mkdir()
    (users / "data.csv").write_text("1,2\n")
    monkeypatch.setenv("CONTRACT_LIB_CACHE_DIR", str(users))
    cache.store("d" * 64, Frames.from_rows({}, _meta()))  # stored, but not marked
    assert not (users / cache.MARKER).exists()
    before = sorted(p.name for p in users.iterdir())
    assert main(["cache", "clear"]) == 2
    err = capsys.readouterr().err
    assert "not a frame cache directory" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in users.iterdir()) == before
    assert (users / "data.csv").read_text() == "1,2\n"


def test_clear_empties_the_default_directory_of_an_older_version(tmp_path, monkeypatch):
    """The default directory (in the project checkout) is the cache's own even without a
    marker (older versions wrote none); still only its entries go."""
    default = tmp_path / "default-cache"
    default.mkdir()
    (default / ("f" * 64 + ".json")).write_text("{}\n")
    (default / "README").write_text("mine\n")
    monkeypatch.setattr(cache, "DEFAULT_DIR", default)
    monkeypatch.delenv("CONTRACT_LIB_CACHE_DIR", raising=False)
    assert cache.clear() == 1
    assert [p.name for p in default.iterdir()] == ["README"]


# -- 5. atomic writes -------------------------------------------------------------------------


def _no_temporaries(directory: Path) -> bool:
    return not [p for p in directory.iterdir() if p.name.endswith(".tmp")]


def test_a_frames_save_that_fails_midway_keeps_the_old_file(run_cached, tmp_path,
                                                            monkeypatch):
    frames = run_cached("single-decode", "normal")
    path = frames.save(tmp_path / "out" / "f.json")
    good = path.read_bytes()
    _fail_writes(monkeypatch, path.parent)
    with pytest.raises(OSError, match="No space left"):
        frames.save(path)
    assert path.read_bytes() == good and _no_temporaries(path.parent)


def test_a_frames_save_whose_serializer_fails_keeps_the_old_file(run_cached, tmp_path):
    frames = run_cached("single-decode", "normal")
    path = frames.save(tmp_path / "f.json")
    good = path.read_bytes()
    broken = Frames(tables=frames.tables, meta={**frames.meta, "bad": object()})
    with pytest.raises(TypeError):
        broken.save(path)
    assert path.read_bytes() == good and _no_temporaries(tmp_path)


def test_a_trace_write_that_fails_midway_keeps_the_old_file(run_cached, tmp_path,
                                                            monkeypatch):
    from contract_lib.campaigns.trace import write_trace

    runs = [run_cached("single-decode", "normal")]
    path = write_trace(runs, tmp_path / "t.trace.json")
    good = path.read_bytes()
    _fail_writes(monkeypatch, tmp_path)
    with pytest.raises(OSError, match="No space left"):
        write_trace(runs, path)
    assert path.read_bytes() == good and _no_temporaries(tmp_path)


def test_a_cache_store_that_fails_midway_keeps_the_old_entry(private_cache, monkeypatch):
    frames = Frames.from_rows({}, _meta())
    cache.store("e" * 64, frames)
    entry = private_cache / f"{'e' * 64}.json"
    good = entry.read_bytes()
    _fail_writes(monkeypatch, private_cache)
    monkeypatch.setattr(cache, "_warned", set())
    with pytest.warns(cache.CacheWarning, match="No space left"):
        cache.store("e" * 64, Frames.from_rows({}, _meta(workload="other")))
    assert entry.read_bytes() == good and _no_temporaries(private_cache)


@pytest.mark.parametrize("loop, kwargs", [
    ("normal", {}), ("overlap", {"audit": True}), ("mlx", {}), ("mlx", {"runner": "real"}),
    ("mlx-normal", {}), ("disagg-prefill-overlap", {}), ("disagg-decode-normal", {})])
def test_a_run_loads_nothing_of_the_library_outside_its_run_side(loop, kwargs):
    """The cache key and the server fingerprint cover only ``paths.RUN_SIDE``: a module
    of the library a run imported from elsewhere (the checker, the views) would shape
    frames unkeyed. The run reports every module it loaded from outside the keyed and
    installed code (``user_modules``): none may be the library's."""
    from contract_lib.paths import PACKAGE_DIR

    frames = contract_lib.run("staggered", loop, cache=False, **kwargs)
    assert frames.status == "finished", frames.error
    library = [path for path in frames.meta["user_modules"]
               if Path(path).resolve().is_relative_to(PACKAGE_DIR)]
    assert library == []
