"""Following only the groups an engine drafts for: :class:`GroupFollower` (the server's ``Follow``
stream).

An engine that mirrors every record (:class:`~histospec_sgl.sync.subscribe.HistorySubscriber`) must
hold the whole history of the job; at a real job's scale that is many times one engine's memory
budget, and its least-recently-used eviction throws away a prompt's history long before the prompt
returns next epoch. A follower instead asks the server for a group's history when the group's first
request arrives (or earlier, when the step's prompts are announced), then receives the group's new
records as they are published, and lets a group go once the index has evicted it. The server keeps
the epoch; each engine keeps what it is decoding.

The decode loop never waits on the network: :meth:`GroupFollower.want` only queues the request, the
history arrives on a background thread, and :meth:`GroupFollower.poll` applies what has arrived at a
step boundary. A request whose group's history is still on its way drafts from its in-flight siblings
meanwhile. Each group's records reach the index in the server's order, so every engine that holds a
group holds the same history of it.

A trainer that knows its next step's prompts announces their groups
(:meth:`~histospec_sgl.sync.client.HistoryPublisher.announce`, which slime's data source does); the
server passes the announcement to every follower, and each asks for the announced groups it has
decoded before: routing by group sends a prompt back to the engine that decoded it, so the history
is there before the step's first request.

A fetch has a bound (``fetch_timeout``): one not answered within it (its shard is down or
restarting) is given up, counted in ``fetches_given_up``, and its requests go on drafting from their
siblings. The group stays held, so its history still arrives when the shard is back (the time it
took is in ``late_seconds``); while a fetch is outstanding the stream retries at least every half
bound instead of backing off further.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import grpc

from histospec_sgl import _core
from histospec_sgl.sync.client import (
    DEFAULT_MAX_MESSAGE_BYTES,
    RETRYABLE,
    SERVICE,
    DraftServerError,
    _describe,
)
from histospec_sgl.sync.subscribe import _Receiver

__all__ = ["GroupFollower"]

#: Groups a follower remembers having asked for (what an announcement is matched against).
MAX_SEEN = 1 << 20

log = logging.getLogger("histospec_sgl.sync")


class GroupFollower(_Receiver):
    """Feeds a :class:`~histospec_sgl.HistoryIndex` with the records of the groups it is asked for.

    Args:
        address: the draft server (``host:port``).
        index: the index to feed (only :meth:`poll` touches it, from the owner's thread); None:
            receive and count only (for measuring delivery).
        idle_seconds: a held group whose history has arrived, not asked for within this long and no
            longer in the index (evicted under its memory budget), is dropped from the stream.
        sweep_every: :meth:`poll` calls between two looks for groups to drop.
        max_buffered: messages held before the stream is paused (back-pressure to the server).
        fetch_timeout: seconds after which a fetch not answered yet is given up (the group stays
            held, and its history is applied whenever it arrives).

    Counters: ``fetch_seconds`` (each added group's time from :meth:`want` to its whole history
    received, or to being given up), ``announced`` (announced groups asked for), ``fetches_given_up``, ``late_seconds`` (a given-up fetch's time to
    its history received after all), ``received_bytes``, ``received_records``, ``applied_records``,
    ``reconnects``, ``dropped_groups``.
    """

    def __init__(
        self,
        address: str,
        index: Any,
        *,
        auth_token: str | None = None,
        tls_root_certificates: bytes | None = None,
        idle_seconds: float = 60.0,
        sweep_every: int = 64,
        max_buffered: int = 256,
        backoff: float = 0.05,
        max_backoff: float = 2.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        fetch_timeout: float = 0.5,
    ):
        if fetch_timeout <= 0:
            raise ValueError(f"fetch_timeout must be positive, got {fetch_timeout}")
        super().__init__(address, thread_name="histospec-follower", backoff=backoff, max_backoff=max_backoff,
                         auth_token=auth_token, tls_root_certificates=tls_root_certificates,
                         max_message_bytes=max_message_bytes)
        self.index = index
        self.idle_seconds = idle_seconds
        self.sweep_every = max(1, sweep_every)
        self._lock = threading.Lock()  # the groups' state, shared with the receiving thread
        # group -> last time it was asked for (held: added to the stream, or about to be).
        self._held: dict[int, float] = {}
        # group -> highest sequence received for it (what a re-add after a reconnect starts after).
        self._last: dict[int, int] = {}
        # group -> highest sequence applied to the index (the index holds the group's records up to it,
        # unless it has evicted the group since).
        self._applied: dict[int, int] = {}
        self.fetch_timeout = fetch_timeout
        self._asked: dict[int, float] = {}  # added, history not all received yet
        self._late: dict[int, float] = {}  # given up, history not received yet: when it was asked
        # Groups asked for before (insertion-ordered, the oldest forgotten past MAX_SEEN): the ones an
        # announcement is for.
        self._seen: dict[int, None] = {}
        self._announcements: list[int] = []  # announced, not looked at yet
        self._ready: set[int] = set()
        self._ready_at: dict[int, float] = {}  # held group -> when its whole history last arrived
        self._cursor = 0  # every record of a held group below this has been received
        self._requests: queue.Queue[bytes] | None = None  # the open stream's outgoing requests
        self._messages: queue.Queue[tuple[bytes, dict[int, int]]] = queue.Queue(maxsize=max(1, max_buffered))
        self._error: DraftServerError | None = None
        self._polls = 0
        self.fetch_seconds: list[float] = []
        self.late_seconds: list[float] = []
        self.fetches_given_up = 0
        self.announced = 0
        self.received_bytes = 0
        self.received_records = 0
        self.applied_records = 0
        self.rejected_records = 0
        self.dropped_groups = 0

    # -- what the engine calls ---------------------------------------------------------------------
    def want(self, groups: Iterable[int]) -> int:
        """Asks for these groups' history and new records; returns how many were not held yet.
        Never blocks: the history arrives in the background and :meth:`poll` applies it."""
        now = time.monotonic()
        add, again = [], []
        with self._lock:
            for g in groups:
                g = int(g)
                if g not in self._seen:
                    self._seen[g] = None
                    if len(self._seen) > MAX_SEEN:
                        del self._seen[next(iter(self._seen))]
                if g in self._held and self._evicted(g):
                    # Held, but the index let its history go since: fetch it whole again.
                    again.append(g)
                    self._ready.discard(g)
                    self._applied.pop(g, None)
                    self._last[g] = 0
                    self._asked[g] = now
                    self._late.pop(g, None)
                    add.append((g, 0))
                elif g not in self._held:
                    # The index may still hold what was applied before the group was let go.
                    after = self._applied.get(g, 0) if not self._evicted(g) else 0
                    if after == 0:
                        self._applied.pop(g, None)
                    self._last[g] = after
                    self._asked[g] = now
                    self._late.pop(g, None)
                    add.append((g, after))
                self._held[g] = now
            if add and self._requests is not None:
                self._requests.put(_core.encode_follow(0, add, again))
            self._give_up(now)
        return len(add)

    def _give_up(self, now: float) -> None:
        """Gives up the fetches older than the bound (the lock held)."""
        cutoff = now - self.fetch_timeout
        old = [g for g, t in self._asked.items() if t < cutoff]
        for g in old:
            t = self._asked.pop(g)
            self._late[g] = t
            self.fetch_seconds.append(now - t)
        self.fetches_given_up += len(old)

    def _evicted(self, g: int) -> bool:
        """Records of ``g`` were applied, and the index holds none of them now."""
        return self.index is not None and self._applied.get(g, 0) > 0 and self.index.group_len(g) == 0

    def _announced(self, groups: list[int]) -> None:
        """An announcement from the server: asks for the groups decoded here before."""
        now = time.monotonic()
        with self._lock:
            mine = [g for g in groups if g in self._seen]
            for g in mine:
                if g in self._ready and not self._evicted(g):
                    self._ready_at[g] = now  # already here whole: nothing to fetch
        if mine:
            self.announced += len(mine)
            self.want(mine)

    def ready(self, group: int) -> bool:
        """Whether the group's whole history has been received (applied at the next :meth:`poll`)
        and the index has not let it go since."""
        return int(group) in self._ready and not self._evicted(int(group))

    def ready_at(self, group: int) -> float | None:
        """When (``time.monotonic()``) the group's whole history was last known to be here: its
        arrival, or an announcement that found it held; None if it has not arrived."""
        return self._ready_at.get(int(group))

    @property
    def held(self) -> int:
        """Groups the stream carries."""
        return len(self._held)

    @property
    def error(self) -> DraftServerError | None:
        """Set when the stream stopped for good."""
        return self._error

    def poll(self) -> int:
        """Asks for the announced groups decoded here before, and applies every message received so
        far to the index; returns how many records."""
        if self._announcements:
            with self._lock:
                announced, self._announcements = self._announcements, []
            self._announced(announced)
        n = 0
        while True:
            try:
                data, last = self._messages.get_nowait()
            except queue.Empty:
                break
            with self._lock:
                for g, q in last.items():
                    if g in self._held:
                        self._applied[g] = max(self._applied.get(g, 0), q)
            try:
                r = _core.apply_records(self.index, data, "follow")
            except ValueError as e:
                raise DraftServerError(f"bad Follow message from {self.address}: {e}") from None
            n += r["applied"]
            self.rejected_records += r["rejected"]
        self.applied_records += n
        if self._asked:
            with self._lock:
                self._give_up(time.monotonic())
        self._polls += 1
        if self._polls % self.sweep_every == 0:
            self._sweep()
        if n == 0 and self._error is not None:
            raise self._error
        return n

    def _sweep(self) -> None:
        """Drops the groups nobody asked for lately that the index no longer holds."""
        if self.index is None:
            return
        cutoff = time.monotonic() - self.idle_seconds
        with self._lock:
            gone = [g for g, t in self._held.items()
                    if t < cutoff and g in self._ready and self.index.group_len(g) == 0]
            for g in gone:
                del self._held[g]
                self._last.pop(g, None)
                self._applied.pop(g, None)
                self._ready.discard(g)
                self._ready_at.pop(g, None)
                self._asked.pop(g, None)
                self._late.pop(g, None)
            if gone and self._requests is not None:
                self._requests.put(_core.encode_follow(0, [], gone))
        self.dropped_groups += len(gone)

    # -- receiving thread -------------------------------------------------------------------------
    def _outgoing(self, q: queue.Queue[bytes], done: threading.Event) -> Iterator[bytes]:
        while not done.is_set():
            try:
                yield q.get(timeout=0.2)
            except queue.Empty:
                continue

    def _open_follow(self, done: threading.Event) -> Any:
        """A new Follow stream that re-adds every held group after what was received for it (so
        nothing comes twice), its requests fed from :attr:`_requests` until ``done``."""
        with self._lock:
            q: queue.Queue[bytes] = queue.Queue()
            q.put(_core.encode_follow(self._cursor, [(g, self._last.get(g, 0)) for g in self._held], []))
            self._requests = q
        return self._channel.stream_stream(f"/{SERVICE}/Follow")(self._outgoing(q, done), metadata=self._metadata)

    def _run(self) -> None:
        while not self._stop.is_set():
            done = threading.Event()  # set when this stream ends: its request iterator stops
            call = self._opened(functools.partial(self._open_follow, done))
            if call is None:
                return
            try:
                for data in call:
                    if self._stop.is_set():
                        return
                    self._received(data)
                    self._pauses.reset()
            except grpc.RpcError as e:
                if self._stop.is_set():
                    return
                code, msg = _describe(e)
                if code not in RETRYABLE and code != grpc.StatusCode.CANCELLED:
                    self._error = DraftServerError(f"follow stream to {self.address} stopped: {msg}", code)
                    log.error("%s", self._error)
                    return
            finally:
                done.set()
                with self._lock:
                    self._requests = None
            # A fetch waiting: retry at least every half bound, so the history follows the shard's
            # return closely.
            if not self._backoff(self.fetch_timeout / 2 if self._asked or self._late else None):
                return

    def _received(self, data: bytes) -> None:
        span = _core.follow_span(data)
        now = time.monotonic()
        self.received_bytes += len(data)
        self.received_records += span["records"]
        with self._lock:
            for g, s in span["last"].items():
                if g in self._held:
                    self._last[g] = max(self._last.get(g, 0), s)
            for g in span["ready_groups"]:
                if g in self._held:
                    self._ready.add(g)
                    self._ready_at[g] = now
                    t = self._asked.pop(g, None)
                    if t is not None:
                        self.fetch_seconds.append(now - t)
                    t = self._late.pop(g, None)
                    if t is not None:
                        self.late_seconds.append(now - t)
            self._cursor = max(self._cursor, span["cursor"])
        if span["announced_groups"]:
            # Asked for at the next poll, from the owner's thread (want reads the index).
            with self._lock:
                self._announcements.extend(span["announced_groups"])
        if not span["records"] and not span["ready_groups"]:
            return  # an announcement alone: nothing for the index
        if self.index is None:
            return
        while not self._stop.is_set():
            try:
                self._messages.put((data, span["last"]), timeout=0.1)
                return
            except queue.Full:
                continue

