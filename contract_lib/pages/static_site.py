"""``scripts/build-site``: the executed notebooks (with their stored figures) and the docs
as static HTML, for reviewers who will not run Jupyter; and the check that every local
link of the site resolves.

The site keeps the checkout's layout (``notebooks/NN-name.html``, ``docs/name.html``,
``docs/findings/name/issue.html``, ``README.html``) so relative links stay valid once ``.md`` and ``.ipynb`` become
``.html``; a repository file a page links to is copied beside it. ``index.html`` lists
the notebooks in reading order and the docs. A Markdown table that does not parse is
named too.
"""

from __future__ import annotations

import html
import re
import shutil
import sys
from pathlib import Path

from contract_lib.paths import PROJECT_ROOT

DEFAULT_OUT = PROJECT_ROOT / "build" / "site"
_LINK = re.compile(r'(?P<attr>href|src)="(?P<url>[^"]*)"')
_EXTERNAL = ("http:", "https:", "mailto:", "data:", "javascript:")


def slug(text: str) -> str:
    """A heading's anchor as GitHub writes it."""
    text = re.sub(r"<[^>]+>", "", html.unescape(text)).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _markdown():
    import mistune
    from mistune.renderers.html import HTMLRenderer

    class Anchored(HTMLRenderer):
        """Headings with GitHub's anchors, so ``doc.md#section`` links resolve."""

        def heading(self, text: str, level: int, **attrs) -> str:
            return f'<h{level} id="{slug(text)}">{text}</h{level}>\n'

    return mistune.create_markdown(escape=False, renderer=Anchored(escape=False),
                                   plugins=["table", "strikethrough", "url"])


def _page(title: str, body: str) -> str:
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>body{{max-width:62em;margin:2em auto;"
            "padding:0 1em;font-family:sans-serif;line-height:1.45}table{border-collapse:"
            "collapse}td,th{border:1px solid #ccc;padding:.2em .5em;vertical-align:top}"
            "code,pre{background:#f4f4f4}pre{padding:.6em;overflow-x:auto}</style></head>"
            f"<body>\n{body}\n</body></html>\n")


def _relink(text: str, page: Path, out: Path, root: Path) -> str:
    """``.md``/``.ipynb`` links made ``.html``; a linked repository file copied."""
    def swap(match: re.Match) -> str:
        url = match["url"]
        path, hashmark, fragment = url.partition("#")
        if not path or url.startswith(_EXTERNAL):
            return match.group(0)
        if path.endswith((".md", ".ipynb")):
            path = path.rsplit(".", 1)[0] + ".html"
        else:
            source = (root / page.parent / path).resolve()
            if source.is_file() and source.is_relative_to(root):
                target = out / source.relative_to(root)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, target)
        return f'{match["attr"]}="{path}{hashmark}{fragment}"'
    return _LINK.sub(swap, text)


def _notebook_title(path: Path) -> str:
    import nbformat

    for cell in nbformat.read(path, as_version=4).cells:
        heading = re.search(r"^# (.+)$", cell.source, re.MULTILINE)
        if cell.cell_type == "markdown" and heading:
            return heading.group(1).replace("`", "")
    return path.stem


def build(out: Path = DEFAULT_OUT, root: Path = PROJECT_ROOT) -> list[Path]:
    """Write the site into ``out`` (emptied first); the pages written."""
    from nbconvert import HTMLExporter

    if out.exists():
        shutil.rmtree(out)
    pages, markdown = [], _markdown()
    exporter = HTMLExporter(template_name="lab")
    notebooks = sorted((root / "notebooks").glob("*.ipynb"))
    for notebook in notebooks:
        relative = notebook.relative_to(root).with_suffix(".html")
        body, _ = exporter.from_filename(str(notebook))
        pages.append(_write(out / relative, _relink(body, relative, out, root)))
    docs = [root / "README.md", *sorted((root / "docs").rglob("*.md")),
            *sorted((root / "benchmarks").glob("*.md"))]
    for doc in docs:
        relative = doc.relative_to(root).with_suffix(".html")
        body = _relink(markdown(doc.read_text()), relative, out, root)
        pages.append(_write(out / relative, _page(doc.name, body)))
    items = "".join(f'<li><a href="{n.relative_to(root).with_suffix(".html")}">{n.stem}</a>: '
                    f"{html.escape(_notebook_title(n))}</li>\n" for n in notebooks)
    links = "".join(f'<li><a href="{d.relative_to(root).with_suffix(".html")}">'
                    f"{d.relative_to(root)}</a></li>\n" for d in docs)
    index = (f"<h1>contract_lib: the executed notebook suite</h1>\n<p>Each notebook as "
             f"stored, with its outputs and figures, in reading order; then the docs.</p>\n"
             f"<h2>Notebooks</h2>\n<ol>\n{items}</ol>\n<h2>Docs</h2>\n<ul>\n{links}</ul>")
    pages.append(_write(out / "index.html", _page("contract_lib", index)))
    return pages


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def broken_links(out: Path) -> list[str]:
    """``page: url`` of every local link or image of the site whose file, or anchor in
    it, does not exist."""
    ids: dict[Path, set[str]] = {}

    def anchors(page: Path) -> set[str]:
        if page not in ids:
            ids[page] = set(re.findall(r'\b(?:id|name)="([^"]+)"', page.read_text()))
        return ids[page]

    broken = []
    for page in sorted(out.rglob("*.html")):
        for match in _LINK.finditer(page.read_text()):
            url = html.unescape(match["url"])
            if url.startswith(_EXTERNAL):
                continue
            path, _, fragment = url.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.is_file() or (fragment and target.suffix == ".html"
                                        and fragment not in anchors(target)):
                broken.append(f"{page.relative_to(out)}: {url}")
    return broken


def broken_tables(out: Path) -> list[str]:
    """``page: row`` of every Markdown table row rendered as a paragraph: the table did
    not parse (most often a ``|`` inside a code span, which GitHub splits on too: write
    ``\\|``)."""
    return [f"{page.relative_to(out)}: {row[:80]}" for page in sorted(out.rglob("*.html"))
            for row in re.findall(r"<p>(\|[^\n]*)", page.read_text())]


def main(argv: list[str]) -> int:
    out = Path(argv[0]).resolve() if argv else DEFAULT_OUT
    pages = build(out)
    broken = broken_links(out)
    for line in broken:
        print(f"broken link: {line}")
    tables = broken_tables(out)
    for line in tables:
        print(f"table not rendered: {line}")
    print(f"build-site: {len(pages)} pages in {out}; open {out / 'index.html'}",
          file=sys.stderr)
    return 1 if broken or tables else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
