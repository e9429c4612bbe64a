"""Every replacement this project makes to SGLang, in one place, each with its reason.

Principle: fake the model, never the scheduling logic under test. What is replaced here is
exactly three things, one module per boundary, and nothing else in the package replaces
SGLang behaviour (except the release backports of :mod:`contract_lib.sources.compat`, each an
upstream bug of one release that stops a run from starting):

1. **Platform gates** (:mod:`.platform`), import-time and runtime, that stop SGLang's MLX
   backend, or SGLang itself, from loading on a Linux CPU machine. None of them is
   applied where SGLang's own gate passes (Apple Silicon with MPS and Metal).
2. **The model boundary**: the torch forward (``TpModelWorker.forward_batch_generation``,
   :mod:`.torch_forward`) and the MLX runner (``MlxModelRunner``, :mod:`.mlx_runner`)
   become a deterministic next-token function (:mod:`.model`). The MLX replacement
   returns SGLang's real ``MlxPendingPrefill/Extend/Decode`` holding *lazy*
   ``mlx.core`` arrays, so ``mx.async_eval``, chaining on still-lazy tokens and the
   blocking ``.tolist()`` are real; its syncs into the KV pool (a pool of contents: per
   slot, a digest of the tokens the KV was computed from) run SGLang's own runner
   methods. With ``runner="real"`` the MLX loop keeps SGLang's
   own ``MlxModelRunner`` (a tiny random-weight mlx-lm model, its patched attention and
   its ``MlxAttentionKVPool``) on MLX's CPU backend; only two Metal-only opt-in flags are
   forced off (:func:`install_mlx_real_runner`).
3. **Request ingress** (:mod:`.ingress`): the zmq receiver becomes a scripted one that
   hands SGLang real ``TokenizedGenerateReqInput`` objects (and SGLang's own
   ``AbortReq``) at chosen loop iterations.

The disaggregation loops (SGLang's fake KV transfer backend, :mod:`.disaggregation`)
add the same kinds: what the transfer set-up reads off the bookkeeping runner's
zero-byte KV cache (the model boundary), the remote prefill's first token (the model),
one CUDA-only event (a platform gate), the PD router's bootstrap fields on each request
(ingress), and **the one replaced SGLang validation** of this project: prefill's
refusal of the fake backend, declared as ``disaggregation.VALIDATION_EXCEPTION`` with
its reason.

The same three, and nothing else, for sglang-omni's ``OmniScheduler`` (loop ``omni``,
:mod:`.omni`): its platform gates (its CPU platform; unpinned host staging), its model (the
``ModelWorker``'s runner and the plain-LM ``ModelRunner``'s forward) and its ingress
(inbox messages and the model's request builder).

The capture hooks in :mod:`contract_lib.child.capture` only observe (they call through).
"""

import importlib

from contract_lib.lazy import lazy_getattr

# Each name's module, imported on first use (PEP 562): the parent process imports only
# ``model`` (the outputs check's next-token function); the platform gates (which import
# ``unittest.mock`` and asyncio), the runners and omni's shims load in the run's process.
_MODULE_OF = {
    "ScriptedReceiver": "ingress",
    "abort_request": "ingress",
    "tokenized_request": "ingress",
    "bootstrap_fields": "disaggregation",
    "disaggregation_server_args": "disaggregation",
    "install_disaggregation_shims": "disaggregation",
    "ModelFreeMlxRunner": "mlx_runner",
    "install_mlx_model_free_runner": "mlx_runner",
    "install_mlx_real_runner": "mlx_runner",
    "VOCAB_SIZE": "model",
    "install_token_script": "model",
    "next_token": "model",
    "scripted_token": "model",
    "install_omni_model_free_runner": "omni",
    "install_omni_model_free_worker": "omni",
    "install_omni_platform": "omni",
    "install_omni_unpinned_staging": "omni",
    "omni_request_builder": "omni",
    "omni_request_message": "omni",
    "omni_result_adapter": "omni",
    "install_import_shims": "platform",
    "install_mlx_runtime_gate_shim": "platform",
    "on_apple_silicon_with_mlx": "platform",
    "scheduler_class_for": "platform",
    "bookkeeping_runner": "torch_forward",
    "install_torch_model_free_forward": "torch_forward",
    "model_free_result": "torch_forward",
    "model_free_tokens": "torch_forward",
}
__getattr__ = lazy_getattr(__name__, _MODULE_OF, globals())


def import_all() -> None:
    """Import every shim module now (the warm server does, so forked runs find them)."""
    for module in sorted(set(_MODULE_OF.values())):
        importlib.import_module(f"{__name__}.{module}")


__all__ = sorted(_MODULE_OF)
