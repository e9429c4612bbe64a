"""The loop registry: one :class:`LoopSpec` per scheduler loop a run can drive.

Everything that varies by loop reads it from here — the harness (validation, the pinned
release, the server flag, the scheduler build, the event-loop function the run must
enter), the capture (how requests enter, where in-flight work waits), the contract
(clause 5's in-flight term), ``status``/``audit`` (which loops run by default, which are
the reference) and the CLI (``--loop`` choices). A new variant of an existing family
(torch, MLX or sglang-omni) is one :func:`register` call; a new family also names its
build in :mod:`contract_lib.child` and its ingress in :mod:`contract_lib.capture`.

Bottom floor: imports nothing from the package.
"""

from __future__ import annotations

import dataclasses

REFERENCE, CANDIDATE = "reference", "candidate"
# Families: how the scheduler is built and fed. ``sglang``: SGLang's own ``Scheduler``
# built by its ``__init__`` and fed through a scripted ``request_receiver``; ``omni``:
# sglang-omni's ``OmniScheduler`` (:mod:`contract_lib.omni`), fed through its inbox.
SGLANG, OMNI = "sglang", "omni"


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
    sglang: str | None = None  # the SGLang release the loop is pinned to, if any
    in_flight: str = "result_queue"  # where launched-but-unprocessed work waits (clause 5)
    default: bool = True  # ``status``/``audit`` run it when no loop is named
    note: str = ""

    @property
    def reference(self) -> bool:
        return self.role == REFERENCE

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


def dispatched_function(disable_overlap_schedule: bool, mlx: bool) -> str:
    """The event loop SGLang's ``run_event_loop`` dispatch enters for these settings."""
    if disable_overlap_schedule:
        return "event_loop_normal"
    return "event_loop_overlap_mlx" if mlx else "event_loop_overlap"


def loop_functions() -> dict[str, str]:
    """Loop name -> the event-loop function a run of it must enter."""
    return {n: s.function for n, s in LOOP_SPECS.items()}


register(LoopSpec("normal", REFERENCE, "event_loop_normal", disable_overlap_schedule=True,
                  note="SGLang's torch loop without overlap"))
register(LoopSpec("overlap", REFERENCE, "event_loop_overlap",
                  note="SGLang's torch overlap loop"))
register(LoopSpec("mlx", CANDIDATE, "event_loop_overlap_mlx", mlx=True,
                  note="SGLang's MLX overlap loop (the real mixin, on MLX's CPU backend)"))
register(LoopSpec("omni", CANDIDATE, "event_loop_async_decode", family=OMNI, sglang="0.5.22",
                  in_flight="async_pending", default=False,
                  # a pinned loop's note names the pin (it is the set-up error's text)
                  note="sglang-omni 0.1.9, built on sglang 0.5.22"))
