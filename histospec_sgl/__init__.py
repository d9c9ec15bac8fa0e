"""histospec-sgl: model-free speculative decoding for RL rollouts, drafted from rollout history.

The core is :class:`HistoryIndex`, a per-prompt suffix-automaton index of earlier responses (and of
in-flight siblings) that drafts chains or trees for a whole decode batch in one call. See the README
for the SGLang plugin, the offline replay and the benchmarks.
"""

from __future__ import annotations

from histospec_sgl import errors
from histospec_sgl._core import SNAPSHOT_FORMAT_VERSION, HistoryIndex, __version__, prompt_key
from histospec_sgl.errors import (
    DuplicateRequestError,
    HistospecError,
    InvalidTokenError,
    SnapshotError,
    UnknownRequestError,
)
from histospec_sgl.index import Draft, draft

__all__ = [
    "HistoryIndex",
    "Draft",
    "draft",
    "prompt_key",
    "errors",
    "HistospecError",
    "InvalidTokenError",
    "UnknownRequestError",
    "DuplicateRequestError",
    "SnapshotError",
    "SNAPSHOT_FORMAT_VERSION",
    "__version__",
]
