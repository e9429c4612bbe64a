"""``pytest -p no_sglang``: in this process, importing SGLang (or torch, MLX, triton: a
Scheduler's stack) raises ImportError, as on a machine without them. The fast tier must
pass this way (``tests/test_tiers.py``)."""

import sys

BLOCKED = ("sglang", "torch", "mlx", "triton")


class _Blocked:
    """A meta path finder that refuses the blocked top-level packages."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked by tests/no_sglang.py")
        return None


sys.meta_path.insert(0, _Blocked())
