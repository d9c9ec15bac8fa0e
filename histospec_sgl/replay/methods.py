"""Draft sources the replay drives through one interface (:class:`Method`), and ours (:class:`Ours`);
the peers are in :mod:`~histospec_sgl.replay.peers`.

Each method sees the same calls in the same order: ``reset`` at a new case (per-prompt methods
start empty; global ones keep what they had), ``add_history`` for the case's finished responses,
``begin`` per request, then per verify step ``draft`` (or, where a method has it, ``draft_batch``
for every request of the step at once, as a decode batch drafts) and ``extend`` with the tokens the
step emitted, and ``finish`` when a response ends (a finished in-flight sibling becomes history).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from histospec_sgl._core import HistoryIndex
from histospec_sgl.engine.config import HistoryConfig
from histospec_sgl.engine.draft import tree_parents_batch
from histospec_sgl.engine.drafter import BatchDrafter


class Method(Protocol):
    name: str
    description: str

    def reset(self, case_online_visible: bool, num_nodes: int = 16) -> None: ...
    def add_history(self, prompt: Sequence[int], response: Sequence[int]) -> None: ...
    def begin(self, rid: int, prompt: Sequence[int]) -> None: ...
    def draft(self, rid: int, num_nodes: int) -> tuple[Sequence[int], ...]: ...
    def extend(self, rid: int, tokens: Sequence[int]) -> None: ...
    def finish(self, rid: int) -> None: ...


#: How ``Ours`` turns a finished in-flight request into history (``--finish``).
FINISH_MODES = ("keep", "draft-server")


class _TimedIndex:
    """The drafter's index, with the time spent in its drafting and updating calls counted, so that
    the replay charges the engine for the index's work alone (its per-request cost at the replay's
    small batches is not the worker's Python bookkeeping, which ``bench worker`` measures)."""

    DRAFT = frozenset({"draft", "draft_batch"})
    UPDATE = frozenset({"extend_request", "extend_batch"})

    def __init__(self, index: HistoryIndex):
        self.index = index
        self.draft_ns = 0
        self.update_ns = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.index, name)
        if name not in self.DRAFT and name not in self.UPDATE:
            return attr
        counter = "draft_ns" if name in self.DRAFT else "update_ns"

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return attr(*args, **kwargs)
            finally:
                setattr(self, counter, getattr(self, counter) + time.perf_counter_ns() - t0)

        return timed


class Ours:
    """histospec-sgl's drafting exactly as the SGLang worker runs it: one
    :class:`~histospec_sgl.engine.drafter.BatchDrafter` per case, whose requests are synced and
    drafted for a whole decode batch at once (:meth:`draft_batch`), with the worker's default
    settings and any draft knobs given, at a fixed width (``HISTOSPEC_CONTROL=fixed``): the replay
    measures what the drafts give at every step; which steps the cost model would verify depends
    on an engine's step times (``histospec-sgl simulate``). ``chain=True`` drafts chains with the
    index's own ``draft(chain=True)`` instead (no worker mode does).

    ``finish``: ``keep`` finishes a request with ``keep=True`` (the worker without a draft
    server). ``draft-server`` does what the worker does with one: the request leaves unkept
    (its tokens stay until its group's next rebuild) and its response comes back at once as a
    published record (``add_finished``), so while siblings decode the response is in the automaton
    twice. That is the worst case of the sync path: a record published later than at once counts
    twice for a shorter time.
    """

    name = "ours"

    def __init__(self, chain: bool = False, draft_config: dict[str, Any] | None = None, finish: str = "keep",
                 probs: bool = False, threads: int = 0):
        if finish not in FINISH_MODES:
            raise ValueError(f"finish must be one of {', '.join(FINISH_MODES)}, got {finish!r}")
        self.chain = chain
        self.draft_config = dict(draft_config or {})
        self.finish_mode = finish
        #: Drafts come with their nodes' path probabilities, ``(tokens, parents, probs)``, at the full
        #: width (``BatchDrafter.draft_nodes``: what the step policy reads), for the simulator.
        self.probs = probs
        self.threads = threads  # the index's threads (0: HISTOSPEC_THREADS' default)
        #: Wall seconds of the last batch's sync (``sync_batch``) and draft (``BatchDrafter.draft``).
        self.last_sync_s = 0.0
        self.last_draft_s = 0.0
        self.description = "histospec-sgl HistoryIndex, per-prompt GSAM, " + ("chain" if chain else "tree")
        if finish != "keep":
            self.description += f", finish={finish}"
        self.drafter: BatchDrafter | None = None
        self.timed: _TimedIndex | None = None  # the drafter's index, timed
        # Each request's prompt, the tokens it emitted that the drafter has seen and those it has not
        # (SGLang's overlap scheduler hands the worker ``output_ids``, a step behind, and the tokens
        # accepted last step), and the requests with tokens the drafter has not seen yet.
        self.texts: dict[int, tuple[list[int], list[int], list[int]]] = {}
        self.pending: set[int] = set()

    @property
    def index(self) -> HistoryIndex | None:
        """The case's index itself (not timed)."""
        return self.timed.index if self.timed is not None else None

    def reset(self, case_online_visible: bool, num_nodes: int = 16) -> None:
        knobs = tuple(self.draft_config.items()) or None
        self.drafter = BatchDrafter(num_nodes, HistoryConfig(draft_knobs=knobs, control="fixed", threads=self.threads))
        self.timed = _TimedIndex(self.drafter.index)
        self.drafter.index = self.timed  # type: ignore[assignment]
        self.texts.clear()
        self.pending.clear()

    def index_ns(self) -> tuple[int, int]:
        """Nanoseconds the index has spent drafting and updating since this case began."""
        assert self.timed is not None
        return self.timed.draft_ns, self.timed.update_ns

    def add_history(self, prompt: Sequence[int], response: Sequence[int]) -> None:
        assert self.drafter is not None
        self.drafter.add_finished(prompt, response)

    def begin(self, rid: int, prompt: Sequence[int]) -> None:
        assert self.drafter is not None
        self.texts[rid] = (list(prompt), [], [])
        self.drafter.sync(str(rid), prompt, [])

    def draft_batch(self, rids: Sequence[int], num_nodes: int) -> list[tuple[Sequence[int], ...]]:
        """One decode step's drafts for every request in ``rids``, as the worker draws them:
        ``(tokens, parents)``, or with ``probs`` ``(tokens, parents, probs)`` at the full width."""
        assert self.drafter is not None
        if num_nodes != self.drafter.d:
            raise ValueError(f"this case was reset for {self.drafter.d}-node drafts, not {num_nodes}")
        if self.chain:
            return [self.draft(rid, num_nodes) for rid in rids]
        self._sync()
        keys = [str(r) for r in rids]
        d = num_nodes
        if self.probs:
            tokens, mask, probs, counts = self.drafter.draft_nodes(keys)
            parents = tree_parents_batch(mask[: len(keys) * d * d], d)
            return [(tokens[b * d:b * d + 1 + c].tolist(), parents[b, :1 + c].tolist(),
                     probs[b * d:b * d + 1 + c].tolist()) for b, c in enumerate(counts.tolist())]
        t0 = time.perf_counter()
        tokens, mask = self.drafter.draft(keys)[:2]
        self.last_draft_s = time.perf_counter() - t0
        parents = tree_parents_batch(mask, d)
        out: list[tuple[Sequence[int], ...]] = []
        for b, key in enumerate(keys):
            n = 1 + self.drafter.drafted(key)
            out.append((tokens[b * d:b * d + n].tolist(), parents[b, :n].tolist()))
        return out

    def draft(self, rid: int, num_nodes: int) -> tuple[Sequence[int], ...]:
        assert self.drafter is not None
        if not self.chain:
            return self.draft_batch([rid], num_nodes)[0]
        self._sync()
        assert self.timed is not None
        toks, parents, _ = self.timed.draft(self.drafter.request_id(str(rid)), num_nodes, True)
        return toks, parents

    def extend(self, rid: int, tokens: Sequence[int]) -> None:
        # The worker learns a step's tokens at its next draft, for the whole batch at once.
        self.texts[rid][2].extend(tokens)
        self.pending.add(rid)

    def _sync(self) -> None:
        assert self.drafter is not None
        if self.pending:
            rids = sorted(self.pending)
            batch = [(str(r), *self.texts[r], None) for r in rids]
            t0 = time.perf_counter()
            self.drafter.sync_batch(batch)
            self.last_sync_s = time.perf_counter() - t0
            for r in rids:
                _, seen, new = self.texts[r]
                seen.extend(new)
                new.clear()
            self.pending.clear()

    def finish(self, rid: int) -> None:
        assert self.drafter is not None
        prompt, seen, new = self.texts.pop(rid)
        response = seen + new
        self.pending.discard(rid)
        # "draft-server": published, and back at once as a record.
        echo = self.drafter.add_finished if self.finish_mode == "draft-server" else None
        self.drafter.complete(str(rid), prompt, response, publish=echo)
