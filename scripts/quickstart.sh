#!/usr/bin/env bash
# The quickstart, end to end on CPU: data → tokenizer + tiny model → SFT → GRPO → validation → plot,
# then a short summary. Everything lands in runs/quickstart/ (or $QS_DIR).
#
#   bash scripts/quickstart.sh [extra `verl run` overrides ...]
#
# Environment: VERL (the binary, default target/release/verl), QS_DIR, QS_SFT_STEPS, QS_RL_STEPS,
# QS_SEED, QS_SFT_NOISE. The plugins are found next to the binary.
#
# The SFT data is deliberately noisy (QS_SFT_NOISE, default 0.6: that fraction of the SFT answers
# ends in a final answer one too high, so the SFT model prefers the slip); the RL ground truth is
# always correct, so RL with the rule reward has the slips to remove. See examples/quickstart/job.yaml.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# shellcheck disable=SC1091
source scripts/env.sh

VERL="${VERL:-$root/target/release/verl}"
QS_DIR="${QS_DIR:-runs/quickstart}"
SFT_STEPS="${QS_SFT_STEPS:-600}"
RL_STEPS="${QS_RL_STEPS:-40}"
SFT_NOISE="${QS_SFT_NOISE:-0.6}"
SEED="${QS_SEED:-7}"
[ -x "$VERL" ] || { echo "error: $VERL not found; build it with \`make build\`" >&2; exit 1; }

started=$(date +%s)
rm -rf "$QS_DIR"
mkdir -p "$QS_DIR"
export VERL_FILE_LOGGER_ROOT="$QS_DIR/logs"

echo "== 1/5 data: arithmetic word problems (verl GSM8K format, data_source openai/gsm8k; SFT answers noisy: $SFT_NOISE)"
"$VERL" data arith --out "$QS_DIR/data" --train 4000 --val 128 --seed "$SEED" --sft-noise "$SFT_NOISE"

echo "== 2/5 tokenizer + model: byte-level BPE on the task text, Qwen2-shaped, random init"
"$VERL" init-model --out "$QS_DIR/init_model" --data "$QS_DIR/data/train.parquet" \
  --data "$QS_DIR/data/sft_train.parquet" --vocab 512 --hidden 128 --intermediate 256 \
  --layers 2 --heads 4 --kv-heads 2 --seed "$SEED"

echo "== 3/5 SFT on the deliberately noisy teacher (verl sft, examples/quickstart/sft.yaml)"
"$VERL" sft examples/quickstart/sft.yaml \
  data.train_files="$QS_DIR/data/sft_train.parquet" data.val_files="$QS_DIR/data/sft_val.parquet" \
  model.partial_pretrain="$QS_DIR/init_model" trainer.default_local_dir="$QS_DIR/sft" \
  trainer.total_training_steps="$SFT_STEPS" trainer.seed="$SEED" | tail -n 4
sft_model="$QS_DIR/sft/global_step_$SFT_STEPS"

echo "== 4/5 GRPO: verl run examples/quickstart/job.yaml (validation before and during training)"
"$VERL" run examples/quickstart/job.yaml \
  data.train_files="$QS_DIR/data/train.parquet" data.val_files="$QS_DIR/data/val.parquet" \
  actor_rollout_ref.model.path="$sft_model" trainer.default_local_dir="$QS_DIR/checkpoints" \
  trainer.total_training_steps="$RL_STEPS" "$@"

metrics="$QS_DIR/logs/verl_rs_quickstart/arith_grpo_cpu.jsonl"
echo "== 5/5 plot"
"$VERL" plot "$metrics" -o "$QS_DIR/metrics.png" \
  -m critic/score/mean -m 'val-core/*' -m actor/pg_loss -m response_length/mean

elapsed=$(( $(date +%s) - started ))
python3 - "$metrics" "$elapsed" "$QS_DIR" "$SFT_NOISE" <<'EOF'
import json, sys
path, elapsed, qs, noise = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
key = "val-core/openai/gsm8k/reward/mean@1"
val, score = [], []
for line in open(path):
    r = json.loads(line)
    d = r.get("data", {})
    if key in d:
        val.append((r["step"], d[key]))
    if "critic/score/mean" in d:
        score.append(d["critic/score/mean"])
print()
print("quickstart summary")
print(f"  the SFT data is deliberately noisy ({float(noise):.0%} of its answers slip by one); RL's rule reward scores against the correct answers")
if val:
    (s0, a0), (s1, a1) = val[0], val[-1]
    print(f"  val accuracy (greedy mean@1): {a0:.3f} at step {s0} (SFT start) -> {a1:.3f} at step {s1} ({a1 - a0:+.3f})")
if score:
    k = max(1, len(score) // 4)
    print(f"  train reward (critic/score/mean): first {k} steps {sum(score[:k]) / k:.3f} -> last {k} steps {sum(score[-k:]) / k:.3f}")
print(f"  steps: {len(score)} GRPO, time: {elapsed // 60}m{elapsed % 60:02d}s end to end")
print(f"  plot:        {qs}/metrics.png")
print(f"  metrics:     {path}")
print(f"  checkpoints: {qs}/checkpoints (SFT model: {qs}/sft)")
EOF
