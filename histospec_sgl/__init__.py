"""histospec-sgl: model-free speculative decoding for RL rollouts, drafted from rollout history.

The core is :class:`HistoryIndex`, a per-prompt suffix-automaton index of earlier responses (and of
in-flight siblings) that drafts chains or trees for a whole decode batch in one call. See README.md
and docs/ for the SGLang plugin, the offline replay and the benchmarks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from histospec_sgl import errors
from histospec_sgl.errors import (
    DuplicateRequestError,
    HistospecError,
    InvalidTokenError,
    SnapshotError,
    UnknownRequestError,
)

if TYPE_CHECKING:
    from histospec_sgl._core import (
        SNAPSHOT_FORMAT_VERSION,
        HistoryIndex,
        __version__,
        group_key,
        prompt_key,
    )
    from histospec_sgl.engine.draft import Draft, draft
    from histospec_sgl.hugepages import huge_pages

# The native module loads on first use: SGLang imports this package (its plugin entry point) in
# every one of its processes, most of which never touch the index.
_LAZY = {
    "HistoryIndex": "histospec_sgl._core",
    "prompt_key": "histospec_sgl._core",
    "group_key": "histospec_sgl._core",
    "huge_pages": "histospec_sgl.hugepages",
    "SNAPSHOT_FORMAT_VERSION": "histospec_sgl._core",
    "__version__": "histospec_sgl._core",
    "Draft": "histospec_sgl.engine.draft",
    "draft": "histospec_sgl.engine.draft",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'histospec_sgl' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

__all__ = [
    "HistoryIndex",
    "Draft",
    "draft",
    "prompt_key",
    "group_key",
    "huge_pages",
    "errors",
    "HistospecError",
    "InvalidTokenError",
    "UnknownRequestError",
    "DuplicateRequestError",
    "SnapshotError",
    "SNAPSHOT_FORMAT_VERSION",
    "__version__",
]
