"""Drives slime's real rollout (``slime.rollout.sglang_rollout.generate_rollout`` with its
``RolloutDataSourceWithBuffer``) for two epochs through ``histospec_sgl.integrations.slime``, against
a real SGLang server behind a real sglang-router. Run by tests/trainers/test_slime.py with .venv-sglang's
interpreter and slime's source on ``PYTHONPATH``.

    python slime_driver.py MODE ROUTER_URL MODEL_DIR PROMPTS_JSONL DRAFT_SERVER OUT_JSON [ROUTER_POLICY]

DRAFT_SERVER may be empty (history mode without one: each engine drafts from its own history).
ROUTER_POLICY is slime's ``--router-policy`` (default ``consistent_hashing``).

Prints nothing useful; writes, per epoch, every sample's fields the test checks.
"""

from __future__ import annotations

import json
import os
import sys
from argparse import Namespace
from urllib.parse import urlsplit


async def reward(args, sample) -> float:
    """``--custom-rm-path``: a rule on the response (slime calls it for every finished sample)."""
    return float(len(sample.response) % 2)


def make_args(mode: str, router: str, model: str, prompts: str, draft_server: str,
              router_policy: str = "consistent_hashing") -> Namespace:
    """The fields slime's parser would give (it needs Megatron to run; the values are its defaults or
    what a GRPO job on one engine would pass)."""
    url = urlsplit(router)
    return Namespace(
        # rollout
        rollout_global_dataset=True, prompt_data=prompts, input_key="prompt", label_key="label",
        metadata_key="metadata", tool_key=None, multimodal_keys=None, apply_chat_template=False,
        apply_chat_template_kwargs={}, rollout_shuffle=False, rollout_seed=42, rollout_max_prompt_len=None,
        rollout_batch_size=4, over_sampling_batch_size=4, n_samples_per_prompt=4,
        rollout_max_response_len=24, rollout_temperature=1.0 if mode == "specrl" else 0.0, rollout_top_p=1.0,
        rollout_top_k=-1, rollout_stop=None, rollout_stop_token_ids=None, rollout_skip_special_tokens=False,
        partial_rollout=False, mask_offpolicy_in_partial_rollout=False, dynamic_sampling_filter_path=None,
        rollout_sample_filter_path=None, buffer_filter_path=None, rollout_sample_hook_path=None,
        rollout_all_samples_process_path="histospec_sgl.integrations.slime.record",
        custom_generate_function_path="histospec_sgl.integrations.slime.generate",
        use_rollout_routing_replay=False, dump_details=None, ci_test=False, load=None, save=None,
        # reward
        custom_rm_path="slime_driver.reward", rm_type=None, rm_url=None, group_rm=False, reward_key=None,
        eval_reward_key=None,
        # engines and router
        hf_checkpoint=model, sglang_router_ip=url.hostname, sglang_router_port=url.port,
        sglang_server_concurrency=16, rollout_num_engines=1, sglang_dp_size=None, use_distributed_post=False,
        router_policy=router_policy, sglang_speculative_algorithm="HISTORY",
        sglang_enable_deterministic_inference=False, num_gpus_per_node=1,
        # histospec.yaml (--custom-config-path sets these on args)
        histospec_mode=mode, histospec_draft_server=draft_server, histospec_lenience=1.0, histospec_seed=7,
        # Length-first scheduling on: epoch 2's requests wait for each other and go longest first.
        histospec_length_first=True,
    )


def main() -> None:
    mode, router, model, prompts, draft_server, out_path = sys.argv[1:7]
    router_policy = sys.argv[7] if len(sys.argv) > 7 else "consistent_hashing"
    import time

    from _draft import TOKEN_ENV, token_file, wrong_token_error
    from slime.rollout.data_source import RolloutDataSourceWithBuffer
    from slime.rollout.sglang_rollout import GenerateState, generate_rollout
    from slime.utils.http_utils import init_http_client

    from histospec_sgl.integrations.slime import AnnouncingDataSource
    from histospec_sgl.specrl.store import shared
    from histospec_sgl.sync.process import DraftServerProcess

    servers: list[DraftServerProcess] = []
    data_dir = draft_server
    if mode == "specrl":
        # SPEC-RL's store is this driver's own draft server (DRAFT_SERVER is its data dir), which
        # requires a token, as a job's does: killed once the first rollout's records are acknowledged,
        # restarted after the second.
        token = token_file(os.path.dirname(os.path.abspath(data_dir)))
        os.environ[TOKEN_ENV] = token
        servers.append(DraftServerProcess(data_dir=data_dir, auth_token_file=token))
        draft_server = servers[0].address
    args = make_args(mode, router, model, prompts, draft_server, router_policy)
    args.histospec_publish_wait = 3.0
    init_http_client(args)
    # With a draft server, history mode announces each next rollout's groups (slime's own data source
    # underneath: the same samples, the same checkpoints).
    data_source = (AnnouncingDataSource(args) if mode == "history" and draft_server
                   else RolloutDataSourceWithBuffer(args))
    out: dict = {"epochs": []}
    try:
        for rollout_id in range(2):
            if rollout_id == 1 and mode == "specrl":
                servers[0].kill()  # record() had the first rollout's records acknowledged and mirrored
                start = time.monotonic()
                # A longer budget: a previous response cut at 24 is kept whole and continued by
                # slime's generate, as it continues a partial rollout.
                args.rollout_max_response_len = 32
                GenerateState(args).sampling_params["max_new_tokens"] = 32
            output = generate_rollout(args, rollout_id, data_source)
            rows = []
            for group in output.samples:
                for s in group:
                    rows.append({
                        "index": s.index, "group_index": s.group_index, "prompt": s.prompt, "tokens": s.tokens,
                        "response": s.response, "response_length": s.response_length, "loss_mask": s.loss_mask,
                        "rollout_log_probs": s.rollout_log_probs, "status": s.status.value, "reward": s.reward,
                        "session_id": s.session_id, "spec_info": s.spec_info.to_dict(),
                        "weight_versions": s.weight_versions, "histospec": s.metadata.get("histospec"),
                    })
            out["epochs"].append({"rollout_id": rollout_id, "epoch_id": data_source.epoch_id, "samples": rows})
        out["announced"] = getattr(data_source, "announced", None)
        if mode == "specrl":
            out["dead_rollout_seconds"] = time.monotonic() - start
            servers.append(DraftServerProcess(listen=draft_server, data_dir=data_dir, auth_token_file=token))
            # The second rollout's records, queued while the server was down, go out now.
            out["settled_after_restart"] = shared().settle(draft_server, 60)
            out["partial"] = partial_rollouts(args, data_source)
            out["wrong_token"] = wrong_token_error(draft_server, os.path.dirname(os.path.abspath(data_dir)))
    finally:
        for server in servers:
            server.kill()
    with open(out_path, "w") as f:
        json.dump(out, f)


def _row(s) -> dict:
    """A sample's fields as they are now (copies: slime resumes the same objects later)."""
    return {"index": s.index, "prompt": s.prompt, "tokens": list(s.tokens), "response_length": s.response_length,
            "rollout_log_probs": list(s.rollout_log_probs or []), "loss_mask": list(s.loss_mask or []),
            "status": s.status.value, "histospec": dict(s.metadata.get("histospec") or {}),
            "start_rollout_id": s.metadata.get("start_rollout_id")}


def partial_rollouts(args: Namespace, data_source) -> dict:
    """slime's own abort path with ``--partial-rollout``, as ``generate_rollout_async`` takes it when a
    rollout has what it needs: a rollout's groups are submitted (every slot has a previous response,
    and the budget is now 96, so each continues past its kept 32 tokens), and once the first
    continuation is sent slime's ``abort()`` sets its flag, aborts every engine's requests through
    the router's worker list, and collects the pending groups; they go back to slime's buffer, and
    the next ``generate_rollout`` resumes them."""
    import asyncio

    from slime.rollout.sglang_rollout import GenerateState, abort, generate_rollout
    from slime.utils.async_utils import run

    state = GenerateState(args)
    args.partial_rollout = True
    args.rollout_max_response_len = 96
    state.sampling_params["max_new_tokens"] = 96

    async def submit_then_abort() -> list:
        groups = data_source.get_samples(args.over_sampling_batch_size)
        state.submit_generate_tasks(groups)
        # Once a sample holds its kept 32 tokens, its continuation is being sent: abort then (the
        # others are in their scoring calls or just past them).
        while not any(s.response_length >= 32 for g in groups for s in g):
            await asyncio.sleep(0.005)
        aborted = await abort(args, 2)
        state.reset()
        return aborted

    aborted = run(submit_then_abort())
    buffered = [_row(s) for group in aborted for s in group]
    data_source.add_samples(aborted)
    resumed = generate_rollout(args, 3, data_source)
    return {"buffered": buffered, "resumed": [_row(s) for group in resumed.samples for s in group]}


if __name__ == "__main__":
    main()
