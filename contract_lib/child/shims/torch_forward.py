"""The model boundary of the torch loops: SGLang's bookkeeping-only runner, and the fake
model as the forward (:func:`install_torch_model_free_forward`)."""

from __future__ import annotations

from typing import Any, Callable

from contract_lib.child.shims.model import next_token, scripted_token


def install_torch_model_free_forward(on_launch: Callable[[Any, list[int]], None]) -> None:
    """Torch loops: SGLang's bookkeeping-only runner, and a next-token function as forward.

    Why: there are no weights to load. ``TpModelWorker._init_model_runner`` runs as the
    release wrote it, except that the ``ModelRunner`` it builds is SGLang's own
    ``MlxModelRunnerStub`` (with the same arguments), which creates the real
    ``ReqToTokenPool`` and ``TokenToKVPoolAllocator`` over a zero-byte KV cache and loads
    nothing. The forward reads the real resolved ``batch.input_ids`` (decode: one id per
    request, relayed through the FutureMap; extend: each request's segment) and
    ``batch.seq_lens``. ``on_launch(batch, tokens)`` is the capture hook, called at every
    forward launch.
    """
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.model_executor import model_runner

    real_init = TpModelWorker._init_model_runner

    def _init_model_runner(self) -> None:
        real_class = model_runner.ModelRunner
        model_runner.ModelRunner = stub_runner
        try:
            real_init(self)
        finally:
            model_runner.ModelRunner = real_class

    def forward_batch_generation(self, batch, *args, **kwargs):
        tokens = model_free_tokens(batch)
        on_launch(batch, tokens)
        return model_free_result(tokens)

    TpModelWorker._init_model_runner = _init_model_runner
    TpModelWorker.forward_batch_generation = forward_batch_generation


def bookkeeping_runner(worker, **kwargs: Any):
    """:func:`stub_runner` for ``worker`` (a worker that is not a ``TpModelWorker``)."""
    from contract_lib.sources.compat import schedule_args

    return stub_runner(
        model_config=worker.model_config,
        mem_fraction_static=schedule_args(worker.server_args).mem_fraction_static,
        gpu_id=worker.gpu_id, nccl_port=worker.nccl_port, server_args=worker.server_args,
        **kwargs)


def stub_runner(**kwargs: Any):
    """SGLang's ``MlxModelRunnerStub`` built with a ``ModelRunner``'s arguments: the real
    ``ReqToTokenPool`` and KV allocator over a zero-byte KV cache, no weights loaded;
    its pool holds ``max_total_tokens`` slots (``BASE_SERVER_ARGS``), rounded down to
    whole pages.

    With ``page_size > 1`` the allocator is the paged one SGLang's model runner builds
    for that page size (:func:`use_paged_allocator`): the stub, written for the MLX
    backend, always builds the token-level one, which the scheduler's paged path
    cannot use ("alloc_extend is only for paged allocator" at the first prefill).
    """
    from sglang.srt.hardware_backend.mlx.model_runner_stub import MlxModelRunnerStub

    from contract_lib.sources.compat import schedule_args

    schedule = schedule_args(kwargs["server_args"])
    page_size = int(schedule.page_size or 1)
    # As the model runner's pool configurator: whole pages only.
    pool_size = schedule.max_total_tokens // page_size * page_size
    runner = MlxModelRunnerStub(mlx_pool_size=pool_size, **kwargs)
    if page_size > 1:
        use_paged_allocator(runner, page_size)
    return runner


def use_paged_allocator(runner, page_size: int) -> None:
    """Give ``runner`` the allocator ``KVCacheConfigurator`` builds for a plain
    full-attention model with ``page_size > 1``: the platform's paged allocator class,
    else ``PagedTokenToKVPoolAllocator`` (native kernels where Triton cannot launch),
    over the runner's KV cache, whose page size it takes."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.platforms import current_platform

    try:
        allocator_class = current_platform.get_paged_allocator_cls()
    except NotImplementedError:  # <= 0.5.21: only out-of-tree platforms name one
        allocator_class = None
    kv_cache = runner.token_to_kv_pool
    kv_cache.page_size = page_size
    runner.token_to_kv_pool_allocator = (allocator_class or PagedTokenToKVPoolAllocator)(
        runner.max_total_num_tokens, page_size=page_size, dtype=runner.kv_cache_dtype,
        device="cpu", kvcache=kv_cache, need_sort=False)


def model_free_tokens(batch) -> list[int]:
    """:func:`next_token` for every request of a launched batch, from the batch's real
    resolved ``input_ids`` (decode: one id per request, relayed through the FutureMap;
    extend: each request's segment) and ``seq_lens``; a scripted token (the workload's
    ``emit``) where the request's output position has one."""
    input_ids = batch.input_ids.tolist()
    seq_lens = batch.seq_lens.tolist()
    if batch.forward_mode.is_decode():
        last_ids = input_ids
    else:
        ends, offset = [], 0
        for n in batch.extend_lens:
            offset += n
            ends.append(offset - 1)
        last_ids = [input_ids[e] for e in ends]
        # A mixed batch appends one relayed id per running request after the
        # prefill segments (``resolve_forward_inputs``).
        last_ids += input_ids[offset:]
    return [_scripted_or(next_token(t, n), req, n)
            for req, t, n in zip(batch.reqs, last_ids, seq_lens)]


def _scripted_or(token: int, req, seq_len: int) -> int:
    """``token``, unless the workload scripts another at this output position."""
    scripted = scripted_token(req.rid, seq_len, len(req.origin_input_ids))
    return token if scripted is None else scripted


def model_free_result(tokens: list[int]):
    """The ``GenerationBatchResult`` a forward that sampled ``tokens`` returns."""
    import torch
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.managers.utils import GenerationBatchResult

    return GenerationBatchResult(
        logits_output=LogitsProcessorOutput(next_token_logits=None),
        next_token_ids=torch.tensor(tokens, dtype=torch.int64),
        can_run_cuda_graph=False,
    )

