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
- slime's own plugin-contract tests accept ``generate``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import ROOT, require_modules, sglang_missing, shared_path
from histospec_sgl.bench.engine_server import free_port

pytestmark = pytest.mark.timeout(900)
DRIVER = Path(__file__).with_name("slime_driver.py")


@pytest.fixture(scope="module")
def slime_src(sglang_py) -> Path:
    src = Path(os.environ["HISTOSPEC_SLIME_SRC"]) if os.environ.get("HISTOSPEC_SLIME_SRC") else shared_path(
        "trainers", "slime")
    if src is None or not (src / "slime" / "rollout" / "sglang_rollout.py").exists():
        sglang_missing("slime's source is missing: set HISTOSPEC_SLIME_SRC or put it in ../shared/trainers/slime",
                       "needs slime's source (HISTOSPEC_SLIME_SRC)")
    require_modules(sglang_py, "sglang_router, pyarrow, pylatexenc", "slime's dependencies are")
    return src


def _group(prompt: str) -> int:
    return int.from_bytes(hashlib.blake2b(prompt.encode(), digest_size=8).digest(), "little")


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


@pytest.fixture(scope="module")
def stack(sglang_py, slime_src, text_engine, tmp_path_factory):
    """sglang-router in front of the shared HISTORY server (synced with the draft server)."""
    tmp = tmp_path_factory.mktemp("slime")
    srv = text_engine["server"]
    port = free_port()
    with open(tmp / "router.log", "wb") as log:
        router = subprocess.Popen(
            [str(sglang_py), "-m", "sglang_router.launch_router", "--worker-urls", srv.url, "--host",
             "127.0.0.1", "--port", str(port), "--policy", "round_robin", "--log-level", "warn"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_http(f"http://127.0.0.1:{port}/workers")
        yield {**text_engine, "router": f"http://127.0.0.1:{port}", "tmp": tmp, "slime": slime_src}
    finally:
        router.kill()
        router.wait(30)


def _run(sglang_py: Path, stack: dict, mode: str, prompts: list[str]) -> dict:
    tmp = stack["tmp"]
    data = tmp / f"prompts-{mode}.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "label": "x"}) + "\n" for p in prompts))
    out = tmp / f"out-{mode}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HISTOSPEC_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(stack["slime"]), str(DRIVER.parent)])
    # HISTORY mode syncs with the engine's draft server; SPEC-RL's store is the driver's own (a data dir).
    draft = stack["draft_server"].address if mode == "history" else str(tmp / "specrl-draft")
    r = subprocess.run([str(sglang_py), str(DRIVER), mode, stack["router"], str(stack["model"]), str(data),
                        draft, str(out)], capture_output=True, text=True, timeout=600, env=env, cwd=tmp)
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


def test_history_mode_two_epochs(sglang_py, stack):
    prompts = ["The quick brown fox jumps over", "def fibonacci(n):", "In 1492, Columbus sailed",
               "Solve for x: 3x + 5 = 20."]
    epochs = _run(sglang_py, stack, "history", prompts)["epochs"]
    assert [e["rollout_id"] for e in epochs] == [0, 1] and epochs[1]["epoch_id"] == 1
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
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(slime_src), str(DRIVER.parent)])
    r = subprocess.run([str(sglang_py), "-c", GUARD, str(text_model)], capture_output=True, text=True, timeout=300,
                       env=env, cwd=DRIVER.parent)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-3000:] + r.stderr[-5000:]
