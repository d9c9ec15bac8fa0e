"""The main job from a plain install: a fresh virtual environment with only the wheel and the
dependencies pip resolves for it (no extras) runs ``histospec-sgl replay --preset humaneval-sample``,
and a command that needs an extra says in one line what to install, with no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def plain_venv(tmp_path_factory) -> Path:
    wheels = sorted((ROOT / "target" / "wheels-sglang").glob("histospec_sgl-*.whl"))
    tmp = tmp_path_factory.mktemp("plain")
    if not wheels:  # scripts/setup_sglang_env.sh builds it from this checkout; otherwise build it here
        subprocess.run([str(ROOT / ".venv" / "bin" / "maturin"), "build", "--release", "-q", "-o", str(tmp / "w")],
                       check=True, cwd=ROOT, timeout=800)
        wheels = sorted((tmp / "w").glob("histospec_sgl-*.whl"))
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(wheels[-1])], check=True,
                   timeout=600)
    return venv


def _cli(venv: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv / "bin" / "histospec-sgl"), *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env={"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(cwd)})


def test_main_job_from_a_plain_install(plain_venv, tmp_path):
    r = _cli(plain_venv, "replay", "--preset", "humaneval-sample", "--json", str(tmp_path / "r.json"), cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "Traceback" not in r.stderr
    # The table, in full off a terminal: no cell cut short, our row on one line with every column.
    ours = [line for line in r.stdout.splitlines() if line.lstrip("│ ").startswith("ours ")]
    assert len(ours) == 1 and "…" not in r.stdout, r.stdout[-3000:]
    lines = r.stdout.splitlines()
    h = next(i for i, line in enumerate(lines) if "method" in line)
    assert lines[h + 1].startswith("┡"), "\n".join(lines[h:h + 4])  # column titles not wrapped
    assert ours[0].count("│") == lines[h].count("┃") >= 4
    assert (tmp_path / "r.json").stat().st_size > 0


def test_simulate_on_the_shipped_sample_from_a_plain_install(plain_venv, tmp_path):
    """The README's simulate line: a whole step of the shipped HumanEval sample, from a bare install."""
    r = _cli(plain_venv, "simulate", "--preset", "humaneval-sample", "--groups", "8", "--per-group", "8",
             "--max-running", "32", "--steps", "2", "--json", str(tmp_path / "s.json"), cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "Traceback" not in r.stderr and "history_cost_model" in r.stdout
    assert (tmp_path / "s.json").stat().st_size > 0


@pytest.mark.parametrize("args, needs", [
    (("replay", "--preset", "humaneval-sample", "--plot", "plots"), "pip install './histospec-sgl[bench]'"),
    (("bench", "engine", "--batch-sizes", "1", "--repeats", "1"), "pip install sglang"),
    (("ray", "draft-server"), "pip install ray"),
])
def test_commands_that_need_an_extra_say_what_to_install(plain_venv, tmp_path, args, needs):
    r = _cli(plain_venv, *args, cwd=tmp_path)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-4000:]
    assert needs in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def _extras() -> set[str]:
    import tomllib

    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def test_every_install_line_can_run_today():
    """histospec-sgl is not on PyPI: an install line names a checkout (``./histospec-sgl``, a local path)
    or a built wheel, never the bare package name; every extra named anywhere exists in pyproject.toml."""
    import re

    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").rglob("*.sh"),
             *(p for p in (ROOT / "histospec_sgl").rglob("*.py") if p.name != "install.py")]
    bare, unknown = [], []
    for page in pages:
        text = page.read_text()
        bare += [f"{page.name}: {m}" for m in re.findall(r"pip install [^\n]*?(?<![./\w-])histospec-sgl\b[^\n]*", text)]
        unknown += [f"{page.name}: [{e}]" for e in re.findall(r"histospec-sgl\[(\w+)\]", text) if e not in _extras()]
    assert bare == [] and unknown == []
    from histospec_sgl.install import pip_line
    from histospec_sgl.integrations import versions

    assert "./histospec-sgl[bench]" in pip_line("bench")
    for dist in versions.SUPPORTED:
        msg = versions.problem(dist, "0.0.1")
        assert msg is not None and ("pip install -e" in msg if dist == "slime" else f"./histospec-sgl[{dist}]" in msg)
