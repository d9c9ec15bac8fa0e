"""Builds histospec_sgl/data/humaneval_sample.jsonl.gz, the replay sample the quickstart runs.

Source: microsoft/CodeT (MIT), HumanEval completions by CodeGen-16B (T=0.8, top_p=0.95, 100 per
prompt), as stored in ../shared/data/rollouts/codet-humaneval-codegen16b. The first N HumanEval
tasks (by task number) are kept with all 100 completions, pre-tokenized with the Qwen3 tokenizer so
the quickstart needs no tokenizer file. See histospec_sgl/data/NOTICE.md.

    .venv/bin/python scripts/make_humaneval_sample.py [--tasks 24]
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT.parent / "shared" / "data" / "rollouts" / "codet-humaneval-codegen16b"
TOK = ROOT.parent / "shared" / "data" / "tokenizers" / "qwen3" / "tokenizer.json"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=24)
    args = ap.parse_args()
    task_of = {}
    for line in (SRC / "HumanEval_for_code_generation.jsonl").open():
        d = json.loads(line)
        task_of[d["prompt"]] = d["task_id"]
    rows = []
    for line in (SRC / "HumanEval_codegen16B_temp0.8_topp0.95_num100_max300_code_solution.jsonl").open():
        d = json.loads(line)
        rows.append((int(task_of[d["prompt"]].split("/")[1]), task_of[d["prompt"]], d))
    rows.sort(key=lambda r: r[0])
    tok = Tokenizer.from_file(str(TOK))
    out = ROOT / "histospec_sgl" / "data" / "humaneval_sample.jsonl.gz"
    with gzip.open(out, "wt", encoding="utf-8", compresslevel=9) as f:
        for _, task, d in rows[: args.tasks]:
            rec = {
                "task_id": task,
                "prompt": d["prompt"],
                "prompt_ids": tok.encode(d["prompt"], add_special_tokens=False).ids,
                "samples_ids": [e.ids for e in tok.encode_batch(d["samples"], add_special_tokens=False)],
            }
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")
    print(f"wrote {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
