"""Test-only stand-in for SGLang's kernel package on a machine without a GPU.

``sglang.srt.speculative.ngram_worker`` (and the HISTORY worker built on it) imports names from
``sgl_kernel`` at module import. With ``SGLANG_USE_CPU_ENGINE=1`` SGLang takes its CPU branches,
which call the ``*_cpu`` ops below. They restate, in plain torch, what SGLang's kernels do
(sgl-kernel ``VerifyTreeGreedy``, ``reconstructIndicesFromTreeMask``, and the Triton
``assign_extend_cache_locs`` / ``fill_accept_out_cache_loc``), so that NGRAM's own verify path
(``forward_batch_generation``: tree reconstruction, greedy tree verification, KV compaction) runs
on CPU in the tests. Ops no test reaches raise.
"""

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
    flat_target = target_predict.reshape(-1)
    for b in range(bs):
        last = int(retrive_index[b, 0])
        accept_index[b, 0] = last
        n, cur = 0, 0
        for _ in range(1, steps):
            cur = int(retrive_next_token[b, cur])
            while cur != -1:
                want = int(flat_target[last])
                if int(candidates[b, cur]) == want:
                    predicts[last] = want
                    n += 1
                    accept_index[b, n] = int(retrive_index[b, cur])
                    last = int(retrive_index[b, cur])
                    break
                cur = int(retrive_next_sibling[b, cur])
            if cur == -1:
                break
        accept_token_num[b] = n
        predicts[last] = flat_target[last]


def _unreachable(name):
    def op(*args, **kwargs):
        raise RuntimeError(f"sgl_kernel test stub: {name} is not available on CPU")

    op.__name__ = name
    return op


build_tree_kernel_efficient_cpu = _unreachable("build_tree_kernel_efficient_cpu")
fill_bonus_tokens_cpu = _unreachable("fill_bonus_tokens_cpu")
rotate_input_ids_cpu = _unreachable("rotate_input_ids_cpu")
copy_all_layer_kv_cache_cpu = _unreachable("copy_all_layer_kv_cache_cpu")
assign_req_to_token_pool_cpu = _unreachable("assign_req_to_token_pool_cpu")
assign_draft_cache_locs_contiguous_cpu = _unreachable("assign_draft_cache_locs_contiguous_cpu")
