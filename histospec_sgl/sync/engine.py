"""The draft-server hook an engine worker calls (the SGLang worker uses it on TP rank 0, which holds
the engine's index, when ``HISTOSPEC_DRAFT_SERVER`` is set).

- Finished responses are published batched, by a background thread that retries
  while the server is unreachable: a decode step never waits on the network (records queue in
  memory meanwhile, and go out in order once the server is back).
  With a draft server the worker finishes its requests with ``keep=False``: its own responses come
  back through the subscription like everyone else's, so every replica holds the same history in the
  same order.
- Records from the server are applied at step boundaries only, up to the sequence received so
  far, never from the receiving thread into a live draft call.

Environment: ``HISTOSPEC_DRAFT_SERVER`` (``host:port``), ``HISTOSPEC_DRAFT_SERVER_TOKEN_FILE``
(bearer token), ``HISTOSPEC_DRAFT_SERVER_CA`` (PEM roots: use TLS).
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from pathlib import Path
from typing import Any

from histospec_sgl.sync.client import RETRYABLE, HistoryPublisher, HistorySubscriber, PublishError

log = logging.getLogger("histospec_sgl.sync")

ENV_ADDRESS = "HISTOSPEC_DRAFT_SERVER"
ENV_TOKEN_FILE = "HISTOSPEC_DRAFT_SERVER_TOKEN_FILE"
ENV_CA = "HISTOSPEC_DRAFT_SERVER_CA"


class EngineSync:
    """Keeps one engine's index in the draft server's global order.

    Args:
        address: the server.
        index: the engine's :class:`~histospec_sgl.HistoryIndex`.
        apply_timeout: seconds a step boundary waits for records already received.
        publish_timeout: seconds per publish attempt (the background thread retries with backoff).
    """

    def __init__(
        self,
        address: str,
        index: Any,
        *,
        auth_token: str | None = None,
        tls_root_certificates: bytes | None = None,
        apply_timeout: float = 60.0,
        publisher_id: str | None = None,
        publish_timeout: float = 10.0,
    ):
        self.apply_timeout = apply_timeout
        self.subscriber = HistorySubscriber(
            address, index, auth_token=auth_token, tls_root_certificates=tls_root_certificates
        ).start()
        self.publisher = HistoryPublisher(
            address,
            auth_token=auth_token,
            tls_root_certificates=tls_root_certificates,
            batch_records=1 << 30,
            batch_tokens=1 << 62,
            max_attempts=1,
            timeout=publish_timeout,
            id_prefix=publisher_id,
        )
        self.publish_failures = 0
        self.refused_records = 0
        self._queue: list[tuple[tuple, dict]] = []
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._publish_loop, name="histospec-publisher", daemon=True)
        self._thread.start()

    @classmethod
    def from_env(cls, index: Any, **kw: Any) -> EngineSync | None:
        """An EngineSync configured from the environment, or None when no server is set."""
        address = os.environ.get(ENV_ADDRESS, "").strip()
        if not address:
            return None
        token_file = os.environ.get(ENV_TOKEN_FILE)
        token = Path(token_file).read_text().strip() if token_file else None
        ca_file = os.environ.get(ENV_CA)
        ca = Path(ca_file).read_bytes() if ca_file else None
        return cls(address, index, auth_token=token, tls_root_certificates=ca, **kw)

    def finished(self, prompt_ids: Any, response_ids: Any, *, version: int, sample_index: int = 0,
                 group: int | None = None, logprobs: Any = None, reward: float | None = None) -> None:
        """Queues a finished response for publishing. Never blocks."""
        with self._cond:
            self._queue.append(((prompt_ids, response_ids), dict(group=group, version=version,
                                                                 sample_index=sample_index, logprobs=logprobs,
                                                                 reward=reward)))
            self._cond.notify_all()

    def step_boundary(self) -> int:
        """Applies the server's records up to the point received so far; returns how many were
        applied. Publishing runs beside it and never delays it."""
        if self.subscriber.error is not None:
            raise self.subscriber.error
        target = self.subscriber.received_sequence
        return self.subscriber.poll(through_sequence=target, timeout=self.apply_timeout)

    @property
    def unpublished(self) -> int:
        """Finished responses not yet acknowledged by the server."""
        with self._cond:
            return len(self._queue) + self.publisher.queued

    def drain(self, timeout: float) -> bool:
        """Waits until everything finished so far is acknowledged; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue or self.publisher.queued:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    def _publish_loop(self) -> None:
        pause = 0.05
        while True:
            with self._cond:
                while not self._queue and not self.publisher.queued and not self._stop:
                    self._cond.wait()
                if self._stop and not self._queue and not self.publisher.queued:
                    return
                # Handed to the publisher under the lock, so that drain() never sees them in neither.
                for (prompt, response), kw in self._queue:
                    self.publisher.publish(prompt, response, **kw)
                self._queue = []
            try:
                self.publisher.flush()
                pause = 0.05
                with self._cond:
                    self._cond.notify_all()
            except PublishError as e:
                if e.code is not None and e.code not in RETRYABLE:
                    # Retrying cannot fix a refusal (a bad record, a wrong token): say so and move on.
                    self.refused_records += self.publisher.discard()
                    log.error("histospec: %s; these records are dropped", e)
                    continue
                self.publish_failures += 1
                if self.publish_failures <= 3 or self.publish_failures % 100 == 0:
                    log.warning("histospec: draft server unreachable (%s); %d records wait to be published",
                                e, self.unpublished)
                with self._cond:
                    if self._stop:
                        return
                    self._cond.wait(pause * (0.5 + random.random()))
                pause = min(pause * 2, 2.0)
            except Exception:
                self.refused_records += self.publisher.discard()
                log.exception("histospec: publishing failed; these records are dropped")

    def close(self, timeout: float = 10.0) -> None:
        """Publishes what is queued (waiting up to ``timeout`` for the server), then closes."""
        if self._thread.is_alive():
            if not self.drain(timeout):
                log.warning("histospec: closing with %d finished responses not published (server unreachable)",
                            self.unpublished)
            with self._cond:
                self._stop = True
                self._cond.notify_all()
            self._thread.join(timeout)
        self.publisher.discard()
        self.publisher.close()
        self.subscriber.close()
