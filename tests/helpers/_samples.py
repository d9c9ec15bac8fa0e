"""Real completions for the draft-source tests: the shipped HumanEval sample (MIT; token ids)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

SAMPLE = Path(__file__).resolve().parents[2] / "histospec_sgl" / "data" / "humaneval_sample.jsonl.gz"


def humaneval(n_tasks: int = 8) -> list[tuple[list[int], list[list[int]]]]:
    out = []
    with gzip.open(SAMPLE, "rt") as f:
        for line in f:
            r = json.loads(line)
            out.append((json.loads(r["prompt_ids"]) if isinstance(r["prompt_ids"], str) else r["prompt_ids"],
                        json.loads(r["samples_ids"]) if isinstance(r["samples_ids"], str) else r["samples_ids"]))
            if len(out) == n_tasks:
                break
    return out
