"""Which responses are replayed, and what history each one sees.

Every scenario yields :class:`Case` objects: a set of responses decoded together (``replay`` are
measured, ``siblings`` decode alongside them but are not measured) over a history of finished
responses. Selection is seeded (``random.Random(seed)``), so the same command replays the same
responses, and ``cold`` replays exactly the responses of the scenario it mirrors.
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


def _buckets(rows: Sequence[Rollout], key: Callable[[Rollout], Any]) -> dict[Any, list[Rollout]]:
    out: dict[Any, list[Rollout]] = defaultdict(list)
    for r in rows:
        out[key(r)].append(r)
    for v in out.values():
        v.sort(key=lambda r: (r.sample, r.source))
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
    eligible = [k for k, v in b.items() if len({r.policy for r in v}) >= 2]
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
