"""Publishing that never waits: :class:`BackgroundPublisher`, a :class:`~histospec_sgl.sync.client.
HistoryPublisher` behind a bounded queue and a thread (engines, trainer adapters)."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from histospec_sgl.sync.client import (
    AUTH_CODES,
    RETRYABLE,
    Backoff,
    DraftServerError,
    HistoryPublisher,
    PublishError,
)

__all__ = ["BackgroundPublisher"]

log = logging.getLogger("histospec_sgl.sync")

class BackgroundPublisher:
    """Publishes from a background thread, for code that must never wait on the draft server or
    fail because of it (an engine's decode loop, a trainer's rollout).

    :meth:`publish` queues and returns at once, whether or not the server is up. The thread sends the
    queue in order, in batches of ``batch_records``, retrying with back-off while the server is
    unreachable (records published meanwhile wait in memory and keep their ids, so a resend after a
    restart is stored once). The queue is bounded: past ``max_queue`` records a new one is dropped and
    counted (:attr:`dropped`), with one warning. A record the server refuses for good (a bad record, a
    wrong token) is dropped and counted too (:attr:`refused_records`), with an error logged.

    Args:
        address, auth_token, tls_root_certificates: as :class:`HistoryPublisher`.
        timeout: seconds per publish attempt.
        max_queue: records held while the server is unreachable.
        batch_records: records per publish call.
        id_prefix: as :class:`HistoryPublisher`.
    """

    def __init__(
        self,
        address: str,
        *,
        auth_token: str | None = None,
        tls_root_certificates: bytes | None = None,
        timeout: float = 10.0,
        max_queue: int = 1 << 16,
        batch_records: int = 256,
        id_prefix: str | None = None,
    ):
        if max_queue < 1 or batch_records < 1:
            raise ValueError("max_queue and batch_records must be >= 1")
        self.address = address
        self.publisher = HistoryPublisher(
            address,
            auth_token=auth_token,
            tls_root_certificates=tls_root_certificates,
            batch_records=1 << 30,
            batch_tokens=1 << 62,
            max_attempts=1,
            timeout=timeout,
            id_prefix=id_prefix,
        )
        self.max_queue = max_queue
        self.batch_records = batch_records
        #: Publish attempts that failed while the server was unreachable.
        self.publish_failures = 0
        #: Records the server refused for good (dropped).
        self.refused_records = 0
        #: Records dropped because the queue was full.
        self.dropped = 0
        #: Set when the server refused this client's credentials: :meth:`publish` raises it from then on.
        self.error: DraftServerError | None = None
        self._queue: collections.deque[tuple[tuple, dict]] = collections.deque()
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="histospec-publisher", daemon=True)
        self._thread.start()

    def publish(self, prompt_ids: Sequence[int] | Any, response_ids: Sequence[int] | Any, **kw: Any) -> bool:
        """Queues one record (keywords as :meth:`HistoryPublisher.publish`). Never blocks, never raises
        for an unreachable server; False when the queue was full and the record was dropped.

        Raises:
            DraftServerError: the server refused this client's token (a setting to fix, not a
                condition to wait out: the records would be lost).
        """
        if self.error is not None:
            raise self.error
        with self._cond:
            if len(self._queue) + self.publisher.queued >= self.max_queue:
                self.dropped += 1
                if self.dropped == 1:
                    log.warning("histospec: %d records wait for the draft server at %s; further records are "
                                "dropped (history lost, the rollout goes on) until it is back",
                                self.max_queue, self.address)
                return False
            self._queue.append(((prompt_ids, response_ids), kw))
            self._cond.notify_all()
        return True

    @property
    def unpublished(self) -> int:
        """Records queued and not yet acknowledged by the server."""
        with self._cond:
            return len(self._queue) + self.publisher.queued

    @property
    def last_sequence(self) -> int:
        """The highest sequence the server has acknowledged to this publisher."""
        return self.publisher.last_sequence

    def drain(self, timeout: float) -> bool:
        """Waits until everything queued so far is acknowledged (or dropped); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue or self.publisher.queued:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    def _loop(self) -> None:
        pauses = Backoff()
        while True:
            with self._cond:
                while not self._queue and not self.publisher.queued and not self._stop:
                    self._cond.wait()
                if self._stop and not self._queue and not self.publisher.queued:
                    return
                # Handed to the publisher under the lock, so that drain() never sees them in neither.
                room = self.batch_records - self.publisher.queued
                while self._queue and room > 0:
                    (prompt, response), kw = self._queue.popleft()
                    self.publisher.publish(prompt, response, **kw)
                    room -= 1
            try:
                self.publisher.flush()
                pauses.reset()
                with self._cond:
                    self._cond.notify_all()
            except PublishError as e:
                if e.code is not None and e.code not in RETRYABLE:
                    # Retrying cannot fix a refusal (a bad record, a wrong token): say so and move on.
                    self.refused_records += self.publisher.discard()
                    log.error("histospec: %s; these records are dropped", e)
                    if e.code in AUTH_CODES:
                        self.error = e
                        with self._cond:
                            self._queue.clear()
                            self._cond.notify_all()
                    continue
                self.publish_failures += 1
                if self.publish_failures <= 3 or self.publish_failures % 100 == 0:
                    log.warning("histospec: draft server unreachable (%s); %d records wait to be published",
                                e, self.unpublished)
                with self._cond:
                    if self._stop:
                        return
                    self._cond.wait(pauses.next())
            except Exception:
                self.refused_records += self.publisher.discard()
                log.exception("histospec: publishing failed; these records are dropped")

    def close(self, timeout: float = 10.0) -> None:
        """Publishes what is queued (waiting up to ``timeout`` for the server), then closes."""
        if self._thread.is_alive():
            if not self.drain(timeout):
                log.warning("histospec: closing with %d records not published (draft server %s unreachable)",
                            self.unpublished, self.address)
            with self._cond:
                self._stop = True
                self._cond.notify_all()
            self._thread.join(timeout)
        self.publisher.discard()
        self.publisher.close()
