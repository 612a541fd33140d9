#!/usr/bin/env bash
# Multi-turn GSM8K with the built-in calculator on one GPU, at Qwen2.5-0.5B's shape: the step time
# of GRPO with verl's tool agent loop, and what the tools cost it.
#
#   bash bench/multi_turn_gsm8k.sh [extra `verl run` overrides ...]
#
# Nothing is downloaded: the model is initialised at random (24 layers, hidden 896, 14 heads / 2
# KV heads, intermediate 4864; a 16 k-token BPE trained on the data instead of Qwen's 152 k), then
# SFT on GSM8K's own calculator annotations (`verl data gsm8k --tools calculator`) teaches it the
# calling format, so the GRPO rollouts have real tool turns. The numbers it learns are not the
# point; the step's timing, turn and tool metrics are.
#
# Environment: VERL (the binary; plugins next to it), MT_DIR (work folder, default /tmp/mt),
# MT_DATA (the `verl data gsm8k --tools calculator` folder, made from ../shared/data/gsm8k when
# absent), MT_SFT_STEPS (300), MT_RL_STEPS (6).
set -euo pipefail
VERL="${VERL:-target/release/verl}"
OUT="${MT_DIR:-/tmp/mt}"
DATA="${MT_DATA:-.bin/mt/data}"
SFT_STEPS="${MT_SFT_STEPS:-300}"
RL_STEPS="${MT_RL_STEPS:-6}"
mkdir -p "$OUT"
export VERL_FILE_LOGGER_ROOT="$OUT/logs"
[ -f "$DATA/sft_train.parquet" ] || "$VERL" data gsm8k ../shared/data/gsm8k "$DATA" --tools calculator

t0=$(date +%s)
"$VERL" init-model --out "$OUT/init" --data "$DATA/sft_train.parquet" --vocab 16384 --hidden 896 \
  --intermediate 4864 --layers 24 --heads 14 --kv-heads 2 --max-positions 2048 --digit-group 1 --seed 1
t1=$(date +%s)
"$VERL" sft examples/gsm8k_tools/sft.yaml data.train_files="$DATA/sft_train.parquet" \
  data.val_files="$DATA/sft_test.parquet" model.partial_pretrain="$OUT/init" \
  trainer.default_local_dir="$OUT/sft" trainer.total_training_steps="$SFT_STEPS" | tail -n 3
t2=$(date +%s)
"$VERL" run examples/gsm8k_tools/job.yaml data.train_files="$DATA/train.parquet" \
  data.val_files="$DATA/test.parquet" actor_rollout_ref.model.path="$OUT/sft/global_step_$SFT_STEPS" \
  trainer.default_local_dir="$OUT/checkpoints" trainer.total_training_steps="$RL_STEPS" "$@" | tail -n 5
t3=$(date +%s)
echo "wall: init-model $((t1 - t0)) s, sft $((t2 - t1)) s, grpo $((t3 - t2)) s"
python3 - "$OUT/logs/verl_rs_multi_turn/gsm8k_tools_grpo.jsonl" <<'PY'
import json, sys
keys = ["timing_s/step", "timing_s/gen", "timing_s/old_log_prob", "timing_s/update_actor",
        "num_turns/mean", "tool_call_counts/mean", "response_length/mean", "tools/calls",
        "tools/errors", "tools/busy_s", "tools/latency_s/mean", "tools/latency_s/max",
        "rollout/idle_s", "rollout/continued_turns", "rollout/appended_tokens",
        "rollout/evicted_waiting", "critic/score/mean", "training/rollout_probs_diff_max"]
rows = [json.loads(l) for l in open(sys.argv[1])]
print("step " + " ".join(k.split("/", 1)[1] if k.startswith("timing") else k for k in keys))
for r in rows:
    d = r["data"]
    print(r["step"], " ".join(f"{d[k]:.4g}" if k in d else "-" for k in keys))
PY
