"""Speculation that pays for itself: each decode step, the verify width that gives the most tokens
per second for the running batch, from the step-cost profile and the acceptance the drafts promise.

The index's node probabilities estimate how likely each draft node is to be accepted, so a width-w
draft promises the sum of its w-1 best nodes' probabilities in accepted tokens (the drafts are
grown best-first, so a narrower draft is the wider one's most probable nodes). Those promises are
scaled by a calibration factor: accepted tokens over promised tokens, measured on the steps
verified so far. Width 1 is plain decoding (no draft), so the choice is never worse than plain
decoding by the model's own account, and it turns speculation on when the batch shrinks.
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
    chosen: dict[int, int] = field(default_factory=dict)

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
        best, best_rate = 1, n / self.profile.step_s(batch, 1, context, prefill)
        for w in self.widths:
            if w <= 1:
                continue
            rate = (n + c * promised.get(w, 0.0)) / self.profile.step_s(batch, w, context, prefill)
            if rate > best_rate:
                best, best_rate = w, rate
        self.chosen[best] = self.chosen.get(best, 0) + 1
        return best

    def observe(self, promised: float, accepted: float) -> None:
        """A verified step: what its drafts promised and what was accepted."""
        self.promised += promised
        self.accepted += accepted
