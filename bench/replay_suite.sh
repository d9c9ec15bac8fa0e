#!/usr/bin/env bash
# The replay table of bench/RESULTS.md: every scenario of issue 3 on the shared rollout logs,
# ours and the peers in the same run. Needs ../shared/data (or HISTOSPEC_DATA_DIR and
# HISTOSPEC_TOKENIZER). Writes bench/out/replay/<name>.json and plots, then prints a markdown table.
# Run with PY=.venv-sglang/bin/python to add ArcticInference's SuffixDecoding (arctic_per_prompt,
# arctic_global), which scripts/setup_sglang_env.sh installs there; PEERS=... overrides the list.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-bench/out/replay}
mkdir -p "$OUT"
if [ -z "${PEERS:-}" ]; then
  PEERS=ngram,sglang_trie_per_prompt,sglang_trie_global
  if "$PY" -c 'import sys; from histospec_sgl.replay import arctic; sys.exit(arctic.missing_reason() is not None)'; then
    PEERS=$PEERS,arctic_per_prompt,arctic_global
  fi
fi
echo "== peers: $PEERS" >&2
run() {
  local name=$1; shift
  echo "== $name: histospec-sgl replay $*" >&2
  "$PY" -m histospec_sgl.cli replay "$@" --peers "$PEERS" --bounds bound_copy_after_1,bound_copy_any --no-progress --json "$OUT/$name.json" --plot-dir "$OUT/plots" >/dev/null
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
