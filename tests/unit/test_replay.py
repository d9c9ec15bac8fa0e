"""Offline replay: hand-computed tiny logs, the real shared logs, errors, and the CLI end to end."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from histospec_sgl.replay import (
    FieldMap,
    ReplayDataError,
    ReplayOptions,
    Selection,
    accept_greedy,
    build_cases,
    load_rollouts,
    run_replay,
)
from histospec_sgl.replay.data import PRESETS, default_tokenizer, preset_path
from histospec_sgl.replay.measure import Track, replay, run_method
from histospec_sgl.replay.methods import Ours
from histospec_sgl.replay.peers import CopyBound, PromptLookup, SGLangTrie
from histospec_sgl.replay.run import load_cases

IDS = FieldMap("p", "r", group="g", token_ids=True)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tiny_log(tmp_path: Path) -> Path:
    # One group, prompt [1, 2], two responses that share "3 4 5" and then differ.
    return write_jsonl(
        tmp_path / "tiny.jsonl",
        [
            {"g": "q", "p": [1, 2], "r": [3, 4, 5, 9, 6, 7]},  # A
            {"g": "q", "p": [1, 2], "r": [3, 4, 5, 6, 8]},  # B
        ],
    )


def test_accept_greedy_walks_the_matching_branch():
    # root(0) -> 5(1) -> 6(3); root -> 7(2) -> 8(4)
    toks, parents = [0, 5, 7, 6, 8], [-1, 0, 0, 1, 2]
    assert accept_greedy(toks, parents, [9, 7, 8, 1], 1) == 2
    assert accept_greedy(toks, parents, [5, 6], 0) == 2
    assert accept_greedy(toks, parents, [6], 0) == 0
    assert accept_greedy([0], [-1], [1, 2], 0) == 0


def test_the_replay_loop_advances_by_the_step_or_by_one_position():
    """The one replay loop on a hand-checked history: a response that repeats its prompt's history
    is drafted whole at each step (15 tokens at d=16 from the first decoded token on); at every
    position the loop advances one token and reads each draft; a request joining later (``start``)
    drafts only from there, and the method sees every emitted token (its index holds the response)."""
    truth = list(range(100, 140))
    m = Ours()
    m.reset(True, 16)
    m.add_history([1, 2], truth)
    tr = Track(7, [1, 2], truth)
    steps = [[(s.track.pos, s.accepted, s.emit) for s in batch] for batch in replay(m, [tr], 16)]
    # 39 tokens after the prefill's: 15 + 1 per step; the last step's draft covers the 7 left (no bonus).
    assert steps == [[(1, 15, 16)], [(17, 15, 16)], [(33, 7, 7)]]
    assert (tr.pos, tr.steps, tr.emitted) == (40, 3, 39)
    m.reset(True, 16)
    m.add_history([1, 2], truth)
    every = [(b[0].track.pos, b[0].accepted)
             for b in replay(m, [Track(8, [1, 2], truth, start=30)], 16, every_position=True)]
    assert every == [(p, min(15, 40 - p)) for p in range(30, 40)]
    # Two tracks decode as one batch, one drafted call a step; a one-token response ends at its
    # prefill and never drafts.
    m.reset(True, 16)
    m.add_history([1, 2], truth)
    both = list(replay(m, [Track(1, [1, 2], truth[:20]), Track(2, [1, 2], truth[:10]), Track(3, [1, 2], truth[:1])], 16))
    assert [[(s.track.rid, s.emit) for s in b] for b in both] == [[(1, 16), (2, 9)], [(1, 3)]]
    with pytest.raises(ValueError, match="at least 2 nodes"):
        next(replay(m, [], 1))


def test_a_store_per_prompt_drafts_each_request_from_its_own_prompts_history():
    """``PerPrompt`` (how ``bench index`` drives its peers' per-prompt stores through the replay's
    loop): two prompts, each with its own history, decode as one batch; each request drafts from its
    prompt's store alone, as if replayed on its own, and a replay closed after some steps finishes
    the requests still in flight. ``timed_steps`` reads the store's own time (``index_ns``) per step."""
    from histospec_sgl.bench.index_peers import timed_steps
    from histospec_sgl.bench.workload import W1, generate
    from histospec_sgl.replay.peers import PerPrompt

    a, b = list(range(100, 130)), list(range(200, 230))
    made: list[tuple[int, ...]] = []

    def per_prompt(key: tuple[int, ...]) -> PromptLookup:
        made.append(key)
        m = PromptLookup()
        m.add_history(list(key), a if key == (1,) else b)
        return m

    m = PerPrompt("lookup", per_prompt)
    run = replay(m, [Track(1, [1], a), Track(2, [2], b)], 8)
    first = next(run)
    assert [s.accepted for s in first] == [7, 7] and sorted(made) == [(1,), (2,)]
    run.close()
    assert m.of == {} and all(not x.reqs for x in m.methods.values())
    # Alone, each drafts the same.
    alone = PromptLookup()
    alone.add_history([1], a)
    assert [s.draft for s in next(replay(alone, [Track(1, [1], a)], 8))] == [first[0].draft]

    class Counted(PromptLookup):
        """Prompt lookup that counts 1000 ns per draft call and 10 per updated request."""

        def __init__(self) -> None:
            super().__init__()
            self.ns = [0, 0]

        def index_ns(self) -> tuple[int, int]:
            return self.ns[0], self.ns[1]

        def draft(self, rid, num_nodes):
            self.ns[0] += 1000
            return super().draft(rid, num_nodes)

        def extend(self, rid, tokens):
            self.ns[1] += 10
            super().extend(rid, tokens)

    w = generate(W1, prompts=3)
    drafts, updates = timed_steps(Counted(), w, 3, 8, steps=4)
    assert drafts == [3000] * 4 and updates == [30] * 4


def test_the_simulators_draft_probabilities_are_the_engines():
    """``Ours(probs=True)`` drafts through ``BatchDrafter.draft_nodes``: the same trees the worker's
    fixed-width drafts are, with each node's path probability (non-increasing from parent to child;
    the root's 1)."""
    from histospec_sgl.replay.methods import Ours as O

    truth = [5, 6, 7, 8, 9, 5, 6, 7, 10, 11]
    drafts = {}
    for probs in (False, True):
        m = O(probs=probs)
        m.reset(True, 8)
        m.add_history([1], truth)
        m.add_history([1], truth[:6] + [12, 13])
        drafts[probs] = [s.draft for b in replay(m, [Track(3, [1], truth)], 8, every_position=True) for s in b]
    assert [d[:2] for d in drafts[True]] == drafts[False]
    assert any(len(d[0]) > 2 for d in drafts[True])
    for toks, parents, probs in drafts[True]:
        assert len(probs) == len(toks) and probs[0] == pytest.approx(1.0)
        assert all(probs[i] <= probs[parents[i]] + 1e-6 for i in range(1, len(toks)))


def test_tiny_log_gives_hand_computed_tokens_per_step(tmp_path):
    rows = load_rollouts(tiny_log(tmp_path), IDS)
    cases = build_cases(rows, "cross-sample", Selection(per_group=0))
    assert [(c.replay[0].response_ids, [h.response_ids for h in c.history]) for c in cases] == [
        ([3, 4, 5, 9, 6, 7], [[3, 4, 5, 6, 8]]),
        ([3, 4, 5, 6, 8], [[3, 4, 5, 9, 6, 7]]),
    ]
    t = run_method(Ours(), cases, 16)
    # A over B: prefill 3; step 1 drafts 4 5 6 8, accepts 4 5, emits 4 5 9; step 2 has nothing
    # after "9" (empty draft), emits 6; step 3 drafts 8 after "6", emits 7.
    # B over A: prefill 3; step 1 drafts 4 5 9 6 7, accepts 4 5, emits 4 5 6; step 2 drafts 7
    # after "6", emits 8.  Total: 9 tokens in 5 verify steps, 4 of them with a draft.
    assert (t.emitted, t.steps, t.covered, t.accepted) == (9, 5, 4, 4)
    assert t.hist[:3] == [3, 0, 2] and sum(t.hist) == 5
    s = t.summary([1.0], batch_size=1, decode_step_ms=1e9)
    assert s["tokens_per_verify_step"] == pytest.approx(9 / 5)
    assert s["draft_coverage"] == pytest.approx(4 / 5)
    assert s["projected_speedup"]["1"] == pytest.approx(9 / 5, rel=1e-6)


def test_tiny_log_peers_hand_computed(tmp_path):
    cases = build_cases(load_rollouts(tiny_log(tmp_path), IDS), "cross-sample", Selection(per_group=0))
    # n-gram over A (history B = 1 2 3 4 5 6 8): after "3", 3-gram "1 2 3" -> 4 5 6 8: accept 4 5,
    # emit 4 5 9; after "5 9": own "9" has no continuation, history has none -> empty, emit 6;
    # after "9 6": 1-gram "6" in history -> 8, emit 7.  Over B (history A): after "3" -> 4 5 9 6 7:
    # accept 4 5, emit 4 5 6; after "5 6": 1-gram "6" -> 7, emit 8.  9 tokens in 5 steps again.
    t = run_method(PromptLookup(), cases, 16)
    assert (t.emitted, t.steps, t.covered, t.accepted) == (9, 5, 4, 4)
    t = run_method(SGLangTrie(per_prompt=True), cases, 16)
    assert (t.emitted, t.steps) == (9, 5)


def test_tiny_log_copy_bounds_hand_computed(tmp_path):
    cases = build_cases(load_rollouts(tiny_log(tmp_path), IDS), "cross-sample", Selection(per_group=0))
    # Anywhere: A over B (1 2 3 4 5 6 8): "4 5" occurs, "4 5 9" does not: emit 4 5 9; "6" occurs,
    # "6 7" does not: emit 6 7.  B over A (1 2 3 4 5 9 6 7): emit 4 5 6; "8" occurs nowhere: emit 8.
    t = run_method(CopyBound(context=0), cases, 16)
    assert (t.emitted, t.steps, t.accepted, t.hist[:3]) == (9, 4, 5, [1, 1, 2])
    # After the last token: A: "3 4 5" -> emit 4 5 9; "9 6" nowhere -> 6; "6 7" nowhere -> 7.
    # B: "3 4 5" -> 4 5 6; "6 8" nowhere -> 8.  9 tokens in 5 steps, like ours (hand-computed above).
    t = run_method(CopyBound(context=1), cases, 16)
    assert (t.emitted, t.steps, t.accepted, t.hist[:3]) == (9, 5, 4, [3, 0, 2])
    # Capped at one draft token: A emits 4 5 | 9 | 6 7, B emits 4 5 | 6 8.
    t = run_method(CopyBound(context=0, max_len=1), cases, 16)
    assert (t.emitted, t.steps, t.accepted) == (9, 5, 4)


def test_copy_bounds_are_ceilings_on_real_text():
    # One replayed response per case, so every method decodes alone and visibility depends only on
    # the position: each response's tokens per step under the bound must be at least every drafter's
    # (each drafts paths that spell text it has seen; the trie and prompt lookup only after a match of
    # the last token). The sample ships with the project (MIT HumanEval completions).
    opts = ReplayOptions(preset="humaneval-sample", scenario="cross-sample", max_groups=6, per_group=1,
                         progress=False)
    cases, _ = load_cases(opts)
    per = {m.name: run_method(m, cases, 16).per_response
           for m in (Ours(), SGLangTrie(per_prompt=True), PromptLookup(), CopyBound(0), CopyBound(1))}
    assert len(per["ours"]) == len(cases) >= 6
    for name in ("ours", "sglang_trie_per_prompt", "ngram", "bound_copy_after_1"):
        assert all(b >= m - 1e-9 for b, m in zip(per["bound_copy_any"], per[name], strict=True)), name
    for name in ("sglang_trie_per_prompt", "ngram"):
        assert all(b >= m - 1e-9 for b, m in zip(per["bound_copy_after_1"], per[name], strict=True)), name
    # ... and it is not vacuous: the ceiling is well above what the drafters reach.
    assert sum(per["bound_copy_any"]) > 1.2 * sum(per["ours"])


def test_inflight_siblings_draft_from_each_other(tmp_path):
    # Two identical-prefix samples decoding together, one ahead of the other by construction:
    # B is shorter, finishes, and becomes history; A then drafts from it.
    log = write_jsonl(
        tmp_path / "inflight.jsonl",
        [
            {"g": "q", "p": [1], "r": [2, 3, 4, 5, 6, 7, 8, 9]},
            {"g": "q", "p": [1], "r": [2, 3, 4, 5, 6, 7, 8, 9]},
            {"g": "q", "p": [1], "r": [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]},
        ],
    )
    rows = load_rollouts(log, IDS)
    cold = run_method(Ours(), build_cases(rows, "cold", Selection(per_group=0)), 16)
    infl = run_method(Ours(), build_cases(rows, "cross-sample-inflight", Selection(per_group=1)), 16)
    # Cold, every response only sees itself: nothing repeats, one token per step.
    assert cold.emitted == cold.steps
    # In flight, the replayed sample sees siblings that are exactly as far as itself, so the first
    # steps have no continuation either; nothing may be drafted from the future.
    assert infl.emitted == infl.steps


def test_draft_server_finish_counts_a_sibling_twice_until_the_group_is_idle():
    # Two siblings of one prompt; A finishes first while B still decodes.
    def run(finish: str) -> tuple[dict, dict, list[int], list[float]]:
        m = Ours(finish=finish)
        m.reset(True, num_nodes=4)
        assert m.index is not None
        # Some earlier history, so that A's deferred tokens are under half of what the group
        # holds (over half, the group is rebuilt at once).
        m.add_history([1, 2], list(range(20, 32)))
        m.begin(1, [1, 2])
        m.begin(2, [1, 2])
        m.extend(1, [3, 4, 5, 6])
        m.extend(2, [3, 4])
        m.finish(1)
        m.draft_batch([2], 4)  # B's tokens reach the index at its next draft, as in the worker
        mid = m.index.stats()
        toks, _, probs = m.index.draft(m.drafter.request_id("2"), 4, False)
        m.extend(2, [5, 7])
        m.finish(2)
        return mid, m.index.stats(), list(toks), list(probs)

    keep_mid, keep_end, keep_draft, keep_p = run("keep")
    srv_mid, srv_end, srv_draft, srv_p = run("draft-server")
    # Either way B drafts A's continuation after "3 4".
    assert keep_draft[1:3] == srv_draft[1:3] == [5, 6]
    # While B decodes, A's response is in the automaton twice (its deferred tokens and the
    # published record), so its continuation is estimated as seen twice: more likely.
    assert keep_mid["responses"] == srv_mid["responses"] == 2
    assert srv_mid["rebuilds"] == 0
    assert srv_p[1] > keep_p[1]
    # Once the group is idle it holds exactly the published history: one rebuild, no copies.
    assert srv_end["rebuilds"] == 1
    assert (srv_end["tokens"], srv_end["responses"], srv_end["states"]) == (
        keep_end["tokens"],
        keep_end["responses"],
        keep_end["states"],
    )
    assert keep_end["responses"] == 3
    with pytest.raises(ValueError, match="finish must be one of"):
        Ours(finish="drop")


def test_scenarios_select_the_documented_history(tmp_path):
    rows = []
    for pol in ("a", "b"):
        for step in (1, 2):
            for k in range(3):
                rows.append({"g": "q", "p": [1], "r": [10 * step + k, 7], "pol": pol, "s": step, "i": k})
    log = write_jsonl(tmp_path / "multi.jsonl", rows)
    fm = FieldMap("p", "r", group="g", step="s", sample="i", policy="pol", token_ids=True)
    loaded = load_rollouts(log, fm)
    ep = build_cases(loaded, "cross-epoch", Selection())
    assert len(ep) == 6
    for c in ep:
        assert {h.step for h in c.history} == {1} and c.replay[0].step == 2
        assert {h.policy for h in c.history} == {c.replay[0].policy}
    pol = build_cases(loaded, "cross-policy", Selection(per_group=1))
    assert len(pol) == 2
    for c in pol:
        assert all(h.policy != c.replay[0].policy and h.step == c.replay[0].step for h in c.history)
        assert len(c.history) == 3
    cs = build_cases(loaded, "cross-sample", Selection(per_group=0, seed=3))
    for c in cs:
        r = c.replay[0]
        assert r not in c.history and len(c.history) == 2
        assert all((h.policy, h.step) == (r.policy, r.step) for h in c.history)
    cold = build_cases(loaded, "cold", Selection(per_group=0, seed=3))
    assert [c.replay[0].source for c in cold] == [c.replay[0].source for c in cs]
    assert all(not c.history and not c.siblings for c in cold)


def test_malformed_line_names_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"g": "q", "p": [1], "r": [2]}\n\n{"g": "q", "p": [1], "r": [2]\n')
    with pytest.raises(ReplayDataError, match=r"bad\.jsonl:3: malformed JSON"):
        load_rollouts(p, IDS)
    gz = tmp_path / "bad.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write('{"g": "q", "p": [1], "r": [2]}\n[1, 2]\n')
    with pytest.raises(ReplayDataError, match=r"bad\.jsonl\.gz:2: expected a JSON object"):
        load_rollouts(gz, IDS)


def test_wrong_field_mapping_says_which_field(tmp_path):
    p = write_jsonl(tmp_path / "x.jsonl", [{"question": "hi", "answer": "there"}])
    with pytest.raises(ReplayDataError, match=r"x\.jsonl:1: field 'response' \(--response-field\) is missing"):
        load_rollouts(p, FieldMap("question", "response"))
    with pytest.raises(ReplayDataError, match=r"field 'step' \(--step-field\) is missing; the line has: answer, question"):
        load_rollouts(p, FieldMap("question", "answer", step="step"))
    with pytest.raises(ReplayDataError, match="list of non-negative token ids"):
        load_rollouts(p, FieldMap("question", "answer", token_ids=True))


def test_text_log_without_tokenizer_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HISTOSPEC_TOKENIZER", str(tmp_path / "missing.json"))
    p = write_jsonl(tmp_path / "t.jsonl", [{"q": "a b", "a": ["c", "d"]}])
    opts = ReplayOptions(input=p, fields=FieldMap("q", "a"), peers=(), progress=False, per_group=0)
    with pytest.raises(ReplayDataError, match="not a usable tokenizer file"):
        run_replay(opts)


needs_shared = pytest.mark.usefixtures("data_root")  # the real rollout logs, beside the checkout


@needs_shared
@pytest.mark.parametrize(
    ("preset", "rows", "groups"),
    [("grpo", 25_848, 475), ("ei", 35_840, 640), ("humaneval", 16_400, 164), ("humaneval-sample", 2_400, 24)],
)
def test_presets_parse_the_real_files(preset, rows, groups):
    pre = PRESETS[preset]
    loaded = load_rollouts(preset_path(pre, None), pre.fields)
    assert len(loaded) == rows
    if preset == "grpo":
        assert len({r.group for r in loaded}) >= groups  # prompt text: a few questions have two templates
    else:
        assert len({r.group for r in loaded}) == groups


@needs_shared
def test_shipped_sample_is_the_qwen3_tokenization_of_the_source():
    from tokenizers import Tokenizer

    from histospec_sgl.replay.data import iter_jsonl

    tok = default_tokenizer()
    assert tok is not None and tok.is_file()
    t = Tokenizer.from_file(str(tok))
    pre = PRESETS["humaneval"]
    by_prompt: dict[str, list[str]] = {}
    for r in load_rollouts(preset_path(pre, None), pre.fields):
        by_prompt.setdefault(r.prompt, []).append(r.response)  # type: ignore[arg-type]
    checked = 0
    for _, rec in iter_jsonl(Path(PRESETS["humaneval-sample"].relpath)):
        texts = by_prompt[rec["prompt"]]
        assert rec["prompt_ids"] == t.encode(rec["prompt"], add_special_tokens=False).ids
        for text, ids in list(zip(texts, rec["samples_ids"]))[:5]:
            assert ids == t.encode(text, add_special_tokens=False).ids
            checked += 1
    assert checked == 24 * 5


@needs_shared
@pytest.mark.parametrize(
    ("preset", "scenario"),
    [("grpo", "cross-sample"), ("grpo", "cross-epoch"), ("grpo", "cross-policy"), ("ei", "cross-policy"), ("humaneval", "cold")],
)
def test_real_scenarios_replay(preset, scenario):
    opts = ReplayOptions(preset=preset, scenario=scenario, max_groups=3, progress=False)
    r = run_replay(opts)
    assert r["config"]["replayed_responses"] > 0
    for name in ("ours", "ngram", "sglang_trie_per_prompt"):
        m = r["ours"] if name == "ours" else r["peers"][name]
        assert 1.0 <= m["tokens_per_verify_step"] <= 16.0
        assert 0.0 <= m["draft_coverage"] <= 1.0
        assert sum(m["accepted_length_histogram"]) == m["verify_steps"]


def test_cli_quickstart_job_writes_json_and_plots(tmp_path):
    out = tmp_path / "r.json"
    plots = tmp_path / "plots"
    cmd = [sys.executable, "-m", "histospec_sgl.cli", "replay", "--preset", "humaneval-sample",
           "--scenario", "cross-sample", "--json", str(out), "--plot", str(plots),
           "--no-progress", "--max-groups", "6"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    r = json.loads(out.read_text())
    assert set(r) >= {"ours", "peers", "config", "best_peer", "ours_vs_best_peer"}
    for k in ("tokens_per_verify_step", "draft_coverage", "projected_speedup", "accepted_length_histogram",
              "draft_us_per_step", "update_us_per_step"):
        assert k in r["ours"]
    assert r["peers"]["sglang_trie_per_prompt"]["status"] == "ok"
    assert r["peers"]["arctic_global"]["status"] in ("missing", "ok")
    assert (plots / "accepted_hist_humaneval-sample_cross-sample.png").stat().st_size > 1000
    assert "tok/step" in res.stdout


def test_cli_reports_bad_input_without_traceback(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text("not json\n")
    cmd = [sys.executable, "-m", "histospec_sgl.cli", "replay", "--input", str(p), "--prompt-field", "p",
           "--response-field", "r", "--token-ids", "--no-progress"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert "bad.jsonl:1: malformed JSON" in res.stderr and "Traceback" not in res.stderr


def test_cli_plot_dir_without_matplotlib_is_refused_before_the_replay(tmp_path):
    # An interpreter without matplotlib (as sys.modules[...] = None makes it): the replay must not
    # run to its end and then fail writing plots; it exits 2 at once with what to install.
    code = ("import sys; sys.modules['matplotlib'] = None; from histospec_sgl.cli import main; "
            "sys.argv = ['histospec-sgl', 'replay', '--preset', 'humaneval-sample', '--no-progress', "
            f"'--json', {str(tmp_path / 'r.json')!r}, '--plot', {str(tmp_path / 'plots')!r}]; sys.exit(main())")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "--plot needs matplotlib" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "r.json").exists()


def test_stale_install_note_names_the_newer_source_file(tmp_path):
    # An installed copy (its extension built at t=1000) run from a checkout edited after it.
    import os

    from histospec_sgl.cli import stale_install_note

    inst = tmp_path / "site" / "histospec_sgl"
    inst.mkdir(parents=True)
    (inst / "__init__.py").write_text("")
    (inst / "_core.abi3.so").write_bytes(b"")
    os.utime(inst / "_core.abi3.so", (1000, 1000))
    co = tmp_path / "checkout"
    (co / "histospec_sgl" / "replay").mkdir(parents=True)
    (co / "rust" / "x" / "src").mkdir(parents=True)
    for f in (co / "histospec_sgl" / "__init__.py", co / "histospec_sgl" / "replay" / "arctic.py",
              co / "rust" / "x" / "src" / "lib.rs"):
        f.write_text("")
        os.utime(f, (900, 900))
    assert stale_install_note(inst, co) is None  # everything older than the build
    os.utime(co / "rust" / "x" / "src" / "lib.rs", (2000, 2000))
    note = stale_install_note(inst, co)
    assert note is not None and "rust/x/src/lib.rs" in note and str(inst) in note
    # Running the checkout itself (maturin develop, or python -m from its root) is never stale.
    assert stale_install_note(co / "histospec_sgl", co) is None
    assert stale_install_note(inst, tmp_path / "elsewhere") is None
