"""Type stubs for the native module ``histospec_sgl._core`` (written by hand, checked by stubtest)."""

from collections.abc import Sequence
from os import PathLike
from typing import Any, TypedDict, final

import numpy as np
import numpy.typing as npt
from typing_extensions import Unpack

__all__ = [
    "HistoryIndex",
    "TriePeer",
    "prompt_key",
    "group_key",
    "encode_publish",
    "decode_publish_response",
    "encode_subscribe",
    "encode_follow",
    "encode_announce",
    "decode_announce",
    "decode_stats",
    "decode_records",
    "apply_records",
    "wire_span",
    "follow_span",
    "draft_server_main",
    "draft_server_help",
    "__version__",
    "SNAPSHOT_FORMAT_VERSION",
]

__version__: str
SNAPSHOT_FORMAT_VERSION: int

_Tokens = Sequence[int] | npt.NDArray[np.int32] | npt.NDArray[np.int64]
_Rids = Sequence[int] | npt.NDArray[np.int64]

def prompt_key(prompt_ids: _Tokens) -> int:
    """XXH3-64 of the prompt's token ids as little-endian int32 bytes (the group key)."""

def group_key(prompt_ids: _Tokens | None = None, group: int | str | None = None) -> int:
    """The group key every component keys history by: ``group`` None, ``prompt_key(prompt_ids)``;
    an int in [-2**63, 2**64), itself (negative ones modulo 2**64); a str, the named group's key."""

class _DraftKnobs(TypedDict, total=False):
    """The draft policy's knobs (docs/index.md describes each)."""

    min_match: int
    min_prob: float
    escape: float
    escape_short: float
    recency: float
    recency_decay: float
    max_children: int
    follow: float
    follow_resync: float
    hub_follow: float
    hub_follow_degree: int

@final
class HistoryIndex:
    """Per-prompt history of earlier responses that drafts speculative-decoding trees.

    Args:
        vocab_size: token ids must be below this (None: any non-negative int32).
        max_responses: keep only the last N finished responses per group (0: all).
        max_versions: keep only the responses of the last E versions per group (0: all).
        max_bytes: global memory budget; idle groups are evicted least recently used first (0: none).
        version_decay: an occurrence from version v weighs ``version_decay ** (newest - v)``.
        threads: threads that batch calls (``draft_batch``, ``draft_chain_batch``,
            ``extend_batch``) may use, the caller's included (1..64). A batch of at least 32
            requests is split into contiguous parts; the results are the same for every value.
        **draft: the draft policy's knobs by name (``HistoryIndex.draft_knobs()``;
            docs/index.md describes each).

    Raises:
        ValueError: a setting outside its domain, or an unknown knob.
    """

    def __new__(
        cls,
        *,
        vocab_size: int | None = None,
        max_responses: int = 0,
        max_versions: int = 0,
        max_bytes: int = 0,
        version_decay: float = 1.0,
        threads: int = 1,
        **draft: Unpack[_DraftKnobs],
    ) -> HistoryIndex: ...
    def begin_request(self, rid: int, group: int | None, prompt_ids: _Tokens, version: int | None = None) -> int:
        """Starts request ``rid`` in ``group`` (None: ``prompt_key(prompt_ids)``); returns the group key.

        Raises:
            DuplicateRequestError: ``rid`` is already in flight.
            InvalidTokenError: a token id out of range.
            ValueError: an empty prompt.
        """

    def extend_request(self, rid: int, tokens: _Tokens) -> None:
        """Appends accepted tokens to request ``rid``.

        Raises:
            UnknownRequestError: ``rid`` is not in flight.
            InvalidTokenError: a token id out of range.
        """

    def extend_batch(self, rids: _Rids, tokens: _Tokens, lens: _Tokens) -> None:
        """Appends ``lens[i]`` tokens of the flat ``tokens`` to ``rids[i]``; validated before applied."""

    def finish_request(self, rid: int, keep: bool = True, *, defer_removal: bool = False) -> None:
        """Ends ``rid``; with ``keep`` its response becomes history of its group (with its version).

        Unkept, it is not history, and its tokens leave the group's automaton: at once (which
        rebuilds the group: one insertion per token it holds, milliseconds for a GRPO group), or
        with ``defer_removal`` at the group's next rebuild: when the group's last in-flight request
        finishes, or once such tokens are more than half of what it holds. Until then in-flight
        siblings may draft from them. Engines use it (with a draft server every request finishes
        unkept, its response coming back as a published record); a group with nothing in flight
        always holds exactly its history either way.
        """

    def add_response(
        self, group: int | None, prompt_ids: _Tokens, response_ids: _Tokens, version: int = 0
    ) -> int:
        """Adds a finished response to a group's history; returns the group key."""

    def draft(self, rid: int, num_nodes: int = 16, chain: bool = False) -> tuple[list[int], list[int], list[float]]:
        """``(tokens, parents, probs)`` of one request's draft, BFS order, root first, unpadded."""

    def draft_batch(
        self,
        rids: _Rids,
        num_nodes: int,
        tokens: npt.NDArray[np.int64],
        mask: npt.NDArray[Any],
        probs: npt.NDArray[np.float32] | None = None,
        counts: npt.NDArray[np.int64] | None = None,
        interleave: bool = True,
    ) -> tuple[int, int]:
        """Fills ``tokens[bs*d]``, ``mask[bs*d*d]`` (int64/int32/uint8/bool), ``probs[bs*d]`` and
        ``counts[bs]`` (real draft nodes per request, root and pads excluded) for a batch with the
        GIL released; returns (requests with a draft, draft nodes). The batch's requests grow
        several at a time with their memory accesses interleaved; ``interleave=False`` grows them
        one after the other (the same drafts, for paired timing).

        Raises:
            ValueError: a buffer of the wrong size or a budget of 0.
            TypeError: a buffer of the wrong dtype or not writable.
            UnknownRequestError: an id that is not in flight (nothing is written).
        """

    def draft_chain_batch(
        self,
        rids: _Rids,
        k: int,
        tokens: npt.NDArray[np.int64],
        lens: npt.NDArray[np.int64],
        probs: npt.NDArray[np.float32] | None = None,
    ) -> tuple[int, int]:
        """Fills ``tokens[bs*k]`` (0-padded chains), ``lens[bs]`` and ``probs[bs*k]``."""

    @property
    def version(self) -> int:
        """The version new requests are tagged with (settable)."""

    @version.setter
    def version(self, v: int) -> None: ...
    @property
    def threads(self) -> int:
        """Threads batch calls may use, the caller's included (settable, 1..64; ValueError otherwise)."""

    @threads.setter
    def threads(self, n: int) -> None: ...
    def draft_config(self) -> dict[str, Any]:
        """The draft policy."""

    def set_draft_config(self, **draft: Unpack[_DraftKnobs]) -> None:
        """Changes some draft-policy knobs by name (the others keep their values)."""
    @staticmethod
    def draft_knobs() -> list[str]:
        """The names of the draft-policy knobs."""
    @staticmethod
    def draft_defaults(**draft: Unpack[_DraftKnobs]) -> dict[str, Any]:
        """Every draft-policy knob's value: the defaults, with those given by name set and checked
        (``ValueError`` naming the knob), without building an index."""

    def config(self) -> dict[str, Any]:
        """Every setting of the index."""

    def stats(self) -> dict[str, int]:
        """groups, requests, responses, tokens, prompt_tokens, states, edges, bytes, rebuilds, evictions."""

    def has_request(self, rid: int) -> bool: ...
    def request_group(self, rid: int) -> int: ...
    def group_keys(self) -> list[int]: ...
    def group_len(self, group: int) -> int:
        """How many finished responses ``group`` holds (0: none, or not held)."""
    def responses(self, group: int) -> list[tuple[list[int], list[int], int]]:
        """Kept responses of a group, oldest first, as (prompt_ids, response_ids, version)."""
    def response_lengths(self, group: int) -> list[int]:
        """The lengths of a group's kept responses, oldest first."""

    def remove_group(self, group: int) -> bool: ...
    def clear(self) -> None: ...
    def to_bytes(self) -> bytes:
        """Snapshot of the history (versioned, checksummed; in-flight requests excluded)."""

    def load_bytes(self, data: bytes) -> None:
        """Replaces the history with a snapshot. Raises SnapshotError on a corrupt or foreign one."""

    def save(self, path: str | PathLike[str]) -> None:
        """Writes a snapshot file crash-safely."""

    def load(self, path: str | PathLike[str]) -> None:
        """Replaces the history with a snapshot file. Raises SnapshotError."""


@final
class TriePeer:
    """Model of SGLang 0.5.23's NGRAM trie drafter (recency BFS), used by the replay as a peer."""

    def __new__(cls, max_depth: int = 18, min_breadth: int = 1, max_breadth: int = 10) -> TriePeer: ...
    def insert(self, tokens: _Tokens) -> None:
        """Inserts every suffix of ``tokens`` truncated to ``max_depth``."""

    def draft(self, context: _Tokens, num_nodes: int) -> tuple[list[int], list[int]]:
        """(tokens, parents) of a tree of at most ``num_nodes`` nodes; the root's parent is -1."""

    def clear(self) -> None: ...
    def __len__(self) -> int: ...


# -- draft-server wire format (histospec.v1) and the server itself -----------------------------------

_PublishTuple = tuple[
    bytes, int | None, _Tokens, _Tokens, int, int, Sequence[float] | npt.NDArray[np.floating[Any]] | None, float | None
]

def encode_publish(records: list[_PublishTuple]) -> bytes:
    """A ``PublishRequest`` from ``(record_id, group, prompt_ids, response_ids, version, sample_index,
    logprobs, reward)`` tuples. Raises ValueError naming the record on a bad one."""

def decode_publish_response(data: bytes) -> dict[str, Any]:
    """``{"sequences", "accepted", "duplicates", "durable"}``."""

def encode_subscribe(from_sequence: int) -> bytes: ...
def encode_announce(group_keys: list[int]) -> bytes:
    """Encodes an ``AnnounceRequest`` of these group keys."""

def decode_announce(data: bytes) -> int:
    """An ``AnnounceResponse``'s ``followers`` (the Follow streams told)."""

def encode_follow(from_sequence: int = 0, add: list[tuple[int, int]] = ..., drop: list[int] = ...) -> bytes:
    """A ``FollowRequest``: ``add`` is ``(group_key, after_sequence)`` pairs, ``drop`` group keys."""

def decode_stats(data: bytes) -> dict[str, Any]: ...
def decode_records(data: bytes, kind: str) -> dict[str, Any]:
    """A Subscribe (``kind="subscribe"``), Snapshot (``"snapshot"``) or Follow (``"follow"``: with
    ``ready_groups`` and ``cursor``) message with its records as dicts."""

def apply_records(
    index: HistoryIndex, data: bytes, kind: str, after_sequence: int = 0, through_sequence: int | None = None
) -> dict[str, Any]:
    """Applies the message's records with sequence in (after, through] to ``index``; returns
    ``applied``, ``rejected``, ``last_sequence``, ``more`` and the message header."""

def follow_span(data: bytes) -> dict[str, Any]:
    """A Follow message's ``cursor``, ``head_sequence``, ``ready_groups``, ``records`` (count) and
    ``last`` (each group's highest sequence in it), without its tokens."""

def wire_span(data: bytes, kind: str) -> tuple[int, int]:
    """(last record sequence or 0, head_sequence / through_sequence) of a message."""

def draft_server_main(argv: list[str]) -> int:
    """Runs the draft server from its command line (``argv[0]``: the program's name; the flags of
    ``histospec-draft-server``) until SIGTERM/SIGINT; returns the exit status (0 after a graceful stop
    or ``--help``, 1 when it cannot start, 2 for bad flags)."""

def draft_server_help(name: str) -> str:
    """The draft server's ``--help`` under the program name ``name``."""
