#!/usr/bin/env bash
# GRPO with slime, rollouts decoded with HISTORY (or SPEC-RL: histospec_mode in histospec.yaml), on
# the head node of a Ray cluster that runs slime (its own README), with histospec-sgl installed in the
# image next to SGLang (0.5.15, slime's pin, is supported):
#
#   SLIME_DIR=/root/slime bash examples/slime/run_grpo.sh --hf-checkpoint /models/Qwen3-4B \
#       --prompt-data /data/math.jsonl --rollout-batch-size 32 --num-rollout 100 [slime's flags...]
#
# Every argument goes to slime's train.py (the model, checkpoint, data and GPU flags of your job).
# The flags slime requires are checked first, and the paths given exist on this node.
# DRY_RUN=1 prints the commands and starts nothing; examples/common.sh lists the other settings.
HERE="$(cd "$(dirname "$0")" && pwd)"
# shellcheck source=../common.sh
source "$HERE/../common.sh"
need SLIME_DIR "slime's checkout on the head node (the folder of its train.py)"
if [ "$DRY_RUN" != 1 ] && [ -n "${SLIME_DIR:-}" ] && [ ! -f "$SLIME_DIR/train.py" ]; then
  refuse "SLIME_DIR=$SLIME_DIR: no train.py there (slime's checkout on the head node)"
fi
# What slime's own parser and argument checks require (slime/utils/arguments.py).
need_flag --hf-checkpoint "the Hugging Face checkpoint slime's engines load" "$@"
need_flag --prompt-data "the prompts, a JSONL file (slime's dataset)" "$@"
need_flag --rollout-batch-size "prompts per rollout step (slime's parser requires it)" "$@"
need_flag "--num-rollout|--num-epoch" "how long to train (slime requires one)" "$@"
for f in --hf-checkpoint --prompt-data --load --ref-load --custom-config-path; do
  need_path "$f" "given to slime" "$@"
done
job_env "{\"env_vars\": {\"HISTOSPEC_DRAFT_SERVER_ACTOR\": \"$ACTOR\"}}"
checked

# 1. One draft server for the job (durable; a second call prints the running one). It makes a token
#    and hands it, with its address, to every engine and to the rollout manager through the actor.
draft_server

# 2. The job: the setup hook registers HISTORY in slime's engine actors and finds the draft server.
run ray job submit --address="$RAY_DASHBOARD" \
  --runtime-env-json="$JOB_ENV" \
  -- python3 "$SLIME_DIR/train.py" \
  --advantage-estimator grpo --n-samples-per-prompt 8 --rollout-temperature 1.0 \
  --sglang-speculative-algorithm HISTORY --sglang-speculative-num-draft-tokens 12 \
  --custom-generate-function-path histospec_sgl.integrations.slime.generate \
  --rollout-all-samples-process-path histospec_sgl.integrations.slime.record \
  --custom-config-path "$HERE/histospec.yaml" ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"} "$@"
