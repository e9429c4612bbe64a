"""Every replacement this project makes to SGLang, in one place, each with its reason.

Principle: fake the model, never the scheduling logic under test. What is replaced here is
exactly three things, one module per boundary, and nothing else in the package replaces
SGLang behaviour (except the release backports of :mod:`contract_lib.compat`, each an
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

The same three, and nothing else, for sglang-omni's ``OmniScheduler`` (loop ``omni``,
:mod:`.omni`): its platform gates (its CPU platform; unpinned host staging), its model (the
``ModelWorker``'s runner and the plain-LM ``ModelRunner``'s forward) and its ingress
(inbox messages and the model's request builder).

The capture hooks in :mod:`contract_lib.capture` only observe (they call through).
"""

from contract_lib.shims.ingress import ScriptedReceiver, abort_request, tokenized_request
from contract_lib.shims.mlx_runner import (ModelFreeMlxRunner, install_mlx_model_free_runner,
                                           install_mlx_real_runner)
from contract_lib.shims.model import (VOCAB_SIZE, install_token_script, next_token,
                                      scripted_token)
from contract_lib.shims.omni import (install_omni_model_free_runner,
                                     install_omni_model_free_worker, install_omni_platform,
                                     install_omni_unpinned_staging, omni_request_builder,
                                     omni_request_message, omni_result_adapter)
from contract_lib.shims.platform import (install_import_shims, install_mlx_runtime_gate_shim,
                                         on_apple_silicon_with_mlx, scheduler_class_for)
from contract_lib.shims.torch_forward import (bookkeeping_runner,
                                              install_torch_model_free_forward,
                                              model_free_result, model_free_tokens)

__all__ = [
    "ModelFreeMlxRunner", "ScriptedReceiver", "VOCAB_SIZE", "abort_request",
    "bookkeeping_runner",
    "install_import_shims", "install_mlx_model_free_runner", "install_mlx_real_runner",
    "install_mlx_runtime_gate_shim",
    "install_omni_model_free_runner", "install_omni_model_free_worker",
    "install_omni_platform", "install_omni_unpinned_staging",
    "install_token_script", "install_torch_model_free_forward", "model_free_result",
    "model_free_tokens", "next_token", "omni_request_builder", "omni_request_message", "omni_result_adapter",
    "on_apple_silicon_with_mlx", "scheduler_class_for", "scripted_token",
    "tokenized_request",
]
