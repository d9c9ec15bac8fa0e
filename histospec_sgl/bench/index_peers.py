"""Peers of ``histospec-sgl bench index``, run in the same process on the same workload.

``sglang-sam-prob`` / ``sglang-sam-bfs``: SGLang's NGRAM suffix automaton, the one its engine builds
for an external corpus (``NgramCorpus.load_external_corpus_named`` with ``external_sam_budget`` > 0),
one corpus per prompt holding the prompt and its epoch-1 responses, drafted with its frequency heap
(PROB) or its default recency BFS. The trie gets no budget (SGLang's online trie is global and is
measured by ``histospec-sgl replay``). SGLang matches the last ``max_trie_depth`` = 18 tokens.
Needs sglang (``.venv-sglang``) and a C++ compiler: the corpus is JIT-built on first use.

Metrics as for ours (``index_bench``): ingest and RSS growth, the 256-request batch draft per step
(one ``batch_get`` per request from Python, as SGLang's worker calls it per batch; binding overhead
included), greedy chain acceptance at k=16 at every position and simulated tokens per verify step
with 16-node trees. Acceptance drives each peer through its replay adapter (``replay.methods``
``SGLangNgram`` over the bench's corpora, ``replay.arctic.ArcticMethod`` over its stores), the one
``histospec-sgl replay`` drives, and so does the timing (:func:`peer_latency`): 256 requests, one per
prompt, decode their epoch-2 responses together through the replay's loop, and each step's time in
the peer's own calls (its batch call where it has one) is what its method counts
(``index_ns``), as ours counts its index's. The classes here build each peer's stores (the ingest
and memory measured) and say which replay methods drive them.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from histospec_sgl.bench.workload import Workload
from histospec_sgl.replay.measure import Clocks, Track, replay
from histospec_sgl.replay.methods import Method
from histospec_sgl.replay.peers import PerPrompt, SGLangNgram, inserted, sglang_ngram_corpus_class

DEPTH = 18
#: Draft nodes (root included) and chain length, as for ours.
D = 16
K = 16
#: Nodes SGLang's corpora return per draft (root included): its 16 draft tokens, one more than ours.
SGLANG_NODES = D + 1


def _longest_path(tokens: Any, parents: Any) -> list[int]:
    """The tokens of a tree's longest root-to-leaf path (root excluded)."""
    depth = np.zeros(len(tokens), dtype=np.int64)
    for i in range(1, len(tokens)):
        if parents[i] >= 0:
            depth[i] = depth[parents[i]] + 1
    leaf = int(np.argmax(depth))
    path = []
    while leaf > 0:
        path.append(int(tokens[leaf]))
        leaf = int(parents[leaf])
    path.reverse()
    return path


def _matching(chain: Any, truth: Any, pos: int) -> int:
    """How many leading tokens of ``chain`` equal ``truth[pos:]``."""
    acc = 0
    for t in chain:
        if pos + acc >= len(truth) or t != truth[pos + acc]:
            break
        acc += 1
    return acc


def _chain_accept(draft: tuple, truth: Any, pos: int) -> int:
    """How many leading tokens of the draft's longest path (at most ``K``) equal ``truth[pos:]``."""
    return _matching(_longest_path(draft[0], draft[1])[:K], truth, pos)


def replay_acceptance(w: Workload, prompts: int, method: Callable[[int, str], Method],
                      chain_nodes: int = K + 1, tree_nodes: int = D) -> dict[str, float]:
    """Acceptance of ours or a peer on 2 epoch-2 responses of each of the first ``prompts`` prompts,
    through the replay's loop (:func:`~histospec_sgl.replay.measure.replay`), each response alone
    and from its first decoded token (the prefill's token is known, as in the engine).
    ``method(p, kind)``: the replay adapter (:class:`~histospec_sgl.replay.methods.Method`) holding
    prompt ``p``'s history, for one response; ``kind`` "chain" (its ``chain_nodes``-node draft's
    longest path, at most k = 16 tokens, is read at every position: ``accepted_per_position_k16``)
    or "tree" (a ``tree_nodes``-node tree per verify step, accepted greedily and advanced by
    accepted + 1: ``tokens_per_verify_step_d16``, ``draft_coverage_d16`` and the drafting time per
    call, ``replay_draft_us_per_call``)."""
    acc_sum = positions = steps = toks = nonempty = draft_ns = 0
    for p in range(min(prompts, len(w.prompts))):
        prompt = w.prompts[p].tolist()
        for j in range(2):
            truth = w.epoch2(p, j).tolist()
            rid = 2 * p + j
            m = method(p, "chain")
            for batch in replay(m, [Track(rid, prompt, truth)], chain_nodes, every_position=True,
                                accept=_chain_accept):
                acc_sum += sum(s.accepted for s in batch)
                positions += len(batch)
            m = method(p, "tree")
            clocks = Clocks(m)
            for batch in replay(m, [Track(rid, prompt, truth)], tree_nodes, clocks=clocks):
                steps += len(batch)
                toks += sum(s.emit for s in batch)
                nonempty += sum(len(s.draft[0]) > 1 for s in batch)
            draft_ns += clocks.draft_ns
            # A peer's per-prompt store can be large (SGLang's smallest corpus pool is about 190 MB):
            # each goes before the next is built.
            del m
    return {
        "accepted_per_position_k16": acc_sum / positions,
        "tokens_per_verify_step_d16": toks / steps,
        "draft_coverage_d16": nonempty / steps,
        "replay_draft_us_per_call": draft_ns / steps / 1e3,
        "positions": positions,
        "verify_steps": steps,
    }


def _by_prompt(w: Workload) -> dict[tuple[int, ...], int]:
    """Each prompt's index by its tokens (a :class:`~histospec_sgl.replay.peers.PerPrompt` key)."""
    return {tuple(int(t) for t in prompt): p for p, prompt in enumerate(w.prompts)}


def timed_steps(method: Any, w: Workload, n: int, nodes: int, steps: int, warm: int = 500) -> tuple[list[int], list[int]]:
    """Nanoseconds per step drafting and updating, as ``method`` counts its store's calls: the
    epoch-2 responses of the first ``n`` prompts (one request each, from their token ``warm`` on)
    decode together through the replay's loop (:func:`~histospec_sgl.replay.measure.replay`) with
    ``nodes``-node drafts, for ``steps`` steps. A step's update is what comes between its draft and
    the next (its tokens appended, and the windows a trie inserts before drafting)."""
    tracks = [Track(p, w.prompts[p].tolist(), w.epoch2(p, 0).tolist(), start=warm) for p in range(n)]
    clocks = Clocks(method)
    drafts: list[int] = []
    updates: list[int] = []
    d0 = u0 = 0
    run = replay(method, tracks, nodes, clocks=clocks)
    for i, _ in enumerate(run):
        if i:
            updates.append(clocks.update_ns - u0)
        if i == steps:
            break
        drafts.append(clocks.draft_ns - d0)
        d0, u0 = clocks.draft_ns, clocks.update_ns
    run.close()
    return drafts, updates


def peer_latency(w: Workload, n: int, steps: int, tree: Any, tree_nodes: int, chain: Any = None,
                 chain_nodes: int = 0, update: bool = True) -> dict[str, float]:
    """A peer's per-step times on ``n`` requests (:func:`timed_steps`), medians in ms: its ``tree``
    method's drafts (``batch_draft_ms_per_step``) and updates (``update_ms_per_step``, unless the
    store takes no request output), and its ``chain`` method's drafts (``batch_chain_ms_per_step``)."""
    n = min(n, len(w.prompts))
    ms = lambda xs: float(np.median(xs) / 1e6)  # noqa: E731
    drafts, updates = timed_steps(tree, w, n, tree_nodes, steps)
    out = {"batch_draft_ms_per_step": ms(drafts)}
    if update:
        out["update_ms_per_step"] = ms(updates)
    if chain is not None:
        out["batch_chain_ms_per_step"] = ms(timed_steps(chain, w, n, chain_nodes, steps)[0])
    return out


class SGLangSAM:
    """One SGLang ``NgramCorpus`` per prompt, drafting only from its external-corpus SAM."""

    def __init__(self, match_type: str) -> None:
        self.cls = sglang_ngram_corpus_class()
        self.match_type = match_type
        self.name = f"sglang-sam-{match_type.lower()}"

    def _corpus(self, nodes: int, breadth: tuple[int, int]) -> Any:
        return self.cls(max_trie_depth=DEPTH, min_bfs_breadth=breadth[0], max_bfs_breadth=breadth[1],
                        draft_token_num=nodes, match_type=self.match_type, capacity=64,
                        external_sam_budget=nodes - 1, external_corpus_max_tokens=1 << 40)

    def build(self, w: Workload, nodes: int, breadth: tuple[int, int]) -> list[Any]:
        out = []
        for p, prompt in enumerate(w.prompts):
            c = self._corpus(nodes, breadth)
            docs = [prompt.tolist()] + [r.tolist() for r in w.epoch1[p]]
            n = c.load_external_corpus_named(f"prompt-{p}", docs)
            c.commit_external_corpus_load(f"prompt-{p}", n)
            out.append(c)
        return out

    def run(self, w: Workload, rss: Callable[[], int], steps: int, acc_prompts: int,
            latency_requests: int, measure_ingest: bool = True) -> dict[str, Any]:
        """``measure_ingest``: time the build and take its RSS growth. Only the first automaton of a
        process gives a fair figure: a second one reuses memory the C++ allocator kept from the
        first (and the match type does not change the automaton)."""
        ntok = sum(len(r) for rs in w.epoch1 for r in rs)
        gc.collect()
        r0 = rss()
        t = time.perf_counter()
        tree = self.build(w, SGLANG_NODES, (1, 10))
        dt = time.perf_counter() - t
        res: dict[str, Any] = {}
        if measure_ingest:
            res["ingest_tokens_per_s"] = ntok / dt
            res["bytes_per_token"] = (rss() - r0) / ntok
        chain = self.build(w, SGLANG_NODES, (1, 1))
        if latency_requests:
            res.update(self._latency(w, tree, chain, steps, latency_requests))
        res.update(self._acceptance(w, tree, chain, acc_prompts))
        return res

    def _latency(self, w: Workload, tree: list[Any], chain: list[Any], steps: int, n: int) -> dict[str, float]:
        route = _by_prompt(w)

        def over(corpora: list[Any]) -> PerPrompt:  # immutable once built: no request output goes in
            return PerPrompt(self.name, lambda key: SGLangNgram(corpus=corpora[route[key]], nodes=SGLANG_NODES,
                                                                insert_own=False))

        return peer_latency(w, n, steps, over(tree), SGLANG_NODES, over(chain), SGLANG_NODES, update=False)

    def _acceptance(self, w: Workload, tree: list[Any], chain: list[Any], prompts: int) -> dict[str, float]:
        # The SAM cannot take the request's own output (immutable after its build).
        def method(p: int, kind: str) -> SGLangNgram:
            return SGLangNgram(corpus=(chain if kind == "chain" else tree)[p], nodes=SGLANG_NODES, insert_own=False)

        return replay_acceptance(w, prompts, method, SGLANG_NODES, SGLANG_NODES)


class SGLangTriePeer:
    """SGLang's NGRAM trie (its ``NgramCorpus`` without a SAM budget: the index its engine drafts from
    online), with SGLang's defaults: BFS, depth 18, breadth 1..10; 17 nodes like the SAM peers.

    - Ingest, memory and the per-step times: one corpus for every request at SGLang's default
      capacity (10 M nodes, least-recently-used nodes evicted), holding W1's history the way its
      worker inserts text (each response behind its prompt's last 18 tokens). Per step, as its
      worker does: one ``batch_put`` of every request's last 18 tokens (the update, with the insert
      thread waited for) and one ``batch_get`` for all 256 requests (the tree draft).
    - Acceptance: a corpus per prompt holding that prompt's history only (the replay's best peer,
      ``sglang_trie_per_prompt``), one drafting trees and one chains (breadth 1); the request's own
      output goes in as the worker inserts it. A per-prompt corpus costs about 190 MB at SGLang's
      smallest default pool, so they are built one prompt at a time.
    Needs sglang (``.venv-sglang``); the corpus is JIT-built on first use."""

    name = "sglang-trie-bfs"

    def __init__(self) -> None:
        self.cls = sglang_ngram_corpus_class()

    def _corpus(self, breadth: tuple[int, int], capacity: int) -> Any:
        return self.cls(max_trie_depth=DEPTH, min_bfs_breadth=breadth[0], max_bfs_breadth=breadth[1],
                        draft_token_num=SGLANG_NODES, match_type="BFS", capacity=capacity,
                        external_sam_budget=0, external_corpus_max_tokens=0)

    @staticmethod
    def _history(c: Any, w: Workload, p: int) -> None:
        c.batch_put([inserted(w.prompts[p], r, DEPTH) for r in w.epoch1[p]])

    def run(self, w: Workload, rss: Callable[[], int], steps: int, acc_prompts: int,
            latency_requests: int, measure_ingest: bool = True) -> dict[str, Any]:
        ntok = sum(len(r) for rs in w.epoch1 for r in rs)
        res: dict[str, Any] = {}
        if latency_requests or measure_ingest:
            gc.collect()
            r0 = rss()
            t = time.perf_counter()
            c = self._corpus((1, 10), 10_000_000)
            for p in range(len(w.prompts)):
                self._history(c, w, p)
            c.synchronize()
            dt = time.perf_counter() - t
            if measure_ingest:
                res["ingest_tokens_per_s"] = ntok / dt
                res["bytes_per_token"] = (rss() - r0) / ntok
            if latency_requests:
                res.update(self._latency(w, c, steps, latency_requests))
            del c
        res.update(self._acceptance(w, acc_prompts))
        return res

    def _latency(self, w: Workload, c: Any, steps: int, n: int) -> dict[str, float]:
        # One corpus for every request, each request's window inserted every step, as the worker does.
        return peer_latency(w, n, steps, SGLangNgram(corpus=c, nodes=SGLANG_NODES), SGLANG_NODES)

    def _acceptance(self, w: Workload, prompts: int) -> dict[str, float]:
        def method(p: int, kind: str) -> SGLangNgram:
            c = self._corpus((1, 1) if kind == "chain" else (1, 10), 1_000_000)
            self._history(c, w, p)
            return SGLangNgram(corpus=c, nodes=SGLANG_NODES)  # the output goes in as the worker inserts it

        return replay_acceptance(w, prompts, method, SGLANG_NODES, SGLANG_NODES)


class ArcticPeer:
    """ArcticInference's SuffixDecoding (arctic-inference 0.3.0, ``histospec_sgl.replay.arctic``).

    ``arctic-per-prompt``: Arctic's trees per prompt (``PerPromptTrees``: the prompt and its
    epoch-1 responses, and a tree per request for its prompt and output), drafted with Arctic's
    best settings of anchors.md (``max_spec_factor`` 4; chains for k=16, best-first trees for d=16).
    ``arctic-global``: the shipped ``SuffixDecodingCache`` as ArcticInference's vLLM runner drives
    it (``SharedCache``: one global tree of every response of every prompt, one tree per active
    request, shipped settings: factor 1, chains). Both speculate on the last 64 tokens, one call per
    request from Python (Arctic has no batch call)."""

    def __init__(self, per_prompt: bool) -> None:
        from histospec_sgl.replay import arctic

        self.arctic = arctic
        self.per_prompt = per_prompt
        self.name = "arctic-per-prompt" if per_prompt else "arctic-global"
        self.chain_s = arctic.SpecSettings(factor=4.0) if per_prompt else arctic.SHIPPED
        self.tree_s = arctic.BEST if per_prompt else arctic.SHIPPED

    def build(self, w: Workload) -> list[Any]:
        """Per prompt, the store that serves it: a ``PerPromptTrees`` each, or one shared cache."""
        if self.per_prompt:
            stores: list[Any] = [self.arctic.PerPromptTrees() for _ in w.prompts]
        else:
            shared = self.arctic.SharedCache()
            stores = [shared] * len(w.prompts)
        for p, prompt in enumerate(w.prompts):
            for r in w.epoch1[p]:
                stores[p].add(prompt, r)
        return stores

    def run(self, w: Workload, rss: Callable[[], int], steps: int, acc_prompts: int,
            latency_requests: int, measure_ingest: bool = True) -> dict[str, Any]:
        ntok = sum(len(r) for rs in w.epoch1 for r in rs)
        gc.collect()
        r0 = rss()
        t = time.perf_counter()
        stores = self.build(w)
        dt = time.perf_counter() - t
        res: dict[str, Any] = {"settings_k16": self.chain_s.label(), "settings_d16": self.tree_s.label()}
        if measure_ingest:
            res["ingest_tokens_per_s"] = ntok / dt
            res["bytes_per_token"] = (rss() - r0) / ntok
        if latency_requests:
            res.update(self._latency(w, stores, steps, latency_requests))
        res.update(self._acceptance(w, stores, acc_prompts))
        return res

    def _method(self, store: Any, settings: Any) -> Any:
        """The replay's Arctic method over ``store``; a replayed response leaves it when it ends (it
        must not draft for the next one; ours finishes with keep=False)."""
        m = self.arctic.ArcticMethod(self.name, lambda: store, settings, "", keep=False)
        m.reset(True)
        return m

    def _latency(self, w: Workload, stores: list[Any], steps: int, n: int) -> dict[str, float]:
        route = _by_prompt(w)

        def over(settings: Any) -> Any:
            if not self.per_prompt:
                return self._method(stores[0], settings)
            return PerPrompt(self.name, lambda key: self._method(stores[route[key]], settings))

        return peer_latency(w, n, steps, over(self.tree_s), D, over(self.chain_s), K + 1)

    def _acceptance(self, w: Workload, stores: list[Any], prompts: int) -> dict[str, float]:
        def method(p: int, kind: str) -> Any:
            return self._method(stores[p], self.chain_s if kind == "chain" else self.tree_s)

        return replay_acceptance(w, prompts, method)
