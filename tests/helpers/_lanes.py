"""Pytest-xdist workers on a 24 GB machine: a memory budget the workers share.

``scripts/test.sh`` runs the suite on three workers (``-n 3 --dist loadscope``: a module, or a class,
runs whole on one worker, so its module-scoped servers start once). A CPU SGLang server takes about
2 GB, and several tests start four or five side by side: two such tests at once would not fit. A test
that starts servers says how much memory it needs at its peak (``@pytest.mark.memory(gb)``: the
peak its run records below, servers of its module's fixtures included), and a worker waits before
setting it up until the reservations the other workers hold and its own fit in :data:`BUDGET_GB`.
A worker holds a test's reservation until the next test of the same module asks for its own, or the
module ends: module and class fixtures keep their servers between the tests, and while the next
test waits. A server that a module fixture keeps between its tests and that the module's
reservations leave out (``text_engine``) declares itself with :meth:`MemoryGate.standing`: it
counts against the budget of every test, on every worker, until its module ends. A worker already
waiting goes before a test that asks later; when every worker that holds memory is waiting, none
could free it, and the one that asked first goes. Without xdist (one process) nothing waits.

While a marked test runs, its worker samples the memory of the processes it started (their PSS, each
shared page split among its sharers, so that the workers' sums add up to what the machine holds),
less what standing servers of its own declare, and records the peak (:data:`PEAK_PROPERTY`): the
summary of a run names the tests whose peak went past their reservation, or stayed far below it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

#: Reservations that may be held at once: 24 GB less the pytest processes, the tests that reserve
#: nothing (each under 1.5 GB at its peak) and the system.
BUDGET_GB = float(os.environ.get("HISTOSPEC_TEST_MEMORY_GB", "16"))
#: The user property (junit XML too) in which a test records the seconds it waited for memory.
WAIT_PROPERTY = "memory_wait_s"
#: The user properties in which a marked test records its reservation and the peak memory (GB) of the
#: processes it started.
RESERVED_PROPERTY, PEAK_PROPERTY = "memory_reserved_gb", "memory_peak_gb"


def children_pss_gb() -> float:
    """The PSS of every process this one started, and theirs (GB)."""
    total = 0
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += p.memory_full_info().pss
    return total / 1e9


class PeakSampler:
    """Samples :func:`children_pss_gb` every ``poll_s`` from :meth:`start` to :meth:`stop`;
    :attr:`peak` is the most seen so far."""

    def __init__(self, poll_s: float = 1.0):
        self.poll_s, self.peak, self._stop = poll_s, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._loop, name="memory-peak", daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.sample()

    def sample(self) -> float:
        self.peak = max(self.peak, children_pss_gb())
        return self.peak

    def start(self) -> PeakSampler:
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


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
        used = sum(e["held"] for e in others) + sum(e["standing"] for e in state.values())
        earlier = [e for e in others if e["waiting"] and e["ticket"] < me["ticket"]]
        # One that asked first goes first where it would not fit beside this one (its reservation
        # replaces what it holds while it waits).
        if any(used - e["held"] + e["waiting"] + gb > self.budget for e in earlier):
            return False
        # Where no other worker's test runs holding memory, waiting would free nothing: the first to
        # ask goes (a test larger than the budget runs alone rather than waiting for good).
        stuck = not earlier and all(e["waiting"] or not e["held"] for e in others)
        return used + gb <= self.budget or stuck

    def acquire(self, gb: float, timeout_s: float = 3600) -> float:
        """Waits until ``gb`` fits beside what the other workers and every standing server hold, then
        holds it in place of what this worker held (the servers that held it stand while it waits);
        returns the seconds waited."""
        t0 = time.monotonic()
        with self._state() as state:
            self._entry(state).update(waiting=gb, ticket=time.time())
        while True:
            with self._state() as state:
                if self._may_start(state, gb) or time.monotonic() - t0 > timeout_s:
                    self._entry(state).update(held=gb, waiting=0.0)
                    return time.monotonic() - t0
            time.sleep(self.poll_s)

    def standing_gb(self) -> float:
        """What this worker's standing servers declare."""
        with self._state() as state:
            return float(self._entry(state)["standing"])

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
    until its peak fits, and its worker holds that share until the next test of the module asks for
    its own or the module's last teardown is done. The wait is outside the
    test's time limit: this wrapper is the outermost one, around pytest-timeout's, whose timer
    covers setup, call and teardown; a test that waited long for memory is not cut short for it."""

    def __init__(self, gate: MemoryGate):
        self.gate = gate
        #: The running test's sampler, and what this worker's standing servers declared during its call.
        self._sampler: PeakSampler | None = None
        self._standing = 0.0

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
        mark = item.get_closest_marker("memory")
        if mark is not None:
            waited = self.gate.acquire(float(mark.args[0]))
            item.user_properties += [(RESERVED_PROPERTY, float(mark.args[0])), (WAIT_PROPERTY, round(waited, 1))]
            self._sampler, self._standing = PeakSampler().start(), 0.0
        try:
            yield
        finally:
            if self._sampler is not None:
                self._sampler.stop()
                self._sampler = None
            # The module's fixtures (and what the reservation held) go when the next test is another
            # module's; until then they stand, unmarked tests of the module included.
            if nextitem is None or nextitem.path != item.path:
                self.gate.release()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
        """The teardown's report carries the test's peak (the reports, not the item, reach the
        controller), less the standing servers of this worker's module, as they stood during the
        call (they count in every test's budget on their own)."""
        outcome = yield
        if self._sampler is None:
            return
        if call.when == "call":
            self._standing = self.gate.standing_gb()
        elif call.when == "teardown":
            peak = self._sampler.sample() - self._standing
            outcome.get_result().user_properties.append((PEAK_PROPERTY, round(max(0.0, peak), 2)))
