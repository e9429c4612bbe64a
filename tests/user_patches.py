"""Patches written outside the package, as a triager would: ``user_patches:NAME``.

The fault patches (``*_in_loop``) wrap ``Scheduler.get_next_batch_to_run`` (called once
per scheduling iteration by every loop) and misbehave on its 4th call, i.e. inside the
loop, after frames exist; each of the others says what it changes.
"""

import os
import signal
import time

from sglang.srt.managers.scheduler import Scheduler

FAULT_AT_CALL = 4


def _on_call(action):
    original = Scheduler.get_next_batch_to_run
    calls = [0]

    def get_next_batch_to_run(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == FAULT_AT_CALL:
            action()
        return original(self, *args, **kwargs)

    Scheduler.get_next_batch_to_run = get_next_batch_to_run


def raise_in_loop():
    def action():
        raise RuntimeError("injected fault in get_next_batch_to_run")

    _on_call(action)


def segfault_in_loop():
    _on_call(lambda: os.kill(os.getpid(), signal.SIGSEGV))


def hang_in_loop():
    _on_call(lambda: time.sleep(3600))


def stale_forward_iter():
    """A suspected change a triager might try: stamp forward_iter before the advance."""
    from contract_lib.patches.builtin import patch_source

    patch_source(Scheduler, "run_batch", [
        ("batch.forward_iter = self.forward_ct\n",
         "batch.forward_iter = self.forward_ct - 1\n"),
    ], "stale-forward-iter")


def undo_stub_backport():
    """Remove contract_lib's backport of ``MlxModelRunnerStub.logical_max_total_num_tokens``
    (0.5.21 lacks it): the run then meets 0.5.21's startup bug."""
    from sglang.srt.hardware_backend.mlx.model_runner_stub import MlxModelRunnerStub

    del MlxModelRunnerStub.logical_max_total_num_tokens


def overlap_off_after_build():
    """Turn the overlap flag off once the Scheduler is built (as a PD or platform hook
    might): SGLang's dispatch then enters another loop than the one asked for."""
    original = Scheduler.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.enable_overlap = False

    Scheduler.__init__ = __init__


def print_a_lot():
    """Write 100 MB of lines and a last line to stdout (the run's log), then raise."""
    def action():
        line = b"x" * 1023 + b"\n"
        for _ in range(100):
            os.write(1, line * 1024)
        os.write(1, b"the last line of a chatty child\n")
        raise RuntimeError("after a lot of output")

    _on_call(action)


def omni_forward_raises():
    """sglang-omni: the (model-free) decode forward raises; OmniScheduler catches it,
    aborts the batch's requests and carries on (``handle_batch_failure``)."""
    from sglang_omni.model_runner.base import ModelRunner

    def custom_decode_forward(self, *args, **kwargs):
        raise RuntimeError("injected decode failure")

    ModelRunner.custom_decode_forward = custom_decode_forward


def own_loop():
    """Replace SGLang's dispatch: ``run_event_loop`` runs ``event_loop_normal``'s body
    through the class, bypassing every ``event_loop_*`` method of the instance, whatever
    loop was asked for (a replacement loop that is not SGLang's)."""
    body = Scheduler.event_loop_normal

    def run_event_loop(self):
        return body(self)

    Scheduler.run_event_loop = run_event_loop


def relay_reader_raises():
    """Rebind ``resolve_forward_inputs`` where the scheduler module and the MLX mixin call
    it, to a reader that raises: the capture must wrap the patched binding, not put
    SGLang's own back."""
    from sglang.srt.hardware_backend.mlx import scheduler_mixin
    from sglang.srt.managers import scheduler as scheduler_module

    def resolve_forward_inputs(batch, future_map):
        raise RuntimeError("the patched relay reader ran")

    scheduler_module.resolve_forward_inputs = resolve_forward_inputs
    scheduler_mixin.resolve_forward_inputs = resolve_forward_inputs


def _surviving_normal_loop(survived: type) -> None:
    """``event_loop_normal`` rewritten as a loop that logs and survives every error of
    type ``survived`` its iterations raise (as production loops may)."""
    import logging

    log = logging.getLogger(__name__)

    def event_loop_normal(self):
        while True:
            try:
                self.ingest_requests()
                plan = self.get_next_batch_to_run(running_batch=self.running_batch,
                                                  last_batch=self.last_batch)
                self.running_batch = plan.running_batch
                batch = plan.batch_to_run
                if batch:
                    self.process_batch_result(batch, self.run_batch(batch))
                else:
                    self.on_idle()
                self.last_batch = batch
            except survived:
                log.exception("the step failed; carrying on")

    Scheduler.event_loop_normal = event_loop_normal


def survive_exceptions():
    _surviving_normal_loop(Exception)


def survive_everything():
    _surviving_normal_loop(BaseException)


def leak_on_finish():
    """A finished request's KV row is never released (the result processor's call of
    ``release_kv_cache`` does nothing): the last request's leak is past SGLang's own idle
    check, which the run's end comes before."""
    from sglang.srt.managers.scheduler_components import batch_result_processor

    batch_result_processor.release_kv_cache = lambda req, tree_cache, *, checkpoint: None


def relay_overwritten_after_stash():
    """``FutureMap.stash`` publishes, then overwrites the rows with token 7 (what a read
    then returns is not the token the forward made)."""
    from sglang.srt.managers.overlap_utils import FutureMap

    real = FutureMap.stash

    def stash(self, future_indices, payload, *args, **kwargs):
        out = real(self, future_indices, payload, *args, **kwargs)
        if future_indices.shape[0]:
            self.output_tokens_buf[future_indices] = 7
        return out

    FutureMap.stash = stash


def _restamp_launch_ts(stamp: str, name: str) -> None:
    """``run_batch`` stamps ``launch_ts`` with ``stamp`` instead of ``time.monotonic()``."""
    from contract_lib.patches.builtin import patch_source

    patch_source(Scheduler, "run_batch", [
        ("batch.launch_ts = time.monotonic()\n", f"batch.launch_ts = {stamp}\n")], name)


def frozen_launch_ts():
    """Every launch carries the first launch's stamp."""
    _restamp_launch_ts("self.__dict__.setdefault('_first_ts', time.monotonic())",
                       "frozen-launch-ts")


def wall_clock_launch_ts():
    """The launch is stamped from the wall clock, not the loop's monotonic clock."""
    _restamp_launch_ts("time.time()", "wall-clock-launch-ts")


def in_flight_elsewhere():
    """The overlap loop keeps its launched, unprocessed batches in a queue of its own, not
    in ``result_queue`` (which ``is_fully_idle``'s in-flight term reads)."""
    from contract_lib.patches.builtin import patch_source

    patch_source(Scheduler, "event_loop_overlap", [
        ("self.result_queue: Deque[", "self._held_results: Deque["),
        ("self.result_queue.popleft()", "self._held_results.popleft()"),
        ("self.result_queue.append(", "self._held_results.append(")], "in-flight-elsewhere")


def skip_some_decode_prepares():
    """Every third ``prepare_for_decode`` of a decode batch does nothing: the batch decodes
    again at the same position, its counters not advanced (the forward still runs)."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    real = ScheduleBatch.prepare_for_decode
    calls = [0]

    def prepare_for_decode(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] % 3 == 0 and self.forward_mode.is_decode():
            return None
        return real(self, *args, **kwargs)

    ScheduleBatch.prepare_for_decode = prepare_for_decode


def swap_decode_slots():
    """A decode batch's new slots are recorded in reversed request order: each row gets
    another request's slot, while the forward writes each request's KV to its own."""
    from sglang.srt.mem_cache import allocation

    from contract_lib.patches.builtin import patch_source

    patch_source(allocation, "alloc_for_decode_default", [
        ("(batch.req_pool_indices, locs), out_cache_loc.to(torch.int32)",
         "(batch.req_pool_indices, locs), out_cache_loc.flip(0).to(torch.int32)")],
        "swap-decode-slots")
    allocation.ALLOC_FOR_DECODE_FUNCS.clear()  # it holds the function as first looked up


def renamed_runner_keeps_caches():
    """The MLX worker holds its runner as ``_mlx_engine`` (a name not ending in
    ``runner``), and the runner keeps a removed request's cache: a leak only the runner's
    own structure shows (clause 7)."""
    from sglang.srt.hardware_backend.mlx import model_runner, tp_worker

    def get(worker):
        try:
            return worker.__dict__["_mlx_engine"]
        except KeyError:
            raise AttributeError("_mlx_runner") from None

    def set_(worker, runner):
        worker.__dict__["_mlx_engine"] = runner

    tp_worker.MlxTpModelWorker._mlx_runner = property(get, set_)
    runner_class = model_runner.MlxModelRunner  # as the worker will build it
    real_remove = runner_class.remove_request

    def remove_request(runner, req_id):
        kept = runner._req_caches.get(req_id)
        real_remove(runner, req_id)
        if kept is not None:
            runner._req_caches[req_id] = kept

    runner_class.remove_request = remove_request


def launch_ts_at_processing():
    """The overlap loop stamps each batch again just before its result is processed:
    increasing, on the loop's clock, but not the time of its launch."""
    from sglang.srt.managers.scheduler import Scheduler

    from contract_lib.patches.builtin import patch_source

    patch_source(Scheduler, "event_loop_overlap", [
        ("            self.process_batch_result(tmp_batch, tmp_result)\n",
         "            tmp_batch.launch_ts = time.monotonic()\n"
         "            self.process_batch_result(tmp_batch, tmp_result)\n")],
        "launch-ts-at-processing")


def relay_reader_flipped():
    """The relay reader gathers a decode batch's rows in reverse order when it has two or
    more requests: each request is fed another request's token (the rows themselves hold
    what was published)."""
    from sglang.srt.hardware_backend.mlx import scheduler_mixin
    from sglang.srt.managers import scheduler as scheduler_module

    scheduler_module.resolve_forward_inputs = _flipped_reader()
    scheduler_mixin.resolve_forward_inputs = scheduler_module.resolve_forward_inputs


def _flipped_reader():
    """``resolve_forward_inputs``, but a decode batch of two or more requests gathers its
    relay rows in reverse order (each request fed another's token)."""
    from sglang.srt.managers import overlap_utils

    real = overlap_utils.resolve_forward_inputs

    def resolve_forward_inputs(batch, future_map):
        if (batch.prefill_input_ids_cpu is None and batch.input_ids is None
                and future_map.spec_algo.is_none() and len(batch.reqs) >= 2):
            batch.input_ids = future_map.output_tokens_buf[batch.req_pool_indices.flip(0)]
            return None
        return real(batch, future_map)

    return resolve_forward_inputs


def _replace_relay_reader_calls(call: str) -> None:
    """Every loop's ``resolve_forward_inputs(batch, self.future_map)`` call made as
    ``call`` instead (the torch ``run_batch`` and the MLX loop), recompiled in place."""
    import inspect
    import linecache
    import textwrap

    from sglang.srt.hardware_backend.mlx import scheduler_mixin
    from sglang.srt.managers.scheduler import Scheduler

    for owner, name in ((Scheduler, "run_batch"),
                        (scheduler_mixin.SchedulerMlxOverlapMixin, "event_loop_overlap_mlx")):
        function = inspect.unwrap(inspect.getattr_static(owner, name))
        source = textwrap.dedent(inspect.getsource(function)).replace(
            "resolve_forward_inputs(batch, self.future_map)", call)
        filename = f"<{call} in {name}>"
        # Its source stays readable, so a built-in fix can still patch it afterwards.
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        defined: dict = {}
        exec(compile(source, filename, "exec",  # noqa: S102
                     flags=__import__("__future__").annotations.compiler_flag,
                     dont_inherit=True), inspect.getmodule(function).__dict__, defined)
        setattr(owner, name, defined[name])


def relay_reader_on_future_map():
    """The relay reader moved onto ``FutureMap`` (a refactor): every loop that called
    ``resolve_forward_inputs(batch, self.future_map)`` calls ``self.future_map.resolve(batch)``,
    which reaches the reader through its defining module, not the loops' own bindings."""
    from sglang.srt.managers import overlap_utils

    overlap_utils.FutureMap.resolve = (
        lambda self, batch: overlap_utils.resolve_forward_inputs(batch, self))
    _replace_relay_reader_calls("self.future_map.resolve(batch)")


def relay_gathered_inline():
    """``run_batch`` gathers a decode batch's relay rows itself (no call of the reader),
    in reverse order when it has two or more requests: each request is fed another
    request's token; other batches go through the reader as before."""
    from sglang.srt.managers import scheduler as scheduler_module

    scheduler_module.gather_inputs = _flipped_reader()
    _replace_relay_reader_calls("gather_inputs(batch, self.future_map)")


def idle_in_flight_term_only_by_default():
    """``is_fully_idle`` keeps its in-flight term only for a plain call: the health check
    (``for_health_check``) and the flush (``ignore_waiting``) are told idle while a job
    is in ``result_queue``."""
    from sglang.srt.managers.scheduler import Scheduler

    from contract_lib.patches.builtin import patch_source

    patch_source(Scheduler, "is_fully_idle", [
        ("(not self.enable_overlap or len(self.result_queue) == 0)",
         "(not self.enable_overlap or ignore_waiting or for_health_check"
         " or len(self.result_queue) == 0)")], "idle-term-default-only")


def idle_flag_of_one_caller():
    """A new ``is_fully_idle`` flag that only the memory release passes drops the
    in-flight term: that caller is told idle with a job in ``result_queue``, while the
    plain call, the health check and the flush still hear busy."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components import weight_updater

    from contract_lib.patches.builtin import patch_source

    patch_source(Scheduler, "is_fully_idle", [
        ("def is_fully_idle(self, for_health_check=False, ignore_waiting=False) -> bool:\n",
         "def is_fully_idle(self, for_health_check=False, ignore_waiting=False,\n"
         "                  for_memory_release=False) -> bool:\n"),
        ("(not self.enable_overlap or len(self.result_queue) == 0)",
         "(not self.enable_overlap or for_memory_release or len(self.result_queue) == 0)"),
    ], "idle-flag-of-one-caller")
    patch_source(weight_updater.SchedulerWeightUpdaterManager, "release_memory_occupation", [
        ("ignore_waiting=scheduler is not None and scheduler._engine_paused\n",
         "ignore_waiting=scheduler is not None and scheduler._engine_paused,\n"
         "for_memory_release=True,\n")], "idle-flag-of-one-caller")


def checkpoint_swaps_last_two():
    """Before each radix insert (``checkpoint``) the request's last two slots up to the
    insert point trade places in its row: the set of slots is the same (the pool
    balances) and the positions move inside the protected prefix, but each of the two
    now names the other position's KV."""
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    for cls in (RadixCache, UnifiedRadixCache):
        real = cls.checkpoint

        def checkpoint(self, req, *, up_to, _real=real, **kwargs):
            start = req.kv.cache_protected_len
            if up_to - start >= 2:
                row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
                first, second = int(row[up_to - 2]), int(row[up_to - 1])
                row[up_to - 2], row[up_to - 1] = second, first
            return _real(self, req, up_to=up_to, **kwargs)

        cls.checkpoint = checkpoint


def truncated_finish_insert():
    """A finished request's radix insert stops two positions short of what it committed:
    its counters are right, the pool balances (the tail is freed), and a later turn with
    its prefix prefills those positions again."""
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    for cls in (RadixCache, UnifiedRadixCache):
        real = cls.checkpoint

        def checkpoint(self, req, *, up_to, _real=real, **kwargs):
            if req.finished():
                up_to = max(req.kv.cache_protected_len, up_to - 2)
            return _real(self, req, up_to=up_to, **kwargs)

        cls.checkpoint = checkpoint


def radix_keys_skip_first_output():
    """The radix insert keys a request's KV by its prompt and its output ids from the
    second one on (an off-by-one slice): the slots and the protected length are right
    (the pool balances), the keys past the prompt are each the next position's token,
    so a later turn matches only the prompt and prefills the rest again."""
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from contract_lib.patches.builtin import patch_source

    for cls, name in ((RadixCache, "checkpoint"), (UnifiedRadixCache, "checkpoint_into_tree")):
        patch_source(cls, name, [
            ("token_ids = req.full_untruncated_fill_ids[:up_to]\n",
             "token_ids = (req.origin_input_ids + req.output_ids[1:])[:up_to]\n")],
            "radix-keys-skip-first-output")


def mlx_prefill_ids_from_the_first_lane():
    """The MLX worker slices each request's prefill ids out of the batch's ``input_ids``
    without advancing past the lanes before it: every request of a multi-request extend
    batch is fed the first request's prompt (its slots, lengths and counters right)."""
    from sglang.srt.hardware_backend.mlx.tp_worker import MlxTpModelWorker

    from contract_lib.patches.builtin import patch_source

    patch_source(MlxTpModelWorker, "_async_extend_batch", [
        ("req_token_ids = input_ids_cpu[offset : offset + seq_len]\n",
         "req_token_ids = input_ids_cpu[0:seq_len]\n")],
        "mlx-prefill-ids-from-the-first-lane")


def retraction_recounts_the_cache_hit():
    """SGLang #11900 reintroduced: a retracted request's re-prefill adds its radix hit
    to ``cached_tokens`` again (users saw more cached tokens than the prompt had)."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    from contract_lib.patches.builtin import patch_source

    patch_source(ScheduleBatch, "prepare_for_extend", [
        ("            if not req.retracted_stain:\n",
         "            if True:  # #11900 reintroduced\n")],
        "retraction-recounts-the-cache-hit")


def chunks_counted_as_cache_hits():
    """SGLang #2555 reintroduced: each later prefill chunk counts the request's own
    earlier chunks as cached tokens (the cache hit rate of chunked prompts inflated)."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    from contract_lib.patches.builtin import patch_source

    patch_source(ScheduleBatch, "prepare_for_extend", [
        ("                new_cached = pre_len - req.already_computed\n",
         "                new_cached = pre_len\n")],
        "chunks-counted-as-cache-hits")


def cache_hit_counted_one_high():
    """A radix hit counted one token high (``cached_tokens`` = matched + 1 when anything
    matched): within the prompt, counted once, above the reuse the tree allowed."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    from contract_lib.patches.builtin import patch_source

    patch_source(ScheduleBatch, "prepare_for_extend", [
        ("                new_cached = pre_len - req.already_computed\n",
         "                new_cached = pre_len - req.already_computed + (pre_len > 0)\n")],
        "cache-hit-counted-one-high")


def length_before_stop():
    """SGLang #17487 reintroduced: the finish checks test ``max_new_tokens`` before the
    stop token and EOS, so a stop landing as the last allowed token ends the request by
    length and is not trimmed (the client gets the EOS)."""
    from sglang.srt.managers.schedule_batch import Req

    from contract_lib.patches.builtin import patch_source

    patch_source(Req, "update_finish_state", [(
        "        new_accepted_tokens = self.output_ids[-new_accepted_len:]\n",
        "        new_accepted_tokens = self.output_ids[-new_accepted_len:]\n"
        "        if len(self.output_ids) >= self.sampling_params.max_new_tokens:\n"
        "            self.finished_reason = FINISH_LENGTH(\n"
        "                length=self.sampling_params.max_new_tokens\n"
        "            )\n"
        "            self.finished_len = self.sampling_params.max_new_tokens\n"
        "            return\n")], "length-before-stop")


def middle_chunk_not_counted():
    """sgl-project/sglang-jax #971, ported: the in-flight middle-chunk counter is armed
    only when a chunked request starts, not for each continuing chunk, so with three or
    more chunks a middle chunk's result is processed as the last prefill (a token from
    half a prompt)."""
    from sglang.srt.managers.scheduler import Scheduler

    from contract_lib.patches.builtin import patch_source

    patch_source(Scheduler, "_get_new_batch_prefill_raw", [(
        "self.chunked_req.inflight_middle_chunks += 1",
        "self.chunked_req.inflight_middle_chunks += int(adder.new_chunked_req is not None)",
    )], "middle-chunk-not-counted")


def mlx_release_skips_the_sync():
    """SGLang before #30147's fix: the MLX worker frees a finished request's row without
    the runner's release sync, so its decode KV never reaches the pool, and a later
    radix hit reads positions nothing wrote (the real runner's outputs change)."""
    from sglang.srt.hardware_backend.mlx.tp_worker import MlxTpModelWorker

    from contract_lib.patches.builtin import patch_source

    patch_source(MlxTpModelWorker, "prepare_for_kv_cache_release", [
        ("self._mlx_runner.release_request_row(req.rid, req.owned_kv_len())", "pass")],
        "mlx-release-skips-the-sync")


def _python_tree_core() -> None:
    """Select SGLang's Python TreeCore for the radix tree (what every non-Linux host, e.g.
    Apple Silicon under MLX, runs; Linux defaults to the Rust one)."""
    import os

    os.environ["SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"] = "python"


def radix_match_one_token_long():
    """The radix match's search counts the first diverging token as matched (``hi``,
    not ``lo``): a prompt that diverges from a cached one is served the KV the other
    request computed for its own token at that position."""
    from sglang.srt.mem_cache import radix_cache

    from contract_lib.patches.builtin import patch_source

    _python_tree_core()
    patch_source(radix_cache.RadixKey, "match_at", [
        ("                matched_tokens = lo\n", "                matched_tokens = hi\n"),
    ], "radix-match-one-token-long")


def radix_match_page_ceil():
    """A paged radix match rounds the matched length up to whole pages: a page that only
    partly matches is served from the tree, its tail the other prompt's KV."""
    from sglang.srt.mem_cache import radix_cache

    from contract_lib.patches.builtin import patch_source

    _python_tree_core()
    patch_source(radix_cache.RadixKey, "match_at", [
        ("        return (matched_tokens // page_size) * page_size\n",
         "        return min(-(-matched_tokens // page_size) * page_size,\n"
         "                   len(self) // page_size * page_size,\n"
         "                   (len(other) - offset) // page_size * page_size)\n"),
    ], "radix-match-page-ceil")


def python_tree_core():
    """No bug: the Python TreeCore alone (the baseline of the two patches above)."""
    _python_tree_core()


class _PenaltyState:
    """A per-request store one level below the runner (``runner._penalty.by_rid``)."""

    def __init__(self) -> None:
        self.by_rid: dict = {}


def nested_state_kept_on_abort():
    """The MLX runner keeps a per-request penalty state in an object it holds (one level
    below its own attributes), filled at each prefill and dropped at release except for
    an aborted request: the aborted request's entry stays."""
    from sglang.srt.hardware_backend.mlx import model_runner, tp_worker

    runner = model_runner.MlxModelRunner
    real_finalize = runner.prefill_finalize

    def store(self):
        if "_penalty" not in self.__dict__:
            self._penalty = _PenaltyState()
        return self._penalty.by_rid

    def prefill_finalize(self, pending, *args, **kwargs):
        out = real_finalize(self, pending, *args, **kwargs)
        store(self)[pending.req_id] = list(self._req_token_ids.get(pending.req_id, ()))
        return out

    worker = tp_worker.MlxTpModelWorker
    real_prepare = worker.prepare_for_kv_cache_release

    def prepare_for_kv_cache_release(self, req):
        if req.finished_reason is None or req.finished_reason.to_json().get("type") != "abort":
            store(self._mlx_runner).pop(req.rid, None)
        return real_prepare(self, req)

    runner.prefill_finalize = prefill_finalize
    worker.prepare_for_kv_cache_release = prepare_for_kv_cache_release


def stale_rids_kept_by_the_runner():
    """The MLX worker's stale-request cleanup no longer tells its runner: requests that
    left the batch keep their runner caches (clause 7, already violated on the MLX loop,
    gets worse)."""
    from sglang.srt.hardware_backend.mlx.tp_worker import MlxTpModelWorker

    from contract_lib.patches.builtin import patch_source

    patch_source(MlxTpModelWorker, "_cleanup_stale_rids", [
        ("self._mlx_runner.remove_request(rid)\n", "pass\n")], "stale-rids-kept")


def row_kept_on_last_finish():
    """``ReqToTokenPool.free`` forgets the last request's row (``a2`` on two-turn): the
    request looks released (no ``req_pool_idx``) but its row never returns to the free
    list. SGLang's idle check would raise, but the workload is done before it runs."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    real_free = ReqToTokenPool.free

    def free(self, req, *args, **kwargs):
        if getattr(req, "rid", None) == "a2":
            req.kv.req_pool_idx = None
            return None
        return real_free(self, req, *args, **kwargs)

    ReqToTokenPool.free = free


def finish_after_two_tokens():
    """Every request finishes by length after two tokens, whatever its budget (the
    finish reason and its length agree with each other, not with the request)."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req

    real = Req.update_finish_state

    def update_finish_state(self, new_accepted_len=1):
        if not self.finished() and len(self.output_ids) >= 2:
            self.finished_reason, self.finished_len = FINISH_LENGTH(length=2), 2
            return None
        return real(self, new_accepted_len)

    Req.update_finish_state = update_finish_state


def request_c_never_scheduled():
    """Request ``c`` is marked finished (by length, no token) instead of being queued."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.managers.scheduler import Scheduler

    real = Scheduler._add_request_to_queue

    def _add_request_to_queue(self, req, *args, **kwargs):
        if req.rid == "c":
            req.finished_reason = FINISH_LENGTH(length=0)
            return None
        return real(self, req, *args, **kwargs)

    Scheduler._add_request_to_queue = _add_request_to_queue


def prompt_loses_its_last_token():
    """Each prompt loses its last token when it is queued."""
    from sglang.srt.managers.scheduler import Scheduler

    real = Scheduler._add_request_to_queue

    def _add_request_to_queue(self, req, is_retracted=False, *args, **kwargs):
        if not is_retracted and not getattr(req, "_truncated", False):
            req._truncated = True
            req.origin_input_ids = req.origin_input_ids[:-1]
        return real(self, req, is_retracted, *args, **kwargs)

    Scheduler._add_request_to_queue = _add_request_to_queue


def overlap_body_is_normal():
    """``event_loop_overlap`` runs the normal loop's body: SGLang's dispatch enters the
    overlap loop by name, with overlap on, and nothing ever overlaps."""
    from sglang.srt.managers.scheduler import Scheduler

    Scheduler.event_loop_overlap = Scheduler.event_loop_normal


def every_fourth_decode_processed_twice():
    """``process_batch_result`` handles every fourth decode result a second time (a
    result taken from the queue without being removed): its requests get the same tokens
    appended again, and every counter moves with them."""
    from sglang.srt.managers.scheduler import Scheduler

    real = Scheduler.process_batch_result
    decodes = [0]

    def process_batch_result(self, batch, result, *args, **kwargs):
        processed = real(self, batch, result, *args, **kwargs)
        if batch.forward_mode.is_decode():
            decodes[0] += 1
            if decodes[0] % 4 == 0:
                real(self, batch, result, *args, **kwargs)
        return processed

    Scheduler.process_batch_result = process_batch_result


def decode_tokens_to_the_wrong_lanes():
    """``process_batch_result`` gives a decode batch's tokens to its requests in reverse
    order (a result applied to the wrong lanes): each request continues another's text."""
    import torch
    from sglang.srt.managers.scheduler import Scheduler

    real = Scheduler.process_batch_result

    def process_batch_result(self, batch, result, *args, **kwargs):
        tokens = getattr(result, "next_token_ids", None)
        if (batch.forward_mode.is_decode() and isinstance(tokens, torch.Tensor)
                and len(tokens) > 1 and not getattr(result, "_reversed", False)):
            result.next_token_ids, result._reversed = tokens.flip(0), True
        return real(self, batch, result, *args, **kwargs)

    Scheduler.process_batch_result = process_batch_result


def stop_check_one_late():
    """The stop-token check reads the token before the newest (an off-by-one slice): a
    stop ends its request one step late, with one token more than the client asked."""
    from sglang.srt.managers.schedule_batch import Req

    from contract_lib.patches.builtin import patch_source

    patch_source(Req, "update_finish_state", [
        ("new_accepted_tokens = self.output_ids[-new_accepted_len:]\n",
         "new_accepted_tokens = self.output_ids[-new_accepted_len - 1:-1]\n")],
        "stop-check-one-late")


def abort_keeps_queued():
    """An abort of a queued request sends its abort output but leaves it in the waiting
    queue (``waiting_queue[i]``, not ``pop(i)``): it is served anyway, for a client told
    it was aborted."""
    from sglang.srt.managers.scheduler import Scheduler

    from contract_lib.patches.builtin import patch_source

    patch_source(Scheduler, "abort_request", [
        ("req = self.waiting_queue.pop(i)\n", "req = self.waiting_queue[i]\n")],
        "abort-keeps-queued")


def idle_gap_not_stamped():
    """Every launched batch is stamped as contiguous with the previous one
    (``after_idle_gap`` False; torch ``run_batch`` and the MLX launch): the step after an
    idle gap is timed with the gap in it."""
    from sglang.srt.hardware_backend.mlx.scheduler_mixin import SchedulerMlxOverlapMixin
    from sglang.srt.managers.scheduler import Scheduler

    def unstamped(real):
        def launch(self, batch, *args, **kwargs):
            launched = real(self, batch, *args, **kwargs)
            batch.after_idle_gap = False
            return launched
        return launch

    Scheduler.run_batch = unstamped(Scheduler.run_batch)
    for owner in (SchedulerMlxOverlapMixin, Scheduler):
        if "_prepare_mlx_launch" in vars(owner):
            owner._prepare_mlx_launch = unstamped(vars(owner)["_prepare_mlx_launch"])


def release_keeps_the_tree_lock():
    """``release_kv_cache`` gives the row back but never unlocks the request's tree node:
    a finished request's prefix stays protected, never evictable (under pressure the
    scheduler can no longer admit anything)."""
    import sys

    from sglang.srt.mem_cache import common

    from contract_lib.patches.builtin import patch_source

    original = common.release_kv_cache
    patch_source(common, "release_kv_cache", [("tree_cache.unlock(req.lock)\n", "pass\n")],
                 "release-keeps-the-tree-lock")
    for module in list(sys.modules.values()):  # the modules that imported it by name
        if (getattr(module, "__name__", "").startswith("sglang")
                and getattr(module, "release_kv_cache", None) is original):
            module.release_kv_cache = common.release_kv_cache


def evict_the_whole_need():
    """SGLang #32016, reintroduced: the allocator asks the radix tree to evict the whole
    allocation (``num_tokens``), not its shortfall past what is free: cached prefixes are
    thrown away under memory pressure for nothing."""
    from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator

    from contract_lib.patches.builtin import patch_source

    patch_source(BaseTokenToKVPoolAllocator, "evict_to_free_tokens", [
        ("tree_cache.evict_for_alloc(EvictParams(num_tokens=shortfall))\n",
         "tree_cache.evict_for_alloc(EvictParams(num_tokens=num_tokens))\n")],
        "evict-the-whole-need")


def evict_without_shortfall():
    """The allocator's shortfall forgets what is free (``shortfall = num_tokens``): every
    allocation evicts cached prefixes, even with the pool nearly empty."""
    from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator

    from contract_lib.patches.builtin import patch_source

    patch_source(BaseTokenToKVPoolAllocator, "evict_to_free_tokens", [
        ("shortfall = num_tokens - self.available_size()\n", "shortfall = num_tokens\n")],
        "evict-without-shortfall")


def retraction_not_counted():
    """``Req.reset_for_retract`` no longer counts the retraction: the request's
    ``num_retractions`` reads 0, and the MLX worker's ``_drop_state_if_retracted`` (keyed
    on the count) no longer sees it."""
    from sglang.srt.managers.schedule_batch import Req

    from contract_lib.patches.builtin import patch_source

    patch_source(Req, "reset_for_retract", [("self.retraction_count += 1\n", "pass\n")],
                 "retraction-not-counted")


def one_token_chunk_as_decode():
    """The MLX worker routes extend lanes by ``seq_len`` again (what
    ``_route_extend_request``'s docstring warns against): a last prefill chunk of one
    token runs as a decode lane, and the runner is fed its own stale prediction from the
    previous chunk instead of the prompt's last token (every later token is wrong)."""
    from sglang.srt.hardware_backend.mlx.tp_worker import MlxTpModelWorker

    from contract_lib.patches.builtin import patch_source

    patch_source(MlxTpModelWorker, "_async_extend_batch", [
        ("route = self._route_extend_request(req.rid, decoding_rids)\n",
         "route = self._route_extend_request(req.rid, decoding_rids)\n"
         "if route == \"continuation\" and seq_len == 1:\n"
         "    route = \"decode\"\n")], "one-token-chunk-as-decode")



def _clock_at_processing(extend_only: bool) -> None:
    """A loop-local clock bug on top of ``fix-processed-tokens-counter`` (apply it
    first): ``process_batch_result`` adds the batch's ``extend_num_tokens`` to the HRRN
    clock again (extend batches only, or every batch as the catalogued bug does)."""
    original = Scheduler.process_batch_result

    def process_batch_result(self, batch, result, *args, **kwargs):
        if batch.extend_num_tokens and (batch.forward_mode.is_extend() or not extend_only):
            self.processed_tokens_counter += batch.extend_num_tokens
        return original(self, batch, result, *args, **kwargs)

    Scheduler.process_batch_result = process_batch_result


def clock_counts_prefill_twice():
    _clock_at_processing(extend_only=True)


def clock_adds_every_batch():
    _clock_at_processing(extend_only=False)


# -- mutants of the PD-disaggregation batch builders --------------------------------------


def prebuilt_skips_the_relay_stash():
    """The decode side's prebuilt batch does not stash the hand-off token into the relay
    (``process_prebuilt``): the first decode reads a row nothing published."""
    from sglang.srt.disaggregation.decode_schedule_batch_mixin import (
        ScheduleBatchDisaggregationDecodeMixin,
    )

    from contract_lib.patches.builtin import patch_source

    patch_source(ScheduleBatchDisaggregationDecodeMixin, "process_prebuilt", [(
        "future_map.stash(\n"
        "    self.req_pool_indices, RelayPayload(bonus_tokens=last_tokens_tensor)\n"
        ")\n", "pass\n")], "prebuilt-skips-the-relay-stash")


def prebuilt_seq_lens_one_high():
    """``prepare_for_prebuilt`` counts the hand-off token's position as computed: the
    running batch's ``seq_lens`` lead the KV the transfer delivered by one."""
    from sglang.srt.disaggregation.decode_schedule_batch_mixin import (
        ScheduleBatchDisaggregationDecodeMixin,
    )

    from contract_lib.patches.builtin import patch_source

    patch_source(ScheduleBatchDisaggregationDecodeMixin, "prepare_for_prebuilt", [(
        "seq_len = len(req.origin_input_ids) + max(0, len(req.output_ids) - 1)\n",
        "seq_len = len(req.origin_input_ids) + len(req.output_ids)\n")],
        "prebuilt-seq-lens-one-high")


def idle_ignores_the_prealloc_queue():
    """``is_fully_idle`` forgets the decode side's preallocation queue."""
    from contract_lib.patches.builtin import patch_source

    patch_source(Scheduler, "is_fully_idle", [(
        "idle &= len(self.disagg_decode_prealloc_queue.queue) == 0\n", "")],
        "idle-ignores-the-prealloc-queue")


def prefill_first_token_shifted():
    """The prefill side commits the token after the one its forward sampled as the
    request's first (``process_batch_result_disagg_prefill``): the hand-off is wrong."""
    from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin

    from contract_lib.patches.builtin import patch_source

    patch_source(SchedulerDisaggregationPrefillMixin, "process_batch_result_disagg_prefill",
                 [("req.output_ids.append(next_token_id)\n",
                   "req.output_ids.append(next_token_id + 1)\n")],
                 "prefill-first-token-shifted")


def shutdown_after_three_results():
    """After the third ``process_batch_result`` the scheduler is asked to exit gracefully,
    as a ``ShutdownReq`` does (it only sets ``gracefully_exit``): a loop that checks the
    flag returns at its next iteration."""
    from sglang.srt.managers.scheduler import Scheduler

    real = Scheduler.process_batch_result

    def process_batch_result(self, batch, result, *args, **kwargs):
        out = real(self, batch, result, *args, **kwargs)
        self.results_processed = getattr(self, "results_processed", 0) + 1
        if self.results_processed == 3:
            self.gracefully_exit = True
        return out

    Scheduler.process_batch_result = process_batch_result


def lose_the_port_race_until_the_marker():
    """A run start draws ``$CONTRACT_LIB_TEST_TAKEN_PORT`` (a port the test holds) for
    torch's TCPStore, as a concurrent run's draw of SGLang's ``get_free_port`` can, until
    the file ``$CONTRACT_LIB_TEST_PORT_MARKER`` has ``$..._LOSSES`` lines (one per start)."""
    from sglang.srt.server_args import PortArgs

    marker = os.environ["CONTRACT_LIB_TEST_PORT_MARKER"]
    with open(marker, "a+") as starts:
        starts.seek(0)
        lost = len(starts.readlines())
        if lost >= int(os.environ["CONTRACT_LIB_TEST_PORT_LOSSES"]):
            return
        starts.write("lost\n")
    original = PortArgs.init_new

    def init_new(*args, **kwargs):
        port_args = original(*args, **kwargs)
        port_args.nccl_port = int(os.environ["CONTRACT_LIB_TEST_TAKEN_PORT"])
        return port_args

    PortArgs.init_new = staticmethod(init_new)
