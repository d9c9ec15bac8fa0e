"""Response lengths from history: what a prompt's earlier responses and its siblings say about how
long a request will run.

A GRPO step ends when its longest response ends, so a scheduler that starts the longest requests
first shortens the step's tail. :class:`LengthPredictor` estimates a request's length from its
group's known lengths (earlier epochs or related policies, and siblings of the same step that
finished), conditioned on how far the request has already run: ``E[L | L > progress]`` over the
group's known lengths. Without history it falls back to a prior (the mean length of the data seen).
A group's *longest* sample, what decides when the step ends, is estimated as the expected longest of
n draws from the group's known lengths (:meth:`LengthPredictor.longest`).

:func:`evaluate` measures it on rollout logs as a rank correlation (Spearman) of predicted against
actual length, next to the no-history baseline (one mean for every request: no order at all) and
Seer's probe rule (a group's first finished sibling's length stands for every sibling).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np


class LengthPredictor:
    """Per-group response lengths, and predictions from them (cheap: O(known lengths) per call).

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
        longer = [x for x in known if x > progress]
        if not longer:
            return progress + 1.0
        return sum(longer) / len(longer)

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


def spearman(predicted: Sequence[float], actual: Sequence[float]) -> float:
    """Spearman's rank correlation (NaN when either side is constant: no order to compare)."""
    from scipy.stats import spearmanr

    p, a = np.asarray(predicted, float), np.asarray(actual, float)
    if len(p) < 2 or np.ptp(p) == 0 or np.ptp(a) == 0:
        return math.nan
    return float(spearmanr(p, a).statistic)


@dataclass(frozen=True)
class Response:
    """One logged response, as the evaluation needs it."""

    group: Hashable  # the prompt
    policy: Hashable  # run or checkpoint
    step: int | None
    length: int


def _by(rows: Iterable[Response], key) -> dict:
    out: dict = defaultdict(list)
    for r in rows:
        out[key(r)].append(r)
    return out


def _probe(members: Sequence[Response]) -> float:
    """Seer's probe: the first sibling to finish (siblings start together) stands for all."""
    return float(min(m.length for m in members))


def evaluate(rows: Sequence[Response]) -> dict[str, dict]:
    """Spearman of predicted vs actual length per scenario, with the baselines, on ``rows``.

    Scenarios (each request is predicted before it starts unless said):
      - ``cross-epoch``: history is the same policy's responses to the prompt at its previous step;
      - ``cross-policy``: history is other policies' responses to the prompt at the same step;
      - ``cross-sample``: history is the other finished samples of its group (leave one out);
      - ``in-flight``: the group's samples start together; when half of them have finished, each
        running one is predicted from the finished ones, other policies' responses to the prompt
        at the same step (where the log has them) and its own progress.
    The probe baseline is the same in every scenario (it needs no history); the mean baseline is a
    constant, so its correlation is undefined (NaN: it gives the scheduler no order).

    Where a whole group is predicted before it starts (cross-epoch, cross-policy), ``longest`` also
    ranks groups by what length-first scheduling orders them by: the expected longest of the
    group's n samples (:meth:`LengthPredictor.longest`) against the group's actual longest, next to
    the probe (the group's first finished sibling).
    """
    mean_len = float(np.mean([r.length for r in rows])) if rows else 1.0
    groups = _by(rows, lambda r: (r.policy, r.step, r.group))
    out: dict[str, dict] = {}

    def report(name: str, cases: list[tuple[float, float, int]],
               longest: list[tuple[float, float, int]] | None = None) -> None:
        if not cases:
            return
        pred, probe, actual = zip(*cases)
        out[name] = {
            "requests": len(cases),
            "ours": spearman(pred, actual),
            "probe": spearman(probe, actual),
            "mean": spearman([mean_len] * len(actual), actual),
        }
        if longest:
            gp, gprobe, gmax = zip(*longest)
            out[name]["longest"] = {"groups": len(longest), "ours": spearman(gp, gmax),
                                    "probe": spearman(gprobe, gmax)}

    def group_case(pred: LengthPredictor, grp: Hashable, members: Sequence[Response]) -> tuple[float, float, int]:
        return pred.longest(grp, len(members)), _probe(members), max(m.length for m in members)

    # cross-epoch
    cases, longest = [], []
    by_prompt = _by(rows, lambda r: (r.policy, r.group))
    for (pol, grp), members in by_prompt.items():
        steps = sorted({m.step for m in members if m.step is not None})
        for s0, s1 in zip(steps, steps[1:]):
            pred = LengthPredictor(mean_len)
            for m in members:
                if m.step == s0:
                    pred.record(grp, m.length)
            later = groups[(pol, s1, grp)]
            cases += [(pred.predict(grp), _probe(later), m.length) for m in later]
            longest.append(group_case(pred, grp, later))
    report("cross-epoch", cases, longest)
    # cross-policy
    cases, longest = [], []
    by_step = _by(rows, lambda r: (r.group, r.step))
    for (grp, step), members in by_step.items():
        pols = {m.policy for m in members}
        if len(pols) < 2:
            continue
        for pol in sorted(pols, key=repr):
            pred = LengthPredictor(mean_len)
            for m in members:
                if m.policy != pol:
                    pred.record(grp, m.length)
            mine = groups[(pol, step, grp)]
            cases += [(pred.predict(grp), _probe(mine), m.length) for m in mine]
            longest.append(group_case(pred, grp, mine))
    report("cross-policy", cases, longest)
    # cross-sample and in-flight
    cases, flight = [], []
    for (_, _, grp), members in groups.items():  # noqa: B007 - the key names the group
        if len(members) < 2:
            continue
        probe = _probe(members)
        for i, m in enumerate(members):
            pred = LengthPredictor(mean_len)
            for j, o in enumerate(members):
                if j != i:
                    pred.record(grp, o.length)
            cases.append((pred.predict(grp), probe, m.length))
        t = int(np.median([m.length for m in members]))
        pred = LengthPredictor(mean_len)
        for m in members:
            if m.length <= t:
                pred.record(grp, m.length)
        for o in by_step.get((grp, members[0].step), ()):
            if o.policy != members[0].policy:
                pred.record(grp, o.length)
        flight += [(pred.predict(grp, progress=t), probe, m.length) for m in members if m.length > t]
    report("cross-sample", cases)
    report("in-flight", flight)
    return out
