"""The documentation against the code: the settings table is the code's own, every environment
variable the package reads is documented, every relative link resolves, and the README stays a
front page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from histospec_sgl import settings
from histospec_sgl.engine.config import settings_table

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS, ROOT / "bench" / "RESULTS.md", ROOT / "bench" / "gpu" / "NOTES.md"]


def test_plugin_settings_table_is_the_codes():
    # Regenerate with: python -c "from histospec_sgl.engine.config import settings_table; print(settings_table())"
    assert settings_table() in (ROOT / "docs" / "plugin.md").read_text()


def test_cli_reference_is_the_parsers():
    # Regenerate: python -c "from histospec_sgl.cli import reference; print(reference())"
    from histospec_sgl.cli import reference

    assert reference() in (ROOT / "docs" / "cli.md").read_text()


#: Messages SGLang prints itself, checked against its source where the SGLang environment exists.
SGLANG_MESSAGES = {"Unknown speculative algorithm name: HISTORY": "Unknown speculative algorithm name: "}


def test_troubleshooting_quotes_messages_the_code_prints():
    """Each heading of docs/troubleshooting.md quotes a message; every piece between its ``...`` is in
    the package's source or the draft server's (the message's own file), or in SGLang's for the
    messages SGLang prints."""
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    headings = re.findall(r"^### `(.+)`$", text, re.M)
    assert len(headings) >= 15
    sources = {p: p.read_text() for p in [*(ROOT / "histospec_sgl").rglob("*.py"),
                                          *(ROOT / "rust" / "histospec-server" / "src").rglob("*.rs")]}
    missing = []
    for h in headings:
        if h in SGLANG_MESSAGES:
            spec = ROOT / ".venv-sglang" / "lib" / "python3.11" / "site-packages" / "sglang" / "srt" / "speculative"
            if spec.is_dir():
                found = any(SGLANG_MESSAGES[h] in p.read_text() for p in spec.glob("*.py"))
                assert found, h
            continue
        pieces = [x.strip() for x in re.split(r"\.\.\.|\(what the setting means\)", h) if x.strip()]
        if not any(all(piece in src for piece in pieces) for src in sources.values()):
            missing.append(h)
    assert missing == []


def test_draft_knob_table_is_the_indexs():
    """docs/index.md's knob table names every knob, with the default the index itself holds."""
    from histospec_sgl import HistoryIndex

    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", (ROOT / "docs" / "index.md").read_text(), re.M)
    documented = {name: float(default) for name, default in rows if name in HistoryIndex.draft_knobs()}
    defaults = HistoryIndex.draft_defaults()
    assert sorted(documented) == sorted(defaults)
    assert {k: round(v, 6) for k, v in documented.items()} == {k: round(float(v), 6) for k, v in defaults.items()}


def test_every_environment_variable_is_documented():
    text = "\n".join(p.read_text() for p in DOCS)
    assert sorted(s.env for s in settings.SETTINGS if s.env not in text) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    missing = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
        if "://" not in target and not (page.parent / target).exists():
            missing.append(target)
    assert missing == []


def test_readme_is_a_front_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


#: The benchmarks the README, docs/ and bench/README.md cite for their numbers: each keeps a section
#: of bench/RESULTS.md (rerun to update it; never dropped).
CITED_SECTIONS = ("replay", "bench index", "bench worker", "bench sync", "bench specrl", "bench engine",
                  "bench engine --trace grpo", "bench lengths", "simulate")


def _results() -> str:
    return (ROOT / "bench" / "RESULTS.md").read_text()


def test_every_cited_benchmark_has_its_section_in_results():
    headings = re.findall(r"^## `histospec-sgl ([^`]+)`", _results(), re.M)
    assert [s for s in CITED_SECTIONS if s not in headings] == []


def test_results_is_the_current_page_not_a_diary():
    text = _results().lower()
    for stale in ("predates", "what changed since", "previous run", "stale column", "this column"):
        assert stale not in text, stale


def _numbers(text: str) -> set[str]:
    """Measured figures as written: decimals (2.53, 1.03x, 0.70-0.82x) and their ranges' ends."""
    return set(re.findall(r"(?<![\w.])\d+\.\d+(?![\d.])", text))


def test_the_readmes_numbers_are_in_results():
    readme = (ROOT / "README.md").read_text()
    gives = readme[readme.index("## What it gives"):]
    gives = gives[: gives.index("\n## ", 4)]
    missing = sorted(n for n in _numbers(gives) if n not in _numbers(_results()))
    assert missing == [], f"README figures not in bench/RESULTS.md: {missing}"
