"""The install line every hint in the package gives: one a user can run today.

histospec-sgl is not on PyPI, so a line names a checkout (``./histospec-sgl``), which pip builds
(the Rust core, about 3 minutes on two cores), or the wheel ``maturin build --release`` writes.
``tests/docs/test_install.py`` checks that every extra a message or page names exists in pyproject.toml.
"""

from __future__ import annotations

__all__ = ["pip_line"]


def pip_line(extra: str | None = None) -> str:
    """``pip install './histospec-sgl[extra]'`` and where that path comes from."""
    target = f"./histospec-sgl[{extra}]" if extra else "./histospec-sgl"
    return (f"pip install '{target}' (a checkout of histospec-sgl: it is not on PyPI yet; or the wheel "
            f"`maturin build --release` writes{', with the same extra' if extra else ''})")
