"""SGLang's own NGRAM verify path, run on CPU with the HISTORY worker and a fake target model.

Run by ``tests/engine/test_plugin.py`` in the SGLang environment with ``SGLANG_USE_CPU_ENGINE=1`` and the
test ``sgl_kernel`` (bench/cpu_engine/stubs) on ``PYTHONPATH``; prints one ``RESULT {json}`` line.

What is real: SGLang 0.5.17's server arguments (parsed with the plugin loaded), its model config,
and all of ``NGRAMWorker.forward_batch_generation``: the tree reconstruction, the TARGET_VERIFY
batch (input ids, positions, cache locations, the custom mask), greedy tree verification in
``eagle_sample``, the KV compaction of the accepted path and the result it hands the scheduler.

What is fake: the target model and the scheduler loop. The model is a deterministic greedy policy
over a small vocabulary that emulates tree attention: it writes each node's token into a KV store
at the node's cache location, then reads every node's context back from the request's committed
slots (``req_to_token``) plus the node's ancestors in the custom mask, checking the node's position
on the way. A wrong cache location, position, mask or compaction changes what it reads, and so
what it predicts: the test compares every response with plain greedy decoding of the same policy.

Two engines run two epochs of 3 prompts x 2 samples each on the synchronous loop, under each step
policy: ``HISTOSPEC_CONTROL=fixed`` (every step verified at width d) and ``cost`` (each step verified
at one of its widths or decoded plainly, the target's DECODE forward at width 1). SGLang's overlap
scheduler is not emulated here: tests/engine/test_lossless.py runs HISTORY under the real one.

``sglang_cpu_verify.py MODEL RANK PORT`` runs one of two tensor-parallel ranks (gloo on loopback):
rank 0 drafts and broadcasts its drafts (:mod:`histospec_sgl.plugin.tp`), rank 1 keeps no index.
Both must run the same steps at the same widths and produce the same responses.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import types

import numpy as np
import torch

D, V, SLOTS, SLOT_LEN = 8, 200, 16, 256


class Policy:
    """Greedy next token: the prompt's reference response while the context follows it, else a
    hash of the last three tokens."""

    def __init__(self, prompts: list[list[int]], rng: np.random.Generator):
        self.ref = {tuple(p): rng.integers(10, V, size=80).tolist() for p in prompts}

    def __call__(self, ctx: list[int]) -> int:
        ref, resp = self.ref[tuple(ctx[:4])], ctx[4:]
        if len(resp) < len(ref) and resp == ref[: len(resp)]:
            return ref[len(resp)]
        return (hash(tuple(ctx[-3:])) % (V - 10)) + 10

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        ctx = list(prompt)
        for _ in range(n):
            ctx.append(self(ctx))
        return ctx[len(prompt):]


class KVStore:
    """The token_to_kv_pool's KV cache: one token id per slot."""

    def __init__(self):
        self.store = torch.full((SLOTS * SLOT_LEN,), -1, dtype=torch.int64)

    def move_kv_cache(self, tgt: torch.Tensor, src: torch.Tensor) -> None:
        self.store[tgt] = self.store[src].clone()


class Target:
    """Stands for SGLang's TpModelWorker: memory pools, a TARGET_VERIFY forward and a DECODE forward
    with its sampling (greedy), reading each request's context from its KV slots."""

    def __init__(self, server_args, policy: Policy):
        from sglang.srt.configs.model_config import ModelConfig

        self.policy = policy
        self.kv = KVStore()
        self.req_to_token = torch.arange(SLOTS * SLOT_LEN, dtype=torch.int32).reshape(SLOTS, SLOT_LEN)
        self.pools = (types.SimpleNamespace(req_to_token=self.req_to_token),
                      types.SimpleNamespace(get_kvcache=lambda: self.kv, page_size=1))
        self.model_runner = types.SimpleNamespace(max_running_requests=SLOTS,
                                                  model_config=ModelConfig.from_server_args(server_args),
                                                  watermark_state=None)  # read by 0.5.23
        # (batch size, tokens per request) of every forward: the tree width of a verify, 1 of a
        # plain decode step; and the forward modes seen
        self.calls: list[tuple[int, int]] = []
        self.modes: set[str] = set()

    def get_memory_pool(self):
        return self.pools

    def forward_batch_generation(self, batch, is_verify=False, **_kwargs):  # 0.5.23 adds pp_proxy_tensors
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput

        if not is_verify:
            return self._decode(batch)
        assert batch.forward_mode.is_target_verify()
        self.modes.add("verify")
        bs = len(batch.reqs)
        si = batch.spec_info
        w = si.draft_token_num
        assert batch.input_ids.numel() == bs * w and batch.out_cache_loc.numel() == bs * w
        self.calls.append((bs, w))
        mask = si.custom_mask.reshape(-1)[: bs * w * w].reshape(bs, w, w).bool()
        store = self.kv.store
        store[batch.out_cache_loc.long()] = batch.input_ids.long()
        logits = torch.full((bs * w, V), -1e4)
        for b in range(bs):
            slot, committed = int(batch.req_pool_indices[b]), int(batch.seq_lens[b])
            prefix = store[self.req_to_token[slot, :committed].long()].tolist()
            assert -1 not in prefix, "a committed position has no KV"
            for i in range(w):
                anc = [j for j in range(w) if mask[b, i, j]]
                assert int(si.positions[b * w + i]) == committed + len(anc) - 1, "position"
                ctx = prefix + [int(store[int(batch.out_cache_loc[b * w + j])]) for j in anc]
                logits[b * w + i, self.policy(ctx)] = 0.0
        return types.SimpleNamespace(logits_output=LogitsProcessorOutput(next_token_logits=logits),
                                     can_run_cuda_graph=False)

    def _decode(self, batch):
        """A plain decode step as SGLang's TpModelWorker runs it: one input token per request,
        written to its cache slot, at position ``seq_lens - 1`` (``seq_lens`` counts it), sampled
        from the context in the request's committed slots."""
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput

        assert batch.forward_mode.is_decode() and batch.spec_info is None
        bs = len(batch.reqs)
        assert batch.input_ids.numel() == bs and batch.out_cache_loc.numel() == bs
        assert batch.seq_lens_sum == int(batch.seq_lens_cpu.sum()) and (batch.seq_lens == batch.seq_lens_cpu).all()
        self.calls.append((bs, 1))
        self.modes.add("decode")
        store = self.kv.store
        store[batch.out_cache_loc.long()] = batch.input_ids.long()
        logits = torch.full((bs, V), -1e4)
        nxt = torch.empty(bs, dtype=torch.int64)
        for b in range(bs):
            slot, n = int(batch.req_pool_indices[b]), int(batch.seq_lens[b])
            assert int(batch.out_cache_loc[b]) == int(self.req_to_token[slot, n - 1]), "the new token's slot"
            ctx = store[self.req_to_token[slot, :n].long()].tolist()
            assert -1 not in ctx, "a position has no KV"
            nxt[b] = self.policy(ctx)
            logits[b, nxt[b]] = 0.0
        return types.SimpleNamespace(logits_output=LogitsProcessorOutput(next_token_logits=logits),
                                     next_token_ids=nxt, can_run_cuda_graph=False)


class Req:
    def __init__(self, rid: str, prompt: list[int], slot: int, max_new: int):
        self.rid, self.origin_input_ids, self.slot, self.max_new = rid, prompt, slot, max_new
        self.output_ids: list[int] = []
        self.pending: list[int] = []  # accepted by the last step, processed before the next
        self.done, self.finished_reason = False, None
        self.sampling_params = types.SimpleNamespace(custom_params=None)

    def finished(self) -> bool:
        return self.done


def decode(worker, target: Target, reqs: list[Req]) -> int:
    """Prefill, then synchronous decode steps (each step's result processed before the next one)
    until every request has max_new tokens."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    for r in reqs:
        n = len(r.origin_input_ids)
        target.kv.store[target.req_to_token[r.slot, :n].long()] = torch.tensor(r.origin_input_ids)
        r.pending = [target.policy(list(r.origin_input_ids))]
    live, steps = list(reqs), 0
    while live:
        bs = len(live)
        for r in live:
            r.output_ids, r.pending = r.output_ids + r.pending, []
        seq = torch.tensor([len(r.origin_input_ids) + len(r.output_ids) + len(r.pending) - 1 for r in live])
        acc = torch.zeros(bs * D, dtype=torch.int32)
        lens = torch.zeros(bs, dtype=torch.int32)
        for i, r in enumerate(live):
            # the relay of the previous step's accepted tokens (the last one, on the synchronous loop)
            prev = r.output_ids[-1:]
            acc[i * D: i * D + len(prev)] = torch.tensor(prev)
            lens[i] = len(prev)
        batch = types.SimpleNamespace(
            reqs=live, forward_mode=ForwardMode.DECODE, seq_lens=seq, seq_lens_cpu=seq.clone(),
            req_pool_indices=torch.tensor([r.slot for r in live]), req_to_token_pool=target.pools[0],
            has_grammar=False, return_logprob=False, device="cpu", input_ids=None, out_cache_loc=None,
            seq_lens_sum=None,
            sampling_info=types.SimpleNamespace(is_all_greedy=True, acc_additive_penalties=None,
                                                acc_scaling_penalties=None, logit_bias=None),
            spec_info=types.SimpleNamespace(accept_tokens=acc, accept_lens=lens),
            grammar_needs_sync=lambda: False)
        res = worker.forward_batch_generation(batch)
        steps += 1
        nxt = res.next_draft_input
        # The relay to the next step is at stride d whatever the step's width; the tokens the
        # scheduler reads are at the step's own stride, which the result names (a narrower verify
        # or a plain step: fewer than d).
        assert nxt.draft_token_num == D and nxt.accept_tokens.numel() == bs * D
        stride = res.speculative_num_draft_tokens
        assert 1 <= stride <= D and res.next_token_ids.numel() == bs * stride, (stride, res.next_token_ids.numel())
        relayed = nxt.accept_tokens.reshape(bs, D)
        emitted = res.next_token_ids.reshape(bs, stride)
        for i, r in enumerate(live):
            n = int(res.accept_lens[i])
            assert int(nxt.new_seq_lens[i]) == int(seq[i]) + n
            assert emitted[i, :n].tolist() == relayed[i, :n].tolist()
            r.output_ids += r.pending  # result processing of the previous step
            r.pending = emitted[i, :n].tolist()
        worker.on_verify_complete_cpu((res.accept_lens - 1).tolist())
        for r in list(live):
            if len(r.output_ids) + len(r.pending) >= r.max_new:
                r.output_ids = (r.output_ids + r.pending)[: r.max_new]
                r.pending, r.done = [], True
                live.remove(r)
                worker.note_request_finished(rid=r.rid, natural_stop=True)
    return steps


def engine(model_path: str, control: str, tp: tuple | None = None) -> dict:
    from sglang.srt.server_args import prepare_server_args, set_global_server_args_for_scheduler

    from histospec_sgl.plugin.worker import HistoryWorker

    os.environ["HISTOSPEC_CONTROL"] = control
    args = ["--model-path", model_path, "--device", "cpu", "--load-format", "dummy", "--skip-tokenizer-init",
            "--speculative-algorithm", "HISTORY", "--speculative-num-draft-tokens", str(D),
            "--attention-backend", "flashinfer"]
    sa = prepare_server_args(args + ["--disable-overlap-schedule"])
    set_global_server_args_for_scheduler(sa)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, V, size=4).tolist() for _ in range(3)]
    policy = Policy(prompts, rng)
    target = Target(sa, policy)
    # NGRAMWorker's constructor takes `ps` in 0.5.17 and not in 0.5.23: pass what it names.
    from sglang.srt.speculative.ngram_worker import NGRAMWorker

    kw = dict(server_args=sa, gpu_id=0, ps=types.SimpleNamespace(tp_rank=0), nccl_port=0, target_worker=target)
    names = inspect.signature(NGRAMWorker.__init__).parameters
    worker = HistoryWorker(**{k: v for k, v in kw.items() if k in names})
    worker.alloc_memory_pool()
    if tp is not None:  # (group, rank): rank 0 drafts and broadcasts, rank 1 keeps no index
        from histospec_sgl.plugin.tp import DraftBroadcast

        group, rank = tp
        worker.broadcast = DraftBroadcast(group, src=0, rank_in_group=rank, world_size=2)
        if rank != 0:
            worker.drafter = None
    assert worker.enable_overlap is False
    from histospec_sgl.engine.costmodel import EngineControl

    control = worker.drafter.policy if worker.drafter is not None else None
    if isinstance(control, EngineControl):
        # Every width measured up front in every batch bucket (the engine measures d and plain
        # decoding in its first bucket, and the others once chosen or once a bucket has run
        # `settle` steps), so that each width's verify runs here whatever the costs say; no timing
        # left out as an outlier, so that which steps count as measured does not depend on the
        # machine's load (a dropped timing would stretch the exploration past the short-lived batch
        # sizes).
        control.explore = (*control.widths, 1)
        control.settle = 0
        control.clock.outlier = float("inf")
    import sglang

    out: dict = {"epochs": [], "sglang": sglang.__version__}
    for epoch in range(2):
        # different lengths, so that the batch shrinks step by step
        reqs = [Req(f"e{epoch}p{k}s{s}", prompts[k], 2 * k + s, 20 + 6 * (2 * k + s))
                for k in range(3) for s in range(2)]
        target.calls.clear()
        steps = decode(worker, target, reqs)
        out["epochs"].append(dict(
            steps=steps, tokens=sum(r.max_new for r in reqs),
            identical=all(r.output_ids == policy.greedy(r.origin_input_ids, r.max_new) for r in reqs),
            calls=sorted(set(target.calls)), modes=sorted(target.modes)))
    out.update(plain_steps=worker.plain_steps, context_mismatches=worker.context_mismatches,
               width_after=worker.draft_token_num,
               responses=worker.history_stats().get("responses"))
    out["measured_widths"] = sorted({w for w, _ in control.step_costs()}) if control is not None else []
    return out


if __name__ == "__main__":
    from sglang.srt.plugins import load_plugins

    load_plugins()
    tp = None
    if len(sys.argv) > 2:  # tensor parallelism: RANK PORT, two processes over gloo
        import torch.distributed as dist

        rank, port = int(sys.argv[2]), sys.argv[3]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        tp = (dist.new_group([0, 1], backend="gloo"), rank)
    results = {c: engine(sys.argv[1], c, tp) for c in ("fixed", "cost")}
    print("RESULT " + json.dumps(results))
