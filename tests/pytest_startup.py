"""Loaded first by every pytest process of this project (``-p pytest_startup`` in
pyproject's addopts, importable through its ``pythonpath``): what start-up can defer.

nbval (a plugin every process loads: addopts names its options) imports nbformat, which
imports jsonschema, which imports ``rfc3987_syntax`` to offer an ``iri`` format check. That
import compiles an Earley grammar: ~0.8 s of CPU in the controller and in each xdist
worker (``--collect-only -m fast``: 2.6 s with it, 1.5 s without), for a format no test
validates. Here the module is a stand-in that imports the real one at its first use: the
same function, the same answers, no grammar built until then.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

_DEFERRED = "rfc3987_syntax"


def _defer(name: str, functions: tuple[str, ...]) -> None:
    """Put a stand-in for module ``name`` in ``sys.modules``: ``functions`` are forwarders
    that import the real module on their first call; any other attribute imports it at
    once. Does nothing when the module is absent or already imported."""
    if name in sys.modules or importlib.util.find_spec(name) is None:
        return

    class Deferred(types.ModuleType):
        def __getattr__(self, attribute: str):
            if attribute.startswith("__"):  # the import system's probes (__path__, ...)
                raise AttributeError(attribute)
            if sys.modules.get(name) is self:
                del sys.modules[name]
            return getattr(importlib.import_module(name), attribute)

    stand_in = Deferred(name)

    def forwarder(function: str):
        def call(*args, **kwargs):
            return stand_in.__getattr__(function)(*args, **kwargs)
        call.__name__ = call.__qualname__ = function
        return call

    for function in functions:
        setattr(stand_in, function, forwarder(function))
    sys.modules[name] = stand_in


# Only the function jsonschema imports (jsonschema/_format.py); kept out of this module's
# globals, where pytest's fixture scan would read the stand-in's attributes.
_defer(_DEFERRED, ("is_valid_syntax",))
