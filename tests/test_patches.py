"""Source patches and the bug catalog, without running SGLang."""

from __future__ import annotations

import re

import pytest

from contract_lib.patches.builtin import BUILTIN_PATCHES, PatchError, patch_source, patch_spec
from contract_lib.patches.catalog import bug_catalog


@pytest.fixture()
def module(module_on_disk):
    """A tiny module on disk, fresh for every test."""
    return module_on_disk("fake_sglang_module",
                          "def helper():\n    return 'real'\n\n\n"
                          "class Loop:\n"
                          "    def step(self):\n"
                          "        x = 1\n"
                          "        if x:\n"
                          "            x += 1\n"
                          "        return helper(), x\n")


def test_patch_source_replaces_at_any_indentation(module, monkeypatch):
    patch_source(module.Loop, "step", [("x += 1\n", "x += 10\n")], "t")
    assert module.Loop().step() == ("real", 11)


def test_patched_function_sees_later_rebinding_of_module_names(module, monkeypatch):
    patch_source(module.Loop, "step", [("x = 1\n", "x = 2\n")], "t")
    monkeypatch.setattr(module, "helper", lambda: "hooked")
    assert module.Loop().step() == ("hooked", 3)


def test_patch_source_fails_loudly_when_the_code_moved(module):
    with pytest.raises(PatchError, match="found 0"):
        patch_source(module.Loop, "step", [("y = 1\n", "y = 2\n")], "t")


def test_patch_spec_combines_and_validates():
    assert patch_spec(["fix-chained-accounting", "fix-idle-predicate"]) == (
        "fix-chained-accounting+fix-idle-predicate")
    assert patch_spec("user_patches:raise_in_loop") == "user_patches:raise_in_loop"
    with pytest.raises(PatchError, match="unknown patch 'nope'"):
        patch_spec("fix-idle-predicate+nope")
    with pytest.raises(PatchError, match="cannot import it"):
        patch_spec(lambda: None)


def test_bug_catalog_replays_name_real_patches_and_workloads():
    import contract_lib
    from contract_lib.contract import CLAUSES

    bugs = bug_catalog()
    assert {1, 2, 3, 4, 5} <= {b["clause"] for b in bugs} <= set(CLAUSES)  # every RFC clause
    for bug in bugs:
        assert {"id", "prs", "clause", "field", "symptom", "flags", "affected",
                "measured", "replay"} <= set(bug)
        for name in re.findall(r"patch ([\w-]+)", bug["replay"]):
            assert name in BUILTIN_PATCHES, bug["id"]
        for name in re.findall(r"workload ([\w-]+)", bug["replay"]):
            assert name in contract_lib.workload_names(), bug["id"]


def test_a_patch_named_twice_applies_once():
    assert patch_spec("skip-relay-publish+skip-relay-publish") == "skip-relay-publish"


def test_a_user_patch_from_a_missing_module_is_a_usage_error():
    with pytest.raises(PatchError, match="no module 'nosuch.module'"):
        patch_spec("nosuch.module:fn")
