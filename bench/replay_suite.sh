#!/usr/bin/env bash
# The replay table of bench/RESULTS.md: every scenario on the shared rollout logs,
# ours and the peers in the same run. Needs ../shared/data (or HISTOSPEC_DATA_DIR and
# HISTOSPEC_TOKENIZER). Writes bench/out/replay/<name>.json and plots, then prints a markdown table.
# Run with PY=.venv-sglang/bin/python to add ArcticInference's SuffixDecoding (arctic_per_prompt,
# arctic_global), which scripts/setup_sglang_env.sh installs there; PEERS=a,b,... sets the list.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-bench/out/replay}
mkdir -p "$OUT"
# The replay's default peers (the arctic ones included where installed), unless PEERS names others.
PEER_ARGS=()
if [ -n "${PEERS:-}" ]; then
  PEER_ARGS=(--peers "$PEERS")
fi
run() {
  local name=$1; shift
  echo "== $name: histospec-sgl replay $*" >&2
  "$PY" -m histospec_sgl.cli replay "$@" "${PEER_ARGS[@]}" --bounds bound_copy_after_1,bound_copy_any --no-progress --json "$OUT/$name.json" --plot "$OUT/plots" >/dev/null
}
run grpo-cross-sample          --preset grpo --scenario cross-sample
run grpo-cross-sample-inflight --preset grpo --scenario cross-sample-inflight
run grpo-cross-epoch           --preset grpo --scenario cross-epoch
run grpo-cross-policy          --preset grpo --scenario cross-policy
run ei-cross-policy            --preset ei --scenario cross-policy
run humaneval-cross-sample     --preset humaneval --scenario cross-sample
run grpo-cold                  --preset grpo --scenario cold
run ei-cold                    --preset ei --scenario cold
run humaneval-cold             --preset humaneval --scenario cold
"$PY" bench/replay_table.py "$OUT"
