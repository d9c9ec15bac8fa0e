"""``histospec-sgl simulate``: loading the logs, running whole rollout steps, tables; ``--check``
against a trace-mode ``bench engine`` result."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from histospec_sgl.replay.data import (
    FieldMap,
    ReplayDataError,
    Tokenization,
    default_tokenizer,
    load_rollouts,
    preset_rows,
)
from histospec_sgl.simulate import step as simulate
from histospec_sgl.simulate.prefill import PrefixCache
from histospec_sgl.simulate.profile import resolve


def run(preset: str | None, data_root: Path | None, tokenizer: Path | None, profile_name: str, groups: int,
        max_running: list[int], widths: list[int], fixed_width: int, history_policies: int, seed: int,
        plot: str | None = None, steps: int = 5, engines: int = 1, kind: str = "one-policy",
        siblings: bool = True, input: Path | None = None, fields: FieldMap | None = None,
        per_group: int = 0) -> dict[str, Any]:
    """Simulates ``steps`` rollout steps (seeds ``seed``, ``seed + 1``, ...) under every policy, at
    each KV budget in ``max_running``; figures are medians over the steps, with their ranges. The
    log is a preset (``preset``) or the user's own (``input`` with its ``fields``); a group's history
    is other policies' responses at the same step, or the prompt's earlier steps in a log of one
    policy (:func:`~histospec_sgl.replay.scenarios.history_source`)."""
    if (preset is None) == (input is None):
        raise ReplayDataError("give exactly one of --preset NAME or --input PATH")
    if input is not None and fields is None:
        raise ReplayDataError("--input needs --prompt-field and --response-field")
    if fixed_width not in widths:
        raise ValueError(f"--fixed-width {fixed_width} is not one of --widths {widths}")
    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    if engines < 1:
        raise ValueError(f"--engines must be >= 1, got {engines}")
    profile = resolve(profile_name)
    if per_group < 0:
        raise ValueError(f"--per-group must be >= 0, got {per_group}")
    # Only the step's rows are tokenized (a text log's), with the given tokenizer or the default.
    if input is not None:
        assert fields is not None
        rows = load_rollouts(input, fields)
    else:
        assert preset is not None
        rows = preset_rows(preset, data_root, tokenizer, tokenize=False)
    tok = Tokenization(tokenizer or default_tokenizer())
    built = [simulate.build_step(rows, simulate.StepSpec(groups, history_policies, seed + k, kind, siblings,
                                                         per_group), widths, ensure=tok.ensure)
             for k in range(steps)]
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
        "input": str(input) if input is not None else None,
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
        t.caption = f"a group's history: {st['built'][0]['history']}"
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


#: ``bench engine`` methods the simulator predicts, and how: a fixed verify width, or the cost model
#: (each also with a draft-token count of its own, ``history_d4``; overlap scheduler only): the
#: rows whose :func:`~histospec_sgl.simulate.profile.row_control` is one of these.
CHECKED = ("fixed", "cost")


def check(engine: dict[str, Any], data_root: Path | None = None) -> dict[str, Any]:
    """The simulator checked against a trace-mode ``bench engine`` result: a measured profile built
    from the result itself (the step costs the engine's clock measured,
    :func:`~histospec_sgl.simulate.profile.from_engine_clock`, as they stood at the end of the
    median run of the default policy's row of the batch size checked (its last run, in results
    that keep no run's clock), or else the rows' averages,
    :func:`~histospec_sgl.simulate.profile.from_engine_bench`; plain decoding by the plain server's
    own steps where trace mode timed them, a fixed width's by its own server's), the same
    logged step rebuilt with the model's tokenizer (:mod:`histospec_sgl.simulate.trace`), and
    each measured row re-run in the simulator as the engine ran it: its requests in order, in
    batches of the row's size one after the other, a group's earlier samples of the row its history
    beside the loaded one. Returns every row's predicted and measured speedup over plain decoding."""
    from histospec_sgl.simulate import trace as et
    from histospec_sgl.simulate.profile import (
        Measured,
        at_median_run,
        from_engine_bench,
        from_engine_clock,
        row_control,
        with_row_clock,
    )

    settings = engine.get("settings", {})
    if settings.get("mode") != "trace":
        raise ValueError("simulate --check needs a trace-mode bench engine result (bench engine --trace grpo)")
    # Each row priced by the clock its median run left, the run whose time the row reports: the
    # host drifts from run to run, and the last run's clock (the row's ``step_seconds``) may be
    # faster or slower than the run measured.
    engine = {**engine, "rows": [at_median_run(r) for r in engine["rows"]]}
    # The engine's own step clock where the result has it (the default policy's rows): a cost per
    # decode step at the batch running, every width it ran. Else the rows' averages.
    clock = from_engine_clock(engine)
    prof_json = clock or from_engine_bench(engine)
    profile = Measured.from_json(prof_json)
    tr = settings["trace"]
    spec = et.TraceSpec(tr["preset"], tr["groups"], tr["history_policies"], tr["seed"])
    groups = et.workload(spec, Path(engine["model"]["path"]), data_root)
    rebuilt = et.digest(groups)
    if "digest" in tr and rebuilt != tr["digest"]:
        raise ValueError(f"the log given ({data_root or 'the default data root'}) does not hold the step this result "
                         f"traced (digest {rebuilt}, the result's {tr['digest']}): pass --data-root the "
                         "folder bench engine --trace ran on")
    d = int(settings["draft_tokens"])
    cap = int(settings["max_new_tokens"])
    measured = {(r["method"], r["batch_size"], r["temperature"]): r for r in engine["rows"]}
    out = []
    # The engine's policy lives as long as the server, and the bench runs every row on one server
    # per method, temperature by temperature, batch sizes ascending: the policy of a row starts with
    # what the earlier rows taught it (the step costs of every batch bucket they ran, the
    # calibration of its promises), so the simulated one does too.
    from histospec_sgl.engine.costmodel import EngineControl

    # One policy per server: a method with its own draft-token count (``history_cost_d4``) has its own.
    controls: dict[str, EngineControl] = {}
    for (method, batch, temp), row in sorted(measured.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
        kind = row_control(row)
        if kind not in CHECKED or ("plain", batch, temp) not in measured:
            continue
        cost = kind == "cost"
        rd = int(row.get("draft_tokens") or d)  # the row's server's draft-token count
        if cost and method not in controls:
            controls[method] = EngineControl(rd)
        control = controls.get(method) if cost else None
        reqs = et.requests(groups, et.row_requests(batch, int(settings["sampled_requests"]),
                                                   int(tr.get("single_requests", et.SINGLE_REPEATS))))

        # The engine's clock prices each step at the batch then running. A row's average instead
        # is its wall time over the passes its longest request took, at the row's batch size:
        # every simulated step of the row costs that, however many of its requests are still
        # running (the interpolation to the running batch would count the tail's smaller batches
        # twice: the average already holds them).
        # The clock as it stood at the end of the default policy's row of this batch size (each
        # bucket's last timings then): a later row's tail would reprice this row's steps. A default
        # with a draft-token count of its own is priced by its own clock, a fixed row's verify
        # steps by its own server's.
        mine = method if cost else "history_cost"
        at_row = clock and from_engine_clock({**engine, "rows": [
            r for r in engine["rows"] if r["method"] == "plain"
            or (r["method"], r["batch_size"], r["temperature"]) == (mine, batch, temp)]})
        if at_row and not cost:
            at_row = with_row_clock(at_row, row, rd)
        row_profile = Measured.from_json(at_row) if at_row else profile if clock else AtBatch(profile, batch)
        plain_row = measured[("plain", batch, temp)]
        # Plain decoding by its own server's steps where the trace model timed them, as a fixed
        # row's verify steps are its server's (the default's plain steps run beside a draft policy).
        plain_profile = Measured.from_json(with_row_clock(at_row, plain_row, 1)) if at_row else row_profile
        base = _trace_row(groups, reqs, batch, cap, d, plain_profile, None, None, overlap(plain_row),
                          plain_row.get("prefill_chunk"))
        if control is not None:
            # The row's runs one after the other on the server's policy (the first run of the first
            # row explores and calibrates, later ones use what it learned), their median as the
            # bench reports it (with ``server_starts`` sets of servers, each set runs these again).
            runs = sorted((_trace_row(groups, reqs, batch, cap, rd, row_profile, None, control, overlap(row),
                                      row.get("prefill_chunk"))
                           for _ in range(max(1, int(settings.get("repeats", 1))))),
                          key=lambda run: run[:2])  # by time and steps (the width counts do not order)
            sim = runs[len(runs) // 2]
        else:
            sim = _trace_row(groups, reqs, batch, cap, rd, row_profile, rd, None, overlap(row),
                             row.get("prefill_chunk"))
        s, steps, used = sim.seconds, sim.steps, sim.used
        extra: dict[str, Any] = {"draft_tokens": rd} if rd != d else {}
        if control is not None:
            # Every fixed width the default chooses among, on the same clock and step: what it
            # chose against what it could have fixed, free of the host's drift between servers.
            extra["predicted_fixed_speedups"] = {
                str(w): round(base.seconds / _trace_row(groups, reqs, batch, cap, w, row_profile, w, None,
                                                        overlap(row), row.get("prefill_chunk")).seconds, 3)
                for w in control.widths}
        out.append({"method": method, "batch_size": batch, "temperature": temp, **extra,
                    "predicted_speedup": round(base.seconds / s, 3) if s else None,
                    "measured_speedup": row.get("vs_plain"),
                    # Each row's own time, simulated against the engine's wall time (a run's median):
                    # where the speedup misses, whether the HISTORY row or the plain one is mispriced.
                    "predicted_seconds": round(s, 3), "measured_seconds": row.get("wall_s"),
                    "predicted_plain_seconds": round(base.seconds, 3),
                    "measured_plain_seconds": plain_row.get("wall_s"),
                    "measured_tokens_per_step": row.get("tokens_per_step"),
                    "predicted_passes": steps, "measured_passes": round(1000 * row["wall_s"] / row["step_ms"]),
                    "predicted_plain_passes": base.steps,
                    # Prompt tokens the prefill passes computed (no cached prefix covered them), a
                    # run's, simulated and as SGLang reported them (None in results from before).
                    "predicted_prefill_tokens": sim.prefill_tokens,
                    "measured_prefill_tokens": _prefilled(row),
                    # Steps per verify width, simulated and as the engine ran them (all of its runs).
                    "predicted_width_steps": {str(w): n for w, n in sorted(used.items())},
                    "measured_width_steps": row.get("width_steps", {})})
    for c in out:
        p, m = c["predicted_speedup"], c["measured_speedup"]
        c["error"] = round(p / m - 1, 3) if p and m else None
        for k, (ps, ms) in {"time_error": ("predicted_seconds", "measured_seconds"),
                            "plain_time_error": ("predicted_plain_seconds", "measured_plain_seconds")}.items():
            c[k] = round(c[ps] / c[ms] - 1, 3) if c[ps] and c[ms] else None
    own_plain = clock and any(r["method"] == "plain" and r.get("step_seconds") for r in engine["rows"])
    return {"check": out, "profile": prof_json, "priced_by": "engine clock" if clock else "row averages",
            "plain_priced_by": "plain server's clock" if own_plain else "engine clock" if clock else "row averages",
            "trace": tr, "draft_tokens": d, "log_verified": "digest" in tr,
            "not_predicted": sorted({r["method"] for r in engine["rows"]
                                     if row_control(r) not in CHECKED} - {"plain", "plain_sync"})}


def _prefilled(row: dict[str, Any]) -> int | None:
    """The prompt tokens a measured row's prefill passes computed: its prompt tokens less those a
    cached prefix covered (SGLang's ``meta_info``), a run's median; None where not recorded."""
    if row.get("prompt_tokens") is None or row.get("cached_tokens") is None:
        return None
    return int(row["prompt_tokens"]) - int(row["cached_tokens"])


def overlap(row: dict[str, Any]) -> bool:
    """Whether a measured row's server ran SGLang's overlap scheduler (every row since it is recorded)."""
    return bool(row.get("overlap", False))


@dataclass(frozen=True)
class AtBatch:
    """A profile read at one batch size whatever the running batch (:func:`check`)."""

    profile: Any
    batch: int

    @property
    def name(self) -> str:
        return str(self.profile.name)

    @property
    def analytic(self) -> bool:
        return bool(self.profile.analytic)

    @property
    def description(self) -> str:
        return f"{self.profile.description}, at batch {self.batch}"

    def step_s(self, batch: int, width: int, context: float, prefill: int = 0) -> float:
        return float(self.profile.step_s(self.batch, width, context, prefill))


class RowRun(NamedTuple):
    """A simulated trace row (:func:`_trace_row`): its seconds, decode steps, tokens, steps per verify
    width, and the prompt tokens its prefill passes computed."""

    seconds: float
    steps: int
    tokens: int
    used: dict[int, int]
    prefill_tokens: int


def _trace_row(groups: list[Any], reqs: list[tuple[int, int]], batch: int, cap: int, d: int, profile: Any,
               width: int | None, control: Any, overlap_scheduler: bool = False,
               prefill_chunk: int | None = None) -> RowRun:
    """A trace row simulated under one policy (a fixed ``width``, the engine's default policy
    ``control`` at widths up to ``d``, or plain decoding): its requests in batches of ``batch`` one
    after the other, each group's samples of earlier batches in the row added to its history, as
    the engine keeps them (``control`` keeps its clock and calibration over the row's batches, as
    the server does), on one radix cache (flushed before the row, as the bench does; what a batch
    prefilled is cached for the later ones), ``prefill_chunk`` prompt tokens at most a prefill pass
    (the server's ``chunked_prefill_size``); ``overlap_scheduler``: under SGLang's overlap
    scheduler, a request's batch runs one step past its end
    (:func:`~histospec_sgl.simulate.step.run_step`)."""
    from histospec_sgl.engine.policy import Fixed

    seconds, steps, tokens, prefilled = 0.0, 0, 0, 0
    used: dict[int, int] = {}
    done: dict[int, list[list[int]]] = {}
    cache = PrefixCache()
    widths = list(control.widths) if control is not None else [d]
    for k in range(0, len(reqs), batch):
        chunk = reqs[k:k + batch]
        sims = []
        for gi in sorted({gi for gi, _ in chunk}):
            g = groups[gi]
            mine = [g.samples[si][:cap] for gj, si in chunk if gj == gi]
            sims += simulate.group_requests(gi, g.prompt_ids, [*g.history_ids, *done.get(gi, [])], mine, widths,
                                            cap=cap)
            done.setdefault(gi, []).extend(mine)
        o = simulate.run_step(sims, profile, batch, length_first=False, policy=control or Fixed(width or 1),
                              overlap=overlap_scheduler, cache=cache, prefill_chunk=prefill_chunk)
        seconds += o.makespan_s
        steps += o.steps
        tokens += sum(r.length for r in sims)
        prefilled += o.prefill_tokens
        for w, n in o.widths.items():
            used[w] = used.get(w, 0) + n
    return RowRun(seconds, steps, tokens, used, prefilled)


def print_check(result: dict[str, Any]) -> None:
    from rich.table import Table

    from histospec_sgl.console import console

    t = Table(title=f"simulate --check: predicted against measured speedup over plain decoding (trace mode, "
                    f"d={result['draft_tokens']}, profile {result['profile']['name']})")
    for c in ("method", "batch", "T", "predicted", "measured", "error", "time error (row, plain)", "predicted fixed"):
        t.add_column(c, justify="left" if c in ("method", "predicted fixed") else "right")

    def pct(v: float | None) -> str:
        return f"{100 * v:+.0f}%" if v is not None else ""

    for c in result["check"]:
        fixed = ", ".join(f"{w}: {x:.2f}x" for w, x in c.get("predicted_fixed_speedups", {}).items())
        times = f"{pct(c.get('time_error'))}, {pct(c.get('plain_time_error'))}" if c.get("time_error") is not None else ""
        t.add_row(c["method"], str(c["batch_size"]), str(c["temperature"]), f"{c['predicted_speedup']:.2f}x",
                  f"{c['measured_speedup']:.2f}x", pct(c["error"]), times, fixed)
    console().print(t)
    if not result.get("log_verified", True):
        console().print("[yellow]warning:[/] this result records no digest of its traced step (a bench engine "
                        "from before digests): the step was rebuilt from the log given and not checked against it")
    if result["not_predicted"]:
        console().print(f"not predicted (the simulator models HISTORY's drafting only): {', '.join(result['not_predicted'])}")
