"""The settings registry (histospec_sgl/settings.py) against the tree: every ``HISTOSPEC_*`` name the
code, scripts, examples and docs use is registered, the package reads them only through the registry,
the docs show the registry's own table, and an engine accepts every other scope's variables."""

from __future__ import annotations

import re
from pathlib import Path

import dev_settings
import pytest
from _scopes import other_scopes

from histospec_sgl import settings
from histospec_sgl.engine.config import ENGINE_SCOPES, HistoryConfig, HistoryConfigError

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"\bHISTOSPEC_[A-Z0-9]+(?:_[A-Z0-9]+)*\b")
#: Test modules that use unregistered names on purpose (typos the check must catch).
TYPO_TESTS = {"test_plugin_config.py", "test_settings.py"}
#: The typo docs/troubleshooting.md shows the check catching.
DOC_TYPOS = {"HISTOSPEC_LOG_EVRY"}


def _files() -> list[Path]:
    out = [ROOT / "README.md", ROOT / "Makefile"]
    for folder, patterns in (("histospec_sgl", ("*.py",)), ("tests", ("*.py",)), ("scripts", ("*.sh", "*.py")),
                             ("examples", ("*",)), ("docs", ("*.md",)), ("bench", ("*.md", "*.sh", "*.py")),
                             ("rust", ("*.rs",)), (".ci", ("*",))):
        for pattern in patterns:
            out += [p for p in (ROOT / folder).rglob(pattern) if p.is_file() and p.name not in TYPO_TESTS]
    return out


def test_every_name_in_the_tree_is_registered():
    unknown: dict[str, str] = {}
    for path in _files():
        for name in NAME.findall(path.read_text(errors="replace")):
            if (not settings.registered(name) and name not in dev_settings.BY_NAME and name not in settings.RETIRED
                    and name not in DOC_TYPOS):
                unknown.setdefault(name, str(path.relative_to(ROOT)))
    assert unknown == {}


def test_the_wheel_ships_the_products_settings_and_only_the_names_of_the_tests():
    """The tests' and scripts' settings are declared with the tests; the package lists their names
    only, the same names, none of them its own, and reads none of them."""
    assert settings.DEVELOPMENT == frozenset(dev_settings.BY_NAME)
    assert not settings.DEVELOPMENT & set(settings.BY_NAME)
    assert all(s.scope in settings.SCOPES for s in settings.SETTINGS) and "tests" not in settings.SCOPES
    package = "\n".join(p.read_text() for p in (ROOT / "histospec_sgl").rglob("*.py") if p.name != "settings.py")
    assert sorted(n for n in settings.DEVELOPMENT if n in package) == []
    settings.check_names({name: "1" for name in settings.DEVELOPMENT})  # an engine a test starts accepts them


def test_the_package_reads_histospec_variables_only_through_the_registry():
    read = re.compile(r"""(environ\.get\(|environ\[|getenv\()\s*["']HISTOSPEC_""")
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "histospec_sgl").rglob("*.py")
                 if p.name != "settings.py" and read.search(p.read_text())]
    assert offenders == []


def test_docs_show_the_registrys_tables():
    # Regenerate: python -c "from histospec_sgl import settings; print(settings.table(with_scope=True))"
    assert settings.table(with_scope=True) in (ROOT / "docs" / "settings.md").read_text()
    assert dev_settings.table() in (ROOT / "docs" / "settings.md").read_text()
    from histospec_sgl.engine.config import settings_table

    assert settings_table() in (ROOT / "docs" / "plugin.md").read_text()


def test_launch_server_options_come_from_the_registry():
    from histospec_sgl.plugin.launch import OPTIONS

    flagged = {s.env for s in settings.SETTINGS if s.flag}
    assert {env for env, _ in OPTIONS.values()} == flagged
    assert all(settings.BY_NAME[env].scope in ENGINE_SCOPES for env in flagged)


def test_an_engine_accepts_every_other_scopes_variables(tmp_path):
    """The documented trainer, client, server, tools and test variables all reach an engine in a Ray
    job; it must start (this is the check SGLang's server start runs), and every value must parse."""
    env = other_scopes(tmp_path)
    # Every variable but the engine's own, and the draft server's address (which would connect).
    assert sorted(env) == sorted([*(s.env for s in settings.SETTINGS
                                    if s.scope != "engine" and s.env != "HISTOSPEC_DRAFT_SERVER"),
                                  *dev_settings.BY_NAME])
    cfg = HistoryConfig.from_env(env)
    assert cfg.draft_server_token_file == env["HISTOSPEC_DRAFT_SERVER_TOKEN_FILE"]
    assert cfg.draft_server_mode == "mirror"
    for name in env:  # every example is a valid value
        if name in dev_settings.BY_NAME:
            dev_settings.BY_NAME[name].parse(env[name])
        else:
            settings.value(name, env)


@pytest.mark.parametrize("env, needle", [
    ({"HISTOSPEC_LOG_EVRY": "5"}, r"unknown setting HISTOSPEC_LOG_EVRY \(did you mean HISTOSPEC_LOG_EVERY\?\)"),
    ({"HISTOSPEC_SPECRL_TIMEOT": "5"}, r"did you mean HISTOSPEC_SPECRL_TIMEOUT"),
    ({"HISTOSPEC_DRAFT_SERVER": "nohost"}, r"HISTOSPEC_DRAFT_SERVER='nohost': .* not host:port"),
    ({"HISTOSPEC_DRAFT_SERVER_TOKEN_FILE": "/nonexistent/token"}, r"TOKEN_FILE.*no such file"),
    ({"HISTOSPEC_DRAFT_SERVER_ACTOR": "justaname"}, r"not namespace/name"),
])
def test_engine_errors_name_the_variable(env, needle):
    with pytest.raises(HistoryConfigError, match=needle):
        HistoryConfig.from_env(env)


def test_trainer_values_are_checked_where_they_are_read(monkeypatch):
    from histospec_sgl.specrl.guard import Options

    monkeypatch.setenv("HISTOSPEC_SPECRL_TIMEOUT", "soon")
    with pytest.raises(settings.SettingError, match="HISTOSPEC_SPECRL_TIMEOUT='soon'"):
        Options.resolve()
    monkeypatch.setenv("HISTOSPEC_SPECRL_TIMEOUT", "45")
    monkeypatch.setenv("HISTOSPEC_LENIENCE", "2")
    opts = Options.resolve()
    assert (opts.timeout, opts.lenience) == (45.0, 2.0)
    monkeypatch.setenv("HISTOSPEC_LENIENCE", "0.5")  # one range for the variable, engine and trainer alike
    with pytest.raises(settings.SettingError, match="HISTOSPEC_LENIENCE"):
        Options.resolve()
