"""What a run refuses before its loop starts, each with its reason: server args that make
SGLang enter another loop (:class:`LoopMismatch`), and what a loop cannot take as SGLang
built it (:class:`Unsupported`: a workload feature, a page size its KV allocator cannot
serve). Runs in the run's process, after the shims; imports SGLang only in functions.
"""

from __future__ import annotations

from typing import Any

from contract_lib import loops
from contract_lib.wire.protocol import LoopMismatch, Unsupported
from contract_lib.workloads import Workload


def refuse_workload(loop_spec: loops.LoopSpec, workload: Workload, runner: str) -> None:
    """Refuse a loop that cannot run here and the workload features the runner cannot
    take (:class:`Unsupported`); a family's own refusals are its
    (:meth:`contract_lib.child.families.SGLangFamily.refuse`)."""
    if loop_spec.unsupported:
        raise Unsupported(f"loop {loop_spec.name} ({loop_spec.function}) cannot run here: "
                          f"{loop_spec.unsupported}")
    if runner == "real" and workload.scripted_tokens():
        raise Unsupported(
            "the workload scripts the model-free forward (emit), which --runner real "
            "replaces with a real model; run it with the model-free runner")


def resolved_args(scheduler) -> dict[str, Any]:
    """The server args the checker reads as the scheduler runs with them, after SGLang
    resolved them (``enable_deterministic_inference`` on a backend without radix
    support disables the radix cache; an MLA backend sets the page size; a decode
    server disables it), not as given: ``page_size``, ``disable_radix_cache`` and
    ``disaggregation_mode``."""
    args = scheduler.server_args
    # The radix tree's own switch first (sglang-omni's scheduler keeps no resolved copy)
    tree = getattr(scheduler, "tree_cache", None)
    disabled = next(bool(getattr(source, name)) for source, name in (
        (tree, "disable"), (scheduler, "disable_radix_cache"), (args, "disable_radix_cache"))
        if hasattr(source, name))
    return {"page_size": int(getattr(scheduler, "page_size", None) or args.page_size or 1),
            "disable_radix_cache": disabled,
            "disaggregation_mode": str(getattr(args, "disaggregation_mode", "null"))}


def check_page_size(scheduler, loop: str, triton: bool) -> None:
    """Refuse, before the loop, a page size the KV allocator SGLang built cannot serve.

    With ``page_size > 1`` the scheduler allocates through the paged path
    (``alloc_extend`` / ``alloc_decode``), which a token-level allocator (page size 1)
    fails at the first prefill ("alloc_extend is only for paged allocator"). SGLang's MLX
    backend (``MlxModelRunnerStub``) builds a token-level allocator whatever the page
    size; the torch loops' bookkeeping runner builds the paged one SGLang's model runner
    builds (:mod:`contract_lib.child.shims`). A paged allocator without a native path (no
    ``use_triton_kernels`` switch: 0.5.21) launches Triton kernels, which need a real
    ``triton`` (``triton``: False where SGLang's stand-in was loaded)."""
    from importlib import metadata

    wanted = resolved_args(scheduler)["page_size"]
    allocator = scheduler.token_to_kv_pool_allocator
    if allocator.page_size != wanted:
        raise Unsupported(
            f"page_size={wanted} is not supported on loop {loop}: SGLang built a KV "
            f"allocator of page size {allocator.page_size} ({type(allocator).__name__}), "
            "which the scheduler's paged path would fail on at the first prefill")
    if wanted > 1 and not triton and getattr(allocator, "use_triton_kernels", True):
        raise Unsupported(
            f"page_size={wanted} is not supported on loop {loop} with sglang "
            f"{metadata.version('sglang')}: its {type(allocator).__name__} launches Triton "
            "kernels only (no native path), and this machine has no Triton")


def check_loop_args(loop_spec: loops.LoopSpec, server_args, args: dict[str, Any],
                    workload_args: dict[str, Any], cli_args: dict[str, Any],
                    server_args_class) -> None:
    """Refuse, before the Scheduler is built, server args that turn the requested loop
    into another: SGLang picks the loop from ``disable_overlap_schedule`` (the normal
    loop when set, else the overlap or MLX overlap loop) and ``disaggregation_mode``
    (the PD prefill or decode loops). Names the argument responsible: the override that
    sets it, or the one whose removal restores the loop (ServerArgs' own post-init
    hooks can set it from other arguments)."""
    wanted = {"disable_overlap_schedule": loop_spec.disable_overlap_schedule,
              "disaggregation_mode": loop_spec.disaggregation or "null"}
    actual = {"disable_overlap_schedule": bool(server_args.disable_overlap_schedule),
              "disaggregation_mode": str(getattr(server_args, "disaggregation_mode",
                                                 "null"))}
    for name in wanted:
        if actual[name] != wanted[name]:
            culprit = _culprit(name, wanted[name], args, workload_args, cli_args,
                               server_args_class)
            entered = loops.dispatched_function(
                actual["disable_overlap_schedule"], loop_spec.mlx,
                None if actual["disaggregation_mode"] == "null"
                else actual["disaggregation_mode"])
            raise LoopMismatch(
                f"--loop {loop_spec.name} needs {name}={wanted[name]}, but "
                f"{culprit or 'the server args'} make(s) it {actual[name]}: SGLang would "
                f"run {entered} instead of {loop_spec.function}; remove that argument or "
                "choose that loop")


def _culprit(name: str, wanted: Any, args: dict[str, Any], workload_args: dict[str, Any],
             cli_args: dict[str, Any], server_args_class) -> str | None:
    """The given argument that makes server arg ``name`` differ from ``wanted``: one
    that sets it, else the first whose removal restores it (None: none found)."""
    sources = [("--server-arg", cli_args), ("workload [server_args]", workload_args)]
    culprit = next((f"{where} {name}={given[name]!r}"
                    for where, given in sources if name in given), None)
    if culprit is not None:
        return culprit
    for where, given in sources:
        for key in given:
            trial = {k: v for k, v in args.items() if k != key}
            trial[name] = wanted
            try:
                restored = getattr(server_args_class(**trial), name, None)
            except Exception:  # noqa: BLE001 - a trial that does not build proves nothing
                continue
            if restored == wanted:
                return f"{where} {key}={given[key]!r}"
    return None
