"""One decode step's plan, decided in one place for the engine's drafter
(:meth:`~histospec_sgl.engine.drafter.BatchDrafter.draft`) and the simulator
(:func:`histospec_sgl.simulate.step.run_step`): what the batch's drafts promise at each width the
step policy may choose (calibrated by request class, :meth:`Feedback.promises`), the width it
chooses, each request's promise at that width, and which drafts are followed as shadow drafts (a
plain step's at the width the policy names; a narrower verified step's widest beside it). The
callers only carry it out: narrow the drafts, verify or decode, start the shadows.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from histospec_sgl.engine.feedback import Feedback
from histospec_sgl.engine.policy import StepPolicy


@dataclass(frozen=True)
class StepPlan:
    """What a decode step does (:func:`plan_step`)."""

    #: The verify width (1: plain decoding, each request's root alone).
    width: int
    #: Each request's promised accepted tokens at :attr:`width` (0 at width 1).
    promises: np.ndarray
    #: The width whose drafts are followed as shadow drafts (1: none).
    shadow: int = 1
    #: The shadows stand beside a narrower verified step (they speak for their width only).
    beside: bool = False
    #: The requests (rows of the batch) whose draft at :attr:`shadow` starts being followed.
    shadowed: tuple[int, ...] = ()
    #: The batch's calibrated promise at each width the policy may choose (what it chose from).
    promised: Mapping[int, float] = field(default_factory=dict)


def plan_step(policy: StepPolicy, feedback: Feedback, by_width: Mapping[int, np.ndarray],
              klasses: Sequence[str | None] | None, drafted: np.ndarray, keys: Sequence[Hashable], *,
              batch: int | None = None, forced: int | None = None, context: float = 0.0,
              prefill: int = 0) -> StepPlan:
    """The plan of one decode step whose ``len(keys)`` decoding requests may be drafted for, in a
    running batch of ``batch`` (default: those), at mean ``context`` tokens with ``prefill`` prompt
    tokens joining it.

    ``by_width[w]``: each request's promise at width ``w`` (:func:`~histospec_sgl.engine.costmodel.
    width_promises`), at least at every width in ``policy.widths`` when the policy reads promises;
    ``klasses``: each request's class (greedy, sampled), whose calibration scales its promises (None:
    classes unknown, the promises summed as they are); ``drafted``: whether each
    request has a draft (the index found nodes for it); ``keys``: each request's key in
    ``feedback``; ``forced``: this width instead of the policy's choice (its choice is still made
    and counted). A request is shadowed when it has a draft and none is being followed for it.
    Reads ``feedback`` and asks ``policy`` to choose; changes nothing else."""
    n = len(keys)
    promised = (feedback.promises({w: by_width[w] for w in policy.widths if w > 1}, klasses)
                if policy.reads_promises else {})
    chosen = policy.choose(promised, n if batch is None else batch, context, prefill)
    width = chosen if forced is None else forced
    per_request = np.asarray(by_width[width], dtype=np.float64) if width > 1 and width in by_width \
        else np.zeros(n, dtype=np.float64)
    widest = max(policy.widths, default=1)
    shadow = policy.shadow_width() if width == 1 else widest if 1 < width < widest else 1
    rows: tuple[int, ...] = ()
    if shadow > 1 and shadow in by_width:
        rows = tuple(b for b in np.flatnonzero(drafted).tolist() if not feedback.shadowing(keys[b]))
    else:
        shadow = 1
    return StepPlan(width, per_request, shadow, width > 1, rows, promised)


@dataclass
class StepCounts:
    """What the decode steps did, counted in one place: the engine's drafter keeps one since its start
    (its ``totals``) and one since its last log line; the simulator one per simulated step run."""

    steps: int = 0
    drafted_steps: int = 0
    request_steps: int = 0
    #: Request-steps whose request had a draft.
    covered: int = 0
    accepted: int = 0
    offered: int = 0
    draft_seconds: float = 0.0
    finished: int = 0
    kept: int = 0
    #: Decode steps at each verify width (1: plain decoding).
    width_steps: dict[int, int] = field(default_factory=dict)

    def step(self, width: int, batch: int, covered: int = 0, offered: int = 0, seconds: float = 0.0) -> None:
        """A decode step of ``batch`` requests at ``width``."""
        self.steps += 1
        self.drafted_steps += int(width > 1)
        self.request_steps += batch
        self.covered += covered
        self.offered += offered
        self.draft_seconds += seconds
        self.width_steps[width] = self.width_steps.get(width, 0) + 1

    def as_dict(self) -> dict[str, float]:
        """The counts by name (not the widths)."""
        return {k: v for k, v in self.__dict__.items() if k != "width_steps"}
