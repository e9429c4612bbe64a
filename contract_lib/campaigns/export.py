"""A source patch written as an upstream diff (``python -m contract_lib patch export``).

A source patch is made of :func:`~contract_lib.patches.source.patch_source` calls, each an
exact edit of one SGLang function. The patch runs in a fresh interpreter where the chosen
SGLang (the venv's, a release or a source tree: :func:`contract_lib.sources.origin.resolve`) is
imported as every run imports it, with ``patch_source`` recording each edit (file, first
line, the function's text before and after) instead of installing it. Every attribute of
every SGLang module and class is compared before and after the patch: a patch that
changes anything else (installs a wrapper, assigns a method) is not a source patch, and
:class:`ExportError` names what it does besides. The edits, applied to copies of their
files, are written by ``git diff`` in the upstream layout (``a/python/sglang/...``), which
``git apply`` and ``--diff`` take, and on which ``compare --head diff=`` judges as on the
patch itself (``tests/test_export.py``).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from contract_lib.patches.builtin import PatchError, patch_spec
from contract_lib.patches.source import added_names, edited, function_source
from contract_lib.runs.pool import child_env
from contract_lib.sources.origin import Source, resolve

EXPORT_TIMEOUT_S = 300
# What a run's process imports before its patch runs (contract_lib.child.preload.preload):
# the modules built-in patches edit, so their state is recorded before the patch.
PRELOAD = ("sglang.srt.managers.scheduler", "sglang.srt.server_args",
           "sglang.srt.hardware_backend.mlx.model_runner",
           "sglang.srt.hardware_backend.mlx.model_runner_stub",
           "sglang.srt.hardware_backend.mlx.runtime",
           "sglang.srt.hardware_backend.mlx.scheduler_mixin",
           "sglang.srt.hardware_backend.mlx.tp_worker")
_MISSING = object()


class ExportError(PatchError):
    """The patch cannot be written as a diff (not a source patch, or it does not apply)."""


@dataclasses.dataclass
class Edit:
    """One function's edit: its file (under the SGLang folder), first line, and text
    before (as in the file) and after (without its common indentation)."""

    file: str
    line: int
    original: str
    text: str


def export_patch(patch: str, sglang: str | Path | Source | None = None) -> str:
    """The diff of ``patch`` (a built-in or ``module:callable`` source patch, or several
    joined with ``+``) against ``sglang``; :class:`ExportError` when it is not only a
    source patch or does not apply there."""
    diff = export_patches([patch], sglang)[patch]
    if isinstance(diff, ExportError):
        raise diff
    return diff


def export_patches(patches: Sequence[str], sglang: str | Path | Source | None = None
                   ) -> dict[str, str | ExportError]:
    """Each patch's diff against ``sglang``, or the :class:`ExportError` that refuses it,
    by patch. One export process imports SGLang once and records each patch in a fork
    of its own (~5 s of imports per release instead of per patch)."""
    specs = {patch: patch_spec(patch) for patch in patches}
    for patch, spec in specs.items():
        if spec is None:
            raise ExportError("patch export: no patch named")
    source = sglang if isinstance(sglang, Source) else resolve(sglang)
    records = _records(list(specs.values()), source)
    return {patch: _diff_or_error(spec, records[spec], source)
            for patch, spec in specs.items()}


def _diff_or_error(spec: str, record: dict[str, Any], source: Source) -> str | ExportError:
    where = f"sglang {source.label}"
    if record.get("failed"):
        return ExportError(f"patch {spec!r}: the export process failed: {record['failed']}")
    if record.get("error"):
        return ExportError(record["error"])
    if record["other"]:
        return ExportError(f"patch {spec!r} is not only a source patch (patch_source "
                           f"edits): it also {'; '.join(record['other'])}")
    if not record["edits"]:
        return ExportError(f"patch {spec!r} makes no source edit on {where}")
    try:
        return _diff(Path(record["root"]), [Edit(**e) for e in record["edits"]], where)
    except ExportError as exc:
        return exc


def _records(specs: list[str], source: Source) -> dict[str, dict[str, Any]]:
    """Run the patches in a fresh interpreter (this module's :func:`main`) and read what
    each recorded, by spec."""
    what = (f"patch {specs[0]!r}" if len(specs) == 1
            else "patches " + ", ".join(map(repr, specs)))
    with tempfile.TemporaryDirectory(prefix="contract_lib-export-") as tmp:
        out = Path(tmp) / "records.json"
        try:
            done = subprocess.run([sys.executable, "-m", "contract_lib.campaigns.export",
                                   str(out), *specs],
                                  env=child_env(source.sglang_dir), capture_output=True,
                                  text=True, timeout=EXPORT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise ExportError(f"{what}: export timed out after "
                              f"{EXPORT_TIMEOUT_S} s") from None
        if done.returncode != 0 or not out.is_file():
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise ExportError(f"{what}: the export process failed "
                              f"(exit {done.returncode}): {tail}")
        return json.loads(out.read_text())


def _diff(root: Path, edits: list[Edit], where: str) -> str:
    """``git diff`` of the edited files against their originals, upstream layout."""
    with tempfile.TemporaryDirectory(prefix="contract_lib-export-") as tmp:
        for file in sorted({e.file for e in edits}):
            text = (root / file).read_text()
            lines = text.splitlines(keepends=True)
            for edit in sorted((e for e in edits if e.file == file), key=lambda e: -e.line):
                original = edit.original.splitlines(keepends=True)
                start = edit.line - 1
                if lines[start:start + len(original)] != original:
                    raise ExportError(f"{file} on disk differs from the code {where} "
                                      f"imported at line {edit.line}")
                lines[start:start + len(original)] = _as_compiled(
                    edit, _reindented(edit.original, edit.text), file)
            for side, content in (("a", text), ("b", "".join(lines))):
                path = Path(tmp) / side / "python" / file
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(content)
        # No user or system configuration (a diff.noprefix or diff.algorithm there would
        # change the text): an empty global file of our own.
        (Path(tmp) / "gitconfig").write_text("")
        env = {**os.environ, "GIT_CONFIG_GLOBAL": str(Path(tmp) / "gitconfig"),
               "GIT_CONFIG_NOSYSTEM": "1"}
        done = subprocess.run(["git", "diff", "--no-index", "--no-prefix", "--no-color",
                               "--no-ext-diff", "a", "b"], cwd=tmp, env=env,
                              capture_output=True, text=True)
    if done.returncode not in (0, 1):
        raise ExportError(f"git diff failed: {done.stderr.strip()}")
    return done.stdout


def _as_compiled(edit: Edit, lines: list[str], file: str) -> list[str]:
    """``lines``, the diff's text of ``edit``, once read back as ``patch_source`` reads a
    function (dedented) they are the code the patch compiles: the same syntax tree
    (positions aside). Else the diff would run other code than the patch, and the export
    says where instead of writing it."""
    margin = edit.original[:len(edit.original) - len(edit.original.lstrip())]
    try:
        written = ast.dump(ast.parse(textwrap.dedent("".join(lines))))
    except SyntaxError as exc:
        written = f"SyntaxError: {exc.msg}"
    if (not lines[0].startswith(margin) or lines[0][len(margin)] == " "
            or written != ast.dump(ast.parse(edit.text))):
        raise ExportError(f"{file}:{edit.line}: the diff's text of this function is not "
                          "the code the patch compiles (re-indented differently)")
    return lines


def _reindented(original: str, text: str) -> list[str]:
    """The lines of ``text`` (an edit of ``original`` without its common indentation) at
    ``original``'s indentation: unchanged lines as they were, new ones indented."""
    raw = original.splitlines(keepends=True)
    bare = textwrap.dedent(original).splitlines(keepends=True)
    new = text.splitlines(keepends=True)
    margin = raw[0][:len(raw[0]) - len(raw[0].lstrip())]
    lines: list[str] = []
    matcher = difflib.SequenceMatcher(None, bare, new, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            lines += raw[i1:i2]
        else:
            lines += [margin + line if line.strip() else line for line in new[j1:j2]]
    return lines


# -- the export process ----------------------------------------------------------------


class Recorder:
    """Stands in for ``patch_source``: records each edit, installs nothing."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.edits: dict[tuple[int, str], Edit] = {}
        self.outside: list[str] = []

    def __call__(self, owner: object, name: str, replacements: list[tuple[str, str]],
                 label: str) -> None:
        key = (id(owner), name)
        edit = self.edits.get(key)
        if edit is None:
            try:
                function, text = function_source(owner, name, label)
            except AttributeError:
                raise PatchError(f"patch {label!r}: {owner.__name__} has no {name} (export "
                                 "does not follow a method an earlier edit added)") from None
            lines, first = inspect.getsourcelines(function)
            file = Path(inspect.getsourcefile(function)).resolve()
            if self.root not in file.parents:
                self.outside.append(f"edits {function.__qualname__} in {file}, outside "
                                    f"SGLang ({self.root})")
                return
            edit = Edit(str(file.relative_to(self.root)), first, "".join(lines), text)
            self.edits[key] = edit
        where = f"{getattr(owner, '__qualname__', owner)}.{name}"
        edit.text = edited(edit.text, replacements, label, where)
        added_names(edit.text, owner, name, label)


def _ours(module: str) -> bool:
    return module.split(".", 1)[0] in ("sglang", "sglang_omni")


def _snapshot() -> dict[str, tuple[object, dict[str, object]]]:
    """Every SGLang module's and class's attributes, by name."""
    state: dict[str, tuple[object, dict[str, object]]] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not _ours(name):
            continue
        state[name] = (module, dict(vars(module)))
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__module__ == name:
                state[f"{name}.{value.__qualname__}"] = (value, dict(vars(value)))
    return state


def _changes(before: dict[str, tuple[object, dict[str, object]]]) -> list[str]:
    """What differs from ``before``: each attribute set, replaced or deleted (a
    submodule imported since is not a change)."""
    found = []
    for name, (owner, attributes) in before.items():
        now = vars(owner)
        for attribute in sorted(set(attributes) | set(now)):
            old, new = attributes.get(attribute, _MISSING), now.get(attribute, _MISSING)
            if (old is new or isinstance(new, types.ModuleType)
                    or attribute == "__warningregistry__"):
                continue
            what = ("deletes" if new is _MISSING else "replaces" if old is not _MISSING
                    else "adds")
            value = "" if new is _MISSING else f" ({_named(new)})"
            found.append(f"{what} {name}.{attribute}{value}")
    return found


def _named(value: object) -> str:
    function = getattr(value, "__func__", value)
    module = getattr(function, "__module__", None)
    qualname = getattr(function, "__qualname__", None)
    return f"{module}.{qualname}" if module and qualname else type(value).__name__


def main(argv: list[str] | None = None) -> None:
    """The export process: ``python -m contract_lib.campaigns.export OUT.json SPEC...``.
    SGLang is imported once; each spec is recorded in a fork, so one patch's changes
    never show in the next one's record."""
    import importlib
    import traceback

    out, *specs = argv or sys.argv[1:]
    from contract_lib.child.shims import install_import_shims

    install_import_shims()
    for name in PRELOAD:
        importlib.import_module(name)
    records = {}
    with tempfile.TemporaryDirectory(prefix="contract_lib-export-") as tmp:
        for index, spec in enumerate(specs):
            path = Path(tmp) / f"{index}.json"
            pid = os.fork()
            if pid == 0:  # the fork: record this spec, write it, and leave at once
                code = 0
                try:
                    path.write_text(json.dumps(_record_here(spec)))
                except BaseException:  # noqa: BLE001 - any failure is the record's
                    last = traceback.format_exc().strip().splitlines()[-1]
                    path.write_text(json.dumps({"failed": last}))
                    code = 1
                os._exit(code)
            os.waitpid(pid, 0)
            records[spec] = (json.loads(path.read_text()) if path.is_file()
                             else {"failed": "the recording fork died"})
    Path(out).write_text(json.dumps(records))


def _record_here(spec: str) -> dict[str, Any]:
    """Apply ``spec`` in this process with ``patch_source`` recording: its edits, and
    whatever else it changes in SGLang's modules and classes."""
    import sglang

    from contract_lib.patches import builtin as patches, source as source_patch

    root = Path(sglang.__file__).resolve().parent.parent
    recorder = Recorder(root)
    before = _snapshot()
    # Every patch module that bound patch_source by name (builtin, disagg_bugs, ...)
    # records too; a user patch module imported later picks up the recorder itself.
    original = source_patch.patch_source
    for module in [m for n, m in sys.modules.items() if n.startswith("contract_lib.patches")]:
        if getattr(module, "patch_source", None) is original:
            module.patch_source = recorder
    record: dict[str, Any] = {"root": str(root), "edits": [], "other": []}
    try:
        patches.apply_patch(spec)
    except PatchError as exc:
        record["error"] = str(exc)
    record["edits"] = [dataclasses.asdict(e) for e in recorder.edits.values()]
    record["other"] = recorder.outside + _changes(before)
    return record


if __name__ == "__main__":
    main()
