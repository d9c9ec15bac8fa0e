"""The draft source of the HISTORY worker, with no SGLang or torch dependency.

:class:`BatchDrafter` owns the :class:`~histospec_sgl.HistoryIndex` of one engine and turns a decode
batch (request ids, prompt ids, generated ids) into the two host arrays SGLang's NGRAM verify path
consumes: ``tokens`` int64 ``[bs*d]`` and ``mask`` int64 ``[bs*d*d]``. The contract (checked by
``tests/engine/test_plugin.py`` against SGLang's own host-side tree reconstruction):

- node 0 of each request is the root, the request's last token (its KV is not computed yet);
- nodes are in BFS order, every parent before its children;
- ``mask[b, i, j] = 1`` iff j is i or an ancestor of i; row 0 is ``[1, 0, ...]``;
- exactly d nodes per request: unused slots are a chain of token-0 pads under the last real node,
  so no node has two children with the same token (duplicate siblings would be counted twice by
  SGLang's sampling verification and bias it).

It keeps each in-flight request's context in the index in step with what SGLang has accepted (so
siblings of a group draft from each other while they decode), turns finished requests into
history of their group, measures acceptance from how far each request advanced between two steps,
and asks its step policy (:mod:`histospec_sgl.engine.policy`) whether each step drafts.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from histospec_sgl._core import HistoryIndex
from histospec_sgl.engine.config import HistoryConfig
from histospec_sgl.engine.costmodel import EngineControl, ShadowDraft, TimedFixed
from histospec_sgl.engine.draft import clear_rows, tree_parents_batch
from histospec_sgl.engine.feedback import Feedback
from histospec_sgl.engine.plan import (
    StepCounts,
    StepPlan,
    greedy_classes,
    plan_step,
    sure_conditional,
    width_promises,
)
from histospec_sgl.engine.policy import StepPolicy
from histospec_sgl.engine.remaining import GroupLengths
from histospec_sgl.engine.remaining import room as cap_room
from histospec_sgl.hugepages import TUNABLE, huge_pages

logger = logging.getLogger("histospec_sgl.plugin")

#: ``sampling_params.custom_params`` key a client sets to choose a request's group.
GROUP_PARAM = "histospec_group"


def group_of(custom_params: Any) -> int | None:
    """The group key a client chose in ``custom_params["histospec_group"]`` by the one rule
    (:func:`histospec_sgl.group_key`: an int in [-2**63, 2**64) is the key, a string names a
    group), the same on every rank, engine and run; None if unset.

    Raises:
        ValueError: a value of another type or out of range, naming the parameter.
    """
    if not custom_params or GROUP_PARAM not in custom_params:
        return None
    from histospec_sgl import group_key

    try:
        return group_key(group=custom_params[GROUP_PARAM])
    except ValueError as e:
        raise ValueError(f"{GROUP_PARAM}: {e}") from None


def narrow(tokens: np.ndarray, mask: np.ndarray, order: np.ndarray, bs: int, d: int, width: int
           ) -> tuple[np.ndarray, np.ndarray]:
    """The width-``width`` drafts of a batch's d-node drafts: each request's root and its
    ``width - 1`` most probable nodes (``order``: nodes 1..d-1 by path probability, most probable
    first, as indices from 0). A node's path probability is at most its parent's, so the nodes kept
    are a subtree; kept in their BFS order, with the mask restricted to them (pads, of probability 0,
    are kept in order from the top of their chain)."""
    keep = np.concatenate([np.zeros((bs, 1), dtype=np.int64), np.sort(order[:, : width - 1], axis=1) + 1], axis=1)
    t = np.take_along_axis(tokens.reshape(bs, d), keep, axis=1)
    m = mask.reshape(bs, d, d)[np.arange(bs)[:, None, None], keep[:, :, None], keep[:, None, :]]
    return t.reshape(-1).copy(), m.reshape(-1).copy()


@dataclasses.dataclass
class _Live:
    iid: int  # the index's integer request id
    known: int  # response tokens the index holds for it
    last: int  # its last token (the root of its next draft)
    drafted: int = 0  # real draft nodes (root excluded) offered at its last draft
    accepted: int = 0  # draft tokens accepted so far
    offered: int = 0  # draft nodes offered so far
    steps: int = 0  # verify steps it took part in
    group: int | None = None  # the group it was started in (None: its prompt's key)
    klass: str | None = None  # its request class at its last draft (greedy, sampled)
    key: int = 0  # its group's key in the index


class StepDraft(NamedTuple):
    """A decode step's draft, whole: what the engine's worker runs. ``tokens`` (int64[bs*w]) and
    ``mask`` (int64[bs*w*w], each node's ancestors) at the step's verify ``width`` w (1: plain
    decoding, each request's root alone); ``drafted``: whether any request has a draft node (False:
    a verify would accept nothing, so the step may as well decode plainly)."""

    tokens: np.ndarray
    mask: np.ndarray
    width: int
    drafted: bool

    @property
    def roots(self) -> np.ndarray:
        """Each request's root: its last accepted token, the one a plain step decodes."""
        return self.tokens[:: self.width]



class BatchDrafter:
    """History drafting for one engine (one per process; only TP rank 0 builds one).

    Args:
        draft_tokens: d, the verify width (root included); SGLang's ``speculative_num_draft_tokens``.
        config: the ``HISTOSPEC_*`` settings.
        vocab_size: the model's vocabulary size (token ids are checked against it).
    """

    def __init__(self, draft_tokens: int, config: HistoryConfig | None = None,
                 vocab_size: int | None = None):
        if draft_tokens < 1:
            raise ValueError(f"draft_tokens must be >= 1, got {draft_tokens}")
        self.d = draft_tokens
        self.config = config or HistoryConfig()
        if self.config.huge_pages == "1" and not huge_pages():
            logger.warning("histospec: HISTOSPEC_HUGE_PAGES=1 is not in force: this process did not start "
                           "with GLIBC_TUNABLES=%s (set it, or set HISTOSPEC_HUGE_PAGES before the engine "
                           "starts), or its C library has no such switch (glibc >= 2.35 on Linux); the "
                           "index uses ordinary pages", TUNABLE)
        self.index = HistoryIndex(vocab_size=vocab_size, **self.config.index_kwargs())
        #: A greedy chain node's conditional probability that counts whole (:func:`width_promises`).
        self._sure = sure_conditional(self.index.draft_config())
        #: Whether each step drafts: ``HISTOSPEC_CONTROL=fixed``, always d; ``cost`` (the default), the
        #: width the measured step costs and the drafts' promised acceptance say gives more tokens per
        #: second (:class:`EngineControl`, whose clock the engine's worker feeds).
        self.policy: StepPolicy = (EngineControl(draft_tokens) if self.config.control == "cost" else
                                   TimedFixed(draft_tokens))
        #: Whether the last :meth:`draft` drafted (False: the policy chose plain decoding).
        self.drafting = True
        #: The verify width of the last :meth:`draft` (1: plain decoding; d: the widest).
        self.width = draft_tokens
        #: What the policy learns from: the promises of each step's drafts, the verified steps'
        #: acceptance (overlap scheduling verifies a step after the next one is drafted) and the
        #: shadow drafts of plain steps, by request (its index id).
        self.feedback = Feedback(self.policy, draft_tokens)
        self._live: dict[str, _Live] = {}
        #: Each group's finished lengths, for how long a request has left to run.
        self.lengths = GroupLengths(self.index)
        self._next_iid = 1
        self._tokens = np.zeros(0, dtype=np.int64)
        self._mask = np.zeros(0, dtype=np.int64)
        self._counts = np.zeros(0, dtype=np.int64)
        self._probs = np.zeros(0, dtype=np.float32)
        #: What the decode steps did since the start, and since the last :meth:`take_window`.
        self.totals = StepCounts()
        self._window = StepCounts()
        #: Each live request's response tokens as the index holds them, for the worker's check that
        #: they are what SGLang holds (``HISTOSPEC_CHECK_CONTEXT=1``; None when off).
        self.contexts: dict[str, list[int]] | None = {} if self.config.check_context == "1" else None

    # -- history in and out -------------------------------------------------------------------

    def load(self, path: str | Path) -> int:
        """Loads history: an index snapshot (replaces the history), or token-id JSONL(.gz) whose
        lines are ``{"prompt_ids": [...], "response_ids": [...], "group"?: int, "version"?: int}``
        (added to it). Returns the number of responses the index holds afterwards."""
        p = Path(path)
        name = p.name.lower()
        if name.endswith((".jsonl", ".jsonl.gz")):
            opener = gzip.open if name.endswith(".gz") else open
            with opener(p, "rt", encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                        version = rec.get("version")
                        self.index.add_response(rec.get("group"), rec["prompt_ids"], rec["response_ids"],
                                                version=self.index.version if version is None else version)
                    except (KeyError, TypeError, ValueError) as e:
                        raise ValueError(f"{p}:{n}: not a history record ({e})") from None
        else:
            self.index.load(p)
        return int(self.index.stats()["responses"])

    def save(self, path: str | Path) -> None:
        """Saves the index (history only; requests in flight are not part of a snapshot)."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        self.index.save(p)

    # -- the request stream ---------------------------------------------------------------------

    def sync(self, rid: str, prompt_ids: Sequence[int], response: Sequence[int],
             group: int | None = None, pending: Sequence[int] = ()) -> None:
        """Brings request ``rid``'s context up to ``prompt_ids + response + pending`` (what SGLang has
        accepted, last token included; ``pending``: tokens accepted but not yet in ``response``, as in
        SGLang's overlap mode), starting it in ``group`` (None: the prompt's key) if it is new."""
        self.sync_batch([(rid, prompt_ids, response, pending, group)])

    def sync_batch(self, requests: Iterable[tuple[str, Sequence[int], Sequence[int], Sequence[int],
                                                  int | None]]) -> list[int]:
        """:meth:`sync` for a whole decode batch, with one call into the index for all the new tokens.
        Each item is ``(rid, prompt_ids, response, pending, group)``; only the tokens past what the
        index already holds are read, so a step costs O(new tokens), not O(response length).

        ``group`` is read only when ``rid`` starts; a request whose context got shorter (SGLang
        retracted it) starts again from its prompt in the group it began in. Returns the group keys
        of the requests that started here (a draft server is asked for those groups' history).
        """
        todo: list[tuple[_Live, int, list[int]]] = []
        started: list[int] = []
        contexts = self.contexts
        for rid, prompt_ids, response, pending, group in requests:
            live = self._live.get(rid)
            if live is None:
                if contexts is not None:
                    contexts[rid] = []
                iid = self._next_iid
                self._next_iid += 1
                key = self.index.begin_request(iid, group, prompt_ids)
                started.append(key)
                live = self._live[rid] = _Live(iid=iid, known=0, last=int(prompt_ids[-1]), group=group, key=key)
            head = len(response)
            n = head + len(pending)
            last = pending[-1] if len(pending) else response[-1] if head else prompt_ids[-1]
            if n < live.known or (n == live.known and int(last) != live.last):
                # SGLang rewound the request (retraction), or the context handed in disagrees with
                # what the index holds: start its context again, since the root of the next draft
                # must be the request's real last token. (Its old tokens leave the automaton when
                # the group is next rebuilt: a retraction under memory pressure hits many requests
                # at once, and rebuilding a group for each would stall the scheduler.)
                self.index.finish_request(live.iid, keep=False, defer_removal=True)
                self.index.begin_request(live.iid, live.group, prompt_ids)
                live.known = 0
                live.last = int(prompt_ids[-1])
                live.drafted = 0
                self.feedback.finished(live.iid, complete=False)
                if contexts is not None:
                    contexts[rid] = []
            if n > live.known:
                k = live.known
                new = list(response[k:]) + list(pending) if k < head else list(pending[k - head:])
                todo.append((live, n, new))
                if contexts is not None:
                    contexts[rid].extend(int(t) for t in new)
        if not todo:
            return started
        self.index.extend_batch([lv.iid for lv, _, _ in todo], [t for _, _, new in todo for t in new],
                                [len(new) for _, _, new in todo])
        for live, n, new in todo:
            self._advanced(live, n, new[-1], new)
        return started

    def _advanced(self, live: _Live, n: int, last: int, new: Sequence[int]) -> None:
        """The index now holds ``n`` response tokens of ``live``, the last one ``last`` (``new``: the
        tokens added, which a shadow draft follows)."""
        self.feedback.advanced(live.iid, new)
        if live.steps:
            # It advanced by (accepted + 1) since its last verify step (less at a stop).
            acc = max(min(n - live.known - 1, live.drafted), 0)
            live.accepted += acc
            self._window.accepted += acc
            self.totals.accepted += acc
        live.known = n
        live.last = int(last)

    def finish(self, rid: str, response: Sequence[int] | None = None, *, keep: bool = True) -> None:
        """Request ``rid`` is done: its response (brought up to ``response`` first when given) becomes
        history of its group when ``keep``; an unknown ``rid`` is ignored. An unkept response leaves
        the index when its group is next rebuilt (``defer_removal``: at the latest when the group's
        last request finishes), so that finishing, which with a draft server every request does
        unkept, never rebuilds a group per request."""
        live = self._live.pop(rid, None)
        if self.contexts is not None:
            self.contexts.pop(rid, None)
        if live is None:
            return
        if response is not None and len(response) > live.known:
            new = response[live.known:]
            self.index.extend_request(live.iid, new)
            self._advanced(live, len(response), response[-1], new)
        self.feedback.finished(live.iid, complete=response is not None)
        self.index.finish_request(live.iid, keep=keep, defer_removal=not keep)
        self.totals.finished += 1
        self.totals.kept += int(keep)

    def add_finished(self, prompt_ids: Sequence[int], response: Sequence[int], group: int | None = None,
                     version: int | None = None) -> None:
        """A response that never reached a decode step (e.g. one token long) becomes history."""
        if len(response):
            self.index.add_response(group, prompt_ids, response,
                                    version=self.index.version if version is None else version)

    def complete(self, rid: str, prompt_ids: Sequence[int], response: Sequence[int], *, keep: bool = True,
                 group: int | None = None,
                 publish: Callable[[Sequence[int], Sequence[int], int | None], None] | None = None) -> None:
        """Request ``rid`` finished with ``response``: the one place that decides what a finished
        request does with the history (the SGLang worker, the replay and the benchmarks call it).

        ``keep`` False (an aborted request, one that came back after it was finished): nothing of it
        becomes history. Otherwise, with ``publish`` (a draft server's publisher: ``(prompt_ids,
        response, group)``) the response goes there and comes back through the subscription, so the
        request's own copy leaves the index unkept; without, the request's copy becomes history of
        its group in place, unless the index never saw it (it never reached a decode step) or holds
        tokens past the response's end (a step that accepted several tokens ran past a stop string,
        EOS or ``max_new_tokens``): then the response is added afresh and the copy let go."""
        live = self.is_live(rid)
        overshot = live and self.held(rid) > len(response)
        self.finish(rid, response, keep=keep and publish is None and not overshot)
        if not keep:
            return
        if publish is not None:
            publish(prompt_ids, response, group)
        elif not live or overshot:
            self.add_finished(prompt_ids, response, group)

    @property
    def width_steps(self) -> dict[int, int]:
        """Decode steps at each verify width since the start (1: plain decoding)."""
        return self.totals.width_steps

    def held(self, rid: str) -> int:
        """Response tokens the index holds for live request ``rid``."""
        return self._live[rid].known

    def is_live(self, rid: str) -> bool:
        return rid in self._live

    def request_id(self, rid: str) -> int:
        """The index's id of live request ``rid`` (for calls on :attr:`index` itself)."""
        return self._live[rid].iid

    def drafted(self, rid: str) -> int:
        """Draft nodes (root excluded) offered to live request ``rid`` at the last :meth:`draft`."""
        return self._live[rid].drafted

    def live(self) -> set[str]:
        return set(self._live)

    # -- drafting -------------------------------------------------------------------------------

    def draft(self, rids: Sequence[str], classes: Sequence[str | None] | None = None,
              width: int | None = None, waiting: int = 0, caps: Sequence[int | None] | None = None,
              ended: Sequence[bool] | None = None) -> StepDraft:
        """Drafts for a decode batch whose requests were all :meth:`sync`-ed this step, at the width
        the step policy chooses (:attr:`width`). ``classes``: each request's class (``"greedy"``,
        ``"sampled"``), which the cost model calibrates apart.

        Returns the step's :class:`StepDraft`, its tokens and mask at the chosen width w: at d, views into
        buffers that the next call reuses (SGLang copies them to the device right away); at a
        narrower width, each request's w - 1 most probable nodes (the index grows drafts best-first by
        path probability, so they form a subtree, kept in BFS order); at 1 (plain decoding), each
        request's root. ``width``: this width instead of the policy's choice (d where the caller's
        verify path runs only d, e.g. SGLang's grammar batches). ``waiting``: requests waiting for a
        slot in the engine; ``caps``: each request's ``max_new_tokens`` (None: none), which with its
        group's finished lengths says how long it has left (:mod:`~histospec_sgl.engine.remaining`;
        :func:`~histospec_sgl.engine.plan.plan_step`); ``ended``: each request that has ended (by the
        step before's tokens, under overlap scheduling): no draft, no promise, nothing left."""
        bs, d = len(rids), self.d
        t0 = time.perf_counter()
        tokens, mask, counts = self._buffers(bs)
        lives = [self._live[r] for r in rids]
        klasses: list[str | None] = list(classes) if classes is not None else [None] * bs
        iids = np.fromiter((lv.iid for lv in lives), dtype=np.int64, count=bs)
        gone = np.flatnonzero(np.asarray(ended, dtype=bool)) if ended is not None and any(ended) else None
        if self.policy.reads_promises:
            probs = self._probs[: bs * d]
            nonempty = self._index_drafts(iids, tokens, mask, counts, gone, probs)
            # Each request's nodes by path probability, most probable first (pads have probability 0),
            # and what they promise at each width (cum[:, w-2]); nodes past a request's cap promise nothing.
            greedy = np.fromiter((k == "greedy" for k in klasses), dtype=bool, count=bs)
            room = cap_room(caps, [lv.known for lv in lives])
            order, cum = width_promises(probs.reshape(bs, d), mask, greedy, self._sure, room)
            by_width = {w: cum[:, w - 2] for w in range(2, d + 1)}
            klasses = greedy_classes(klasses, greedy, cum, room)
        else:
            order, cum, by_width, room = None, None, {}, None
            counts[:] = 0  # drafted below, once the width is known
        for lv, k in zip(lives, klasses):
            lv.klass = k
        # How long each request has left, where the batch is all there is to decode (the plan credits
        # a step's fixed part by the promise of the request expected to end last).
        left = (np.array(self.lengths.remaining([lv.key for lv in lives], [lv.known for lv in lives], caps))
                if self.policy.reads_promises and waiting <= 0 and bs > 1 else None)
        if left is not None and gone is not None:
            left[gone] = 0.0
        plan = plan_step(self.policy, self.feedback, by_width, klasses if classes is not None else None,
                         counts > 0, iids.tolist(), forced=width, waiting=waiting, remaining=left)
        width = plan.width
        if width > 1 and not self.policy.reads_promises:
            nonempty = self._index_drafts(iids, tokens, mask, counts, gone)
        if plan.shadowed:
            assert cum is not None and order is not None
            self._shadow(plan, lives, tokens, mask, cum, counts, order)
        drafting = width > 1
        self.drafting = drafting
        self.width = width
        self.feedback.drafted(width, plan.promises.tolist(), klasses, room)
        if not drafting:
            # A plain step: each request's root alone.
            roots = np.fromiter((lv.last for lv in lives), dtype=np.int64, count=bs)
            tokens, mask = roots, np.ones(bs, dtype=np.int64)
            counts[:] = 0
            nonempty = 0
        elif width < d:
            assert order is not None
            tokens, mask = narrow(tokens, mask, order, bs, d, width)
            np.minimum(counts, width - 1, out=counts)
            nonempty = int(np.count_nonzero(counts))
        for lv, c in zip(lives, counts.tolist()):
            lv.drafted = c
            lv.offered += c
            lv.steps += 1
        dt = time.perf_counter() - t0
        for c in (self._window, self.totals):  # an ended request is not decoding: no request-step
            c.step(width, bs - (0 if gone is None else len(gone)), nonempty, int(counts.sum()), dt, waiting)
        return StepDraft(tokens, mask, width, nonempty > 0)

    def _index_drafts(self, iids: np.ndarray, tokens: np.ndarray, mask: np.ndarray, counts: np.ndarray,
                      gone: np.ndarray | None, probs: np.ndarray | None = None) -> int:
        """The index's d-node drafts of the batch's requests into its buffers, emptied for the rows
        ``gone`` (requests that have ended); returns how many requests have a draft node."""
        nonempty, _ = self.index.draft_batch(iids, self.d, tokens, mask, probs, counts)
        return int(nonempty) if gone is None else clear_rows(tokens, mask, counts, gone, self.d, probs)

    def _buffers(self, bs: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The draft buffers for ``bs`` requests (tokens, mask, counts; :attr:`_probs` beside them),
        grown when the batch outgrows them."""
        d = self.d
        if self._tokens.size < bs * d:
            cap = max(bs, 8) * 2
            self._tokens = np.zeros(cap * d, dtype=np.int64)
            self._mask = np.zeros(cap * d * d, dtype=np.int64)
            self._counts = np.zeros(cap, dtype=np.int64)
            self._probs = np.zeros(cap * d, dtype=np.float32)
        return self._tokens[: bs * d], self._mask[: bs * d * d], self._counts[:bs]

    def draft_nodes(self, rids: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every request's d-node draft with its nodes' path probabilities, the drafts the step policy
        reads before it chooses a width, without choosing one or counting a step (the offline
        simulator narrows them to each width itself). Returns ``(tokens [bs*d], mask [bs*d*d],
        probs [bs*d], counts [bs])``, views into buffers the next call reuses."""
        bs, d = len(rids), self.d
        tokens, mask, counts = self._buffers(bs)
        probs = self._probs[: bs * d]
        iids = np.fromiter((self._live[r].iid for r in rids), dtype=np.int64, count=bs)
        self.index.draft_batch(iids, d, tokens, mask, probs, counts)
        return tokens, mask, probs, counts

    def _shadow(self, plan: StepPlan, lives: list[_Live], tokens: np.ndarray, mask: np.ndarray, cum: np.ndarray,
                counts: np.ndarray, order: np.ndarray) -> None:
        """Starts the plan's shadow drafts (:attr:`StepPlan.shadowed`): each request's widest draft,
        followed along the tokens it goes on to produce, to measure what verifying it at each of the
        plan's :attr:`~StepPlan.measured` widths would have accepted against what it promised there
        (``cum``, :func:`width_promises`; ``order``, the nodes most probable first)."""
        d, bs = self.d, len(lives)
        parents = tree_parents_batch(mask, d)  # the whole batch in one pass, once a step
        ranks = np.empty_like(order)
        np.put_along_axis(ranks, order, np.arange(d - 1)[None, :], axis=1)
        for b in plan.shadowed:
            lv = lives[b]
            n = int(counts[b])
            promised = {w: float(cum[b, min(w - 1, n) - 1]) for w in plan.measured}
            draft = ShadowDraft(tokens[b * d: b * d + n + 1].tolist(), parents[b, : n + 1].tolist(),
                                [-1, *ranks[b, :n].tolist()], promised, width=plan.shadow if plan.shadow > 1 else None)
            self.feedback.shadow(lv.iid, draft, lv.klass, batch=bs)

    def observe_step(self, accepted: Iterable[int]) -> None:
        """Accepted draft tokens per request of a verified batch (SGLang's
        ``on_verify_complete_cpu``); feeds the step policy."""
        self.feedback.verified(accepted)

    def take_window(self) -> dict[str, float]:
        """Counters since the last call (for the periodic log line), then resets them."""
        w = self._window
        out = dict(
            steps=w.steps,
            batch=w.request_steps / max(w.steps, 1),
            accept_len=1.0 + w.accepted / max(w.request_steps, 1),
            coverage=w.covered / max(w.request_steps, 1),
            draft_ms=1e3 * w.draft_seconds / max(w.steps, 1),
        )
        self._window = StepCounts()
        return out
