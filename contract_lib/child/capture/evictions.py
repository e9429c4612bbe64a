"""The ``evictions`` table: every time the KV allocator makes room by evicting the radix
tree (``evict_to_free_tokens``), what it needed, what was free, what it asked the tree
for, and what the tree gave up."""

from __future__ import annotations

from typing import Any, Callable

# The tree's eviction entry points an allocator may call (the asked size is read off
# each call's ``EvictParams.num_tokens``).
_TREE_EVICTS = ("evict_for_alloc", "evict")


class EvictionRecorder:
    """Wraps the scheduler's allocator's ``evict_to_free_tokens`` and its tree's eviction
    entry points (instance attributes; a release without them records nothing).
    ``(step, need, available, asked, evictable_before, evictable_after)`` goes to
    ``emit_row`` after each call that asked the tree or changed it; ``asked`` is the
    most the call asked the tree for (None when it asked nothing)."""

    def __init__(self, scheduler, step: Callable[[], int],
                 emit_row: Callable[[tuple], None]) -> None:
        self.step, self.emit_row = step, emit_row
        self.asked: int | None = None
        self.inside = False
        allocator, tree = scheduler.token_to_kv_pool_allocator, scheduler.tree_cache
        real = getattr(allocator, "evict_to_free_tokens", None)
        if real is None or tree is None or not hasattr(tree, "evictable_size"):
            return
        for name in _TREE_EVICTS:
            if hasattr(tree, name):
                setattr(tree, name, self._asking(getattr(tree, name)))
        allocator.evict_to_free_tokens = self._recording(real, allocator)

    def _asking(self, real_evict: Callable) -> Callable:
        def evict(params, *args, **kwargs):
            if self.inside:
                asked = getattr(params, "num_tokens", None)
                if isinstance(asked, int):
                    self.asked = max(asked, self.asked or 0)
            return real_evict(params, *args, **kwargs)
        return evict

    def _recording(self, real: Callable, allocator: Any) -> Callable:
        def evict_to_free_tokens(tree_cache, num_tokens, *args, **kwargs):
            if self.inside:  # a nested call: counted in the outer one
                return real(tree_cache, num_tokens, *args, **kwargs)
            available = allocator.available_size()
            before = tree_cache.evictable_size() if tree_cache is not None else 0
            self.inside, self.asked = True, None
            try:
                return real(tree_cache, num_tokens, *args, **kwargs)
            finally:
                self.inside = False
                after = tree_cache.evictable_size() if tree_cache is not None else 0
                if self.asked is not None or after != before:
                    self.emit_row((self.step(), int(num_tokens), int(available),
                                   self.asked, int(before), int(after)))
        return evict_to_free_tokens
