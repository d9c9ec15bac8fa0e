"""Times two builds of the extension in one process, step by step, on W1 (256 requests).

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/paired_builds.py --base /tmp/old/_core.abi3.so \
        [--steps 120] [--json out.json]

"new" is the installed ``histospec_sgl._core``; "base" is another build's ``_core.abi3.so``
(copy it aside before rebuilding), loaded as a second module. Each build holds W1's history
with its own 256 requests; every step both draft a d=16 tree, then a k=16 chain, then both
append the same accepted tokens, the order of the two builds alternating from step to step. So
both see the same VM phase, which single-process runs minutes apart do not (this VM drifts by
20-30%). The two builds' tree tokens, masks and chains must be equal at every step: a change meant
to keep the drafts fails here if it does not. Two 1 GB indexes share the TLB and caches, so absolute
times are higher than ``bench index``'s; compare the ratios.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time

import numpy as np

import histospec_sgl._core as new_core
from histospec_sgl.bench.workload import SPECS, generate

N, D, K, WARM = 256, 16, 16, 500


def _load(path: str):
    spec = importlib.util.spec_from_file_location("hsbase._core", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the other build's _core.abi3.so")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--json", help="write the medians and ratios here")
    args = ap.parse_args()
    cores = {"base": _load(args.base), "new": new_core}
    w = generate(SPECS["W1"])
    truths = [w.epoch2(p, 0) for p in range(N)]
    rids = np.arange(10_000_000, 10_000_000 + N, dtype=np.int64)
    ixs = {}
    for name, core in cores.items():
        ix = core.HistoryIndex()
        for p, prompt in enumerate(w.prompts):
            for resp in w.epoch1[p]:
                ix.add_response(p, prompt, resp, 1)
        for i in range(N):
            ix.begin_request(int(rids[i]), i, w.prompts[i])
            ix.extend_request(int(rids[i]), truths[i][:WARM])
        ixs[name] = ix
    bufs = {k: (np.zeros(N * D, np.int64), np.zeros(N * D * D, np.int64), np.zeros(N * K, np.int64), np.zeros(N, np.int64)) for k in ixs}
    times: dict[str, dict[str, list[float]]] = {k: {"tree": [], "chain": [], "update": []} for k in ixs}
    pos = np.full(N, WARM, dtype=np.int64)
    for step in range(args.steps):
        order = ["base", "new"] if step % 2 == 0 else ["new", "base"]
        for what in ("tree", "chain"):
            for k in order:
                tok, mask, ctok, clen = bufs[k]
                t0 = time.perf_counter()
                if what == "tree":
                    ixs[k].draft_batch(rids, D, tok, mask)
                else:
                    ixs[k].draft_chain_batch(rids, K, ctok, clen)
                times[k][what].append(time.perf_counter() - t0)
        for i in range(3):
            if not np.array_equal(bufs["base"][i], bufs["new"][i]):
                raise SystemExit(f"step {step}: the builds drafted differently (buffer {i})")
        chains = bufs["new"][2].reshape(N, K)
        adv = []
        for i in range(N):
            want = truths[i][pos[i] : pos[i] + K]
            acc = int(np.cumprod(chains[i, : len(want)] == want).sum()) if len(want) else 0
            adv.append(min(acc + 1, max(len(truths[i]) - pos[i], 0)))
        lens = np.asarray(adv, dtype=np.int64)
        flat = np.concatenate([truths[i][pos[i] : pos[i] + lens[i]] for i in range(N)]).astype(np.int32)
        for k in order:
            t0 = time.perf_counter()
            ixs[k].extend_batch(rids, flat, lens)
            times[k]["update"].append(time.perf_counter() - t0)
        pos += lens
    out = {}
    for what in ("tree", "chain", "update"):
        b, n = np.array(times["base"][what]), np.array(times["new"][what])
        out[what] = {
            "base_ms": float(np.median(b) * 1e3),
            "new_ms": float(np.median(n) * 1e3),
            "ratio_of_medians": float(np.median(n) / np.median(b)),
            "median_paired_ratio": float(np.median(n / b)),
        }
        r = out[what]
        print(f"{what:6s} base {r['base_ms']:.3f} ms  new {r['new_ms']:.3f} ms  "
              f"ratio of medians {r['ratio_of_medians']:.3f}  median paired ratio {r['median_paired_ratio']:.3f}")
    print(f"drafts identical over {args.steps} steps")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "base": args.base, **out}, f, indent=1)


if __name__ == "__main__":
    main()
