"""The SGLang releases contract_lib drives, and every per-release difference in one place.

Probes and backports are chosen by feature, not by version string: each answers "does
the running release have X?", so a release between or after the pinned ones gets the
right branch. Backports replace SGLang behaviour, like :mod:`contract_lib.shims`: each is
an upstream bug of one release that stops a run from starting, installed only where the
running release lacks the fix, and recorded by name in the run's ``shims``.

Supporting a new release: add it to :data:`SUPPORTED_SGLANG_VERSIONS`, and where it moved
code the library reads, a probe here (or an anchor in :mod:`contract_lib.patches`).
"""

from __future__ import annotations

# Field names, call sites and the MLX worker API the capture hooks and shims rely on were
# read from these releases' code (see docs/contract.md for the anchors). 0.5.21 needs two
# backports (:func:`install_release_compat`); 0.5.22 and 0.5.23 need none.
SUPPORTED_SGLANG_VERSIONS = ("0.5.21", "0.5.22", "0.5.23")

# The modules a Scheduler build imports on first use, in the order it imports them
# (0.5.23, every loop): ~80 ms of a ~120 ms build, most of it ``dllm.algorithm``, whose
# import wraps a function in ``torch.compile`` and builds dynamo's trace rules. The warm
# server imports them once (:func:`contract_lib.server.preload`), so forked runs do not;
# a release without one skips it. None reads the environment at import time, and the
# committed fixtures equal fresh runs with them preloaded (``tests/test_tiers.py``).
BUILD_IMPORTS = (
    "sglang.srt.arg_groups.kv_shard_hook",
    "sglang.srt.arg_groups.resolution_hooks",
    "sglang.srt.arg_groups.pipeline",
    "sglang.srt.arg_groups.cp_tp_group_sharing_hook",
    "sglang.srt.arg_groups.parallel_hook",
    "sglang.srt.arg_groups.mega_moe_hook",
    "sglang.srt.arg_groups.serving_hook",
    "sglang.srt.arg_groups.hicache_hook",
    "sglang.srt.arg_groups.memory_hook",
    "sglang.srt.arg_groups.platform_hook",
    "sglang.srt.arg_groups.model_path_hook",
    "sglang.srt.arg_groups.muse_spark_hook",
    "sglang.srt.model_loader.expert_pack_config",
    "sglang.srt.arg_groups.expert_pack_hook",
    "sglang.srt.arg_groups.pd_disaggregation_hook",
    "sglang.srt.arg_groups.cuda_graph_hook",
    "sglang.srt.arg_groups.model_hook",
    "sglang.srt.arg_groups.mamba_hook",
    "sglang.srt.arg_groups.attention_hook",
    "sglang.srt.arg_groups.moe_hook",
    "sglang.srt.arg_groups.speculative_hook",
    "sglang.srt.arg_groups.boundary_reduction",
    "sglang.srt.arg_groups.layernorm_sp_hook",
    "sglang.srt.arg_groups.dllm_hook",
    "sglang.srt.distributed.device_communicators.custom_all_reduce_ops",
    "sglang.srt.distributed.device_communicators.custom_all_reduce",
    "sglang.srt.distributed.device_communicators.pymscclpp",
    "sglang.srt.distributed.device_communicators.all_reduce_utils",
    "sglang.srt.distributed.device_communicators.torch_symm_mem",
    "sglang.srt.distributed.device_communicators.pcie_ipc_ar",
    "sglang.srt.distributed.device_communicators.hpu_communicator",
    "sglang.srt.distributed.device_communicators.xpu_communicator",
    "sglang.srt.distributed.device_communicators.shm_broadcast",
    "sglang.srt.dllm.algorithm.base",
    "sglang.srt.dllm.algorithm.gemma4_renoise",
    "sglang.srt.dllm.algorithm.joint_threshold",
    "sglang.srt.dllm.algorithm.joint_threshold_indel",
    "sglang.srt.dllm.algorithm.low_confidence",
    "sglang.srt.dllm.algorithm",
    "sglang.srt.rust_extensions.loader",
    "sglang.srt.rust_extensions",
    "sglang.srt.rust_extensions.torch_build",
    "sglang.srt.mem_cache.rust_tree_core",
    "sglang.srt.mem_cache.rust_tree_core.mem_cache",
    "sglang.srt.mem_cache.rust_tree_core.extension",
    "sglang.srt.mem_cache.rust_tree_core.adapter",
)


# -- backports ---------------------------------------------------------------------------


def install_release_compat() -> list[str]:
    """Backports the running SGLang release needs to start a run; returns their names."""
    applied = []
    if _backport_stub_logical_max_total_num_tokens():
        applied.append("backport-stub-logical-max-total-num-tokens")
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


# -- probes (read-only) ------------------------------------------------------------------


class EmptyBatch:
    """A batch with no requests (stands in where SGLang reads one that does not exist)."""

    reqs: list = []

    @staticmethod
    def is_empty() -> bool:
        return True


def uncached_sizes(checker) -> int:
    """``SchedulerInvariantChecker._get_total_uncached_sizes`` at any step boundary.

    0.5.21 reads ``get_last_batch().reqs`` unguarded (SGLang calls it only once a batch
    ran); the step boundaries before the first batch have none, so an empty batch stands
    in there."""
    if checker.get_last_batch() is not None:
        return checker._get_total_uncached_sizes()[0]
    saved = checker.get_last_batch
    checker.get_last_batch = EmptyBatch
    try:
        return checker._get_total_uncached_sizes()[0]
    finally:
        checker.get_last_batch = saved


def radix_match_slots(tree, match) -> list[int]:
    """The pool slots of a radix-tree ``match_prefix`` result (0.5.21/0.5.22:
    ``MatchResult.device_indices``; 0.5.23: read off the matched path)."""
    if hasattr(match, "device_indices"):
        return [int(s) for s in match.device_indices.tolist()]
    path = tree.path_device_indices(match.last_device_node)
    return [int(s) for s in path[: match.device_prefix_len].tolist()]
