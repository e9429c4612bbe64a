"""The MLX attention KV pool of a run: every write into it, and what it holds.

With ``runner="real"`` the MLX loop runs SGLang's own ``MlxModelRunner``, whose
per-request contiguous KV caches are copied into the shared ``MlxAttentionKVPool`` at
the slot ids the scheduler wrote into ``req_to_token``; a later request with a radix hit
reads its prefix from those slots. Clause 1 is about exactly these slot ids. The
model-free runner keeps the same pool of contents instead of KV (per slot, a digest of
the tokens the KV there was computed from) and runs SGLang's own sync methods, so its
writes and verdicts are the real runner's (:mod:`contract_lib.child.shims.mlx_runner`). This
module observes (it calls through) and records two tables:

- ``kv_syncs``: every position written into the pool, when (``step``), for which request
  (``rid``), by which path (``kind``), into which slot, and whose slot that was
  (``target``, ``owner``). Kinds, by the runner method that wrote:

  - ``prefill`` / ``extend``: a prefill or chunked-prefill launch writes its new positions
    to the slots the scheduler allocated (``prefill_start`` / ``extend_start``);
  - ``release``: the decode-KV sync when a request is released
    (``release_request_row``, 0.5.22+: clamped to ``owned_kv_len()``);
  - ``flush``: the extend-time flush of every active request's decode KV
    (``flush_all_decode_kv``, through 0.5.21: unclamped);
  - ``remove``: the sync in ``remove_request`` (through 0.5.21: unclamped);
  - ``dropped``: not a write. The positions a clamped release leaves out
    (``owned_kv_len() <= p < cache offset``), with the slot an unclamped sync would have
    written (usually 0: chained decode never recorded it). Their KV never reaches the pool.

  Targets: ``own`` (the writer's own slot at that position), ``slot 0`` (the padding
  slot), ``other live request`` (a slot another live request holds, named in
  ``owner``), ``shared prefix`` (another live request holds it at the same position
  inside its radix-protected prefix: same tokens, same KV), ``free`` (the allocator's),
  ``cached`` (held by no live request: the radix tree's).

- ``kv_pool``: at the end of the run, for every request, the pool slots the radix tree
  matches for its token sequence (prompt + output), each compared with the K and V that
  mlx-lm's own model computes for that sequence (:func:`contract_lib.sources.tiny_model.reference_kv`),
  over every layer (model-free: with the contents a correct run computes,
  :func:`contract_lib.child.shims.mlx_runner.reference_contents`): ``ok`` (``allclose``, atol
  1e-5), ``zero`` (the slot was never written) or ``wrong`` (other KV: the slot was
  overwritten, or its KV was computed from a damaged prefix). ``max_abs_diff`` is the
  largest difference over layers, K and V (model-free: NaN).

``meta["kv_pool"]`` adds ``slot0_nonzero`` (whether padding slot 0 holds anything at the
end) and ``model`` (the tiny model's weights digest).
"""

from __future__ import annotations

import array
import itertools
import math
import sys

from contract_lib.child.capture import free_slot_mask
from contract_lib.sources.compat import pool_layers, radix_match_slots, req_kv

KIND_BY_CALLER = {
    "prefill_start": "prefill",
    "extend_start": "extend",
    "release_request_row": "release",
    "flush_all_decode_kv": "flush",
    "remove_request": "remove",
}
TARGETS = ("own", "slot 0", "other live request", "shared prefix", "free", "cached")
ATOL = 1e-5


class KvPoolRecorder:
    """Records ``kv_syncs`` while the run goes and ``kv_pool`` at its end.

    ``state`` is the run's :class:`contract_lib.child.capture.RunState`: its ``step`` is
    the step a write happens in, its ``reqs`` the requests SGLang knows.
    """

    def __init__(self, state, model_dir: str) -> None:
        from contract_lib.child.capture import NumpyView

        self.s = state.scheduler
        self.state = state
        self.emit = state.emit
        self.req_to_token_view = NumpyView()  # sliced in numpy, not torch
        self.model_dir = model_dir
        self.runner = None
        self._model = None  # mlx-lm's model (real runner), loaded at the run's end
        self._context: list[tuple[str, str]] = []

    # -- writes -----------------------------------------------------------------------------

    def install(self) -> None:
        runner = self.s.tp_worker._mlx_runner
        self.runner = runner
        real_new = runner._sync_new_kv_to_pool
        real_decode = runner._sync_decode_kv_to_pool
        context = self._context

        def _sync_decode_kv_to_pool(req_id, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_name
            kind = KIND_BY_CALLER.get(caller, caller)
            end = args[0] if args else kwargs.get("end")
            context.append((req_id, kind))
            try:
                out = real_decode(req_id, *args, **kwargs)
            finally:
                context.pop()
            if end is not None:
                self._record_dropped(req_id, end)
            return out

        def _sync_new_kv_to_pool(cache, cache_start, slot_ids):
            if context:
                rid, kind = context[-1]
            else:
                frame = sys._getframe(1)
                kind = KIND_BY_CALLER.get(frame.f_code.co_name, frame.f_code.co_name)
                rid = frame.f_locals.get("req_id")
            if slot_ids and runner._attention_kv_pool is not None:
                self._record(rid, kind, int(cache_start), [int(s) for s in slot_ids])
            return real_new(cache, cache_start, slot_ids)

        runner._sync_decode_kv_to_pool = _sync_decode_kv_to_pool
        runner._sync_new_kv_to_pool = _sync_new_kv_to_pool

    def _record_dropped(self, rid: str, end: int) -> None:
        runner = self.runner
        cache = runner._req_caches.get(rid)
        row = runner._req_pool_idx.get(rid)
        if cache is None or row is None or runner._attention_kv_pool is None:
            return
        offset = runner._first_attention_cache(cache).offset
        start = max(int(end), runner._req_synced_offset.get(rid, 0))
        if offset <= start:
            return
        rtt = self._req_to_token()
        slots = [int(s) for s in rtt[row, start:offset].tolist()]
        self._record(rid, "dropped", start, slots)

    def _live_holders(self, rid: str) -> dict[int, tuple[str, int, int]]:
        """slot -> (request, position, cache_protected_len) over the other live requests."""
        rtt = self._req_to_token()
        holders: dict[int, tuple[str, int, int]] = {}
        for other, req in self.state.reqs.items():
            kv = req_kv(req)
            if other == rid or kv.req_pool_idx is None or req.finished():
                continue
            entries = rtt[kv.req_pool_idx, :kv.kv_allocated_len].tolist()
            for position, slot in enumerate(entries):
                if slot:
                    holders.setdefault(int(slot), (other, position, kv.cache_protected_len))
        return holders

    def _req_to_token(self):
        """``req_to_token`` as numpy."""
        return self.req_to_token_view.of(self.s.req_to_token_pool.req_to_token)

    def _record(self, rid: str | None, kind: str, start: int, slots: list[int]) -> None:
        req = self.state.reqs.get(rid)
        row = None if req is None else req_kv(req).req_pool_idx
        own = [] if row is None else self._req_to_token()[row, start:start + len(slots)].tolist()
        # The other live requests' slots and the allocator's free ones, read at the first
        # slot that is not the writer's own (most writes have none).
        holders: dict[int, tuple[str, int, int]] | None = None
        free = None
        rows = []
        for i, slot in enumerate(slots):
            position = start + i
            owner = None
            if slot == 0:
                target = "slot 0"
            elif i < len(own) and own[i] == slot:
                target = "own"
            else:
                if holders is None:
                    holders = self._live_holders(rid)
                    free = free_slot_mask(self.s.token_to_kv_pool_allocator)
                if slot in holders:
                    owner, held_at, protected = holders[slot]
                    target = ("shared prefix" if held_at == position and position < protected
                              else "other live request")
                elif slot < len(free) and free[slot]:
                    target = "free"
                else:
                    target = "cached"
            # a tuple in the table's column order (``frames.COLUMNS``)
            rows.append(("kv_syncs", (self.state.step, rid, kind, position, slot, target,
                                      owner)))
        self.emit(("rows", rows, []))

    # -- contents at the end ----------------------------------------------------------------

    def finish(self) -> None:
        """Emit ``kv_pool`` (every request's radix-matched slots against what a correct run
        holds there) and ``meta["kv_pool"]``."""
        from contract_lib.child.shims.mlx_runner import ModelFreeKvPool

        pool = self.runner._attention_kv_pool if self.runner is not None else None
        if pool is None:
            return
        model_free = isinstance(pool, ModelFreeKvPool)
        rows = []
        for rid, req in self.state.reqs.items():
            tokens = list(req.origin_input_ids) + list(req.output_ids)
            slots = self._radix_slots(tokens)
            if not slots:
                continue
            found = (zip(pool.verdicts(tokens, slots), itertools.repeat(math.nan))
                     if model_free else self._kv_verdicts(pool, tokens, slots))
            for position, (slot, (verdict, diff)) in enumerate(zip(slots, found)):
                rows.append(("kv_pool", {"rid": rid, "position": position, "slot": slot,
                                         "verdict": verdict, "max_abs_diff": diff}))
        self.emit(("rows", rows, []))
        if model_free:
            meta = {"slot0_nonzero": 0 in pool.contents, "model": "model-free"}
        else:
            from contract_lib.sources.tiny_model import weights_digest

            meta = {"slot0_nonzero": self._slot0_nonzero(pool),
                    "model": weights_digest(self.model_dir)}
        self.emit(("meta", {"kv_pool": meta}))

    def _kv_verdicts(self, pool, tokens: list[int], slots: list[int]
                     ) -> list[tuple[str, float]]:
        """Per slot: its verdict and largest difference over layers, K and V, against the
        KV mlx-lm's own model computes for ``tokens``."""
        import mlx.core as mx

        from contract_lib.sources.tiny_model import load_reference_model, reference_kv

        if self._model is None:
            self._model = load_reference_model(self.model_dir)
        reference = reference_kv(self._model, tokens)
        layers = pool_layers(self.runner._cache_layout)
        index = mx.array(slots, dtype=mx.int32)
        n = len(slots)
        diff = mx.zeros((n,))
        nonzero = mx.zeros((n,), dtype=mx.bool_)
        for j, layer in enumerate(layers):
            ref_k, ref_v = reference[layer]
            for buffer, ref in ((pool.k_buffer[j], ref_k), (pool.v_buffer[j], ref_v)):
                got = buffer[index]                        # (n, heads, head_dim)
                want = ref[:, :n, :].transpose(1, 0, 2)    # (n, heads, head_dim)
                diff = mx.maximum(diff, mx.abs(got - want).max(axis=(1, 2)))
                nonzero = nonzero | mx.any(got != 0, axis=(1, 2))
        mx.eval(diff, nonzero)
        return [("ok" if d <= ATOL else ("wrong" if nz else "zero"), float(f"{d:.3g}"))
                for d, nz in zip(diff.tolist(), nonzero.tolist())]

    @staticmethod
    def _slot0_nonzero(pool) -> bool:
        import mlx.core as mx

        buffers = pool.all_buffers()
        mx.eval(*buffers)
        return any(bool(mx.any(buffer[0] != 0).item()) for buffer in buffers)

    def _radix_slots(self, tokens: list[int]) -> list[int]:
        """The pool slots the radix tree holds for the longest cached prefix of ``tokens``."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        tree = self.s.tree_cache
        match = tree.match_prefix(MatchPrefixParams(key=RadixKey(array.array("q", tokens))))
        return radix_match_slots(tree, match)
