"""The SGLang releases contract_lib drives, and every per-release difference in one place.

Probes are chosen by feature, not by version string: each answers "does the running
release have X?", so a release between or after the pinned ones gets the right branch.
The backports an older release needs to start a run are beside this module, in
:mod:`contract_lib.sources.backports`.

Supporting a new release: add it to :data:`SUPPORTED_SGLANG_VERSIONS`, and where it moved
code the library reads, a probe here (or an anchor in :mod:`contract_lib.patches.builtin`); a
contract field it lacks, :data:`OPTIONAL_FIELDS`; what it imports that the venv lacks,
:data:`RELEASE_REQUIREMENTS` (keyed by version: a pin is installed before anything can
be probed). What each release from 0.5.14 needed: ``docs/history.md``.
"""

from __future__ import annotations

import re
import sysconfig
from pathlib import Path

# Field names, call sites and the MLX worker API the capture hooks and shims rely on were
# read from these releases' code (docs/contract.md, docs/history.md). Backports of an
# upstream startup bug (:mod:`contract_lib.sources.backports`): the MLX stub runner of
# 0.5.14, 0.5.16 and 0.5.21; 0.5.14-0.5.19's config registration.
SUPPORTED_SGLANG_VERSIONS = ("0.5.14", "0.5.15", "0.5.16", "0.5.17", "0.5.18", "0.5.19",
                             "0.5.20", "0.5.21", "0.5.22", "0.5.23")

# Distributions a release imports to build a Scheduler that the venv (set up for 0.5.23)
# does not hold, at the release's own pin, installed into its folder beside it
# (:func:`contract_lib.sources.versions.install_release`): 0.5.16-0.5.20's ``server_args``
# imports ``function_call_parser``, which imports ``xgrammar`` (``inkling_detector``);
# 0.5.21 made that import lazy.
RELEASE_REQUIREMENTS: dict[str, tuple[str, ...]] = {
    version: ("xgrammar==0.2.1",)
    for version in ("0.5.16", "0.5.17", "0.5.18", "0.5.19", "0.5.20")}

# SGLang's own Triton stand-in (a mock ``triton`` package) and its installer, which
# installs it only on Apple Silicon with MPS.
TRITON_STANDIN = ("_platform_stubs.py", "install_platform_stubs")


def package_version(package: Path) -> str | None:
    """The version an SGLang package folder was built as (``sglang/_version.py``, which
    SGLang's build writes), or None."""
    try:
        text = (package / "_version.py").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    found = re.search(r"^__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", text,
                      re.M) or re.search(r"^version\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
    return found.group(1) if found else None


def triton_standin(package: Path) -> Path:
    """The Triton stand-in file for the SGLang package folder ``package``: its own where
    it defines ``triton.compiler.CompiledKernel`` as a class (0.5.19+), else the venv's
    SGLang's (0.5.23). Torch 2.13 (the venv's) imports that name, with others, as a
    class while initializing Inductor (which ``import sglang.srt`` does, compiling its
    first function): 0.5.18's stand-in, and <= 0.5.17's ``_triton_stub.py``, hand it a
    module (``TypeError: unsupported operand type(s) for |: 'module' and 'type'``);
    0.5.19 fixed that ("Torch 2.13 imports these as classes while initializing
    Inductor")."""
    own = package / TRITON_STANDIN[0]
    if own.is_file() and "CompiledKernel" in own.read_text(encoding="utf-8"):
        return own
    return Path(sysconfig.get_paths()["purelib"]) / "sglang" / TRITON_STANDIN[0]


# The modules a Scheduler build imports on first use, in the order it imports them
# (0.5.23, every loop): ~80 ms of a ~120 ms build, most of it ``dllm.algorithm``, whose
# import wraps a function in ``torch.compile`` and builds dynamo's trace rules. The warm
# server imports them once (:func:`contract_lib.child.preload.preload`), so forked runs do not;
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


# -- a run's build -----------------------------------------------------------------------


def schedule_args(server_args):
    """Where the release's workers read the schedule's server args (``page_size``,
    ``max_total_tokens``, ``mem_fraction_static``): the runtime context's
    ``get_schedule()`` (0.5.17+), else the server args themselves."""
    from sglang.srt import runtime_context

    get_schedule = getattr(runtime_context, "get_schedule", None)
    return server_args if get_schedule is None else get_schedule()


def build_scheduler(scheduler_class: type, server_args, port_args):
    """Rank 0's ``Scheduler``, built as the release's ``run_scheduler_process`` builds
    it: the runtime context published first (0.5.21+: with the process's
    ``SpawnRanks``; 0.5.17-0.5.20: without; <= 0.5.16: no runtime context to publish),
    then the Scheduler (<= 0.5.20 takes the ranks as arguments: GPU, TP, MoE EP, PP,
    attention CP, MoE DP ranks 0, DP rank None)."""
    import inspect

    from sglang.srt import runtime_context

    publish = getattr(runtime_context, "publish", None)
    if publish is not None and "ranks" in inspect.signature(publish).parameters:
        publish(server_args, role="scheduler", ranks=runtime_context.SpawnRanks(
            world_rank=0, dp_rank=None, gpu_id=0))
    elif publish is not None:
        publish(server_args, role="scheduler")
    if "gpu_id" in inspect.signature(scheduler_class.__init__).parameters:
        return scheduler_class(server_args, port_args, 0, 0, 0, 0, 0, 0, None)
    return scheduler_class(server_args, port_args)


def mlx_runtime_gate():
    """The module holding the release's MLX runtime gate (``_validate_runtime``, cached
    ``use_mlx``; 0.5.19+), or None: <= 0.5.18's ``utils.tensor_bridge.use_mlx`` reads
    ``SGLANG_USE_MLX`` and whether ``mlx`` imports, nothing a CPU machine fails."""
    import importlib
    import importlib.util

    name = "sglang.srt.hardware_backend.mlx.runtime"
    return importlib.import_module(name) if importlib.util.find_spec(name) else None


# -- probes (read-only) ------------------------------------------------------------------

# Contract fields a release may not have: field -> (what holds it, the ``Scheduler``
# method that reads it). A release without the field whose reader does not read it has
# nothing the field's clause could find stale (:func:`absent_fields`): ``launch_ts``
# and its reader arrived in 0.5.17 (#32245), ``after_idle_gap`` in 0.5.18, the HRRN
# clock ``processed_tokens_counter`` in 0.5.20.
OPTIONAL_FIELDS = {
    "launch_ts": ("ScheduleBatch", "_record_step_counters"),
    "after_idle_gap": ("ScheduleBatch", "_record_step_counters"),
    "processed_tokens_counter": ("Scheduler", "_get_new_batch_prefill_raw"),
}


def absent_fields(scheduler) -> dict[str, str]:
    """The contract fields the running release does not have, each with why its absence
    is no violation: those of :data:`OPTIONAL_FIELDS` it lacks and nothing in it reads
    (a field some reader reads but nothing holds is not absent: its clause finds it
    missing), and ``cache_protected_len`` as written at a request's release, where the
    release does not write it there (:func:`_release_records_protected`)."""
    import inspect
    from importlib import metadata

    from sglang.srt.managers.schedule_batch import ScheduleBatch

    holders = {"ScheduleBatch": ScheduleBatch, "Scheduler": scheduler}
    version = metadata.version("sglang")
    absent = {}
    for field, (holder, reader) in OPTIONAL_FIELDS.items():
        if hasattr(holders[holder], field):
            continue
        function = getattr(type(scheduler), reader, None)
        if function is None:
            why = f"nor its reader Scheduler.{reader}"
        elif field not in inspect.getsource(function):
            why = f"and its reader Scheduler.{reader} does not read it"
        else:
            continue
        absent[field] = f"sglang {version} has no {holder}.{field} {why}"
    tree = getattr(scheduler, "tree_cache", None)
    if tree is not None and not _release_records_protected(tree):
        absent["cache_protected_len"] = (
            f"sglang {version} releases a finished request through "
            f"{type(tree).__name__}.cache_finished_req, which inserts it into the radix "
            "tree without writing what it kept into cache_protected_len (0.5.21's "
            "insert_req does): what the tree kept is judged by a later request's reuse "
            "(cached_tokens) alone")
    return absent


def _release_records_protected(tree) -> bool:
    """Whether releasing a finished request leaves what the radix tree kept of it in its
    ``cache_protected_len``: 0.5.21+ release through ``insert_req`` / ``checkpoint``,
    which write it; <= 0.5.20 through ``cache_finished_req``, which does not."""
    import inspect

    if hasattr(tree, "insert_req") or hasattr(tree, "checkpoint"):
        return True
    finish = getattr(type(tree), "cache_finished_req", None)
    return finish is None or "cache_protected_len =" in inspect.getsource(finish)


def step_boundary(scheduler) -> tuple[object, str]:
    """The call every SGLang loop makes first in an iteration, before its requests
    arrive, as ``(object, method name)``: ``Scheduler.ingest_requests`` (0.5.20+), else
    ``request_receiver.recv_requests`` (<= 0.5.19, which call it and then
    ``process_input_requests`` at the top of every loop)."""
    if hasattr(type(scheduler), "ingest_requests"):
        return scheduler, "ingest_requests"
    return scheduler.request_receiver, "recv_requests"



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


class _KvOnReq:
    """<= 0.5.18: a request's KV bookkeeping read where it lives: ``req_pool_idx``,
    ``kv_committed_len`` and ``cache_protected_len`` on the ``Req``; ``kv_allocated_len``
    on the ``Req`` (<= 0.5.15) or on its ``kv`` (a ``ReqKvInfo`` while it holds KV, else
    None: 0.5.16-0.5.18)."""

    __slots__ = ("req",)

    def __init__(self, req) -> None:
        self.req = req

    @property
    def req_pool_idx(self) -> int | None:
        return self.req.req_pool_idx

    @property
    def kv_committed_len(self) -> int:
        return self.req.kv_committed_len

    @property
    def cache_protected_len(self) -> int:
        return self.req.cache_protected_len

    @property
    def kv_allocated_len(self) -> int:
        req = self.req
        if hasattr(req, "kv_allocated_len"):
            return req.kv_allocated_len
        kv = getattr(req, "kv", None)
        return 0 if kv is None else kv.kv_allocated_len


def req_kv(req):
    """A request's KV bookkeeping (``req_pool_idx``, ``kv_committed_len``,
    ``kv_allocated_len``, ``cache_protected_len``): its ``kv`` (0.5.19+: a ``ReqKvInfo``
    always there, holding all four), else read off the request (:class:`_KvOnReq`)."""
    kv = getattr(req, "kv", None)
    return kv if hasattr(kv, "req_pool_idx") else _KvOnReq(req)


def mlx_launch_parts(launch) -> tuple[object, list, list, object]:
    """``(key, prefills, extends, decode)`` of what the MLX worker's async forward (fresh
    or chained) returned: an ``MlxLaunch`` (0.5.18+), keyed by itself, or <= 0.5.17's
    5-tuple ``(lazy tokens, prefills, extends, decode, mode)``, keyed by its prefills
    list. Either key is the first argument the worker's ``finalize_mlx_result`` gets
    back for that launch (``(launch, reqs)``; <= 0.5.17 ``(prefills, extends, decode,
    mode, reqs)``)."""
    if isinstance(launch, tuple):
        _, prefills, extends, decode, _ = launch
        return prefills, prefills, extends, decode
    return launch, launch.prefills, launch.extends, launch.decode


def mlx_pending(kind: type, **values):
    """One of the MLX runner's pending records (``MlxPendingPrefill/Extend/Decode``) built
    from the fields the release declares: <= 0.5.17 has no ``MlxPendingExtend.cache``
    nor ``MlxPendingDecode.logprob_spec`` / ``edit_rows``."""
    import dataclasses

    declared = {field.name for field in dataclasses.fields(kind)}
    return kind(**{name: value for name, value in values.items() if name in declared})


def pool_layers(cache_layout) -> list[int]:
    """The model layers whose KV the MLX attention pool holds, in its buffers' order:
    ``full_attention_layer_indices`` (0.5.18+, which tells sliding-window layers apart),
    else <= 0.5.17's ``attention_layer_indices`` (every attention layer)."""
    if hasattr(cache_layout, "full_attention_layer_indices"):
        return list(cache_layout.full_attention_layer_indices)
    return list(cache_layout.attention_layer_indices)


def free_pages(allocator):
    """The KV allocator's free pages, released ones included: SGLang's own census
    ``get_all_free_pages`` (0.5.20+), else what it lists on <= 0.5.19's allocators
    (``free_pages`` and ``release_pages``)."""
    if hasattr(allocator, "get_all_free_pages"):
        return allocator.get_all_free_pages()
    import torch

    return torch.cat((allocator.free_pages, allocator.release_pages))


def radix_match_slots(tree, match) -> list[int]:
    """The pool slots of a radix-tree ``match_prefix`` result (0.5.21/0.5.22:
    ``MatchResult.device_indices``; 0.5.23: read off the matched path)."""
    if hasattr(match, "device_indices"):
        return [int(s) for s in match.device_indices.tolist()]
    path = tree.path_device_indices(match.last_device_node)
    return [int(s) for s in path[: match.device_prefix_len].tolist()]
