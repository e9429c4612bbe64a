"""A package's names resolved on first use (PEP 562), so importing the package stays cheap."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_getattr(package: str, module_of: dict[str, str],
                 namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``package``: each name of ``module_of`` is
    imported from its submodule (``module_of[name]``) on first use and kept in
    ``namespace`` (the package's globals), so later uses skip this function."""

    def __getattr__(name: str) -> Any:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    return __getattr__
