"""Pythonic helpers over the native :class:`~histospec_sgl.HistoryIndex`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from histospec_sgl._core import HistoryIndex

__all__ = ["Draft", "draft"]


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
        m = np.zeros((d, d), dtype=bool)
        for i in range(d):
            p = int(self.parents[i]) if i < len(self) else i - 1
            if p >= 0:
                m[i] = m[p]
            m[i, i] = True
        return m

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
