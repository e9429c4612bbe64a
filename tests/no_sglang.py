"""``pytest -p no_sglang``: in this process, importing SGLang (or torch, MLX, triton: a
Scheduler's stack) raises ImportError, as if they were not installed; locating their
files (``importlib.util.find_spec``, e.g. to copy a source tree) still works. The fast
tier must pass this way (``tests/test_tiers.py``)."""

import importlib.abc
import sys

BLOCKED = ("sglang", "torch", "mlx", "triton")


class _Refuse(importlib.abc.Loader):
    def create_module(self, spec):
        raise ImportError(f"import of {spec.name} is blocked by tests/no_sglang.py")

    def exec_module(self, module):  # never reached: create_module raises
        raise ImportError(module.__name__)


class _Blocked(importlib.abc.MetaPathFinder):
    """Finds the blocked packages as the other finders do, with a loader that refuses."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in BLOCKED:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else finder.find_spec(name, path, target)
            if spec is not None:
                spec.loader = _Refuse()
                return spec
        return None


sys.meta_path.insert(0, _Blocked())
