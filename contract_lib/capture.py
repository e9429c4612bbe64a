"""Observation hooks inside the child process: they record SGLang's state and call through.

Nothing here changes what SGLang computes. Each hook wraps one SGLang call site,
records, and calls the original:

- ``Scheduler.ingest_requests`` (instance): the step boundary; also where scripted
  requests are fed in and where the run is stopped.
- ``Scheduler._add_request_to_queue`` (instance): keeps a registry of every ``Req``.
- ``Scheduler.process_batch_result`` (instance): completes the launch record.
- ``ipc_channels.send_to_tokenizer.send_output`` (instance): the ``AbortReq`` outputs by
  which SGLang ends a request outside the output stream (an abort while it is queued
  pops it without setting ``finished_reason``); recorded as that request's finish.
- ``resolve_forward_inputs`` (the name imported by ``scheduler`` and the MLX mixin):
  relay reads; ``FutureMap.stash`` / ``stash_bonus_tokens`` (instance): relay writes.
- The forward launch: the torch model-free forward calls :meth:`Recorder.on_torch_launch`;
  on the MLX loop ``MlxTpModelWorker.async_forward_batch_generation_mlx`` (fresh) and
  ``async_chained_decode_mlx`` (chained) are wrapped on the instance.
- ``ReqToTokenPool.write`` (class, in the child only): the one CPU-path writer of ``req_to_token`` in
  0.5.21-0.5.23 (``alloc_for_extend`` via ``write_cache_indices``' non-Triton branch,
  ``alloc_for_decode``, the radix caches' ``cache_unfinished_req``); every entry written
  is attributed to the request holding that row at write time, so a ``slots`` entry
  left by a row's previous holder shows as not ``written``.
- :class:`BackendStateRecorder` wraps nothing: at each step boundary it reads the
  backend's per-request dicts and sets (table ``backend_state``, clause 7).

On sglang-omni's ``OmniScheduler`` (loop ``omni``, :mod:`contract_lib.omni`) the step
boundary is ``recv_requests`` (the first call of its loop iteration after the admin
queue), scripted requests go into its ``inbox``, the registry wraps its
``request_builder`` (it appends to ``waiting_queue`` itself, not through
``_add_request_to_queue``), and its model-free forward calls
:meth:`Recorder.on_torch_launch`. Its in-flight work is its one-step lookahead
(``async_pending``): ``steps.enable_overlap`` and ``result_queue_len`` record it there.
"""

from __future__ import annotations

import array
import collections
import time
from typing import Any, Callable

import numpy as np

from contract_lib.loops import OMNI, LoopSpec
from contract_lib.workloads import RequestSpec, Workload

Emit = Callable[[tuple], None]


class StopRun(Exception):
    """Raised at a step boundary once the workload is done (every request finished)."""


class OmniRequestError(RuntimeError):
    """sglang-omni put an error for a request into its outbox (a failed batch)."""


class StepBudgetExceeded(Exception):
    """Raised at a step boundary past the workload's ``max_steps``."""


def _mode_name(batch) -> str | None:
    if batch is None or batch.is_empty():
        return None
    return batch.forward_mode.name.lower()


def _tolist(tensor) -> list:
    return [] if tensor is None else tensor.tolist()


def _prefill_lanes(batch) -> list[int]:
    """Indices into ``batch.reqs`` of its prefill/extend lanes: every request of an
    extend or mixed batch except its decode lanes (``decoding_reqs``); none of a decode
    batch."""
    if batch is None or batch.is_empty() or not batch.forward_mode.is_extend():
        return []
    decoding = {id(req) for req in (batch.decoding_reqs or ())}
    return [i for i, req in enumerate(batch.reqs) if id(req) not in decoding]


def _prefilled_tokens(batch) -> int:
    """Tokens a launch prefills (clause 6): its prefill lanes' ``extend_lens``; a decode
    lane of a mixed batch, a decode or a chained launch (``batch`` None) prefill none."""
    lanes = _prefill_lanes(batch)
    return int(sum(batch.extend_lens[i] for i in lanes))


def free_slot_mask(allocator) -> np.ndarray:
    """A mask over slot ids: True where the allocator holds the slot as free (its free
    pages, released or staged ones included, as SGLang's own census
    ``get_all_free_pages`` lists them; a page is ``page_size`` slots, page 0 reserved)."""
    page = allocator.page_size
    pages = allocator.get_all_free_pages().numpy()
    mask = np.zeros((allocator.size // page + 1) * page, dtype=bool)
    mask[(pages[:, None] * page + np.arange(page)).reshape(-1)] = True
    return mask


class Recorder:
    """Records frames of one run and streams them through ``emit`` as they are taken.

    Messages are ``("row", table, row)``, ``("rows", [(table, row), ...], slots)`` (a
    step boundary's whole frame, sent together as soon as it is taken; ``slots`` holds
    ``(step, rid, req_pool_idx, [slot...], [free...], [written...])`` per live request) and ``("update", table,
    key, value, fields)``; nothing is buffered, so a dying child loses nothing taken.
    """

    def __init__(self, scheduler, loop_spec: LoopSpec, workload: Workload, emit: Emit,
                 capture: bool = True, audit: bool = False) -> None:
        self.s = scheduler
        self.capture = capture
        self.effects = None
        if audit:
            from contract_lib.effects import EffectsRecorder

            self.effects = EffectsRecorder()
        self.loop = loop_spec.name
        self.mlx = loop_spec.mlx  # the MLX mixin's launch hooks and relay import
        self.omni = loop_spec.family == OMNI  # sglang-omni's ingress, resolve and queue
        self.workload = workload
        self.emit = emit
        self.step = -1
        self.reqs: dict[str, Any] = {}
        self.fed: set[str] = set()
        self.kv_computed: dict[str, int] = {}
        self.latest_token: dict[str, int] = {}
        self.launch_ct = 0
        self.unprocessed: collections.deque[int] = collections.deque()
        self.relay_written: dict[int, tuple[int, str | None, int | None]] = {}
        # Per req_to_token entry: the registry index (in ``reqs`` order) of the request
        # that held the row when the entry was last written; -1 never written.
        self.written_by: np.ndarray | None = None
        self._checker = None
        self.resolving: int | None = None  # omni: the launch being resolved
        # Per request: kv_computed at the end of its last prefill/extend lane (clause 2's
        # decode_batch_idx counts the decode launches since).
        self.kv_prefilled: dict[str, int] = {}
        self.backend = None
        # Requests SGLang ended with an AbortReq output: rid -> its finished_reason dict.
        self.abort_outputs: dict[str, dict[str, Any]] = {}
        self.aborts_sent: set[str] = set()

    # -- installation -------------------------------------------------------------------

    def install(self) -> None:
        s = self.s
        boundary = "recv_requests" if self.omni else "ingest_requests"
        real_ingest = getattr(s, boundary)
        real_add = s._add_request_to_queue
        real_process = s.process_batch_result

        def ingest_requests(*args, **kwargs):
            self.on_step_boundary()
            return real_ingest(*args, **kwargs)

        def add_request_to_queue(req, *args, **kwargs):
            self.reqs.setdefault(req.rid, req)
            return real_add(req, *args, **kwargs)

        def process_batch_result(batch, result, *args, **kwargs):
            self.on_processed(batch, result)
            return real_process(batch, result, *args, **kwargs)

        setattr(s, boundary, ingest_requests)
        self._install_abort_output_hook()
        if self.omni:
            real_build = s.request_builder

            def request_builder(payload):
                data = real_build(payload)
                self.reqs.setdefault(data.req.rid, data.req)
                return data

            s.request_builder = request_builder
        else:
            s._add_request_to_queue = add_request_to_queue
        if not self.capture:
            return  # feed and stop only: the baseline for the capture overhead
        s.process_batch_result = process_batch_result
        self._install_row_write_hook()
        if self.omni:
            self._install_omni_resolve_hook()
        self._install_relay_hooks()
        if self.effects is not None:
            self.effects.install(s)
        if self.mlx:
            self._install_mlx_launch_hooks()
        self.backend = BackendStateRecorder(self.s)

    def _install_abort_output_hook(self) -> None:
        """Record every ``AbortReq`` SGLang sends back for a request (every caller ends
        the request); a request aborted while queued has no other trace of its end."""
        from sglang.srt.managers.io_struct import AbortReq

        sender = self.s.ipc_channels.send_to_tokenizer
        real_send = sender.send_output

        def send_output(output, *args, **kwargs):
            if isinstance(output, AbortReq) and output.rid:
                self.abort_outputs.setdefault(
                    output.rid, dict(output.finished_reason or {"type": "abort"}))
            return real_send(output, *args, **kwargs)

        sender.send_output = send_output

    def _ended(self, req) -> bool:
        """Finished, or ended by an abort output (popped from the queue unfinished)."""
        return bool(req.finished()) or req.rid in self.abort_outputs

    def _install_omni_resolve_hook(self) -> None:
        """Pair each lookahead launch with its resolve (``resolve_and_process``), in
        launch order: a launch whose requests all finished in an earlier step (the
        lookahead overrun) is resolved and dropped without ``process_batch_result``, so
        pairing processed batches with launches by order alone would shift by one."""
        real_resolve = self.s.resolve_and_process

        def resolve_and_process(*args, **kwargs):
            self.resolving = self.unprocessed.popleft() if self.unprocessed else None
            try:
                return real_resolve(*args, **kwargs)
            finally:
                self.resolving = None

        self.s.resolve_and_process = resolve_and_process

    def _install_relay_hooks(self) -> None:
        from sglang.srt.managers import overlap_utils, scheduler as scheduler_module

        future_map = self.s.future_map
        future_map.output_tokens_buf.fill_(-1)  # poison: an unwritten row reads -1
        real_resolve = overlap_utils.resolve_forward_inputs

        def resolve_forward_inputs(batch, fmap):
            self.on_relay_read(batch, fmap)
            return real_resolve(batch, fmap)

        scheduler_module.resolve_forward_inputs = resolve_forward_inputs
        if self.omni:  # its execution bridge imports it at every forward
            overlap_utils.resolve_forward_inputs = resolve_forward_inputs
        if self.mlx:
            from sglang.srt.hardware_backend.mlx import scheduler_mixin

            scheduler_mixin.resolve_forward_inputs = resolve_forward_inputs

        real_stash = future_map.stash
        real_stash_bonus = future_map.stash_bonus_tokens

        def stash(indices, payload, *args, **kwargs):
            out = real_stash(indices, payload, *args, **kwargs)
            self.on_relay_write(indices, payload.bonus_tokens, "stash")
            return out

        def stash_bonus_tokens(indices, bonus_tokens, *args, **kwargs):
            out = real_stash_bonus(indices, bonus_tokens, *args, **kwargs)
            self.on_relay_write(indices, bonus_tokens, "stash_bonus_tokens")
            return out

        future_map.stash = stash
        future_map.stash_bonus_tokens = stash_bonus_tokens

    def _install_row_write_hook(self) -> None:
        """Wrap ``write`` on the class that defines it (not the instance), before the
        effects recorder wraps the same class: its hook then still sees SGLang's caller."""
        pool = self.s.req_to_token_pool
        self.written_by = np.full(tuple(pool.req_to_token.shape), -1, dtype=np.int32)
        owner = next(c for c in type(pool).__mro__ if "write" in vars(c))
        real_write = owner.write
        recorder = self

        def write(obj, indices, values, *args, **kwargs):
            out = real_write(obj, indices, values, *args, **kwargs)
            if obj is pool:
                recorder.on_row_write(indices)
            return out

        owner.write = write

    def on_row_write(self, indices) -> None:
        """Attribute the entries ``req_to_token[indices]`` just written to the request
        holding each row (by index, whatever form ``indices`` takes)."""
        import torch

        marker = torch.zeros(self.written_by.shape, dtype=torch.bool)
        marker[indices] = True
        rows, positions = (t.numpy() for t in marker.nonzero(as_tuple=True))
        holders = {row: self._row_holder(int(row)) for row in set(rows.tolist())}
        self.written_by[rows, positions] = [holders[row] for row in rows.tolist()]

    def _row_holder(self, row: int) -> int:
        """Registry index of the request whose ``req_pool_idx`` is ``row`` (-1: none)."""
        for index, req in enumerate(self.reqs.values()):
            if req.kv.req_pool_idx == row:
                return index
        return -1

    def _install_mlx_launch_hooks(self) -> None:
        worker = self.s.tp_worker
        real_fresh = worker.async_forward_batch_generation_mlx
        real_chained = worker.async_chained_decode_mlx
        real_finalize = worker.finalize_mlx_result

        def async_forward_batch_generation_mlx(batch):
            launch = real_fresh(batch)
            self.on_mlx_launch(launch, batch, chained=False)
            return launch

        def async_chained_decode_mlx(prev_pending):
            launch = real_chained(prev_pending)
            self.on_mlx_launch(launch, None, chained=True)
            return launch

        def finalize_mlx_result(launch, reqs):
            result = real_finalize(launch, reqs)
            if result.next_token_ids is not None:
                for req, token in zip(reqs, result.next_token_ids.tolist()):
                    self.latest_token[req.rid] = token
            return result

        worker.async_forward_batch_generation_mlx = async_forward_batch_generation_mlx
        worker.async_chained_decode_mlx = async_chained_decode_mlx
        worker.finalize_mlx_result = finalize_mlx_result

    # -- launches -------------------------------------------------------------------------

    def _record_launch(self, *, forward_iter, launch_ts, mode, chained, rids,
                       prefilled_tokens: int = 0) -> None:
        self.launch_ct += 1
        self.unprocessed.append(self.launch_ct)
        self.emit(("row", "launches", {
            "launch": self.launch_ct, "step": self.step, "loop": self.loop,
            "forward_ct": self.s.forward_ct, "forward_iter": forward_iter,
            "launch_ts": launch_ts, "mode": mode, "chained": chained,
            "rids": ",".join(rids), "processed_step": None,
            "processed_forward_iter": None, "processed_launch_ts": None,
            "prefilled_tokens": prefilled_tokens,
        }))

    def on_torch_launch(self, batch, tokens: list[int]) -> None:
        """Called by the torch model-free forward with the batch and the tokens it made."""
        if not self.capture:
            return
        rids = [req.rid for req in batch.reqs]
        for rid, seq_len, token in zip(rids, batch.seq_lens.tolist(), tokens):
            self.kv_computed[rid] = int(seq_len)
            self.latest_token[rid] = int(token)
        for lane in _prefill_lanes(batch):
            self.kv_prefilled[rids[lane]] = self.kv_computed[rids[lane]]
        self._record_launch(forward_iter=batch.forward_iter, launch_ts=batch.launch_ts,
                            mode=_mode_name(batch), chained=False, rids=rids,
                            prefilled_tokens=_prefilled_tokens(batch))

    def on_mlx_launch(self, launch, batch, *, chained: bool) -> None:
        rids = []
        for pending in (*launch.prefills, *launch.extends):
            self.kv_computed[pending.req_id] = int(pending.cache[0].offset)
            self.kv_prefilled[pending.req_id] = self.kv_computed[pending.req_id]
            rids.append(pending.req_id)
        if launch.decode is not None:
            for rid, cache in zip(launch.decode.req_ids, launch.decode.caches):
                self.kv_computed[rid] = int(cache[0].offset)
                rids.append(rid)
        if batch is not None:
            rids = [req.rid for req in batch.reqs]
            forward_iter, launch_ts, mode = batch.forward_iter, batch.launch_ts, _mode_name(batch)
        else:
            forward_iter, launch_ts, mode = None, None, "decode"
        self._record_launch(forward_iter=forward_iter, launch_ts=launch_ts, mode=mode,
                            chained=chained, rids=rids,
                            prefilled_tokens=_prefilled_tokens(batch))

    def on_processed(self, batch, result) -> None:
        if self.resolving is not None:
            launch, self.resolving = self.resolving, None
        elif self.unprocessed:
            launch = self.unprocessed.popleft()
        else:
            return
        self.emit(("update", "launches", "launch", launch, {
            "processed_step": self.step,
            "processed_forward_iter": batch.forward_iter,
            "processed_launch_ts": batch.launch_ts,
        }))

    # -- relay ------------------------------------------------------------------------------

    def _row_owner(self, row: int) -> str | None:
        for rid, req in self.reqs.items():
            if req.kv.req_pool_idx == row and not req.finished():
                return rid
        return None

    def on_relay_read(self, batch, future_map) -> None:
        if batch.prefill_input_ids_cpu is not None:
            if batch.mix_running_indices is None:
                return
            rows, kind = _tolist(batch.mix_running_indices), "mixed"
            rids = [req.rid for req in batch.reqs[len(batch.reqs) - len(rows):]]
        elif batch.input_ids is None and future_map.spec_algo.is_none():
            rows, kind = _tolist(batch.req_pool_indices), "decode"
            rids = [req.rid for req in batch.reqs]
        else:
            return
        values = future_map.output_tokens_buf[rows].tolist() if rows else []
        for row, rid, value in zip(rows, rids, values):
            written = self.relay_written.get(row)
            last_value, last_rid = (written[0], written[1]) if written else (None, None)
            published = (written is not None and last_rid == rid
                         and last_value == self.latest_token.get(rid))
            self.emit(("row", "relay", {
                "event": "read", "step": self.step, "launch": self.launch_ct + 1,
                "loop": self.loop, "kind": kind, "row": row, "rid": rid, "value": value,
                "last_published": last_value, "published_for_rid": published,
            }))

    def on_relay_write(self, indices, tokens, kind: str) -> None:
        for row, value in zip(_tolist(indices), _tolist(tokens)):
            rid = self._row_owner(row)
            self.relay_written[row] = (int(value), rid, self.launch_ct)
            self.emit(("row", "relay", {
                "event": "write", "step": self.step, "launch": self.launch_ct,
                "loop": self.loop, "kind": kind, "row": row, "rid": rid, "value": int(value),
                "last_published": None, "published_for_rid": None,
            }))

    # -- step boundary ----------------------------------------------------------------------

    def on_step_boundary(self) -> None:
        self.step += 1
        if self.effects is not None:
            self.effects.active = False  # the capture's own reads and writes are not effects
            self._emit_effects()
        if self.capture:
            self.snapshot()
        if self.omni:
            self._raise_omni_errors()
        if self.done():
            raise StopRun()
        if self.step >= self.workload.max_steps:
            raise StepBudgetExceeded(
                f"workload {self.workload.name!r} did not finish within its step budget "
                f"of {self.workload.max_steps} steps")
        self.feed()
        if self.effects is not None:
            self.effects.step = self.step
            self.effects.active = True

    def _raise_omni_errors(self) -> None:
        """Make a request error sglang-omni reported end the run (crashed).

        Its loop catches a failing batch (``run_batch``, ``handle_batch_failure``),
        aborts the batch's requests and carries on; the error only goes to the outbox
        for the next pipeline stage. Without this, a run whose forward raised would
        finish with aborted requests and hold every clause vacuously."""
        for message in list(self.s.outbox.queue):
            if message.type == "error":
                error = message.data
                raise OmniRequestError(
                    f"sglang-omni reported an error for request {message.request_id!r}: "
                    f"{type(error).__name__}: {error}") from (
                        error if isinstance(error, BaseException) else None)

    def _emit_effects(self) -> None:
        rows = [("effects", row) for row in self.effects.take(self.loop)]
        if rows:
            self.emit(("rows", rows, []))

    def done(self) -> bool:
        return (len(self.fed) == len(self.workload.requests)
                and all(self._ended(req) for req in self.reqs.values())
                and len(self.reqs) == len(self.workload.requests)
                and self._in_flight() == 0)

    def _in_flight(self) -> int:
        """Launched steps not yet processed that the loop carries to its next iteration:
        SGLang's overlap loops' ``result_queue``; omni's lookahead step (``async_pending``)."""
        if self.omni:
            return int(self.s.async_pending is not None)
        return len(getattr(self.s, "result_queue", ()) or ())

    def _overlaps(self) -> bool:
        """Whether the loop can carry in-flight work (omni: ``enable_async_decode``)."""
        return bool(self.s.enable_overlap or (self.omni and self.s.enable_async_decode))

    def feed(self) -> None:
        """Hand SGLang the requests due at this step, then the aborts due (each after its
        request, through the same ingress)."""
        for spec in self.workload.requests:
            self._feed_request(spec)
        for spec in self.workload.requests:
            if (spec.abort_at is not None and spec.abort_at <= self.step
                    and spec.rid in self.fed and spec.rid not in self.aborts_sent):
                self._send_abort(spec.rid)

    def _send_abort(self, rid: str) -> None:
        """SGLang's own ``AbortReq``, as the tokenizer manager sends for a client abort."""
        from sglang.srt.managers.io_struct import AbortReq

        self.s.request_receiver.pending.append(AbortReq(rid=rid))
        self.aborts_sent.add(rid)

    def _feed_request(self, spec: RequestSpec) -> None:
        if spec.rid in self.fed or spec.arrival > self.step:
            return
        prompt = list(spec.prompt)
        if spec.turn_of is not None:
            parent = self.reqs.get(spec.turn_of)
            if parent is None or not self._ended(parent):
                return
            prompt = list(parent.origin_input_ids) + list(parent.output_ids) + prompt
        if self.omni:
            from contract_lib.shims import omni_request_message

            self.s.inbox.put(omni_request_message(spec.rid, prompt, spec.sampling()))
        else:
            self.s.request_receiver.pending.append(_tokenized_request(spec, prompt))
        self.fed.add(spec.rid)

    def snapshot(self) -> None:
        s, step = self.s, self.step
        running, last = s.running_batch, s.last_batch
        rows: list[tuple[str, dict[str, Any]]] = []
        rows.append(("steps", {
            "step": step, "loop": self.loop, "forward_ct": s.forward_ct,
            "result_queue_len": self._in_flight(),
            "is_fully_idle": bool(s.is_fully_idle()), "idle_probe": self._idle_probe(),
            "enable_overlap": self._overlaps(),
            "enable_overlap_mlx": bool(s.enable_overlap_mlx),
            "running_bs": 0 if running is None else len(running.reqs),
            "running_mode": _mode_name(running), "last_batch_mode": _mode_name(last),
            "waiting_len": len(s.waiting_queue), **self._pool_terms(),
            "wall_time": time.monotonic(),
            "processed_tokens_counter": getattr(s, "processed_tokens_counter", None),
        }))
        free = free_slot_mask(self.s.token_to_kv_pool_allocator)
        rtt = s.req_to_token_pool.req_to_token
        slot_rows = []
        for index, (rid, req) in enumerate(self.reqs.items()):
            kv = req.kv
            row = kv.req_pool_idx
            reason = (req.finished_reason.to_json() if req.finished_reason
                      else self.abort_outputs.get(rid, {}))
            rows.append(("requests", {
                "step": step, "rid": rid, "prompt_len": len(req.origin_input_ids),
                "emitted": len(req.output_ids), "finished": self._ended(req),
                "req_pool_idx": row, "seq_len": self._seq_len(req, running, last),
                "kv_computed": self.kv_computed.get(rid),
                "kv_committed_len": kv.kv_committed_len,
                "kv_allocated_len": kv.kv_allocated_len,
                "cache_protected_len": kv.cache_protected_len,
                "cached_tokens": req.cached_tokens,
                "finish_reason": reason.get("type"), "finish_message": reason.get("message"),
                "retractions": req.retraction_count,
                "decode_batch_idx": getattr(req, "decode_batch_idx", None),
                "kv_prefilled": self.kv_prefilled.get(rid),
            }))
            if row is None or self._ended(req):
                continue
            width = max(self.kv_computed.get(rid, 0), kv.kv_allocated_len)
            entries = rtt[row, :width].numpy()
            written = (self.written_by[row, :width] == index).tolist()
            slot_rows.append((step, rid, row, entries.tolist(), free[entries].tolist(),
                              written))
        rows += [("backend_state", row) for row in self.backend.rows(step, self.reqs)]
        # One message: the step's frame, taken together (slots column-wise, expanded by
        # the parent into one row per position).
        self.emit(("rows", rows, slot_rows))

    def _idle_probe(self) -> bool:
        """``is_fully_idle()`` with every term but the in-flight one masked to idle."""
        s = self.s
        saved = (s.running_batch, s.last_batch, s.chunked_req, s.waiting_queue)
        try:
            s.running_batch = _EmptyBatch()
            s.last_batch, s.chunked_req, s.waiting_queue = None, None, []
            return bool(s.is_fully_idle())
        finally:
            s.running_batch, s.last_batch, s.chunked_req, s.waiting_queue = saved

    def _pool_terms(self) -> dict[str, Any]:
        """SGLang's own KV pool conservation terms (``InvariantChecker``), and its verdict."""
        checker = self._invariant_checker()
        stats = checker.pool_stats_observer.get_pool_stats()
        if checker.get_last_batch() is None:
            # <= 0.5.21 reads ``get_last_batch().reqs`` unguarded (SGLang calls it only
            # once a batch ran); the step boundaries before the first batch have none.
            saved = checker.get_last_batch
            checker.get_last_batch = _EmptyBatch
            try:
                uncached, _ = checker._get_total_uncached_sizes()
            finally:
                checker.get_last_batch = saved
        else:
            uncached, _ = checker._get_total_uncached_sizes()
        leak, _message = checker._check_full_pool(stats, uncached=uncached)
        return {
            "kv_total": int(self.s.max_total_num_tokens),
            "kv_available": int(stats.full_available_size),
            "kv_evictable": int(stats.full_evictable_size),
            "kv_protected": int(self.s.tree_cache.protected_size()),
            "kv_uncached": int(uncached), "pool_leak": bool(leak),
        }

    def _invariant_checker(self):
        """SGLang's ``SchedulerInvariantChecker``: the scheduler's own or, where the loop
        builds none (``omni``), one SGLang's ``init_invariant_checker`` builds over the
        scheduler's pools for the frames only (nothing in the loop reads it)."""
        checker = getattr(self.s, "invariant_checker", None)
        if checker is None:
            if self._checker is None:
                from sglang.srt.managers.scheduler import Scheduler

                view = _ReadThrough(self.s)
                Scheduler.init_invariant_checker(view)
                self._checker = view.invariant_checker
            checker = self._checker
        return checker

    @staticmethod
    def _seq_len(req, running, last) -> int | None:
        for batch in (running, last):
            if batch is None or batch.is_empty() or batch.seq_lens is None:
                continue
            for i, other in enumerate(batch.reqs):
                if other is req:
                    return int(batch.seq_lens[i])
        return None

    def finish(self) -> None:
        """Emit the outputs table (called once, whatever ended the run)."""
        if self.effects is not None:
            self.effects.active = False
            self._emit_effects()
        if not self.capture:
            return
        for rid, req in self.reqs.items():
            for index, token in enumerate(req.output_ids):
                self.emit(("row", "outputs", {"rid": rid, "index": index, "token": int(token)}))


class BackendStateRecorder:
    """Records the backend's per-request structures at every step boundary.

    The backend is the scheduler's ``tp_worker`` and every ``*runner`` object it holds
    (MLX: ``MlxTpModelWorker``, its ``MlxModelRunner`` and the bookkeeping stub; torch:
    ``TpModelWorker`` and its runner). A structure is per-request when it is a dict or set
    attribute of one of them that has ever been keyed by a request id the scheduler knows;
    from then on every string key it holds is recorded, known or not. No names are
    assumed, so a release or a replacement loop that renames them is still covered.
    """

    def __init__(self, scheduler) -> None:
        self.s = scheduler
        self.per_request: set[str] = set()  # "object.attribute" found keyed by request ids

    def _objects(self) -> dict[str, Any]:
        worker = getattr(self.s, "tp_worker", None)
        if worker is None:
            return {}
        objects = {"tp_worker": worker}
        for name, value in vars(worker).items():
            if name.endswith("runner") and value is not None and hasattr(value, "__dict__"):
                objects[f"tp_worker.{name}"] = value
        return objects

    def rows(self, step: int, reqs: dict[str, Any]) -> list[dict[str, Any]]:
        """``(step, rid, structure, row)`` per request key held, in a stable order."""
        rows = []
        for owner, obj in self._objects().items():
            for name, value in sorted(vars(obj).items()):
                if not isinstance(value, (dict, set, frozenset)):
                    continue
                structure = f"{owner}.{name}"
                keys = [k for k in value if isinstance(k, str)]
                if structure not in self.per_request:
                    if not any(k in reqs for k in keys):
                        continue
                    self.per_request.add(structure)
                maps_row = isinstance(value, dict) and "pool_idx" in name
                for key in sorted(keys):
                    row = value[key] if maps_row else None
                    rows.append({"step": step, "rid": key, "structure": structure,
                                 "row": int(row) if isinstance(row, int) else None})
        return rows


class _ReadThrough:
    """Reads fall through to the scheduler; writes stay here (see ``_invariant_checker``)."""

    def __init__(self, scheduler) -> None:
        self._scheduler = scheduler

    def __getattr__(self, name: str):
        return getattr(self._scheduler, name)


class _EmptyBatch:
    """Stands in for the running batch during the idle probe."""

    reqs: list = []

    @staticmethod
    def is_empty() -> bool:
        return True


def _tokenized_request(spec: RequestSpec, prompt: list[int]):
    """A real ``TokenizedGenerateReqInput``, greedy, with the request's stop tokens,
    sampling switches and priority, as the tokenizer manager would send it."""
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    from contract_lib.shims import VOCAB_SIZE

    params = SamplingParams(**spec.sampling())
    params.normalize(None)
    params.verify(VOCAB_SIZE)
    return TokenizedGenerateReqInput(
        rid=spec.rid, input_text=None, input_ids=array.array("q", prompt),
        input_embeds=None, mm_inputs=None, token_type_ids=None, sampling_params=params,
        return_logprob=False, logprob_start_len=-1, top_logprobs_num=0,
        token_ids_logprob=None, stream=False, priority=spec.priority)
