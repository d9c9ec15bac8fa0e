"""The draft server as a detached, named Ray actor on the head node.

Every engine of a multi-node job should see every group's history, whichever engine sampled it:
one ``histospec-sgl draft-server`` per job, reachable from all nodes, does that. On Ray it runs as
an actor that owns the server process:

- **detached** (it outlives the driver that created it, so a restarted trainer finds its history),
- **named** (``histospec-draft-server`` in namespace ``histospec`` unless told otherwise; a second
  :func:`get_or_create` returns the running one),
- **on the head node** (``num_cpus=0``, hard node affinity: worker nodes come and go),
- **durable** under ``data_dir`` (every acknowledged record is fsynced; a restart recovers them),
- restarted by Ray if its process dies (``max_restarts=-1``), on the same port (a port chosen by
  ``:0`` is kept in ``data_dir``), and the server restarted by the actor if the server alone dies.

Engines find it in one of two ways:

1. ``HISTOSPEC_DRAFT_SERVER=<head-ip>:<port>`` in the job's ``runtime_env.env_vars`` (printed by
   ``histospec-sgl ray draft-server``; Ray merges job and actor environments, so it reaches slime's
   and verl's engine actors and the SGLang processes they start);
2. ``HISTOSPEC_DRAFT_SERVER_ACTOR=<namespace>/<name>``: the plugin resolves the actor's address
   inside the engine actor, where SGLang's ``ServerArgs`` are built (:func:`resolve_env`), and
   exports ``HISTOSPEC_DRAFT_SERVER`` to the SGLang processes started from there.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

logger = logging.getLogger("histospec_sgl.integrations")

NAME = "histospec-draft-server"
NAMESPACE = "histospec"
DEFAULT_LISTEN = "0.0.0.0:50061"
ACTOR_ENV = "HISTOSPEC_DRAFT_SERVER_ACTOR"
ADDRESS_ENV = "HISTOSPEC_DRAFT_SERVER"


class DraftServerOwner:
    """The actor's body: starts ``histospec-sgl draft-server`` as a child process that ends with it,
    and watches it: a child that dies (killed, out of memory) is started again on the same address
    from the same data dir, so engines and trainers reconnect to it and find every record it had
    acknowledged (each one is fsynced before it is acknowledged)."""

    def __init__(self, listen: str, data_dir: str | None, extra: list[str] | None = None,
                 log: str | None = None, watch_every: float = 0.5):
        import threading

        self._data_dir, self._extra, self._log = data_dir, extra, log
        bound = Path(data_dir) / "ray-actor-listen" if data_dir else None
        if bound is not None:
            bound.parent.mkdir(parents=True, exist_ok=True)
            if listen.endswith(":0") and bound.exists():
                # A restart after the process died: the port it had, which engines were given.
                listen = bound.read_text().strip()
        self._proc = self._start(listen)
        if bound is not None:
            bound.write_text(self._proc.address)
        host, port = self._proc.address.rsplit(":", 1)
        if host in ("0.0.0.0", "::", "[::]", ""):
            import ray

            host = ray.util.get_node_ip_address()
        self._address = f"{host}:{port}"
        self._restarts = 0
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._watcher = threading.Thread(target=self._watch, args=(watch_every,), name="histospec-watch",
                                         daemon=True)
        self._watcher.start()
        logger.info("histospec: draft server listening on %s (data dir %s)", self._address, data_dir)

    def _start(self, listen: str) -> Any:
        from histospec_sgl.sync.process import DraftServerProcess

        return DraftServerProcess(listen, data_dir=self._data_dir, extra=self._extra, log=self._log,
                                  die_with_parent=True)

    def _watch(self, every: float) -> None:
        from histospec_sgl.sync.process import wait_port_free

        while not self._stopped.wait(every):
            with self._lock:
                if self._stopped.is_set() or self._proc.alive():
                    continue
                code = self._proc.proc.poll()
                listen = self._proc.address
                logger.error("histospec: the draft server (pid %d) exited with %s; starting it again on %s",
                             self._proc.proc.pid, code, listen)
                self._proc.kill()
                try:
                    wait_port_free(int(listen.rsplit(":", 1)[1]))
                    self._proc = self._start(listen)
                    self._restarts += 1
                except Exception:
                    logger.exception("histospec: restarting the draft server failed; trying again")

    def address(self) -> str:
        return self._address

    def alive(self) -> bool:
        return self._proc.alive()

    def pid(self) -> int:
        return int(self._proc.proc.pid)

    def restarts(self) -> int:
        """How many times the watcher has started the server again."""
        return self._restarts

    def stop(self) -> int:
        """Graceful stop (drain, final snapshot); the actor stays until killed."""
        self._stopped.set()
        with self._lock:
            return self._proc.terminate()


def head_node_id() -> str:
    """The Ray head node's id (the node whose resources include ``node:__internal_head__``)."""
    import ray

    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in node.get("Resources", {}):
            return str(node["NodeID"])
    raise RuntimeError("no live Ray head node found (is this a Ray cluster?)")


def get_or_create(*, name: str = NAME, namespace: str = NAMESPACE, listen: str = DEFAULT_LISTEN,
                  data_dir: str | os.PathLike[str] | None = None, extra: list[str] | None = None,
                  log: str | os.PathLike[str] | None = None, timeout: float = 60.0) -> tuple[Any, str]:
    """The running draft-server actor ``namespace/name``, or a new one on the head node.

    Needs ``ray.init()`` first. Returns ``(actor handle, "host:port")``. A second call (from any
    driver of the cluster) returns the running actor; ``listen`` and ``data_dir`` apply only when it
    is created.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if not ray.is_initialized():
        raise RuntimeError("call ray.init() (or connect to the cluster) before get_or_create")
    cls = ray.remote(DraftServerOwner)
    actor = cls.options(
        name=name, namespace=namespace, lifetime="detached", get_if_exists=True, num_cpus=0,
        max_restarts=-1, max_task_retries=-1,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=head_node_id(), soft=False),
    ).remote(listen, str(data_dir) if data_dir else None, list(extra or []), str(log) if log else None)
    address = ray.get(actor.address.remote(), timeout=timeout)
    return actor, address


def lookup(name: str = NAME, namespace: str = NAMESPACE, timeout: float = 60.0) -> str | None:
    """The address of the running draft-server actor, or None when there is none."""
    import ray

    try:
        actor = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None
    return str(ray.get(actor.address.remote(), timeout=timeout))


def stop(name: str = NAME, namespace: str = NAMESPACE) -> bool:
    """Stops the server gracefully and removes the actor. Returns whether there was one."""
    import ray

    try:
        actor = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    try:
        ray.get(actor.stop.remote(), timeout=60)
    finally:
        ray.kill(actor, no_restart=True)
    return True


def resolve_env(environ: dict[str, str] | None = None) -> str | None:
    """Inside an engine actor: with ``HISTOSPEC_DRAFT_SERVER_ACTOR=namespace/name`` set and
    ``HISTOSPEC_DRAFT_SERVER`` not, looks the actor up and sets ``HISTOSPEC_DRAFT_SERVER`` (which the
    SGLang processes started from here inherit). Returns the address in effect. Does nothing outside
    a connected Ray worker; never raises for a missing actor (logs it: the engine then runs without
    a draft server)."""
    env = os.environ if environ is None else environ
    if env.get(ADDRESS_ENV) or not env.get(ACTOR_ENV):
        return env.get(ADDRESS_ENV) or None
    spec = env[ACTOR_ENV].strip()
    namespace, _, name = spec.rpartition("/")
    try:
        import ray

        if not ray.is_initialized():
            logger.warning("histospec: %s=%s is set but this process is not a Ray worker; no draft server",
                           ACTOR_ENV, spec)
            return None
        address = lookup(name or NAME, namespace or NAMESPACE)
    except Exception:
        logger.exception("histospec: could not look up the draft-server actor %s", spec)
        return None
    if address is None:
        logger.warning("histospec: no draft-server actor %s is running; engines draft from their own history",
                       spec)
        return None
    env[ADDRESS_ENV] = address
    logger.info("histospec: draft server %s found through the Ray actor %s", address, spec)
    return address
