"""slime through ``histospec_sgl.integrations.slime``, with slime's real code (its source from
../shared/trainers/slime, never copied here) on a real stack: SGLang's server on CPU decoding with
HISTORY, sglang-router in front of it, the draft server; a random-weight Llama with the Qwen3
tokenizer, so that slime's text path (tokenize, detokenize) runs for real.

- HISTORY mode, greedy: two epochs of slime's ``generate_rollout``; a group's samples share one
  routing key and history group; the second epoch drafts whole responses; every response equals
  the first epoch's (lossless); ``record`` publishes every finished sample to the draft server.
- SPEC-RL mode, T=1: the second epoch reuses the previous responses of the same sample slots,
  the log-probs slime trains on are the current policy's (checked against a fresh scoring pass),
  and the sample's fields line up as slime's own generate leaves them.
- Routing across two engines (sglang-router 0.3.2): without a draft server, ``--router-policy
  manual`` keeps a prompt's n samples and its next epoch on the engine that holds its history;
  with one, every engine drafts every group whatever the router picks.
- slime's own engine code starts HISTORY (``SGLangEngine.init``: ``_compute_server_args`` over
  slime's parser's arguments), and drafting goes on through its weight update (
  ``update_weights_from_disk`` + ``flush_cache``) and its release/resume of memory.
- slime's own plugin-contract tests accept ``generate``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from _engine_checks import FIXED
from _greedy import check_phases, run_in_group

from conftest import DRIVERS, ROOT, driver_path
from histospec_sgl import group_key, procs
from histospec_sgl.bench.engine_server import verify_steps
from histospec_sgl.procs import free_port

# slime's source (tests/conftest.py) first: without it every test here skips before a server starts.
pytestmark = [pytest.mark.timeout(900), pytest.mark.usefixtures("slime_src")]
DRIVER = DRIVERS / "slime_driver.py"


def _group(prompt: str) -> int:
    """The adapter names a sample's group by its prompt text (the one rule, histospec_sgl.group_key)."""
    return group_key(group=prompt)


def _wait_http(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


@contextlib.contextmanager
def _router(sglang_py: Path, urls: list[str], policy: str, log: Path, *extra: str):
    """sglang-router (its command line) in front of ``urls``; yields its URL once every worker is
    registered and healthy."""
    port = free_port()
    with open(log, "wb") as f:
        router = procs.spawn(
            [str(sglang_py), "-m", "sglang_router.launch_router", "--worker-urls", *urls, "--host", "127.0.0.1",
             "--port", str(port), "--prometheus-port", str(free_port()), "--policy", policy, "--log-level", "warn",
             *extra], stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http(f"{url}/workers")
        deadline = time.monotonic() + 120
        while True:
            with urllib.request.urlopen(f"{url}/workers", timeout=5) as r:
                workers = json.loads(r.read()).get("workers", [])
            if len(workers) == len(urls) and all(w.get("is_healthy") for w in workers):
                break
            assert time.monotonic() < deadline and router.poll() is None, log.read_text(errors="replace")[-3000:]
            time.sleep(0.5)
        yield url
    finally:
        procs.stop(router)


@pytest.fixture(scope="module")
def stack(sglang_py, slime_src, text_engine, tmp_path_factory):
    """sglang-router in front of the shared HISTORY server (synced with the draft server)."""
    tmp = tmp_path_factory.mktemp("slime")
    with _router(sglang_py, [text_engine["server"].url], "round_robin", tmp / "router.log") as url:
        yield {**text_engine, "router": url, "tmp": tmp, "slime": slime_src}


def _run(sglang_py: Path, stack: dict, mode: str, prompts: list[str], *, router: str | None = None,
         draft: str | None = None, policy: str = "consistent_hashing", name: str | None = None) -> dict:
    tmp = stack["tmp"]
    name = name or mode
    data = tmp / f"prompts-{name}.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "label": "x"}) + "\n" for p in prompts))
    out = tmp / f"out-{name}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HISTOSPEC_")}
    env["PYTHONPATH"] = driver_path(stack["slime"])
    # HISTORY mode syncs with the engine's draft server; SPEC-RL's store is the driver's own (a data dir).
    if draft is None:
        draft = stack["draft_server"].address if mode == "history" else str(tmp / "specrl-draft")
    r = subprocess.run([str(sglang_py), str(DRIVER), mode, router or stack["router"], str(stack["model"]), str(data),
                        draft, str(out), policy], capture_output=True, text=True, timeout=600, env=env, cwd=tmp)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-8000:]
    return json.loads(out.read_text())


def _tokenizer(stack: dict):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(stack["model"] / "tokenizer.json"))


def _check_fields(s: dict, n_prompt: int) -> None:
    n = s["response_length"]
    assert n > 0 and len(s["tokens"]) == n_prompt + n
    assert len(s["rollout_log_probs"]) == n and all(lp <= 0.0 for lp in s["rollout_log_probs"])
    assert s["loss_mask"] == [1] * n
    assert s["status"] in ("completed", "truncated") and s["reward"] is not None


@pytest.mark.memory(2)
def test_history_mode_two_epochs(sglang_py, stack):
    prompts = ["The quick brown fox jumps over", "def fibonacci(n):", "In 1492, Columbus sailed",
               "Solve for x: 3x + 5 = 20."]
    out = _run(sglang_py, stack, "history", prompts)
    epochs = out["epochs"]
    assert [e["rollout_id"] for e in epochs] == [0, 1] and epochs[1]["epoch_id"] == 1
    # The data source announced each next rollout's 4 groups (the next epoch's, across its end).
    assert out["announced"] == 8
    by_prompt: dict[str, list[dict]] = {}
    for e in epochs:
        assert len(e["samples"]) == 16
        for s in e["samples"]:
            by_prompt.setdefault(s["prompt"], []).append(s)
    assert sorted(by_prompt) == sorted(prompts)
    tok = _tokenizer(stack)
    for prompt, samples in by_prompt.items():
        assert len(samples) == 8
        # One routing key and one history group for a prompt's samples, in both epochs.
        assert {s["session_id"] for s in samples} == {f"{_group(prompt):016x}"}
        n_prompt = len(tok.encode(prompt, add_special_tokens=False).ids)
        for s in samples:
            _check_fields(s, n_prompt)
        # Greedy and lossless: every sample of both epochs is the same response.
        assert len({tuple(s["tokens"]) for s in samples}) == 1
    first = [s["spec_info"] for s in epochs[0]["samples"]]
    second = [s["spec_info"] for s in epochs[1]["samples"]]
    per_step = [sum(x["completion_token_num"] for x in e) / sum(x["spec_verify_ct"] for x in e)
                for e in (first, second)]
    # The first epoch's siblings decode in lockstep (little to draft); the second drafts whole responses.
    assert per_step[1] > 4.0 and per_step[1] > 2 * per_step[0], per_step
    # record() published every finished sample, with log-probs, under the prompt's group and slot.
    from histospec_sgl.specrl.client import PreviousResponses

    store = PreviousResponses.from_draft_server(stack["draft_server"].address)
    for prompt, samples in by_prompt.items():
        for slot in range(4):
            prev = store.get(_group(prompt), slot)
            assert prev is not None and list(prev.response_ids) == samples[0]["tokens"][-len(prev.response_ids):]


@pytest.mark.memory(2)
def test_specrl_mode_reuses_previous_responses_with_current_logprobs(sglang_py, stack):
    prompts = ["Once upon a time, in a land", "import numpy as np\n", "The capital of France is",
               "Let f(x) = x^2. Then f(3) ="]
    res = _run(sglang_py, stack, "specrl", prompts)
    epochs = res["epochs"]
    tok = _tokenizer(stack)
    first, second = epochs[0]["samples"], epochs[1]["samples"]
    for s in first + second:
        _check_fields(s, len(tok.encode(s["prompt"], add_special_tokens=False).ids))
        assert s["session_id"] == f"{_group(s['prompt']):016x}"
        h = s["histospec"]
        assert h["reused"] + h["generated"] == s["response_length"]
    assert all(s["histospec"]["previous_len"] == 0 for s in first)
    assert all(s["histospec"]["previous_len"] > 0 for s in second)
    reused = [s["histospec"]["reused"] for s in second]
    assert sum(r > 0 for r in reused) >= 12, reused
    # Reuse is per sample slot: a reused prefix is the previous response of the same slot.
    prev = {(s["prompt"], s["index"] % 4): s["tokens"] for s in first}
    for s in second:
        k = s["histospec"]["reused"]
        if k:
            n_prompt = len(s["tokens"]) - s["response_length"]
            assert s["tokens"][n_prompt:n_prompt + k] == prev[(s["prompt"], s["index"] % 4)][n_prompt:n_prompt + k]
    # The second rollout's budget is 32: responses cut at 24 were kept whole and continued by
    # slime's own generate (its partial-rollout continuation).
    continued = [s for s in second if s["histospec"]["reused"] == 24 and s["histospec"]["generated"] > 0]
    assert continued and all(s["response_length"] <= 32 for s in second)
    # The log-probs slime trains on are the current policy's: score the whole response afresh.
    srv = stack["server"]
    for s in continued[:4] + second[:2]:
        n_prompt = len(s["tokens"]) - s["response_length"]
        out = srv._post("/generate", {"input_ids": s["tokens"], "return_logprob": True,
                                      "logprob_start_len": n_prompt - 1,
                                      "sampling_params": {"temperature": 1.0, "max_new_tokens": 1}}, 120)
        scored = [e[0] for e in out["meta_info"]["input_token_logprobs"]]
        scored = scored[-s["response_length"]:]
        assert max(abs(a - b) for a, b in zip(scored, s["rollout_log_probs"])) < 1e-3
    # The draft server was killed (SIGKILL) before the second rollout: it ran on the mirror, and
    # record() waited only histospec_publish_wait (3 s) for it. Restarted, it took the queued records.
    assert res["dead_rollout_seconds"] < 60 and res["settled_after_restart"] is True

    # The draft server requires a token (as a job's does): every record above went through with it, and
    # a lookup with a wrong token fails with a message naming the setting, not silently empty.
    wrong = res["wrong_token"]
    assert "UNAUTHENTICATED" in wrong and "HISTOSPEC_DRAFT_SERVER_TOKEN_FILE" in wrong, wrong
    # slime's abort path with --partial-rollout (slime_driver.partial_rollouts): the groups in flight
    # came back aborted, not as an error (a sample that had finished comes back finished, as slime
    # returns it), each sample whole: its tokens, log-probs and mask agree.
    buffered, resumed = res["partial"]["buffered"], res["partial"]["resumed"]
    assert len(buffered) == 16 and sum(s["status"] == "aborted" for s in buffered) >= 8
    assert all(s["status"] in ("aborted", "completed", "truncated") for s in buffered)
    for s in buffered:
        n = s["response_length"]
        assert len(s["tokens"]) == len(tok.encode(s["prompt"], add_special_tokens=False).ids) + n
        assert len(s["rollout_log_probs"] or []) == n and (s["loss_mask"] or []) == [1] * n
    # Aborted in its continuation: it keeps the reused previous response (the second rollout's,
    # published while the draft server was down) and what was generated before the abort.
    partial = {s["index"]: s for s in buffered if s["status"] == "aborted" and s["response_length"] > 0}
    assert partial and all(s["response_length"] >= s["histospec"]["reused"] > 0 for s in partial.values())
    by_slot = {(s["prompt"], s["index"] % 4): s for s in second}
    for s in partial.values():
        prev, k = by_slot[(s["prompt"], s["index"] % 4)], s["histospec"]["reused"]
        assert s["tokens"][-s["response_length"]:][:k] == prev["tokens"][-prev["response_length"]:][:k]
    # The next rollout resumed them from the buffer: a partial response is continued, not redone.
    assert len(resumed) == 16 and all(s["status"] in ("completed", "truncated") for s in resumed)
    for s in resumed:
        if s["index"] in partial:
            before = partial[s["index"]]
            assert s["tokens"][: len(before["tokens"])] == before["tokens"]
            assert s["rollout_log_probs"][: before["response_length"]] == before["rollout_log_probs"]
            assert s["response_length"] > before["response_length"]


@pytest.mark.memory(3)
def test_slime_engine_code_starts_history_and_keeps_it_through_weight_updates(sglang_py, slime_src, greedy_model,
                                                                             tmp_path):
    """slime's ``SGLangEngine`` (tests/drivers/slime_engine_driver.py lists what it stands in, and why):
    the server arguments slime computes name HISTORY and keep SGLang's running limit; the second
    rollout drafts whole responses, and so do the rollouts after a weight update from disk (the
    responses carry the new weight version) and after a release and resume of memory."""
    from histospec_sgl.bench.engine_server import cpu_engine_env

    env = {k: v for k, v in os.environ.items() if not k.startswith("HISTOSPEC_")}
    env.update(FIXED)
    env["PYTHONPATH"] = driver_path(slime_src)
    out = tmp_path / "out.json"
    run_in_group([str(sglang_py), str(DRIVER.with_name("slime_engine_driver.py")), str(greedy_model), str(out)],
                 cpu_engine_env(str(sglang_py), base=env), tmp_path, 600)
    res = json.loads(out.read_text())
    assert res["server_args"]["speculative_algorithm"] == "HISTORY"
    assert res["server_args"]["speculative_num_draft_tokens"] == 8
    assert res["server_args"]["max_running_requests"] is None  # SGLang's own limit for speculation
    phases = res["phases"]
    assert list(phases) == ["first", "second", "after_update", "after_wake"], res.get("wake_error")
    check_phases(phases)
    assert {r["weight_version"] for r in phases["after_update"] + phases["after_wake"]} == {"2"}


def test_slime_plugin_contracts_accept_generate(sglang_py, slime_src):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HISTOSPEC_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(slime_src)])
    # The contract tests run slime's reference generate as the inner one: the wrapper must keep it whole.
    env["HISTOSPEC_SLIME_INNER_GENERATE"] = "plugin_contracts.test_plugin_generate_contracts.custom_generate"
    r = subprocess.run([str(sglang_py), str(slime_src / "tests" / "plugin_contracts" / "test_plugin_generate_contracts.py"),
                        "--custom-generate-function-path", "histospec_sgl.integrations.slime.generate", "-q",
                        "-p", "no:cacheprovider"], capture_output=True, text=True, timeout=300, env=env,
                       cwd=slime_src / "tests")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert " passed" in r.stdout and "failed" not in r.stdout


GUARD = r"""
import asyncio, sys
from slime.utils.types import Sample
import slime_driver
from histospec_sgl.integrations import slime as h
from histospec_sgl.specrl.store import shared

calls = []


async def inner(args, sample, sampling_params, evaluation=False):
    calls.append({"response_length": sample.response_length, "evaluation": evaluation,
                  "params": dict(sampling_params)})
    return sample


slime_driver.inner = inner
# The router's port is closed: a request SPEC-RL scored would fail.
args = slime_driver.make_args("specrl", "http://127.0.0.1:9", sys.argv[1], "unused.jsonl", "")
args.histospec_draft_server = None
args.histospec_inner_generate_path = "slime_driver.inner"
sample = Sample(prompt="What is 17 * 23?", index=0)
group = h.sample_group(sample)
shared().record(None, [1, 2, 3], [7, 8, 9], [-1.0, -2.0, -3.0], "stop", group=group, slot=0, version=0)
assert shared().get(None, group, 0) is not None
plain = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 8}
cases = [({**plain, "top_p": 0.9, "custom_params": {"return_top_p_token_ids": True}}, False),
         ({**plain, "temperature": 0.6}, False), (plain, True)]
for params, evaluation in cases:
    out = asyncio.run(h.generate(args, sample, params, evaluation=evaluation))
    assert out is sample and sample.response_length == 0 and "histospec" not in sample.metadata
assert [c["evaluation"] for c in calls] == [False, False, True], calls
assert all(c["params"]["custom_params"]["histospec_group"] == group for c in calls)
assert calls[0]["params"]["custom_params"]["return_top_p_token_ids"] is True
print("ok")
"""


def test_specrl_hands_what_it_cannot_score_to_the_inner_generate(sglang_py, slime_src, text_model):
    """Top-p with slime's top-p replay, a temperature other than 1, and evaluation go to the inner
    generate untouched, although the slot has a previous response: the scoring pass would not give
    the sampling distribution's log-probs (the rule every trainer adapter shares)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HISTOSPEC_")}
    env["PYTHONPATH"] = driver_path(slime_src)
    r = subprocess.run([str(sglang_py), "-c", GUARD, str(text_model)], capture_output=True, text=True, timeout=300,
                       env=env, cwd=DRIVER.parent)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-3000:] + r.stderr[-5000:]


# -- two engines (last in the module: their servers stay up until it ends) --------------------------


@pytest.fixture(scope="module")
def engines(sglang_py, stack):
    """Two HISTORY engines with per-engine history only (no draft server), and one more synced with
    the shared engine's draft server."""
    from histospec_sgl.bench.engine_server import EngineServer, running

    tmp = stack["tmp"]
    kw = dict(python=str(sglang_py), tokenizer=True, max_running=16, max_total_tokens=16384)
    alone = [EngineServer(stack["model"], "history", log_path=tmp / f"alone-{i}.log", env=dict(FIXED), **kw)
             for i in range(2)]
    synced = EngineServer(stack["model"], "history", log_path=tmp / "synced.log",
                          env={"HISTOSPEC_DRAFT_SERVER": stack["draft_server"].address, **FIXED}, **kw)
    with running(*alone, synced):
        yield {"alone": alone, "synced": [stack["server"], synced]}


def _per_step(samples: list[dict]) -> float:
    info = [s["spec_info"] for s in samples]
    return sum(x["completion_token_num"] for x in info) / sum(x["spec_verify_ct"] for x in info)


def _probe(srv, tok, prompt: str) -> float:
    """Tokens per verify step of one greedy request for ``prompt`` sent to ``srv`` itself, as slime's
    next epoch reaches it. sglang-router 0.3.2 drops ``custom_params`` from the sampling params it
    forwards, so behind it the engines group a request by its prompt ids, and so does this one."""
    ids = tok.encode(prompt, add_special_tokens=False).ids
    out = srv._post("/generate", {"input_ids": ids, "sampling_params": {
        "temperature": 0.0, "max_new_tokens": 24, "skip_special_tokens": False}}, 300)
    return out["meta_info"]["completion_tokens"] / verify_steps(out)


@pytest.mark.memory(10)
def test_two_engines_without_a_draft_server_keep_each_group_on_one_engine(sglang_py, stack, engines):
    """sglang-router 0.3.2's command line has no ``consistent_hashing`` (slime's policy for routing
    by key); ``manual`` routes by the same ``X-SMG-Routing-Key``, and our generate makes slime's send
    it. Each prompt's 4 samples and its next epoch land on one engine, which alone holds its
    history: a request for the prompt sent to that engine drafts whole responses, one sent to the
    other does not; ``min_group`` spreads the groups over both engines (the router gives a new key
    to the engine holding the fewest; keys that arrive together may see the same counts, so the four
    groups split two and two or three and one)."""
    prompts = ["Roses are red, violets are", "for i in range(10):", "The mitochondria is the",
               "Compute 12 * 13 step by step."]
    with _router(sglang_py, [e.url for e in engines["alone"]], "manual", stack["tmp"] / "router-manual.log",
                 "--assignment-mode", "min_group") as url:
        epochs = _run(sglang_py, stack, "history", prompts, router=url, draft="", policy="manual",
                      name="manual")["epochs"]
    second = epochs[1]["samples"]
    assert _per_step(second) > 4.0, [_per_step(e["samples"]) for e in epochs]
    tok = _tokenizer(stack)
    holders = []
    for prompt in prompts:
        rates = [_probe(e, tok, prompt) for e in engines["alone"]]
        holder = max(range(2), key=rates.__getitem__)
        assert rates[holder] > 4.0 and rates[1 - holder] < rates[holder] / 2, (prompt, rates)
        holders.append(holder)
    assert set(holders) == {0, 1}, holders


@pytest.mark.memory(10)
def test_two_engines_with_a_draft_server_draft_every_group(sglang_py, stack, engines):
    """With a draft server, routing does not matter for drafting: round-robin sends a prompt's
    samples to both engines, and either engine drafts the prompt's next epoch."""
    prompts = ["Twinkle twinkle little star,", "SELECT name FROM users WHERE", "Water boils at a temperature of",
               "Prove that the square root of 2 is"]
    with _router(sglang_py, [e.url for e in engines["synced"]], "round_robin",
                 stack["tmp"] / "router-synced.log") as url:
        epochs = _run(sglang_py, stack, "history", prompts, router=url, policy="round_robin", name="synced")["epochs"]
    assert _per_step(epochs[1]["samples"]) > 4.0, [_per_step(e["samples"]) for e in epochs]
    tok = _tokenizer(stack)
    for prompt in prompts:
        rates = [_probe(e, tok, prompt) for e in engines["synced"]]
        assert min(rates) > 4.0, (prompt, rates)
