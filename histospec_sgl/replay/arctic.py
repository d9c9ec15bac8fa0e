"""ArcticInference's SuffixDecoding as a peer (``arctic-inference`` 0.3.0 on PyPI).

The package ships only an sdist; its ``suffix_decoding`` extension is plain C++ (nanobind) and
imports with numpy alone, but ``setup.py`` imports torch, so it installs with
``pip install --no-build-isolation --no-deps arctic-inference==0.3.0`` into an environment that
has torch (``scripts/setup_sglang_env.sh`` does this for ``.venv-sglang``). Two ways to use it:

- ``SuffixTree`` (the C++ core) per prompt (``PerPromptTrees``): the prompt and each history
  response behind the prompt's last ``CONTEXT`` tokens, the outputs in flight, and a tree per
  request for its own prompt and output. Arctic itself ships no per-prompt grouping; this is the
  shipped cache's arrangement scoped to one prompt (../shared/reference/anchors-real.md also built
  its per-prompt Arctic peer on ``SuffixTree``).
- ``SuffixDecodingCache`` as shipped and as ArcticInference's vLLM runner drives it: one global
  tree of every cached response plus one tree per active request (its prompt and output);
  ``speculate`` drafts from both and keeps the higher score.

``speculate`` always gets the last ``CONTEXT`` = 64 tokens (``suffix_cache_max_depth``, what the
runner passes). Shipped draft settings: ``max_spec_factor`` 1, offset 0, ``min_token_prob`` 0.1,
chains. The factor caps a draft at factor x match length; anchors.md measured factor 4 with trees
as Arctic's best configuration.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

#: Tree depth and context length (ArcticInference's ``suffix_cache_max_depth`` default).
CONTEXT = 64


@dataclass(frozen=True)
class SpecSettings:
    """Arguments of Arctic's ``speculate`` besides the context and the budget."""

    factor: float = 1.0
    offset: float = 0.0
    min_prob: float = 0.1
    tree: bool = False

    def label(self) -> str:
        return f"factor {self.factor:g}, {'tree' if self.tree else 'chain'}, min prob {self.min_prob:g}"


#: What ArcticInference's vLLM runner uses.
SHIPPED = SpecSettings()
#: Arctic's best configuration in anchors.md / anchors-real.md.
BEST = SpecSettings(factor=4.0, tree=True)


def missing_reason() -> str | None:
    """Why the Arctic peers cannot run in this interpreter (``None``: they can)."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache  # noqa: F401
        from arctic_inference.suffix_decoding._C import SuffixTree  # noqa: F401
    except Exception as e:  # ImportError, or a broken build
        return (f"{type(e).__name__}: {e}; install it with scripts/setup_sglang_env.sh (arctic-inference "
                "builds from its sdist against an installed torch) and run from .venv-sglang")
    return None


def suffix_tree(depth: int = CONTEXT) -> Any:
    """A new, empty Arctic ``SuffixTree``."""
    from arctic_inference.suffix_decoding._C import SuffixTree

    return SuffixTree(depth)


def nodes(last: int, draft: Any) -> tuple[list[int], list[int]]:
    """An Arctic draft as the replay's tree: node 0 is the last context token; Arctic's parents
    index its own token list with -1 for the root's children, so each shifts by one."""
    return [int(last), *(int(t) for t in draft.token_ids)], [-1, *(int(p) + 1 for p in draft.parents)]


def int32(tokens: Sequence[int]) -> np.ndarray:
    """Tokens as the contiguous int32 array Arctic's zero-copy ``*_ndarray`` calls take."""
    return np.ascontiguousarray(tokens, dtype=np.int32)


def speculate(tree: Any, ctx: Sequence[int], budget: int, s: SpecSettings) -> Any:
    """``tree.speculate`` on the last ``CONTEXT`` tokens of ``ctx`` with at most ``budget`` tokens."""
    return tree.speculate_ndarray(int32(ctx[-CONTEXT:]), budget, s.factor, s.offset, s.min_prob, s.tree)


class PerPromptTrees:
    """Arctic's trees for one prompt, arranged as its ``SuffixDecodingCache`` arranges them, but per
    prompt (shared by the replay method and ``bench index``):

    - ``history``: the prompt once and every finished response behind the prompt's last ``depth``
      tokens;
    - ``live``: the outputs of the requests in flight (behind the same prompt tail), as the shipped
      cache's global tree holds active responses, so in-flight siblings draft from each other;
    - one ``local`` tree per request: its prompt and its own output, as in the shipped cache.

    A draft is the best-scoring of the local, history and live trees' drafts (Arctic's own rule
    across its two trees; on a tie the earlier one). The live tree is asked only while another
    request of the prompt is in flight: alone, a request's own output in it adds an occurrence
    without a continuation to every match it makes (its own string ends there), which halves the
    estimates and cost Arctic 10.07 -> 8.80 accepted tokens per position on W1; its own output is
    in its local tree anyway."""

    def __init__(self, depth: int = CONTEXT) -> None:
        self.depth = depth
        self.history = suffix_tree(depth)
        self.live = suffix_tree(depth)
        self.n_history = 0
        self.next_live = 0
        # handle -> (local tree, live sequence id, prompt tail, own output)
        self.reqs: dict[int, tuple[Any, int, np.ndarray, list[int]]] = {}

    def _history_seq(self, tokens: np.ndarray) -> None:
        self.history.extend_ndarray(self.n_history, tokens)
        self.n_history += 1

    def prompt(self, prompt: Sequence[int]) -> None:
        """Holds the prompt once (the first call; the trees serve one prompt)."""
        if self.n_history == 0:
            self._history_seq(int32(prompt))

    def add(self, prompt: Sequence[int], response: Sequence[int]) -> None:
        """A finished response."""
        self.prompt(prompt)
        self._history_seq(np.concatenate([int32(prompt[-self.depth :]), int32(response)]))

    def begin(self, prompt: Sequence[int]) -> int:
        """A request in flight; its handle."""
        self.prompt(prompt)
        h = self.next_live
        self.next_live += 1
        local = suffix_tree(self.depth)
        local.extend_ndarray(0, int32(prompt))
        tail = int32(prompt[-self.depth :])
        self.live.extend_ndarray(h, tail)
        self.reqs[h] = (local, h, tail, [])
        return h

    def extend(self, h: int, tokens: Sequence[int]) -> None:
        if len(tokens):
            local, sid, _, out = self.reqs[h]
            arr = int32(tokens)
            local.extend_ndarray(0, arr)
            self.live.extend_ndarray(sid, arr)
            out.extend(int(t) for t in arr)

    def speculate(self, h: int, ctx: Sequence[int], budget: int, s: SpecSettings) -> Any:
        trees = [self.reqs[h][0], self.history] + ([self.live] if len(self.reqs) > 1 else [])
        best = None
        for t in trees:
            d = speculate(t, ctx, budget, s)
            if best is None or d.score > best.score:
                best = d
        return best

    def finish(self, h: int, keep: bool = True) -> None:
        """The request leaves the live tree; with ``keep`` its response becomes history."""
        _, sid, tail, out = self.reqs.pop(h)
        self.live.remove(sid)
        if keep and out:
            self._history_seq(np.concatenate([tail, int32(out)]))


class SharedCache:
    """Arctic's shipped ``SuffixDecodingCache`` behind the interface of ``PerPromptTrees``, driven as
    ArcticInference's vLLM runner drives it: ``start_request`` with the prompt,
    ``add_active_response`` with each step's tokens, ``speculate`` on the last 64 tokens (the
    global tree of every cached response and the request's own tree; the higher score wins),
    ``stop_request`` (the response stays cached unless it is not kept). History responses go in
    the same way."""

    def __init__(self, max_cached_requests: int = 100_000) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache = SuffixDecodingCache(max_tree_depth=CONTEXT, max_cached_requests=max_cached_requests)
        self.n = 0

    def begin(self, prompt: Sequence[int]) -> int:
        """A request in flight; its handle (its id in the cache)."""
        h = self.n
        self.n += 1
        self.cache.start_request(h, int32(prompt))
        return h

    def add(self, prompt: Sequence[int], response: Sequence[int]) -> None:
        """A finished response."""
        h = self.begin(prompt)
        self.extend(h, response)
        self.finish(h)

    def extend(self, h: int, tokens: Sequence[int]) -> None:
        if len(tokens):
            self.cache.add_active_response(h, int32(tokens))

    def speculate(self, h: int, ctx: Sequence[int], budget: int, s: SpecSettings) -> Any:
        return self.cache.speculate(h, int32(ctx[-CONTEXT:]), max_spec_tokens=budget, max_spec_factor=s.factor,
                                    max_spec_offset=s.offset, min_token_prob=s.min_prob, use_tree_spec=s.tree)

    def finish(self, h: int, keep: bool = True) -> None:
        """The request stops; without ``keep`` its response leaves the cache too."""
        self.cache.stop_request(h)
        if not keep:
            self.cache.evict_cached_response(h)


class ArcticMethod:
    """Replay method over one Arctic store per case (``PerPromptTrees`` or ``SharedCache``). It
    starts empty at every case: a case's responses appear as history in other cases of the
    leave-one-out scenarios, so a store kept across cases would hold the very response being
    replayed. A finished request stays, as history for the others, unless ``keep`` is False (``bench
    index`` replays epoch-2 responses that must not draft for the next one). The time spent in the
    store's ``speculate`` (drafting) and ``extend`` (updating) is counted (:meth:`index_ns`), as ours
    counts its index's; Arctic has no batch call, so a step drafts request by request."""

    def __init__(self, name: str, store: Callable[[], Any], settings: SpecSettings, description: str,
                 keep: bool = True):
        self.name = name
        self.make = store
        self.s = settings
        self.keep = keep
        self.description = f"{description}, {settings.label()}"
        self.store: Any = None
        self.reqs: dict[int, tuple[int, list[int]]] = {}
        self.draft_ns = 0
        self.update_ns = 0

    def index_ns(self) -> tuple[int, int]:
        """Nanoseconds spent in the store's drafting and updating calls so far."""
        return self.draft_ns, self.update_ns

    def reset(self, case_online_visible: bool, num_nodes: int = 16) -> None:
        self.store = self.make()
        self.reqs.clear()

    def add_history(self, prompt: Sequence[int], response: Sequence[int]) -> None:
        self.store.add(prompt, response)

    def begin(self, rid: int, prompt: Sequence[int]) -> None:
        self.reqs[rid] = (self.store.begin(prompt), list(prompt))

    def draft(self, rid: int, num_nodes: int) -> tuple[Sequence[int], Sequence[int]]:
        h, ctx = self.reqs[rid]
        t0 = time.perf_counter_ns()
        draft = self.store.speculate(h, ctx, num_nodes - 1, self.s)
        self.draft_ns += time.perf_counter_ns() - t0
        return nodes(ctx[-1], draft)

    def extend(self, rid: int, tokens: Sequence[int]) -> None:
        h, ctx = self.reqs[rid]
        t0 = time.perf_counter_ns()
        self.store.extend(h, tokens)
        self.update_ns += time.perf_counter_ns() - t0
        ctx.extend(tokens)

    def finish(self, rid: int) -> None:
        self.store.finish(self.reqs.pop(rid)[0], keep=self.keep)


def per_prompt_method(settings: SpecSettings = BEST) -> ArcticMethod:
    """Replay peer ``arctic_per_prompt``: Arctic's trees per prompt, its best settings."""
    return ArcticMethod("arctic_per_prompt", PerPromptTrees, settings,
                        "ArcticInference SuffixTree (arctic-inference 0.3.0), per prompt")


def shared_cache_method(settings: SpecSettings = SHIPPED) -> ArcticMethod:
    """Replay peer ``arctic_global``: the shipped ``SuffixDecodingCache``, shipped settings."""
    return ArcticMethod("arctic_global", SharedCache, settings,
                        "ArcticInference SuffixDecodingCache as shipped (global response tree + per-request tree)")
