"""One decode step's plan, decided in one place for the engine's drafter
(:meth:`~histospec_sgl.engine.drafter.BatchDrafter.draft`) and the simulator
(:func:`histospec_sgl.simulate.step.run_step`): what the batch's drafts promise at each width the
step policy may choose (calibrated by request class, :meth:`Feedback.promises`), the width it
chooses, each request's promise at that width, and which drafts are followed as shadow drafts
(each request's widest draft, measured at every width but the one verified, so that every width is
measured at every batch size whether or not it is chosen). The
callers only carry it out: narrow the drafts, verify or decode, start the shadows. What each
request's draft promises at each width is :func:`width_promises`, here too.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from histospec_sgl.engine.draft import tree_parents_batch
from histospec_sgl.engine.feedback import Feedback
from histospec_sgl.engine.policy import StepPolicy


def sure_conditional(draft_config: Mapping[str, Any]) -> float:
    """The probability the index's estimate gives a continuation seen once behind a match of
    unbounded length (docs/index.md): ``((1 - recency) + recency * (1 - recency_decay)) / (1 +
    escape)``, 0.425 at the defaults. A greedy target is deterministic, so such a continuation is as
    sure as the history can make one; a shorter match (more escape mass) or a split history is less."""
    a, beta = float(draft_config["recency"]), float(draft_config["recency_decay"])
    return ((1.0 - a) + a * (1.0 - beta)) / (1.0 + float(draft_config["escape"]))


def width_promises(probs: np.ndarray, masks: np.ndarray | None = None, greedy: np.ndarray | None = None,
                   sure: float | None = None, room: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """What each request's draft promises at each width, the one definition the engine's drafter and
    the simulator use. ``probs[bs, d]``: each draft's path probabilities in SGLang's layout (node 0
    the root, pads 0), ``masks`` its flat ancestor masks (``[bs*d*d]``: a node is taken as at most as
    probable as its parent, so that the most probable nodes form a subtree whatever the rounding; and
    greedy rows' chains), ``greedy[bs]``: which requests decode greedily.

    Returns ``(order, cum)``: ``order[b]`` the non-root nodes (1-based positions minus 1), most
    probable first (a narrower draft keeps the first ``w - 1``), and ``cum[b, w - 2]`` the tokens
    request b's width-w draft promises. A sampled request accepts a node about as often as its path
    probability says, so its promise is their sum. A greedy one accepts a node exactly when it is the
    target's argmax: its promise counts the kept nodes on its majority chain, each more probable
    than its drafted siblings together, its parent on the chain too. The history's majority
    continuation is where a greedy target goes when the history's distribution has its mode where
    the target's has; a repeated greedy response, one occurrence behind a long match, has every
    node at 0.4-0.7 of its parent (the rest is the estimate's mass for continuations never seen), a
    path probability that falls by half or more every node or two, and accepts them all. ``sure``
    (:func:`sure_conditional`): a chain node's conditional probability (its over its parent's) at
    which it counts whole; one below counts that share of it, times its parent's, so a chain behind
    a one-token match (conditionals near half of ``sure``) promises a token or two, not w - 1, while
    a repeated response still promises its whole chain (None: every chain node counts whole).
    ``room[b]`` (with ``masks``): the draft tokens request b can still emit, its ``max_new_tokens``
    less the tokens it has and the step's own (:func:`~histospec_sgl.engine.remaining.room`); a node
    deeper than that promises nothing, and comes after every node that does, so a narrower width keeps
    the nodes the request can use (None: no cap)."""
    bs, d = probs.shape
    rows = np.arange(bs)
    full = probs.astype(np.float64)
    parents = tree_parents_batch(masks, d) if masks is not None and d > 1 else None
    if parents is not None:
        # No node above its parent (rounding, or a source that does not keep to it), so that the most
        # probable nodes, ties going to the lower index (a parent's), always form a subtree.
        bound = np.full(bs, np.inf)
        depth = np.zeros((bs, d), dtype=np.int64)
        for i in range(1, d):  # BFS order: a parent comes before its children
            par = parents[:, i]
            full[:, i] = np.minimum(full[:, i], np.where(par == 0, bound, full[rows, par]))
            depth[:, i] = depth[rows, par] + 1
        if room is not None:
            full[depth > np.asarray(room, dtype=np.float64)[:, None]] = 0.0
    p = full[:, 1:]
    order = np.argsort(-p, axis=1, kind="stable")
    per_node = p
    if greedy is not None and parents is not None and bool(np.any(greedy)):
        kids = np.zeros((bs, d))  # each node's children's probabilities, summed
        np.add.at(kids, (np.repeat(rows, d - 1), parents[:, 1:].reshape(-1)), full[:, 1:].reshape(-1))
        chain = np.zeros((bs, d), dtype=bool)
        chain[:, 0] = True
        for i in range(1, d):  # BFS order: a parent comes before its children
            par = parents[:, i]
            chain[:, i] = chain[rows, par] & (full[:, i] > 0) & (2 * full[:, i] > kids[rows, par])
        weight = chain.astype(np.float64)
        if sure is not None:
            for i in range(1, d):
                above = full[rows, parents[:, i]]
                cond = np.divide(full[:, i], above, out=np.zeros(bs), where=above > 0)
                weight[:, i] *= weight[rows, parents[:, i]] * np.minimum(1.0, cond / sure)
        per_node = np.where(greedy[:, None], weight[:, 1:], p)
    cum = np.cumsum(np.take_along_axis(per_node, order, axis=1), axis=1)
    return order, cum


#: A greedy request's class at a step whose chain promises less than this share of a whole one (its
#: match is short): calibrated apart from greedy chains behind long matches (:func:`greedy_classes`).
SURE_SHARE = 0.75
SHORT_GREEDY = "greedy-short"


def greedy_classes(klasses: list[str | None], greedy: np.ndarray, cum: np.ndarray,
                   room: np.ndarray | None = None) -> list[str | None]:
    """The request classes with :data:`SHORT_GREEDY` for each greedy request whose widest draft
    (``cum[:, -1]``, :func:`width_promises`) promises less than :data:`SURE_SHARE` of a whole chain,
    one as long as the draft or as its ``room`` (what it can still emit). A greedy chain behind a long
    match is accepted whole and one behind a short match seldom: calibrated apart, so that a repeated
    pass's acceptance does not price the next first pass's drafts (or the other way round)."""
    if cum.shape[1] == 0:
        return klasses
    whole = cum.shape[1] if room is None else np.minimum(room, cum.shape[1])
    short = greedy & (cum[:, -1] < SURE_SHARE * whole)
    return [SHORT_GREEDY if sh else k for k, sh in zip(klasses, short.tolist())]


@dataclass(frozen=True)
class StepPlan:
    """What a decode step does (:func:`plan_step`)."""

    #: The verify width (1: plain decoding, each request's root alone).
    width: int
    #: Each request's promised accepted tokens at :attr:`width` (0 at width 1).
    promises: np.ndarray
    #: A plain step's shadow width, the one the policy names (:meth:`StepPolicy.shadow_width`), whose
    #: shadow drafts count in their request class's calibration too (1: none, as beside a verified
    #: step, whose own drafts count there).
    shadow: int = 1
    #: The requests (rows of the batch) whose widest draft starts being followed as a shadow draft.
    shadowed: tuple[int, ...] = ()
    #: The batch's calibrated promise at each width the policy may choose (what it chose from).
    promised: Mapping[int, float] = field(default_factory=dict)
    #: The widths the shadow drafts measure: every width the policy may choose but the one verified.
    #: Each width's draft is a subtree of the widest (its most probable nodes), so one walk down the
    #: widest draft measures what verifying each would have accepted.
    measured: tuple[int, ...] = ()


def plan_step(policy: StepPolicy, feedback: Feedback, by_width: Mapping[int, np.ndarray],
              klasses: Sequence[str | None] | None, drafted: np.ndarray, keys: Sequence[Hashable], *,
              batch: int | None = None, forced: int | None = None, context: float = 0.0,
              prefill: int = 0, waiting: int = 0, remaining: np.ndarray | None = None) -> StepPlan:
    """The plan of one decode step whose ``len(keys)`` decoding requests may be drafted for, in a
    running batch of ``batch`` (default: those), at mean ``context`` tokens with ``prefill`` prompt
    tokens joining it and ``waiting`` requests waiting for a slot.

    ``by_width[w]``: each request's promise at width ``w`` (:func:`~histospec_sgl.engine.plan.width_promises`), at least at every width in ``policy.widths`` when the policy reads promises;
    ``klasses``: each request's class (greedy, sampled), whose calibration scales its promises (None:
    classes unknown, the promises summed as they are); ``drafted``: whether each
    request has a draft (the index found nodes for it); ``keys``: each request's key in
    ``feedback``; ``forced``: this width instead of the policy's choice (its choice is still made
    and counted). A request is shadowed when it has a draft and none is being followed for it.
    Reads ``feedback`` and asks ``policy`` to choose; changes nothing else.

    The policy prices a promised token at what it saves of the time until the batch's last request
    ends (:meth:`CostModel.rates`, given the promise of the request expected to end last: the one
    with the most steps to go by its ``remaining`` tokens, :meth:`Feedback.promises`; without them,
    the least promised), where the batch is all there is to decode. With requests ``waiting``, a
    request that ends early lets one of them in, so every promised token counts whole: the batch's
    promises alone."""
    n = len(keys)
    both = (feedback.promises({w: by_width[w] for w in policy.widths if w > 1}, klasses,
                              remaining if waiting <= 0 else None)
            if policy.reads_promises else {})
    promised = {w: total for w, (total, _) in both.items()}
    least = {w: low for w, (_, low) in both.items()} if waiting <= 0 else None
    chosen = policy.choose(promised, n if batch is None else batch, context, prefill, least=least)
    width = chosen if forced is None else forced
    per_request = np.asarray(by_width[width], dtype=np.float64) if width > 1 and width in by_width \
        else np.zeros(n, dtype=np.float64)
    widest = max(policy.widths, default=1)
    # A plain step's shadows count at the width the policy names, and only where it names one.
    shadow = policy.shadow_width() if width == 1 else 1
    measured = tuple(w for w in policy.widths if 1 < w != width) if width > 1 or shadow > 1 else ()
    rows: tuple[int, ...] = ()
    if measured and widest in by_width:
        rows = tuple(b for b in np.flatnonzero(drafted).tolist() if not feedback.shadowing(keys[b]))
    if not rows:
        measured, shadow = (), 1
    return StepPlan(width, per_request, shadow if shadow in measured else 1, rows, promised, measured)


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
    #: Decode steps run while requests waited for a slot.
    waiting_steps: int = 0
    #: Decode steps at each verify width (1: plain decoding).
    width_steps: dict[int, int] = field(default_factory=dict)

    def step(self, width: int, batch: int, covered: int = 0, offered: int = 0, seconds: float = 0.0,
             waiting: int = 0) -> None:
        """A decode step of ``batch`` requests at ``width``, with ``waiting`` requests waiting for a
        slot."""
        self.steps += 1
        self.waiting_steps += int(waiting > 0)
        self.drafted_steps += int(width > 1)
        self.request_steps += batch
        self.covered += covered
        self.offered += offered
        self.draft_seconds += seconds
        self.width_steps[width] = self.width_steps.get(width, 0) + 1

    def as_dict(self) -> dict[str, float]:
        """The counts by name (not the widths)."""
        return {k: v for k, v in self.__dict__.items() if k != "width_steps"}
