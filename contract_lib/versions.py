"""Which SGLang releases the harness knows how to drive, checked before anything runs."""

from __future__ import annotations

from importlib import metadata

# Field names, call sites and the MLX worker API the capture hooks and shims rely on were
# read from these releases' code (see docs/contract.md for the anchors).
SUPPORTED_SGLANG_VERSIONS = ("0.5.23",)


class UnsupportedSGLangError(RuntimeError):
    """The installed SGLang is missing or is a release the harness was not built for."""


def installed_sglang_version() -> str | None:
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def require_supported_sglang() -> str:
    """The installed SGLang version, or an error naming installed and supported versions."""
    version = installed_sglang_version()
    if version not in SUPPORTED_SGLANG_VERSIONS:
        raise UnsupportedSGLangError(
            f"installed sglang: {version or 'none'}; contract_lib supports sglang "
            f"{', '.join(SUPPORTED_SGLANG_VERSIONS)}. Install a supported release "
            "(see README: the set-up command creates the environment)")
    return version
