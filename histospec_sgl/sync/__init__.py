"""History shared between index replicas through the draft server (``histospec-sgl draft-server``).

- :class:`HistoryPublisher`: trainers and engines publish finished responses (batched, retried,
  idempotent record ids).
- :class:`HistorySubscriber`: feeds a :class:`~histospec_sgl.HistoryIndex` from the server's global
  order (snapshot catch-up, reconnects), applying at a point the owner chooses.
- :class:`DraftServerProcess`: runs a server as a child process.

The protocol is ``proto/histospec/v1/history.proto``.
"""

from histospec_sgl.sync.client import DraftServerError, HistoryPublisher, PublishError
from histospec_sgl.sync.process import DraftServerProcess
from histospec_sgl.sync.subscribe import HistorySubscriber

__all__ = ["HistoryPublisher", "HistorySubscriber", "DraftServerError", "PublishError", "DraftServerProcess"]
