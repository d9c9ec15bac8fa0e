"""``histospec-sgl bench specrl``: the reuse / fidelity trade-off of SPEC-RL's lenience.

On a synthetic policy pair with a controlled divergence, for each lenience ℓ: the expected share of
tokens reused from the old response (exact, by enumeration, and sampled through ``cut_points``),
the share generated, the share verified (every old token is scored once), and the total-variation
distance between the assembled samples and the new policy, for fresh and residual resampling.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from histospec_sgl.specrl.synthetic import PolicyPair, total_variation

DEFAULT_LENIENCE = (1.0, math.exp(0.15), math.exp(0.3), math.exp(0.5), math.exp(1.0), math.exp(2.0), math.inf)


def run(
    lenience: Sequence[float] = DEFAULT_LENIENCE,
    vocab: int = 4,
    length: int = 6,
    divergence: float = 0.5,
    seed: int = 0,
    samples: int = 100_000,
) -> dict[str, Any]:
    pp = PolicyPair.make(vocab=vocab, length=length, divergence=divergence, seed=seed)
    target = pp.seq_probs(pp.p)
    rng = np.random.default_rng(seed)
    out: dict[str, Any] = {
        "config": {"vocab": vocab, "length": length, "divergence": divergence, "seed": seed, "samples": samples,
                   "divergence_metric": "total variation distance to the new policy's sequence distribution"},
        "lenience": [], "log_lenience_b": [], "reuse_fraction": [], "reuse_fraction_sampled": [],
        "generated_fraction": [], "verified_fraction": [], "divergence_fresh": [], "divergence_residual": [],
        "divergence_old_policy": total_variation(pp.seq_probs(pp.q), target),
    }
    for ell in lenience:
        fresh, cut = pp.exact_output(ell, "fresh")
        resid, _ = pp.exact_output(ell, "residual")
        reuse = float((cut * np.arange(length + 1)).sum() / length)
        _, cuts = pp.sample(samples, ell, "fresh", rng)
        out["lenience"].append(ell if math.isfinite(ell) else "inf")
        out["log_lenience_b"].append(math.log(ell) if math.isfinite(ell) else "inf")
        out["reuse_fraction"].append(reuse)
        out["reuse_fraction_sampled"].append(float(cuts.mean() / length))
        out["generated_fraction"].append(1.0 - reuse)
        out["verified_fraction"].append(1.0)
        out["divergence_fresh"].append(total_variation(fresh, target))
        out["divergence_residual"].append(total_variation(resid, target))
    return out


def print_table(r: dict[str, Any]) -> None:
    from rich.table import Table

    from histospec_sgl.console import console

    c = r["config"]
    t = Table(title=f"SPEC-RL lenience trade-off (synthetic pair: V={c['vocab']}, T={c['length']}, divergence {c['divergence']})")
    for col in ("ℓ", "b = ln ℓ", "reused", "reused (sampled)", "generated", "TV fresh", "TV residual"):
        t.add_column(col, justify="right")
    for i, ell in enumerate(r["lenience"]):
        b = r["log_lenience_b"][i]
        t.add_row(
            ell if isinstance(ell, str) else f"{ell:.3f}",
            b if isinstance(b, str) else f"{b:.2f}",
            f"{r['reuse_fraction'][i]:.1%}",
            f"{r['reuse_fraction_sampled'][i]:.1%}",
            f"{r['generated_fraction'][i]:.1%}",
            f"{r['divergence_fresh'][i]:.3f}",
            f"{r['divergence_residual'][i]:.3f}",
        )
    console().print(t)
    console().print(f"TV between the old and new policies themselves: {r['divergence_old_policy']:.3f}. "
                    "Every old token is verified once (one scoring pass).")


def plot(r: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [math.log(x) if not isinstance(x, str) else math.log(50.0) for x in r["lenience"]]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(xs, r["reuse_fraction"], marker="o", label="reused fraction")
    ax.plot(xs, r["divergence_fresh"], marker="s", label="TV to new policy (fresh resample)")
    ax.plot(xs, r["divergence_residual"], marker="^", label="TV to new policy (residual resample)")
    ax.set_xlabel("b = ln ℓ (rightmost point: ℓ = ∞)")
    ax.set_title("SPEC-RL: reuse vs fidelity")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
