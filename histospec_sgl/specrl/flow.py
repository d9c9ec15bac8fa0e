"""SPEC-RL's flow, written once for every trainer: a sample's slot in its group, the slot's previous
response, a generator seeded from what the sample is (never from the clock or a random id), the
reuse (the previous response scored under the current policy and cut at the first rejection,
:meth:`~histospec_sgl.specrl.client.SpecRLRollout.reuse`), the continuation by the trainer's own
engine call, and the response recorded for the next epoch (:func:`record`, into
:func:`~histospec_sgl.specrl.store.shared`).

The trainer adapters (slime's generate, verl's server manager, OpenRLHF's engine) translate their
trainer's types into these calls and nothing more, so the same inputs give the same draws in every
trainer: the acceptance draws of the k-th reuse of slot s of group g under seed x come from
``SeedSequence([x, g mod 2**32, g >> 32, s, k])``.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from histospec_sgl.specrl.client import Backend, Previous, Reuse, SpecRLRollout
from histospec_sgl.specrl.guard import Options
from histospec_sgl.specrl.store import shared


def seed_sequence(seed: int, group: int, slot: int, round_: int) -> np.random.SeedSequence:
    """The seed of the acceptance draws of the ``round_``-th reuse of ``slot`` in ``group``."""
    if min(seed, group, slot, round_) < 0:
        raise ValueError(f"seed, group, slot and round must be >= 0, got {(seed, group, slot, round_)}")
    return np.random.SeedSequence([seed, group & 0xFFFFFFFF, group >> 32, slot, round_])


class SlotCounter:
    """Calls counted per key: a sample's slot in its group where the trainer does not say which of the
    n samples a call is (:meth:`take`; verl's and OpenRLHF's adapters, through a Ray actor of this
    class), and a slot's round where the trainer does not count them (:meth:`count`; slime runs a
    step's generates in one process)."""

    def __init__(self) -> None:
        self._next: collections.Counter[Hashable] = collections.Counter()
        self._lock = threading.Lock()

    def count(self, key: Hashable) -> int:
        """How many times ``key`` was counted before this call."""
        with self._lock:
            k = self._next[key]
            self._next[key] = k + 1
            return k

    def take(self, group: int, n: int) -> int:
        """The k-th call for ``group`` gets slot ``k mod n``."""
        return self.count(group) % max(1, n)


async def reuse(backend: Backend, options: Options, *,
                group: int, slot: int, round_: int, prompt_ids: Sequence[int], sampling_params: Mapping[str, Any],
                previous: Previous, aborted: Callable[[], bool] | None = None, name: str = "") -> Reuse:
    """The previous response of ``slot`` scored through ``backend`` (the trainer's engine call) and
    cut under ``options.lenience``, with the draws of :func:`seed_sequence`. The caller continues
    from ``prompt_ids + reuse.prefix`` unless ``reuse.done``, and records the whole response."""
    rng = np.random.default_rng(seed_sequence(options.seed, group, slot, round_))
    client = SpecRLRollout(backend, lenience=options.lenience, rng=rng, concurrency=1, timeout=options.timeout,
                           aborted=aborted)
    return await client.reuse([int(t) for t in prompt_ids], dict(sampling_params), previous, name=name)


@dataclass(frozen=True)
class Finished:
    """A finished sample as SPEC-RL records it, whichever trainer sampled it: what each adapter
    translates its trainer's output into (slime's ``Sample``, verl's ``TokenOutput``, vLLM's
    ``CompletionOutput`` under OpenRLHF), and all :func:`record` reads.

    ``response_ids``: the reused prefix and the generated tokens together; ``logprobs``: the current
    policy's log-prob of each of them, or None; ``finish_reason``: SGLang's (``"stop"``,
    ``"length"``, ``"abort"``; an adapter maps its trainer's other names for an abort to
    ``"abort"``); ``version``: the policy version that sampled it, as the trainer numbers its steps
    (slime's weight version or rollout id, verl's ``global_steps``; OpenRLHF's executor is not told its
    step, so there it is the slot's round, which grows with it)."""

    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    finish_reason: str | None
    group: int
    slot: int
    version: int
    reward: float | None = None

    @classmethod
    def of(cls, prompt_ids: Sequence[int], response_ids: Sequence[int], logprobs: Sequence[float] | None,
           finish_reason: str | None, *, group: int, slot: int, version: int,
           reward: float | None = None) -> Finished:
        """Built from a trainer's lists (numpy or torch scalars included), as plain ints and floats."""
        return cls(tuple(int(t) for t in prompt_ids), tuple(int(t) for t in response_ids),
                   None if logprobs is None else tuple(float(x) for x in logprobs), finish_reason,
                   int(group), int(slot), int(version), None if reward is None else float(reward))


def record(draft_server: str | None, sample: Finished) -> bool:
    """A finished sample recorded for the next epoch, by the one rule every adapter keeps: a response
    of at least one token that was not aborted (``finish_reason`` ``"abort"``) is recorded, the
    reused prefix and the generated tokens together, as history (to the draft server, in the
    background: never waits on it, never fails for it) and as the slot's previous response; its
    log-probs go with it only when there is one per token (without them it is history only, and no
    previous response in a process without a draft server). A slot keeps the response of the highest
    ``version``. Returns whether it was recorded."""
    ids = list(sample.response_ids)
    if not ids or sample.finish_reason == "abort":
        return False
    lps = list(sample.logprobs) if sample.logprobs is not None and len(sample.logprobs) == len(ids) else None
    return shared().record(draft_server, list(sample.prompt_ids), ids, lps, sample.finish_reason,
                           group=sample.group, slot=sample.slot, version=sample.version, reward=sample.reward)


__all__ = ["Finished", "SlotCounter", "record", "reuse", "seed_sequence"]
