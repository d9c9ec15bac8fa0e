"""HISTORY end to end on a GPU machine, under SGLang's overlap scheduler (a GPU's default): run by
bench/gpu/run_on_box.sh, first, within one call. What it answers, each into ``$OUT/e2e.json``
(``e2e.partial.json`` after every phase, so a timeout keeps what was done):

1. ``identity``: greedy requests arriving while others decode, a long prompt in chunked prefill,
   radix-cache hits, aborts mid-decode and stop tokens (tests/helpers/_overlap.py, the scenario the CPU
   tests run), twice (the second pass drafts from the first), through HISTORY at a fixed width
   (``history``), on the default step policy (``cost``), on the default policy with SGLang's test
   retraction (``retract``) and through NGRAM (``ngram``, SGLang's own, for comparison): each response
   against plain decoding's, with ``histospec:context_mismatches_total`` (every HISTORY server runs
   ``HISTOSPEC_CHECK_CONTEXT=1``);
2. ``first_differences``: where a greedy output first differs from plain decoding's, the target's top-2
   log-prob margin there (plain decoding's own top-2 at that position): eager and graphed bf16 kernels
   can pick differently where the two are nearly tied, which a margin near 0 shows;
3. ``accept_length``: tokens per verify step on the second pass of 64 prompts x 128 tokens;
4. ``throughput``: tokens/s at batch 1, 8 and 32 for plain decoding, NGRAM, HISTORY at d and the
   default policy (on prompts seen once: each prompt's second epoch);
5. ``step_seconds``: each verify width's step cost per batch bucket as the default policy measured it,
   with CUDA graphs (``cost``: graphs at width d only, other widths and plain steps eager) and without
   (``cost_eager``);
6. ``chi_square``: 2,560 continuations at temperature 1 of a peaked random model (24 tokens, sharpened
   output layer) through the default policy (SGLang's CUDA verify kernel) against plain decoding's,
   the p-values of a homogeneity test of their first 2, 3 and 4 tokens.

The plain server starts first (it compiles FlashInfer's kernels, about 4 minutes on a cold box); the
seven others then start side by side with the kernels cached.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from histospec_sgl.bench.engine_server import EngineServer, running, step_seconds, verify_steps

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
import _overlap  # noqa: E402

D = 8
PEAKED_PROMPT = [3, 7, 11, 5, 9]
CHECKED = {"HISTOSPEC_CHECK_CONTEXT": "1", "HISTOSPEC_LOG_EVERY": "50"}


def chi2_sf(x: float, k: int) -> float:
    """P(X > x) for X ~ chi-square with k degrees of freedom: the regularized upper incomplete gamma
    Q(k/2, x/2) (series below a + 1, continued fraction above; Numerical Recipes' gammq)."""
    a, x = k / 2.0, x / 2.0
    if x <= 0:
        return 1.0
    lg = math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        n = a
        for _ in range(1000):
            n += 1
            term *= x / n
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return max(0.0, 1.0 - total * math.exp(-x + a * math.log(x) - lg))
    b, c, d = x + 1 - a, 1e300, 1.0 / (x + 1 - a)
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return math.exp(-x + a * math.log(x) - lg) * h


def homogeneity(a: list[tuple], b: list[tuple], ks: tuple[int, ...] = (2, 3, 4)) -> list[float]:
    """Chi-square homogeneity p-values of the first k tokens of two sets of continuations (outcomes
    seen fewer than 10 times pooled), as tests/helpers/_engine_checks.same_distribution computes them."""
    out = []
    for k in ks:
        ca, cb = Counter(x[:k] for x in a), Counter(x[:k] for x in b)
        keys = sorted(x for x in set(ca) | set(cb) if ca[x] + cb[x] >= 10)
        rows = [[c[x] for x in keys] + [n - sum(c[x] for x in keys)] for c, n in ((ca, len(a)), (cb, len(b)))]
        cols = [j for j in range(len(rows[0])) if rows[0][j] + rows[1][j] > 0]
        total = sum(rows[0][j] + rows[1][j] for j in cols)
        stat = 0.0
        for r in rows:
            n = sum(r[j] for j in cols)
            for j in cols:
                expect = n * (rows[0][j] + rows[1][j]) / total
                stat += (r[j] - expect) ** 2 / expect
        out.append(chi2_sf(stat, len(cols) - 1) if len(cols) > 1 else 1.0)
    return out


def metric(srv: EngineServer, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in srv.metrics().splitlines() if line.startswith(name + "{"))


def generate(srv: EngineServer, prompts: list[list[int]], concurrency: int, max_new: int = 128,
             **extra: Any) -> tuple[list[dict], float]:
    sp = {"temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": True}
    t0 = time.time()
    with cf.ThreadPoolExecutor(concurrency) as ex:
        outs = list(ex.map(lambda p: srv.generate([p], sp, **extra)[0], prompts))
    return outs, time.time() - t0


def accept_length(outs: list[dict]) -> float:
    return sum(len(o["output_ids"]) - 1 for o in outs) / max(1, sum(verify_steps(o) for o in outs))


def first_differences(plain: EngineServer, name: str, res: dict) -> list[dict]:
    """Where each differing greedy response first differs: the token, plain decoding's top-2 there."""
    out = []
    for r in res["reqs"]:
        got, want = res["got"][r["rid"]]["output_ids"], res["want"][r["rid"]]
        n = min(len(got), len(want))
        at = next((i for i in range(n) if got[i] != want[i]), None)
        if at is None:
            continue
        o = plain.generate([r["prompt"] + want[:at]], {**r["sp"], "max_new_tokens": 1}, return_logprob=True,
                           top_logprobs_num=2)[0]
        top = o["meta_info"]["output_top_logprobs"][0]
        out.append({"server": name, "rid": r["rid"], "at": at, "got": got[at], "want": want[at],
                    "top2": [[t[1], t[0]] for t in top], "margin": top[0][0] - top[1][0]})
    return out


def failed_checks(result: dict[str, Any]) -> list[str]:
    """What ``E2E PASS`` stands for, each check that does not hold named (none: the job passed).
    NGRAM (SGLang's own) is run for comparison and checks nothing."""
    failed = []
    for name, v in result["identity"].items():
        if name == "ngram":
            continue
        if not v["identical"]:
            failed.append(f"identity {name}: outputs differ from plain decoding's ({v['mismatches']})")
        if v.get("context_mismatches"):
            failed.append(f"identity {name}: {v['context_mismatches']:g} context mismatches")
    for name in ("history", "cost"):
        if result["identical_64"][name]:
            failed.append(f"identical_64 {name}: {result['identical_64'][name]} of 128 responses differ")
    if not result["accept_length"]["history"] > 1.0:
        failed.append(f"accept_length history: {result['accept_length']['history']:.3f} tokens a step, not above 1")
    chi = result["chi_square"]
    if not min(chi["p_values"]) > 1e-4:
        failed.append(f"chi_square: p-values {chi['p_values']}, one at or under 1e-4")
    if chi["context_mismatches"]:
        failed.append(f"chi_square: {chi['context_mismatches']:g} context mismatches")
    return failed


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="the tiny model (make_tiny_model.py)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--log-dir", help="the servers' logs (default: --out; a call returns at most 8 files)")
    ap.add_argument("--no-cuda-graph", action="store_true")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: a dry run of this script on the CPU engine, from a checkout (no CUDA graphs)")
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--rounds", type=int, default=40, help="chi-square: batches of 64 samples")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(args.log_dir) if args.log_dir else out
    logs.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    result: dict[str, Any] = {"args": vars(args)}

    def save(phase: str) -> None:
        result.setdefault("phases", {})[phase] = round(time.time() - t_start, 1)
        (out / "e2e.partial.json").write_text(json.dumps(result, indent=1))
        print(f"[e2e] {phase} at {result['phases'][phase]} s", flush=True)

    from histospec_sgl.bench.engine_models import ensure

    if not os.environ.get("HISTOSPEC_MODEL_CACHE"):  # not among the files that come back
        import tempfile

        os.environ["HISTOSPEC_MODEL_CACHE"] = tempfile.mkdtemp(prefix="histospec-models-")
    gpu = args.device == "cuda"
    dtype = "bfloat16" if gpu else "float32"
    peaked = ensure("random", vocab=24, logit_scale=12.0, seed=1, dtype=dtype, log=print)
    graphs = ([] if args.no_cuda_graph else ["--cuda-graph-max-bs-decode", "32"]) + ["--cuda-graph-backend-prefill",
                                                                                      "disabled"]
    eager = ["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]
    if not gpu:
        graphs = eager = []

    def srv(name: str, model: Path | str, method: str, env: dict[str, str] | None = None,
            cuda_graph: bool = True) -> EngineServer:
        # Eight servers start side by side and SGLang charges what the others allocate meanwhile against
        # each one's static fraction, so the fraction is generous and --max-total-tokens sizes the pool.
        extra = [*(["--mem-fraction-static", "0.6", "--max-total-tokens", "131072"] if gpu else []),
                 "--chunked-prefill-size", "64",
                 *(graphs if cuda_graph else eager)]
        if method == "history":
            extra.append("--enable-metrics")
        return EngineServer(model, method, device=args.device, dtype=dtype, draft_tokens=D, max_running=32,
                            env={**(env or {}), **(CHECKED if method == "history" else {})}, extra_args=extra,
                            log_path=logs / f"server-{name}.log", startup_timeout=args.startup_timeout)

    plain = srv("plain", args.model, "plain")
    others = {"ngram": srv("ngram", args.model, "ngram"),
              "history": srv("history", args.model, "history", {"HISTOSPEC_CONTROL": "fixed"}),
              "cost": srv("cost", args.model, "history", {"HISTOSPEC_CONTROL": "cost"}),
              "retract": srv("retract", args.model, "history", {"HISTOSPEC_CONTROL": "cost", "SGLANG_TEST_RETRACT": "1"}),
              "cost_eager": srv("cost_eager", args.model, "history", {"HISTOSPEC_CONTROL": "cost"}, cuda_graph=False),
              "peaked_plain": srv("peaked_plain", peaked, "plain"),
              "peaked_cost": srv("peaked_cost", peaked, "history", {"HISTOSPEC_CONTROL": "cost"})}
    with running(plain):
        save("plain server up (FlashInfer compiled)")
        with running(*others.values()):
            save("all servers up")
            result["overlap"] = {n: s.overlap() for n, s in {"plain": plain, **others}.items()}
            # 1-2. identity under the overlap scheduler, and the margin where an output first differs
            ident, diffs = {}, []
            for name in ("history", "cost", "retract", "ngram"):
                s = others[name]
                passes = [_overlap.run(s, plain), _overlap.run(s, plain)]
                bad = [_overlap.mismatches(p) for p in passes]
                ident[name] = {"identical": not any(bad), "mismatches": bad}
                if s.method == "history":
                    ident[name]["context_mismatches"] = metric(s, "histospec:context_mismatches_total")
                if name == "retract":
                    ident[name]["retracted"] = metric(s, "sglang:num_retracted_requests_total")
                for p in passes:
                    diffs += first_differences(plain, name, p)
            result["identity"], result["first_differences"] = ident, diffs
            save("identity")
            # 3-4. 64 prompts, 128 greedy tokens: identity and accept length on a second pass; tokens/s
            rng = random.Random(0)
            vocab = int(json.loads((Path(args.model) / "config.json").read_text())["vocab_size"])
            prompts = [[rng.randrange(2, min(vocab - 1, 21000)) for _ in range(32)] for _ in range(64)]
            want = [o["output_ids"] for o in generate(plain, prompts, 32)[0]]
            result["accept_length"], result["throughput"], result["identical_64"] = {}, {}, {}
            for name, s in (("plain", plain), *((n, others[n]) for n in ("ngram", "history", "cost"))):
                first = generate(s, prompts, 32)[0]
                second = generate(s, prompts, 32)[0]
                result["identical_64"][name] = sum(a["output_ids"] != w for a, w in zip(first + second, want + want))
                result["accept_length"][name] = accept_length(second)
                result["throughput"][name] = {}
                for bs in (1, 8, 32):
                    outs, secs = generate(s, prompts[: {1: 8, 8: 32, 32: 64}[bs]], bs)
                    result["throughput"][name][str(bs)] = {
                        "tokens_per_s": round(sum(len(o["output_ids"]) for o in outs) / secs, 1),
                        "accept_length": round(accept_length(outs), 3)}
            save("throughput")
            # 5. each width's step cost, graphed (width d) and eager
            generate(others["cost_eager"], prompts, 32)
            for bs in (1, 8, 32):
                generate(others["cost_eager"], prompts[: {1: 8, 8: 32, 32: 64}[bs]], bs)
            result["step_seconds"] = {"cost": step_seconds(others["cost"]),
                                      "cost_eager": step_seconds(others["cost_eager"])}
            save("step costs")
            # 6. chi-square through the CUDA verify kernel
            sp = {"temperature": 1.0, "max_new_tokens": 4, "ignore_eos": True}
            seqs: dict[str, list[tuple]] = {"peaked_plain": [], "peaked_cost": []}
            steps = {k: [0, 0] for k in seqs}
            for name in seqs:
                for _ in range(args.rounds):
                    for o in others[name].generate([PEAKED_PROMPT] * 64,
                                                   {**sp, "custom_params": {"histospec_group": "chi"}}):
                        seqs[name].append(tuple(o["output_ids"]))
                        steps[name][0] += len(o["output_ids"])
                        steps[name][1] += verify_steps(o)
            result["chi_square"] = {"p_values": homogeneity(seqs["peaked_plain"], seqs["peaked_cost"]),
                                    "samples": len(seqs["peaked_cost"]),
                                    "tokens_per_step": {k: v[0] / max(1, v[1]) for k, v in steps.items()},
                                    "context_mismatches": metric(others["peaked_cost"],
                                                                 "histospec:context_mismatches_total")}
            save("chi-square")
    result["failed"] = failed_checks(result)
    ok = result["pass"] = not result["failed"]
    (out / "e2e.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("identity", "identical_64", "accept_length", "throughput", "chi_square",
                                             "first_differences", "failed", "pass")}, indent=1))
    print("E2E PASS" if ok else "E2E FAIL: " + "; ".join(result["failed"]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
