"""SGLang 0.5.21 and 0.5.22 beside the venv's 0.5.23, each from its own install folder
(0.5.14-0.5.20: tests/test_history.py).

The first use of each older release downloads its wheel (~30 MB) from PyPI once into
``.cache/sglang/<version>``; later sessions reuse the folder.
"""

from __future__ import annotations

import dataclasses
import subprocess

import pandas as pd
import pytest

import contract_lib
from contract_lib import loops
from contract_lib.campaigns.status import releases_status
from contract_lib.cli import main
from contract_lib.contract import check, kv_damage
from contract_lib.runs import fingerprint
from contract_lib.runs.pool import child_env
from contract_lib.sources import versions
from contract_lib.sources.tiny_model import reference_outputs
from contract_lib.wire.spec import RunSpec

# Tier: other SGLang releases / sglang-omni, installed from the package index on first use.
pytestmark = pytest.mark.releases

OLDER = ("0.5.21", "0.5.22")
RELEASES = ("0.5.21", "0.5.22", "0.5.23")


# -- choosing a release ----------------------------------------------------------------------


@pytest.mark.parametrize("version", ["0.5.13", "0.5.24", "0.4.0"])
def test_unsupported_release_fails_before_anything_runs(version, monkeypatch):
    def no_install(*_args, **_kwargs):
        raise AssertionError("an unsupported release must not be installed")

    monkeypatch.setattr(versions, "install_release", no_install)
    monkeypatch.setattr(contract_lib.runs.harness, "_execute", no_install)
    with pytest.raises(contract_lib.UnsupportedSGLangError,
                       match=rf"requested sglang: {version}.*supports sglang "
                             r"0\.5\.23, 0\.5\.22, .*, 0\.5\.15, 0\.5\.14"):
        contract_lib.run("two-turn", "mlx", sglang=version)


def test_cli_rejects_an_unsupported_release(capsys):
    assert main(["check", "--loop", "mlx", "--workload", "two-turn",
                 "--sglang", "0.5.13"]) == 2
    assert "requested sglang: 0.5.13" in capsys.readouterr().err


def test_the_venv_release_needs_no_folder():
    assert versions.installed_sglang_version() == "0.5.23"
    assert versions.sglang_path(None) is None
    assert versions.sglang_path("0.5.23") is None


@pytest.mark.parametrize("version", OLDER)
def test_older_release_is_installed_in_its_own_folder(version):
    folder = versions.sglang_path(version)
    assert folder == versions.release_folder(version)
    assert (folder / "sglang" / "__init__.py").is_file()
    assert (folder / f"sglang-{version}.dist-info").is_dir()
    env = child_env(folder)
    assert env["PYTHONPATH"].split(":")[0] == str(folder)
    # The cache key reads the folder's SGLang, not the venv's.
    spec = RunSpec(contract_lib.load_workload("two-turn"), loops.spec("mlx"), sglang=version)
    assert fingerprint.key(dataclasses.replace(spec, sglang_dir=str(folder))) != \
        fingerprint.key(spec)


def test_a_failing_install_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv(versions.RELEASES_DIR_ENV, str(tmp_path))

    def failing_pip(command, **_kwargs):
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching "
                                           "distribution found for sglang==0.5.21")

    monkeypatch.setattr(versions.subprocess, "run", failing_pip)
    with pytest.raises(contract_lib.SGLangInstallError,
                       match=r"(?s)could not install sglang 0\.5\.21.*network access.*"
                             "No matching distribution"):
        versions.install_release("0.5.21")
    # Nothing half-installed: only the lock file is left.
    assert [path.name for path in tmp_path.iterdir()] == [".install.lock"]


# -- runs on each release --------------------------------------------------------------------


@pytest.mark.parametrize("version", OLDER)
def test_model_free_run_on_an_older_release(run_cached, version):
    frames = run_cached("two-turn", "mlx", sglang=version)
    assert frames.status == "finished", frames.error
    assert frames.meta["sglang_version"] == version
    compat = {"backport-stub-logical-max-total-num-tokens"}
    applied = compat & set(frames.meta["shims"])
    assert applied == (compat if version == "0.5.21" else set())
    # The scheduler's bookkeeping is the same as on 0.5.23: same tokens, same slots.
    current = run_cached("two-turn", "mlx")
    assert frames.output_tokens() == current.output_tokens()
    pd.testing.assert_frame_equal(frames.slots, current.slots)


def test_0_5_21_needs_the_stub_backport_to_start():
    """Without the backport, 0.5.21's own stub fails the Scheduler build (upstream bug)."""
    frames = contract_lib.run("two-turn", "normal", sglang="0.5.21",
                              patch="user_patches:undo_stub_backport")
    assert frames.status == "crashed" and frames.error["phase"] == "setup"
    assert "kv_cache_configurator" in frames.error["message"]


def test_cold_child_imports_the_same_release(run_cached):
    cold = contract_lib.run("two-turn", "mlx", sglang="0.5.21", runner="real", warm=False,
                            cache=False)
    assert cold.status == "finished", cold.error
    warm = run_cached("two-turn", "mlx", sglang="0.5.21", runner="real")
    for name, table in cold.comparable().items():
        pd.testing.assert_frame_equal(table, warm.comparable()[name], obj=name)


def test_0_5_21_shipped_the_wrong_output(run_cached):
    """0.5.21's own code, no patch: the unclamped sync writes into slot 0 and into a2's
    slots, and a2 (a radix hit on a's reused row) emits other tokens than mlx-lm."""
    frames = run_cached("two-turn", "mlx", sglang="0.5.21", runner="real")
    assert frames.status == "finished", frames.error
    table = kv_damage.summary_table(frames).set_index("rid")
    assert table.loc["a", "into slot 0"] > 0 and table.loc["a", "into another live request"] > 0
    reference = reference_outputs("two-turn")
    outputs = frames.output_tokens()
    assert outputs["a2"] != reference["a2"]
    assert {rid: outputs[rid] for rid in "abc"} == {rid: reference[rid] for rid in "abc"}
    # The revert patch on 0.5.23 replays exactly this run.
    replay = run_cached("two-turn", "mlx", "unclamped-sync", runner="real")
    for name in ("kv_syncs", "kv_pool", "outputs", "slots", "requests"):
        pd.testing.assert_frame_equal(frames.comparable()[name], replay.comparable()[name],
                                      obj=name)


MLX_FIXES = ("fix-chained-accounting+fix-idle-predicate+fix-processed-tokens-counter"
             "+fix-backend-state")


def test_0_5_21s_removal_sync_damages_the_pool_on_the_model_free_runner_too(run_cached):
    """0.5.21's ``remove_request`` syncs a request's decode KV unclamped: with every MLX
    fix on, memory-pressure retracts ``d``, and its removal writes position 8 into a slot
    ``c`` now holds. The model-free runner runs 0.5.21's own sync, so its pool shows what
    the real runner's does; status shows the KV pool row once a run damaged it."""
    frames = run_cached("memory-pressure", "mlx", MLX_FIXES, sglang="0.5.21")
    real = run_cached("memory-pressure", "mlx", MLX_FIXES, sglang="0.5.21", runner="real")
    writes = frames.kv_syncs[frames.kv_syncs.target == "other live request"]
    assert writes[["rid", "kind", "owner"]].values.tolist() == [["d", "remove", "c"]]
    pd.testing.assert_frame_equal(kv_damage.summary_table(frames), kv_damage.summary_table(real))
    assert "the MLX KV pool was damaged" in check(frames).verdict().line()
    table = releases_status(["0.5.21"], workloads=["memory-pressure"], loops=("mlx",),
                            patch=MLX_FIXES, progress=False).statuses[0].table()
    assert table.loc["- KV pool (model-free runner's contents)", "mlx"] == "damaged (1/1)"
    assert not kv_damage.damaged(run_cached("memory-pressure", "mlx", MLX_FIXES))


@pytest.mark.parametrize("version", ["0.5.22", "0.5.23"])
def test_the_clamped_releases_do_not_damage_the_pool(run_cached, version):
    frames = run_cached("two-turn", "mlx", sglang=version, runner="real")
    assert frames.status == "finished", frames.error
    assert not kv_damage.damaged(frames)
    assert frames.output_tokens() == reference_outputs("two-turn")


def test_unclamped_sync_fails_loudly_on_the_release_that_has_it(run_cached):
    frames = run_cached("two-turn", "mlx", "unclamped-sync", sglang="0.5.21", runner="real")
    assert frames.status == "crashed"
    assert frames.error["type"] == "PatchError"


# -- the clause tables side by side ----------------------------------------------------------


def test_clause_tables_of_three_releases_side_by_side():
    result = releases_status(list(RELEASES), workloads=["two-turn"], progress=False)
    table = result.table()
    assert list(table.columns) == list(RELEASES)
    # Measured: the scheduler's bookkeeping, hence every clause, is the same on all three;
    # 0.5.21's unclamped sync damages the MLX pool (the model-free runner's contents).
    kv = table.loc["- KV pool (model-free runner's contents)"]
    assert kv.loc["mlx"].tolist() == ["damaged (1/1)", "intact (1/1)", "intact (1/1)"]
    assert kv.loc["normal"].tolist() == ["-"] * 3
    clauses = table.drop(index="- KV pool (model-free runner's contents)", level="clause")
    assert (clauses.nunique(axis=1) == 1).all(), table
    assert table.loc[("1 slots recorded", "mlx"), "0.5.21"] == "violated (1/1)"
    assert table.loc[("1 slots recorded", "normal"), "0.5.23"] == "holds (1/1)"
    assert result.reference_violations().empty


def test_cli_status_with_the_real_runner_shows_the_damaged_release(capsys):
    code = main(["status", "--runner", "real", "--workload", "two-turn",
                 *[arg for version in RELEASES for arg in ("--sglang", version)]])
    out = capsys.readouterr().out
    assert code == 0
    header, *rows = out.splitlines()
    assert all(f"sglang {version}" in header for version in RELEASES)
    kv_row = next(row for row in rows if row.startswith("- KV pool"))
    assert kv_row.split()[-6:] == ["damaged", "(1/1)", "intact", "(1/1)", "intact", "(1/1)"]
