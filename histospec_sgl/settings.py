"""Every ``HISTOSPEC_*`` environment variable the package reads, declared once (the project's tests
and scripts declare their own in tests/helpers/dev_settings.py, outside the wheel: :data:`DEVELOPMENT`).

Each :class:`Setting` names its variable, its scope (who reads it), its parser, default and help.
Everything in the package reads these variables through :func:`value` (or :class:`HistoryConfig
<histospec_sgl.engine.config.HistoryConfig>` for the engine's); nothing else calls ``os.environ`` for
a ``HISTOSPEC_*`` name (``tests/unit/test_settings.py`` scans the tree for it). The launcher's
``--history-*`` options, the tables in docs/settings.md and docs/plugin.md and the unknown-name check
all come from this table.

A process checks the values of the scopes it reads and accepts every other registered name: an SGLang
engine started inside a Ray job sees the trainer's and the offline tools' variables too, and must not
stop for them. An unregistered ``HISTOSPEC_*`` name is an error wherever names are checked (most likely
a typo: the message offers the closest registered name), and a retired one names its replacement.

Pure Python (no sglang, no torch, no native module until a knob is parsed): the launcher, the trainer
adapters and the tests import it cheaply.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from histospec_sgl.errors import HistospecError

__all__ = ["Setting", "SettingError", "SETTINGS", "SCOPES", "RETIRED", "DEVELOPMENT", "RESOLVERS", "value", "check_names",
           "registered", "resolve", "table", "parse_size"]


class SettingError(HistospecError, ValueError):
    """A ``HISTOSPEC_*`` variable with a value outside its domain, an unknown name or a retired one."""


#: Who reads the variables of each scope.
SCOPES: dict[str, str] = {
    "engine": "the HISTORY worker inside each SGLang engine (checked when the server starts)",
    "client": "every process that talks to a draft server: engines, trainer adapters, SPEC-RL",
    "trainer": "SPEC-RL and the slime, verl and OpenRLHF adapters",
    "server": "the draft server (histospec-sgl draft-server)",
    "tools": "the offline tools and benchmarks (replay, bench, simulate)",
}

# -- parsers: text -> value, ValueError with a short reason --------------------------------------

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


def _text(text: str) -> str:
    if not text.strip():
        raise ValueError("empty")
    return text.strip()


def _path(text: str) -> str:
    if not text.strip():
        raise ValueError("empty path")
    return str(Path(text.strip()).expanduser())


def _existing_file(text: str) -> str:
    p = _path(text)
    if not Path(p).is_file():
        raise ValueError(f"no such file: {p}")
    return p


def _address(text: str) -> str:
    """``host:port``, or a comma list of them (a sharded draft server, one address per shard)."""
    parts = [p.strip() for p in text.split(",")]
    for v in parts:
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{text!r} is not host:port (or a comma list of them, one per shard)")
    return ",".join(parts)


def _actor(text: str) -> str:
    v = text.strip()
    namespace, sep, name = v.rpartition("/")
    if not sep or not namespace or not name:
        raise ValueError(f"{text!r} is not namespace/name")
    return v


def _urls(text: str) -> tuple[str, ...]:
    urls = tuple(u.strip() for u in text.split(",") if u.strip())
    if not urls:
        raise ValueError("empty")
    return urls


def _knobs(text: str) -> tuple[tuple[str, float], ...]:
    """``"recency=0.2,max_children=4"`` -> the draft knobs, checked by the index's own rules
    (:meth:`~histospec_sgl.HistoryIndex.draft_defaults`)."""
    from histospec_sgl._core import HistoryIndex

    pairs: list[tuple[str, float]] = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, eq, raw = item.partition("=")
        if not eq:
            raise ValueError(f"{item!r} is not name=value")
        try:
            number = float(raw)
        except ValueError:
            raise ValueError(f"{name.strip()}: {raw.strip()!r} is not a number") from None
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


def _seconds(text: str) -> float:
    v = float(text.strip())
    if not 0 < v < float("inf"):
        raise ValueError(f"{v} is not a positive number of seconds")
    return v


# -- the table ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Setting:
    """One ``HISTOSPEC_*`` variable.

    Attributes:
        env: the variable's name.
        scope: who reads it (a key of :data:`SCOPES`).
        parse: text -> value; raises ValueError with the reason.
        default: the value when unset or empty (None: unset).
        help: one sentence for the docs and ``--help``.
        field: the :class:`~histospec_sgl.engine.config.HistoryConfig` field it fills (engine settings).
        flag: the ``histospec-sgl launch-server`` option that sets it, with ``metavar``.
        shown: the default as the docs show it, where ``default`` reads badly (a byte count).
    """

    env: str
    scope: str
    parse: Callable[[str], Any]
    default: Any
    help: str
    field: str | None = None
    flag: str | None = None
    metavar: str = "VALUE"
    shown: str | None = None

    def shown_default(self) -> str:
        if self.shown is not None:
            return self.shown
        return "unset" if self.default is None else str(self.default)


_E, _C, _T, _S, _O = "engine", "client", "trainer", "server", "tools"

SETTINGS: tuple[Setting, ...] = (
    # The engine (HistoryConfig).
    Setting("HISTOSPEC_MAX_RESPONSES", _E, _int(0), 0,
            "retention: keep the last N finished responses per prompt group (0: all)",
            field="max_responses", flag="--history-max-responses", metavar="N"),
    Setting("HISTOSPEC_MAX_VERSIONS", _E, _int(0), 0,
            "retention: keep responses of the last E policy versions per group (0: all)",
            field="max_versions", flag="--history-max-versions", metavar="E"),
    Setting("HISTOSPEC_MEMORY_BUDGET", _E, parse_size, 4 << 30,
            "memory budget of the index per engine (e.g. 4G); idle groups are evicted LRU first",
            field="memory_budget", flag="--history-memory-budget", metavar="SIZE", shown="4G"),
    Setting("HISTOSPEC_VERSION_DECAY", _E, _float(0.0, 1.0, lo_open=True), 1.0,
            "an occurrence from version v weighs decay**(newest - v)",
            field="version_decay", flag="--history-version-decay", metavar="X"),
    Setting("HISTOSPEC_DRAFT_KNOBS", _E, _knobs, None,
            "the draft policy's knobs by name, e.g. min_match=2,follow=0,recency=0 (recency=0: order "
            "continuations by pure frequency); docs/index.md lists each knob and its default, which the "
            "index itself holds (HistoryIndex.draft_defaults())",
            field="draft_knobs", flag="--history-draft-knobs", metavar="NAME=X,..."),
    Setting("HISTOSPEC_HISTORY_LOAD", _E, _path, None,
            "history to load at start: an index snapshot, or token-id JSONL(.gz) lines "
            '{"prompt_ids": [...], "response_ids": [...], "group"?: int, "version"?: int}',
            field="history_load", flag="--history-load", metavar="PATH"),
    Setting("HISTOSPEC_SNAPSHOT_PATH", _E, _path, None,
            "where the index is saved at every weight update (flush_cache), at a clean exit and by the "
            "histospec_save RPC",
            field="snapshot_path", flag="--history-snapshot", metavar="PATH"),
    Setting("HISTOSPEC_CONTROL", _E, _control, "cost",
            "the step policy. cost (the default): each decode step decodes plainly (the target's own DECODE "
            "forward, one token per request) or verifies the drafts' most probable nodes at one of the widths "
            "2, 4, ... up to d, whichever gives the most tokens per second by the step costs the engine measures "
            "per width and batch size and the acceptance the drafts promise (calibrated apart for greedy and "
            "sampled requests); fixed: every decode step verifies at width d, as SGLang's NGRAM does",
            field="control", flag="--history-control", metavar="cost|fixed"),
    Setting("HISTOSPEC_THREADS", _E, _int(0, 64), 0,
            "threads for the index's batch calls (drafting, appending accepted tokens), the scheduler's "
            "included; batches of 32+ requests are split, drafts are the same (0: min(4, cores available))",
            field="threads", flag="--history-threads", metavar="N"),
    Setting("HISTOSPEC_HUGE_PAGES", _E, _choice("0", "1"), "0",
            "1: the index's memory on transparent huge pages (glibc's GLIBC_TUNABLES=glibc.malloc.hugetlb=1, "
            "set for the scheduler processes): faster drafts and appends, slower first touch of fresh memory",
            field="huge_pages", flag="--history-huge-pages", metavar="0|1"),
    Setting("HISTOSPEC_LOG_EVERY", _E, _int(0), 200,
            "log acceptance, coverage, index size and draft time every N decode steps (0: never)",
            field="log_every", flag="--history-log-every", metavar="N"),
    Setting("HISTOSPEC_LENIENCE", _E, _float(1.0, 1e6), 1.0,
            "ℓ in [1, 1e6]: a draft node is accepted with probability min(1, ℓ·p) under sampling "
            "(SGLang's --speculative-accept-threshold-acc = 1/ℓ), and SPEC-RL's default ℓ; 1 is exact. "
            "Lossy above 1; log-probs returned stay the current policy's",
            field="lenience"),
    Setting("HISTOSPEC_CHECK_CONTEXT", _E, _choice("0", "1"), "0",
            "1: a debugging check at every decode step that each request's context in the index is what "
            "SGLang holds (its processed output tokens, then the accepted tokens it has not processed yet, "
            "adding up with its seq_lens); a request that disagrees is counted in "
            "histospec:context_mismatches_total and logged. Keeps a copy of every response in flight",
            field="check_context", flag="--history-check-context", metavar="0|1"),
    # Reaching a draft server: engines and trainers alike.
    Setting("HISTOSPEC_DRAFT_SERVER", _C, _address, None,
            "host:port of a histospec draft server (a comma list: its shards, a group's records on shard "
            "key mod n): engines follow its history and publish finished responses; SPEC-RL finds previous "
            "responses there",
            field="draft_server", flag="--history-draft-server", metavar="HOST:PORT"),
    Setting("HISTOSPEC_DRAFT_SERVER_MODE", _C, _choice("on_demand", "mirror"), "on_demand",
            "how an engine follows the draft server: on_demand (the default) holds the groups it drafts for, "
            "fetching a group's history when its first request arrives and following its new records; "
            "mirror subscribes to every record (the whole history in every engine, under its memory budget)",
            field="draft_server_mode", flag="--history-draft-server-mode", metavar="on_demand|mirror"),
    Setting("HISTOSPEC_DRAFT_SERVER_TOKEN_FILE", _C, _existing_file, None,
            "a file holding the draft server's bearer token (the server's --auth-token-file); every client "
            "of the server sends it", field="draft_server_token_file"),
    Setting("HISTOSPEC_DRAFT_SERVER_CA", _C, _existing_file, None,
            "PEM root certificates: talk to the draft server over TLS (the server's --tls-cert)",
            field="draft_server_ca"),
    Setting("HISTOSPEC_DRAFT_SERVER_ACTOR", _C, _actor, None,
            "namespace/name of a draft-server Ray actor (histospec-sgl ray draft-server): its address and "
            "token are looked up inside the Ray job, no file to copy"),
    # SPEC-RL and the trainer adapters.
    Setting("HISTOSPEC_SPECRL_TIMEOUT", _T, _seconds, 600.0,
            "SPEC-RL: seconds one engine call may take before the rollout fails with a clear error"),
    Setting("HISTOSPEC_SLIME_INNER_GENERATE", _T, _text, None,
            "slime: the generate function the adapter hands requests to, as a dotted path (default: "
            "slime's own)"),
    Setting("HISTOSPEC_N_SAMPLES", _T, _int(1), None,
            "OpenRLHF: --rollout.n_samples_per_prompt, which the SPEC-RL executor needs (required there)"),
    Setting("HISTOSPEC_INNER_AGENT_FUNC_PATH", _T, _path, None,
            "OpenRLHF: the executor SPEC-RL wraps, a file with an AgentExecutor (default: OpenRLHF's "
            "single-turn executor)"),
    Setting("HISTOSPEC_REMOTE_RM_URL", _T, _urls, None,
            "OpenRLHF: the single-turn executor's reward, URLs or a reward_func file, comma-separated"),
    # The draft server's own log.
    Setting("HISTOSPEC_LOG", _S, _text, "info",
            "the draft server's log filter (tracing's EnvFilter syntax, e.g. debug or histospec_server=trace)"),
    # Offline tools and benchmarks.
    Setting("HISTOSPEC_DATA_DIR", _O, _path, None,
            "the rollout logs' root for replay and the benchmarks; when set, the only one looked at (default: "
            "../shared/data/rollouts beside the checkout or the working directory)"),
    Setting("HISTOSPEC_TOKENIZER", _O, _path, None,
            "the tokenizer for text rollout logs (default: the Qwen3 tokenizer beside the data root)"),
    Setting("HISTOSPEC_MODEL_CACHE", _O, _path, None,
            "where bench engine's models are built and cached (default ~/.cache/histospec-sgl/models)",
            shown="~/.cache/histospec-sgl/models"),
    Setting("HISTOSPEC_SGLANG_0523", _O, _path, None,
            "SGLang 0.5.23 unpacked beside the environment's SGLang (scripts/setup_sglang_env.sh does it)"),
)

#: Retired names: setting one is an error that says what replaced it.
_SWITCH_OFF = ("the switch-off settings were retired: the cost model (HISTOSPEC_CONTROL=cost) decodes plainly the "
               "steps whose drafts do not pay, with no threshold to tune (bench/RESULTS.md, 'Tried and not kept', "
               "compares them); unset it")
RETIRED: dict[str, str] = {name: _SWITCH_OFF for name in (
    "HISTOSPEC_MAX_BATCH", "HISTOSPEC_MIN_ACCEPT", "HISTOSPEC_PROBE_EVERY", "HISTOSPEC_NARROW_VERIFY")}

#: Names this project's own tests and scripts read, never the package: they are declared, parsed and
#: documented with the tests (tests/helpers/dev_settings.py; docs/settings.md, "Development"), and listed
#: here only so that an engine a test starts, which inherits them, accepts them as it accepts every
#: other scope's variables (tests/unit/test_settings.py checks the two lists are the same).
DEVELOPMENT: frozenset[str] = frozenset({
    "HISTOSPEC_REQUIRE_SGLANG",
    "HISTOSPEC_TEST_MEMORY_GB",
    "HISTOSPEC_TEST_MODEL",
    "HISTOSPEC_TEST_ACTOR",
    "HISTOSPEC_TINY_MODEL",
    "HISTOSPEC_SHARED",
    "HISTOSPEC_REQUIRE_SHARED",
    "HISTOSPEC_SLIME_SRC",
    "HISTOSPEC_FUZZ_EXAMPLES",
    "HISTOSPEC_SGLANG_VERSION",
})

BY_NAME: dict[str, Setting] = {s.env: s for s in SETTINGS}
assert len(BY_NAME) == len(SETTINGS) and all(s.scope in SCOPES for s in SETTINGS)


#: Called in order by :func:`resolve` to complete the environment from what the process runs in. The
#: Ray integration adds the draft-server actor's lookup (address, token, CA) when its setup hook runs
#: (:func:`histospec_sgl.integrations.ray_setup.setup`), so engines and trainers alike get them with
#: nothing imported from the Ray side here.
RESOLVERS: list[Callable[[], object]] = []


def resolve() -> None:
    """Runs the :data:`RESOLVERS` (each logs and returns on failure; none raises)."""
    for r in list(RESOLVERS):
        r()


def registered(name: str) -> bool:
    return name in BY_NAME


def value(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The value of registered variable ``name`` in ``environ`` (default: this process's), parsed;
    its default when unset or empty.

    Raises:
        SettingError: a bad value; the message names the variable and says what it means.
        KeyError: ``name`` is not registered (a bug in the caller).
    """
    s = BY_NAME[name]
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return s.default
    try:
        return s.parse(raw)
    except ValueError as e:
        raise SettingError(f"{name}={raw!r}: {e} ({s.help})") from None


def check_names(environ: Mapping[str, str] | None = None) -> None:
    """Every ``HISTOSPEC_*`` name in ``environ`` is registered and not retired.

    Raises:
        SettingError: retired names (with what replaced them) or unknown ones (with the closest
            registered name, when one is close).
    """
    env = os.environ if environ is None else environ
    names = [k for k in env if k.startswith("HISTOSPEC_")]
    retired = sorted(k for k in names if k in RETIRED)
    if retired:
        raise SettingError(f"{', '.join(retired)}: {RETIRED[retired[0]]}")
    unknown = sorted(k for k in names if k not in BY_NAME and k not in DEVELOPMENT)
    if unknown:
        hints = []
        for k in unknown:
            close = difflib.get_close_matches(k, list(BY_NAME), n=1, cutoff=0.8)
            hints.append(f"{k} (did you mean {close[0]}?)" if close else k)
        raise SettingError(f"unknown setting {', '.join(hints)}; docs/settings.md lists every HISTOSPEC_* "
                           "variable")


def table(scopes: tuple[str, ...] | None = None, *, with_scope: bool = False,
          flagged: bool | None = None, settings: tuple[Setting, ...] = SETTINGS) -> str:
    """The ``settings`` (default: the package's) of ``scopes`` (default: all) as a Markdown table;
    ``flagged``: only the settings with (True) or without (False) a ``--history-*`` option."""
    head = "| variable | scope | default | meaning |" if with_scope else "| variable | default | meaning |"
    rows = [head, "|---|---|---|---|" if with_scope else "|---|---|---|"]
    for s in settings:
        if scopes is not None and s.scope not in scopes:
            continue
        if flagged is not None and bool(s.flag) != flagged:
            continue
        cells = [f"`{s.env}`", *([s.scope] if with_scope else []), s.shown_default(), s.help]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)
