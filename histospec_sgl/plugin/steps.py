"""How the HISTORY worker runs a decode step that is not NGRAM's verify at width d, on SGLang's own
paths: a verify at a narrower width (NGRAM's path with its width and per-width buffers set to w for
the call), a plain decode step (the target's own DECODE forward and sampler, laid out as a verify
that accepted nothing) and, with ``--enable-return-hidden-states``, a verify step's hidden states
in the order plain decoding returns them. :class:`StepPaths` is mixed into
:class:`~histospec_sgl.plugin.worker.HistoryWorker` before SGLang's ``NGRAMWorker``, whose
``forward_batch_generation`` ``super()`` reaches here; the worker's step dispatch decides which runs.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
from sglang.srt.speculative.ngram_info import NgramVerifyInput

from histospec_sgl.engine.draft import tree_parents_batch
from histospec_sgl.engine.drafter import StepDraft

#: What NGRAM's buffer allocator (``NGRAMWorker._init_preallocated_tensors``) reads of its worker, in
#: every SGLang release the plugin supports (0.5.15, 0.5.17, 0.5.23).
_ALLOCATOR_READS = ("max_batch_size", "draft_token_num", "device")


def width_buffers(max_batch_size: int, width: int, device: Any) -> dict[str, Any]:
    """NGRAM's preallocated per-batch-size buffers (draft tokens, tree mask, positions, retrieve
    indices) for verify width ``width``, made by NGRAM's own allocator on an object that holds only
    what it reads: the attributes it sets are the buffers, by name, whatever the release calls
    them. A release whose allocator reads more fails here with the name it missed."""
    from sglang.srt.speculative.ngram_worker import NGRAMWorker

    holder = types.SimpleNamespace(max_batch_size=max_batch_size, draft_token_num=width, device=device)
    NGRAMWorker._init_preallocated_tensors(holder)  # type: ignore[arg-type]
    return {k: v for k, v in vars(holder).items() if k not in _ALLOCATOR_READS}


class StepPaths:
    """The step paths of :class:`~histospec_sgl.plugin.worker.HistoryWorker` beside NGRAM's own."""

    # Set by the worker (and NGRAM's __init__ for the first four).
    draft_token_num: int
    max_batch_size: int
    device: Any
    target_worker: Any
    plain_steps: int
    _width_state: dict[int, dict[str, Any]]
    _last_draft: StepDraft | None

    def _accepted_hidden_states(self, result: Any, batch: Any) -> Any:
        """``--enable-return-hidden-states``: a verify step's hidden states as plain decoding returns
        them, one row per emitted token. SGLang's NGRAM verify leaves them in the draft's node order
        (``[bs * w, hidden]``) and the scheduler reads a request's first accepted-length rows, which
        are the accepted tokens' only when the accepted path is nodes 0, 1, 2, ...; the rows of the
        path are gathered to the front here (found from the draft and the accepted tokens: no two
        siblings carry the same token)."""
        hidden = getattr(result.logits_output, "hidden_states", None)
        if hidden is None or not getattr(batch, "return_hidden_states", False) or self._last_draft is None:
            return result
        import torch

        tokens, mask, w, _ = self._last_draft
        bs = len(batch.reqs)
        if w < 2 or hidden.shape[0] != bs * w:
            return result
        toks = tokens.reshape(bs, w)
        parents = tree_parents_batch(mask, w)
        accepted = result.next_token_ids.reshape(bs, -1).cpu().tolist()
        lens = result.accept_lens.cpu().tolist()
        rows = np.arange(bs * w).reshape(bs, w)
        for i in range(bs):
            path, node = [0], 0
            for tok in accepted[i][: int(lens[i]) - 1]:  # each accepted draft node carries the token before it
                kids = np.flatnonzero((parents[i] == node) & (toks[i] == tok))
                if not kids.size:
                    break
                node = int(kids[0])
                path.append(node)
            rows[i, : len(path)] = i * w + np.asarray(path)
        result.logits_output.hidden_states = hidden[torch.from_numpy(rows.reshape(-1)).to(hidden.device)]
        return result

    def _narrow_verify(self, batch: Any, w: int, *args: Any, **kwargs: Any) -> Any:
        """A verify step at width ``w`` < d: SGLang's own NGRAM verify path with its width and its
        per-width buffers set to ``w`` for the call, so the target verifies w nodes per request (not
        d with padding), and the result laid out as SGLang expects: the tokens of the step at stride
        w (``speculative_num_draft_tokens`` = w tells the scheduler), the relay of accepted tokens to
        the next step at stride d, as every other step's. Where CUDA graphs were captured at width d
        only, SGLang runs a width-w verify eagerly (its graph runner checks the width); the step
        clock times it as it runs."""
        import torch

        bs, d = len(batch.reqs), self.draft_token_num
        with self._at_width(w):
            result = super().forward_batch_generation(batch, *args, **kwargs)  # type: ignore[misc]  # NGRAM's
        nxt = result.next_draft_input
        acc = nxt.accept_tokens.reshape(bs, w)
        padded = torch.zeros((bs, d), dtype=acc.dtype, device=acc.device)
        padded[:, :w] = acc
        result.next_draft_input = NgramVerifyInput(draft_token_num=d, new_seq_lens=nxt.new_seq_lens,
                                                   accept_tokens=padded.flatten(), accept_lens=nxt.accept_lens)
        return result

    @contextlib.contextmanager
    def _at_width(self, w: int) -> Iterator[None]:
        """NGRAM's width and its preallocated per-batch-size buffers set to width ``w`` for the block
        (the buffers of each width are made once, by NGRAM's own allocator: :func:`width_buffers`)."""
        buffers = self._width_state.get(w)
        if buffers is None:
            buffers = self._width_state[w] = width_buffers(self.max_batch_size, w, self.device)
        state = {**buffers, "draft_token_num": w, "speculative_num_draft_tokens": w}
        saved = {k: getattr(self, k) for k in state}
        for k, v in state.items():
            setattr(self, k, v)
        try:
            yield
        finally:
            for k, v in saved.items():
                setattr(self, k, v)

    def _plain_decode(self, batch: Any, roots: np.ndarray, on_publish: Any = None, **kwargs: Any) -> Any:
        """A plain decode step in the speculative batch: each request's root (its last accepted
        token, whose KV this step computes) goes through the target's own DECODE forward and
        sampler, exactly what SGLang runs without speculation, and the result is laid out as a
        verify step that accepted nothing (one token per request).

        Under speculation the scheduler does not count the root in ``seq_lens`` and has already
        reserved its KV slot (the first of the d a verify writes); the DECODE forward counts the
        token being decoded, so ``seq_lens`` is one longer for the forward and restored after. The
        result names stride 1 (its tokens, and hidden states with ``--enable-return-hidden-states``,
        one row per request, as the DECODE forward returns them)."""
        import torch

        bs, d = len(batch.reqs), self.draft_token_num
        device = batch.seq_lens.device
        seq_lens, seq_lens_cpu, seq_lens_sum = batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum
        orig_seq_lens, spec_info = getattr(batch, "orig_seq_lens", None), batch.spec_info
        batch.input_ids = torch.from_numpy(roots).to(device=device, non_blocking=True)
        slots = batch.req_to_token_pool.req_to_token[batch.req_pool_indices.long(), seq_lens.long()]
        batch.out_cache_loc = slots.to(torch.int64)
        batch.seq_lens = seq_lens + 1
        batch.seq_lens_cpu = seq_lens_cpu + 1
        batch.seq_lens_sum = int(seq_lens_cpu.sum()) + bs
        if orig_seq_lens is not None:
            batch.orig_seq_lens = orig_seq_lens + 1
        batch.spec_info = None
        try:
            result = self.target_worker.forward_batch_generation(batch, **kwargs)
        finally:
            batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum = seq_lens, seq_lens_cpu, seq_lens_sum
            if orig_seq_lens is not None:
                batch.orig_seq_lens = orig_seq_lens
            batch.spec_info = spec_info
        self.plain_steps += 1
        predict = result.next_token_ids
        accept_lens = torch.ones(bs, dtype=torch.int32, device=device)
        new_seq_lens = seq_lens + 1
        out = result.logits_output
        if batch.return_logprob and out.next_token_logprobs is not None:
            # The sampler wrote each sampled token's log-prob (at its request's temperature), then
            # turned the logits into probabilities in place: a log-prob computed again from
            # ``next_token_logits`` would be wrong for every sampled request. Laid out as a verify
            # step that accepted one token per request (its top-k rows are already one per request).
            out.next_token_logprobs = out.next_token_logprobs.reshape(bs, 1)
        if on_publish is not None:
            on_publish(new_seq_lens)
        # The step's tokens at stride 1, one per request (the stride the scheduler reads them, and any
        # hidden states, at); the relay of accepted tokens to the next step at stride d, as every
        # other step's.
        predict = predict.to(torch.int32)
        padded = torch.zeros((bs, d), dtype=torch.int32, device=device)
        padded[:, 0] = predict
        result.next_token_ids = predict
        result.accept_lens = accept_lens
        result.new_seq_lens = new_seq_lens
        result.next_draft_input = NgramVerifyInput(draft_token_num=d, new_seq_lens=new_seq_lens,
                                                   accept_tokens=padded.flatten(), accept_lens=accept_lens)
        result.speculative_num_draft_tokens = 1
        if hasattr(result, "speculative_output_stride"):  # 0.5.23 reads this one first
            result.speculative_output_stride = 1
        return result
