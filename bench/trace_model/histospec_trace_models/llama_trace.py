"""TRACE MODE, a benchmark instrument: a Llama whose every next-token choice is forced to a logged
response's token. Never reachable from a user's server: it lives in the checkout's ``bench/`` (not
in the wheel), and SGLang loads it only when ``bench engine --trace`` writes a model directory whose
``config.json`` names :class:`HistospecTraceLlamaForCausalLM` and starts the server with
``SGLANG_EXTERNAL_MODEL_PACKAGE=histospec_trace_models`` and ``TRACE_MODE_FILE``.

The model's own forward runs in full (its cost is what the benchmark measures); only its choice is
replaced: after SGLang's logits processor, each row's logits are set to 0 at the forced token and
to a large negative number elsewhere, so that greedy decoding and sampling at any temperature pick
that token, and SGLang's tree verification (greedy or sampled) accepts a drafted token exactly when
it is the logged one. Acceptance is then the logging policy's: a logged token is a sample of it.

A request is traced when its ``rid`` ends in ``#trace<k>``: the ``k``-th entry of the trace file,
``{"eos": id, "traces": [{"prompt_len": n, "response": [ids]}]}``. A row that predicts the token at
position ``p + 1`` (``p``: the position of the row's input token, from the forward's ``positions``)
is forced to ``response[p + 1 - prompt_len]``, and to ``eos`` past the response's end, so a traced
request ends at its logged length. This holds for every row SGLang computes: the last prompt token
of a prefill, a decode step, and every node of a verified draft tree (nodes off the logged path
are never reached by verification, whatever they are forced to). Requests without the suffix
(warm-up) decode as the model would.

Per request slot the forced tokens live in a device buffer written at prefill, and decode and
verify rows gather from it with tensor operations only, so CUDA graphs capture the forcing too.

With ``TRACE_MODE_CLOCK`` set (``bench engine`` sets it for a plain server, which has no step policy
to time its steps), the model times its decode steps: from one decode forward's start to the next's,
at the batch size running; an interval that a prefill or any other pass interrupts is not a decode
step's and is not kept. It times its prefill passes as the step policy does: from the pass's start
to the next forward's, with the prompt tokens it computed. Each timing is appended to that file as a
line, ``batch seconds`` for a decode step and ``prefill tokens seconds`` for a prefill pass (one
write, a few microseconds); the bench puts them on the step policy's own clock
(:func:`histospec_sgl.bench.engine_server.step_seconds`,
:func:`~histospec_sgl.bench.engine_server.prefill_cost`), so that ``simulate --check`` prices the
plain row by its own server's steps and prefill passes.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from typing import Any

import torch
from sglang.srt.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

RID = re.compile(r"#trace(\d+)$")
#: Request slots the buffer holds (SGLang's request pool is smaller: max running requests + a few).
SLOTS = int(os.environ.get("TRACE_MODE_SLOTS", "1024"))
NEG = -1e9


class HistospecTraceLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        path = os.environ.get("TRACE_MODE_FILE")
        if not path:
            raise RuntimeError("HistospecTraceLlamaForCausalLM (bench engine --trace) needs TRACE_MODE_FILE")
        with open(path) as f:
            spec = json.load(f)
        self.trace_eos = int(spec["eos"])
        self.traces = [(int(t["prompt_len"]), [int(x) for x in t["response"]]) for t in spec["traces"]]
        width = 2 + max((len(r) for _, r in self.traces), default=0)
        device = torch.get_default_device() if hasattr(torch, "get_default_device") else "cpu"
        # Forced tokens per request slot (eos past the end), each slot's prompt length, and whether
        # the slot's request is traced.
        self.trace_table = torch.full((SLOTS, width), self.trace_eos, dtype=torch.long, device=device)
        self.trace_prompt_len = torch.zeros(SLOTS, dtype=torch.long, device=device)
        self.trace_active = torch.zeros(SLOTS, dtype=torch.bool, device=device)
        self.trace_width = width
        logger.warning("TRACE MODE (benchmark): %d logged responses from %s force every traced token",
                       len(self.traces), path)
        clock = os.environ.get("TRACE_MODE_CLOCK")
        # Open for the server's life, line-buffered: each timing reaches the file in one write.
        self.trace_clock = open(clock, "a", buffering=1) if clock else None
        #: The timed forward before this one: whether a prefill, its batch size (a prefill's tokens) and
        #: start; None after any other pass.
        self.trace_last_pass: tuple[bool, int, float] | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: Any, *args: Any,
                **kwargs: Any) -> Any:
        if self.trace_clock is not None:
            self._time_step(forward_batch)
        out = super().forward(input_ids, positions, forward_batch, *args, **kwargs)
        logits = getattr(out, "next_token_logits", None)
        if logits is None:
            return out
        mode = forward_batch.forward_mode
        if mode.is_target_verify():
            d = logits.shape[0] // max(1, forward_batch.req_pool_indices.shape[0])
            slots = forward_batch.req_pool_indices.repeat_interleave(d)
            pos = positions[: logits.shape[0]]
        elif mode.is_decode():
            slots, pos = forward_batch.req_pool_indices, positions[: logits.shape[0]]
        elif mode.is_extend() and not mode.is_mixed():
            self._assign(forward_batch)
            ends = torch.cumsum(forward_batch.extend_seq_lens, 0) - 1
            slots, pos = forward_batch.req_pool_indices, positions[ends]
        else:
            return out
        if slots.shape[0] != logits.shape[0]:
            raise RuntimeError(f"TRACE MODE: {logits.shape[0]} logit rows for {slots.shape[0]} request rows "
                               f"in a {mode} forward")
        slots = slots.long()
        idx = (pos.long() + 1 - self.trace_prompt_len[slots]).clamp(0, self.trace_width - 1)
        forced = self.trace_table[slots, idx]
        active = self.trace_active[slots].unsqueeze(1)
        onehot = torch.full_like(logits, NEG)
        onehot.scatter_(1, forced.unsqueeze(1), 0.0)
        out.next_token_logits = torch.where(active, onehot, logits)
        return out

    def _time_step(self, forward_batch: Any) -> None:
        """The pass before this forward took the time since it started: kept if it was a prefill, or a
        decode step followed by another (:data:`TRACE_MODE_CLOCK <histospec_trace_models.llama_trace>`)."""
        now = time.perf_counter()
        last, self.trace_last_pass = self.trace_last_pass, None
        mode = forward_batch.forward_mode
        decode = mode.is_decode() and not mode.is_target_verify()
        if last is not None and (last[0] or decode):
            prefill, size, start = last
            self.trace_clock.write(f"{'prefill ' if prefill else ''}{size} {now - start!r}\n")
        if decode:
            self.trace_last_pass = (False, int(forward_batch.batch_size), now)
        elif mode.is_extend() and not mode.is_mixed() and forward_batch.extend_num_tokens:
            self.trace_last_pass = (True, int(forward_batch.extend_num_tokens), now)

    def _assign(self, forward_batch: Any) -> None:
        """At prefill: each traced request's forced tokens into its slot."""
        rids = getattr(forward_batch, "rids", None) or []
        slots = forward_batch.req_pool_indices.tolist()
        for slot, rid in zip(slots, rids):
            m = RID.search(str(rid))
            if m is None:
                self.trace_active[slot] = False
                continue
            k = int(m.group(1))
            if not 0 <= k < len(self.traces):
                raise RuntimeError(f"TRACE MODE: request {rid} names trace {k} of {len(self.traces)}")
            prompt_len, resp = self.traces[k]
            row = torch.full((self.trace_width,), self.trace_eos, dtype=torch.long)
            row[: len(resp)] = torch.tensor(resp, dtype=torch.long)
            self.trace_table[slot].copy_(row)
            self.trace_prompt_len[slot] = prompt_len
            self.trace_active[slot] = True


EntryClass = [HistospecTraceLlamaForCausalLM]
