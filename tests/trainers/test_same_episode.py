"""The same SPEC-RL episode through slime's, verl's and OpenRLHF's adapters gives the same records
(histospec_sgl/specrl/flow.py: one rule, one meaning of version): each adapter translates its
trainer's real types (slime's ``Sample``, verl's ``TokenOutput``, vLLM's ``CompletionOutput`` and
``Logprob``) and nothing else decides. tests/drivers/same_episode.py builds the episodes in
.venv-sglang, where the trainers are installed."""

from __future__ import annotations

import json
import os
import subprocess

from conftest import DRIVERS, ROOT, driver_path, require_modules


def test_the_same_episode_through_three_adapters_gives_the_same_records(sglang_py, slime_src):
    py = require_modules(sglang_py, "verl, openrlhf.utils.agent, vllm.outputs", "verl, OpenRLHF or vLLM is")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HISTOSPEC_")}
    env["PYTHONPATH"] = driver_path()
    r = subprocess.run([str(py), str(DRIVERS / "same_episode.py"), str(slime_src)], capture_output=True, text=True,
                       timeout=300, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-6000:]
    episodes = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(episodes) == {"truncated", "finished", "aborted", "a log-prob missing"}
    for name, by_trainer in episodes.items():
        assert set(by_trainer) == {"slime", "verl", "openrlhf"}
        assert by_trainer["slime"] == by_trainer["verl"] == by_trainer["openrlhf"], name
    truncated = episodes["truncated"]["verl"]
    # The reused prefix and the generated tokens together, with the policy's log-prob of each, and the
    # policy version that sampled them.
    assert truncated["finished"]["response_ids"] == [21, 22, 23, 24, 25] and truncated["finished"]["version"] == 3
    assert truncated["recorded"] and truncated["previous"]["logprobs"] == [-0.1, -0.2, -0.3, -0.4, -0.5]
    assert truncated["previous"]["finish_reason"] == "length"
    # verl's vLLM server calls an abort "aborted", slime a status: each is SGLang's "abort", not recorded.
    aborted = episodes["aborted"]["verl"]
    assert aborted["finished"]["finish_reason"] == "abort" and not aborted["recorded"] and aborted["previous"] is None
    # Without a log-prob for every token: recorded as history only (no previous response without a
    # draft server).
    missing = episodes["a log-prob missing"]["openrlhf"]
    assert missing["finished"]["logprobs"] is None and missing["recorded"] and missing["previous"] is None
