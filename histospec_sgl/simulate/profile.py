"""Step-cost profiles: how long one engine step takes for a running batch of ``batch`` requests that
verifies ``width`` tokens each (1: plain decoding) at a mean context of ``context`` tokens, plus
the prompt tokens prefilled in the same step.

Two kinds, and every output says which: an *analytic* profile computes the time from a model's
size against a GPU's memory bandwidth and peak compute (no measurement), and a *measured* profile
interpolates step times timed on a real engine (a JSON file, ``--profile PATH``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from histospec_sgl.engine.policy import PrefillCost, Profile, interpolate

#: ``bench engine`` row keys that are a server's clock as a run left it: step costs per width and
#: batch bucket, and what a prefill pass costs (each run's too, ``{key}_runs``).
CLOCK = ("step_seconds", "step_seconds_mean", "prefill_s_fixed", "prefill_s_per_token")

__all__ = ["ANALYTIC", "H100_8B", "Analytic", "Measured", "Profile", "from_engine_bench", "resolve"]


@dataclass(frozen=True)
class Analytic:
    """A decode step as memory and compute time on one GPU: the weights and every running request's
    KV cache are read once per step, and ``batch * width`` tokens (plus ``prefill``) are computed,
    whichever takes longer, plus a fixed per-step overhead and, when drafts are verified, the
    drafting and tree bookkeeping. Efficiencies are the shares of peak bandwidth and compute that
    decode kernels reach."""

    name: str
    description: str
    weight_bytes: float
    kv_bytes_per_token: float
    flops_per_token: float
    bandwidth: float  # bytes/s, peak
    peak_flops: float  # flop/s, peak (dense bf16)
    bandwidth_eff: float = 0.8
    compute_eff: float = 0.5
    overhead_s: float = 0.0012
    spec_overhead_s: float = 0.0004
    analytic: bool = True

    def step_s(self, batch: int, width: int, context: float, prefill: int = 0) -> float:
        if batch <= 0:
            return 0.0
        memory = (self.weight_bytes + batch * context * self.kv_bytes_per_token) / (self.bandwidth * self.bandwidth_eff)
        compute = (batch * width + prefill) * self.flops_per_token / (self.peak_flops * self.compute_eff)
        return self.overhead_s + (self.spec_overhead_s if width > 1 else 0.0) + max(memory, compute)

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__}


#: An 8B Llama-3-shaped model in bf16 on one H100 SXM (3.35 TB/s HBM3, 989 Tflop/s dense bf16):
#: 16.1 GB of weights, 128 KiB of KV per token (32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes).
H100_8B = Analytic(
    name="h100-8b-analytic",
    description="analytic: 8B Llama-3-shaped model, bf16, one H100 SXM (3.35 TB/s, 989 Tflop/s); "
                "80% of peak bandwidth, 50% of peak compute, 1.2 ms per step, 0.4 ms more to draft and verify",
    weight_bytes=16.06e9,
    kv_bytes_per_token=131072,
    flops_per_token=2 * 8.03e9,
    bandwidth=3.35e12,
    peak_flops=989e12,
)

ANALYTIC = {H100_8B.name: H100_8B}


@dataclass(frozen=True)
class Measured:
    """Step times timed on a real engine: ``points[(width)]`` is a sorted list of
    ``(batch, seconds)``, interpolated linearly in the batch size (held flat beyond the ends);
    ``context_s_per_token`` adds the KV read per running request and context token, and a step
    with prompt tokens to prefill adds their prefill forward pass: ``prefill_s_fixed`` a pass and
    ``prefill_s_per_token`` a token. A width that was not timed is interpolated linearly between
    the nearest timed widths (a verify step's cost grows with the nodes it verifies; the engine's
    own clock, :class:`~histospec_sgl.engine.clock.StepClock`, prices an untimed width the same
    way), and beyond the widest takes the widest."""

    name: str
    description: str
    points: dict[int, list[tuple[int, float]]]
    context_s_per_token: float = 0.0
    prefill_s_per_token: float = 0.0
    prefill_s_fixed: float = 0.0
    analytic: bool = False

    def step_s(self, batch: int, width: int, context: float, prefill: int = 0) -> float:
        if batch <= 0:
            return 0.0
        if width in self.points:
            base = interpolate(self.points[width], batch)
        else:
            base = interpolate([(w, interpolate(pts, batch)) for w, pts in sorted(self.points.items())], width)
        return (base + batch * context * self.context_s_per_token
                + PrefillCost(self.prefill_s_fixed, self.prefill_s_per_token).seconds(prefill))

    @classmethod
    def load(cls, path: Path) -> Measured:
        """Reads a profile JSON: ``{"name", "description", "points": [{"batch", "width", "step_s"}],
        "context_s_per_token"?, "prefill_s_per_token"?, "prefill_s_fixed"?}``."""
        return cls.from_json(json.loads(Path(path).read_text()), str(path))

    @classmethod
    def from_json(cls, raw: dict[str, Any], where: str = "profile") -> Measured:
        """A profile from its JSON object (:meth:`load`; ``where`` names it in errors and is the
        default name and description)."""
        if raw.get("analytic"):
            raise ValueError(f"{where}: an analytic profile is named, not loaded (--profile {raw.get('name')})")
        points: dict[int, list[tuple[int, float]]] = {}
        for p in raw["points"]:
            points.setdefault(int(p["width"]), []).append((int(p["batch"]), float(p["step_s"])))
        if 1 not in points:
            raise ValueError(f"{where}: a profile needs plain decode steps (width 1)")
        return cls(raw.get("name", Path(where).stem), raw.get("description", where),
                   {w: sorted(v) for w, v in points.items()},
                   float(raw.get("context_s_per_token", 0.0)), float(raw.get("prefill_s_per_token", 0.0)),
                   float(raw.get("prefill_s_fixed", 0.0)))


def row_control(row: dict[str, Any]) -> str | None:
    """How a ``bench engine`` row's HISTORY server chose its verify widths under the overlap
    scheduler: ``fixed`` or ``cost`` (the row's ``control``; in results from before rows recorded it,
    by the method's name); None for other methods and for the synchronous loop (``_sync``)."""
    method = row.get("method", "")
    if method.endswith("_sync"):
        return None
    return row.get("control") or {"history": "fixed", "history_cost": "cost"}.get(method)


def from_engine_bench(result: dict[str, Any] | list[dict[str, Any]], name: str | None = None) -> dict[str, Any]:
    """A measured profile (the JSON :meth:`Measured.load` reads) from ``histospec-sgl bench engine``
    results: plain decoding's step time per batch size is width 1, a fixed-width HISTORY row's verify
    step time is its width (the result's d); the median over the rows' passes and temperatures. Several
    results (one per width, as ``bench profile`` runs them) give a profile of every width they ran."""
    import statistics

    results = [result] if isinstance(result, dict) else list(result)
    if not results:
        raise ValueError("no engine result to make a profile from")
    times: dict[tuple[int, int], list[float]] = {}
    for res in results:
        d = int(res["settings"]["draft_tokens"])
        for r in res["rows"]:
            fixed = row_control(r) == "fixed"
            width = 1 if r["method"] == "plain" else int(r.get("draft_tokens") or d) if fixed else None
            if width is not None and r.get("step_ms"):
                times.setdefault((width, int(r["batch_size"])), []).append(float(r["step_ms"]) / 1e3)
    if not any(w == 1 for w, _ in times) or not any(w > 1 for w, _ in times):
        raise ValueError("the engine result needs rows of plain decoding and of HISTORY (--methods plain,history)")
    first = results[0]
    return _measured_json(first, {k: statistics.median(v) for k, v in times.items()},
                          name, "measured", "histospec-sgl bench engine", "",
                          [r.get("command") for r in results] if len(results) > 1 else first.get("command"))


def from_engine_clock(result: dict[str, Any]) -> dict[str, Any] | None:
    """A measured profile from the step costs a ``bench engine`` result's default-policy rows carry
    (``step_seconds``: what the engine's own clock, :class:`~histospec_sgl.engine.clock.StepClock`,
    had measured per verify width and batch-size bucket by the end of the row; later rows override
    earlier ones, as the server's clock does). These are per decode step at the batch actually
    running, the costs that a row's average over its passes hides (its prefill, its shrinking
    tail). The means of the clock's timings where the result has them (``step_seconds_mean``): a row
    pays every step, the slow ones too, where the clock's median, which the policy chooses by, leaves
    them out. A batch-size bucket whose plain step the clock never timed (the policy verified every
    step there) is priced by the plain row's own average at that batch, not extrapolated from the
    smaller buckets. The prefill forward passes as the same clock timed them, a fixed part a pass
    and a part per prompt token (``prefill_s_fixed``, ``prefill_s_per_token``: the engine spends
    them outside decode steps; the latest row's), are charged for the prompts joining a step. None
    when no default-policy row carries step costs (a result of fixed widths only, or from before
    they were recorded); a fixed-width server's clock prices nothing here."""
    from histospec_sgl.engine.costmodel import bucket

    times: dict[tuple[int, int], float] = {}
    rows = result.get("rows", [])
    key = "step_seconds_mean" if any(r.get("step_seconds_mean") for r in rows) else "step_seconds"
    # The default's servers at the run's draft-token count (a ``history_cost_d4`` server's clock is
    # its own).
    d = result.get("settings", {}).get("draft_tokens")
    timed = [r for r in rows if r.get("draft_tokens") in (None, d) and row_control(r) == "cost"]
    for r in timed:
        for w, by_bucket in (r.get(key) or {}).items():
            for b, seconds in by_bucket.items():
                times[(int(w), int(b))] = float(seconds)
    if not any(w == 1 for w, _ in times) or not any(w > 1 for w, _ in times):
        return None
    filled = []
    for r in rows:
        b = bucket(int(r.get("batch_size", 0) or 0))
        if r.get("method") == "plain" and r.get("step_ms") and (1, b) not in times:
            times[(1, b)] = float(r["step_ms"]) / 1e3
            filled.append(b)
    note = f"; plain steps at batch {', '.join(map(str, sorted(filled)))} from the plain rows' averages" if filled else ""
    out = _measured_json(result, times, None, "engine-clock",
                         "the engine's own step clock during histospec-sgl bench engine",
                         f", per batch-size bucket{note}", result.get("command"))
    prefill = [r for r in timed if r.get("prefill_s_per_token")]
    if prefill:
        out["prefill_s_per_token"] = float(prefill[-1]["prefill_s_per_token"])
        out["prefill_s_fixed"] = float(prefill[-1].get("prefill_s_fixed") or 0.0)
        out["description"] += ", prefill timed per pass and prompt token"
    return out


def at_median_run(row: dict[str, Any]) -> dict[str, Any]:
    """A ``bench engine`` row with its clock (:data:`CLOCK`) as its median run left it
    (``median_run``: the run whose wall time is the row's), not as its last run did; unchanged where
    the row keeps no run's clock (results from before they were kept). A step cost that run's clock
    had not timed yet (a width in a batch bucket the server first timed in a later run: the first
    timing of each is warm-up) is the nearest run's that had, the later of two as near: the server
    paid it all the same."""
    i = row.get("median_run")
    if i is None:
        return row
    out = {**row, **{k: row[f"{k}_runs"][i] for k in CLOCK if f"{k}_runs" in row}}
    for k in ("step_seconds", "step_seconds_mean"):
        runs = row.get(f"{k}_runs")
        if not runs or out.get(k) is None:
            continue
        table: dict[str, dict[str, float]] = {}
        for j in sorted(range(len(runs)), key=lambda j: (abs(j - i), -j)):  # the median run first
            for w, by in (runs[j] or {}).items():
                for b, v in by.items():
                    table.setdefault(w, {}).setdefault(b, v)
        out[k] = {w: dict(sorted(by.items(), key=lambda x: int(x[0])))
                  for w, by in sorted(table.items(), key=lambda x: int(x[0]))}
    return out


def with_row_clock(profile: dict[str, Any], row: dict[str, Any], width: int) -> dict[str, Any]:
    """``profile`` (a measured profile's JSON, :func:`from_engine_clock`) with ``width``'s step costs
    replaced by the ones a fixed-width row's own server timed (the row's ``step_seconds_mean``, else
    ``step_seconds``), where it has them: each server runs at its own pace on a shared host, and a
    fixed row's verify steps are its server's, not the default's; and a plain row's steps (width 1)
    its own server's, where trace mode's model timed them (``TRACE_MODE_CLOCK``). Its prefill
    passes likewise, where the row's server timed them (``prefill_s_fixed``, ``prefill_s_per_token``):
    at a large batch they are much of the row's time."""
    own = row.get("step_seconds_mean") or row.get("step_seconds") or {}
    mine = {int(b): float(v) for b, v in (own.get(str(width)) or {}).items()}
    if not mine:
        return profile
    points = [p for p in profile["points"] if not (p["width"] == width and p["batch"] in mine)]
    points += [{"batch": b, "width": width, "step_s": v} for b, v in mine.items()]
    out = {**profile, "points": sorted(points, key=lambda p: (p["width"], p["batch"])),
           "description": f"{profile['description']}; width {width} as the row's own server timed it"}
    if row.get("prefill_s_per_token"):
        out["prefill_s_per_token"] = float(row["prefill_s_per_token"])
        out["prefill_s_fixed"] = float(row.get("prefill_s_fixed") or 0.0)
        out["description"] += ", its prefill passes too"
    return out


def _measured_json(result: dict[str, Any], times: dict[tuple[int, int], float], name: str | None, suffix: str,
                   how: str, detail: str, source: Any) -> dict[str, Any]:
    """The profile JSON of step costs ``times[(width, batch)]`` measured by ``how`` on the machine and
    model that ``result`` (a ``bench engine`` result) names."""
    m = result.get("machine", {})
    kind = result.get("model", {}).get("kind")
    device = result.get("device", "?")
    hw = m.get("gpu") or m.get("cpu") or "?"
    ran = sorted({w for w, _ in times})
    return {
        "name": name or f"{device}-{kind or 'model'}-{suffix}",
        "analytic": False,
        "description": f"measured: {how} on {device} ({hw}), model {kind or '?'}, sglang {m.get('sglang')}, "
                       f"widths {','.join(map(str, ran))}{detail}",
        "points": [{"batch": b, "width": w, "step_s": v} for (w, b), v in sorted(times.items())],
        "source": source,
    }


def resolve(name_or_path: str) -> Profile:
    """An analytic profile by name, or a measured one from a JSON file."""
    if name_or_path in ANALYTIC:
        return ANALYTIC[name_or_path]
    path = Path(name_or_path)
    if not path.exists():
        raise ValueError(f"--profile {name_or_path!r}: neither an analytic profile ({', '.join(ANALYTIC)}) "
                         "nor a profile JSON file")
    return Measured.load(path)
