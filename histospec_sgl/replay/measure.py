"""Simulated speculative decoding against logged responses.

Each verify step asks the method for a tree of ``num_nodes`` nodes (the root is the last emitted
token), accepts greedily along it (exact match with the logged continuation), and emits
accepted + 1 tokens (the target model's bonus token), or what is left of the response. The first
token of a response comes from prefill and is not counted as a verify step. All requests of a case
draft first, then all advance, as one decode batch does.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from histospec_sgl.engine.draft import walk
from histospec_sgl.replay.methods import Method
from histospec_sgl.replay.scenarios import Case


def accept_greedy(tokens: Sequence[int] | Any, parents: Sequence[int] | Any, truth: Sequence[int] | Any, pos: int) -> int:
    """Length of the longest root path of the tree whose tokens equal ``truth[pos:]``'s prefix.

    Nodes are in parent-before-child order with the root at index 0 (its parent is -1)
    (:func:`histospec_sgl.engine.draft.walk`).
    """
    return walk(tokens, parents, itertools.islice(truth, pos, None))[1]


@dataclass
class Tally:
    num_nodes: int
    steps: int = 0
    emitted: int = 0
    accepted: int = 0
    covered: int = 0
    responses: int = 0
    draft_ns: int = 0
    update_ns: int = 0
    hist: list[int] = field(default_factory=list)
    per_response: list[float] = field(default_factory=list)
    by_label: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.hist:
            self.hist = [0] * self.num_nodes

    def summary(self, verify_costs: Sequence[float], batch_size: int, decode_step_ms: float) -> dict:
        s = max(self.steps, 1)
        tps = self.emitted / s
        draft_us = self.draft_ns / s / 1e3
        update_us = self.update_ns / s / 1e3
        cpu_frac = (draft_us + update_us) * batch_size / (decode_step_ms * 1e3)
        pr = sorted(self.per_response)

        def pct(q: float) -> float:
            return pr[min(len(pr) - 1, int(q * len(pr)))] if pr else 0.0

        return {
            "tokens_per_verify_step": tps,
            "draft_coverage": self.covered / s,
            "accepted_per_step": self.accepted / s,
            "projected_speedup": {f"{c:g}": tps / (c + cpu_frac) for c in verify_costs},
            "draft_us_per_step": draft_us,
            "update_us_per_step": update_us,
            "accepted_length_histogram": list(self.hist),
            "verify_steps": self.steps,
            "replayed_tokens": self.emitted,
            "responses": self.responses,
            "per_response_tokens_per_step": {
                "p10": pct(0.1),
                "p50": pct(0.5),
                "p90": pct(0.9),
                "mean": statistics.fmean(pr) if pr else 0.0,
            },
            "tokens_per_verify_step_by_step": {
                str(k): v[0] / max(v[1], 1) for k, v in sorted(self.by_label.items())
            },
        }


def run_method(
    method: Method,
    cases: Sequence[Case],
    num_nodes: int,
    on_case: Callable[[], None] | None = None,
) -> Tally:
    """Replays every case with ``method``; only the cases' ``replay`` responses are measured."""
    if num_nodes < 2:
        raise ValueError("a draft needs at least 2 nodes (the root and one draft token)")
    tally = Tally(num_nodes)
    rid_base = 0
    clock = time.perf_counter_ns
    reveal = getattr(method, "reveal", None)  # bounds (not drafters) are told the logged response
    batch = getattr(method, "draft_batch", None)  # a decode batch's drafts in one call (ours)
    # Time inside the index alone where the method counts it (ours), else wall time around the call.
    index_ns = getattr(method, "index_ns", None)
    draft_clock = (lambda: index_ns()[0]) if index_ns else clock
    update_clock = (lambda: index_ns()[1]) if index_ns else clock
    for case in cases:
        method.reset(case.online_visible, num_nodes)
        for h in case.history:
            method.add_history(h.prompt_ids, h.response_ids)  # type: ignore[arg-type]
        reqs = [(r, True) for r in case.replay] + [(r, False) for r in case.siblings]
        # rid -> [truth, pos, measured, steps, emitted]
        state: dict[int, list] = {}
        for i, (row, measured) in enumerate(reqs):
            rid = rid_base + i
            truth = row.response_ids or []
            method.begin(rid, row.prompt_ids)  # type: ignore[arg-type]
            if reveal is not None:
                reveal(rid, truth)
            if not truth:
                method.finish(rid)
                continue
            method.extend(rid, truth[:1])  # the prefill's token
            if len(truth) == 1:
                method.finish(rid)
                if measured:
                    tally.responses += 1
                continue
            state[rid] = [truth, 1, measured, 0, 0, row.step]
        rid_base += len(reqs)
        while state:
            drafts = {}
            if batch is not None:
                # One call for the step's whole batch (which also brings the index up to the last
                # step's tokens, as the worker does); the index's time is shared out over its requests.
                rids = list(state)
                share = sum(st[2] for st in state.values()) / len(rids)
                t0, u0 = draft_clock(), update_clock()
                drafts = dict(zip(rids, batch(rids, num_nodes)))
                tally.draft_ns += int((draft_clock() - t0) * share)
                tally.update_ns += int((update_clock() - u0) * share)
            else:
                for rid, st in state.items():
                    t0 = draft_clock()
                    drafts[rid] = method.draft(rid, num_nodes)
                    if st[2]:
                        tally.draft_ns += draft_clock() - t0
            done = []
            for rid, st in state.items():
                truth, pos, measured = st[0], st[1], st[2]
                toks, parents = drafts[rid]
                acc = accept_greedy(toks, parents, truth, pos)
                emit = min(acc + 1, len(truth) - pos)
                t0 = update_clock()
                method.extend(rid, truth[pos : pos + emit])
                if measured:
                    tally.update_ns += update_clock() - t0
                    tally.steps += 1
                    tally.emitted += emit
                    tally.accepted += acc
                    tally.covered += len(toks) > 1
                    tally.hist[min(acc, num_nodes - 1)] += 1
                    st[3] += 1
                    st[4] += emit
                st[1] = pos + emit
                if st[1] >= len(truth):
                    done.append(rid)
            for rid in done:
                st = state.pop(rid)
                u0 = update_clock()
                method.finish(rid)
                if st[2] and index_ns:
                    tally.update_ns += update_clock() - u0  # its last tokens reach the index here
                if st[2]:
                    tally.responses += 1
                    tally.per_response.append(st[4] / max(st[3], 1))
                    if st[5] is not None:
                        lab = tally.by_label.setdefault(st[5], [0, 0])
                        lab[0] += st[4]
                        lab[1] += st[3]
        if on_case:
            on_case()
    return tally
