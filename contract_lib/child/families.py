"""Loop families, in the run's process: how a family's scheduler is built, fed and
entered, and where it keeps work between steps. One object per family; the build
(:mod:`contract_lib.child.main`) and the capture (:mod:`contract_lib.child.capture`) ask
it and never test which family a loop is.

- :class:`SGLangFamily`: SGLang's own ``Scheduler`` (torch or MLX backend, by
  ``LoopSpec.mlx``) built by its ``__init__``, fed through a scripted
  ``request_receiver`` at its step boundary, entered by ``run_event_loop``.
- :class:`DisaggregationFamily`: the same scheduler as one side of PD disaggregation on
  SGLang's fake transfer backend; requests carry the router's bootstrap fields, and its
  queues (bootstrap, transfer, preallocation) hold requests outside any batch.
- :class:`OmniFamily`: sglang-omni's ``OmniScheduler`` (SGLang's scheduling methods on
  its own class), fed through its inbox, entered by ``start``; its in-flight work is its
  one-step lookahead.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

from contract_lib import loops
from contract_lib.wire.protocol import Unsupported
from contract_lib.workloads import RequestSpec, Workload

OnLaunch = Callable[[Any, list[int]], None]


class SGLangFamily:
    """SGLang's ``Scheduler`` (module docstring)."""

    # SGLang's ``stream_output`` marks a request whose final output it sent
    # (``Req.finished_output``).
    marks_sent = True

    def __init__(self, loop: loops.LoopSpec) -> None:
        self.loop = loop

    # -- the build ------------------------------------------------------------------------

    def refuse(self, workload: Workload) -> None:
        """Raise :class:`Unsupported` for a workload feature the family cannot take."""

    def install_shims(self, omni_dir: str | None, on_launch: OnLaunch) -> list[str]:
        """The family's fakes, before any patch runs; their names."""
        from contract_lib.child import shims

        shims.install_torch_model_free_forward(on_launch)
        return ["torch-model-free-forward"]

    def server_args(self) -> dict[str, Any]:
        """Server args the family sets (the workload's and the caller's come after)."""
        return {}

    def build(self, server_args, args: dict[str, Any], user_args: dict[str, Any],
              workload_args: dict[str, Any], applied: list[str],
              timing: dict[str, float]):
        """The scheduler, built by SGLang's own ``__init__`` (wall time into ``timing``)."""
        from sglang.srt.server_args import PortArgs, ServerArgs

        from contract_lib.child import shims
        from contract_lib.child.refusals import check_loop_args
        from contract_lib.sources import compat

        check_loop_args(self.loop, server_args, args, workload_args, user_args, ServerArgs)
        port_args = PortArgs.init_new(server_args)
        scheduler_class = shims.scheduler_class_for(self.loop.mlx)
        if scheduler_class.__name__ != "Scheduler":
            applied.append("mlx-overlap-mixin")
        built = time.perf_counter()
        try:
            scheduler = compat.build_scheduler(scheduler_class, server_args, port_args)
        finally:
            _remove_ipc_names(port_args)  # built, or failed in its build
        timing["build_s"] = time.perf_counter() - built
        scheduler.request_receiver = shims.ScriptedReceiver()
        applied.append("scripted-ingress")
        return scheduler

    def enter(self, scheduler) -> None:
        scheduler.run_event_loop()

    # -- the capture ----------------------------------------------------------------------

    def boundary(self, scheduler) -> tuple[object, str]:
        """The owner and name of the method each loop iteration calls first."""
        from contract_lib.sources.compat import step_boundary

        return step_boundary(scheduler)

    def watch_admissions(self, scheduler, admitted: Callable[[Any], None]) -> None:
        """Call ``admitted(req)`` for every request the scheduler takes in."""
        real = scheduler._add_request_to_queue

        def add_request_to_queue(req, *args, **kwargs):
            admitted(req)
            return real(req, *args, **kwargs)

        scheduler._add_request_to_queue = add_request_to_queue

    def install_hooks(self, hooks) -> None:
        """The family's own capture hooks, beside the shared ones."""

    def feed(self, scheduler, spec: RequestSpec, prompt: list[int], index: int) -> None:
        """Hand the scheduler request ``spec`` with ``prompt`` (the ``index``-th fed)."""
        from contract_lib.child.shims import tokenized_request

        scheduler.request_receiver.pending.append(tokenized_request(spec, prompt))

    def check_errors(self, scheduler) -> None:
        """Raise what the loop caught and only reported (nothing on SGLang's loops)."""

    def in_flight(self, scheduler) -> int:
        """Launched steps not yet processed that the loop carries to its next iteration."""
        return len(getattr(scheduler, "result_queue", ()) or ())

    def overlaps(self, scheduler) -> bool:
        """Whether the loop can carry in-flight work."""
        return bool(scheduler.enable_overlap)

    # -- requests held outside any batch (PD disaggregation's queues; none here) -----------

    def queued(self, scheduler) -> int | None:
        """Requests in the queues ``is_fully_idle`` reads beside the batches; None: none."""
        return None

    def retracted(self, scheduler) -> int:
        """Retracted requests waiting to resume in a queue."""
        return 0

    def parked(self, scheduler, waiting: bool) -> list:
        """The requests the loop keeps in its queues rather than in a batch."""
        return []

    @contextlib.contextmanager
    def queues_emptied(self, scheduler) -> Iterator[None]:
        """Those queues emptied for the time of an idle probe."""
        yield


class DisaggregationFamily(SGLangFamily):
    """One side of PD disaggregation on the fake transfer backend (module docstring)."""

    def __init__(self, loop: loops.LoopSpec) -> None:
        super().__init__(loop)
        self.role = loop.disaggregation  # loops.PREFILL or loops.DECODE

    def refuse(self, workload: Workload) -> None:
        turns = [r.rid for r in workload.requests if r.turn_of is not None]
        if self.role == loops.PREFILL and turns:
            raise Unsupported(
                f"loop {self.loop.name} does not take turn_of (request {turns[0]!r}): a "
                "later turn's prompt holds its parent's whole output, which a decode side "
                "produces; a prefill side emits only the first token (it sets "
                "max_new_tokens to 1, disaggregation/prefill.py:482), so the turn would be "
                "another request than on event_loop_normal; run it on a decode loop")

    def install_shims(self, omni_dir: str | None, on_launch: OnLaunch) -> list[str]:
        from contract_lib.child import shims

        return (super().install_shims(omni_dir, on_launch)
                + shims.install_disaggregation_shims(self.role))

    def server_args(self) -> dict[str, Any]:
        from contract_lib.child.shims import disaggregation_server_args

        return disaggregation_server_args(self.role)

    def install_hooks(self, hooks) -> None:
        if self.role == loops.DECODE:
            hooks.install_prebuilt_hook()

    def feed(self, scheduler, spec: RequestSpec, prompt: list[int], index: int) -> None:
        from contract_lib.child.shims import bootstrap_fields, tokenized_request

        scheduler.request_receiver.pending.append(
            tokenized_request(spec, prompt, **bootstrap_fields(self.role, index)))

    def queued(self, scheduler) -> int:
        """Prefill: its bootstrap and inflight (transfer) queues; decode: preallocation
        (and retracted) and transfer queues, and its held releases of transfers aborted
        midway (one, however many): what ``is_fully_idle`` reads
        (``managers/scheduler.py:5373-5381``)."""
        held = (scheduler.disagg_decode_transfer_queue.has_pending_deferred_releases()
                if self.role == loops.DECODE else False)
        return len(self.parked(scheduler, waiting=False)) + int(held)

    def retracted(self, scheduler) -> int:
        if self.role != loops.DECODE:
            return 0
        return len(scheduler.disagg_decode_prealloc_queue.retracted_queue)

    def parked(self, scheduler, waiting: bool) -> list:
        """Prefill: bootstrap, inflight; decode: preallocation, retracted, transfer, and
        with ``waiting`` its waiting queue, whose requests hold their transferred KV until
        a prebuilt batch admits them (``managers/scheduler.py:5357-5359``)."""
        s = scheduler
        if self.role == loops.PREFILL:
            return [*s.disagg_prefill_bootstrap_queue.queue, *s.disagg_prefill_inflight_queue]
        prealloc, transfer = s.disagg_decode_prealloc_queue, s.disagg_decode_transfer_queue
        return [*(d.req for d in prealloc.queue), *prealloc.retracted_queue,
                *(d.req for d in transfer.queue), *(s.waiting_queue if waiting else ())]

    @contextlib.contextmanager
    def queues_emptied(self, scheduler) -> Iterator[None]:
        """A decode side's held releases too: ``has_pending_deferred_releases`` reads that
        list."""
        s = scheduler
        if self.role == loops.PREFILL:
            holders = [(s.disagg_prefill_bootstrap_queue, "queue"),
                       (s, "disagg_prefill_inflight_queue")]
        else:
            prealloc, transfer = s.disagg_decode_prealloc_queue, s.disagg_decode_transfer_queue
            holders = [(prealloc, "queue"), (prealloc, "retracted_queue"),
                       (transfer, "queue"), (transfer, "_deferred_releases")]
        saved = [getattr(owner, name) for owner, name in holders]
        try:
            for owner, name in holders:
                setattr(owner, name, [])
            yield
        finally:
            for (owner, name), value in zip(holders, saved):
                setattr(owner, name, value)


class OmniFamily(SGLangFamily):
    """sglang-omni's ``OmniScheduler`` (module docstring; :mod:`contract_lib.child.omni_build`)."""

    # Its own ``stream_output`` sends a finished request to its outbox without marking it.
    marks_sent = False

    def refuse(self, workload: Workload) -> None:
        """Aborts and priorities go through SGLang's ingress (``AbortReq``, the request's
        ``priority``); sglang-omni's ingress is its inbox of pipeline messages, which
        this project does not script for them."""
        fields = [f for f in ("abort_at", "priority")
                  if any(getattr(r, f) is not None for r in workload.requests)]
        if fields:
            raise Unsupported(f"loop omni does not take {' or '.join(fields)}: aborts and "
                              "priorities are not scripted through sglang-omni's inbox "
                              "ingress; run this workload on normal, overlap or mlx")

    def install_shims(self, omni_dir: str | None, on_launch: OnLaunch) -> list[str]:
        from contract_lib.child import omni_build as omni

        return omni.install_shims(omni_dir, on_launch)

    def build(self, server_args, args: dict[str, Any], user_args: dict[str, Any],
              workload_args: dict[str, Any], applied: list[str],
              timing: dict[str, float]):
        """Its ``ModelWorker`` publishes the runtime context; no loop flag to check."""
        from contract_lib.child import omni_build as omni

        built = time.perf_counter()
        scheduler = omni.build_scheduler(server_args)
        timing["build_s"] = time.perf_counter() - built
        return scheduler

    def enter(self, scheduler) -> None:
        scheduler.start()  # OmniScheduler's entry (``run_event_loop`` would be SGLang's)

    def boundary(self, scheduler) -> tuple[object, str]:
        return scheduler, "recv_requests"

    def watch_admissions(self, scheduler, admitted: Callable[[Any], None]) -> None:
        """Its request builder appends to ``waiting_queue`` itself, not through
        ``_add_request_to_queue``."""
        real = scheduler.request_builder

        def request_builder(payload):
            data = real(payload)
            admitted(data.req)
            return data

        scheduler.request_builder = request_builder

    def install_hooks(self, hooks) -> None:
        hooks.install_omni_resolve_hook()

    def feed(self, scheduler, spec: RequestSpec, prompt: list[int], index: int) -> None:
        from contract_lib.child.shims import omni_request_message

        scheduler.inbox.put(omni_request_message(spec.rid, prompt, spec.sampling()))

    def check_errors(self, scheduler) -> None:
        """A request error sglang-omni reported ends the run (crashed). Its loop catches a
        failing batch (``run_batch``, ``handle_batch_failure``), aborts the batch's
        requests and carries on; the error only goes to the outbox for the next pipeline
        stage. Without this, a run whose forward raised would finish with aborted
        requests and hold every clause vacuously."""
        for message in list(scheduler.outbox.queue):
            if message.type == "error":
                error = message.data
                raise OmniRequestError(
                    f"sglang-omni reported an error for request {message.request_id!r}: "
                    f"{type(error).__name__}: {error}") from (
                        error if isinstance(error, BaseException) else None)

    def in_flight(self, scheduler) -> int:
        """Its one-step lookahead (``async_pending``)."""
        return int(scheduler.async_pending is not None)

    def overlaps(self, scheduler) -> bool:
        return bool(scheduler.enable_overlap or scheduler.enable_async_decode)


class OmniRequestError(RuntimeError):
    """sglang-omni put an error for a request into its outbox (a failed batch)."""


def family_of(loop: loops.LoopSpec) -> SGLangFamily:
    """The family object of ``loop``."""
    if loop.family == loops.OMNI:
        return OmniFamily(loop)
    if loop.disaggregation:
        return DisaggregationFamily(loop)
    return SGLangFamily(loop)


def _remove_ipc_names(port_args) -> None:
    """Remove the files behind the Scheduler's ``ipc://`` names, once it is built or its
    build failed: SGLang's ``PortArgs.init_new`` takes each name with
    ``NamedTemporaryFile(delete=False)`` and never removes it, so every run left five
    empty files in ``$TMPDIR`` (154,000 had piled up in this machine's /tmp). Its
    sockets are bound and connected by then, and no peer ever connects by name (the
    ingress is scripted, the outputs go nowhere), so the loop runs as before; removed
    here, in the run's process, they are gone even if the run or its requester is
    killed later."""
    import os

    for value in vars(port_args).values():
        if isinstance(value, str) and value.startswith("ipc://"):
            with contextlib.suppress(OSError):
                os.unlink(value.removeprefix("ipc://"))
