"""The model boundary of the torch loops: SGLang's bookkeeping-only runner, and the fake
model as the forward (:func:`install_torch_model_free_forward`)."""

from __future__ import annotations

from typing import Any, Callable

from contract_lib.shims.model import next_token



def install_torch_model_free_forward(on_launch: Callable[[Any, list[int]], None]) -> None:
    """Torch loops: SGLang's bookkeeping-only runner, and a next-token function as forward.

    Why: there are no weights to load. ``TpModelWorker._init_model_runner`` builds
    SGLang's own ``MlxModelRunnerStub``, which creates the real ``ReqToTokenPool`` and
    ``TokenToKVPoolAllocator`` over a zero-byte KV cache and loads nothing. The forward
    reads the real resolved ``batch.input_ids`` (decode: one id per request, relayed
    through the FutureMap; extend: each request's segment) and ``batch.seq_lens``.
    ``on_launch(batch, tokens)`` is the capture hook, called at every forward launch.
    """
    from sglang.srt.managers.tp_worker import TpModelWorker

    def _init_model_runner(self) -> None:
        self._model_runner = bookkeeping_runner(
            self, is_draft_worker=self.is_draft_worker,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
            memory_pool_config=self.memory_pool_config)

    def forward_batch_generation(self, batch, *args, **kwargs):
        tokens = model_free_tokens(batch)
        on_launch(batch, tokens)
        return model_free_result(tokens)

    TpModelWorker._init_model_runner = _init_model_runner
    TpModelWorker.forward_batch_generation = forward_batch_generation


def bookkeeping_runner(worker, **kwargs: Any):
    """SGLang's ``MlxModelRunnerStub`` for ``worker``: the real ``ReqToTokenPool`` and
    ``TokenToKVPoolAllocator`` over a zero-byte KV cache, no weights loaded; its pool
    holds ``max_total_tokens`` slots (``BASE_SERVER_ARGS``)."""
    from sglang.srt.hardware_backend.mlx.model_runner_stub import MlxModelRunnerStub
    from sglang.srt.runtime_context import get_schedule

    return MlxModelRunnerStub(
        model_config=worker.model_config,
        mem_fraction_static=get_schedule().mem_fraction_static,
        gpu_id=worker.gpu_id, nccl_port=worker.nccl_port, server_args=worker.server_args,
        mlx_pool_size=get_schedule().max_total_tokens, **kwargs)


def model_free_tokens(batch) -> list[int]:
    """:func:`next_token` for every request of a launched batch, from the batch's real
    resolved ``input_ids`` (decode: one id per request, relayed through the FutureMap;
    extend: each request's segment) and ``seq_lens``."""
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
    return [next_token(t, n) for t, n in zip(last_ids, seq_lens)]


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

