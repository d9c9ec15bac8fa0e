"""Receiving from the draft server: the reconnecting stream every receiver shares (``_Receiver``) and
:class:`HistorySubscriber`, which follows the server's global record order into a
:class:`~histospec_sgl.HistoryIndex`."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc

from histospec_sgl import _core
from histospec_sgl.sync.client import (
    DEFAULT_MAX_MESSAGE_BYTES,
    RETRYABLE,
    Backoff,
    DraftServerError,
    _Client,
    _describe,
)

__all__ = ["HistorySubscriber"]

log = logging.getLogger("histospec_sgl.sync")


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
        #: The pauses between a stream's end and the next open (reset by each message received).
        self._pauses = Backoff(backoff, max_backoff)
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

    def _backoff(self, cap: float | None = None) -> bool:
        """After a stream ended: counts the reconnect and waits the next pause (at most ``cap``);
        False once close() has begun."""
        if self._stop.is_set():
            return False
        self.reconnects += 1
        return not self._stop.wait(self._pauses.next(cap))


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
            self._pauses.reset()
            last, mark = self._deliver(kind, data)
            self._received = max(self._received, last)
            if kind == "snapshot":
                self._received = max(self._received, mark)
            self._head = max(self._head, mark)
            with self._cond:
                self._cond.notify_all()

    def _run(self) -> None:
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
            if not self._backoff():
                return

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
