"""HISTOSPEC_HUGE_PAGES=1: the index's memory on transparent huge pages through glibc's own switch,
which a process reads when it starts. So each case runs its own interpreter, started the way the
engine's scheduler, the launcher and the command line start theirs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import DRIVERS
from histospec_sgl import hugepages

CHILD = DRIVERS / "huge_pages_child.py"
PARENT = DRIVERS / "huge_pages_parent.py"

pytestmark = pytest.mark.skipif(not hugepages.supported(), reason="needs Linux with glibc >= 2.35")




def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HISTOSPEC_HUGE_PAGES", "GLIBC_TUNABLES")}
    env.update(extra)
    return env


def _run(args: list[str], env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_huge_pages_change_where_memory_lives_not_what_is_drafted():
    off = _run([str(CHILD)], _env())
    # Set in the parent's environment, the switch reaches the children it starts.
    on = _run([str(PARENT), str(CHILD)], _env(HISTOSPEC_HUGE_PAGES="1"))
    # In a process that started without it, asking changes nothing (the child prepares only its
    # own children's environment).
    late = _run(["-c", f"from histospec_sgl import hugepages; hugepages.prepare_children(); "
                 f"import runpy; runpy.run_path({str(CHILD)!r})"], _env(HISTOSPEC_HUGE_PAGES="1"))
    assert (off["on"], on["on"], late["on"]) == (False, True, False)
    # The same drafts, bit for bit.
    assert on["tokens"] == off["tokens"] and on["mask"] == off["mask"]
    assert any(t != 0 for t in on["tokens"])
    # On, the index's memory (several MiB here) is advised for huge pages; off, little is.
    assert on["advised_kb"] * 1024 >= on["index_bytes"] // 2, on
    assert off["advised_kb"] < on["advised_kb"] // 4, (off, on)


def test_the_command_line_starts_again_with_the_switch(tmp_path):
    out = tmp_path / "index.json"
    cmd = ["-m", "histospec_sgl.cli", "bench", "index", "--workloads", "W2", "--acc-prompts", "1",
           "--json", str(out)]
    for value, want in (("0", False), ("1", True)):
        run = subprocess.run([sys.executable, *cmd], env=_env(HISTOSPEC_HUGE_PAGES=value, OPENBLAS_NUM_THREADS="1"),
                             capture_output=True, text=True, timeout=300, check=False)
        assert run.returncode == 0, run.stderr
        result = json.loads(out.read_text())
        assert result["machine"]["huge_pages"] is want
        if want and result["machine"]["transparent_hugepages"] in ("madvise", "always"):
            assert result["workloads"]["W2"]["anon_huge_bytes"] > 0


def test_tunables_are_added_not_replaced():
    env = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "HISTOSPEC_HUGE_PAGES": "1"}
    assert hugepages.prepare_children(env)
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:" + hugepages.TUNABLE
    hugepages.prepare_children(env)  # idempotent
    assert env["GLIBC_TUNABLES"].count("hugetlb") == 1
    assert not hugepages.prepare_children({"HISTOSPEC_HUGE_PAGES": "0"})
