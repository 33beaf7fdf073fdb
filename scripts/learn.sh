#!/usr/bin/env bash
# The whole "does it learn?" experiment of docs/results.md, in order, from the repo root:
#   1. baseline: `rollflow eval` of the untouched bundled SmolLM2-135M on the 50 validation tasks
#   2. SFT warm start on the game's expert transcripts (LoRA adapter)
#   3. GRPO from that adapter through the training flow; its step-0 validation is the
#      SFT-only policy, its last one the final policy (curves in MLflow and as PNGs)
#   4. the figure and table of docs/results.md, from the run folders, into the GRPO run
#      folder (learn_tool_use_game.png)
#   5. 4 more validation episodes a task of the SFT and of the final policy (`rollflow
#      eval`, another seed), and the two compared on 8 episodes a task
# Every stage is resumable: run the script again and finished work is skipped (the eval
# and SFT folders are reused as they are; the GRPO run resumes from its last step).
#
#   scripts/learn.sh                   1 h 43 min on 2 cores in float32 (2026-12-05, a CPU
#                                      without AMX, docs/results.md run 4): SFT ~15 min
#                                      alone, GRPO steps of ~2 min and validation passes
#                                      of ~1.6 min. The configs now put LoRA on the MLP
#                                      too and run 30 steps in bfloat16 with the
#                                      curriculum (run 10): 1 h 08 min from nothing on a
#                                      quiet machine (2026-12-05: baseline 1 min, SFT
#                                      ~16 min, GRPO 47 min with steps of ~72 s, the final
#                                      comparison 4 min); with the settings of 2026-11-29
#                                      (commit c9cdcab) it took 3 h 50 min
#   OUT=runs/learn2 scripts/learn.sh   into other folders (the GRPO config is rewritten to
#                                      read that folder's SFT adapter)
#   GRPO_CONFIG=my.toml OUT=... scripts/learn.sh
#                                      another GRPO config (an arm of a comparison); its
#                                      adapter line is rewritten the same way
#   SFT_CONFIG=my_sft.toml GRPO_CONFIG=my.toml OUT=... scripts/learn.sh
#                                      another SFT config too (e.g. other LoRA modules:
#                                      the GRPO config must name the same)
#   GRPO_CONFIG=configs/mcp_tool_use_game.toml OUT=runs/learn-mcp SFT_RUN=runs/learn/sft \
#     scripts/learn.sh                 an arm that starts from another experiment's SFT run
#                                      (reused as it is, or trained there if missing): here
#                                      the game with its tools over MCP, paired with the
#                                      default run from the very same adapter
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=.venv/bin
OUT=${OUT:-runs/learn}
export PREFECT_HOME=${PREFECT_HOME:-$PWD/.rollflow/prefect}
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_LOGGING_LEVEL=${PREFECT_LOGGING_LEVEL:-WARNING}
# A busy machine can take longer than Prefect's default 20 s to start its local server.
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=${PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS:-300}

SFT_CONFIG=${SFT_CONFIG:-configs/learn_tool_use_game_sft.toml}
GRPO_CONFIG=${GRPO_CONFIG:-configs/learn_tool_use_game.toml}
SFT_RUN=${SFT_RUN:-$OUT/sft}
ADAPTER=$SFT_RUN/sft/policy

if [ ! -f "$OUT/baseline/validation/step=000000/metrics.json" ]; then
  echo "== 1/5 baseline: the untouched model on the validation tasks"
  "$BIN/rollflow" eval --config "$SFT_CONFIG" --run-dir "$OUT/baseline"
fi

echo "== 2/5 SFT warm start -> $ADAPTER"
"$BIN/rollflow" sft "$SFT_CONFIG" --run-dir "$SFT_RUN"

echo "== 3/5 GRPO from the SFT adapter"
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

echo "== 4/5 figure and table"
"$BIN/python" scripts/learning_figure.py --run "$OUT/grpo" --baseline "$OUT/baseline" \
  --out "$OUT/grpo/learn_tool_use_game.png"

# Four validation episodes a task measure a pass rate to about +-0.035. Four more a task of
# the SFT policy and of the final one, sampled under another seed (so they are new
# episodes), pool with the run's own validation of each into 8 a task, 400 episodes a side.
echo "== 5/5 the SFT and the final policy compared on 400 episodes each"
EVAL_CONFIG=$OUT/eval-seed1.toml
sed -e 's/^seed = 0$/seed = 1/' "$config" > "$EVAL_CONFIG"
if [ "$(grep -cE '^seed = 1$' "$EVAL_CONFIG")" != 1 ]; then
  echo "scripts/learn.sh: could not set the seed in $EVAL_CONFIG" >&2
  exit 1
fi
FINAL=$(ls -d "$OUT"/grpo/checkpoints/step=* | tail -n 1)
for side in sft final; do
  if [ ! -f "$OUT/eval-$side-seed1/validation/step=000000/metrics.json" ]; then
    adapter=$ADAPTER
    [ "$side" = final ] && adapter=$FINAL
    "$BIN/rollflow" eval --config "$EVAL_CONFIG" --adapter "$adapter" --run-dir "$OUT/eval-$side-seed1"
  fi
done
"$BIN/python" scripts/compare_policies.py \
  --before "$OUT/grpo/validation/step=000000" "$OUT/eval-sft-seed1" \
  --after "$(ls -d "$OUT"/grpo/validation/step=* | tail -n 1)" "$OUT/eval-final-seed1"
