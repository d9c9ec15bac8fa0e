"""grpcio clients of the draft server: what every client shares (addresses, shards, credentials,
errors) and :class:`HistoryPublisher`; :mod:`~histospec_sgl.sync.outbox` publishes in the background,
:mod:`~histospec_sgl.sync.subscribe` and :mod:`~histospec_sgl.sync.follow` receive.

Messages travel as raw bytes; the native module encodes and decodes them with the server's own
protobuf types (``proto/histospec/v1/history.proto``), so no protobuf runtime is needed and a
subscriber applies records to a :class:`~histospec_sgl.HistoryIndex` without a Python object per token.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

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
    "Announcer",
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


class Backoff:
    """The pauses between tries, for every client that retries (publishing, the background outbox,
    the receivers' streams): ``first`` doubling up to ``largest``, each drawn between half and one and
    a half times its value so that clients that failed together do not retry together."""

    def __init__(self, first: float = 0.05, largest: float = 2.0):
        self.first, self.largest = first, largest
        self.pause = first

    def reset(self) -> None:
        """After a success: the next failure waits ``first`` again."""
        self.pause = self.first

    def next(self, cap: float | None = None) -> float:
        """The seconds to wait now (the current pause, at most ``cap``, jittered); the pause after it
        doubles."""
        pause = self.pause if cap is None else min(self.pause, cap)
        self.pause = min(self.pause * 2, self.largest)
        return pause * (0.5 + random.random())


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
        pauses = Backoff(self.backoff, self.max_backoff)
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
                pause = pauses.next()
                log.warning("publish attempt %d failed (%s); retrying in %.2fs", attempt, msg, pause)
                time.sleep(pause)
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


class Announcer:
    """What a trainer adapter announces coming groups with (:meth:`HistoryPublisher.announce`) without
    ever failing or stalling its trainer over it: the client is made on first use with the job's
    credentials (:meth:`Credentials.from_env`), announcements go out one at a time in order, and a
    failure is logged and returned as False (the engines then fetch those groups at their first
    request). ``announced`` counts the groups the server took."""

    def __init__(self, address: str):
        self.address = address
        self.announced = 0
        self._publisher: HistoryPublisher | None = None
        self._lock = threading.Lock()

    def announce(self, groups: Sequence[int], timeout: float = 5.0) -> bool:
        if not groups:
            return True
        try:
            with self._lock:
                if self._publisher is None:
                    self._publisher = HistoryPublisher(self.address, **Credentials.from_env().kwargs())
                self._publisher.announce(groups, timeout)
                self.announced += len(groups)
            return True
        except Exception as e:  # a hint: the engines fetch at the first request instead
            log.warning("histospec: announcing %d groups to %s failed: %s", len(groups), self.address, e)
            return False
