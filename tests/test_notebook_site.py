"""``scripts/build-site`` (:mod:`contract_lib.pages.static_site`): the executed notebooks
and the docs as static HTML, every local link resolving and every table parsed. The
first test builds the whole site (the notebooks tier)."""

from __future__ import annotations

import re

import pytest

from contract_lib.pages import static_site as site

ROOT = site.PROJECT_ROOT


def test_the_site_has_every_notebook_with_its_figures_and_no_broken_link(tmp_path):
    pages = site.build(tmp_path)
    assert site.broken_links(tmp_path) == []
    assert site.broken_tables(tmp_path) == []
    index = (tmp_path / "index.html").read_text()
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    for notebook in notebooks:
        page = tmp_path / "notebooks" / f"{notebook.stem}.html"
        assert page in pages and f'href="notebooks/{page.name}"' in index
        figures = page.read_text().count("data:image/png;base64,")
        stored = notebook.read_text().count('"image/png"')
        assert figures >= stored, f"{page.name}: {figures} figures of {stored} stored"
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        assert f'href="{doc.relative_to(ROOT).with_suffix(".html")}"' in index


@pytest.mark.fast
def test_a_broken_link_or_anchor_is_named(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.html").write_text('<h2 id="here">x</h2><a href="#here">ok</a>'
                                              '<a href="#gone">no anchor</a>')
    (tmp_path / "index.html").write_text('<a href="docs/a.html#here">ok</a>'
                                         '<a href="docs/b.html">missing</a>'
                                         '<img src="https://example.org/x.png">')
    assert site.broken_links(tmp_path) == ["docs/a.html: #gone", "index.html: docs/b.html"]


@pytest.mark.fast
def test_a_table_with_an_unescaped_pipe_in_code_is_named(tmp_path):
    page = tmp_path / "doc.html"
    page.write_text(site._markdown()("| a | b |\n|---|---|\n| `x|y` | z |\n"))
    assert site.broken_tables(tmp_path) == ["doc.html: | a | b |"]
    page.write_text(site._markdown()("| a | b |\n|---|---|\n| `x\\|y` | z |\n"))
    assert site.broken_tables(tmp_path) == []


@pytest.mark.fast
def test_headings_get_githubs_anchors():
    assert site.slug("The other loops SGLang dispatches to: MLX without overlap and PD "
                     "disaggregation") == ("the-other-loops-sglang-dispatches-to-mlx-without-"
                                           "overlap-and-pd-disaggregation")
    assert site.slug("Clause 1 end to end (<code>notebooks/08</code>)") == (
        "clause-1-end-to-end-notebooks08")
    assert re.fullmatch(r"[\w-]+", site.slug("A, b: c"))
