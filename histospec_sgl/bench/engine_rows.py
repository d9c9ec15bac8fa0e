"""A ``bench engine`` row from its runs, and what compares the rows with each other: the medians of
a row's repeats (:func:`median_row`; its clock as each run left it,
:func:`~histospec_sgl.simulate.profile.at_median_run`),
its ratios over plain decoding's row (:func:`ratios`), whether a greedy row's outputs are plain
decoding's (:func:`identical`), and the default policy's verified-step tallies summed over runs
(:func:`tallies`)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from histospec_sgl.simulate.profile import CLOCK

#: Row keys that are per-request outputs, compared across methods and then dropped from the rows.
OUTPUTS = "_outputs"


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from ``repeats`` timings of it: the median of each number, and every run's tokens/s."""
    out: dict[str, Any] = {}
    for k in runs[0]:
        if k == "width_steps":  # summed over the runs, and each run's (a policy explores in its first run)
            total: Counter[str] = sum((Counter(r[k]) for r in runs), Counter())
            out[k] = dict(sorted(total.items(), key=lambda x: int(x[0])))
            out["width_steps_runs"] = [r[k] for r in runs]
            continue
        if k in CLOCK:  # by the last run (the clock as the row left it), and as each run left it
            out[k] = runs[-1][k]
            out[f"{k}_runs"] = [r[k] for r in runs]
            continue
        if k == "server_start":  # which server set ran each run (``--server-starts``)
            out["server_start_runs"] = [r[k] for r in runs]
            continue
        if k == OUTPUTS:  # every run's outputs, in order
            out[k] = [o for r in runs for o in r[k]]
            continue
        if k == "verified_tokens":  # summed over the runs
            out[k] = tallies([r[k] for r in runs])
            continue
        if k == "context_mismatches":  # summed over the runs
            vals_ = [r[k] for r in runs]
            out[k] = None if None in vals_ else sum(vals_)
            continue
        if any(r[k] is None for r in runs):  # not measured in some run (host_ms_per_step of a stepless row)
            out[k] = None
            continue
        vals = sorted(r[k] for r in runs)
        mid = len(vals) // 2
        out[k] = vals[mid] if len(vals) % 2 else round((vals[mid - 1] + vals[mid]) / 2, 4)
        if all(isinstance(v, int) for v in vals):
            out[k] = int(out[k])
    out["tokens_per_s_runs"] = [r["tokens_per_s"] for r in runs]
    # The run whose wall time is the row's median (of two middle ones, the faster): its clock prices
    # the time the row reports (simulate --check), where the host drifts from run to run.
    if all("wall_s" in r for r in runs):
        walls = sorted(range(len(runs)), key=lambda i: runs[i]["wall_s"])
        out["median_run"] = walls[(len(runs) - 1) // 2]
    return out


def ratios(rows: list[dict[str, Any]]) -> None:
    """``vs_plain`` (tokens/s over plain decoding's, medians over medians), ``vs_plain_runs`` (each
    run's over the plain run of the same repeat, timed beside it) and ``verify_cost`` (step time over
    plain's) for every row that has a plain row with the same pass, batch size, temperature and
    siblings; ``vs_plain_sync`` where there is a ``plain_sync`` row."""
    def point(r: dict[str, Any]) -> tuple:
        return tuple(r[k] for k in ("pass", "batch_size", "temperature", "siblings"))

    bases = {(r["method"], point(r)): r for r in rows if r["method"] in ("plain", "plain_sync")}
    for r in rows:
        base = bases.get(("plain", point(r)))
        if base is not None:
            r["vs_plain"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
            r["vs_plain_runs"] = [round(x / y, 3) for x, y in zip(r["tokens_per_s_runs"], base["tokens_per_s_runs"])]
            r["verify_cost"] = round(r["step_ms"] / base["step_ms"], 3)
        base = bases.get(("plain_sync", point(r)))
        if base is not None:
            r["vs_plain_sync"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)


def identical(rows: list[dict[str, Any]]) -> None:
    """``identical_to_plain`` on every row: for a greedy row, whether every output equals the plain
    row's for the same requests (same pass, batch size and siblings); None where there is no plain row
    or the row samples. The outputs themselves leave the rows here."""
    def point(r: dict[str, Any]) -> tuple:
        return tuple(r[k] for k in ("pass", "batch_size", "temperature", "siblings"))

    # plain last, so that its outputs are the reference where plain_sync ran too
    plain = {point(r): r[OUTPUTS] for r in sorted(rows, key=lambda r: r["method"] == "plain")
             if r["method"] in ("plain", "plain_sync")}
    for r in rows:
        ref = plain.get(point(r))
        r["identical_to_plain"] = None if ref is None or r["temperature"] > 0 else r[OUTPUTS] == ref
    for r in rows:
        r.pop(OUTPUTS)


def tallies(added: list[dict[str, dict[str, list[float]]]],
            taken: dict[str, dict[str, list[float]]] | None = None) -> dict[str, dict[str, list[float]]]:
    """Width -> bucket -> [expected, accepted] tallies
    (:func:`~histospec_sgl.bench.engine_server.verified_tokens`) summed, less
    ``taken`` (a row's: the counters after it less those before), rounded; the empty ones left out."""
    out: dict[str, dict[str, list[float]]] = {}
    for sign, group in ((1, added), (-1, [taken or {}])):
        for t in group:
            for w, by in t.items():
                for b, pair in by.items():
                    acc = out.setdefault(w, {}).setdefault(b, [0.0, 0.0])
                    acc[0], acc[1] = acc[0] + sign * pair[0], acc[1] + sign * pair[1]
    return {w: {b: [round(x, 3) for x in pair] for b, pair in sorted(by.items(), key=lambda x: int(x[0])) if pair[0] > 0}
            for w, by in sorted(out.items(), key=lambda x: int(x[0])) if any(p[0] > 0 for p in by.values())}
