"""Greedy requests that exercise SGLang's overlap scheduler the ways a rollout does, sent to a
speculative server and to a plain one: the responses must be token-identical.

What the overlap scheduler does differently from the synchronous loop shows only when batches change
under it: a request joining while others decode (a prefill between two decode steps, whose result is
processed while the decode batch still relays the same accepted tokens), a long prompt prefilled in
chunks, a prompt the radix cache already holds, a request aborted or retracted mid-decode, and
requests that stop early at a stop token (ended as at EOS) beside ones that go on. :func:`run` sends all of them
at staggered times from threads, so the scheduler sees them arrive while it decodes.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from histospec_sgl.bench.engine_server import EngineServer


def requests(seed: int = 0, vocab: int = 500, long_prompt: int = 300) -> list[dict[str, Any]]:
    """The scenario's requests: ``rid``, ``prompt``, ``sp`` (greedy sampling parameters), ``delay``
    (seconds after the start) and ``kind``; ``abort_after`` for the ones aborted mid-decode."""
    rng = random.Random(seed)

    def prompt(n: int | None = None) -> list[int]:
        return [rng.randrange(2, vocab - 1) for _ in range(n or rng.randrange(12, 40))]

    base = [prompt() for _ in range(6)]
    out: list[dict[str, Any]] = []

    def add(kind: str, p: list[int], max_new: int, delay: float, **extra: Any) -> None:
        sp = {"temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": True, **extra.pop("sp", {})}
        out.append({"rid": f"{kind}-{len(out)}", "prompt": p, "sp": sp, "delay": delay, "kind": kind, **extra})

    for i, p in enumerate(base):  # arrive one by one while the earlier ones decode
        add("staggered", p, rng.choice((64, 128, 200)), 0.06 * i)
    add("chunked", prompt(long_prompt), 96, 0.1)  # prefilled in chunks (--chunked-prefill-size)
    add("radix", base[0], 80, 0.15)  # the same prompt again: a radix-cache hit, while its twin decodes
    add("radix", base[1] + prompt(6), 64, 0.2)  # a prefix hit
    for i in range(3):  # aborted while the others decode
        add("abort", prompt(), 3000, 0.03 + 0.1 * i, abort_after=0.15 + 0.15 * i)
    # Stopped by a token plain decoding emits mid-response (run() picks it): SGLang ends a request at
    # a stop token as at EOS (FINISH_MATCHED_TOKEN), with the scheduler a step ahead of it.
    add("stop", base[2], 200, 0.12, sp={"ignore_eos": False})
    add("stop", base[3], 128, 0.25, sp={"ignore_eos": False})
    return out


def _send(srv: EngineServer, r: dict[str, Any], t0: float) -> dict[str, Any]:
    time.sleep(max(0.0, t0 + r["delay"] - time.monotonic()))
    answered = threading.Event()
    if "abort_after" in r:
        def abort() -> None:
            if answered.wait(r["abort_after"]):
                return
            while not answered.wait(0.2):  # an abort that reaches the server first is a no-op: repeat
                srv.abort(r["rid"])
        threading.Thread(target=abort, daemon=True).start()
    try:
        return srv.generate([r["prompt"]], r["sp"], rids=[r["rid"]], timeout=600)[0]
    finally:
        answered.set()


def run(srv: EngineServer, plain: EngineServer, reqs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Sends ``reqs`` (default :func:`requests`) to ``srv`` at their delays, and each (unaborted) to
    ``plain`` in one batch. Returns ``{"got": {rid: output}, "want": {rid: plain output}, "reqs"}``."""
    reqs = [dict(r) for r in (reqs or requests())]
    for stop in (r for r in reqs if r["kind"] == "stop"):  # a token plain decoding emits mid-response
        ref = plain.generate([stop["prompt"]], stop["sp"])[0]["output_ids"]
        stop["sp"] = {**stop["sp"], "stop_token_ids": [ref[len(ref) // 2]]}
    sps = [{**r["sp"], "max_new_tokens": r["sp"]["max_new_tokens"] if "abort_after" not in r else 64}
           for r in reqs]
    want = {r["rid"]: o["output_ids"] for r, o in zip(reqs, plain.generate([r["prompt"] for r in reqs], sps))}
    t0 = time.monotonic()
    with ThreadPoolExecutor(len(reqs)) as pool:
        got = dict(zip((r["rid"] for r in reqs), pool.map(lambda r: _send(srv, r, t0), reqs)))
    return {"got": got, "want": want, "reqs": reqs}


def mismatches(result: dict[str, Any]) -> list[str]:
    """What differs from plain decoding: every response equals plain's, an aborted one is a prefix of
    it (as long as the first 64 tokens plain's reference holds) and ended as aborted."""
    bad = []
    for r in result["reqs"]:
        o, want = result["got"][r["rid"]], result["want"][r["rid"]]
        ids = o["output_ids"]
        if "abort_after" in r:
            if o["meta_info"]["finish_reason"]["type"] != "abort":
                bad.append(f"{r['rid']}: not aborted ({o['meta_info']['finish_reason']})")
            if ids[: len(want)] != want[: len(ids)]:
                bad.append(f"{r['rid']}: differs from plain decoding before its abort")
        elif ids != want:
            at = next((i for i, (a, b) in enumerate(zip(ids, want)) if a != b), min(len(ids), len(want)))
            bad.append(f"{r['rid']} ({r['kind']}): differs from plain decoding at token {at} "
                       f"({len(ids)} against {len(want)} tokens)")
    return bad
