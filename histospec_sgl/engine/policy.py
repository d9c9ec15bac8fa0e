"""The step policy: each decode step, verify the drafts (at a width above 1) or decode plainly (width
1, one token per request). One interface, :class:`StepPolicy`, for the engine
(:class:`~histospec_sgl.engine.drafter.BatchDrafter` asks it every step) and the simulator
(:func:`histospec_sgl.simulate.step.run_step` asks it every simulated step), so that a policy the
simulator scores is the one the engine runs:

- :class:`Fixed`: always the same width (plain decoding at 1);
- :class:`SwitchOff`: a width, or plain decoding above a batch size or while measured acceptance is
  low (``HISTOSPEC_MAX_BATCH``, ``HISTOSPEC_MIN_ACCEPT``, ``HISTOSPEC_PROBE_EVERY``);
- :class:`~histospec_sgl.engine.costmodel.CostModel` (on a step-cost profile) and
  :class:`~histospec_sgl.engine.costmodel.EngineControl` (on the step costs the engine times
  itself, ``HISTOSPEC_CONTROL=cost``): the width that gives the most tokens per second.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class StepPolicy(Protocol):
    """Chooses each decode step's verify width."""

    #: The widths above 1 it may choose; the caller prices a step's drafts at each
    #: (``promised[w]``: accepted tokens the width-w drafts promise, summed over the batch).
    widths: Sequence[int]
    #: Whether :meth:`choose` reads ``promised`` (the index then reports node probabilities).
    reads_promises: bool

    def choose(self, promised: Mapping[int, float], batch: int, context: float = 0.0, prefill: int = 0,
               decoding: int | None = None) -> int:
        """The width for a step of ``batch`` running requests, ``decoding`` of which emit a token
        (default: all), at mean ``context`` tokens with ``prefill`` prompt tokens joining."""
        ...

    def observe(self, promised: float, accepted: float, requests: int, *, shadow: bool = False) -> None:
        """A verified step's drafts over ``requests`` request-steps: what they promised and what was
        accepted. ``shadow``: drafts of a plain step, followed along the tokens decoded instead
        (what verifying them would have accepted)."""
        ...

    def shadow_width(self) -> int:
        """After a plain step, the width whose drafts to measure as shadow drafts (1: none)."""
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
               decoding: int | None = None) -> int:
        return self.width

    def observe(self, promised: float, accepted: float, requests: int, *, shadow: bool = False) -> None:
        pass

    def shadow_width(self) -> int:
        return 1


class SwitchOff(Fixed):
    """A fixed ``width``, switched off (plain decoding) above ``max_batch`` requests, or while the
    mean accepted draft tokens per request-step, measured over the last ``window`` drafted steps, is
    below ``min_accept``; then every ``probe_every``-th step still drafts, to notice when acceptance
    comes back. With the defaults (no limit, ``min_accept`` 0) it is :class:`Fixed`."""

    def __init__(self, width: int, max_batch: int = 0, min_accept: float = 0.0, probe_every: int = 64,
                 window: int = 32):
        super().__init__(width)
        self.max_batch = max_batch
        self.min_accept = min_accept
        self.probe_every = probe_every
        self.window = window
        self._acc: list[float] = []
        self._off_steps = 0

    @property
    def mean_accept(self) -> float | None:
        return sum(self._acc) / len(self._acc) if self._acc else None

    def observe(self, promised: float, accepted: float, requests: int, *, shadow: bool = False) -> None:
        """A drafted step's outcome: accepted draft tokens over its request-steps. A probe (a step
        drafted while switched off) that reaches ``min_accept`` switches drafting back on at once and
        starts a fresh window, so acceptance that came back is not averaged with the old."""
        if shadow or not requests:
            return
        rate = accepted / requests
        mean = self.mean_accept
        if (self.min_accept > 0 and mean is not None and mean < self.min_accept and rate >= self.min_accept
                and len(self._acc) >= min(8, self.window)):
            self._acc = []
            self._off_steps = 0
        self._acc.append(rate)
        del self._acc[: -self.window]

    def should_draft(self, batch_size: int) -> bool:
        if self.max_batch and batch_size > self.max_batch:
            return False
        mean = self.mean_accept
        if self.min_accept <= 0 or mean is None or len(self._acc) < min(8, self.window):
            return True
        if mean >= self.min_accept:
            self._off_steps = 0
            return True
        self._off_steps += 1
        return self._off_steps % self.probe_every == 0

    def choose(self, promised: Mapping[int, float], batch: int, context: float = 0.0, prefill: int = 0,
               decoding: int | None = None) -> int:
        return self.width if self.width > 1 and self.should_draft(batch) else 1
