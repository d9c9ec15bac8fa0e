"""``reconstruct_indices_from_tree_mask`` for the CPU tests (see the package docstring)."""

import torch


def reconstruct_indices_from_tree_mask(tree_mask, verified_seq_len, positions, retrive_index,
                                       retrive_next_token, retrive_next_sibling, batch_size,
                                       draft_token_num):
    """From each request's ``[d, d]`` ancestor mask: the node's position (its depth after the
    request's verified length), its flat index, its first child and its next sibling (-1: none)."""
    d = draft_token_num
    m = tree_mask.reshape(-1)[: batch_size * d * d].reshape(batch_size, d, d).bool()
    for b in range(batch_size):
        parent = [-1] * d
        for t in range(d):
            anc = [i for i in range(t) if m[b, t, i]]
            parent[t] = anc[-1] if anc else -1
            retrive_index[b, t] = b * d + t
            positions[b * d + t] = len(anc) + int(verified_seq_len[b])
        for t in range(d):
            kids = [i for i in range(t + 1, d) if parent[i] == t]
            retrive_next_token[b, t] = kids[0] if kids else -1
            sib = [i for i in range(t + 1, d) if parent[t] != -1 and parent[i] == parent[t]]
            retrive_next_sibling[b, t] = sib[0] if sib else -1
