"""The process helper every child process of the package goes through (histospec_sgl/procs.py):
real processes, killed with real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from histospec_sgl import procs

#: A child that starts a grandchild in its own group (as SGLang's launcher starts its scheduler)
#: and prints both pids.
FAMILY = ("import subprocess, sys, time; g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
          "print(g.pid, flush=True); time.sleep(600)")

#: An owner that starts a child through the helper, prints its pid, and waits to be killed.
OWNER = ("import sys, time; from histospec_sgl import procs; "
         "p = procs.spawn([sys.executable, '-c', 'import time; time.sleep(600)']); "
         "print(p.pid, flush=True); time.sleep(600)")


def _gone(pid: int, timeout: float = 10.0) -> bool:
    """The process has ended (a zombie not yet reaped counts as ended: nothing of it runs)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.05)
    return False


def _first_line(proc: subprocess.Popen) -> int:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    proc.stdout.close()
    return int(line)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_child_never_outlives_its_owner(sig):
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    child = _first_line(owner)
    os.kill(child, 0)  # running
    owner.send_signal(sig)
    owner.wait(10)
    assert _gone(child), "the child outlived the owner that was killed"


def test_stop_ends_the_child_and_what_it_started():
    proc = procs.spawn([sys.executable, "-c", FAMILY], stdout=subprocess.PIPE, text=True)
    grandchild = _first_line(proc)
    assert procs.stop(proc, grace=0.2) is not None
    assert _gone(grandchild)
    assert procs.stop(None) is None


def test_run_in_group_kills_what_the_command_left_behind():
    code = ("import subprocess, sys; g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
            "print(g.pid)")
    done = procs.run_in_group([sys.executable, "-c", code], timeout=60)
    assert done.returncode == 0
    assert _gone(int(done.stdout.split()[0]))
    with pytest.raises(subprocess.TimeoutExpired):
        procs.run_in_group([sys.executable, "-c", "import time; time.sleep(600)"], timeout=0.5)


def test_wait_ready_names_a_child_that_exits_or_never_comes_up():
    quits = procs.spawn([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(procs.ChildError, match="exited with 3 while starting:\nits log"):
        procs.wait_ready(quits, lambda: False, 30, what="the quitter", interval=0.05, log=lambda: "its log")
    sleeper = procs.spawn([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        with pytest.raises(procs.ChildError, match="did not come up in 0 s"):
            procs.wait_ready(sleeper, lambda: False, 0.2, interval=0.05)
        calls = []

        def ready() -> bool:
            calls.append(1)
            if len(calls) < 3:
                raise OSError("not listening yet")
            return True

        procs.wait_ready(sleeper, ready, 30, interval=0.01)
        assert len(calls) == 3
    finally:
        procs.stop(sleeper)


def test_free_port_and_wait_port_free():
    import socket

    port = procs.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        with pytest.raises(TimeoutError, match=str(port)):
            procs.wait_port_free(port, timeout=0.2)
    procs.wait_port_free(port, timeout=5)
