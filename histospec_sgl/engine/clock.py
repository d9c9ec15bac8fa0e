"""The engine's step clock: what a decode step costs per verify width and batch size, timed as the
engine runs (:class:`StepClock`), the prices the default step policy
(:class:`~histospec_sgl.engine.costmodel.EngineControl`) chooses by."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from histospec_sgl.engine.policy import PrefillCost, interpolate


def bucket(batch: int) -> int:
    """Batch sizes share a measured step cost within powers of two: 1, 2, 3-4, 5-8, ..."""
    return 1 << max(batch - 1, 0).bit_length()


@dataclass
class StepClock:
    """Step costs measured on the running engine: the time from one decode step's start to the
    next's, per verify width and batch-size bucket, each timing kept with the batch it ran at. A
    timing is priced at another batch size as a fixed part plus a part per request
    (:meth:`fixed`), so that a width timed in a bucket's tail (batch 33) and another timed at its
    top (batch 64) are compared at the batch asked about. A bucket's cost at a width and batch is the
    median of its last ``window`` timings so priced, so that one slow step (the first of a shape, a
    pause of the host) does not move it; where ``exact`` of them ran at that very batch size (the
    steps of a full batch), the median of those alone: the steps of a shrinking or growing batch
    carry host work of their own (requests leaving and joining), which scaled to the full batch
    would price its steps above what they cost. A profile
    (:class:`~histospec_sgl.engine.policy.Profile`) once a bucket has both widths measured."""

    name: str = "measured online"
    description: str = "step costs timed by the engine as it runs"
    analytic: bool = False
    window: int = 9
    #: Timings at the batch size asked about that price it alone (:meth:`price`).
    exact: int = 3
    #: (width, bucket) -> its last timings, oldest first, as (batch, seconds).
    samples: dict[tuple[int, int], list[tuple[int, float]]] = field(default_factory=dict)
    #: (width, bucket) -> the value of ``records`` when it was last timed.
    last: dict[tuple[int, int], int] = field(default_factory=dict)
    records: int = 0

    #: An interval this many times the bucket's estimate held more than a step (the engine idled).
    outlier: float = 5.0
    #: The first timings of each width are left out: a server's first forward of a kind warms caches
    #: and allocators (and on a fresh server can take several steps' time), and before any estimate
    #: exists nothing else would tell such a step from a real cost. Once per width, not per bucket:
    #: a width's first step in a later bucket took what its later steps there took (on SmolLM2 on
    #: the CPU, 0.88-1.13 of their median), and a bucket's cost is the median of its timings, which
    #: one slow step does not move; a step left out in every bucket a row passes through is a step
    #: the policy spends running a width it may not want, for nothing.
    warmup: int = 1
    #: width -> timings left out as warm-up so far.
    warmed: dict[int, int] = field(default_factory=dict)
    #: Timings a width needs in a bucket before they alone price it there (:meth:`step_s`): with
    #: fewer, its price is their median where that is less than what the bucket's other measurements
    #: say of it, else the geometric mean of the two (:func:`_untrusted`), so that one slow first step
    #: in a bucket (its first of a new shape, or the host pausing) does not put the width out of the
    #: running before it is timed again, and an estimate that undersells it does not have it chosen
    #: again on the estimate alone.
    trusted: int = 2
    #: bucket -> the steps timed in it so far (every width).
    timed: dict[int, int] = field(default_factory=dict)
    #: width -> the fixed part of its step's cost (:meth:`fixed`), where its timings give one.
    fixed_s: dict[int, float] = field(default_factory=dict)
    #: (width, bucket) -> the median batch and the median seconds of its timings.
    points: dict[tuple[int, int], tuple[float, float]] = field(default_factory=dict)
    #: bucket of prompt tokens -> its last prefill forward passes, oldest first, as (tokens, seconds).
    prefills: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    prefill_warmed: int = 0
    _prefill: PrefillCost | None = None
    _costs: tuple[dict[tuple[int, int], float], dict[tuple[int, int], float]] | None = None

    def record(self, batch: int, width: int, seconds: float) -> None:
        key = (width, bucket(batch))
        if self.warmed.get(width, 0) < self.warmup:
            self.warmed[width] = self.warmed.get(width, 0) + 1
            return
        if self.samples.get(key) and seconds > self.outlier * self.price(batch, width):
            return
        self.records += 1
        self.timed[key[1]] = self.timed.get(key[1], 0) + 1
        xs = self.samples.setdefault(key, [])
        xs.append((batch, seconds))
        del xs[: -self.window]
        self.last[key] = self.records
        self.points[key] = (_median([b for b, _ in xs]), _median([t for _, t in xs]))
        fit = _fixed_part([p for (w, _), p in self.points.items() if w == width])
        if fit is None:
            self.fixed_s.pop(width, None)
        else:
            self.fixed_s[width] = fit
        self._costs = None

    def record_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill forward pass computed ``tokens`` prompt tokens (those no cached prefix covers) in
        ``seconds`` (start to the next forward's start). Not a decode step: the policy does not price
        it, the simulator charges it. Kept per bucket of token counts, as decode steps are per batch
        size, so that passes of one token (a prompt the radix cache holds) and of whole prompts both
        stay measured."""
        if self.prefill_warmed < self.warmup:  # a fresh server's first prefill warms it up
            self.prefill_warmed += 1
            return
        xs = self.prefills.setdefault(bucket(tokens), [])
        if xs and self._prefill is not None and seconds > self.outlier * self._prefill.seconds(tokens):
            return  # the engine idled (a first pass of its size is taken: nothing prices it yet)
        xs.append((tokens, seconds))
        del xs[: -self.window]
        points = [(_median([t for t, _ in v]), _median([x for _, x in v])) for _, v in sorted(self.prefills.items())]
        line = _line(points)
        if line is None:  # one size of pass timed: its seconds per token, no fixed part known
            self._prefill = PrefillCost(0.0, _median([x / t for t, x in xs]))
        else:
            self._prefill = PrefillCost(*line)

    def prefill(self) -> PrefillCost | None:
        """What a prefill forward pass costs: the Theil-Sen line through each bucket's median pass
        (tokens, seconds), its intercept the fixed part (:class:`PrefillCost`); with passes of one
        bucket only, their median seconds per token and no fixed part. None before any is timed."""
        return self._prefill

    @property
    def table(self) -> dict[tuple[int, int], float]:
        """(width, bucket) -> its cost at the bucket's largest batch (the batch its key names): the
        median of its timings priced there."""
        return self._tables()[0]

    @property
    def means(self) -> dict[tuple[int, int], float]:
        """(width, bucket) -> the mean of the same priced timings: what a run of such steps takes a
        step on average, a few slow ones included (the median leaves them out; a row pays them)."""
        return self._tables()[1]

    def _tables(self) -> tuple[dict[tuple[int, int], float], dict[tuple[int, int], float]]:
        if self._costs is None:
            table, means = {}, {}
            for (w, b), xs in self.samples.items():
                if xs:
                    priced = self._at(xs, w, b)
                    table[(w, b)] = _median(priced)
                    means[(w, b)] = sum(priced) / len(priced)
            self._costs = (table, means)
        return self._costs

    def fixed(self, width: int) -> float | None:
        """The part of a width-``width`` step's cost that does not grow with the batch: the intercept
        of its cost against the batch size (Theil-Sen over its buckets' median timings, at most their
        smallest), or plain decoding's where the width has not been timed at two batch sizes. A
        timing at batch ``b`` is priced at batch ``n`` as ``fixed + (seconds - fixed) * n / b``. None
        while neither the width nor plain decoding has been timed at two batch sizes: a timing is
        then its price at any batch of its bucket."""
        return self.fixed_s.get(width, self.fixed_s.get(1))

    def _priced(self, xs: Sequence[tuple[int, float]], width: int, batch: int) -> list[float]:
        """The timings ``xs`` (batch, seconds) of ``width``, priced at ``batch``."""
        f = self.fixed(width)
        if f is None:
            return [s for _, s in xs]
        return [f + max(s - f, 0.0) * batch / b for b, s in xs]

    def _at(self, xs: Sequence[tuple[int, float]], width: int, batch: int) -> list[float]:
        """The timings ``xs`` that price ``width`` at ``batch``: those that ran at ``batch`` where
        there are ``exact`` of them, else all of them priced there (:meth:`_priced`)."""
        same = [s for b, s in xs if b == batch]
        return same if len(same) >= self.exact else self._priced(xs, width, batch)

    def price(self, batch: int, width: int) -> float:
        """The median of the bucket's timings at ``width`` that price ``batch`` (:meth:`_at`; measured
        there)."""
        return _median(self._at(self.samples[(width, bucket(batch))], width, batch))

    def count(self, batch: int, width: int) -> int:
        return len(self.samples.get((width, bucket(batch)), ()))

    def age(self, batch: int, width: int) -> int:
        """Steps timed since this width was last timed in this batch size's bucket."""
        return self.records - self.last.get((width, bucket(batch)), 0)

    def known(self, batch: int, width: int) -> bool:
        return bool(self.samples.get((width, bucket(batch))))

    def steps_in(self, batch: int) -> int:
        """Steps timed in this batch size's bucket so far."""
        return self.timed.get(bucket(batch), 0)

    def _by_bucket(self) -> dict[int, list[int]]:
        """Each bucket's measured widths, in order."""
        out: dict[int, list[int]] = {}
        for (w, b), xs in sorted(self.samples.items()):
            if xs:
                out.setdefault(b, []).append(w)
        return out

    @staticmethod
    def _lender(b: int, by_bucket: dict[int, list[int]], width: int | None = None) -> int | None:
        """The nearest bucket to ``b`` (the smaller of two as near) with two widths or more measured;
        for pricing ``width``, the nearest whose measured widths reach it, if any does (a bucket that
        only verified at 2 and 4 holds plain decoding at width 2's cost, which says nothing of what
        plain decoding costs against width 2)."""
        full = [bb for bb, ws in by_bucket.items() if bb != b and len(ws) > 1]
        reach = [bb for bb in full if width is not None and by_bucket[bb][0] <= width <= by_bucket[bb][-1]]
        near = reach or full
        return min(near, key=lambda bb: (abs(bb.bit_length() - b.bit_length()), bb)) if near else None

    def priced(self, batch: int) -> bool:
        """Whether :meth:`step_s` can price every width for this batch size: its bucket has two widths
        measured, or another bucket has, to borrow from."""
        return len(self._by_bucket().get(bucket(batch), ())) > 1 or self.borrows(batch)

    def borrows(self, batch: int) -> bool:
        """Whether another bucket than this batch size's has two widths measured, to borrow from."""
        return self._lender(bucket(batch), self._by_bucket()) is not None

    def step_s(self, batch: int, width: int, context: float = 0.0, prefill: int = 0) -> float:
        """The bucket's measured cost at ``width`` priced at ``batch`` (with fewer than
        :attr:`trusted` timings there, :func:`_untrusted` of it and what the rest says); a width not
        measured there yet, between two that are, is interpolated linearly in the width (a verify
        step's cost grows with the nodes it verifies), and measured once it is chosen. A width
        beyond the bucket's measured ones (plain decoding in a bucket that only verified), and every
        width of a bucket with fewer than two measured, is priced as the nearest bucket that has two
        does (that measured around the width, where one did: :meth:`_lender`), scaled to agree with
        its own cost at the nearest width it measured, and where it measured two or more, with the
        lender's differences between widths stretched to its own: what a width costs against
        another carries over between neighbouring batch sizes better than holding the nearest
        measured cost flat, or not knowing at all."""
        if self.known(batch, width):
            own = self.price(batch, width)
            if self.count(batch, width) >= self.trusted:
                return own
            try:
                return _untrusted(own, self._estimate(batch, width, omit=True))
            except KeyError:  # nothing else measured to say what it costs
                return own
        return self._estimate(batch, width)

    def _estimate(self, batch: int, width: int, omit: bool = False) -> float:
        """A width's price at ``batch`` from the other widths and buckets measured (:meth:`step_s`);
        ``omit``: its own timings in the bucket left out (it has too few to trust them alone), where
        the bucket has another width's timings to scale by (KeyError where not: a borrowed price not
        scaled to the bucket's own says nothing against the bucket's timing)."""
        b = bucket(batch)
        per = self._by_bucket()
        if omit:
            per[b] = [w for w in per.get(b, []) if w != width]
            if not per[b]:
                raise KeyError((width, b))
        own = [(w, self.price(batch, w)) for w in per.get(b, [])]
        if len(own) > 1 and own[0][0] <= width <= own[-1][0]:
            return interpolate(own, width)
        lender = self._lender(b, per, width)
        if lender is None:
            if len(own) > 1:  # nothing to borrow the shape from: the nearest measured cost
                return interpolate(own, width)
            raise KeyError((width, b))
        theirs = self._lent(lender, per[lender])
        if not own:
            return interpolate(theirs, width)
        near, cost = min(own, key=lambda wc: abs(wc[0] - width))
        at_near = interpolate(theirs, near)
        if len(own) > 1:
            # The lender's steps between the bucket's two outermost measured widths, stretched to the
            # bucket's own: a verify step's extra cost over a narrower one grows with the batch
            # faster than the step's whole cost does (on SmolLM2 on the CPU, width 8 over plain
            # decoding: 1.4x at batch 1, 2.2x at batch 16), so the bucket's own difference says
            # more of a wider width's than its nearest width's cost alone.
            (lo, c_lo), (hi, c_hi) = own[0], own[-1]
            span = interpolate(theirs, hi) - interpolate(theirs, lo)
            if span > 0 and c_hi > c_lo:
                est = cost + (interpolate(theirs, width) - at_near) * (c_hi - c_lo) / span
                if est > 0:
                    return est
        return interpolate(theirs, width) * cost / at_near

    def _lent(self, lender: int, widths: Sequence[int]) -> list[tuple[int, float]]:
        """The prices a bucket lends (:meth:`_estimate`): a width it timed fewer than ``trusted``
        times at the lesser of its timing and the line through its other widths around it, so that
        one slow timing does not bend the shape it lends (the bucket itself prices the width between
        the two, :func:`_untrusted`: its own timing says more of its own steps than of another
        batch size's)."""
        timed = [(w, self.price(lender, w)) for w in widths]
        out = []
        for w, cost in timed:
            if self.count(lender, w) < self.trusted:
                others = [(v, c) for v, c in timed if v != w]
                if others and others[0][0] < w < others[-1][0]:
                    cost = min(cost, interpolate(others, w))
            out.append((w, cost))
        return out


def _untrusted(timed: float, estimate: float) -> float:
    """The price of a width from a timing too few to trust alone and what the other measurements say
    of it: the timing where it is the lower (a width cheaper than estimated is run and so timed
    again), else their geometric mean. One slow step (the first of a new shape, the host pausing)
    does not put the width out of the running at its timing; nor, where the estimate undersells it
    (a shape lent from another batch size), does the estimate alone have it chosen again to confirm
    a timing that said it costs more."""
    return timed if timed <= estimate else math.sqrt(timed * estimate)


def _median(xs: Sequence[float]) -> float:
    """The lower median (an observed value)."""
    return sorted(xs)[(len(xs) - 1) // 2]


def _fixed_part(points: Sequence[tuple[float, float]]) -> float | None:
    """The intercept of the Theil-Sen line through ``points`` (batch, seconds) (:func:`_line`)."""
    line = _line(points)
    return None if line is None else line[0]


def _line(points: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """The Theil-Sen line through ``points`` (size, seconds) as (intercept, slope): the median of the
    slopes between points of different sizes (at least 0), then the median intercept, held between 0
    and the smallest cost (a step costs at least its fixed part). None without two sizes."""
    slopes = [(s1 - s0) / (b1 - b0) for i, (b0, s0) in enumerate(points) for b1, s1 in points[i + 1:] if b1 != b0]
    if not slopes:
        return None
    slope = max(sorted(slopes)[len(slopes) // 2], 0.0)
    f = sorted(s - slope * b for b, s in points)[len(points) // 2]
    return min(max(f, 0.0), min(s for _, s in points)), slope
