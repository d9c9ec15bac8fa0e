"""``HistoryWorker``: SGLang's NGRAM worker with drafts from the history index.

Everything after drafting is NGRAM's, unchanged: the full attention mask, SGLang's tree
reconstruction, the TARGET_VERIFY forward (FlashInfer tree attention, CUDA graphs), greedy or
sampling verification (``eagle_sample``), the KV compaction, the current policy's log-probs and the
overlap relay. What differs:

- ``_prepare_draft_tokens``: one batch call into the Rust index fills the tokens and masks of the
  whole batch, on TP rank 0, broadcast to the other ranks (:mod:`histospec_sgl.plugin.tp`);
- each request's context in the index follows what SGLang accepted, so the n samples of a group
  draft from each other while they decode; finished requests become history of their group
  (``custom_params["histospec_group"]``, else ``prompt_key`` of the prompt ids);
- ``clear_cache_pool`` (``flush_cache``, which runs after every weight update) keeps the history:
  NGRAM forgets its trie there, but history across epochs is the point;
- no NGRAM corpus is built (no C++ JIT, no preallocated trie);
- history is loaded at start (``HISTOSPEC_HISTORY_LOAD``), saved to ``HISTOSPEC_SNAPSHOT_PATH`` at
  every ``flush_cache`` (weight update), at a clean exit and on demand
  (``Engine.collective_rpc("histospec_save", path=...)``), bulk-loaded at run time
  (``collective_rpc("histospec_load", path=...)``, which every rank runs at the same point between
  steps) and synced with a draft server (``HISTOSPEC_DRAFT_SERVER``);
- the cost model (``HISTOSPEC_CONTROL=cost``): each decode step verifies the drafts at
  width d or decodes plainly (the target's own DECODE forward and sampler, one token per request),
  whichever the step costs it times per batch size and the acceptance the drafts promise say gives
  more tokens per second (:class:`~histospec_sgl.engine.costmodel.EngineControl`); a step in which
  no request has a draft is decoded plainly (the default). ``HISTOSPEC_CONTROL=fixed`` verifies
  every decode step at width d, as NGRAM does;
- with ``--enable-metrics`` the drafter's counters and the index size are Prometheus metrics
  (:mod:`histospec_sgl.plugin.metrics`).

This module imports SGLang's NGRAM worker and therefore needs a CUDA build of ``sgl_kernel``; the
plugin imports it only in the worker factory, inside the scheduler.
"""

from __future__ import annotations

import atexit
import collections
import logging
import time
from typing import Any

import numpy as np
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.ngram_worker import NGRAMWorker

from histospec_sgl.engine.config import HistoryConfig
from histospec_sgl.engine.draft import write_empty
from histospec_sgl.engine.drafter import BatchDrafter, StepDraft, group_of
from histospec_sgl.hugepages import huge_pages
from histospec_sgl.plugin import compat, scheduler
from histospec_sgl.plugin.metrics import HistoryMetrics
from histospec_sgl.plugin.requests import batch_seq_lens, ended, needs_full_sampler, request_class, returned
from histospec_sgl.plugin.steps import StepPaths
from histospec_sgl.plugin.tp import DraftBroadcast

logger = logging.getLogger("histospec_sgl.plugin")


class _NoCorpus:
    """Stands where NGRAM keeps its C++ corpus; the calls NGRAM's own code makes land here."""

    def __init__(self, worker: HistoryWorker):
        self._worker = worker

    def erase_match_state(self, rids: list[str]) -> None:
        # NGRAM calls this for requests that left the decode batch.
        self._worker._departed(rids)

    def synchronize(self) -> None:
        pass

    def batch_put(self, *_: Any) -> None:
        pass

    def reset(self) -> None:
        pass


class HistoryWorker(StepPaths, NGRAMWorker):
    def __init__(self, *args: Any, **kwargs: Any):
        named = compat.bind_worker_args(NGRAMWorker.__init__, args, kwargs)
        BaseSpecWorker.__init__(self)
        server_args = named["server_args"]
        target_worker = named["target_worker"]
        # The attributes NGRAMWorker.__init__ sets (its corpus aside).
        self.server_args = server_args
        self._target_worker = target_worker
        self.model_runner = target_worker.model_runner
        self.tp_rank = compat.tp_rank_of(named)
        # enable_overlap, page_size, draft_token_num, ..., device: as the version's NGRAM reads them.
        for name, value in compat.ngram_settings(server_args).items():
            setattr(self, name, value)
        self.adaptive_controller = None
        self._prev_decode_rids: set = set()
        self.grammar_tree_host = None
        self.ngram_corpus = _NoCorpus(self)

        self.config = HistoryConfig.from_env()
        self.broadcast = DraftBroadcast.from_sglang(int(getattr(server_args, "tp_size", 1) or 1))
        self.drafter: BatchDrafter | None = None
        self.sync = None
        self.metrics: HistoryMetrics | None = None
        self._reqs: dict[str, Any] = {}
        #: The requests of the last forward pass the step policy timed (:meth:`forward_batch_generation`).
        self._last_step_reqs: list[Any] = []
        self._done: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._no_keep: set[str] = set()
        self._errors = 0
        self.context_mismatches = 0
        self._width_state: dict[int, dict[str, Any]] = {}
        # The step's draft, made before NGRAM's verify path runs and handed to it (_verify).
        self._staged: StepDraft | None = None
        # The draft the last verify step ran, for its hidden states' rows.
        self._last_draft: StepDraft | None = None
        self.plain_steps = 0
        #: Requests waiting in the scheduler's queue for a slot, as the batch being run started
        #: (set by the scheduler, :mod:`histospec_sgl.plugin.scheduler`).
        self.waiting = 0
        self._last_log = time.monotonic()
        if self.broadcast.is_source:
            self.drafter = BatchDrafter(self.draft_token_num, self.config)
            if self.config.history_load:
                n = self.drafter.load(self.config.history_load)
                logger.info("histospec: loaded %s (%d responses)", self.config.history_load, n)
            if self.config.draft_server:
                from histospec_sgl.sync.engine import EngineSync

                self.sync = EngineSync.from_env(self.drafter.index)
            if self.config.snapshot_path:
                atexit.register(self.history_save)
            try:
                self.metrics = HistoryMetrics.from_sglang(server_args, self.tp_rank)
            except Exception:
                logger.exception("histospec: Prometheus metrics are off (the server runs without them)")
        scheduler.install(HistoryWorker)
        logger.info(
            "histospec: HISTORY worker on TP rank %d (d=%d, drafts %s, overlap %s%s)", self.tp_rank,
            self.draft_token_num, "here" if self.drafter else "from rank 0", self.enable_overlap,
            f", index threads {self.drafter.index.threads}, huge pages {'on' if huge_pages() else 'off'}"
            if self.drafter else "",
        )

    # -- SGLang's hooks ------------------------------------------------------------------------

    def clear_cache_pool(self) -> None:
        # flush_cache (after weight updates): the KV cache goes, the history stays. The engine is
        # idle here, so this is where the snapshot is refreshed: SGLang ends its scheduler processes
        # with SIGKILL at shutdown, so an exit hook alone would rarely run.
        self._prev_decode_rids = set()
        if self.drafter is not None and self.config.snapshot_path:
            try:
                self.history_save()
            except Exception:
                logger.exception("histospec: could not save the history snapshot")

    def update_weights_from_disk(self, recv_req: Any) -> tuple[bool, str]:
        # The scheduler has updated the target's weights; the history has none. SGLang 0.5.17's
        # base class would walk the draft model's runners, and NGRAM has none (its draft_worker is
        # None), so /update_weights_from_disk killed the scheduler.
        return True, "Succeeded to update model weights (HISTORY has no draft weights)."

    def update_weights_from_ipc(self, recv_req: Any) -> tuple[bool, str]:
        return self.update_weights_from_disk(recv_req)

    def _update_ngram_corpus(self, batch: Any) -> None:
        # Contexts are brought up to date right before drafting (_prepare_draft_tokens).
        pass

    def on_verify_complete_cpu(self, num_correct_drafts_per_req: list[int], batch_size: int = 0) -> None:
        if self.drafter is not None:
            self.drafter.observe_step(num_correct_drafts_per_req)

    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        req = self._reqs.get(rid)
        if req is not None:
            self._finalize(rid, req)

    def _plain_when_undrafted(self) -> bool:
        """Whether a decode step in which no request has a draft is decoded plainly: under the cost
        model, which decides each step; at a fixed width every step is verified at d."""
        return self.config.control == "cost"

    def forward_batch_generation(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        """One scheduler step. A prefill is NGRAM's. A decode step is drafted first, at the width the
        step policy chooses, then run as that draft says: plainly (width 1, or no request has a
        draft), or verified at its width. Under ``HISTOSPEC_CONTROL=fixed`` and for grammar batches
        (whose verify path runs only d) NGRAM's own verify at d asks for its draft itself."""
        started = time.perf_counter()
        policy = self.drafter.policy if self.drafter is not None else None  # rank 0's: it times the steps
        if policy is not None:
            # A step whose requests had all finished may have been followed by an idle engine (the
            # next requests came later): the time until this pass is not that step's cost.
            policy.begin(started, after_idle=bool(self._last_step_reqs)
                         and all(req.finished() for req in self._last_step_reqs))
            self._last_step_reqs = list(batch.reqs)
        self._track(batch)
        if not batch.forward_mode.is_decode():
            tokens = getattr(batch, "extend_num_tokens", None)
            if policy is not None and batch.forward_mode.is_extend() and tokens:
                policy.prefill_step(int(tokens), started)
            return super().forward_batch_generation(batch, *args, **kwargs)
        bs, d = len(batch.reqs), self.draft_token_num
        grammar = getattr(batch, "has_grammar", False)
        # A request whose sampling SGLang's verify path does not reproduce: the whole step is decoded
        # plainly, through the target's own sampler (every rank reads the same requests).
        full_sampler = not grammar and any(needs_full_sampler(req) for req in batch.reqs)
        if grammar or not (full_sampler or self._plain_when_undrafted()):
            if policy is not None:
                policy.decode_step(bs, d, started)
            return self._accepted_hidden_states(super().forward_batch_generation(batch, *args, **kwargs), batch)
        # Every TP rank gets rank 0's draft, so every rank takes the same path below.
        step = self._step_draft(batch, width=1 if full_sampler else None)
        width = step.width if step.drafted else 1
        if policy is not None:
            policy.decode_step(bs, width, started)
        if width == 1:
            return self._plain_decode(batch, step.roots.copy(), *args, **kwargs)
        return self._accepted_hidden_states(self._verify(batch, step, *args, **kwargs), batch)

    def _verify(self, batch: Any, step: StepDraft, *args: Any, **kwargs: Any) -> Any:
        """``step`` verified on NGRAM's path (at a narrower width through :meth:`_narrow_verify`).
        NGRAM's ``forward_batch_generation`` takes no draft: it asks ``_prepare_draft_tokens`` for
        one, so the draft made ahead of it is handed over there (``_staged``). SGLang's interface
        allows no other way in; this is the only place the worker re-enters itself."""
        self._staged = step
        try:
            if step.width < self.draft_token_num:
                return self._narrow_verify(batch, step.width, *args, **kwargs)
            return super().forward_batch_generation(batch, *args, **kwargs)
        finally:
            self._staged = None

    def add_external_corpus(self, corpus_id: str, token_chunks: list[list[int]]) -> int:
        raise NotImplementedError(
            "HISTORY does not use NGRAM external corpora: load history with HISTOSPEC_HISTORY_LOAD, "
            "collective_rpc('histospec_load', path=...) or a draft server"
        )

    def list_external_corpora(self) -> dict[str, int]:
        return {}

    # -- drafting ------------------------------------------------------------------------------

    def _prepare_draft_tokens(self, batch: Any) -> tuple[np.ndarray, np.ndarray]:
        # NGRAM's verify path asks for the step's draft: the one _verify staged, else (NGRAM's own
        # verify at d: grammar batches, a fixed width) one drafted now at d.
        step = self._staged if self._staged is not None else self._step_draft(batch, width=self.draft_token_num)
        self._staged = None
        return step.tokens, step.mask

    def _step_draft(self, batch: Any, width: int | None) -> StepDraft:
        """The decode step's draft at ``width`` (None: the width the step policy chooses), drafted on
        TP rank 0 and shared with the others; an empty draft at d if drafting failed."""
        t0 = time.perf_counter()
        bs, d = len(batch.reqs), self.draft_token_num
        prev_ids, prev_lens = batch.spec_info.accept_tokens, batch.spec_info.accept_lens
        if not prev_ids.is_cpu:
            prev_ids, prev_lens = prev_ids.cpu(), prev_lens.cpu()
        self.prev_token_ids = prev_ids.tolist()
        self.prev_accept_lens = prev_lens.tolist()
        step = None
        if self.drafter is not None:
            # Overlap mode is one step behind: the last accepted tokens are not in output_ids yet.
            use_prev = self.enable_overlap and not compat.grammar_needs_sync(batch)
            try:
                step = self._draft(batch, use_prev, width)
            except Exception:
                self._errors += 1
                if self._errors <= 3 or self._errors % 1000 == 0:
                    logger.exception("histospec: drafting failed (%d times); verifying without drafts",
                                     self._errors)
                step = self._empty(batch, use_prev)
        step = self._last_draft = self.broadcast.share(step, bs, d)
        if self.metrics is not None and self.drafter is not None:
            try:
                self.metrics.observe(self.drafter, errors=self._errors, plain_steps=self.plain_steps,
                                     context_mismatches=self.context_mismatches,
                                     host_seconds=time.perf_counter() - t0)
            except Exception:
                logger.exception("histospec: could not update the Prometheus metrics; they stay off")
                self.metrics = None
        return step

    def _draft(self, batch: Any, use_prev: bool, width: int | None) -> StepDraft:
        assert self.drafter is not None
        if self.sync is not None:
            try:
                self.sync.step_boundary()
            except Exception as e:  # the server is down: draft from what we have
                self._errors += 1
                if self._errors <= 3 or self._errors % 1000 == 0:
                    logger.warning("histospec: draft server sync failed: %s", e)
        rids, items, classes, caps, over = [], [], [], [], []
        drafter = self.drafter
        unprocessed = self._unprocessed(batch, use_prev)
        for req, prev in zip(batch.reqs, unprocessed):
            rid = req.rid
            if rid in self._done:  # came back after it was finalized: draft, but never keep it twice
                self._done.pop(rid)
                self._no_keep.add(rid)
            # The group is read only for a request the drafter does not know yet.
            group = None if drafter.is_live(rid) else self._group(req)
            items.append((rid, req.origin_input_ids, req.output_ids, prev, group))
            rids.append(rid)
            classes.append(request_class(req))
            caps.append(getattr(getattr(req, "sampling_params", None), "max_new_tokens", None))
            over.append(ended(req, prev))
        started = drafter.sync_batch(items)
        if drafter.contexts is not None:
            self._check_contexts(batch, unprocessed)
        if started and self.sync is not None:
            # A group's first request asks the draft server for its history (on_demand); it arrives
            # in the background, and the request drafts from its siblings until it has.
            self.sync.want(started)
        step = drafter.draft(rids, classes, width=width, waiting=self.waiting, caps=caps, ended=over)
        self._maybe_log()
        return step

    def _empty(self, batch: Any, use_prev: bool) -> StepDraft:
        d, bs = self.draft_token_num, len(batch.reqs)
        roots = []
        for req, prev in zip(batch.reqs, self._unprocessed(batch, use_prev)):
            if prev:
                roots.append(prev[-1])
            elif req.output_ids:
                roots.append(req.output_ids[-1])
            else:
                roots.append(req.origin_input_ids[-1])
        tokens = np.empty(bs * d, dtype=np.int64)
        mask = np.empty(bs * d * d, dtype=np.int64)
        write_empty(tokens, mask, roots, d)
        return StepDraft(tokens, mask, d, False)

    def _unprocessed(self, batch: Any, use_prev: bool) -> list[list[int]]:
        """Each request's accepted tokens that are not in its ``output_ids`` yet.

        SGLang's overlap scheduler processes a batch's result after it has launched the next batch,
        so a request that decoded in the step just before is one step behind: its last accepted
        tokens (``spec_info.accept_tokens``) are missing from ``output_ids``. Not every request is: when
        another batch ran in between (a prefill of new requests, two prefills in a row), its result
        has been processed while ``spec_info`` still relays the same tokens. The root of a draft is
        the request's last token, and a stale root makes the verify compute the wrong position, so
        the count comes from SGLang's own ``seq_lens`` (every accepted token but the root, whose KV
        this step computes), not from the overlap flag alone."""
        d = self.draft_token_num
        seq_lens = batch_seq_lens(batch)
        out = []
        for i, req in enumerate(batch.reqs):
            # Without overlap SGLang has processed every result: nothing may be missing.
            prev = self.prev_token_ids[i * d: i * d + self.prev_accept_lens[i]] if use_prev else []
            missing = seq_lens[i] + 1 - len(req.origin_input_ids) - len(req.output_ids)
            if not 0 <= missing <= len(prev):
                # Not what SGLang's relay produces; NGRAM's rule (all of them) keeps drafting.
                self.context_mismatches += 1
                if self.context_mismatches <= 3:
                    logger.error("histospec: request %s: seq_len %d, %d prompt + %d output tokens and %d "
                                 "relayed do not add up", req.rid, seq_lens[i], len(req.origin_input_ids),
                                 len(req.output_ids), len(prev))
                missing = len(prev)
            out.append(prev[len(prev) - missing:])
        return out

    def _check_contexts(self, batch: Any, unprocessed: list[list[int]]) -> None:
        """``HISTOSPEC_CHECK_CONTEXT=1``: each request's context in the index is what SGLang holds: its
        output tokens as processed, then the accepted tokens not processed yet, as many as its
        ``seq_lens`` says (every accepted token but the root). Each request that disagrees is counted
        in :attr:`context_mismatches` and logged. Tokens the index took from a relay in an earlier
        step are checked against ``output_ids`` once SGLang has processed them."""
        assert self.drafter is not None and self.drafter.contexts is not None
        contexts = self.drafter.contexts
        for req, prev, seq_len in zip(batch.reqs, unprocessed, batch_seq_lens(batch)):
            held = contexts.get(req.rid)
            output = list(req.output_ids)
            if held == output + list(prev) and len(req.origin_input_ids) + len(held) == seq_len + 1:
                continue
            self.context_mismatches += 1
            if self.context_mismatches <= 10:
                at = next((i for i, (a, b) in enumerate(zip(held or [], output)) if a != b), None)
                logger.error("histospec: request %s: the index holds %s response tokens, SGLang %d processed "
                             "+ %d not yet (seq_len %d, prompt %d)%s", req.rid,
                             "no" if held is None else len(held), len(output), len(prev), seq_len,
                             len(req.origin_input_ids), "" if at is None else f"; they differ at token {at}")

    def _group(self, req: Any) -> int | None:
        params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
        try:
            return group_of(params)
        except ValueError as e:
            logger.warning("histospec: request %s: %s; grouping by prompt", req.rid, e)
            return None

    # -- request lifecycle ---------------------------------------------------------------------

    def _track(self, batch: Any) -> None:
        """The batch's requests are remembered until they finish; those that left it finished are
        completed (:meth:`_finalize`)."""
        if self.drafter is None:
            return
        current = set()
        for req in batch.reqs:
            self._reqs.setdefault(req.rid, req)
            current.add(req.rid)
        self._sweep(current)

    def _departed(self, rids: list[str]) -> None:
        for rid in rids:
            req = self._reqs.get(rid)
            if req is not None and req.finished():
                self._finalize(rid, req)

    def _sweep(self, current: set[str]) -> None:
        for rid, req in list(self._reqs.items()):
            if rid not in current and req.finished():
                self._finalize(rid, req)

    def _finalize(self, rid: str, req: Any) -> None:
        self._reqs.pop(rid, None)
        if self.drafter is None:
            return
        aborted = type(getattr(req, "finished_reason", None)).__name__ == "FINISH_ABORT"
        keep = not aborted and rid not in self._no_keep
        self._no_keep.discard(rid)
        try:
            self.drafter.complete(rid, req.origin_input_ids, returned(req), keep=keep,
                                  group=self._group(req) if keep else None,
                                  publish=self._publish if self.sync is not None else None)
        except Exception:
            logger.exception("histospec: could not record finished request %s", rid)
        self._done[rid] = None
        while len(self._done) > 4096:
            self._done.popitem(last=False)

    def _publish(self, prompt_ids: Any, response: Any, group: int | None) -> None:
        """A finished response to the draft server (it comes back through the subscription)."""
        assert self.sync is not None and self.drafter is not None
        self.sync.finished(prompt_ids, response, version=self.drafter.index.version, group=group)

    # -- history in and out --------------------------------------------------------------------

    def history_save(self, path: str | None = None) -> None:
        target = path or self.config.snapshot_path
        if self.drafter is None or not target:
            return
        self.drafter.save(target)
        logger.info("histospec: saved history to %s", target)

    def history_load(self, path: str) -> None:
        if self.drafter is not None:
            n = self.drafter.load(path)
            logger.info("histospec: loaded %s (%d responses)", path, n)

    def history_stats(self) -> dict[str, Any]:
        if self.drafter is None:
            return {}
        return {**self.drafter.index.stats(), **self.drafter.totals.as_dict(), "plain_steps": self.plain_steps,
                "context_mismatches": self.context_mismatches}

    def _maybe_log(self) -> None:
        assert self.drafter is not None
        every = self.config.log_every
        if not every or self.drafter.totals.steps % every:
            return
        w = self.drafter.take_window()
        st = self.drafter.index.stats()
        logger.info(
            "histospec: %d steps, batch %.1f, accept length %.2f, draft coverage %.2f, draft %.3f ms/step, "
            "index %d groups / %d responses / %.1f MB%s",
            w["steps"], w["batch"], w["accept_len"], w["coverage"], w["draft_ms"],
            st["groups"], st["responses"], st["bytes"] / 1e6,
            ", steps per verify width so far {" + ", ".join(
                f"{w}: {n}" for w, n in sorted(self.drafter.width_steps.items())) + "}"
            if self._plain_when_undrafted() else "",
        )
        summary = self.drafter.policy.summary()
        if summary:
            logger.info("histospec: step policy: %s", summary)
