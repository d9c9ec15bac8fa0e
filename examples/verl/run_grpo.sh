#!/usr/bin/env bash
# GRPO with verl 0.9 and SGLang rollouts decoded with HISTORY; SPEC_RL=1 adds the SPEC-RL agent loop.
# On the head node of a Ray cluster, with histospec-sgl installed next to verl and SGLang. Data and
# model settings are verl's own (its examples/grpo_trainer scripts).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
DRAFT=$(histospec-sgl ray draft-server --data-dir /ckpt/histospec --listen 0.0.0.0:50061)

SPEC=()
if [ "${SPEC_RL:-0}" = 1 ]; then
  SPEC=(actor_rollout_ref.rollout.agent.default_agent_loop=histospec_specrl
        actor_rollout_ref.rollout.agent.agent_loop_config_path="$HERE/agent_loops.yaml")
fi

ray job submit --address="http://127.0.0.1:8265" \
  --runtime-env-json="{\"env_vars\": {\"HISTOSPEC_DRAFT_SERVER\": \"$DRAFT\"}}" \
  -- python3 -m verl.trainer.main_ppo \
  algorithm.adv_estimator=grpo \
  data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet" \
  actor_rollout_ref.model.path="$MODEL" \
  actor_rollout_ref.rollout.name=sglang actor_rollout_ref.rollout.n=8 \
  +actor_rollout_ref.rollout.engine_kwargs.sglang.speculative_algorithm=HISTORY \
  +actor_rollout_ref.rollout.engine_kwargs.sglang.speculative_num_draft_tokens=12 \
  actor_rollout_ref.rollout.router_config_path="$HERE/router.yaml" \
  actor_rollout_ref.rollout.calculate_log_probs=True \
  ${SPEC[@]+"${SPEC[@]}"} "$@"
