"""Effects recording (inside the child): which state each loop step writes, and where.

In an audit run every attribute assignment on the objects the per-step contract is about
is recorded, with the step and the SGLang code location that made it: the ``Scheduler``,
``ScheduleBatch``, ``Req`` and its ``ReqKvInfo``, the ``FutureMap``, the tree cache, the
KV allocator, the ``ReqToTokenPool``, the metrics reporter and the profiler manager. The
in-place tensor writes that matter are recorded as pseudo-fields: ``req_to_token[]``
(``ReqToTokenPool.write``), ``output_tokens_buf[]`` (``FutureMap.stash`` /
``stash_bonus_tokens``) and ``new_seq_lens_buf[]`` (``FutureMap.publish``).

A write that leaves the value as it was (same object, or an equal scalar) is counted in
``count`` but not in ``changed``. Only writes made while the loop runs are kept; writes made by contract_lib's own capture
(the step snapshot, the idle probe) are excluded by pausing the recorder around it.
"""

from __future__ import annotations

import collections
import os
import sys
from typing import Any, Callable

from contract_lib.paths import PACKAGE_DIR

_THIS_PACKAGE = str(PACKAGE_DIR)  # contract_lib's own writes are not SGLang's


def _sglang_root() -> str:
    import sglang

    return os.path.dirname(os.path.dirname(os.path.abspath(sglang.__file__)))


_MISSING = object()
_PLAIN = (int, float, bool, str, bytes, type(None))


def _same(old, new) -> bool:
    """True when an assignment leaves the value as it was (the same object, or an equal
    plain scalar): such a write is recorded but is not an effect."""
    if old is new:
        return True
    return type(old) is type(new) and isinstance(new, _PLAIN) and old == new


class EffectsRecorder:
    """Counts writes per (step, object, field, location) and hands them out per step."""

    def __init__(self) -> None:
        self.active = False
        self.step = -1
        self.counts: collections.Counter = collections.Counter()
        self.changed: collections.Counter = collections.Counter()
        self.root = _sglang_root()

    def _location(self, frame) -> str | None:
        """The writing SGLang code as ``path.py:function``; None for contract_lib's own.
        A dataclass-generated ``__init__`` is reported as its caller plus ``(new object)``:
        constructing an object is not a write to existing state."""
        constructed = ""
        while frame is not None and frame.f_code.co_filename == "<string>":
            constructed = " (new object)"
            frame = frame.f_back
        if frame is None:
            return None
        filename = os.path.abspath(frame.f_code.co_filename)
        if filename.startswith(_THIS_PACKAGE):
            return None
        if filename.startswith(self.root):
            filename = os.path.relpath(filename, self.root)
            filename = filename.removeprefix("sglang/srt/")
        elif filename.startswith("<patch "):
            filename = filename.split(":")[0].removeprefix("<") + ">"
        return f"{filename}:{frame.f_code.co_name}{constructed}"

    def record(self, kind: str, field: str, frame, changed: bool = True) -> None:
        if not self.active:
            return
        location = self._location(frame)
        if location is not None:
            self.counts[(self.step, kind, field, location)] += 1
            self.changed[(self.step, kind, field, location)] += int(changed)

    def take(self, loop: str) -> list[dict[str, Any]]:
        rows = [{"step": step, "loop": loop, "object": kind, "field": field,
                 "location": location, "count": count,
                 "changed": self.changed[(step, kind, field, location)]}
                for (step, kind, field, location), count in sorted(self.counts.items())]
        self.counts.clear()
        self.changed.clear()
        return rows

    # -- installation -----------------------------------------------------------------------

    def hook_class(self, cls: type, kind: str) -> None:
        original = cls.__setattr__
        recorder = self

        def __setattr__(obj, name, value):
            if recorder.active:
                old = getattr(obj, name, _MISSING)
                recorder.record(kind, name, sys._getframe(1), not _same(old, value))
            original(obj, name, value)

        cls.__setattr__ = __setattr__

    def hook_method(self, owner: type, name: str, kind: str, field: str) -> None:
        original: Callable = getattr(owner, name)
        recorder = self

        def method(obj, *args, **kwargs):
            recorder.record(kind, field, sys._getframe(1))
            return original(obj, *args, **kwargs)

        setattr(owner, name, method)

    def install(self, scheduler) -> None:
        from sglang.srt.managers.overlap_utils import FutureMap
        from sglang.srt.managers.schedule_batch import Req, ReqKvInfo, ScheduleBatch
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        owners = [
            (Scheduler, "Scheduler"), (ScheduleBatch, "ScheduleBatch"), (Req, "Req"),
            (ReqKvInfo, "ReqKvInfo"), (FutureMap, "FutureMap"),
            (type(scheduler.tree_cache), "tree_cache"),
            (type(scheduler.token_to_kv_pool_allocator), "allocator"),
            (type(scheduler.metrics_reporter), "metrics_reporter"),
        ]
        if not isinstance(scheduler, Scheduler):  # sglang-omni's OmniScheduler (composition)
            owners.append((type(scheduler), "Scheduler"))
        profiler = getattr(scheduler, "profiler_manager", None)  # OmniScheduler has none
        if profiler is not None:
            owners.append((type(profiler), "profiler_manager"))
        for cls, kind in owners:
            self.hook_class(cls, kind)
        self.hook_method(ReqToTokenPool, "write", "ReqToTokenPool", "req_to_token[]")
        self.hook_method(FutureMap, "stash", "FutureMap", "output_tokens_buf[]")
        self.hook_method(FutureMap, "stash_bonus_tokens", "FutureMap", "output_tokens_buf[]")
        self.hook_method(FutureMap, "publish", "FutureMap", "new_seq_lens_buf[]")
