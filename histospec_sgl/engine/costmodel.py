"""Speculation that pays for itself: each decode step, the verify width that gives the most tokens
per second for the running batch, from the step-cost profile and the acceptance the drafts promise.

The index's node probabilities estimate how likely each draft node is to be accepted, so a width-w
draft promises the sum of its w-1 best nodes' probabilities in accepted tokens (the drafts are
grown best-first, so a narrower draft is the wider one's most probable nodes). Those promises are
scaled by a calibration factor: accepted tokens over promised tokens, measured on the steps
verified so far. Something must keep measuring while plain decoding wins, or promises that
understate acceptance would keep it plain for good: in the simulator one step in ``probe_every`` is
verified wide; in the engine a draft that was not verified is followed along the tokens the plain
steps then sample (:class:`ShadowDraft`), which measures what verifying it would have accepted at no
cost. Width 1 is plain decoding (no draft), so apart from probes the choice is never worse than
plain decoding by the model's own account, and it turns speculation on when the batch shrinks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from histospec_sgl.engine.clock import StepClock, bucket
from histospec_sgl.engine.draft import walk
from histospec_sgl.engine.policy import Fixed, PrefillCost, Profile


@dataclass
class CostModel:
    """Chooses the verify width per step (a :class:`~histospec_sgl.engine.policy.StepPolicy`).
    ``widths`` are the draft widths it may verify (root included; 1, plain decoding, is always
    allowed)."""

    reads_promises = True
    profile: Profile
    widths: Sequence[int]
    accepted: float = 0.0
    promised: float = 0.0
    #: The first steps trust the promises as they are (no measurement yet).
    min_promised: float = 32.0
    #: While plain decoding wins, every this many steps one is verified wide anyway, so that the
    #: calibration keeps measuring what the drafts deliver (promises that understate acceptance
    #: would otherwise keep it plain for good); 0: never (the engine measures by shadow drafts).
    probe_every: int = 16
    #: Each time this many tokens have been promised, the old measurements count half (None: never),
    #: so the calibration follows a change in acceptance (another temperature, a new policy).
    forget_after: float | None = None
    chosen: dict[int, int] = field(default_factory=dict)
    #: At the last choice, the width above 1 with the most expected tokens per second (1: none), chosen or not.
    candidate: int = 1
    #: Calibrations by request class (e.g. greedy and sampled requests), by class and verify width
    #: (a node's path probability shrinks with its depth faster than its acceptance may), and by
    #: class, width and batch-size bucket: key -> [promised, accepted], keys ``klass``, ``(klass,
    #: width)`` and ``(klass, width, bucket)``. One with too little measured falls back to the coarser
    #: one; a bucket's is drawn towards its width's (:attr:`bucket_prior`).
    classes: dict[Any, list[float]] = field(default_factory=dict)
    #: A batch-size bucket's calibration is its accepted tokens plus this many promised tokens at the
    #: width's calibration, over its promised tokens plus as many: with little measured in the bucket
    #: it is the width's, and what the bucket measures takes over as it grows. Requests in a batch
    #: accept differently from one running alone (their siblings are in flight beside them, not
    #: finished in history), and the batch-1 rows' steps, which are many, would set the factor.
    bucket_prior: float = 64.0
    _since_wide: int = 0

    @classmethod
    def measuring_shadows(cls, profile: Profile, widths: Sequence[int], forget_after: float = 2048.0) -> CostModel:
        """The engine's configuration: no probes (the caller measures the drafts of plain steps as
        shadow drafts and passes them to :meth:`observe`), and a calibration that forgets."""
        return cls(profile, widths, probe_every=0, forget_after=forget_after)

    def calibration(self, klass: str | None = None, width: int | None = None, batch: int | None = None) -> float:
        """Accepted over promised draft tokens so far: for request class ``klass`` at verify width
        ``width``, else for the class, else over every class, whichever first has enough measured (1
        until enough has been promised); with ``batch``, the width's drawn towards what requests of
        the class accepted at the width in that batch size's bucket (:attr:`bucket_prior`)."""
        coarse = self._calibration(klass, width)
        if klass is None or width is None or batch is None:
            return coarse
        promised, accepted = self.classes.get((klass, width, bucket(batch)), (0.0, 0.0))
        return (accepted + self.bucket_prior * coarse) / (promised + self.bucket_prior)

    def _calibration(self, klass: str | None, width: int | None) -> float:
        keys: list[Any] = ([(klass, width)] if klass is not None and width is not None else []) + (
            [klass] if klass is not None else [])
        for key in keys:
            promised, accepted = self.classes.get(key, (0.0, 0.0))
            if promised >= self.min_promised:
                return accepted / promised
        if self.promised < self.min_promised:
            return 1.0
        return self.accepted / self.promised

    def choose(self, promised: Mapping[int, float], batch: int, context: float = 0.0, prefill: int = 0,
               decoding: int | None = None, calibrated: bool = False,
               least: Mapping[int, float] | None = None) -> int:
        """The width with the most expected tokens per second. ``promised[w]``: the batch's sum of
        promised accepted tokens at width ``w`` (``calibrated``: already scaled by the caller, e.g.
        per request class); ``least[w]``: the promise of the request expected to end the batch
        (:meth:`rates`);
        ``decoding``: requests that emit a token this step (default: the whole batch)."""
        return self.pick(self.rates(promised, batch, context, prefill, decoding, calibrated, least))

    def pick(self, rates: Mapping[int, float]) -> int:
        """The choice among :meth:`rates` (plain decoding at 1), counted as made."""
        plain = rates[1]
        wide, wide_rate = 1, 0.0
        for w, rate in rates.items():
            if w > 1 and rate > wide_rate:
                wide, wide_rate = w, rate
        self.candidate = wide
        probe = 0 < self.probe_every <= self._since_wide
        best = wide if wide > 1 and (wide_rate > plain or probe) else 1
        self._since_wide = 0 if best > 1 else self._since_wide + 1
        self.chosen[best] = self.chosen.get(best, 0) + 1
        return best

    def rates(self, promised: Mapping[int, float], batch: int, context: float = 0.0, prefill: int = 0,
              decoding: int | None = None, calibrated: bool = False,
              least: Mapping[int, float] | None = None) -> dict[int, float]:
        """Expected tokens per second at plain decoding (width 1) and at each width, by the profile:
        ``(decoding + promised) / step cost``.

        With ``least`` (at each width, the promise of the request expected to end the batch: the
        least promised one where every request has as long to go), a promised token is worth what it
        saves of the time until the batch's last request ends: a step's cost is a part per request,
        which each accepted token saves, plus a fixed part (:func:`fixed_share` of a plain step),
        which only fewer steps save, and the batch takes as many steps as its last request needs.
        So the fixed part is credited for that request's promise (``decoding * least``), the rest
        for all of them: ``(1 - f) * promised + f * decoding * least``. Where the requests are
        promised alike this is ``promised``; where the request that ends the batch is promised
        nothing, drafts that only shorten the others are worth their per-request part."""
        n = batch if decoding is None else decoding
        c = 1.0 if calibrated else self.calibration()
        out = {1: n / self.profile.step_s(batch, 1, context, prefill)}
        f = fixed_share(self.profile, batch, context, prefill) if least is not None and n > 1 else 0.0
        for w in self.widths:
            if w > 1:
                p = c * promised.get(w, 0.0)
                if least is not None:
                    p = (1.0 - f) * p + f * n * c * least.get(w, 0.0)
                out[w] = (n + p) / self.profile.step_s(batch, w, context, prefill)
        return out

    def observe(self, promised: float, accepted: float, requests: int = 0, *, shadow: bool = False,
                klass: str | None = None, width: int | None = None, beside: bool = False,
                batch: int | None = None) -> None:
        """What drafts promised and what was (or would have been, ``shadow``) accepted of them, by
        requests of class ``klass`` at verify width ``width`` in a batch of ``batch`` (counted in the
        calibrations of the class at the width in the batch's bucket, at the width, of the class, and
        overall; ``beside``: at the width only, the step's verified drafts having counted for the
        rest)."""
        if not beside:
            self.promised += promised
            self.accepted += accepted
            if self.forget_after is not None and self.promised >= self.forget_after:
                self.promised /= 2
                self.accepted /= 2
        keys: list[Any] = [klass] if klass is not None and not beside else []
        if klass is not None and width is not None:
            keys.append((klass, width))
            if batch is not None:
                keys.append((klass, width, bucket(batch)))
        for key in keys:
            cls = self.classes.setdefault(key, [0.0, 0.0])
            cls[0] += promised
            cls[1] += accepted
            if self.forget_after is not None and cls[0] >= self.forget_after:
                cls[0] /= 2
                cls[1] /= 2

    def shadow_width(self) -> int:
        """With no probes, a plain step's drafts at the width that came closest to paying are
        measured as shadow drafts."""
        return self.candidate if not self.probe_every else 1

    def begin(self, now: float, after_idle: bool = False) -> None:
        pass  # priced by its profile: it times nothing

    def decode_step(self, batch: int, width: int, started: float) -> None:
        pass

    def prefill_step(self, tokens: int, started: float) -> None:
        pass

    def step_costs(self, mean: bool = False) -> dict[tuple[int, int], float]:
        return {}

    def prefill_cost(self) -> PrefillCost | None:
        return None

    def summary(self) -> str:
        chosen = ", ".join(f"w{w} {n}" for w, n in sorted(self.chosen.items()))
        return f"calibration {self.calibration():.2f}, steps chosen {{{chosen}}}"


@dataclass
class ShadowDraft:
    """A draft that was not verified, followed along the tokens the request goes on to produce: the
    number of its tokens those match from the root down is what verifying it would have accepted.
    It is a request's widest draft and measures every narrower one with it: a width-w draft keeps
    the w - 1 most probable nodes (``ranks``: each node's place in that order, from 0; the root's
    -1), a subtree, so at width w verifying would have accepted the matched path's nodes ranked
    below w - 1.

    Under greedy decoding that is exact. Under sampling, SGLang's tree verification with
    deterministic drafts accepts a child with the target's probability of sampling it, after the
    siblings before it were rejected, so it accepts some child exactly as often as the target
    samples one of them, which is what the match counts: an unbiased measurement, taken from steps
    that did not verify it."""

    tokens: list[int]  # node 0 is the root
    parents: list[int]  # parents[i] for node i > 0 (parents[0] unused)
    ranks: list[int]  # ranks[i]: node i's place among the non-root nodes by path probability
    promised: dict[int, float]  # what its draft at each width it measures promised
    width: int | None = None  # the width it counts at in its class's calibration too (None: none)
    node: int = 0

    def accepted(self, width: int) -> int:
        """Tokens its draft at ``width`` matched so far: the matched path's nodes ranked below
        ``width - 1`` (a node ranks after its parent, so they are the path's first ones)."""
        n, node = 0, self.node
        while node > 0:
            n += self.ranks[node] < width - 1
            node = self.parents[node]
        return n

    def advance(self, tokens: Sequence[int]) -> bool:
        """The request produced ``tokens`` after the draft's root (or after the last call's):
        follows them down the tree. True once the walk has ended (a miss or a leaf), with every
        width's count final."""
        self.node, _, ended = walk(self.tokens, self.parents, tokens, self.node, leaf_ends=True)
        return ended


def fixed_share(profile: Profile, batch: int, context: float = 0.0, prefill: int = 0) -> float:
    """The share of a plain step of ``batch`` requests that does not grow with the batch: where the
    line through the profile's plain step at batch 1 and at ``batch`` meets batch 0 (held between 0
    and the cheaper step), over the step at ``batch``. On a CPU most of a step grows with the batch;
    on a GPU, which reads the weights once a step whatever the batch, most does not."""
    if batch <= 1:
        return 1.0
    one, full = profile.step_s(1, 1, context, prefill), profile.step_s(batch, 1, context, prefill)
    fixed = (batch * one - full) / (batch - 1)
    return min(max(fixed, 0.0), one, full) / full if full > 0 else 0.0


def verify_widths(d: int) -> tuple[int, ...]:
    """The widths above 1 the engine may verify at for a configured width ``d``: the powers of two
    below it, and ``d`` (2, 4, 8 for d = 8; 2, 4, 8, 12 for d = 12)."""
    out, w = [], 2
    while w < d:
        out.append(w)
        w *= 2
    return (*out, d) if d > 1 else ()


class Timed:
    """A policy that times the engine's forward passes on its :class:`StepClock` (the engine's
    worker calls :meth:`begin`, :meth:`decode_step` and :meth:`prefill_step` around each): every
    decode step per width and batch-size bucket, every prefill pass per prompt token."""

    clock: StepClock
    #: (width, batch) of the step in flight and when it started (width 0: a prefill, of ``batch`` tokens).
    _current: tuple[int, int, float] | None

    def begin(self, now: float, after_idle: bool = False) -> None:
        """The engine starts a forward pass (of any kind): the decode step before it, if any, took
        the time since that step started; ``after_idle``: the engine may have idled since (every
        request of that step had finished), so the time is not the step's and is not kept."""
        if self._current is not None and not after_idle:
            w, b, t0 = self._current
            if w:
                self.clock.record(b, w, now - t0)
            else:
                self.clock.record_prefill(b, now - t0)
        self._current = None

    def decode_step(self, batch: int, width: int, started: float) -> None:
        """The forward pass begun at ``started`` is a decode step of ``batch`` requests at ``width``."""
        self._current = (width, batch, started)

    def prefill_step(self, tokens: int, started: float) -> None:
        """The forward pass begun at ``started`` prefills ``tokens`` prompt tokens (timed, not priced:
        the choice of width is made between decode steps)."""
        if tokens > 0:
            self._current = (0, tokens, started)

    def step_costs(self, mean: bool = False) -> dict[tuple[int, int], float]:
        """Its clock's measured costs: seconds per (width, batch-size bucket), the medians it prices
        by (``mean``: the means of the same timings)."""
        return dict(self.clock.means if mean else self.clock.table)

    def prefill_cost(self) -> PrefillCost | None:
        """What a prefill forward pass costs, as its clock timed them (:meth:`StepClock.prefill`)."""
        return self.clock.prefill()


class TimedFixed(Timed, Fixed):
    """:class:`Fixed` as the engine runs it (``HISTOSPEC_CONTROL=fixed``: every decode step at
    width d; plain steps where a request needs the full sampler), timing its steps as the default
    policy does, so that a fixed-width server reports
    its step costs (``histospec:step_seconds``) beside a default one's."""

    def __init__(self, width: int):
        Fixed.__init__(self, width)
        self.clock = StepClock()
        self._current = None


@dataclass
class EngineControl(Timed):
    """The engine's per-step choice of verify width: plain decoding (width 1, the target's DECODE
    forward) or the drafts' most probable nodes at one of :func:`verify_widths` (``d`` the widest),
    from step costs it measures itself (:class:`StepClock`) and what the drafts promise at each
    width, calibrated per request class and width (greedy and sampled requests accept differently,
    and a deep node's path probability understates a repeated response's). A batch-size bucket runs
    d and plain decoding in its first steps until it has ``min_samples`` timings of each (the other
    widths are priced between them until chosen, then measured as they run), and a measured width
    that comes within ``contend`` of the best but that the choices have not used in a bucket for
    ``remeasure_after`` timed steps is run once more, so that a cost measured too high is not kept
    for good by never being chosen again (one measured too low is chosen, and so measured again).
    ``widths`` restricts the set (e.g. to ``(d,)``: verify at d or decode plainly)."""

    reads_promises = True
    d: int
    clock: StepClock = field(default_factory=StepClock)
    model: CostModel = field(init=False)
    #: Steps chosen at a width in a bucket to measure it.
    tries: dict[tuple[int, int], int] = field(default_factory=dict)
    #: The calibration's memory, in promised tokens (:attr:`CostModel.forget_after`).
    forget_after: float = 2048.0
    min_samples: int = 3
    remeasure_after: int = 128
    #: Timed steps after which a bucket that began on borrowed prices measures d and plain decoding
    #: itself.
    settle: int = 32
    #: A width priced within this fraction of the best expected rate, whose price in the bucket is
    #: not yet its own measurement, is run to measure it (a few steps, each at most this much
    #: slower by the estimate).
    contend: float = 0.2
    #: Over the verified steps: the accepted tokens expected (calibrated promises) and accepted.
    verified: list[float] = field(default_factory=lambda: [0.0, 0.0])
    #: The same per (width, batch-size bucket) of the steps (``histospec:verified_*_tokens``).
    verified_by: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    #: The widths above 1 it may choose (default :func:`verify_widths` of ``d``).
    widths: Sequence[int] = ()
    #: The widths each batch-size bucket measures in its first steps (default d and plain decoding);
    #: the others are priced between them (:meth:`StepClock.step_s`) until they are chosen.
    explore: Sequence[int] = ()
    #: (width, batch) of the step in flight and when it started.
    _current: tuple[int, int, float] | None = None

    def __post_init__(self) -> None:
        self.widths = tuple(sorted(set(self.widths))) if self.widths else verify_widths(self.d)
        if any(w < 2 or w > self.d for w in self.widths):
            raise ValueError(f"verify widths must be in [2, {self.d}], got {self.widths}")
        # The widest width and plain decoding; plain decoding alone at d = 1 (no width to verify at).
        self.explore = tuple(self.explore) if self.explore else (*self.widths[-1:], 1)
        # No probes: the drafts of plain steps are measured as shadow drafts (:class:`ShadowDraft`).
        self.model = CostModel.measuring_shadows(self.clock, list(self.widths), self.forget_after)

    def calibration(self, klass: str | None = None, width: int | None = None, batch: int | None = None) -> float:
        """Accepted over promised draft tokens, for requests of class ``klass`` at ``width`` in a batch
        of ``batch``."""
        return self.model.calibration(klass, width, batch)

    def choose(self, promised: Mapping[int, float], batch: int, context: float = 0.0, prefill: int = 0,
               decoding: int | None = None, least: Mapping[int, float] | None = None) -> int:
        """The width of a decode step of ``batch`` requests whose drafts promise ``promised[w]``
        accepted tokens in all at width ``w``, ``least[w]`` the least of one request (already
        calibrated per request class; :meth:`CostModel.rates`)."""
        # A bucket that can borrow its prices from another, measured one (:meth:`StepClock.step_s`)
        # runs what they say and measures its own widths only once it has run ``settle`` timed steps
        # (a batch size that lasts); the first bucket the engine runs measures them from its first
        # steps, ``min_samples`` timings each (one timing of each would price it already).
        explore = not self.clock.borrows(batch) or self.clock.steps_in(batch) >= self.settle
        for w in self.explore if explore else ():
            # Until it has run often enough here: a step chosen at a width but run at another (no
            # request had a draft, so it ran plainly) times the width it ran at, and this one is
            # chosen again, until drafts come.
            if self.clock.count(batch, w) < self.min_samples:
                key = (w, bucket(batch))
                self.tries[key] = self.tries.get(key, 0) + 1
                return w
        # A width that comes within ``contend`` of the best is measured before the choice trusts its
        # price, where that price is not its own measurement here (interpolated between the widths
        # measured, or borrowed from another batch size): a bucket measures what it chooses between,
        # wherever the batch spends its steps. And one the choices have not run here for
        # ``remeasure_after`` timed steps is run once more, so that a cost measured too high does
        # not keep it unchosen for good. A width further behind is not run to measure it: a step
        # spent there would change no choice unless its price were that far off. The contenders are
        # measured narrowest first, plain decoding before any verify width: the cheapest steps to
        # spend, and each timing reprices the bucket's borrowed and interpolated prices (scaled to
        # its own measured widths), which may put a wider contender out of the running before a
        # step is spent on it. A contender timed once is run again only where that timing itself
        # keeps it within ``contend`` of the best: a second step where the first said it is behind
        # would only check that the first was not slow for another reason, and its price
        # (:meth:`StepClock.step_s`, between the timing and the estimate) has it chosen all the same
        # where it is the best.
        rates = self.model.rates(promised, batch, calibrated=True, least=least)
        best = max(rates.values())
        floor = (1.0 - self.contend) * best
        for w, rate in sorted(rates.items()):
            if rate < floor:
                continue
            key = (w, bucket(batch))
            timed = self.clock.count(batch, w)
            if timed < self.clock.trusted and self.tries.get(key, 0) < self.clock.trusted + 2 and (
                    not timed or rate * self.clock.step_s(batch, w) / self.clock.price(batch, w) >= floor):
                self.tries[key] = self.tries.get(key, 0) + 1
                return w
            if rate < best and self.clock.known(batch, w) and self.clock.age(batch, w) > self.remeasure_after:
                return w
        return self.model.pick(rates)

    def observe(self, promised: float, accepted: float, requests: int = 0, *, shadow: bool = False,
                klass: str | None = None, width: int | None = None, beside: bool = False,
                batch: int | None = None) -> None:
        """A verified step's drafts (or, ``shadow``, a shadow draft's; ``beside``, one at a width other
        than the step verified) by requests of class ``klass`` at ``width`` in a batch of ``batch``:
        what they promised and what was (or would have been) accepted."""
        if not shadow:
            expected = self.model.calibration(klass, width, batch) * promised
            tallies = [self.verified]
            if width and batch:
                tallies.append(self.verified_by.setdefault((width, bucket(batch)), [0.0, 0.0]))
            for tally in tallies:
                tally[0] += expected
                tally[1] += accepted
        self.model.observe(promised, accepted, klass=klass, width=width, beside=beside, batch=batch)

    def shadow_width(self) -> int:
        """After a plain step, the width whose drafts are measured as shadow drafts: the one that
        came closest to paying."""
        return self.model.candidate if self.model.candidate > 1 else max(self.widths, default=1)

    def costs(self) -> dict[int, dict[int, float]]:
        """Each width's measured step cost over plain decoding's, by batch-size bucket."""
        out: dict[int, dict[int, float]] = {}
        for (w, b), cost in sorted(self.clock.table.items()):
            plain = self.clock.table.get((1, b))
            if w > 1 and plain:
                out.setdefault(w, {})[b] = cost / plain
        return out

    def summary(self) -> str:
        """One line for the engine's log: the calibration per request class, each width's measured
        step cost over a plain one per batch bucket, the steps chosen at each width so far, and the
        accepted tokens the verified steps were expected to bring against what they brought."""
        cal = ", ".join(f"{k} {self.model.calibration(k):.2f}"
                        for k in sorted(k for k in self.model.classes if isinstance(k, str))) or \
            f"{self.model.calibration():.2f}"
        costs = "; ".join(f"w{w}: " + ", ".join(f"{b}: {r:.2f}" for b, r in by.items())
                          for w, by in self.costs().items())
        chosen = ", ".join(f"w{w} {n}" for w, n in sorted(self.model.chosen.items()))
        return (f"calibration {cal}, step cost over plain by batch {{{costs}}}, steps chosen {{{chosen}}}, "
                f"verified steps expected {self.verified[0]:.0f} accepted tokens and got {self.verified[1]:.0f}")
