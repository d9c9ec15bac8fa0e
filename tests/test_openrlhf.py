"""OpenRLHF 0.11.2 (from PyPI, in .venv-sglang, with vLLM 0.33.0 for its types) through
``histospec_sgl.integrations.openrlhf_agent``: two episodes of OpenRLHF's real
``SamplesGenerator.generate_samples`` over two of its ``RolloutRayActor``s on a local Ray cluster,
the executor loaded by OpenRLHF's own loader, only vLLM's engine stood in (by the real CPU SGLang
server, answering with vLLM's own ``RequestOutput``). The second episode reuses the first's
responses through the draft server, whichever engine each sample lands on, with the current
policy's log-probs, and the reward comes from OpenRLHF's reward-function path.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, require_modules

pytestmark = pytest.mark.timeout(600)
DRIVER = Path(__file__).with_name("openrlhf_driver.py")


@pytest.fixture(scope="module")
def openrlhf_py(sglang_py) -> Path:
    return require_modules(sglang_py, "openrlhf.utils.agent, vllm.outputs", "OpenRLHF or vLLM is")


def test_specrl_executor_two_episodes(openrlhf_py, text_engine, tmp_path):
    srv, ds = text_engine["server"], text_engine["draft_server"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HISTOSPEC_")}
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=str(ROOT))
    out_path = tmp_path / "out.json"
    r = subprocess.run([str(openrlhf_py), str(DRIVER), str(text_engine["model"]), srv.url, ds.address, str(out_path)],
                       capture_output=True, text=True, timeout=540, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-8000:]
    out = json.loads(out_path.read_text())
    first, second = out["episodes"]
    assert len(first) == len(second) == 16
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
    # The log-probs OpenRLHF trains on are the current policy's: score afresh.
    for r_ in second[:4]:
        scored = srv._post("/generate", {"input_ids": r_["prompt_ids"] + r_["response_ids"], "return_logprob": True,
                                         "logprob_start_len": len(r_["prompt_ids"]) - 1,
                                         "sampling_params": {"temperature": 1.0, "max_new_tokens": 1}}, 120)
        lps = [e[0] for e in scored["meta_info"]["input_token_logprobs"]][-len(r_["response_ids"]):]
        assert max(abs(a - b) for a, b in zip(lps, r_["rollout_log_probs"])) < 1e-3


UNIT = r"""
import os, sys
sys.path.insert(0, sys.argv[1])
from vllm import SamplingParams
from histospec_sgl.integrations import openrlhf_agent as m

os.environ.pop("HISTOSPEC_N_SAMPLES", None)
try:
    m.AgentExecutor()
except ValueError as e:
    assert "HISTOSPEC_N_SAMPLES" in str(e) and "n_samples_per_prompt" in str(e), e
else:
    raise AssertionError("no error without HISTOSPEC_N_SAMPLES")
os.environ["HISTOSPEC_N_SAMPLES"] = "4"
assert m.AgentExecutor().n == 4
# OpenRLHF's own defaults (samples_generator.py) are plain sampling: reuse.
assert m._reuse_blocker(SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=8, min_tokens=1,
                                       logprobs=1)) is None
for kw, word in [({"temperature": 0.7}, "temperature"), ({"top_p": 0.9}, "top_p"), ({"top_k": 20}, "top_k"),
                 ({"min_p": 0.05}, "min_p"), ({"repetition_penalty": 1.1}, "repetition_penalty")]:
    assert word in (m._reuse_blocker(SamplingParams(**kw)) or ""), kw
print("ok")
"""


def test_executor_refuses_what_it_cannot_do_exactly(openrlhf_py):
    """Without the group size the executor refuses to start (a group's samples would share one
    previous response); sampling other than plain T=1 reuses nothing (vLLM's prompt log-probs skip
    its sampling processors)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HISTOSPEC_")}
    r = subprocess.run([str(openrlhf_py), "-c", UNIT, str(ROOT)], capture_output=True, text=True, timeout=300,
                       env=env, cwd=ROOT / "tests")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]
