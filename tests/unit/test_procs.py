"""The process helper every child process of the package goes through (histospec_sgl/procs.py):
real processes, killed with real signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

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


def test_read_line_finds_the_ready_line_and_never_hangs_on_a_silent_child():
    """The draft server's and a replica's start-up line: lines before it are skipped; a child that
    stays silent (or exits without it) yields None once the timeout passes, not a hang."""
    talks = procs.spawn([sys.executable, "-c", "print('warming up'); print('READY 127.0.0.1:5', flush=True); "
                         "import time; time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    silent = procs.spawn([sys.executable, "-c", "import time; time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    quits = procs.spawn([sys.executable, "-c", "print('bye')"], stdout=subprocess.PIPE, text=True)
    try:
        assert procs.read_line(talks, "READY ", 30) == "127.0.0.1:5"
        t0 = time.monotonic()
        assert procs.read_line(silent, "READY ", 0.3) is None
        assert time.monotonic() - t0 < 10
        assert procs.read_line(quits, "READY ", 30) is None
    finally:
        for p in (talks, silent, quits):
            procs.stop(p)
            p.stdout.close()


def test_free_port_and_wait_port_free():
    import socket

    port = procs.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        with pytest.raises(TimeoutError, match=str(port)):
            procs.wait_port_free(port, timeout=0.2)
    procs.wait_port_free(port, timeout=5)


def test_listen_port_lies_below_the_ports_outgoing_connections_take(monkeypatch):
    """Clients' source ports come from the kernel's ephemeral range; a port for a server that binds it
    later is drawn below it, skipping one in use, and is free_port's where the range leaves no room."""
    import socket

    low = procs.ephemeral_low()
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        clients = [socket.create_connection(server.getsockname()) for _ in range(32)]
        try:
            assert all(c.getsockname()[1] >= low for c in clients)
            ports = {procs.listen_port() for _ in range(32)}
            assert all(20000 <= p < low for p in ports), sorted(ports)
            assert len(ports) > 1  # drawn at random, not the same for every caller
        finally:
            for c in clients:
                c.close()
    with socket.socket() as held:
        held.bind(("127.0.0.1", procs.listen_port()))
        taken = held.getsockname()[1]
        spare = next(p for p in range(20000, low) if p != taken and _bindable(p))
        monkeypatch.setattr(procs.random, "sample", lambda population, k: [taken, spare])
        assert procs.listen_port() == spare
    monkeypatch.undo()
    assert procs.listen_port(low=low - 10) >= low  # no room below the range: free_port's pick


def _bindable(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


#: An engine stood in for the harness (``EngineServer``): run as ``<python> -m sglang.launch_server
#: ... --port N``; FAKE_ENGINE "taken" logs a bind failure on its first launch and stays up (as
#: SGLang's launcher does), "exit" fails at once, otherwise it answers /health_generate.
FAKE_ENGINE = r'''
import http.server, os, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
mode, marker = os.environ["FAKE_ENGINE"], os.environ["FAKE_ENGINE_MARKER"]
if mode == "exit":
    print("no model here", flush=True)
    sys.exit(3)
if mode == "taken" and not os.path.exists(marker):
    open(marker, "w").close()
    print("OSError: [Errno 98] error while attempting to bind: address already in use", flush=True)
    time.sleep(600)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health_generate" else 404)
        self.end_headers()

    def log_message(self, *a):
        pass

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
'''


@pytest.mark.parametrize("mode", ["up", "taken", "exit"])
def test_engine_harness_waits_relaunches_on_a_taken_port_and_names_an_exit(tmp_path, mode):
    """The engine harness waits through the process helper: a server that answers is ready; one whose
    port was taken (it logs the bind failure and stays up) is stopped and launched on a new port; one
    that exits raises with its log."""
    from histospec_sgl.bench.engine_server import EngineError, EngineServer

    (tmp_path / "engine.py").write_text(FAKE_ENGINE)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{tmp_path / "engine.py"}" "$@"\n')
    python.chmod(0o755)
    env = {"FAKE_ENGINE": mode, "FAKE_ENGINE_MARKER": str(tmp_path / "launched")}
    srv = EngineServer(tmp_path, "plain", python=str(python), device="cuda", env=env, startup_timeout=30,
                       log_path=tmp_path / "server.log")
    first_port = srv.port
    if mode == "exit":
        with pytest.raises(EngineError, match="the plain server exited with 3 while starting:\n.*no model here"):
            srv.start()
        assert srv.proc is None
        return
    with srv:
        pid = srv.proc.pid
        assert (srv.port != first_port) == (mode == "taken")
        with urllib.request.urlopen(srv.url + "/health_generate", timeout=5) as r:
            assert r.status == 200
    assert _gone(pid)
