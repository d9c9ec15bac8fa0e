"""Exceptions raised by histospec-sgl.

Every error of the index derives from :class:`HistospecError`; the specific ones also derive from the
built-in exception a Python programmer would catch (``KeyError`` for unknown ids, ``ValueError`` for
bad values). Bad argument types and shapes raise plain ``TypeError`` / ``ValueError``.
"""

from __future__ import annotations

__all__ = [
    "HistospecError",
    "InvalidTokenError",
    "UnknownRequestError",
    "DuplicateRequestError",
    "SnapshotError",
]


class HistospecError(Exception):
    """Base class of histospec-sgl's own errors."""


class InvalidTokenError(HistospecError, ValueError):
    """A token id is negative, above int32, or not below the configured vocabulary size."""


class UnknownRequestError(HistospecError, KeyError):
    """A request id that was never begun, or that has already finished."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class DuplicateRequestError(HistospecError, ValueError):
    """``begin_request`` with an id that is still in flight."""


class SnapshotError(HistospecError, ValueError):
    """A snapshot is corrupt, truncated, of another format version, or cannot be read or written."""
