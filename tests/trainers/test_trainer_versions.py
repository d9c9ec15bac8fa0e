"""Each trainer adapter checks the installed trainer's release when it is imported
(histospec_sgl/integrations/versions.py), against the range stated once there and quoted by the
pyproject extras and docs/trainers.md.

The real adapters are imported in .venv-sglang, where scripts/setup_sglang_env.sh installed the
supported releases (they import); then the same imports with the distribution's metadata reporting
a release outside the range (verl 0.9.0, OpenRLHF 0.11.0: the releases the adapters do not work
on) fail with one line naming the supported range.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, require_modules
from histospec_sgl.integrations import versions

ADAPTERS = {
    "verl": ["histospec_sgl.integrations.verl.agent_loop", "histospec_sgl.integrations.verl.router"],
    "openrlhf": ["histospec_sgl.integrations.openrlhf_agent"],
}
UNSUPPORTED = {"verl": "0.9.0", "openrlhf": "0.11.0"}


def test_the_ranges_admit_the_tested_releases_and_refuse_the_broken_ones():
    assert versions.problem("verl", "0.9.1") is None
    assert versions.problem("openrlhf", "0.11.2") is None
    assert versions.problem("slime", "0.3.1") is None
    for dist, bad in [("verl", "0.9.0"), ("verl", "0.10.0"), ("openrlhf", "0.11.0"), ("openrlhf", "0.12.0"),
                      ("slime", "0.2.9"), ("verl", "not-a-version")]:
        msg = versions.problem(dist, bad)
        assert msg is not None and versions.SUPPORTED[dist] in msg and bad in msg and "\n" not in msg
    with pytest.raises(KeyError):  # only trainers with an adapter have a range
        versions.require("vllm")


def test_extras_and_docs_quote_the_ranges():
    pyproject = (ROOT / "pyproject.toml").read_text()
    docs = (ROOT / "docs" / "trainers.md").read_text()
    for dist, spec in versions.SUPPORTED.items():
        assert f"`{dist}{spec}`" in docs, f"docs/trainers.md does not state {dist}{spec}"
        if dist != "slime":  # not on PyPI
            assert re.search(rf'^{dist} = \["{dist}{re.escape(spec)}"', pyproject, re.M), dist


PROBE = """
import importlib.metadata as m, json, sys
dist, fake, modules = sys.argv[1], sys.argv[2], sys.argv[3:]
real = m.version
m.version = lambda d: fake if d == dist else real(d)
out = {"refused": {}, "imported": []}
if dist == "verl":
    import histospec_sgl.integrations.verl as v  # the entry point: logs, never raises
    out["entry_point_supported"] = v.SUPPORTED_VERSION
for mod in modules:
    try:
        __import__(mod)
        out["refused"][mod] = None
    except ImportError as e:
        out["refused"][mod] = f"{type(e).__name__}: {e}"
m.version = real
for mod in modules:  # a refused import left nothing behind: the real release imports
    __import__(mod)
    out["imported"].append(mod)
print(json.dumps(out))
"""


@pytest.mark.parametrize("dist", sorted(ADAPTERS))
def test_an_adapter_imports_under_the_installed_release_and_refuses_another(sglang_py, dist):
    py = require_modules(sglang_py, dist, f"{dist} is")
    r = subprocess.run([str(py), "-c", PROBE, dist, UNSUPPORTED[dist], *ADAPTERS[dist]], capture_output=True,
                       text=True, cwd=ROOT, timeout=300,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": str(Path.home())})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["imported"] == ADAPTERS[dist]
    for module, refusal in out["refused"].items():
        assert refusal is not None, f"{module} imported under {dist} {UNSUPPORTED[dist]}"
        assert refusal.startswith("UnsupportedTrainerVersion: "), refusal
        assert f"{dist}{versions.SUPPORTED[dist]}" in refusal and UNSUPPORTED[dist] in refusal
        assert "\n" not in refusal
    if dist == "verl":
        assert out["entry_point_supported"] is False
        assert f"verl{versions.SUPPORTED['verl']}" in r.stderr  # logged, not raised
