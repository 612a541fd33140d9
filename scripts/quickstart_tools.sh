#!/usr/bin/env bash
# The tool quickstart, on CPU: arithmetic word problems whose 3-4 digit numbers the tiny model
# cannot add, and a calculator tool (verl's tool agent loop). Data → tokenizer + tiny model → SFT
# (this file's first block) → GRPO with the calculator (the second block). Everything lands in
# runs/quickstart_tools/ (or $QS_DIR).
#
#   bash scripts/quickstart_tools.sh [extra `verl run` overrides ...]   (`make run` runs it second)
#
# Environment: VERL (the binary, default target/release/verl), QS_DIR, QS_SFT_STEPS, QS_RL_STEPS,
# QS_SEED, QS_TOOL_RATE. The plugins are found next to the binary.
#
# The SFT data teaches both behaviours: a QS_TOOL_RATE fraction (default 0.3) of its answers
# call the calculator and copy its result into `#### N`, the rest work the sum out directly, which
# the model cannot do. The SFT model so calls the tool on about a quarter of its samples and, when
# decoding greedily, answers directly and wrongly; GRPO with the rule reward makes calling the
# tool its choice. See examples/quickstart/tools_sft.yaml.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# shellcheck disable=SC1091
source scripts/env.sh

VERL="${VERL:-$root/target/release/verl}"
QS_DIR="${QS_DIR:-runs/quickstart_tools}"
SFT_STEPS="${QS_SFT_STEPS:-1000}"
TOOL_RATE="${QS_TOOL_RATE:-0.3}"
SEED="${QS_SEED:-7}"
[ -x "$VERL" ] || { echo "error: $VERL not found; build it with \`make build\`" >&2; exit 1; }

started=$(date +%s)
rm -rf "$QS_DIR"
mkdir -p "$QS_DIR"
export VERL_FILE_LOGGER_ROOT="$QS_DIR/logs"

# ---- data, tokenizer + model, SFT --------------------------------------------------------------
# Leaves the SFT model in $sft_model.
tools_sft_stage() {
  echo "== 1/4 data: 3-4 digit arithmetic word problems for verl's tool agent loop (data_source openai/gsm8k); SFT conversations, $TOOL_RATE calling the calculator"
  "$VERL" data arith --out "$QS_DIR/data" --train 4000 --val 128 --seed "$SEED" \
    --min-operand 100 --max-operand 9999 --max-ops 2 --tools calculator --tool-rate "$TOOL_RATE"

  echo "== 2/4 tokenizer + model: byte-level BPE on the rendered conversations (one token per digit), Qwen2-shaped, random init"
  "$VERL" init-model --out "$QS_DIR/init_model" --data "$QS_DIR/data/train.parquet" \
    --data "$QS_DIR/data/sft_train.parquet" --vocab 1024 --digit-group 1 --hidden 128 \
    --intermediate 128 --layers 3 --heads 8 --kv-heads 4 --max-positions 512 --seed "$SEED"

  echo "== 3/4 SFT on the conversations (verl sft, multi-turn, examples/quickstart/tools_sft.yaml)"
  local t0=$SECONDS
  "$VERL" sft examples/quickstart/tools_sft.yaml \
    data.train_files="$QS_DIR/data/sft_train.parquet" data.val_files="$QS_DIR/data/sft_val.parquet" \
    model.partial_pretrain="$QS_DIR/init_model" trainer.default_local_dir="$QS_DIR/sft" \
    trainer.total_training_steps="$SFT_STEPS" trainer.seed="$SEED" | tail -n 3
  echo "   SFT took $((SECONDS - t0))s"
  sft_model="$QS_DIR/sft/global_step_$SFT_STEPS"
}

tools_sft_stage

# ---- GRPO with the calculator, summary ---------------------------------------------------------
RL_STEPS="${QS_RL_STEPS:-30}"
echo "== 4/4 GRPO with the calculator: verl run examples/quickstart/tools_job.yaml (verl's tool agent loop)"
"$VERL" run examples/quickstart/tools_job.yaml \
  data.train_files="$QS_DIR/data/train.parquet" data.val_files="$QS_DIR/data/val.parquet" \
  actor_rollout_ref.model.path="$sft_model" trainer.default_local_dir="$QS_DIR/checkpoints" \
  trainer.total_training_steps="$RL_STEPS" "$@"

metrics="$QS_DIR/logs/verl_rs_quickstart/arith_tools_grpo_cpu.jsonl"
"$VERL" plot "$metrics" -o "$QS_DIR/metrics.png" \
  -m critic/score/mean -m 'val-core/*' -m tool_call_counts/mean -m num_turns/mean

elapsed=$(( $(date +%s) - started ))
python3 - "$metrics" "$elapsed" "$QS_DIR" <<'PY'
import json, sys
path, elapsed, qs = sys.argv[1], int(sys.argv[2]), sys.argv[3]
val_key = "val-core/openai/gsm8k/reward/mean@1"
val, calls, score = [], [], []
for line in open(path):
    r = json.loads(line)
    d = r.get("data", {})
    if val_key in d:
        val.append((r["step"], d[val_key]))
    if "tool_call_counts/mean" in d:
        calls.append(d["tool_call_counts/mean"])
    if "critic/score/mean" in d:
        score.append(d["critic/score/mean"])
print()
print("tool quickstart summary")
k = max(1, len(calls) // 5)
a, b = calls[0], sum(calls[-k:]) / k
(s0, c), (s1, d) = val[0], val[-1]
print(f"tool use: calls/response {a:.2f} -> {b:.2f}, val accuracy {c:.3f} -> {d:.3f}")
print(f"  calls/response: the first GRPO step's (the SFT policy) -> the mean of the last {k} (tool_call_counts/mean, sampled at temperature 1)")
print(f"  val accuracy: greedy mean@1 at step {s0} (SFT start) and step {s1}")
if score:
    print(f"  train reward (critic/score/mean): first {k} steps {sum(score[:k]) / k:.3f} -> last {k} steps {sum(score[-k:]) / k:.3f}")
print(f"  steps: {len(score)} GRPO, time: {elapsed // 60}m{elapsed % 60:02d}s end to end")
print(f"  plot:        {qs}/metrics.png")
print(f"  metrics:     {path}")
PY
