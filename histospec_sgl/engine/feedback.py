"""What the step policy learns from, and when: written once for the engine's drafter
(:class:`~histospec_sgl.engine.drafter.BatchDrafter`) and the simulator
(:func:`histospec_sgl.simulate.step.run_step`), so that the policy the simulator scores is fed as
the engine feeds it.

- **Promises.** Before a step, each width's promise for the batch: each request's promise at the
  width (its ``w - 1`` most probable nodes' path probabilities) times its request class's
  calibration at that width, and the promise of the request expected to end the batch (by how
  long each has left to run; :meth:`Feedback.promises`).
- **Verified steps.** A step drafted at a width above 1 is remembered with its promises by class
  (:meth:`Feedback.drafted`) until the engine reports what it accepted (:meth:`Feedback.verified`;
  with overlap scheduling, after the next step was drafted).
- **Shadow drafts.** A plain step's drafts are followed along the tokens the request goes on to
  produce, one per request at a time, and observed once the walk ends or the request finishes
  (:meth:`Feedback.shadow`, :meth:`Feedback.advanced`, :meth:`Feedback.finished`). So is a step's
  widest draft beside the narrower one it verified (``beside``): a width the choices have left
  keeps being measured, or a calibration that undersold it would keep it unchosen for good.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Protocol

import numpy as np

from histospec_sgl.engine.policy import StepPolicy


class Shadow(Protocol):
    """A draft that was not verified (:class:`~histospec_sgl.engine.costmodel.ShadowDraft` in the
    engine; the simulator knows its outcome from the log, :class:`KnownShadow`)."""

    promised: float
    width: int | None

    @property
    def accepted(self) -> int:
        """Tokens it matched so far (final once :meth:`advance` said its walk ended)."""
        ...

    def advance(self, tokens: Sequence[int]) -> bool:
        """The request produced ``tokens``; True once the walk has ended (``accepted`` final)."""
        ...


class KnownShadow:
    """A shadow draft whose walk is known in advance: it accepts ``outcome`` tokens, so its walk ends
    at the token after them (a leaf reached after them ends it one token earlier in the engine)."""

    def __init__(self, promised: float, outcome: int, width: int) -> None:
        self.promised = promised
        self.outcome = outcome
        self.width: int | None = width
        self.seen = 0

    @property
    def accepted(self) -> int:
        return min(self.outcome, self.seen)

    def advance(self, tokens: Sequence[int]) -> bool:
        self.seen += len(tokens)
        return self.seen > self.outcome


class Feedback:
    """The measurements a step policy learns from, per engine (see the module's docstring)."""

    def __init__(self, policy: StepPolicy, width: int, pending_steps: int = 4) -> None:
        """``width``: what a verified step nothing was drafted for counts as (the widest)."""
        self.policy = policy
        self.width = width
        # Each drafted-for step not yet verified: its width (1: plain), and per request class what its
        # drafts promised and which requests it held.
        self._steps: collections.deque[tuple[int, dict[str, float], list[str | None]]] = \
            collections.deque(maxlen=pending_steps)
        self._shadows: dict[Hashable, tuple[Shadow, str | None, bool, int | None]] = {}

    def promises(self, by_width: Mapping[int, np.ndarray], klasses: Sequence[str | None] | None,
                 remaining: np.ndarray | None = None) -> dict[int, tuple[float, float]]:
        """``by_width[w]``: each request's promise at width ``w``. Scaled per request class by the
        policy's calibration at the batch's size (:meth:`StepPolicy.calibration`) where the classes
        are known (else taken as they are), then, at each width, summed over the batch, and the
        promise of the request expected to end the batch: ``(sum, slowest's)``.

        The request that ends the batch is the one with the most steps to go, its ``remaining``
        tokens (:mod:`~histospec_sgl.engine.remaining`; NaN: not known, taken as long as the
        longest known; 0: it has ended, and is not the one) over one plus its promise; without
        ``remaining`` every request is taken as equally long, and so the least promised one ends it."""
        out: dict[int, tuple[float, float]] = {}
        left = None
        if remaining is not None and len(remaining):
            live = remaining != 0  # NaN too
            known = live & ~np.isnan(remaining)
            if known.any():
                left = np.where(np.isnan(remaining), np.max(remaining[known]), remaining)
            elif live.any() and not live.all():
                left = live.astype(np.float64)  # the live ones equally long: the least promised of them
        for w, per in by_width.items():
            if klasses is not None:
                cal = {k: self.policy.calibration(k, w, len(klasses)) for k in set(klasses)}
                per = np.array([cal[k] for k in klasses]) * per
            if not len(per):
                out[w] = (0.0, 0.0)
                continue
            slowest = float(np.min(per)) if left is None else float(per[int(np.argmax(left / (1.0 + per)))])
            out[w] = (float(np.sum(per)), slowest)
        return out

    def drafted(self, width: int, per_request: Sequence[float], klasses: Sequence[str | None]) -> None:
        """A step drafted at ``width`` (1: plain), each request's promise at it."""
        by_class: dict[str, float] = {}
        for k, v in zip(klasses, per_request):
            by_class[k or ""] = by_class.get(k or "", 0.0) + float(v)
        self._steps.append((width, by_class, list(klasses)))

    def verified(self, accepted: Iterable[int]) -> None:
        """Accepted draft tokens per request of the oldest drafted step, observed by class (a step
        verified without drafts measures nothing)."""
        acc = list(accepted)
        width, promised, klasses = (self._steps.popleft() if self._steps
                                    else (self.width, {"": 0.0}, [None] * len(acc)))
        if width <= 1:
            return
        if len(klasses) != len(acc):  # not the step drafted for: count it as one class
            klasses = [None for _ in acc]
            promised = {"": sum(promised.values())}
        by_class: dict[str, list[float]] = {}
        for k, a in zip(klasses, acc):
            e = by_class.setdefault(k or "", [0.0, 0.0])
            e[0] += 1
            e[1] += a
        for k, (n, got) in by_class.items():
            self.policy.observe(promised.get(k, 0.0), got, int(n), klass=k or None, width=width, batch=len(acc))

    def shadowing(self, key: Hashable) -> bool:
        """Whether request ``key`` has a shadow draft being followed."""
        return key in self._shadows

    def shadow(self, key: Hashable, draft: Shadow, klass: str | None, beside: bool = False,
               batch: int | None = None) -> None:
        """Follows ``draft``, a plain step's draft of request ``key`` (of class ``klass``, in a step of
        ``batch`` requests), or (``beside``) its widest draft beside the narrower one the step
        verified."""
        self._shadows[key] = (draft, klass, beside, batch)

    def advanced(self, key: Hashable, tokens: Sequence[int]) -> None:
        """Request ``key`` produced ``tokens``: its shadow draft follows them, observed once it ends."""
        entry = self._shadows.get(key)
        if entry is not None and entry[0].advance(tokens):
            del self._shadows[key]
            self._observe(*entry)

    def finished(self, key: Hashable, complete: bool = True) -> None:
        """Request ``key`` ended: a shadow draft still followed is observed as far as it got, where the
        response is ``complete`` (verifying it would have accepted up to the response's end), or dropped."""
        entry = self._shadows.pop(key, None)
        if entry is not None and complete:
            self._observe(*entry)

    def _observe(self, draft: Shadow, klass: str | None, beside: bool, batch: int | None) -> None:
        self.policy.observe(draft.promised, draft.accepted, 1, shadow=True, klass=klass, width=draft.width,
                            beside=beside, batch=batch)
