"""How long each request of a decode batch has left to run, from its group's finished responses:
what tells the step plan which request will end the batch (:func:`~histospec_sgl.engine.plan.plan_step`).

A request that has generated ``k`` tokens is expected to end at ``E[L | L > k]`` over its group's
known lengths (earlier epochs' responses, siblings that finished: :meth:`histospec_sgl.length.Lengths.end`,
as :meth:`~histospec_sgl.length.LengthPredictor.predict` says too), and no later than its
``max_new_tokens``. Its remaining tokens are that end less ``k``; unknown (NaN) where its group has
no known length and it has no cap. The engine's drafter reads its groups' lengths from the history
index (:class:`GroupLengths`), the simulator from the log; both through :func:`remaining`, one
request at a time (a few list reads: cheaper, at a decode batch's sizes, than numpy's calls).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from histospec_sgl.length import Lengths


def remaining(lengths: Lengths | None, progress: int, cap: float | None = None) -> float:
    """Tokens a request that has generated ``progress`` has left, by its group's known ``lengths``
    (None or empty: none) and its ``cap`` (``max_new_tokens``; None: none); at least 1; NaN where
    nothing is known."""
    if lengths is not None and lengths.sorted:
        end = lengths.end(progress)
        if cap is not None:
            end = min(end, float(cap))
    elif cap is not None:
        end = float(cap)
    else:
        return math.nan
    return max(end - progress, 1.0)


def room(caps: Sequence[float | None] | None, progress: Sequence[int]) -> np.ndarray | None:
    """The draft tokens each request can still emit: its cap (``max_new_tokens``) less the tokens it
    has generated (``progress``) and the one a verify step emits after its accepted drafts (at least
    0; inf: no cap). None where no request has a cap. A verify step's accepted drafts beyond it are
    cut off by the request's end: they neither promise nor count as accepted."""
    if caps is None or all(c is None for c in caps):
        return None
    return np.array([math.inf if c is None else max(float(c) - k - 1, 0.0) for c, k in zip(caps, progress)])


class GroupLengths:
    """The finished responses' lengths of each group the history index holds, read from the index
    when a group's count of responses changed (siblings finished, history loaded or synced). At
    most :attr:`held` groups are kept (then the cache starts again from the groups in flight)."""

    held = 4096

    def __init__(self, index: Any) -> None:
        self.index = index
        self._groups: dict[int, tuple[int, Lengths]] = {}

    def lengths(self, key: int) -> Lengths:
        """Group ``key``'s known lengths."""
        count = int(self.index.group_len(key))
        held = self._groups.get(key)
        if held is None or held[0] != count:
            held = self._groups[key] = (count, Lengths.of(self.index.response_lengths(key)))
        return held[1]

    def remaining(self, keys: Sequence[int], progress: Sequence[int],
                  caps: Sequence[int | None] | None = None) -> list[float]:
        """Each request's remaining tokens (:func:`remaining`): ``keys`` their groups, ``progress``
        the tokens each has generated, ``caps`` each one's ``max_new_tokens`` (None: none)."""
        if len(self._groups) > self.held:
            self._groups.clear()
        seen: dict[int, Lengths] = {}
        out = []
        for i, (key, k) in enumerate(zip(keys, progress)):
            lens = seen.get(key)
            if lens is None:
                lens = seen[key] = self.lengths(key)
            out.append(remaining(lens, k, None if caps is None else caps[i]))
        return out
