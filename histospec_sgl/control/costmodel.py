"""Speculation that pays for itself: each decode step, the verify width that gives the most tokens
per second for the running batch, from the step-cost profile and the acceptance the drafts promise.

The index's node probabilities estimate how likely each draft node is to be accepted, so a width-w
draft promises the sum of its w-1 best nodes' probabilities in accepted tokens (the drafts are
grown best-first, so a narrower draft is the wider one's most probable nodes). Those promises are
scaled by a calibration factor: accepted tokens over promised tokens, measured on the steps
verified so far (while plain decoding wins, one step in ``probe_every`` is verified wide to keep
measuring it). Width 1 is plain decoding (no draft), so apart from those probes the choice is
never worse than plain decoding by the model's own account, and it turns speculation on when the
batch shrinks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from histospec_sgl.control.profile import Profile


@dataclass
class CostModel:
    """Chooses the verify width per step. ``widths`` are the draft widths it may verify (root
    included; 1, plain decoding, is always allowed)."""

    profile: Profile
    widths: Sequence[int]
    accepted: float = 0.0
    promised: float = 0.0
    #: The first steps trust the promises as they are (no measurement yet).
    min_promised: float = 32.0
    #: While plain decoding wins, every this many steps one is verified wide anyway, so that the
    #: calibration keeps measuring what the drafts deliver (promises that understate acceptance
    #: would otherwise keep it plain for good).
    probe_every: int = 16
    chosen: dict[int, int] = field(default_factory=dict)
    _since_wide: int = 0

    def calibration(self) -> float:
        """Accepted over promised draft tokens so far (1 until enough has been promised)."""
        if self.promised < self.min_promised:
            return 1.0
        return self.accepted / self.promised

    def choose(self, promised: dict[int, float], batch: int, context: float, prefill: int = 0,
               decoding: int | None = None) -> int:
        """The width with the most expected tokens per second. ``promised[w]``: the batch's sum of
        promised accepted tokens at width ``w``; ``decoding``: requests that emit a token this step
        (default: the whole batch)."""
        n = batch if decoding is None else decoding
        c = self.calibration()
        plain = n / self.profile.step_s(batch, 1, context, prefill)
        wide, wide_rate = 1, 0.0
        for w in self.widths:
            if w <= 1:
                continue
            rate = (n + c * promised.get(w, 0.0)) / self.profile.step_s(batch, w, context, prefill)
            if rate > wide_rate:
                wide, wide_rate = w, rate
        best = wide if wide > 1 and (wide_rate > plain or self._since_wide >= self.probe_every) else 1
        self._since_wide = 0 if best > 1 else self._since_wide + 1
        self.chosen[best] = self.chosen.get(best, 0) + 1
        return best

    def observe(self, promised: float, accepted: float) -> None:
        """A verified step: what its drafts promised and what was accepted."""
        self.promised += promised
        self.accepted += accepted


def bucket(batch: int) -> int:
    """Batch sizes share a measured step cost within powers of two: 1, 2, 3-4, 5-8, ..."""
    return 1 << max(batch - 1, 0).bit_length()


@dataclass
class StepClock:
    """Step costs measured on the running engine: the time from one decode step's start to the
    next's, per verify width and batch-size bucket (an exponential moving average). A profile
    (:class:`~histospec_sgl.control.profile.Profile`) once a bucket has both widths measured."""

    name: str = "measured online"
    description: str = "step costs timed by the engine as it runs"
    analytic: bool = False
    decay: float = 0.2
    table: dict[tuple[int, int], float] = field(default_factory=dict)

    #: An interval this many times the bucket's estimate held more than a step (the engine idled).
    outlier: float = 5.0

    def record(self, batch: int, width: int, seconds: float) -> None:
        key = (width, bucket(batch))
        old = self.table.get(key)
        if old is None:
            self.table[key] = seconds
        elif seconds <= self.outlier * old:
            self.table[key] = (1 - self.decay) * old + self.decay * seconds

    def known(self, batch: int, width: int) -> bool:
        return (width, bucket(batch)) in self.table

    def step_s(self, batch: int, width: int, context: float = 0.0, prefill: int = 0) -> float:
        return self.table[(width, bucket(batch))]


@dataclass
class EngineControl:
    """The engine's per-step choice between verifying the drafts at width ``d`` and plain decoding
    (width 1: the target's DECODE forward), from step costs it measures itself (:class:`StepClock`) and what the
    drafts promise. A batch-size bucket whose cost at a width is not yet known tries that width
    first, so each bucket is measured within its first steps."""

    d: int
    clock: StepClock = field(default_factory=StepClock)
    model: CostModel = field(init=False)
    #: Steps that tried a width in a bucket to measure it (a width the engine cannot run there,
    #: e.g. plain decoding with a grammar, is given up after a few tries).
    tries: dict[tuple[int, int], int] = field(default_factory=dict)
    #: (width, batch) of the step in flight and when it started.
    _current: tuple[int, int, float] | None = None

    def __post_init__(self) -> None:
        self.model = CostModel(self.clock, [self.d])

    def choose(self, batch: int, promised: float) -> int:
        """``d`` or 1 for a decode step of ``batch`` requests whose drafts promise ``promised``
        accepted tokens in all."""
        unknown = False
        for w in (self.d, 1):
            if not self.clock.known(batch, w):
                key = (w, bucket(batch))
                if self.tries.get(key, 0) < 3:
                    self.tries[key] = self.tries.get(key, 0) + 1
                    return w
                unknown = True
        if unknown:
            return self.d
        return self.model.choose({self.d: promised}, batch, 0.0)

    def begin(self, now: float) -> None:
        """The engine starts a forward pass (of any kind): the decode step before it, if any, took
        the time since that step started."""
        if self._current is not None:
            w, b, t0 = self._current
            self.clock.record(b, w, now - t0)
        self._current = None

    def decode_step(self, batch: int, width: int, started: float) -> None:
        """The forward pass begun at ``started`` is a decode step of ``batch`` requests at ``width``."""
        self._current = (width, batch, started)

    def observe(self, promised: float, accepted: float) -> None:
        self.model.observe(promised, accepted)
