"""The loop registry: one :class:`LoopSpec` per scheduler loop a run can drive.

Everything that varies by loop reads it from here — the harness (validation, the pinned
release, the server flag, the scheduler build, the event-loop function the run must
enter), the capture (how requests enter, where in-flight work waits), the contract
(clause 5's in-flight term), ``status``/``audit`` (which loops run by default, which are
the reference) and the CLI (``--loop`` choices). A new variant of an existing family
(torch, MLX or sglang-omni) is one :func:`register` call; a new family also names its
build in :mod:`contract_lib.child.main` and its ingress in :mod:`contract_lib.child.capture`.

Bottom floor: imports nothing from the package.
"""

from __future__ import annotations

import dataclasses

REFERENCE, CANDIDATE = "reference", "candidate"
# Families: how the scheduler is built and fed. ``sglang``: SGLang's own ``Scheduler``
# built by its ``__init__`` and fed through a scripted ``request_receiver``; ``omni``:
# sglang-omni's ``OmniScheduler`` (:mod:`contract_lib.child.omni_build`), fed through its inbox.
SGLANG, OMNI = "sglang", "omni"
# PD-disaggregation roles (``ServerArgs.disaggregation_mode``).
PREFILL, DECODE = "prefill", "decode"


@dataclasses.dataclass(frozen=True)
class LoopSpec:
    """One loop: what a run of it builds, must enter and is judged against."""

    name: str
    role: str  # REFERENCE (must satisfy every clause) or CANDIDATE (what is measured)
    function: str  # the event-loop method SGLang's dispatch must enter
    family: str = SGLANG  # SGLANG or OMNI: how the scheduler is built and fed
    # ServerArgs.disable_overlap_schedule the loop needs (SGLang picks its loop from it).
    disable_overlap_schedule: bool = False
    mlx: bool = False  # the MLX backend: SGLANG_USE_MLX, its runtime gate, runner, mixin
    # ServerArgs.disaggregation_mode (PREFILL or DECODE: a PD-disaggregation loop on
    # SGLang's fake transfer backend; None: SGLang's "null")
    disaggregation: str | None = None
    sglang: str | None = None  # the SGLang release the loop is pinned to, if any
    in_flight: str = "result_queue"  # where launched-but-unprocessed work waits (clause 5)
    default: bool = True  # ``status``/``audit`` run it when no loop is named
    # Why SGLang cannot run this loop here (its requirement, file:line): every run of
    # it is refused in set-up (``Unsupported``); empty for a loop that runs.
    unsupported: str = ""
    note: str = ""

    @property
    def reference(self) -> bool:
        return self.role == REFERENCE

    @property
    def first_token_only(self) -> bool:
        """A PD prefill side: it emits each request's first token and hands it off (it
        sets ``max_new_tokens`` to 1, ``disaggregation/prefill.py``)."""
        return self.disaggregation == PREFILL

LOOP_SPECS: dict[str, LoopSpec] = {}


def register(spec: LoopSpec, *, replace: bool = False) -> LoopSpec:
    """Add a loop; the derived tuples below are recomputed. A name already registered is
    a ValueError unless ``replace`` (it keeps its place in :func:`names`)."""
    if spec.name in LOOP_SPECS and not replace:
        raise ValueError(f"loop {spec.name!r} is already registered "
                         f"({LOOP_SPECS[spec.name].function}); pass replace=True to replace it")
    if spec.role not in (REFERENCE, CANDIDATE):
        raise ValueError(f"loop {spec.name!r}: role must be {REFERENCE!r} or {CANDIDATE!r}")
    if spec.family not in (SGLANG, OMNI):
        raise ValueError(f"loop {spec.name!r}: family must be {SGLANG!r} or {OMNI!r}")
    if spec.disaggregation not in (None, PREFILL, DECODE) or (
            spec.disaggregation and (spec.mlx or spec.family != SGLANG)):
        raise ValueError(f"loop {spec.name!r}: disaggregation must be None, {PREFILL!r} or "
                         f"{DECODE!r}, on the torch family")
    LOOP_SPECS[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove a loop (tests that register a toy one)."""
    LOOP_SPECS.pop(name, None)


def spec(name: str) -> LoopSpec:
    """The registered loop ``name`` (KeyError if none)."""
    return LOOP_SPECS[name]


def known(name: str) -> LoopSpec:
    """The registered loop ``name``, or a candidate SGLang overlap loop of that name (frames
    of a loop registered in another process are still checked)."""
    return LOOP_SPECS.get(name) or LoopSpec(name, CANDIDATE, "")


def names() -> tuple[str, ...]:
    """Every registered loop, in registration order (the order of tables' columns)."""
    return tuple(LOOP_SPECS)


def default_names() -> tuple[str, ...]:
    """The loops ``status`` and ``audit`` run when none is named."""
    return tuple(n for n, s in LOOP_SPECS.items() if s.default)


def reference_names() -> tuple[str, ...]:
    """The loops that must satisfy every clause (SGLang's torch loops)."""
    return tuple(n for n, s in LOOP_SPECS.items() if s.reference)


def dispatched_function(disable_overlap_schedule: bool, mlx: bool,
                        disaggregation: str | None = None) -> str:
    """The event loop SGLang's dispatch enters for these settings
    (``_dispatch_event_loop_once``, ``managers/scheduler.py:6218``; one pipeline stage)."""
    if disaggregation in (PREFILL, DECODE):
        kind = "normal" if disable_overlap_schedule else "overlap"
        return f"event_loop_{kind}_disagg_{disaggregation}"
    if disable_overlap_schedule:
        return "event_loop_normal"
    return "event_loop_overlap_mlx" if mlx else "event_loop_overlap"


def refusal(name: str) -> str | None:
    """Why a run of the registered loop ``name`` is refused here (one line naming
    SGLang's requirement), or None for a loop that runs."""
    spec = LOOP_SPECS[name]
    if not spec.unsupported:
        return None
    return f"loop {name} ({spec.function}) cannot run here: {spec.unsupported}"


def loop_functions() -> dict[str, str]:
    """Loop name -> the event-loop function a run of it must enter."""
    return {n: s.function for n, s in LOOP_SPECS.items()}


register(LoopSpec("normal", REFERENCE, "event_loop_normal", disable_overlap_schedule=True,
                  note="SGLang's torch loop without overlap"))
register(LoopSpec("overlap", REFERENCE, "event_loop_overlap",
                  note="SGLang's torch overlap loop"))
register(LoopSpec("mlx", CANDIDATE, "event_loop_overlap_mlx", mlx=True,
                  note="SGLang's MLX overlap loop (the real mixin, on MLX's CPU backend)"))
register(LoopSpec("mlx-normal", CANDIDATE, "event_loop_normal", disable_overlap_schedule=True,
                  mlx=True, default=False,
                  note="SGLang's MLX backend without overlap (disable_overlap_schedule): "
                       "event_loop_normal, its forward through MlxTpModelWorker"))


def _register_disaggregation_loops() -> None:
    """The PD-disaggregation loops on SGLang's fake transfer backend: the prefill side
    prefills and hands each request off; the decode side admits requests already
    prefilled (their prompt KV and first token arrive by transfer) and decodes."""
    for role in (PREFILL, DECODE):
        for overlap in (False, True):
            register(LoopSpec(
                f"disagg-{role}-{'overlap' if overlap else 'normal'}", CANDIDATE,
                dispatched_function(not overlap, False, role),
                disable_overlap_schedule=not overlap, disaggregation=role,
                in_flight=("result_queue+" if overlap else "") + "disaggregation queues",
                default=False,
                note=f"SGLang's PD-disaggregation {role} loop"
                     f"{' with overlap' if overlap else ''} (fake KV transfer backend)"))


# What stops the pipeline loops (docs/contract.md, "Not driven: the pipeline loops").
_PIPELINE = (
    "pp_size=2 needs two Scheduler processes, one per pipeline stage, joined by "
    "torch.distributed: a single rank waits forever in the c10d TCP rendezvous "
    "(init_distributed_environment, distributed/parallel_state.py:2517, via "
    "distributed/bootstrap.py:322 from managers/scheduler.py:536; before it, on a CPU "
    "with fewer NUMA nodes than ranks, utils/numa_utils.py:463 asserts unless "
    "SGLANG_CPU_OMP_THREADS_BIND is set), and a first stage whose forward returns "
    "PPProxyTensors (managers/tp_worker.py:674, :766-774); a run here is one "
    "Scheduler in one process")
_PDMUX = (
    "enable_pdmux partitions a CUDA GPU's SMs into stream groups when the Scheduler is "
    "built (managers/scheduler.py:552 -> multiplex/pdmux_context.py:105 imports "
    "sgl_kernel.spatial, :114 torch.cuda.current_device()); this machine has no CUDA "
    "device and no sgl_kernel (ModuleNotFoundError: No module named 'sgl_kernel')")


def _register_unsupported_loops() -> None:
    """The loops SGLang's dispatch enters that cannot run here: registered so that
    asking for one is a set-up refusal naming SGLang's requirement."""
    for name, function, reason in (
            ("pp", "event_loop_pp", _PIPELINE),
            ("pp-disagg-prefill", "event_loop_pp_disagg_prefill", _PIPELINE),
            ("pp-disagg-decode", "event_loop_pp_disagg_decode", _PIPELINE),
            ("pdmux", "event_loop_pdmux", _PDMUX)):
        register(LoopSpec(name, CANDIDATE, function, disable_overlap_schedule=True,
                          default=False, unsupported=reason,
                          note=f"SGLang's {function} (not drivable here)"))


_register_disaggregation_loops()
_register_unsupported_loops()
register(LoopSpec("omni", CANDIDATE, "event_loop_async_decode", family=OMNI, sglang="0.5.22",
                  in_flight="async_pending", default=False,
                  # a pinned loop's note names the pin (it is the set-up error's text)
                  note="sglang-omni 0.1.9, built on sglang 0.5.22"))
