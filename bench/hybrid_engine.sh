#!/usr/bin/env bash
# Generation at its own tensor-parallel size (3D-HybridEngine) on several GPUs of one host: GRPO
# steps of a random-weight model at a public 7B/8B shape, for each training layout × rollout TP,
# with step and phase times, the reshard's bytes and seconds, memory per GPU and tokens/s/GPU by
# NeMo-RL's definition (all prompt + response tokens of the step / step time / GPUs).
#
#   bash bench/hybrid_engine.sh
#
# Environment: VERL (the binary; plugins next to it), HE_GPUS (ranks, default: every GPU
# nvidia-smi lists), HE_SHAPES (qwen2.5-7b llama3-8b), HE_DIR (work folder, /tmp/he), HE_STEPS (4),
# HE_DEVICE (cuda; cpu with HE_SHAPES=tiny tries the script out), HE_PROMPTS (64), HE_N (8),
# HE_RESPONSE (1024), HE_LAYOUTS (default: every layout below that fits HE_GPUS).
#
# Layouts are `backend:train_tp:rollout_tp`; FSDP's train TP is 1 (ZeRO-3 over every rank).
set -euo pipefail
VERL="${VERL:-target/release/verl}"
OUT="${HE_DIR:-/tmp/he}"
DEVICE="${HE_DEVICE:-cuda}"
GPUS="${HE_GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}"
SHAPES="${HE_SHAPES:-qwen2.5-7b llama3-8b}"
STEPS="${HE_STEPS:-4}"
PROMPTS="${HE_PROMPTS:-64}"
N="${HE_N:-8}"
RESPONSE="${HE_RESPONSE:-1024}"
[ "$GPUS" -ge 1 ] || { echo "no GPUs: set HE_GPUS" >&2; exit 1; }
if [ -z "${HE_LAYOUTS:-}" ]; then
  HE_LAYOUTS="fsdp:1:1"
  for t in 2 4; do
    [ "$t" -le "$GPUS" ] || continue
    HE_LAYOUTS="$HE_LAYOUTS fsdp:1:$t megatron:$t:$t megatron:$t:1"
    [ "$t" -gt 2 ] && HE_LAYOUTS="$HE_LAYOUTS megatron:$t:2"
  done
fi
mkdir -p "$OUT"
[ -f "$OUT/data/train.parquet" ] || "$VERL" data arith --out "$OUT/data" --train 4096 >/dev/null

# `verl init-model` arguments of each shape: the public config's widths, depth and heads, as a
# Qwen2-architecture model (Llama-3-8B's shape thus gains q/k/v biases) with a BPE trained on the
# arithmetic data in place of the public vocabularies (the folder's config.json has its size).
shape_args() {
  case "$1" in
    qwen2.5-7b) echo "--hidden 3584 --intermediate 18944 --layers 28 --heads 28 --kv-heads 4" ;;
    llama3-8b) echo "--hidden 4096 --intermediate 14336 --layers 32 --heads 32 --kv-heads 8" ;;
    tiny) echo "--hidden 64 --intermediate 128 --layers 2 --heads 4 --kv-heads 4" ;;
    *) echo "unknown shape $1" >&2; exit 1 ;;
  esac
}

printf '%-11s %-22s %7s %7s %7s %7s %9s %9s %8s %11s\n' shape layout step gen update ref \
  reshard_s reshard_mb mem_gb tok/s/GPU
for shape in $SHAPES; do
  model="$OUT/model-$shape"
  if [ "$shape" = tiny ]; then vocab=512; else vocab=32768; fi
  [ -f "$model/config.json" ] || "$VERL" init-model --out "$model" --data "$OUT/data/train.parquet" \
    --vocab "$vocab" --max-positions 4096 $(shape_args "$shape") --seed 1 >/dev/null
  for layout in $HE_LAYOUTS; do
    IFS=: read -r backend ttp rtp <<<"$layout"
    name="$shape-$backend-tp$ttp-rollout$rtp"
    args=(trainer.device="$DEVICE" trainer.n_gpus_per_node="$GPUS" trainer.total_training_steps="$STEPS"
      trainer.test_freq=-1 trainer.save_freq=-1 trainer.val_before_train=false
      trainer.project_name=hybrid_engine trainer.experiment_name="$name"
      trainer.default_local_dir="$OUT/ckpt/$name" trainer.resume_mode=disable
      data.train_files="$OUT/data/train.parquet" data.val_files="$OUT/data/val.parquet"
      data.train_batch_size="$PROMPTS" data.max_prompt_length=256 data.max_response_length="$RESPONSE"
      actor_rollout_ref.model.path="$model" actor_rollout_ref.rollout.n="$N"
      actor_rollout_ref.rollout.ignore_eos=true actor_rollout_ref.actor.use_kl_loss=true
      actor_rollout_ref.actor.ppo_mini_batch_size="$PROMPTS"
      actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4
      actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
      actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8
      actor_rollout_ref.rollout.tensor_model_parallel_size="$rtp")
    if [ "$backend" = megatron ]; then
      args+=(actor_rollout_ref.actor.strategy=megatron
        actor_rollout_ref.actor.megatron.tensor_model_parallel_size="$ttp"
        actor_rollout_ref.ref.megatron.tensor_model_parallel_size="$ttp"
        actor_rollout_ref.actor.megatron.use_distributed_optimizer=true
        actor_rollout_ref.ref.megatron.param_offload=true)
    else
      args+=(actor_rollout_ref.ref.fsdp_config.param_offload=true)
    fi
    log="$OUT/logs"
    if ! VERL_FILE_LOGGER_ROOT="$log" "$VERL" run examples/quickstart/job.yaml "${args[@]}" \
      >"$OUT/$name.out" 2>&1; then
      printf '%-11s %-22s failed: %s\n' "$shape" "$backend tp$ttp/rollout$rtp" \
        "$(grep -m1 '^error' "$OUT/$name.out" || tail -n1 "$OUT/$name.out")"
      continue
    fi
    python3 - "$log/hybrid_engine/$name.jsonl" "$shape" "$backend tp$ttp/rollout$rtp" "$GPUS" \
      "$PROMPTS" "$N" <<'PY'
import json, sys
path, shape, layout, gpus, prompts, n = sys.argv[1:7]
rows = [json.loads(l)["data"] for l in open(path)]
last = rows[1:] or rows  # the first step warms kernels and the allocator up
def mean(k):
    v = [r[k] for r in last if k in r]
    return sum(v) / len(v) if v else float("nan")
first = rows[0]
tokens = (mean("prompt_length/mean") + mean("response_length/mean")) * int(prompts) * int(n)
mem = max(r.get("perf/max_memory_reserved_gb", r.get("perf/max_memory_allocated_gb", float("nan"))) for r in rows)
print(f"{shape:<11} {layout:<22} {mean('timing_s/step'):7.2f} {mean('timing_s/gen'):7.2f} "
      f"{mean('timing_s/update_actor'):7.2f} {mean('timing_s/ref'):7.2f} "
      f"{mean('rollout/reshard_s'):9.3f} {mean('rollout/reshard_mb'):9.1f} {mem:8.1f} "
      f"{tokens / mean('timing_s/step') / int(gpus):11.0f}")
PY
  done
done
