"""The memory budget pytest workers share (tests/helpers/_lanes.py): a test waits only while another
worker holds memory it would not fit beside, a worker that asked first goes first, and a dead
worker's reservation is dropped; the wait is not counted against a test's time limit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from _lanes import PEAK_PROPERTY, RESERVED_PROPERTY, WAIT_PROPERTY, MemoryGate

HELPERS = Path(__file__).resolve().parents[1] / "helpers"


def _acquire_in_thread(gate: MemoryGate, gb: float) -> tuple[threading.Thread, list[float]]:
    got: list[float] = []
    t = threading.Thread(target=lambda: got.append(gate.acquire(gb)), daemon=True)
    t.start()
    return t, got


def test_a_test_waits_until_it_fits_and_not_longer(tmp_path):
    path = tmp_path / "gate.json"
    a, b = (MemoryGate(path, w, budget=10, poll_s=0.02) for w in ("gw0", "gw1"))
    assert a.acquire(6) < 0.5
    assert b.acquire(4) < 0.5  # 6 + 4 fits
    b.release()
    t, got = _acquire_in_thread(b, 5)  # 6 + 5 does not
    time.sleep(0.3)
    assert not got
    a.release()
    t.join(5)
    assert got and 0.2 < got[0] < 5
    # Alone, a test larger than the whole budget still runs rather than waiting forever.
    b.release()
    assert a.acquire(30) < 0.5


def test_the_worker_that_asked_first_goes_first(tmp_path):
    path = tmp_path / "gate.json"
    a, b = (MemoryGate(path, w, budget=10, poll_s=0.02) for w in ("gw0", "gw1"))
    b.acquire(4)
    t, got = _acquire_in_thread(a, 8)  # waits for b's 4
    time.sleep(0.2)
    b.release()
    # b asks again at once: its 4 would fit beside nothing held, but not beside a's waiting 8.
    tb, got_b = _acquire_in_thread(b, 4)
    t.join(5)
    assert got
    time.sleep(0.2)
    assert not got_b
    a.release()
    tb.join(5)
    assert got_b


def test_a_standing_server_counts_against_later_tests(tmp_path):
    path = tmp_path / "gate.json"
    a, b = (MemoryGate(path, w, budget=10, poll_s=0.02) for w in ("gw0", "gw1"))
    with a.standing(4):
        assert b.acquire(5) < 0.5  # no test of a runs: b waits for nothing
        t, got = _acquire_in_thread(a, 3)  # 4 standing + 5 + 3 > 10
        time.sleep(0.3)
        assert not got
        b.release()
        t.join(5)
        assert got
        a.release()
    assert json.loads(path.read_text())["gw0"]["standing"] == 0


def test_a_dead_workers_reservation_is_dropped(tmp_path):
    path = tmp_path / "gate.json"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    path.write_text(json.dumps({"gw1": {"pid": int(dead.stdout), "held": 9.0, "standing": 3.0, "waiting": 0.0,
                                        "ticket": 1.0}}))
    assert MemoryGate(path, "gw0", budget=10, poll_s=0.02).acquire(8) < 0.5
    assert "gw1" not in json.loads(path.read_text())


def test_the_last_worker_to_leave_removes_the_file(tmp_path):
    path = tmp_path / "gate.json"
    a, b = (MemoryGate(path, w, budget=10, poll_s=0.02) for w in ("gw0", "gw1"))
    a.acquire(1)
    b.acquire(1)
    a.leave()
    assert list(json.loads(path.read_text())) == ["gw1"]
    b.leave()
    assert list(tmp_path.iterdir()) == []


def test_workers_that_all_wait_holding_memory_do_not_wait_for_good(tmp_path):
    """Two workers hold memory between tests of their modules (their servers stand) and both ask for
    more than fits beside the other's: neither could free it by waiting, so the one that asked first
    goes, and the other waits for it."""
    path = tmp_path / "gate.json"
    a, b = (MemoryGate(path, w, budget=10, poll_s=0.02) for w in ("gw0", "gw1"))
    a.acquire(6)
    b.acquire(3)
    ta, got_a = _acquire_in_thread(a, 8)  # 3 + 8 > 10, but b runs nothing now that it waits too
    time.sleep(0.1)
    tb, got_b = _acquire_in_thread(b, 7)
    ta.join(5)
    assert got_a and got_a[0] < 2
    time.sleep(0.3)
    assert not got_b  # 8 + 7 > 10, and a's test runs
    a.release()
    tb.join(5)
    assert got_b


def test_outside_xdist_nothing_waits(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert MemoryGate.for_this_worker() is None


def test_the_wait_for_memory_is_outside_the_time_limit(tmp_path):
    """A real pytest run with pytest-timeout: its first test waits up to 6 s for memory another worker
    holds, under a 2-s limit on setup, call and teardown, and passes, its wait recorded. Its second
    test's fixture starts a process holding 300 MB: the test records that peak beside its reservation."""
    gate_file = tmp_path / "gate.json"
    (tmp_path / "pytest.ini").write_text("[pytest]\ntimeout = 2\nmarkers =\n    memory(gb): peak memory\n")
    (tmp_path / "conftest.py").write_text(
        "from pathlib import Path\nfrom _lanes import GateHooks, MemoryGate\n\n"
        "def pytest_configure(config):\n"
        f"    gate = MemoryGate(Path({str(gate_file)!r}), 'gw1', budget=10, poll_s=0.05)\n"
        "    config.pluginmanager.register(GateHooks(gate), 'gate')\n")
    (tmp_path / "test_inner.py").write_text(
        f"import json, subprocess, sys, time\nfrom pathlib import Path\n\nimport pytest\n\n"
        f"GATE = Path({str(gate_file)!r})\n"
        "HOLD = \"b = b'x' * 300_000_000; print('ready', flush=True); import time; time.sleep(60)\"\n\n"
        "@pytest.fixture\ndef server():\n    yield 1\n\n"
        "@pytest.mark.memory(8)\ndef test_big(server):\n    assert server == 1\n\n"
        "@pytest.fixture\ndef holder():\n"
        "    p = subprocess.Popen([sys.executable, '-c', HOLD], stdout=subprocess.PIPE, text=True)\n"
        "    assert p.stdout.readline().strip() == 'ready'\n    yield p\n    p.kill()\n    p.wait()\n\n"
        "@pytest.mark.timeout(60)\n@pytest.mark.memory(1)\ndef test_holds(holder):\n    time.sleep(2.5)\n\n"
        # The module's servers may stand until it ends: its worker holds the last reservation meanwhile.
        "def test_after():\n    assert json.loads(GATE.read_text())['gw1']['held'] == 1.0\n")
    other = MemoryGate(gate_file, "gw0", budget=10, poll_s=0.05)
    other.acquire(6)
    threading.Timer(6.0, other.release).start()
    env = {**os.environ, "PYTHONPATH": str(HELPERS)}
    env.pop("PYTEST_XDIST_WORKER", None)
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist",
                          f"--junitxml={tmp_path / 'out.xml'}", str(tmp_path / "test_inner.py")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "3 passed" in run.stdout
    assert json.loads(gate_file.read_text())["gw1"]["held"] == 0  # released with the module
    xml = (tmp_path / "out.xml").read_text()
    props = {case.get("name"): {p.get("name"): float(p.get("value")) for p in case.iter("property")}
             for case in ET.fromstring(xml).iter("testcase")}
    assert 2 < props["test_big"][WAIT_PROPERTY] < 60, xml  # longer than the limit
    assert props["test_holds"][RESERVED_PROPERTY] == 1.0
    assert 0.25 < props["test_holds"][PEAK_PROPERTY] < 0.6, xml
