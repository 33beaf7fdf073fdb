#!/usr/bin/env bash
# On-policy distillation against GRPO on the bundled tool-use game, from the same start
# (the untouched bundled SmolLM2-135M), with the same sizes (6 steps of 4 tasks x 2 episodes):
#   1. the teacher: `rollflow sft` on the game's expert transcripts (LoRA adapter)
#   2. OPD:  configs/opd_tool_use_game.toml       (the teacher's per-token signal)
#   3. GRPO: configs/grpo_vs_opd_tool_use_game.toml (the game's reward; the teacher only measured)
#   4. the teacher itself on the same 20 validation tasks (`rollflow eval`, the runs' dtype
#      and temperature): the pass rate OPD distills towards
#   5. side by side, per validation step: the validation pass rate of each run, and the
#      teacher KL (opd/teacher_kl: mean over action tokens of student_logp - teacher_logp) of
#      the training step sampled by the same policy version
# Every stage is resumable: run it again and finished work is skipped.
#
#   scripts/opd_vs_grpo.sh                 SFT 65 min here (2 cores, AVX2), then 13-17 min a run: ~1 h 40 min in all
#   OUT=runs/opd2 scripts/opd_vs_grpo.sh   into other folders (configs rewritten to that teacher)
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=.venv/bin
OUT=${OUT:-runs/opd}
export PREFECT_HOME=${PREFECT_HOME:-$PWD/.rollflow/prefect}
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_LOGGING_LEVEL=${PREFECT_LOGGING_LEVEL:-WARNING}
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=${PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS:-300}

TEACHER=$OUT/sft/sft/policy
DEFAULT_TEACHER=runs/opd/sft/sft/policy  # what the two configs name

echo "== 1/5 teacher: SFT -> $TEACHER"
if [ ! -f "$TEACHER/adapter_config.json" ]; then
  "$BIN/rollflow" sft configs/learn_tool_use_game_sft.toml --run-dir "$OUT/sft"
fi

run() {  # run NAME CONFIG
  local config=$2
  if [ "$TEACHER" != "$DEFAULT_TEACHER" ]; then
    mkdir -p "$OUT"
    config=$OUT/$1.toml
    sed "s#^teacher_adapter = \"$DEFAULT_TEACHER\"#teacher_adapter = \"$TEACHER\"#" "$2" > "$config"
  fi
  if [ -f "$OUT/$1/config.toml" ]; then
    "$BIN/rollflow" resume "$OUT/$1"
  else
    "$BIN/rollflow" train "$config" --run-dir "$OUT/$1"
  fi
}

echo "== 2/5 OPD from the untouched model"
run opd configs/opd_tool_use_game.toml
echo "== 3/5 GRPO from the untouched model"
run grpo configs/grpo_vs_opd_tool_use_game.toml

echo "== 4/5 the teacher on the same validation tasks"
if [ ! -f "$OUT/teacher-eval/validation/step=000000/scores.parquet" ]; then
  rm -rf "$OUT/teacher-eval"  # an evaluation cut short: cheap to play again
  "$BIN/rollflow" eval --config configs/opd_tool_use_game.toml --adapter "$TEACHER" --tasks 20 \
    --run-dir "$OUT/teacher-eval"
fi

echo "== 5/5 side by side"
"$BIN/python" - "$OUT/opd" "$OUT/grpo" "$OUT/teacher-eval" <<'PY'
import sys

from rollflow.storage.query import open_run_sql, run_query

PASS = "SELECT step, avg(passed::DOUBLE), count(*) FROM scores WHERE split = 'validation' GROUP BY step"
KL = ("SELECT step, sum(teacher_kl * num_action_tokens) / sum(num_action_tokens) FROM teacher "
      "GROUP BY step")


def table(run: str, sql: str) -> dict[int, tuple]:
    con = open_run_sql([run])
    try:
        return {row[0]: row[1:] for row in run_query(con, sql)[1]}
    finally:
        con.close()


runs = {"opd": sys.argv[1], "grpo": sys.argv[2]}
passed = {name: table(path, PASS) for name, path in runs.items()}
kl = {name: table(path, KL) for name, path in runs.items()}
steps = sorted(set(passed["opd"]) | set(passed["grpo"]))
teacher_rate = table(sys.argv[3], PASS)[0]
print(f"teacher (the SFT policy) on the same tasks: {teacher_rate[0]:.2f} ({teacher_rate[1]})")
print(f"{'val step':>8}  {'OPD pass':>12}  {'GRPO pass':>12}  {'OPD teacher KL':>14}  {'GRPO teacher KL':>15}")
for step in steps:
    cells = []
    for name in runs:
        rate = passed[name].get(step)
        cells.append(f"{rate[0]:.2f} ({rate[1]:>2})" if rate else "-")
    for name in runs:
        value = kl[name].get(step)  # the training step that the same policy version sampled
        cells.append(f"{value[0]:.4f}" if value else "-")
    print(f"{step:>8}  {cells[0]:>12}  {cells[1]:>12}  {cells[2]:>14}  {cells[3]:>15}")
print("\nteacher KL per training step (mean over action tokens of student_logp - teacher_logp):")
for name in runs:
    print(f"  {name:>4}: " + "  ".join(f"{s}:{v[0]:.4f}" for s, v in sorted(kl[name].items())))
PY
