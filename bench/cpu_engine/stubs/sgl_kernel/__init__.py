"""Test-only stand-in for SGLang's kernel package on a machine without a GPU.

``sglang.srt.speculative.ngram_worker`` (and the HISTORY worker built on it) imports names from
``sgl_kernel`` at module import. With ``SGLANG_USE_CPU_ENGINE=1`` SGLang takes its CPU branches,
which call the ``*_cpu`` ops below. They restate, in plain torch, what SGLang's kernels do
(sgl-kernel ``VerifyTreeGreedy``, ``reconstructIndicesFromTreeMask``, and the Triton
``assign_extend_cache_locs`` / ``fill_accept_out_cache_loc``), so that NGRAM's own verify path
(``forward_batch_generation``: tree reconstruction, greedy tree verification, KV compaction) runs
on CPU in the tests, and, for the real CPU engine (``bench/cpu_engine``), the KV moves of SGLang's
memory pools and the sampling-verify kernel with its two renormalizations. Ops no test reaches raise.
"""

import ctypes

import numpy as np
import torch

from sgl_kernel.speculative import reconstruct_indices_from_tree_mask  # noqa: F401


def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len=None):
    """``out_cache_loc`` = the concatenation over requests of
    ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]``."""
    at = 0
    for i in range(req_pool_indices.numel()):
        s, e = int(start_offset[i]), int(end_offset[i])
        out_cache_loc[at: at + e - s] = req_to_token[int(req_pool_indices[i]), s:e]
        at += e - s


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc):
    """The accepted slots' cache locations, packed to the front in ``accept_index`` order."""
    flat = accept_index.reshape(-1)
    keep = flat[flat != -1].long()
    accept_out_cache_loc[: keep.numel()] = out_cache_loc[keep]


def verify_tree_greedy_cpu(predicts, accept_index, accept_token_num, candidates, retrive_index,
                           retrive_next_token, retrive_next_sibling, target_predict):
    """Greedy tree verification, one request at a time: from the root, follow the child whose draft
    token equals the target's argmax at the last accepted node (first child, then next siblings)."""
    bs, d = candidates.shape
    steps = accept_index.shape[1]
    cand, index = candidates.tolist(), retrive_index.tolist()
    first, sibling = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    target = target_predict.reshape(-1).tolist()
    at, values = [], []
    for b in range(bs):
        last = index[b][0]
        accepted = [last]
        cur = 0
        for _ in range(1, steps):
            cur = first[b][cur]
            want = target[last]
            while cur != -1 and cand[b][cur] != want:
                cur = sibling[b][cur]
            if cur == -1:
                break
            at.append(last)
            values.append(want)
            last = index[b][cur]
            accepted.append(last)
        at.append(last)
        values.append(target[last])
        accept_index[b, : len(accepted)] = torch.tensor(accepted, dtype=accept_index.dtype)
        accept_token_num[b] = len(accepted) - 1
    predicts[torch.tensor(at, dtype=torch.long)] = torch.tensor(values, dtype=predicts.dtype)


def _unreachable(name):
    def op(*args, **kwargs):
        raise RuntimeError(f"sgl_kernel test stub: {name} is not available on CPU")

    op.__name__ = name
    return op


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """For every layer buffer (base address ``data_ptrs[i]``, ``strides[i]`` bytes per token slot):
    slot ``tgt_loc[j]`` = slot ``src_loc[j]``. Every source is read before any target is written,
    as the Triton kernel's tiles do, so overlapping moves are safe."""
    if tgt_loc.numel() == 0:
        return
    tgt = tgt_loc.long().numpy()
    src = src_loc.long().numpy()
    rows = int(max(tgt.max(), src.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (rows * int(stride))).from_address(int(ptr))
        buf = np.frombuffer(raw, dtype=np.uint8).reshape(rows, int(stride))
        buf[tgt] = buf[src]


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len=None):
    """The inverse of :func:`assign_extend_cache_locs_cpu`: request ``i``'s slots
    ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`` take the next
    ``end_offset[i] - start_offset[i]`` entries of ``out_cache_loc``."""
    at = 0
    for i in range(req_pool_indices.numel()):
        s, e = int(start_offset[i]), int(end_offset[i])
        req_to_token[int(req_pool_indices[i]), s:e] = out_cache_loc[at: at + e - s]
        at += e - s


def top_k_renorm_prob(probs, top_k):
    """Each row keeps its ``top_k[i]`` largest probabilities (ties at the k-th value kept), renormalized."""
    k = top_k.reshape(-1).long().clamp(min=1, max=probs.shape[-1])
    ordered = probs.sort(dim=-1, descending=True).values
    kth = ordered.gather(-1, (k - 1).unsqueeze(-1))
    kept = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)


def top_p_renorm_prob(probs, top_p):
    """Each row keeps its most probable tokens up to cumulative probability ``top_p[i]`` (a token is
    kept while the mass before it is at most ``top_p``: SGLang's torch sampler's rule), renormalized."""
    p = top_p.reshape(-1, 1).to(probs.dtype)
    ordered, idx = probs.sort(dim=-1, descending=True)
    before = ordered.cumsum(dim=-1) - ordered
    ordered = torch.where(before > p, torch.zeros_like(ordered), ordered)
    kept = torch.zeros_like(probs).scatter_(-1, idx, ordered)
    return kept / kept.sum(dim=-1, keepdim=True)


def tree_speculative_sampling_target_only(predicts, accept_index, accept_token_num, candidates, retrive_index,
                                          retrive_next_token, retrive_next_sibling, uniform_samples,
                                          uniform_samples_for_final_sampling, target_probs, draft_probs,
                                          threshold_single=1.0, threshold_acc=1.0, deterministic=True):
    """Sampling verification of draft trees (sgl-kernel's ``TreeSpeculativeSamplingTargetOnly``).

    Per request, from the root: the children of the last accepted node are tried in order with one
    coin u (``uniform_samples`` at that node); child k with token t is accepted when
    ``u <= (p_1 + ... + p_k) / threshold_acc`` or ``p_k >= threshold_single`` (p: the target's
    probability of each child's token at the parent). A rejected child's probability is moved into
    ``draft_probs`` at the parent. The bonus token is drawn with the final coin from
    ``relu(target - draft)`` at the last accepted node: the target distribution with the rejected
    tokens taken out, which makes the whole step sample exactly from the target when thresholds are 1."""
    bs, d = candidates.shape
    steps = accept_index.shape[1]
    acc = float(threshold_acc)
    single = float(threshold_single)
    cand, index = candidates.tolist(), retrive_index.tolist()
    first, sibling = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    coins, final_coins = uniform_samples.tolist(), uniform_samples_for_final_sampling.reshape(-1).tolist()
    for b in range(bs):
        last = index[b][0]
        accepted = [last]
        cur, parent = 0, 0
        coin = coins[b][0]
        rejected: list[int] = []
        for _ in range(1, steps):
            cur = first[b][cur]
            mass = 0.0
            while cur != -1:
                token = cand[b][cur]
                p = float(target_probs[b, parent, token])
                mass += p
                if coin <= mass / acc or p >= single:
                    coin = coins[b][cur]
                    predicts[last] = token
                    last = index[b][cur]
                    accepted.append(last)
                    parent = cur
                    rejected = []
                    break
                rejected.append(token)
                cur = sibling[b][cur]
            if cur == -1:
                break
        accept_index[b, : len(accepted)] = torch.tensor(accepted, dtype=accept_index.dtype)
        accept_token_num[b] = len(accepted) - 1
        if rejected:
            draft_probs[b, parent, rejected] = target_probs[b, parent, rejected]
        rest = (target_probs[b, parent] - draft_probs[b, parent]).clamp(min=0).double()
        cdf = rest.cumsum(0)
        u = final_coins[b] * float(cdf[-1])
        token = int(torch.searchsorted(cdf, torch.tensor([u], dtype=cdf.dtype), right=True)[0])
        predicts[last] = min(token, rest.numel() - 1)


build_tree_kernel_efficient_cpu = _unreachable("build_tree_kernel_efficient_cpu")
fill_bonus_tokens_cpu = _unreachable("fill_bonus_tokens_cpu")
rotate_input_ids_cpu = _unreachable("rotate_input_ids_cpu")
assign_draft_cache_locs_contiguous_cpu = _unreachable("assign_draft_cache_locs_contiguous_cpu")
