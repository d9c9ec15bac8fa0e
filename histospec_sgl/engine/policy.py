"""The step policy: each decode step, verify the drafts (at a width above 1) or decode plainly (width
1, one token per request). One interface, :class:`StepPolicy`, for the engine
(:class:`~histospec_sgl.engine.drafter.BatchDrafter` asks it every step) and the simulator
(:func:`histospec_sgl.simulate.step.run_step` asks it every simulated step), so that a policy the
simulator scores is the one the engine runs:

- :class:`Fixed`: always the same width (plain decoding at 1; ``HISTOSPEC_CONTROL=fixed`` at d);
- :class:`~histospec_sgl.engine.costmodel.CostModel` (on a step-cost profile) and
  :class:`~histospec_sgl.engine.costmodel.EngineControl` (on the step costs the engine times
  itself, ``HISTOSPEC_CONTROL=cost``, the default): the width that gives the most tokens per second.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import NamedTuple, Protocol, runtime_checkable


def interpolate(points: Sequence[tuple[float, float]], x: float) -> float:
    """``y`` at ``x`` on the line through ``points`` (``(x, y)`` sorted by ``x``, at least one), held
    flat beyond the first and the last: how step costs are read between the widths or batch sizes
    that were timed (the engine's clock and the simulator's measured profiles alike)."""
    i = bisect.bisect_left([p[0] for p in points], x)
    if i == 0:
        return points[0][1]
    if i == len(points):
        return points[-1][1]
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class PrefillCost(NamedTuple):
    """What a prefill forward pass costs: ``fixed_s`` a pass, whatever it prefills (a decode step's
    overhead: a pass of one token, a prompt the radix cache holds, costs it), plus ``per_token_s``
    for each prompt token it computes (the tokens no cached prefix covers)."""

    fixed_s: float
    per_token_s: float

    def seconds(self, tokens: int) -> float:
        """A pass of ``tokens`` prompt tokens (none: no pass)."""
        return self.fixed_s + self.per_token_s * tokens if tokens > 0 else 0.0


class Profile(Protocol):
    """Step costs: how long one engine step takes for a running batch of ``batch`` requests that
    verifies ``width`` tokens each (1: plain decoding) at a mean context of ``context`` tokens, plus
    the prompt tokens prefilled in the same step. The engine measures its own
    (:class:`~histospec_sgl.engine.clock.StepClock`); the simulator's analytic and measured
    profiles are in :mod:`histospec_sgl.simulate.profile`."""

    @property
    def name(self) -> str: ...
    @property
    def analytic(self) -> bool: ...
    @property
    def description(self) -> str: ...

    def step_s(self, batch: int, width: int, context: float, prefill: int = 0) -> float: ...


@runtime_checkable
class StepPolicy(Protocol):
    """Chooses each decode step's verify width."""

    #: The widths above 1 it may choose; the caller prices a step's drafts at each
    #: (``promised[w]``: accepted tokens the width-w drafts promise, summed over the batch).
    widths: Sequence[int]
    #: Whether :meth:`choose` reads ``promised`` (the index then reports node probabilities).
    reads_promises: bool

    def choose(self, promised: Mapping[int, float], batch: int, context: float = 0.0, prefill: int = 0,
               decoding: int | None = None, least: Mapping[int, float] | None = None) -> int:
        """The width for a step of ``batch`` running requests, ``decoding`` of which emit a token
        (default: all), at mean ``context`` tokens with ``prefill`` prompt tokens joining.
        ``least[w]``: at width ``w``, the promise of the request expected to end the batch last,
        which decides how soon the batch ends (:meth:`~histospec_sgl.engine.feedback.Feedback.promises`:
        the least promised one where every request has as long to go; None: not known, or requests
        wait for a slot and every promised token counts whole)."""
        ...

    def observe(self, promised: float, accepted: float, requests: int, *, shadow: bool = False,
                klass: str | None = None, width: int | None = None, beside: bool = False,
                batch: int | None = None) -> None:
        """A verified step's drafts over ``requests`` request-steps: what they promised and what was
        accepted. ``shadow``: drafts not verified, followed along the tokens decoded instead (what
        verifying them would have accepted); ``beside``: such a draft measured at a width other than
        the one its step verified or named (it speaks for its width only). ``klass``: the
        requests' class (greedy, sampled), ``width`` the drafts' verify width and ``batch`` the size
        of the batch they were drafted in, for a policy that calibrates them apart."""
        ...

    def shadow_width(self) -> int:
        """After a plain step, the width whose shadow drafts count in their request class's
        calibration too (1: no shadow drafts); every width is measured beside it (and beside a
        verified step, every width but the step's)."""
        ...

    def calibration(self, klass: str | None = None, width: int | None = None, batch: int | None = None) -> float:
        """What requests of class ``klass`` at verify width ``width`` in a batch of ``batch`` accept
        per promised token (1: promises taken as they are)."""
        ...

    def begin(self, now: float, after_idle: bool = False) -> None:
        """The engine starts a forward pass at ``now`` (any kind): for a policy that times its steps,
        the decode step before it ended; ``after_idle``: every request of that step had finished, so
        the engine may have idled in between and the time is not the step's."""
        ...

    def decode_step(self, batch: int, width: int, started: float) -> None:
        """The forward pass begun at ``started`` is a decode step of ``batch`` requests at ``width``."""
        ...

    def prefill_step(self, tokens: int, started: float) -> None:
        """The forward pass begun at ``started`` prefills ``tokens`` prompt tokens."""
        ...

    def step_costs(self, mean: bool = False) -> dict[tuple[int, int], float]:
        """The step costs it measured: seconds per (width, batch-size bucket), its robust estimates
        (``mean``: the plain means of the same timings, what a run of such steps pays); empty if it
        times none."""
        ...

    def prefill_cost(self) -> PrefillCost | None:
        """What its prefill forward passes cost, a fixed part and a part per prompt token, as it
        timed them (None: it times none). The engine spends this outside decode steps; the simulator
        charges it."""
        ...

    def summary(self) -> str:
        """One line for the engine's log about what it learned (empty: nothing to say)."""
        ...


class Fixed:
    """The same width every step: 1 is plain decoding, d is HISTORY at a fixed width."""

    reads_promises = False

    def __init__(self, width: int):
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        self.width = width
        self.widths: Sequence[int] = (width,) if width > 1 else ()

    def choose(self, promised: Mapping[int, float], batch: int, context: float = 0.0, prefill: int = 0,
               decoding: int | None = None, least: Mapping[int, float] | None = None) -> int:
        return self.width

    def observe(self, promised: float, accepted: float, requests: int, *, shadow: bool = False,
                klass: str | None = None, width: int | None = None, beside: bool = False,
                batch: int | None = None) -> None:
        pass

    def shadow_width(self) -> int:
        return 1

    def calibration(self, klass: str | None = None, width: int | None = None, batch: int | None = None) -> float:
        return 1.0

    def begin(self, now: float, after_idle: bool = False) -> None:
        pass

    def decode_step(self, batch: int, width: int, started: float) -> None:
        pass

    def prefill_step(self, tokens: int, started: float) -> None:
        pass

    def step_costs(self, mean: bool = False) -> dict[tuple[int, int], float]:
        return {}

    def prefill_cost(self) -> PrefillCost | None:
        return None

    def summary(self) -> str:
        return ""
