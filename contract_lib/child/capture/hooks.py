"""Where the recorder hooks SGLang: each hook wraps one call site, records, and calls the
original (the list is in :mod:`contract_lib.child.capture`)."""

from __future__ import annotations

import numpy as np

from contract_lib.child.capture.backend_state import BackendStateRecorder
from contract_lib.child.capture.evictions import EvictionRecorder
from contract_lib.sources.compat import req_kv

_FEW = 32  # lanes a decode write's index may have to be applied entry by entry


def _numpy_index(indices):
    """The same index for the numpy view of the table (CPU tensors become arrays, no
    copy): numpy indexes a few entries in ~1 µs where torch takes ~10 µs an op. A part
    with a ``numpy`` method is a tensor (numpy's own arrays have none)."""
    if isinstance(indices, tuple):
        return tuple(part.numpy() if hasattr(part, "numpy") else part for part in indices)
    return indices.numpy() if hasattr(indices, "numpy") else indices


class HookInstaller:
    """The installation part of :class:`~contract_lib.child.capture.recorder.Recorder` (its state
    is set in ``Recorder.__init__``)."""

    def install(self) -> None:
        s = self.s
        owner, boundary = self.family.boundary(s)
        real_ingest = getattr(owner, boundary)
        real_process = s.process_batch_result

        def ingest_requests(*args, **kwargs):
            self.on_step_boundary()
            return real_ingest(*args, **kwargs)

        def process_batch_result(batch, result, *args, **kwargs):
            self.on_processed(batch, result)
            return real_process(batch, result, *args, **kwargs)

        setattr(owner, boundary, ingest_requests)
        self._install_abort_output_hook()
        self.family.watch_admissions(s, lambda req: self.reqs.setdefault(req.rid, req))
        if not self.capture:
            return  # feed and stop only: the baseline for the capture overhead
        s.process_batch_result = process_batch_result
        self._install_row_write_hook()
        self._install_relay_hooks()
        if self.effects is not None:
            self.effects.install(s)
        if self.mlx:
            self._install_mlx_launch_hooks()
        self.family.install_hooks(self)
        self.backend = BackendStateRecorder(self.s)
        EvictionRecorder(self.s, lambda: self.step,
                         lambda row: self._emit_rows([("evictions", row)]))
        self.find_invariant_checker()
        self.find_idle_arguments()

    def _install_abort_output_hook(self) -> None:
        """Record every ``AbortReq`` SGLang sends back for a request (each caller ends
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

    def _install_prebuilt_hook(self) -> None:
        """The decode side's prebuilt batch (``get_new_prebuilt_batch``, instance): the
        requests it admits without a forward, recorded once it is built and its relay
        stashed (``process_prebuilt``), before the first decode reads it."""
        real_prebuilt = self.s.get_new_prebuilt_batch

        def get_new_prebuilt_batch(*args, **kwargs):
            batch = real_prebuilt(*args, **kwargs)
            if batch is not None:
                self.on_prebuilt(batch)
            return batch

        self.s.get_new_prebuilt_batch = get_new_prebuilt_batch

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
        # The defining module's binding (what omni's execution bridge, or a reader moved
        # elsewhere, e.g. onto FutureMap, calls through) and each calling loop's own.
        callers = [overlap_utils, scheduler_module]
        if self.mlx:
            from sglang.srt.hardware_backend.mlx import scheduler_mixin

            callers.append(scheduler_mixin)
        for module in callers:
            # Each module's own binding is wrapped: a patch that rebound it there runs.
            module.resolve_forward_inputs = self._relay_reader(module.resolve_forward_inputs)

        # The relay's writers (``stash_bonus_tokens``: 0.5.19+), each wrapped where the
        # release has it.
        for kind in ("stash", "stash_bonus_tokens"):
            if hasattr(future_map, kind):
                setattr(future_map, kind, self._relay_writer(getattr(future_map, kind), kind))

    def _relay_writer(self, real_write, kind: str):
        """A relay writer of the FutureMap, its writes recorded after they happen."""

        def write(indices, payload, *args, **kwargs):
            out = real_write(indices, payload, *args, **kwargs)
            self.on_relay_write(indices, kind)
            return out

        return write

    def _relay_reader(self, real_resolve):
        """``resolve_forward_inputs`` as one module calls it, its reads recorded with
        what they fed the batch."""

        def resolve_forward_inputs(batch, fmap):
            if self.reading:  # called through another wrapped binding: recorded there
                return real_resolve(batch, fmap)
            lanes = self.relay_lanes(batch, fmap)
            self.reading = True
            try:
                out = real_resolve(batch, fmap)
            finally:
                self.reading = False
            if lanes is not None:
                self.on_relay_read(batch, fmap, lanes)
            return out

        return resolve_forward_inputs

    def _install_row_write_hook(self) -> None:
        """Wrap ``write`` on the class that defines it (not the instance), before the
        effects recorder wraps the same class: its hook then still sees SGLang's caller."""
        pool = self.s.req_to_token_pool
        self.track_row_writes(tuple(pool.req_to_token.shape))
        owner = next(c for c in type(pool).__mro__ if "write" in vars(c))
        real_write = owner.write
        recorder = self

        def write(obj, indices, values, *args, **kwargs):
            out = real_write(obj, indices, values, *args, **kwargs)
            if obj is pool:
                recorder.on_row_write(indices)
            return out

        owner.write = write

    def track_row_writes(self, shape: tuple[int, int]) -> None:
        """Start ``written_by`` for a ``req_to_token`` table of ``shape``: -1 everywhere."""
        self.written_by = np.full(shape, -1, dtype=np.int32)
        # Every entry holds its row number (a broadcast view, no copy): indexed like
        # ``req_to_token``, it gives the row of each entry an index selects.
        self._row_numbers = np.broadcast_to(np.arange(shape[0])[:, None], shape)
        self._holders: tuple[tuple, np.ndarray | None] = ((), None)

    def on_row_write(self, indices) -> None:
        """Attribute the entries ``req_to_token[indices]`` just written to the request
        holding each row (by index, whatever form ``indices`` takes): the same index
        applied to ``written_by`` and to the row numbers, so it costs the write's size,
        not the table's; a ``(row, span)`` index takes that row's holder directly."""
        if (isinstance(indices, tuple) and len(indices) == 2 and type(indices[0]) is int
                and type(indices[1]) is slice):  # (row, span): the extend path's form
            self.written_by[indices] = self._row_holders()[indices[0]]
            return
        if (isinstance(indices, tuple) and len(indices) == 2
                and all(getattr(part, "ndim", None) == 1  # integer tensors, not masks
                        and getattr(part.dtype, "is_signed", False)
                        and not part.dtype.is_floating_point for part in indices)
                and indices[0].shape[0] == indices[1].shape[0] <= _FEW):
            # (rows, positions) of a few lanes, the decode path's form: entry by entry
            # (~2 µs for four; a tensor's ``numpy()`` alone costs more)
            holders, written_by = self._row_holders(), self.written_by
            for row, position in zip(indices[0].tolist(), indices[1].tolist()):
                written_by[row, position] = holders[row]
            return
        index = _numpy_index(indices)
        if (isinstance(index, tuple) and len(index) == 2 and isinstance(index[1], np.ndarray)
                and isinstance(index[0], (np.ndarray, int))):
            # (rows, positions), the decode path's form: each entry's row is its part of
            # ``rows`` (broadcast like the index), without indexing the row numbers
            self.written_by[index] = self._row_holders()[index[0]]
            return
        self.written_by[index] = self._row_holders()[self._row_numbers[index]]

    def _row_holders(self) -> np.ndarray:
        """Per ``req_to_token`` row: the registry index of the first request whose
        ``req_pool_idx`` it is (-1: none); rebuilt only when a request's row changed."""
        rows_held = tuple(req_kv(req).req_pool_idx for req in self.reqs.values())
        if rows_held != self._holders[0] or self._holders[1] is None:
            rows = self.written_by.shape[0]
            holders = np.full(rows, -1, dtype=np.int32)
            for index in reversed(range(len(rows_held))):
                row = rows_held[index]
                if row is not None and 0 <= row < rows:
                    holders[row] = index
            self._holders = (rows_held, holders)
        return self._holders[1]

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

        def finalize_mlx_result(*args):
            # (launch, reqs); <= 0.5.17 (prefills, extends, decode, mode, reqs): the first
            # is the launch's key (compat.mlx_launch_parts), the last its requests
            self.produced = {}
            result = real_finalize(*args)
            if result.next_token_ids is not None:
                for req, token in zip(args[-1], result.next_token_ids.tolist()):
                    self.latest_token[req.rid] = token
            self.on_mlx_finalized(args[0])
            return result

        self._install_mlx_produced_hooks(getattr(worker, "_mlx_runner", None))
        worker.async_forward_batch_generation_mlx = async_forward_batch_generation_mlx
        worker.async_chained_decode_mlx = async_chained_decode_mlx
        worker.finalize_mlx_result = finalize_mlx_result

    def _install_mlx_produced_hooks(self, runner) -> None:
        """Note each token the MLX runner's finalize calls return, by request id (in
        ``produced``): what the model produced, whatever the worker makes of it. A
        release whose runner lacks one of them leaves its lanes unrecorded."""
        def noting(real, rids_of):
            def finalize(pending, *args, **kwargs):
                tokens = real(pending, *args, **kwargs)
                rids = rids_of(pending)
                values = list(tokens) if hasattr(tokens, "__len__") else [tokens]
                if len(values) == len(rids):
                    self.produced.update(zip(rids, map(int, values)))
                return tokens
            return finalize

        for name, rids_of in (("decode_batch_finalize", lambda pending: pending.req_ids),
                              ("prefill_finalize", lambda pending: [pending.req_id]),
                              ("extend_finalize", lambda pending: [pending.req_id])):
            real = getattr(runner, name, None)
            if real is not None:
                setattr(runner, name, noting(real, rids_of))
