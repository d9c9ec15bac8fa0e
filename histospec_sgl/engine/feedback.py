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
- **Shadow drafts.** A step's widest drafts are followed along the tokens the request goes on to
  produce, one per request at a time, and observed once the walk ends or the request finishes
  (:meth:`Feedback.shadow`, :meth:`Feedback.advanced`, :meth:`Feedback.finished`), at every width
  but the one the step verified: a narrower width's draft is a subtree of the widest, so one walk
  measures them all. Every width is measured at every batch size whether or not the choices run
  it there, so a calibration that undersold a width cannot keep it unchosen for good, and a width
  seldom chosen is priced by what it would have accepted on every step, not only on the few steps
  it won (which, chosen for promising most, accept less of their promise).
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Protocol

import numpy as np

from histospec_sgl.engine.policy import StepPolicy


class Shadow(Protocol):
    """A draft that was not verified, measured at several widths at once (:class:`~histospec_sgl.engine.costmodel.ShadowDraft` in the
    engine; the simulator knows its outcome from the log, :class:`KnownShadow`)."""

    @property
    def promised(self) -> Mapping[int, float]:
        """What its draft at each width it measures promised."""
        ...

    @property
    def width(self) -> int | None:
        """The width it counts at in its request class's calibration too (a plain step's shadow at
        the width the policy named); None: it speaks for its widths only."""
        ...

    def accepted(self, width: int) -> int:
        """Tokens its draft at ``width`` matched so far (final once :meth:`advance` said its walk ended)."""
        ...

    def advance(self, tokens: Sequence[int]) -> bool:
        """The request produced ``tokens``; True once the walk has ended (every width's count final)."""
        ...


class KnownShadow:
    """A shadow draft whose walk is known in advance: at each width it accepts ``outcome[w]`` tokens,
    so its walk ends at the token after the most of them (a leaf reached after them ends it one token
    earlier in the engine)."""

    def __init__(self, promised: Mapping[int, float], outcome: Mapping[int, int], width: int | None) -> None:
        self.promised = dict(promised)
        self.outcome = dict(outcome)
        self.width = width
        self.seen = 0

    def accepted(self, width: int) -> int:
        return min(self.outcome[width], self.seen)

    def advance(self, tokens: Sequence[int]) -> bool:
        self.seen += len(tokens)
        return self.seen > max(self.outcome.values(), default=0)


class Feedback:
    """The measurements a step policy learns from, per engine (see the module's docstring)."""

    def __init__(self, policy: StepPolicy, width: int, pending_steps: int = 4) -> None:
        """``width``: what a verified step nothing was drafted for counts as (the widest)."""
        self.policy = policy
        self.width = width
        # Each drafted-for step not yet verified: its width (1: plain), per request class what its
        # drafts promised, which requests it held and how many draft tokens each could still emit.
        self._steps: collections.deque[tuple[int, dict[str, float], list[str | None], list[float] | None]] = \
            collections.deque(maxlen=pending_steps)
        self._shadows: dict[Hashable, tuple[Shadow, str | None, int | None]] = {}

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

    def drafted(self, width: int, per_request: Sequence[float], klasses: Sequence[str | None],
                room: Sequence[float] | np.ndarray | None = None) -> None:
        """A step drafted at ``width`` (1: plain), each request's promise at it; ``room``: the draft
        tokens each could still emit (:func:`~histospec_sgl.engine.remaining.room`; None: no cap),
        which its promise kept to and which the tokens it is found to accept are cut to."""
        by_class: dict[str, float] = {}
        for k, v in zip(klasses, per_request):
            by_class[k or ""] = by_class.get(k or "", 0.0) + float(v)
        self._steps.append((width, by_class, list(klasses), None if room is None else list(room)))

    def verified(self, accepted: Iterable[int]) -> None:
        """Accepted draft tokens per request of the oldest drafted step, observed by class (a step
        verified without drafts measures nothing)."""
        acc = list(accepted)
        width, promised, klasses, room = (self._steps.popleft() if self._steps
                                          else (self.width, {"": 0.0}, [None] * len(acc), None))
        if width <= 1:
            return
        if len(klasses) != len(acc):  # not the step drafted for: count it as one class
            klasses = [None for _ in acc]
            promised = {"": sum(promised.values())}
        elif room is not None:  # SGLang's verify counts drafts past a request's cap; its end cuts them
            acc = [a if a <= r else int(r) for a, r in zip(acc, room)]  # r may be inf (no cap)
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

    def shadow(self, key: Hashable, draft: Shadow, klass: str | None, batch: int | None = None) -> None:
        """Follows ``draft``, the widest draft of request ``key`` (of class ``klass``, in a step of
        ``batch`` requests) beside a plain or verified step, to measure it at its widths."""
        self._shadows[key] = (draft, klass, batch)

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

    def _observe(self, draft: Shadow, klass: str | None, batch: int | None) -> None:
        for w, promised in draft.promised.items():
            self.policy.observe(promised, draft.accepted(w), 1, shadow=True, klass=klass, width=w,
                                beside=w != draft.width, batch=batch)
