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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from histospec_sgl import settings
from histospec_sgl.settings import SettingError, parse_size

__all__ = ["HistoryConfig", "HistoryConfigError", "parse_size", "settings_table", "NAME", "SUPPORTED_SGLANG",
           "default_threads"]

#: Errors of the settings (the registry's own class; the name the plugin has always raised).
HistoryConfigError = SettingError

#: The algorithm's name on SGLang's command line.
NAME = "HISTORY"
#: SGLang versions the plugin is written for (slime pins 0.5.15; 0.5.17 is what CI and the GPU box run).
SUPPORTED_SGLANG = ((0, 5, 15), (0, 5, 23))

#: The scopes an engine reads (the rest of the registered names it accepts unread).
ENGINE_SCOPES = ("engine", "client")


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
    control: str = "cost"
    threads: int = 0
    huge_pages: str = "0"
    log_every: int = 200
    lenience: float = 1.0
    check_context: str = "0"
    draft_server: str | None = None
    draft_server_mode: str = "on_demand"
    draft_server_token_file: str | None = None
    draft_server_ca: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> HistoryConfig:
        """Reads and checks the engine's ``HISTOSPEC_*`` variables (:data:`ENGINE_SCOPES`); every
        other registered name is accepted unread (a trainer's or a tool's, handed to the engine by a
        Ray runtime env).

        Raises:
            HistoryConfigError: a bad value (the message names the variable), an unregistered
                ``HISTOSPEC_`` variable (most likely a typo), a retired one, or a load path that does
                not exist.
        """
        env = os.environ if environ is None else environ
        settings.check_names(env)
        values: dict[str, Any] = {}
        for s in settings.SETTINGS:
            if s.scope in ENGINE_SCOPES:
                v = settings.value(s.env, env)  # checked even where the config keeps no field
                if s.field is not None:
                    values[s.field] = v
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
    """The engine's settings as a Markdown table (docs/plugin.md and ``launch-server --help``)."""
    return settings.table(ENGINE_SCOPES)
