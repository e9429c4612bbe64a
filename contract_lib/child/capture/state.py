"""What one run's recorder parts share, declared in one place: the run's registry of
requests, its counters and where its rows go. Each part keeps the rest of its state to
itself."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Callable

from contract_lib.child.families import SGLangFamily
from contract_lib.workloads import Workload

Emit = Callable[[tuple], None]


@dataclass(eq=False)
class RunState:
    """The state the recorder's parts (:mod:`.hooks`, :mod:`.launches`,
    :mod:`.snapshot`, :mod:`.row_writes`) read and write; set up by
    :class:`~contract_lib.child.capture.recorder.Recorder`."""

    scheduler: Any  # SGLang's ``Scheduler`` (sglang-omni's ``OmniScheduler``)
    loop: str  # the loop's name (``loops.LoopSpec.name``), a column of several tables
    mlx: bool  # the MLX loop: its launch hooks and relay import
    family: SGLangFamily  # how the scheduler is fed and where it keeps work between steps
    workload: Workload
    emit: Emit  # sends one message to the parent (nothing is buffered)
    capture: bool  # False: feed and stop only (the capture overhead's baseline)
    step: int = -1  # the step boundaries passed, less one
    reqs: dict[str, Any] = field(default_factory=dict)  # rid -> SGLang's Req, as admitted
    # rid -> the prompt it was fed with (its keys: the requests fed so far)
    fed_prompts: dict[str, list[int]] = field(default_factory=dict)
    # Per request: the KV positions computed (counted at each launch, not read off the
    # batch), that count at the end of its last prefill/extend lane (clause 2's
    # decode_batch_idx counts the decode launches since), and its latest token.
    kv_computed: dict[str, int] = field(default_factory=dict)
    kv_prefilled: dict[str, int] = field(default_factory=dict)
    latest_token: dict[str, int] = field(default_factory=dict)
    # Requests SGLang ended with an ``AbortReq`` output: rid -> its finished_reason.
    abort_outputs: dict[str, dict[str, Any]] = field(default_factory=dict)
    launch_ct: int = 0  # forward launches so far (a launch's number)
    # Launch numbers whose results are not processed yet, in launch order.
    unprocessed: collections.deque[int] = field(default_factory=collections.deque)
    resolving: int | None = None  # omni: the launch being resolved

    def emit_rows(self, taken: list[tuple[str, tuple | dict]]) -> None:
        """The rows one hook call took, in one message (sent before the call returns)."""
        if taken:
            self.emit(("rows", taken, []))

    def ended(self, req) -> bool:
        """Finished, or ended by an ``AbortReq`` output (SGLang pops a request aborted
        while queued without setting its ``finished_reason``)."""
        return bool(req.finished()) or req.rid in self.abort_outputs

    def in_flight(self) -> int:
        """Launched steps not yet processed that the loop carries to its next iteration
        (SGLang's overlap loops' ``result_queue``; omni's lookahead step)."""
        return self.family.in_flight(self.scheduler)
