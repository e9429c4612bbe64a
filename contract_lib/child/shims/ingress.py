"""Request ingress: SGLang's zmq receiver becomes a scripted one, fed real
``TokenizedGenerateReqInput`` objects at chosen loop iterations."""

from __future__ import annotations

import array
from typing import Any

from contract_lib.child.shims.model import VOCAB_SIZE
from contract_lib.workloads import RequestSpec


class ScriptedReceiver:
    """Stands in for ``scheduler.request_receiver``: hands out scripted requests.

    Why: the real receiver reads zmq sockets fed by a tokenizer process that does not
    exist here, and ``SchedulerRequestReceiver`` is a frozen slots dataclass whose method
    cannot be patched, so the attribute is replaced whole. What it returns goes through
    SGLang's real ``ingest_requests`` → ``process_input_requests`` →
    ``handle_generate_request``.
    """

    def __init__(self) -> None:
        self.pending: list[Any] = []

    def recv_requests(self, local_reqs=None) -> list[Any]:
        out = list(local_reqs or []) + self.pending
        self.pending = []
        return out


def tokenized_request(spec: RequestSpec, prompt: list[int], **bootstrap: Any):
    """A real ``TokenizedGenerateReqInput``, greedy, with the request's stop tokens,
    ``ignore_eos`` and priority, as the tokenizer manager would send it; ``bootstrap``:
    the PD router's ``bootstrap_host`` and ``bootstrap_room`` (disaggregation loops)."""
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(**spec.sampling())
    params.normalize(None)
    params.verify(VOCAB_SIZE)
    return TokenizedGenerateReqInput(
        rid=spec.rid, input_text=None, input_ids=array.array("q", prompt),
        input_embeds=None, mm_inputs=None, token_type_ids=None, sampling_params=params,
        return_logprob=False, logprob_start_len=-1, top_logprobs_num=0,
        token_ids_logprob=None, stream=False, priority=spec.priority, **bootstrap)


def abort_request(rid: str):
    """SGLang's own ``AbortReq`` for one request, as the tokenizer manager sends it when
    a client aborts; it goes through the same ingress (``process_input_requests`` →
    ``abort_request``)."""
    from sglang.srt.managers.io_struct import AbortReq

    return AbortReq(rid=rid)
