"""Child processes, one way for the whole package: start one that never outlives the thread that
started it (its owner killed with SIGTERM or SIGKILL included), wait until it is ready, and stop it
with everything it started.

Used by the draft-server process (:mod:`histospec_sgl.sync.process`), the engine harness
(:mod:`histospec_sgl.bench.engine_server`), the GPU job (``bench/gpu/e2e.py``) and the test drivers.
Linux delivers the parent-death signal (``PR_SET_PDEATHSIG``); elsewhere the owner's :func:`stop`
still ends the child.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

_PR_SET_PDEATHSIG = 1


class ChildError(RuntimeError):
    """A child process exited, or did not become ready in time."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now (another process may take it before
    the caller binds it; a server started on it must be ready to be started again elsewhere)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (``net.ipv4.ip_local_port_range``), from which
    outgoing connections take their source ports; Linux's default, 32768, where it cannot be read."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def listen_port(host: str = "127.0.0.1", low: int = 20000, attempts: int = 64) -> int:
    """A TCP port on ``host`` that nothing listens on right now, for a server that binds it later, drawn
    at random below the kernel's ephemeral range (``net.ipv4.ip_local_port_range``): the outgoing
    connections of every process on the host take their source ports from that range, and so can take
    a port :func:`free_port` returned before its server binds it (SGLang 0.5.17's torch.distributed
    store, which binds its own pick from that range, died so). Another process drawing the same way may
    still pick the same port (rarely). :func:`free_port` where the range leaves no room below it."""
    high = ephemeral_low() - 1
    if high - low < attempts:
        return free_port(host)
    for port in random.sample(range(low, high + 1), attempts):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    return free_port(host)


def wait_port_free(port: int, timeout: float = 10.0, host: str = "127.0.0.1") -> None:
    """Waits until nothing listens on ``host:port`` (after a kill, before a restart on it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
                return
            except OSError:
                time.sleep(0.05)
    raise TimeoutError(f"port {port} still in use after {timeout}s")


def dies_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A ``preexec_fn`` for :class:`subprocess.Popen`: the kernel sends the child ``sig`` when the
    thread that started it ends (so start children from a thread that outlives them, the main
    thread), and a child whose parent died before this ran exits at once. SIGKILL suits a child
    with nothing to save; SIGTERM one that shuts down cleanly (the draft server's final snapshot).
    Children of the child (SGLang's scheduler and detokenizer) die with it when they arm the same."""
    parent = os.getpid()

    def arm() -> None:
        if sys.platform.startswith("linux"):
            with contextlib.suppress(OSError, AttributeError):
                import ctypes

                ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return arm


def spawn(cmd: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
          stdout: Any = None, stderr: Any = None, text: bool = False, group: bool = True,
          parent_death: int | None = signal.SIGKILL) -> subprocess.Popen:
    """Starts ``cmd``. ``group``: in a process group of its own (a new session), so that
    :func:`stop` ends whatever it starts too, and a signal to the caller's group (Ctrl-C) does not
    reach it; ``parent_death``: the signal it gets when its owner dies (None: none)."""
    proc = subprocess.Popen(list(cmd), env=env, cwd=cwd, stdout=stdout, stderr=stderr, text=text,
                            start_new_session=group,
                            preexec_fn=dies_with_parent(parent_death) if parent_death is not None else None)
    if group:
        _GROUP_LEADERS.add(proc.pid)
    return proc


def wait_ready(proc: subprocess.Popen, ready: Callable[[], bool], timeout: float, *, what: str = "the process",
               interval: float = 0.5, log: Callable[[], str] = lambda: "") -> None:
    """Polls ``ready()`` until it is true; raises :class:`ChildError` (with ``log()``) if ``proc``
    exits first or ``timeout`` seconds pass. ``ready`` may raise OSError (not listening yet)."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise ChildError(f"{what} exited with {proc.returncode} while starting:\n{log()}")
        with contextlib.suppress(OSError):
            if ready():
                return
        if time.monotonic() > deadline:
            raise ChildError(f"{what} did not come up in {timeout:.0f} s:\n{log()}")
        time.sleep(interval)


def read_line(proc: subprocess.Popen, prefix: str, timeout: float) -> str | None:
    """The rest of the first line on ``proc``'s stdout (text mode) that starts with ``prefix``,
    stripped; None if none came within ``timeout`` seconds (the child stuck, or its stdout closed).
    Lines before it are skipped. The reader is a daemon thread, so a child that never writes cannot
    hang the caller."""
    out = proc.stdout
    assert out is not None, "read_line needs stdout=subprocess.PIPE"
    found: list[str] = []

    def read() -> None:
        for line in out:
            if line.startswith(prefix):
                found.append(line[len(prefix):].strip())
                return

    t = threading.Thread(target=read, daemon=True, name="read-line")
    t.start()
    t.join(timeout)
    return found[0] if found else None


def stop(proc: subprocess.Popen | None, grace: float = 1.0) -> int | None:
    """Ends ``proc`` and, if it leads a process group (:func:`spawn` with ``group``), everything in
    it: SIGTERM, then SIGKILL after ``grace`` seconds, then SIGKILL to the group's leftovers.
    Returns its exit code (None if it had not been started)."""
    if proc is None:
        return None
    grouped = _leads_group(proc)
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 15.0)):
        if proc.poll() is None:
            _signal(proc, sig, grouped)
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    if grouped:
        _signal(proc, signal.SIGKILL, True)  # children left behind
        _GROUP_LEADERS.discard(proc.pid)
    return proc.returncode


def run_in_group(cmd: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
                 timeout: float | None = None) -> subprocess.CompletedProcess:
    """Runs ``cmd`` to its end in a group of its own (stdout and stderr together, as text), then
    kills whatever it left behind in the group (an engine a trainer's code started), whatever
    happened, a timeout included."""

    proc = spawn(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    chunks: list[str] = []
    # Read as it comes (a full pipe would stall the command); the output ends when the last process
    # holding it does, which may be one the command left behind, so the end of the command, not of
    # its output, is waited for.
    reader = threading.Thread(target=lambda: chunks.extend(iter(proc.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        _signal(proc, signal.SIGKILL, True)
        proc.wait()
        _GROUP_LEADERS.discard(proc.pid)
        reader.join(10)
        proc.stdout.close()
    out = "".join(chunks)
    if timed_out:
        raise subprocess.TimeoutExpired(list(cmd), timeout or 0.0, output=out)
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, None)


#: Pids :func:`spawn` started as process-group leaders (a group outlives its leader's exit).
_GROUP_LEADERS: set[int] = set()


def _leads_group(proc: subprocess.Popen) -> bool:
    if proc.pid in _GROUP_LEADERS:
        return True
    try:
        return proc.poll() is None and os.getpgid(proc.pid) == proc.pid
    except ProcessLookupError:
        return False


def _signal(proc: subprocess.Popen, sig: int, group: bool) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)


__all__ = ["ChildError", "dies_with_parent", "ephemeral_low", "free_port", "run_in_group", "spawn", "stop", "wait_port_free",
           "wait_ready"]
