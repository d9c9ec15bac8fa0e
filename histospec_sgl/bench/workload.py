"""Seeded synthetic RL-shaped rollout workloads (W1, W2) for the index benchmark.

W1: 256 prompts of 256 tokens; 16 epoch-1 responses of 2000 tokens per prompt; tokens over ids
1..31999 with p ∝ 1/(rank+10)^1.1. A base response per prompt is made of 20-80-token segments (70%
fresh, 25% copies of an earlier segment of the same response, 5% copies from the prompt). Each epoch-1
sibling is the base mutated at 6% per token (a third substitutions, a third insertions of 1-5 tokens,
a third deletions of 1-5 tokens) plus fresh 20-100-token block rewrites at 0.3% per token. Epoch-2
response j is epoch-1 response j mutated at 3% per token plus 10-50-token block rewrites at 0.1%.
W2 is the same with 15% and 10% mutation and 64 prompts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

VOCAB = 32000
RESPONSE_LEN = 2000
PROMPT_LEN = 256


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    prompts: int
    siblings: int = 16
    epoch1_rate: float = 0.06
    epoch1_block_rate: float = 0.003
    epoch2_rate: float = 0.03
    epoch2_block_rate: float = 0.001
    seed: int = 0


W1 = WorkloadSpec("W1", prompts=256)
W2 = WorkloadSpec("W2", prompts=64, epoch1_rate=0.15, epoch2_rate=0.10)
SPECS = {"W1": W1, "W2": W2}


@dataclass
class Workload:
    spec: WorkloadSpec
    prompts: list[np.ndarray] = field(default_factory=list)  # [P][PROMPT_LEN] int32
    epoch1: list[list[np.ndarray]] = field(default_factory=list)  # [P][siblings][RESPONSE_LEN] int32
    rng: np.random.Generator | None = None

    def epoch2(self, p: int, j: int) -> np.ndarray:
        """Epoch-2 response j of prompt p (derived on demand, deterministic per (p, j))."""
        g = _Gen(np.random.default_rng([self.spec.seed, 2, p, j]))
        return g.mutate(self.epoch1[p][j], self.spec.epoch2_rate, self.spec.epoch2_block_rate, 10, 50)


class _Gen:
    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        ranks = np.arange(1, VOCAB, dtype=np.float64)
        p = 1.0 / (ranks - 1 + 10) ** 1.1
        self.cdf = np.cumsum(p / p.sum())
        self.cdf[-1] = 1.0

    def fresh(self, n: int) -> np.ndarray:
        return (np.searchsorted(self.cdf, self.rng.random(n)) + 1).astype(np.int32)

    def base(self, prompt: np.ndarray) -> np.ndarray:
        out: list[np.ndarray] = []
        total = 0
        while total < RESPONSE_LEN:
            n = int(self.rng.integers(20, 81))
            u = self.rng.random()
            if u < 0.70 or total < 20:
                seg = self.fresh(n)
            elif u < 0.95:
                cur = np.concatenate(out)
                n = min(n, len(cur))
                s = int(self.rng.integers(0, len(cur) - n + 1))
                seg = cur[s : s + n].copy()
            else:
                n = min(n, len(prompt))
                s = int(self.rng.integers(0, len(prompt) - n + 1))
                seg = prompt[s : s + n].copy()
            out.append(seg)
            total += len(seg)
        return np.concatenate(out)[:RESPONSE_LEN]

    def mutate(self, seq: np.ndarray, rate: float, block_rate: float, blo: int, bhi: int) -> np.ndarray:
        n = len(seq)
        ev = np.nonzero(self.rng.random(n) < rate)[0]
        bl = np.nonzero(self.rng.random(n) < block_rate)[0]
        events = sorted([(int(i), 0) for i in ev] + [(int(i), 1) for i in bl])
        out: list[np.ndarray] = []
        i = 0
        for pos, kind in events:
            if pos < i:
                continue
            out.append(seq[i:pos])
            if kind == 1:
                k = int(self.rng.integers(blo, bhi + 1))
                out.append(self.fresh(k))
                i = pos + k
                continue
            op = int(self.rng.integers(0, 3))
            if op == 0:  # substitution
                out.append(self.fresh(1))
                i = pos + 1
            elif op == 1:  # insertion of 1-5 tokens before seq[pos]
                out.append(self.fresh(int(self.rng.integers(1, 6))))
                i = pos
            else:  # deletion of 1-5 tokens
                i = pos + int(self.rng.integers(1, 6))
        out.append(seq[i:])
        res = np.concatenate(out)
        if len(res) < RESPONSE_LEN:
            res = np.concatenate([res, self.fresh(RESPONSE_LEN - len(res))])
        return res[:RESPONSE_LEN].astype(np.int32)


def generate(spec: WorkloadSpec, prompts: int | None = None) -> Workload:
    """Builds the prompts and epoch-1 responses of ``spec`` (optionally only the first prompts)."""
    nprompts = spec.prompts if prompts is None else min(prompts, spec.prompts)
    w = Workload(spec)
    for p in range(nprompts):
        g = _Gen(np.random.default_rng([spec.seed, 1, p]))
        prompt = g.fresh(PROMPT_LEN)
        base = g.base(prompt)
        sibs = [
            g.mutate(base, spec.epoch1_rate, spec.epoch1_block_rate, 20, 100) for _ in range(spec.siblings)
        ]
        w.prompts.append(prompt)
        w.epoch1.append(sibs)
    return w
