"""What a reader sees, checked against runs: the docs' generated blocks and their
generators, the SGLang lines and project names the docs give, ``environment.yml``, and
the executed notebooks as a static site.

- :mod:`.docs_check`: ``scripts/check-docs``, every check below;
- :mod:`.markers`: generated blocks between markers, with a digest of their text;
- :mod:`.generators`: the generators by name; :mod:`.file_blocks` (committed files, the
  test suite) and :mod:`.run_blocks` (runs of SGLang's loops) register them;
- :mod:`.prose`: which files, and where their prose is;
- :mod:`.sglang_lines`: SGLang file:line references against the installed source;
- :mod:`.project_paths`: the paths, modules and tests the docs name;
- :mod:`.environment`: ``environment.yml`` from ``pyproject.toml``;
- :mod:`.static_site`: ``scripts/build-site``, the notebooks and docs as static HTML.
"""
