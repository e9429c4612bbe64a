"""The model boundary of the MLX loop: the model-free ``MlxModelRunner``, or SGLang's real
runner with its Metal-only flags off."""

from __future__ import annotations

import os
from typing import Any

from contract_lib.child.shims.model import next_token, scripted_token
from contract_lib.child.shims.platform import on_apple_silicon_with_mlx


def kv_content(fold: int, token: int) -> int:
    """The model-free stand-in for one position's KV: a digest of the token fed there and
    of everything the model attended to before it (``fold``, :class:`_ModelFreeCache`).
    Two positions hold the same content only when fed the same tokens after the same
    contents, as two real KV entries agree only then. Python hashes ints the same in
    every process."""
    return hash((fold, token))


_UNWRITTEN = object()


class ModelFreeKvPool:
    """The model-free stand-in for ``MlxAttentionKVPool``: per slot, the content last
    written there (:func:`kv_content`); a slot never written holds none."""

    def __init__(self) -> None:
        self.contents: dict[int, int | None] = {}  # slot -> its content

    def clear(self) -> None:
        self.contents.clear()

    def verdicts(self, tokens: list[int], slots: list[int]) -> list[str]:
        """Per slot of ``slots`` (the radix tree's for ``tokens``, in position order): ``ok``
        (the content a correct run computes for ``tokens`` there), ``zero`` (never
        written) or ``wrong``."""
        expected = reference_contents(tokens[:len(slots)])
        found = []
        for position, slot in enumerate(slots):
            content = self.contents.get(slot, _UNWRITTEN)
            found.append("zero" if content is _UNWRITTEN
                         else "ok" if content == expected[position] else "wrong")
        return found


class _ModelFreeCache:
    """Per-request stand-in for the MLX contiguous KV cache: its ``offset`` and the
    contents of the positions it holds.

    As in the real ``MLXAttentionWrapper.write_token``, the offset advances when a step's
    graph is *built*, not when it is evaluated. A decode position's content is known
    once its fed token is (the runner's token list, after the previous step's finalize),
    so ``contents`` may lag ``offset``; :meth:`upto` fills it.
    """

    def __init__(self, offset: int, prompt_len: int) -> None:
        self.offset = offset
        self.prompt_len = prompt_len  # where the request's output starts (the script)
        self.contents: list[int | None] = []
        self.fold = 0  # the digest of ``contents``
        # The runner's token list of the request (from its first finalize): a decode
        # position is fed the token the list holds there.
        self.tokens: list[int] | None = None

    def upto(self, end: int) -> list[int | None]:
        """``contents``, filled through position ``end`` - 1 where the fed tokens are
        known."""
        tokens = self.tokens or ()
        while len(self.contents) < min(end, len(tokens)):
            self.feed([tokens[len(self.contents)]])
        return self.contents

    def feed(self, tokens) -> None:
        """Append the contents of positions fed ``tokens``, after those held."""
        for token in tokens:
            self.contents.append(kv_content(self.fold, int(token)))
            self.fold = hash((self.fold, self.contents[-1]))

    def gathered(self, contents: list[int | None]) -> None:
        """Start from a prefix read off the pool (``None``: a slot never written)."""
        for content in contents:
            self.contents.append(content)
            self.fold = hash((self.fold, content))


def reference_contents(tokens: list[int]) -> list[int]:
    """The contents a correct run leaves for ``tokens`` (a request's prompt and output),
    position by position: what :func:`contract_lib.sources.tiny_model.reference_kv` is to the
    real runner."""
    cache = _ModelFreeCache(0, len(tokens))
    cache.feed(tokens)
    return cache.contents


class ModelFreeMlxRunner:
    """Replaces ``hardware_backend.mlx.model_runner.MlxModelRunner`` on the MLX loop.

    Why: the real runner loads an mlx-lm model. This one keeps the runner's own request
    bookkeeping (token lists, cache offsets, row mapping, synced offsets) and a pool of
    contents (:class:`ModelFreeKvPool`), and computes :func:`next_token` as a *lazy*
    ``mlx.core`` graph; a chained decode builds on the previous step's still-lazy tokens,
    exactly as ``decode_batch_start_chained`` does. It exposes the surface
    ``MlxTpModelWorker`` calls; the worker itself is SGLang's, and so are the runner's
    methods that move decode KV into the pool (:data:`BORROWED`).
    """

    def __init__(self, *, pool_size: int | None = None, disable_radix_cache: bool = False,
                 **_ignored: Any) -> None:
        self._pool_size = pool_size or 2048
        self.disable_radix_cache = disable_radix_cache
        self._req_caches: dict[str, list[_ModelFreeCache]] = {}
        self._req_token_ids: dict[str, list[int]] = {}
        self._req_pool_idx: dict[str, int] = {}
        self._req_synced_offset: dict[str, int] = {}
        self._req_sampling: dict[str, Any] = {}  # read by SGLang's remove_request
        self._req_to_token_pool = None
        # As the real runner: a pool only where the radix cache can read one back.
        self._attention_kv_pool = None if disable_radix_cache else ModelFreeKvPool()

    @property
    def pool_size(self) -> int:
        return self._pool_size

    def init_cache_pools(self, req_to_token_pool) -> None:
        self._req_to_token_pool = req_to_token_pool

    def cache_offset(self, req_id: str) -> int | None:
        """Positions whose KV the runner has computed or queued (graph built)."""
        cache = self._req_caches.get(req_id)
        return cache[0].offset if cache else None

    @staticmethod
    def cache_state_arrays(caches) -> list:
        return []

    @staticmethod
    def collect_logprobs(lazy_logprobs) -> None:
        return None

    def has_request(self, req_id: str) -> bool:
        return req_id in self._req_caches

    @staticmethod
    def _first_attention_cache(cache: list[_ModelFreeCache]) -> _ModelFreeCache:
        return cache[0]

    @staticmethod
    def _release_cache(cache: list[_ModelFreeCache]) -> None:
        """Nothing to give back (the real runner recycles its cache buffers)."""

    def _sync_new_kv_to_pool(self, cache: list[_ModelFreeCache], cache_start: int,
                             slot_ids: list[int]) -> None:
        """As the real runner: copy the cache's positions from ``cache_start`` into the
        pool slots ``slot_ids``. Refused (the run crashes, no verdict) for a position whose
        fed token is not known yet: two chained decodes in flight past the finalized
        tokens, which no release's sync was seen to reach (checked on unclamped syncs)."""
        if not slot_ids or self._attention_kv_pool is None:
            return
        end = cache_start + len(slot_ids)
        contents = self._first_attention_cache(cache).upto(end)
        if len(contents) < end:
            raise RuntimeError(
                f"the model-free MLX runner was asked to sync positions {len(contents)}.."
                f"{end - 1} into the KV pool before their fed tokens were known; it cannot "
                "compute their contents (run with --runner real)")
        written = self._attention_kv_pool.contents
        for position, slot in enumerate(slot_ids, cache_start):
            written[int(slot)] = contents[position]

    def store_auxiliary_state_for_request(self, req_id: str) -> None:
        """No auxiliary (SSM) state in a model-free run."""

    @staticmethod
    def _lazy_next(last_tokens, seq_lens: list[int], rids: list[str],
                   prompt_lens: list[int]):
        """:func:`next_token` as a lazy ``mlx.core`` graph over a batch (``last_tokens``
        may be the previous step's still-lazy tokens), with the scripted tokens
        (:func:`scripted_token`) selected in the graph."""
        import mlx.core as mx

        tokens = next_token(last_tokens, mx.array(seq_lens, dtype=mx.int32))
        scripted = [scripted_token(rid, n, p)
                    for rid, n, p in zip(rids, seq_lens, prompt_lens)]
        if all(t is None for t in scripted):
            return tokens
        return mx.where(mx.array([t is not None for t in scripted]),
                        mx.array([0 if t is None else t for t in scripted], dtype=mx.int32),
                        tokens)

    def prefill_start(self, req_id, new_token_ids, full_token_ids, prefix_slot_ids,
                      new_slot_ids, req_pool_idx, req=None, needs_logits=True,
                      logit_edit_row=None, logprob_spec=None):
        import mlx.core as mx
        from sglang.srt.hardware_backend.mlx.model_runner import MlxPendingPrefill

        from contract_lib.sources.compat import mlx_pending

        full = list(full_token_ids)
        # The scheduler's request: where its output starts (a retracted request's
        # re-prefill carries its earlier output in ``full``).
        prompt_len = len(req.origin_input_ids) if req is not None else len(full)
        # As the real runner: the model runs on the ids it is fed after the prefix it
        # gathers from the pool (none with the radix cache off), not on ``full``, so a
        # worker that feeds the wrong ids or prefix computes the wrong token here too.
        fed = list(new_token_ids) or full[-1:]
        computed = (len(fed) + (0 if self.disable_radix_cache else len(prefix_slot_ids))
                    if new_token_ids else len(full))
        token = self._lazy_next(mx.array([fed[-1]], dtype=mx.int32), [computed],
                                [req_id], [prompt_len])[0]
        cache = _ModelFreeCache(computed, prompt_len)
        if self._attention_kv_pool is not None:
            # The prefix is read off the pool; a full hit re-runs its last position.
            prefix = list(prefix_slot_ids)[:computed - len(fed)]
            cache.gathered([self._attention_kv_pool.contents.get(int(slot)) for slot in prefix])
        cache.feed(fed)
        self._sync_new_kv_to_pool([cache], len(prefix_slot_ids), list(new_slot_ids))
        return mlx_pending(
            MlxPendingPrefill, lazy_token=token, cache=[cache], req_id=req_id,
            full_token_ids=full, req_pool_idx=req_pool_idx,
            synced_offset=len(prefix_slot_ids) + len(new_slot_ids))

    def prefill_finalize(self, pending) -> int:
        token = int(pending.lazy_token.item())
        self._req_token_ids[pending.req_id] = list(pending.full_token_ids) + [token]
        pending.cache[0].tokens = self._req_token_ids[pending.req_id]
        self._req_caches[pending.req_id] = pending.cache
        self._req_pool_idx[pending.req_id] = pending.req_pool_idx
        self._req_synced_offset[pending.req_id] = pending.synced_offset
        return token

    def extend_start(self, req_id, new_token_ids, new_slot_ids, needs_logits=True,
                     logit_edit_row=None, logprob_spec=None):
        import mlx.core as mx
        from sglang.srt.hardware_backend.mlx.model_runner import MlxPendingExtend

        from contract_lib.sources.compat import mlx_pending

        cache = self._req_caches[req_id]
        cache[0].upto(cache[0].offset)  # the chunk's contents go after every held position
        cache[0].offset += len(new_token_ids)
        cache[0].feed(new_token_ids)
        token = self._lazy_next(mx.array([new_token_ids[-1]], dtype=mx.int32),
                                [cache[0].offset], [req_id], [cache[0].prompt_len])[0]
        synced = self._req_synced_offset.get(req_id, 0)
        if not self.disable_radix_cache and new_slot_ids:
            self._sync_new_kv_to_pool(cache, synced, list(new_slot_ids))
            synced += len(new_slot_ids)
        return mlx_pending(MlxPendingExtend, lazy_token=token, cache=cache, req_id=req_id,
                           new_token_ids=list(new_token_ids), new_synced_offset=synced)

    def extend_finalize(self, pending) -> int:
        token = int(pending.lazy_token.item())
        tokens = self._req_token_ids[pending.req_id]
        if tokens:
            tokens.pop()  # the stale intermediate token, as in the real runner
        tokens.extend(pending.new_token_ids)
        tokens.append(token)
        self._req_synced_offset[pending.req_id] = pending.new_synced_offset
        return token

    def _decode(self, req_ids, caches, last_tokens, edit_rows=None, logprob_spec=None):
        from sglang.srt.hardware_backend.mlx.model_runner import MlxPendingDecode

        from contract_lib.sources.compat import mlx_pending

        for cache in caches:
            cache[0].offset += 1
        tokens = self._lazy_next(last_tokens, [cache[0].offset for cache in caches],
                                 list(req_ids), [cache[0].prompt_len for cache in caches])
        return mlx_pending(MlxPendingDecode, lazy_tokens=tokens, req_ids=list(req_ids),
                           caches=caches, logprob_spec=logprob_spec, edit_rows=edit_rows)

    def decode_batch_start(self, req_ids, edit_rows=None, logprob_spec=None,
                           logits_hook=None):
        import mlx.core as mx

        caches = [self._req_caches[rid] for rid in req_ids]
        last = mx.array([self._req_token_ids[rid][-1] for rid in req_ids], dtype=mx.int32)
        return self._decode(req_ids, caches, last, edit_rows, logprob_spec)

    def decode_batch_start_chained(self, prev):
        return self._decode(prev.req_ids, prev.caches, prev.lazy_tokens,  # <= 0.5.17: no
                            getattr(prev, "edit_rows", None),  # edit rows, logprob spec
                            getattr(prev, "logprob_spec", None))

    def decode_batch_finalize(self, pending) -> list[int]:
        raw = pending.lazy_tokens.tolist()
        tokens = [int(t) for t in (raw if isinstance(raw, list) else [raw])]
        for rid, token in zip(pending.req_ids, tokens):
            self._req_token_ids[rid].append(token)
        return tokens


def install_mlx_real_runner() -> list[str]:
    """MLX loop, ``runner="real"``: keep SGLang's real ``MlxModelRunner`` (mlx-lm model,
    ``patch_model_attention``, ``MlxAttentionKVPool``) on MLX's CPU backend. Returns the
    shims applied (empty where the real gate passes, on Apple Silicon with Metal).

    Why only this: on MLX's CPU backend the runner's default paths need no replacement
    (``mx.fast.rope`` and ``mx.fast.scaled_dot_product_attention`` have CPU kernels;
    ``mx.device_info()`` has no ``max_recommended_working_set_size`` there, so the wired
    limit is skipped). Two opt-in environment flags select Metal-only code and are
    forced off, so a user's environment cannot turn them on in a CPU run:

    - ``SGLANG_MLX_USE_CUSTOM_ROPE``: the AOT Metal RoPE + pool-scatter kernel from
      ``sgl_kernel.metal`` (``hardware_backend/mlx/aot.py``), which has no CPU build;
    - ``SGLANG_MLX_FUSE_SWIGLU``: patches SwiGLU blocks with an ``mx.fast.metal_kernel``
      (``moe/fused_swiglu.py``), which raises "No Metal back-end" on CPU.

    The runner's pool is sized from ``max_total_tokens`` (``BASE_SERVER_ARGS``), as the
    CPU backend reports no memory to auto-size it from.
    """
    if on_apple_silicon_with_mlx():
        return []
    for flag in ("SGLANG_MLX_USE_CUSTOM_ROPE", "SGLANG_MLX_FUSE_SWIGLU"):
        os.environ[flag] = "0"
    return ["mlx-metal-only-flags-off"]


# The real runner's request bookkeeping the model-free one runs as SGLang ships it: when
# decode KV reaches the pool (release, flush, removal) and up to where. A release that
# changes them, or a patch of them, is then what the model-free runner does too.
BORROWED = ("_sync_decode_kv_to_pool", "release_request_row", "remove_request",
            "flush_all_decode_kv")


def install_mlx_model_free_runner() -> None:
    """MLX loop: ``MlxTpModelWorker`` builds :class:`ModelFreeMlxRunner` as its runner,
    which takes the installed ``MlxModelRunner``'s :data:`BORROWED` methods (those this
    release has).

    Why: ``MlxTpModelWorker._init_model_runner`` does ``from ...model_runner import
    MlxModelRunner`` at call time, so replacing the module attribute is enough; the
    worker, its stub runner and every pool stay SGLang's own.
    """
    from sglang.srt.hardware_backend.mlx import model_runner

    real = model_runner.MlxModelRunner
    if real is not ModelFreeMlxRunner:
        for name in BORROWED:
            if (function := getattr(real, name, None)) is not None:
                setattr(ModelFreeMlxRunner, name, function)
    model_runner.MlxModelRunner = ModelFreeMlxRunner
