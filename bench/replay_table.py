"""Markdown table from the JSON files of bench/replay_suite.sh (tokens per verify step, d=16)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

# Best peer on these files in ../shared/reference/anchors-real.md (SGLang trie BFS, per-prompt history).
REFERENCE = {
    "grpo-cross-sample": 3.62,
    "grpo-cross-epoch": 3.50,
    "grpo-cross-policy": 3.05,
    "ei-cross-policy": 3.16,
    "humaneval-cross-sample": 2.67,
    "grpo-cold": 2.04,
    "ei-cold": 1.84,
    "humaneval-cold": 1.42,
}
PEERS = ("ngram", "sglang_trie_per_prompt", "sglang_trie_global", "arctic_per_prompt", "arctic_global")
# Oracle ceilings (replay --bounds): the longest prefix of the logged continuation that occurs in the
# visible text, anywhere or right after the last token.
BOUNDS = ("bound_copy_after_1", "bound_copy_any")


def main(out: Path) -> None:
    cols = ["scenario", "responses", "ours", *PEERS, "ours / best peer", "target (1.2x ref)", "speedup @1.25",
            *BOUNDS]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for name in REFERENCE | {"grpo-cross-sample-inflight": None}:
        f = out / f"{name}.json"
        if not f.exists():
            continue
        r = json.loads(f.read_text())
        ours = r["ours"]["tokens_per_verify_step"]
        cells = [name, str(r["config"]["replayed_responses"]), f"**{ours:.2f}**"]
        for p in PEERS:
            v = r["peers"].get(p, {})
            cells.append(f"{v['tokens_per_verify_step']:.2f}" if v.get("status") == "ok" else "n/a")
        ratio = r["ours_vs_best_peer"]
        cells.append(f"{ratio:.2f}x ({r['best_peer']})" if ratio else "")
        ref = REFERENCE.get(name)
        cells.append(f"{1.2 * ref:.2f} {'met' if ours >= 1.2 * ref else 'missed'}" if ref else "")
        cells.append(f"{r['ours']['projected_speedup']['1.25']:.2f}x")
        for b in BOUNDS:
            v = r.get("bounds", {}).get(b)
            cells.append(f"{v['tokens_per_verify_step']:.2f}" if v else "")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "bench/out/replay"))
