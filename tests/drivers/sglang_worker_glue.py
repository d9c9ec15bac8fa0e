"""The real HistoryWorker (a subclass of SGLang 0.5.17's NGRAMWorker) driven through overlap-mode
decode steps with fake requests, in .venv-sglang with the sgl_kernel stand-ins on PYTHONPATH (for
tests/engine/test_plugin.py):

    python sglang_worker_glue.py SNAPSHOT_PATH
"""
import inspect
import json
import sys
import types

import torch

from histospec_sgl import prompt_key
from histospec_sgl.plugin.worker import HistoryWorker

D = 8
sa = types.SimpleNamespace(disable_overlap_schedule=False, page_size=1, speculative_num_draft_tokens=D,
                           speculative_ngram_max_trie_depth=18, speculative_eagle_topk=8,
                           speculative_num_steps=1, device="cpu", tp_size=1, enable_metrics=True,
                           served_model_name="tiny-llama")
target = types.SimpleNamespace(model_runner=types.SimpleNamespace())
# The constructor's arguments as the installed SGLang names them: 0.5.15 takes each rank, 0.5.17
# (server_args, gpu_id, ps, nccl_port, target_worker).
from sglang.srt.speculative.ngram_worker import NGRAMWorker  # noqa: E402

kw = dict(server_args=sa, gpu_id=0, ps=types.SimpleNamespace(tp_rank=0), nccl_port=0, target_worker=target,
          tp_rank=0, dp_rank=None, moe_ep_rank=0, attn_cp_rank=0, moe_dp_rank=0)
w = HistoryWorker(**{k: v for k, v in kw.items() if k in inspect.signature(NGRAMWorker.__init__).parameters})

class Req:
    def __init__(self, rid, prompt, full, group=None, abort=False):
        self.rid, self.origin_input_ids, self.full = rid, prompt, full
        self.output_ids = []
        self.sampling_params = types.SimpleNamespace(
            custom_params={"histospec_group": group} if group is not None else None)
        self.done, self.abort = False, abort
        self.finished_reason = self.finished_len = None
    def finished(self):
        return self.done

def step(reqs, pending):
    """One overlap-mode decode step: pending[rid] = tokens accepted last step, not yet in output_ids."""
    acc = torch.zeros(len(reqs) * D, dtype=torch.int64)
    lens = torch.zeros(len(reqs), dtype=torch.int32)
    for i, r in enumerate(reqs):
        p = pending.get(r.rid, [])
        acc[i * D: i * D + len(p)] = torch.tensor(p, dtype=torch.int64)
        lens[i] = len(p)
    # SGLang's seq_lens: every accepted token but the root (the last one), whose KV the step computes.
    seq = torch.tensor([len(r.origin_input_ids) + len(r.output_ids) + len(pending.get(r.rid, [])) - 1 for r in reqs])
    batch = types.SimpleNamespace(reqs=reqs, spec_info=types.SimpleNamespace(accept_tokens=acc, accept_lens=lens),
                                  seq_lens=seq, seq_lens_cpu=seq, grammar_needs_sync=lambda: False)
    for r in reqs:
        w._reqs.setdefault(r.rid, r)
    tokens, mask = w._prepare_draft_tokens(batch)
    assert tokens.shape == (len(reqs) * D,) and mask.shape == (len(reqs) * D * D,)
    out = {}
    for i, r in enumerate(reqs):
        r.output_ids = r.output_ids + pending.get(r.rid, [])  # result processing catches up
        pos = len(r.output_ids)
        t = tokens[i * D:(i + 1) * D].tolist()
        assert t[0] == (r.output_ids[-1] if r.output_ids else r.origin_input_ids[-1])
        # Greedy chain acceptance of what the request will really generate next.
        acc_n = 0
        m = mask[i * D * D:(i + 1) * D * D].reshape(D, D)
        node = 0
        while pos + acc_n < len(r.full):
            kids = [j for j in range(1, D) if m[j].sum() == m[node].sum() + 1 and m[j, node] and t[j] == r.full[pos + acc_n]]
            if not kids:
                break
            node = kids[0]
            acc_n += 1
        out[r.rid] = r.full[pos: pos + acc_n + 1]
    return out, tokens

prompt = [101, 102, 103]
base = list(range(200, 240))
reqs = [Req(f"a{k}", prompt, [7] + base + [9000 + k]) for k in range(3)]
# First decode step after prefill: the prefill token is pending.
# a0 starts alone; its siblings join 15 steps later and draft from its in-flight context.
start = {"a0": 0, "a1": 15, "a2": 15}
pending = {}
accepted_steps = []
for n in range(80):
    for r in reqs:
        if start[r.rid] == n:
            pending[r.rid] = [r.full[0]]  # the prefill token
    live = [r for r in reqs if not r.done and start[r.rid] <= n]
    if not live:
        break
    pending, tokens = step(live, pending)
    accepted_steps.append(sum(len(v) - 1 for v in pending.values()))
    for r in live:
        if len(r.output_ids) + len(pending[r.rid]) >= len(r.full):
            r.output_ids += pending.pop(r.rid)
            r.done = True
            w.note_request_finished(rid=r.rid, natural_stop=True)
stats = w.history_stats()
# A second epoch of the same prompt drafts the whole response from history.
r2 = Req("b0", prompt, [7] + base + [9000])
pend, _ = step([r2], {"b0": [7]})
first = len(pend["b0"])
# An aborted request leaves no history; a custom group is honoured.
ab = Req("x", [5, 5, 5], [1, 2, 3], group="custom")
step([ab], {"x": [1]})
ab.done = True
ab.finished_reason = type("FINISH_ABORT", (), {})()
w._departed(["x"])
step([r2], {"b0": pend["b0"]})  # the next step's metrics see the abort
w.metrics.refresh_index(w.drafter)
from prometheus_client import CollectorRegistry, multiprocess  # noqa: E402

reg = CollectorRegistry()
multiprocess.MultiProcessCollector(reg)
metrics = {}
for fam in reg.collect():
    for smp in fam.samples:
        if smp.name.startswith("histospec:"):
            assert smp.labels["model_name"] == "tiny-llama", smp
            metrics[smp.name + (f"/{smp.labels['kept']}" if "kept" in smp.labels else "")] = smp.value
totals = w.drafter.totals.as_dict()
index = w.drafter.index.stats()
# A request whose last step went past its end (a stop string matched 6 tokens into the 10 it has):
# SGLang keeps them all in output_ids and returns 6; the history holds those 6.
stop = Req("s", [6, 6, 6], list(range(300, 310)))
sp_ = {"s": [300]}
while not stop.done:
    sp_, _ = step([stop], sp_)
    if len(stop.output_ids) + len(sp_["s"]) >= 8:
        stop.output_ids += sp_.pop("s")
        stop.done, stop.finished_len = True, 6
        w.note_request_finished(rid="s", natural_stop=True)
cut = [(list(p), list(r)) for p, r, _ in w.drafter.index.responses(prompt_key([6, 6, 6]))]
w.clear_cache_pool()  # flush_cache after a weight update: history stays
w.history_save(sys.argv[1])
import sglang  # noqa: E402

print("RESULT " + json.dumps(dict(sglang=sglang.__version__,
    steps=len(accepted_steps), accepted=sum(accepted_steps), responses=stats["responses"],
    after_flush=w.drafter.index.stats()["responses"], first=first, finished=stats["finished"],
    live=sorted(w.drafter.live()), groups=w.drafter.index.group_keys(), key=prompt_key(prompt),
    metrics=metrics, totals=totals, index=index, cut=cut)))
