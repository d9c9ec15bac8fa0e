"""``reconstruct_indices_from_tree_mask`` for the CPU tests (see the package docstring)."""

import numpy as np
import torch


def reconstruct_indices_from_tree_mask(tree_mask, verified_seq_len, positions, retrive_index,
                                       retrive_next_token, retrive_next_sibling, batch_size,
                                       draft_token_num):
    """From each request's ``[d, d]`` ancestor mask: the node's position (its depth after the
    request's verified length), its flat index, its first child and its next sibling (-1: none).
    A node's parent is its latest ancestor (parents precede children)."""
    bs, d = batch_size, draft_token_num
    m = tree_mask.reshape(-1)[: bs * d * d].reshape(bs, d, d).bool().numpy()
    strict = np.tril(m, k=-1)  # ancestors, without the node itself
    has = strict.any(axis=-1)
    parent = np.where(has, d - 1 - np.argmax(strict[:, :, ::-1], axis=-1), -1)
    rows = np.arange(bs)
    first_child = np.full((bs, d), -1, dtype=np.int64)
    next_sibling = np.full((bs, d), -1, dtype=np.int64)
    latest = np.full((bs, d + 1), -1, dtype=np.int64)  # per parent (+1), the next node seen so far
    for t in range(d - 1, 0, -1):
        p = parent[:, t]
        next_sibling[:, t] = latest[rows, p + 1]
        latest[rows, p + 1] = t
        ok = p >= 0
        first_child[rows[ok], p[ok]] = t
    depth = strict.sum(axis=-1) + verified_seq_len[:bs].long().numpy()[:, None]
    positions[: bs * d] = torch.from_numpy(depth.reshape(-1)).to(positions.dtype)
    retrive_index[:bs] = torch.arange(bs * d).reshape(bs, d).to(retrive_index.dtype)
    retrive_next_token[:bs] = torch.from_numpy(first_child).to(retrive_next_token.dtype)
    retrive_next_sibling[:bs] = torch.from_numpy(next_sibling).to(retrive_next_sibling.dtype)
