#!/usr/bin/env bash
# GRPO with OpenRLHF 0.11 and SPEC-RL: each sample reuses its slot's response from the last epoch,
# scored by OpenRLHF's own vLLM engines and cut at the first rejected token. (OpenRLHF drives vLLM
# only, so HISTORY drafting is not available here; see docs/trainers.md.) On the head node of a Ray
# cluster, with histospec-sgl installed next to OpenRLHF:
#
#   MODEL=/models/Qwen3-4B DATA=/data/math.jsonl bash examples/openrlhf/run_grpo.sh [OpenRLHF flags...]
#
# Every argument goes to openrlhf.cli.train_ppo_ray (the GPU layout below is a default for one node
# of 8 GPUs: override it there). The group size is --rollout.n_samples_per_prompt (default 8).
# DRY_RUN=1 prints the commands and starts nothing.
HERE="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=../common.sh
source "$HERE/../common.sh"
need MODEL "the model to train (a Hugging Face path or name)"
need DATA "OpenRLHF's --data.prompt_dataset (question and answer fields)"
# The SPEC-RL executor's file, as OpenRLHF's --train.agent_func_path takes it.
AGENT=$(python3 -c 'import importlib.util as u; print(u.find_spec("histospec_sgl.integrations.openrlhf_agent").origin)' \
        2>/dev/null) || AGENT=""
need AGENT "histospec-sgl importable by python3 (pip install ./histospec-sgl next to OpenRLHF)"
# The group size has one source, the trainer's own flag (default 8 here); the SPEC-RL executor is
# not told it by OpenRLHF, so it travels in the runtime env as HISTOSPEC_N_SAMPLES, derived from it.
N="$(flag_value --rollout.n_samples_per_prompt "$@")"
GROUP=()
if [ -z "$N" ]; then N=8; GROUP=(--rollout.n_samples_per_prompt "$N"); fi
[[ "$N" =~ ^[1-9][0-9]*$ ]] || refuse "--rollout.n_samples_per_prompt $N: not a positive whole number"
if [ -n "${N_SAMPLES:-}" ] && [ "$N_SAMPLES" != "$N" ]; then
  refuse "N_SAMPLES=$N_SAMPLES: the group size is OpenRLHF's --rollout.n_samples_per_prompt ($N); unset N_SAMPLES"
fi
# HISTOSPEC_REMOTE_RM_URL takes what --reward.remote_url would (OpenRLHF hands an executor no reward).
job_env "{\"working_dir\": \"$HERE\", \"env_vars\": {
    \"HISTOSPEC_DRAFT_SERVER_ACTOR\": \"$ACTOR\", \"HISTOSPEC_N_SAMPLES\": \"$N\",
    \"HISTOSPEC_REMOTE_RM_URL\": \"reward_func.py\", \"HISTOSPEC_LENIENCE\": \"1.0\"}}" "HISTOSPEC_N_SAMPLES=--rollout.n_samples_per_prompt"
checked

# 1. One draft server for the job, on the head node: the store of previous responses that every
#    engine reads (OpenRLHF sends a prompt to a different engine each epoch). Durable; its token
#    reaches the executors through the actor.
draft_server

# 2. The job.
run ray job submit --address="$RAY_DASHBOARD" --runtime-env-json="$JOB_ENV" \
  -- python3 -m openrlhf.cli.train_ppo_ray \
  --actor.num_nodes 1 --actor.num_gpus_per_node 8 \
  --vllm.num_engines 4 --vllm.tensor_parallel_size 2 --train.colocate_all --vllm.enable_sleep \
  --actor.model_name_or_path "$MODEL" --data.prompt_dataset "$DATA" --data.input_key question --data.label_key answer \
  --algo.advantage.estimator group_norm ${GROUP[@]+"${GROUP[@]}"} \
  --rollout.temperature 1.0 --algo.advantage.is_correction_level token \
  --train.agent_func_path "$AGENT" "$@"
