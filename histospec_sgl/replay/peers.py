"""The peers the replay measures ours against, each driven through the replay's one interface
(:class:`~histospec_sgl.replay.methods.Method`): models of SGLang's NGRAM trie, SGLang's own NGRAM
corpus, prompt lookup, and the copy bounds."""

from __future__ import annotations

import functools
import importlib.util
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from histospec_sgl._core import TriePeer
from histospec_sgl.engine.draft import tree_parents


def inserted(prompt: Sequence[int] | Any, response: Sequence[int] | Any, depth: int) -> list[int]:
    """A finished response as SGLang's NGRAM worker inserts it into its trie: behind its prompt's
    last ``depth`` tokens (its ``max_trie_depth``), so that a match may start in the prompt. The one
    rule of the replay's trie peers and ``bench index``'s."""
    return [*(int(t) for t in prompt[len(prompt) - min(depth, len(prompt)):]), *(int(t) for t in response)]


class SGLangTrie:
    """Model of SGLang's NGRAM trie (recency BFS, depth 18, breadth 1..10), see ``TriePeer``.

    ``per_prompt``: one trie per prompt, holding the prompt once and each history response behind
    the prompt's last 18 tokens (the best peer of ../shared/reference/anchors-real.md). Otherwise the
    trie as stock SGLang runs it online (``global``): it only holds what the engine itself inserted
    (each request's last 18 tokens per step; the prompt body never), and history only when the
    engine would have decoded it since the last weight update (finished siblings of the same step),
    since ``flush_cache`` wipes it at every weight update. It starts empty at every case: the logs
    hold one question per run and step, so other prompts of the same batch cannot be modelled, and
    one run's requests must not leak into another run's.
    """

    def __init__(self, per_prompt: bool, depth: int = 18):
        self.per_prompt = per_prompt
        self.depth = depth
        self.name = "sglang_trie_per_prompt" if per_prompt else "sglang_trie_global"
        self.description = (
            "SGLang NGRAM trie algorithm (reimplemented), " + ("per-prompt history" if per_prompt else "global, online")
        )
        self.trie = TriePeer(max_depth=depth)
        self.ctx: dict[int, list[int]] = {}
        self.inserted_len: dict[int, int] = {}
        self.prompts: set[tuple[int, ...]] = set()
        self.visible = True

    def reset(self, case_online_visible: bool, num_nodes: int = 16) -> None:
        self.trie = TriePeer(max_depth=self.depth)
        self.prompts.clear()
        self.visible = case_online_visible
        self.ctx.clear()
        self.inserted_len.clear()

    def _prompt(self, prompt: Sequence[int]) -> None:
        key = tuple(prompt)
        if self.per_prompt and key not in self.prompts:
            self.prompts.add(key)
            self.trie.insert(list(prompt))

    def add_history(self, prompt: Sequence[int], response: Sequence[int]) -> None:
        if not self.per_prompt and not self.visible:
            return
        self._prompt(prompt)
        self.trie.insert(inserted(prompt, response, self.depth))

    def begin(self, rid: int, prompt: Sequence[int]) -> None:
        self._prompt(prompt)
        self.ctx[rid] = list(prompt)
        self.inserted_len[rid] = len(prompt) - min(len(prompt), self.depth)

    def _sync(self, rid: int) -> None:
        # The worker inserts the request's last window every step, so all of its output is in.
        ctx = self.ctx[rid]
        if self.inserted_len[rid] < len(ctx):
            start = max(0, len(ctx) - self.depth)
            if len(ctx) - self.inserted_len[rid] > self.depth:
                start = max(0, self.inserted_len[rid] - self.depth + 1)
            self.trie.insert(ctx[start:])
            self.inserted_len[rid] = len(ctx)

    def draft(self, rid: int, num_nodes: int) -> tuple[Sequence[int], Sequence[int]]:
        self._sync(rid)
        return self.trie.draft(self.ctx[rid][-self.depth :], num_nodes)

    def extend(self, rid: int, tokens: Sequence[int]) -> None:
        self.ctx[rid].extend(tokens)

    def finish(self, rid: int) -> None:
        self._sync(rid)
        del self.ctx[rid]


def sglang_ngram_corpus_class() -> Any:
    """SGLang's ``NgramCorpus`` (its C++ module is JIT-built on first use). SGLang 0.5.17's JIT sources
    use ``size_t`` without including ``<cstddef>``, which g++ 12 rejects; unless ``CXX`` is set, the
    compiler is called as ``c++ -include cstddef``, and the venv's ``ninja`` is put on ``PATH``."""
    import os
    import sys

    os.environ.setdefault("CXX", "c++ -include cstddef")
    bindir = os.path.dirname(sys.executable)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    from sglang.srt.speculative.cpp_ngram.ngram_corpus import NgramCorpus

    return NgramCorpus


class SGLangNgram:
    """SGLang's own NGRAM corpus (the C++ trie its NGRAM worker drafts from, JIT-built on first use),
    driven as the worker drives it online: one corpus for every request, each request's last
    ``max_trie_depth`` tokens inserted once per step, one ``batch_get`` for the step's batch on the
    same windows (:meth:`draft_batch`), the corpus reset at every weight update (here: at every
    case, like ``sglang_trie_global``). The time spent in the corpus's own calls is counted
    (:meth:`index_ns`: ``batch_get`` drafting; ``batch_put`` and waiting for its insert thread
    updating), as ours counts its index's. Needs sglang (``.venv-sglang``), ninja and a C++ compiler
    (see :func:`sglang_ngram_corpus_class`).
    """

    name = "sglang_ngram_global"

    def __init__(self, depth: int = 18, min_breadth: int = 1, max_breadth: int = 10,
                 match_type: str = "BFS", capacity: int = 1_000_000, *, corpus: Any = None, nodes: int = 0,
                 insert_own: bool = True):
        """``corpus``: drive this ``NgramCorpus`` (built for ``nodes`` draft tokens, loaded by the
        caller, kept by :meth:`reset`) instead of one made per draft size (``bench index`` drives its
        corpora this way). ``insert_own``: insert each request's window as it grows, as the worker
        does (False for a corpus that takes no request output, like the external-corpus SAM)."""
        self._cls = sglang_ngram_corpus_class()
        self.kw = dict(min_bfs_breadth=min_breadth, max_bfs_breadth=max_breadth, match_type=match_type,
                       capacity=capacity, max_trie_depth=depth, external_sam_budget=0,
                       external_corpus_max_tokens=0)
        self.depth = depth
        self.description = f"SGLang's NGRAM C++ corpus ({match_type}, depth {depth}), global, online"
        self.bound = corpus is not None
        self.corpus: Any = corpus
        self.d = nodes if self.bound else 0
        self.insert_own = insert_own
        self.visible = True
        self.ctx: dict[int, list[int]] = {}
        self.inserted: dict[int, int] = {}
        # Text put into the corpus that its insert thread may not have taken yet (a corpus handed in
        # may hold the caller's).
        self.unsynced = self.bound
        self.draft_ns = 0
        self.update_ns = 0

    def index_ns(self) -> tuple[int, int]:
        """Nanoseconds spent in the corpus's drafting and updating calls so far."""
        return self.draft_ns, self.update_ns

    def _ensure(self, d: int) -> None:
        if self.bound:
            if d != self.d:
                raise ValueError(f"this corpus drafts {self.d} nodes, not {d}")
            return
        if self.corpus is None or self.d != d:
            self.corpus = self._cls(draft_token_num=d, **self.kw)
            self.d = d

    def reset(self, case_online_visible: bool, num_nodes: int = 16) -> None:
        if self.corpus is not None and not self.bound:
            self.corpus.reset()
        self.visible = case_online_visible
        self.ctx.clear()
        self.inserted.clear()

    def _put(self, texts: list[list[int]]) -> None:
        t0 = time.perf_counter_ns()
        self.corpus.batch_put(texts)
        self.update_ns += time.perf_counter_ns() - t0
        self.unsynced = True

    def add_history(self, prompt: Sequence[int], response: Sequence[int]) -> None:
        # Online, the engine saw these only if it decoded them since the last weight update.
        if self.visible:
            self._ensure(self.d or 16)
            self._put([inserted(prompt, response, self.depth)])

    def begin(self, rid: int, prompt: Sequence[int]) -> None:
        self.ctx[rid] = list(prompt)
        self.inserted[rid] = len(prompt)  # the prompt body is never inserted (SGLang's FIXME)

    def draft_batch(self, rids: Sequence[int], num_nodes: int) -> list[tuple[Sequence[int], Sequence[int]]]:
        """One decode step's drafts for ``rids``, as the worker draws them: the windows that grew are
        inserted in one ``batch_put``, then one ``batch_get`` for the whole batch."""
        self._ensure(num_nodes)
        wins = [self.ctx[rid][-self.depth:] for rid in rids]
        if self.insert_own:
            grew = [w for rid, w in zip(rids, wins) if self.inserted[rid] < len(self.ctx[rid])]
            for rid in rids:
                self.inserted[rid] = len(self.ctx[rid])
            if grew:
                self._put(grew)
        t0 = time.perf_counter_ns()
        if self.unsynced:
            self.corpus.synchronize()
            self.unsynced = False
        t1 = time.perf_counter_ns()
        toks, mask = self.corpus.batch_get([str(r) for r in rids], wins, [len(self.ctx[r]) for r in rids])
        t2 = time.perf_counter_ns()
        self.update_ns += t1 - t0
        self.draft_ns += t2 - t1
        toks = np.asarray(toks).reshape(len(rids), num_nodes)
        mask = np.asarray(mask).reshape(len(rids), -1)
        return [(toks[i].tolist(), tree_parents(mask[i], num_nodes).tolist()) for i in range(len(rids))]

    def draft(self, rid: int, num_nodes: int) -> tuple[Sequence[int], Sequence[int]]:
        return self.draft_batch([rid], num_nodes)[0]

    def extend(self, rid: int, tokens: Sequence[int]) -> None:
        self.ctx[rid].extend(tokens)

    def finish(self, rid: int) -> None:
        if self.corpus is not None:
            self.corpus.erase_match_state([str(rid)])
        del self.ctx[rid]
        del self.inserted[rid]


class PerPrompt:
    """Several methods behind the replay's one interface, one per prompt: a request is drafted by
    its prompt's (``method(prompt)``, made at the prompt's first request), as a store per prompt
    serves a decode batch of many prompts (``bench index`` drives its peers' per-prompt stores this
    way). A step's batch goes to each prompt's method in one call where it has ``draft_batch``.
    :meth:`index_ns` adds up the time of its methods' calls: what each counts of its own store
    (``index_ns``), or else the call's wall time."""

    def __init__(self, name: str, method: Callable[[tuple[int, ...]], Any]):
        self.name = name
        self.description = f"{name}, a store per prompt"
        self.make = method
        self.methods: dict[tuple[int, ...], Any] = {}
        self.of: dict[int, Any] = {}
        self.ns = [0, 0]  # drafting, updating

    def index_ns(self) -> tuple[int, int]:
        return self.ns[0], self.ns[1]

    def _call(self, m: Any, which: int, fn: Callable[[], Any]) -> Any:
        """``fn()``, a call to ``m``: the time ``m`` counts in it (drafting and updating alike), or
        its wall time as ``which`` (0 drafting, 1 updating)."""
        own = getattr(m, "index_ns", None)
        before = own() if own else None
        t0 = time.perf_counter_ns()
        try:
            return fn()
        finally:
            if own is not None and before is not None:
                after = own()
                self.ns[0] += after[0] - before[0]
                self.ns[1] += after[1] - before[1]
            else:
                self.ns[which] += time.perf_counter_ns() - t0

    def reset(self, case_online_visible: bool, num_nodes: int = 16) -> None:
        for m in self.methods.values():
            m.reset(case_online_visible, num_nodes)

    def _method(self, prompt: Sequence[int]) -> Any:
        key = tuple(int(t) for t in prompt)
        if key not in self.methods:
            self.methods[key] = self.make(key)
        return self.methods[key]

    def add_history(self, prompt: Sequence[int], response: Sequence[int]) -> None:
        self._method(prompt).add_history(prompt, response)

    def begin(self, rid: int, prompt: Sequence[int]) -> None:
        self.of[rid] = self._method(prompt)
        self.of[rid].begin(rid, prompt)

    def draft_batch(self, rids: Sequence[int], num_nodes: int) -> list[tuple[Sequence[int], ...]]:
        by: dict[int, list[int]] = {}
        for i, rid in enumerate(rids):
            by.setdefault(id(self.of[rid]), []).append(i)
        out: list[Any] = [None] * len(rids)
        for idx in by.values():
            m = self.of[rids[idx[0]]]
            drafts = self._call(m, 0, functools.partial(self._draft, m, [rids[i] for i in idx], num_nodes))
            for i, d in zip(idx, drafts):
                out[i] = d
        return out

    @staticmethod
    def _draft(m: Any, rids: list[int], num_nodes: int) -> list[Any]:
        """``m``'s drafts for ``rids``: in one call where it has ``draft_batch``."""
        batch = getattr(m, "draft_batch", None)
        return list(batch(rids, num_nodes)) if batch else [m.draft(r, num_nodes) for r in rids]

    def draft(self, rid: int, num_nodes: int) -> tuple[Sequence[int], ...]:
        return self.draft_batch([rid], num_nodes)[0]

    def extend(self, rid: int, tokens: Sequence[int]) -> None:
        m = self.of[rid]
        self._call(m, 1, lambda: m.extend(rid, tokens))

    def finish(self, rid: int) -> None:
        m = self.of.pop(rid)
        self._call(m, 1, lambda: m.finish(rid))


class PromptLookup:
    """Plain prompt-lookup n-gram: the last 3, 2, then 1 tokens' most recent earlier occurrence in
    the request's own context, then in the group's finished responses; drafts the chain after it."""

    name = "ngram"
    description = "prompt-lookup n-gram (last 3..1 tokens, most recent occurrence, chain)"

    def __init__(self, max_n: int = 3):
        self.max_n = max_n
        self.hist_seqs: list[list[int]] = []
        self.hist_map: dict[tuple[int, ...], tuple[int, int]] = {}
        self.reqs: dict[int, tuple[list[int], dict[tuple[int, ...], int]]] = {}

    def reset(self, case_online_visible: bool, num_nodes: int = 16) -> None:
        self.hist_seqs, self.hist_map, self.reqs = [], {}, {}

    def add_history(self, prompt: Sequence[int], response: Sequence[int]) -> None:
        self._remember(list(prompt) + list(response))

    def _remember(self, seq: list[int]) -> None:
        # Later occurrences overwrite earlier ones: the map keeps the most recent.
        sid = len(self.hist_seqs)
        self.hist_seqs.append(seq)
        for i in range(len(seq) - 1):  # an n-gram ending at i, continued by seq[i + 1]
            for n in range(1, self.max_n + 1):
                if i - n + 1 >= 0:
                    self.hist_map[tuple(seq[i - n + 1 : i + 1])] = (sid, i)

    def begin(self, rid: int, prompt: Sequence[int]) -> None:
        self.reqs[rid] = ([], {})
        self.extend(rid, prompt)

    def extend(self, rid: int, tokens: Sequence[int]) -> None:
        seq, m = self.reqs[rid]
        for t in tokens:
            seq.append(t)
            i = len(seq) - 2  # the n-grams ending just before the new token now have a continuation
            for n in range(1, self.max_n + 1):
                if i - n + 1 >= 0:
                    m[tuple(seq[i - n + 1 : i + 1])] = i

    def draft(self, rid: int, num_nodes: int) -> tuple[Sequence[int], Sequence[int]]:
        seq, m = self.reqs[rid]
        k = num_nodes - 1
        cont: list[int] = []
        for n in range(min(self.max_n, len(seq)), 0, -1):
            key = tuple(seq[-n:])
            if key in m:
                i = m[key]
                cont = seq[i + 1 : i + 1 + k]
                break
            if key in self.hist_map:
                sid, i = self.hist_map[key]
                cont = self.hist_seqs[sid][i + 1 : i + 1 + k]
                break
        toks = [seq[-1] if seq else 0, *cont]
        return toks, list(range(-1, len(cont)))

    def finish(self, rid: int) -> None:
        seq, _ = self.reqs.pop(rid)
        self._remember(seq)


def missing_peers() -> dict[str, dict[str, str]]:
    """Peers this replay cannot drive here, or was not asked to, and why."""
    from histospec_sgl.replay import arctic

    out = {}
    sglang = importlib.util.find_spec("sglang") is not None
    why_a = arctic.missing_reason() or "not requested: add it to --peers (it runs here)"
    why_s = (
        "SGLang's external-corpus SAM cannot be scoped to one prompt (every corpus serves every request; "
        "PR #35102); its online trie is sglang_ngram_global"
        if sglang
        else "sglang is not installed; its trie algorithm is measured through the reimplementation"
    )
    out["arctic_per_prompt"] = {"status": "missing", "reason": why_a}
    out["arctic_global"] = {"status": "missing", "reason": why_a}
    out["sglang_sam_per_group"] = {"status": "missing", "reason": why_s}
    out["sglang_ngram_global"] = {
        "status": "missing",
        "reason": "not requested: add sglang_ngram_global to --peers (needs sglang, e.g. .venv-sglang)"
        if sglang
        else "sglang is not installed here; run the replay from .venv-sglang with --peers ...,sglang_ngram_global",
    }
    return out


_MASK = (1 << 64) - 1
_BASE = 0x9E3779B97F4A7C15  # odd, so the polynomial hash mod 2^64 mixes every token


class CopyBound:
    """Not a drafter: an upper bound for every drafter that copies from the history.

    It knows the logged continuation and drafts, at each verify step, the longest prefix of it
    (at most ``num_nodes - 1`` tokens) that occurs somewhere in what the index could see: the
    case's history responses and prompts, and every request's context so far, preceded there by
    the request's last ``context`` tokens (``context=0``: anywhere). Any draft tree whose
    root-to-node paths spell substrings of that text following a match of at least ``context``
    tokens (suffix automata, tries, prompt lookup, suffix trees) accepts no more at any step, so
    tokens per verify step under this chain bounds theirs when they decode the same steps; it is
    a ceiling for ranking and tree shape, not a reachable target. Substrings are kept as 64-bit
    polynomial hashes of every n-gram up to ``context + num_nodes - 1`` tokens.
    """

    def __init__(self, context: int = 0, max_len: int = 15):
        if context < 0:
            raise ValueError("context must be >= 0")
        self.context = context
        self.max_len = max_len
        self.name = "bound_copy_any" if context == 0 else f"bound_copy_after_{context}"
        self.description = (
            "oracle: longest prefix of the logged continuation found in the visible text"
            + ("" if context == 0 else f" after the last {context} context token(s)")
        )
        self.seen: set[int] = set()
        self.prompts: set[tuple[int, ...]] = set()
        self.ctx: dict[int, list[int]] = {}
        self.truth: dict[int, tuple[Sequence[int], int]] = {}

    def _span(self) -> int:
        return self.context + self.max_len

    def _add(self, seq: Sequence[int], start: int = 0) -> None:
        """Adds the hashes of every n-gram (n <= span) of ``seq`` that ends at index >= ``start``."""
        span, seen = self._span(), self.seen
        for end in range(max(start, 0), len(seq)):
            h, mul = 0, 1
            for i in range(end, max(-1, end - span), -1):
                h = (h + (seq[i] + 1) * mul) & _MASK
                mul = (mul * _BASE) & _MASK
                seen.add(h)

    def reset(self, case_online_visible: bool, num_nodes: int = 16) -> None:
        self.seen = set()
        self.prompts.clear()
        self.ctx.clear()
        self.truth.clear()

    def _prompt(self, prompt: Sequence[int]) -> None:
        key = tuple(prompt)
        if key not in self.prompts:
            self.prompts.add(key)
            self._add(key)

    def add_history(self, prompt: Sequence[int], response: Sequence[int]) -> None:
        # The prompt's n-grams once per case; the response's with the prompt tail before them.
        self._prompt(prompt)
        tail = list(prompt[max(0, len(prompt) - self._span() + 1) :])
        self._add(tail + list(response), len(tail))

    def begin(self, rid: int, prompt: Sequence[int]) -> None:
        self._prompt(prompt)
        self.ctx[rid] = list(prompt)

    def reveal(self, rid: int, truth: Sequence[int]) -> None:
        self.truth[rid] = (truth, len(self.ctx[rid]))

    def draft(self, rid: int, num_nodes: int) -> tuple[Sequence[int], Sequence[int]]:
        ctx = self.ctx[rid]
        truth, offset = self.truth[rid]
        pos = len(ctx) - offset
        if self.context > len(ctx):
            return [ctx[-1] if ctx else 0], [-1]
        # hash(seq) = sum (tok + 1) * BASE^(distance from the end): extend on the right by h*BASE + t.
        h = 0
        for t in ctx[len(ctx) - self.context :]:
            h = (h * _BASE + t + 1) & _MASK
        cont: list[int] = []
        for t in truth[pos : pos + min(num_nodes - 1, self.max_len)]:
            h = (h * _BASE + t + 1) & _MASK
            if h not in self.seen:
                break
            cont.append(t)
        return [ctx[-1] if ctx else 0, *cont], list(range(-1, len(cont)))

    def extend(self, rid: int, tokens: Sequence[int]) -> None:
        ctx = self.ctx[rid]
        start = len(ctx)
        ctx.extend(tokens)
        self._add(ctx, start)

    def finish(self, rid: int) -> None:
        del self.ctx[rid]
        self.truth.pop(rid, None)
