"""A whole RL rollout step, offline: B prompts x n samples with their logged tokens and lengths on an
engine with a KV budget (at most ``max_running`` requests at once) and a step-cost profile, under
several policies side by side.

Per request and position, the acceptance comes from the real index drafting on the real tokens,
as in ``histospec-sgl replay``: the group's history is loaded, the group's samples advance together
one logged token at a time, and at each position a ``max(widths)``-node draft is grown; a width-w
draft is its w most probable nodes (the drafts grow best-first), accepted greedily against the
logged continuation. A group's samples draft from each other's tokens so far, as HISTORY's
in-flight siblings do (``StepSpec.siblings``; off, each request sees its history only).

Policies: ``baseline`` (first come first served, plain decoding: what slime does by default),
``history_fixed`` (HISTORY at a fixed width), ``history_cost_model`` (the width chosen each step by
the engine's own policy, :class:`~histospec_sgl.engine.costmodel.EngineControl`: it times the
simulated steps per width and batch bucket as it times the engine's, and calibrates by the verified
steps and by the drafts of plain steps, measured against the logged tokens), ``length_first`` (plain decoding, the groups
whose longest sample is expected to run longest first) and ``full`` (length first with the cost
model); ``length_first_oracle`` is the ceiling of length-first scheduling (every true length
known) and ``length_first_group_oracle`` the ceiling of ranking whole groups (every group's true
longest known), not policies. A step's groups may be spread over several engines (:func:`run_policies`).
Every figure is a simulation on the named profile; an analytic profile is labelled as such.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections import Counter, defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from histospec_sgl.engine.costmodel import EngineControl
from histospec_sgl.engine.draft import advance, tree_mask
from histospec_sgl.engine.feedback import Feedback, KnownShadow
from histospec_sgl.engine.plan import StepCounts, plan_step, width_promises
from histospec_sgl.engine.policy import Fixed, Profile, StepPolicy
from histospec_sgl.engine.remaining import remaining
from histospec_sgl.engine.remaining import room as cap_room
from histospec_sgl.length import Lengths, expected_longest
from histospec_sgl.replay.measure import Track, accept_greedy, replay
from histospec_sgl.replay.methods import Ours
from histospec_sgl.replay.scenarios import HISTORY_SOURCES, StepSpec, choose_groups, history_source
from histospec_sgl.simulate.prefill import PrefixCache, prefill_passes

POLICIES = ("baseline", "history_fixed", "history_cost_model", "length_first", "full")
#: Not a policy but its ceiling: length first with every request's true length known.
ORACLE = "length_first_oracle"
#: The ceiling of ranking groups, as the trainer adapters do: every sample of a group predicted at
#: the group's true longest, so the groups go longest first and a group's samples in submission order.
GROUP_ORACLE = "length_first_group_oracle"


@dataclass
class SimRequest:
    """One request of the step: its logged length, its group's history (earlier responses'
    lengths) and, per draft width, the tokens accepted and the tokens its draft promised at each
    position (index = response tokens generated so far). ``predicted``: the prediction of a request
    whose group has no known length (and the only one with ``siblings=False``)."""

    group: Hashable
    length: int
    prompt_len: int
    predicted: float = 0.0
    history: tuple[int, ...] = ()
    accepted: dict[int, np.ndarray] = field(default_factory=dict)
    promised: dict[int, np.ndarray] = field(default_factory=dict)
    #: The prompt's token ids, for the radix cache's prefix matches (:class:`PrefixCache`; empty: the
    #: prompt is known by its group alone).
    prompt: tuple[int, ...] = ()
    #: Its ``max_new_tokens`` (None: none), which bounds how long the engine expects it to run.
    cap: int | None = None


Traces = tuple[dict[int, np.ndarray], dict[int, np.ndarray]]


def draft_traces(history: Sequence[Sequence[int]], prompt: Sequence[int], response: Sequence[int],
                 widths: Sequence[int]) -> Traces:
    """Accepted and promised draft tokens at every position of ``response`` for each width, the
    index holding ``history`` (earlier responses to ``prompt``)."""
    return group_traces(history, prompt, [response], widths)[0]


def group_traces(history: Sequence[Sequence[int]], prompt: Sequence[int], responses: Sequence[Sequence[int]],
                 widths: Sequence[int], siblings: bool = True, cap: int | None = None) -> list[Traces]:
    """:func:`draft_traces` for a group's samples decoding together, as the engine runs them: the
    samples start at once and advance in lockstep, one logged token a step, through the replay's
    loop (:func:`~histospec_sgl.replay.measure.replay`) on the engine's drafter
    (:class:`~histospec_sgl.replay.methods.Ours` with each draft's path probabilities). With
    ``siblings`` each drafts from the others' tokens so far (and a sample that finished is history
    of the group, as the engine keeps it); without, each sees the history alone. A width-w draft is
    the full draft's w - 1 most probable nodes (the engine's narrowing), accepted greedily; with a
    ``cap`` (``max_new_tokens``), nodes past it promise nothing, as in the engine."""
    top = max(widths)
    out: list[Traces] = [({w: np.zeros(len(r), np.int32) for w in widths},
                          {w: np.zeros(len(r), np.float32) for w in widths}) for r in responses]

    def with_history() -> Ours:
        m = Ours(probs=True)
        m.reset(True, top)
        for h in history:
            m.add_history(list(prompt), list(h))
        return m

    tracks = [Track(k, list(prompt), list(r)) for k, r in enumerate(responses)]
    # One drafter for the group, or one per sample holding the history only.
    runs = [(with_history(), tracks)] if siblings else [(with_history(), [t]) for t in tracks]
    for method, group in runs:
        for steps in replay(method, group, top, every_position=True):
            for s in steps:
                accepted, promised = out[s.track.rid]
                p, (toks, parents, probs) = s.track.pos, s.draft
                # Nodes by probability (parents first among equals: a parent's index is smaller), and
                # their promise at each width, as the engine's drafter reads them (sampled requests).
                # Near its cap a node may lie past what the request can emit: only then the tree's depths
                # are needed (its mask), the draft's own nodes deeper than the room promising nothing.
                room = cap_room(None if cap is None else [cap], [p])
                if room is not None and room[0] >= len(toks) - 1:
                    room = None
                order, cum = width_promises(np.asarray(probs, np.float64)[None, :],
                                            None if room is None else tree_mask(parents, len(toks)), room=room)
                for w in widths:
                    keep = set((order[0, : w - 1] + 1).tolist())
                    promised[w][p] = cum[0, min(w - 1, cum.shape[1]) - 1] if cum.shape[1] else 0.0
                    # The nodes left out carry no token (-1), so the walk never enters them.
                    masked = [t if i in keep else -1 for i, t in enumerate(toks)]
                    accepted[w][p] = accept_greedy(masked, parents, s.track.truth, p)
    return out


@dataclass
class Outcome:
    makespan_s: float
    tail_s: float
    tokens_per_s: float
    steps: int
    finish_s: list[float]
    timeline: list[tuple[float, int, int, float]]  # (time, running batch, width, tokens per request-step)
    widths: dict[int, int]
    #: Prompt tokens prefilled (those no cached prefix covered), and the prefill passes.
    prefill_tokens: int = 0
    prefill_passes: int = 0

    def summary(self, baseline_tps: float) -> dict[str, Any]:
        return {
            "makespan_s": self.makespan_s,
            "tail_s": self.tail_s,
            "tokens_per_s": self.tokens_per_s,
            "ratio_vs_baseline": self.tokens_per_s / baseline_tps if baseline_tps else float("nan"),
            "steps": self.steps,
            "width_steps": {str(k): v for k, v in sorted(self.widths.items())},
        }


def run_step(reqs: Sequence[SimRequest], profile: Profile, max_running: int, *, length_first: bool,
             policy: StepPolicy | None = None, siblings: bool = True, overlap: bool = False,
             cache: PrefixCache | None = None, prefill_chunk: int | None = None) -> Outcome:
    """Simulates one rollout step. ``policy`` chooses each step's verify width, as it does in the
    engine (:mod:`histospec_sgl.engine.policy`; None: plain decoding). New requests join when slots free up, in
    submission order or, with ``length_first``, longest predicted first (ties: submission order).
    A group ends when its longest sample does, so a waiting request's prediction is the expected
    longest of its group's n samples (n: the group's requests in the step) drawn from the group's
    known lengths: its history and its siblings that finished in this step
    (:func:`~histospec_sgl.length.expected_longest`); ``predicted`` for a group with none.
    Without ``siblings``, ``predicted`` alone. A request's first token comes from its prefill, in
    the step it joins, before that step's decode forward (a step where every request has just joined
    is its prefill passes alone: nothing decodes in it): the prefill passes of the requests
    joining (:func:`prefill_passes`, at most ``prefill_chunk`` tokens a pass), each computing the
    prompt tokens no prefix in the radix cache covers (``cache``, updated as passes prefill; a fresh
    one, as after a weight update, if None), each pass priced by the profile as the step's
    ``prefill`` tokens. ``overlap``: as SGLang's overlap scheduler runs it, the step after a
    request's last one was launched before its end was known, so the request stays in that step's
    batch (its slot taken, its cost paid, nothing emitted) and its answer is out when that step ends."""
    if max_running < 1:
        raise ValueError(f"max_running must be >= 1, got {max_running}")
    policy = policy or Fixed(1)
    queue = list(range(len(reqs)))
    queue.reverse()  # pop() from the end: submission order
    sizes = Counter(r.group for r in reqs)
    finished: dict[Hashable, list[int]] = defaultdict(list)
    history = {r.group: r.history for r in reqs}

    def known_lengths(group: Hashable) -> list[int]:
        """The group's known lengths: its history's and its siblings' that finished in this step."""
        return [*history[group], *finished.get(group, ())]

    def predictions() -> dict[int, float]:
        if not siblings:
            return {i: reqs[i].predicted for i in queue}
        by_group: dict[Hashable, float] = {}
        for i in queue:
            r = reqs[i]
            if r.group not in by_group:
                known = known_lengths(r.group)
                by_group[r.group] = expected_longest(known, sizes[r.group]) if known else r.predicted
        return {i: by_group[reqs[i].group] for i in queue}

    # The policy is fed the simulated clock as the engine's worker feeds it the real one (a policy that
    # times nothing ignores it), and learns from the engine's own feedback (:class:`Feedback`:
    # promises calibrated per request class and width, every logged sample a sampled request;
    # verified steps; shadow drafts, known here from the log), through the engine's step plan.
    widest = max(policy.widths, default=1)
    feedback = Feedback(policy, widest)
    known: dict[Hashable, Lengths] = {}  # known_lengths by group, sorted; dropped when one finishes

    def group_lengths(group: Hashable) -> Lengths:
        lens = known.get(group)
        if lens is None:
            lens = known[group] = Lengths.of(known_lengths(group))
        return lens

    running: list[list[int]] = []  # [request index, tokens generated]
    lingering: list[int] = []  # under ``overlap``: requests that ended at the last step, in this one too
    t = 0.0
    finish: list[float] = []
    timeline: list[tuple[float, int, int, float]] = []
    counts = StepCounts()
    cache = PrefixCache() if cache is None else cache
    prefill_tokens = prefilled_passes = 0

    def settle(now: float) -> list[int]:
        """The step ending at ``now``: the lingering requests' answers are out, the requests that
        reached their length end (lingering one step more under ``overlap``); returns those."""
        finish.extend(now for _ in lingering)
        ended = []
        for entry in [e for e in running if e[1] >= reqs[e[0]].length]:
            running.remove(entry)
            feedback.finished(entry[0])
            if overlap:
                ended.append(entry[0])
            else:
                finish.append(now)
            finished[reqs[entry[0]].group].append(reqs[entry[0]].length)
            known.pop(reqs[entry[0]].group, None)
        return ended

    while queue or running or lingering:
        joining: list[SimRequest] = []
        if length_first and queue and len(running) + len(lingering) < max_running:
            # Longest predicted last (popped first); the sort is stable, so ties keep submission order.
            pred = predictions()
            queue.sort(key=lambda i: (pred[i], -i))
        while queue and len(running) + len(lingering) < max_running:
            i = queue.pop()
            running.append([i, 0])
            joining.append(reqs[i])
        passes = prefill_passes(joining, cache, prefill_chunk, overlap)  # none if none join
        prefill = sum(passes)
        prefill_tokens += prefill
        prefilled_passes += len(passes)
        bs = len(running) + len(lingering)
        context = (sum(reqs[i].prompt_len + pos for i, pos in running)
                   + sum(reqs[i].prompt_len + reqs[i].length for i in lingering)) / bs
        decoding = [(i, pos) for i, pos in running if pos > 0]
        if not decoding and not lingering:
            # Every request of the batch has just joined (the first batch, or one after the last
            # ended): SGLang runs their prefill passes alone, each request's first token comes from
            # its own, and no decode forward runs before the next step.
            policy.begin(t)
            t += sum(profile.step_s(bs, 1, context, p) - profile.step_s(bs, 1, context) for p in passes)
            for entry in running:
                entry[1] = advance(0, reqs[entry[0]].length)
                feedback.advanced(entry[0], range(entry[1]))
            timeline.append((t, bs, 1, 1.0))
            lingering = settle(t)
            continue
        klasses: list[str | None] = ["sampled"] * len(decoding)
        by_width = {w: np.array([reqs[i].promised[w][pos] for i, pos in decoding], np.float64)
                    for w in policy.widths if w > 1}
        # A sampled request's promise is positive exactly when the index drafted nodes for it.
        drafted = by_width[widest] > 0 if widest > 1 else np.zeros(len(decoding), dtype=bool)
        # How long each request has left, by its group's known lengths (its history and the siblings
        # that finished), as the engine's drafter reads them from its index.
        left = (np.array([remaining(group_lengths(reqs[i].group), pos, reqs[i].cap) for i, pos in decoding])
                if policy.reads_promises and not queue and len(decoding) > 1 else None)
        plan = plan_step(policy, feedback, by_width, klasses, drafted, [i for i, _ in decoding], batch=bs,
                         context=context, prefill=prefill, waiting=len(queue), remaining=left)
        w = plan.width
        # The step before this one ends now; this one's decode forward starts after the prompts
        # joining it are prefilled.
        decode_s = profile.step_s(bs, w, context)
        cost = decode_s + sum(profile.step_s(bs, w, context, p) - decode_s for p in passes)
        policy.begin(t)
        policy.decode_step(bs, w, t + cost - decode_s)
        t += cost
        counts.step(w, bs, waiting=len(queue))
        if decoding:
            feedback.drafted(w, plan.promises.tolist(), klasses,
                             cap_room([reqs[i].cap for i, _ in decoding], [pos for _, pos in decoding]))
            for b in plan.shadowed:
                # Each request's drafts at every width but the one verified, followed as shadow
                # drafts, their outcome known from the log.
                i, pos = decoding[b]
                follow = KnownShadow({m: float(reqs[i].promised[m][pos]) for m in plan.measured},
                                     {m: int(reqs[i].accepted[m][pos]) for m in plan.measured},
                                     plan.shadow if plan.shadow > 1 else None)
                feedback.shadow(i, follow, klasses[b], batch=len(klasses))
        emitted = 0
        accepted = []
        for entry in running:
            i, pos = entry
            r = reqs[i]
            acc = 0
            if pos > 0 and w > 1:
                acc = int(r.accepted[w][pos])
                accepted.append(acc)
            adv = advance(acc, r.length - pos)
            entry[1] += adv
            emitted += adv
            feedback.advanced(i, range(adv))
        if decoding:
            feedback.verified(accepted)  # a plain step's entry is taken and measures nothing
        timeline.append((t, bs, w, emitted / bs))
        lingering = settle(t)
    policy.begin(t)
    finish.sort()
    tokens = sum(r.length for r in reqs)
    makespan = finish[-1] if finish else 0.0
    return Outcome(makespan, _tail(finish), tokens / makespan if makespan else 0.0, counts.steps, finish, timeline,
                   counts.width_steps, prefill_tokens, prefilled_passes)


def engine_of(group: Hashable, engines: int) -> int:
    """The engine a group's requests go to: a stable hash of the group, as a router with consistent
    hashing on the group sends every sample of a prompt to one engine."""
    return zlib.crc32(repr(group).encode()) % engines


def combine(parts: Sequence[Outcome]) -> Outcome:
    """One step over several engines running side by side: it ends when the last engine does.
    Finish times are merged; the timeline is the engine that finishes last."""
    finish = sorted(t for o in parts for t in o.finish_s)
    n = len(finish)
    makespan = finish[-1] if n else 0.0
    tokens = sum(o.tokens_per_s * o.makespan_s for o in parts)
    widths: dict[int, int] = {}
    for o in parts:
        for w, k in o.widths.items():
            widths[w] = widths.get(w, 0) + k
    last = max(parts, key=lambda o: o.makespan_s)
    return Outcome(makespan, _tail(finish), tokens / makespan if makespan else 0.0, sum(o.steps for o in parts),
                   finish, last.timeline, widths, sum(o.prefill_tokens for o in parts),
                   sum(o.prefill_passes for o in parts))


def _tail(finish: Sequence[float]) -> float:
    """From the 90th-percentile finish to the last (``finish`` sorted)."""
    n = len(finish)
    return finish[-1] - finish[max(0, int(np.ceil(0.9 * n)) - 1)] if n else 0.0


def run_policies(reqs: Sequence[SimRequest], profile: Profile, max_running: int, widths: Sequence[int],
                 fixed_width: int, engines: int = 1) -> dict[str, Outcome]:
    """Every policy on the same step. With ``engines`` > 1 the step's groups are spread over that
    many engines (:func:`engine_of`), each with ``max_running`` slots and its own cost model, and
    the step ends when the last engine finishes."""
    if engines < 1:
        raise ValueError(f"engines must be >= 1, got {engines}")
    parts = [[r for r in reqs if engine_of(r.group, engines) == e] for e in range(engines)] if engines > 1 else [reqs]
    parts = [p for p in parts if p]
    runs = {
        "baseline": lambda rs: run_step(rs, profile, max_running, length_first=False),
        "history_fixed": lambda rs: run_step(rs, profile, max_running, length_first=False, policy=Fixed(fixed_width)),
        "history_cost_model": lambda rs: run_step(rs, profile, max_running, length_first=False,
                                                  policy=engine_control(widths)),
        "length_first": lambda rs: run_step(rs, profile, max_running, length_first=True),
        "full": lambda rs: run_step(rs, profile, max_running, length_first=True, policy=engine_control(widths)),
        ORACLE: lambda rs: run_step([dataclasses.replace(r, predicted=float(r.length)) for r in rs], profile,
                                    max_running, length_first=True, siblings=False),
        GROUP_ORACLE: lambda rs: run_step(_group_longest(rs), profile, max_running, length_first=True, siblings=False),
    }
    return {name: (fn(parts[0]) if len(parts) == 1 else combine([fn(p) for p in parts])) for name, fn in runs.items()}


def engine_control(widths: Sequence[int]) -> EngineControl:
    """The engine's step policy (:class:`~histospec_sgl.engine.costmodel.EngineControl`, the
    default ``HISTOSPEC_CONTROL=cost``) choosing among ``widths`` (and plain decoding), the widest
    its configured d: it measures the simulated steps' costs as the engine measures its own."""
    wide = sorted({w for w in widths if w > 1})
    if not wide:
        raise ValueError(f"the cost model needs a verify width above 1, got {list(widths)}")
    return EngineControl(wide[-1], widths=wide)


def _group_longest(reqs: Sequence[SimRequest]) -> list[SimRequest]:
    """The requests with each one predicted at its group's true longest length."""
    longest: dict[Hashable, int] = defaultdict(int)
    for r in reqs:
        longest[r.group] = max(longest[r.group], r.length)
    return [dataclasses.replace(r, predicted=float(longest[r.group])) for r in reqs]


def summarize(outcomes: dict[str, Outcome]) -> dict[str, dict[str, Any]]:
    base = outcomes["baseline"]
    out = {name: o.summary(base.tokens_per_s) for name, o in outcomes.items()}
    for name, o in outcomes.items():
        out[name]["makespan_change"] = o.makespan_s / base.makespan_s - 1 if base.makespan_s else 0.0
        out[name]["tail_change"] = o.tail_s / base.tail_s - 1 if base.tail_s else 0.0
    return out


#: A step counts as slower than the baseline's when its throughput is more than this share below.
SLOWER = 1e-3

#: The per-step figures :func:`aggregate` takes the median of.
AGGREGATED = ("makespan_s", "tail_s", "tokens_per_s", "ratio_vs_baseline", "makespan_change", "tail_change")


def aggregate(steps: Sequence[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Several simulated steps (each :func:`summarize`'s output) as one: per policy the median of
    each figure over the steps, and the range of the throughput ratio, the makespan and the tail
    changes (``*_range``: [min, max])."""
    out: dict[str, dict[str, Any]] = {}
    for name in steps[0]:
        per = [s[name] for s in steps]
        v: dict[str, Any] = {k: float(np.median([p[k] for p in per])) for k in AGGREGATED}
        for k in ("ratio_vs_baseline", "makespan_change", "tail_change"):
            v[f"{k}_range"] = [float(min(p[k] for p in per)), float(max(p[k] for p in per))]
        v["steps"] = int(np.median([p["steps"] for p in per]))
        v["width_steps"] = per[0]["width_steps"] if len(per) == 1 else {}
        v["slower_than_baseline_in"] = sum(p["ratio_vs_baseline"] < 1 - SLOWER for p in per)
        out[name] = v
    return out


# -- a step from the rollout logs -------------------------------------------------------------------


def build_step(rows: Sequence[Any], spec: StepSpec, widths: Sequence[int], progress: Any = None,
               ensure: Any = None) -> tuple[list[SimRequest], dict[str, Any]]:
    """A step of ``spec.groups`` groups from a log (:func:`choose_groups`),
    with every request's draft traces. ``ensure(rows)`` fills the token ids of the rows the step
    uses (rows of text logs)."""
    chosen = choose_groups(rows, spec)
    reqs: list[SimRequest] = []
    history_responses = 0
    for g in chosen:
        if ensure is not None:
            ensure([*g.samples, *g.history])
        history_responses += len(g.history)
        reqs += group_requests(g.key, g.samples[0].prompt_ids, [h.response_ids for h in g.history],
                               [m.response_ids for m in g.samples], widths, spec.siblings)
        if progress is not None:
            for _ in g.samples:
                progress()
    info = {"kind": spec.kind, "groups": spec.groups, "requests": len(reqs), "tokens": sum(r.length for r in reqs),
            "history_responses": history_responses,
            "history": _history_text(rows, spec),
            "siblings": spec.siblings,
            "sampled_by": sorted({str(g.policy) for g in chosen}), "seed": spec.seed}
    return reqs, info


def _history_text(rows: Sequence[Any], spec: StepSpec) -> str:
    source = history_source(rows)
    if source == "none" or not spec.history_policies:
        return HISTORY_SOURCES["none"]
    if source == "policies":
        return f"{spec.history_policies} other policies' responses to the prompt at the same step"
    return f"the prompt's responses at up to {spec.history_policies} of its earlier steps (epochs) in the log"


def group_requests(key: Hashable, prompt: Sequence[int], history: Sequence[Sequence[int]],
                   samples: Sequence[Sequence[int]], widths: Sequence[int], siblings: bool = True,
                   cap: int | None = None) -> list[SimRequest]:
    """A group's requests with their draft traces (:func:`group_traces`), asked for at most ``cap``
    tokens each."""
    lengths = tuple(len(h) for h in history)
    traces = group_traces(history, prompt, samples, widths, siblings=siblings, cap=cap)
    return [SimRequest(key, len(s), len(prompt), float(np.mean(lengths)) if lengths else 0.0, lengths, acc, prom,
                       tuple(prompt), cap)
            for s, (acc, prom) in zip(samples, traces)]


def plot_timeline(outcomes: dict[str, Outcome], path: str, title: str) -> None:
    """Running batch size and tokens per request-step over the step, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for name, o in outcomes.items():
        ts = [x[0] for x in o.timeline]
        a.plot(ts, [x[1] for x in o.timeline], label=name, lw=1)
        b.plot(ts, [x[3] for x in o.timeline], label=name, lw=0.8)
    a.set_ylabel("running requests")
    b.set_ylabel("tokens per request-step")
    b.set_xlabel("simulated time (s)")
    a.legend(fontsize=8)
    a.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
