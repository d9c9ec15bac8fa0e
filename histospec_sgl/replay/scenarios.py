"""Which responses are replayed, and what history each one sees.

Every scenario yields :class:`Case` objects: a set of responses decoded together (``replay`` are
measured, ``siblings`` decode alongside them but are not measured) over a history of finished
responses. :func:`choose_groups` draws a whole rollout step the same way (one policy's groups, other
policies' responses as history), for ``histospec-sgl simulate`` and ``bench engine --trace``.
Selection is seeded (``random.Random(seed)``), so the same command replays the same responses, and
``cold`` replays exactly the responses of the scenario it mirrors.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from histospec_sgl.replay.data import ReplayDataError, Rollout

SCENARIOS = ("cross-epoch", "cross-sample", "cross-sample-inflight", "cross-policy", "cold")


@dataclass
class Case:
    history: list[Rollout]
    replay: list[Rollout]
    siblings: list[Rollout] = field(default_factory=list)
    label: int | None = None  # the step/epoch the replayed responses come from (plots by step)
    # Would SGLang's online trie (global, wiped at every weight update) have seen this history?
    online_visible: bool = False


@dataclass(frozen=True)
class Selection:
    max_groups: int = 0  # 0 = every eligible group
    per_group: int = 2  # responses replayed per group (0 = all)
    history_size: int = 0  # cap on history responses per case (0 = all)
    history_policies: int = 0  # cross-policy: how many other policies form the history (0 = all)
    min_step: int | None = None
    seed: int = 0


def _buckets(rows: Sequence[Rollout], key: Callable[[Rollout], Any], *, in_log_order: bool = False
             ) -> dict[Any, list[Rollout]]:
    """``rows`` by ``key``; each bucket by (sample, source) unless ``in_log_order``."""
    out: dict[Any, list[Rollout]] = defaultdict(list)
    for r in rows:
        out[key(r)].append(r)
    if not in_log_order:
        for v in out.values():
            v.sort(key=lambda r: (r.sample, r.source))
    return out


def _answered(by_prompt_step: dict[Any, list[Rollout]], policies: int) -> dict[Any, list[Any]]:
    """The (prompt, step) keys that ``policies`` or more policies answered, in key order, each with
    its policies (sorted): the prompts whose step has other policies' responses as history."""
    out = {}
    for key, members in sorted(by_prompt_step.items(), key=lambda kv: repr(kv[0])):
        pols = sorted({m.policy for m in members}, key=repr)
        if len(pols) >= policies:
            out[key] = pols
    return out


def _pick_keys(keys: list, sel: Selection, rng: random.Random) -> list:
    keys = sorted(keys, key=repr)
    if sel.max_groups and len(keys) > sel.max_groups:
        keys = sorted(rng.sample(keys, sel.max_groups), key=repr)
    return keys


def _choose(members: list[Rollout], n: int, rng: random.Random) -> list[Rollout]:
    if n <= 0 or n >= len(members):
        return list(members)
    idx = sorted(rng.sample(range(len(members)), n))
    return [members[i] for i in idx]


def _step_ok(r: Rollout, sel: Selection) -> bool:
    return sel.min_step is None or (r.step is not None and r.step >= sel.min_step)


def _sample_groups(rows: Sequence[Rollout], sel: Selection, rng: random.Random):
    """(members, chosen) per (policy, step, group) bucket with at least two responses."""
    b = _buckets([r for r in rows if _step_ok(r, sel)], lambda r: (r.policy, r.step, r.group))
    eligible = [k for k, v in b.items() if len(v) >= 2]
    if not eligible:
        raise ReplayDataError("no group has two or more responses from one policy at one step: nothing to replay")
    for k in _pick_keys(eligible, sel, rng):
        members = b[k]
        yield members, _choose(members, sel.per_group, rng)


def cross_sample(rows: Sequence[Rollout], sel: Selection) -> list[Case]:
    """Leave-one-out: each chosen response replays over its group's other (finished) responses."""
    rng = random.Random(sel.seed)
    cases = []
    for members, chosen in _sample_groups(rows, sel, rng):
        for j in chosen:
            others = [m for m in members if m is not j]
            if sel.history_size:
                others = _choose(others, sel.history_size, rng)
            cases.append(Case(others, [j], label=j.step, online_visible=True))
    return cases


def cross_sample_inflight(rows: Sequence[Rollout], sel: Selection) -> list[Case]:
    """The group's samples decode together; the chosen ones (as in cross-sample) are measured."""
    rng = random.Random(sel.seed)
    cases = []
    for members, chosen in _sample_groups(rows, sel, rng):
        others = [m for m in members if all(m is not c for c in chosen)]
        if sel.history_size:
            others = _choose(others, max(0, sel.history_size - len(chosen) + 1), rng)
        cases.append(Case([], chosen, others, label=chosen[0].step, online_visible=True))
    return cases


def cross_epoch(rows: Sequence[Rollout], sel: Selection) -> list[Case]:
    """History: a group's responses at an earlier step of the same policy; replay: the later step."""
    if any(r.step is None for r in rows):
        raise ReplayDataError("cross-epoch needs a step/epoch field (--step-field)")
    rng = random.Random(sel.seed)
    b = _buckets(rows, lambda r: (r.policy, r.group))
    pairs = []
    for k, v in b.items():
        steps = sorted({r.step for r in v})  # type: ignore[type-var]
        pairs += [(k, s0, s1) for s0, s1 in zip(steps, steps[1:])]
    if not pairs:
        raise ReplayDataError("no group was sampled at two steps by one policy: cross-epoch has nothing to replay")
    cases = []
    for k, s0, s1 in _pick_keys(pairs, sel, rng):
        hist = [r for r in b[k] if r.step == s0]
        later = [r for r in b[k] if r.step == s1]
        if sel.history_size:
            hist = _choose(hist, sel.history_size, rng)
        cases += [Case(hist, [r], label=s1) for r in later]
    return cases


def cross_policy(rows: Sequence[Rollout], sel: Selection) -> list[Case]:
    """History: other policies' responses to the same prompt at the same step."""
    rng = random.Random(sel.seed)
    b = _buckets([r for r in rows if _step_ok(r, sel)], lambda r: (r.group, r.step))
    eligible = list(_answered(b, 2))
    if not eligible:
        raise ReplayDataError(
            "no prompt was answered by two policies at one step: cross-policy needs a policy field (--policy-field)"
        )
    cases = []
    for k in _pick_keys(eligible, sel, rng):
        by_pol = _buckets(b[k], lambda r: r.policy)
        pols = sorted(by_pol)
        target = rng.choice(pols)
        others = [p for p in pols if p != target]
        if sel.history_policies:
            others = sorted(rng.sample(others, min(sel.history_policies, len(others))))
        hist = [r for p in others for r in by_pol[p]]
        if sel.history_size:
            hist = _choose(hist, sel.history_size, rng)
        cases += [Case(hist, [r], label=k[1]) for r in _choose(by_pol[target], sel.per_group, rng)]
    return cases


# -- a rollout step drawn from a log (the simulator and trace mode) --------------------------------


#: How a simulated step's groups are drawn from a log (``StepSpec.kind``).
STEP_KINDS = ("one-policy", "mixed")


@dataclass(frozen=True)
class StepSpec:
    """``one-policy``: the groups are ``groups`` consecutive logged steps of one policy (a run logs
    a prompt's samples per step), so one policy answers every prompt, as in a trainer's step;
    ``mixed``: each group's policy is drawn at random (policies that differ in how long they answer
    share the step). ``siblings``: a group's samples draft from each other while they decode
    (:func:`histospec_sgl.simulate.step.group_traces`), as HISTORY does; off, from the history alone.
    ``history_policies``: how many other policies (a log of several) or earlier steps of the prompt
    (a log of one policy, with steps) give the group's history (:func:`history_source`)."""

    groups: int = 32
    history_policies: int = 2
    seed: int = 0
    kind: str = "one-policy"
    siblings: bool = True
    per_group: int = 0  # samples per group (0: all the log has)


@dataclass
class ChosenGroup:
    """One group of a step drawn from a log: ``samples``, one policy's responses to a prompt at a
    logged step (by sample index), and ``history``, the same prompt's responses from other policies
    at that step."""

    key: tuple[Any, Any]
    policy: Any
    samples: list[Any]
    history: list[Any]


#: Where a drawn group's history comes from (:func:`history_source`).
HISTORY_SOURCES = {
    "policies": "other policies' responses to the prompt at the same step",
    "earlier steps": "the prompt's responses at its earlier steps (epochs) in the log",
    "none": "none (the log has one policy and no earlier step of a prompt): siblings only",
}


def history_source(rows: Sequence[Rollout]) -> str:
    """``policies`` for a log of several policies (the presets), else ``earlier steps`` when some
    prompt was sampled at more than one step, else ``none``."""
    if len({r.policy for r in rows}) > 1:
        return "policies"
    steps: dict[Any, set] = defaultdict(set)
    for r in rows:
        if r.step is not None:
            steps[r.group].add(r.step)
    return "earlier steps" if any(len(v) > 1 for v in steps.values()) else "none"


def _choose_across_steps(rows: Sequence[Rollout], spec: StepSpec) -> list[ChosenGroup]:
    """A step from a log of one policy: each group is a prompt's samples at one logged step, its
    history the prompt's responses at up to ``spec.history_policies`` of its latest earlier steps
    (what the epochs before gave). Groups that have such history are drawn first; a log without
    steps gives groups of siblings alone."""
    by_key = _buckets(rows, lambda r: (r.group, r.step), in_log_order=True)
    steps_of: dict[Any, list[Any]] = defaultdict(list)
    for grp, step in by_key:
        if step is not None:
            steps_of[grp].append(step)
    entries = []
    for grp, step in sorted(by_key, key=lambda k: (k[1] if k[1] is not None else -1, repr(k[0]))):
        earlier = sorted(s for s in steps_of[grp] if step is not None and s < step)
        entries.append((grp, step, earlier[-spec.history_policies:] if spec.history_policies else []))
    with_history = [e for e in entries if e[2]]
    pool = with_history if len(with_history) >= spec.groups and spec.history_policies else entries
    if len(pool) < spec.groups:
        raise ValueError(f"the log has {len(pool)} prompt groups (a prompt at a step); asked for {spec.groups} "
                         "(--groups)")
    rng = random.Random(spec.seed)
    if spec.kind == "mixed":
        chosen = rng.sample(pool, spec.groups)
    else:  # consecutive groups in step order, as a trainer's step samples them
        first = rng.randrange(len(pool) - spec.groups + 1)
        chosen = pool[first:first + spec.groups]
    out = []
    for grp, step, earlier in chosen:
        samples = sorted(by_key[(grp, step)], key=lambda m: m.sample)
        out.append(ChosenGroup((grp, step), samples[0].policy, samples[:spec.per_group or None],
                               [m for s in earlier for m in by_key[(grp, s)]]))
    return out


def choose_groups(rows: Sequence[Rollout], spec: StepSpec) -> list[ChosenGroup]:
    """The ``spec.groups`` groups of a step from a log (``Rollout`` rows). A log of one policy:
    :func:`_choose_across_steps`. A log with several policies:
    each group is one policy's samples of one prompt at one logged step, its history the same
    prompt's responses from ``spec.history_policies`` other policies at that step (the responses
    an earlier epoch of a closely related policy gives). ``spec.kind`` says how the groups are
    drawn (:class:`StepSpec`). The same ``spec`` draws the same groups, for the simulator and for
    ``bench engine --trace``."""
    if spec.kind not in STEP_KINDS:
        raise ValueError(f"unknown step kind {spec.kind!r}; choose from {', '.join(STEP_KINDS)}")
    if history_source(rows) != "policies":
        return _choose_across_steps(rows, spec)
    by_key = _buckets(rows, lambda r: (r.group, r.step), in_log_order=True)
    # The policies of each (prompt, step) that has enough other policies' responses at that step.
    policies = _answered(by_key, 1 + spec.history_policies)
    eligible = [(grp, step, pol) for (grp, step), pols in policies.items() for pol in pols]
    rng = random.Random(spec.seed)
    if spec.kind == "mixed":
        if len(policies) < spec.groups:
            raise ValueError(f"only {len(policies)} prompts have {spec.history_policies} other policies' "
                             f"responses at their step; asked for {spec.groups} groups")
        chosen = [(g, s, rng.choice(policies[(g, s)])) for g, s in rng.sample(list(policies), spec.groups)]
    else:
        by_policy: dict[Any, list[tuple[Any, Any, Any]]] = defaultdict(list)
        for e in eligible:
            by_policy[e[2]].append(e)
        runs = sorted((p for p, es in by_policy.items() if len(es) >= spec.groups), key=repr)
        if not runs:
            raise ValueError(f"no policy has {spec.groups} prompts with {spec.history_policies} other policies' "
                             "responses at their step; ask for fewer groups or --step-kind mixed")
        run = rng.choice(runs)
        entries = sorted(by_policy[run], key=lambda e: (e[1] if e[1] is not None else -1, repr(e[0])))
        first = rng.randrange(len(entries) - spec.groups + 1)
        chosen = entries[first:first + spec.groups]
    out = []
    for grp, step, target in chosen:
        members = by_key[(grp, step)]
        others = rng.sample(sorted({m.policy for m in members if m.policy != target}, key=repr),
                            spec.history_policies)
        out.append(ChosenGroup((grp, step), target, sorted((m for m in members if m.policy == target),
                                                           key=lambda m: m.sample)[:spec.per_group or None],
                               [m for m in members if m.policy in others]))
    return out


BUILDERS = {
    "cross-sample": cross_sample,
    "cross-sample-inflight": cross_sample_inflight,
    "cross-epoch": cross_epoch,
    "cross-policy": cross_policy,
}


def build_cases(rows: Sequence[Rollout], scenario: str, sel: Selection, cold_mirrors: str = "cross-sample") -> list[Case]:
    if scenario == "cold":
        base = BUILDERS[cold_mirrors](rows, sel)
        return [Case([], c.replay, [], c.label) for c in base]
    if scenario not in BUILDERS:
        raise ReplayDataError(f"unknown scenario {scenario!r}; choose from {', '.join(SCENARIOS)}")
    return BUILDERS[scenario](rows, sel)
