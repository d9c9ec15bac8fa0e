"""``bench scale``'s server-side runs: the load run (one publisher, N receive-only engines, the
server's CPU per published token) and a restart timed at the load run's size."""

from __future__ import annotations

import collections
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from histospec_sgl.sync.client import HistoryPublisher
from histospec_sgl.sync.process import DraftServerProcess


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _received_records(sub: Any) -> int:
    """Records a receive-only follower or subscriber has had (follower: counted per message)."""
    return int(getattr(sub, "received_records", 0) or getattr(sub, "received_sequence", 0))


def run_load(counts: Sequence[int], job: list, *, tmp: str, progress: Callable[[str], None],
             repeat: int = 4, settle: float = 120.0) -> list[dict[str, Any]]:
    """Traffic at cluster scale on loopback: for each count N, a fresh server, N receive-only engines,
    and one publisher sending the job's records (every epoch, ``repeat`` times over, so that the
    server's CPU time is long against its clock tick) in Publish batches of 256.
    ``filtered``: each engine follows its groups only (group ``g`` on engine ``g mod N``), as
    on_demand engines do; ``mirror``: each subscribes to every record. Reports the server's CPU per
    published token and each engine's received bytes against its groups' share of the history (the
    bytes all engines received together, over N; a mirror's share is the whole history)."""
    from histospec_sgl.sync.follow import GroupFollower
    from histospec_sgl.sync.subscribe import HistorySubscriber

    records = [(g, prompt, resp) for steps in job for step in steps for g, prompt, rs in step for resp in rs]
    records *= repeat
    groups = sorted({g for g, _, _ in records})
    tokens = sum(len(p) + len(r) for _, p, r in records)
    per_group = collections.Counter(g for g, _, _ in records)  # records of each group
    group_tokens: collections.Counter[int] = collections.Counter()  # and their tokens
    for g, p, r in records:
        group_tokens[g] += len(p) + len(r)
    out: list[dict[str, Any]] = []
    whole = 0  # bytes of the whole history on the wire: what one mirror subscriber receives
    for mode in ("mirror", "filtered"):
        for n in counts:
            progress(f"load: {n} {mode} engines, {len(records)} records")
            with DraftServerProcess(log=os.path.join(tmp, f"load-{mode}-{n}.log")) as srv:
                subs: list[Any]
                if mode == "filtered":
                    subs = [GroupFollower(srv.address, None).start() for _ in range(n)]
                    for i, f in enumerate(subs):
                        f.want([g for g in groups if g % n == i])
                    want = [sum(c for g, c in per_group.items() if g % n == i) for i in range(n)]
                else:
                    subs = [HistorySubscriber(srv.address, None, background=True).start() for _ in range(n)]
                    want = [len(records)] * n
                time.sleep(1.0)  # every stream open and its groups added
                cpu0 = _cpu_seconds(srv.proc.pid)
                t0 = time.monotonic()
                with HistoryPublisher(srv.address, batch_records=256) as pub:
                    for g, prompt, resp in records:
                        pub.publish(prompt, resp, group=g)
                    pub.flush()
                deadline = time.monotonic() + settle
                while time.monotonic() < deadline and any(_received_records(x) < w for x, w in zip(subs, want)):
                    time.sleep(0.05)
                seconds = time.monotonic() - t0
                cpu = _cpu_seconds(srv.proc.pid) - cpu0
                delivered = all(_received_records(x) >= w for x, w in zip(subs, want))
                received = [x.received_bytes for x in subs]
                for x in subs:
                    x.close()
            if mode == "mirror":
                whole = whole or min(received)
                share = [whole] * n
            else:  # each engine's groups' tokens, as a share of the whole history's bytes
                mine = [sum(t for g, t in group_tokens.items() if g % n == i) for i in range(n)]
                share = [whole * t / tokens for t in mine]
            over = max(r / s for r, s in zip(received, share)) if whole else None
            out.append({
                "mode": mode, "subscribers": n, "records": len(records), "tokens": tokens, "seconds": seconds,
                "server_cpu_seconds": cpu, "server_cpu_ns_per_token": 1e9 * cpu / tokens,
                "received_bytes_per_subscriber": statistics.fmean(received), "received_bytes_max": max(received),
                "share_bytes": statistics.fmean(share), "max_over_share": over,
                "delivered": delivered,
            })
    return out


def timed_restart(port: int, data_dir: str, *, index: bool, log: str,
                  extra: Sequence[str] = ()) -> tuple[DraftServerProcess, float]:
    """Starts a draft server again on ``port`` and its data dir (the one before it killed) and times
    it to listening: from the data dir's index, or with ``index=False`` with the index deleted first,
    so that every record is decoded. Returns the server and the seconds."""
    from histospec_sgl.procs import wait_port_free

    wait_port_free(port)
    if not index:
        for f in os.listdir(data_dir):
            if f.endswith(".idx"):
                os.remove(os.path.join(data_dir, f))
    t0 = time.monotonic()
    srv = DraftServerProcess(f"127.0.0.1:{port}", data_dir=data_dir, extra=list(extra), log=log)
    return srv, time.monotonic() - t0


def run_restart(job: list, *, tmp: str, progress: Callable[[str], None], repeat: int = 4,
                times: int = 3) -> dict[str, Any]:
    """A restart at the load run's size: one durable server is sent the job's records ``repeat`` times
    over, killed (SIGKILL), and started again on its data dir ``times`` times from its index, then
    ``times`` times with the index deleted (every record decoded); seconds from spawn to listening."""
    records = [(g, prompt, r) for epoch in job for step in epoch for g, prompt, rs in step for r in rs] * repeat
    data_dir = os.path.join(tmp, "restart-data")
    progress(f"restart: {len(records)} records into a durable server")
    srv = DraftServerProcess(data_dir=data_dir, log=os.path.join(tmp, "restart.log"))
    port = srv.port
    try:
        with HistoryPublisher(srv.address, batch_records=256) as pub:
            for g, prompt, resp in records:
                pub.publish(prompt, resp, group=g)
            pub.flush()
            stats = pub.stats()
    finally:
        srv.kill()
    disk = sum(os.path.getsize(os.path.join(data_dir, f)) for f in os.listdir(data_dir) if f.endswith(".bin"))
    out: dict[str, Any] = {"records": int(stats["records"]), "tokens": int(stats["tokens"]), "data_bytes": disk}
    for key, index in (("seconds_index", True), ("seconds_decoding", False)):
        out[key] = []
        for i in range(times):
            # Decoding: each restart deletes the index again (the one before wrote a fresh log's).
            srv, seconds = timed_restart(port, data_dir, index=index, log=os.path.join(tmp, f"restart-{key}-{i}.log"))
            out[key].append(seconds)
            with HistoryPublisher(srv.address) as pub:
                held = int(pub.stats()["records"])
            srv.kill()
            if held != out["records"]:
                raise RuntimeError(f"the restarted server holds {held} of {out['records']} records")
    return out
