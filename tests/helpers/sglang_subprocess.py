"""Running code in .venv-sglang (real SGLang) from the tests, in fresh subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

DRIVERS = Path(__file__).resolve().parents[1] / "drivers"
#: Server arguments SGLang's argument code accepts without a GPU or weights.
BASE = ["--device", "cpu", "--load-format", "dummy", "--skip-tokenizer-init"]


def sglang_env(**extra: str) -> dict[str, str]:
    """This process's environment without any ``HISTOSPEC_*`` setting, plus ``extra``."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("HISTOSPEC_")}, **extra}


def run_sglang(py: Path, code: str, *argv: str, env: dict | None = None, timeout: int = 240
               ) -> subprocess.CompletedProcess:
    """A few lines of code in a fresh interpreter of ``py``."""
    return subprocess.run([str(py), "-c", textwrap.dedent(code), *argv], capture_output=True, text=True,
                          env=sglang_env(**{"PYTHONWARNINGS": "ignore", **(env or {})}), timeout=timeout,
                          cwd=str(DRIVERS))


def run_script(py: Path, script: str, *argv: str, env: dict | None = None, timeout: int = 600
               ) -> subprocess.CompletedProcess:
    """One of the tests' scripts (``tests/drivers/<script>``) in a fresh interpreter of ``py``."""
    return subprocess.run([str(py), str(DRIVERS / script), *argv], capture_output=True, text=True,
                          env=sglang_env(**{"PYTHONWARNINGS": "ignore", **(env or {})}), timeout=timeout,
                          cwd=str(DRIVERS))


def resolve(py: Path, args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """SGLang's server arguments for ``args`` with the plugins loaded (tests/drivers/sglang_resolve.py)."""
    return run_script(py, "sglang_resolve.py", *args, env=env, timeout=240)


def result(r: subprocess.CompletedProcess) -> dict:
    """The JSON a subprocess printed on its last ``RESULT`` line."""
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, f"rc={r.returncode}\nstdout:{r.stdout[-2000:]}\nstderr:{r.stderr[-4000:]}"
    return json.loads(lines[-1][7:])
