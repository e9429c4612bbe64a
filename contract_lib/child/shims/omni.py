"""sglang-omni's ``OmniScheduler`` (loop ``omni``; built by :mod:`contract_lib.child.omni_build`): its
platform gates, its model boundary and its ingress."""

from __future__ import annotations

import os
from typing import Any, Callable
from unittest import mock

from contract_lib.child.shims.model import VOCAB_SIZE
from contract_lib.child.shims.torch_forward import (
    bookkeeping_runner,
    model_free_result,
    model_free_tokens,
)

OMNI_PLATFORM_SPEC_ENV = "SGLANG_OMNI_PLATFORM_SPEC"
OMNI_CPU_PLATFORM = "sglang_omni.platforms.cpu.CPUOmniPlatform"


def install_omni_platform() -> list[str]:
    """Select sglang-omni's own CPU platform (before ``sglang_omni`` is imported).

    Why: sglang-omni derives its platform from SGLang's (``sglang_omni/platforms``,
    ``resolve_platform``). On Linux without CUDA SGLang's is the base ``SRTPlatform``
    (SGLang picks its CPU platform only with ``SGLANG_USE_CPU_ENGINE=1``, which would
    also switch SGLang itself to its CPU engine, unlike the torch loops), whose
    ``get_device`` raises ``NotImplementedError``; sglang-omni's ``ModelRunner.__init__``
    calls it. sglang-omni's own override variable selects its ``CPUOmniPlatform`` and
    leaves SGLang's platform as the torch loops have it. Not applied where SGLang
    resolved a real platform (CUDA, MPS, ...) or the variable is already set.
    """
    from sglang.srt import platforms
    from sglang.srt.platforms.interface import SRTPlatform

    if (os.environ.get(OMNI_PLATFORM_SPEC_ENV)
            or type(platforms.current_platform) is not SRTPlatform):
        return []
    os.environ[OMNI_PLATFORM_SPEC_ENV] = OMNI_CPU_PLATFORM
    return ["omni-cpu-platform"]


def install_omni_unpinned_staging() -> list[str]:
    """Host staging buffers without pinned memory where the platform has none.

    Why: ``ModelRunner.pinned_pingpong`` (sglang-omni) allocates the lookahead's host
    staging buffers with ``pin_memory=True`` unconditionally, and torch refuses pinned
    memory without an accelerator ("pin_memory=True requires a CUDA or other accelerator
    backend"). Where sglang-omni's platform reports no pinned memory, the allocation
    inside that method is made unpinned: same shape, dtype and ping-pong; a copy into it
    is then synchronous, which a CPU forward is anyway. Not applied where pinned memory
    is available.
    """
    import torch
    from sglang_omni.model_runner import base
    from sglang_omni.platforms import current_platform

    if current_platform.is_pin_memory_available():
        return []
    real_empty, real_pingpong = torch.empty, base.ModelRunner.pinned_pingpong

    def unpinned_empty(*args, pin_memory: bool = False, **kwargs):
        return real_empty(*args, **kwargs)

    def pinned_pingpong(self, *args, **kwargs):
        with mock.patch.object(base.torch, "empty", unpinned_empty):
            return real_pingpong(self, *args, **kwargs)

    base.ModelRunner.pinned_pingpong = pinned_pingpong
    return ["omni-unpinned-staging"]


def install_omni_model_free_worker() -> None:
    """sglang-omni's ``ModelWorker`` builds SGLang's bookkeeping-only runner.

    Why: its ``init_model_runner`` builds ``SGLModelRunner`` (sglang-omni's subclass of
    SGLang's full ``ModelRunner``), which loads weights and sizes a KV cache from free
    device memory. :func:`bookkeeping_runner` is what the torch loops use: SGLang's real
    pools, no weights. The rest of ``ModelWorker.__init__`` (model config, parallel
    runtime, seed) and of ``create_sglang_infrastructure`` (tree cache) is sglang-omni's.
    """
    from sglang_omni.model_runner.model_worker import ModelWorker

    def init_model_runner(self) -> None:
        self.model_runner = bookkeeping_runner(self, is_draft_worker=False)

    ModelWorker.init_model_runner = init_model_runner


def install_omni_model_free_runner(on_launch: Callable[[Any, list[int]], None]) -> None:
    """sglang-omni's plain-LM ``ModelRunner`` with the model forward replaced.

    Why: ``ModelRunner.prepare_and_forward`` calls the model through
    ``custom_prefill_forward`` / ``custom_decode_forward`` (sglang-omni's hooks for a
    model-specific forward; None means ``tp_worker.forward_batch_generation``, the
    weights and the sampler). Returning :func:`model_free_result` there replaces the
    forward and the sampling, as on the torch loops. ``build_forward_batch`` keeps its
    ``(forward_batch, schedule_batch, is_prefill)`` contract with no ``ForwardBatch``
    (a value sglang-omni's hooks accept): ``ForwardBatch.init_new`` is the model's input
    (attention backend, KV index translator), which the torch loops' replaced
    ``TpModelWorker.forward_batch_generation`` builds inside the forward too, and which
    the bookkeeping runner has none of. Input resolution through the FutureMap (the
    execution bridge around it), the token publish, the lookahead launch/resolve and
    ``finalize`` stay sglang-omni's. ``on_launch`` gets the live ``ScheduleBatch``
    (stamped by ``stamp_batch_launch``) and the tokens.
    """
    from sglang_omni.model_runner.base import ModelRunner

    def build_forward_batch(self, scheduler_output):
        batch = scheduler_output.batch_data
        if batch is None:
            return None
        return None, batch, bool(batch.forward_mode.is_extend())

    def model_free_forward(self, forward_batch, schedule_batch, requests):
        tokens = model_free_tokens(schedule_batch)
        on_launch(schedule_batch, tokens)
        return model_free_result(tokens)

    ModelRunner.build_forward_batch = build_forward_batch
    ModelRunner.custom_prefill_forward = model_free_forward
    ModelRunner.custom_decode_forward = model_free_forward


def omni_request_message(rid: str, prompt: list[int], sampling: dict[str, Any]):
    """A ``new_request`` for the scheduler's inbox, as a pipeline stage would put it.

    Why: sglang-omni's ingress is ``OmniScheduler.inbox``, fed by a pipeline ``Stage``
    that does not exist here. The payload carries the prompt token ids and the
    ``SamplingParams`` arguments (:meth:`RequestSpec.sampling`); what it goes
    through (``recv_requests`` → ``process_input_requests`` → the request builder →
    ``enqueue_built_request``) is sglang-omni's.
    """
    from sglang_omni.proto.request import OmniRequest, StagePayload
    from sglang_omni.scheduling.message import IncomingMessage

    payload = StagePayload(request_id=rid, request=OmniRequest(
        inputs=list(prompt), params=dict(sampling)), data=None)
    return IncomingMessage(request_id=rid, type="new_request", data=payload)


def omni_request_builder(payload, eos_token_ids=None):
    """The request builder: a greedy SGLang ``Req`` over the payload's token ids.

    Why: every sglang-omni model ships its own builder (tokenizer, chat template,
    multimodal inputs); this is the plain-LM one, written as sglang-omni's own builders
    write theirs (``models/nemotron_voicechat/request_builders.ar_request``), with the
    sampling parameters the torch loops' scripted requests carry and the model's EOS
    ids (``eos_token_ids``, bound by :func:`contract_lib.child.omni_build.build_scheduler`), which
    SGLang's scheduler gives every request it builds.
    """
    import torch
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang_omni.scheduling.sglang_backend import SGLangARRequestData

    prompt = list(payload.request.inputs)
    max_new_tokens = int(payload.request.params["max_new_tokens"])
    params = SamplingParams(**payload.request.params)
    params.normalize(None)
    params.verify(VOCAB_SIZE)
    req = Req(rid=payload.request_id, origin_input_text="", origin_input_ids=prompt,
              sampling_params=params, vocab_size=VOCAB_SIZE, eos_token_ids=eos_token_ids)
    return SGLangARRequestData(req=req, input_ids=torch.tensor(prompt, dtype=torch.long),
                               stage_payload=payload, max_new_tokens=max_new_tokens,
                               temperature=0.0)


def omni_result_adapter(data):
    """The result a finished request hands to the next stage (none here): its data."""
    return data
