"""The recorder of one run: state, the step boundary (feed, stop), and the outputs table;
its hooks, launch records and snapshot are the three parts it is built from."""

from __future__ import annotations

import collections
from typing import Any, Callable

import numpy as np

from contract_lib.child.capture.batches import NumpyView
from contract_lib.child.capture.hooks import HookInstaller
from contract_lib.child.capture.launches import LaunchRecording
from contract_lib.child.capture.snapshot import StepSnapshot
from contract_lib.child.families import SGLangFamily, family_of
from contract_lib.child.shims import abort_request
from contract_lib.loops import LoopSpec
from contract_lib.workloads import RequestSpec, Workload

Emit = Callable[[tuple], None]


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


class Recorder(HookInstaller, LaunchRecording, StepSnapshot):
    """Records frames of one run and streams them through ``emit`` as they are taken.

    Messages are ``("rows", [(table, row), ...], slots)`` (rows taken together, sent as
    soon as they are: a step boundary's whole frame, the relay rows of one read or
    write, a launch's row and its forward slots; ``slots`` holds ``(step, rid,
    req_pool_idx, [slot...], [free...], [written...])`` per live request) and
    ``("update", table, key, value, fields)``; nothing is buffered past the hook call
    that took it, so a dying child loses nothing taken.
    """

    def __init__(self, scheduler, loop_spec: LoopSpec, workload: Workload, emit: Emit,
                 capture: bool = True, audit: bool = False) -> None:
        self.s = scheduler
        self.capture = capture
        self.effects = None
        if audit:
            from contract_lib.child.effects import EffectsRecorder

            self.effects = EffectsRecorder()
        self.loop = loop_spec.name
        self.mlx = loop_spec.mlx  # the MLX mixin's launch hooks and relay import
        # How the loop's scheduler is fed and where it keeps work between steps.
        self.family: SGLangFamily = family_of(loop_spec)
        self.handed_off: set[str] = set()  # decode side: requests whose KV was transferred
        self.workload = workload
        self.emit = emit
        self.step = -1
        self.reqs: dict[str, Any] = {}
        self.fed: set[str] = set()
        self.fed_prompts: dict[str, list[int]] = {}  # rid -> the prompt it was fed with
        self.kv_computed: dict[str, int] = {}
        self.latest_token: dict[str, int] = {}
        self.launch_ct = 0
        self.unprocessed: collections.deque[int] = collections.deque()
        self.relay_written: dict[int, tuple[int, str | None, int | None]] = {}
        self.reading = False  # inside a recorded relay read (its wrappers nest)
        # Per req_to_token entry: the registry index (in ``reqs`` order) of the request
        # that held the row when the entry was last written; -1 never written.
        self.written_by: np.ndarray | None = None
        self.invariant_checker = None  # SGLang's, found when the hooks go in
        self.idle_arguments: list[dict[str, bool]] = []  # is_fully_idle's flags, found then too
        # Numpy views of the tensors read every step (sliced without torch).
        self.req_to_token_view = NumpyView()
        self.relay_view = NumpyView()
        self.resolving: int | None = None  # omni: the launch being resolved
        # MLX: id(launch) -> (its number, its rids, the launch, kept alive) until its
        # result is finalized, and the tokens the runner produced in the finalize under way.
        self.mlx_unfinalized: dict[int, tuple[int, list[str], Any]] = {}
        self.produced: dict[str, int] = {}
        # Per request: kv_computed at the end of its last prefill/extend lane (clause 2's
        # decode_batch_idx counts the decode launches since).
        self.kv_prefilled: dict[str, int] = {}
        self.backend = None
        # Requests SGLang ended with an ``AbortReq`` output: rid -> its finished_reason.
        self.abort_outputs: dict[str, dict[str, Any]] = {}
        self.aborts_sent: set[str] = set()
        self.ending: RunEnd | None = None  # raised at a step boundary: the run is over
    # -- step boundary ----------------------------------------------------------------------

    def on_step_boundary(self) -> None:
        if self.ending is not None:
            # The loop swallowed the run's end (``except BaseException``): end it again,
            # recording nothing more, until the hang check stops a loop that never lets go.
            raise type(self.ending)(*self.ending.args)
        self.step += 1
        if self.effects is not None:
            self.effects.active = False  # the capture's own reads and writes are not effects
            self._emit_effects()
        if self.capture:
            self.snapshot()
        self.family.check_errors(self.s)
        if self.done():
            self.ending = StopRun()
        elif self.step >= self.workload.max_steps:
            self.ending = StepBudgetExceeded(
                f"workload {self.workload.name!r} did not finish within its step budget "
                f"of {self.workload.max_steps} steps")
        if self.ending is not None:
            raise self.ending
        self.feed()
        if self.effects is not None:
            self.effects.step = self.step
            self.effects.active = True

    def _emit_effects(self) -> None:
        self._emit_rows([("effects", row) for row in self.effects.take(self.loop)])

    def done(self) -> bool:
        return (len(self.fed) == len(self.workload.requests)
                and all(self.ended(req) for req in self.reqs.values())
                and len(self.reqs) == len(self.workload.requests)
                and self._in_flight() == 0 and not self.family.queued(self.s))

    def ended(self, req) -> bool:
        """Finished, or ended by an ``AbortReq`` output (SGLang pops a request aborted
        while queued without setting its ``finished_reason``)."""
        return bool(req.finished()) or req.rid in self.abort_outputs

    def _in_flight(self) -> int:
        """Launched steps not yet processed that the loop carries to its next iteration
        (SGLang's overlap loops' ``result_queue``; omni's lookahead step)."""
        return self.family.in_flight(self.s)

    def disagg_parked_kv(self) -> int:
        """The KV those parked requests hold (each its allocated length in whole pages
        less its radix-protected prefix, as SGLang's ``kv_private_tokens``,
        ``pool_stats_observer.py:31-32``): a term of the pool's conservation law SGLang's
        own checker does not see (``_requests_owning_rows`` reads the batches only,
        ``invariant_checker.py:274``; SGLang runs that law on these loops only once fully
        idle). 0 on another loop."""
        page = self.s.token_to_kv_pool_allocator.page_size
        return sum(-(-req.kv.kv_allocated_len // page) * page - req.kv.cache_protected_len
                   for req in self.family.parked(self.s, waiting=True) if req.kv.holds_kv)

    def _overlaps(self) -> bool:
        """Whether the loop can carry in-flight work."""
        return self.family.overlaps(self.s)

    def feed(self) -> None:
        """Hand SGLang the requests due at this step, then the aborts due, each after
        its request, through the same ingress."""
        for spec in self.workload.requests:
            self._feed_request(spec)
        for spec in self.workload.requests:
            if (spec.abort_at is not None and spec.abort_at <= self.step
                    and spec.rid in self.fed and spec.rid not in self.aborts_sent):
                self.s.request_receiver.pending.append(abort_request(spec.rid))
                self.aborts_sent.add(spec.rid)

    def _feed_request(self, spec: RequestSpec) -> None:
        if spec.rid in self.fed or spec.arrival > self.step:
            return
        prompt = list(spec.prompt)
        if spec.turn_of is not None:
            parent = self.reqs.get(spec.turn_of)
            if parent is None or not self.ended(parent):
                return
            # The parent's prompt as fed, not its origin_input_ids: SGLang replaces those
            # of a request it rejects (``set_finish_with_abort``) with a placeholder.
            prompt = self.fed_prompts[spec.turn_of] + list(parent.output_ids) + prompt
        self.family.feed(self.s, spec, prompt, len(self.fed))
        self.fed.add(spec.rid)
        self.fed_prompts[spec.rid] = prompt
        if self.capture:  # every prompt fed so far (clause 1 compares the slots' tokens)
            self.emit(("meta", {"prompts": dict(self.fed_prompts)}))

    def finish(self) -> None:
        """Emit the outputs table (called once, whatever ended the run)."""
        if self.effects is not None:
            self.effects.active = False
            self._emit_effects()
        if not self.capture:
            return
        self.emit(("meta", {"stop_ids": {rid: stop_ids(req) for rid, req in self.reqs.items()}}))
        self._emit_rows([("outputs", (rid, index, int(token)))
                         for rid, req in self.reqs.items()
                         for index, token in enumerate(req.output_ids)])
