"""Patches: apply a change to the real SGLang code for one run, inside the child process.

A patch is a callable with no arguments, run after the shims are installed and before
the ``Scheduler`` is built. It is named one of three ways:

- a built-in name from :data:`BUILTIN_PATCHES` (replays of the July bugs, candidate fixes);
- ``"package.module:callable"`` for a patch of your own (the module must be importable
  in the child: it inherits the parent's ``sys.path``);
- a callable defined at the top level of an importable module (not in ``__main__`` or a
  notebook cell: the child is a fresh process and imports it by name).

Most built-ins are *source patches* (:func:`~contract_lib.patches.source.patch_source`):
each reads like a diff against SGLang and fails loudly when the code it expects has moved
(an unsupported release). Several patches travel as one :class:`PatchSpec`.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import tomllib
from typing import Callable, Iterable

from contract_lib.sources.compat import req_kv
from contract_lib.paths import BUG_CATALOG
from contract_lib.patches.source import PatchError, patch_source

__all__ = ["BUILTIN_PATCHES", "Patch", "PatchArg", "PatchError", "PatchSpec", "apply_patch",
           "bug_catalog", "patch_source", "patch_spec", "resolve_patch"]


@dataclasses.dataclass(frozen=True)
class Patch:
    """A built-in patch: its name, what it does, and the bug it replays or fixes."""

    name: str
    summary: str
    apply: Callable[[], None]
    bug: str


# -- built-in patches ------------------------------------------------------------------------


def _mlx_mixin():
    from sglang.srt.hardware_backend.mlx.scheduler_mixin import SchedulerMlxOverlapMixin

    return SchedulerMlxOverlapMixin


def no_forward_ct() -> None:
    """#29217 (June): the MLX launch bypasses ``run_batch``'s ``forward_ct += 1`` and the
    profiler predicate. ``forward_iter`` is stamped with the stale counter (0.5.23's
    ``_record_step_counters`` would otherwise raise on ``None``); ``launch_ts`` is kept
    so the replay isolates ``forward_ct``."""
    patch_source(_mlx_mixin(), "_prepare_mlx_launch", [
        ("self.forward_ct += 1\n", ""),
        ("self.profiler_manager._profile_batch_predicate(batch)\n", ""),
    ], "no-forward-ct")


def no_launch_ts() -> None:
    """#32245 (July, fixed by #32447): ``_record_step_counters`` reads ``launch_ts``,
    which only ``run_batch`` stamped: ``TypeError`` on the first processed batch."""
    patch_source(_mlx_mixin(), "_prepare_mlx_launch", [
        ("batch.launch_ts = time.monotonic()\n", ""),
    ], "no-launch-ts")


def fix_chained_accounting() -> None:
    """#30093, the approach of #33874 / #40046: every chained continuation runs
    ``prepare_for_decode`` on the live batch (allocation, ``req_to_token``, counters),
    and the loop declines to chain when ``check_decode_mem()`` says the step won't fit."""
    patch_source(_mlx_mixin(), "event_loop_overlap_mlx", [
        ("batch_copy = prev.batch_copy.copy()\n",
         "prev.schedule_batch.prepare_for_decode()\n"
         "batch_copy = prev.schedule_batch.copy()\n"),
        ("    and not self.waiting_queue\n)\n",
         "    and not self.waiting_queue\n"
         "    and pending_curr.schedule_batch.check_decode_mem()\n)\n"),
    ], "fix-chained-accounting")


def fix_idle_predicate() -> None:
    """#32934: the in-flight term of ``is_fully_idle`` tests either overlap loop."""
    from sglang.srt.managers.scheduler import Scheduler

    patch_source(Scheduler, "is_fully_idle", [
        ("(not self.enable_overlap or len(self.result_queue) == 0)",
         "(not (self.enable_overlap or self.enable_overlap_mlx)"
         " or len(self.result_queue) == 0)"),
    ], "fix-idle-predicate")


def flush_all_decode_kv(self) -> None:
    """Sync all active requests' un-flushed decode KV to the pool (0.5.21's
    ``MlxModelRunner.flush_all_decode_kv``, verbatim; installed by ``unclamped-sync``)."""
    if self.disable_radix_cache or self._attention_kv_pool is None:
        return
    for req_id in list(self._req_caches.keys()):
        self._sync_decode_kv_to_pool(req_id)


def unclamped_sync() -> None:
    """#30093's reader side as shipped through 0.5.21, restored on 0.5.22+ (the ``sync
    clamped to owned_kv_len at release`` of 0.5.22, reverted). Three code points of
    0.5.21, each put back verbatim:

    - ``MlxTpModelWorker.async_forward_batch_generation_mlx`` calls
      ``_mlx_runner.flush_all_decode_kv()`` before every extend launch, which syncs every
      active request's decode KV up to its cache offset (unclamped) through its
      ``req_to_token`` row, including a finished request whose row was already released
      and reused;
    - ``MlxModelRunner.remove_request`` syncs the remaining decode KV (unclamped) before
      dropping the request's state;
    - ``prepare_for_kv_cache_release`` no longer calls ``release_request_row`` (the
      runner keeps the row mapping until ``remove_request``).

    The chained positions' KV goes to slot 0 (fresh row) and into another live request's
    slots (reused row), and a radix hit reads zeros: with the real runner's KV, and with
    the model-free runner's contents (it runs these methods as SGLang ships them).
    """
    from sglang.srt.hardware_backend.mlx import model_runner, tp_worker

    runner = model_runner.MlxModelRunner  # the model-free runner when that one is installed
    if hasattr(runner, "flush_all_decode_kv"):
        raise PatchError("patch 'unclamped-sync': this SGLang already has "
                         "flush_all_decode_kv (<= 0.5.21): it needs no patch")
    worker = tp_worker.MlxTpModelWorker
    patch_source(worker, "async_forward_batch_generation_mlx", [
        ("return self._async_extend_batch(batch)\n",
         "self._mlx_runner.flush_all_decode_kv()\n"
         "return self._async_extend_batch(batch)\n"),
    ], "unclamped-sync")
    patch_source(worker, "prepare_for_kv_cache_release", [
        ("self._mlx_runner.release_request_row(req.rid, req.owned_kv_len())\n", ""),
    ], "unclamped-sync")
    patch_source(runner, "remove_request", [
        ("self._req_token_ids.pop(req_id, None)\n",
         "if not self.disable_radix_cache:\n"
         "    self._sync_decode_kv_to_pool(req_id)\n"
         "self._req_token_ids.pop(req_id, None)\n"),
    ], "unclamped-sync")
    runner.flush_all_decode_kv = flush_all_decode_kv


def skip_relay_publish() -> None:
    """A deliberate break on the torch loops (no upstream bug): ``run_batch`` never
    stashes sampled tokens into ``future_map.output_tokens_buf``, so the next decode
    reads a row nobody published. Shows clause 4 failing on a reference loop."""
    from sglang.srt.managers.scheduler import Scheduler

    patch_source(Scheduler, "_relay_forward_payload", [
        ("    future_indices = future_indices[: batch.beam_tail.num_base_rows]\n"
         "self.future_map.stash(future_indices, payload)\n",
         "    future_indices = future_indices[: batch.beam_tail.num_base_rows]\n"),
    ], "skip-relay-publish")


def prefilled_tokens(batch) -> int:
    """The tokens a launched batch prefills: ``extend_num_tokens`` of an extend or mixed
    batch less its decode lanes (``decoding_reqs``, one token each); 0 for any other
    mode."""
    if not batch.forward_mode.is_extend() or not batch.extend_num_tokens:
        return 0
    return int(batch.extend_num_tokens) - len(batch.decoding_reqs or ())


def fix_processed_tokens_counter() -> None:
    """Clause 6: the HRRN clock advances by exactly the tokens each launch prefills.

    Torch (``run_batch``, every release 0.5.21-0.5.23): ``if batch.extend_num_tokens``
    also fires on decode batches, whose ``extend_num_tokens`` ``prepare_for_decode``
    never resets (the last prefill's value is added at every decode step), and on a
    mixed batch it counts the decode lanes (``decoding_reqs``); the advance is gated on an extend-mode batch
    and leaves the decode lanes out. MLX (``_prepare_mlx_launch``, fresh and chained):
    the loop never advanced it; it now does, by the same amount, after the stamps (a
    wrapper, so it composes with ``no-forward-ct`` / ``no-launch-ts`` applied first).
    sglang-omni's ``OmniScheduler.stamp_batch_launch`` ("mirror upstream per-forward
    bookkeeping", loop ``omni``) copies the same lines and gets the same fix.
    """
    from sglang.srt.managers.scheduler import Scheduler

    advance = [("if batch.extend_num_tokens:\n"
                "    self.processed_tokens_counter += batch.extend_num_tokens\n",
                "if batch.forward_mode.is_extend() and batch.extend_num_tokens:\n"
                "    self.processed_tokens_counter += batch.extend_num_tokens - len(\n"
                "        batch.decoding_reqs or ())\n")]
    patch_source(Scheduler, "run_batch", advance, "fix-processed-tokens-counter")
    if importlib.util.find_spec("sglang_omni") is not None:  # loop omni: its own copy
        from sglang_omni.scheduling.omni_scheduler import OmniScheduler

        patch_source(OmniScheduler, "stamp_batch_launch", advance,
                     "fix-processed-tokens-counter")
    mixin = _mlx_mixin()
    stamp = mixin._prepare_mlx_launch

    def _prepare_mlx_launch(self, batch) -> None:
        stamp(self, batch)
        self.processed_tokens_counter += prefilled_tokens(batch)

    mixin._prepare_mlx_launch = _prepare_mlx_launch


def retire_released_requests(worker) -> None:
    """Drop the MLX worker's and runner's state of every request it launched that the
    scheduler has since released (finished, aborted, or retracted: no ``req_to_token``
    row). Installed on ``MlxTpModelWorker`` by ``fix-backend-state``; called where
    nothing is in flight (before a fresh launch, at idle)."""
    launched = worker.__dict__.setdefault("_launched_reqs", {})
    for rid, req in list(launched.items()):
        if req.finished() or req_kv(req).req_pool_idx is None:
            worker._mlx_runner.remove_request(rid)
            worker._mlx_active_rids.discard(rid)
            getattr(worker, "_req_retraction_count", {}).pop(rid, None)
            del launched[rid]


def fix_backend_state() -> None:
    """Clause 7: the MLX worker retires a released request's state at the next launch
    of any mode, or when the loop goes idle.

    As shipped, ``MlxTpModelWorker._cleanup_stale_rids`` drops state only at a fresh
    *decode* launch (an extend launch only adds, a chained one never cleans), and a
    retracted request's state only when it is re-prefilled
    (``_drop_state_if_retracted``); at idle nothing is dropped. The fix: before every
    fresh launch (the MLX loop launches fresh only once every in-flight job is
    finalized) and in ``Scheduler.on_idle``, :func:`retire_released_requests`.
    """
    from sglang.srt.hardware_backend.mlx import tp_worker
    from sglang.srt.managers.scheduler import Scheduler

    worker = tp_worker.MlxTpModelWorker
    launch = worker.async_forward_batch_generation_mlx
    on_idle = Scheduler.on_idle

    def async_forward_batch_generation_mlx(self, batch):
        retire_released_requests(self)
        self.__dict__.setdefault("_launched_reqs", {}).update(
            {req.rid: req for req in batch.reqs})
        return launch(self, batch)

    def on_idle_retiring(self) -> None:
        retire = getattr(self.tp_worker, "retire_released_requests", None)
        if retire is not None:
            retire()
        return on_idle(self)

    worker.async_forward_batch_generation_mlx = async_forward_batch_generation_mlx
    worker.retire_released_requests = retire_released_requests
    Scheduler.on_idle = on_idle_retiring


BUILTIN_PATCHES: dict[str, Patch] = {
    patch.name: patch
    for patch in (
        Patch("no-forward-ct", "MLX launch without the forward_ct advance and profiler "
              "predicate", no_forward_ct, "#29217"),
        Patch("no-launch-ts", "MLX launch without the launch_ts stamp (TypeError at "
              "startup)", no_launch_ts, "#32245 (fixed by #32447)"),
        Patch("fix-chained-accounting", "chained MLX decode runs prepare_for_decode, "
              "gated on check_decode_mem", fix_chained_accounting,
              "#30093 (approach of #33874, #40046)"),
        Patch("fix-idle-predicate", "is_fully_idle's queue term tests either overlap loop",
              fix_idle_predicate, "#32934"),
        Patch("skip-relay-publish", "torch run_batch skips the FutureMap relay publish "
              "(a deliberate break)", skip_relay_publish, "none (demonstration)"),
        Patch("unclamped-sync", "<= 0.5.21's decode-KV pool sync on 0.5.22+: unclamped, "
              "flushed at every extend launch and at remove_request", unclamped_sync,
              "#30093 reader side (clamped in 0.5.22)"),
        Patch("fix-processed-tokens-counter", "the HRRN clock advances by the tokens each "
              "launch prefills (torch run_batch and the MLX launch)",
              fix_processed_tokens_counter, "processed-tokens-counter (this project)"),
        Patch("fix-backend-state", "the MLX worker retires a released request's state at "
              "the next launch or at idle", fix_backend_state,
              "backend-state (this project)"),
    )
}


class PatchSpec(str):
    """Validated patches for one run, applied left to right (from :func:`patch_spec`).

    Its text joins them with ``+``: the form stored in run specs, frames and cache keys
    (it is a ``str``, so it travels as one). Code reads :attr:`parts`, never splits.
    """

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(p for p in self.split("+") if p)

    @classmethod
    def of(cls, parts: Iterable[str]) -> PatchSpec | None:
        """The spec of ``parts`` in order, each once (None: no patch)."""
        unique = dict.fromkeys(p for p in parts if p)
        return cls("+".join(unique)) if unique else None


PatchArg = str | Callable[[], None] | list | tuple | None




def bug_catalog() -> list[dict]:
    """The bugs of ``data/bugs.toml``: id, PRs, clause, field, symptom, flags, affected
    releases (as read), the releases measured, and how contract_lib replays each."""
    with BUG_CATALOG.open("rb") as handle:
        return tomllib.load(handle)["bug"]


def patch_spec(patch: PatchArg) -> PatchSpec | None:
    """Validate a patch argument and return its :class:`PatchSpec`.

    Several patches combine with ``+`` (``"fix-chained-accounting+fix-idle-predicate"``)
    or as a list (None entries are skipped); they are applied left to right, each once.
    """
    if patch is None:
        return None
    if isinstance(patch, (list, tuple)):
        specs = [patch_spec(p) for p in patch]
        return PatchSpec.of(part for spec in specs if spec for part in spec.parts)
    if callable(patch):
        module, qualname = patch.__module__, patch.__qualname__
        if module == "__main__" or "<" in qualname:
            raise PatchError(
                f"patch {qualname!r} is defined in {module!r}; the child process cannot "
                "import it. Put it at the top level of a .py module and pass "
                "'module:function'")
        return PatchSpec(f"{module}:{qualname}")
    spec = PatchSpec.of(PatchSpec(patch).parts)
    for part in spec.parts if spec else ():
        if part not in BUILTIN_PATCHES and ":" not in part:
            raise PatchError(
                f"unknown patch {part!r}; built-in patches: {', '.join(BUILTIN_PATCHES)} "
                "(or 'package.module:callable'; combine several with '+')")
        if part not in BUILTIN_PATCHES and _module_missing(part.partition(":")[0]):
            raise PatchError(
                f"patch {part!r}: no module {part.partition(':')[0]!r} on this Python path "
                "(the run's child process imports it by name)")
    return spec


def _module_missing(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


def resolve_patch(spec: str) -> Callable[[], None]:
    """The callable one patch spec names (imports the module for ``module:callable``)."""
    if spec in BUILTIN_PATCHES:
        return BUILTIN_PATCHES[spec].apply
    module_name, _, attr = spec.partition(":")
    try:
        target: object = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise PatchError(f"patch {spec!r}: cannot import it ({exc})") from exc
    if not callable(target):
        raise PatchError(f"patch {spec!r} is not callable")
    return target


def apply_patch(spec: str | None) -> None:
    """Apply a patch spec (its text) inside the child, each part in order."""
    for part in PatchSpec(spec or "").parts:
        resolve_patch(part)()
