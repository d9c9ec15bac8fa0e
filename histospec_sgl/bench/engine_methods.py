"""The methods ``histospec-sgl bench engine`` runs, each in its own server, and how a method's name
says what its server runs.

A name is one of :data:`BASES`; a HISTORY method may end in ``_d<N>`` to verify at most N draft
tokens where the bench's ``--draft-tokens`` says otherwise (``history_d4``: HISTORY at the fixed
width 4 in a run whose other servers draft 8, so that two widths are timed in one run, back to back,
rather than in two runs the host drifts between); any but ``ngram_corpus`` may end in ``_sync`` to run
SGLang's synchronous loop instead of its overlap scheduler (``history_d4_sync``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: The methods by what their servers run.
BASES = ("plain", "ngram", "ngram_corpus", "history", "history_cost")
#: Every method name without a width of its own, in the order tables list them.
METHODS = ("plain", "plain_sync", "ngram", "ngram_sync", "ngram_corpus", "history", "history_sync", "history_cost",
           "history_cost_sync")
#: A method named with ``_sync`` runs SGLang's synchronous loop instead of its overlap scheduler.
SYNC_ARGS = ["--disable-overlap-schedule"]
#: Each HISTORY method's settings: ``history`` at a fixed width, ``history_cost`` with the cost model
#: picking each step's width (:mod:`histospec_sgl.engine.costmodel`).
SETTINGS = {"history": {"HISTOSPEC_CONTROL": "fixed"}, "history_cost": {"HISTOSPEC_CONTROL": "cost"}}

# The longer base first where one begins another (ngram_corpus before ngram).
_NAME = re.compile(rf"({'|'.join(sorted(BASES, key=len, reverse=True))})(?:_d(\d+))?(_sync)?")


@dataclass(frozen=True)
class Method:
    """A parsed method name: what its server runs (``base``), its own draft-token count where it
    names one (``draft_tokens``), and whether it runs the synchronous loop (``sync``)."""

    name: str
    base: str
    draft_tokens: int | None
    sync: bool

    @property
    def algorithm(self) -> str:
        """The ``--speculative-algorithm`` its server runs: plain, ngram or history."""
        return "history" if self.base.startswith("history") else "plain" if self.base == "plain" else "ngram"

    @property
    def control(self) -> str | None:
        """Its HISTORY server's ``HISTOSPEC_CONTROL`` (``fixed`` or ``cost``); None for other methods."""
        return SETTINGS.get(self.base, {}).get("HISTOSPEC_CONTROL")

    def width(self, draft_tokens: int) -> int:
        """Its server's ``--speculative-num-draft-tokens`` in a bench run of ``draft_tokens``."""
        return self.draft_tokens or draft_tokens

    def order(self) -> tuple[int, int, str]:
        """Where tables list it: by its unwidened name's place in :data:`METHODS`, then its width."""
        return METHODS.index(self.base + ("_sync" if self.sync else "")), self.draft_tokens or 0, self.name


def parse(name: str) -> Method:
    """A method name's :class:`Method`; ``ValueError`` naming the accepted forms for any other name."""
    m = _NAME.fullmatch(name)
    ok = m is not None and not (m[2] and not m[1].startswith("history")) and not (m[3] and m[1] == "ngram_corpus")
    if not ok or (m and m[2] and int(m[2]) < 1):
        raise ValueError(f"unknown method {name!r}: expected one of {', '.join(METHODS)}, a HISTORY method with "
                         "its own draft-token count (history_d4, history_cost_d4; N at least 1) or either with _sync")
    assert m is not None
    return Method(name, m[1], int(m[2]) if m[2] else None, bool(m[3]))


def server_spec(method: str) -> tuple[str, dict[str, str], list[str]]:
    """A method's server: the algorithm it runs, its ``HISTOSPEC_*`` settings and its extra arguments."""
    parsed = parse(method)
    algo = parsed.algorithm
    # HISTORY servers export their steps per verify width (each row's ``width_steps``) and their
    # context mismatches.
    metrics = ["--enable-metrics"] if algo == "history" else []
    return algo, dict(SETTINGS.get(parsed.base, {})), ["--sleep-on-idle", *metrics,
                                                        *(SYNC_ARGS if parsed.sync else [])]
