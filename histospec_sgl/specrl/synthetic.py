"""A pair of small synthetic policies with explicit next-token distributions.

Every prefix of length < T over a vocabulary of V tokens has a new-policy distribution p(.|h) and
an old-policy distribution q(.|h) whose logits differ by ``divergence`` times Gaussian noise, so the
exact distribution of SPEC-RL's output can be computed by enumeration and compared with the new
policy, and sampled to test the implementation.

Resampling at the cut:
- ``fresh`` (the paper's, and the only one SGLang's API allows): the token at the first rejection is
  drawn from p(.|h) like any other generated token. Not exact even at lenience 1: tokens the old
  policy over-weights are counted twice.
- ``residual`` (speculative sampling's): drawn from max(0, p - min(q, ℓp)) renormalized, which at
  ℓ = 1 is max(0, p - q) and makes the output an exact sample of p.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from histospec_sgl.specrl.acceptance import check_lenience, cut_points

RESAMPLE = ("fresh", "residual")


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@dataclass
class PolicyPair:
    vocab: int
    length: int
    p: np.ndarray  # [num_prefixes, vocab], new policy
    q: np.ndarray  # [num_prefixes, vocab], old policy
    offsets: np.ndarray  # offsets[t]: id of the first prefix of length t

    @classmethod
    def make(cls, vocab: int = 4, length: int = 4, divergence: float = 0.5, seed: int = 0, temp: float = 1.5) -> PolicyPair:
        rng = np.random.default_rng(seed)
        counts = [vocab**t for t in range(length)]
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        n = int(offsets[-1])
        logits = rng.normal(0.0, temp, size=(n, vocab))
        old = logits + divergence * rng.normal(0.0, 1.0, size=(n, vocab))
        return cls(vocab, length, _softmax(logits), _softmax(old), offsets)

    def prefix_id(self, seqs: np.ndarray, t: int) -> np.ndarray:
        """Ids of the length-t prefixes of ``seqs`` ([N, >= t] int array)."""
        v = np.zeros(seqs.shape[0], dtype=np.int64)
        for j in range(t):
            v = v * self.vocab + seqs[:, j]
        return self.offsets[t] + v

    def all_sequences(self) -> np.ndarray:
        grid = np.indices((self.vocab,) * self.length).reshape(self.length, -1).T
        return grid.astype(np.int64)

    def seq_probs(self, table: np.ndarray) -> np.ndarray:
        """Probability of every full sequence (``all_sequences`` order) under ``table``."""
        z = self.all_sequences()
        out = np.ones(z.shape[0])
        for t in range(self.length):
            out *= table[self.prefix_id(z, t), z[:, t]]
        return out

    def residual(self, lenience: float) -> np.ndarray:
        r = np.maximum(0.0, self.p - np.minimum(self.q, lenience * self.p))
        s = r.sum(axis=1, keepdims=True)
        return np.where(s > 1e-15, r / np.where(s > 1e-15, s, 1.0), self.p)

    def exact_output(self, lenience: float, resample: str) -> tuple[np.ndarray, np.ndarray]:
        """(probability of each output sequence, probability of each cut position 0..T)."""
        lenience = check_lenience(lenience)
        if resample not in RESAMPLE:
            raise ValueError(f"resample must be one of {RESAMPLE}")
        kept = np.minimum(self.q, lenience * self.p) if np.isfinite(lenience) else self.q.copy()
        reject = np.clip(1.0 - kept.sum(axis=1), 0.0, 1.0)  # per prefix
        r = self.p if resample == "fresh" else self.residual(lenience)
        z = self.all_sequences()
        T = self.length
        ids = [self.prefix_id(z, t) for t in range(T)]
        # A[t]: probability that the old response equals z[:t] and its first t tokens were kept.
        A = np.ones((T + 1, z.shape[0]))
        for t in range(T):
            A[t + 1] = A[t] * kept[ids[t], z[:, t]]
        # tail[t]: probability under p of z[t+1:] given z[:t+1].
        tail = np.ones((T + 1, z.shape[0]))
        for t in range(T - 1, -1, -1):
            tail[t] = tail[t + 1] * (self.p[ids[t + 1], z[:, t + 1]] if t + 1 < T else 1.0)
        out = A[T].copy()
        cut = np.zeros(T + 1)
        cut[T] = A[T].sum()
        for n in range(T):
            mass = A[n] * reject[ids[n]]
            out += mass * r[ids[n], z[:, n]] * tail[n]
            # Every z with the same prefix z[:n] carries the same mass: count it once per prefix.
            cut[n] = mass.reshape(self.vocab**n, -1)[:, 0].sum()
        return out, cut

    def sample(
        self, n: int, lenience: float, resample: str, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray]:
        """``n`` SPEC-RL outputs through :func:`cut_points`: (sequences [n, T], cuts [n])."""
        if resample not in RESAMPLE:
            raise ValueError(f"resample must be one of {RESAMPLE}")
        T = self.length

        def draw(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
            c = np.cumsum(table[ids], axis=1)
            u = rng.random((ids.size, 1)) * c[:, -1:]
            return np.minimum((u > c).sum(axis=1), self.vocab - 1)

        old = np.zeros((n, T), dtype=np.int64)
        lp_new = np.zeros((n, T))
        lp_old = np.zeros((n, T))
        for t in range(T):
            ids = self.prefix_id(old, t)
            old[:, t] = draw(self.q, ids)
            lp_new[:, t] = np.log(self.p[ids, old[:, t]])
            lp_old[:, t] = np.log(self.q[ids, old[:, t]])
        cuts = cut_points(list(lp_new), list(lp_old), lenience, rng)
        out = old.copy()
        r = self.p if resample == "fresh" else self.residual(check_lenience(lenience))
        for t in range(T):
            ids = self.prefix_id(out, t)
            at_cut = cuts == t
            after = cuts < t
            if at_cut.any():
                out[at_cut, t] = draw(r, ids[at_cut])
            if after.any():
                out[after, t] = draw(self.p, ids[after])
        return out, cuts

    def index_of(self, seqs: np.ndarray) -> np.ndarray:
        """Position of each sequence in ``all_sequences`` order."""
        v = np.zeros(seqs.shape[0], dtype=np.int64)
        for j in range(self.length):
            v = v * self.vocab + seqs[:, j]
        return v


def total_variation(a: np.ndarray, b: np.ndarray) -> float:
    return float(0.5 * np.abs(a - b).sum())
