"""Rollout control: the length predictor, the cost model and the step simulator on hand-made
inputs with hand-computed answers, and ``histospec-sgl simulate`` / ``bench lengths`` on the logs."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from histospec_sgl.bench.length_bench import Response, evaluate, spearman
from histospec_sgl.engine.costmodel import CostModel, EngineControl
from histospec_sgl.engine.policy import Fixed
from histospec_sgl.length import LengthPredictor, expected_longest
from histospec_sgl.replay.data import Rollout
from histospec_sgl.replay.scenarios import StepSpec
from histospec_sgl.simulate.prefill import PrefixCache, prefill_passes
from histospec_sgl.simulate.profile import H100_8B, Measured, resolve
from histospec_sgl.simulate.step import (
    GROUP_ORACLE,
    ORACLE,
    SimRequest,
    aggregate,
    build_step,
    draft_traces,
    engine_of,
    group_traces,
    run_policies,
    run_step,
)

#: A plain step costs 1 s at any batch size; a verify step at width 4 costs 2 s.
FLAT = Measured("flat", "test: 1 s plain, 2 s at width 4, 1 s a prefill pass", {1: [(1, 1.0), (64, 1.0)], 4: [(1, 2.0), (64, 2.0)]},
                prefill_s_fixed=1.0)


def _req(length: int, accepted4: list[int] | None = None, promised4: list[float] | None = None,
         predicted: float = 0.0, group: str = "g", history: tuple[int, ...] = ()) -> SimRequest:
    acc = np.array(accepted4 or [0] * length, np.int32)
    prom = np.array(promised4 or [0.0] * length, np.float32)
    return SimRequest(group, length, prompt_len=3, predicted=predicted, history=history, accepted={4: acc},
                      promised={4: prom})


# -- length ----------------------------------------------------------------------------------------


def test_predictor_conditions_on_progress_and_falls_back_without_history():
    p = LengthPredictor()
    for n in (10, 20, 60):
        p.record("a", n)
    assert p.predict("a") == pytest.approx(30.0)  # (10 + 20 + 60) / 3
    assert p.predict("a", progress=15) == pytest.approx(40.0)  # known lengths above 15: 20, 60
    assert p.predict("a", progress=60) == 61.0  # it outran every known length
    assert p.predict("new") == pytest.approx(30.0)  # no history: the mean of everything recorded
    assert LengthPredictor(prior=7.0).predict("new", progress=9) == 10.0
    with pytest.raises(ValueError):
        p.record("a", -1)


def test_expected_longest_of_n_draws_by_hand():
    # Two known lengths, 1 and 10: the longest of two draws is 1 only when both draws are 1
    # (probability 1/4), so 0.25 * 1 + 0.75 * 10 = 7.75; one draw is the mean.
    assert expected_longest([10, 1], 2) == pytest.approx(7.75)
    assert expected_longest([10, 1], 1) == pytest.approx(5.5)
    # Three: P(longest = 4) = 1 - (2/3)^2 = 5/9, P(= 2) = (2/3)^2 - (1/3)^2 = 3/9, P(= 1) = 1/9.
    assert expected_longest([1, 2, 4], 2) == pytest.approx((4 * 5 + 2 * 3 + 1) / 9)
    p = LengthPredictor()
    p.record("a", 1)
    p.record("a", 10)
    assert p.longest("a", 2) == pytest.approx(7.75)
    assert p.longest("new", 8) == pytest.approx(5.5)  # no history: the fallback
    with pytest.raises(ValueError):
        expected_longest([], 2)
    with pytest.raises(ValueError):
        expected_longest([3], 0)


def test_evaluate_scenarios_on_a_hand_made_log():
    # Policy A at steps 1 and 2 and policy B at step 1 answer prompt "q" and "r". Prompt q's
    # responses are long everywhere, r's short: history orders them perfectly.
    rows = []
    for pol, step, q_lens, r_lens in (("A", 1, (100, 120), (10, 12)), ("A", 2, (110, 130), (11, 9)),
                                      ("B", 1, (90, 140), (8, 14))):
        rows += [Response("q", pol, step, n) for n in q_lens] + [Response("r", pol, step, n) for n in r_lens]
    res = evaluate(rows)
    assert set(res) == {"cross-epoch", "cross-policy", "cross-sample", "in-flight"}
    # cross-epoch: step 2 of A predicted from step 1 of A: q -> 110, r -> 11 for both of each prompt.
    assert res["cross-epoch"]["requests"] == 4
    ranks_pred, ranks_true = [110, 110, 11, 11], [110, 130, 11, 9]
    assert res["cross-epoch"]["ours"] == pytest.approx(spearman(ranks_pred, ranks_true))
    assert res["cross-epoch"]["ours"] > 0.8
    # Groups by their longest: q's two of {100, 120} -> 0.25 * 100 + 0.75 * 120 = 115, r's of {10, 12}
    # -> 11.5; actual longest 130 and 11: the order is right. Cross-policy: two groups per policy.
    assert res["cross-epoch"]["longest"] == {"groups": 2, "ours": pytest.approx(1.0), "probe": pytest.approx(1.0)}
    assert res["cross-policy"]["longest"]["groups"] == 4 and "longest" not in res["cross-sample"]
    # The dataset mean is one number for everyone: no order.
    assert all(math.isnan(v["mean"]) for v in res.values())


# -- cost model ------------------------------------------------------------------------------------


def test_cost_model_picks_the_width_with_the_most_tokens_per_second():
    # Batch of 2: plain gives 2 tokens per 1 s; width 4 gives (2 + promised) per 2 s.
    cm = CostModel(FLAT, [4])
    assert cm.choose({4: 6.0}, batch=2, context=10) == 4  # 8/2 = 4 > 2
    assert cm.choose({4: 1.0}, batch=2, context=10) == 1  # 3/2 = 1.5 < 2
    # Measured acceptance scales the promises: drafts that deliver a quarter of what they promise.
    cm.observe(promised=40.0, accepted=10.0)
    assert cm.calibration() == 0.25
    assert cm.choose({4: 6.0}, batch=2, context=10) == 1  # (2 + 1.5)/2 = 1.75 < 2
    assert cm.chosen == {4: 1, 1: 2}


def test_a_step_s_fixed_part_pays_only_for_what_every_request_is_promised():
    from histospec_sgl.engine.costmodel import fixed_share

    # A CPU-like step: 0.04 s a step plus 0.005 s a request; a width-4 verify costs 1.5x plain.
    cpu = Measured("cpu", "test", {1: [(1, 0.045), (16, 0.12)], 4: [(1, 0.0675), (16, 0.18)]})
    assert fixed_share(cpu, 16) == pytest.approx(0.04 / 0.12)
    assert fixed_share(cpu, 1) == 1.0
    # Memory-bound (a GPU's decode): nearly all of the step is fixed; never above the step itself.
    assert fixed_share(FLAT, 64) == pytest.approx(1.0)
    cm = CostModel(cpu, [4])
    # 16 requests, 10 tokens promised in all: by the batch's tokens per second it pays
    # ((16 + 10) / 0.18 = 144 > 16 / 0.12 = 133)...
    assert cm.choose({4: 10.0}, 16, calibrated=True) == 4
    # ...and where every request is promised 10/16 alike, it does.
    assert cm.choose({4: 10.0}, 16, calibrated=True, least={4: 10.0 / 16}) == 4
    # Where one request is promised nothing the batch ends no sooner: only the per-request part
    # (2/3) of the 10 tokens counts, (16 + 6.7) / 0.18 = 126 < 133.
    rates = cm.rates({4: 10.0}, 16, calibrated=True, least={4: 0.0})
    assert rates[4] == pytest.approx((16 + 10.0 * 2 / 3) / 0.18)
    assert cm.choose({4: 10.0}, 16, calibrated=True, least={4: 0.0}) == 1
    # A lone request is its batch's slowest: its promise counts whole.
    assert cm.rates({4: 0.6}, 1, calibrated=True, least={4: 0.6}) == cm.rates({4: 0.6}, 1, calibrated=True)


def test_with_requests_waiting_for_a_slot_every_promised_token_counts_whole():
    """Where requests wait for a slot, a request that ends early lets one in: the step plan prices
    every promised token whole (the batch's promises alone), as when the batch's slowest request
    is promised as much as the rest. The simulator tells it how many wait; the steps run while
    some do are counted."""
    from histospec_sgl.engine.feedback import Feedback
    from histospec_sgl.engine.plan import StepCounts, plan_step

    cpu = Measured("cpu", "test", {1: [(1, 0.045), (16, 0.12)], 4: [(1, 0.0675), (16, 0.18)]})
    # 16 requests, one promised 10 tokens, the rest nothing: with none waiting the batch ends no
    # sooner, so only the per-request part counts and plain decoding wins (as above).
    per = np.zeros(16)
    per[3] = 10.0

    def plan(waiting: int) -> int:
        cm = CostModel(cpu, [4])
        return plan_step(cm, Feedback(cm, 4), {4: per}, None, per > 0, list(range(16)), waiting=waiting).width

    assert plan(0) == 1
    assert plan(5) == 4  # (16 + 10) / 0.18 > 16 / 0.12
    counts = StepCounts()
    counts.step(4, 16, waiting=5)
    counts.step(4, 16)
    assert counts.waiting_steps == 1 and counts.as_dict()["waiting_steps"] == 1

    # The simulated engine: 6 requests on 2 slots. While some wait, the policy is given no least
    # promise; once the last has joined, it is.
    class Leasts(Fixed):
        reads_promises = True

        def __init__(self) -> None:
            super().__init__(4)
            self.least: list[bool] = []

        def choose(self, promised, batch, context=0.0, prefill=0, decoding=None, least=None) -> int:
            self.least.append(least is not None)
            return 4

    n = 20
    reqs = [SimRequest(f"g{i}", n, prompt_len=3, accepted={4: np.full(n, 1, np.int32)},
                       promised={4: np.full(n, 1.0, np.float32)}) for i in range(6)]
    pol = Leasts()
    run_step(reqs, cpu, max_running=2, length_first=False, policy=pol)
    last_join = pol.least.index(True)
    assert last_join > 0 and not any(pol.least[:last_join]) and all(pol.least[last_join:]), pol.least


def test_the_fixed_part_is_credited_by_the_request_expected_to_end_the_batch():
    """A step's fixed part is credited by the promise of the request with the most steps to go: its
    remaining tokens (from its group's known lengths and its cap) over one plus its promise. Where
    every request has as long to go (or nothing is known), that is the least promised one; where the
    unpromised request is about to end, the batch's end is the long one's, and its promise counts."""
    from histospec_sgl.engine.feedback import Feedback
    from histospec_sgl.engine.remaining import GroupLengths, remaining
    from histospec_sgl.length import Lengths

    # E[L | L > k] over the known lengths, capped, less k; past every known length: the next token.
    lens = Lengths.of([40, 10, 100])
    assert lens.sorted == [10.0, 40.0, 100.0] and lens.tails == [150.0, 140.0, 100.0, 0.0]
    assert remaining(lens, 0) == pytest.approx(50.0)
    assert remaining(lens, 20) == pytest.approx(70.0 - 20)
    assert remaining(lens, 20, cap=64) == pytest.approx(64 - 20)
    assert remaining(lens, 150) == 1.0
    assert remaining(None, 5, cap=64) == 59.0 and math.isnan(remaining(Lengths.of([]), 5))

    fb = Feedback(_Recorder(), 4)
    per = {4: np.array([0.0, 3.0, 3.0])}
    assert fb.promises(per, None) == {4: (6.0, 0.0)}  # nothing known: the least
    assert fb.promises(per, None, np.array([50.0, 50.0, 50.0])) == {4: (6.0, 0.0)}
    # The unpromised request has 5 tokens left, the others 50: 50 / 4 steps > 5 / 1.
    assert fb.promises(per, None, np.array([5.0, 50.0, 50.0])) == {4: (6.0, 3.0)}
    # ...but one with 30 left needs 30 steps, more than the others' 50 / 4.
    assert fb.promises(per, None, np.array([30.0, 50.0, 50.0])) == {4: (6.0, 0.0)}
    # Not known: as long as the longest known.
    assert fb.promises(per, None, np.array([np.nan, 50.0, 50.0])) == {4: (6.0, 0.0)}
    assert fb.promises(per, None, np.array([5.0, np.nan, np.nan])) == {4: (6.0, 0.0)}
    # 0 left: it has ended (the overlap scheduler's step past its end), and does not end the batch.
    per3 = {4: np.array([0.0, 1.0, 3.0])}
    assert fb.promises(per3, None, np.array([0.0, 50.0, 50.0])) == {4: (4.0, 1.0)}
    assert fb.promises(per3, None, np.array([0.0, np.nan, np.nan])) == {4: (4.0, 1.0)}  # the least live
    assert fb.promises(per3, None, np.array([0.0, 0.0, 0.0])) == {4: (4.0, 0.0)}

    # The engine's drafter reads a group's lengths from the index, again when it holds more.
    from histospec_sgl._core import HistoryIndex

    index = HistoryIndex()
    index.add_response(7, [1, 2, 3], list(range(10)))
    gl = GroupLengths(index)
    key = index.group_keys()[0]
    assert gl.remaining([key, key], [0, 4], [None, 6]) == [10.0, 2.0]
    index.add_response(7, [1, 2, 3], list(range(30)))
    assert gl.remaining([key], [12]) == [30.0 - 12]


def test_analytic_profile_is_labelled_and_monotone():
    assert H100_8B.analytic and "analytic" in H100_8B.description
    assert resolve("h100-8b-analytic") is H100_8B
    assert H100_8B.step_s(64, 16, 500) > H100_8B.step_s(64, 4, 500) > H100_8B.step_s(64, 1, 500)
    assert H100_8B.step_s(128, 1, 500) > H100_8B.step_s(1, 1, 500)
    with pytest.raises(ValueError, match="neither an analytic profile"):
        resolve("no-such-profile")


def test_measured_profile_interpolates_and_rejects_bad_files(tmp_path):
    p = tmp_path / "p.json"
    p.write_text(json.dumps({"name": "cpu", "points": [{"batch": 1, "width": 1, "step_s": 0.01},
                                                        {"batch": 5, "width": 1, "step_s": 0.05},
                                                        {"batch": 1, "width": 8, "step_s": 0.03}]}))
    m = resolve(str(p))
    assert not m.analytic
    assert m.step_s(3, 1, 0) == pytest.approx(0.03)  # halfway between 1 and 5
    assert m.step_s(9, 1, 0) == pytest.approx(0.05)  # flat beyond the last point
    # An untimed width lies on the line between the timed widths around it (1 and 8 at batch 1).
    assert m.step_s(1, 6, 0) == pytest.approx(0.01 + 0.02 * 5 / 7)
    assert m.step_s(1, 12, 0) == pytest.approx(0.03)  # beyond the widest: the widest
    p.write_text(json.dumps({"name": "x", "points": [{"batch": 1, "width": 8, "step_s": 0.03}]}))
    with pytest.raises(ValueError, match="width 1"):
        resolve(str(p))


# -- the simulator ---------------------------------------------------------------------------------


def test_two_request_step_makespan_by_hand():
    # A: 5 tokens; at position 1 a width-4 draft gets 2 accepted. B: 2 tokens, nothing accepted.
    a = _req(5, accepted4=[0, 2, 0, 0, 0])
    b = _req(2)
    # Width 4: one prefill pass, alone (no decode step: both just joined), gives A and B their first
    # tokens (t=1); decode step 1: A 1+2 -> 4, B -> 2 (done, t=3); step 2: A alone -> 5 (done, t=5).
    spec = run_step([a, b], FLAT, max_running=2, length_first=False, policy=Fixed(4))
    assert (spec.makespan_s, spec.steps, spec.finish_s) == (5.0, 2, [3.0, 5.0])
    assert spec.tokens_per_s == pytest.approx(7 / 5)
    # Plain decoding: the prefill, then A's 4 decode steps of 1 s; B is done after its first.
    plain = run_step([a, b], FLAT, max_running=2, length_first=False)
    assert (plain.makespan_s, plain.finish_s) == (5.0, [2.0, 5.0])
    # The tail is the time from the 90th-percentile finish to the last: here the last alone.
    assert plain.tail_s == 0.0


def test_under_the_overlap_scheduler_a_request_runs_one_step_past_its_end():
    """SGLang's overlap scheduler launches the next step before the last one's result is known: a
    request stays in that step's batch (its slot taken, the step paid, nothing emitted) and its
    answer is out when the step ends. The by-hand step above, and one slot for two requests."""
    a = _req(5, accepted4=[0, 2, 0, 0, 0])
    b = _req(2)
    # Width 4: after the prefill (t=1), B ends at decode step 1 (t=3) and rides along in step 2 (out
    # at 5); A ends at step 2 (t=5) and stays for step 3, alone (out at 7).
    spec = run_step([a, b], FLAT, max_running=2, length_first=False, policy=Fixed(4), overlap=True)
    assert (spec.makespan_s, spec.steps, spec.finish_s) == (7.0, 3, [5.0, 7.0])
    # One slot, plain: A's prefill, 4 decode steps and its extra one before B's slot frees (out at
    # 6); then B's prefill, 1 decode step and one more (out at 9): 7 decode steps.
    one = run_step([a, b], FLAT, max_running=1, length_first=False, overlap=True)
    assert (one.makespan_s, one.steps, one.finish_s) == (9.0, 7, [6.0, 9.0])
    assert run_step([a, b], FLAT, max_running=1, length_first=False).makespan_s == 7.0


def test_length_first_admits_the_longest_predicted_first():
    # One slot; lengths 2, 2, 4 submitted in that order (a prefill pass and a decode step: 1 s each).
    # FCFS: finishes at 2, 4, 8. Longest predicted first: 4 first (t=4), then the short ones (6, 8).
    # Same makespan, and the tail (from the 90% finish, here the third, to the last) is the same; the
    # order is what changes.
    reqs = [_req(2, predicted=2, group="a"), _req(2, predicted=2, group="b"), _req(4, predicted=4, group="c")]
    fcfs = run_step(reqs, FLAT, max_running=1, length_first=False)
    lf = run_step(reqs, FLAT, max_running=1, length_first=True)
    assert fcfs.finish_s == [2.0, 4.0, 8.0] and lf.finish_s == [4.0, 6.0, 8.0]
    # Two slots: FCFS runs the short pair first and the long one alone at the end (makespan 6);
    # longest first decodes it beside the short ones (makespan 5).
    fcfs2 = run_step(reqs, FLAT, max_running=2, length_first=False)
    lf2 = run_step(reqs, FLAT, max_running=2, length_first=True)
    assert (fcfs2.makespan_s, lf2.makespan_s) == (6.0, 5.0)


def test_length_first_learns_from_siblings_that_finished():
    # One slot. Group a (a1, a2: 1 token each) has history [10], group b (b1: 3 tokens) history [8].
    # A group is ranked by the expected longest of its samples: a's 2 samples from {10} -> 10, b's
    # 1 sample -> 8, so a1 goes first (done at 1). Then a's known lengths are {10, 1}: the longest
    # of 2 draws is 0.75 * 10 + 0.25 * 1 = 7.75 < 8, so b1 (done at 4) goes before a2 (done at 5).
    # From history alone (``predicted``: a 10, b 8) a2 goes second (done at 2), b1 last (done at 5).
    reqs = [_req(1, predicted=10, group="a", history=(10,)), _req(3, predicted=8, group="b", history=(8,)),
            _req(1, predicted=10, group="a", history=(10,))]
    assert run_step(reqs, FLAT, max_running=1, length_first=True).finish_s == [1.0, 4.0, 5.0]
    assert run_step(reqs, FLAT, max_running=1, length_first=True, siblings=False).finish_s == [1.0, 2.0, 5.0]


def test_the_group_ceiling_ranks_groups_by_their_true_longest():
    # One slot. Group a: 1 and 5 tokens, group b: 3 and 3, submitted a1, b1, a2, b2. Ranked by the
    # group's true longest (a 5, b 3), a's samples go first in submission order (a1 done at 1, a2
    # at 6), then b's (9, 12); knowing each request's length, 5, 3, 3, 1: 5, 8, 11, 12.
    reqs = [_req(1, group="a"), _req(3, group="b"), _req(5, group="a"), _req(3, group="b")]
    out = run_policies(reqs, FLAT, max_running=1, widths=[4], fixed_width=4)
    assert out[GROUP_ORACLE].finish_s == [1.0, 6.0, 9.0, 12.0]
    assert out[ORACLE].finish_s == [5.0, 8.0, 11.0, 12.0]
    assert out["baseline"].finish_s == [1.0, 4.0, 9.0, 12.0]


def test_groups_spread_over_engines_end_with_the_last_engine():
    # Groups "a" and "b" hash to engines 0 and 1 of two. One slot each: engine 0 runs a's 2 + 3
    # tokens (done at 2 and 5), engine 1 b's 4 (done at 4). On one engine with two slots: a1 and b1
    # together, a2 after a1 (2 + 3): done at 2, 4, 5 as well; with one slot: 2, 5, 9.
    assert (engine_of("a", 2), engine_of("b", 2)) == (0, 1)
    reqs = [_req(2, group="a"), _req(3, group="a"), _req(4, group="b")]
    two = run_policies(reqs, FLAT, max_running=1, widths=[4], fixed_width=4, engines=2)
    one = run_policies(reqs, FLAT, max_running=1, widths=[4], fixed_width=4)
    assert two["baseline"].finish_s == [2.0, 4.0, 5.0] and two["baseline"].makespan_s == 5.0
    assert one["baseline"].finish_s == [2.0, 5.0, 9.0]
    assert two["baseline"].tokens_per_s == pytest.approx(9 / 5)
    assert two["baseline"].steps == 3 + 3  # both engines' decode steps (a prefill pass alone is none)
    with pytest.raises(ValueError):
        run_policies(reqs, FLAT, max_running=1, widths=[4], fixed_width=4, engines=0)


def test_aggregate_takes_medians_and_ranges_over_steps():
    steps = []
    for base_mk, lf_mk in ((10.0, 8.0), (10.0, 12.0), (20.0, 15.0)):
        row = {}
        for name, mk in (("baseline", base_mk), ("length_first", lf_mk)):
            row[name] = {"makespan_s": mk, "tail_s": 1.0, "tokens_per_s": 100 / mk, "ratio_vs_baseline": base_mk / mk,
                         "makespan_change": mk / base_mk - 1, "tail_change": 0.0, "steps": 10, "width_steps": {}}
        steps.append(row)
    agg = aggregate(steps)["length_first"]
    assert agg["makespan_s"] == 12.0
    assert agg["ratio_vs_baseline"] == pytest.approx(10 / 8)  # ratios 1.25, 0.833, 1.333
    assert agg["ratio_vs_baseline_range"] == pytest.approx([10 / 12, 20 / 15])
    assert agg["makespan_change"] == pytest.approx(-0.2) and agg["makespan_change_range"] == pytest.approx([-0.25, 0.2])
    assert agg["slower_than_baseline_in"] == 1


def test_one_policy_step_takes_consecutive_steps_of_one_policy():
    # Policies P, Q, R answer prompt "q<s>" at steps 1..4 (2 samples each); P's response at step s is
    # s tokens long, Q's and R's 10 * s. A 3-group one-policy step is 3 consecutive steps of one
    # policy, with the other two policies' responses as each group's history.
    rows = []
    for pol, scale in (("P", 1), ("Q", 10), ("R", 10)):
        for s in range(1, 5):
            for k in range(2):
                ids = list(range(100, 100 + scale * s))
                rows.append(Rollout(f"q{s}", "p", "r", pol, s, k, "x", prompt_ids=[1, 2, s], response_ids=ids))
    for seed in range(6):
        reqs, info = build_step(rows, StepSpec(groups=3, history_policies=2, seed=seed), widths=[4])
        assert len(info["sampled_by"]) == 1 and info["requests"] == 6
        pol = info["sampled_by"][0]
        steps = sorted({r.group[1] for r in reqs})
        assert steps in ([1, 2, 3], [2, 3, 4])
        scale = 1 if pol == "P" else 10
        for r in reqs:
            s = r.group[1]
            assert r.length == scale * s
            others = [x for x in ("P", "Q", "R") if x != pol]
            assert sorted(set(r.history)) == sorted({(1 if o == "P" else 10) * s for o in others})
    mixed, info = build_step(rows, StepSpec(groups=3, history_policies=2, seed=0, kind="mixed"), widths=[4])
    assert info["requests"] == 6 and len({r.group for r in mixed}) == 3
    with pytest.raises(ValueError, match="no policy"):
        build_step(rows, StepSpec(groups=5, history_policies=2), widths=[4])
    with pytest.raises(ValueError, match="step kind"):
        build_step(rows, StepSpec(groups=3, kind="bogus"), widths=[4])


def test_cost_model_policy_never_loses_to_plain_on_the_step():
    # Drafts that promise much but deliver nothing: the cost model stops verifying wide once the
    # calibration has measured that, and stays within a few steps of plain decoding.
    rng = np.random.default_rng(0)
    reqs = [_req(int(n), promised4=[3.0] * int(n)) for n in rng.integers(20, 60, 16)]
    out = run_policies(reqs, FLAT, max_running=8, widths=[4], fixed_width=4)
    base = out["baseline"].makespan_s
    assert out["history_fixed"].makespan_s > 1.5 * base  # fixed width pays 2 s a step for nothing
    assert out["history_cost_model"].makespan_s <= base + 2 * 16  # at most the calibration steps
    assert out["history_cost_model"].widths.get(1, 0) > out["history_cost_model"].widths.get(4, 0)


def test_draft_traces_accept_along_the_history():
    # History 5 6 7 8; the response 5 6 7 9 rewrites it. At position 1 (after 5) the draft is the
    # chain 6 7 8: width 4 (3 nodes) accepts 6 7, width 2 (1 node) accepts 6.
    acc, prom = draft_traces([[5, 6, 7, 8]], [1, 2], [5, 6, 7, 9], widths=[2, 4])
    assert acc[4][1] == 2 and acc[2][1] == 1
    assert acc[4][0] == 0  # position 0 is the prefill's token: nothing drafted
    assert 0 < prom[2][1] < prom[4][1] <= 3


def test_group_traces_draft_from_siblings_decoding_alongside():
    # No history. A = 5 6 7 8, B = 9 9 5 6 7 8, in lockstep. At B's position 3 (B has 9 9 5, A has
    # 5 6 7) B's "5" matches A's and A's 6 7 follow: width 4 accepts both. At position 4 A has
    # finished (history now) and 7 8 follow B's 5 6; at 5, 8 alone. Without siblings: nothing.
    a, b = [5, 6, 7, 8], [9, 9, 5, 6, 7, 8]
    (_, _), (acc, prom) = group_traces([], [1, 2], [a, b], widths=[2, 4])
    assert acc[4].tolist() == [0, 0, 0, 2, 2, 1] and acc[2].tolist() == [0, 0, 0, 1, 1, 1]
    assert prom[4][3] > 0
    (_, _), (alone, _) = group_traces([], [1, 2], [a, b], widths=[2, 4], siblings=False)
    assert not alone[4].any()
    # One sample: the same as draft_traces.
    single = group_traces([[5, 6, 7, 8]], [1, 2], [[5, 6, 7, 9]], widths=[2, 4])[0]
    assert all((single[0][w] == draft_traces([[5, 6, 7, 8]], [1, 2], [5, 6, 7, 9], [2, 4])[0][w]).all()
               for w in (2, 4))
    # Asked for at most 10 tokens, a response repeating its history can use 2 draft tokens at position 7,
    # 1 at 8 and none at 9 (the engine's room): its width-4 drafts promise less there than uncapped,
    # the same before.
    hist = [list(range(20, 40))]
    free = group_traces(hist, [1, 2], hist, widths=[4])[0][1][4]
    capped = group_traces(hist, [1, 2], hist, widths=[4], cap=10)[0][1][4]
    assert (capped[:7] == free[:7]).all() and free[7] > capped[7] > capped[8] > capped[9] == 0.0
    assert capped[8] <= 1.0 < capped[7] <= 2.0


# -- the commands on the logs -----------------------------------------------------------------------


def _own_log(tmp_path):
    """A user's own text log: 12 prompts sampled at steps 0 and 1, 4 samples each (the second epoch's
    answers close to the first's), and a word-level tokenizer (tokenizers) trained on it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    rng = np.random.default_rng(7)
    words = [f"w{i}" for i in range(60)]
    rows = []
    for p in range(12):
        answer = [words[i] for i in rng.integers(0, 60, 40)]
        for step in (0, 1):
            for _ in range(4):
                text = list(answer)
                for j in rng.integers(0, 40, 3):  # each sample changes a few words of the prompt's answer
                    text[j] = words[int(rng.integers(0, 60))]
                rows.append({"question": f"q{p} solve", "completion": " ".join(text), "epoch": step, "uid": p})
    log = tmp_path / "mine.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([r["question"] + " " + r["completion"] for r in rows],
                            trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    return log, tmp_path / "tokenizer.json"


def test_simulate_runs_on_your_own_log(tmp_path):
    """``simulate --input`` with the replay's field options and a tokenizer: a log of one policy with
    steps gives each group its prompt's earlier step as history, and the same report as the presets."""
    log, tok = _own_log(tmp_path)
    out = tmp_path / "sim.json"
    base = [sys.executable, "-m", "histospec_sgl.cli", "simulate", "--input", str(log), "--tokenizer", str(tok)]
    r = subprocess.run([*base, "--prompt-field", "question", "--response-field", "completion", "--group-field",
                        "uid", "--step-field", "epoch", "--groups", "6", "--max-running", "12", "--steps", "2",
                        "--history-policies", "1", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["input"] == str(log) and res["preset"] is None and "simulated rollout step" in r.stdout
    for b in res["step"]["built"]:
        # Every group is a prompt at step 1, its history the prompt's 4 answers at step 0.
        assert (b["requests"], b["history_responses"]) == (6 * 4, 6 * 4)
        assert "earlier steps" in b["history"]
    pol = res["policies"]
    assert pol["baseline"]["ratio_vs_baseline"] == 1.0
    assert pol["history_cost_model"]["ratio_vs_baseline"] > 1.2  # the second epoch rhymes with the first
    # Without steps in the mapping there is no earlier step: siblings alone, said so.
    r = subprocess.run([*base, "--prompt-field", "question", "--response-field", "completion", "--groups", "6",
                        "--max-running", "12", "--steps", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    built = json.loads(out.read_text())["step"]["built"][0]
    assert built["history_responses"] == 0 and "siblings only" in built["history"]
    r = subprocess.run([*base, "--response-field", "completion"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--prompt-field" in r.stderr and "Traceback" not in r.stderr

needs_logs = pytest.mark.usefixtures("data_root")  # the real rollout logs, beside the checkout


@needs_logs
def test_simulate_command_writes_the_documented_json(tmp_path):
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    r = subprocess.run([sys.executable, "-m", "histospec_sgl.cli", "simulate", "--groups", "6", "--max-running",
                        "16,48", "--steps", "2", "--engines", "2", "--json", str(out), "--plot", str(png)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["profile"] == "h100-8b-analytic" and res["analytic"] is True
    assert "ANALYTIC" in r.stdout
    names = {"baseline", "history_fixed", "history_cost_model", "length_first", "full",
             "length_first_oracle", "length_first_group_oracle"}
    assert set(res["policies"]) == names
    for v in res["policies"].values():
        assert {"makespan_s", "tail_s", "tokens_per_s", "ratio_vs_baseline", "ratio_vs_baseline_range"} <= set(v)
    assert res["policies"]["baseline"]["ratio_vs_baseline"] == 1.0
    assert [s["max_running"] for s in res["sweep"]] == [16, 48]
    assert (res["step"]["steps"], res["step"]["engines"], res["step"]["kind"]) == (2, 2, "one-policy")
    built = res["step"]["built"]
    assert [b["requests"] for b in built] == [6 * 8, 6 * 8] and all(len(b["sampled_by"]) == 1 for b in built)
    for s in res["sweep"]:
        for k, step in enumerate(s["per_step"]):
            # Every request's tokens are produced whatever the policy: throughput x makespan = tokens.
            for v in step.values():
                assert v["tokens_per_s"] * v["makespan_s"] == pytest.approx(built[k]["tokens"], rel=1e-6)
        for name in names:  # the headline is the median over the steps
            ratios = [step[name]["ratio_vs_baseline"] for step in s["per_step"]]
            assert s["policies"][name]["ratio_vs_baseline"] == pytest.approx(float(np.median(ratios)))
    assert png.stat().st_size > 10_000


@needs_logs
def test_bench_lengths_on_the_logs(tmp_path):
    out = tmp_path / "len.json"
    r = subprocess.run([sys.executable, "-m", "histospec_sgl.cli", "bench", "lengths", "--preset", "humaneval",
                        "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    sc = json.loads(out.read_text())["logs"]["humaneval"]["scenarios"]
    assert sc["cross-sample"]["requests"] == 16400
    assert sc["cross-sample"]["ours"] > 0.2  # history orders lengths; the constant mean cannot
    assert math.isnan(sc["cross-sample"]["mean"])


# -- the engine's control --------------------------------------------------------------------------


def _time_steps(ec: EngineControl, batch: int, width: int, seconds: float, n: int = 3) -> None:
    """``n`` timings of ``width`` kept by the clock (after the width's warm-up timing, which it leaves
    out once a server)."""
    for _ in range(ec.clock.warmup - ec.clock.warmed.get(width, 0)):
        ec.clock.record(batch, width, seconds)
    for _ in range(n):
        ec.clock.record(batch, width, seconds)


def test_engine_control_measures_both_widths_then_chooses_by_cost():
    ec = EngineControl(d=8, min_samples=2, widths=(8,))  # d or plain decoding
    # A new batch-size bucket is measured first: two steps at width d, two at width 1, each after a
    # warm-up step (the first of a shape, slow on a fresh engine) that is left out.
    t = 0.0
    for width, took in ((8, 9.0), (8, 2.0), (8, 2.0), (1, 5.0), (1, 1.0), (1, 1.0)):
        ec.begin(t)  # as the worker does: the step before is timed, then this one chosen
        assert ec.choose({ec.d: 0.0}, 4) == width
        ec.decode_step(4, width, t)
        t += took
    ec.begin(t)
    assert (ec.clock.step_s(4, 8), ec.clock.step_s(4, 1)) == (2.0, 1.0)
    # 4 requests: plain gives 4 tokens/s; wide (4 + promised) / 2.
    assert ec.choose({ec.d: 3.0}, 4) == 1  # 3.5 < 4
    assert ec.choose({ec.d: 5.0}, 4) == 8  # 4.5 > 4
    assert ec.choose({ec.d: 5.0}, 3) == 8  # 3 shares the bucket of 4: no new measurement
    # 5-8 is a new bucket: priced as 3-4's (5 requests, promising 3: 5 tokens/s plain, 4 wide) until
    # it has run `settle` timed steps of its own, then measured as the first bucket was.
    assert ec.choose({ec.d: 3.0}, 5) == 1
    _time_steps(ec, 5, 1, 1.5, n=ec.settle - 1)
    assert ec.choose({ec.d: 0.0}, 5) == 1
    _time_steps(ec, 5, 1, 1.5)
    assert ec.choose({ec.d: 0.0}, 5) == 8
    # An interval far beyond the bucket's estimate held an idle engine, not a step.
    ec.decode_step(4, 1, 10.0)
    ec.begin(100.0)
    assert ec.clock.step_s(4, 1) == 1.0
    # A width chosen to be measured but not run (a step without drafts runs plainly, and is timed at
    # width 1) is chosen again until it has run often enough.
    ec2 = EngineControl(d=8, min_samples=2, widths=(8,))
    _time_steps(ec2, 2, 1, 1.0)
    assert [ec2.choose({ec2.d: 0.0}, 2) for _ in range(5)] == [8] * 5
    _time_steps(ec2, 2, 8, 1.0, n=2)
    assert ec2.choose({ec2.d: 0.0}, 2) == 1


def test_simulator_runs_the_engines_policy_on_its_own_clock():
    # One policy, two runners: the simulator feeds EngineControl the simulated step times as the
    # engine's worker feeds it real ones. Width 2 accepts 1 token a step for 1.2 s, width 4 accepts 2
    # for 3 s, plain decoding 1 s: per request-second 1.67, 1.0 and 1.0 tokens, so after measuring
    # d = 4 and plain decoding the policy must settle on width 2, priced by interpolation until run.
    prof = Measured("w", "test", {1: [(1, 1.0)], 2: [(1, 1.2)], 4: [(1, 3.0)]})
    n = 120

    def req(group: str) -> SimRequest:
        return SimRequest(group, n, prompt_len=3,
                          accepted={2: np.ones(n, np.int32), 4: np.full(n, 2, np.int32)},
                          promised={2: np.full(n, 0.9, np.float32), 4: np.full(n, 1.8, np.float32)})

    ec = EngineControl(4)
    assert ec.widths == (2, 4)
    out = run_step([req("a"), req("b")], prof, max_running=2, length_first=False, policy=ec)
    assert out.widths[4] >= ec.min_samples and out.widths[1] >= ec.min_samples  # measured first
    assert out.widths[2] > 0.8 * out.steps  # then the width that pays
    assert ec.clock.step_s(2, 1) == pytest.approx(1.0)
    assert ec.clock.step_s(2, 4) == pytest.approx(3.0)
    assert ec.clock.step_s(2, 2) == pytest.approx(1.2)  # timed once chosen
    assert ec.calibration("sampled", 2) == pytest.approx(1 / 0.9, rel=1e-3)  # every logged sample is sampled
    fixed4 = run_step([req("a"), req("b")], prof, max_running=2, length_first=False, policy=Fixed(4))
    plain = run_step([req("a"), req("b")], prof, max_running=2, length_first=False)
    assert out.makespan_s < 0.7 * min(fixed4.makespan_s, plain.makespan_s)


def test_the_first_bucket_measures_d_and_plain_decoding_min_samples_times_each():
    """Nothing to borrow from: the first bucket times d and plain decoding ``min_samples`` times each
    (after each one's warm-up) before it prices by them, so that one slow timing (a fresh server's
    first steps of a shape) is not the price it keeps."""
    ec = EngineControl(d=8, widths=(4, 8))
    seq = []
    for k in range(10):
        w = ec.choose({4: 0.0, 8: 0.0}, 1)
        seq.append(w)
        ec.clock.record(1, w, 9.0 if (w, k) == (8, 1) else 1.0 if w == 1 else 2.0)
    n = ec.clock.warmup + ec.min_samples
    assert seq[:2 * n] == [8] * n + [1] * n and set(seq[2 * n:]) == {1}
    assert ec.clock.step_s(1, 8) == 2.0 and ec.clock.step_s(1, 1) == 1.0  # the 9 s timing is not the price


def test_a_new_batch_bucket_borrows_the_nearest_measured_prices():
    """A bucket with fewer than two widths timed prices each width as the nearest bucket with two
    does, scaled to its own timing where it has one, and so does a bucket with two for a width
    beyond them; until then nothing can price it."""
    ec = EngineControl(d=8, widths=(4, 8))
    with pytest.raises(KeyError):
        ec.clock.step_s(1, 8)
    assert not ec.clock.priced(1)
    for w, took in ((1, 1.0), (8, 2.0)):
        for _ in range(ec.clock.warmup + 1):
            ec.clock.record(1, w, took)
    # Bucket 1 measured: 4 is priced between plain and d; 5-8 and 9-16 borrow bucket 1's prices.
    assert ec.clock.step_s(1, 4) == pytest.approx(1 + 3 / 7)
    assert ec.clock.priced(8) and ec.clock.step_s(8, 8) == 2.0 and ec.clock.step_s(16, 1) == 1.0
    # Bucket 5-8 times its first width (d at 6 s, three times bucket 1's): its other widths scale.
    for _ in range(ec.clock.warmup + 1):
        ec.clock.record(8, 8, 6.0)
    assert ec.clock.step_s(8, 8) == 6.0 and ec.clock.step_s(8, 1) == pytest.approx(3.0)
    # 5-8 has one width only, so 9-16 still borrows bucket 1's.
    assert ec.clock.step_s(16, 1) == 1.0
    # Its own second width makes 5-8 priced by its own timings alone.
    for _ in range(ec.clock.warmup + 1):
        ec.clock.record(8, 1, 2.0)
    assert ec.clock.step_s(8, 1) == 2.0 and ec.clock.step_s(8, 4) == pytest.approx(2 + 4 * 3 / 7)
    # 9-16 now borrows from 5-8, the nearer.
    assert ec.clock.step_s(16, 8) == 6.0
    # A bucket that verified at 4 and 8 only (never plain) prices plain decoding by its neighbour's
    # shape, stretched to its own: at 5-8 width 8 costs 16/7 s more than width 4 and width 4 12/7 s
    # more than plain decoding; at 9-16 width 8 costs 2 s more than width 4 (7/8 of 16/7), so plain
    # decoding is 7/8 of 12/7 s below width 4's 5 s, not width 4's cost held flat below it.
    for w, took in ((4, 5.0), (8, 7.0)):
        for _ in range(ec.clock.warmup + 1):
            ec.clock.record(16, w, took)
    assert ec.clock.step_s(16, 6) == pytest.approx(6.0)
    assert ec.clock.step_s(16, 1) == pytest.approx(5.0 - 12 / 7 * 7 / 8)
    assert ec.clock.step_s(16, 2) == pytest.approx(5.0 - 8 / 7 * 7 / 8)


def test_a_wider_width_is_priced_by_the_bucket_own_difference_between_widths():
    """A width beyond the two or more a bucket measured is priced along the lender's steps between
    widths, stretched to the bucket's own difference between its outermost measured widths: a
    verify step's extra cost grows with the batch faster than a plain step does. SmolLM2 on the CPU,
    a first greedy pass (one server's step log): at batch 1 plain steps 0.0414 s, width 2 0.049 s,
    width 4 0.0642 s, width 8 0.0631 s; at batch 16 plain 0.0884 s and width 2 0.1184 s, and width
    8 then cost 0.253 s, where scaling batch 1's width 8 by width 2's ratio priced it at 0.152 s."""
    ec = EngineControl(d=8, widths=(2, 4, 8))
    for w, took in ((1, 0.0414), (2, 0.049), (4, 0.0642), (8, 0.0631)):
        _time_steps(ec, 1, w, took)
    _time_steps(ec, 16, 1, 0.0884)
    # One width measured: scaled by its ratio.
    assert ec.clock.step_s(16, 8) == pytest.approx(0.0631 * 0.0884 / 0.0414)
    _time_steps(ec, 16, 2, 0.1184)
    # Width 2 plus batch 1's steps from width 2, stretched by 0.030 s against 0.0076 s.
    k = (0.1184 - 0.0884) / (0.049 - 0.0414)
    assert ec.clock.step_s(16, 8) == pytest.approx(0.1184 + (0.0631 - 0.049) * k)
    assert ec.clock.step_s(16, 8) == pytest.approx(0.174, abs=1e-3)
    assert ec.clock.step_s(16, 4) == pytest.approx(0.1184 + (0.0642 - 0.049) * k)
    # A lender's width timed once is lent at the lesser of its timing and the line through the
    # lender's other widths, so one slow step there does not bend the shape.
    lent = EngineControl(d=8, widths=(2, 4, 8)).clock
    for w, took in ((1, 0.075), (4, 0.090), (8, 0.105)):
        for _ in range(lent.warmup + lent.trusted):
            lent.record(1, w, took)
    lent.record(1, 2, 0.2)  # its warm-up
    lent.record(1, 2, 0.2)  # one slow timing
    # Its own bucket prices it between the timing and the line (their geometric mean); it lends
    # the line's 0.080 s.
    assert lent.step_s(1, 2) == pytest.approx(math.sqrt(0.2 * 0.080))
    for _ in range(lent.trusted):
        lent.record(16, 1, 0.25)
    assert lent.step_s(16, 2) == pytest.approx(0.080 * 0.25 / 0.075)
    # Where the bucket's own widths do not rise (noise), its nearest width's ratio scales it.
    clock = EngineControl(d=8, widths=(2, 8)).clock
    for b, timed in ((1, {1: 0.075, 2: 0.080, 8: 0.105}), (16, {1: 0.30, 2: 0.30})):
        for w, took in timed.items():
            for _ in range(clock.warmup + clock.trusted):
                clock.record(b, w, took)
    assert clock.step_s(16, 8) == pytest.approx(0.30 * 0.105 / 0.080)


def test_plain_decoding_is_borrowed_from_a_bucket_that_timed_it():
    """A bucket that never decoded plainly prices plain decoding as the nearest bucket that did, against
    its own nearest width: not as a nearer bucket that only verified (at 2 and 4), which holds plain
    decoding at width 2's cost and so would price it as free against width 2."""
    ec = EngineControl(d=8, widths=(2, 4, 8))
    for b, timed in ((8, {1: 1.0, 2: 1.5, 4: 2.0}), (32, {2: 3.0, 4: 4.0}), (64, {2: 6.0})):
        for w, took in timed.items():
            for _ in range(ec.clock.warmup + ec.clock.trusted):
                ec.clock.record(b, w, took)
    # Bucket 32 lends its shape between widths 2 and 4 (nearest), bucket 8 plain decoding's.
    assert ec.clock.step_s(64, 4) == pytest.approx(8.0)
    assert ec.clock.step_s(64, 1) == pytest.approx(1.0 * 6.0 / 1.5)
    assert ec.clock.step_s(32, 1) == pytest.approx(1.0 * 3.0 / 1.5)


def test_a_timing_is_priced_at_the_batch_asked_about():
    """A bucket spans batch sizes (33-64): a width timed in a row's tail (batch 36) and another timed
    at its top (64) are compared at the batch asked about, as a fixed part plus a part per request,
    not as if both ran at one size. Here steps cost 0.02 s plus 12, 19 and 26 ms per request at
    widths 1, 4 and 8: width 8 timed at 36 is 0.96 s, but at 64 it costs 1.68 s, more than width 4's
    1.24 s, and width 4 gives more tokens per second there."""
    ec = EngineControl(d=8, widths=(4, 8))
    per_request = {1: 0.012, 4: 0.019, 8: 0.026}

    def cost(w: int, batch: int) -> float:
        return 0.02 + per_request[w] * batch

    for batch in (1, 2, 4, 8, 16, 32):
        for w in (1, 8):
            _time_steps(ec, batch, w, cost(w, batch))
    _time_steps(ec, 64, 1, cost(1, 64))
    _time_steps(ec, 36, 8, cost(8, 36))
    _time_steps(ec, 64, 4, cost(4, 64))
    assert ec.clock.fixed(1) == pytest.approx(0.02) and ec.clock.fixed(8) == pytest.approx(0.02)
    for batch in (36, 48, 64):
        for w in (1, 4, 8):
            assert ec.clock.step_s(batch, w) == pytest.approx(cost(w, batch), rel=1e-6), (batch, w)
    # The table is each width's cost at the bucket's largest batch, as the metrics and the simulator read it.
    assert ec.clock.table[(8, 64)] == pytest.approx(cost(8, 64))
    ec.clock.timed[64] = ec.settle  # the bucket has run long enough to trust what it measured
    promised = {4: 64 * 1.5, 8: 64 * 2.0}
    assert ec.choose(promised, 64) == 4
    # Priced as timed (width 8 at 0.96 s whatever the batch), width 8 would have looked best.
    assert (64 + promised[8]) / cost(8, 36) > (64 + promised[4]) / cost(4, 64)


def test_a_full_batch_is_priced_by_its_own_steps_not_by_a_tails_scaled_up():
    """Where three timings ran at the batch size asked about, they alone price it: the steps of a
    shrinking batch carry host work of their own (requests leaving), so a tail's timings scaled up
    by the per-request line would price a full batch's plain steps above what they cost. Timed on
    SmolLM2 at batch 16 (first greedy pass): plain steps 0.12 s at 16 and 0.13-0.14 s at 12-15;
    scaled to 16 those read 0.15-0.16 s, and width 2 (0.149 s) looked nearly free."""
    clock = EngineControl(d=8, widths=(2, 8)).clock
    for batch, seconds in ((1, 0.045), (1, 0.046), (1, 0.044), (1, 0.045)):
        clock.record(batch, 1, seconds)
    tail = [(12, 0.128), (13, 0.134), (14, 0.137), (14, 0.14), (15, 0.139)]
    for batch, seconds in [(16, 0.12), (16, 0.121), *tail[:3], (16, 0.117), *tail[3:], (16, 0.119)]:
        clock.record(batch, 1, seconds)
    # The median of the four at 16 (plain decoding's warm-up step was its first, at batch 1).
    assert clock.price(16, 1) == 0.119
    assert clock.table[(1, 16)] == 0.119
    # Batch 14 has two timings of its own: all the bucket's nine, priced at 14, price it.
    priced = clock._priced(clock.samples[(1, 16)], 1, 14)
    assert len(priced) == 9 and clock.price(14, 1) == sorted(priced)[4]
    # The tail's timings priced at 16 would have said more than any step at 16 took.
    assert min(clock._priced(tail, 1, 16)) > 0.14


def test_a_bucket_measures_the_widths_it_chooses_between_before_trusting_their_prices():
    """At a batch size its prices are borrowed for (or interpolated between the widths it measured),
    the policy runs each width that comes within ``contend`` of the best until it has timed it there
    often enough to trust the timing alone (``trusted``), and then chooses by what it measured: a
    width a borrowed price undersold is found."""
    ec = EngineControl(d=8, widths=(4, 8))
    # Batch 8 measured: plain 1 s, width 4 1.1 s, width 8 1.3 s (a small batch: wide steps cheap).
    for w, took in ((1, 1.0), (4, 1.1), (8, 1.3)):
        _time_steps(ec, 8, w, took)
    # Batch 64 borrows them; each request's drafts promise 1.3 tokens at width 4 and 1.8 at 8.
    promised = {4: 1.3 * 64, 8: 1.8 * 64}
    rates = ec.model.rates(promised, 64, calibrated=True)
    assert rates[8] > rates[4] > 0.8 * rates[8] and rates[1] < 0.8 * rates[8]
    # The contenders (4 and 8, within 20% of the best; plain decoding is not) are run to time them,
    # the narrower first: the cheaper step, whose timing reprices the other's borrowed price.
    ran = []
    at64 = {1: 1.0, 4: 1.5, 8: 2.5}  # what a step really costs at batch 64
    for _ in range(3 * (ec.min_samples + ec.clock.warmup)):
        w = ec.choose(promised, 64)
        ran.append(w)
        ec.clock.record(64, w, at64[w])
    # Each width's warm-up step was its first at batch 8: every step here is timed.
    timed = ec.clock.trusted
    assert ran[:timed] == [4] * timed
    # Width 4 timed at 1.5 s, width 8 is priced as batch 8 prices it against width 4 (1.3 / 1.1 of
    # it: 1.77 s) and still contends. One timing of its own (2.5 s) is not trusted alone: it is
    # priced between the two (2.1 s), but the timing itself puts it more than 20% behind width 4
    # (2.8 * 64 / 2.5 s against 2.3 * 64 / 1.5 s), so no second step is spent to confirm it.
    assert ec.clock.trusted == 2
    assert ran[timed:timed + 1] == [8] and ec.clock.count(64, 8) == 1
    assert ec.clock.step_s(64, 8) == pytest.approx(math.sqrt(2.5 * 1.5 * 1.3 / 1.1))
    assert set(ran[timed + 1:]) == {4}
    assert ec.choose(promised, 64) == 4
    # Where its one timing keeps it within 20% of the best, it is run again until it is trusted.
    close = EngineControl(d=8, widths=(4, 8))
    for w, took in ((1, 1.0), (4, 1.1), (8, 1.3)):
        _time_steps(close, 8, w, took)
    ran = []
    for _ in range(8):
        w = close.choose(promised, 64)
        ran.append(w)
        close.clock.record(64, w, {1: 1.0, 4: 1.5, 8: 1.9}[w])
    assert ran[:timed + 2] == [4, 4, 8, 8] and close.clock.count(64, 8) == 2
    # A bucket measured whole has nothing left to try: the choice is the model's at once.
    assert ec.choose(promised, 8) == ec.model.choose(promised, 8, calibrated=True)


def test_one_slow_first_step_in_a_bucket_does_not_put_a_width_out_of_the_running():
    """A width's warm-up is left out once a server, so its first step in a later bucket is timed:
    where that one step is slow (the host paused), the width is priced between it and what the
    bucket's other timings say of it (their geometric mean) until a second timing comes, so where it
    pays at that price it is run again and then priced by what it costs."""
    ec = EngineControl(d=8, widths=(8,))
    # Batch 8 measured: plain 1 s, width 8 1.5 s.
    for w, took in ((1, 1.0), (8, 1.5)):
        _time_steps(ec, 8, w, took)
    # Batch 16 has timed plain decoding (2 s) and width 8 once, at 9 s (really 3 s).
    for _ in range(3):
        ec.clock.record(16, 1, 2.0)
    ec.clock.record(16, 8, 9.0)
    assert ec.clock.price(16, 8) == 9.0
    # Batch 8's shape against plain decoding, scaled to batch 16's own, says 3 s: priced between the
    # two (5.2 s), not at 9.
    assert ec.clock.step_s(16, 8) == pytest.approx(math.sqrt(9.0 * 3.0))
    # Drafts that pay at 5.2 s a step (4 tokens a request) and not at 9: width 8 is chosen.
    promised = {8: 3.0 * 16}
    assert ec.choose(promised, 16) == 8
    ec.clock.record(16, 8, 3.0)
    # Two timings: their (lower) median prices it, the slow one left behind.
    assert ec.clock.step_s(16, 8) == 3.0 and ec.choose(promised, 16) == 8
    # Two slow timings are trusted: at batch 32 (plain decoding 4 s), width 8 at 18 s twice is priced
    # at 18 s, not at the 6 s the other buckets would say, and is out of the running.
    for w, took in ((1, 4.0), (1, 4.0), (1, 4.0), (8, 18.0)):
        ec.clock.record(32, w, took)
    assert ec.clock.step_s(32, 8) == pytest.approx(math.sqrt(18.0 * 6.0)) and ec.choose({8: 2.0 * 32}, 32) == 8
    ec.clock.record(32, 8, 18.0)
    assert ec.clock.step_s(32, 8) == 18.0 and ec.choose({8: 2.0 * 32}, 32) == 1


def test_a_width_warms_up_once_a_server_not_once_a_bucket():
    """A width's first timing is left out (a server's first forward of it); its first step in a later
    batch-size bucket is kept, a step the policy does not spend for nothing in every bucket a row
    passes through, and one slow step there does not move the bucket's median of three."""
    from histospec_sgl.engine.clock import StepClock

    clock = StepClock()
    clock.record(1, 8, 9.0)  # the warm-up: left out
    for took in (2.0, 2.1, 1.9):
        clock.record(1, 8, took)
    assert clock.count(1, 8) == 3 and clock.price(1, 8) == 2.0
    clock.record(8, 8, 4.5)  # width 8's first step at batch 8: kept
    assert clock.count(8, 8) == 1 and clock.price(8, 8) == 4.5
    for took in (3.0, 3.1):
        clock.record(8, 8, took)
    assert clock.price(8, 8) == 3.1
    clock.record(8, 1, 1.0)  # plain decoding's first step: its warm-up, wherever it runs
    assert clock.count(8, 1) == 0 and clock.warmed == {8: 1, 1: 1}


def test_step_costs_shrug_off_a_slow_step_and_are_measured_again():
    ec = EngineControl(d=8, remeasure_after=10, widths=(8,))
    # The first wide step of a shape is slow (a warm-up) and left out; a slow step later (a pause of
    # the host) is kept out by the median of three.
    for took in (60.0, 2.0, 8.0, 2.0):
        ec.clock.record(1, 8, took)
    assert ec.clock.samples[(8, 1)] == [(1, 2.0), (1, 8.0), (1, 2.0)]
    _time_steps(ec, 1, 1, 1.0)
    assert ec.clock.step_s(1, 8) == 2.0
    assert ec.choose({ec.d: 1.5}, 1) == 8  # 2.5 tokens / 2 s beat 1 / 1 s
    # Plain decoding wins for a while, by 2x (nothing promised: 1 token / 2 s against 1 / 1 s). No
    # step is spent measuring a width that far behind, however old its timings (a repeated greedy
    # pass, where width d wins by 3x, runs no plain step to time it).
    for _ in range(16):  # the wide timings end up 13 to 20 steps old
        assert ec.choose({ec.d: 0.0}, 1) == 1
        ec.clock.record(1, 1, 1.0)
    # Within 20% of the best (1.7 tokens / 2 s), a width not timed for remeasure_after steps is run
    # once more, so that a cost measured too high does not keep it unchosen for good.
    assert ec.choose({ec.d: 0.7}, 1) == 8
    ec.clock.record(1, 8, 1.0)
    assert ec.choose({ec.d: 0.7}, 1) == 1  # timed just now (its median still 2 s)


def test_drafter_under_the_cost_model_drafts_only_where_it_pays():
    from histospec_sgl.engine.config import HistoryConfig
    from histospec_sgl.engine.drafter import BatchDrafter

    d = 8
    dr = BatchDrafter(d, HistoryConfig(control="cost"))
    for _ in range(3):
        dr.add_finished([1, 2, 3], list(range(10, 40)))
    for r in ("a", "b"):
        dr.sync(r, [1, 2, 3], [10, 11])
    assert isinstance(dr.policy, EngineControl)
    # Verifying at any width costs 100x plain decoding here: the drafts cannot pay, the step is
    # plain (each request's root alone).
    assert dr.policy.widths == (2, 4, 8)
    for w in dr.policy.widths:
        _time_steps(dr.policy, 2, w, 100.0)
    _time_steps(dr.policy, 2, 1, 1.0)
    tokens, _ = dr.draft(["a", "b"])[:2]
    assert tokens.tolist() == [11, 11] and not dr.drafting and dr.width == 1
    dr.observe_step([0, 0])
    # At the same cost as plain decoding, any promised token pays: the widest draft promises most.
    for w in dr.policy.widths:
        _time_steps(dr.policy, 2, w, 1.0, n=dr.policy.clock.window)
    tokens, _ = dr.draft(["a", "b"])[:2]
    assert dr.width == d
    assert tokens.reshape(2, d)[:, 1:4].tolist() == [[12, 13, 14], [12, 13, 14]] and dr.drafting
    dr.observe_step([7, 7])
    assert dr.policy.model is not None and dr.policy.model.accepted == 14 and dr.policy.model.promised > 0


def test_a_bench_engine_result_becomes_a_measured_profile(tmp_path):
    from histospec_sgl.simulate.profile import from_engine_bench

    rows = [{"method": m, "batch_size": b, "pass": p, "step_ms": ms}
            for m, b, p, ms in (("plain", 1, 1, 10.0), ("plain", 1, 2, 12.0), ("plain", 8, 1, 20.0),
                                ("history", 1, 1, 30.0), ("history", 8, 1, 70.0), ("ngram", 1, 1, 99.0))]
    engine = {"settings": {"draft_tokens": 8}, "rows": rows, "device": "cpu", "model": {"kind": "rhyme"},
              "machine": {"cpu": "test", "sglang": "0.5.17"}}
    prof = from_engine_bench(engine)
    assert prof["points"] == [{"batch": 1, "width": 1, "step_s": 0.011}, {"batch": 8, "width": 1, "step_s": 0.02},
                              {"batch": 1, "width": 8, "step_s": 0.03}, {"batch": 8, "width": 8, "step_s": 0.07}]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    m = resolve(str(path))
    assert not m.analytic and m.step_s(4, 8, 0) == pytest.approx(0.03 + (0.07 - 0.03) * 3 / 7)
    with pytest.raises(ValueError, match="plain decoding and of HISTORY"):
        from_engine_bench({**engine, "rows": rows[:3]})
    # bench profile runs one fixed width per result: together they give every width they ran, and a
    # width between them is priced on the line between its neighbours.
    at4 = {**engine, "settings": {"draft_tokens": 4},
           "rows": [{"method": "history", "batch_size": 1, "pass": 1, "step_ms": 16.0}]}
    both = from_engine_bench([engine, at4])
    assert {(x["width"], x["batch"]): x["step_s"] for x in both["points"]}[(4, 1)] == 0.016
    assert "widths 1,4,8" in both["description"]
    path.write_text(json.dumps(both))
    assert resolve(str(path)).step_s(1, 6, 0) == pytest.approx(0.016 + (0.03 - 0.016) / 2)


def test_the_engines_own_step_clock_becomes_a_measured_profile(tmp_path):
    """``simulate --check`` prices steps by the costs the default policy's clock measured per width
    and batch bucket (``step_seconds`` of the result's rows), a later row's value over an earlier
    one's, as the server's clock keeps them; a result without them has no such profile."""
    from histospec_sgl.simulate.profile import from_engine_clock

    rows = [{"method": "plain", "batch_size": 1, "step_ms": 10.0},
            {"method": "history_cost", "batch_size": 1, "step_seconds": {"1": {"1": 0.010}, "8": {"1": 0.020}}},
            {"method": "history_cost", "batch_size": 4,
             "step_seconds": {"1": {"1": 0.011, "4": 0.030}, "2": {"4": 0.040}, "8": {"1": 0.020, "4": 0.080}}}]
    engine = {"settings": {"draft_tokens": 8}, "rows": rows, "device": "cpu", "model": {"kind": "rhyme"},
              "machine": {"cpu": "test"}}
    prof = from_engine_clock(engine)
    assert prof is not None and "engine-clock" in prof["name"] and "widths 1,2,8" in prof["description"]
    assert {(x["width"], x["batch"]): x["step_s"] for x in prof["points"]} == {
        (1, 1): 0.011, (1, 4): 0.030, (2, 4): 0.040, (8, 1): 0.020, (8, 4): 0.080}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    m = resolve(str(path))
    # Per step at the running batch: interpolated between the buckets, and width 4 between 2 and 8.
    assert m.step_s(2, 1, 0) == pytest.approx(0.011 + (0.030 - 0.011) / 3)
    assert m.step_s(4, 4, 0) == pytest.approx(0.040 + (0.080 - 0.040) * 2 / 6)
    assert from_engine_clock({**engine, "rows": rows[:1]}) is None
    assert from_engine_clock({**engine, "rows": [{"step_seconds": {"8": {"1": 0.02}}}]}) is None
    # A fixed-width server's clock (its own steps) prices nothing: the default's clock does...
    fixed = {"method": "history", "control": "fixed", "batch_size": 4, "step_seconds": {"8": {"4": 0.5}}}
    assert from_engine_clock({**engine, "rows": [*rows, fixed]}) == prof
    # ...except that fixed row's own verify steps (simulate --check), plain decoding staying the default's.
    from histospec_sgl.simulate.profile import with_row_clock

    own = {(x["width"], x["batch"]): x["step_s"] for x in with_row_clock(prof, fixed, 8)["points"]}
    assert own == {(1, 1): 0.011, (1, 4): 0.030, (2, 4): 0.040, (8, 1): 0.020, (8, 4): 0.5}
    assert with_row_clock(prof, {**fixed, "step_seconds": {}}, 8) == prof
    # A plain row whose server's steps trace mode timed prices plain decoding by them, not by the
    # default's plain steps; its verify widths untouched.
    plain = {"method": "plain", "batch_size": 4, "step_seconds": {"1": {"4": 0.026}}}
    own = {(x["width"], x["batch"]): x["step_s"] for x in with_row_clock(prof, plain, 1)["points"]}
    assert own == {(1, 1): 0.011, (1, 4): 0.026, (2, 4): 0.040, (8, 1): 0.020, (8, 4): 0.080}
    # ...and its prefill passes by its own server's, where it timed them (at batch 64 about half a
    # row's time): the profile's otherwise.
    timed = with_row_clock({**prof, "prefill_s_per_token": 0.002, "prefill_s_fixed": 0.1},
                           {**plain, "prefill_s_per_token": 0.0025, "prefill_s_fixed": 0.05}, 1)
    assert (timed["prefill_s_per_token"], timed["prefill_s_fixed"]) == (0.0025, 0.05)
    assert "prefill" in timed["description"]
    kept = with_row_clock({**prof, "prefill_s_per_token": 0.002, "prefill_s_fixed": 0.1},
                          {**plain, "prefill_s_per_token": None}, 1)
    assert (kept["prefill_s_per_token"], kept["prefill_s_fixed"]) == (0.002, 0.1)
    # A row pays every step, the slow ones too: where the result has the means of the clock's timings
    # (step_seconds_mean), they price the steps, not the medians the policy chose by.
    means = [{**r, "step_seconds_mean": {w: {b: 2 * s for b, s in by.items()} for w, by in r["step_seconds"].items()}}
             for r in rows[1:]]
    prof = from_engine_clock({**engine, "rows": [rows[0], *means]})
    assert prof is not None and {(x["width"], x["batch"]): x["step_s"] for x in prof["points"]} == {
        (1, 1): 0.022, (1, 4): 0.060, (2, 4): 0.080, (8, 1): 0.040, (8, 4): 0.160}
    # A bucket whose plain step the policy never ran (it verified every step at batch 64) is priced by
    # the plain row's average there, not from the smaller buckets.
    big = [*rows, {"method": "plain", "batch_size": 64, "step_ms": 120.0},
           {"method": "history_cost", "batch_size": 64, "step_seconds": {"4": {"64": 0.15}}}]
    prof = from_engine_clock({**engine, "rows": big})
    points = {(x["width"], x["batch"]): x["step_s"] for x in prof["points"]}
    assert points[(1, 64)] == 0.120 and points[(1, 4)] == 0.030 and "plain steps at batch 64" in prof["description"]
    assert "prefill_s_per_token" not in prof
    # The prefill passes the clock timed (the latest row's) are charged for the prompt tokens joining
    # a step: a fixed part a pass and a part a token.
    timed = [*rows[:2], {**rows[2], "prefill_s_per_token": 0.0005, "prefill_s_fixed": 0.02}]
    prof = from_engine_clock({**engine, "rows": timed})
    assert prof is not None and prof["prefill_s_per_token"] == 0.0005 and prof["prefill_s_fixed"] == 0.02
    assert "prefill timed" in prof["description"]
    path.write_text(json.dumps(prof))
    assert resolve(str(path)).step_s(1, 1, 0, prefill=200) == pytest.approx(0.011 + 0.02 + 200 * 0.0005)
    assert resolve(str(path)).step_s(1, 1, 0) == pytest.approx(0.011)


def test_the_clock_times_prefill_passes_apart_from_decode_steps():
    """A prefill forward pass is timed from its start to the next forward's, apart from the decode
    steps the policy prices, and priced as a fixed part a pass plus a part per prompt token it
    computes: the line through the passes of each size (the first, a fresh server's warm-up, left
    out; one far slower than the others of its size, an idle engine, too). A pass of a prompt the
    radix cache holds (one token) is a cost, not an outlier of the whole prompts' cost per token.
    The policies that time nothing report none."""
    from histospec_sgl.engine.policy import Fixed, PrefillCost

    ec = EngineControl(d=8)
    assert ec.prefill_cost() is None
    t = 0.0

    def prefill(tokens: int, seconds: float) -> None:
        nonlocal t
        ec.prefill_step(tokens, t)
        t += seconds
        ec.begin(t)

    # 50 ms a pass and 2 ms a token.
    prefill(100, 9.0)
    prefill(100, 0.25)
    # Passes of one size alone: their time per token, no fixed part known.
    assert ec.prefill_cost() == pytest.approx(PrefillCost(0.0, 0.0025))
    for tokens, seconds in ((1, 0.052), (200, 0.45), (100, 50.0), (2, 0.054), (100, 0.25)):
        prefill(tokens, seconds)
    cost = ec.prefill_cost()
    assert cost is not None and cost.fixed_s == pytest.approx(0.05) and cost.per_token_s == pytest.approx(0.002)
    assert cost.seconds(0) == 0.0 and cost.seconds(300) == pytest.approx(0.65)
    assert sum(len(v) for v in ec.clock.prefills.values()) == 5  # the warm-up and the idle one left out
    # A decode step after it is timed as a decode step, not as a prefill.
    ec.decode_step(1, 8, t)
    ec.begin(t + 0.1)
    assert sum(len(v) for v in ec.clock.prefills.values()) == 5 and ec.clock.warmed[8] == 1
    assert Fixed(8).prefill_cost() is None and CostModel(ec.clock, [8]).prefill_cost() is None


def test_a_prompt_the_radix_cache_holds_prefills_one_token():
    """The simulator charges prefill passes for the requests joining a step: a whole prompt for each
    request of a group whose prompt is not cached yet (requests of one pass share nothing, as under
    SGLang's first-come-first-served scheduling), one token for a group's prompt prefilled in an
    earlier pass, on a cache the caller may carry over several runs (a row's batches)."""
    prof = Measured("p", "test: 1 s a step, a prefill pass 0.5 s and 0.01 s a token",
                    {1: [(1, 1.0), (64, 1.0)]}, prefill_s_per_token=0.01, prefill_s_fixed=0.5)
    a1, a2, a3 = (_req(2, group="a") for _ in range(3))
    b = _req(2, group="b")
    # Two slots: a1 and a2 join together (3 + 3 tokens: a pass of 0.56 s, alone: nothing decodes
    # yet), then one decode step; a3 and b join next (1 + 3 tokens: 0.54 s), then one step.
    out = run_step([a1, a2, a3, b], prof, max_running=2, length_first=False)
    assert (out.prefill_tokens, out.prefill_passes) == (10, 2)
    assert out.makespan_s == pytest.approx(0.56 + 1 + 0.54 + 1)
    # A cache that holds both prompts already: one token each.
    cache = PrefixCache()
    run_step([a1, b], prof, max_running=2, length_first=False, cache=cache)
    assert cache.groups == {"a", "b"}
    again = run_step([a1, b], prof, max_running=2, length_first=False, cache=cache)
    assert (again.prefill_tokens, again.prefill_passes) == (2, 1)
    # Two passes of at most 4 tokens: a1 and a2 take 3 + 1 (a2 cut), then a2's last token (a1's
    # prompt, cached, covers the rest).
    cut = run_step([a1, a2], prof, max_running=2, length_first=False, prefill_chunk=4)
    assert (cut.prefill_tokens, cut.prefill_passes) == (5, 2)
    assert cut.makespan_s == pytest.approx(0.54 + 0.51 + 1)


def test_prefill_passes_match_prefixes_and_cut_at_the_chunk_as_sglang_schedules_them():
    """Requests joining at once, with their prompts' token ids: a prompt shares its chat template
    with another prompt prefilled before, so only the rest is computed; passes are cut at the
    chunk; under the overlap scheduler what a pass prefilled is cached only for the pass after the
    next (its results are processed after the next pass is formed), a cut request's prefix at once.
    SGLang counted 2880 and 10185 prompt tokens prefilled for rows of this shape (batch 8 and 64 of
    a trace step, 2048-token chunks), which the overlap rule gives (2880, 10241) and the other does
    not (2609, 8195)."""
    template = tuple(range(100, 110))

    def req(group: str, body: tuple[int, ...]) -> SimRequest:
        prompt = template + body
        return SimRequest(group, 4, prompt_len=len(prompt), prompt=prompt)

    a = [req("a", (1, 2, 3, 4, 5)) for _ in range(3)]  # 15 tokens each
    b = [req("b", (7, 8, 9)) for _ in range(2)]  # 13 each
    cache = PrefixCache()
    # No chunk: one pass, every request computing its whole prompt (they share nothing in a pass).
    assert prefill_passes(a, cache) == [45]
    # Group b then shares the template: 3 tokens each; a group-a request now computes one.
    assert prefill_passes([*b, a[0]], cache) == [3 + 3 + 1]
    # 20-token chunks on a fresh cache: a[0] and 5 of a[1] (cut); a[1]'s other 10 (its prefix so far
    # cached, a[0]'s prompt too without the overlap scheduler: then 1), then a[2] and b.
    assert prefill_passes([*a, *b], PrefixCache(), chunk=20) == [20, 1 + 1 + 3 + 3]
    # Under the overlap scheduler a[0]'s prompt is not cached yet when the second pass is formed:
    # a[1]'s other 10 and a[2]'s 10 past a[1]'s cut prefix fill it; b then finds the template.
    assert prefill_passes([*a, *b], PrefixCache(), chunk=20, overlap=True) == [20, 10 + 10, 3 + 3]
    # Known by group alone (no token ids): a whole prompt, then one token once the group's is cached.
    c = SimRequest("c", 4, prompt_len=6)
    cache = PrefixCache()
    assert prefill_passes([c, c], cache) == [12] and prefill_passes([c], cache) == [1]


def test_shadow_draft_measures_what_verifying_would_have_accepted():
    from histospec_sgl.engine.costmodel import ShadowDraft

    # Root 5 with children 7 (node 1) and 8 (node 2); 7 -> 9 (node 3) -> 4 (node 4); 8 -> 6 (node 5).
    # By path probability: 7, 9, 8, 4, 6 (ranks 0..4), so the width-3 draft is {7, 9}, width 4 adds 8.
    tree = dict(tokens=[5, 7, 8, 9, 6, 4], parents=[0, 0, 0, 1, 2, 3], ranks=[-1, 0, 2, 1, 4, 3],
                promised={2: 0.9, 3: 1.6, 6: 2.5})
    s = ShadowDraft(**tree)
    assert not s.advance([7]) and s.accepted(6) == 1  # still on the tree
    assert not s.advance([9]) and s.accepted(6) == 2
    assert s.advance([4, 1]) and s.accepted(6) == 3  # node 4 is a leaf: the walk ends there
    # The narrower drafts are its most probable nodes: width 3 holds 7 -> 9, width 2 only 7.
    assert [s.accepted(w) for w in (2, 3, 4, 5)] == [1, 2, 2, 3]
    s = ShadowDraft(**tree)
    assert s.advance([8, 6]) and s.accepted(6) == 2  # the other branch, down to its leaf
    assert [s.accepted(w) for w in (2, 3, 4, 5, 6)] == [0, 0, 1, 1, 2]
    s = ShadowDraft(**tree)
    assert s.advance([8, 9]) and s.accepted(6) == 1  # 9 is not 8's child
    s = ShadowDraft(**tree)
    assert s.advance([3]) and s.accepted(6) == 0 and s.accepted(2) == 0


class _Recorder:
    """A step policy that records what it is fed."""

    widths = (4,)
    reads_promises = True

    def __init__(self) -> None:
        self.seen: list[tuple] = []
        self.batches: list[int | None] = []

    def calibration(self, klass=None, width=None, batch=None) -> float:
        return {"greedy": 2.0, "sampled": 0.5}.get(klass, 1.0)

    def observe(self, promised, accepted, requests=0, *, shadow=False, klass=None, width=None,
                beside=False, batch=None) -> None:
        self.seen.append((promised, accepted, shadow, klass, width) + ((True,) if beside else ()))
        self.batches.append(batch)


def test_feedback_prices_by_class_observes_verified_steps_and_follows_one_shadow_a_request():
    from histospec_sgl.engine.feedback import Feedback, KnownShadow

    rec = _Recorder()
    fb = Feedback(rec, 4)
    # Each request's promise times its class's calibration at the width: summed, and the least.
    assert fb.promises({4: np.array([1.0, 1.0, 2.0])}, ["greedy", "sampled", None]) == {4: (2.0 + 0.5 + 2.0, 0.5)}
    assert fb.promises({4: np.array([1.0, 3.0])}, None) == {4: (4.0, 1.0)}  # no classes: as they are
    # A verified step is observed by class, after the next one was drafted; a plain one measures nothing.
    fb.drafted(4, [0.5, 1.0], ["greedy", "sampled"])
    fb.drafted(1, [0.0, 0.0], ["greedy", "sampled"])
    fb.verified([1, 0])
    fb.verified([0, 0])
    assert rec.seen == [(0.5, 1, False, "greedy", 4), (1.0, 0, False, "sampled", 4)]
    assert rec.batches == [2, 2]  # the size of the batch drafted, for a calibration per batch size
    rec.seen.clear()
    rec.batches.clear()
    # One shadow per request at a time, observed when its walk ends (2 accepted: the third token misses).
    fb.shadow("a", KnownShadow({4: 2.0}, {4: 2}, 4), "sampled", batch=3)
    assert fb.shadowing("a") and not fb.shadowing("b")
    fb.advanced("a", [7, 8])
    assert rec.seen == []
    fb.advanced("a", [9])
    assert rec.seen == [(2.0, 2, True, "sampled", 4)] and rec.batches == [3] and not fb.shadowing("a")
    # A request that ends on its draft counts as far as it got; one dropped (rewound) counts nothing.
    fb.shadow("b", KnownShadow({4: 1.0}, {4: 5}, 4), None)
    fb.advanced("b", [1, 2])
    fb.finished("b")
    fb.shadow("c", KnownShadow({4: 1.0}, {4: 5}, 4), None)
    fb.finished("c", complete=False)
    assert rec.seen[1:] == [(1.0, 2, True, None, 4)]
    rec.seen.clear()
    # One walk measures every width it names: its walk ends after the most any width accepts; the
    # width the plain step's policy named counts in the class's calibration, the others beside it.
    fb.shadow("d", KnownShadow({2: 0.5, 4: 1.5, 8: 2.5}, {2: 1, 4: 1, 8: 3}, 4), "greedy", batch=2)
    fb.advanced("d", [1, 2])
    assert fb.shadowing("d")
    fb.advanced("d", [3, 4])
    assert sorted(rec.seen) == [(0.5, 1, True, "greedy", 2, True), (1.5, 1, True, "greedy", 4),
                                (2.5, 3, True, "greedy", 8, True)]
    rec.seen.clear()
    # Beside a verified step (no width named) every width speaks for itself only.
    fb.shadow("e", KnownShadow({2: 0.5, 8: 2.5}, {2: 0, 8: 0}, None), "greedy", batch=2)
    fb.advanced("e", [1])
    assert sorted(rec.seen) == [(0.5, 0, True, "greedy", 2, True), (2.5, 0, True, "greedy", 8, True)]


def test_simulator_follows_plain_steps_drafts_as_the_engine_does():
    """Where verifying never pays, the simulated engine decodes plainly and follows its drafts as
    shadow drafts one at a time, each until its walk ends: 3 accepted, so one observation per 4
    tokens, not one per plain step."""
    prof = Measured("slow-verify", "test", {1: [(1, 1.0)], 4: [(1, 100.0)]})
    n = 200
    r = SimRequest("g", n, prompt_len=3, accepted={4: np.full(n, 3, np.int32)},
                   promised={4: np.full(n, 2.0, np.float32)})
    ec = EngineControl(4, widths=(4,))
    seen: list[tuple[float, float]] = []
    observe = ec.observe

    def spy(promised, accepted, requests=0, *, shadow=False, klass=None, width=None, beside=False, batch=None):
        if shadow:
            seen.append((promised, accepted))
        observe(promised, accepted, requests, shadow=shadow, klass=klass, width=width, beside=beside, batch=batch)

    ec.observe = spy  # type: ignore[method-assign]
    out = run_step([r], prof, max_running=1, length_first=False, policy=ec)
    plain = out.widths[1]
    assert plain > 150
    assert abs(len(seen) - plain / 4) <= 2, (len(seen), plain)
    assert all(s == (2.0, 3) for s in seen[:-1])


def test_a_narrower_verified_step_measures_the_widest_beside_it():
    """A step verified at a narrower width follows its widest draft beside it, counted at that
    width only: the widest width, whose promise understates its acceptance (3.2 promised, 7
    accepted), keeps being measured while width 4 is chosen, and takes over once it shows it pays.
    Without it, width 8 is run only when its cost is remeasured (every 128 steps, and only while it
    comes within 20% of the best)."""
    ec = EngineControl(8, widths=(4, 8))
    ec.observe(3.0, 1.0, klass="sampled", width=4)
    ec.observe(10.0, 7.0, shadow=True, klass="sampled", width=8, beside=True)
    assert ec.model.classes[("sampled", 8)] == [10.0, 7.0] and ec.model.classes["sampled"] == [3.0, 1.0]
    assert (ec.model.promised, ec.model.accepted) == (3.0, 1.0)

    # The simulated engine, its width-8 calibration left low by an earlier phase (64 promised, none
    # accepted), width 4's measured: it verifies at 4, and the drafts at 8 beside it show them pay.
    prof = Measured("wide-pays", "test", {1: [(1, 1.0)], 4: [(1, 1.5)], 8: [(1, 2.0)]})
    n = 1200
    r = SimRequest("g", n, prompt_len=3, accepted={4: np.full(n, 3, np.int32), 8: np.full(n, 7, np.int32)},
                   promised={4: np.full(n, 3.0, np.float32), 8: np.full(n, 3.2, np.float32)})
    ec = EngineControl(8, widths=(4, 8))
    ec.model.classes.update({("sampled", 8): [64.0, 0.0], ("sampled", 4): [64.0, 64.0], "sampled": [128.0, 64.0]})
    out = run_step([r], prof, max_running=1, length_first=False, policy=ec)
    assert out.widths.get(8, 0) > out.widths.get(4, 0), out.widths


def test_a_batch_size_bucket_calibrates_its_own_promises_drawn_towards_its_widths():
    """Requests in a batch of 64 accept less of what their drafts promise than one running alone
    (measured: 0.79-0.87 of it at width 2 in the trace bench's batch-64 rows, 1.04-1.17 at batch 1).
    A bucket's calibration starts at its width's and moves to what the bucket measures."""
    cm = CostModel.measuring_shadows(FLAT, [4])
    for _ in range(20):  # batch 1: whole promises kept
        cm.observe(10.0, 10.0, klass="sampled", width=4, batch=1)
    assert cm.calibration("sampled", 4, batch=64) == pytest.approx(1.0)  # nothing measured at 64 yet
    cm.observe(16.0, 8.0, klass="sampled", width=4, batch=64)
    # A little measured at 64: drawn towards the width's (64 promised tokens' worth of it).
    assert cm.calibration("sampled", 4, batch=64) == pytest.approx((8 + 64 * cm.calibration("sampled", 4)) / (16 + 64))
    for _ in range(30):
        cm.observe(16.0, 8.0, klass="sampled", width=4, batch=64)
    # Much measured at 64: close to its own 0.5; batch 1 and the buckets between keep the width's.
    assert 0.5 < cm.calibration("sampled", 4, batch=64) < 0.6
    assert cm.calibration("sampled", 4, batch=1) > 0.9
    assert cm.calibration("sampled", 4, batch=8) == pytest.approx(cm.calibration("sampled", 4))
    # A class measured at no batch size falls back to the overall ratio, at every bucket.
    assert cm.calibration("greedy", 4, batch=64) == pytest.approx(cm.calibration())


def test_calibration_forgets_and_the_engine_never_probes():
    cm = CostModel(FLAT, [4], forget_after=100.0)
    cm.observe(promised=80.0, accepted=80.0)
    cm.observe(promised=20.0, accepted=0.0)  # 100 promised: both halve
    assert (cm.promised, cm.accepted) == (50.0, 40.0)
    for _ in range(10):
        cm.observe(promised=40.0, accepted=0.0)
    assert cm.calibration() < 0.05  # the old 80% is forgotten
    # The simulator's cost model probes one step in probe_every; the engine's never does.
    probing = CostModel(FLAT, [4], probe_every=3)
    assert [probing.choose({4: 0.0}, batch=2, context=0) for _ in range(8)] == [1, 1, 1, 4, 1, 1, 1, 4]
    ec = EngineControl(d=4)
    for w in (1, 2, 4):
        _time_steps(ec, 2, w, 1.0)
    assert ec.model.probe_every == 0
    assert {ec.choose({ec.d: 0.0}, 2) for _ in range(100)} == {1}


def test_drafter_measures_the_drafts_of_plain_steps():
    from histospec_sgl.engine.config import HistoryConfig
    from histospec_sgl.engine.drafter import BatchDrafter

    d = 4
    dr = BatchDrafter(d, HistoryConfig(control="cost"))
    for _ in range(3):
        dr.add_finished([1, 2, 3], list(range(10, 40)))
    dr.sync("a", [1, 2, 3], [10, 11])
    dr.sync("b", [1, 2, 3], [10, 11])
    assert isinstance(dr.policy, EngineControl)
    for w in dr.policy.widths:
        _time_steps(dr.policy, 2, w, 100.0)  # verifying never pays: every step is plain
    _time_steps(dr.policy, 2, 1, 1.0)
    dr.draft(["a", "b"])
    assert not dr.drafting
    dr.observe_step([0, 0])
    model = dr.policy.model
    assert model.promised == 0  # nothing measured yet: the shadow drafts 12, 13, 14 are pending
    # "a" samples the drafted 12, 13, 14 (the draft's end: 3 accepted), "b" 12 then 99 (1 accepted).
    dr.sync("a", [1, 2, 3], [10, 11, 12])
    dr.sync("b", [1, 2, 3], [10, 11, 12])
    dr.draft(["a", "b"])  # the shadows are already taken: no new ones while they walk
    dr.sync("a", [1, 2, 3], [10, 11, 12, 13, 14])
    dr.sync("b", [1, 2, 3], [10, 11, 12, 99])
    assert model.accepted == 4 and model.promised > 0
    promised = model.promised
    # A request's shadow that is still on its draft when the request ends counts as far as it got.
    dr.draft(["a", "b"])  # a new shadow for "a" (15, 16, 17); "b" (after 99) has no draft
    dr.finish("b", [10, 11, 12, 99])
    dr.finish("a", [10, 11, 12, 13, 14, 15])  # one of three drafted tokens, then the end
    assert model.accepted == 5 and model.promised > promised


def test_a_greedy_request_is_promised_its_majority_chain():
    """A sampled request's width-w promise is the sum of its w - 1 most probable nodes' path
    probabilities; a greedy one's counts those of them on its majority chain (each node more probable
    than its drafted siblings together, its parent on the chain), which a repeated greedy response
    fills and a split history does not. Written against the index's real drafts."""
    from histospec_sgl._core import HistoryIndex
    from histospec_sgl.engine.draft import tree_mask
    from histospec_sgl.engine.plan import width_promises

    d = 8
    prompt = list(range(100, 120))
    repeat = list(range(500, 540))
    split = [[900 + k, *range(600 + 40 * k, 640 + 40 * k)] for k in range(4)]  # 4 different first tokens
    idx = HistoryIndex()
    idx.add_response(1, prompt, repeat)
    for r in split:
        idx.add_response(2, prompt, r)
    idx.begin_request(1, 1, [*prompt, *repeat[:10]])
    idx.begin_request(2, 2, prompt)
    tokens = np.zeros(2 * d, np.int64)
    mask = np.zeros(2 * d * d, np.int64)
    probs = np.zeros(2 * d, np.float32)
    counts = np.zeros(2, np.int64)
    idx.draft_batch(np.array([1, 2], np.int64), d, tokens, mask, probs, counts)
    p = probs.reshape(2, d).astype(np.float64)
    # The repeated response: one chain, each node well under its parent's probability.
    assert tokens[1:d].tolist() == repeat[10:17] and p[0, 1] < 0.9 and p[0, d - 1] < 0.2
    order, sampled = width_promises(probs.reshape(2, d))
    assert sampled[:, 2] == pytest.approx(np.sort(p[:, 1:], axis=1)[:, ::-1][:, :3].sum(axis=1))
    _, greedy = width_promises(probs.reshape(2, d), mask, np.array([True, True]))
    assert greedy[0].tolist() == [1, 2, 3, 4, 5, 6, 7]
    # The split one: four first tokens, none more probable than the others together, so nothing on
    # the chain.
    assert sorted(tokens[d + 1:d + 5].tolist()) == [900, 901, 902, 903] and greedy[1].tolist() == [0] * (d - 1)
    _, mixed = width_promises(probs.reshape(2, d), mask, np.array([True, False]))
    assert mixed[0].tolist() == greedy[0].tolist() and mixed[1] == pytest.approx(sampled[1])
    # A hand-made tree: the chain goes through each node more probable than its siblings together.
    par = [-1, 0, 1, 2, 1, 0]
    pr = np.array([[1.0, 0.8, 0.5, 0.45, 0.2, 0.1]])
    _, c = width_promises(pr, tree_mask(par, 6).reshape(-1), np.array([True]))
    assert c[0].tolist() == [1, 2, 3, 3, 3]  # nodes 1 (over 5), 2 (over 4), 3 (an only child); not 4 nor 5


def test_a_greedy_chain_behind_a_short_match_promises_less():
    """A greedy request's chain weighs the match behind it (``sure``): a chain drafted after a
    one-token match promises a few tokens, one after a longer match more, and a repeated response
    (one occurrence behind a long match) nearly its whole chain; without ``sure`` all three promise
    w - 1. Written against the index's real drafts."""
    from histospec_sgl._core import HistoryIndex
    from histospec_sgl.engine.plan import sure_conditional, width_promises

    d = 8
    prompt, repeat = list(range(100, 120)), list(range(500, 540))
    own = list(range(7, 18))  # a prompt whose tokens the response starts to repeat
    idx = HistoryIndex()
    idx.add_response(1, prompt, repeat)
    idx.begin_request(1, 1, [*prompt, *repeat[:10]])  # the repeated response
    idx.begin_request(2, 2, own)
    idx.extend_request(2, [3, 9])  # one token (9) matched
    idx.begin_request(3, 3, own)
    idx.extend_request(3, [3, 8, 9, 10])  # three tokens matched
    tokens, mask = np.zeros(3 * d, np.int64), np.zeros(3 * d * d, np.int64)
    probs, counts = np.zeros(3 * d, np.float32), np.zeros(3, np.int64)
    idx.draft_batch(np.array([1, 2, 3], np.int64), d, tokens, mask, probs, counts)
    assert counts.tolist() == [d - 1] * 3  # three full chains (root excluded)
    greedy = np.array([True] * 3)
    _, whole = width_promises(probs.reshape(3, d), mask, greedy)
    assert whole[:, -1].tolist() == [d - 1] * 3
    sure = sure_conditional(idx.draft_config())
    assert sure == pytest.approx(0.425)
    _, weighed = width_promises(probs.reshape(3, d), mask, greedy, sure)
    repeated, short, longer = weighed[:, -1]
    assert repeated > 0.85 * (d - 1) and short < 0.35 * (d - 1) and short < longer < repeated
    assert np.all(weighed <= whole + 1e-9) and np.all(np.diff(weighed, axis=1) >= 0)


def test_narrow_drafts_keep_the_most_probable_subtree():
    """A width-w draft is the d-node draft's root and its w - 1 most probable nodes: a subtree (every
    kept node's parent kept), in BFS order, with the contract SGLang checks, the same tokens, and the
    promise the cost model priced (the sum of the kept nodes' path probabilities)."""
    from _contract import check_contract
    from _samples import humaneval

    from histospec_sgl.engine.config import HistoryConfig
    from histospec_sgl.engine.draft import tree_parents_batch
    from histospec_sgl.engine.drafter import BatchDrafter, narrow

    d = 8
    dr = BatchDrafter(d, HistoryConfig(control="fixed"))
    tasks = humaneval(4)
    for prompt, samples in tasks:
        for s in samples[:6]:
            dr.add_finished(prompt, s)
    rids = []
    for t, (prompt, samples) in enumerate(tasks):
        rid = f"r{t}"
        dr.sync(rid, prompt, samples[6][:5])
        rids.append(rid)
    bs = len(rids)
    probs = np.zeros(bs * d, dtype=np.float32)
    tokens = np.zeros(bs * d, dtype=np.int64)
    mask = np.zeros(bs * d * d, dtype=np.int64)
    counts = np.zeros(bs, dtype=np.int64)
    iids = np.array([dr._live[r].iid for r in rids], dtype=np.int64)
    dr.index.draft_batch(iids, d, tokens, mask, probs, counts)
    assert counts.min() >= 3, counts  # real trees to cut
    p = probs.reshape(bs, d)[:, 1:]
    order = np.argsort(-p, axis=1, kind="stable")
    parents = tree_parents_batch(mask, d)
    roots = tokens.reshape(bs, d)[:, 0].tolist()
    for w in (2, 3, 4, 8):
        tw, mw = narrow(tokens, mask, order, bs, d, w)
        check_contract(tw, mw, roots, w)
        pw = tree_parents_batch(mw, w)
        for b in range(bs):
            keep = [0, *sorted(int(i) + 1 for i in order[b, : w - 1])]
            assert tw.reshape(bs, w)[b].tolist() == tokens.reshape(bs, d)[b, keep].tolist()
            # The kept nodes' parents, mapped back, are the original parents: a subtree.
            assert [keep[int(x)] for x in pw[b, 1:]] == [int(parents[b, i]) for i in keep[1:]]
            kept = sorted(p[b], reverse=True)[: w - 1]
            assert abs(sum(kept) - sum(p[b, i - 1] for i in keep[1:])) < 1e-6


def test_engine_control_picks_the_width_that_pays():
    """Several widths, each priced at its own measured step cost and its own promise: the choice is
    the most tokens per second, which moves to narrower widths as the wide step's cost grows."""
    ec = EngineControl(d=8)
    assert ec.widths == (2, 4, 8)
    promised = {2: 3.6, 4: 6.0, 8: 7.0}  # 4 requests: the best node 0.9 each, the next two 0.6, ...
    for costs, want in (({2: 1.1, 4: 1.3, 8: 1.2}, 8), ({2: 1.1, 4: 1.3, 8: 1.6}, 4),
                        ({2: 1.1, 4: 1.6, 8: 3.0}, 2), ({2: 2.5, 4: 3.0, 8: 3.5}, 1)):
        for w, c in ((1, 1.0), *costs.items()):
            ec.clock.samples.pop((w, 4), None)
            _time_steps(ec, 4, w, c)
        rates = {1: 4 / 1.0, **{w: (4 + promised[w]) / c for w, c in costs.items()}}
        assert max(rates, key=rates.get) == want
        assert ec.choose(promised, 4) == want
    # Drafts that promise nothing: plain decoding.
    assert ec.choose({2: 0.0, 4: 0.0, 8: 0.0}, 4) == 1
    assert "w2" in ec.summary() and "w8" in ec.summary()


def test_greedy_and_sampled_requests_are_calibrated_apart():
    """After sampled steps that accept a fifth of what the drafts promise, greedy requests whose drafts
    are accepted whole still draft: each class has its own calibration, and the drafter weighs each
    request's promise by its class's."""
    from histospec_sgl.engine.config import HistoryConfig
    from histospec_sgl.engine.drafter import BatchDrafter

    d = 8
    dr = BatchDrafter(d, HistoryConfig(control="cost"))
    ec = dr.policy
    assert ec is not None
    for _ in range(20):
        ec.observe(promised=10.0, accepted=2.0, klass="sampled")
        ec.observe(promised=10.0, accepted=10.0, klass="greedy")
    assert ec.calibration("sampled") == pytest.approx(0.2) and ec.calibration("greedy") == pytest.approx(1.0)
    # A class with nothing measured takes the overall calibration.
    assert ec.calibration("new") == pytest.approx(ec.model.calibration())
    for _ in range(3):
        dr.add_finished([1, 2, 3], list(range(10, 40)))
    dr.sync("g", [1, 2, 3], [10, 11])
    dr.sync("s", [1, 2, 3], [10, 11])
    # A verify step costs 1.5 plain steps at every width: worth it for drafts that deliver half a
    # token a request or more (this one promises about 1.4).
    for w in (2, 4, 8):
        _time_steps(ec, 1, w, 1.5)
    _time_steps(ec, 1, 1, 1.0)
    dr.draft(["g"], ["greedy"])
    assert dr.width > 1, "greedy drafts are trusted"
    dr.observe_step([dr.width - 1])
    dr.draft(["s"], ["sampled"])
    assert dr.width == 1, "sampled drafts, accepted at a fifth of their promise, do not pay"


def test_a_greedy_chain_behind_a_short_match_is_calibrated_apart():
    """A repeated greedy response (a long match) and a first pass's chain behind a one-token match are
    both greedy, but their chains are not alike: the short one's class is ``greedy-short``, and its
    low acceptance does not lower what the repeated response's drafts are trusted with."""
    from histospec_sgl.engine.config import HistoryConfig
    from histospec_sgl.engine.drafter import BatchDrafter
    from histospec_sgl.engine.plan import SHORT_GREEDY

    d = 8
    dr = BatchDrafter(d, HistoryConfig(control="cost"))
    ec = dr.policy
    for w in (2, 4, 8):
        _time_steps(ec, 1, w, 1.5)
        _time_steps(ec, 2, w, 1.5)
    _time_steps(ec, 1, 1, 1.0)
    _time_steps(ec, 2, 1, 1.0)
    dr.add_finished([1, 2, 3], list(range(10, 40)))
    first_prompt = list(range(50, 70))
    dr.sync("first", first_prompt, [155, 55])  # ...55: one token matched in its own prompt
    for step in range(16):
        dr.sync("again", [1, 2, 3], list(range(10, 12 + step)))  # repeating the history: a long match
        dr.draft(["again", "first"], ["greedy", "greedy"])
        if dr.width > 1:
            dr.observe_step([dr.width - 1, 0])  # the repeated response accepted whole, the first pass nothing
    assert ec.calibration("greedy", d) > 0.8
    assert ec.calibration(SHORT_GREEDY, d) < 0.2
    # The first pass alone does not pay; the repeated response alone does.
    dr.draft(["first"], ["greedy"])
    assert dr.width == 1
    dr.sync("again", [1, 2, 3], list(range(10, 25)))
    dr.draft(["again"], ["greedy"])
    assert dr.width > 1


def _bfs_trees(draw, d: int) -> tuple[list[int], np.ndarray]:
    """A draft tree in BFS order (parents non-decreasing: children of earlier nodes come first) with
    path probabilities that tie (a child as probable as its parent, siblings alike), halve, or sit one
    float32 step above the parent's (rounding), and a chain of probability-0 pads at its end."""
    from hypothesis import strategies as st

    pads = draw(st.integers(0, d - 2))
    parents, probs = [-1], [1.0]
    for i in range(1, d):
        if i >= d - pads:
            parents.append(i - 1 if i > d - pads else draw(st.integers(parents[-1] if i > 1 else 0, i - 1)))
            probs.append(0.0)
            continue
        par = draw(st.integers(parents[-1] if i > 1 else 0, i - 1))
        base = probs[par] if par else 1.0
        kind = draw(st.sampled_from(["tie", "half", "rounding", "any"]))
        p = {"tie": base, "half": base / 2, "rounding": float(np.nextafter(np.float32(base), np.float32(2))),
             "any": base * draw(st.floats(0.01, 1.0))}[kind]
        parents.append(par)
        probs.append(p)
    return parents, np.array(probs, dtype=np.float32)


def test_narrowing_never_keeps_a_node_without_its_parent():
    """Property: at every width, a draft's root and its w - 1 most probable nodes (as the drafter and
    its shadows narrow them) form a subtree with the d-node draft's own parent links, for trees whose
    nodes tie with their parents, halve, or exceed them by a float32 rounding step, greedy and sampled."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from histospec_sgl.engine.draft import tree_mask, tree_parents_batch
    from histospec_sgl.engine.drafter import narrow
    from histospec_sgl.engine.plan import width_promises

    @st.composite
    def batches(draw):
        d = draw(st.integers(2, 12))
        trees = [_bfs_trees(draw, d) for _ in range(draw(st.integers(1, 4)))]
        return d, trees, draw(st.lists(st.booleans(), min_size=len(trees), max_size=len(trees)))

    @settings(max_examples=300, deadline=None)
    @given(batches())
    def check(batch):
        d, trees, greedy = batch
        bs = len(trees)
        mask = np.concatenate([tree_mask(par, d).reshape(-1) for par, _ in trees]).astype(np.int64)
        probs = np.stack([p for _, p in trees])
        tokens = np.arange(bs * d, dtype=np.int64) + 100  # distinct: a kept node is found by its token
        order, _ = width_promises(probs, mask, np.array(greedy))
        for w in range(2, d + 1):
            tw, mw = narrow(tokens, mask, order, bs, d, w)
            pw = tree_parents_batch(mw, w)
            for b, (par, _) in enumerate(trees):
                kept = (tw.reshape(bs, w)[b] - 100 - b * d).tolist()
                assert kept[0] == 0 and kept == sorted(kept)
                for j in range(1, w):
                    assert par[kept[j]] in kept, (w, kept, par)  # its parent is kept ...
                    assert kept[pw[b, j]] == par[kept[j]]  # ... and is its parent in the narrowed mask

    check()


def test_trace_rows_run_the_requests_their_result_records():
    """A trace row's requests: batches of its size up to ``--sampled-requests``, and at batch 1 as many
    one at a time (at least 4); ``simulate --check`` re-runs a row with the count its result records,
    4 at batch 1 in results from before they recorded it."""
    from histospec_sgl.simulate.trace import SINGLE_REPEATS, row_requests, single_requests

    assert [single_requests(n) for n in (1, 4, 16)] == [4, 4, 16]
    assert [row_requests(b, 16, single_requests(16)) for b in (1, 8, 64, 12)] == [16, 16, 64, 24]
    assert row_requests(1, 16) == SINGLE_REPEATS == 4


def test_a_fixed_width_engine_times_its_steps_as_the_default_does():
    """``HISTOSPEC_CONTROL=fixed`` runs every step at d and times them on the default's clock, so that
    a fixed-width server's step costs can be read beside a default one's; the simulator's ``Fixed``
    times nothing."""
    from histospec_sgl.engine.costmodel import TimedFixed
    from histospec_sgl.engine.policy import Fixed

    p = TimedFixed(4)
    assert p.choose({4: 0.0}, 8) == 4 and p.widths == (4,)
    t = 100.0
    for _ in range(4):  # decode steps of 8 requests, 0.2 s each, then a prefill of 300 tokens
        p.begin(t)
        p.decode_step(8, 4, t)
        t += 0.2
    p.begin(t)
    p.prefill_step(300, t)
    p.begin(t + 0.5)
    assert set(p.step_costs()) == {(4, 8)} and abs(p.step_costs()[(4, 8)] - 0.2) < 1e-9
    # The last step of requests that all finished is followed by an idle engine until the next ones
    # come: that gap is not a step's cost, and the worker says so (``after_idle``).
    for _ in range(3):
        p.decode_step(8, 4, t)
        p.begin(t + 30.0, after_idle=True)
        t += 31.0
    assert abs(p.step_costs()[(4, 8)] - 0.2) < 1e-9 and abs(p.step_costs(mean=True)[(4, 8)] - 0.2) < 1e-9
    assert Fixed(4).step_costs() == {} and Fixed(4).prefill_cost() is None


def test_draft_nodes_past_a_requests_cap_promise_nothing_and_their_acceptance_does_not_count():
    """A request with ``max_new_tokens`` left for r more drafts (``room``) can use no node deeper than
    r: such nodes promise nothing, a narrower width keeps the nodes it can use, the tokens SGLang's
    verify reports past its cap are cut off before they calibrate, and a repeated greedy response that
    near its cap is verified at a narrower width, still calibrated as a whole chain."""
    from histospec_sgl.engine.config import HistoryConfig
    from histospec_sgl.engine.draft import tree_mask
    from histospec_sgl.engine.drafter import BatchDrafter
    from histospec_sgl.engine.feedback import Feedback
    from histospec_sgl.engine.plan import SHORT_GREEDY, greedy_classes, width_promises
    from histospec_sgl.engine.remaining import room

    assert room([64, None, 10], [60, 5, 10]).tolist() == [3.0, math.inf, 0.0]
    assert room([None, None], [1, 2]) is None and room(None, [1]) is None
    # A chain 1-2-3-4 with a side branch: 5 under the root (7 under it), 6 under node 1.
    par = [-1, 0, 1, 2, 3, 0, 1, 5]
    pr = np.array([[1.0, 0.9, 0.8, 0.7, 0.6, 0.05, 0.1, 0.04]])
    mask = tree_mask(par, 8).reshape(-1)
    order, whole = width_promises(pr, mask)
    assert (order[0, :3] + 1).tolist() == [1, 2, 3]
    for r in (math.inf, 7.0):
        o, c = width_promises(pr, mask, room=np.array([r]))
        assert o.tolist() == order.tolist() and c.tolist() == whole.tolist()
    order2, two = width_promises(pr, mask, room=np.array([2.0]))
    assert (order2[0, :3] + 1).tolist() == [1, 2, 6]  # width 4 keeps the nodes it can use
    assert two[0, -1] == pytest.approx(0.9 + 0.8 + 0.05 + 0.1 + 0.04)
    _, greedy = width_promises(pr, mask, np.array([True]), room=np.array([2.0]))
    assert greedy[0].tolist() == [1, 2, 2, 2, 2, 2, 2]
    # A chain cut by its room is a whole one as far as the request can go: not a short match's.
    assert greedy_classes(["greedy"], np.array([True]), greedy, np.array([2.0])) == ["greedy"]
    assert greedy_classes(["greedy"], np.array([True]), greedy) == [SHORT_GREEDY]

    rec = _Recorder()
    fb = Feedback(rec, 4)
    fb.drafted(4, [1.0, 2.0], ["greedy", "greedy"], np.array([1.0, math.inf]))
    fb.verified([3, 3])  # SGLang counts 3 for both; the first request ended after 1 of them
    assert rec.seen == [(3.0, 4, False, "greedy", 4)]

    d = 8
    dr = BatchDrafter(d, HistoryConfig(control="cost"))
    ec = dr.policy
    for w, s in ((1, 1.0), (2, 1.2), (4, 1.4), (8, 2.0)):
        _time_steps(ec, 1, w, s)
    prompt, answer = [1, 2, 3], list(range(10, 50))
    dr.add_finished(prompt, answer)
    for known in (2, 10, 18, 26):  # repeating the history: 7 drafts and the step's token a step
        dr.sync("again", prompt, answer[:known])
        dr.draft(["again"], ["greedy"], caps=[37])
        assert dr.width == d
        dr.observe_step([d - 1])
    # Three tokens left under its cap: 2 drafts and the step's own token; width 4 holds them, at the
    # greedy chain's calibration.
    dr.sync("again", prompt, answer[:34])
    dr.draft(["again"], ["greedy"], caps=[37])
    assert dr.width == 4
    dr.observe_step([3])  # SGLang counts all 3; the request used 2
    assert ec.calibration("greedy", 4, 1) == pytest.approx(1.0)
    for cap, width in ((36, 2), (35, 1)):  # one draft token left: width 2; none: a plain step
        dr.draft(["again"], ["greedy"], caps=[cap])
        assert dr.width == width
