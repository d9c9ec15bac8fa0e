"""The draft-server hook an engine worker calls (the SGLang worker of issue 4 uses it when
``HISTOSPEC_DRAFT_SERVER`` is set).

- Finished responses are published by TP rank 0 only (batched; sent at the next step boundary).
  With a draft server the worker finishes its requests with ``keep=False``: its own responses come
  back through the subscription like everyone else's, so every replica holds the same history in the
  same order.
- Records from the server are applied at step boundaries only, never from the receiving thread into
  a live draft call: rank 0 picks the sequence it has received, ``broadcast`` hands it to every rank
  (e.g. a ``torch.distributed`` broadcast on the TP group), and each rank applies exactly up to it.

Environment: ``HISTOSPEC_DRAFT_SERVER`` (``host:port``), ``HISTOSPEC_DRAFT_SERVER_TOKEN_FILE``
(bearer token), ``HISTOSPEC_DRAFT_SERVER_CA`` (PEM roots: use TLS).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from histospec_sgl.sync.client import HistoryPublisher, HistorySubscriber

ENV_ADDRESS = "HISTOSPEC_DRAFT_SERVER"
ENV_TOKEN_FILE = "HISTOSPEC_DRAFT_SERVER_TOKEN_FILE"
ENV_CA = "HISTOSPEC_DRAFT_SERVER_CA"


class EngineSync:
    """Keeps one engine's index in the draft server's global order.

    Args:
        address: the server.
        index: the engine's :class:`~histospec_sgl.HistoryIndex` (one per rank).
        tp_rank: this rank; rank 0 publishes and decides the apply point.
        broadcast: ``f(value_on_rank0) -> value`` on every rank (identity for TP=1).
        apply_timeout: seconds a rank waits for records rank 0 has already received.
    """

    def __init__(
        self,
        address: str,
        index: Any,
        *,
        tp_rank: int = 0,
        broadcast: Callable[[int], int] | None = None,
        auth_token: str | None = None,
        tls_root_certificates: bytes | None = None,
        apply_timeout: float = 60.0,
        publisher_id: str | None = None,
    ):
        self.tp_rank = tp_rank
        self.broadcast = broadcast or (lambda v: v)
        self.apply_timeout = apply_timeout
        self.subscriber = HistorySubscriber(
            address, index, auth_token=auth_token, tls_root_certificates=tls_root_certificates
        ).start()
        self.publisher = (
            HistoryPublisher(
                address,
                auth_token=auth_token,
                tls_root_certificates=tls_root_certificates,
                batch_records=1 << 30,
                batch_tokens=1 << 62,
                id_prefix=publisher_id,
            )
            if tp_rank == 0
            else None
        )

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
        """Queues a finished response for publishing (rank 0; other ranks ignore it)."""
        if self.publisher is not None:
            self.publisher.publish(prompt_ids, response_ids, group=group, version=version,
                                   sample_index=sample_index, logprobs=logprobs, reward=reward)

    def step_boundary(self) -> int:
        """Publishes what finished (rank 0), then applies the server's records up to the point rank 0
        has received, on every rank; returns how many records were applied here."""
        if self.publisher is not None:
            self.publisher.flush()
        if self.subscriber.error is not None:
            raise self.subscriber.error
        target = self.broadcast(self.subscriber.received_sequence if self.tp_rank == 0 else 0)
        return self.subscriber.poll(through_sequence=target, timeout=self.apply_timeout)

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
        self.subscriber.close()
