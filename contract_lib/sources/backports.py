"""Backports: an older SGLang release's own bugs that stop a run from starting, each the
fixing release's code, installed only where the running release lacks the fix and
recorded by name in the run's ``shims``. Backports replace SGLang behaviour, like
:mod:`contract_lib.child.shims`; chosen by feature, not by version string, as the probes
of :mod:`contract_lib.sources.compat`.
"""

from __future__ import annotations

# Model types <= 0.5.19 registers with transformers' ``AutoConfig`` that the venv's
# transformers ships itself (0.5.20 registers them with ``exist_ok=True``).
_CONFIGS_TRANSFORMERS_SHIPS = ("qwen3_asr", "qwen3_asr_thinker")
_IMPORT_BACKPORTS: list[str] = []  # needed by this process's SGLang import (forks inherit it)


def install_import_compat() -> list[str]:
    """Backports the release needs to be imported, installed before the first ``import
    sglang.srt`` (idempotent); returns the names of those its import has needed so far."""
    from transformers import AutoConfig

    real = AutoConfig.register
    if getattr(real, "contract_lib_backport", False):
        return list(_IMPORT_BACKPORTS)

    def register(model_type, config, exist_ok=False):
        """0.5.14-0.5.19: ``sglang.srt.configs.qwen3_asr`` registers model types that
        transformers 5.19 (the venv's; those releases pin 5.8.1 or 5.12.1) ships, and
        transformers refuses a second registration: ``ValueError: 'qwen3_asr' is already
        used by a Transformers config`` on ``import sglang.srt.configs``. 0.5.20 passes
        ``exist_ok=True``; so does this, for those names only."""
        try:
            return real(model_type, config, exist_ok=exist_ok)
        except ValueError:
            if model_type not in _CONFIGS_TRANSFORMERS_SHIPS:
                raise
            if "backport-config-register-exist-ok" not in _IMPORT_BACKPORTS:
                _IMPORT_BACKPORTS.append("backport-config-register-exist-ok")
            return real(model_type, config, exist_ok=True)

    register.contract_lib_backport = True
    AutoConfig.register = staticmethod(register)
    return list(_IMPORT_BACKPORTS)



def install_release_compat() -> list[str]:
    """Backports the running SGLang release needs to start a run; returns their names."""
    return [name for name, backport in _RELEASE_BACKPORTS if backport()]


def _backport_stub_alloc_memory_pool() -> bool:
    """0.5.14: ``MlxModelRunnerStub.alloc_memory_pool`` (backport of 0.5.15).

    Why: an upstream startup bug of 0.5.14's MLX stub runner. Its ``initialize``
    builds the pools but sets no ``memory_pool_config``, so the Scheduler's
    ``init_target_memory_pool`` calls ``alloc_memory_pool``, which the stub does not
    override: ``ModelRunner._init_pools`` finds a ``req_to_token_pool`` already there
    and fails ``assert self.is_draft_worker`` while the Scheduler is built, on the MLX
    backend and on the torch loops (same stub). 0.5.15 added the no-op below ("MLX
    manages its own KV cache"). Returns False where the release has it.
    """
    from sglang.srt.hardware_backend.mlx.model_runner_stub import MlxModelRunnerStub

    if "alloc_memory_pool" in MlxModelRunnerStub.__dict__:
        return False

    def alloc_memory_pool(self, memory_pool_config=None) -> None:
        """No-op: MLX manages its own KV cache."""

    MlxModelRunnerStub.alloc_memory_pool = alloc_memory_pool
    return True


def _backport_stub_dp_size() -> bool:
    """0.5.16: ``MlxModelRunnerStub.dp_size`` (what 0.5.17 reads instead:
    ``ps.attn_dp_size``).

    Why: an upstream startup bug of 0.5.16's MLX stub runner (#32674). Its
    ``_resolve_max_running_requests`` divides ``--max-running-requests`` by
    ``self.dp_size``, which ``ModelRunner`` stopped setting in 0.5.16 (its ranks moved
    to ``self.ps``): ``AttributeError`` while the Scheduler is built whenever
    ``max_running_requests`` is set (every run: ``BASE_SERVER_ARGS``). 0.5.17 divides by
    ``self.ps.attn_dp_size``; the property below gives it that name. Returns False where
    the stub does not read ``dp_size`` or something sets it.
    """
    import inspect

    from sglang.srt.hardware_backend.mlx.model_runner_stub import MlxModelRunnerStub
    from sglang.srt.model_executor.model_runner import ModelRunner

    resolve = getattr(MlxModelRunnerStub, "_resolve_max_running_requests", None)
    if (resolve is None or "self.dp_size" not in inspect.getsource(resolve)
            or "self.dp_size" in inspect.getsource(ModelRunner.__init__)
            or hasattr(MlxModelRunnerStub, "dp_size")):
        return False
    MlxModelRunnerStub.dp_size = property(lambda self: self.ps.attn_dp_size)
    return True


def _backport_stub_logical_max_total_num_tokens() -> bool:
    """0.5.21: ``MlxModelRunnerStub.logical_max_total_num_tokens`` (backport of 0.5.22).

    Why: an upstream startup bug of 0.5.21's MLX stub runner. The stub does not
    override the property, so ``ModelRunner.logical_max_total_num_tokens`` reads
    ``self.kv_cache_configurator``, which only ``ModelRunner.__init__`` sets and the stub
    never runs: ``AttributeError`` in ``TpModelWorker.alloc_memory_pool`` when the
    Scheduler is built, on the MLX backend (``MlxTpModelWorker``) and on the torch loops
    (which use the same stub here). 0.5.22 added the override below: MLX pool slots
    already count logical tokens. Returns False where the release has it, or has no
    such property (<= 0.5.20).
    """
    from sglang.srt.hardware_backend.mlx.model_runner_stub import MlxModelRunnerStub
    from sglang.srt.model_executor.model_runner import ModelRunner

    if ("logical_max_total_num_tokens" in MlxModelRunnerStub.__dict__
            or not hasattr(ModelRunner, "logical_max_total_num_tokens")):
        return False

    def logical_max_total_num_tokens(self) -> int:
        return self.req_to_token_pool.schedulable_token_capacity(self.max_total_num_tokens)

    MlxModelRunnerStub.logical_max_total_num_tokens = property(logical_max_total_num_tokens)
    return True


_RELEASE_BACKPORTS = (
    ("backport-stub-alloc-memory-pool", _backport_stub_alloc_memory_pool),
    ("backport-stub-dp-size", _backport_stub_dp_size),
    ("backport-stub-logical-max-total-num-tokens",
     _backport_stub_logical_max_total_num_tokens),
)
