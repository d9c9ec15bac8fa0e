"""The draft source of the HISTORY worker (:class:`histospec_sgl.engine.drafter.BatchDrafter`, no SGLang
needed) on real HumanEval completions: the draft contract, sibling drafting, batched syncing, the
request lifecycle, plain steps, the step policies, history in and out; and ``histospec-sgl bench
worker``, which times it.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import numpy as np
import pytest
from _contract import check_contract
from _samples import humaneval

from histospec_sgl.engine.config import HistoryConfig
from histospec_sgl.engine.drafter import BatchDrafter
from histospec_sgl.engine.policy import Fixed, StepPolicy

#: Every step drafts at width d (the cost model chooses by the step times the engine's worker
#: measures, which these tests do not feed).
FIXED = HistoryConfig(control="fixed")

# -- the draft source ------------------------------------------------------------------------------


def test_a_finished_request_is_completed_in_one_place():
    """``BatchDrafter.complete``, what the SGLang worker, the replay and the benchmarks do with a
    finished request: kept in place; added afresh when the index never saw it or holds tokens past
    its end (a step that accepted past a stop); nothing on an abort; with a publisher (a draft
    server), published and let go, its copy coming back through the subscription."""
    from histospec_sgl import group_key

    prompt = [1, 2, 3]
    g = group_key(prompt)
    dr = BatchDrafter(8, FIXED)

    def history() -> list[list[int]]:
        return [r for _, r, _ in dr.index.responses(g)] if g in dr.index.group_keys() else []

    dr.sync("kept", prompt, [10, 11])
    dr.complete("kept", prompt, [10, 11, 12])
    assert history() == [[10, 11, 12]] and not dr.is_live("kept")
    dr.complete("never-decoded", prompt, [20])
    assert history()[-1] == [20]
    dr.sync("overshot", prompt, [30, 31, 32, 33])  # the index took 4 tokens; the response ends at 2
    dr.complete("overshot", prompt, [30, 31])
    assert history()[-1] == [30, 31] and [30, 31, 32, 33] not in history()
    dr.sync("aborted", prompt, [40, 41])
    dr.complete("aborted", prompt, [40, 41], keep=False)
    assert [40, 41] not in history() and not dr.is_live("aborted")
    sent = []
    dr.sync("published", prompt, [50, 51])
    dr.complete("published", prompt, [50, 51], group=7, publish=lambda p, r, grp: sent.append((list(p), list(r), grp)))
    assert sent == [(prompt, [50, 51], 7)] and [50, 51] not in history()
    dr.complete("aborted-published", prompt, [60], keep=False, publish=lambda *a: sent.append(a))
    assert len(sent) == 1


def test_drafter_contract_and_sibling_drafting_on_real_completions():
    """Decode the samples of each HumanEval task in lockstep, as SGLang does, feeding back exactly
    what greedy tree verification would accept; check the contract at every step, that siblings
    in flight draft from each other and that finished responses become history."""
    d = 12
    dr = BatchDrafter(d, FIXED)
    tasks = humaneval(4)
    steps = accepted_total = 0
    for task, (prompt, samples) in enumerate(tasks):
        samples = samples[:4]
        rids = [f"t{task}-s{k}" for k in range(len(samples))]
        pos = [1] * len(samples)  # tokens accepted so far (the first came from prefill)
        active = list(range(len(samples)))
        while active:
            for k in active:
                dr.sync(rids[k], prompt, samples[k][:pos[k]])
            tokens, mask = dr.draft([rids[k] for k in active])[:2]
            roots = [samples[k][pos[k] - 1] for k in active]
            parents = check_contract(tokens.copy(), mask.copy(), roots, d)
            steps += 1
            nxt = []
            for b, k in enumerate(active):
                t = tokens[b * d:(b + 1) * d]
                truth = samples[k][pos[k]:]
                node, acc = 0, 0
                while acc < len(truth):
                    kids = [i for i in range(1, d) if parents[b][i] == node and t[i] == truth[acc]]
                    if not kids:
                        break
                    node, acc = kids[0], acc + 1
                accepted_total += min(acc, len(truth) - 1)  # what the token counts show
                pos[k] = min(pos[k] + acc + 1, len(samples[k]))
                if pos[k] >= len(samples[k]):
                    dr.finish(rids[k], samples[k])
                else:
                    nxt.append(k)
            active = nxt
        assert dr.index.stats()["responses"] == 4 * (task + 1)
    tot = dr.totals
    assert tot.finished == tot.kept == 16
    assert tot.accepted == accepted_total > 0
    # Real completions of one task rhyme: well over one token per step on average.
    generated = sum(len(s) for _, ss in tasks for s in ss[:4]) - 16
    assert generated / steps > 1.5 * (16 / 4) / 4  # batch of 4 per step: > 1.5 tokens per request-step


def test_sync_batch_with_pending_tokens_equals_syncing_whole_contexts():
    """The worker hands each request's context as SGLang holds it in overlap mode: ``output_ids``
    (one step behind) plus the tokens accepted last step. One ``sync_batch`` call with those parts
    must leave the index exactly where syncing every whole context one by one does: same drafts,
    same acceptance counts, also across a retraction and with a group that only the start reads.
    The batched side runs its index on three threads (40 requests: appends and drafts are split),
    the one-by-one side on one."""
    d = 10
    tasks = humaneval(8)
    whole, parts = BatchDrafter(d, HistoryConfig(threads=1, control="fixed")), BatchDrafter(d, HistoryConfig(threads=3, control="fixed"))
    assert (whole.index.threads, parts.index.threads) == (1, 3)
    rng = np.random.default_rng(0)
    reqs = [(f"t{t}-{k}", prompt, samples[k]) for t, (prompt, samples) in enumerate(tasks) for k in range(5)]
    pos = {rid: 1 for rid, _, _ in reqs}
    retracted = False
    for step in range(60):
        live = [r for r in reqs if pos[r[0]] < len(r[2])]
        if not live:
            break
        items = []
        for rid, prompt, full in live:
            ctx = full[:pos[rid]]
            whole.sync(rid, prompt, ctx, group=7 if rid.endswith("-0") else None)
            # Where output_ids ends: usually right after what the index held last step (overlap
            # mode), sometimes before or after it.
            head = int(rng.integers(max(0, len(ctx) - 8), len(ctx) + 1))
            # A group given after the start is ignored; passing a different one must change nothing.
            group = 7 if rid.endswith("-0") else None
            if parts.is_live(rid):
                group = 12345
            items.append((rid, prompt, ctx[:head], ctx[head:], group))
        parts.sync_batch(items)
        rids = [r[0] for r in live]
        a, b = whole.draft(rids), parts.draft(rids)[:2]
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]), f"step {step}"
        for i, (rid, _, full) in enumerate(live):
            t = a[0][i * d:(i + 1) * d]
            acc = 0
            while acc + 1 < d and pos[rid] + acc < len(full) and t[acc + 1] == full[pos[rid] + acc]:
                acc += 1  # the chain along the first children is enough to advance differently
            pos[rid] += min(acc + 1, len(full) - pos[rid])
        if step == 20 and not retracted:
            # SGLang retracts a request: its context restarts shorter.
            rid = live[0][0]
            pos[rid], retracted = 2, True
    assert retracted
    counts = ("steps", "request_steps", "covered", "accepted", "offered")
    assert [whole.totals.as_dict()[k] for k in counts] == [parts.totals.as_dict()[k] for k in counts]
    assert whole.totals.accepted > 50
    assert whole.index.group_keys() == parts.index.group_keys()
    assert 7 in parts.index.group_keys() and 12345 not in parts.index.group_keys()


def test_a_context_of_the_same_length_with_another_last_token_restarts_the_request():
    """The root of a draft is the request's last token. A context handed in with as many tokens as
    the index holds but another last token (what a double-counted overlap relay produced on a GPU:
    the prefill token twice, then the next token never read) must not leave the old root in place:
    the request's context is read again whole."""
    d = 4
    dr = BatchDrafter(d, FIXED)
    prompt = [5, 6, 7]
    dr.sync_batch([("a", prompt, [1], [1], None)])  # [1] counted twice: the index holds 2 tokens
    assert dr.draft(["a"])[0][0] == 1
    dr.sync_batch([("a", prompt, [1], [2], None)])  # the real context: 2 tokens, the last one 2
    tokens, _ = dr.draft(["a"])[:2]
    assert tokens[0] == 2
    dr.sync_batch([("a", prompt, [1, 2], [3], None)])
    assert dr.draft(["a"])[0][0] == 3


def test_the_default_policy_is_told_how_long_each_request_has_left():
    """Under the default policy the drafter tells the step plan each request's remaining tokens, by
    its group's finished responses in the index and its cap (``max_new_tokens``), and nothing where
    requests wait for a slot (every promised token counts whole there) or one request runs alone."""
    dr = BatchDrafter(8, HistoryConfig(control="cost"))
    prompt = [5, 6, 7]
    for n in (20, 60):
        dr.add_finished(prompt, list(range(100, 100 + n)), group=3)
    seen: list = []
    promises = dr.feedback.promises

    def spy(by_width, klasses, remaining=None):
        seen.append(None if remaining is None else remaining.tolist())
        return promises(by_width, klasses, remaining)

    dr.feedback.promises = spy  # type: ignore[method-assign]
    dr.sync_batch([("a", prompt, [100] * 10, [], 3), ("b", prompt, [100] * 30, [], 3), ("c", [9, 9], [1], [], None)])
    dr.draft(["a", "b", "c"], ["sampled"] * 3, caps=[50, None, None])
    dr.draft(["a", "b", "c"], ["sampled"] * 3, waiting=2)
    dr.draft(["a"], ["sampled"])
    # a: E[L | L > 10] = 40, under its cap 50: 30 left; b: past 20, E = 60: 30 left; c: its group
    # holds nothing and it has no cap: not known.
    assert seen[0][:2] == [30.0, 30.0] and np.isnan(seen[0][2]), seen
    assert seen[1:] == [None, None], seen


@pytest.mark.parametrize("control", ["cost", "fixed"])
def test_a_request_that_has_ended_gets_no_draft(control):
    """Under overlap scheduling a request whose last step ended it (its cap, a stop token) is still
    in the next batch: it gets its root alone, promises nothing, has nothing left, and a step of
    such requests only is no verify (``drafted`` False: the worker decodes it plainly), under the
    default policy and at a fixed width alike; the others draft as before."""
    d = 8
    dr = BatchDrafter(d, HistoryConfig(control=control))
    prompt = [5, 6, 7]
    answer = list(range(100, 140))
    dr.add_finished(prompt, answer, group=3)
    seen: list = []
    promises = dr.feedback.promises

    def spy(by_width, klasses, remaining=None):
        seen.append(({w: v.tolist() for w, v in by_width.items()}, None if remaining is None else remaining.tolist()))
        return promises(by_width, klasses, remaining)

    dr.feedback.promises = spy  # type: ignore[method-assign]
    dr.sync_batch([("a", prompt, answer[:10], [], 3), ("b", prompt, answer[:20], [], 3)])
    step = dr.draft(["a", "b"], ["greedy"] * 2, width=d, caps=[64, 20], ended=[False, True])
    rows = step.tokens.reshape(2, d)
    assert rows[0].tolist() == answer[9:9 + d] and rows[1].tolist() == [answer[19]] + [0] * (d - 1)
    assert step.mask.reshape(2, d, d)[1].tolist() == np.tril(np.ones((d, d), dtype=int)).tolist()
    assert step.drafted
    if control == "cost":
        by_width, left = seen[-1]
        assert all(v[0] > 0 and v[1] == 0 for v in by_width.values()), by_width
        assert left[1] == 0 and left[0] > 0, left
    assert dr.totals.request_steps == 1  # an ended request is not decoding: no request-step
    gone = dr.draft(["a", "b"], ["greedy"] * 2, caps=[10, 20], ended=[True, True])
    assert not gone.drafted and gone.roots.tolist() == [answer[9], answer[19]]
    assert dr.totals.request_steps == 1 and dr.totals.steps == 2


def test_one_draft_token_decodes_every_step_plainly_under_the_default_policy():
    """``--speculative-num-draft-tokens 1`` leaves no width to verify at: the default policy (which
    once failed to start there) chooses plain decoding at every step, with each request's root."""
    dr = BatchDrafter(1)
    prompt, answer = [5, 6, 7], list(range(100, 140))
    dr.add_finished(prompt, answer, group=3)
    dr.sync_batch([("a", prompt, answer[:10], [], 3), ("b", prompt, answer[:20], [], 3)])
    for _ in range(12):
        step = dr.draft(["a", "b"], ["greedy", "sampled"], caps=[64, 64])
        assert (step.width, step.drafted) == (1, False)
        assert step.roots.tolist() == [answer[9], answer[19]] and step.tokens.tolist() == step.roots.tolist()
    assert dr.totals.width_steps == {1: 12}


def test_shadow_drafts_measure_every_width_but_the_one_verified():
    """Under the default policy each request's widest draft is followed along the tokens it goes on
    to produce and measured at every width but the step's: beside a step verified at d, what the
    narrower widths (its most probable nodes) would have accepted; beside a plain step, every width,
    the one the policy names counting in the class's calibration too."""
    d = 8
    dr = BatchDrafter(d, HistoryConfig(control="cost"))
    prompt = [5, 6, 7]
    answer = list(range(100, 140))
    dr.add_finished(prompt, answer, group=3)
    seen: list[tuple] = []
    observe = dr.feedback.policy.observe

    def spy(promised, accepted, requests=0, *, shadow=False, klass=None, width=None, beside=False, batch=None):
        if shadow:
            seen.append((width, accepted, beside, klass, batch, promised > 0))
        observe(promised, accepted, requests, shadow=shadow, klass=klass, width=width, beside=beside, batch=batch)

    dr.feedback.policy.observe = spy  # type: ignore[method-assign]
    dr.sync_batch([("a", prompt, answer[:10], [], 3)])
    step = dr.draft(["a"], ["greedy"], width=d)
    assert step.tokens.tolist() == answer[9:9 + d] and seen == []
    dr.observe_step([d - 1])
    # The step accepted its whole chain and the target's token after it: the walk ends at the leaf.
    dr.sync_batch([("a", prompt, answer[:10 + d], [], 3)])
    assert sorted(seen) == [(2, 1, True, "greedy", 1, True), (4, 3, True, "greedy", 1, True)], seen
    seen.clear()
    plain = dr.draft(["a"], ["greedy"], width=1)
    assert plain.width == 1
    # Two tokens on the chain, then one off it.
    dr.sync_batch([("a", prompt, answer[:10 + d] + answer[10 + d:12 + d] + [1], [], 3)])
    named = dr.feedback.policy.shadow_width()
    assert sorted(w for w, *_ in seen) == [2, 4, 8], seen
    assert {w: (acc, beside) for w, acc, beside, *_ in seen} == {w: (min(w - 1, 2), w != named) for w in (2, 4, 8)}


def test_drafter_lifecycle_retraction_plain_steps_and_history_io(tmp_path):
    d = 6
    dr = BatchDrafter(d, FIXED)
    prompt = [5, 6, 7]
    dr.add_finished(prompt, [1, 2, 3, 4, 5, 6])
    dr.sync("a", prompt, [1])
    tokens, mask = dr.draft(["a"])[:2]
    assert tokens[:d].tolist() == [1, 2, 3, 4, 5, 6]  # the earlier response, as a chain
    # Retraction: SGLang rewinds a request; its context starts again, nothing breaks.
    dr.sync("a", prompt, [1, 2, 3])
    dr.sync("a", prompt, [1])
    assert dr.draft(["a"])[0][:2].tolist() == [1, 2]
    # A step its policy decodes plainly (width 1): each request's root alone.
    for r in ("b", "c"):
        dr.sync(r, prompt, [1])
    dr.policy = Fixed(1)
    tokens, mask = dr.draft(["a", "b", "c"])[:2]
    assert tokens.tolist() == [1, 1, 1] and mask.tolist() == [1, 1, 1] and dr.width == 1
    # A caller whose verify path runs only d (SGLang's grammar batches) gets d, whatever the policy.
    tokens, mask = dr.draft(["a", "b", "c"], width=d)[:2]
    dr.policy = Fixed(d)
    check_contract(tokens, mask, [1, 1, 1], d)
    assert dr.totals.drafted_steps == 3 and dr.totals.steps == 4
    assert dr.width_steps == {d: 3, 1: 1}
    # An abort leaves no history; an unknown rid is ignored.
    rebuilds = dr.index.stats()["rebuilds"]
    dr.finish("b", [1, 9], keep=False)
    dr.finish("nope", [1])
    assert dr.index.stats()["responses"] == 1
    # Its tokens leave the automaton once the group is idle, not with a rebuild per finish.
    dr.finish("c", [1, 8], keep=False)
    assert dr.index.stats()["rebuilds"] == rebuilds
    dr.finish("a", [1, 2], keep=False)
    assert dr.index.stats()["rebuilds"] == rebuilds + 1
    # History out and in: a snapshot, and token-id JSONL (gzip too).
    snap = tmp_path / "h" / "index.snap"
    dr.save(snap)
    other = BatchDrafter(d)
    assert other.load(snap) == 1
    lines = [{"prompt_ids": [1, 2], "response_ids": [3, 4, 5], "version": 2},
             {"prompt_ids": [1, 2], "response_ids": [3, 4, 6], "group": 99}]
    (tmp_path / "h.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    with gzip.open(tmp_path / "h.jsonl.gz", "wt") as f:
        f.write(json.dumps(lines[0]) + "\n")
    assert other.load(tmp_path / "h.jsonl") == 3
    assert other.load(tmp_path / "h.jsonl.gz") == 4
    (tmp_path / "bad.jsonl").write_text('{"prompt_ids": [1]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not a history record"):
        other.load(tmp_path / "bad.jsonl")


def test_every_step_policy_has_the_one_interface():
    """The engine's policies and the simulator's are one kind of object."""
    from histospec_sgl.engine.costmodel import CostModel, EngineControl, TimedFixed
    from histospec_sgl.simulate.profile import ANALYTIC

    policies = [Fixed(1), Fixed(8), EngineControl(8), CostModel(next(iter(ANALYTIC.values())), [4, 8])]
    assert all(isinstance(p, StepPolicy) for p in policies)
    assert [p.choose({8: 3.0}, 4) for p in policies[:2]] == [1, 8]
    # The engine's default is the cost model over the widths 2, 4, ..., d; HISTOSPEC_CONTROL=fixed
    # verifies every step at d.
    default = BatchDrafter(8)
    assert isinstance(default.policy, EngineControl) and default.policy.widths == (2, 4, 8)
    assert HistoryConfig().control == "cost"
    fixed = BatchDrafter(8, HistoryConfig(control="fixed"))
    assert isinstance(fixed.policy, TimedFixed) and fixed.policy.width == 8  # times its steps, as the default
    # What the worker and the metrics use, on every policy: the simulator's fixed width times nothing.
    for p in policies:
        p.decode_step(4, 8, 0.0)
        p.begin(0.5)
        assert isinstance(p.summary(), str) and p.calibration("sampled", 8) > 0
    assert [bool(p.step_costs()) for p in policies] == [False, False, False, False]  # a first timing is warm-up
    for t0, dt in ((1.0, 0.4), (2.0, 0.4), (3.0, 1.0)):  # a slow step among steady ones
        policies[2].decode_step(4, 8, t0)
        policies[2].begin(t0 + dt)
    # The median the policy chooses by leaves the slow step out; the mean, what a row pays, has it.
    assert policies[2].step_costs() == {(8, 4): pytest.approx(0.4)}
    assert policies[2].step_costs(mean=True) == {(8, 4): pytest.approx(0.6)}
    assert all(p.step_costs(mean=True) == {} for p in (policies[0], policies[1], policies[3]))


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "histospec_sgl.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_bench_worker_runs_the_worker_loop_and_reports_host_time(tmp_path):
    out = tmp_path / "worker.json"
    r = cli("bench", "worker", "--batch-sizes", "4,8", "--groups", "4", "--steps", "4", "--warm", "200",
             "--draft-tokens", "8", "--json", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["command"].startswith("histospec-sgl bench worker") and set(res["batch_sizes"]) == {"4", "8"}
    for bs, row in res["batch_sizes"].items():
        assert row["requests"] == int(bs) and row["steps"] == 4
        assert row["host_ms_per_step"] >= row["draft_ms_per_step"] > 0 and row["sync_one_by_one_ms_per_step"] > 0
        # W1's epoch-2 responses follow their epoch-1 history closely: several tokens per step.
        assert row["tokens_per_request_step"] > 2
        assert 200 + 4 < row["response_tokens_at_end"] <= 200 + 4 * 8
    bad = cli("bench", "worker", "--batch-sizes", "0")
    assert bad.returncode == 2 and "--batch-sizes" in bad.stderr
