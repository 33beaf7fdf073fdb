#!/usr/bin/env bash
# The whole "does it learn?" experiment of docs/results.md, in order, from the repo root:
#   1. baseline: `rollflow eval` of the untouched bundled SmolLM2-135M on the 50 validation tasks
#   2. SFT warm start on the game's expert transcripts (LoRA adapter)
#   3. GRPO from that adapter through the training flow; its step-0 validation is the
#      SFT-only policy, its last one the final policy (curves in MLflow and as PNGs)
#   4. the figure and table of docs/results.md, from the run folders, into the GRPO run
#      folder (learn_tool_use_game.png)
# Every stage is resumable: run the script again and finished work is skipped (the eval
# and SFT folders are reused as they are; the GRPO run resumes from its last step).
#
#   scripts/learn.sh                   about 2 h 15 min on 2 cores (measured: baseline 1 min,
#                                      SFT 12 min, GRPO about 2 h for 16 steps and 3
#                                      validation passes)
#   OUT=runs/learn2 scripts/learn.sh   into other folders (the GRPO config is rewritten to
#                                      read that folder's SFT adapter)
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=.venv/bin
OUT=${OUT:-runs/learn}
export PREFECT_HOME=${PREFECT_HOME:-$PWD/.rollflow/prefect}
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_LOGGING_LEVEL=${PREFECT_LOGGING_LEVEL:-WARNING}
# A busy machine can take longer than Prefect's default 20 s to start its local server.
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=${PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS:-300}

SFT_CONFIG=configs/learn_tool_use_game_sft.toml
GRPO_CONFIG=configs/learn_tool_use_game.toml
ADAPTER=$OUT/sft/sft/policy

if [ ! -f "$OUT/baseline/validation/step=000000/metrics.json" ]; then
  echo "== 1/4 baseline: the untouched model on the validation tasks"
  "$BIN/rollflow" eval --config "$SFT_CONFIG" --run-dir "$OUT/baseline"
fi

echo "== 2/4 SFT warm start -> $ADAPTER"
"$BIN/rollflow" sft "$SFT_CONFIG" --run-dir "$OUT/sft"

echo "== 3/4 GRPO from the SFT adapter"
config=$GRPO_CONFIG
if [ "$ADAPTER" != "runs/learn/sft/sft/policy" ]; then  # the config names the default place
  config=$OUT/grpo.toml
  sed "s#^adapter = \"runs/learn/sft/sft/policy\"#adapter = \"$ADAPTER\"#" "$GRPO_CONFIG" > "$config"
fi
if [ -f "$OUT/grpo/config.toml" ]; then
  "$BIN/rollflow" resume "$OUT/grpo"
else
  "$BIN/rollflow" train "$config" --run-dir "$OUT/grpo"
fi

echo "== 4/4 figure and table"
"$BIN/python" scripts/learning_figure.py --run "$OUT/grpo" --baseline "$OUT/baseline" \
  --out "$OUT/grpo/learn_tool_use_game.png"
