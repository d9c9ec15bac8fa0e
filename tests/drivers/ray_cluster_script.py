"""Drivers for tests/trainers/test_ray.py, run by .venv-sglang's interpreter (Ray and SGLang live there).

The model directory (a local test model: ServerArgs reads its config) comes in
``HISTOSPEC_TEST_MODEL``.

``python ray_cluster_script.py hook``: on a local Ray cluster, an engine actor (its own
``runtime_env``, as slime's and verl's engine actors have) builds SGLang's ``ServerArgs`` with
``speculative_algorithm="HISTORY"``: once on a cluster started without the setup hook, once with it.
Prints one JSON line.

``python ray_cluster_script.py engine ADDRESS``: connects to a running cluster; an engine actor that
only knows ``HISTOSPEC_DRAFT_SERVER_ACTOR`` builds ``ServerArgs`` (the plugin resolves the actor to an
address there), starts the engine-side sync with an index and waits until a record published by this
driver reaches it; then the server process is killed, the actor starts it again, and a new engine
sync finds the record from before the kill and one published after. The server requires the token
the actor made (a publisher without it is refused); the engine actor and a trainer's SPEC-RL store
get it through the actor. Prints one JSON line.

``python ray_cluster_script.py restart ADDRESS DATA_DIR OTHER_DIR``: :func:`restart` (``DATA_DIR``
empty: no data dir). Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import ray

HOOK = "histospec_sgl.integrations.ray_setup.setup"
#: An engine actor's first call starts a Ray worker that imports SGLang: 15 s on an idle two-core
#: machine, past two minutes beside the other test workers' servers.
FIRST_CALL_S = 270


def _server_args(**extra: object) -> dict:
    """SGLang's ServerArgs as an engine actor builds them (slime: ``ServerArgs(**kwargs)``)."""
    from sglang.srt.server_args import ServerArgs

    try:
        sa = ServerArgs(model_path=os.environ["HISTOSPEC_TEST_MODEL"], speculative_algorithm="HISTORY", device="cuda",
                        load_format="dummy", skip_tokenizer_init=True, **extra)
    except Exception as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}
    return {"ok": True, "algorithm": str(sa.speculative_algorithm),
            "attention_backend": sa.attention_backend, "draft_tokens": sa.speculative_num_draft_tokens}


@ray.remote(num_cpus=0)
class EngineActor:
    """Stands where slime's SGLangEngine / verl's SGLangHttpServer actor builds ServerArgs."""

    def server_args(self) -> dict:
        return _server_args()

    def env(self, name: str) -> str | None:
        return os.environ.get(name)

    def trainer_record(self, prompt: list[int]) -> dict:
        """What a trainer's rollout worker does with SPEC-RL: find the draft server (the actor's
        address and token, through the setup hook's lookup), record a response, read it back."""
        from histospec_sgl.specrl.guard import Options
        from histospec_sgl.specrl.store import shared

        opts = Options.resolve()
        st = shared()
        st.record(opts.draft_server, prompt, [41, 42], [-0.1, -0.2], "stop", group=5, slot=0, version=1)
        settled = st.settle(opts.draft_server, 30) if opts.draft_server else False
        prev = st.get(opts.draft_server, 5, 0)
        return {"draft_server": opts.draft_server, "settled": settled,
                "previous": None if prev is None else list(prev.response_ids)}

    def receive(self, prompt: list[int], timeout: float, want: int = 1) -> dict:
        from histospec_sgl import HistoryIndex
        from histospec_sgl.sync.engine import EngineSync

        index = HistoryIndex()
        sync = EngineSync.from_env(index)
        if sync is None:
            return {"responses": 0, "error": "no HISTOSPEC_DRAFT_SERVER in the engine's environment"}
        try:
            from histospec_sgl import group_key

            sync.want([group_key(prompt)])  # what the worker does when the prompt's first request arrives
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                sync.step_boundary()
                if index.stats()["responses"] >= want:
                    break
                time.sleep(0.05)
            return {"responses": index.stats()["responses"], "address": sync.address if hasattr(sync, "address")
                    else os.environ.get("HISTOSPEC_DRAFT_SERVER")}
        finally:
            sync.close()


def hook() -> None:
    out = {}
    for with_hook in (False, True):
        runtime_env = {"worker_process_setup_hook": HOOK} if with_hook else {}
        ray.init(num_cpus=2, include_dashboard=False, runtime_env=runtime_env, log_to_driver=False)
        try:
            actor = EngineActor.options(runtime_env={"env_vars": {"HISTOSPEC_TEST_ACTOR": "1"}}).remote()
            args = ray.get(actor.server_args.remote(), timeout=FIRST_CALL_S)
            out["with_hook" if with_hook else "without_hook"] = args
        finally:
            ray.shutdown()
    print(json.dumps(out))


def engine(address: str) -> None:
    from histospec_sgl.integrations import ray_draft_server as rds
    from histospec_sgl.sync.client import HistoryPublisher

    # The job's runtime env, as `ray job submit --runtime-env-json` gives it to slime's and verl's actors.
    ray.init(address=address, log_to_driver=False, runtime_env={"worker_process_setup_hook": HOOK})
    try:
        server = rds.lookup()
        info = rds.client_settings()
        creds = {"auth_token": info["token"]} if info else {}
        again, pid = None, None
        if server is not None:
            actor, again = rds.get_or_create(listen="127.0.0.1:0")  # the running one, not a second
            pid = ray.get(actor.pid.remote())
        prompt = [11, 12, 13, 14]
        no_token = None
        if server is not None:
            with HistoryPublisher(server, **creds) as pub:
                pub.publish(prompt, [21, 22, 23, 24, 25], version=3)
                pub.flush()
            try:  # secure by default: a client without the token is refused, with a clear reason
                with HistoryPublisher(server, max_attempts=1) as pub:
                    pub.publish(prompt, [26, 27], version=3)
                    pub.flush()
                no_token = "accepted"
            except Exception as e:
                no_token = str(e)
        env = {"HISTOSPEC_DRAFT_SERVER_ACTOR": f"{rds.NAMESPACE}/{rds.NAME}"}
        eng = EngineActor.options(runtime_env={"env_vars": env}).remote()
        args = ray.get(eng.server_args.remote(), timeout=FIRST_CALL_S)
        resolved = ray.get(eng.env.remote("HISTOSPEC_DRAFT_SERVER"))
        got = ray.get(eng.receive.remote(prompt, 30.0), timeout=120)
        out = {"lookup": server, "again": again, "server_pid": pid, "server_args": args, "resolved": resolved,
               "received": got, "token_required": bool(info and info["token"]), "no_token": no_token,
               "engine_token_file": ray.get(eng.env.remote("HISTOSPEC_DRAFT_SERVER_TOKEN_FILE"))}
        if server is not None:
            # The server child dies (as to the OOM killer): the actor starts it again on the same
            # address from its data dir; what it acknowledged is there, and publishing goes on.
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while ray.get(actor.restarts.remote()) < 1 and time.monotonic() < deadline:
                time.sleep(0.2)
            out["restarts"] = ray.get(actor.restarts.remote())
            out["pid_after"] = ray.get(actor.pid.remote())
            out["address_after"] = ray.get(actor.address.remote())
            with HistoryPublisher(server, **creds) as pub:
                pub.publish(prompt, [31, 32, 33], version=4)
                pub.flush()
            out["received_after"] = ray.get(eng.receive.remote(prompt, 30.0, 2), timeout=120)
            out["trainer"] = ray.get(eng.trainer_record.remote(prompt), timeout=120)
        print(json.dumps(out))
    finally:
        ray.shutdown()


def restart(address: str, data_dir: str, other_dir: str) -> None:
    """A draft-server actor (with ``data_dir``, or without when it is empty) whose server process is
    killed, then whose actor is killed (Ray starts it again with the same arguments), while a
    publisher holding the token it was given goes on publishing: every batch is acknowledged, the token
    stays the same, and with a data dir every acknowledged record is there at the end. A second call
    with other shards or another data dir is refused."""
    from histospec_sgl.integrations import ray_draft_server as rds
    from histospec_sgl.procs import free_port
    from histospec_sgl.sync.client import HistoryPublisher

    ray.init(address=address, log_to_driver=False)
    name = "restart-" + ("dir" if data_dir else "nodir")
    out: dict = {}
    try:
        actor, server = rds.get_or_create(name=name, listen=f"127.0.0.1:{free_port()}", data_dir=data_dir or None)
        token = rds.client_settings(name)["token"]
        for label, kwargs in (("other_shards", {"shards": 2}), ("other_dir", {"data_dir": other_dir})):
            try:
                rds.get_or_create(name=name, **kwargs)
                out[label] = "accepted"
            except ValueError as e:
                out[label] = str(e)

        def batch(pub, k0: int) -> None:
            for k in range(k0, k0 + 10):
                pub.publish([500 + k, 1, 2], [k, k + 1], group=k, version=1)
            pub.flush()  # raises unless every record was acknowledged

        with HistoryPublisher(server, auth_token=token, max_attempts=120, max_backoff=1.0) as pub:
            batch(pub, 0)
            os.kill(ray.get(actor.pid.remote()), signal.SIGKILL)  # the server process
            batch(pub, 10)
            before = ray.get(actor.pid.remote())
            ray.kill(actor, no_restart=False)  # the actor: Ray starts it again with the same arguments
            deadline = time.monotonic() + 120
            while True:  # until the restarted actor's server answers (ray.kill does not wait)
                try:
                    if ray.get(actor.pid.remote(), timeout=30) != before:
                        break
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    pass
                assert time.monotonic() < deadline, "the draft-server actor was not restarted"
                time.sleep(0.2)
            batch(pub, 20)
            out["records"] = pub.stats()["records"]
        out["token_same"] = rds.client_settings(name)["token"] == token
        out["address_same"] = rds.lookup(name) == server
        rds.stop(name)
    finally:
        ray.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    if sys.argv[1] == "hook":
        hook()
    elif sys.argv[1] == "restart":
        restart(*sys.argv[2:5])
    else:
        engine(sys.argv[2])
