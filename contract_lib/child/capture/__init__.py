"""Observation hooks inside the child process: they record SGLang's state and call through.

Nothing here changes what SGLang computes. Each hook wraps one SGLang call site,
records, and calls the original:

- ``Scheduler.ingest_requests`` (instance; <= 0.5.19 the scripted
  ``request_receiver.recv_requests``, :func:`contract_lib.sources.compat.step_boundary`): the step
  boundary; also where scripted requests are fed in and where the run is stopped.
- ``Scheduler._add_request_to_queue`` (instance): keeps a registry of every ``Req``.
- ``Scheduler.process_batch_result`` (instance): completes the launch record.
- ``ipc_channels.send_to_tokenizer.send_output`` (instance): the ``AbortReq`` outputs by
  which SGLang ends a request outside the output stream (an abort while it is queued
  pops it without setting ``finished_reason``); recorded as that request's finish.
- ``resolve_forward_inputs`` (the binding in ``overlap_utils``, which defines it, in
  ``scheduler`` and in the MLX mixin, each wrapped as it is, so a patch that rebound
  it still runs; a read passing through several is recorded once): relay reads;
  ``FutureMap.stash`` / ``stash_bonus_tokens`` (instance): relay writes.
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
- The KV allocator's ``evict_to_free_tokens`` and the radix tree's ``evict_for_alloc`` /
  ``evict`` (instance): what each eviction needed, asked and took (table ``evictions``).

On sglang-omni's ``OmniScheduler`` (loop ``omni``, :mod:`contract_lib.child.omni_build`) the step
boundary is ``recv_requests`` (the first call of its loop iteration after the admin
queue), scripted requests go into its ``inbox``, the registry wraps its
``request_builder`` (it appends to ``waiting_queue`` itself, not through
``_add_request_to_queue``), and its model-free forward calls
:meth:`Recorder.on_torch_launch`. Its in-flight work is its one-step lookahead
(``async_pending``): ``steps.enable_overlap`` and ``result_queue_len`` record it there.

Modules: :mod:`.recorder` (the step boundary, feed and stop), built from parts over
:mod:`.state` (the run's shared state, declared): :mod:`.hooks` (installing the hooks),
:mod:`.launches` (launch and relay rows), :mod:`.row_writes` (who wrote each
``req_to_token`` entry) and :mod:`.snapshot` (the step-boundary frame);
:mod:`.backend_state` (clause 7's table); :mod:`.evictions` (the allocator's evictions);
:mod:`.batches` (helpers reading SGLang's batches and allocator).
"""

from contract_lib.lazy import lazy_getattr

# Each name's module, imported on first use (PEP 562): the process that asked for a run
# reads frames, and its one use of this package (``kvpool``'s free-slot mask) needs
# numpy, not the hooks and the shims they pull in (``unittest.mock``, asyncio).
_MODULE_OF = {
    "BackendStateRecorder": "backend_state",
    "free_slot_mask": "batches",
    "NumpyView": "batches",
    "Recorder": "recorder",
    "RunState": "state",
    "StepBudgetExceeded": "recorder",
    "StopRun": "recorder",
}
__all__ = sorted(_MODULE_OF)
__getattr__ = lazy_getattr(__name__, _MODULE_OF, globals())
