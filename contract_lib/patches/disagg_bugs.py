"""Replays of two PD-disaggregation bugs of SGLang's history on 0.5.23: per-batch
bookkeeping the regular path does that the disaggregation paths skipped (built-in
patches, registered in :data:`contract_lib.patches.builtin.BUILTIN_PATCHES`; catalogued
in ``data/bugs.toml``)."""

from __future__ import annotations

from contract_lib.patches.source import patch_source

# The per-batch n-gram embedding hook, as 0.5.23's disaggregation paths call it.
_NGRAM_HOOK = ("batch = self.ngram_embedding_manager.prepare_for_forward(\n"
               "    batch, chunked_req=self.chunked_req\n"
               ")\n")


def prebuilt_skips_stream_output() -> None:
    """#12839's kind: its review flagged that moving the fake-extend (prebuilt) batch's
    handling into ``run_batch`` dropped the ``stream_output`` the decode loops had made
    for it. Here ``process_batch_result_prebuilt`` (the prebuilt batch's result
    processing in 0.5.23) no longer streams: a request that ends at its hand-off token
    (its ``max_new_tokens`` reached, or a stop token) is released without its final
    output ever being sent, and a request that decodes on has its first token sent one
    step late, with the next decode's output."""
    from sglang.srt.managers.scheduler_components.batch_result_processor import (
        SchedulerBatchResultProcessor,
    )

    patch_source(SchedulerBatchResultProcessor, "process_batch_result_prebuilt", [(
        "self.output_streamer.stream_output(batch.reqs, batch.return_logprob)\n", "")],
        "prebuilt-skips-stream-output")


def disagg_skips_ngram_embedding() -> None:
    """#30175 (fixed by #31134): the per-batch n-gram embedding hook (0.5.23:
    ``ngram_embedding_manager.prepare_for_forward``, which attaches the token table a
    LongCat forward reads) is called by ``get_next_batch_to_run`` only; the four
    disaggregation loops and the decode side's prebuilt batch
    (``get_new_prebuilt_batch``) skip it. A no-op for any model without n-gram
    embedding or engram layers (``prepare_for_forward`` returns the batch untouched),
    so no run here can show it: ``docs/contract.md``, "The two bugs of the
    disaggregation paths' history"."""
    from sglang.srt.disaggregation.decode import SchedulerDisaggregationDecodeMixin
    from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin

    for owner, loop in ((SchedulerDisaggregationPrefillMixin, "event_loop_normal_disagg_prefill"),
                        (SchedulerDisaggregationPrefillMixin, "event_loop_overlap_disagg_prefill"),
                        (SchedulerDisaggregationDecodeMixin, "event_loop_normal_disagg_decode"),
                        (SchedulerDisaggregationDecodeMixin, "event_loop_overlap_disagg_decode")):
        patch_source(owner, loop, [(_NGRAM_HOOK, "")], "disagg-skips-ngram-embedding")
    patch_source(SchedulerDisaggregationDecodeMixin, "get_new_prebuilt_batch", [(
        "self.ngram_embedding_manager.prepare_for_forward(\n"
        "    batch, chunked_req=self.chunked_req\n"
        ")\n", "")], "disagg-skips-ngram-embedding")
