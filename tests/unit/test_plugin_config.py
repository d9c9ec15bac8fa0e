"""The plugin's ``HISTOSPEC_*`` settings and ``histospec-sgl launch-server`` (no SGLang needed up to
the exec)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from histospec_sgl import HistoryIndex, settings
from histospec_sgl.engine.config import HistoryConfig, HistoryConfigError, parse_size, settings_table
from histospec_sgl.engine.drafter import group_of

# -- settings --------------------------------------------------------------------------------------


def test_config_defaults_and_values():
    assert HistoryConfig.from_env({}) == HistoryConfig()
    cfg = HistoryConfig.from_env({
        "HISTOSPEC_MAX_RESPONSES": "32", "HISTOSPEC_MEMORY_BUDGET": "512M",
        "HISTOSPEC_DRAFT_KNOBS": "recency=0,follow=0", "HISTOSPEC_CONTROL": "cost",
    })
    assert (cfg.max_responses, cfg.memory_budget, cfg.control) == (32, 512 << 20, "cost")
    assert HistoryConfig().control == "cost" and HistoryConfig.from_env({"HISTOSPEC_CONTROL": " Fixed"}).control == "fixed"
    assert HistoryConfig.from_env({"HISTOSPEC_HUGE_PAGES": "1"}).huge_pages == "1"
    assert HistoryConfig.from_env({"HISTOSPEC_THREADS": "3"}).index_kwargs()["threads"] == 3
    assert 1 <= HistoryConfig().index_kwargs()["threads"] <= 4  # 0: min(4, cores available)
    assert HistoryIndex(**HistoryConfig.from_env({"HISTOSPEC_THREADS": "3"}).index_kwargs()).threads == 3
    kw = cfg.index_kwargs()
    assert kw["recency"] == 0.0 and kw["max_bytes"] == 512 << 20 and kw["follow"] == 0.0
    assert HistoryIndex(**kw).draft_config()["follow"] == 0.0  # the index takes every setting
    assert parse_size("4G") == 4 << 30 and parse_size("1.5KiB") == 1536 and parse_size("100") == 100
    assert "HISTOSPEC_DRAFT_SERVER" in settings_table()
    # Any draft knob by name: checked by the index, handed to it, and overriding only what it names;
    # the defaults are the index's own (no second copy in Python).
    assert "min_match" not in cfg.index_kwargs() and "follow" not in HistoryConfig().index_kwargs()
    assert HistoryIndex().draft_config() == HistoryIndex.draft_defaults()
    assert HistoryIndex.draft_defaults(follow=0)["follow"] == 0.0
    with pytest.raises(ValueError, match="max_children"):
        HistoryIndex.draft_defaults(max_children=0)
    knobs = HistoryConfig.from_env({"HISTOSPEC_DRAFT_KNOBS": " max_children=3, escape=0.5,follow=0 "})
    assert knobs.draft_knobs == (("max_children", 3), ("escape", 0.5), ("follow", 0))
    drawn = HistoryIndex(**knobs.index_kwargs()).draft_config()
    assert (drawn["max_children"], drawn["escape"], drawn["follow"], drawn["min_match"]) == (3, 0.5, 0.0, 1)


@pytest.mark.parametrize("env, needle", [
    ({"HISTOSPEC_MAX_RESPONSES": "-1"}, "HISTOSPEC_MAX_RESPONSES"),
    ({"HISTOSPEC_MEMORY_BUDGET": "lots"}, "HISTOSPEC_MEMORY_BUDGET"),
    ({"HISTOSPEC_VERSION_DECAY": "0"}, "HISTOSPEC_VERSION_DECAY"),
    ({"HISTOSPEC_LENIENCE": "inf"}, "HISTOSPEC_LENIENCE"),
    ({"HISTOSPEC_HUGE_PAGES": "yes"}, "HISTOSPEC_HUGE_PAGES"),
    ({"HISTOSPEC_LENIENCE": "0.5"}, "HISTOSPEC_LENIENCE"),
    ({"HISTOSPEC_DRAFT_KNOBS": "follow=1"}, "HISTOSPEC_DRAFT_KNOBS.*follow"),
    ({"HISTOSPEC_FOLLOW": "0.2"}, "unknown setting HISTOSPEC_FOLLOW"),
    ({"HISTOSPEC_CONTROL": "thresholds"}, "HISTOSPEC_CONTROL.*switch-off settings"),
    ({"HISTOSPEC_CONTROL": "always"}, "HISTOSPEC_CONTROL.*not one of cost, fixed"),
    # The retired switch-off settings are errors that say what replaced them, not unknown names.
    ({"HISTOSPEC_NARROW_VERIFY": "1"}, "HISTOSPEC_NARROW_VERIFY: the switch-off settings were retired.*cost model"),
    ({"HISTOSPEC_MAX_BATCH": "64", "HISTOSPEC_MIN_ACCEPT": "1"}, "HISTOSPEC_MAX_BATCH, HISTOSPEC_MIN_ACCEPT: .*retired"),
    ({"HISTOSPEC_PROBE_EVERY": "8"}, "HISTOSPEC_PROBE_EVERY: .*retired"),
    ({"HISTOSPEC_THREADS": "65"}, "HISTOSPEC_THREADS"),
    ({"HISTOSPEC_MAX_REPSONSES": "3"}, "unknown setting HISTOSPEC_MAX_REPSONSES"),
    ({"HISTOSPEC_HISTORY_LOAD": "/nonexistent/h.jsonl"}, "no such file"),
    ({"HISTOSPEC_DRAFT_KNOBS": "recencyy=0.1"}, "HISTOSPEC_DRAFT_KNOBS.*unknown draft knob"),
    ({"HISTOSPEC_DRAFT_KNOBS": "max_children=0"}, "HISTOSPEC_DRAFT_KNOBS.*max_children"),
    ({"HISTOSPEC_DRAFT_KNOBS": "escape"}, "HISTOSPEC_DRAFT_KNOBS.*name=value"),
    ({"HISTOSPEC_DRAFT_KNOBS": "escape=much"}, "HISTOSPEC_DRAFT_KNOBS.*not a number"),
    ({"HISTOSPEC_DRAFT_KNOBS": "follow=0,follow=0.2"}, "HISTOSPEC_DRAFT_KNOBS.*set twice"),
])
def test_config_errors_name_the_variable(env, needle):
    with pytest.raises(HistoryConfigError, match=needle):
        HistoryConfig.from_env(env)


def test_group_param():
    assert group_of(None) is None and group_of({"other": 1}) is None
    assert group_of({"histospec_group": 7}) == 7
    assert group_of({"histospec_group": (1 << 64) - 1}) == (1 << 64) - 1
    s = group_of({"histospec_group": "prompt-17"})
    assert s == group_of({"histospec_group": "prompt-17"}) and 0 <= s < 1 << 64
    assert group_of({"histospec_group": -1}) == (1 << 64) - 1  # a signed 64-bit key
    for bad in (1 << 64, 1.5, True, [1]):
        with pytest.raises(ValueError, match="histospec_group"):
            group_of({"histospec_group": bad})


# -- the launcher (no SGLang needed up to the exec) --------------------------------------------------


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "histospec_sgl.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=60)


def test_launch_server_help_and_errors():
    r = _cli("launch-server", "--help")
    assert r.returncode == 0 and "--history-load" in r.stdout and "HISTOSPEC_MEMORY_BUDGET" in r.stdout
    # The table names only the settings that have an option; the others are listed as environment-only.
    table, _, tail = r.stdout.partition("without an option")
    env_only = tail.split(":", 1)[1].replace(",", " ").split()
    for s in settings.SETTINGS:
        if s.scope in ("engine", "client"):
            assert (f"`{s.env}`" in table) == bool(s.flag), s.env
            assert (s.env in env_only) != bool(s.flag), s.env
    r = _cli("launch-server", "--history-memory-budget", "lots", "--model-path", "m")
    assert r.returncode == 2 and "HISTOSPEC_MEMORY_BUDGET='lots'" in r.stderr
    r = _cli("launch-server", "--model-path", "m", "--history-draft-knobs", "recency=bogus")
    assert r.returncode == 2 and "HISTOSPEC_DRAFT_KNOBS" in r.stderr
    r = _cli("launch-server", "--model-path", "m", "--attention-backend", "triton")
    assert r.returncode == 2 and "--attention-backend flashinfer" in r.stderr
    r = _cli("launch-server", "--model-path", "m", "--speculative-algorithm", "NGRAM")
    assert r.returncode == 2 and "runs HISTORY" in r.stderr
    assert "launch-server" in _cli("--help").stdout
    if importlib.util.find_spec("sglang") is None:
        r = _cli("launch-server", "--check")
        assert r.returncode == 1 and "sglang is not installed" in r.stderr


def _imports(package: str) -> dict[str, list[str]]:
    """The modules each file of ``package`` imports (absolute ``histospec_sgl`` names, relative ones
    resolved), wherever in the file the import sits."""
    import ast
    import importlib
    from pathlib import Path

    root = Path(importlib.import_module(package).__file__).parent
    out = {}
    for path in root.glob("*.py"):
        names = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package.rsplit(".", node.level - 1)[0] + "." if node.level else ""
                names.append(base + (node.module or ""))
        out[path.name] = names
    return out


OFFLINE = ("histospec_sgl.replay", "histospec_sgl.simulate", "histospec_sgl.bench")

#: Where each layer's code may not reach: the runtime (engine, plugin, sync, specrl, integrations)
#: imports none of the offline tools; the engine neither SGLang's adapter nor a trainer; the SGLang
#: plugin never the trainer side; of the offline tools, replay (the measurement core) imports neither
#: of the others and simulate not bench (bench sits on both).
FORBIDDEN = {
    "histospec_sgl.engine": ("histospec_sgl.plugin", "histospec_sgl.integrations", *OFFLINE, "sglang"),
    "histospec_sgl.plugin": ("histospec_sgl.integrations", *OFFLINE),
    "histospec_sgl.sync": ("histospec_sgl.plugin", "histospec_sgl.integrations", *OFFLINE),
    "histospec_sgl.specrl": ("histospec_sgl.plugin", "histospec_sgl.integrations", *OFFLINE),
    "histospec_sgl.integrations": OFFLINE,
    "histospec_sgl.integrations.verl": OFFLINE,
    "histospec_sgl.replay": ("histospec_sgl.simulate", "histospec_sgl.bench"),
    "histospec_sgl.simulate": ("histospec_sgl.bench",),
}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_runtime_layers_import_nothing_above_them(package):
    """engine/ runs inside the engine without SGLang; plugin/ adapts SGLang only (the Ray integration
    hands it the draft-server actor lookup, ``registration.ENV_RESOLVERS``, instead of the plugin
    importing it). No runtime layer imports the offline tools, and those never import each other in a
    circle."""
    offenders = [f"{f}: {n}" for f, names in _imports(package).items() for n in names
                 if any(n == x or n.startswith(x + ".") for x in FORBIDDEN[package])]
    assert offenders == []


def test_which_requests_need_the_full_sampler_on_every_step():
    """The one rule docs/plugin.md tabulates, on SGLang's request fields: what tree verification does
    not apply as a plain step's sampler does sends the request (and its batch) to plain steps."""
    from types import SimpleNamespace

    from histospec_sgl.plugin.requests import needs_full_sampler, request_class, returned

    def req(**sp):
        base = dict(temperature=1.0, top_k=1 << 30, top_p=1.0, min_p=0.0, frequency_penalty=0.0,
                    presence_penalty=0.0, repetition_penalty=1.0, min_new_tokens=0, sampling_seed=None)
        return SimpleNamespace(sampling_params=SimpleNamespace(**{**base, **sp}), custom_logit_processor=None)

    full = {"min_p": dict(min_p=0.1), "repetition": dict(repetition_penalty=1.3),
            "frequency": dict(frequency_penalty=0.5), "presence": dict(presence_penalty=0.5),
            "min_new_tokens": dict(min_new_tokens=4), "top_k and top_p": dict(top_k=20, top_p=0.9),
            "seed": dict(sampling_seed=7), "greedy with a penalty": dict(temperature=0.0, repetition_penalty=1.2)}
    verified = {"plain sampling": {}, "top_k alone": dict(top_k=20), "top_p alone": dict(top_p=0.9),
                "greedy with min_p": dict(temperature=0.0, min_p=0.1),
                "greedy with top_k and top_p": dict(temperature=0.0, top_k=20, top_p=0.9)}
    assert [k for k, v in full.items() if not needs_full_sampler(req(**v))] == []
    assert [k for k, v in verified.items() if needs_full_sampler(req(**v))] == []
    r = req()
    r.custom_logit_processor = "a serialized processor"
    assert needs_full_sampler(r)
    assert request_class(req(temperature=0.0)) == request_class(req(top_k=1)) == "greedy"
    assert request_class(req()) == "sampled"
    # A verify step may accept tokens past where the request finished; the response leaves them out.
    assert returned(SimpleNamespace(output_ids=[5, 6, 7, 8], finished_len=3)) == [5, 6, 7]
    assert returned(SimpleNamespace(output_ids=[5, 6], finished_len=None)) == [5, 6]


def test_a_request_the_step_before_ended_is_known_before_sglang_processes_it():
    """Under the overlap scheduler a request's last accepted tokens are not in ``output_ids`` yet when
    the next step is drafted: they end it when they reach ``max_new_tokens`` or hold a stop token
    (its own stop ids, the model's EOS ids, the tokenizer's), unless it ignores EOS; the fields SGLang's
    ``Req._check_token_based_finish`` reads."""
    from types import SimpleNamespace

    from histospec_sgl.plugin.requests import ended

    def req(out, cap=32, stops=(), eos=(2,), ignore_eos=False, tokenizer=None):
        sp = SimpleNamespace(max_new_tokens=cap, stop_token_ids=set(stops), ignore_eos=ignore_eos)
        return SimpleNamespace(sampling_params=sp, output_ids=list(out), eos_token_ids=set(eos), tokenizer=tokenizer)

    assert ended(req(range(28), cap=32), [7, 8, 9, 10])
    assert not ended(req(range(28), cap=32), [7, 8, 9])
    assert not ended(req(range(32), cap=32), [])  # all processed: SGLang would have finished it
    assert ended(req([5], stops=[9]), [7, 9, 4]) and ended(req([5]), [2])
    assert not ended(req([5], stops=[9], ignore_eos=True), [9, 2])
    assert ended(req([5], eos=(), tokenizer=SimpleNamespace(eos_token_id=0, additional_stop_token_ids={11})), [11])
    assert not ended(req([5], eos=(), tokenizer=SimpleNamespace(eos_token_id=0, additional_stop_token_ids=None)), [3])
