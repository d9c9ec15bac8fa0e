"""``histospec-sgl bench worker``: the host time the HISTORY worker adds to each decode step.

Every verify step the worker brings each request's context in the index up to what SGLang accepted,
then drafts the whole batch (:class:`~histospec_sgl.engine.drafter.BatchDrafter`, the code the
SGLang worker runs). This benchmark replays that loop without a GPU, on W1 (RL-shaped synthetic,
2000-token responses): ``--groups`` prompts hold their 16 epoch-1 responses as history, and
``bs / groups`` epoch-2 responses of each prompt decode together, as siblings of a GRPO group do.
The steps run through the replay's loop (:func:`~histospec_sgl.replay.measure.replay`) on its
adapter of the worker's drafter (:class:`~histospec_sgl.replay.methods.Ours`): each step drafts,
accepts greedily along the tree against the logged continuation (exact match) and advances by
accepted + 1.

SGLang's overlap scheduler hands the worker a request's context in two parts: ``output_ids``, one step
behind, and the tokens accepted last step. Two ways of syncing are timed on the same steps, each on
its own drafter holding the same history:

- ``sync_ms_per_step``: what the worker does, one ``sync_batch`` call that reads only the new tokens
  and appends them in one call into the index;
- ``sync_one_by_one_ms_per_step``: the earlier way, a call per request with its whole context
  (``output_ids + pending``) copied into one list, whose cost grows with the response length.

``draft_ms_per_step`` is the batch draft; ``host_ms_per_step`` = sync + draft. Medians over the steps
after ``--warm`` tokens per request; the index runs on ``--threads`` threads (default 1; the worker's
``HISTOSPEC_THREADS`` defaults to min(4, cores)).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from histospec_sgl.bench.workload import W1, generate
from histospec_sgl.engine.config import HistoryConfig
from histospec_sgl.engine.drafter import BatchDrafter
from histospec_sgl.replay.measure import Track, replay
from histospec_sgl.replay.methods import Ours


def _sync_one_by_one(dr: BatchDrafter, tracks: list[Track]) -> float:
    """The earlier worker loop: one call per request, with its whole context copied into one list."""
    t0 = time.perf_counter()
    for tr in tracks:
        dr.sync(str(tr.rid), tr.prompt, list(tr.truth[: tr.pos]))
    return time.perf_counter() - t0


def _run_batch(w: Any, bs: int, groups: int, d: int, warm: int, steps: int, threads: int) -> dict[str, float]:
    per = max(1, bs // groups)
    reqs = [(g, j) for g in range(groups) for j in range(per)][:bs]
    # The worker's drafter, driven by the replay's loop (the overlap scheduler's two-part context,
    # timed per step), and the earlier way's drafter, holding the same history.
    fast = Ours(threads=threads)
    fast.reset(True, d)
    slow = BatchDrafter(d, HistoryConfig(threads=threads, control="fixed"))
    for g in range(groups):
        for resp in w.epoch1[g]:
            fast.add_history(w.prompts[g].tolist(), resp.tolist())
            slow.add_finished(w.prompts[g].tolist(), resp.tolist())
    # Each request joins `warm` response tokens in, the last of them not yet seen by the drafter.
    tracks = [Track(i, w.prompts[g].tolist(), w.epoch2(g, j).tolist(), start=warm + 1)
              for i, (g, j) in enumerate(reqs)]
    loop = replay(fast, tracks, d)
    t_sync, t_slow, t_draft, advanced = [], [], [], []
    for step in range(steps):
        # The two ways alternate which goes first, so neither always finds the caches warmer.
        if step % 2:
            t_slow.append(_sync_one_by_one(slow, tracks))
        batch = next(loop, None)
        if batch is None:
            break
        if not step % 2:
            t_slow.append(_sync_one_by_one(slow, tracks))
        t_sync.append(fast.last_sync_s)
        t_draft.append(fast.last_draft_s)
        advanced.append(sum(s.emit for s in batch) / len(tracks))
    ms = lambda xs: float(np.median(xs) * 1e3)  # noqa: E731
    return {
        "sync_ms_per_step": ms(t_sync),
        "draft_ms_per_step": ms(t_draft),
        "host_ms_per_step": ms(np.add(t_sync, t_draft)),
        "sync_one_by_one_ms_per_step": ms(t_slow),
        "tokens_per_request_step": float(np.mean(advanced)),
        "response_tokens_at_end": float(np.mean([tr.pos for tr in tracks])),
        "requests": len(reqs),
        "groups": groups,
        "steps": len(t_sync),
    }


def run(batch_sizes: list[int], groups: int = 64, d: int = 12, warm: int = 1000, steps: int = 60,
        progress: Callable[[str], None] | None = None, threads: int = 1) -> dict[str, Any]:
    say = progress or (lambda _m: None)
    say(f"generating W1 ({groups} prompts)")
    w = generate(W1, prompts=groups)
    out: dict[str, Any] = {"workload": "W1", "draft_tokens": d, "warm_tokens": warm, "threads": threads,
                           "batch_sizes": {}}
    for bs in batch_sizes:
        g = min(groups, bs)
        say(f"batch {bs}: {g} groups x {max(1, bs // g)} siblings, {steps} steps")
        out["batch_sizes"][str(bs)] = _run_batch(w, bs, g, d, warm, steps, threads)
    return out


def print_table(result: dict[str, Any]) -> None:
    from rich.table import Table

    from histospec_sgl.console import console

    t = Table(title=f"histospec-sgl bench worker (W1, d={result['draft_tokens']}, "
                    f"responses past {result['warm_tokens']} tokens, {result['threads']} index thread(s); "
                    "ms per decode step)")
    for col in ("batch", "sync", "draft", "host (sync + draft)", "sync one by one (earlier)",
                "tokens / request-step"):
        t.add_column(col, justify="right")
    for bs, r in result["batch_sizes"].items():
        t.add_row(bs, f"{r['sync_ms_per_step']:.2f}", f"{r['draft_ms_per_step']:.2f}",
                  f"{r['host_ms_per_step']:.2f}", f"{r['sync_one_by_one_ms_per_step']:.2f}",
                  f"{r['tokens_per_request_step']:.2f}")
    console().print(t)
