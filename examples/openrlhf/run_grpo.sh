#!/usr/bin/env bash
# GRPO with OpenRLHF 0.11 and SPEC-RL: each sample reuses its slot's response from the last epoch,
# scored by OpenRLHF's own vLLM engines and cut at the first rejected token. (OpenRLHF drives vLLM
# only, so HISTORY drafting is not available here; see docs/trainers.md.) On the head node of a Ray
# cluster, with histospec-sgl installed next to OpenRLHF. MODEL, DATA and the GPU layout are
# OpenRLHF's own settings (its examples/scripts/train_*_ray.sh).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
N=8

# 1. One draft server for the job, on the head node: the store of previous responses that every
#    engine reads (OpenRLHF sends a prompt to a different engine each epoch). Durable under --data-dir.
DRAFT=$(histospec-sgl ray draft-server --data-dir /ckpt/histospec --listen 0.0.0.0:50061)
AGENT=$(python3 -c 'import histospec_sgl.integrations.openrlhf_agent as m; print(m.__file__)')

# 2. The job. OpenRLHF gives an agent executor neither the reward URL nor the group size, so they
#    travel in the runtime env (HISTOSPEC_REMOTE_RM_URL takes what --reward.remote_url would).
ray job submit --address="http://127.0.0.1:8265" \
  --runtime-env-json="{\"working_dir\": \"$HERE\", \"env_vars\": {
      \"HISTOSPEC_DRAFT_SERVER\": \"$DRAFT\", \"HISTOSPEC_N_SAMPLES\": \"$N\",
      \"HISTOSPEC_REMOTE_RM_URL\": \"reward_func.py\", \"HISTOSPEC_LENIENCE\": \"1.0\"}}" \
  -- python3 -m openrlhf.cli.train_ppo_ray \
  --actor.num_nodes 1 --actor.num_gpus_per_node 8 \
  --vllm.num_engines 4 --vllm.tensor_parallel_size 2 --train.colocate_all --vllm.enable_sleep \
  --actor.model_name_or_path "$MODEL" --data.prompt_dataset "$DATA" --data.input_key question --data.label_key answer \
  --algo.advantage.estimator group_norm --rollout.n_samples_per_prompt "$N" \
  --rollout.temperature 1.0 --algo.advantage.is_correction_level token \
  --train.agent_func_path "$AGENT" "$@"
