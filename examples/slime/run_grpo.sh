#!/usr/bin/env bash
# GRPO with slime, rollouts decoded with HISTORY (or SPEC-RL: histospec_mode in histospec.yaml), on
# the head node of a Ray cluster that runs slime (its own README), with histospec-sgl installed in the
# image next to SGLang (0.5.15, slime's pin, is supported):
#
#   SLIME_DIR=/root/slime bash examples/slime/run_grpo.sh --hf-checkpoint /models/Qwen3-4B [slime's flags...]
#
# Every argument goes to slime's train.py (the model, checkpoint, data and GPU flags of your job).
# DRY_RUN=1 prints the commands and starts nothing; examples/common.sh lists the other settings.
HERE="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=../common.sh
source "$HERE/../common.sh"
need SLIME_DIR "slime's checkout on the head node (the folder of its train.py)"
need_flag --hf-checkpoint "the Hugging Face checkpoint slime's engines load" "$@"
checked

# 1. One draft server for the job (durable; a second call prints the running one). It makes a token
#    and hands it, with its address, to every engine and to the rollout manager through the actor.
draft_server

# 2. The job: the setup hook registers HISTORY in slime's engine actors and finds the draft server.
run ray job submit --address="$RAY_DASHBOARD" \
  --runtime-env-json="$(runtime_env "{\"env_vars\": {\"HISTOSPEC_DRAFT_SERVER_ACTOR\": \"$ACTOR\"}}")" \
  -- python3 "$SLIME_DIR/train.py" \
  --advantage-estimator grpo --n-samples-per-prompt 8 --rollout-temperature 1.0 \
  --sglang-speculative-algorithm HISTORY --sglang-speculative-num-draft-tokens 12 \
  --custom-generate-function-path histospec_sgl.integrations.slime.generate \
  --rollout-all-samples-process-path histospec_sgl.integrations.slime.record \
  --custom-config-path "$HERE/histospec.yaml" ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"} "$@"
