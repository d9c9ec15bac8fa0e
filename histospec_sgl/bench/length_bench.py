"""``histospec-sgl bench lengths``: response length predicted from history against the actual length on
rollout logs, as a rank correlation (Spearman), next to the no-history baseline (one mean for every
request: no order at all) and Seer's probe rule (a group's first finished sibling's length stands for
every sibling)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from histospec_sgl.length import LengthPredictor
from histospec_sgl.replay.data import preset_rows


def spearman(predicted: Sequence[float], actual: Sequence[float]) -> float:
    """Spearman's rank correlation (NaN when either side is constant: no order to compare)."""
    from scipy.stats import spearmanr

    p, a = np.asarray(predicted, float), np.asarray(actual, float)
    if len(p) < 2 or np.ptp(p) == 0 or np.ptp(a) == 0:
        return math.nan
    return float(spearmanr(p, a).statistic)


@dataclass(frozen=True)
class Response:
    """One logged response, as the evaluation needs it."""

    group: Hashable  # the prompt
    policy: Hashable  # run or checkpoint
    step: int | None
    length: int


def _by(rows: Iterable[Response], key) -> dict:
    out: dict = defaultdict(list)
    for r in rows:
        out[key(r)].append(r)
    return out


def _probe(members: Sequence[Response]) -> float:
    """Seer's probe: the first sibling to finish (siblings start together) stands for all."""
    return float(min(m.length for m in members))


def evaluate(rows: Sequence[Response]) -> dict[str, dict]:
    """Spearman of predicted vs actual length per scenario, with the baselines, on ``rows``.

    Scenarios (each request is predicted before it starts unless said):
      - ``cross-epoch``: history is the same policy's responses to the prompt at its previous step;
      - ``cross-policy``: history is other policies' responses to the prompt at the same step;
      - ``cross-sample``: history is the other finished samples of its group (leave one out);
      - ``in-flight``: the group's samples start together; when half of them have finished, each
        running one is predicted from the finished ones, other policies' responses to the prompt
        at the same step (where the log has them) and its own progress.
    The probe baseline is the same in every scenario (it needs no history); the mean baseline is a
    constant, so its correlation is undefined (NaN: it gives the scheduler no order).

    Where a whole group is predicted before it starts (cross-epoch, cross-policy), ``longest`` also
    ranks groups by what length-first scheduling orders them by: the expected longest of the
    group's n samples (:meth:`LengthPredictor.longest`) against the group's actual longest, next to
    the probe (the group's first finished sibling).
    """
    mean_len = float(np.mean([r.length for r in rows])) if rows else 1.0
    groups = _by(rows, lambda r: (r.policy, r.step, r.group))
    out: dict[str, dict] = {}

    def report(name: str, cases: list[tuple[float, float, int]],
               longest: list[tuple[float, float, int]] | None = None) -> None:
        if not cases:
            return
        pred, probe, actual = zip(*cases)
        out[name] = {
            "requests": len(cases),
            "ours": spearman(pred, actual),
            "probe": spearman(probe, actual),
            "mean": spearman([mean_len] * len(actual), actual),
        }
        if longest:
            gp, gprobe, gmax = zip(*longest)
            out[name]["longest"] = {"groups": len(longest), "ours": spearman(gp, gmax),
                                    "probe": spearman(gprobe, gmax)}

    def group_case(pred: LengthPredictor, grp: Hashable, members: Sequence[Response]) -> tuple[float, float, int]:
        return pred.longest(grp, len(members)), _probe(members), max(m.length for m in members)

    # cross-epoch
    cases, longest = [], []
    by_prompt = _by(rows, lambda r: (r.policy, r.group))
    for (pol, grp), members in by_prompt.items():
        steps = sorted({m.step for m in members if m.step is not None})
        for s0, s1 in zip(steps, steps[1:]):
            pred = LengthPredictor(mean_len)
            for m in members:
                if m.step == s0:
                    pred.record(grp, m.length)
            later = groups[(pol, s1, grp)]
            cases += [(pred.predict(grp), _probe(later), m.length) for m in later]
            longest.append(group_case(pred, grp, later))
    report("cross-epoch", cases, longest)
    # cross-policy
    cases, longest = [], []
    by_step = _by(rows, lambda r: (r.group, r.step))
    for (grp, step), members in by_step.items():
        pols = {m.policy for m in members}
        if len(pols) < 2:
            continue
        for pol in sorted(pols, key=repr):
            pred = LengthPredictor(mean_len)
            for m in members:
                if m.policy != pol:
                    pred.record(grp, m.length)
            mine = groups[(pol, step, grp)]
            cases += [(pred.predict(grp), _probe(mine), m.length) for m in mine]
            longest.append(group_case(pred, grp, mine))
    report("cross-policy", cases, longest)
    # cross-sample and in-flight
    cases, flight = [], []
    for (_, _, grp), members in groups.items():  # noqa: B007 - the key names the group
        if len(members) < 2:
            continue
        probe = _probe(members)
        for i, m in enumerate(members):
            pred = LengthPredictor(mean_len)
            for j, o in enumerate(members):
                if j != i:
                    pred.record(grp, o.length)
            cases.append((pred.predict(grp), probe, m.length))
        t = int(np.median([m.length for m in members]))
        pred = LengthPredictor(mean_len)
        for m in members:
            if m.length <= t:
                pred.record(grp, m.length)
        for o in by_step.get((grp, members[0].step), ()):
            if o.policy != members[0].policy:
                pred.record(grp, o.length)
        flight += [(pred.predict(grp, progress=t), probe, m.length) for m in members if m.length > t]
    report("cross-sample", cases)
    report("in-flight", flight)
    return out


def lengths(presets: list[str], data_root: Path | None, tokenizer: Path | None) -> dict[str, Any]:
    """Spearman of predicted vs actual response length on each log, per scenario."""
    out: dict[str, Any] = {"logs": {}}
    for p in presets:
        rows = preset_rows(p, data_root, tokenizer)
        resp = [Response(r.group, r.policy, r.step, len(r.response_ids or ())) for r in rows]
        out["logs"][p] = {"responses": len(resp), "scenarios": evaluate(resp)}
    return out


def print_lengths(result: dict[str, Any]) -> None:
    from rich.table import Table

    from histospec_sgl.console import console

    def f(x: float) -> str:
        return "n/a (constant)" if isinstance(x, float) and math.isnan(x) else f"{x:.3f}"

    t = Table(title="response length from history: Spearman of predicted vs actual length")
    for c in ("log", "scenario", "requests", "history (ours)", "probe sibling (Seer)", "dataset mean", "groups",
              "group's longest: ours", "probe"):
        t.add_column(c, justify="left" if c in ("log", "scenario") else "right")
    for log, r in result["logs"].items():
        for sc, v in r["scenarios"].items():
            g = v.get("longest")
            t.add_row(log, sc, str(v["requests"]), f(v["ours"]), f(v["probe"]), f(v["mean"]),
                      *((str(g["groups"]), f(g["ours"]), f(g["probe"])) if g else ("", "", "")))
    console().print(t)
