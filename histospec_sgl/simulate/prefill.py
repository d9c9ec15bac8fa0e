"""A step's prefill as SGLang runs it, for the simulator (:func:`histospec_sgl.simulate.step.run_step`):
which prompt tokens the radix cache covers (:class:`PrefixCache`) and how the requests joining at
once are cut into prefill forward passes (:func:`prefill_passes`)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from histospec_sgl.simulate.step import SimRequest


class PrefixCache:
    """The engine's radix cache as the simulator prices prefills: the prompts (or the prompt prefixes
    a chunked prefill stopped at) prefilled so far, as a token trie, and how much of a new request's
    prompt they cover: the longest prefix it shares with one of them (another prompt's chat
    template too), at most all but its last token (SGLang extends at least one, to sample from). A
    request without token ids is matched by its group: its whole prompt once the group's prompt was
    prefilled."""

    def __init__(self) -> None:
        self.trie: dict[int, Any] = {}
        self.groups: set[Hashable] = set()

    def cached(self, r: SimRequest) -> int:
        if not r.prompt:
            return max(r.prompt_len - 1, 0) if r.group in self.groups else 0
        node, n = self.trie, 0
        for t in r.prompt:
            deeper = node.get(t)
            if deeper is None:
                break
            node, n = deeper, n + 1
        return min(n, max(r.prompt_len - 1, 0))

    def insert(self, r: SimRequest, upto: int) -> None:
        """``r``'s first ``upto`` prompt tokens are prefilled."""
        if r.prompt:
            node = self.trie
            for t in r.prompt[:upto]:
                node = node.setdefault(t, {})
        elif upto >= r.prompt_len:
            self.groups.add(r.group)


def prefill_passes(joining: Sequence[SimRequest], cache: PrefixCache, chunk: int | None = None,
                   overlap: bool = False) -> list[int]:
    """The prefill forward passes for requests joining at once, as SGLang's first-come-first-served
    scheduler runs them: each pass takes the waiting requests in order, each computing its prompt
    tokens that the cache held as the pass was formed does not cover (requests of one pass share
    nothing), up to ``chunk`` tokens a pass (SGLang's ``chunked_prefill_size``; None: no limit), the
    request that does not fit being cut there and continued in the next pass (its prefix so far
    cached at once). What a pass prefilled is cached for the next one or, under the ``overlap``
    scheduler (which forms a pass before the last one's results are processed, and caches a
    request's prompt as its result is), for the one after. Returns each pass's token count."""
    passes: list[int] = []
    progress = [0] * len(joining)
    k = 0
    late: list[tuple[SimRequest, int]] = []  # under ``overlap``: the last pass's, cached after the next
    while k < len(joining):
        budget = chunk if chunk and chunk > 0 else None
        tokens = 0
        done: list[tuple[SimRequest, int]] = []
        while k < len(joining) and (budget is None or tokens < budget):
            r = joining[k]
            start = max(progress[k], cache.cached(r))
            take = r.prompt_len - start if budget is None else min(r.prompt_len - start, budget - tokens)
            tokens += take
            progress[k] = start + take
            if progress[k] < r.prompt_len:  # cut by the chunk: the rest in the next pass
                cache.insert(r, progress[k])  # its prefix is cached as that pass is formed
                break
            done.append((r, progress[k]))
            k += 1
        for r, upto in late if overlap else done:
            cache.insert(r, upto)
        late = done
        passes.append(tokens)
    for r, upto in late:
        cache.insert(r, upto)
    return passes
