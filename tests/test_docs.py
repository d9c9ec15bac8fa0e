"""The documentation against the code: the settings table is the code's own, every environment
variable the package reads is documented, every relative link resolves, and the README stays a
front page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from histospec_sgl.plugin.config import ENV_NAMES, settings_table

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS, ROOT / "bench" / "RESULTS.md", ROOT / "bench" / "gpu" / "NOTES.md"]


def test_plugin_settings_table_is_the_codes():
    # Regenerate with: python -c "from histospec_sgl.plugin.config import settings_table; print(settings_table())"
    assert settings_table() in (ROOT / "docs" / "plugin.md").read_text()


def test_every_environment_variable_is_documented():
    text = "\n".join(p.read_text() for p in DOCS)
    assert sorted(n for n in ENV_NAMES if n not in text) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    missing = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
        if "://" not in target and not (page.parent / target).exists():
            missing.append(target)
    assert missing == []


def test_readme_is_a_front_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
