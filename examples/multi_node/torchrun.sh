#!/usr/bin/env bash
# Two nodes of 8 GPUs under torchrun: run this on every node with NODE_RANK=0 and 1 and
# MASTER_ADDR set to node 0's address. torchrun starts 8 `verl run` processes per node; each
# reads its rank from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
# MASTER_PORT), and verl checks that it agrees with trainer.nnodes x trainer.n_gpus_per_node.
#   NODE_RANK=0 MASTER_ADDR=node0 bash examples/multi_node/torchrun.sh
set -euo pipefail
JOB=${JOB:-examples/grpo_trainer/qwen2.5-7b_gsm8k_math_8gpu.yaml}
torchrun --nnodes=2 --nproc_per_node=8 --node_rank="${NODE_RANK:?set NODE_RANK}" \
  --master_addr="${MASTER_ADDR:?set MASTER_ADDR}" --master_port="${MASTER_PORT:-29500}" \
  --no-python "$(command -v verl)" run "$JOB" trainer.nnodes=2 trainer.n_gpus_per_node=8 "$@"
