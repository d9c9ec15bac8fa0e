"""The previous responses SPEC-RL reuses, as every trainer adapter reads and records them.

With a draft server (``HISTOSPEC_DRAFT_SERVER``; its token and CA from the same settings as the
engines', :class:`~histospec_sgl.sync.client.Credentials`), the store is a live mirror of its records
(:meth:`PreviousResponses.follow`), the same in every engine and process of the job, and a finished
response is published to it with its log-probs, slot and policy version: next epoch's previous
response is found whichever engine or worker the prompt lands on. Without one, each process keeps
what it recorded itself, which helps only when a prompt's samples come back to the same process.

One :class:`PreviousStore` per process (:func:`shared`): its mirrors and publishers are opened once
per address and used from the trainers' worker threads and event loops alike.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from histospec_sgl.specrl.client import Previous, PreviousResponses

logger = logging.getLogger("histospec_sgl.specrl")


class PreviousStore:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.local = PreviousResponses()
        self._followers: dict[str, PreviousResponses] = {}
        self._publishers: dict[str, Any] = {}

    def follower(self, address: str) -> PreviousResponses:
        """The live mirror of the draft server at ``address`` (opened on first use)."""
        with self._lock:
            store = self._followers.get(address)
            if store is None:
                from histospec_sgl.sync.client import Credentials

                store = self._followers[address] = PreviousResponses.follow(address, **Credentials.from_env().kwargs())
            return store

    def publisher(self, address: str) -> Any:
        """The background publisher to the draft server at ``address``
        (:class:`~histospec_sgl.sync.outbox.BackgroundPublisher`: it never blocks or fails a rollout;
        while the server is down records wait in a bounded queue and go out once it is back)."""
        with self._lock:
            pub = self._publishers.get(address)
            if pub is None:
                from histospec_sgl.sync.client import Credentials
                from histospec_sgl.sync.outbox import BackgroundPublisher

                pub = self._publishers[address] = BackgroundPublisher(address, **Credentials.from_env().kwargs())
            return pub

    def close(self, timeout: float = 10.0) -> None:
        """Publishes what is queued (up to ``timeout`` per server) and closes the connections; runs
        at exit for :func:`shared`."""
        with self._lock:
            publishers, followers = list(self._publishers.values()), list(self._followers.values())
            self._publishers.clear()
            self._followers.clear()
        for pub in publishers:
            pub.close(timeout)
        for store in followers:
            store.close()

    def settle(self, address: str, timeout: float) -> bool:
        """Waits up to ``timeout`` seconds for what this process recorded to be acknowledged by the
        draft server and back in its mirror (so that the next rollout finds it). False, with a
        warning, when the server did not answer in time: the rollout goes on, and the records follow
        once it is back."""
        deadline = time.monotonic() + timeout
        pub = self.publisher(address)
        if not pub.drain(timeout):
            logger.warning("histospec: the draft server %s did not acknowledge %d records within %.0fs; "
                           "the next rollout may not find them as previous responses", address,
                           pub.unpublished, timeout)
            return False
        if not pub.last_sequence:
            return True
        try:
            self.follower(address).wait_for(pub.publisher.last_sequences,
                                            timeout=max(deadline - time.monotonic(), 0.1))
        except Exception as e:
            logger.warning("histospec: the mirror of the draft server %s is behind (%s)", address, e)
            return False
        return True

    def get(self, address: str | None, group: int, slot: int) -> Previous | None:
        """The previous response of ``slot`` in ``group``: from the draft server's mirror, or without
        a server from what this process recorded (:meth:`record` fills one or the other)."""
        return (self.follower(address) if address else self.local).get(group, slot)

    def record(self, address: str | None, prompt_ids: Sequence[int], response_ids: Sequence[int],
               logprobs: Sequence[float] | None, finish_reason: str | None, *, group: int, slot: int,
               version: int, reward: float | None = None) -> bool:
        """Record a finished response: queued for the draft server at ``address`` (published in the
        background: this never waits on the server or fails when it is down), else kept in this
        process when it has log-probs. An empty or aborted response is not recorded (returns False)."""
        if not response_ids or finish_reason == "abort":
            return False
        if address:
            self.publisher(address).publish(list(prompt_ids), list(response_ids), group=group, version=version,
                                            sample_index=slot, reward=reward,
                                            logprobs=None if logprobs is None else list(logprobs))
        elif logprobs is not None:
            self.local.put(group, slot, Previous(list(response_ids), list(logprobs), finish_reason, version))
        return True


_SHARED: PreviousStore | None = None
_SHARED_LOCK = threading.Lock()


def shared() -> PreviousStore:
    """This process's store."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None:
            _SHARED = PreviousStore()
            atexit.register(_SHARED.close)
        return _SHARED
