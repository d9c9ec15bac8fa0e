"""``histospec-sgl simulate`` and ``histospec-sgl bench lengths``: loading the logs, running, tables."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from histospec_sgl.control import length, simulate
from histospec_sgl.control.profile import resolve
from histospec_sgl.replay.data import (
    PRESETS,
    ReplayDataError,
    Tokenization,
    default_tokenizer,
    load_rollouts,
    preset_path,
)

#: Logs with several policies per prompt and step, as a simulated step's history needs.
SIMULATE_PRESETS = ("grpo", "ei")


def _rows(preset: str, data_root: Path | None, tokenizer: Path | None, tokenize: bool = True) -> list[Any]:
    if preset not in PRESETS:
        raise ReplayDataError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    pre = PRESETS[preset]
    rows = load_rollouts(preset_path(pre, data_root), pre.fields)
    if tokenize and not pre.fields.token_ids:
        Tokenization(tokenizer or default_tokenizer()).ensure(rows)
    return rows


def lengths(presets: list[str], data_root: Path | None, tokenizer: Path | None) -> dict[str, Any]:
    """Spearman of predicted vs actual response length on each log, per scenario."""
    out: dict[str, Any] = {"logs": {}}
    for p in presets:
        rows = _rows(p, data_root, tokenizer)
        resp = [length.Response(r.group, r.policy, r.step, len(r.response_ids)) for r in rows]
        out["logs"][p] = {"responses": len(resp), "scenarios": length.evaluate(resp)}
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


def run(preset: str, data_root: Path | None, tokenizer: Path | None, profile_name: str, groups: int,
        max_running: list[int], widths: list[int], fixed_width: int, history_policies: int, seed: int,
        plot: str | None = None, steps: int = 5, engines: int = 1, kind: str = "one-policy",
        siblings: bool = True) -> dict[str, Any]:
    """Simulates ``steps`` rollout steps (seeds ``seed``, ``seed + 1``, ...) under every policy, at
    each KV budget in ``max_running``; figures are medians over the steps, with their ranges."""
    if preset not in SIMULATE_PRESETS:
        raise ReplayDataError(f"simulate needs a log with several policies per prompt: {', '.join(SIMULATE_PRESETS)}")
    if fixed_width not in widths:
        raise ValueError(f"--fixed-width {fixed_width} is not one of --widths {widths}")
    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    if engines < 1:
        raise ValueError(f"--engines must be >= 1, got {engines}")
    profile = resolve(profile_name)
    rows = _rows(preset, data_root, tokenizer, tokenize=False)  # only the step's rows are tokenized
    tok = Tokenization(tokenizer or default_tokenizer())
    built = [simulate.build_step(rows, simulate.StepSpec(groups, history_policies, seed + k, kind, siblings), widths,
                                 ensure=tok.ensure) for k in range(steps)]
    sweep = []
    first: dict[str, simulate.Outcome] | None = None
    for r in max_running:
        per_step = []
        for reqs, _ in built:
            outcomes = simulate.run_policies(reqs, profile, r, widths, fixed_width, engines)
            first = first or outcomes
            per_step.append(simulate.summarize(outcomes))
        sweep.append({"max_running": r, "policies": simulate.aggregate(per_step),
                      "per_step": [{name: {k: v[k] for k in simulate.AGGREGATED} for name, v in s.items()}
                                   for s in per_step]})
    assert first is not None
    infos = [info for _, info in built]
    result = {
        "profile": profile.name,
        "analytic": profile.analytic,
        "profile_description": profile.description,
        "preset": preset,
        "step": {"kind": kind, "groups": groups, "steps": steps, "engines": engines, "siblings": siblings,
                 "requests": infos[0]["requests"], "history": infos[0]["history"],
                 "max_running": max_running[0], "widths": widths, "fixed_width": fixed_width,
                 "built": infos},
        "policies": sweep[0]["policies"],
        "sweep": sweep,
    }
    if plot:
        Path(plot).parent.mkdir(parents=True, exist_ok=True)
        label = "ANALYTIC profile" if profile.analytic else "measured profile"
        simulate.plot_timeline(first, plot, f"simulated step 1 of {steps} ({label}: {profile.name}), {infos[0]['requests']} "
                                            f"requests, at most {max_running[0]} running"
                                            + (f" on each of {engines} engines (the last to finish)" if engines > 1 else ""))
    return result


def print_simulation(result: dict[str, Any]) -> None:
    from rich.table import Table

    from histospec_sgl.console import console

    kind = "ANALYTIC (not measured)" if result["analytic"] else "measured"
    st = result["step"]
    where = f", {st['engines']} engines" if st["engines"] > 1 else ""

    def pct(v: float) -> str:
        return f"{100 * v:+.0f}%"

    for s in result["sweep"]:
        t = Table(title=f"simulated rollout step: profile {result['profile']} ({kind}), {st['requests']} requests "
                        f"({st['kind']}){where}, at most {s['max_running']} running; median of {st['steps']} steps "
                        "[range]")
        for c in ("policy", "makespan s", "tail s (last 10%)", "tokens/s", "vs baseline", "makespan", "tail",
                  "slower steps"):
            t.add_column(c, justify="left" if c == "policy" else "right")
        for name, v in s["policies"].items():
            lo, hi = v["ratio_vs_baseline_range"]
            mlo, mhi = v["makespan_change_range"]
            tlo, thi = v["tail_change_range"]
            t.add_row(name, f"{v['makespan_s']:.2f}", f"{v['tail_s']:.2f}", f"{v['tokens_per_s']:.0f}",
                      f"{v['ratio_vs_baseline']:.2f}x [{lo:.2f}-{hi:.2f}]",
                      f"{pct(v['makespan_change'])} [{pct(mlo)}, {pct(mhi)}]",
                      f"{pct(v['tail_change'])} [{pct(tlo)}, {pct(thi)}]",
                      f"{v['slower_than_baseline_in']}/{st['steps']}")
        console().print(t)
