"""The SGLang plugin (issue 4), on CPU.

Two kinds of tests:

- in this interpreter: the ``HISTOSPEC_*`` settings, the draft source the worker calls
  (:class:`BatchDrafter`, on real HumanEval completions), and ``histospec-sgl launch-server``;
- in fresh subprocesses of ``.venv-sglang`` (real SGLang 0.5.17, made by
  ``scripts/setup_sglang_env.sh``): entry-point discovery, argument resolution through SGLang's own
  code, the draft contract against SGLang's own tree-link derivation, and the TP broadcast over a
  real two-process ``torch.distributed`` group.

``scripts/test.sh`` builds ``.venv-sglang`` and sets ``HISTOSPEC_REQUIRE_SGLANG=1``, so there these
tests fail instead of skipping when SGLang is missing.
"""

from __future__ import annotations

import ast
import gzip
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from _contract import check_contract

from conftest import SGLANG_0523
from conftest import sglang_missing as _sglang_missing
from histospec_sgl import HistoryIndex
from histospec_sgl.drafter import BatchDrafter, SwitchOff, group_of
from histospec_sgl.plugin.config import HistoryConfig, HistoryConfigError, parse_size, settings_table

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "histospec_sgl" / "data" / "humaneval_sample.jsonl.gz"


def _humaneval(n_tasks: int = 8) -> list[tuple[list[int], list[list[int]]]]:
    out = []
    with gzip.open(SAMPLE, "rt") as f:
        for line in f:
            r = json.loads(line)
            out.append((json.loads(r["prompt_ids"]) if isinstance(r["prompt_ids"], str) else r["prompt_ids"],
                        json.loads(r["samples_ids"]) if isinstance(r["samples_ids"], str) else r["samples_ids"]))
            if len(out) == n_tasks:
                break
    return out


# -- settings --------------------------------------------------------------------------------------


def test_config_defaults_and_values():
    assert HistoryConfig.from_env({}) == HistoryConfig()
    cfg = HistoryConfig.from_env({
        "HISTOSPEC_MAX_RESPONSES": "32", "HISTOSPEC_MEMORY_BUDGET": "512M",
        "HISTOSPEC_DRAFT_POLICY": "Frequency", "HISTOSPEC_MAX_BATCH": "64", "HISTOSPEC_MIN_ACCEPT": "0.5",
        "HISTOSPEC_FOLLOW": "0",
    })
    assert (cfg.max_responses, cfg.memory_budget, cfg.draft_policy, cfg.max_batch, cfg.min_accept) == (
        32, 512 << 20, "frequency", 64, 0.5)
    assert HistoryConfig.from_env({"HISTOSPEC_NARROW_VERIFY": "65"}).narrow_verify == 65
    assert HistoryConfig.from_env({"HISTOSPEC_HUGE_PAGES": "1"}).huge_pages == "1"
    assert HistoryConfig.from_env({"HISTOSPEC_THREADS": "3"}).index_kwargs()["threads"] == 3
    assert 1 <= HistoryConfig().index_kwargs()["threads"] <= 4  # 0: min(4, cores available)
    assert HistoryIndex(**HistoryConfig.from_env({"HISTOSPEC_THREADS": "3"}).index_kwargs()).threads == 3
    kw = cfg.index_kwargs()
    assert kw["recency"] == 0.0 and kw["max_bytes"] == 512 << 20 and kw["follow"] == 0.0
    assert HistoryIndex(**kw).draft_config()["follow"] == 0.0  # the index takes every setting
    assert parse_size("4G") == 4 << 30 and parse_size("1.5KiB") == 1536 and parse_size("100") == 100
    assert "HISTOSPEC_DRAFT_SERVER" in settings_table()


@pytest.mark.parametrize("env, needle", [
    ({"HISTOSPEC_MAX_RESPONSES": "-1"}, "HISTOSPEC_MAX_RESPONSES"),
    ({"HISTOSPEC_MEMORY_BUDGET": "lots"}, "HISTOSPEC_MEMORY_BUDGET"),
    ({"HISTOSPEC_DRAFT_POLICY": "random"}, "recency, frequency"),
    ({"HISTOSPEC_VERSION_DECAY": "0"}, "HISTOSPEC_VERSION_DECAY"),
    ({"HISTOSPEC_LENIENCE": "inf"}, "HISTOSPEC_LENIENCE"),
    ({"HISTOSPEC_HUGE_PAGES": "yes"}, "HISTOSPEC_HUGE_PAGES"),
    ({"HISTOSPEC_LENIENCE": "0.5"}, "HISTOSPEC_LENIENCE"),
    ({"HISTOSPEC_FOLLOW": "1"}, "HISTOSPEC_FOLLOW"),
    ({"HISTOSPEC_NARROW_VERIFY": "wide"}, "HISTOSPEC_NARROW_VERIFY"),
    ({"HISTOSPEC_THREADS": "65"}, "HISTOSPEC_THREADS"),
    ({"HISTOSPEC_MAX_REPSONSES": "3"}, "unknown setting HISTOSPEC_MAX_REPSONSES"),
    ({"HISTOSPEC_HISTORY_LOAD": "/nonexistent/h.jsonl"}, "no such file"),
])
def test_config_errors_name_the_variable(env, needle):
    with pytest.raises(HistoryConfigError, match=needle):
        HistoryConfig.from_env(env)


def test_group_param():
    assert group_of(None) is None and group_of({"other": 1}) is None
    assert group_of({"histospec_group": 7}) == 7
    assert group_of({"histospec_group": (1 << 64) - 1}) == (1 << 64) - 1
    s = group_of({"histospec_group": "prompt-17"})
    assert s == group_of({"histospec_group": "prompt-17"}) and 0 <= s < 1 << 64
    for bad in (-1, 1 << 64, 1.5, True, [1]):
        with pytest.raises(ValueError, match="histospec_group"):
            group_of({"histospec_group": bad})


# -- the draft source ------------------------------------------------------------------------------


def test_drafter_contract_and_sibling_drafting_on_real_completions():
    """Decode the samples of each HumanEval task in lockstep, as SGLang does, feeding back exactly
    what greedy tree verification would accept; check the contract at every step, that siblings
    in flight draft from each other and that finished responses become history."""
    d = 12
    dr = BatchDrafter(d)
    tasks = _humaneval(4)
    steps = accepted_total = 0
    for task, (prompt, samples) in enumerate(tasks):
        samples = samples[:4]
        rids = [f"t{task}-s{k}" for k in range(len(samples))]
        pos = [1] * len(samples)  # tokens accepted so far (the first came from prefill)
        active = list(range(len(samples)))
        while active:
            for k in active:
                dr.sync(rids[k], prompt, samples[k][:pos[k]])
            tokens, mask = dr.draft([rids[k] for k in active])
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
    assert tot["finished"] == tot["kept"] == 16
    assert tot["accepted"] == accepted_total > 0
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
    tasks = _humaneval(8)
    whole, parts = BatchDrafter(d, HistoryConfig(threads=1)), BatchDrafter(d, HistoryConfig(threads=3))
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
        a, b = whole.draft(rids), parts.draft(rids)
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
    assert [whole.totals[k] for k in counts] == [parts.totals[k] for k in counts]
    assert whole.totals["accepted"] > 50
    assert whole.index.group_keys() == parts.index.group_keys()
    assert 7 in parts.index.group_keys() and 12345 not in parts.index.group_keys()


def test_drafter_lifecycle_retraction_switch_off_and_history_io(tmp_path):
    d = 6
    dr = BatchDrafter(d, HistoryConfig(max_batch=2))
    prompt = [5, 6, 7]
    dr.add_finished(prompt, [1, 2, 3, 4, 5, 6])
    dr.sync("a", prompt, [1])
    tokens, mask = dr.draft(["a"])
    assert tokens[:d].tolist() == [1, 2, 3, 4, 5, 6]  # the earlier response, as a chain
    # Retraction: SGLang rewinds a request; its context starts again, nothing breaks.
    dr.sync("a", prompt, [1, 2, 3])
    dr.sync("a", prompt, [1])
    assert dr.draft(["a"])[0][:2].tolist() == [1, 2]
    # Switch-off above max_batch: root only, padded as a chain.
    for r in ("b", "c"):
        dr.sync(r, prompt, [1])
    tokens, mask = dr.draft(["a", "b", "c"])
    assert tokens.reshape(3, d)[:, 0].tolist() == [1, 1, 1] and not tokens.reshape(3, d)[:, 1:].any()
    check_contract(tokens, mask, [1, 1, 1], d)
    assert dr.totals["drafted_steps"] == 2 and dr.totals["steps"] == 3
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


def test_switch_off_by_measured_acceptance():
    sw = SwitchOff(min_accept=1.0, probe_every=4, window=8)
    assert sw.should_draft(32)  # nothing measured yet
    for _ in range(8):
        sw.observe(accepted=2, request_steps=32)  # 0.06 accepted per request-step
    decisions = [sw.should_draft(32) for _ in range(8)]
    assert decisions.count(True) == 2  # probes only
    # One probe that reaches the threshold switches drafting back on with a fresh window.
    sw.observe(accepted=64, request_steps=32)
    assert sw.mean_accept == 2.0
    assert all(sw.should_draft(32) for _ in range(8))


def test_steps_verified_without_drafts_do_not_count_as_rejections():
    """While switched off, the verify steps that carried no drafts accept nothing; they must not enter
    the acceptance window, or a probe could never bring drafting back."""
    dr = BatchDrafter(8, HistoryConfig(min_accept=1.0, probe_every=4))
    prompt, resp = list(range(10, 40)), list(range(100, 160))
    dr.add_finished(prompt, resp, None)
    dr.sync_batch([("r", prompt, [], (), None)])
    for _ in range(8):  # measured: nothing accepted
        dr.draft(["r"])
        dr.observe_step([0])
    assert dr.switch.mean_accept == 0.0
    window = list(dr.switch._acc)
    for _ in range(3):  # switched off: these steps draft nothing and measure nothing
        dr.draft(["r"])
        assert not dr.drafting
        dr.observe_step([0])
    assert dr.switch._acc == window
    while not dr.drafting:  # until the probe
        dr.observe_step([0])
        dr.draft(["r"])
    dr.observe_step([7])
    assert dr.switch.mean_accept == 7.0 and dr.switch.should_draft(1)


# -- the launcher (no SGLang needed up to the exec) --------------------------------------------------


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "histospec_sgl.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=60)


def test_launch_server_help_and_errors():
    r = _cli("launch-server", "--help")
    assert r.returncode == 0 and "--history-load" in r.stdout and "HISTOSPEC_MEMORY_BUDGET" in r.stdout
    r = _cli("launch-server", "--history-memory-budget", "lots", "--model-path", "m")
    assert r.returncode == 2 and "HISTOSPEC_MEMORY_BUDGET='lots'" in r.stderr
    r = _cli("launch-server", "--model-path", "m", env={"HISTOSPEC_DRAFT_POLICY": "bogus"})
    assert r.returncode == 2 and "HISTOSPEC_DRAFT_POLICY" in r.stderr
    r = _cli("launch-server", "--model-path", "m", "--attention-backend", "triton")
    assert r.returncode == 2 and "--attention-backend flashinfer" in r.stderr
    r = _cli("launch-server", "--model-path", "m", "--speculative-algorithm", "NGRAM")
    assert r.returncode == 2 and "runs HISTORY" in r.stderr
    assert "launch-server" in _cli("--help").stdout
    if importlib.util.find_spec("sglang") is None:
        r = _cli("launch-server", "--check")
        assert r.returncode == 1 and "sglang is not installed" in r.stderr


# -- real SGLang, in fresh subprocesses ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A model directory SGLang's argument code can read (config only: no weights are loaded)."""
    p = tmp_path_factory.mktemp("tiny")
    (p / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "num_hidden_layers": 2, "vocab_size": 32000, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
    }))
    return p


def _sglang_env(**extra: str) -> dict[str, str]:
    """This process's environment without any ``HISTOSPEC_*`` setting, plus ``extra``."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("HISTOSPEC_")}, **extra}


def _free_port() -> int:
    """A TCP port on loopback that nothing listens on (for a torch.distributed rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_sglang(py: Path, code: str, *argv: str, env: dict | None = None, timeout: int = 240
                ) -> subprocess.CompletedProcess:
    return subprocess.run([str(py), "-c", textwrap.dedent(code), *argv], capture_output=True, text=True,
                          env=_sglang_env(**{"PYTHONWARNINGS": "ignore", **(env or {})}), timeout=timeout,
                          cwd=str(ROOT / "tests"))


_RESOLVE = """
    import json, sys
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    algo = SpeculativeAlgorithm.from_string("history")
    sa = prepare_server_args(sys.argv[1:])
    print("RESULT " + json.dumps(dict(
        algo_type=type(algo).__name__, is_ngram=algo.is_ngram(), has_draft_kv=algo.has_draft_kv(),
        need_topk=algo.need_topk(), carries=algo.carries_draft_hidden_states(),
        supports_overlap=algo.supports_overlap,
        alg=sa.speculative_algorithm, d=sa.speculative_num_draft_tokens, topk=sa.speculative_eagle_topk,
        steps=sa.speculative_num_steps, mrr=sa.max_running_requests, mixed=sa.enable_mixed_chunk,
        attn=sa.attention_backend, breadth=sa.speculative_ngram_max_bfs_breadth,
        acc=sa.speculative_accept_threshold_acc)))
"""


def _resolve(py: Path, args: list[str], env: dict | None = None):
    return _run_sglang(py, _RESOLVE, *args, env=env)


def _result(r: subprocess.CompletedProcess) -> dict:
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, f"rc={r.returncode}\nstdout:{r.stdout[-2000:]}\nstderr:{r.stderr[-4000:]}"
    return json.loads(lines[-1][7:])


BASE = ["--device", "cpu", "--load-format", "dummy", "--skip-tokenizer-init"]


def test_entry_point_registers_history_and_resolves_ngram_defaults(sglang_py, tiny_model):
    r = _resolve(sglang_py, ["--model-path", str(tiny_model), *BASE, "--speculative-algorithm", "HISTORY",
                             "--attention-backend", "flashinfer"])
    res = _result(r)
    assert res["algo_type"] == "HistoryAlgo"
    assert res["is_ngram"] and not res["has_draft_kv"] and not res["need_topk"] and not res["carries"]
    assert res["supports_overlap"]
    # SGLang's NGRAM defaults, filled in by SGLang's own code.
    assert res["alg"] == "HISTORY" and res["d"] == 12 and res["mrr"] == 48 and res["mixed"] is False
    assert res["topk"] == res["breadth"] and res["steps"] == 12 // res["topk"]
    assert res["attn"] == "flashinfer"
    # The user's own choices win.
    res = _result(_resolve(sglang_py, ["--model-path", str(tiny_model), *BASE, "--speculative-algorithm",
                                       "history", "--speculative-num-draft-tokens", "16",
                                       "--max-running-requests", "8"]))
    assert (res["d"], res["mrr"]) == (16, 8)
    assert res["attn"] == "flashinfer", "an unset attention backend becomes FlashInfer"
    assert res["acc"] == 1.0, "exact verification by default"


def test_lenience_sets_sglang_accept_threshold(sglang_py, tiny_model):
    args = ["--model-path", str(tiny_model), *BASE, "--speculative-algorithm", "HISTORY"]
    res = _result(_resolve(sglang_py, args, env={"HISTOSPEC_LENIENCE": "1.6487"}))
    assert res["acc"] == pytest.approx(1 / 1.6487)
    r = _resolve(sglang_py, [*args, "--speculative-accept-threshold-acc", "0.5"], env={"HISTOSPEC_LENIENCE": "2"})
    assert r.returncode != 0 and "set one of them" in r.stderr, r.stderr[-2000:]


def test_wrong_backend_and_bad_settings_are_clear_errors(sglang_py, tiny_model):
    r = _resolve(sglang_py, ["--model-path", str(tiny_model), *BASE, "--speculative-algorithm", "HISTORY",
                             "--attention-backend", "triton"])
    assert r.returncode != 0 and "--attention-backend flashinfer" in r.stderr, r.stderr[-3000:]
    r = _resolve(sglang_py, ["--model-path", str(tiny_model), *BASE, "--speculative-algorithm", "HISTORY",
                             "--attention-backend", "flashinfer"], env={"HISTOSPEC_MAX_BATCH": "-3"})
    assert r.returncode != 0 and "HISTOSPEC_MAX_BATCH" in r.stderr, r.stderr[-3000:]
    # Other algorithms are untouched by the plugin (and by a bad HISTOSPEC_ value).
    res = _result(_resolve(sglang_py, ["--model-path", str(tiny_model), *BASE, "--speculative-algorithm",
                                       "NGRAM", "--attention-backend", "triton"],
                           env={"HISTOSPEC_MAX_BATCH": "-3"}))
    assert res["alg"] == "NGRAM" and res["attn"] == "triton"


def test_registration_is_idempotent_cheap_and_fails_loudly(sglang_py):
    r = _run_sglang(sglang_py, """
        import sys
        import histospec_sgl.plugin as p
        p.register(); p.register()
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        assert type(SpeculativeAlgorithm.from_string("HISTORY")).__name__ == "HistoryAlgo"
        heavy = [m for m in ("histospec_sgl._core", "histospec_sgl.plugin.worker",
                             "sglang.srt.speculative.ngram_worker", "histospec_sgl.drafter") if m in sys.modules]
        print("RESULT", heavy)
    """)
    assert "RESULT []" in r.stdout, r.stdout + r.stderr[-3000:]
    # A registration that fails inside SGLang's loader (which only logs plugin errors) stops a
    # process that asked for HISTORY, with the reason and the fix.
    r = _run_sglang(sglang_py, """
        import sys
        import histospec_sgl.plugin.registration as c
        def boom(): raise ImportError("simulated broken install")
        c.register_history = boom
        sys.argv = ["sglang.launch_server", "--speculative-algorithm", "HISTORY"]
        from sglang.srt.plugins import load_plugins
        load_plugins()
        print("NOT REACHED")
    """)
    assert r.returncode != 0 and "NOT REACHED" not in r.stdout
    assert "simulated broken install" in r.stderr and "launch-server --check" in r.stderr
    # The worker needs SGLang's NGRAM worker (a CUDA sgl_kernel): without it the factory says so.
    r = _run_sglang(sglang_py, """
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        class SA: disable_overlap_schedule = False
        try:
            SpeculativeAlgorithm.from_string("HISTORY").create_worker(SA())
        except RuntimeError as e:
            print("RESULT", e)
    """)
    assert "RESULT histospec-sgl: the HISTORY worker cannot be imported" in r.stdout, r.stdout + r.stderr[-2000:]


def test_launch_server_check_finds_the_plugin(sglang_py):
    r = subprocess.run([str(sglang_py), "-m", "histospec_sgl.cli", "launch-server", "--check"],
                       capture_output=True, text=True, timeout=240,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "sglang 0.5.17" in r.stdout and "entry point histospec = histospec_sgl.plugin:register" in r.stdout
    assert "HISTORY -> CustomSpecAlgo('HISTORY')" in r.stdout


def _sglang_tree_links(py: Path) -> str:
    """SGLang's own host-side tree-link derivation (ngram_worker._derive_tree_links), lifted from the
    installed source: importing ngram_worker needs a CUDA sgl_kernel."""
    r = _run_sglang(py, "import sglang, os; print(os.path.dirname(sglang.__file__))")
    src = Path(r.stdout.strip().splitlines()[-1], "srt", "speculative", "ngram_worker.py").read_text()
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "_derive_tree_links")
    return ast.get_source_segment(src, fn)


def test_draft_buffers_match_sglang_tree_reconstruction(sglang_py, tmp_path):
    """Our parents and BFS order, as SGLang's verification walks them: SGLang's derivation of
    first-child / next-sibling links from our masks must agree with our tree, and walking those
    links (as verify_tree_greedy does) must reach every real node exactly once."""
    d = 16
    dr = BatchDrafter(d)
    tasks = _humaneval(6)
    rids, roots = [], []
    for t, (prompt, samples) in enumerate(tasks):
        for s in samples[1:4]:
            dr.add_finished(prompt, s)
        rid = f"r{t}"
        head = samples[0][: max(1, min(20, len(samples[0]) // 2))]
        dr.sync(rid, prompt, head)
        rids.append(rid)
        roots.append(head[-1])
    tokens, mask = dr.draft(rids)
    parents = check_contract(tokens, mask, roots, d)
    np.save(tmp_path / "mask.npy", mask)
    code = _sglang_tree_links(sglang_py) + textwrap.dedent(f"""
        import numpy as np, json
        mask = np.load({str(tmp_path / 'mask.npy')!r}).astype(bool)
        nt, ns = _derive_tree_links(mask, {len(rids)}, {d})
        print("RESULT " + json.dumps([nt.tolist(), ns.tolist()]))
    """)
    r = _run_sglang(sglang_py, "import numpy as np\nimport torch\n" + code)
    next_token, next_sibling = _result(r)
    for b in range(len(rids)):
        seen = []

        def walk(node: int, b: int = b, seen: list[int] = seen) -> None:
            seen.append(node)
            c = next_token[b][node]
            while c != -1:
                assert parents[b][c] == node
                walk(c, b, seen)
                c = next_sibling[b][c]

        walk(0)
        assert sorted(seen) == list(range(d)), "every node reached once from the root"
    assert dr.totals["covered"] == len(rids), "every request got a draft from its group's history"


def test_tp_broadcast_gives_every_rank_rank0s_drafts(sglang_py, tmp_path):
    """Two real torch.distributed ranks (gloo, as SGLang's TP CPU group): rank 0 drafts from its
    index, rank 1 has none; both must return the same buffers, step after step, including a step
    where rank 0's drafting failed and it sent the empty draft."""
    script = tmp_path / "tp.py"
    script.write_text(textwrap.dedent("""
        import os, sys, json
        import numpy as np
        import torch.distributed as dist
        from histospec_sgl.drafter import BatchDrafter
        from histospec_sgl.plugin.tp import DraftBroadcast
        rank = int(sys.argv[1]); port = sys.argv[2]; out = sys.argv[3]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        g = dist.new_group([0, 1], backend="gloo")
        bc = DraftBroadcast(g, src=0, rank_in_group=rank, world_size=2)
        d, bs = 8, 3
        dr = BatchDrafter(d) if bc.is_source else None
        got = []
        for step in range(20):
            if dr is not None:
                if step == 0:
                    for k in range(bs):
                        dr.add_finished([1, 2, 3], [10 + k, 11, 12, 13, 14, 15])
                for k in range(bs):
                    dr.sync(f"r{k}", [1, 2, 3], [10 + k, 11, 12, 13, 14, 15][: 1 + step % 5])
                if step == 7:
                    tokens = np.zeros(bs * d, np.int64); mask = np.tile(np.tril(np.ones((d, d), np.int64)).ravel(), bs)
                else:
                    tokens, mask = dr.draft([f"r{k}" for k in range(bs)])
                tokens, mask = bc.share(tokens, mask, bs, d)
            else:
                tokens, mask = bc.share(None, None, bs, d)
            got.append([tokens.tolist(), mask.tolist()])
        json.dump(got, open(out, "w"))
        dist.destroy_process_group()
    """))
    port = _free_port()
    env = _sglang_env()
    logs = [tmp_path / f"r{r}.log" for r in (0, 1)]
    procs = []
    for r in (0, 1):
        with open(logs[r], "w") as log:
            procs.append(subprocess.Popen([str(sglang_py), str(script), str(r), str(port),
                                           str(tmp_path / f"r{r}.json")], env=env, stderr=log))
    try:
        for r, p in enumerate(procs):
            assert p.wait(timeout=120) == 0, logs[r].read_text()[-3000:]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    a = json.loads((tmp_path / "r0.json").read_text())
    b = json.loads((tmp_path / "r1.json").read_text())
    assert a == b and len(a) == 20
    assert any(any(t[1:8]) for t, _ in a), "rank 0 drafted real nodes"


_WORKER = r'''
import json, sys, types
import numpy as np
import torch
from histospec_sgl.plugin.worker import HistoryWorker
from histospec_sgl import prompt_key

D = 8
sa = types.SimpleNamespace(disable_overlap_schedule=False, page_size=1, speculative_num_draft_tokens=D,
                           speculative_ngram_max_trie_depth=18, speculative_eagle_topk=8,
                           speculative_num_steps=1, device="cpu", tp_size=1, enable_metrics=True,
                           served_model_name="tiny-llama")
target = types.SimpleNamespace(model_runner=types.SimpleNamespace())
# SGLang 0.5.17's constructor: (server_args, gpu_id, ps, nccl_port, target_worker).
w = HistoryWorker(server_args=sa, gpu_id=0, ps=types.SimpleNamespace(tp_rank=0), nccl_port=0,
                  target_worker=target)

class Req:
    def __init__(self, rid, prompt, full, group=None, abort=False):
        self.rid, self.origin_input_ids, self.full = rid, prompt, full
        self.output_ids = []
        self.sampling_params = types.SimpleNamespace(
            custom_params={"histospec_group": group} if group is not None else None)
        self.done, self.abort = False, abort
        self.finished_reason = None
    def finished(self):
        return self.done

def step(reqs, pending):
    """One overlap-mode decode step: pending[rid] = tokens accepted last step, not yet in output_ids."""
    acc = torch.zeros(len(reqs) * D, dtype=torch.int64)
    lens = torch.zeros(len(reqs), dtype=torch.int32)
    for i, r in enumerate(reqs):
        p = pending.get(r.rid, [])
        acc[i * D: i * D + len(p)] = torch.tensor(p, dtype=torch.int64)
        lens[i] = len(p)
    batch = types.SimpleNamespace(reqs=reqs, spec_info=types.SimpleNamespace(accept_tokens=acc, accept_lens=lens),
                                  grammar_needs_sync=lambda: False)
    for r in reqs:
        w._reqs.setdefault(r.rid, r)
    tokens, mask = w._prepare_draft_tokens(batch)
    assert tokens.shape == (len(reqs) * D,) and mask.shape == (len(reqs) * D * D,)
    out = {}
    for i, r in enumerate(reqs):
        r.output_ids = r.output_ids + pending.get(r.rid, [])  # result processing catches up
        pos = len(r.output_ids)
        t = tokens[i * D:(i + 1) * D].tolist()
        assert t[0] == (r.output_ids[-1] if r.output_ids else r.origin_input_ids[-1])
        # Greedy chain acceptance of what the request will really generate next.
        acc_n = 0
        m = mask[i * D * D:(i + 1) * D * D].reshape(D, D)
        node = 0
        while pos + acc_n < len(r.full):
            kids = [j for j in range(1, D) if m[j].sum() == m[node].sum() + 1 and m[j, node] and t[j] == r.full[pos + acc_n]]
            if not kids:
                break
            node = kids[0]; acc_n += 1
        out[r.rid] = r.full[pos: pos + acc_n + 1]
    return out, tokens

prompt = [101, 102, 103]
base = list(range(200, 240))
reqs = [Req(f"a{k}", prompt, [7] + base + [9000 + k]) for k in range(3)]
# First decode step after prefill: the prefill token is pending.
# a0 starts alone; its siblings join 15 steps later and draft from its in-flight context.
start = {"a0": 0, "a1": 15, "a2": 15}
pending = {}
accepted_steps = []
for n in range(80):
    for r in reqs:
        if start[r.rid] == n:
            pending[r.rid] = [r.full[0]]  # the prefill token
    live = [r for r in reqs if not r.done and start[r.rid] <= n]
    if not live:
        break
    pending, tokens = step(live, pending)
    accepted_steps.append(sum(len(v) - 1 for v in pending.values()))
    for r in live:
        if len(r.output_ids) + len(pending[r.rid]) >= len(r.full):
            r.output_ids += pending.pop(r.rid)
            r.done = True
            w.note_request_finished(rid=r.rid, natural_stop=True)
stats = w.history_stats()
# A second epoch of the same prompt drafts the whole response from history.
r2 = Req("b0", prompt, [7] + base + [9000])
pend, _ = step([r2], {"b0": [7]})
first = len(pend["b0"])
# An aborted request leaves no history; a custom group is honoured.
ab = Req("x", [5, 5, 5], [1, 2, 3], group="custom")
step([ab], {"x": [1]})
ab.done = True
ab.finished_reason = type("FINISH_ABORT", (), {})()
w._departed(["x"])
step([r2], {"b0": pend["b0"]})  # the next step's metrics see the abort
w.metrics.refresh_index(w.drafter)
from prometheus_client import CollectorRegistry, multiprocess
reg = CollectorRegistry()
multiprocess.MultiProcessCollector(reg)
metrics = {}
for fam in reg.collect():
    for smp in fam.samples:
        if smp.name.startswith("histospec:"):
            assert smp.labels["model_name"] == "tiny-llama", smp
            metrics[smp.name + (f"/{smp.labels['kept']}" if "kept" in smp.labels else "")] = smp.value
totals = dict(w.drafter.totals)
index = w.drafter.index.stats()
w.clear_cache_pool()  # flush_cache after a weight update: history stays
w.history_save(sys.argv[1])
print("RESULT " + json.dumps(dict(
    steps=len(accepted_steps), accepted=sum(accepted_steps), responses=stats["responses"],
    after_flush=w.drafter.index.stats()["responses"], first=first, finished=stats["finished"],
    live=sorted(w.drafter.live()), groups=w.drafter.index.group_keys(), key=prompt_key(prompt),
    metrics=metrics, totals=totals, index=index)))
'''


def test_worker_glue_with_sglang_ngram_worker_on_cpu(sglang_py, tmp_path):
    """The real HistoryWorker (subclass of SGLang 0.5.17's real NGRAMWorker; only the CUDA kernel
    import is stubbed) driven through overlap-mode decode steps with fake requests: contexts follow
    the accepted tokens including the ones not yet in output_ids, siblings draft from each other,
    finished requests become history that survives flush_cache, aborted ones do not."""
    snap = tmp_path / "snap.bin"
    auto = tmp_path / "auto" / "history.snap"
    prom = tmp_path / "prometheus"
    prom.mkdir()
    r = _run_sglang(sglang_py, _WORKER.replace("sys.argv[1]", repr(str(snap))),
                    env={"PYTHONPATH": str(ROOT / "tests" / "_stubs"), "HISTOSPEC_SNAPSHOT_PATH": str(auto),
                         "PROMETHEUS_MULTIPROC_DIR": str(prom)})
    res = _result(r)
    assert res["responses"] == 3 and res["finished"] == 3 and res["after_flush"] == 3
    # a0 decodes 41 tokens one step at a time (nothing to draft from); its siblings, 15 steps late,
    # catch up with it within a few steps by drafting from its in-flight context (about 15 tokens
    # each), then all three advance together.
    assert res["steps"] <= 42 and res["accepted"] >= 26
    assert res["first"] >= 8, "a new epoch's first verify step takes a full draft from history"
    assert res["live"] == ["b0"] and res["key"] in res["groups"] and len(res["groups"]) == 1
    assert snap.exists() and snap.stat().st_size > 0
    # HISTOSPEC_SNAPSHOT_PATH is refreshed at flush_cache; it loads back with the same history.
    from histospec_sgl import HistoryIndex

    back = HistoryIndex()
    back.load(auto)
    assert back.stats()["responses"] == 3
    # --enable-metrics: the worker's counters reach SGLang's multiprocess Prometheus collection.
    m, tot, idx = res["metrics"], res["totals"], res["index"]
    assert m["histospec:decode_steps_total"] == tot["steps"] == res["steps"] + 3
    for name, key in [("request_steps", "request_steps"), ("covered_request_steps", "covered"),
                      ("draft_tokens_offered", "offered"), ("draft_tokens_accepted", "accepted"),
                      ("drafted_steps", "drafted_steps")]:
        assert m[f"histospec:{name}_total"] == tot[key], name
    assert m["histospec:draft_tokens_accepted_total"] >= res["accepted"] > 0
    assert m["histospec:finished_requests_total/1"] == 3 and m["histospec:finished_requests_total/0"] == 1
    assert 0 < m["histospec:draft_seconds_total"] <= m["histospec:host_seconds_total"]
    assert m["histospec:drafting"] == 1 and m["histospec:draft_errors_total"] == 0
    assert m["histospec:index_responses"] == idx["responses"] == 3
    assert m["histospec:index_bytes"] == idx["bytes"] > 0 and m["histospec:inflight_requests"] == 1


#: SGLang 0.5.23 unpacked by scripts/setup_sglang_env.sh, to lay over the 0.5.17 environment.


def _cpu_verify(py: Path, model: Path, *argv: str) -> tuple[list[str], dict]:
    """The command line and keywords that run tests/sglang_cpu_verify.py in the SGLang environment."""
    env = _sglang_env(PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT / "tests" / "_stubs"),
                      SGLANG_USE_CPU_ENGINE="1")
    return [str(py), str(ROOT / "tests" / "sglang_cpu_verify.py"), str(model), *argv], dict(
        cwd=str(ROOT / "tests"), env=env)


def test_sglang_verify_path_on_cpu_is_lossless_with_and_without_narrow_verify(sglang_py, tiny_model):
    """SGLang's own NGRAM verify path (forward_batch_generation: tree reconstruction, the
    TARGET_VERIFY batch, greedy tree verification, KV compaction) driven by the HISTORY worker on
    CPU, against a fake model that emulates tree attention from the KV slots and the mask it is
    given (tests/sglang_cpu_verify.py). Every response must equal plain greedy decoding, with and
    without overlap scheduling; history must be accepted; and with narrow verify, batches above
    HISTOSPEC_MAX_BATCH (which draft nothing) must reach the model at width 1, the rest at width d."""
    cmd, kw = _cpu_verify(sglang_py, tiny_model)
    _check_cpu_verify(_result(subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)), "0.5.17")


def test_sglang_0_5_23_verify_path_on_cpu_is_lossless(sglang_py, tiny_model):
    """The same run on SGLang 0.5.23, laid over the 0.5.17 environment (its dependencies suffice for
    this path). 0.5.23 moved the worker's settings into a resolved runtime context and changed the
    NGRAM worker's constructor and verify call; every response must still equal greedy decoding."""
    if not (SGLANG_0523 / ".done").exists():
        _sglang_missing(f"{SGLANG_0523} is missing: scripts/setup_sglang_env.sh did not finish",
                        "needs SGLang 0.5.23 unpacked by scripts/setup_sglang_env.sh")
    cmd, kw = _cpu_verify(sglang_py, tiny_model)
    kw["env"]["PYTHONPATH"] += os.pathsep + str(SGLANG_0523)
    _check_cpu_verify(_result(subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)), "0.5.23")


def _check_cpu_verify(res: dict, version: str) -> None:
    assert {run["sglang"] for run in res.values()} == {version}
    assert len(res) == 4
    d = 8
    for name, run in res.items():
        first, second = run["epochs"]
        assert first["identical"] and second["identical"], name
        assert run["width_after"] == d and run["responses"] == 12, name
        narrow = name.endswith("narrow=True")
        widths = {w for _, w in first["calls"] + second["calls"]}
        if not narrow:
            assert widths == {d} and run["narrow_steps"] == 0, name
            # Epoch 2 drafts each response whole from epoch 1's: about d tokens per verify step.
            assert second["steps"] * 4 < first["steps"], name
        else:
            assert run["narrow_steps"] > 0 and widths == {1, d}, name
            # Above HISTOSPEC_MAX_BATCH=3 nothing is drafted and the step is verified at width 1;
            # at 3 or fewer the second epoch drafts from history at width d.
            assert all(w == 1 for bs, w in second["calls"] if bs > 3), name
            assert all(w == d for bs, w in second["calls"] if bs <= 3), name
            assert second["steps"] < first["steps"], name


def test_sglang_verify_path_with_two_tp_ranks_runs_in_step(sglang_py, tiny_model, tmp_path):
    """The same verify path on two tensor-parallel ranks (real gloo over loopback): rank 0 drafts and
    broadcasts, rank 1 keeps no index. Narrow verify decides the width from the broadcast drafts, so
    both ranks take the same branch every step: neither waits on the other (a hang fails the
    timeout), and they run the same steps at the same widths with identical, lossless responses."""
    port = _free_port()
    procs = []
    for rank in (0, 1):
        cmd, kw = _cpu_verify(sglang_py, tiny_model, str(rank), str(port))
        with open(tmp_path / f"r{rank}.out", "w") as out:
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, **kw))
    try:
        for p in procs:
            p.wait(timeout=600)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    res = []
    for rank in (0, 1):
        text = (tmp_path / f"r{rank}.out").read_text()
        res.append(_result(subprocess.CompletedProcess([], procs[rank].returncode, text, "")))
    r0, r1 = res
    assert r0.keys() == r1.keys() and len(r0) == 4
    for name in r0:
        assert r0[name]["responses"] == 12 and r1[name]["responses"] is None, "rank 1 keeps no history"
        for k in ("epochs", "narrow_steps", "width_after"):
            assert r0[name][k] == r1[name][k], (name, k)
        assert all(e["identical"] for e in r0[name]["epochs"]), name
    assert r0["overlap=True,narrow=True"]["narrow_steps"] > 0


def test_replay_drives_sglangs_own_ngram_corpus(sglang_py, tmp_path):
    """The replay peer ``sglang_ngram_global`` runs SGLang's real C++ NGRAM corpus (JIT-built here):
    on the shipped HumanEval sample it must agree with our reimplementation of the same trie
    (``sglang_trie_global``), which the other benchmarks use where SGLang is not installed."""
    out = tmp_path / "r.json"
    r = subprocess.run([str(sglang_py), "-m", "histospec_sgl.cli", "replay", "--preset", "humaneval-sample",
                        "--scenario", "cross-sample", "--peers", "sglang_trie_global,sglang_ngram_global",
                        "--json", str(out)], capture_output=True, text=True, timeout=600,
                       env=_sglang_env(PYTHONWARNINGS="ignore", OPENBLAS_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    peers = json.loads(out.read_text())["peers"]
    real, model = peers["sglang_ngram_global"], peers["sglang_trie_global"]
    assert real["status"] == model["status"] == "ok"
    assert real["tokens_per_verify_step"] > 1.5
    assert abs(real["tokens_per_verify_step"] / model["tokens_per_verify_step"] - 1) < 0.05


_INDEX_PEER = r"""
import json, os
from histospec_sgl import HistoryIndex
from histospec_sgl.bench import index_bench
from histospec_sgl.bench.index_peers import SGLangSAM
from histospec_sgl.bench.workload import W1, generate
w = generate(W1, prompts=4)
peer = SGLangSAM("PROB").run(w, index_bench._rss, steps=3, acc_prompts=2, latency_requests=4)
ix, _, _ = index_bench.ingest(w, {})
ours = index_bench.acceptance(ix, w, 2)
print(json.dumps({"peer": peer, "ours": ours}))
"""


def test_index_bench_runs_sglangs_own_suffix_automaton(sglang_py):
    """``bench index`` measures SGLang's real NGRAM suffix automaton (its external-corpus SAM, one per
    prompt) side by side with ours; on a 4-prompt W1 both must draft, at comparable acceptance."""
    r = subprocess.run([str(sglang_py), "-c", _INDEX_PEER], capture_output=True, text=True, timeout=600,
                       env=_sglang_env(PYTHONWARNINGS="ignore", OPENBLAS_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    peer, ours = res["peer"], res["ours"]
    assert peer["ingest_tokens_per_s"] > 0 and peer["batch_draft_ms_per_step"] > 0
    assert peer["accepted_per_position_k16"] > 3.0 and peer["tokens_per_verify_step_d16"] > 2.0
    for k in ("accepted_per_position_k16", "tokens_per_verify_step_d16"):
        assert 0.7 < peer[k] / ours[k] < 1.3, (k, peer[k], ours[k])


_TRIE_PEER = r"""
import json
from histospec_sgl.bench import index_bench
from histospec_sgl.bench.index_peers import SGLangTriePeer
from histospec_sgl.bench.workload import W1, generate
w = generate(W1, prompts=4)
peer = SGLangTriePeer().run(w, index_bench._rss, steps=3, acc_prompts=2, latency_requests=4)
ix, _, _ = index_bench.ingest(w, {})
ours = index_bench.acceptance(ix, w, 2)
print(json.dumps({"peer": peer, "ours": ours}))
"""


def test_index_bench_runs_sglangs_own_trie(sglang_py):
    """``bench index`` measures SGLang's real NGRAM trie (its online index): one corpus at its default
    capacity for ingest and the per-step calls, a corpus per prompt for acceptance. On a 4-prompt W1
    it drafts and accepts in the range anchors.md measured for it (k=16 about 7), below ours."""
    r = subprocess.run([str(sglang_py), "-c", _TRIE_PEER], capture_output=True, text=True, timeout=600,
                       env=_sglang_env(PYTHONWARNINGS="ignore", OPENBLAS_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    peer, ours = res["peer"], res["ours"]
    for k in ("ingest_tokens_per_s", "bytes_per_token", "batch_draft_ms_per_step", "update_ms_per_step"):
        assert peer[k] > 0, (k, peer[k])
    assert 5.0 < peer["accepted_per_position_k16"] < ours["accepted_per_position_k16"], (peer, ours)
    assert 3.0 < peer["tokens_per_verify_step_d16"] < ours["tokens_per_verify_step_d16"], (peer, ours)


def test_bench_worker_runs_the_worker_loop_and_reports_host_time(tmp_path):
    out = tmp_path / "worker.json"
    r = _cli("bench", "worker", "--batch-sizes", "4,8", "--groups", "4", "--steps", "4", "--warm", "200",
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
    bad = _cli("bench", "worker", "--batch-sizes", "0")
    assert bad.returncode == 2 and "--batch-sizes" in bad.stderr
