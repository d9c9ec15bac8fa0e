"""A clone with nothing beside it, as a user's ``bash scripts/test.sh`` runs it: the tests that read
what the repository cannot ship (marked ``shared`` by tests/conftest.py: the MATH rollout logs and
slime's source) run with the shared folder hidden, and each passes or skips with one line naming
what is missing and the setting or path that provides it. ``.ci/run`` requires the folder
(``HISTOSPEC_REQUIRE_SHARED=1``); here it is hidden on purpose."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from conftest import ROOT

pytestmark = pytest.mark.timeout(900)


def test_tests_that_read_the_shared_folder_skip_naming_what_is_missing(tmp_path):
    nothing = tmp_path / "nothing"
    nothing.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("HISTOSPEC_SLIME_SRC", "HISTOSPEC_REQUIRE_SHARED") and not k.startswith("PYTEST_")}
    env.update(HISTOSPEC_SHARED=str(nothing), HISTOSPEC_DATA_DIR=str(nothing / "data" / "rollouts"))
    report = tmp_path / "report.xml"
    r = subprocess.run([sys.executable, "-m", "pytest", "tests", "-m", "shared", "-p", "no:cacheprovider", "-q",
                        "-n", "0", "--junitxml", str(report)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=850)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    cases = list(ET.parse(report).getroot().iter("testcase"))
    outcomes: dict[str, str] = {}
    for case in cases:
        name = f"{case.get('classname')}::{case.get('name')}"
        skipped = case.find("skipped")
        assert case.find("failure") is None and case.find("error") is None, name
        if skipped is None:
            outcomes[name] = "passed"
            continue
        reason = skipped.get("message", "")
        # One line: what is missing, and the setting or the path that provides it.
        assert "\n" not in reason and reason.count("needs ") == 1, (name, reason)
        assert "HISTOSPEC_" in reason and "../shared" in reason, (name, reason)
        outcomes[name] = "skipped"
    # The modules that read the folder are all here (the logs, slime, the examples' slime parser).
    modules = {n.split("::")[0].rsplit(".", 1)[-1] for n in outcomes}
    assert {"test_replay", "test_golden", "test_control", "test_engine_smollm2", "test_slime",
            "test_examples"} <= modules, sorted(modules)
    assert "skipped" in outcomes.values(), outcomes
