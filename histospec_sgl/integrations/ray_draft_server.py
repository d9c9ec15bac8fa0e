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

**Sharded** (``shards=N``, ``histospec-sgl ray draft-server --shards N``): N such actors, shard 0 named
``name`` and shard i ``name-shard-i``, each with its own process, port and ``data_dir/shard-i``, one
token for all; a group's records live on shard ``group_key mod N``, and clients are given the comma
list of the shards' addresses (in shard order), by which they route. A shard whose process dies is
started again by its actor from its data dir while the others go on.

It is **secure by default**: unless given a token (``--auth-token-file``) or told ``insecure``, the
actor makes one (kept in ``data_dir``, so a restart keeps it) and the server requires it. Engines and
trainers find the server, its token and (for TLS) its certificate through the actor:

- ``HISTOSPEC_DRAFT_SERVER_ACTOR=<namespace>/<name>`` in the job's ``runtime_env.env_vars``, with the
  setup hook :func:`histospec_sgl.integrations.ray_setup.setup`: inside each Ray worker the lookup
  (:func:`resolve_env`) sets ``HISTOSPEC_DRAFT_SERVER`` and writes the token (and CA) to private files
  named by ``HISTOSPEC_DRAFT_SERVER_TOKEN_FILE`` (``..._CA``), which the SGLang processes started from
  there inherit and SPEC-RL's store reads. No file is copied by hand.
- or ``HISTOSPEC_DRAFT_SERVER=<head-ip>:<port>`` with ``HISTOSPEC_DRAFT_SERVER_TOKEN_FILE`` on every
  node, set by hand.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import tempfile
from pathlib import Path
from typing import Any

from histospec_sgl import settings

logger = logging.getLogger("histospec_sgl.integrations")

NAME = "histospec-draft-server"
NAMESPACE = "histospec"
DEFAULT_LISTEN = "0.0.0.0:50061"
ACTOR_ENV = "HISTOSPEC_DRAFT_SERVER_ACTOR"
ADDRESS_ENV = "HISTOSPEC_DRAFT_SERVER"
TOKEN_ENV = "HISTOSPEC_DRAFT_SERVER_TOKEN_FILE"
CA_ENV = "HISTOSPEC_DRAFT_SERVER_CA"


def is_loopback(listen: str) -> bool:
    """Whether ``host:port`` binds loopback only."""
    host = listen.rsplit(":", 1)[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _private_file(directory: Path, name: str, data: bytes) -> Path:
    """``data`` in ``directory/name``, readable by this user only."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = directory / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


class DraftServerOwner:
    """The actor's body: starts ``histospec-sgl draft-server`` as a child process that ends with it,
    and watches it: a child that dies (killed, out of memory) is started again on the same address
    from the same data dir, so engines and trainers reconnect to it and find every record it had
    acknowledged (each one is fsynced before it is acknowledged)."""

    def __init__(self, listen: str, data_dir: str | None, extra: list[str] | None = None,
                 log: str | None = None, watch_every: float = 0.5, *, token_file: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None, insecure: bool = False,
                 token: str | None = None, shard: int = 0, shards: int = 1, new_token: str | None = None):
        import threading

        self._data_dir, self._log = data_dir, log
        self._shard, self._shards = shard, shards
        self._extra = list(extra or [])
        # The token: the user's file; else shard 0's (given to the other shards); else the one kept
        # in the data dir (a restart of a server that had one); else the one the creating driver made
        # (``new_token``: Ray starts a restarted actor with the same arguments, so an actor without a
        # data dir keeps its token across restarts too); else a new one.
        self._token: str | None = None
        if token and not token_file:
            home = Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="histospec-draft-"))
            self._token = token
            token_file = str(_private_file(home, "ray-actor-token", token.encode()))
        elif token_file:
            self._token = Path(token_file).read_text().strip() or None
            if self._token is None:
                raise ValueError(f"--auth-token-file {token_file} is empty")
        elif not insecure:
            home = Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="histospec-draft-"))
            made = home / "ray-actor-token"
            if made.exists():
                self._token = made.read_text().strip()
            else:
                self._token = new_token or secrets.token_urlsafe(32)
                _private_file(home, made.name, self._token.encode())
            token_file = str(made)
        elif not is_loopback(listen):
            logger.warning("histospec: the draft server listens on %s with no token (insecure): anyone who can "
                           "reach it can read every prompt and response of the job", listen)
        if token_file:
            self._extra += ["--auth-token-file", token_file]
        if insecure:
            self._extra += ["--insecure"]
        self._ca: bytes | None = None
        if tls_cert or tls_key:
            if not (tls_cert and tls_key):
                raise ValueError("--tls-cert and --tls-key go together")
            self._extra += ["--tls-cert", tls_cert, "--tls-key", tls_key]
            # Clients trust the server's own chain (a self-signed certificate is its own root).
            self._ca = Path(tls_cert).read_bytes()
        bound = Path(data_dir) / "ray-actor-listen" if data_dir else None
        if bound is not None:
            bound.parent.mkdir(parents=True, exist_ok=True)
            if listen.endswith(":0") and bound.exists():
                # A restart after the process died: the port it had, which engines were given.
                listen = bound.read_text().strip()
        if not listen.endswith(":0"):
            # A restarted actor: the server of the actor that died goes with it (it dies with its
            # parent); its port is free again in a moment.
            from histospec_sgl.procs import wait_port_free

            try:
                wait_port_free(int(listen.rsplit(":", 1)[1]))
            except TimeoutError:
                pass  # taken by something else: the server's start says so
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
        logger.info("histospec: draft server listening on %s (data dir %s, %s)", self._address, data_dir,
                    "token required" if self._token else "no token")

    def _start(self, listen: str) -> Any:
        from histospec_sgl.sync.process import DraftServerProcess

        return DraftServerProcess(listen, data_dir=self._data_dir, extra=self._extra, log=self._log,
                                  die_with_parent=True)

    def _watch(self, every: float) -> None:
        from histospec_sgl.procs import wait_port_free

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

    def client_settings(self) -> dict[str, Any]:
        """What a client needs: ``address``, ``token`` (None: none required) and ``ca`` (PEM bytes for
        TLS, else None). Ray hands actor results only to processes of the same cluster."""
        return {"address": self._address, "token": self._token, "ca": self._ca}

    def shard(self) -> tuple[int, int]:
        """(this shard, how many shards the server has)."""
        return self._shard, self._shards

    def config(self) -> dict[str, Any]:
        """What it was started with that a second ``get_or_create`` must not contradict: ``shards``
        and the job's ``data_dir`` (None: history in memory only)."""
        job = self._data_dir if self._shards == 1 or not self._data_dir else str(Path(self._data_dir).parent)
        return {"shards": self._shards, "data_dir": job}

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
                  log: str | os.PathLike[str] | None = None, timeout: float = 60.0,
                  token_file: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                  insecure: bool = False, shards: int | None = None) -> tuple[Any, str]:
    """The running draft-server actor ``namespace/name``, or a new one on the head node.

    Needs ``ray.init()`` first. Returns ``(actor handle, "host:port")`` (shard 0's handle and every
    shard's address, comma-separated, when sharded). A second call (from any driver of the cluster)
    returns the running actor; the other arguments apply only when it is created, except ``shards`` and
    ``data_dir``: given (not None) and not what it runs with, the call is refused (ValueError). The server requires a
    token unless ``insecure``: ``token_file`` (a path on the head node), else one the actor makes and
    keeps in ``data_dir``. ``tls_cert``/``tls_key``: serve TLS (paths on the head node). ``shards``:
    that many servers (default 1), a group's records on shard ``group_key mod shards`` (ports
    ``port + i`` for a fixed ``listen`` port, each its own for ``:0``).
    """
    import ray

    if not ray.is_initialized():
        raise RuntimeError("call ray.init() (or connect to the cluster) before get_or_create")
    if shards is not None and shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    data_dir = os.path.abspath(data_dir) if data_dir is not None else None  # the head node's, as the actor sees it
    creating = shards or 1

    # Made here, given to the actor: a restart of the actor (same arguments) keeps the token that
    # engines and publishers hold, with or without a data dir.
    new_token = None if (insecure or token_file) else secrets.token_urlsafe(32)

    def one(i: int, token: str | None = None) -> Any:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        host, port = listen.rsplit(":", 1)
        at = listen if i == 0 or int(port) == 0 else f"{host}:{int(port) + i}"
        home = data_dir if creating == 1 or not data_dir else Path(data_dir) / f"shard-{i}"
        return ray.remote(DraftServerOwner).options(
            name=shard_name(name, i), namespace=namespace, lifetime="detached", get_if_exists=True, num_cpus=0,
            max_restarts=-1, max_task_retries=-1,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=head_node_id(), soft=False),
        ).remote(at, str(home) if home else None, list(extra or []),
                 f"{log}.shard-{i}" if log and creating > 1 else (str(log) if log else None),
                 token_file=token_file, tls_cert=tls_cert, tls_key=tls_key, insecure=insecure, token=token,
                 shard=i, shards=creating, new_token=new_token if i == 0 else None)

    actor = one(0)
    have = ray.get(actor.config.remote(), timeout=timeout)
    if (shards is not None and have["shards"] != shards) or (data_dir is not None and have["data_dir"] != data_dir):
        running = f"--shards {have['shards']} and " + (f"--data-dir {have['data_dir']}" if have["data_dir"]
                                                        else "no --data-dir")
        raise ValueError(f"the draft server {namespace}/{name} is running with {running}; asked for "
                         + " and ".join(x for x in (f"--shards {shards}" if shards is not None else "",
                                                    f"--data-dir {data_dir}" if data_dir is not None else "") if x)
                         + ". Ask for what it runs with, or stop it first (histospec-sgl ray draft-server --stop; "
                         "docs/draft-server.md says what a changed shard count does to its history)")
    first = ray.get(actor.client_settings.remote(), timeout=timeout)
    for i in range(1, have["shards"]):  # a running server keeps its own count
        ray.get(one(i, first["token"]).address.remote(), timeout=timeout)
    info = client_settings(name, namespace, timeout)
    assert info is not None
    return actor, str(info["address"])


def shard_name(name: str, shard: int) -> str:
    """The actor name of one shard: ``name`` for shard 0, ``name-shard-i`` for the others."""
    return name if shard == 0 else f"{name}-shard-{shard}"


def lookup(name: str = NAME, namespace: str = NAMESPACE, timeout: float = 60.0) -> str | None:
    """The address of the running draft-server actor, or None when there is none."""
    info = client_settings(name, namespace, timeout)
    return None if info is None else str(info["address"])


def client_settings(name: str = NAME, namespace: str = NAMESPACE, timeout: float = 60.0) -> dict[str, Any] | None:
    """The running draft-server actor's address, token and CA (:meth:`DraftServerOwner.client_settings`),
    or None when there is none."""
    import ray

    try:
        actor = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None
    info = dict(ray.get(actor.client_settings.remote(), timeout=timeout))
    _, shards = ray.get(actor.shard.remote(), timeout=timeout)
    addresses = [info["address"]]
    for i in range(1, shards):
        try:
            other = ray.get_actor(shard_name(name, i), namespace=namespace)
        except ValueError:
            raise RuntimeError(f"the draft server {namespace}/{name} has {shards} shards but shard {i} "
                               f"({shard_name(name, i)}) is not running; start it again with "
                               f"`histospec-sgl ray draft-server --shards {shards}`") from None
        addresses.append(ray.get(other.address.remote(), timeout=timeout))
    info["address"] = ",".join(addresses)
    return info


def stop(name: str = NAME, namespace: str = NAMESPACE) -> bool:
    """Stops the server gracefully and removes the actor. Returns whether there was one."""
    import ray

    try:
        actor = ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    actors = [actor]
    try:
        _, shards = ray.get(actor.shard.remote(), timeout=60)
        for i in range(1, shards):
            try:
                actors.append(ray.get_actor(shard_name(name, i), namespace=namespace))
            except ValueError:
                pass
        ray.get([a.stop.remote() for a in actors], timeout=60)
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)
    return True


def resolve_env(environ: Any = None) -> str | None:
    """Inside a Ray worker (an engine actor, a trainer's rollout worker): with
    ``HISTOSPEC_DRAFT_SERVER_ACTOR=namespace/name`` set, looks the actor up and fills what is unset of
    ``HISTOSPEC_DRAFT_SERVER``, ``HISTOSPEC_DRAFT_SERVER_TOKEN_FILE`` and ``HISTOSPEC_DRAFT_SERVER_CA`` (the
    token and certificate go to files only this user can read), which the SGLang processes started from
    here inherit. Returns the address in effect. Does nothing outside a connected Ray worker; never
    raises for a missing actor (logs it: engines then run without a draft server)."""
    env = os.environ if environ is None else environ
    spec = settings.value(ACTOR_ENV, env)
    address = settings.value(ADDRESS_ENV, env)
    if not spec or (address and settings.value(TOKEN_ENV, env)):
        return address
    namespace, _, name = spec.rpartition("/")
    try:
        import ray

        if not ray.is_initialized():
            logger.warning("histospec: %s=%s is set but this process is not a Ray worker; no draft server",
                           ACTOR_ENV, spec)
            return address
        info = client_settings(name or NAME, namespace or NAMESPACE)
    except Exception:
        logger.exception("histospec: could not look up the draft-server actor %s", spec)
        return address
    if info is None:
        logger.warning("histospec: no draft-server actor %s is running; engines draft from their own history",
                       spec)
        return address
    private = Path(tempfile.mkdtemp(prefix="histospec-client-"))
    if info.get("token") and not settings.value(TOKEN_ENV, env):
        env[TOKEN_ENV] = str(_private_file(private, "token", str(info["token"]).encode()))
    if info.get("ca") and not settings.value(CA_ENV, env):
        env[CA_ENV] = str(_private_file(private, "ca.pem", bytes(info["ca"])))
    if not address:
        address = env[ADDRESS_ENV] = str(info["address"])
    logger.info("histospec: draft server %s found through the Ray actor %s", address, spec)
    return address
