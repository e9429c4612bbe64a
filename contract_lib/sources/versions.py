"""Which SGLang releases the harness knows how to drive, checked before anything runs.

The venv holds one SGLang (the set-up release, 0.5.23). The other supported releases run
from their own install folder, ``.cache/sglang/<version>`` in the project checkout (or
``$CONTRACT_LIB_SGLANG_DIR/<version>``), installed on first use with
``pip install --no-deps --target`` (pip byte-compiles it, so runs never compile SGLang
from source even where ``PYTHONDONTWRITEBYTECODE`` is set) and put first
on the run's ``PYTHONPATH``: the run's child process (and its warm fork server) imports
that release, everything else (torch, mlx, transformers) from the venv. The venv is
never modified.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from contract_lib.paths import PROJECT_ROOT
from contract_lib.sources.compat import RELEASE_REQUIREMENTS, SUPPORTED_SGLANG_VERSIONS
from contract_lib.sources.installs import installed_version
from contract_lib.trust import UntrustedError, own_directory

RELEASES_DIR_ENV = "CONTRACT_LIB_SGLANG_DIR"
PIP_TIMEOUT_S = 900

_INSTALL_LOCK = threading.Lock()


class UnsupportedSGLangError(RuntimeError):
    """The installed SGLang is missing or is a release the harness was not built for."""


class SGLangInstallError(RuntimeError):
    """A supported release could not be installed into its folder (pip failed)."""


def installed_sglang_version() -> str | None:
    return installed_version("sglang")


def _supported_text() -> str:
    return ", ".join(reversed(SUPPORTED_SGLANG_VERSIONS))


def require_supported_sglang(version: str | None = None) -> str:
    """The SGLang version a run will use, or an error naming what is supported.

    ``version=None``: the venv's installed SGLang, which must be a supported release.
    Otherwise ``version`` itself must be one (it runs from the venv if that is the
    venv's release, else from its own install folder, see :func:`sglang_path`).
    """
    if version is None:
        installed = installed_sglang_version()
        if installed not in SUPPORTED_SGLANG_VERSIONS:
            raise UnsupportedSGLangError(
                f"installed sglang: {installed or 'none'}; contract_lib supports sglang "
                f"{_supported_text()}. Install a supported release (see README: the "
                "set-up command creates the environment), or choose one per run with "
                "sglang=VERSION / --sglang VERSION")
        return installed
    version = str(version)
    if version not in SUPPORTED_SGLANG_VERSIONS:
        raise UnsupportedSGLangError(
            f"requested sglang: {version}; contract_lib supports sglang "
            f"{_supported_text()} (the venv holds "
            f"{installed_sglang_version() or 'none'}; the others install into their own "
            "folder on first use)")
    return version


def release_range(value: str) -> list[str]:
    """``OLDEST..NEWEST`` (``--sglang 0.5.14..0.5.23``): the supported releases from one
    to the other in release order, both included; any other value (a release, a path)
    as itself. A bad range is one :class:`UnsupportedSGLangError` line."""
    first, sep, last = value.partition("..")
    if not sep or os.sep in value or os.path.exists(value):
        return [value]
    order = list(SUPPORTED_SGLANG_VERSIONS)
    unknown = [end for end in (first, last) if end not in order]
    if unknown:
        what = ("an end is missing" if "" in unknown
                else f"not supported: {', '.join(unknown)}")
        raise UnsupportedSGLangError(f"release range {value}: {what}; write OLDEST..NEWEST "
                                     f"with two of {', '.join(order)}")
    if order.index(first) > order.index(last):
        raise UnsupportedSGLangError(
            f"release range {value}: empty ({first} is newer than {last}); write "
            f"OLDEST..NEWEST, e.g. {order[0]}..{order[-1]}")
    return order[order.index(first):order.index(last) + 1]


def release_spans(versions: list[str]) -> str:
    """Releases as runs of consecutive supported ones: ``0.5.14-0.5.16, 0.5.18`` (any
    other label as itself)."""
    order = list(SUPPORTED_SGLANG_VERSIONS)
    spans: list[list[str]] = []
    for version in versions:
        follows = (spans and spans[-1][-1] in order and version in order
                   and order.index(version) == order.index(spans[-1][-1]) + 1)
        if follows:
            spans[-1].append(version)
        else:
            spans.append([version])
    return ", ".join(span[0] if len(span) == 1 else f"{span[0]}-{span[-1]}" for span in spans)


def releases_dir() -> Path:
    return Path(os.environ.get(RELEASES_DIR_ENV, PROJECT_ROOT / ".cache" / "sglang"))


def release_folder(version: str) -> Path:
    """Where ``version`` is (or will be) installed; the folder to prepend to PYTHONPATH."""
    return releases_dir() / version


def requirements(version: str) -> list[str]:
    """What ``version``'s folder holds: the release, and what else it imports that the
    venv lacks (:data:`contract_lib.sources.compat.RELEASE_REQUIREMENTS`)."""
    return [f"sglang=={version}", *RELEASE_REQUIREMENTS.get(version, ())]


def _complete(folder: Path, version: str) -> bool:
    dists = [requirement.replace("==", "-") for requirement in requirements(version)]
    return ((folder / "sglang" / "__init__.py").is_file()
            and all((folder / f"{dist}.dist-info").is_dir() for dist in dists))


def installed_release_folders() -> list[Path]:
    """The folders of the supported releases installed next to the venv's SGLang."""
    venv = installed_sglang_version()
    return [release_folder(version) for version in SUPPORTED_SGLANG_VERSIONS
            if version != venv and _complete(release_folder(version), version)]


def sglang_path(version: str | None) -> Path | None:
    """The folder to put first on a run's ``PYTHONPATH`` for SGLang ``version``, or
    None when the venv's own SGLang is that release (or ``version`` is None).

    Installs the release on first use (see :func:`install_release`).
    """
    version = require_supported_sglang(version)
    if version == installed_sglang_version():
        return None
    folder = release_folder(version)
    if trusted_install(folder, f"sglang {version}") and _complete(folder, version):
        return folder
    return install_release(version)


def trusted_install(folder: Path, label: str) -> bool:
    """Whether ``folder`` exists, after refusing (:class:`SGLangInstallError`) an install
    folder, or its parent, that another user owns or can write to: its code would be
    imported. The parent is created (0755) when missing."""
    try:
        own_directory(folder.parent, 0o022, f"the install folder of {label}")
        if not os.path.lexists(folder):
            return False
        own_directory(folder, 0o022, f"the install folder of {label}")
    except UntrustedError as exc:
        raise SGLangInstallError(f"{exc}; nothing is imported from it") from None
    return True


def install_release(version: str) -> Path:
    """``pip install --no-deps --target <folder> sglang==<version>`` and what else it
    needs (:func:`requirements`; ~8 s, ~200 MB, 0.5.16-0.5.20 ~115 MB more).

    Raises :class:`SGLangInstallError` with pip's output when pip fails (most often:
    no network access to PyPI). See :func:`install_target`.
    """
    version = require_supported_sglang(version)
    return install_target(release_folder(version), requirements(version),
                          complete=lambda folder: _complete(folder, version),
                          label=f"sglang {version}", size_hint="~30 MB download")


def install_target(folder: Path, requirements: list[str], *, complete, label: str,
                   size_hint: str) -> Path:
    """``pip install --no-deps --target <folder> <requirements>``, once.

    Atomic: pip writes into a temporary sibling folder which is renamed into place when
    ``complete(tmp)`` holds, so an interrupted install never leaves a half folder behind.
    Serialised across threads and processes by a lock file in the parent folder.
    """
    parent = folder.parent
    trusted_install(folder, label)
    with _INSTALL_LOCK, open(parent / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if complete(folder):
            return folder
        tmp = parent / f".{folder.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        command = [sys.executable, "-m", "pip", "install", "--no-deps",
                   "--disable-pip-version-check", "--quiet", "--target", str(tmp),
                   *requirements]
        started = time.perf_counter()
        _say(f"contract_lib: installing {label} into {folder} (first use; {size_hint}) ...")
        try:
            done = subprocess.run(command, capture_output=True, text=True,
                                  timeout=PIP_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise SGLangInstallError(
                f"installing {label} timed out after {PIP_TIMEOUT_S} s "
                f"({' '.join(command)}); is PyPI reachable?") from exc
        if done.returncode != 0 or not complete(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
            output = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
            raise SGLangInstallError(
                f"could not install {label} into {folder}: pip exited with "
                f"{done.returncode}. It needs network access to PyPI (or a local index "
                f"holding {' '.join(requirements)}). Command: {' '.join(command)}\n"
                f"{output}")
        if folder.exists():  # an incomplete folder left by hand
            shutil.rmtree(folder)
        os.rename(tmp, folder)
        _say(f"contract_lib: {label} installed in {time.perf_counter() - started:.1f} s")
        return folder


def _say(message: str) -> None:
    """Progress on a terminal only (a notebook's or CI's stderr stays clean)."""
    if sys.stderr.isatty():
        print(message, file=sys.stderr, flush=True)


