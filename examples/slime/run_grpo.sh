#!/usr/bin/env bash
# GRPO with slime, rollouts decoded with HISTORY (or SPEC-RL: histospec_mode in histospec.yaml).
# On the head node of a Ray cluster that runs slime (its own README), with histospec-sgl installed
# in the image next to SGLang. MODEL_ARGS, CKPT_ARGS, ... are slime's own settings for the model.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"

# 1. One draft server for the job, on the head node (durable; a second call prints the running one).
DRAFT=$(histospec-sgl ray draft-server --data-dir /ckpt/histospec --listen 0.0.0.0:50061)

# 2. The job: the setup hook registers HISTORY in slime's engine actors; the draft server's address
#    reaches every engine and the rollout manager.
ray job submit --address="http://127.0.0.1:8265" \
  --runtime-env-json="{\"env_vars\": {\"HISTOSPEC_DRAFT_SERVER\": \"$DRAFT\"},
                       \"worker_process_setup_hook\": \"histospec_sgl.integrations.ray_setup.setup\"}" \
  -- python3 train.py \
  ${MODEL_ARGS[@]+"${MODEL_ARGS[@]}"} ${CKPT_ARGS[@]+"${CKPT_ARGS[@]}"} \
  --advantage-estimator grpo --n-samples-per-prompt 8 --rollout-temperature 1.0 \
  --sglang-speculative-algorithm HISTORY --sglang-speculative-num-draft-tokens 12 \
  --custom-generate-function-path histospec_sgl.integrations.slime.generate \
  --rollout-all-samples-process-path histospec_sgl.integrations.slime.record \
  --custom-config-path "$HERE/histospec.yaml"
