#!/usr/bin/env bash
# GRPO with verl 0.9.1 and SGLang rollouts decoded with HISTORY; SPEC_RL=1 adds the SPEC-RL agent
# loop. On the head node of a Ray cluster, with histospec-sgl installed next to verl and a supported
# SGLang (verl's own [sglang] extra pins 0.5.12, below the range: docs/trainers.md, "Versions"):
#
#   MODEL=/models/Qwen3-4B DATA=/data/gsm8k bash examples/verl/run_grpo.sh [verl overrides...]
#
# DATA holds train.parquet and test.parquet (verl's examples/data_preprocess). Every argument is a
# verl (Hydra) override appended to the command. DRY_RUN=1 prints the commands and starts nothing.
HERE="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=../common.sh
source "$HERE/../common.sh"
need MODEL "the model to train (a Hugging Face path or name)"
need DATA "the folder with train.parquet and test.parquet"
job_env "{\"env_vars\": {\"HISTOSPEC_DRAFT_SERVER_ACTOR\": \"$ACTOR\"}}"
checked

SPEC=()
if [ "${SPEC_RL:-0}" = 1 ]; then
  SPEC=(actor_rollout_ref.rollout.agent.default_agent_loop=histospec_specrl
        actor_rollout_ref.rollout.agent.agent_loop_config_path="$HERE/agent_loops.yaml")
fi

# Each step's groups are announced to the draft server before the step's requests go out, through
# histospec's subclass of the agent loop manager the trainer dispatches with: verl's v1 trainer (its
# default) or the legacy one (trainer.use_v1=false).
MANAGER=AnnouncingAgentLoopManagerTQ
for a in "$@"; do
  case "${a,,}" in *trainer.use_v1=false | *trainer.use_v1=0) MANAGER=AnnouncingAgentLoopManager ;; esac
done

# One draft server for the job; engines and agent loops find it (and its token) through the actor.
draft_server

run ray job submit --address="$RAY_DASHBOARD" \
  --runtime-env-json="$JOB_ENV" \
  -- python3 -m verl.trainer.main_ppo \
  algorithm.adv_estimator=grpo \
  data.train_files="$DATA/train.parquet" data.val_files="$DATA/test.parquet" \
  actor_rollout_ref.model.path="$MODEL" \
  actor_rollout_ref.rollout.name=sglang actor_rollout_ref.rollout.n=8 \
  +actor_rollout_ref.rollout.engine_kwargs.sglang.speculative_algorithm=HISTORY \
  +actor_rollout_ref.rollout.engine_kwargs.sglang.speculative_num_draft_tokens=12 \
  actor_rollout_ref.rollout.router_config_path="$HERE/router.yaml" \
  actor_rollout_ref.rollout.calculate_log_probs=True \
  +actor_rollout_ref.rollout.agent.agent_loop_manager_class="histospec_sgl.integrations.verl.announce.$MANAGER" \
  ${SPEC[@]+"${SPEC[@]}"} "$@"
