"""PD disaggregation on SGLang's fake transfer backend: what its loops need on a
model-free CPU run, each with its reason (SGLang 0.5.23 file:line).

SGLang ships a fake KV transfer backend (``disaggregation_transfer_backend="fake"``,
``srt/disaggregation/fake/conn.py``) for warm-up: a transfer completes at once and
moves no KV. On it the four disaggregation loops run on the real ``Scheduler`` with
the torch loops' bookkeeping runner (:mod:`.torch_forward`), once these gaps are filled:

- **The zero-byte KV cache and the bookkeeping runner** (:func:`_complete_bookkeeping_runner`):
  the transfer set-up reads attributes SGLang's ``MlxModelRunnerStub`` and its
  ``_DummyKVCache`` do not define (model boundary: no weights, no KV buffers).
- **The remote prefill's model** (:func:`_handoff_from_the_model`): the decode side's
  first token is the prefill instance's sample. The fake backend, having no model,
  makes it a hash of the request id (``_generate_fake_prefill_handoff_output_id``,
  ``disaggregation/decode.py:2514``); here it is the fake model's first token, so the
  decode side emits what ``event_loop_normal`` emits.
- **A platform gate** (:func:`_device_neutral_early_send_event`): overlap prefill
  creates ``torch.cuda.Event()`` (``disaggregation/prefill.py:1496``).
- **One SGLang validation replaced** (:data:`VALIDATION_EXCEPTION`): prefill refuses the
  fake backend (``arg_groups/pd_disaggregation_hook.py:146``). The only exception of
  its kind in this project: it lifts a check SGLang makes, it is not a platform gate.

Requests reach these loops as a PD router sends them, with a bootstrap host and room
(:func:`bootstrap_fields`).
"""

from __future__ import annotations

from typing import Any

from contract_lib.child.shims.model import next_token, scripted_token
from contract_lib.patches.source import patch_source

PREFILL, DECODE = "prefill", "decode"

# The host a prefill-side request carries: any real host string. The fake backend's
# sender moves nothing whatever the host, and a real host keeps SGLang's radix cache
# on (``FAKE_BOOTSTRAP_HOST`` sets ``skip_radix_cache_insert``, schedule_batch.py:1404).
PREFILL_BOOTSTRAP_HOST = "127.0.0.1"

# Decode tokens reserved per admitted request (``disaggregation_server_args``).
RESERVED_DECODE_TOKENS = 8

# The exception to "replace no SGLang validation", declared once, with its reason.
VALIDATION_EXCEPTION = (
    "arg_groups/pd_disaggregation_hook.py:146 asserts that a prefill server does not "
    "use the 'fake' transfer backend. A prefill Scheduler builds its backend's KV "
    "manager at init (disaggregation/prefill.py:358-364); the real backends need their "
    "transfer engine (mooncake's imports mooncake.engine, "
    "distributed/device_communicators/mooncake_transfer_engine.py:120), which cannot "
    "be installed here, so without this exception no prefill loop can be built. The "
    "assertion guards deployments (a fake prefill sends no KV to any decode peer); "
    "it is not part of the per-step bookkeeping the contract checks, and the "
    "sender the prefill loop polls is SGLang's own FakeKVSender.")


def install_disaggregation_shims(mode: str) -> list[str]:
    """Fill the gaps of a ``mode`` (``prefill`` or ``decode``) disaggregation run on the
    fake backend; returns the names applied (the run's meta ``shims``)."""
    if mode not in (PREFILL, DECODE):
        raise ValueError(f"disaggregation mode must be {PREFILL!r} or {DECODE!r}, not {mode!r}")
    applied = [_complete_bookkeeping_runner()]
    if mode == PREFILL:
        applied += [_accept_fake_backend_on_prefill(), _device_neutral_early_send_event()]
    else:
        applied.append(_handoff_from_the_model())
    return applied


def disaggregation_server_args(mode: str) -> dict[str, Any]:
    """The server args of a ``mode`` run, under the workload's and the caller's: the
    role, the fake backend, and ``num_reserved_decode_tokens`` sized for the shipped
    workloads' pools (128 to 2048 slots). SGLang's default, 512, is added to every
    request's preallocation on the decode side (``disaggregation/decode.py:604``): on
    a 128-slot pool no request is ever admitted, on 2048 at most three at a time."""
    return {"disaggregation_mode": mode, "disaggregation_transfer_backend": "fake",
            "num_reserved_decode_tokens": RESERVED_DECODE_TOKENS}


def bootstrap_fields(mode: str, room: int) -> dict[str, Any]:
    """The bootstrap fields a PD router gives a request (``TokenizedGenerateReqInput``).

    Decode: SGLang's ``FAKE_BOOTSTRAP_HOST`` (as its warm-up requests,
    ``entrypoints/warmup.py:97-99``), which routes the request through the fake
    receiver (``_is_fake_transfer``, ``disaggregation/utils.py:238``); without a host the
    decode side crashes building the peer address (``utils/network.py:548`` via
    ``disaggregation/decode.py:155``). Prefill: a real host string (see
    :data:`PREFILL_BOOTSTRAP_HOST`). The room pairs the two sides' requests."""
    if mode == DECODE:
        from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

        return {"bootstrap_host": FAKE_BOOTSTRAP_HOST, "bootstrap_room": room}
    return {"bootstrap_host": PREFILL_BOOTSTRAP_HOST, "bootstrap_room": room}


def _complete_bookkeeping_runner() -> str:
    """What the transfer set-up reads off the runner and its KV cache, answered for a
    cache with no buffers:

    - ``model_runner.kv_cache_dtype_str`` (``disaggregation/decode.py:618``,
      ``prefill.py:268``): the server's ``kv_cache_dtype``, as a real runner's pool
      configurator sets it (``model_executor/pool_configurator.py:226``);
    - ``token_to_kv_pool.head_num`` (``prefill.py:337``): the model's KV heads;
    - ``get_contiguous_buf_infos()`` (``disaggregation/utils.py:1459``): no buffers,
      three empty lists;
    - ``get_cpu_copy`` / ``load_cpu_copy`` (decode retraction backs up and restores a
      request's KV, ``schedule_batch.py:2381``; ``mem_cache/memory_pool.py:2154``
      raises): nothing to copy, nothing to load."""
    from sglang.srt.hardware_backend.mlx.model_runner_stub import (
        MlxModelRunnerStub,
        _DummyKVCache,
    )
    from sglang.srt.runtime_context import get_parallel

    real_initialize = MlxModelRunnerStub.initialize

    def initialize(self, *args, **kwargs):
        out = real_initialize(self, *args, **kwargs)
        self.kv_cache_dtype_str = self.server_args.kv_cache_dtype
        self.token_to_kv_pool.head_num = self.model_config.get_num_kv_heads(
            get_parallel().attn_tp_size)  # as model_executor/pool_configurator.py:438
        return out

    MlxModelRunnerStub.initialize = initialize
    _DummyKVCache.get_contiguous_buf_infos = lambda self: ([], [], [])
    _DummyKVCache.get_cpu_copy = lambda self, indices, *args, **kwargs: []
    _DummyKVCache.load_cpu_copy = lambda self, kv_cache_cpu, indices, *args, **kwargs: None
    return "disagg-zero-byte-kv-transfer"


def _handoff_from_the_model() -> str:
    """The decode side's first token (the prefill instance's sample, committed when the
    transfer lands, ``disaggregation/decode.py:2694``) is the fake model's first token
    for the request: the same function every loop's forward computes, the workload's
    scripted token where it has one."""
    from sglang.srt.disaggregation import decode

    def _generate_fake_prefill_handoff_output_id(req) -> int:
        prompt = req.origin_input_ids
        token = scripted_token(req.rid, len(prompt), len(prompt))
        return next_token(prompt[-1], len(prompt)) if token is None else token

    decode._generate_fake_prefill_handoff_output_id = _generate_fake_prefill_handoff_output_id
    return "disagg-handoff-token-from-the-model"


def _accept_fake_backend_on_prefill() -> str:
    """:data:`VALIDATION_EXCEPTION`: the assertion, and only it, is removed from
    ``handle_pd_disaggregation`` (a loud failure if its text moved)."""
    from sglang.srt.arg_groups import pd_disaggregation_hook

    patch_source(pd_disaggregation_hook, "handle_pd_disaggregation", [(
        'assert cfg.disaggregation_transfer_backend != "fake", (\n'
        '    "Prefill server does not support \'fake\' as the transfer backend"\n'
        ')\n',
        "pass  # contract_lib: VALIDATION_EXCEPTION (shims/disaggregation.py)\n")],
        "disagg-fake-backend-on-prefill")
    return "disagg-fake-backend-on-prefill (validation exception)"


def _device_neutral_early_send_event() -> str:
    """Overlap prefill's early send of a cached prefix records ``torch.cuda.Event()``
    (``disaggregation/prefill.py:1496``), which a CPU build cannot create: the
    scheduler's own device module makes the same event on any device."""
    from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin

    patch_source(SchedulerDisaggregationPrefillMixin, "maybe_send_cached_prefix_chunk", [(
        "ev = torch.cuda.Event()\n", "ev = self.device_module.Event()\n")],
        "disagg-early-send-event")
    return "disagg-early-send-event (platform gate)"
