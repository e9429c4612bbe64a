"""sglang-omni's ``OmniScheduler`` as a loop (``omni``), in the run's process: its shims
and its build. Its release and install: :mod:`contract_lib.sources.omni_release`.

sglang-omni (PyPI ``sglang-omni``) runs SGLang's scheduling methods on its own class by
composition (``OmniScheduler.__getattr__`` binds upstream ``Scheduler`` methods to an
``OmniScheduler``) and owns its decode loop, ``event_loop_async_decode``: each iteration
launches the current decode step and then resolves the previous one (a one-step
lookahead), with its own per-forward bookkeeping (``stamp_batch_launch``). Findings and
figures: ``docs/omni.md``.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable


def install_shims(folder: str, on_launch: Callable[[Any, list[int]], None]) -> list[str]:
    """Put sglang-omni on ``sys.path`` and install its shims (``contract_lib.child.shims``
    section 6: platform gates, the model, the request builder) before any patch runs,
    as for the torch loops; returns their names."""
    if folder not in sys.path:
        sys.path.insert(0, folder)
    from contract_lib.child import shims

    applied = shims.install_omni_platform()  # before sglang_omni is first imported
    applied += shims.install_omni_unpinned_staging()
    shims.install_omni_model_free_worker()
    shims.install_omni_model_free_runner(on_launch)
    return applied + ["omni-model-free-worker", "omni-model-free-forward",
                      "omni-scripted-request-builder"]


def build_scheduler(server_args):
    """Build an ``OmniScheduler`` as sglang-omni's engine builder does for a plain-LM
    stage (``AsrEngineBuilder``): ``create_sglang_infrastructure`` (its ``ModelWorker``,
    SGLang's pools and its tree cache), the plain-LM ``ModelRunner`` with its
    ``SGLangExecutionBridge``, and the scheduler with ``enable_async_decode`` (the
    one-step-lookahead loop). Call :func:`install_shims` first."""
    from sglang_omni.model_runner.base import ModelRunner
    from sglang_omni.scheduling import bootstrap, omni_scheduler
    from sglang_omni.scheduling.sglang_backend import SGLangOutputProcessor

    from contract_lib.child import shims

    _want_cuda_graph, (worker, tree_cache, req_to_token_pool, allocator, model_config) = (
        bootstrap.create_sglang_infrastructure_defer_cuda_graph(server_args, 0))
    return omni_scheduler.OmniScheduler(
        tp_worker=worker, tree_cache=tree_cache, req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=allocator, server_args=server_args,
        model_config=model_config, model_runner=ModelRunner(worker, SGLangOutputProcessor()),
        request_builder=functools.partial(shims.omni_request_builder,
                                          eos_token_ids=model_config.hf_eos_token_id),
        result_adapter=shims.omni_result_adapter, enable_async_decode=True)
