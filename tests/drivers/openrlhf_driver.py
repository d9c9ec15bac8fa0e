"""Drives OpenRLHF 0.11.2's real rollout path with histospec-sgl's SPEC-RL executor, for
tests/trainers/test_openrlhf.py (run by .venv-sglang's interpreter, with openrlhf and vllm installed there
without their dependencies).

    python openrlhf_driver.py MODEL SGLANG_URL DRAFT_DATA_DIR OUT_JSON

Three episodes of OpenRLHF's ``SamplesGenerator.generate_samples`` (prompt dispatch by engine load,
``generate_responses``, ``Experience`` conversion) over two engine actors that are OpenRLHF's
``RolloutRayActor`` with only its vLLM ``AsyncLLMEngine`` stood in: the stand-in answers
``generate(TokensPrompt, SamplingParams, request_id)`` with real ``vllm.outputs.RequestOutput``s from
the real CPU SGLang server (vLLM has no CPU build here). The executor is loaded by OpenRLHF's own
``_load_agent_executor`` from ``histospec_sgl/integrations/openrlhf_agent.py``.

The draft server is this driver's own child: once the first episode's records are acknowledged it
is killed with SIGKILL, the second episode runs without it, and it is restarted on the same address
and data directory before the third.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import types
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "histospec_sgl" / "integrations" / "openrlhf_agent.py"


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


class SGLangBackedLLM:
    """Where RolloutRayActor holds ``vllm.AsyncLLMEngine``: the same call, answered by SGLang."""

    def __init__(self, url: str):
        self.url = url
        self.calls = 0

    async def generate(self, prompt: Any, sampling_params: Any, request_id: str):
        from vllm.logprobs import Logprob
        from vllm.outputs import CompletionOutput, RequestOutput

        self.calls += 1
        ids = list(prompt["prompt_token_ids"])
        sp = {"temperature": sampling_params.temperature, "top_p": sampling_params.top_p,
              "top_k": sampling_params.top_k, "max_new_tokens": sampling_params.max_tokens,
              "min_new_tokens": sampling_params.min_tokens}
        body: dict[str, Any] = {"input_ids": ids, "sampling_params": sp, "return_logprob": True,
                                "logprob_start_len": 0 if sampling_params.prompt_logprobs is not None else -1}
        out = await asyncio.to_thread(_post, self.url, body)
        meta = out["meta_info"]
        prompt_logprobs = None
        if sampling_params.prompt_logprobs is not None:
            entries = meta["input_token_logprobs"]
            prompt_logprobs = [None] + [{int(t): Logprob(logprob=float(lp))} for lp, t, _ in entries[1:]]
        tokens = [int(t) for t in out["output_ids"]]
        logprobs = None
        if sampling_params.logprobs is not None:
            logprobs = [{int(t): Logprob(logprob=float(lp))} for lp, t, _ in meta["output_token_logprobs"]]
        finish = meta["finish_reason"]["type"] if meta.get("finish_reason") else None
        completion = CompletionOutput(index=0, text="", token_ids=tokens, cumulative_logprob=None, logprobs=logprobs,
                                      finish_reason=finish)
        yield RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=ids, prompt_logprobs=prompt_logprobs,
                            outputs=[completion], finished=True)


def engine_class() -> type:
    from openrlhf.trainer.ray.vllm_engine import RolloutRayActor, _load_agent_executor

    class CpuRolloutActor(RolloutRayActor.__ray_actor_class__):
        """OpenRLHF's engine actor; only its constructor (which builds vLLM on a GPU) is replaced."""

        def __init__(self, url: str, agent_func_path: str):
            self.executor = _load_agent_executor(agent_func_path)
            self.llm = SGLangBackedLLM(url)
            self.llm.output_processor = types.SimpleNamespace(get_num_unfinished_requests=lambda: 0)
            self._mm_pad_token_ids = None

        def calls(self) -> int:
            return self.llm.calls

    return CpuRolloutActor


def main(model: str, url: str, data_dir: str, out: str) -> None:
    import time

    import ray
    from _draft import TOKEN_ENV, token_file, wait_records, wrong_token_error
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator
    from transformers import AutoTokenizer

    from histospec_sgl.sync.process import DraftServerProcess

    # It requires a token, as a job's does; the executors get it from the settings, as engines do.
    token = token_file(Path(data_dir).resolve().parent)
    os.environ[TOKEN_ENV] = token
    server = DraftServerProcess(data_dir=data_dir, auth_token_file=token)
    address = server.address
    env = {"HISTOSPEC_DRAFT_SERVER": address, "HISTOSPEC_N_SAMPLES": "4", TOKEN_ENV: token,
           "HISTOSPEC_REMOTE_RM_URL": str(Path(__file__).with_name("openrlhf_reward.py"))}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    durable: dict = {}
    try:
        cls = ray.remote(engine_class())
        engines = [cls.remote(url, str(AGENT)) for _ in range(2)]
        args = types.SimpleNamespace(
            rollout=types.SimpleNamespace(batch_size=4, n_samples_per_prompt=4, vllm_generate_batch_size=None),
            vllm=types.SimpleNamespace(enable_sleep=False),
            algo=types.SimpleNamespace(dynamic_filtering_enable=False,
                                       advantage=types.SimpleNamespace(is_correction_level="tis")))
        prompts = ["Write a haiku about rivers.", "What is 17 * 23?", "Name three prime numbers.",
                   "Translate 'good morning' to French."]
        tokenizer = AutoTokenizer.from_pretrained(model)
        episodes = []
        # The second and third episodes' budget is longer: a previous response cut at 24 is kept and
        # continued.
        for episode, max_new in enumerate((24, 32, 32)):
            if episode == 1:
                # Every record of the first episode acknowledged, then the server killed outright.
                durable["before_kill"] = wait_records(address, 0, 16)
                time.sleep(0.5)  # and in the engines' mirrors
                server.kill()
            if episode == 2:
                server = DraftServerProcess(listen=address, data_dir=data_dir, auth_token_file=token)
                # The second episode's records, queued while the server was down, arrive after it.
                durable["after_restart"] = wait_records(address, 1, 16)
                time.sleep(1.0)  # and reach the engines' mirrors
            loader = [(None, prompts, ["x"] * len(prompts), [None] * len(prompts))]
            gen = SamplesGenerator(types.SimpleNamespace(args=args), loader, None, tokenizer, engines)
            experiences, *_ = gen.generate_samples(temperature=1.0, max_new_tokens=max_new, max_len=128,
                                                    n_samples_per_prompt=4)
            rows = []
            for e in experiences:
                seq = e.sequences[0].tolist()
                mask = [0] + e.action_mask[0].tolist()  # OpenRLHF drops the first position from the mask
                start = mask.index(1)
                rows.append({"prompt": e.prompts[0], "prompt_ids": seq[:start], "response_ids": seq[start:],
                             "rollout_log_probs": e.rollout_log_probs[0].tolist()[start - 1:],
                             "reward": float(e.rewards[0]) if e.rewards is not None else None,
                             **{k: float(v[0]) for k, v in e.info.items() if k.startswith("histospec_")}})
            episodes.append(rows)
        calls = ray.get([e.calls.remote() for e in engines])
        wrong = wrong_token_error(address, Path(data_dir).resolve().parent)
    finally:
        ray.shutdown()
        server.kill()
    Path(out).write_text(json.dumps({"episodes": episodes, "engine_calls": calls, "durable": durable,
                                     "wrong_token": wrong}))


if __name__ == "__main__":
    main(*sys.argv[1:5])
