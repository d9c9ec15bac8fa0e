"""End-to-end HISTORY check on a GPU machine: run by bench/gpu/run_on_box.sh.

1. Plain SGLang server (no speculation): greedy outputs of N prompts, and tokens/s at a few batch sizes.
2. The same server with ``--speculative-algorithm HISTORY`` at a fixed width (``HISTOSPEC_CONTROL=fixed``):
   - pass 1 over the same prompts: outputs must be token-identical to plain greedy decoding;
   - pass 2 (history now holds pass 1): accepted tokens per verify step > 1;
   - tokens/s at the same batch sizes.
3. HISTORY under the cost model (``HISTOSPEC_CONTROL=cost``; plain steps run the target's DECODE forward
   eagerly): pass 1 token-identical to plain decoding, tokens/s at the same batch sizes.
Writes ``$OUT/e2e.json`` and prints a summary. The standard library and the installed histospec-sgl
wheel (its process helper): the box has no network.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from histospec_sgl import procs


def post(url: str, body: dict, timeout: float = 300) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_healthy(base: str, proc: subprocess.Popen, limit: float) -> None:
    def healthy() -> bool:
        with urllib.request.urlopen(base + "/health_generate", timeout=10) as r:
            return r.status == 200

    procs.wait_ready(proc, healthy, limit, what="the server", interval=2.0)


def start(args: argparse.Namespace, spec: bool, log: Path, env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model,
           "--attention-backend", "flashinfer", "--sampling-backend", "pytorch", "--grammar-backend", "none",
           "--mem-fraction-static", "0.3", "--host", "127.0.0.1", "--port", str(args.port),
           "--skip-tokenizer-init", "--max-running-requests", str(max(args.batch_sizes))]
    if args.no_cuda_graph:
        cmd += ["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]
    else:
        # Decode graphs up to the largest batch used; prefill graphs (58 sizes, each a JIT compile on a
        # cold box) only when asked for: they are not what speculation verifies in.
        cmd += ["--cuda-graph-max-bs-decode", str(max(args.batch_sizes))]
        if not args.prefill_cuda_graph:
            cmd += ["--cuda-graph-backend-prefill", "disabled"]
    if spec:
        cmd += ["--speculative-algorithm", "HISTORY", "--speculative-num-draft-tokens", str(args.draft_tokens),
                "--enable-metrics"]
    print("+", " ".join(cmd), flush=True)
    f = open(log, "w")
    if env:
        print("+ env", env, flush=True)
    # cwd is the output folder: started from a checkout, ``python -m`` would put the checkout's
    # histospec_sgl (no compiled core) ahead of the installed one. The server dies with this job.
    return procs.spawn(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=args.out, env={**os.environ, **(env or {})})


def stop(proc: subprocess.Popen) -> None:
    procs.stop(proc, grace=30.0)


def generate(base: str, prompts: list[list[int]], max_new: int, concurrency: int) -> tuple[list[dict], float]:
    def one(p: list[int]) -> dict:
        return post(base + "/generate", {"input_ids": p, "sampling_params": {
            "temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": True}})

    t0 = time.time()
    with cf.ThreadPoolExecutor(concurrency) as ex:
        outs = list(ex.map(one, prompts))
    return outs, time.time() - t0


def accept_length(outs: list[dict]) -> float | None:
    toks = sum(o["meta_info"].get("completion_tokens", 0) for o in outs)
    steps = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
    return toks / steps if steps else None


def specrl_alignment(base: str, prompts: list[list[int]], max_new: int, out: Path) -> dict:
    """SPEC-RL scoring on a real server: generate with log-probs, then score prompt + response in one prefill
    (logprob_start_len = len(prompt) - 1: a cached prefix has no logits); the scored log-probs must line up with the response and equal
    the generation's own. The raw responses are kept as fixtures for CPU tests."""
    from histospec_sgl.specrl.client import scored_logprobs

    raw, diffs = [], []
    for p in prompts:
        gen = post(base + "/generate", {"input_ids": p, "return_logprob": True, "logprob_start_len": -1,
                                        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new,
                                                            "ignore_eos": True}})
        ids = gen["output_ids"]
        sc = post(base + "/generate", {"input_ids": p + ids, "return_logprob": True, "logprob_start_len": len(p) - 1,
                                       "sampling_params": {"temperature": 0.0, "max_new_tokens": 1}})
        raw.append({"prompt_ids": p, "generate": gen, "score": sc})
        new = scored_logprobs(sc["meta_info"], ids)
        old = [e[0] for e in gen["meta_info"]["output_token_logprobs"]]
        diffs.append(max(abs(a - b) for a, b in zip(new, old)))
    (out / "specrl_raw.json").write_text(json.dumps(raw))
    first = raw[0]["score"]["meta_info"]["input_token_logprobs"][:2]
    return {"max_abs_logprob_diff": max(diffs), "first_entries": first}


def histospec_metrics(base: str) -> dict:
    """The worker's Prometheus samples from ``/metrics`` (``--enable-metrics``), or the error."""
    try:
        with urllib.request.urlopen(base + "/metrics", timeout=30) as resp:
            text = resp.read().decode()
    except Exception as e:
        return {"error": repr(e)}
    out = {}
    for line in text.splitlines():
        if line.startswith(("histospec:", "sglang:spec_accept_length")):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=21000)
    ap.add_argument("--draft-tokens", type=int, default=8)
    ap.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--no-cuda-graph", action="store_true")
    ap.add_argument("--prefill-cuda-graph", action="store_true", help="also capture SGLang's prefill graphs")
    ap.add_argument("--health-timeout", type=float, default=240)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, args.vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    base = f"http://127.0.0.1:{args.port}"
    result: dict = {"args": {k: v for k, v in vars(args).items()}, "plain": {}, "history": {}, "cost": {}}
    # "cost": the cost model, which decodes plainly (the DECODE forward, outside CUDA graphs) the
    # steps whose drafts do not pay: must match plain decoding token for token; its tokens/s against
    # plain's and fixed-width HISTORY's is what its choices give on a GPU.
    servers = (("plain", False, None), ("history", True, {"HISTOSPEC_CONTROL": "fixed"}),
               ("cost", True, {"HISTOSPEC_CONTROL": "cost"}))
    for name, spec, env in servers:
        proc = start(args, spec, out / f"server-{name}.log", env)
        try:
            wait_healthy(base, proc, args.health_timeout)
            r = result[name]
            outs, secs = generate(base, prompts, args.max_new, max(args.batch_sizes))
            r["pass1_ids"] = [o["output_ids"] for o in outs]
            r["pass1_accept_length"] = accept_length(outs)
            if not spec:
                result["specrl_alignment"] = specrl_alignment(base, prompts[:4], args.max_new, out)
            if spec:
                outs2, _ = generate(base, prompts, args.max_new, max(args.batch_sizes))
                r["pass2_accept_length"] = accept_length(outs2)
                r["pass2_identical"] = [o["output_ids"] for o in outs2] == r["pass1_ids"]
                r["metrics"] = histospec_metrics(base)
            r["throughput"] = {}
            for bs in args.batch_sizes:
                sub = prompts[:bs] * max(1, 64 // bs) if bs < 64 else prompts[:bs]
                o, secs = generate(base, sub, args.max_new, bs)
                toks = sum(x["meta_info"]["completion_tokens"] for x in o)
                r["throughput"][str(bs)] = {"tokens_per_s": toks / secs, "accept_length": accept_length(o)}
        finally:
            stop(proc)
        # What is done so far survives a timeout of the whole job.
        (out / "e2e.partial.json").write_text(json.dumps(result))
    plain, hist, cost = result["plain"], result["history"], result["cost"]
    result["identical"] = plain["pass1_ids"] == hist["pass1_ids"]
    result["mismatches"] = sum(a != b for a, b in zip(plain["pass1_ids"], hist["pass1_ids"]))
    result["cost_identical"] = plain["pass1_ids"] == cost["pass1_ids"]
    result["cost_mismatches"] = sum(a != b for a, b in zip(plain["pass1_ids"], cost["pass1_ids"]))
    for r in (plain, hist, cost):
        r.pop("pass1_ids", None)
    (out / "e2e.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    ok = result["identical"] and result["cost_identical"] and (hist.get("pass2_accept_length") or 0) > 1.0
    print("E2E", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
