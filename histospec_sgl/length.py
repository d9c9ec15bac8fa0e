"""Response lengths from history: what a prompt's earlier responses and its siblings say about how
long a request will run.

A GRPO step ends when its longest response ends, so a scheduler that starts the longest requests
first shortens the step's tail. :class:`LengthPredictor` estimates a request's length from its
group's known lengths (earlier epochs or related policies, and siblings of the same step that
finished), conditioned on how far the request has already run: ``E[L | L > progress]`` over the
group's known lengths. Without history it falls back to a prior (the mean length of the data seen).
A group's *longest* sample, what decides when the step ends, is estimated as the expected longest of
n draws from the group's known lengths (:meth:`LengthPredictor.longest`).

slime's length-first gate (:mod:`histospec_sgl.integrations.slime`) and the simulator use it;
``histospec-sgl bench lengths`` (:mod:`histospec_sgl.bench.length_bench`) measures it on rollout logs.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Hashable, Iterable, Sequence
from typing import NamedTuple

import numpy as np


class Lengths(NamedTuple):
    """A group's known lengths, sorted ascending, and ``tails[j]``: the sum of ``sorted[j:]``."""

    sorted: list[float]
    tails: list[float]

    @classmethod
    def of(cls, values: Iterable[float]) -> Lengths:
        xs = sorted(float(v) for v in values)
        tails = [0.0] * (len(xs) + 1)
        for j in range(len(xs) - 1, -1, -1):
            tails[j] = tails[j + 1] + xs[j]
        return cls(xs, tails)

    def end(self, progress: float) -> float:
        """Expected final length of a request that has generated ``progress`` tokens (the lengths
        must not be empty): ``E[L | L > progress]``, the mean of the lengths above it;
        ``progress + 1`` when every one is shorter (it already outran them)."""
        j = bisect.bisect_right(self.sorted, progress)
        above = len(self.sorted) - j
        return self.tails[j] / above if above else progress + 1.0


class LengthPredictor:
    """Per-group response lengths, and predictions from them (cheap: O(m log m) per call for a group
    of m known lengths).

    Args:
        prior: the prediction for a group with no known length (None: the mean of every length
            recorded so far, or 1 before any).
    """

    def __init__(self, prior: float | None = None):
        self.prior = prior
        self._known: dict[Hashable, list[int]] = defaultdict(list)
        self._total = 0
        self._count = 0

    def record(self, group: Hashable, length: int) -> None:
        """A finished response of ``group`` (an earlier epoch's, or a sibling's in this step)."""
        if length < 0:
            raise ValueError(f"a length is >= 0, got {length}")
        self._known[group].append(int(length))
        self._total += int(length)
        self._count += 1

    def known(self, group: Hashable) -> Sequence[int]:
        """The lengths recorded for ``group``."""
        return self._known.get(group, ())

    def fallback(self) -> float:
        """The prediction without history: the prior, else the mean of everything recorded."""
        if self.prior is not None:
            return self.prior
        return self._total / self._count if self._count else 1.0

    def predict(self, group: Hashable, progress: int = 0) -> float:
        """Expected final length of a request of ``group`` that has generated ``progress`` tokens:
        the mean of the group's known lengths above ``progress``; ``progress + 1`` when every known
        length is shorter (it already outran them); the fallback (at least ``progress + 1``) when
        the group has none."""
        known = self._known.get(group)
        if not known:
            return max(self.fallback(), progress + 1.0)
        return Lengths.of(known).end(progress)

    def longest(self, group: Hashable, n: int) -> float:
        """Expected length of the longest of ``n`` samples of ``group`` (a GRPO group ends when its
        longest sample does): :func:`expected_longest` over the group's known lengths, the
        fallback when it has none. What length-first scheduling orders groups by."""
        known = self._known.get(group)
        return expected_longest(known, n) if known else self.fallback()


def expected_longest(lengths: Sequence[float], n: int) -> float:
    """The expected longest of ``n`` responses drawn (with replacement) from ``lengths``: with the
    lengths sorted, the j-th of m is the longest of the n with probability (j/m)^n - ((j-1)/m)^n.
    ``n = 1`` gives the mean."""
    if not lengths:
        raise ValueError("expected_longest needs at least one length")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    xs = np.sort(np.asarray(lengths, float))
    cdf = np.arange(1, len(xs) + 1) / len(xs)
    weights = cdf**n - np.concatenate(([0.0], cdf[:-1])) ** n
    return float(weights @ xs)
