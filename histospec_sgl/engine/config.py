"""``HISTOSPEC_*`` settings of the SGLang worker.

SGLang plugins cannot add server flags, so the HISTORY worker reads its settings from the
environment, which every SGLang subprocess inherits. ``histospec-sgl launch-server --history-*``
sets the same variables. Every value is checked when the server starts (in the launcher, through
the plugin's argument validation, and again in each scheduler process); a bad one is an error that
names the variable, never a silent default.

This module is pure Python (no sglang, no torch): the launcher and the tests import it cheaply.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from histospec_sgl.errors import HistospecError


class HistoryConfigError(HistospecError, ValueError):
    """A ``HISTOSPEC_*`` variable (or ``--history-*`` option) with a value outside its domain."""


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?[bB])?\s*$")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``"4G"``, ``"512MiB"``, ``"1000000"`` -> bytes (binary units)."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 4G, 512M, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _int(lo: int, hi: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        v = int(text.strip())
        if v < lo or (hi is not None and v > hi):
            raise ValueError(f"{v} is outside [{lo}, {hi if hi is not None else 'inf'}]")
        return v

    return parse


def _float(lo: float, hi: float, *, lo_open: bool = False) -> Callable[[str], float]:
    def parse(text: str) -> float:
        v = float(text.strip())
        if v != v or v < lo or v > hi or (lo_open and v == lo):
            raise ValueError(f"{v} is outside {'(' if lo_open else '['}{lo}, {hi}]")
        return v

    return parse


def _choice(*names: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        v = text.strip().lower()
        if v not in names:
            raise ValueError(f"{text!r} is not one of {', '.join(names)}")
        return v

    return parse


def _path(text: str) -> str:
    if not text.strip():
        raise ValueError("empty path")
    return str(Path(text.strip()).expanduser())


def _knobs(text: str) -> tuple[tuple[str, float], ...]:
    """``"recency=0.2,max_children=4"`` -> the draft knobs, checked by the index's own rules
    (:meth:`~histospec_sgl.HistoryIndex.draft_defaults`)."""
    from histospec_sgl._core import HistoryIndex

    pairs: list[tuple[str, float]] = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"{item!r} is not name=value")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"{name.strip()}: {value.strip()!r} is not a number") from None
        pairs.append((name.strip(), int(number) if number.is_integer() else number))
    if len({n for n, _ in pairs}) < len(pairs):
        raise ValueError(f"a knob is set twice in {text!r}")
    HistoryIndex.draft_defaults(**dict(pairs))  # type: ignore[arg-type]  # names and domains checked here
    return tuple(pairs)


def _control(text: str) -> str:
    if text.strip().lower() == "thresholds":
        raise ValueError("thresholds went with the switch-off settings: fixed verifies every step at width d "
                         "as it did without them; cost chooses each step's width")
    return _choice("cost", "fixed")(text)


def _lenience(text: str) -> float:
    v = _float(1.0, 1e6)(text)
    return v


#: The algorithm's name on SGLang's command line.
NAME = "HISTORY"
#: SGLang versions the plugin is written for (slime pins 0.5.15; 0.5.17 is what CI and the GPU box run).
SUPPORTED_SGLANG = ((0, 5, 15), (0, 5, 23))


@dataclasses.dataclass(frozen=True)
class Setting:
    env: str
    field: str
    parse: Callable[[str], Any]
    default: Any
    help: str


#: The one table of settings (docs/plugin.md shows :func:`settings_table`, checked by tests/test_docs.py).
SETTINGS: tuple[Setting, ...] = (
    Setting("HISTOSPEC_MAX_RESPONSES", "max_responses", _int(0), 0,
            "retention: keep the last N finished responses per prompt group (0: all)"),
    Setting("HISTOSPEC_MAX_VERSIONS", "max_versions", _int(0), 0,
            "retention: keep responses of the last E policy versions per group (0: all)"),
    Setting("HISTOSPEC_MEMORY_BUDGET", "memory_budget", parse_size, 4 << 30,
            "memory budget of the index per engine (e.g. 4G); idle groups are evicted LRU first"),
    Setting("HISTOSPEC_VERSION_DECAY", "version_decay", _float(0.0, 1.0, lo_open=True), 1.0,
            "an occurrence from version v weighs decay**(newest - v)"),
    Setting("HISTOSPEC_DRAFT_KNOBS", "draft_knobs", _knobs, None,
            "the draft policy's knobs by name, e.g. min_match=2,follow=0,recency=0 (recency=0: order "
            "continuations by pure frequency); docs/index.md lists each knob and its default, which the "
            "index itself holds (HistoryIndex.draft_defaults())"),
    Setting("HISTOSPEC_HISTORY_LOAD", "history_load", _path, None,
            "history to load at start: an index snapshot, or token-id JSONL(.gz) lines "
            '{"prompt_ids": [...], "response_ids": [...], "group"?: int, "version"?: int}'),
    Setting("HISTOSPEC_SNAPSHOT_PATH", "snapshot_path", _path, None,
            "where the index is saved at every weight update (flush_cache), at a clean exit and by the "
            "histospec_save RPC"),
    Setting("HISTOSPEC_DRAFT_SERVER", "draft_server", str.strip, None,
            "host:port of a histospec draft server: subscribe to its history, publish finished responses"),
    Setting("HISTOSPEC_CONTROL", "control", _control, "fixed",
            "the step policy. cost: each decode step verifies the drafts at width d or decodes plainly (the "
            "target's own DECODE forward, one token per request), whichever gives more tokens per second by the "
            "step costs the engine measures per batch size and the acceptance the drafts promise (calibrated by "
            "what was accepted); fixed: every decode step verifies at width d, as SGLang's NGRAM does"),
    Setting("HISTOSPEC_THREADS", "threads", _int(0, 64), 0,
            "threads for the index's batch calls (drafting, appending accepted tokens), the scheduler's "
            "included; batches of 32+ requests are split, drafts are the same (0: min(4, cores available))"),
    Setting("HISTOSPEC_HUGE_PAGES", "huge_pages", _choice("0", "1"), "0",
            "1: the index's memory on transparent huge pages (glibc's GLIBC_TUNABLES=glibc.malloc.hugetlb=1, "
            "set for the scheduler processes): faster drafts and appends, slower first touch of fresh memory"),
    Setting("HISTOSPEC_LOG_EVERY", "log_every", _int(0), 200,
            "log acceptance, coverage, index size and draft time every N decode steps (0: never)"),
    Setting("HISTOSPEC_LENIENCE", "lenience", _lenience, 1.0,
            "ℓ in [1, 1e6]: a draft node is accepted with probability min(1, ℓ·p) under sampling "
            "(SGLang's --speculative-accept-threshold-acc = 1/ℓ); 1 is exact. Lossy above 1; log-probs "
            "returned stay the current policy's"),
)

ENV_NAMES = frozenset(s.env for s in SETTINGS) | {
    "HISTOSPEC_DRAFT_SERVER_TOKEN_FILE",
    "HISTOSPEC_DRAFT_SERVER_CA",
    # namespace/name of a draft-server Ray actor (histospec_sgl.integrations.ray_draft_server)
    "HISTOSPEC_DRAFT_SERVER_ACTOR",
    # the generate slime's adapter hands requests to (histospec_sgl.integrations.slime)
    "HISTOSPEC_SLIME_INNER_GENERATE",
    # OpenRLHF's SPEC-RL executor (histospec_sgl.integrations.openrlhf_agent)
    "HISTOSPEC_N_SAMPLES",
    "HISTOSPEC_REMOTE_RM_URL",
}


#: The retired switch-off settings: setting one is an error that says what replaced them.
RETIRED = frozenset({"HISTOSPEC_MAX_BATCH", "HISTOSPEC_MIN_ACCEPT", "HISTOSPEC_PROBE_EVERY", "HISTOSPEC_NARROW_VERIFY"})
RETIRED_WHY = ("the switch-off settings were retired: the cost model (HISTOSPEC_CONTROL=cost) decodes plainly the "
               "steps whose drafts do not pay, with no threshold to tune (bench/RESULTS.md, 'Tried and not kept', "
               "compares them); unset it")


def default_threads() -> int:
    """``HISTOSPEC_THREADS=0``: up to 4 threads, no more than the cores this process may run on."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


@dataclasses.dataclass(frozen=True)
class HistoryConfig:
    max_responses: int = 0
    max_versions: int = 0
    memory_budget: int = 4 << 30
    version_decay: float = 1.0
    draft_knobs: tuple[tuple[str, float], ...] | None = None
    history_load: str | None = None
    snapshot_path: str | None = None
    draft_server: str | None = None
    control: str = "fixed"
    threads: int = 0
    huge_pages: str = "0"
    log_every: int = 200
    lenience: float = 1.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> HistoryConfig:
        """Reads and checks every ``HISTOSPEC_*`` variable.

        Raises:
            HistoryConfigError: a bad value (the message names the variable), an unknown
                ``HISTOSPEC_`` variable (most likely a typo), or a load path that does not exist.
        """
        env = os.environ if environ is None else environ
        retired = sorted(k for k in env if k in RETIRED)
        if retired:
            raise HistoryConfigError(f"{', '.join(retired)}: {RETIRED_WHY}")
        unknown = sorted(k for k in env if k.startswith("HISTOSPEC_") and k not in ENV_NAMES
                         and not k.startswith(("HISTOSPEC_LOG", "HISTOSPEC_TEST_", "HISTOSPEC_REQUIRE_")))
        if unknown:
            raise HistoryConfigError(
                f"unknown setting {', '.join(unknown)}; known: {', '.join(sorted(ENV_NAMES))}"
            )
        values: dict[str, Any] = {}
        for s in SETTINGS:
            raw = env.get(s.env)
            if raw is None or raw == "":
                continue
            try:
                values[s.field] = s.parse(raw)
            except ValueError as e:
                raise HistoryConfigError(f"{s.env}={raw!r}: {e} ({s.help})") from None
        cfg = cls(**values)
        if cfg.history_load is not None and not Path(cfg.history_load).exists():
            raise HistoryConfigError(f"HISTOSPEC_HISTORY_LOAD={cfg.history_load!r}: no such file")
        return cfg

    def index_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :class:`~histospec_sgl.HistoryIndex`."""
        kw: dict[str, Any] = dict(
            max_responses=self.max_responses,
            max_versions=self.max_versions,
            max_bytes=self.memory_budget,
            version_decay=self.version_decay,
            threads=self.threads or default_threads(),
        )
        kw.update(self.draft_knobs or ())
        return kw


def settings_table() -> str:
    """The settings as a Markdown table (docs/plugin.md and ``launch-server --help``)."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for s in SETTINGS:
        default = "unset" if s.default is None else s.default
        if s.env == "HISTOSPEC_MEMORY_BUDGET":
            default = "4G"
        rows.append(f"| `{s.env}` | {default} | {s.help} |")
    return "\n".join(rows)
