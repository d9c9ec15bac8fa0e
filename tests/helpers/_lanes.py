"""Pytest-xdist workers on a 24 GB machine: a memory budget the workers share.

``scripts/test.sh`` runs the suite on three workers (``-n 3 --dist loadscope``: a module, or a class,
runs whole on one worker, so its module-scoped servers start once). A CPU SGLang server takes about
2 GB, and several tests start four or five side by side: two such tests at once would not fit. A test
that starts servers says how much memory it needs at its peak (``@pytest.mark.memory(gb)``, measured
as the drop in ``MemAvailable`` while it runs alone, servers of its module's fixtures included), and
a worker waits before setting it up until the reservations of the tests running on the other workers
and its own fit in :data:`BUDGET_GB`. A server that a module fixture keeps between its tests
(``text_engine``) can declare itself with :meth:`MemoryGate.standing`: it counts against the budget
of every test, on every worker, until its module ends. Waiting holds no test's reservation, and a
test waits only while a test of another worker holds one, so workers never wait on each other in a
circle; a worker already waiting goes before a test that asks later. Without xdist (one process)
nothing waits.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

#: Reservations that may run at once: 24 GB less the servers that module fixtures keep between tests,
#: the pytest workers and the tests that reserve nothing (about 2 GB each way), and the system. On three
#: workers the least ``MemAvailable`` seen in a whole run was 5.7 GB.
BUDGET_GB = float(os.environ.get("HISTOSPEC_TEST_MEMORY_GB", "13"))
#: The user property (junit XML too) in which a test records the seconds it waited for memory.
WAIT_PROPERTY = "memory_wait_s"


class MemoryGate:
    """Reservations in a JSON file shared by the workers of one run (under an ``flock``):
    ``{worker: {"pid", "held", "standing", "waiting", "ticket"}}``; entries of dead workers are
    dropped."""

    def __init__(self, path: Path, worker: str, budget: float = BUDGET_GB, poll_s: float = 0.5):
        self.path, self.worker, self.budget, self.poll_s = path, worker, budget, poll_s

    @classmethod
    def for_this_worker(cls) -> MemoryGate | None:
        worker, run = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_TESTRUNUID")
        if not worker or not run:
            return None
        return cls(Path(tempfile.gettempdir()) / f"histospec-pytest-memory-{run}.json", worker)

    @contextlib.contextmanager
    def _state(self) -> Iterator[dict]:
        with open(self.path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                state = json.loads(self.path.read_text()) if self.path.exists() else {}
                state = {w: e for w, e in state.items() if w == self.worker or psutil.pid_exists(e["pid"])}
                yield state
                tmp = self.path.with_suffix(f".{self.worker}.tmp")
                tmp.write_text(json.dumps(state))
                os.replace(tmp, self.path)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _entry(self, state: dict) -> dict:
        return state.setdefault(self.worker, {"pid": os.getpid(), "held": 0.0, "standing": 0.0, "waiting": 0.0,
                                              "ticket": 0.0})

    def _may_start(self, state: dict, gb: float) -> bool:
        me = self._entry(state)
        others = [e for w, e in state.items() if w != self.worker]
        held = sum(e["held"] for e in others)
        used = held + sum(e["standing"] for e in state.values())
        for e in others:
            if e["waiting"] and e["ticket"] < me["ticket"] and used + gb + e["waiting"] > self.budget:
                return False  # it asked first and would not fit beside this one (it waits for no one now)
        return held == 0 or used + gb <= self.budget  # alone, waiting would free nothing

    def acquire(self, gb: float, timeout_s: float = 3600) -> float:
        """Waits until ``gb`` fits beside what the other workers' tests and every standing server
        hold, then holds it; returns the seconds waited."""
        t0 = time.monotonic()
        with self._state() as state:
            self._entry(state).update(held=0.0, waiting=gb, ticket=time.time())
        while True:
            with self._state() as state:
                if self._may_start(state, gb) or time.monotonic() - t0 > timeout_s:
                    self._entry(state).update(held=gb, waiting=0.0)
                    return time.monotonic() - t0
            time.sleep(self.poll_s)

    def release(self) -> None:
        with self._state() as state:
            self._entry(state).update(held=0.0, waiting=0.0)

    def leave(self) -> None:
        """This worker is done: its entry goes, and the file with the last one."""
        with self._state() as state:
            state.pop(self.worker, None)
            last = not state
        if last:
            self.path.unlink(missing_ok=True)
            self.path.with_suffix(".lock").unlink(missing_ok=True)

    @contextlib.contextmanager
    def standing(self, gb: float) -> Iterator[None]:
        """Counts ``gb`` against every later test's budget while the block runs (a server that a
        fixture keeps between tests)."""
        with self._state() as state:
            self._entry(state)["standing"] += gb
        try:
            yield
        finally:
            with self._state() as state:
                self._entry(state)["standing"] -= gb


class GateHooks:
    """The pytest hooks that put :class:`MemoryGate` around each test (tests/conftest.py registers
    them on an xdist worker). A test marked ``memory(gb)`` waits, before its fixtures start servers,
    until its peak fits, and holds its share until its teardown is done. The wait is outside the
    test's time limit: this wrapper is the outermost one, around pytest-timeout's, whose timer
    covers setup, call and teardown; a test that waited long for memory is not cut short for it."""

    def __init__(self, gate: MemoryGate):
        self.gate = gate

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
        mark = item.get_closest_marker("memory")
        if mark is None:
            yield
            return
        waited = self.gate.acquire(float(mark.args[0]))
        item.user_properties.append((WAIT_PROPERTY, round(waited, 1)))
        try:
            yield
        finally:
            self.gate.release()
