"""Where the recorder hooks SGLang: each hook wraps one call site, records, and calls the
original (the list is in :mod:`contract_lib.child.capture`)."""

from __future__ import annotations

from typing import Callable

from contract_lib.child.capture.evictions import EvictionRecorder
from contract_lib.child.capture.launches import LaunchRecorder
from contract_lib.child.capture.row_writes import RowWrites
from contract_lib.child.capture.snapshot import StepSnapshot
from contract_lib.child.capture.state import RunState


class HookInstaller:
    """Installs the run's hooks on SGLang's objects: each records through the part that
    keeps that record (``launches``, ``row_writes``, ``snapshot``) and calls the
    original. ``on_step_boundary``: what the step boundary runs before SGLang's own."""

    def __init__(self, state: RunState, on_step_boundary: Callable[[], None],
                 launches: LaunchRecorder, row_writes: RowWrites | None,
                 snapshot: StepSnapshot, effects=None) -> None:
        self.state = state
        self.s = state.scheduler
        self.on_step_boundary = on_step_boundary
        self.launches, self.row_writes, self.snapshot = launches, row_writes, snapshot
        self.effects = effects  # the audit's EffectsRecorder (None: no audit)
        self.reading = False  # inside a recorded relay read (its wrappers nest)

    def install(self) -> None:
        s, state = self.s, self.state
        owner, boundary = state.family.boundary(s)
        real_ingest = getattr(owner, boundary)
        real_process = s.process_batch_result
        on_step_boundary, launches = self.on_step_boundary, self.launches

        def ingest_requests(*args, **kwargs):
            on_step_boundary()
            return real_ingest(*args, **kwargs)

        def process_batch_result(batch, result, *args, **kwargs):
            launches.on_processed(batch, result)
            return real_process(batch, result, *args, **kwargs)

        setattr(owner, boundary, ingest_requests)
        self._install_abort_output_hook()
        state.family.watch_admissions(s, lambda req: state.reqs.setdefault(req.rid, req))
        if not state.capture:
            return  # feed and stop only: the baseline for the capture overhead
        s.process_batch_result = process_batch_result
        self._install_row_write_hook()
        self._install_relay_hooks()
        if self.effects is not None:
            self.effects.install(s)
        if state.mlx:
            self._install_mlx_launch_hooks()
        state.family.install_hooks(self)
        self.snapshot.watch_backend()
        EvictionRecorder(s, lambda: state.step,
                         lambda row: state.emit_rows([("evictions", row)]))
        self.snapshot.find_invariant_checker()
        self.snapshot.find_idle_arguments()

    def _install_abort_output_hook(self) -> None:
        """Record every ``AbortReq`` SGLang sends back for a request (each caller ends
        the request); a request aborted while queued has no other trace of its end."""
        from sglang.srt.managers.io_struct import AbortReq

        sender = self.s.ipc_channels.send_to_tokenizer
        real_send = sender.send_output

        def send_output(output, *args, **kwargs):
            if isinstance(output, AbortReq) and output.rid:
                self.state.abort_outputs.setdefault(
                    output.rid, dict(output.finished_reason or {"type": "abort"}))
            return real_send(output, *args, **kwargs)

        sender.send_output = send_output

    def install_prebuilt_hook(self) -> None:
        """The decode side's prebuilt batch (``get_new_prebuilt_batch``, instance): the
        requests it admits without a forward, recorded once it is built and its relay
        stashed (``process_prebuilt``), before the first decode reads it."""
        real_prebuilt = self.s.get_new_prebuilt_batch

        def get_new_prebuilt_batch(*args, **kwargs):
            batch = real_prebuilt(*args, **kwargs)
            if batch is not None:
                self.launches.on_prebuilt(batch)
            return batch

        self.s.get_new_prebuilt_batch = get_new_prebuilt_batch

    def install_omni_resolve_hook(self) -> None:
        """Pair each lookahead launch with its resolve (``resolve_and_process``), in
        launch order: a launch whose requests all finished in an earlier step (the
        lookahead overrun) is resolved and dropped without ``process_batch_result``, so
        pairing processed batches with launches by order alone would shift by one."""
        real_resolve, state = self.s.resolve_and_process, self.state

        def resolve_and_process(*args, **kwargs):
            state.resolving = state.unprocessed.popleft() if state.unprocessed else None
            try:
                return real_resolve(*args, **kwargs)
            finally:
                state.resolving = None

        self.s.resolve_and_process = resolve_and_process

    def _install_relay_hooks(self) -> None:
        from sglang.srt.managers import overlap_utils, scheduler as scheduler_module

        future_map = self.s.future_map
        future_map.output_tokens_buf.fill_(-1)  # poison: an unwritten row reads -1
        # The defining module's binding (what omni's execution bridge, or a reader moved
        # elsewhere, e.g. onto FutureMap, calls through) and each calling loop's own.
        callers = [overlap_utils, scheduler_module]
        if self.state.mlx:
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
            self.launches.on_relay_write(indices, kind)
            return out

        return write

    def _relay_reader(self, real_resolve):
        """``resolve_forward_inputs`` as one module calls it, its reads recorded with
        what they fed the batch."""

        def resolve_forward_inputs(batch, fmap):
            if self.reading:  # called through another wrapped binding: recorded there
                return real_resolve(batch, fmap)
            lanes = self.launches.relay_lanes(batch, fmap)
            self.reading = True
            try:
                out = real_resolve(batch, fmap)
            finally:
                self.reading = False
            if lanes is not None:
                self.launches.on_relay_read(batch, fmap, lanes)
            return out

        return resolve_forward_inputs

    def _install_row_write_hook(self) -> None:
        """Wrap ``write`` on the class that defines it (not the instance), before the
        effects recorder wraps the same class: its hook then still sees SGLang's caller."""
        pool, row_writes = self.s.req_to_token_pool, self.row_writes
        owner = next(c for c in type(pool).__mro__ if "write" in vars(c))
        real_write = owner.write

        def write(obj, indices, values, *args, **kwargs):
            out = real_write(obj, indices, values, *args, **kwargs)
            if obj is pool:
                row_writes.on_write(indices)
            return out

        owner.write = write

    def _install_mlx_launch_hooks(self) -> None:
        worker = self.s.tp_worker
        real_fresh = worker.async_forward_batch_generation_mlx
        real_chained = worker.async_chained_decode_mlx
        real_finalize = worker.finalize_mlx_result

        def async_forward_batch_generation_mlx(batch):
            launch = real_fresh(batch)
            self.launches.on_mlx_launch(launch, batch, chained=False)
            return launch

        def async_chained_decode_mlx(prev_pending):
            launch = real_chained(prev_pending)
            self.launches.on_mlx_launch(launch, None, chained=True)
            return launch

        def finalize_mlx_result(*args):
            return self.launches.finalize_mlx(real_finalize, args)

        self._install_mlx_produced_hooks(getattr(worker, "_mlx_runner", None))
        worker.async_forward_batch_generation_mlx = async_forward_batch_generation_mlx
        worker.async_chained_decode_mlx = async_chained_decode_mlx
        worker.finalize_mlx_result = finalize_mlx_result

    def _install_mlx_produced_hooks(self, runner) -> None:
        """Note each token the MLX runner's finalize calls return, by request id
        (:meth:`LaunchRecorder.note_produced`): what the model produced, whatever the
        worker makes of it. A release whose runner lacks one of them leaves its lanes
        unrecorded."""
        def noting(real, rids_of):
            def finalize(pending, *args, **kwargs):
                tokens = real(pending, *args, **kwargs)
                rids = rids_of(pending)
                values = list(tokens) if hasattr(tokens, "__len__") else [tokens]
                if len(values) == len(rids):
                    self.launches.note_produced(rids, list(map(int, values)))
                return tokens
            return finalize

        for name, rids_of in (("decode_batch_finalize", lambda pending: pending.req_ids),
                              ("prefill_finalize", lambda pending: [pending.req_id]),
                              ("extend_finalize", lambda pending: [pending.req_id])):
            real = getattr(runner, name, None)
            if real is not None:
                setattr(runner, name, noting(real, rids_of))
