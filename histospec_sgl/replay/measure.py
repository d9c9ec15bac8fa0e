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
from collections.abc import Callable, Generator, Sequence
from dataclasses import InitVar, dataclass, field
from typing import Any

from histospec_sgl.engine.draft import advance, walk
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


@dataclass
class Track:
    """A logged response replayed as one request: ``truth`` its tokens, of which it starts with
    ``start`` known (1: the prefill's token, which no verify step checks). ``measured``: counted by
    the caller (a case's siblings decode but are not); ``label``: the caller's tag. The loop keeps
    ``pos`` (tokens known so far), ``steps`` and ``emitted`` (its verify steps and their tokens)."""

    rid: int
    prompt: Sequence[int]
    truth: Sequence[int]
    measured: bool = True
    label: Any = None
    start: int = 1
    pos: int = 0
    steps: int = 0
    emitted: int = 0


@dataclass
class Step:
    """One request's verify step: its draft (the method's tuple, ``(tokens, parents, ...)``), the
    draft tokens accepted and the tokens the step emits (accepted + 1, or what is left)."""

    track: Track
    draft: tuple
    accepted: int
    emit: int


@dataclass
class Clocks:
    """Where a replay's time goes, counted for measured requests only: ``draft_ns`` drafting and
    ``update_ns`` bringing the index up to the emitted tokens. A method that counts its index's own
    time (``index_ns()``: ours) is read from that, others by wall time around each call; only then does
    the clock hold on to the method (a peer's store can be large)."""

    method: InitVar[Any]
    draft_ns: int = 0
    update_ns: int = 0

    def __post_init__(self, method: Any) -> None:
        index_ns = getattr(method, "index_ns", None)
        self.own = index_ns is not None
        self.draft = (lambda: index_ns()[0]) if index_ns else time.perf_counter_ns
        self.update = (lambda: index_ns()[1]) if index_ns else time.perf_counter_ns


def replay(method: Method, tracks: Sequence[Track], num_nodes: int, *, every_position: bool = False,
           accept: Callable[[tuple, Sequence[int], int], int] | None = None,
           clocks: Clocks | None = None) -> Generator[list[Step], None, None]:
    """The replay loop, written once: ``tracks`` decode together as one batch, a verify step at a
    time. Each step every live request drafts ``num_nodes`` nodes (one ``draft_batch`` call where the
    method has it, as the worker drafts a decode batch), the draft is accepted along the logged
    continuation (``accept(draft, truth, pos)``; default the tree walk, :func:`accept_greedy`), the
    step is yielded to the caller, and each request advances by its step's tokens (one token with
    ``every_position``, so acceptance is read at every position), which the method is told; a
    request whose response is complete finishes. Methods that are bounds, not drafters, are shown
    the logged response first (``reveal``). Closed early (the caller stops iterating), the requests
    still live finish."""
    if num_nodes < 2:
        raise ValueError("a draft needs at least 2 nodes (the root and one draft token)")
    walk_ = accept or (lambda d, truth, pos: accept_greedy(d[0], d[1], truth, pos))
    clk = clocks if clocks is not None else Clocks(method)
    reveal = getattr(method, "reveal", None)
    batch = getattr(method, "draft_batch", None)
    live: list[Track] = []
    for tr in tracks:
        method.begin(tr.rid, tr.prompt)  # type: ignore[arg-type]
        if reveal is not None:
            reveal(tr.rid, tr.truth)
        tr.pos = min(tr.start, len(tr.truth))
        if tr.pos:
            method.extend(tr.rid, list(tr.truth[: tr.pos]))  # type: ignore[arg-type]
        if tr.pos >= len(tr.truth):
            method.finish(tr.rid)
        else:
            live.append(tr)
    try:
        while live:
            if batch is not None:
                # One call for the whole batch (which also brings the index up to the last step's
                # tokens, as the worker does); its time is shared out over the measured requests.
                share = sum(tr.measured for tr in live) / len(live)
                t0, u0 = clk.draft(), clk.update()
                drafts = batch([tr.rid for tr in live], num_nodes)
                clk.draft_ns += int((clk.draft() - t0) * share)
                clk.update_ns += int((clk.update() - u0) * share)
            else:
                drafts = []
                for tr in live:
                    t0 = clk.draft()
                    drafts.append(method.draft(tr.rid, num_nodes))
                    if tr.measured:
                        clk.draft_ns += clk.draft() - t0
            steps = []
            for tr, d in zip(live, drafts):
                acc = walk_(d, tr.truth, tr.pos)
                steps.append(Step(tr, d, acc, advance(acc, len(tr.truth) - tr.pos)))
            yield steps
            for s in steps:
                tr = s.track
                adv = 1 if every_position else s.emit
                t0 = clk.update()
                method.extend(tr.rid, list(tr.truth[tr.pos : tr.pos + adv]))  # type: ignore[arg-type]
                if tr.measured:
                    clk.update_ns += clk.update() - t0
                tr.pos += adv
                tr.steps += 1
                tr.emitted += s.emit
            for tr in [tr for tr in live if tr.pos >= len(tr.truth)]:
                live.remove(tr)
                u0 = clk.update()
                method.finish(tr.rid)
                if tr.measured and clk.own:
                    clk.update_ns += clk.update() - u0  # its last tokens reach the index here
    except GeneratorExit:
        # Closed before its requests ended (a caller that takes only some steps): they finish, so
        # that the method holds none in flight.
        for tr in live:
            method.finish(tr.rid)
        raise


def run_method(
    method: Method,
    cases: Sequence[Case],
    num_nodes: int,
    on_case: Callable[[], None] | None = None,
) -> Tally:
    """Replays every case with ``method`` (:func:`replay`); only the cases' ``replay`` responses are
    measured."""
    if num_nodes < 2:
        raise ValueError("a draft needs at least 2 nodes (the root and one draft token)")
    tally = Tally(num_nodes)
    rid_base = 0
    for case in cases:
        method.reset(case.online_visible, num_nodes)
        for h in case.history:
            method.add_history(h.prompt_ids, h.response_ids)  # type: ignore[arg-type]
        rows = [(r, True) for r in case.replay] + [(r, False) for r in case.siblings]
        tracks = [Track(rid_base + i, row.prompt_ids, row.response_ids or [], measured, row.step)  # type: ignore[arg-type]
                  for i, (row, measured) in enumerate(rows)]
        rid_base += len(rows)
        clocks = Clocks(method)
        for steps in replay(method, tracks, num_nodes, clocks=clocks):
            for s in steps:
                if s.track.measured:
                    tally.steps += 1
                    tally.emitted += s.emit
                    tally.accepted += s.accepted
                    tally.covered += len(s.draft[0]) > 1
                    tally.hist[min(s.accepted, num_nodes - 1)] += 1
        tally.draft_ns += clocks.draft_ns
        tally.update_ns += clocks.update_ns
        for tr in tracks:
            if not tr.measured or not tr.truth:
                continue
            tally.responses += 1
            if tr.steps:
                tally.per_response.append(tr.emitted / tr.steps)
                if tr.label is not None:
                    lab = tally.by_label.setdefault(tr.label, [0, 0])
                    lab[0] += tr.emitted
                    lab[1] += tr.steps
        if on_case:
            on_case()
    return tally
