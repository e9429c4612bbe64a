"""The step-boundary frame: one ``steps`` row, a ``requests`` row per request, the live
rows' ``req_to_token`` entries, and the backend's per-request state, sent as one message."""

from __future__ import annotations

import collections
import contextlib
import time

from contract_lib.child.capture.backend_state import BackendStateRecorder
from contract_lib.child.capture.batches import NumpyView, free_slot_mask, mode_name
from contract_lib.child.capture.row_writes import RowWrites
from contract_lib.child.capture.state import RunState
from contract_lib.sources.compat import EmptyBatch, req_kv, uncached_sizes


class StepSnapshot:
    """Takes the step-boundary frame. ``row_writes``: who wrote each ``req_to_token``
    entry (the ``slots`` rows' ``written``)."""

    def __init__(self, state: RunState, row_writes: RowWrites | None) -> None:
        self.state = state
        self.s = state.scheduler
        self.row_writes = row_writes
        self.req_to_token_view = NumpyView()  # sliced in numpy, not torch
        self.invariant_checker = None  # SGLang's, found when the hooks go in
        self.idle_arguments: list[dict[str, bool]] = []  # is_fully_idle's flags, found then
        self.backend: BackendStateRecorder | None = None  # clause 7's reader, made then too

    def watch_backend(self) -> None:
        """Read the backend's attributes once, when the hooks go in (clause 7's table)."""
        self.backend = BackendStateRecorder(self.s)

    def take(self) -> None:
        s, state = self.s, self.state
        step = state.step
        running, last = s.running_batch, s.last_batch
        rows: list[tuple[str, tuple]] = []
        # Rows are tuples in the tables' column order (``frames.COLUMNS``).
        rows.append(("steps", (
            step, state.loop, s.forward_ct, state.in_flight(), bool(s.is_fully_idle()),
            self._idle_probe(), state.family.overlaps(s), bool(s.enable_overlap_mlx),
            0 if running is None else len(running.reqs), mode_name(running),
            mode_name(last), len(s.waiting_queue), *self._pool_terms(), *self._row_terms(),
            time.monotonic(), getattr(s, "processed_tokens_counter", None),
            state.family.queued(s))))
        seq_lens = self._seq_lens(running, last)
        rtt = self.req_to_token_view.of(s.req_to_token_pool.req_to_token)  # sliced in numpy
        free = None  # the free-slot mask, taken at the first live row
        slot_rows = []
        for index, (rid, req) in enumerate(self.state.reqs.items()):
            kv = req_kv(req)
            row = kv.req_pool_idx
            ended = self.state.ended(req)
            reason = (req.finished_reason.to_json() if req.finished_reason
                      else self.state.abort_outputs.get(rid, {}))
            rows.append(("requests", (
                step, rid, len(req.origin_input_ids), len(req.output_ids), ended, row,
                seq_lens.get(id(req)), self.state.kv_computed.get(rid), kv.kv_committed_len,
                kv.kv_allocated_len, kv.cache_protected_len, req.cached_tokens,
                reason.get("type"), reason.get("message"), req.retraction_count,
                getattr(req, "decode_batch_idx", None), self.state.kv_prefilled.get(rid),
                req.sampling_params.max_new_tokens,
                matched if type(matched := reason.get("matched")) is int else None,
                self._end_sent(rid, req))))
            if row is None or ended:
                continue
            if free is None:
                free = free_slot_mask(s.token_to_kv_pool_allocator)
            width = max(self.state.kv_computed.get(rid, 0), kv.kv_allocated_len)
            entries = rtt[row, :width]
            written = (self.row_writes.written_by[row, :width] == index).tolist()
            slot_rows.append((step, rid, row, entries.tolist(), free[entries].tolist(),
                              written))
        rows += [("backend_state", row) for row in self.backend.rows(step, self.state.reqs)]
        # One message: the step's frame, taken together (slots column-wise, expanded by
        # the parent into one row per position).
        self.state.emit(("rows", rows, slot_rows))

    def _end_sent(self, rid: str, req) -> bool | None:
        """Whether the request's end reached the client: ``stream_output`` sent its
        final output (``finished_output``), or an ``AbortReq`` output went for it. None
        (not recorded) where the release has no ``finished_output``, or the family streams
        outputs its own way (:attr:`~contract_lib.child.families.SGLangFamily.marks_sent`)."""
        if not self.state.family.marks_sent or not hasattr(req, "finished_output"):
            return None
        return bool(req.finished_output) or rid in self.state.abort_outputs  # None until sent

    def _idle_probe(self) -> bool:
        """``is_fully_idle`` with every term but the in-flight ones masked to idle, as each
        of its callers may ask (no arguments; each of its flags, such as the health
        check's ``for_health_check`` or the flush's ``ignore_waiting``, alone; all of
        them together): True when any of them says idle. The flags are tried only when
        the plain call says busy (work in flight). A PD-disaggregation loop's queues
        are asked about alone (and the overlap loop's ``result_queue`` alone), so one
        term cannot answer for the other; the health check is asked about those queues
        only for a decode side's retracted requests: SGLang leaves the others out of it
        by design (``managers/scheduler.py:5338-5342``, :5369), not those (:5361-5367)."""
        s, family = self.s, self.state.family
        everyone, queued = self.idle_arguments, family.queued(s)
        in_flight = self.state.in_flight()
        queue_callers = everyone if family.retracted(s) else [
            a for a in everyone if not a.get("for_health_check")]
        saved = (s.running_batch, s.last_batch, s.chunked_req, s.waiting_queue)
        try:
            s.running_batch = EmptyBatch()
            s.last_batch, s.chunked_req, s.waiting_queue = None, None, []
            if not queued:
                return self._says_idle(everyone)
            if not in_flight:
                return self._says_idle(queue_callers)
            with family.queues_emptied(s):
                queue_alone = self._says_idle(everyone)
            with self._masked_result_queue():
                return queue_alone or self._says_idle(queue_callers)
        finally:
            s.running_batch, s.last_batch, s.chunked_req, s.waiting_queue = saved

    def _says_idle(self, arguments: list[dict[str, bool]]) -> bool:
        """Whether ``is_fully_idle`` says idle plainly or with any of ``arguments``."""
        s = self.s
        return bool(s.is_fully_idle()) or any(bool(s.is_fully_idle(**a)) for a in arguments)

    @contextlib.contextmanager
    def _masked_result_queue(self):
        """The overlap loop's ``result_queue`` emptied for the time of a probe."""
        saved = self.s.result_queue
        self.s.result_queue = collections.deque()
        try:
            yield
        finally:
            self.s.result_queue = saved

    def find_idle_arguments(self) -> None:
        """Set ``idle_arguments``: the ways to call ``is_fully_idle`` other than plainly,
        read off its signature, not assumed: each flag (a parameter with a bool default)
        set to the other value alone, then all of them so set (a release or a patch may
        add a flag only one caller passes)."""
        import inspect

        parameters = inspect.signature(self.s.is_fully_idle).parameters.values()
        flags = {p.name: not p.default for p in parameters if isinstance(p.default, bool)
                 and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        self.idle_arguments = [{name: value} for name, value in flags.items()]
        if len(flags) > 1:
            self.idle_arguments.append(flags)

    def _pool_terms(self) -> tuple[int, int, int, int, int, bool]:
        """SGLang's own KV pool conservation terms (``InvariantChecker``), and its verdict:
        ``kv_total``, ``kv_available``, ``kv_evictable``, ``kv_protected``,
        ``kv_uncached``, ``pool_leak``; on a PD-disaggregation loop ``kv_uncached``
        also holds the KV of requests parked in its queues (:meth:`_disagg_parked_kv`)."""
        checker = self.invariant_checker
        stats = checker.pool_stats_observer.get_pool_stats()
        uncached = uncached_sizes(checker) + self._disagg_parked_kv()
        leak, _message = checker._check_full_pool(stats, uncached=uncached)
        return (int(self.s.max_total_num_tokens), int(stats.full_available_size),
                int(stats.full_evictable_size), int(self.s.tree_cache.protected_size()),
                int(uncached), bool(leak))

    def _disagg_parked_kv(self) -> int:
        """The KV a PD-disaggregation loop's parked requests hold (each its allocated
        length in whole pages less its radix-protected prefix, as SGLang's
        ``kv_private_tokens``, ``pool_stats_observer.py:31-32``): a term of the pool's
        conservation law SGLang's own checker does not see (``_requests_owning_rows``
        reads the batches only, ``invariant_checker.py:274``; SGLang runs that law on
        these loops only once fully idle). 0 on another loop."""
        page = self.s.token_to_kv_pool_allocator.page_size
        return sum(-(-req.kv.kv_allocated_len // page) * page - req.kv.cache_protected_len
                   for req in self.state.family.parked(self.s, waiting=True)
                   if req.kv.holds_kv)

    def _row_terms(self) -> tuple[int, int]:
        """SGLang's own ``req_to_token`` row counts, as its idle check
        (``_check_req_pool``) reads them: ``rows_free`` (free rows, plus rows sessions
        hold) and ``rows_total`` (the pool's rows, pre-allocation headroom included)."""
        pool, checker = self.s.req_to_token_pool, self.invariant_checker
        sessions = getattr(checker.pool_stats_observer, "session_held_req_count", None)
        return (len(pool.free_slots) + (sessions() if sessions else 0),
                int(pool.size + getattr(pool, "pre_alloc_size", 0)))

    def find_invariant_checker(self) -> None:
        """Set ``invariant_checker``: SGLang's ``SchedulerInvariantChecker``, the
        scheduler's own or, where the loop builds none (``omni``), one SGLang's
        ``init_invariant_checker`` builds over the scheduler's pools for the frames only:
        the attribute it sets is taken back at once, so nothing in the loop reads it,
        and the checker's getters read the scheduler directly at every step. Done once,
        when the hooks go in: sglang-omni answers a missing attribute by raising inside
        its ``__getattr__`` (~5 µs), and the build is set-up work, not the step's."""
        checker = getattr(self.s, "invariant_checker", None)
        if checker is None:
            from sglang.srt.managers.scheduler import Scheduler

            Scheduler.init_invariant_checker(self.s)
            checker = self.s.invariant_checker
            del self.s.invariant_checker
        self.invariant_checker = checker

    @staticmethod
    def _seq_lens(running, last) -> dict[int, int]:
        """``id(req)`` -> its ``seq_lens`` entry in the running batch, else in the last
        batch (requests in neither are absent)."""
        found: dict[int, int] = {}
        # After a decode step the running batch is the last batch: read it once.
        for batch in (running,) if last is running else (running, last):
            if batch is None or batch.is_empty() or batch.seq_lens is None:
                continue
            for req, seq_len in zip(batch.reqs, batch.seq_lens.tolist()):
                found.setdefault(id(req), seq_len)  # the first entry wins
        return found

