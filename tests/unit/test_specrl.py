"""SPEC-RL acceptance rule: edge cases, exactness (chi-square against direct sampling), trade-off."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from scipy.stats import chisquare

from histospec_sgl.specrl import SpecRLError, acceptance_probs, cut_points, plan
from histospec_sgl.specrl.synthetic import PolicyPair, total_variation


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_edge_cases():
    ninf = -np.inf
    new = [np.array([]), np.array([ninf, -0.1]), np.array([-1.0, -2.0]), np.array([-0.5])]
    old = [np.array([]), np.array([-0.1, -0.1]), np.array([ninf, ninf]), np.array([-0.5])]
    cuts = cut_points(new, old, 1.0, rng())
    # empty -> 0; impossible under the new policy -> rejected at once; impossible under the old one
    # but possible under the new -> accepted; p_new == p_old -> always accepted.
    assert cuts.tolist() == [0, 0, 2, 1]
    # Even infinite lenience never reuses a token the new policy cannot produce.
    assert cut_points(new, old, math.inf, rng()).tolist() == [0, 0, 2, 1]
    with pytest.raises(SpecRLError, match="lenience must be >= 1"):
        cut_points(new, old, 0.9, rng())
    with pytest.raises(SpecRLError, match="lenience must be >= 1"):
        cut_points(new, old, float("nan"), rng())
    with pytest.raises(SpecRLError, match=r"sequence 1, token 1: logp_old is nan"):
        cut_points([np.array([-1.0]), np.array([-1.0, -1.0])], [np.array([-1.0]), np.array([-1.0, np.nan])], 1.0, rng())
    with pytest.raises(SpecRLError, match=r"sequence 0, token 0: logp_new is 0.5"):
        cut_points([np.array([0.5])], [np.array([-1.0])], 1.0, rng())
    with pytest.raises(SpecRLError, match="sequence 1: 1 new log-probs but 2 old ones"):
        cut_points([np.array([-1.0]), np.array([-1.0])], [np.array([-1.0]), np.array([-1.0, -1.0])], 1.0, rng())
    with pytest.raises(TypeError, match="numpy.random.Generator"):
        cut_points(new, old, 1.0, 0)  # type: ignore[arg-type]


def test_acceptance_frequency_and_first_rejection():
    # One token with p_new/p_old = 0.3: accepted 30% of the time at l=1, 60% at l=2, always at l=4.
    lp_new, lp_old = math.log(0.15), math.log(0.5)
    n = 200_000
    for ell, want in ((1.0, 0.3), (2.0, 0.6), (4.0, 1.0)):
        c = cut_points([np.array([lp_new])] * n, [np.array([lp_old])] * n, ell, rng(1))
        assert abs(c.mean() - want) < 0.005
    assert np.allclose(acceptance_probs(np.array([lp_new]), np.array([lp_old]), 2.0), [0.6])
    # Cut at the FIRST rejection: [certain, impossible, certain] always cuts at 1.
    c = cut_points([np.array([-1.0, -np.inf, -1.0])] * 100, [np.array([-1.0, -1.0, -1.0])] * 100, 1.0, rng())
    assert (c == 1).all()
    # The caller's generator decides: same seed, same cuts; another seed, other cuts.
    a = cut_points([np.full(20, -1.0)] * 50, [np.full(20, -0.5)] * 50, 1.0, rng(7))
    b = cut_points([np.full(20, -1.0)] * 50, [np.full(20, -0.5)] * 50, 1.0, rng(7))
    d = cut_points([np.full(20, -1.0)] * 50, [np.full(20, -0.5)] * 50, 1.0, rng(8))
    assert (a == b).all() and not (a == d).all()


def test_plan():
    p = plan(5, 5, "stop", 100)
    assert p.done and p.finish_reason == "stop" and p.max_new_tokens == 0
    p = plan(100, 100, "length", 100)
    assert p.done and p.finish_reason == "length"
    p = plan(3, 5, "stop", 100)
    assert not p.done and p.max_new_tokens == 97 and p.cut == 3
    p = plan(0, 0, None, 10)
    assert not p.done and p.max_new_tokens == 10
    with pytest.raises(SpecRLError):
        plan(6, 5, "stop", 10)


def _sample_counts(pp: PolicyPair, ell: float, resample: str, n: int, seed: int) -> np.ndarray:
    seqs, _ = pp.sample(n, ell, resample, rng(seed))
    return np.bincount(pp.index_of(seqs), minlength=pp.vocab**pp.length)


def test_residual_resampling_is_exact_at_lenience_one():
    pp = PolicyPair.make(vocab=3, length=4, divergence=0.8, seed=3)
    target = pp.seq_probs(pp.p)
    n = 300_000
    counts = _sample_counts(pp, 1.0, "residual", n, seed=11)
    stat, pval = chisquare(counts, target * n)
    assert pval > 1e-3, (stat, pval)
    # The exact output distribution equals the new policy's.
    assert total_variation(pp.exact_output(1.0, "residual")[0], target) < 1e-12


def test_fresh_resampling_is_measurably_off_and_matches_its_exact_distribution():
    pp = PolicyPair.make(vocab=3, length=4, divergence=0.8, seed=3)
    target = pp.seq_probs(pp.p)
    n = 300_000
    counts = _sample_counts(pp, 1.0, "fresh", n, seed=12)
    _, pval = chisquare(counts, target * n)
    assert pval < 1e-9  # the paper's resampling is not an exact sample of p
    exact_fresh, _ = pp.exact_output(1.0, "fresh")
    _, pval_model = chisquare(counts, exact_fresh * n)
    assert pval_model > 1e-3  # ... and the implementation matches the computed distribution
    assert total_variation(exact_fresh, target) > 0.05


def test_reuse_rises_with_lenience_and_counters_add_up():
    pp = PolicyPair.make(vocab=4, length=5, divergence=0.6, seed=2)
    reuse = []
    for ell in (1.0, 1.16, 1.35, 1.65, 2.72, math.inf):
        _, cut = pp.exact_output(ell, "fresh")
        assert abs(cut.sum() - 1.0) < 1e-9
        reuse.append(float((cut * np.arange(pp.length + 1)).sum()))
        seqs, cuts = pp.sample(20_000, ell, "fresh", rng(5))
        generated = pp.length - cuts
        assert ((cuts >= 0) & (generated >= 0) & (cuts + generated == pp.length)).all()
        assert abs(cuts.mean() - reuse[-1]) < 0.05
    assert all(a < b for a, b in zip(reuse, reuse[1:-1])) and reuse[-1] == pytest.approx(pp.length)


def test_bench_specrl_cli(tmp_path):
    out = tmp_path / "s.json"
    png = tmp_path / "s.png"
    res = subprocess.run(
        [sys.executable, "-m", "histospec_sgl.cli", "bench", "specrl", "--samples", "2000", "--json", str(out),
         "--plot", str(png)],
        capture_output=True, text=True, timeout=300,
    )
    assert res.returncode == 0, res.stderr
    r = json.loads(out.read_text())
    n = len(r["lenience"])
    assert r["lenience"][0] == 1.0
    for k in ("reuse_fraction", "divergence_fresh", "divergence_residual"):
        assert len(r[k]) == n
    assert r["divergence_residual"][0] < 1e-9 < r["divergence_fresh"][0]
    assert png.stat().st_size > 1000
    bad = subprocess.run([sys.executable, "-m", "histospec_sgl.cli", "bench", "specrl", "--lenience", "0.5"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "lenience must be >= 1" in bad.stderr


def test_one_rule_records_a_finished_sample_for_the_next_epoch():
    """specrl.flow.record, what every trainer adapter records through: a finished response of at
    least one token, its log-probs kept only when there is one per token; a slot keeps its newest."""
    from histospec_sgl.specrl import flow
    from histospec_sgl.specrl.store import shared

    group = 0x5EC0_0001
    prompt = [1, 2, 3]
    assert not flow.record(None, flow.Finished.of(prompt, [], [], "stop", group=group, slot=0, version=1))
    assert not flow.record(None, flow.Finished.of(prompt, [7, 8], [-0.1, -0.2], "abort", group=group, slot=0, version=1))
    assert shared().get(None, group, 0) is None
    # Log-probs that do not match the tokens: recorded (history), but no previous response here.
    assert flow.record(None, flow.Finished.of(prompt, [7, 8], [-0.1], "stop", group=group, slot=0, version=1))
    assert shared().get(None, group, 0) is None
    assert flow.record(None, flow.Finished.of(prompt, [7, 8, 9], [-0.1, -0.2, -0.3], "length", group=group, slot=0, version=2))
    prev = shared().get(None, group, 0)
    assert prev is not None and prev.response_ids == [7, 8, 9] and prev.finish_reason == "length"
    assert prev.version == 2 and prev.logprobs == [-0.1, -0.2, -0.3]
    # An older version never replaces a newer one; a newer one does.
    flow.record(None, flow.Finished.of(prompt, [4], [-0.5], "stop", group=group, slot=0, version=1))
    assert shared().get(None, group, 0).response_ids == [7, 8, 9]
    flow.record(None, flow.Finished.of(prompt, [5, 6], [-0.5, -0.6], "stop", group=group, slot=0, version=3))
    assert shared().get(None, group, 0).response_ids == [5, 6]
