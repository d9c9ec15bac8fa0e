"""The draft-server hook an engine worker calls (the SGLang worker uses it on TP rank 0, which holds
the engine's index, when ``HISTOSPEC_DRAFT_SERVER`` is set).

- Finished responses are published batched, by a background thread that retries
  while the server is unreachable: a decode step never waits on the network (records queue in
  memory meanwhile, and go out in order once the server is back).
  With a draft server the worker finishes its requests with ``keep=False``: its own responses come
  back through the subscription like everyone else's, so every replica holds the same history in the
  same order.
- Records from the server are applied at step boundaries only, never from the receiving thread into a
  live draft call.
- ``mode="on_demand"`` (the default): the engine follows the groups it drafts for
  (:class:`~histospec_sgl.sync.follow.GroupFollower`): :meth:`EngineSync.want` asks for a group's
  history when its first request arrives, or earlier when a trainer announces the step's groups
  (:meth:`~histospec_sgl.sync.client.HistoryPublisher.announce`: the engine asks for those it has
  decoded before), and the engine holds that group's records only. ``mode="mirror"``: every record of the job, in the global
  order (:class:`~histospec_sgl.sync.subscribe.HistorySubscriber`), under the index's memory budget.

With a sharded server (``address`` a comma list), each shard is followed on its own and a group is
asked of the shard that holds it (:func:`~histospec_sgl.sync.client.shard_of`); finished responses
go to their group's shard.

Environment: ``HISTOSPEC_DRAFT_SERVER`` (``host:port``, or a comma list of shards), ``HISTOSPEC_DRAFT_SERVER_MODE``
(``on_demand`` or ``mirror``), ``HISTOSPEC_DRAFT_SERVER_TOKEN_FILE`` (bearer token),
``HISTOSPEC_DRAFT_SERVER_CA`` (PEM roots: use TLS).
"""

from __future__ import annotations

import logging
from typing import Any

from histospec_sgl import settings
from histospec_sgl.sync.client import Credentials, HistoryPublisher, shard_addresses, shard_of
from histospec_sgl.sync.follow import GroupFollower
from histospec_sgl.sync.outbox import BackgroundPublisher
from histospec_sgl.sync.subscribe import HistorySubscriber

MODES = ("on_demand", "mirror")

log = logging.getLogger("histospec_sgl.sync")

class EngineSync:
    """Keeps one engine's index in the draft server's global order.

    Args:
        address: the server.
        index: the engine's :class:`~histospec_sgl.HistoryIndex`.
        mode: ``on_demand`` (follow the groups asked for with :meth:`want`) or ``mirror`` (every record).
        apply_timeout: seconds a step boundary waits for records already received (mirror).
        publish_timeout: seconds per publish attempt (the background thread retries with backoff).
        fetch_timeout: on_demand: seconds after which a group's fetch not answered yet (its shard is
            down) is given up; its history is still applied whenever it arrives.
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
        mode: str = "on_demand",
        fetch_timeout: float = 0.5,
    ):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self.apply_timeout = apply_timeout
        shards = shard_addresses(address)
        creds: dict[str, Any] = dict(auth_token=auth_token, tls_root_certificates=tls_root_certificates)
        #: mirror: one subscriber per shard (each shard's records in its own order).
        self.subscribers = [HistorySubscriber(a, index, **creds).start() for a in shards] if mode == "mirror" else []
        #: on_demand: one follower per shard; a group is asked of the shard that holds it.
        self.followers = ([GroupFollower(a, index, fetch_timeout=fetch_timeout, **creds).start() for a in shards]
                          if mode == "on_demand" else [])
        #: Publishes finished responses in the background; its counters (``publish_failures``,
        #: ``refused_records``, ``dropped``) say what did not go out.
        self.outbox = BackgroundPublisher(
            address,
            auth_token=auth_token,
            tls_root_certificates=tls_root_certificates,
            timeout=publish_timeout,
            id_prefix=publisher_id,
        )

    @classmethod
    def from_env(cls, index: Any, **kw: Any) -> EngineSync | None:
        """An EngineSync configured from the environment, or None when no server is set."""
        address = settings.value("HISTOSPEC_DRAFT_SERVER")
        if not address:
            return None
        kw.setdefault("mode", settings.value("HISTOSPEC_DRAFT_SERVER_MODE"))
        return cls(address, index, **Credentials.from_env().kwargs(), **kw)

    def want(self, groups: Any) -> int:
        """Asks for these groups' history (on_demand; a mirror holds everything already). Never blocks:
        a request whose group's history has not arrived drafts from its siblings meanwhile."""
        if not self.followers:
            return 0
        n = len(self.followers)
        by: dict[int, list[int]] = {}
        for g in groups:
            by.setdefault(shard_of(g, n), []).append(g)
        return sum(self.followers[i].want(gs) for i, gs in by.items())

    def finished(self, prompt_ids: Any, response_ids: Any, *, version: int, sample_index: int = 0,
                 group: int | None = None, logprobs: Any = None, reward: float | None = None) -> None:
        """Queues a finished response for publishing. Never blocks."""
        self.outbox.publish(prompt_ids, response_ids, group=group, version=version, sample_index=sample_index,
                            logprobs=logprobs, reward=reward)

    def step_boundary(self) -> int:
        """Applies the server's records up to the point received so far; returns how many were
        applied. Publishing runs beside it and never delays it."""
        n = sum(f.poll() for f in self.followers)
        for sub in self.subscribers:
            if sub.error is not None:
                raise sub.error
            n += sub.poll(through_sequence=sub.received_sequence, timeout=self.apply_timeout)
        return n

    @property
    def received_bytes(self) -> int:
        """Bytes of records received from the server(s)."""
        return sum(f.received_bytes for f in self.followers) + sum(s.received_bytes for s in self.subscribers)

    @property
    def fetch_seconds(self) -> list[float]:
        """on_demand: each fetched group's time from :meth:`want` to its whole history received."""
        return [x for f in self.followers for x in f.fetch_seconds]

    def ready(self, group: int) -> bool:
        """on_demand: whether the group's whole history has been received (mirror: always)."""
        if not self.followers:
            return True
        return self.followers[shard_of(group, len(self.followers))].ready(group)

    def ready_at(self, group: int) -> float | None:
        """on_demand: when the group's whole history last arrived (``time.monotonic()``); None if not."""
        if not self.followers:
            return None
        return self.followers[shard_of(group, len(self.followers))].ready_at(group)

    @property
    def announced(self) -> int:
        """on_demand: announced groups this engine asked for (those it had decoded before)."""
        return sum(f.announced for f in self.followers)

    @property
    def fetches_given_up(self) -> int:
        """on_demand: fetches given up at the bound (their shard was down)."""
        return sum(f.fetches_given_up for f in self.followers)

    @property
    def late_seconds(self) -> list[float]:
        """on_demand: each given-up fetch's time from :meth:`want` to its history received after all."""
        return [x for f in self.followers for x in f.late_seconds]

    @property
    def publisher(self) -> HistoryPublisher:
        return self.outbox.publisher

    @property
    def unpublished(self) -> int:
        """Finished responses not yet acknowledged by the server."""
        return self.outbox.unpublished

    def drain(self, timeout: float) -> bool:
        """Waits until everything finished so far is acknowledged; False on timeout."""
        return self.outbox.drain(timeout)

    def __enter__(self) -> EngineSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, timeout: float = 10.0) -> None:
        """Publishes what is queued (waiting up to ``timeout`` for the server), then closes."""
        self.outbox.close(timeout)
        for c in (*self.subscribers, *self.followers):
            c.close()
