"""histospec-sgl on Ray (Ray 2.60 and SGLang 0.5.17 in .venv-sglang, a real local cluster):

- inside an engine actor that builds SGLang's ``ServerArgs`` itself (slime, verl), HISTORY is an
  unknown algorithm without the setup hook and resolves with it;
- ``histospec-sgl ray draft-server`` starts the draft server once as a detached, named actor that
  outlives the driver that made it; a second call finds it; an engine actor that knows only the
  actor's name resolves its address while building ``ServerArgs`` and receives published history.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from conftest import DRIVERS, ROOT, driver_path, require_modules
from histospec_sgl.procs import free_port

SCRIPT = DRIVERS / "ray_cluster_script.py"
#: A test starts a Ray cluster, engine actors and draft servers, and kills and restarts them: 90 s alone
#: on two cores, twice that beside the other workers' servers.
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def ray_py(sglang_py: Path) -> Path:
    return require_modules(sglang_py, "ray", "Ray is")


def _env(model: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HISTOSPEC_")}
    # A loopback test cluster: no token auth (Ray 2.60 turns it on by default), no usage reporting.
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_DISABLE_DOCKER_CPU_WARNING="1", RAY_AUTH_MODE="disabled",
               PYTHONPATH=driver_path(), HISTOSPEC_TEST_MODEL=str(model))
    return env


def _run(py: Path, model: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(py), *args], capture_output=True, text=True, timeout=timeout, env=_env(model),
                          cwd=ROOT)


def _last_json(r: subprocess.CompletedProcess) -> dict:
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.memory(1.5)
def test_history_resolves_in_an_engine_actor_only_with_the_setup_hook(ray_py, greedy_model):
    # Two clusters one after the other, each an actor's first call (the driver's FIRST_CALL_S).
    out = _last_json(_run(ray_py, greedy_model, str(SCRIPT), "hook", timeout=580))
    assert out["without_hook"]["ok"] is False
    assert "Unknown speculative algorithm name" in out["without_hook"]["error"]
    assert out["with_hook"]["ok"] is True, out["with_hook"]
    assert "HISTORY" in out["with_hook"]["algorithm"]
    assert out["with_hook"]["attention_backend"] == "flashinfer"


@pytest.mark.memory(1)
def test_draft_server_actor_outlives_its_creator_and_feeds_engine_actors(ray_py, greedy_model, tmp_path):
    port = free_port()
    ray_bin = ray_py.parent / "ray"
    head = f"127.0.0.1:{port}"
    temp = tempfile.mkdtemp(prefix="ray-")  # short: Ray's socket paths must fit in 107 bytes
    start = subprocess.run(
        [str(ray_bin), "start", "--head", f"--port={port}", "--num-cpus=2",
         "--include-dashboard=false", f"--temp-dir={temp}", "--disable-usage-stats"],
        capture_output=True, text=True, timeout=180, env=_env(greedy_model))
    assert start.returncode == 0, start.stdout[-3000:] + start.stderr[-3000:]
    data = tmp_path / "history"
    try:
        cli = ["-m", "histospec_sgl.cli", "ray", "draft-server", "--address", head, "--listen", "127.0.0.1:0",
               "--data-dir", str(data)]
        first = _run(ray_py, greedy_model, *cli)
        assert first.returncode == 0, first.stderr[-4000:]
        address = first.stdout.strip().splitlines()[-1]
        assert address.startswith("127.0.0.1:") and int(address.rsplit(":", 1)[1]) > 0
        # The driver that created it has exited; a second call finds the same server.
        second = _run(ray_py, greedy_model, *cli)
        assert second.returncode == 0, second.stderr[-4000:]
        assert second.stdout.strip().splitlines()[-1] == address
        assert (data / "ray-actor-listen").read_text().strip() == address

        out = _last_json(_run(ray_py, greedy_model, str(SCRIPT), "engine", head, timeout=450))
        assert out["lookup"] == address and out["again"] == address
        assert out["server_args"]["ok"] is True, out["server_args"]
        assert out["resolved"] == address  # set by the plugin inside the engine actor
        # Secure by default: the actor made a token; a client without it is refused and told why; the
        # engine actor got it from the actor (a private file), as did a trainer's SPEC-RL store below.
        assert out["token_required"] and out["engine_token_file"], out
        assert "UNAUTHENTICATED" in out["no_token"] and "HISTOSPEC_DRAFT_SERVER_TOKEN_FILE" in out["no_token"], out
        assert (data / "ray-actor-token").stat().st_mode & 0o077 == 0
        assert out["received"]["responses"] == 1, out["received"]
        # The killed server was started again by the actor, on the same address, with its record.
        assert out["restarts"] == 1 and out["pid_after"] != out["server_pid"], out
        assert out["address_after"] == address
        assert out["received_after"]["responses"] == 2, out["received_after"]
        assert out["trainer"] == {"draft_server": address, "settled": True, "previous": [41, 42]}, out["trainer"]

        stop_cli = ["-m", "histospec_sgl.cli", "ray", "draft-server", "--address", head, "--stop"]
        stop = _run(ray_py, greedy_model, *stop_cli)
        assert stop.returncode == 0, stop.stderr[-4000:]
        gone = _run(ray_py, greedy_model, *stop_cli)
        assert gone.returncode == 1 and "no actor" in gone.stdout
        _sharded(ray_py, greedy_model, head, tmp_path / "sharded")
        # The server process killed, then its actor: publishers holding the token go on, with or without
        # a data dir; with one, nothing acknowledged is lost.
        for home, records in ((str(tmp_path / "kept"), 30), ("", 10)):
            out = _last_json(_run(ray_py, greedy_model, str(SCRIPT), "restart", head, home, str(tmp_path / "other")))
            assert out["token_same"] and out["address_same"], out
            assert out["records"] == records, out  # without a data dir, history lives in the process's memory
            assert "is running with --shards 1" in out["other_shards"], out
            assert "is running with" in out["other_dir"] and "--stop" in out["other_dir"], out
    finally:
        _stop_cluster(temp)
        shutil.rmtree(temp, ignore_errors=True)


def _sharded(ray_py, greedy_model, head: str, data) -> None:
    """``--shards 2``: two actors with one token, clients given both addresses; records go to the shard
    of their group; one shard's process killed is started again from its own data dir with every
    record it acknowledged, the other shard untouched; ``--stop`` stops both."""
    import psutil

    from histospec_sgl.sync.client import HistoryPublisher, shard_of

    cli = ["-m", "histospec_sgl.cli", "ray", "draft-server", "--address", head, "--name", "sharded",
           "--listen", "127.0.0.1:0", "--data-dir", str(data), "--shards", "2"]
    made = _run(ray_py, greedy_model, *cli)
    assert made.returncode == 0, made.stderr[-4000:]
    address = made.stdout.strip().splitlines()[-1]
    assert len(address.split(",")) == 2, address
    status = _run(ray_py, greedy_model, *cli[:8], "--status")
    assert status.stdout.strip().splitlines()[-1] == address
    token = (data / "shard-0" / "ray-actor-token").read_text().strip()
    assert token and (data / "shard-1" / "ray-actor-token").read_text().strip() == token
    recs = [([100 + g, 7, 8], [g, g + 1, g + 2]) for g in range(12)]
    with HistoryPublisher(address, auth_token=token) as pub:
        for g, (p, r) in enumerate(recs):
            pub.publish(p, r, group=g, version=1)
        pub.flush()
        before = pub.stats()
    assert [s["records"] for s in before["shards"]] == [sum(shard_of(g, 2) == i for g in range(12)) for i in (0, 1)]

    def servers(shard: int) -> list:
        home = str(data / f"shard-{shard}")
        return [p for p in psutil.process_iter(["cmdline"])
                if "draft-server" in " ".join(p.info["cmdline"] or ()) and home in (p.info["cmdline"] or ())]

    (victim,) = servers(1)
    (other,) = servers(0)
    victim.kill()
    with HistoryPublisher(address, auth_token=token) as pub:  # retries until the shard is back
        for g in range(12, 16):
            pub.publish([100 + g, 7, 8], [g], group=g, version=2)
        pub.flush()
        after = pub.stats()
    assert after["records"] == 16 and after["shards"][1]["records"] == before["shards"][1]["records"] + 2
    assert other.is_running() and servers(0) == [other]
    (again,) = servers(1)
    assert again.pid != victim.pid
    stop = _run(ray_py, greedy_model, *cli[:8], "--stop")
    assert stop.returncode == 0, stop.stderr[-4000:]
    deadline = time.monotonic() + 30
    while servers(0) or servers(1):
        assert time.monotonic() < deadline, "a shard's server outlived --stop"
        time.sleep(0.2)


def _stop_cluster(temp: str) -> None:
    """Stops this test's Ray cluster, and no other: its processes name its temp dir on their command
    lines (``ray stop`` would stop every Ray cluster on the machine, another test's included)."""
    import psutil

    ours = [p for p in psutil.process_iter(["cmdline"]) if any(temp in a for a in p.info["cmdline"] or ())]
    procs = {p.pid: p for p in ours}
    for p in ours:
        try:
            procs.update((c.pid, c) for c in p.children(recursive=True))  # its workers
        except psutil.NoSuchProcess:
            pass
    for p in procs.values():
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(list(procs.values()), timeout=30)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
