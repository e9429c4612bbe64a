"""Launch and relay records: one ``launches`` row per forward launch, completed when its
result is processed, and the FutureMap's relay reads and writes."""

from __future__ import annotations

from typing import Any

from contract_lib.child.capture.batches import (
    NumpyView,
    length,
    mode_name,
    prefill_lanes,
    prefilled_tokens,
    tolist,
)
from contract_lib.child.capture.state import RunState
from contract_lib.sources.compat import mlx_launch_parts, req_kv


class LaunchRecorder:
    """Records each forward launch (``launches``, ``forward_slots``), its processing, a
    decode side's prebuilt admissions (``prebuilt``), and the FutureMap relay's reads,
    writes and fed ids (``relay``); called by the hooks (:mod:`.hooks`) and the torch
    model-free forward."""

    def __init__(self, state: RunState) -> None:
        self.state = state
        self.s = state.scheduler
        self.handed_off: set[str] = set()  # decode side: requests whose KV was transferred
        # Relay row -> (the value its last write left, the rid holding the row then, the
        # launch count at the write).
        self.relay_written: dict[int, tuple[int, str | None, int | None]] = {}
        self.relay_view = NumpyView()  # of the relay buffer (sliced without torch)
        # MLX: id(launch key) -> (its number, its rids, the launch, kept alive) until its
        # result is finalized, and the tokens the runner produced in the finalize under way.
        self.mlx_unfinalized: dict[int, tuple[int, list[str], Any]] = {}
        self.produced: dict[str, int] = {}

    def _launch_row(self, *, batch, forward_iter, launch_ts, mode, chained, rids,
                    prefilled_tokens: int = 0, tokens: str | None = None
                    ) -> tuple[str, tuple]:
        """A new launch, counted, and its ``launches`` row (for the caller to send; the
        ``processed_*`` columns are None until its update). ``tokens``: what the model
        produced for each of ``rids``, comma-joined (None until known: MLX's are lazy).
        ``batch``: the launch's ``ScheduleBatch`` (None: a chained MLX launch)."""
        state = self.state
        state.launch_ct += 1
        state.unprocessed.append(state.launch_ct)
        extend = None if batch is None else getattr(batch, "extend_num_tokens", None)
        return ("launches", (state.launch_ct, state.step, state.loop, self.s.forward_ct,
                             forward_iter, launch_ts, mode, chained, ",".join(rids),
                             None, None, None, prefilled_tokens, tokens, None,
                             None if extend is None else int(extend)))

    def on_torch_launch(self, batch, tokens: list[int]) -> None:
        """Called by the torch model-free forward with the batch and the tokens it made."""
        if not self.state.capture:
            return
        rids = [req.rid for req in batch.reqs]
        lanes = prefill_lanes(batch)
        prefill = set(lanes)
        fed = self._fed_rows(batch, rids, lanes)  # before this launch's tokens
        seq_lens = batch.seq_lens.tolist()
        for lane, (rid, seq_len, token) in enumerate(zip(rids, seq_lens, tokens)):
            # A prefill/extend lane computes up to its seq_len; a decode lane computes one
            # position more than its request had, counted here, not read off the batch's
            # seq_lens (the counter clause 2 checks against this).
            known = self.state.kv_computed.get(rid)
            self.state.kv_computed[rid] = (int(seq_len) if lane in prefill or known is None
                                     else known + 1)
            self.state.latest_token[rid] = int(token)
        for lane in lanes:
            self.state.kv_prefilled[rids[lane]] = self.state.kv_computed[rids[lane]]
        launch = self._launch_row(batch=batch, forward_iter=batch.forward_iter,
                                  launch_ts=getattr(batch, "launch_ts", None),  # 0.5.17+
                                  mode=mode_name(batch), chained=False, rids=rids,
                                  prefilled_tokens=prefilled_tokens(batch, lanes),
                                  tokens=",".join(map(str, tokens)))
        self.state.emit_rows([launch, *fed, *self._forward_slots(batch, rids, seq_lens)])

    def _fed_rows(self, batch, rids: list[str], lanes: list[int]) -> list[tuple]:
        """The ``relay`` table's ``fed`` rows of the launch about to be counted: the input
        id the forward got for each decode lane (the last lanes of ``batch.input_ids``;
        a mixed batch puts its decode lanes after its prefill lanes), against the
        request's latest token. Read at the forward, whatever path filled the ids:
        a reader the hooks do not see (an inlined gather) is seen here. ``lanes``: the
        prefill lanes; none when they are not the first lanes (a shape not read)."""
        ids, prefills = batch.input_ids, len(lanes)
        decodes = len(rids) - prefills
        if (decodes <= 0 or ids is None or not hasattr(ids, "tolist")
                or length(ids) < decodes or lanes != list(range(prefills))):
            return []
        kind, launch = ("mixed" if prefills else "decode"), self.state.launch_ct + 1
        values = ids[length(ids) - decodes:].tolist()
        taken = []
        for req, rid, value in zip(batch.reqs[prefills:], rids[prefills:], values):
            latest, row = self.state.latest_token.get(rid), req_kv(req).req_pool_idx
            taken.append(("relay", ("fed", self.state.step, launch, self.state.loop, kind,
                                    row, rid, value, latest, value == latest)))
        return taken

    def _forward_slots(self, batch, rids: list[str], seq_lens: list[int]) -> list[tuple]:
        """The ``forward_slots`` rows of the launch just counted: the pool slot the
        forward writes each computed position's KV to. A lane
        computes its last ``extend_lens`` positions (an extend or mixed batch; a decode
        lane of either, one), in ``out_cache_loc`` order. Not recorded when the counts
        and ``out_cache_loc`` disagree (a batch shape this reading does not know)."""
        if batch.out_cache_loc is None:
            return []
        slots = batch.out_cache_loc.tolist()
        counts = (list(batch.extend_lens) if batch.forward_mode.is_extend()
                  else [1] * len(rids))
        if len(counts) != len(rids) or sum(counts) != len(slots):
            return []
        launch, step, taken, offset = self.state.launch_ct, self.state.step, [], 0
        for rid, seq_len, count in zip(rids, seq_lens, counts):
            first = seq_len - count
            taken += [("forward_slots", (launch, step, rid, first + index, slot))
                      for index, slot in enumerate(slots[offset:offset + count])]
            offset += count
        return taken

    def on_mlx_launch(self, launch, batch, *, chained: bool) -> None:
        key, prefills, extends, decode = mlx_launch_parts(launch)
        rids, caches = [], self.s.tp_worker._mlx_runner._req_caches
        for pending in (*prefills, *extends):
            # An extend's cache is the runner's own (<= 0.5.17 keep none on the pending).
            cache = getattr(pending, "cache", None) or caches[pending.req_id]
            self.state.kv_computed[pending.req_id] = int(cache[0].offset)
            self.state.kv_prefilled[pending.req_id] = self.state.kv_computed[pending.req_id]
            rids.append(pending.req_id)
        if decode is not None:
            for rid, cache in zip(decode.req_ids, decode.caches):
                self.state.kv_computed[rid] = int(cache[0].offset)
                rids.append(rid)
        if batch is not None:
            rids = [req.rid for req in batch.reqs]
            forward_iter, mode = batch.forward_iter, mode_name(batch)
            launch_ts = getattr(batch, "launch_ts", None)  # 0.5.17+
        else:
            forward_iter, launch_ts, mode = None, None, "decode"
        self.state.emit_rows([self._launch_row(batch=batch, forward_iter=forward_iter,
                                          launch_ts=launch_ts,
                                          mode=mode, chained=chained, rids=rids,
                                          prefilled_tokens=prefilled_tokens(batch))])
        self.mlx_unfinalized[id(key)] = (self.state.launch_ct, rids, launch)

    def finalize_mlx(self, real_finalize, args: tuple):
        """``real_finalize(*args)`` (the worker's ``finalize_mlx_result``; its arguments
        are (launch, reqs), <= 0.5.17 (prefills, extends, decode, mode, reqs): the first
        is the launch's key (:func:`contract_lib.sources.compat.mlx_launch_parts`), the
        last its requests), recorded: each request's latest token, and on the launch's
        row the tokens its runner calls produced (the model boundary, per request id,
        noted by :meth:`note_produced`: not the worker's mapping of them onto the
        batch), in its ``rids`` order ("" for a lane without one)."""
        self.produced = {}
        result = real_finalize(*args)
        if result.next_token_ids is not None:
            for req, token in zip(args[-1], result.next_token_ids.tolist()):
                self.state.latest_token[req.rid] = token
        number, rids, _ = self.mlx_unfinalized.pop(id(args[0]), (None, None, None))
        if number is not None:
            tokens = ",".join(str(self.produced.get(rid, "")) for rid in rids)
            self.state.emit(("update", "launches", "launch", number, {"tokens": tokens}))
        return result

    def note_produced(self, rids: list[str], tokens: list[int]) -> None:
        """The tokens an MLX runner's finalize call returned for ``rids``."""
        self.produced.update(zip(rids, tokens))

    def on_prebuilt(self, batch) -> None:
        """A decode side's prebuilt batch admits requests without a forward: on a
        request's first admission its prompt's KV arrived by transfer, on a re-admission
        after a retraction its backed-up KV was restored (``offload_kv_cache`` /
        ``load_kv_cache``, ``schedule_batch.py:2110-2112``, :2132-2134: every position
        but the last token's). Either way ``kv_computed`` is the prompt fed and the
        tokens emitted, less the last (counted here, not read off the batch's
        ``seq_lens``, which clause 2 checks; a step in flight at the retraction is
        dropped with it), the decode steps count from there (``kv_prefilled``), and the
        latest token is the one ``process_prebuilt`` stashed for the first decode
        (``output_ids[-1]``: on the first admission the remote prefill's hand-off)."""
        taken = []
        for req in batch.reqs:
            rid, token = req.rid, int(req.output_ids[-1])
            transfer = rid not in self.handed_off
            self.handed_off.add(rid)
            computed = len(self.state.fed_prompts[rid]) + len(req.output_ids) - 1
            self.state.kv_computed[rid] = self.state.kv_prefilled[rid] = computed
            self.state.latest_token[rid] = token
            taken.append(("prebuilt", (self.state.step, rid, computed, token, transfer)))
        self.state.emit_rows(taken)

    def on_processed(self, batch, result) -> None:
        if self.state.resolving is not None:
            launch, self.state.resolving = self.state.resolving, None
        elif self.state.unprocessed:
            launch = self.state.unprocessed.popleft()
        else:
            return
        self.state.emit(("update", "launches", "launch", launch, {
            "processed_step": self.state.step,
            "processed_forward_iter": batch.forward_iter,
            "processed_launch_ts": getattr(batch, "launch_ts", None),
            "processed_after_idle_gap": getattr(batch, "after_idle_gap", None),
        }))

    # -- relay ------------------------------------------------------------------------------

    def _row_owners(self) -> dict[int, str]:
        """``req_to_token`` row -> the first unfinished request holding it."""
        owners: dict[int, str] = {}
        for rid, req in self.state.reqs.items():
            row = req_kv(req).req_pool_idx
            if row is not None and row not in owners and not req.finished():
                owners[row] = rid
        return owners

    @staticmethod
    def relay_lanes(batch, future_map) -> tuple[list[int], str, list[str]] | None:
        """Before ``resolve_forward_inputs``: the relay rows it will read and for which
        requests (a decode batch: every lane; a mixed batch: its running lanes, last),
        or None when it reads none (it clears what says so)."""
        if batch.prefill_input_ids_cpu is not None:
            if batch.mix_running_indices is None:
                return None
            rows = tolist(batch.mix_running_indices)
            return rows, "mixed", [req.rid for req in batch.reqs[len(batch.reqs) - len(rows):]]
        if batch.input_ids is None and future_map.spec_algo.is_none():
            return tolist(batch.req_pool_indices), "decode", [req.rid for req in batch.reqs]
        return None

    def on_relay_read(self, batch, future_map,
                      lanes: tuple[list[int], str, list[str]]) -> None:
        """After ``resolve_forward_inputs``: what each lane was fed (the last ids of
        ``batch.input_ids``, one per relay row), against what its row last published.
        The fed ids, not the rows' contents: a reader that gathers other rows is seen.
        A reader that fed nothing is read through the rows it should have gathered."""
        rows, kind, rids = lanes
        state, fed = self.state, batch.input_ids
        if fed is not None and hasattr(fed, "tolist") and length(fed) >= len(rows):
            values = fed[length(fed) - len(rows):].tolist() if rows else []
        else:  # numpy indexes a few rows in ~1 µs (torch ~15 µs from a list)
            values = (self.relay_view.of(future_map.output_tokens_buf)[rows].tolist()
                      if rows else [])
        taken = []
        for row, rid, value in zip(rows, rids, values):
            written = self.relay_written.get(row)
            last_value, last_rid = (written[0], written[1]) if written else (None, None)
            # Published for this request: its holder's last write, of its latest token,
            # and still what the row holds (nothing overwrote it since).
            published = (written is not None and last_rid == rid and value == last_value
                         and last_value == state.latest_token.get(rid))
            taken.append(("relay", ("read", state.step, state.launch_ct + 1, state.loop,
                                    kind, row, rid, value, last_value, published)))
        self.state.emit_rows(taken)

    def on_relay_write(self, indices, kind: str) -> None:
        """After a stash: what the relay rows ``indices`` hold now (read back, not what
        the stash was given: a stash that wrote other values or rows is seen as it is)."""
        rows = tolist(indices)
        held = (self.relay_view.of(self.s.future_map.output_tokens_buf)[rows].tolist()
                if rows else [])
        state, taken, owners = self.state, [], self._row_owners()
        for row, value in zip(rows, held):
            rid = owners.get(row)
            self.relay_written[row] = (int(value), rid, state.launch_ct)
            taken.append(("relay", ("write", state.step, state.launch_ct, state.loop, kind,
                                    row, rid, int(value), None, None)))
        self.state.emit_rows(taken)
