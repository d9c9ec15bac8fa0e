"""A whole RL rollout step, offline: B prompts x n samples with their logged tokens and lengths on an
engine with a KV budget (at most ``max_running`` requests at once) and a step-cost profile, under
several policies side by side.

Per request and position, the acceptance comes from the real index drafting on the real tokens,
as in ``histospec-sgl replay``: the request's group history is loaded, the request advances one
logged token at a time, and at each position a ``max(widths)``-node draft is grown; a width-w
draft is its w most probable nodes (the drafts grow best-first), accepted greedily against the
logged continuation. In-flight siblings are not drafted from (each request sees its history
only), so the acceptance is what cross-epoch history alone gives.

Policies: ``baseline`` (first come first served, plain decoding: what slime does by default),
``history_fixed`` (HISTORY at a fixed width), ``history_cost_model`` (the width chosen each step by
:class:`~histospec_sgl.control.costmodel.CostModel`), ``length_first`` (longest predicted first,
plain decoding) and ``full`` (length first with the cost model); ``length_first_oracle`` is the
ceiling of length-first scheduling (every true length known), not a policy. Every figure is a
simulation on the named profile; an analytic profile is labelled as such.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from histospec_sgl.control.costmodel import CostModel
from histospec_sgl.control.length import LengthPredictor
from histospec_sgl.control.profile import Profile

POLICIES = ("baseline", "history_fixed", "history_cost_model", "length_first", "full")
#: Not a policy but its ceiling: length first with every request's true length known.
ORACLE = "length_first_oracle"


@dataclass
class SimRequest:
    """One request of the step: its logged length and, per draft width, the tokens accepted and
    the tokens its draft promised at each position (index = response tokens generated so far)."""

    group: Hashable
    length: int
    prompt_len: int
    predicted: float = 0.0
    accepted: dict[int, np.ndarray] = field(default_factory=dict)
    promised: dict[int, np.ndarray] = field(default_factory=dict)


def draft_traces(history: Sequence[Sequence[int]], prompt: Sequence[int], response: Sequence[int],
                 widths: Sequence[int]) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """Accepted and promised draft tokens at every position of ``response`` for each width, the
    index holding ``history`` (earlier responses to ``prompt``)."""
    from histospec_sgl import HistoryIndex

    top = max(widths)
    n = len(response)
    accepted = {w: np.zeros(n, np.int32) for w in widths}
    promised = {w: np.zeros(n, np.float32) for w in widths}
    ix = HistoryIndex()
    for h in history:
        ix.add_response(0, list(prompt), list(h), 0)
    ix.begin_request(1, 0, list(prompt))
    if n:
        ix.extend_request(1, [response[0]])
    for p in range(1, n):
        toks, parents, probs = ix.draft(1, top)
        # Nodes by probability (parents first among equals: a parent's index is smaller).
        order = sorted(range(1, len(toks)), key=lambda i: (-probs[i], i))
        for w in widths:
            keep = set(order[: w - 1])
            promised[w][p] = sum(probs[i] for i in keep)
            cur, acc = 0, 0
            while p + acc < n:
                nxt = next((i for i in keep if parents[i] == cur and toks[i] == response[p + acc]), None)
                if nxt is None:
                    break
                cur, acc = nxt, acc + 1
            accepted[w][p] = acc
        ix.extend_request(1, [response[p]])
    return accepted, promised


@dataclass
class Outcome:
    makespan_s: float
    tail_s: float
    tokens_per_s: float
    steps: int
    finish_s: list[float]
    timeline: list[tuple[float, int, int, float]]  # (time, running batch, width, tokens per request-step)
    widths: dict[int, int]

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
             width: int | None = None, cost_model: CostModel | None = None, siblings: bool = True) -> Outcome:
    """Simulates one rollout step. ``width``: a fixed verify width (None or 1: plain decoding);
    ``cost_model``: choose the width each step instead. New requests join when slots free up, in
    submission order or, with ``length_first``, longest predicted first (ties: submission order).
    A waiting request's prediction is its group's history mean (``predicted``) shrunk towards the
    lengths of its siblings that finished in this step: ``(predicted + sum) / (1 + count)``, so
    the history counts as one sibling's worth (it comes from related policies, the siblings from
    this one); without ``siblings``, ``predicted`` alone. A request's first token comes from its
    prefill, in the step it joins."""
    if max_running < 1:
        raise ValueError(f"max_running must be >= 1, got {max_running}")
    queue = list(range(len(reqs)))
    queue.reverse()  # pop() from the end: submission order
    finished_sum: dict[Hashable, float] = {}
    finished_n: dict[Hashable, int] = {}

    def predicted(i: int) -> float:
        if not siblings:
            return reqs[i].predicted
        g = reqs[i].group
        return (reqs[i].predicted + finished_sum.get(g, 0.0)) / (1 + finished_n.get(g, 0))

    running: list[list[int]] = []  # [request index, tokens generated]
    t, steps = 0.0, 0
    finish: list[float] = []
    timeline: list[tuple[float, int, int, float]] = []
    used: dict[int, int] = {}
    while queue or running:
        prefill = 0
        if length_first and queue and len(running) < max_running:
            # Longest predicted last (popped first); the sort is stable, so ties keep submission order.
            queue.sort(key=lambda i: (predicted(i), -i))
        while queue and len(running) < max_running:
            i = queue.pop()
            running.append([i, 0])
            prefill += reqs[i].prompt_len
        bs = len(running)
        context = sum(reqs[i].prompt_len + pos for i, pos in running) / bs
        decoding = [(i, pos) for i, pos in running if pos > 0]
        if cost_model is not None:
            widths = [w for w in cost_model.widths if w > 1]
            promised = {w: float(sum(reqs[i].promised[w][pos] for i, pos in decoding)) for w in widths}
            w = cost_model.choose(promised, bs, context, prefill)
        else:
            w = width or 1
        steps += 1
        t += profile.step_s(bs, w, context, prefill)
        used[w] = used.get(w, 0) + 1
        emitted = 0
        got = promised_now = 0.0
        for entry in running:
            i, pos = entry
            r = reqs[i]
            adv = 1
            if pos > 0 and w > 1:
                acc = int(r.accepted[w][pos])
                adv += acc
                got += acc
                promised_now += float(r.promised[w][pos])
            adv = min(adv, r.length - pos)
            entry[1] += adv
            emitted += adv
        if cost_model is not None and w > 1:
            cost_model.observe(promised_now, got)
        timeline.append((t, bs, w, emitted / bs))
        for entry in [e for e in running if e[1] >= reqs[e[0]].length]:
            running.remove(entry)
            finish.append(t)
            g = reqs[entry[0]].group
            finished_sum[g] = finished_sum.get(g, 0.0) + reqs[entry[0]].length
            finished_n[g] = finished_n.get(g, 0) + 1
    finish.sort()
    n = len(finish)
    tail = finish[-1] - finish[max(0, int(np.ceil(0.9 * n)) - 1)] if n else 0.0
    tokens = sum(r.length for r in reqs)
    makespan = finish[-1] if n else 0.0
    return Outcome(makespan, tail, tokens / makespan if makespan else 0.0, steps, finish, timeline, used)


def run_policies(reqs: Sequence[SimRequest], profile: Profile, max_running: int, widths: Sequence[int],
                 fixed_width: int) -> dict[str, Outcome]:
    """Every policy on the same step."""
    return {
        "baseline": run_step(reqs, profile, max_running, length_first=False),
        "history_fixed": run_step(reqs, profile, max_running, length_first=False, width=fixed_width),
        "history_cost_model": run_step(reqs, profile, max_running, length_first=False,
                                       cost_model=CostModel(profile, widths)),
        "length_first": run_step(reqs, profile, max_running, length_first=True),
        "full": run_step(reqs, profile, max_running, length_first=True, cost_model=CostModel(profile, widths)),
        ORACLE: run_step([dataclasses.replace(r, predicted=float(r.length)) for r in reqs], profile, max_running,
                         length_first=True, siblings=False),
    }


def summarize(outcomes: dict[str, Outcome]) -> dict[str, dict[str, Any]]:
    base = outcomes["baseline"].tokens_per_s
    return {name: o.summary(base) for name, o in outcomes.items()}


# -- a step from the rollout logs -------------------------------------------------------------------


@dataclass(frozen=True)
class StepSpec:
    groups: int = 32
    history_policies: int = 2
    seed: int = 0


def build_step(rows: Sequence[Any], spec: StepSpec, widths: Sequence[int], progress: Any = None,
               ensure: Any = None) -> tuple[list[SimRequest], dict[str, Any]]:
    """A step of ``spec.groups`` groups from a log with several policies (``Rollout`` rows with
    token ids): each group is one policy's samples of one prompt at one step, its history the same
    prompt's responses from ``spec.history_policies`` other policies at that step (the responses
    an earlier epoch of a closely related policy gives). Lengths are predicted from the history.
    ``ensure(rows)`` fills the token ids of the rows the step uses (rows of text logs)."""
    from collections import defaultdict

    by_key: dict[Any, list[Any]] = defaultdict(list)
    for r in rows:
        by_key[(r.group, r.step)].append(r)
    candidates = []
    for (grp, step), members in by_key.items():
        pols = sorted({m.policy for m in members}, key=repr)
        if len(pols) < 1 + spec.history_policies:
            continue
        candidates.append((grp, step, pols))
    if len(candidates) < spec.groups:
        raise ValueError(f"only {len(candidates)} prompts have {spec.history_policies} other policies' "
                         f"responses at their step; asked for {spec.groups} groups")
    rng = random.Random(spec.seed)
    chosen = rng.sample(sorted(candidates, key=repr), spec.groups)
    reqs: list[SimRequest] = []
    history_responses = 0
    for grp, step, pols in chosen:
        target = rng.choice(pols)
        others = rng.sample([p for p in pols if p != target], spec.history_policies)
        members = by_key[(grp, step)]
        mine = sorted((m for m in members if m.policy == target), key=lambda m: m.sample)
        hist = [m for m in members if m.policy in others]
        if ensure is not None:
            ensure([*mine, *hist])
        history_responses += len(hist)
        predictor = LengthPredictor()
        for h in hist:
            predictor.record(grp, len(h.response_ids))
        for m in mine:
            acc, prom = draft_traces([h.response_ids for h in hist], m.prompt_ids, m.response_ids, widths)
            reqs.append(SimRequest(grp, len(m.response_ids), len(m.prompt_ids), predictor.predict(grp), acc, prom))
            if progress is not None:
                progress()
    info = {"groups": spec.groups, "requests": len(reqs), "history_responses": history_responses,
            "history": f"{spec.history_policies} other policies' responses to the prompt at the same step",
            "seed": spec.seed}
    return reqs, info


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
