"""OpenRLHF 0.11.2 (from PyPI, in .venv-sglang, with vLLM 0.33.0 for its types) through
``histospec_sgl.integrations.openrlhf_agent``: three episodes of OpenRLHF's real
``SamplesGenerator.generate_samples`` over two of its ``RolloutRayActor``s on a local Ray cluster,
the executor loaded by OpenRLHF's own loader, only vLLM's engine stood in (by the real CPU SGLang
server, answering with vLLM's own ``RequestOutput``). The second episode reuses the first's
responses through the draft server, whichever engine each sample lands on, with the current
policy's log-probs, and the reward comes from OpenRLHF's reward-function path. The draft server is
killed before the second episode and restarted before the third: the rollouts complete, and the
third drafts from what the second published while it was down.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import DRIVERS, ROOT, driver_path, require_modules

pytestmark = pytest.mark.timeout(600)
DRIVER = DRIVERS / "openrlhf_driver.py"


@pytest.fixture(scope="module")
def openrlhf_py(sglang_py) -> Path:
    return require_modules(sglang_py, "openrlhf.utils.agent, vllm.outputs", "OpenRLHF or vLLM is")


@pytest.mark.memory(3.5)
def test_specrl_executor_three_episodes_and_a_dead_draft_server(openrlhf_py, text_engine, tmp_path):
    srv = text_engine["server"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HISTOSPEC_")}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=driver_path())
    out_path = tmp_path / "out.json"
    r = subprocess.run([str(openrlhf_py), str(DRIVER), str(text_engine["model"]), srv.url, str(tmp_path / "draft"),
                        str(out_path)], capture_output=True, text=True, timeout=540, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-8000:]
    out = json.loads(out_path.read_text())
    first, second, third = out["episodes"]
    assert len(first) == len(second) == len(third) == 16
    # The draft server was killed (SIGKILL) after the first episode's records were acknowledged; the
    # second episode ran without it, reusing from the engines' mirrors; restarted on its data dir, it
    # holds the acknowledged records and the ones queued while it was down.
    assert out["durable"]["before_kill"] == {"0": 16}
    assert out["durable"]["after_restart"] == {"0": 16, "1": 16}

    # The draft server requires a token (as a job's does): every record above went through with it, and
    # a lookup with a wrong token fails with a message naming the setting, not silently empty.
    wrong = out["wrong_token"]
    assert "UNAUTHENTICATED" in wrong and "HISTOSPEC_DRAFT_SERVER_TOKEN_FILE" in wrong, wrong
    # The third episode drafts from the second's responses, published while the server was down:
    # each is a second-episode response of its prompt, kept whole.
    for r_ in third:
        assert r_["histospec_reused"] == r_["histospec_previous_len"] == len(r_["response_ids"]) > 0
        assert any(e["response_ids"] == r_["response_ids"] for e in second if e["prompt"] == r_["prompt"])
    assert all(c > 0 for c in out["engine_calls"])  # OpenRLHF spread the prompts over both engines
    for rows in (first, second):
        for r_ in rows:
            n = len(r_["response_ids"])
            assert n > 0 and len(r_["rollout_log_probs"]) == n
            assert r_["histospec_reused"] + r_["histospec_generated"] == n
            assert r_["reward"] in (0.0, 1.0)
    assert all(r_["histospec_previous_len"] == 0 for r_ in first)
    assert all(r_["histospec_previous_len"] > 0 for r_ in second)
    assert sum(r_["histospec_reused"] for r_ in second) == sum(r_["histospec_previous_len"] for r_ in second)
    # Each second-episode response starts with a first-episode response of its prompt, and the four
    # samples of a prompt start from four different ones.
    by_prompt: dict[str, list[list[int]]] = {}
    for r_ in first:
        by_prompt.setdefault(r_["prompt"], []).append(r_["response_ids"])
    for prompt, earlier in by_prompt.items():
        later = [r_ for r_ in second if r_["prompt"] == prompt]
        starts = []
        for r_ in later:
            k = int(r_["histospec_reused"])
            match = [i for i, e in enumerate(earlier) if e[:k] == r_["response_ids"][:k]]
            assert match, prompt
            starts.append(tuple(r_["response_ids"][:k]))
        assert len(set(starts)) == len({tuple(e) for e in earlier})
    # Responses cut at 24 in the first episode were kept whole and continued to the new budget of 32
    # through OpenRLHF's single-turn executor.
    continued = [r_ for r_ in second if r_["histospec_reused"] == 24 and r_["histospec_generated"] > 0]
    assert continued and all(len(r_["response_ids"]) <= 32 for r_ in second)
    # The log-probs OpenRLHF trains on are the current policy's: score afresh.
    for r_ in continued[:3] + second[:2]:
        scored = srv._post("/generate", {"input_ids": r_["prompt_ids"] + r_["response_ids"], "return_logprob": True,
                                         "logprob_start_len": len(r_["prompt_ids"]) - 1,
                                         "sampling_params": {"temperature": 1.0, "max_new_tokens": 1}}, 120)
        lps = [e[0] for e in scored["meta_info"]["input_token_logprobs"]][-len(r_["response_ids"]):]
        assert max(abs(a - b) for a, b in zip(lps, r_["rollout_log_probs"])) < 1e-3


UNIT = r"""
import asyncio, os, sys
sys.path.insert(0, sys.argv[1])
from transformers import AutoTokenizer
from vllm import SamplingParams
from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput
from histospec_sgl import prompt_key
from histospec_sgl.integrations import openrlhf_agent as m
from histospec_sgl.specrl.store import shared
from histospec_sgl.specrl.guard import reuse_blocker

os.environ.pop("HISTOSPEC_N_SAMPLES", None)
try:
    m.AgentExecutor()
except ValueError as e:
    assert "HISTOSPEC_N_SAMPLES" in str(e) and "n_samples_per_prompt" in str(e), e
else:
    raise AssertionError("no error without HISTOSPEC_N_SAMPLES")
os.environ["HISTOSPEC_N_SAMPLES"] = "1"
ex = m.AgentExecutor()
assert ex.n == 1 and type(ex.inner).__name__ == "SingleTurnAgentExecutor"
# OpenRLHF's own defaults (samples_generator.py) are plain sampling: reuse.
assert reuse_blocker(SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=8, min_tokens=1,
                                    logprobs=1)) is None
for kw, word in [({"temperature": 0.7}, "temperature"), ({"top_p": 0.9}, "top_p"), ({"top_k": 20}, "top_k"),
                 ({"min_p": 0.05}, "min_p"), ({"repetition_penalty": 1.1}, "repetition_penalty")]:
    assert word in (reuse_blocker(SamplingParams(**kw)) or ""), kw


class Engine:
    # Where RolloutRayActor sits: answers with vLLM's own types; every previous token scores at its
    # old log-prob, so the whole previous response is accepted.
    def __init__(self, old):
        self.old, self.calls = old, []

    async def generate(self, ids, sp, multi_modal_data=None):
        self.calls.append({"ids": list(ids), "temperature": sp.temperature, "scoring": sp.prompt_logprobs is not None})
        plp = None
        if sp.prompt_logprobs is not None:
            plp = [None] + [{t: Logprob(logprob=self.old.get(i, -5.0))} for i, t in enumerate(ids[1:], 1)]
        gen = CompletionOutput(index=0, text="", token_ids=[11, 12], cumulative_logprob=None,
                               logprobs=[{11: Logprob(logprob=-0.5)}, {12: Logprob(logprob=-0.25)}], finish_reason="stop")
        return RequestOutput(request_id="r", prompt=None, prompt_token_ids=list(ids), prompt_logprobs=plp,
                             outputs=[gen], finished=True)


tok = AutoTokenizer.from_pretrained(sys.argv[2])
prompt = "What is 17 * 23?"
ids = tok(text=prompt, add_special_tokens=False)["input_ids"]
group = prompt_key(ids)
prev = [7, 8, 9]
shared().record(None, ids, prev, [-1.0, -2.0, -3.0], "stop", group=group, slot=0, version=0)
assert shared().get(None, group, 0) is not None  # no draft server: kept in this process
old = {len(ids) + i: lp for i, lp in enumerate([-1.0, -2.0, -3.0])}

# Not plain sampling: the inner executor runs with the real engine, untouched; nothing reused.
eng = Engine(old)
out = asyncio.run(ex.execute(prompt, "x", SamplingParams(temperature=0.7, max_tokens=8, logprobs=0), 64, tok, eng))
assert [c["scoring"] for c in eng.calls] == [False] and eng.calls[0]["temperature"] == 0.7, eng.calls
assert out["observation_tokens"] == ids + [11, 12] and out["extra_logs"]["histospec_reused"] == 0.0
assert out["extra_logs"]["histospec_generated"] == 2.0

# Plain sampling: one scoring call, the whole previous response kept (it had ended), no generation;
# the inner executor sees it as the engine's answer, with the current policy's log-probs.
eng = Engine(old)
out = asyncio.run(ex.execute(prompt, "x", SamplingParams(temperature=1.0, max_tokens=8, logprobs=0), 64, tok, eng))
assert [c["scoring"] for c in eng.calls] == [True], eng.calls
assert out["observation_tokens"] == ids + prev and out["action_ranges"] == [(len(ids), len(ids) + 3)]
assert out["rollout_log_probs"][-3:] == [-1.0, -2.0, -3.0] and not out["truncated"]
assert out["extra_logs"]["histospec_reused"] == 3.0 and out["extra_logs"]["histospec_previous_len"] == 3.0
print("ok")
"""


def test_executor_refuses_what_it_cannot_do_exactly(openrlhf_py, text_model):
    """Without the group size the executor refuses to start (a group's samples would share one
    previous response). It wraps OpenRLHF's single-turn executor: sampling other than plain T=1 runs
    it untouched (vLLM's prompt log-probs skip its sampling processors), and plain sampling hands it
    the kept previous response as the engine's answer, with the current policy's log-probs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HISTOSPEC_")}
    r = subprocess.run([str(openrlhf_py), "-c", UNIT, str(ROOT), str(text_model)], capture_output=True, text=True,
                       timeout=300, env=env, cwd=ROOT / "tests")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]
