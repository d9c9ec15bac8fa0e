"""The draft layout SGLang's NGRAM verification consumes, checked for a whole batch (shared by tests)."""

from __future__ import annotations

import numpy as np


def check_contract(tokens: np.ndarray, mask: np.ndarray, roots: list[int], d: int) -> list[list[int]]:
    """SGLang's NGRAM verify contract for every request; returns each request's parent list."""
    bs = len(roots)
    assert tokens.shape == (bs * d,) and mask.shape == (bs * d * d,)
    parents_all = []
    for b in range(bs):
        t = tokens[b * d : (b + 1) * d]
        m = mask[b * d * d : (b + 1) * d * d].reshape(d, d)
        assert t[0] == roots[b], "node 0 is the root: the request's last token"
        assert m[0].tolist() == [1] + [0] * (d - 1)
        parents = [-1]
        for i in range(1, d):
            assert m[i, i] == 1 and not m[i, i + 1 :].any(), "a node sees only itself and earlier nodes"
            anc = [j for j in range(i) if m[i, j]]
            assert anc and anc[0] == 0, "every node descends from the root"
            p = anc[-1]
            # The ancestors of i are exactly p and p's ancestors.
            assert set(anc) == {p} | {j for j in range(p) if m[p, j]}
            parents.append(p)
        children: dict[int, list[int]] = {}
        for i in range(1, d):
            children.setdefault(parents[i], []).append(int(t[i]))
        for p, toks in children.items():
            assert len(toks) == len(set(toks)), f"duplicate sibling tokens under node {p}: {toks}"
        parents_all.append(parents)
    return parents_all
