"""The recorder of one run: the step boundary (feed, stop) and the outputs table, over
the parts it is built from (hooks, launch records, row writes, the step's snapshot)."""

from __future__ import annotations

from contract_lib.child.capture.hooks import HookInstaller
from contract_lib.child.capture.launches import LaunchRecorder
from contract_lib.child.capture.row_writes import RowWrites
from contract_lib.child.capture.snapshot import StepSnapshot
from contract_lib.child.capture.state import Emit, RunState
from contract_lib.child.families import family_of
from contract_lib.child.shims import abort_request
from contract_lib.loops import LoopSpec
from contract_lib.workloads import RequestSpec, Workload


def stop_ids(req) -> list[int]:
    """The token ids whose emission finishes ``req``, as SGLang's
    ``Req._check_token_based_finish`` reads them: its stop token ids, the model's EOS ids
    and the tokenizer's EOS and extra stop ids; none under ``ignore_eos``."""
    params = req.sampling_params
    if params.ignore_eos:
        return []
    ids = set(params.stop_token_ids or ()) | set(getattr(req, "eos_token_ids", None) or ())
    tokenizer = getattr(req, "tokenizer", None)
    if tokenizer is not None:
        if getattr(tokenizer, "eos_token_id", None) is not None:
            ids.add(tokenizer.eos_token_id)
        ids |= set(getattr(tokenizer, "additional_stop_token_ids", None) or ())
    return sorted(int(i) for i in ids)


class RunEnd(BaseException):
    """Ends the run from a step boundary, through the loop. A ``BaseException``, as
    ``KeyboardInterrupt`` is: a loop that survives its steps' errors (``except
    Exception``, as a production loop may) must still stop; as an ``Exception`` it was
    swallowed and such a run never ended."""


class StopRun(RunEnd):
    """Raised at a step boundary once the workload is done (every request finished)."""


class StepBudgetExceeded(RunEnd):
    """Raised at a step boundary past the workload's ``max_steps``."""


class Recorder:
    """Records frames of one run and streams them through ``emit`` as they are taken.

    Messages are ``("rows", [(table, row), ...], slots)`` (rows taken together, sent as
    soon as they are: a step boundary's whole frame, the relay rows of one read or
    write, a launch's row and its forward slots; ``slots`` holds ``(step, rid,
    req_pool_idx, [slot...], [free...], [written...])`` per live request) and
    ``("update", table, key, value, fields)``; nothing is buffered past the hook call
    that took it, so a dying child loses nothing taken.

    Built from parts over one declared :class:`~.state.RunState`: the hooks
    (:class:`~.hooks.HookInstaller`), the launch and relay records
    (:class:`~.launches.LaunchRecorder`), who wrote each ``req_to_token`` entry
    (:class:`~.row_writes.RowWrites`) and the step-boundary frame
    (:class:`~.snapshot.StepSnapshot`); it runs the step boundary itself (feed, stop).
    """

    def __init__(self, scheduler, loop_spec: LoopSpec, workload: Workload, emit: Emit,
                 capture: bool = True, audit: bool = False) -> None:
        self.state = RunState(scheduler=scheduler, loop=loop_spec.name, mlx=loop_spec.mlx,
                              family=family_of(loop_spec), workload=workload, emit=emit,
                              capture=capture)
        self.s = scheduler
        self.effects = None
        if audit:
            from contract_lib.child.effects import EffectsRecorder

            self.effects = EffectsRecorder()
        self.launches = LaunchRecorder(self.state)
        table = scheduler.req_to_token_pool.req_to_token
        row_writes = RowWrites(self.state, tuple(table.shape)) if capture else None
        self.snapshot = StepSnapshot(self.state, row_writes)
        self.hooks = HookInstaller(self.state, self.on_step_boundary, self.launches,
                                   row_writes, self.snapshot, self.effects)
        self.aborts_sent: set[str] = set()  # rids whose workload abort was fed
        self.ending: RunEnd | None = None  # raised at a step boundary: the run is over

    def install(self) -> None:
        self.hooks.install()

    def on_torch_launch(self, batch, tokens: list[int]) -> None:
        """Called by the torch model-free forward with the batch and the tokens it made."""
        self.launches.on_torch_launch(batch, tokens)

    # -- step boundary ----------------------------------------------------------------------

    def on_step_boundary(self) -> None:
        state = self.state
        if self.ending is not None:
            # The loop swallowed the run's end (``except BaseException``): end it again,
            # recording nothing more, until the hang check stops a loop that never lets go.
            raise type(self.ending)(*self.ending.args)
        state.step += 1
        if self.effects is not None:
            self.effects.active = False  # the capture's own reads and writes are not effects
            self._emit_effects()
        if state.capture:
            self.snapshot.take()
        state.family.check_errors(self.s)
        if self.done():
            self.ending = StopRun()
        elif state.step >= state.workload.max_steps:
            self.ending = StepBudgetExceeded(
                f"workload {state.workload.name!r} did not finish within its step budget "
                f"of {state.workload.max_steps} steps")
        if self.ending is not None:
            raise self.ending
        self.feed()
        if self.effects is not None:
            self.effects.step = state.step
            self.effects.active = True

    def _emit_effects(self) -> None:
        self.state.emit_rows([("effects", row) for row in self.effects.take(self.state.loop)])

    def done(self) -> bool:
        state, wanted = self.state, len(self.state.workload.requests)
        return (len(state.fed_prompts) == wanted
                and all(state.ended(req) for req in state.reqs.values())
                and len(state.reqs) == wanted
                and state.in_flight() == 0 and not state.family.queued(self.s))

    def feed(self) -> None:
        """Hand SGLang the requests due at this step, then the aborts due, each after
        its request, through the same ingress."""
        state = self.state
        for spec in state.workload.requests:
            self._feed_request(spec)
        for spec in state.workload.requests:
            if (spec.abort_at is not None and spec.abort_at <= state.step
                    and spec.rid in state.fed_prompts and spec.rid not in self.aborts_sent):
                self.s.request_receiver.pending.append(abort_request(spec.rid))
                self.aborts_sent.add(spec.rid)

    def _feed_request(self, spec: RequestSpec) -> None:
        state = self.state
        if spec.rid in state.fed_prompts or spec.arrival > state.step:
            return
        prompt = list(spec.prompt)
        if spec.turn_of is not None:
            parent = state.reqs.get(spec.turn_of)
            if parent is None or not state.ended(parent):
                return
            # The parent's prompt as fed, not its origin_input_ids: SGLang replaces those
            # of a request it rejects (``set_finish_with_abort``) with a placeholder.
            prompt = state.fed_prompts[spec.turn_of] + list(parent.output_ids) + prompt
        state.family.feed(self.s, spec, prompt, len(state.fed_prompts))
        state.fed_prompts[spec.rid] = prompt
        if state.capture:  # every prompt fed so far (clause 1 compares the slots' tokens)
            state.emit(("meta", {"prompts": dict(state.fed_prompts)}))

    def finish(self) -> None:
        """Emit the outputs table (called once, whatever ended the run)."""
        state = self.state
        if self.effects is not None:
            self.effects.active = False
            self._emit_effects()
        if not state.capture:
            return
        state.emit(("meta", {"stop_ids": {rid: stop_ids(req)
                                          for rid, req in state.reqs.items()}}))
        state.emit_rows([("outputs", (rid, index, int(token)))
                         for rid, req in state.reqs.items()
                         for index, token in enumerate(req.output_ids)])
