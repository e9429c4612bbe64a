"""The model boundary of the MLX loop: the model-free ``MlxModelRunner``, or SGLang's real
runner with its Metal-only flags off."""

from __future__ import annotations

import os
from typing import Any

from contract_lib.shims.model import next_token, scripted_token
from contract_lib.shims.platform import on_apple_silicon_with_mlx


class _ModelFreeCache:
    """Per-request stand-in for the MLX contiguous KV cache: only its ``offset``.

    As in the real ``MLXAttentionWrapper.write_token``, the offset advances when a step's
    graph is *built*, not when it is evaluated.
    """

    def __init__(self, offset: int, prompt_len: int) -> None:
        self.offset = offset
        self.prompt_len = prompt_len  # where the request's output starts (the script)


class ModelFreeMlxRunner:
    """Replaces ``hardware_backend.mlx.model_runner.MlxModelRunner`` on the MLX loop.

    Why: the real runner loads an mlx-lm model. This one keeps the runner's own request
    bookkeeping (token lists, cache offsets, row mapping, synced offsets) and computes
    :func:`next_token` as a *lazy* ``mlx.core`` graph; a chained decode builds on the
    previous step's still-lazy tokens, exactly as ``decode_batch_start_chained`` does.
    It exposes the surface ``MlxTpModelWorker`` calls; the worker itself is SGLang's.
    """

    def __init__(self, *, pool_size: int | None = None, disable_radix_cache: bool = False,
                 **_ignored: Any) -> None:
        self._pool_size = pool_size or 2048
        self.disable_radix_cache = disable_radix_cache
        self._req_caches: dict[str, list[_ModelFreeCache]] = {}
        self._req_token_ids: dict[str, list[int]] = {}
        self._req_pool_idx: dict[str, int] = {}
        self._req_synced_offset: dict[str, int] = {}
        self._req_to_token_pool = None

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

    def remove_request(self, req_id: str) -> None:
        for table in (self._req_token_ids, self._req_caches, self._req_pool_idx,
                      self._req_synced_offset):
            table.pop(req_id, None)

    def store_auxiliary_state_for_request(self, req_id: str) -> None:
        """No auxiliary (SSM) state in a model-free run."""

    def release_request_row(self, req_id: str, owned_len: int) -> None:
        """As the real runner: the sync would read up to ``owned_len``; forget the row."""
        offset = self.cache_offset(req_id) or 0
        if not self.disable_radix_cache:
            self._req_synced_offset[req_id] = max(
                self._req_synced_offset.get(req_id, 0), min(offset, owned_len))
        self._req_pool_idx.pop(req_id, None)

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
        return MlxPendingPrefill(
            lazy_token=token, cache=[_ModelFreeCache(computed, prompt_len)], req_id=req_id,
            full_token_ids=full, req_pool_idx=req_pool_idx,
            synced_offset=len(prefix_slot_ids) + len(new_slot_ids))

    def prefill_finalize(self, pending) -> int:
        token = int(pending.lazy_token.item())
        self._req_token_ids[pending.req_id] = list(pending.full_token_ids) + [token]
        self._req_caches[pending.req_id] = pending.cache
        self._req_pool_idx[pending.req_id] = pending.req_pool_idx
        self._req_synced_offset[pending.req_id] = pending.synced_offset
        return token

    def extend_start(self, req_id, new_token_ids, new_slot_ids, needs_logits=True,
                     logit_edit_row=None, logprob_spec=None):
        import mlx.core as mx
        from sglang.srt.hardware_backend.mlx.model_runner import MlxPendingExtend

        cache = self._req_caches[req_id]
        cache[0].offset += len(new_token_ids)
        token = self._lazy_next(mx.array([new_token_ids[-1]], dtype=mx.int32),
                                [cache[0].offset], [req_id], [cache[0].prompt_len])[0]
        synced = self._req_synced_offset.get(req_id, 0)
        if not self.disable_radix_cache and new_slot_ids:
            synced += len(new_slot_ids)
        return MlxPendingExtend(lazy_token=token, cache=cache, req_id=req_id,
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

        for cache in caches:
            cache[0].offset += 1
        tokens = self._lazy_next(last_tokens, [cache[0].offset for cache in caches],
                                 list(req_ids), [cache[0].prompt_len for cache in caches])
        return MlxPendingDecode(lazy_tokens=tokens, req_ids=list(req_ids), caches=caches,
                                logprob_spec=logprob_spec, edit_rows=edit_rows)

    def decode_batch_start(self, req_ids, edit_rows=None, logprob_spec=None,
                           logits_hook=None):
        import mlx.core as mx

        caches = [self._req_caches[rid] for rid in req_ids]
        last = mx.array([self._req_token_ids[rid][-1] for rid in req_ids], dtype=mx.int32)
        return self._decode(req_ids, caches, last, edit_rows, logprob_spec)

    def decode_batch_start_chained(self, prev):
        return self._decode(prev.req_ids, prev.caches, prev.lazy_tokens,
                            prev.edit_rows, prev.logprob_spec)

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


def install_mlx_model_free_runner() -> None:
    """MLX loop: ``MlxTpModelWorker`` builds :class:`ModelFreeMlxRunner` as its runner.

    Why: ``MlxTpModelWorker._init_model_runner`` does ``from ...model_runner import
    MlxModelRunner`` at call time, so replacing the module attribute is enough; the
    worker, its stub runner and every pool stay SGLang's own.
    """
    from sglang.srt.hardware_backend.mlx import model_runner

    model_runner.MlxModelRunner = ModelFreeMlxRunner



def _model_free_flush_all_decode_kv(self) -> None:
    """The model-free runner's ``flush_all_decode_kv``: there is no KV pool to write, so
    only the runner's synced offsets advance (to the cache offset, as 0.5.21's unclamped
    flush does)."""
    for rid in self._req_caches:
        self._req_synced_offset[rid] = self.cache_offset(rid)


def install_model_free_flush() -> None:
    """Give :class:`ModelFreeMlxRunner` the runner method ``flush_all_decode_kv``.

    Why: through 0.5.21 ``MlxTpModelWorker`` calls ``_mlx_runner.flush_all_decode_kv()``
    before every extend launch (0.5.22 replaced it with ``release_request_row``); the
    ``unclamped-sync`` patch restores that call on later releases.
    """
    ModelFreeMlxRunner.flush_all_decode_kv = _model_free_flush_all_decode_kv

