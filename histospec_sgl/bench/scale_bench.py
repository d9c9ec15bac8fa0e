"""``histospec-sgl bench scale``: history at dataset scale, scaled down to this machine.

A GRPO job in which every prompt returns once an epoch, many steps after it was last sampled, with
each engine's index bounded by a memory budget several times smaller than the job's whole history.
Three ways for the engines to hold history, each a fresh draft server (a real process, real gRPC over
loopback) and ``engines`` engines:

- ``mirror``: every engine subscribes to every record (``HISTOSPEC_DRAFT_SERVER_MODE=mirror``) under
  the budget; the index evicts least-recently-used groups, so a prompt's history is gone when it
  returns.
- ``on_demand`` (the default mode): each engine follows the groups it drafts for (``Follow``): the
  trainer announces the next step's groups to the draft server while a step decodes
  (:meth:`~histospec_sgl.sync.client.HistoryPublisher.announce`, as slime's data source does), each
  engine asks for the announced groups it decoded before (the router sends a group back to the
  same engine), and lets evicted groups go. ``ready_at_first_request`` is the share of groups with
  history (epochs after the first) whose history had all arrived (since the announcement, or held
from before) when their first request did; ``held_at_first_request`` those whose history the
engine's index still held then (under a budget below two steps' groups, the current step's
records evict the next step's fetched history; they are fetched again at the first request).
- ``unbounded``: mirror with no budget, the ceiling.

With ``shards`` > 1, ``on_demand`` runs again on a server of that many shards (a group's records on
shard ``key mod shards``), and once more with shard 0 killed (SIGKILL) halfway through the job and
started again from its data dir after a short outage, as its Ray actor does: ``acked_lost`` counts
records acknowledged to an engine that no shard holds at the end, a fetch the dead shard cannot
answer is given up at its bound (``fetches_given_up``; ``late_p99_ms``: their history's arrival after
all), and at the end the shard is restarted on its whole data dir twice, from its index and with the
index deleted (every record decoded): ``restart_seconds`` and ``restart_seconds_decoding``. Every server holds at most
``server_memory`` bytes of records in memory (``--memory-bytes``) and reads older ones back from its
data dir, as a server holding epochs of a real job does.

An engine here is the engine's own drafting (:class:`~histospec_sgl.engine.drafter.BatchDrafter` at a
fixed width d, fed by the same :class:`~histospec_sgl.sync.engine.EngineSync` the SGLang worker
uses) with the model replaced by the logged responses: each decode step drafts for the whole batch
(the step's groups routed to this engine, ``samples`` siblings each, decoding together), accepts each
draft along the logged continuation (tree verification's walk), and publishes each response when it
finishes. Tokens per verify step counts every decode step of every response (the first token comes
from prefill).

With the load run, a restart is timed at its size too (:func:`~histospec_sgl.bench.scale_load.run_restart`): a durable server sent
the job's records four times over is killed and started again on its data dir, from its index and
with the index deleted.

Workload: real rollout responses re-keyed into groups: group i takes the responses of logged prompt
``i mod P`` (the GRPO log's prompts with at least ``samples * epochs`` responses, or the shipped
HumanEval sample), a different slice of them each epoch, under its own group key.
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from histospec_sgl.bench.scale_load import run_load, run_restart, timed_restart
from histospec_sgl.engine.config import HistoryConfig
from histospec_sgl.engine.draft import advance, tree_parents_batch, walk
from histospec_sgl.engine.drafter import BatchDrafter
from histospec_sgl.sync.client import DraftServerError, HistoryPublisher
from histospec_sgl.sync.engine import EngineSync
from histospec_sgl.sync.process import DraftServerProcess

MODES = ("unbounded", "mirror", "on_demand")


@dataclass
class Request:
    rid: str
    group: int
    prompt: list[int]
    truth: list[int]
    pos: int = 1  # tokens emitted (the prefill gave the first)


@dataclass
class Engine:
    """One engine: its drafter, its link to the draft server and its counters."""

    drafter: BatchDrafter
    sync: EngineSync
    d: int
    steps: int = 0
    emitted: int = 0
    peak_bytes: int = 0
    #: Groups with history (after the first epoch) at their first request: [history arrived since the
    #: step was announced or held from before, still in the index, all].
    ready: list[int] = field(default_factory=lambda: [0, 0, 0])
    by_epoch: dict[int, list[int]] = field(default_factory=dict)

    @property
    def index(self) -> Any:
        return self.drafter.index

    def decode(self, reqs: Sequence[Request], epoch: int, announced_at: float | None = None) -> None:
        """Decodes one step's requests together, drafting from whatever history has arrived."""
        d, drafter = self.d, self.drafter
        groups = {r.group for r in reqs}
        if epoch > 0:
            self.sync.step_boundary()
            held = [self.sync.ready(g) for g in groups]
            since = announced_at if announced_at is not None else float("inf")
            self.ready[0] += sum(h or (self.sync.ready_at(g) or -1.0) >= since for g, h in zip(groups, held))
            self.ready[1] += sum(held)
            self.ready[2] += len(groups)
        self.sync.want(groups)  # already asked for when announced: a no-op unless it was not
        self.sync.step_boundary()
        for r in reqs:
            drafter.sync(r.rid, r.prompt, r.truth[:1], group=r.group)
        live = [r for r in reqs if len(r.truth) > 1]
        tally = self.by_epoch.setdefault(epoch, [0, 0])
        for r in reqs:
            if len(r.truth) <= 1:
                self._finish(r, epoch)
        while live:
            self.sync.step_boundary()
            drafter.sync_batch((r.rid, r.prompt, r.truth[:r.pos], (), None) for r in live)
            tokens, mask = drafter.draft([r.rid for r in live], width=d)[:2]
            parents = tree_parents_batch(mask, d)
            still = []
            for b, r in enumerate(live):
                n = 1 + drafter.drafted(r.rid)
                acc = walk(tokens[b * d:b * d + n], parents[b, :n], r.truth[r.pos:])[1]
                step = advance(acc, len(r.truth) - r.pos)
                r.pos += step
                self.steps += 1
                self.emitted += step
                tally[0] += step
                tally[1] += 1
                if r.pos >= len(r.truth):
                    self._finish(r, epoch)
                else:
                    still.append(r)
            live = still
        self.sync.drain(60)
        self.peak_bytes = max(self.peak_bytes, int(self.index.stats()["bytes"]))

    def _finish(self, r: Request, epoch: int) -> None:
        # As the worker does with a draft server: the response comes back through the server.
        self.drafter.complete(r.rid, r.prompt, r.truth, group=r.group,
                              publish=lambda p, resp, g: self.sync.finished(p, resp, version=epoch, group=g))


def load_groups(samples: int, epochs: int, data_root: Any = None, tokenizer: Any = None,
                progress: Callable[[str], None] = lambda s: None) -> tuple[str, list[tuple[list[int], list[list[int]]]]]:
    """(source name, [(prompt_ids, responses)]) of the logged prompts with at least samples x epochs
    responses: the GRPO log where it is found, else the shipped HumanEval sample."""
    from histospec_sgl.replay.data import ReplayDataError, default_data_root, default_tokenizer, preset_rows

    need = samples * epochs
    for preset in ("grpo", "humaneval-sample"):
        try:
            progress(f"loading {preset}")
            rows = preset_rows(preset, data_root or default_data_root(), tokenizer or default_tokenizer())
        except (ReplayDataError, OSError, ValueError) as e:
            progress(f"{preset}: {e}")
            continue
        by: dict[str, list[Any]] = {}
        for r in rows:
            if r.prompt_ids and r.response_ids:
                by.setdefault(r.group, []).append(r)
        groups = [(list(v[0].prompt_ids), [list(x.response_ids) for x in v]) for _, v in sorted(by.items())
                  if len(v) >= need]
        if groups:
            return preset, groups
    raise ReplayDataError("no rollout data with enough responses per prompt (looked for grpo, humaneval-sample)")


def make_job(sources: list[tuple[list[int], list[list[int]]]], groups: int, samples: int, epochs: int,
             step_groups: int, seed: int) -> list[list[list[tuple[int, list[int], list[list[int]]]]]]:
    """epochs x steps x [(group, prompt_ids, the group's responses this step)]: each epoch visits every
    group once, in its own seeded order."""
    rng = random.Random(seed)
    job = []
    for e in range(epochs):
        order = list(range(groups))
        rng.shuffle(order)
        steps = []
        for s in range(0, groups, step_groups):
            step = []
            for g in order[s:s + step_groups]:
                prompt, resp = sources[g % len(sources)]
                # Copies of one logged prompt (g // len(sources) > 0) start at another response.
                start = (e * samples + (g // len(sources)) * 7) % len(resp)
                step.append((g, prompt, [resp[(start + k) % len(resp)] for k in range(samples)]))
            steps.append(step)
        job.append(steps)
    return job


class Shards:
    """``n`` draft-server processes, each durable under its own data dir; one can be killed and
    started again on its port, as the Ray actor that owns a shard does when its process dies."""

    def __init__(self, n: int, tmp: str, tag: str, memory_bytes: int = 0):
        self.dirs = [os.path.join(tmp, f"{tag}-shard-{i}") for i in range(n)]
        self.tmp, self.tag = tmp, tag
        self.extra = ["--memory-bytes", str(memory_bytes)] if memory_bytes else []
        self.procs = [DraftServerProcess(data_dir=d, log=os.path.join(tmp, f"{tag}-{i}.log"), extra=self.extra)
                      for i, d in enumerate(self.dirs)]
        self.address = ",".join(p.address for p in self.procs)
        self.restarts = 0

    def restart_seconds(self, i: int, *, index: bool) -> float:
        """SIGKILLs shard ``i`` and times its restart on its data dir (to listening), from the data
        dir's index or, with ``index=False``, with the index deleted so that every record is decoded."""
        port = self.procs[i].port
        self.procs[i].kill()
        self.procs[i], seconds = timed_restart(port, self.dirs[i], index=index, extra=self.extra,
                                               log=os.path.join(self.tmp, f"{self.tag}-{i}-restart-{index}.log"))
        return seconds

    def kill_and_restart(self, i: int, outage: float) -> threading.Thread:
        """SIGKILLs shard ``i`` now and starts it again after ``outage`` seconds (in the background)."""
        port = self.procs[i].port
        self.procs[i].kill()

        def again() -> None:
            time.sleep(outage)
            self.procs[i], _ = timed_restart(port, self.dirs[i], index=True, extra=self.extra,
                                             log=os.path.join(self.tmp, f"{self.tag}-{i}-again.log"))
            self.restarts += 1

        t = threading.Thread(target=again, daemon=True)
        t.start()
        return t

    def rss_bytes(self) -> int:
        """The shards' resident memory now (Linux; 0 elsewhere)."""
        total = 0
        for p in self.procs:
            try:
                with open(f"/proc/{p.proc.pid}/status") as f:
                    total += next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmRSS:"))
            except (OSError, StopIteration, ValueError):
                pass
        return total

    def close(self) -> None:
        for p in self.procs:
            p.kill()


def run_mode(mode: str, job: list, *, engines: int, d: int, budget: int, tmp: str,
             progress: Callable[[str], None], shards: int = 1, kill: bool = False,
             outage: float = 2.0, server_memory: int = 0) -> dict[str, Any]:
    """One mode on fresh servers: every step of every epoch, groups routed to engine ``g mod engines``.
    ``kill``: shard 0 is killed (SIGKILL) halfway through the job and started again from its data dir
    ``outage`` seconds later."""
    tag = f"{mode}-{shards}{'-kill' if kill else ''}"
    servers = Shards(shards, tmp, tag, server_memory)
    restart: threading.Thread | None = None
    try:
        cfg = HistoryConfig(control="fixed", memory_budget=0 if mode == "unbounded" else budget, threads=1)
        fleet = []
        for _ in range(engines):
            drafter = BatchDrafter(d, cfg)
            sync = EngineSync(servers.address, drafter.index, mode="on_demand" if mode == "on_demand" else "mirror")
            fleet.append(Engine(drafter, sync, d))
        t0 = time.monotonic()
        published = 0
        flat = [(e, s) for e in range(len(job)) for s in range(len(job[e]))]
        trainer = HistoryPublisher(servers.address)  # announces each next step, as the trainer does
        announced_at: float | None = None
        try:
            for i, (e, s) in enumerate(flat):
                if kill and i == len(flat) // 2:
                    progress(f"{tag}: killing shard 0 at step {i} of {len(flat)}")
                    restart = servers.kill_and_restart(0, outage)
                step = job[e][s]
                this_step_announced, announced_at = announced_at, None
                if i + 1 < len(flat) and mode == "on_demand":  # the trainer announces the next step
                    e2, s2 = flat[i + 1]
                    t_announce = time.monotonic()
                    try:
                        trainer.announce([g for g, _, _ in job[e2][s2]], timeout=1.0)
                        announced_at = t_announce
                    except DraftServerError:
                        pass  # a shard is down: its groups are fetched at their first request
                for eng_i, eng in enumerate(fleet):
                    reqs = [Request(f"{e}-{g}-{k}", g, prompt, resp)
                            for g, prompt, rs in step if g % engines == eng_i
                            for k, resp in enumerate(rs)]
                    if reqs:
                        eng.decode(reqs, e, this_step_announced)
                        published += len(reqs)
                if s == 0:
                    progress(f"{tag}: epoch {e} begun ({time.monotonic() - t0:.0f} s)")
            if restart is not None:
                restart.join(60)
            for eng in fleet:
                eng.sync.drain(60)
            seconds = time.monotonic() - t0
            stats = trainer.stats()
            server_rss = servers.rss_bytes()
        finally:
            trainer.close()
            for eng in fleet:
                eng.sync.close(timeout=5)
        restarts = ({"restart_seconds": servers.restart_seconds(0, index=True),
                     "restart_seconds_decoding": servers.restart_seconds(0, index=False),
                     "restart_records": int(stats["shards"][0]["records"]) if "shards" in stats else int(stats["records"])}
                    if kill else {})
    finally:
        if restart is not None:
            restart.join(60)
        servers.close()
    fetch = sorted(x for eng in fleet for x in eng.sync.fetch_seconds)
    late = sorted(x for eng in fleet for x in eng.sync.late_seconds)

    def pct(q: float, xs: list[float] = fetch) -> float | None:
        return 1e3 * xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None

    arrived, held, with_history = (sum(eng.ready[k] for eng in fleet) for k in range(3))

    received = [eng.sync.received_bytes for eng in fleet]
    by_epoch: dict[str, float] = {}
    for e in range(len(job)):
        em = sum(eng.by_epoch.get(e, [0, 0])[0] for eng in fleet)
        st = sum(eng.by_epoch.get(e, [0, 0])[1] for eng in fleet)
        by_epoch[str(e)] = em / max(st, 1)
    return {
        "mode": mode,
        "shards": shards,
        "engines": engines,
        "history_tokens": int(stats["tokens"]),
        "engine_budget_bytes": 0 if mode == "unbounded" else budget,
        "engine_peak_bytes": max(eng.peak_bytes for eng in fleet),
        "tokens_per_step": sum(eng.emitted for eng in fleet) / max(sum(eng.steps for eng in fleet), 1),
        "tokens_per_step_by_epoch": by_epoch,
        "fetch_p50_ms": pct(0.5),
        "fetch_p99_ms": pct(0.99),
        "fetches": len(fetch),
        "fetches_given_up": sum(eng.sync.fetches_given_up for eng in fleet),
        "late_p99_ms": pct(0.99, late),
        "announced": sum(eng.sync.announced for eng in fleet),
        "ready_at_first_request": arrived / with_history if with_history and mode == "on_demand" else None,
        "held_at_first_request": held / with_history if with_history and mode == "on_demand" else None,
        "received_bytes_per_engine": statistics.fmean(received),
        "server_rss_bytes": server_rss,
        "server_resident_bytes": int(stats["resident_bytes"]),
        "server_memory_bytes": server_memory * shards,
        "killed_shard": kill,
        "shard_restarts": servers.restarts,
        "acked_lost": published - int(stats["records"]),
        "seconds": seconds,
        **restarts,
    }


def run(*, groups: int = 256, samples: int = 8, epochs: int = 3, step_groups: int = 32, engines: int = 4,
        d: int = 8, budget: int | None = None, budget_fraction: float = 8.0, modes: Sequence[str] = MODES,
        shards: int = 2, load: Sequence[int] = (4, 64), server_memory: int = 1 << 20, seed: int = 0, data_root: Any = None, tokenizer: Any = None,
        progress: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Runs each mode; the budget is ``budget`` bytes, or the unbounded engine's peak over
    ``budget_fraction`` (the whole history then is that many times one engine's budget). With
    ``shards`` > 1, on_demand runs again on that many shards, and once more with shard 0 killed and
    restarted halfway through."""
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"unknown mode(s) {bad}; choose from {', '.join(MODES)}")
    source, sources = load_groups(samples, epochs, data_root, tokenizer, progress)
    job = make_job(sources, groups, samples, epochs, step_groups, seed)
    rows: list[dict[str, Any]] = []
    order = sorted(modes, key=MODES.index)  # unbounded first: it sizes the budget
    with tempfile.TemporaryDirectory(prefix="histospec-bench-scale-") as tmp:
        for mode in order:
            if budget is None and mode != "unbounded":
                ceiling = next((r for r in rows if r["mode"] == "unbounded"), None)
                if ceiling is None:
                    raise ValueError("give --budget, or include the unbounded mode (it sizes the budget)")
                budget = int(ceiling["engine_peak_bytes"] / budget_fraction)
            progress(f"{mode}: {groups} groups x {samples} samples x {epochs} epochs on {engines} engines")
            rows.append(run_mode(mode, job, engines=engines, d=d, budget=budget or 0, tmp=tmp, progress=progress,
                                 server_memory=server_memory))
        load_rows = run_load(load, job, tmp=tmp, progress=progress) if load else []
        restart = run_restart(job, tmp=tmp, progress=progress) if load else None
        if shards > 1 and "on_demand" in order:
            for kill in (False, True):
                rows.append(run_mode("on_demand", job, engines=engines, d=d, budget=budget or 0, tmp=tmp,
                                     progress=progress, shards=shards, kill=kill, server_memory=server_memory))
    ceiling = next((r for r in rows if r["mode"] == "unbounded"), None)
    if ceiling:
        for r in rows:
            r["vs_unbounded"] = r["tokens_per_step"] / ceiling["tokens_per_step"]
            r["history_bytes_over_budget"] = (ceiling["engine_peak_bytes"] / r["engine_budget_bytes"]
                                              if r["engine_budget_bytes"] else None)
    return {
        "rows": rows,
        "load": load_rows,
        "restart": restart,
        "config": {"groups": groups, "samples": samples, "epochs": epochs, "step_groups": step_groups,
                   "engines": engines, "d": d, "budget": budget, "budget_fraction": budget_fraction, "shards": shards,
                   "server_memory": server_memory,
                   "seed": seed, "data": source, "source_prompts": len(sources), "cpus": os.cpu_count(),
                   "steps_between_returns": int(np.ceil(groups / step_groups))},
    }


def print_table(r: dict[str, Any]) -> None:
    from rich.table import Table

    from histospec_sgl.console import console

    c = r["config"]
    t = Table(title=f"bench scale: {c['groups']} groups x {c['samples']} samples x {c['epochs']} epochs "
              f"({c['data']}), {c['engines']} engines, a group returns every {c['steps_between_returns']} steps")
    for col in ("mode", "shards", "budget MB", "peak MB", "tokens/step", "by epoch", "vs unbounded", "fetch p50/p99 ms",
                "ready at 1st request", "given up", "MB received/engine", "acked lost", "restart s (decoding)"):
        t.add_column(col, justify="left" if col == "mode" else "right")
    for row in r["rows"]:
        fetch = (f"{row['fetch_p50_ms']:.1f} / {row['fetch_p99_ms']:.1f}" if row["fetch_p50_ms"] is not None
                 else "-")
        shards = f"{row['shards']}{' (one killed)' if row['killed_shard'] else ''}"
        t.add_row(row["mode"], shards, f"{row['engine_budget_bytes'] / 1e6:.1f}" if row["engine_budget_bytes"] else "none",
                  f"{row['engine_peak_bytes'] / 1e6:.1f}", f"{row['tokens_per_step']:.3f}",
                  " ".join(f"{v:.2f}" for v in row["tokens_per_step_by_epoch"].values()),
                  f"{row.get('vs_unbounded', 0):.3f}", fetch,
                  f"{row['ready_at_first_request']:.3f}" if row["ready_at_first_request"] is not None else "-",
                  str(row["fetches_given_up"]), f"{row['received_bytes_per_engine'] / 1e6:.1f}",
                  str(row["acked_lost"]),
                  f"{row['restart_seconds']:.2f} ({row['restart_seconds_decoding']:.2f})" if "restart_seconds" in row
                  else "-")
    console().print(t)
    if r.get("restart"):
        x = r["restart"]
        console().print(f"restart on {x['records']} records ({x['data_bytes'] / 1e6:.1f} MB on disk): "
                        f"{statistics.median(x['seconds_index']):.2f} s from the index, "
                        f"{statistics.median(x['seconds_decoding']):.2f} s decoding every record (medians)")
    if r.get("load"):
        t = Table(title="load: one publisher, N engines receiving on loopback (filtered: each follows its groups)")
        for col in ("mode", "engines", "server CPU ns/token", "MB/engine", "max / share", "delivered"):
            t.add_column(col, justify="left" if col == "mode" else "right")
        for x in r["load"]:
            t.add_row(x["mode"], str(x["subscribers"]), f"{x['server_cpu_ns_per_token']:.1f}",
                      f"{x['received_bytes_per_subscriber'] / 1e6:.2f}",
                      f"{x['max_over_share']:.2f}" if x["max_over_share"] else "-", str(x["delivered"]))
        console().print(t)
