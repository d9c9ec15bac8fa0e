"""The SPEC-RL acceptance rule (Liu et al., "SPEC-RL: Accelerating On-Policy Reinforcement Learning
via Speculative Rollouts"), vectorized over a batch of previous responses.

Token i of a previous response is accepted with probability ``min(1, lenience * p_new(i) / p_old(i))``
in order, and the response is cut at the first rejection. ``lenience`` (ℓ = e^b) is 1 for the plain
speculative-decoding test; larger values reuse more and bias the samples toward the old policy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from histospec_sgl.errors import HistospecError


class SpecRLError(HistospecError, ValueError):
    """Invalid input to the SPEC-RL rule (lenience below 1, NaN log-probs, mismatched lengths)."""


def check_lenience(lenience: float) -> float:
    lenience = float(lenience)
    if math.isnan(lenience) or lenience < 1.0:
        raise SpecRLError(f"lenience must be >= 1 (1 = exact speculative test), got {lenience}")
    return lenience


def _flat(seqs: Sequence[np.ndarray] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    arrs = [np.asarray(s, dtype=np.float64).reshape(-1) for s in seqs]
    lens = np.array([a.size for a in arrs], dtype=np.int64)
    flat = np.concatenate(arrs) if arrs else np.zeros(0)
    return flat, lens


def acceptance_probs(logp_new: np.ndarray, logp_old: np.ndarray, lenience: float) -> np.ndarray:
    """Per-token ``min(1, ℓ·p_new/p_old)``, with the edge cases of :func:`cut_points`."""
    lenience = check_lenience(lenience)
    logp_new = np.asarray(logp_new, dtype=np.float64)
    logp_old = np.asarray(logp_old, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        log_ratio = logp_new - logp_old  # -inf - -inf = nan, handled below
        acc = np.exp(np.minimum(0.0, math.log(lenience) + log_ratio)) if math.isfinite(lenience) else np.ones_like(log_ratio)
    impossible_new = np.isneginf(logp_new)
    acc = np.where(impossible_new, 0.0, acc)
    acc = np.where(np.isneginf(logp_old) & ~impossible_new, 1.0, acc)
    return acc


def cut_points(
    logp_new: Sequence[np.ndarray],
    logp_old: Sequence[np.ndarray],
    lenience: float,
    rng: np.random.Generator,
) -> np.ndarray:
    """First rejected position of each sequence (its length if every token is accepted).

    ``logp_new[i][j]``/``logp_old[i][j]``: log-probability of token j of previous response i under
    the current and the previous policy. One uniform draw per token from ``rng`` (the caller's
    generator; there is no global seed). Edge cases: an empty response cuts at 0; a token the new
    policy cannot produce (log-prob -inf) is always rejected, even with infinite lenience; a token
    the old policy gave probability 0 but the new one does not is accepted; NaN or +inf log-probs,
    or mismatched lengths, raise :class:`SpecRLError` naming the sequence.
    """
    if not isinstance(rng, np.random.Generator):
        raise TypeError("rng must be a numpy.random.Generator (e.g. numpy.random.default_rng(seed))")
    lenience = check_lenience(lenience)
    if len(logp_new) != len(logp_old):
        raise SpecRLError(f"{len(logp_new)} new log-prob arrays but {len(logp_old)} old ones")
    new, lens = _flat(logp_new)
    old, lens_old = _flat(logp_old)
    bad = np.nonzero(lens != lens_old)[0]
    if bad.size:
        i = int(bad[0])
        raise SpecRLError(f"sequence {i}: {lens[i]} new log-probs but {lens_old[i]} old ones")
    ends = np.cumsum(lens)
    starts = ends - lens
    for name, arr in (("logp_new", new), ("logp_old", old)):
        broken = np.isnan(arr) | (arr == np.inf) | (arr > 1e-6)
        if broken.any():
            pos = int(np.nonzero(broken)[0][0])
            seq = int(np.searchsorted(ends, pos, side="right"))
            raise SpecRLError(f"sequence {seq}, token {pos - int(starts[seq])}: {name} is {arr[pos]} (log-probs must be <= 0, not NaN)")
    acc = acceptance_probs(new, old, lenience)
    u = rng.random(acc.size)
    rejected = u >= acc
    out = lens.copy()
    idx = np.nonzero(rejected)[0]
    if idx.size:
        seq_of = np.searchsorted(ends, idx, side="right")
        # First rejection per sequence: idx is sorted, so the first occurrence of each seq.
        first = np.unique(seq_of, return_index=True)
        out[first[0]] = idx[first[1]] - starts[first[0]]
    return out


@dataclass(frozen=True)
class Plan:
    """What to do with one previous response after the cut."""

    cut: int  # tokens of the previous response reused
    done: bool  # the reused prefix is the whole response: nothing to generate
    finish_reason: str | None  # "stop"/"length" when done
    max_new_tokens: int  # budget left for the continuation


def plan(cut: int, old_len: int, old_finish: str | None, max_new_tokens: int) -> Plan:
    """Decides whether a cut response needs decoding. A fully accepted response that ended with
    EOS (``old_finish == "stop"``) or at the length cap is returned as is; otherwise the engine
    continues from prompt + prefix with the budget reduced by the prefix length."""
    if not 0 <= cut <= old_len:
        raise SpecRLError(f"cut {cut} outside [0, {old_len}]")
    cut = min(cut, max_new_tokens)
    if cut == old_len and old_len > 0 and old_finish == "stop":
        return Plan(cut, True, "stop", 0)
    if cut >= max_new_tokens:
        return Plan(cut, True, "length", 0)
    return Plan(cut, False, None, max_new_tokens - cut)
