"""grpcio clients of the draft server: :class:`HistoryPublisher` and :class:`HistorySubscriber`.

Messages travel as raw bytes; the native module encodes and decodes them with the server's own
protobuf types (``proto/histospec/v1/history.proto``), so no protobuf runtime is needed and a
subscriber applies records to a :class:`~histospec_sgl.HistoryIndex` without a Python object per token.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import random
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc

from histospec_sgl import _core, settings
from histospec_sgl.errors import HistospecError

__all__ = [
    "shard_addresses",
    "shard_of",
    "Credentials",
    "DraftServerError",
    "PublishError",
    "HistoryPublisher",
    "BackgroundPublisher",
    "HistorySubscriber",
    "SERVICE",
]

log = logging.getLogger("histospec_sgl.sync")

SERVICE = "histospec.v1.HistoryService"
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
# Codes worth retrying: the server is down or restarting, or the call ran out of time.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED})


def shard_addresses(address: str) -> list[str]:
    """The shards of a draft server: ``host:port``, or a comma list of them, one per shard. A record
    of group key k lives on shard ``k mod n`` (:func:`shard_of`); every client routes by that rule."""
    parts = [a.strip() for a in str(address).split(",") if a.strip()]
    if not parts:
        raise ValueError(f"no draft server address in {address!r}")
    return parts


#: Groups per Announce call (the server takes up to 65,536).
ANNOUNCE_BATCH = 4096


def shard_of(group_key: int, shards: int) -> int:
    """The shard that holds a group's records."""
    return int(group_key) % shards


@dataclasses.dataclass(frozen=True)
class Credentials:
    """How a client proves itself to a draft server: the bearer token and, for TLS, the PEM roots.

    Engines, trainer adapters and SPEC-RL all take theirs from :meth:`from_env`, so one setting
    (``HISTOSPEC_DRAFT_SERVER_TOKEN_FILE``, ``HISTOSPEC_DRAFT_SERVER_CA``) reaches every client of a job.
    """

    token: str | None = None
    ca: bytes | None = None

    @classmethod
    def from_env(cls, environ: Any = None) -> Credentials:
        token_file = settings.value("HISTOSPEC_DRAFT_SERVER_TOKEN_FILE", environ)
        ca_file = settings.value("HISTOSPEC_DRAFT_SERVER_CA", environ)
        token = None
        if token_file:
            with open(token_file) as f:
                token = f.read().strip() or None
            if token is None:
                raise settings.SettingError(f"HISTOSPEC_DRAFT_SERVER_TOKEN_FILE={token_file!r}: the file is empty")
        ca = None
        if ca_file:
            with open(ca_file, "rb") as fb:
                ca = fb.read()
        return cls(token, ca)

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments every client class here takes."""
        return {"auth_token": self.token, "tls_root_certificates": self.ca}


class DraftServerError(HistospecError):
    """A draft-server call failed; ``code`` is the gRPC status code (or None)."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.code = code


class PublishError(DraftServerError):
    """A publish failed for good (refused, or still failing after every retry)."""


#: Refusals of who the client is: a missing or wrong token, which no retry fixes.
AUTH_CODES = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})
AUTH_HINT = ("the draft server refused this client's credentials: give every engine and trainer process the "
             "server's token file in HISTOSPEC_DRAFT_SERVER_TOKEN_FILE (on Ray, HISTOSPEC_DRAFT_SERVER_ACTOR "
             "hands it over), and HISTOSPEC_DRAFT_SERVER_CA for a TLS server")


def _describe(e: grpc.RpcError) -> tuple[grpc.StatusCode | None, str]:
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else str(e)
    hint = f" ({AUTH_HINT})" if code in AUTH_CODES else ""
    return code, f"{code.name if code else 'error'}: {details}{hint}"


class _Client:
    """A channel to the server with the auth metadata and size limits every call uses."""

    def __init__(
        self,
        address: str,
        *,
        auth_token: str | None = None,
        tls_root_certificates: bytes | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        channel_options: Sequence[tuple[str, Any]] = (),
    ):
        self.address = address
        options = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.keepalive_time_ms", 20_000),
            # Reconnect within seconds of a restarted server (gRPC's default backoff grows to 2 minutes).
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2_000),
            *channel_options,
        ]
        if tls_root_certificates is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=tls_root_certificates)
            self._channel = grpc.secure_channel(address, creds, options)
        else:
            self._channel = grpc.insecure_channel(address, options)
        self._metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()

    def _unary(self, method: str, request: bytes, timeout: float | None) -> bytes:
        call = self._channel.unary_unary(f"/{SERVICE}/{method}")
        return call(request, timeout=timeout, metadata=self._metadata)

    def _stream(self, method: str, request: bytes, timeout: float | None = None) -> Any:
        call = self._channel.unary_stream(f"/{SERVICE}/{method}")
        return call(request, timeout=timeout, metadata=self._metadata)

    def stats(self, timeout: float = 10.0) -> dict[str, Any]:
        """The server's counters (records, tokens, groups, head_sequence, subscribers, ...)."""
        try:
            return _core.decode_stats(self._unary("Stats", b"", timeout))
        except grpc.RpcError as e:
            code, msg = _describe(e)
            raise DraftServerError(f"Stats on {self.address} failed: {msg}", code) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HistoryPublisher(_Client):
    """Publishes finished responses to the draft server, batched, with retries.

    Every record gets an id when :meth:`publish` queues it (``record_id`` or ``<prefix>:<n>`` with a
    random prefix per publisher), so a batch resent after a timeout or a server restart is stored once.
    Pass your own ids (e.g. ``f"{run}:{step}:{prompt}:{sample}"``) to make a restarted trainer's
    re-publish idempotent too.

    Args:
        address: ``host:port`` of the server, or a comma list of shards (each record goes to the shard
            of its group, :func:`shard_of`; a shard that is down holds up only its own records).
        auth_token: sent as ``authorization: Bearer <token>``.
        tls_root_certificates: PEM roots to verify a TLS server (None: plaintext).
        batch_records, batch_tokens: :meth:`publish` sends once either is reached.
        max_attempts: tries per batch before :class:`PublishError` (retrying UNAVAILABLE,
            DEADLINE_EXCEEDED, ABORTED); the batch stays queued, so calling :meth:`flush` again resumes.
        backoff, max_backoff: first and largest pause between tries (exponential, with jitter).
        timeout: seconds per attempt.
        channel_options: extra grpcio channel options (e.g. keepalive or flow-control settings).
    """

    def __init__(
        self,
        address: str,
        *,
        auth_token: str | None = None,
        tls_root_certificates: bytes | None = None,
        batch_records: int = 256,
        batch_tokens: int = 1 << 20,
        max_attempts: int = 10,
        backoff: float = 0.05,
        max_backoff: float = 2.0,
        timeout: float = 30.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        channel_options: Sequence[tuple[str, Any]] = (),
        id_prefix: str | None = None,
    ):
        shards = shard_addresses(address)
        kw = dict(auth_token=auth_token, tls_root_certificates=tls_root_certificates,
                  max_message_bytes=max_message_bytes, channel_options=channel_options)
        super().__init__(shards[0], **kw)  # type: ignore[arg-type]
        #: One client per shard (this one is the first), and each one's address.
        self._shards: list[_Client] = [self, *(_Client(a, **kw) for a in shards[1:])]  # type: ignore[arg-type]
        self._shard_addresses = shards
        self.address = ",".join(shards)
        if batch_records < 1 or batch_tokens < 1 or max_attempts < 1:
            raise ValueError("batch_records, batch_tokens and max_attempts must be >= 1")
        self.batch_records = batch_records
        self.batch_tokens = batch_tokens
        self.max_attempts = max_attempts
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.timeout = timeout
        self._prefix = id_prefix if id_prefix is not None else uuid.uuid4().hex
        self._n = 0
        self._pending: list[tuple] = []
        self._pending_shard: list[int] = []
        self._pending_tokens = 0
        self._lock = threading.Lock()
        self.published = 0
        self.duplicates = 0
        self.retries = 0
        self.last_sequence = 0
        #: The highest sequence each shard has acknowledged.
        self.last_sequences = [0] * len(self._shards)

    def publish(
        self,
        prompt_ids: Sequence[int] | Any,
        response_ids: Sequence[int] | Any,
        *,
        group: int | None = None,
        version: int = 0,
        sample_index: int = 0,
        logprobs: Sequence[float] | Any | None = None,
        reward: float | None = None,
        record_id: bytes | str | None = None,
    ) -> bytes:
        """Queues one finished response (sending the batch when it is full); returns its record id."""
        with self._lock:
            if record_id is None:
                rid = f"{self._prefix}:{self._n}".encode()
                self._n += 1
            else:
                rid = record_id.encode() if isinstance(record_id, str) else bytes(record_id)
            self._pending.append((rid, group, prompt_ids, response_ids, version, sample_index, logprobs, reward))
            n = len(self._shards)
            self._pending_shard.append(0 if n == 1 else shard_of(_core.group_key(prompt_ids, group), n))
            self._pending_tokens += len(prompt_ids) + len(response_ids)
            full = len(self._pending) >= self.batch_records or self._pending_tokens >= self.batch_tokens
        if full:
            self.flush()
        return rid

    def flush(self) -> dict[str, Any] | None:
        """Sends everything queued; returns the last reply (``sequences``, ``accepted``, ``duplicates``,
        ``durable``), or None when nothing was queued.

        Raises:
            PublishError: the server refused the batch (bad record, reused id with other contents,
                wrong token, too large), or it stayed unreachable for ``max_attempts`` tries.
            ValueError: a record that cannot be encoded (names the record).
        """
        with self._lock:
            if not self._pending:
                return None
            by: dict[int, list[int]] = {}
            for i, sh in enumerate(self._pending_shard):
                by.setdefault(sh, []).append(i)
            sequences = [0] * len(self._pending)
            reply: dict[str, Any] = {"accepted": 0, "duplicates": 0, "durable": True}
            failed: list[int] = []
            error: PublishError | None = None
            for sh, at in sorted(by.items()):
                request = _core.encode_publish([self._pending[i] for i in at])
                try:
                    r = self._send(request, len(at), sh)
                except PublishError as e:  # the other shards' records still go out
                    error = error or e
                    failed += at
                    continue
                for i, q in zip(at, r["sequences"]):
                    sequences[i] = q
                reply["accepted"] += r["accepted"]
                reply["duplicates"] += r["duplicates"]
                reply["durable"] = reply["durable"] and r["durable"]
                self.published += r["accepted"]
                self.duplicates += r["duplicates"]
                if r["sequences"]:
                    self.last_sequences[sh] = max(self.last_sequences[sh], max(r["sequences"]))
            self.last_sequence = max(self.last_sequences)
            self._pending = [self._pending[i] for i in sorted(failed)]
            self._pending_shard = [self._pending_shard[i] for i in sorted(failed)]
            self._pending_tokens = sum(len(p[2]) + len(p[3]) for p in self._pending)
            if error is not None:
                raise error
            reply["sequences"] = sequences
            return reply

    def _send(self, request: bytes, n: int, shard: int = 0) -> dict[str, Any]:
        client, address = self._shards[shard], self._shard_addresses[shard]
        pause = self.backoff
        for attempt in range(1, self.max_attempts + 1):
            try:
                return _core.decode_publish_response(client._unary("Publish", request, self.timeout))
            except grpc.RpcError as e:
                code, msg = _describe(e)
                if code not in RETRYABLE:
                    hint = ""
                    if code == grpc.StatusCode.RESOURCE_EXHAUSTED or "too large" in msg:
                        hint = " (lower batch_records/batch_tokens, or raise the server's --max-message-bytes)"
                    raise PublishError(f"Publish of {n} records to {address} refused: {msg}{hint}", code) from None
                if attempt == self.max_attempts:
                    raise PublishError(
                        f"Publish of {n} records to {address} failed {attempt} times, last: {msg}; "
                        "the records stay queued (call flush() again)",
                        code,
                    ) from None
                self.retries += 1
                log.warning("publish attempt %d failed (%s); retrying in %.2fs", attempt, msg, pause)
                time.sleep(pause * (0.5 + random.random()))
                pause = min(pause * 2, self.max_backoff)
        raise AssertionError("unreachable")

    def discard(self) -> int:
        """Drops the queued records (after a refusal that retrying cannot fix); returns how many."""
        with self._lock:
            n = len(self._pending)
            self._pending.clear()
            self._pending_shard.clear()
            self._pending_tokens = 0
            return n

    @property
    def queued(self) -> int:
        """Records queued and not yet acknowledged."""
        return len(self._pending)

    def close(self) -> None:
        """Flushes what is queued, then closes the channels."""
        try:
            self.flush()
        finally:
            for c in self._shards[1:]:
                c.close()
            super().close()

    def announce(self, groups: Sequence[int], timeout: float = 5.0) -> int:
        """Tells the engines following these groups' shards that the groups come next (a trainer's
        coming step): each engine asks for the history of those it has decoded before, so it arrives
        before their first request. A hint: returns the Follow streams told (summed over shards);
        raises :class:`DraftServerError` when a shard cannot be reached within ``timeout``."""
        by: dict[int, list[int]] = {}
        for g in groups:
            by.setdefault(shard_of(g, len(self._shards)), []).append(int(g))
        told = 0
        for i, gs in by.items():
            for at in range(0, len(gs), ANNOUNCE_BATCH):
                try:
                    reply = self._shards[i]._unary("Announce", _core.encode_announce(gs[at:at + ANNOUNCE_BATCH]),
                                                   timeout)
                except grpc.RpcError as e:
                    code, msg = _describe(e)
                    raise DraftServerError(f"announce to {self._shard_addresses[i]}: {msg}", code) from None
                told += _core.decode_announce(reply)
        return told

    def stats(self, timeout: float = 10.0) -> dict[str, Any]:
        """The server's counters; for shards, summed (``durable``: all are), with each shard's own under
        ``shards``."""
        each = [_Client.stats(c, timeout) for c in self._shards]
        if len(each) == 1:
            return each[0]
        out: dict[str, Any] = {k: sum(e[k] for e in each) for k, v in each[0].items() if not isinstance(v, bool)}
        out["durable"] = all(e["durable"] for e in each)
        out["shards"] = each
        return out



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
        pause = 0.05
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
                pause = 0.05
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
                    self._cond.wait(pause * (0.5 + random.random()))
                pause = min(pause * 2, 2.0)
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

_R = TypeVar("_R", bound="_Receiver")


class _Receiver(_Client):
    """A client whose background thread receives from one server stream at a time, opening it again
    with backoff when it ends (:class:`HistorySubscriber`, :class:`~histospec_sgl.sync.follow.GroupFollower`).
    Subclasses write :meth:`_run`, open their streams with :meth:`_opened` and pause between two
    with :meth:`_backoff`."""

    def __init__(self, address: str, *, thread_name: str, backoff: float, max_backoff: float, **kw: Any):
        super().__init__(address, **kw)
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.reconnects = 0
        self._stop = threading.Event()
        self._call: Any = None
        self._call_lock = threading.Lock()  # orders close() against the opening of a stream
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)

    def start(self: _R) -> _R:
        self._thread.start()
        return self

    def __enter__(self: _R) -> _R:
        return self.start()

    def close(self) -> None:
        """Stops the receiving thread and closes the channel (records not yet polled are dropped)."""
        with self._call_lock:  # no stream opens after this, and the one open is cancelled
            self._stop.set()
            call = self._call
        if call is not None:
            call.cancel()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        super().close()

    def _run(self) -> None:
        raise NotImplementedError

    def _opened(self, open_call: Callable[[], Any]) -> Any:
        """The stream ``open_call`` opens, or None once close() has begun (it cancels the stream it
        sees)."""
        with self._call_lock:
            if self._stop.is_set():
                return None
            self._call = open_call()
            return self._call

    def _backoff(self, pause: float) -> float | None:
        """After a stream ended: counts the reconnect and waits about ``pause`` seconds (jittered);
        returns the next pause, or None once close() has begun."""
        if self._stop.is_set():
            return None
        self.reconnects += 1
        if self._stop.wait(pause * (0.5 + random.random())):
            return None
        return min(pause * 2, self.max_backoff)


class HistorySubscriber(_Receiver):
    """Follows the server's global record order and applies it to a :class:`HistoryIndex`.

    A background thread receives messages (a Snapshot first when starting from nothing or after
    falling behind retention, then Subscribe), reconnecting with backoff when the server goes away and
    resuming after the last record received. Records reach the index in one of two ways:

    - ``background=False`` (default; what an engine uses): messages wait in a bounded queue and the
      owner applies them with :meth:`poll` at a point of its choosing, e.g. between decode steps.
      ``poll(index, through_sequence=s)`` applies exactly up to ``s``, so every tensor-parallel rank
      can apply the same records at the same logical point (rank 0 picks ``s`` from
      :attr:`received_sequence` and broadcasts it).
    - ``background=True`` (a standalone replica): the receiving thread applies them itself.

    Args:
        index: the index to feed; or any object with ``add_records(records)``, which gets the decoded
            records (dicts, as :func:`histospec_sgl._core.decode_records` makes them) in order, e.g. a
            :class:`~histospec_sgl.specrl.client.PreviousResponses`; None: receive and decode only,
            for measuring delivery.
        after_sequence: records up to this sequence are already in ``index`` (0: none).
        max_buffered: messages held before the stream is paused (back-pressure to the server).
        channel_options: extra grpcio channel options.
    """

    def __init__(
        self,
        address: str,
        index: Any,
        *,
        auth_token: str | None = None,
        tls_root_certificates: bytes | None = None,
        after_sequence: int = 0,
        background: bool = False,
        max_buffered: int = 64,
        backoff: float = 0.05,
        max_backoff: float = 2.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        channel_options: Sequence[tuple[str, Any]] = (),
    ):
        super().__init__(
            address,
            thread_name="histospec-subscriber",
            backoff=backoff,
            max_backoff=max_backoff,
            auth_token=auth_token,
            tls_root_certificates=tls_root_certificates,
            max_message_bytes=max_message_bytes,
            channel_options=channel_options,
        )
        self.index = index
        self.background = background
        self._queue: queue.Queue[tuple[str, bytes]] = queue.Queue(maxsize=max(1, max_buffered))
        self._held: tuple[str, bytes] | None = None  # a message applied only up to through_sequence
        self._received = after_sequence
        self._applied = after_sequence
        self._head = 0
        self._cond = threading.Condition()
        self._error: DraftServerError | None = None
        self.applied_records = 0
        self.rejected_records = 0
        self.received_bytes = 0
        self.snapshots = 0

    # -- state ------------------------------------------------------------------------------------
    @property
    def received_sequence(self) -> int:
        """Highest sequence received (applied or waiting in the queue)."""
        return self._received

    @property
    def applied_sequence(self) -> int:
        """Highest sequence applied to the index."""
        return self._applied

    @property
    def head_sequence(self) -> int:
        """The server's head as of the last message."""
        return self._head

    @property
    def error(self) -> DraftServerError | None:
        """Set when the subscription stopped for good (e.g. the server lost history it had sent)."""
        return self._error

    # -- receiving thread -------------------------------------------------------------------------
    def _deliver(self, kind: str, data: bytes) -> tuple[int, int]:
        """Applies a message (background mode) or queues it for :meth:`poll`; returns its last record
        sequence and its head/through sequence. A queued message is decoded here for that, and again
        when applied; a background one only once."""
        if self.background:
            r = self._apply(kind, data, None)
            return r["last_sequence"], r["mark"]
        span = _core.wire_span(data, kind)
        while not self._stop.is_set():
            try:
                self._queue.put((kind, data), timeout=0.1)
                break
            except queue.Full:
                continue
        return span

    def _consume(self, kind: str, stream: Any) -> None:
        for data in stream:
            if self._stop.is_set():
                return
            self.received_bytes += len(data)
            last, mark = self._deliver(kind, data)
            self._received = max(self._received, last)
            if kind == "snapshot":
                self._received = max(self._received, mark)
            self._head = max(self._head, mark)
            with self._cond:
                self._cond.notify_all()

    def _run(self) -> None:
        pause = self.backoff
        need_snapshot = self._received == 0
        while not self._stop.is_set():
            try:
                if need_snapshot:
                    # Counted before its records are handed over: poll() may apply them (and a
                    # caller read this counter) before the stream's end is seen here.
                    self.snapshots += 1
                    call = self._open("Snapshot", b"")
                    if call is None:
                        return
                    self._consume("snapshot", call)
                    need_snapshot = False
                call = self._open("Subscribe", _core.encode_subscribe(self._received + 1))
                if call is None:
                    return
                self._consume("subscribe", call)
                # The server ended the stream (shutdown): reconnect.
            except grpc.RpcError as e:
                if self._stop.is_set():
                    return
                code, msg = _describe(e)
                if code == grpc.StatusCode.OUT_OF_RANGE:
                    log.warning("subscriber fell behind retention (%s); catching up from a snapshot", msg)
                    need_snapshot = True
                    continue
                if code not in RETRYABLE and code != grpc.StatusCode.CANCELLED:
                    self._fail(DraftServerError(f"subscription to {self.address} stopped: {msg}", code))
                    return
            except DraftServerError as e:  # raised by a background apply
                self._fail(e)
                return
            next_pause = self._backoff(pause)
            if next_pause is None:
                return
            pause = next_pause

    def _open(self, method: str, body: bytes) -> Any:
        """A new server stream, or None once close() has begun."""
        return self._opened(lambda: self._stream(method, body))

    def _fail(self, e: DraftServerError) -> None:
        log.error("%s", e)
        self._error = e
        with self._cond:
            self._cond.notify_all()

    # -- applying ---------------------------------------------------------------------------------
    def _apply(self, kind: str, data: bytes, through: int | None) -> dict[str, Any]:
        """Applies one message (records after the applied sequence, up to ``through``); returns
        ``last_sequence``, ``mark`` (its head/through sequence) and ``more`` (records past
        ``through`` remain)."""
        try:
            if self.index is None:  # receive-only (measures delivery without index building)
                last, mark = _core.wire_span(data, kind)
                r = {"applied": max(0, last - self._applied), "rejected": 0, "last_sequence": last, "more": False}
            elif not isinstance(self.index, _core.HistoryIndex):  # a record sink: add_records(records)
                d = _core.decode_records(data, kind)
                fresh = [x for x in d["records"] if x["sequence"] > self._applied
                         and (through is None or x["sequence"] <= through)]
                self.index.add_records(fresh)
                mark = d["head_sequence"] if kind == "subscribe" else d["through_sequence"]
                r = {"applied": len(fresh), "rejected": 0,
                     "last_sequence": max([self._applied, *(x["sequence"] for x in fresh)]),
                     "more": through is not None and any(x["sequence"] > through for x in d["records"])}
            else:
                r = _core.apply_records(self.index, data, kind, self._applied, through)
                mark = r["head_sequence"] if kind == "subscribe" else r["through_sequence"]
        except ValueError as e:
            raise DraftServerError(f"bad message from {self.address}: {e}") from None
        self.applied_records += r["applied"]
        self.rejected_records += r["rejected"]
        with self._cond:
            self._applied = max(self._applied, r["last_sequence"])
            self._cond.notify_all()
        r["mark"] = mark
        return r

    def poll(self, index: Any = None, *, through_sequence: int | None = None, timeout: float = 0.0) -> int:
        """Applies received records to the index; returns how many were applied.

        Without ``through_sequence`` it applies what has arrived (waiting up to ``timeout`` for the
        first message). With it, it applies exactly up to that sequence, waiting up to ``timeout``
        seconds for it to arrive (:class:`TimeoutError` if it does not).
        """
        if self.background:
            raise RuntimeError("poll() is for background=False subscribers; this one applies on its own")
        if index is not None and index is not self.index:
            raise ValueError("poll() applies to the index the subscriber was created with")
        before = self.applied_records
        deadline = time.monotonic() + timeout
        while True:
            if through_sequence is not None and self._applied >= through_sequence:
                break
            if self._held is not None:
                item, self._held = self._held, None
            else:
                wait = max(0.0, deadline - time.monotonic())
                try:
                    item = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
                except queue.Empty:
                    if self._error is not None:
                        raise self._error from None
                    if through_sequence is not None:
                        raise TimeoutError(
                            f"sequence {through_sequence} not received within {timeout}s "
                            f"(applied {self._applied}, received {self._received})"
                        ) from None
                    break
            if self._apply(item[0], item[1], through_sequence)["more"]:
                self._held = item
            if through_sequence is None and self._queue.empty() and self._held is None:
                deadline = time.monotonic()  # applied what had arrived; do not wait again
        return self.applied_records - before

    def wait_applied(self, sequence: int, timeout: float) -> None:
        """Blocks until ``sequence`` is applied (background mode, or another thread polling)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._applied < sequence:
                if self._error is not None:
                    raise self._error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"sequence {sequence} not applied within {timeout}s (applied {self._applied})")
                self._cond.wait(left)
