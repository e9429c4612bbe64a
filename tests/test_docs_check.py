"""``scripts/check-docs`` (:mod:`contract_lib.pages.docs_check`): the docs' numbers are
what their runs give, their SGLang lines hold their code, their names exist, and
environment.yml mirrors pyproject.toml. The fast tests check what committed files decide
and show each check failing; the others regenerate every block from runs."""

from __future__ import annotations

import re

import pytest

from contract_lib.pages import docs_check, markers, prose, sglang_lines
from contract_lib.pages.generators import generate


@pytest.mark.fast
def test_the_committed_docs_pass_the_checks_that_need_no_run():
    """Blocks not edited by hand (and those from committed files current), SGLang lines
    in place, names existing, environment.yml generated from pyproject.toml."""
    assert docs_check.run(needs="files") == []


@pytest.mark.fast
def test_a_number_edited_by_hand_is_named_with_its_file_and_block(tmp_path):
    doc = tmp_path / "doc.md"
    block = markers.Block(0, "fixtures", "", 0, 0, "", inline=True)
    doc.write_text(f"The fast tier reads {markers.render(block, generate(block))}.\n")
    assert docs_check.check_blocks([doc], "files", write=False) == []
    doc.write_text(doc.read_text().replace(" runs saved", "1 runs saved", 1))
    problems = docs_check.check_blocks([doc], "files", write=False)
    assert problems == [f"{doc}:1: block `fixtures`: edited by hand (its text no longer has "
                        "its digest); regenerate it with scripts/check-docs --write"]
    assert docs_check.check_blocks([doc], "files", write=True) == []
    assert docs_check.check_blocks([doc], "files", write=False) == []


@pytest.mark.fast
def test_a_stale_block_shows_what_the_generator_writes_now(tmp_path):
    doc = tmp_path / "doc.md"
    block = markers.Block(0, "fixtures", "", 0, 0, "", inline=False)
    doc.write_text("# A doc\n\n" + markers.render(block, "2 runs, 0.1 MB") + "\n")
    [problem] = docs_check.check_blocks([doc], "files", write=False)
    assert problem.startswith(f"{doc}:3: block `fixtures`: stale; scripts/check-docs")
    assert "-2 runs, 0.1 MB" in problem and "+" + generate(block) in problem


@pytest.mark.fast
def test_a_moved_sglang_line_fails_and_write_moves_its_number(tmp_path, monkeypatch):
    """The reference `managers/x.py:3` and a bare `:5` after it; code inserted above
    them moves both; ``write`` moves the numbers in the doc and the table."""
    source = tmp_path / "site" / "sglang" / "srt" / "managers" / "x.py"
    source.parent.mkdir(parents=True)
    source.write_text("a = 1\nb = 2\ndef here():\n    pass\nthere = 5\n")
    table = tmp_path / "lines.toml"
    table.write_text("# header\n\n")
    entries = [sglang_lines.Entry("sglang/srt/managers/x.py", 3, "def here():"),
               sglang_lines.Entry("sglang/srt/managers/x.py", 5, "there = 5")]
    sglang_lines.save(entries, table)
    doc = tmp_path / "doc.md"
    doc.write_text("`here` (`managers/x.py:3`) and `there` (:5).\n\n`unknown.py:9`\n")
    monkeypatch.setattr(sglang_lines, "root_dir",
                        lambda root, install=False, package="sglang": tmp_path / "site")
    [unknown] = sglang_lines.check([doc], sglang_lines.load(table))
    assert unknown.problem == "unknown" and unknown.ref.path == "unknown.py"
    doc.write_text(doc.read_text().split("\n\n")[0] + "\n")
    assert sglang_lines.check([doc], sglang_lines.load(table)) == []

    source.write_text("import os\n" + source.read_text())
    findings = sglang_lines.check([doc], sglang_lines.load(table))
    assert [(f.problem, f.moved_to) for f in findings] == [("moved", 4), ("moved", 6)]
    assert "`def here():` is now at line 4" in findings[0].line(tmp_path)
    sglang_lines.write(findings, sglang_lines.load(table), table)
    assert doc.read_text() == "`here` (`managers/x.py:4`) and `there` (:6).\n"
    assert sglang_lines.check([doc], sglang_lines.load(table)) == []

    source.write_text(source.read_text().replace("def here():", "def elsewhere():"))
    [gone] = sglang_lines.check([doc], sglang_lines.load(table))
    assert gone.problem == "gone"


@pytest.mark.fast
def test_a_stale_project_path_and_an_out_of_date_environment_fail(tmp_path, monkeypatch):
    from contract_lib.pages import environment, project_paths

    doc = tmp_path / "doc.md"
    doc.write_text("See `contract_lib/capture.py`, `contract_lib.contract.nothing_here` and "
                   "`test_no_such_test`; `contract_lib/verdict.py` exists.\n")
    problems = project_paths.check([doc])
    assert [p.split(": ", 1)[1] for p in problems] == [
        "`contract_lib/capture.py`: no such file or folder",
        "`contract_lib.contract.nothing_here`: contract_lib.contract has no nothing_here",
        "`test_no_such_test`: no such test in tests/"]
    stale = tmp_path / "environment.yml"
    stale.write_text(environment.render().replace("pandas==", "pandas>="))
    monkeypatch.setattr(environment, "ENVIRONMENT", stale)
    assert docs_check.check_environment(write=False) == [
        "environment.yml: differs from what pyproject.toml generates; "
        "scripts/check-docs --write rewrites it"]
    assert "      - hypothesis==" in environment.render()


@pytest.mark.fast
def test_a_begin_marker_without_a_digest_is_an_error_not_skipped():
    with pytest.raises(markers.MarkerError, match="line 2: a begin marker without"):
        markers.blocks("text\n<!-- begin generated: fixtures -->x<!-- end generated -->\n")


@pytest.mark.fast
def test_no_markdown_heading_sits_in_a_notebook_code_cell():
    """A heading commented into a code cell shows as a `#` comment and runs off the
    screen (00's reading order did); every heading of a notebook source is Markdown."""
    for source in prose.notebook_sources():
        text = source.read_text()
        markdown = prose.regions(source, text)
        for heading in re.finditer(r"^# #+ .*$", text, re.MULTILINE):
            assert any(start <= heading.start() < end for start, end in markdown), (
                f"{source.name}: {heading.group(0)!r} is in a code cell")


@pytest.mark.parametrize("doc", prose.doc_files(),
                         ids=lambda path: path.relative_to(prose.PROJECT_ROOT).as_posix())
def test_every_block_that_needs_the_venvs_sglang_is_current(doc):
    """Regenerates each block from the test suite's collection and from runs of the
    venv's SGLang (cached runs are read back): ``scripts/check-docs --needs runs`` a doc
    at a time, so the xdist workers share them (the checks that need no run are the fast
    test's above)."""
    assert docs_check.check_blocks([doc], "runs", write=False) == []


@pytest.mark.releases
def test_every_block_is_current_on_every_release_it_names():
    """The blocks that drive other releases or sglang-omni (the others are regenerated
    by the test above), and the SGLang lines the docs cite in every release."""
    assert docs_check.run(needs="releases", least="releases") == []
