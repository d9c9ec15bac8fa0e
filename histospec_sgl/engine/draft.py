"""A draft tree in SGLang's layout, as the index's ``draft_batch`` writes it (Rust's ``write_tree``):
per request, ``d`` node tokens in BFS order (the root, the last context token, first) and a flat
``d x d`` ancestor mask (row i: node i and its ancestors); a draft of fewer than ``d`` nodes is padded
with a chain of token-0 nodes, each the child of the one before. The conversions between that layout
and parent positions live here once (:func:`tree_mask`, :func:`tree_parents`,
:func:`tree_parents_batch`, :func:`write_empty`);
tests/unit/test_index.py holds them equal to what the index writes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # the native module loads on first use (histospec_sgl/__init__.py)
    from histospec_sgl._core import HistoryIndex

__all__ = ["Draft", "draft", "tree_mask", "tree_parents", "tree_parents_batch", "walk", "write_empty"]


def advance(accepted: int, left: int) -> int:
    """Tokens a verify step emits: its ``accepted`` draft tokens and the one the target samples after
    them, never past the response's end (``left`` tokens to go). The one advance rule of the replay,
    the benchmarks and the simulator's traces."""
    return min(accepted + 1, max(left, 0))


def walk(tokens: Sequence[int] | Any, parents: Sequence[int] | Any, seq: Any, node: int = 0, *,
         leaf_ends: bool = False) -> tuple[int, int, bool]:
    """Tree verification's walk, written once (the replay's acceptance, the simulator's traces and
    the engine's shadow drafts all use it): follows the tokens of ``seq`` down the draft tree from
    ``node``, each to the child that carries it (nodes in parent-before-child order, the root at 0).
    Returns the node reached, how many tokens matched, and whether the walk ended (a token no child
    carries; with ``leaf_ends``, also a leaf reached, where nothing more can match)."""
    n, matched = len(tokens), 0
    for t in seq:
        nxt = -1
        for j in range(node + 1, n):
            if parents[j] == node and tokens[j] == t:
                nxt = j
                break
        if nxt < 0:
            return node, matched, True
        node, matched = nxt, matched + 1
        if leaf_ends and not any(parents[j] == node for j in range(node + 1, n)):
            return node, matched, True
    return node, matched, False


@dataclass(frozen=True)
class Draft:
    """One request's draft tree in SGLang's layout (BFS order, root first, unpadded).

    Attributes:
        tokens: ``[n]`` int64 token ids; ``tokens[0]`` is the root (the last context token).
        parents: ``[n]`` int64 parent positions; ``parents[0] == -1``.
        probs: ``[n]`` float32 estimated probability that each node's path is accepted.
    """

    tokens: np.ndarray  # [n]
    parents: np.ndarray  # [n]
    probs: np.ndarray  # [n]

    @classmethod
    def from_native(cls, raw: tuple[list[int], list[int], list[float]]) -> Draft:
        """Wraps the ``(tokens, parents, probs)`` tuple returned by ``HistoryIndex.draft``."""
        tokens, parents, probs = raw
        return cls(
            np.asarray(tokens, dtype=np.int64),
            np.asarray(parents, dtype=np.int64),
            np.asarray(probs, dtype=np.float32),
        )

    def __len__(self) -> int:
        return len(self.tokens)

    def mask(self, num_nodes: int | None = None) -> np.ndarray:
        """The ``[d, d]`` ancestor mask (row i: i and its ancestors), padded like ``draft_batch``."""
        d = len(self) if num_nodes is None else num_nodes
        if d < len(self):
            raise ValueError(f"num_nodes={d} is smaller than the draft ({len(self)} nodes)")
        return tree_mask(self.parents, d)

    def paths(self) -> list[list[int]]:
        """Every root-to-leaf token path (root excluded): handy in tests and debugging."""
        children: dict[int, list[int]] = {}
        for i, p in enumerate(self.parents.tolist()):
            if p >= 0:
                children.setdefault(p, []).append(i)
        out: list[list[int]] = []

        def walk(i: int, acc: list[int]) -> None:
            kids = children.get(i, [])
            if not kids and acc:
                out.append(acc)
            for k in kids:
                walk(k, acc + [int(self.tokens[k])])

        walk(0, [])
        return out


def draft(index: HistoryIndex, rid: int, num_nodes: int = 16, chain: bool = False) -> Draft:
    """The draft of one in-flight request as a :class:`Draft`."""
    return Draft.from_native(index.draft(rid, num_nodes, chain))


def tree_mask(parents: Sequence[int] | np.ndarray, d: int) -> np.ndarray:
    """The ``[d, d]`` bool ancestor mask of a tree given by its parent positions (``-1`` for the root),
    padded to ``d`` nodes with a chain as ``draft_batch`` pads."""
    m = np.zeros((d, d), dtype=bool)
    for i in range(d):
        p = int(parents[i]) if i < len(parents) else i - 1
        if p >= 0:
            m[i] = m[p]
        m[i, i] = True
    return m


def tree_parents(mask: Any, d: int) -> np.ndarray:
    """Parent positions ``[d]`` (``-1`` for the root) of one tree from its flat ``d x d`` ancestor mask:
    nodes are in BFS order, so a node's parent is its nearest ancestor, the last earlier column set in
    its row."""
    m = np.asarray(mask)
    if m.size != d * d:
        raise ValueError(f"a {d}-node tree's mask has {d * d} values, not {m.size}")
    return tree_parents_batch(m, d)[0]


def tree_parents_batch(masks: Any, d: int) -> np.ndarray:
    """:func:`tree_parents` of every tree in a batch's flat masks (``[bs*d*d]``, as ``draft_batch``
    writes them), in one pass: ``[bs, d]``."""
    below = np.tril(np.asarray(masks).reshape(-1, d, d).astype(bool), k=-1)
    has = np.asarray(below.any(axis=2))
    if not has[:, 1:].all():
        raise ValueError(f"draft tree mask has a non-root node without an ancestor: {masks!r}")
    return np.where(has, d - 1 - np.argmax(below[:, :, ::-1], axis=2), -1)


def write_empty(tokens: np.ndarray, mask: np.ndarray, roots: Sequence[int], d: int) -> None:
    """Writes an empty draft for each request into ``tokens[bs*d]`` / ``mask[bs*d*d]``: its root
    (last token) and the padding chain, the layout SGLang's verify expects when there is nothing
    to offer."""
    bs = len(roots)
    t = tokens.reshape(bs, d)
    t[:] = 0
    t[:, 0] = roots
    mask.reshape(bs, d, d)[:] = np.tril(np.ones((d, d), dtype=mask.dtype))


def clear_rows(tokens: np.ndarray, mask: np.ndarray, counts: np.ndarray, rows: np.ndarray, d: int,
               probs: np.ndarray | None = None) -> int:
    """Empties the drafts of batch rows ``rows`` in a batch's buffers at ``d`` (``tokens[bs*d]``,
    ``mask[bs*d*d]``, ``counts[bs]``, ``probs[bs*d]``): each keeps its root, then the padding chain,
    as :func:`write_empty` writes it. Returns how many requests still have a draft node."""
    tokens.reshape(-1, d)[rows, 1:] = 0
    mask.reshape(-1, d, d)[rows] = np.tril(np.ones((d, d), dtype=mask.dtype))
    if probs is not None:
        probs.reshape(-1, d)[rows, 1:] = 0.0
    counts[rows] = 0
    return int(np.count_nonzero(counts))
