"""Every replacement this project makes to SGLang, in one place, each with its reason.

Principle: fake the model, never the scheduling logic under test. What is replaced here is
exactly three things (plus the release-compatibility backports of section 5, each an
upstream bug of that release), and nothing else in the package replaces SGLang behaviour:

1. **Platform gates** (import-time and runtime) that stop SGLang's MLX backend, or SGLang
   itself, from loading on a Linux CPU machine. None of them is applied where SGLang's own
   gate passes (Apple Silicon with MPS and Metal).
2. **The model boundary**: the torch forward (``TpModelWorker.forward_batch_generation``)
   and the MLX runner (``MlxModelRunner``) become a deterministic next-token function.
   The MLX replacement returns SGLang's real ``MlxPendingPrefill/Extend/Decode`` holding
   *lazy* ``mlx.core`` arrays, so ``mx.async_eval``, chaining on still-lazy tokens and the
   blocking ``.tolist()`` are real. With ``runner="real"`` the MLX loop keeps SGLang's
   own ``MlxModelRunner`` (a tiny random-weight mlx-lm model, its patched attention and
   its ``MlxAttentionKVPool``) on MLX's CPU backend; only two Metal-only opt-in flags are
   forced off (:func:`install_mlx_real_runner`).
3. **Request ingress**: the zmq receiver becomes a scripted one that hands SGLang real
   ``TokenizedGenerateReqInput`` objects at chosen loop iterations.

The same three, and nothing else, for sglang-omni's ``OmniScheduler`` (loop ``omni``,
section 6): its platform gates (its CPU platform; unpinned host staging), its model (the
``ModelWorker``'s runner and the plain-LM ``ModelRunner``'s forward) and its ingress
(inbox messages and the model's request builder).

The capture hooks in :mod:`contract_lib.capture` only observe (they call through).
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
import types
from typing import Any, Callable
from unittest import mock

from contract_lib.workloads import FIRST_ORDINARY_TOKEN

# The vocabulary of the fake model. Token ids below FIRST_ORDINARY_TOKEN are never
# emitted, which keeps SGLang's EOS (id 2 in the shipped config) and other special ids
# out of the way.
VOCAB_SIZE = 512


def next_token(last_token: int, seq_len: int) -> int:
    """The fake model: the token that follows ``last_token`` in a sequence of ``seq_len``.

    ``seq_len`` counts every token whose KV the step has computed, the input token
    included. It depends only on the request's own history, so every loop emits the
    same tokens when it computes the right positions.
    """
    span = VOCAB_SIZE - FIRST_ORDINARY_TOKEN
    return FIRST_ORDINARY_TOKEN + (last_token * 31 + seq_len * 17 + 7) % span


# The workload's ``emit``: {rid: {output position: token}} (``install_token_script``).
_TOKEN_SCRIPT: dict[str, dict[int, int]] = {}


def install_token_script(script: dict[str, dict[int, int]]) -> None:
    """Make the model-free forwards emit ``script[rid][k]`` as output token ``k`` of
    request ``rid`` (a workload's ``emit``; a stop token or EOS at a chosen position).

    Why: stop-token and EOS finishes need the model to emit a chosen token; this is part
    of the fake model (its "weights"), read by :func:`scripted_token` on every path.
    """
    _TOKEN_SCRIPT.clear()
    _TOKEN_SCRIPT.update({rid: dict(tokens) for rid, tokens in script.items()})


def scripted_token(rid: str, seq_len: int, prompt_len: int) -> int | None:
    """The scripted token of ``rid`` for a step that computes ``seq_len`` positions of a
    request whose prompt is ``prompt_len`` tokens (output position ``seq_len -
    prompt_len``: the input token is the previous output, or the prompt's last), or
    None. A pure function of the request and the position, so every loop (and a
    retracted request's re-prefill) emits the same tokens."""
    return _TOKEN_SCRIPT.get(rid, {}).get(seq_len - prompt_len)


def on_apple_silicon_with_mlx() -> bool:
    """True where SGLang's own MLX gate would pass (then no gate shim is applied)."""
    if sys.platform != "darwin" or platform.machine() != "arm64":
        return False
    try:
        import torch
        import mlx.core as mx
    except ImportError:
        return False
    return bool(torch.backends.mps.is_available() and mx.metal.is_available())


# --------------------------------------------------------------------------------------
# 1. Import-time platform gates (must run before the first ``import sglang``).
# --------------------------------------------------------------------------------------


_IMPORT_SHIMS: list[str] = []  # in effect in this process (inherited by forked runs)


def install_import_shims() -> list[str]:
    """Make ``import sglang.srt.managers.scheduler`` possible on Linux CPU (idempotent).

    Returns the names of the import shims in effect (empty where none is needed).
    """
    if ("triton-standin" not in _IMPORT_SHIMS and importlib.util.find_spec("triton") is None
            and not on_apple_silicon_with_mlx()):  # there sglang/__init__ installs it itself
        _install_sglang_triton_standin()
        _IMPORT_SHIMS.append("triton-standin")
    if ("torchvision-placeholder" not in _IMPORT_SHIMS
            and importlib.util.find_spec("torchvision") is None):
        _install_torchvision_placeholder()
        _IMPORT_SHIMS.append("torchvision-placeholder")
    return list(_IMPORT_SHIMS)


def _install_sglang_triton_standin() -> None:
    """Load SGLang's own Triton stand-in (``sglang/_platform_stubs.py``).

    Why: ``sglang/srt/utils/common.py`` does ``import triton`` unconditionally; real
    triton is ~900 MB and has no use without a GPU. SGLang ships a complete stand-in for
    macOS, but installs it only when ``sys.platform == "darwin"``, the machine is arm64
    and MPS is available. We load that file directly (not through ``sglang/__init__``,
    which would import triton first) and call it with the three gate inputs answering
    "Apple"; its MPS-only patches touch ``torch.mps`` attributes and ``non_blocking``
    copies *to MPS*, neither of which a CPU run uses.
    """
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("sglang is not installed")
    path = f"{list(spec.submodule_search_locations)[0]}/_platform_stubs.py"
    stub_spec = importlib.util.spec_from_file_location("_contract_lib_sglang_platform_stubs", path)
    module = importlib.util.module_from_spec(stub_spec)
    sys.modules[stub_spec.name] = module
    stub_spec.loader.exec_module(module)
    import torch

    with (
        mock.patch.object(module.sys, "platform", "darwin"),
        mock.patch.object(module.platform, "machine", lambda: "arm64"),
        mock.patch.object(torch.backends.mps, "is_available", lambda: True),
    ):
        module.install_platform_stubs()


class _AnyAttribute(types.ModuleType):
    """A module whose every missing attribute is a further placeholder (a class)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        placeholder = type(name, (), {"__getattr__": lambda self, attr: attr})
        setattr(self, name, placeholder)
        return placeholder


class _InterpolationModeMeta(type):
    def __getattr__(cls, name: str) -> str:
        if name.startswith("__"):
            raise AttributeError(name)
        return name


def _install_torchvision_placeholder() -> None:
    """Register an import-only ``torchvision`` placeholder.

    Why: ``managers/scheduler`` → ``schedule_batch`` → ``configs`` → ``nano_nemotron_vl``
    → ``multimodal/internvl_utils`` does ``import torchvision.transforms as T`` at import
    time. PyPI's torchvision wheels are CUDA builds that fail against CPU torch
    (``operator torchvision::nms does not exist``) or replace torch with a 6 GB CUDA
    stack. A text-only scheduler run never calls torchvision. transformers then sees
    torchvision as present, so ``InterpolationMode`` must answer attribute access.
    """
    names = [
        "torchvision",
        "torchvision.transforms",
        "torchvision.transforms.functional",
        "torchvision.transforms.v2",
        "torchvision.transforms.v2.functional",
        "torchvision.io",
        "torchvision.ops",
        "torchvision.models",
        "torchvision.utils",
    ]
    modules = {}
    for name in names:
        module = _AnyAttribute(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
        module.__path__ = []
        module.__version__ = "0.0.0+contract-lib-placeholder"
        modules[name] = module
        sys.modules[name] = module
    mode = _InterpolationModeMeta("InterpolationMode", (), {})
    for name in ("torchvision.transforms", "torchvision.transforms.functional",
                 "torchvision.transforms.v2", "torchvision.transforms.v2.functional"):
        modules[name].InterpolationMode = mode
    for name in names:
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, modules[name])


# --------------------------------------------------------------------------------------
# 2. Runtime platform gates for the MLX loop.
# --------------------------------------------------------------------------------------


def install_mlx_runtime_gate_shim() -> bool:
    """Let ``use_mlx()`` answer True on Linux with ``SGLANG_USE_MLX=1``.

    Why: ``hardware_backend/mlx/runtime._validate_runtime`` demands an MPS device and a
    Metal device; on Linux MLX runs on its CPU backend (``mlx[cpu]``), which is enough
    for the lazy-graph semantics the loop relies on. Returns False (no shim) where the
    real gate passes.
    """
    if on_apple_silicon_with_mlx():
        return False
    from sglang.srt.hardware_backend.mlx import runtime

    runtime._validate_runtime = lambda: None
    runtime.use_mlx.cache_clear()
    return True


def scheduler_class_for(mlx: bool) -> type:
    """SGLang's ``Scheduler``, with the real MLX overlap mixin where the loop needs it.

    Why: ``managers/scheduler.py`` imports ``SchedulerMlxOverlapMixin`` only ``if
    is_mps()`` and otherwise defines an empty placeholder, so on Linux ``Scheduler`` has
    no ``event_loop_overlap_mlx``. The subclass adds the real mixin after the
    placeholder in the MRO; nothing is overridden.
    """
    from sglang.srt.managers.scheduler import Scheduler

    if not mlx or hasattr(Scheduler, "event_loop_overlap_mlx"):
        return Scheduler
    from sglang.srt.hardware_backend.mlx.scheduler_mixin import SchedulerMlxOverlapMixin

    return type("SchedulerWithMlxOverlapMixin", (Scheduler, SchedulerMlxOverlapMixin), {})


# --------------------------------------------------------------------------------------
# 3. The model boundary.
# --------------------------------------------------------------------------------------


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
    KV allocator over a zero-byte KV cache, no weights loaded; its pool holds
    ``max_total_tokens`` slots (``BASE_SERVER_ARGS``), rounded down to whole pages.

    With ``page_size > 1`` the allocator is the paged one SGLang's model runner builds
    for that page size (:func:`use_paged_allocator`): the stub, written for the MLX
    backend, always builds the token-level one, which the scheduler's paged path
    cannot use ("alloc_extend is only for paged allocator" at the first prefill).
    """
    from sglang.srt.hardware_backend.mlx.model_runner_stub import MlxModelRunnerStub
    from sglang.srt.runtime_context import get_schedule

    page_size = int(get_schedule().page_size or 1)
    # As the model runner's pool configurator: whole pages only.
    pool_size = get_schedule().max_total_tokens // page_size * page_size
    runner = MlxModelRunnerStub(
        model_config=worker.model_config,
        mem_fraction_static=get_schedule().mem_fraction_static,
        gpu_id=worker.gpu_id, nccl_port=worker.nccl_port, server_args=worker.server_args,
        mlx_pool_size=pool_size, **kwargs)
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
    return [_scripted_or(next_token(t, n), req, n)
            for req, t, n in zip(batch.reqs, last_ids, seq_lens)]


def _scripted_or(token: int, req, seq_len: int) -> int:
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


class _ModelFreeCache:
    """Per-request stand-in for the MLX contiguous KV cache: only its ``offset``.

    As in the real ``MLXAttentionWrapper.write_token``, the offset advances when a step's
    graph is *built*, not when it is evaluated.
    """

    def __init__(self, offset: int, prompt_len: int) -> None:
        self.offset = offset
        self.prompt_len = prompt_len  # where the request's output starts (the script)


class ModelFreeMlxRunner:
    """Replaces ``hardware_backend.mlx.model_runner.MlxModelRunner`` on the MLX loop.

    Why: the real runner loads an mlx-lm model. This one keeps the runner's own request
    bookkeeping (token lists, cache offsets, row mapping, synced offsets) and computes
    :func:`next_token` as a *lazy* ``mlx.core`` graph; a chained decode builds on the
    previous step's still-lazy tokens, exactly as ``decode_batch_start_chained`` does.
    It exposes the surface ``MlxTpModelWorker`` calls; the worker itself is SGLang's.
    """

    def __init__(self, *, pool_size: int | None = None, disable_radix_cache: bool = False,
                 **_ignored: Any) -> None:
        self._pool_size = pool_size or 2048
        self.disable_radix_cache = disable_radix_cache
        self._req_caches: dict[str, list[_ModelFreeCache]] = {}
        self._req_token_ids: dict[str, list[int]] = {}
        self._req_pool_idx: dict[str, int] = {}
        self._req_synced_offset: dict[str, int] = {}
        self._req_to_token_pool = None

    @property
    def pool_size(self) -> int:
        return self._pool_size

    def init_cache_pools(self, req_to_token_pool) -> None:
        self._req_to_token_pool = req_to_token_pool

    def cache_offset(self, req_id: str) -> int | None:
        """Positions whose KV the runner has computed or queued (graph built)."""
        cache = self._req_caches.get(req_id)
        return cache[0].offset if cache else None

    @staticmethod
    def cache_state_arrays(caches) -> list:
        return []

    @staticmethod
    def collect_logprobs(lazy_logprobs) -> None:
        return None

    def has_request(self, req_id: str) -> bool:
        return req_id in self._req_caches

    def remove_request(self, req_id: str) -> None:
        for table in (self._req_token_ids, self._req_caches, self._req_pool_idx,
                      self._req_synced_offset):
            table.pop(req_id, None)

    def store_auxiliary_state_for_request(self, req_id: str) -> None:
        """No auxiliary (SSM) state in a model-free run."""

    def release_request_row(self, req_id: str, owned_len: int) -> None:
        """As the real runner: the sync would read up to ``owned_len``; forget the row."""
        offset = self.cache_offset(req_id) or 0
        if not self.disable_radix_cache:
            self._req_synced_offset[req_id] = max(
                self._req_synced_offset.get(req_id, 0), min(offset, owned_len))
        self._req_pool_idx.pop(req_id, None)

    @staticmethod
    def _lazy_next(last_tokens, seq_lens: list[int], rids: list[str],
                   prompt_lens: list[int]):
        """:func:`next_token` as a lazy graph over ``last_tokens`` (which may be the
        previous step's still-lazy tokens), with the scripted tokens selected in it."""
        import mlx.core as mx

        span = VOCAB_SIZE - FIRST_ORDINARY_TOKEN
        lens = mx.array(seq_lens, dtype=mx.int32)
        tokens = FIRST_ORDINARY_TOKEN + (last_tokens * 31 + lens * 17 + 7) % span
        scripted = [scripted_token(rid, n, p)
                    for rid, n, p in zip(rids, seq_lens, prompt_lens)]
        if all(t is None for t in scripted):
            return tokens
        return mx.where(mx.array([t is not None for t in scripted]),
                        mx.array([0 if t is None else t for t in scripted], dtype=mx.int32),
                        tokens)

    def prefill_start(self, req_id, new_token_ids, full_token_ids, prefix_slot_ids,
                      new_slot_ids, req_pool_idx, req=None, needs_logits=True,
                      logit_edit_row=None, logprob_spec=None):
        import mlx.core as mx
        from sglang.srt.hardware_backend.mlx.model_runner import MlxPendingPrefill

        full = list(full_token_ids)
        # The scheduler's request: where its output starts (a retracted request's
        # re-prefill carries its earlier output in ``full``).
        prompt_len = len(req.origin_input_ids) if req is not None else len(full)
        token = self._lazy_next(mx.array([full[-1]], dtype=mx.int32), [len(full)],
                                [req_id], [prompt_len])[0]
        return MlxPendingPrefill(
            lazy_token=token, cache=[_ModelFreeCache(len(full), prompt_len)], req_id=req_id,
            full_token_ids=full, req_pool_idx=req_pool_idx,
            synced_offset=len(prefix_slot_ids) + len(new_slot_ids))

    def prefill_finalize(self, pending) -> int:
        token = int(pending.lazy_token.item())
        self._req_token_ids[pending.req_id] = list(pending.full_token_ids) + [token]
        self._req_caches[pending.req_id] = pending.cache
        self._req_pool_idx[pending.req_id] = pending.req_pool_idx
        self._req_synced_offset[pending.req_id] = pending.synced_offset
        return token

    def extend_start(self, req_id, new_token_ids, new_slot_ids, needs_logits=True,
                     logit_edit_row=None, logprob_spec=None):
        import mlx.core as mx
        from sglang.srt.hardware_backend.mlx.model_runner import MlxPendingExtend

        cache = self._req_caches[req_id]
        cache[0].offset += len(new_token_ids)
        token = self._lazy_next(mx.array([new_token_ids[-1]], dtype=mx.int32),
                                [cache[0].offset], [req_id], [cache[0].prompt_len])[0]
        synced = self._req_synced_offset.get(req_id, 0)
        if not self.disable_radix_cache and new_slot_ids:
            synced += len(new_slot_ids)
        return MlxPendingExtend(lazy_token=token, cache=cache, req_id=req_id,
                                new_token_ids=list(new_token_ids), new_synced_offset=synced)

    def extend_finalize(self, pending) -> int:
        token = int(pending.lazy_token.item())
        tokens = self._req_token_ids[pending.req_id]
        if tokens:
            tokens.pop()  # the stale intermediate token, as in the real runner
        tokens.extend(pending.new_token_ids)
        tokens.append(token)
        self._req_synced_offset[pending.req_id] = pending.new_synced_offset
        return token

    def _decode(self, req_ids, caches, last_tokens, edit_rows=None, logprob_spec=None):
        from sglang.srt.hardware_backend.mlx.model_runner import MlxPendingDecode

        for cache in caches:
            cache[0].offset += 1
        tokens = self._lazy_next(last_tokens, [cache[0].offset for cache in caches],
                                 list(req_ids), [cache[0].prompt_len for cache in caches])
        return MlxPendingDecode(lazy_tokens=tokens, req_ids=list(req_ids), caches=caches,
                                logprob_spec=logprob_spec, edit_rows=edit_rows)

    def decode_batch_start(self, req_ids, edit_rows=None, logprob_spec=None,
                           logits_hook=None):
        import mlx.core as mx

        caches = [self._req_caches[rid] for rid in req_ids]
        last = mx.array([self._req_token_ids[rid][-1] for rid in req_ids], dtype=mx.int32)
        return self._decode(req_ids, caches, last, edit_rows, logprob_spec)

    def decode_batch_start_chained(self, prev):
        return self._decode(prev.req_ids, prev.caches, prev.lazy_tokens,
                            prev.edit_rows, prev.logprob_spec)

    def decode_batch_finalize(self, pending) -> list[int]:
        raw = pending.lazy_tokens.tolist()
        tokens = [int(t) for t in (raw if isinstance(raw, list) else [raw])]
        for rid, token in zip(pending.req_ids, tokens):
            self._req_token_ids[rid].append(token)
        return tokens


def install_mlx_real_runner() -> list[str]:
    """MLX loop, ``runner="real"``: keep SGLang's real ``MlxModelRunner`` (mlx-lm model,
    ``patch_model_attention``, ``MlxAttentionKVPool``) on MLX's CPU backend. Returns the
    shims applied (empty where the real gate passes, on Apple Silicon with Metal).

    Why only this: on MLX's CPU backend the runner's default paths need no replacement
    (``mx.fast.rope`` and ``mx.fast.scaled_dot_product_attention`` have CPU kernels;
    ``mx.device_info()`` has no ``max_recommended_working_set_size`` there, so the wired
    limit is skipped). Two opt-in environment flags select Metal-only code and are
    forced off, so a user's environment cannot turn them on in a CPU run:

    - ``SGLANG_MLX_USE_CUSTOM_ROPE``: the AOT Metal RoPE + pool-scatter kernel from
      ``sgl_kernel.metal`` (``hardware_backend/mlx/aot.py``), which has no CPU build;
    - ``SGLANG_MLX_FUSE_SWIGLU``: patches SwiGLU blocks with an ``mx.fast.metal_kernel``
      (``moe/fused_swiglu.py``), which raises "No Metal back-end" on CPU.

    The runner's pool is sized from ``max_total_tokens`` (``BASE_SERVER_ARGS``), as the
    CPU backend reports no memory to auto-size it from.
    """
    if on_apple_silicon_with_mlx():
        return []
    for flag in ("SGLANG_MLX_USE_CUSTOM_ROPE", "SGLANG_MLX_FUSE_SWIGLU"):
        os.environ[flag] = "0"
    return ["mlx-metal-only-flags-off"]


def install_mlx_model_free_runner() -> None:
    """MLX loop: ``MlxTpModelWorker`` builds :class:`ModelFreeMlxRunner` as its runner.

    Why: ``MlxTpModelWorker._init_model_runner`` does ``from ...model_runner import
    MlxModelRunner`` at call time, so replacing the module attribute is enough; the
    worker, its stub runner and every pool stay SGLang's own.
    """
    from sglang.srt.hardware_backend.mlx import model_runner

    model_runner.MlxModelRunner = ModelFreeMlxRunner


# --------------------------------------------------------------------------------------
# 4. Request ingress.
# --------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------
# 5. Release compatibility (SGLang 0.5.21).
# --------------------------------------------------------------------------------------
#
# Applied by feature, not by version string: each backport is installed only where the
# running release lacks what it adds, and the names applied are recorded in the run's
# ``shims``. 0.5.22 and 0.5.23 need none.


def install_release_compat() -> list[str]:
    """Backports the running SGLang release needs to start a run; returns their names."""
    applied = []
    if _backport_stub_logical_max_total_num_tokens():
        applied.append("backport-stub-logical-max-total-num-tokens")
    from sglang.srt.hardware_backend.mlx import model_runner

    if hasattr(model_runner.MlxModelRunner, "flush_all_decode_kv"):
        install_model_free_flush()  # the worker of this release calls it (0.5.21)
        applied.append("model-free-flush-all-decode-kv")
    return applied


def _backport_stub_logical_max_total_num_tokens() -> bool:
    """0.5.21: ``MlxModelRunnerStub.logical_max_total_num_tokens`` (backport of 0.5.22).

    Why: an upstream startup bug of 0.5.21's MLX stub runner. The stub does not
    override the property, so ``ModelRunner.logical_max_total_num_tokens`` reads
    ``self.kv_cache_configurator``, which only ``ModelRunner.__init__`` sets and the stub
    never runs: ``AttributeError`` in ``TpModelWorker.alloc_memory_pool`` when the
    Scheduler is built, on the MLX backend (``MlxTpModelWorker``) and on the torch loops
    (which use the same stub here). 0.5.22 added the override below: MLX pool slots
    already count logical tokens. Returns False where the release has it.
    """
    from sglang.srt.hardware_backend.mlx.model_runner_stub import MlxModelRunnerStub

    if "logical_max_total_num_tokens" in MlxModelRunnerStub.__dict__:
        return False

    def logical_max_total_num_tokens(self) -> int:
        return self.req_to_token_pool.schedulable_token_capacity(self.max_total_num_tokens)

    MlxModelRunnerStub.logical_max_total_num_tokens = property(logical_max_total_num_tokens)
    return True


def _model_free_flush_all_decode_kv(self) -> None:
    """The model-free runner's ``flush_all_decode_kv``: there is no KV pool to write, so
    only the runner's synced offsets advance (to the cache offset, as 0.5.21's unclamped
    flush does)."""
    for rid in self._req_caches:
        self._req_synced_offset[rid] = self.cache_offset(rid)


def install_model_free_flush() -> None:
    """Give :class:`ModelFreeMlxRunner` the runner method ``flush_all_decode_kv``.

    Why: through 0.5.21 ``MlxTpModelWorker`` calls ``_mlx_runner.flush_all_decode_kv()``
    before every extend launch (0.5.22 replaced it with ``release_request_row``); the
    ``unclamped-sync`` patch restores that call on later releases.
    """
    ModelFreeMlxRunner.flush_all_decode_kv = _model_free_flush_all_decode_kv


# --------------------------------------------------------------------------------------
# 6. sglang-omni's OmniScheduler (loop ``omni``; built by :mod:`contract_lib.omni`).
# --------------------------------------------------------------------------------------

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
    that does not exist here. The payload carries the prompt token ids; what it goes
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
    ids (``eos_token_ids``, bound by :func:`contract_lib.omni.build_scheduler`), which
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
