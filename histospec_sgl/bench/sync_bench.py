"""``histospec-sgl bench sync``: publish throughput into the draft server and the time until 1, 2 and 4
replicas have applied everything, over loopback with real processes.

Workload: one RL step, ``prompts`` x ``samples`` responses of ``tokens`` tokens (default 256 x 16 x
2000 = 8.2 M response tokens). Responses of a prompt share a base response with a fraction of positions
resampled (``mutation``), as GRPO siblings do; token ids are uniform below ``vocab``.

For each replica count N: a fresh server, N replica processes (``python -m
histospec_sgl.sync.replica``, each a fresh :class:`HistoryIndex` fed by a background subscriber), then
one publisher sends every record. ``apply_seconds[N]`` runs from the first publish call to the moment
the last of the N replicas has applied the last record (wall clock, ``time.time()`` in each process).
``receive_only_seconds`` repeats the largest run with replicas that decode but build no index: the
transport's share.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from histospec_sgl.sync import replica
from histospec_sgl.sync.client import HistoryPublisher
from histospec_sgl.sync.process import DraftServerProcess

TARGET_SECONDS = 4.0  # the target: 8.2 M tokens published and applied by 4 replicas on 2 cores


def make_step(prompts: int, samples: int, tokens: int, prompt_tokens: int, vocab: int, mutation: float, seed: int):
    """(prompt_ids, response_ids) per response of one synthetic RL step."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(prompts):
        p = rng.integers(0, vocab, prompt_tokens, dtype=np.int32)
        base = rng.integers(0, vocab, tokens, dtype=np.int32)
        for _ in range(samples):
            r = base.copy()
            m = rng.random(tokens) < mutation
            r[m] = rng.integers(0, vocab, int(m.sum()), dtype=np.int32)
            out.append((p, r))
    return out


def run_once(
    records: list, replicas: int, *, batch_records: int, data_dir: str | None, log: str | None,
    receive_only: bool = False,
) -> dict[str, Any]:
    with DraftServerProcess(data_dir=data_dir, log=log) as srv:
        procs = [replica.spawn(srv.address, len(records), checksum=False, receive_only=receive_only)
                 for _ in range(replicas)]
        try:
            with HistoryPublisher(srv.address, batch_records=batch_records, batch_tokens=1 << 40) as pub:
                t0 = time.time()
                for p, r in records:
                    pub.publish(p, r, version=1)
                pub.flush()
                t_pub = time.time() - t0
            results = []
            for proc in procs:
                out, _ = proc.communicate(timeout=900)
                res = json.loads(out.strip().splitlines()[-1])
                if proc.returncode != 0:
                    raise RuntimeError(f"replica failed: {res}")
                results.append(res)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    applied = sorted(r["applied_at"] - t0 for r in results)
    return {
        "publish_seconds": t_pub,
        "apply_seconds": applied[-1],
        "apply_seconds_each": applied,
        "replica_index_bytes": [r["stats"]["bytes"] if r["stats"] else 0 for r in results],
    }


def run(
    *,
    prompts: int = 256,
    samples: int = 16,
    tokens: int = 2000,
    prompt_tokens: int = 200,
    vocab: int = 150_000,
    mutation: float = 0.2,
    replicas: list[int] | None = None,
    batch_records: int = 256,
    durable: bool = False,
    seed: int = 0,
    progress: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    replicas = replicas or [1, 2, 4]
    progress(f"generating {prompts} x {samples} responses of {tokens} tokens")
    records = make_step(prompts, samples, tokens, prompt_tokens, vocab, mutation, seed)
    resp_tokens = sum(len(r) for _, r in records)
    all_tokens = resp_tokens + sum(len(p) for p, _ in records)
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="histospec-bench-sync-") as tmp:
        for n in replicas:
            progress(f"{n} replica(s)")
            data_dir = os.path.join(tmp, f"data-{n}") if durable else None
            runs[str(n)] = run_once(
                records, n, batch_records=batch_records, data_dir=data_dir, log=os.path.join(tmp, f"server-{n}.log")
            )
        # The same delivery to the largest replica count, decoding only: what the transport costs
        # without building indexes.
        n = max(replicas)
        progress(f"{n} receive-only replica(s)")
        delivery = run_once(records, n, batch_records=batch_records, data_dir=None,
                            log=os.path.join(tmp, "server-recv.log"), receive_only=True)
    publish_s = min(r["publish_seconds"] for r in runs.values())
    ours = {
        "tokens": resp_tokens,
        "tokens_with_prompts": all_tokens,
        "records": len(records),
        "publish_tokens_per_s": resp_tokens / publish_s,
        "publish_seconds": {k: r["publish_seconds"] for k, r in runs.items()},
        "apply_seconds": {k: r["apply_seconds"] for k, r in runs.items()},
        "apply_seconds_each": {k: r["apply_seconds_each"] for k, r in runs.items()},
        "replica_index_bytes": runs[str(replicas[-1])]["replica_index_bytes"][0],
        "receive_only_seconds": {str(n): delivery["apply_seconds"]},
    }
    biggest = str(max(replicas))
    return {
        "ours": ours,
        "config": {
            "prompts": prompts, "samples": samples, "tokens": tokens, "prompt_tokens": prompt_tokens, "vocab": vocab,
            "mutation": mutation, "replicas": replicas, "batch_records": batch_records, "durable": durable,
            "seed": seed, "cpus": os.cpu_count(),
        },
        "target": {"replicas": 4, "seconds": TARGET_SECONDS, "tokens": 256 * 16 * 2000},
        "meets_target": (
            "4" in ours["apply_seconds"] and resp_tokens >= 256 * 16 * 2000
            and ours["apply_seconds"]["4"] < TARGET_SECONDS
        ) if biggest == "4" else None,
    }


def print_table(r: dict[str, Any]) -> None:
    from rich.table import Table

    from histospec_sgl.console import console

    o = r["ours"]
    t = Table(title=f"bench sync: {o['records']} records, {o['tokens'] / 1e6:.2f} M response tokens "
              f"({'durable' if r['config']['durable'] else 'in memory'})")
    t.add_column("replicas")
    t.add_column("publish s", justify="right")
    t.add_column("all applied s", justify="right")
    t.add_column("each replica s", justify="right")
    for k, s in o["apply_seconds"].items():
        t.add_row(k, f"{o['publish_seconds'][k]:.2f}", f"{s:.2f}", ", ".join(f"{x:.2f}" for x in o["apply_seconds_each"][k]))
    console().print(t)
    for k, v in o["receive_only_seconds"].items():
        print(f"delivery to {k} receive-only replicas (decode, no index): {v:.2f} s")
    print(f"publish throughput: {o['publish_tokens_per_s'] / 1e6:.1f} M tokens/s; "
          f"target: 4 replicas under {TARGET_SECONDS:.0f} s -> {r['meets_target']}")
