#!/usr/bin/env python3
"""Replay verl's own example launch scripts against `verl run --dry-run`.

Every `examples/**/*.sh` of a verl checkout that launches `verl.trainer.main_ppo` runs with `bash`
in a sandbox on a machine without GPUs:

* `python3`/`python`/`uv`/`ray`/`torchrun`/`srun`/`hf`/`nvidia-smi`/... on PATH are shims.
  `python3 -m verl.trainer.main_ppo ARGS` (directly, through `uv run ...`, `ray job submit -- ...`
  or `srun ...`) runs `verl run --dry-run ARGS` instead; `python3 -c 'import torch_npu'` fails (no
  NPU); other invocations are recorded and run, skipped or refused as `SHIM_RULES` below says.
* HOME is a fresh folder per script. The data files the final arguments name are created just
  before verl runs (rows from `verl data arith`; for image/video datasets and VL scripts the rows
  carry an `images` or `videos` column), and model paths are rewritten to folders named after the
  HF id holding that model's real config.json (`MODELS`) and a tokenizer from `verl init-model`.
* With `--isolate` (default when run as root and overlayfs works) each script runs in its own mount
  namespace over an overlay of `/`, so whatever it writes outside its sandbox (log folders under
  /data, ...) is thrown away and listed in the report.

The report classifies each script: `ok` (exit 0; the `ignored` warnings are listed), `refused`
(exit != 0, every error line is one line naming a config key), `error` (anything else). Python 3
standard library only; `pyarrow` is used through the interpreter that has it (`--data-python`).

    source scripts/env.sh
    python3 scripts/replay_verl_examples.py \
        --verl-git /work/.mirror/verl-project+verl/repo@HEAD \
        --verl-git /work/.mirror/verl-project+verl/repo@v0.7.1 \
        --verl-bin target/debug/verl --out docs/verl-examples.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# ----------------------------------------------------------------------------------------------
# Model configs: the real architecture of every model verl's examples name (HF config.json values).
# Supported by verl-rs (crates/nn): llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe.
# Others keep their real `architectures`/`model_type`, so a refusal of them is the honest outcome.
# `src`: where the numbers come from; "approx" marks a model whose config.json was not found (the
# closest known family member's numbers are used, said in the report).
# ----------------------------------------------------------------------------------------------


def _dense(arch, mtype, vocab, hidden, inter, layers, heads, kv, head_dim=None, tie=False,
           max_pos=32768, rope_theta=1000000.0, **extra):
    c = {
        "architectures": [arch], "model_type": mtype, "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "max_position_embeddings": max_pos, "rope_theta": rope_theta,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": tie, "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    }
    if head_dim is not None:
        c["head_dim"] = head_dim
    c.update(extra)
    return c


def _qwen2(vocab, hidden, inter, layers, heads, kv, tie=False, **kw):
    return _dense("Qwen2ForCausalLM", "qwen2", vocab, hidden, inter, layers, heads, kv, tie=tie,
                  use_sliding_window=False, **kw)


def _qwen3(hidden, inter, layers, heads, kv, tie=False):
    return _dense("Qwen3ForCausalLM", "qwen3", 151936, hidden, inter, layers, heads, kv, 128, tie,
                  max_pos=40960)


def _qwen3_moe(hidden, inter, moe_inter, layers, heads, kv, experts, topk):
    return _dense("Qwen3MoeForCausalLM", "qwen3_moe", 151936, hidden, inter, layers, heads, kv, 128,
                  max_pos=40960, moe_intermediate_size=moe_inter, num_experts=experts,
                  num_experts_per_tok=topk, norm_topk_prob=True, decoder_sparse_step=1,
                  mlp_only_layers=[])


def _llama(vocab, hidden, inter, layers, heads, kv, arch="LlamaForCausalLM", tie=False,
           max_pos=4096, rope_theta=10000.0, **kw):
    return _dense(arch, "llama", vocab, hidden, inter, layers, heads, kv, tie=tie, max_pos=max_pos,
                  rope_theta=rope_theta, **kw)


def _vl(arch, mtype, text):
    """A vision-language config: the text model's numbers at the top level and in text_config."""
    c = dict(text)
    c["architectures"] = [arch]
    c["model_type"] = mtype
    c["text_config"] = dict(text)
    c["vision_config"] = {"depth": 32, "hidden_size": 1280}
    return c


_LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

Q25 = {
    "0.5B": _qwen2(151936, 896, 4864, 24, 14, 2, tie=True),
    "1.5B": _qwen2(151936, 1536, 8960, 28, 12, 2, tie=True),
    "3B": _qwen2(151936, 2048, 11008, 36, 16, 2, tie=True),
    "7B": _qwen2(152064, 3584, 18944, 28, 28, 4),
    "14B": _qwen2(152064, 5120, 13824, 48, 40, 8),
    "32B": _qwen2(152064, 5120, 27648, 64, 40, 8),
    "72B": _qwen2(152064, 8192, 29568, 80, 64, 8),
}
Q3 = {
    "0.6B": _qwen3(1024, 3072, 28, 16, 8, tie=True),
    "1.7B": _qwen3(2048, 6144, 28, 16, 8, tie=True),
    "4B": _qwen3(2560, 9728, 36, 32, 8, tie=True),
    "8B": _qwen3(4096, 12288, 36, 32, 8),
    "14B": _qwen3(5120, 17408, 40, 40, 8),
    "32B": _qwen3(5120, 25600, 64, 64, 8),
    "30B-A3B": _qwen3_moe(2048, 6144, 768, 48, 32, 4, 128, 8),
    "235B-A22B": _qwen3_moe(4096, 12288, 1536, 94, 64, 4, 128, 8),
}


def _qwen35(hidden, inter, layers, heads, kv, experts=None, topk=None, moe_inter=None):
    moe = experts is not None
    c = _dense("Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration",
               "qwen3_5_moe" if moe else "qwen3_5", 248320, hidden, inter, layers, heads, kv, 256,
               max_pos=262144, rope_theta=10000000.0, full_attention_interval=4)
    if moe:
        c.update(num_experts=experts, num_experts_per_tok=topk, moe_intermediate_size=moe_inter,
                 shared_expert_intermediate_size=moe_inter)
    return _vl(c["architectures"][0], c["model_type"], c)


def _deepseek_v3(vocab, hidden, inter, moe_inter, layers, heads, experts, shared, topk, dense_first,
                 arch="DeepseekV3ForCausalLM", mtype="deepseek_v3"):
    return _dense(arch, mtype, vocab, hidden, inter, layers, heads, heads, max_pos=163840,
                  rope_theta=10000.0, moe_intermediate_size=moe_inter, n_routed_experts=experts,
                  n_shared_experts=shared, num_experts_per_tok=topk,
                  first_k_dense_replace=dense_first, kv_lora_rank=512, q_lora_rank=1536,
                  qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


# (regex on the lower-cased model path, HF id, config, source). First match wins.
MODELS = [
    (r"qwen3[._-]?5[-_]397b", "Qwen/Qwen3.5-397B-A17B", _qwen35(4096, 1024, 60, 32, 2, 512, 10, 1024),
     "THUDM/slime scripts/models/qwen3.5-397B-A17B.sh"),
    (r"qwen3[._-]?5[-_]122b", "Qwen/Qwen3.5-122B-A10B", _qwen35(3072, 1024, 48, 32, 2, 256, 8, 1024),
     "approx: Qwen3.5 MoE family values (122B config.json not found)"),
    (r"qwen3[._-]?5[-_]35b", "Qwen/Qwen3.5-35B-A3B", _qwen35(2048, 512, 40, 16, 2, 256, 8, 512),
     "THUDM/slime scripts/models/qwen3.5-35B-A3B.sh"),
    (r"qwen3[._-]?5[-_]27b", "Qwen/Qwen3.5-27B", _qwen35(5120, 17408, 64, 24, 4),
     "THUDM/slime scripts/models/qwen3.5-27B.sh"),
    (r"qwen3[._-]?5[-_]4b", "Qwen/Qwen3.5-4B", _qwen35(2560, 9216, 32, 16, 4),
     "approx: Qwen3.5 dense family values (4B config.json not found)"),
    (r"qwen3[._-]?5[-_]2b", "Qwen/Qwen3.5-2B", _qwen35(2048, 6144, 24, 8, 2),
     "approx: Qwen3.5 dense family values (2B config.json not found)"),
    (r"qwen3[._-]?vl[-_]235b", "Qwen/Qwen3-VL-235B-A22B-Instruct",
     _vl("Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe", Q3["235B-A22B"]), "HF card"),
    (r"qwen3[._-]?vl[-_]30b", "Qwen/Qwen3-VL-30B-A3B-Instruct",
     _vl("Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe", Q3["30B-A3B"]), "HF card"),
    (r"qwen3[._-]?vl[-_]32b", "Qwen/Qwen3-VL-32B-Instruct",
     _vl("Qwen3VLForConditionalGeneration", "qwen3_vl", Q3["32B"]), "HF card"),
    (r"qwen3[._-]?vl[-_]8b", "Qwen/Qwen3-VL-8B-Instruct",
     _vl("Qwen3VLForConditionalGeneration", "qwen3_vl", Q3["8B"]), "HF card"),
    (r"qwen3[._-]?vl[-_]2b", "Qwen/Qwen3-VL-2B-Instruct",
     _vl("Qwen3VLForConditionalGeneration", "qwen3_vl", Q3["1.7B"]), "HF card"),
    (r"qwen3[._-]?next[-_]80b", "Qwen/Qwen3-Next-80B-A3B-Instruct",
     _dense("Qwen3NextForCausalLM", "qwen3_next", 151936, 2048, 5120, 48, 16, 2, 256,
            max_pos=262144, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
            shared_expert_intermediate_size=512),
     "THUDM/slime scripts/models/qwen3-next-80B-A3B.sh"),
    (r"qwen3[._-]?(moe[._-]?)?235b", "Qwen/Qwen3-235B-A22B", Q3["235B-A22B"], "HF config.json"),
    (r"qwen3[._-]?(moe[._-]?)?30b", "Qwen/Qwen3-30B-A3B", Q3["30B-A3B"], "HF config.json"),
    (r"qwen3[._-]?32b", "Qwen/Qwen3-32B", Q3["32B"], "HF config.json"),
    (r"qwen3[._-]?14b", "Qwen/Qwen3-14B", Q3["14B"], "HF config.json"),
    (r"qwen3[._-]?8b", "Qwen/Qwen3-8B", Q3["8B"], "HF config.json"),
    (r"fapo[-_]genrm[-_]4b", "dyyyyyyyy/FAPO-GenRM-4B", Q3["4B"],
     "approx: a Qwen3-4B fine-tune, Qwen3-4B's config"),
    (r"qwen3[._-]?4b", "Qwen/Qwen3-4B", Q3["4B"], "HF config.json"),
    (r"qwen3[._-]?1\.7b", "Qwen/Qwen3-1.7B", Q3["1.7B"], "HF config.json"),
    (r"qwen3[._-]?0\.6b", "Qwen/Qwen3-0.6B", Q3["0.6B"], "HF config.json"),
    (r"qwen2[._-]?5[._-]?vl[-_]72b", "Qwen/Qwen2.5-VL-72B-Instruct",
     _vl("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl", Q25["72B"]), "HF config.json"),
    (r"qwen2[._-]?5[._-]?vl[-_]32b", "Qwen/Qwen2.5-VL-32B-Instruct",
     _vl("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl", Q25["32B"]), "HF config.json"),
    (r"qwen2[._-]?5[._-]?vl[-_]7b", "Qwen/Qwen2.5-VL-7B-Instruct",
     _vl("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl", Q25["7B"]), "HF config.json"),
    (r"qwen2[._-]?5[._-]?vl[-_]3b", "Qwen/Qwen2.5-VL-3B-Instruct",
     _vl("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl", Q25["3B"]), "HF config.json"),
    (r"qwen2[._-]?5[._-]?math[-_]7b", "Qwen/Qwen2.5-Math-7B",
     _qwen2(152064, 3584, 18944, 28, 28, 4, max_pos=4096, rope_theta=10000.0), "HF config.json"),
    (r"qwen2[._-]?5[._-]?coder[-_]14b", "Qwen/Qwen2.5-Coder-14B-Instruct", Q25["14B"],
     "HF config.json"),
    (r"qwen2(\.5)?[._-]?72b", "Qwen/Qwen2.5-72B-Instruct", Q25["72B"], "HF config.json (Qwen2-72B: same shape)"),
    (r"qwen2(\.5)?[._-]?32b", "Qwen/Qwen2.5-32B", Q25["32B"], "HF config.json"),
    (r"qwen2(\.5)?[._-]?14b", "Qwen/Qwen2.5-14B-Instruct", Q25["14B"], "HF config.json"),
    (r"qwen2\.5[._-]?7b", "Qwen/Qwen2.5-7B-Instruct", Q25["7B"], "HF config.json"),
    (r"qwen2[._-]?7b", "Qwen/Qwen2-7B-Instruct", Q25["7B"], "HF config.json"),
    (r"qwen2(\.5)?[._-]?3b", "Qwen/Qwen2.5-3B-Instruct", Q25["3B"], "HF config.json"),
    (r"qwen2(\.5)?[._-]?1\.5b", "Qwen/Qwen2.5-1.5B-Instruct", Q25["1.5B"], "HF config.json"),
    (r"qwen2?(\.5)?[._-]?0\.5b|qwen0\.5b", "Qwen/Qwen2.5-0.5B-Instruct", Q25["0.5B"], "HF config.json"),
    (r"qwen1\.5[._-]?moe[._-]?a2\.7b", "Qwen/Qwen1.5-MoE-A2.7B-Chat",
     _dense("Qwen2MoeForCausalLM", "qwen2_moe", 151936, 2048, 5632, 24, 16, 16, max_pos=8192,
            moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_experts=60,
            num_experts_per_tok=4, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[]),
     "HF config.json"),
    (r"deepseek[-_]v4", "deepseek-ai/DeepSeek-V4-Flash",
     _deepseek_v3(129280, 7168, 18432, 2048, 61, 128, 256, 1, 8, 3),
     "approx: config.json not found; DeepSeek-V3's numbers and architecture"),
    (r"deepseek[-_]?v3|dsv3|deepseek671b", "deepseek-ai/DeepSeek-V3",
     _deepseek_v3(129280, 7168, 18432, 2048, 61, 128, 256, 1, 8, 3), "HF config.json"),
    (r"moonlight", "moonshotai/Moonlight-16B-A3B-Instruct",
     _deepseek_v3(163840, 2048, 11264, 1408, 27, 16, 64, 2, 6, 1), "HF config.json"),
    (r"kimi[-_]?k2", "moonshotai/Kimi-K2-Instruct",
     _deepseek_v3(163840, 7168, 18432, 2048, 61, 64, 384, 1, 8, 1),
     "approx: Kimi-K2's config.json (K2.6 not found)"),
    (r"glm[-_]?5", "zai-org/GLM-4.5",
     _dense("Glm4MoeForCausalLM", "glm4_moe", 151552, 5120, 12288, 92, 96, 8, 128,
            max_pos=131072, moe_intermediate_size=1536, n_routed_experts=160, n_shared_experts=1,
            num_experts_per_tok=8, first_k_dense_replace=3),
     "approx: GLM-5.1 not found; GLM-4.5's config.json"),
    (r"deepseek[-_]coder[-_]6\.7b", "deepseek-ai/deepseek-coder-6.7b-instruct",
     _llama(32256, 4096, 11008, 32, 32, 32, max_pos=16384, rope_theta=100000.0,
            rope_scaling={"type": "linear", "factor": 4.0}), "HF config.json"),
    (r"deepseek[-_]llm[-_]7b|deepseek7b", "deepseek-ai/deepseek-llm-7b-chat",
     _llama(102400, 4096, 11008, 30, 32, 32), "HF config.json"),
    (r"deepseek[-_]math[-_]7b", "deepseek-ai/deepseek-math-7b-instruct",
     _llama(102400, 4096, 11008, 30, 32, 32), "HF config.json (same shape as deepseek-llm-7b)"),
    (r"skywork[-_]reward[-_]v2[-_]llama[-_]3\.2[-_]3b", "Skywork/Skywork-Reward-V2-Llama-3.2-3B",
     _llama(128256, 3072, 8192, 28, 24, 8, arch="LlamaForSequenceClassification", tie=True,
            max_pos=131072, rope_theta=500000.0, head_dim=128, num_labels=1,
            rope_scaling=dict(_LLAMA3_SCALING, factor=32.0)), "HF config.json"),
    (r"skywork[-_]reward[-_]llama[-_]3\.1[-_]8b", "Skywork/Skywork-Reward-Llama-3.1-8B",
     _llama(128256, 4096, 14336, 32, 32, 8, arch="LlamaForSequenceClassification",
            max_pos=131072, rope_theta=500000.0, num_labels=1, rope_scaling=_LLAMA3_SCALING),
     "HF config.json"),
    (r"fsfairx[-_]llama3[-_]rm", "sfairXC/FsfairX-LLaMA3-RM-v0.1",
     _llama(128256, 4096, 14336, 32, 32, 8, arch="LlamaForSequenceClassification", max_pos=8192,
            rope_theta=500000.0, num_labels=1), "HF config.json (Llama-3-8B)"),
    (r"llama[-_]?3\.?1?[-_]8b", "meta-llama/Llama-3.1-8B-Instruct",
     _llama(128256, 4096, 14336, 32, 32, 8, max_pos=131072, rope_theta=500000.0,
            rope_scaling=_LLAMA3_SCALING), "HF config.json"),
    (r"mistral[-_]nemo", "mistralai/Mistral-Nemo-Instruct-2407",
     _dense("MistralForCausalLM", "mistral", 131072, 5120, 14336, 40, 32, 8, 128, max_pos=1024000),
     "HF config.json"),
    (r"mixtral", "mistralai/Mixtral-8x7B-Instruct-v0.1",
     _dense("MixtralForCausalLM", "mixtral", 32000, 4096, 14336, 32, 32, 8, max_pos=32768,
            num_local_experts=8, num_experts_per_tok=2), "HF config.json"),
    (r"gemma[-_]2[-_]2b", "google/gemma-2-2b-it",
     _dense("Gemma2ForCausalLM", "gemma2", 256000, 2304, 9216, 26, 8, 4, 256, tie=True,
            max_pos=8192, rope_theta=10000.0), "HF config.json"),
    (r"gemma[-_]1\.1[-_]7b|gemma[-_]7b", "google/gemma-1.1-7b-it",
     _dense("GemmaForCausalLM", "gemma", 256000, 3072, 24576, 28, 16, 16, 256, tie=True,
            max_pos=8192, rope_theta=10000.0), "HF config.json"),
    (r"gemma", "google/gemma-2b-it",
     _dense("GemmaForCausalLM", "gemma", 256000, 2048, 16384, 18, 8, 1, 256, tie=True,
            max_pos=8192, rope_theta=10000.0), "HF config.json"),
    (r"glm[-_]?4\.?1v", "zai-org/GLM-4.1V-9B-Thinking",
     _vl("Glm4vForConditionalGeneration", "glm4v",
         _dense("Glm4vForConditionalGeneration", "glm4v", 151552, 4096, 13696, 40, 32, 2,
                max_pos=65536)), "HF config.json"),
    (r"minicpm[-_]?o", "openbmb/MiniCPM-o-2_6",
     _vl("MiniCPMO", "minicpmo", _qwen2(151700, 3584, 18944, 28, 28, 4)), "HF config.json"),
    (r"mimo[-_]7b", "XiaomiMiMo/MiMo-7B-RL",
     _dense("MiMoForCausalLM", "mimo", 151680, 4096, 11008, 36, 32, 8, rope_theta=640000.0,
            num_nextn_predict_layers=1), "THUDM/slime scripts/models/mimo-7B-rl.sh"),
    (r"seed[-_]oss[-_]36b", "ByteDance-Seed/Seed-OSS-36B-Instruct",
     _dense("SeedOssForCausalLM", "seed_oss", 155136, 5120, 27648, 64, 80, 8, 128,
            max_pos=524288, rope_theta=10000000.0), "HF config.json"),
    (r"gpt[-_]oss[-_]20b", "openai/gpt-oss-20b",
     _dense("GptOssForCausalLM", "gpt_oss", 201088, 2880, 2880, 24, 64, 8, 64, max_pos=131072,
            rope_theta=150000.0, num_local_experts=32, num_experts_per_tok=4), "HF config.json"),
    (r"nemotron[-_a-z0-9.]*nano|nemotron[-_]3", "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
     _dense("NemotronHForCausalLM", "nemotron_h", 131072, 2688, 1856, 52, 32, 2, 128,
            max_pos=262144, n_routed_experts=128, num_experts_per_tok=6,
            moe_intermediate_size=1856, moe_shared_expert_intermediate_size=3712,
            hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"),
     "THUDM/slime scripts/models/nemotron-nano-30B-A3B.sh"),
    (r"hy3|hunyuan", "tencent/Hy3",
     _dense("HunYuanMoEV1ForCausalLM", "hunyuan_v1_moe", 128167, 4096, 3072, 32, 32, 8, 128,
            max_pos=32768, num_experts=64, moe_topk=8),
     "approx: Hy3 not found; Hunyuan-A13B's architecture"),
]
FALLBACK = ("Qwen/Qwen2.5-0.5B-Instruct", Q25["0.5B"], "unknown model: Qwen2.5-0.5B's config")
# verl's default actor_rollout_ref.model.path, created in every sandbox HOME.
VERL_DEFAULT_MODEL = "~/models/deepseek-llm-7b-chat"


def model_for(value: str):
    low = value.lower()
    for pattern, hf_id, cfg, src in MODELS:
        if re.search(pattern, low):
            return hf_id, cfg, src
    return FALLBACK


# ----------------------------------------------------------------------------------------------
# Data: which datasets are multimodal, and their data_source.
# ----------------------------------------------------------------------------------------------
IMAGE_DATASETS = r"geo3k|geometry3k|pokemon|openr1mm|openr1[-_]mm|clevr|mathvista|chartqa|image|vision|[-_/]vl[-_/]|mm[-_]?eureka"
VIDEO_DATASETS = r"video"
TEXT_DATASETS = r"gsm8k|[/_-]math|dapo|aime|hh[-_]rlhf|rlhf|searchr1|search[-_]r1|multiturn|deepscaler|countdown|polaris|eurus"
# A script is a vision-language one when its file name says so.
VL_SCRIPT = r"(^|[-_.])(vl|video|mm|minicpmo\d*|minicpm[-_]o|glm4[-_]?1v|glm41v|vlm|geo3k)([-_.]|$)"
DATA_SOURCES = [
    (r"gsm8k", "openai/gsm8k"),
    (r"geo3k|geometry3k", "hiyouga/geometry3k"),
    (r"dapo|aime", "math_dapo"),
    (r"(^|[/_-])math([/_.-]|$)", "DigitalLearningGmbH/MATH-lighteval"),
]


# Runs under the interpreter that has pyarrow: rewrites verl-format rows (kind, columns).
DATA_HELPER = r'''
import json, struct, sys, zlib
import pyarrow as pa, pyarrow.parquet as pq
src, dst, kind, prompt_key, reward_key, source = sys.argv[1:7]
rows = pq.read_table(src).to_pylist()
def png():
    raw = b"".join(b"\x00" + b"\xff\x00\x00" * 2 for _ in range(2))
    def chunk(t, d):
        c = t + d
        return struct.pack(">I", len(d)) + c + struct.pack(">I", zlib.crc32(c) & 0xffffffff)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 2, 2, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
image = png()
for r in rows:
    r["data_source"] = source
    if kind == "images":
        r["prompt"] = [dict(m, content="<image>" + m["content"]) if m["role"] == "user" else m for m in r["prompt"]]
        r["images"] = [{"bytes": image, "path": None}]
    elif kind == "videos":
        r["prompt"] = [dict(m, content="<video>" + m["content"]) if m["role"] == "user" else m for m in r["prompt"]]
        r["videos"] = [{"video": "file:///replay/clip.mp4", "nframes": 4}]
    if prompt_key != "prompt":
        r[prompt_key] = r["prompt"]
    if reward_key != "data_source":
        r[reward_key] = source
if dst.endswith((".jsonl", ".json")):
    with open(dst, "w") as f:
        for r in rows:
            if "images" in r:
                r["images"] = [{"bytes": None, "path": "replay.png"}]
            f.write(json.dumps(r) + "\n")
else:
    pq.write_table(pa.Table.from_pylist(rows), dst)
'''

# ----------------------------------------------------------------------------------------------
# The shim: one Python program behind every shimmed command name.
# ----------------------------------------------------------------------------------------------
SHIM_NAMES = ["python3", "python", "python3.10", "python3.11", "python3.12", "uv", "ray", "torchrun",
              "srun", "scontrol", "sbatch", "nvidia-smi", "npu-smi", "huggingface-cli", "hf",
              "modelscope", "pip", "pip3", "sleep", "conda"]

SHIM = r'''
import json, os, re, subprocess, sys, time
CONF = json.load(open(sys.argv[1]))
NAME = sys.argv[2]
ARGS = sys.argv[3:]
LOG = CONF["log"]

def record(action, **kw):
    entry = {"t": time.time(), "cmd": NAME, "argv": ARGS, "cwd": os.getcwd(), "action": action}
    entry.update(kw)
    with open(LOG, "a") as f:
        f.write(json.dumps(entry) + "\n")

def fail(msg, code=97):
    record("refused by shim", message=msg)
    sys.stderr.write("replay shim: " + msg + "\n")
    sys.exit(code)

def exec_cmd(cmd):
    """Run a command line again through PATH (so shims apply)."""
    if not cmd:
        fail(f"{NAME}: no command to run")
    record("exec", target=cmd)
    os.execvp(cmd[0], cmd)

MODEL_KEY = re.compile(r"(^|\.)(model\.path|model_path|tokenizer_path|input_tokenizer|hf_config_path)$|^data\.tokenizer$")
DATA_KEY = re.compile(r"^data\.(train_files|val_files)$")

def split_list(v):
    v = v.strip()
    if v.startswith("[") and v.endswith("]"):
        items, cur, q = [], "", None
        for ch in v[1:-1]:
            if q:
                if ch == q:
                    q = None
                else:
                    cur += ch
            elif ch in "'\"":
                q = ch
            elif ch == ",":
                items.append(cur.strip()); cur = ""
            else:
                cur += ch
        if cur.strip():
            items.append(cur.strip())
        return items, True
    if len(v) >= 2 and v[0] == v[-1] and v[0] in "'\"":
        v = v[1:-1]
    return [v], False

def under(p, root):
    p, root = os.path.abspath(p), os.path.abspath(root)
    return p == root or p.startswith(root.rstrip("/") + "/")

def local_path(p):
    """Where a path the script names lives in the sandbox: itself when inside, else rewritten."""
    home = CONF["home"]
    if p.startswith("~/"):
        p = os.path.join(home, p[2:])
    ap = os.path.abspath(p)
    if under(ap, CONF["sandbox"]):
        return ap, False
    return os.path.join(CONF["sandbox"], "ext", ap.lstrip("/")), True

def for_match(p):
    """What a path says about its model/dataset: without the sandbox's own folders (named after the script)."""
    for root in (CONF["home"], os.path.join(CONF["sandbox"], "work"), CONF["sandbox"]):
        if under(p, root):
            return os.path.relpath(os.path.abspath(p), root)
    return p

def ensure_data(p, settings):
    path, rewritten = local_path(p)
    created = None
    if not os.path.exists(path) and re.search(r"\.(parquet|jsonl|json)$", path):
        kind = data_kind(p)
        split = "val" if re.search(r"test|val|eval|aime", os.path.basename(p).lower()) else "train"
        os.makedirs(os.path.dirname(path), exist_ok=True)
        prompt_key = settings.get("data.prompt_key", "prompt")
        reward_key = settings.get("data.reward_fn_key", "data_source")
        source = data_source_for(p)
        base = os.path.join(CONF["cache"], f"{split}.parquet")
        if kind == "text" and prompt_key == "prompt" and reward_key == "data_source" and source == "openai/gsm8k" and path.endswith(".parquet"):
            import shutil
            shutil.copyfile(base, path)
        else:
            r = subprocess.run([CONF["data_python"], "-c", CONF["data_helper"], base, path, kind, prompt_key, reward_key, source],
                               capture_output=True, text=True)
            if r.returncode != 0:
                fail(f"could not write {path}: {r.stderr.strip().splitlines()[-1:]}")
        created = {"path": path, "kind": kind, "split": split, "data_source": source}
    return path, rewritten, created

def data_kind(p):
    low = for_match(p).lower()
    for kind, pat in (("videos", CONF["video_re"]), ("images", CONF["image_re"])):
        if re.search(pat, low):
            return kind
    if re.search(CONF["text_re"], low):
        return "text"
    return CONF["script_kind"]

def data_source_for(p):
    for pat, source in CONF["data_sources"]:
        if re.search(pat, for_match(p).lower()):
            return source
    return "openai/gsm8k"

def ensure_model(value):
    for pat, hf_id, cfg, src in CONF["models"]:
        if re.search(pat, for_match(value).lower()):
            break
    else:
        if "/" not in value:
            return None  # neither an HF id nor a path (e.g. a missing `$`): left as the script wrote it
        hf_id, cfg, src = CONF["fallback"]
    # Named after the HF id the script gives (org/name), else after the table's id.
    table_id = hf_id
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", value.strip()):
        hf_id = value.strip()
    folder = os.path.join(CONF["home"], "hf", hf_id)
    if not os.path.isdir(folder):
        os.makedirs(folder)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            with open(os.path.join(CONF["tokenizer"], name), "rb") as s, open(os.path.join(folder, name), "wb") as d:
                d.write(s.read())
    return folder, hf_id, cfg["architectures"][0], src, table_id

def main_ppo(args, how):
    """verl.trainer.main_ppo ARGS -> verl run --dry-run ARGS (model/data paths made local)."""
    out, notes, i = [], [], 0
    settings = {}
    for a in args:
        if "=" in a and not a.startswith("-"):
            k, v = a.split("=", 1)
            settings[k.lstrip("+~")] = v
    while i < len(args):
        a = args[i]
        if a in ("--config-path", "--config-name", "-cp", "-cn"):
            flag = {"-cp": "--config-path", "-cn": "--config-name"}.get(a, a)
            if i + 1 < len(args):
                out.append(f"{flag}={args[i + 1]}"); i += 2; continue
        if a.startswith(("--config-path=", "--config-name=", "-cp=", "-cn=")):
            k, v = a.split("=", 1)
            out.append({"-cp": "--config-path", "-cn": "--config-name"}.get(k, k) + "=" + v); i += 1; continue
        if "=" in a and not a.startswith("-"):
            k, v = a.split("=", 1)
            key = k.lstrip("+~")
            if MODEL_KEY.search(key) and v.strip() not in ("", "null", "None", "~") and "lora" not in key and "adapter" not in key:
                items, _ = split_list(v)
                made = ensure_model(items[0])
                if made is None:
                    notes.append({"key": key, "from": v, "left": True})
                    out.append(a); i += 1; continue
                folder, hf_id, arch, src, table_id = made
                notes.append({"key": key, "from": v, "to": folder, "hf_id": hf_id, "arch": arch, "src": src,
                              "config_of": table_id})
                out.append(f"{k}={folder}"); i += 1; continue
            if DATA_KEY.search(key) and v.strip() not in ("", "null", "None"):
                items, is_list = split_list(v)
                new = []
                for p in items:
                    path, rewritten, created = ensure_data(p, settings)
                    new.append(path)
                    notes.append({"key": key, "from": p, "to": path, "rewritten": rewritten, "created": created})
                nv = "[" + ", ".join("'" + p + "'" for p in new) + "]" if is_list else new[0]
                out.append(f"{k}={nv}"); i += 1; continue
        out.append(a); i += 1
    # verl's defaults name these; a job that leaves them alone reads them.
    if not any(k in settings for k in ("data.train_files",)) or not any(k in settings for k in ("data.val_files",)):
        for default in ("~/data/rlhf/gsm8k/train.parquet", "~/data/rlhf/math/test.parquet"):
            ensure_data(default, settings)
    cmd = [CONF["verl_bin"], "run", "--dry-run"] + out
    env = dict(os.environ)
    env["VERL_PYTHON"] = CONF["verl_python"]
    start = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    record("verl", how=how, verl_argv=cmd[1:], rc=p.returncode, seconds=round(time.time() - start, 2),
           stdout=p.stdout, stderr=p.stderr, rewrites=notes)
    sys.stdout.write(p.stdout)
    sys.stderr.write(p.stderr)
    sys.exit(p.returncode)

def python(args):
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] not in ("-m", "-c"):
        i += 2 if args[i] in ("-X", "-W") else 1
    rest = args[i:]
    if not rest:
        fail(f"{NAME} {' '.join(args)}: an interactive interpreter")
    if rest[0] == "-m":
        mod = rest[1] if len(rest) > 1 else ""
        if mod == "verl.trainer.main_ppo":
            main_ppo(rest[2:], NAME)
        where = os.path.join(CONF["checkout"], *mod.split(".")) + ".py"
        if mod.startswith("verl.") and not os.path.exists(where):
            fail(f"{NAME} -m {mod}: this verl checkout has no such module (a stale example: verl fails too)")
        fail(f"{NAME} -m {mod}: only verl.trainer.main_ppo is replayed")
    if rest[0] == "-c":
        code = rest[1] if len(rest) > 1 else ""
        if "torch_npu" in code:
            record("no NPU", code=code)
            sys.stderr.write("ModuleNotFoundError: No module named 'torch_npu' (replay shim: no NPU)\n")
            sys.exit(1)
        record("real python -c", code=code)
        os.execv(CONF["verl_python"], [CONF["verl_python"], "-c", code] + rest[2:])
    script = rest[0]
    if re.search(r"data_preprocess/", script):
        record("skipped: data preprocessing (the shim writes the data files main_ppo names)")
        sys.exit(0)
    if re.search(r"(converter_hf_to_mcore|get_model|model_merger|download)", script):
        record("skipped: model download/conversion (the shim writes the model folders main_ppo names)")
        sys.exit(0)
    fail(f"{NAME} {script}: a Python program other than verl.trainer.main_ppo is not replayed")

def uv(args):
    if not args or args[0] != "run":
        record(f"skipped: uv {' '.join(args[:2])}")
        sys.exit(0)
    takes_value = {"--extra", "--with", "--with-requirements", "--with-editable", "--python", "-p", "--project",
                   "--directory", "--package", "--group", "--only-group", "--no-group", "--env-file", "--index",
                   "--index-url", "--extra-index-url", "--cache-dir", "--config-file", "--no-extra"}
    i = 1
    while i < len(args) and args[i].startswith("-"):
        if args[i] == "--":
            i += 1; break
        i += 2 if args[i] in takes_value else 1
    exec_cmd(args[i:])

def ray(args):
    if args[:2] == ["job", "submit"]:
        if "--" in args:
            exec_cmd(args[args.index("--") + 1:])
        fail("ray job submit without `--`")
    if args and args[0] in ("start", "stop", "status", "list"):
        record(f"skipped: ray {args[0]} (no Ray cluster; verl-rs does not use Ray)")
        sys.exit(0)
    fail(f"ray {' '.join(args[:2])}")

def torchrun(args):
    if "-m" in args:
        i = args.index("-m")
        if args[i + 1:i + 2] == ["verl.trainer.main_ppo"]:
            main_ppo(args[i + 2:], "torchrun")
    fail("torchrun of something other than verl.trainer.main_ppo")

def srun(args):
    takes_value = {"-w", "-N", "-n", "-c", "-p", "-t", "-J", "-o", "-e", "-A", "--nodelist", "--nodes", "--ntasks"}
    i = 0
    while i < len(args) and args[i].startswith("-"):
        i += 2 if args[i] in takes_value else 1
    exec_cmd(args[i:])

if NAME.startswith("python"):
    python(ARGS)
elif NAME == "uv":
    uv(ARGS)
elif NAME == "ray":
    ray(ARGS)
elif NAME == "torchrun":
    torchrun(ARGS)
elif NAME == "srun":
    srun(ARGS)
elif NAME == "scontrol":
    record("fake: scontrol (one node, replay-node-0)")
    if ARGS[:2] == ["show", "hostnames"]:
        print("replay-node-0")
    sys.exit(0)
elif NAME == "sleep":
    record("skipped: sleep")
    sys.exit(0)
elif NAME in ("nvidia-smi", "npu-smi"):
    record(f"skipped: {NAME} (no GPUs here; exit 0, no output)")
    sys.exit(0)
else:
    record(f"skipped: {NAME} {' '.join(ARGS[:1])}")
    sys.exit(0)
'''


def placeholder(var: str, home: Path, script: Path) -> str:
    """A value for a variable a script requires and gives no default."""
    known = {"INFER_BACKEND": "vllm", "ROLLOUT_BACKEND": "vllm", "DEVICE": "gpu", "BACKEND": "vllm"}
    if var in known:
        return known[var]
    if var.endswith("MODEL_PATH") and "LORA" not in var:
        return str(home / "models" / script.stem)  # the script's name names its model
    if re.search(r"PATH|DIR|HOME|ROOT|FILE", var):
        return str(home / var.lower())
    return "replay"


def slurm_env(script: Path, work: Path) -> dict:
    """A script written for sbatch runs as sbatch would start it: SLURM_* from its #SBATCH lines."""
    opts = {}
    for line in script.read_text(errors="replace").splitlines():
        m = re.match(r"#SBATCH\s+--([a-z-]+)(?:[= ](\S+))?", line)
        if m:
            opts[m.group(1)] = m.group(2) or ""
    if not opts:
        return {}
    nodes = int(re.match(r"\d+", opts.get("nodes", "1")).group(0))
    env = {
        "SLURM_JOB_ID": "1", "SLURM_JOB_NAME": opts.get("job-name", script.stem),
        "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_NNODES": str(nodes),
        "SLURM_JOB_NODELIST": "replay-node-0" if nodes == 1 else f"replay-node-[0-{nodes - 1}]",
        "SLURM_SUBMIT_DIR": str(work), "SLURM_NTASKS_PER_NODE": opts.get("ntasks-per-node", "1"),
    }
    if "cpus-per-task" in opts:
        env["SLURM_CPUS_PER_TASK"] = opts["cpus-per-task"]
    if "gpus-per-node" in opts:  # SLURM sets it for --gpus-per-node only, not for --gres
        env["SLURM_GPUS_PER_NODE"] = opts["gpus-per-node"]
    return env


def verl_config_keys(checkout: Path) -> set:
    """Every key of verl's flattened trainer configs (verl/trainer/config/_generated_ppo_*trainer.yaml)."""
    keys = set()
    for f in sorted((checkout / "verl" / "trainer" / "config").glob("_generated_ppo*_trainer.yaml")):
        stack = []
        for line in f.read_text().splitlines():
            m = re.match(r"^( *)([A-Za-z_][A-Za-z0-9_]*):", line)
            if not m or line.lstrip().startswith("#"):
                continue
            depth = len(m.group(1)) // 2
            stack = stack[:depth] + [m.group(2)]
            keys.add(".".join(stack))
    return keys


# ----------------------------------------------------------------------------------------------
# Discovery, sandbox, running
# ----------------------------------------------------------------------------------------------
LAUNCH_RE = re.compile(r"verl\.trainer\.main_ppo\w*|main_ppo\w*\.py")


def discover(checkout: Path):
    """Every examples/**/*.sh naming main_ppo, and the others (counted in the report)."""
    replay, others = [], []
    for sh in sorted((checkout / "examples").rglob("*.sh")):
        text = sh.read_text(errors="replace")
        code = "\n".join(l for l in text.splitlines() if not l.lstrip().startswith("#"))
        (replay if LAUNCH_RE.search(code) else others).append(sh)
    return replay, others


def isolation_works(scratch: Path) -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    d = Path(tempfile.mkdtemp(dir=scratch))
    for sub in ("upper", "work", "root"):
        (d / sub).mkdir()
    r = subprocess.run(["unshare", "-m", "sh", "-c",
                        f"mount -t overlay overlay -o lowerdir=/,upperdir={d}/upper,workdir={d}/work {d}/root"],
                       capture_output=True)
    shutil.rmtree(d, ignore_errors=True)
    return r.returncode == 0


class Replayer:
    def __init__(self, args, checkout: Path, label: str, scratch: Path):
        self.args = args
        self.checkout = checkout.resolve()
        self.label = label
        self.root = scratch
        self.verl_bin = str(Path(args.verl_bin).resolve())
        self.cache = self.root / "cache"
        self.cache.mkdir(parents=True, exist_ok=True)
        self.isolate = args.isolate_effective
        self._prepare_cache()
        self.shim_py = self.root / "shim.py"
        self.shim_py.write_text(SHIM)
        self.verl_keys = verl_config_keys(self.checkout)

    def _prepare_cache(self):
        """verl-format rows (verl data arith) and a tokenizer with a chat template (verl init-model)."""
        run = lambda cmd: subprocess.run(cmd, check=True, capture_output=True, text=True)
        arith = self.cache / "arith"
        run([self.verl_bin, "data", "arith", "--out", str(arith), "--train", "64", "--val", "16"])
        shutil.copyfile(arith / "train.parquet", self.cache / "train.parquet")
        shutil.copyfile(arith / "val.parquet", self.cache / "val.parquet")
        run([self.verl_bin, "init-model", "--out", str(self.cache / "tiny"), "--data",
             str(arith / "train.parquet")])

    def conf_for(self, sandbox: Path, home: Path, script_kind: str) -> dict:
        return {
            "log": str(sandbox / "shim.jsonl"), "sandbox": str(sandbox), "home": str(home),
            "cache": str(self.cache), "tokenizer": str(self.cache / "tiny"),
            "verl_bin": self.verl_bin, "verl_python": self.args.verl_python,
            "data_python": self.args.data_python, "data_helper": DATA_HELPER,
            "models": MODELS, "fallback": FALLBACK, "image_re": IMAGE_DATASETS,
            "video_re": VIDEO_DATASETS, "text_re": TEXT_DATASETS, "data_sources": DATA_SOURCES,
            "script_kind": script_kind, "checkout": str(self.checkout),
        }

    def run_script(self, idx: int, script: Path) -> dict:
        rel = script.relative_to(self.checkout)
        name = script.name
        sandbox = self.root / f"{idx:03d}-{name[:-3]}"
        home, work, bindir = sandbox / "home", sandbox / "work", sandbox / "bin"
        for d in (home, work, bindir):
            d.mkdir(parents=True)
        # The cwd: verl's checkout as links, so the script's own relative paths resolve and new
        # files land in the sandbox.
        for entry in self.checkout.iterdir():
            (work / entry.name).symlink_to(entry)
        kind = "videos" if "video" in name.lower() else ("images" if re.search(VL_SCRIPT, name.lower()) else "text")
        conf = self.conf_for(sandbox, home, kind)
        conf_path = sandbox / "shim.json"
        conf_path.write_text(json.dumps(conf))
        for n in SHIM_NAMES:
            w = bindir / n
            w.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(self.shim_py))} "
                         f"{shlex.quote(str(conf_path))} {n} \"$@\"\n")
            w.chmod(0o755)
        # verl's default model folder, read by jobs that never set actor_rollout_ref.model.path.
        default_model = home / "models" / "deepseek-llm-7b-chat"
        default_model.mkdir(parents=True)
        (default_model / "config.json").write_text(json.dumps(model_for("deepseek-llm-7b-chat")[1]))
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(self.cache / "tiny" / f, default_model / f)
        env = {
            "PATH": f"{bindir}:{os.environ.get('PATH', '/usr/bin:/bin')}",
            "HOME": str(home), "USER": os.environ.get("USER", "root"), "LANG": "C.UTF-8",
            "TERM": "dumb", "PWD": str(work), "TMPDIR": str(sandbox / "tmp"),
            # The loggers are checked offline: no credentials on a replay machine.
            "WANDB_MODE": "offline", "SWANLAB_MODE": "offline",
            "MLFLOW_TRACKING_URI": f"sqlite:///{home}/mlruns.db",
        }
        if os.environ.get("LD_LIBRARY_PATH"):
            env["LD_LIBRARY_PATH"] = os.environ["LD_LIBRARY_PATH"]
        sbatch = slurm_env(script, work)
        env.update(sbatch)
        env.update(self.args.env_extra)
        (sandbox / "tmp").mkdir()
        script_path = work / rel
        # Limits this machine will not raise (ulimit -n 65535 ...) are recorded, not fatal.
        bash_env = sandbox / "bash_env.sh"
        bash_env.write_text(
            "ulimit() { builtin ulimit \"$@\" 2>/dev/null || printf "
            "'{\"cmd\": \"ulimit\", \"argv\": [], \"action\": \"skipped: ulimit %s (not permitted here)\"}\\n' "
            f"\"$*\" >> {shlex.quote(str(sandbox / 'shim.jsonl'))}; return 0; }}\n"
            # The Ascend toolkit's environment script (NPU machines only) is recorded, not sourced.
            "source() { case \"$1\" in */Ascend/*|*/ascend-toolkit/*|*/nnal/*) [ -e \"$1\" ] || { printf "
            "'{\"cmd\": \"source\", \"argv\": [], \"action\": \"skipped: source %s (Ascend toolkit, NPU only)\"}\\n' "
            f"\"$1\" >> {shlex.quote(str(sandbox / 'shim.jsonl'))}; return 0; }};; esac; builtin source \"$@\"; }}\n")
        env["BASH_ENV"] = str(bash_env)
        placeholders = {}
        for _attempt in range(4):
            proc, out, err, timed_out, iso, start = self._launch(idx, sandbox, work, script_path, env)
            log = self._log(sandbox)
            if any(e.get("action") == "verl" for e in log) or timed_out:
                break
            # A variable the script needs and gives no default: set a placeholder, run again.
            m = re.search(r"line \d+: ([A-Za-z_][A-Za-z0-9_]*): (unbound variable|.*(set|must).*)$",
                          err.decode(errors="replace"), re.M)
            if not m or m.group(1) in env:
                break
            var = m.group(1)
            env[var] = placeholders[var] = placeholder(var, home, script)
            if iso is not None:
                subprocess.run(["rm", "-rf", str(iso)])
            (sandbox / "shim.jsonl").unlink(missing_ok=True)
        seconds = time.time() - start
        outside = []
        if iso is not None:
            outside = sorted(self._written(iso / "upper"))
            subprocess.run(["rm", "-rf", str(iso)])
        result = {
            "script": str(rel), "rc": proc.returncode, "timed_out": timed_out,
            "seconds": round(seconds, 1), "stdout": out.decode(errors="replace"),
            "stderr": err.decode(errors="replace"), "log": log, "outside": outside,
            "placeholders": placeholders, "sbatch": bool(sbatch),
        }
        result.update(classify(result, self.verl_keys))
        if not self.args.keep:
            shutil.rmtree(sandbox, ignore_errors=True)
        return result

    @staticmethod
    def _log(sandbox: Path):
        path = sandbox / "shim.jsonl"
        if not path.exists():
            return []
        return [json.loads(l) for l in path.read_text().splitlines() if l.strip()]

    def _launch(self, idx, sandbox, work, script_path, env):
        cmd = ["bash", str(script_path)]
        iso = None
        if self.isolate:
            iso = sandbox.parent / f".iso-{idx:03d}"
            for sub in ("upper", "work", "root"):
                (iso / sub).mkdir(parents=True)
            r = iso / "root"
            setup = (
                f"set -e; mount -t overlay overlay -o lowerdir=/,upperdir={iso}/upper,workdir={iso}/work {r}; "
                f"for d in /proc /sys /dev; do mount --rbind $d {r}$d; done; "
                f"mount --bind {sandbox} {r}{sandbox}; "
                f"exec chroot {r} sh -c 'cd \"$0\" && exec \"$@\"' {shlex.quote(str(work))} "
                + " ".join(shlex.quote(c) for c in cmd)
            )
            cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", setup]
        start = time.time()
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        timed_out = False
        try:
            out, err = proc.communicate(timeout=self.args.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        # Whatever the script left running in the background (its own children only).
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return proc, out, err, timed_out, iso, start

    @staticmethod
    def _written(upper: Path):
        """New paths the script wrote outside its sandbox (kept in the overlay, then discarded)."""
        found = []
        for dirpath, dirnames, filenames in os.walk(upper):
            rel = "/" + os.path.relpath(dirpath, upper) if dirpath != str(upper) else "/"
            keep = []
            for n in dirnames + filenames:
                real = os.path.join(rel, n)
                if real.startswith(("/tmp", "/proc", "/sys", "/dev", "/root/.cache")):
                    continue
                if not os.path.lexists(real):
                    found.append(real)
                elif n in dirnames:
                    keep.append(n)
            dirnames[:] = keep
        return found


# ----------------------------------------------------------------------------------------------
# Classification
# ----------------------------------------------------------------------------------------------
SECTIONS = ("actor_rollout_ref|critic|data|algorithm|trainer|reward_model|reward|custom_reward_function|"
            "ray_kwargs|global_profiler|model_engine|plugins|distillation|transfer_queue|reward_manager|"
            "sandbox_fusion|hydra")
KEY_RE = re.compile(r"(?<![\w/.-])\+*~?((?:%s)(?:\.[A-Za-z0-9_]+)+)" % SECTIONS)
UNKNOWN_RE = re.compile(r"there is no key|not in the schema|unknown key|is not a key")
# Errors the harness causes (it failed to point a path at a local file it made).
HARNESS_RE = re.compile(r"does not exist|is not a folder|reading .*config\.json|is not JSON|no files given|loading the tokenizer")
LOG_LINE = re.compile(r"^\S*\s*(\d{4}-\d\d-\d\dT\S+\s+)?(INFO|WARN|DEBUG|TRACE)\b")


def error_lines(stderr: str):
    lines = stderr.splitlines()
    for i, l in enumerate(lines):
        if l.startswith("error:"):
            return lines[i:]
    return []


def refusal_keys(errs):
    """The key each error line names, or None when a line names none (or there are no lines)."""
    if not errs:
        return None
    head = errs[0][len("error:"):].strip()
    m = re.match(r"(\d+) configuration errors:$", head)
    items = [l.strip()[2:] for l in errs[1:]] if m else [head] + errs[1:]
    if m and (len(items) != int(m.group(1)) or not all(l.startswith("  - ") for l in errs[1:])):
        return None
    if not m and len(errs) > 1:
        return None
    keys = []
    for item in items:
        if UNKNOWN_RE.search(item) or HARNESS_RE.search(item):
            return None
        km = KEY_RE.search(item)
        if not km:
            return None
        keys.append((km.group(1), item))
    return keys


def short_reason(item: str) -> str:
    """The part of a refusal that says what is asked for / why, without the echoed override."""
    text = re.sub(r"^(override `[^`]*`|config|[\w.]+): ", "", item)
    text = re.sub(r"^`[^`]*`:? ", "", text)
    m = re.search(r"asks for (.*?)(, which verl-rs does not do|;|$)", text)
    if m:
        return m.group(1)[:100]
    text = re.sub(r"(/tmp|/work)/\S*?/(home|work)/", "~/", text)
    return text[:120] + ("…" if len(text) > 120 else "")


def classify(r: dict, verl_keys=frozenset()) -> dict:
    verl = [e for e in r["log"] if e.get("action") == "verl"]
    other = [e for e in r["log"] if e.get("action") not in ("verl", "exec")]
    notes = []
    for e in other:
        what = e["action"]
        if what == "real python -c":
            what = f"ran `python -c {e.get('code', '')[:40]!r}`"
        elif what == "no NPU":
            what = "torch_npu probe failed (no NPU): DEVICE=gpu path"
        elif what == "refused by shim":
            what = f"shim: {e.get('message')}"
        notes.append(what)
    models, data = [], []
    for v in verl:
        for rw in v.get("rewrites", []):
            if "hf_id" in rw:
                src = rw["src"] if rw["src"].startswith(("approx", "unknown")) else ""
                cfg_of = rw.get("config_of", rw["hf_id"])
                shown = rw["from"] if rw["from"].rstrip("/").endswith(cfg_of) else f"{rw['from']} → {cfg_of}"
                models.append(f"{rw['key']}: {short_path(shown, r)} ({rw['arch']}{'; ' + src if src else ''})")
            elif rw.get("created") and (rw["created"]["kind"] != "text" or rw["rewritten"]):
                c = rw["created"]
                data.append(f"{short_path(rw['from'], r)}: {c['kind']}" + (" (relocated into the sandbox)" if rw["rewritten"] else ""))
    if r.get("sbatch"):
        notes.insert(0, "run as an sbatch job would be: SLURM_* from its #SBATCH lines")
    for var, value in r.get("placeholders", {}).items():
        notes.insert(0, f"harness set {var}={short_path(value, r)} (the script requires it, no default)")
    base = {"notes": dedupe(notes), "models": dedupe(models), "data": dedupe(data), "verl_runs": len(verl)}
    if r["timed_out"]:
        return dict(base, outcome="error", cause="timeout", detail=tail(r["stderr"] + r["stdout"]))
    if not verl:
        shim_fail = [e for e in other if e["action"] == "refused by shim"]
        cause = ("shim: " + shim_fail[0]["message"]) if shim_fail else "the script exited before launching main_ppo"
        return dict(base, outcome="error", cause=cause, detail=tail(r["stderr"]))
    outcomes = []
    for v in verl:
        if v["rc"] == 0:
            ign = [l.split("ignored", 1)[1].strip() for l in v["stdout"].splitlines() if l.startswith("  ignored")]
            bang = [l.strip()[2:] for l in v["stdout"].splitlines() if l.startswith("  ! ")]
            outcomes.append(("ok", ign, bang, v))
            continue
        errs = error_lines(v["stderr"])
        keys = refusal_keys(errs)
        bug = script_bug(v)
        if bug and not bug[1]:
            notes.append(bug[0].replace("script bug:", "also a script bug (not reached):"))
            base["notes"] = dedupe(notes)
        if keys is None or (bug and bug[1]):
            outcomes.append(("error", errs or v["stderr"].splitlines()[-6:], None, v))
        else:
            outcomes.append(("refused", keys, None, v))
    order = {"error": 0, "refused": 1, "ok": 2}
    worst = min(outcomes, key=lambda o: order[o[0]])
    kind, payload, bang, v = worst
    if kind == "ok":
        # What the run says only in its log (not as an `ignored` line) is worth reading too.
        logged = []
        for l in v["stderr"].splitlines():
            m = re.match(r"^\S+\s+(INFO|WARN)\s+(.*?)(\s+plugin=.*)?$", l)
            if m:
                logged.append(f"{m.group(1)}: {m.group(2)}")
        return dict(base, outcome="ok", ignored=payload, plan_warnings=bang, logged=dedupe(logged),
                    not_checked=[l.split("not checked", 1)[1].strip().split(":")[0]
                                 for l in v["stdout"].splitlines() if l.startswith("not checked")])
    if kind == "refused":
        return dict(base, outcome="refused", keys=[(k, short_reason(t)) for k, t in payload])
    text = "\n".join(payload)
    if UNKNOWN_RE.search(text):
        unknown = re.findall(r"there is no key `([^`]+)`|`([^`]+)` is not in the schema|unknown key `([^`]+)`", text)
        unknown = dedupe([a or b or c for a, b, c in unknown])
        verdict = [f"`{k}` ({'in' if k in verl_keys else 'not in'} verl's generated config)" for k in unknown]
        cause = "unknown key: " + ", ".join(verdict[:3]) + (f" and {len(verdict) - 3} more" if len(verdict) > 3 else "")
        return dict(base, outcome="error", cause=cause, detail=text[:3000], unknown=unknown)
    bad = script_bug(v)
    if bad and bad[1]:
        cause = bad[0]
    elif HARNESS_RE.search(text):
        cause = "harness: a file it should have made is missing"
    elif "panicked" in text or "SIGSEGV" in text or v["rc"] < 0:
        cause = "crash"
    elif len(payload) > 1:
        cause = "multi-line error"
    else:
        cause = "one-line error naming no config key"
    return dict(base, outcome="error", cause=cause, detail=text[:3000])


def script_bug(v: dict):
    """(cause, reached) for an argument the script itself gets wrong (verl fails on it too), or None.
    `reached`: the dry run's error is about it (else verl-rs stopped earlier, at a refusal)."""
    err = v.get("stderr", "")
    for a in v.get("verl_argv", []):
        if not a.strip():
            return ("script bug: a blank argument (a `\\ ` line continuation before a comment); verl gets it too",
                    "is neither a job file" in err)
    for rw in v.get("rewrites", []):
        if rw.get("left"):
            return (f"script bug: `{rw['key']}={rw['from']}` names no model (a missing `$`?); verl fails on it too",
                    rw["key"] in err)
    for a in v.get("verl_argv", []):
        k, _, val = a.partition("=")
        if k.lstrip("+") in ("data.train_files", "data.val_files") and val.strip() in ("", "[]", "['']"):
            return (f"script bug: `{k}` is empty (its variable is never set); verl fails on it too",
                    f"{k.lstrip('+')}:" in err)
    empty = re.findall(r"override `\+*([\w.]+)=`: .*found string \"\"", err)
    if empty:
        return f"script bug: `{empty[0]}=` is empty (its variable is never set); verl fails on it too", True
    return None


def short_path(p: str, r: dict) -> str:
    """A sandbox path as the script wrote it: `~/...` for its HOME."""
    m = re.search(r"/\d{3}-[^/]+/(home|work)/(.*)", p)
    if m:
        return ("~/" if m.group(1) == "home" else "") + m.group(2)
    return p


def dedupe(xs):
    seen, out = set(), []
    for x in xs:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out


def tail(text: str, n: int = 6) -> str:
    lines = [l for l in text.splitlines() if l.strip() and not l.startswith("+")]
    return "\n".join(lines[-n:])


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------
def md_escape(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def row_text(r: dict) -> tuple[str, str]:
    if r["outcome"] == "ok":
        shown = []
        for w in r["ignored"]:
            kv = w.split("` is ignored")[0].strip("`")
            shown.append(f"`{kv[:60]}{'…' if len(kv) > 60 else ''}`")
        what = f"{len(shown)} ignored" + (": " + ", ".join(shown) if shown else "")
    elif r["outcome"] == "refused":
        # Keys grouped by what they ask for, the shared prefix of a group said once.
        groups = {}
        for k, reason in r["keys"]:
            groups.setdefault(reason[:70] + ("…" if len(reason) > 70 else ""), []).append(k)
        def keys(ks):
            shown = ", ".join(f"`{k}`" for k in ks[:3])
            return shown + (f" and {len(ks) - 3} more" if len(ks) > 3 else "")
        what = "; ".join(f"{keys(ks)} ({reason})" for reason, ks in groups.items())
    else:
        first = r.get("detail", "").splitlines()[:1]
        what = r["cause"] + (f" — `{first[0][:160]}`" if first and not r["cause"].startswith("script bug")
                             and not r["cause"].startswith("unknown key") else "")
    notes = r["models"][:3] + r["data"][:2]
    notes += [f"log {l}" for l in r.get("logged", [])] + [f"plan: {w}" for w in r.get("plan_warnings") or []]
    multi = [n for n in dedupe(r.get("not_checked", [])) if n != "GPUs"]
    if multi:
        notes.append("not checked: " + ", ".join(multi) + " (multi-node)")
    notes += r["notes"][:5]
    if r.get("outside"):
        notes.append("wrote outside the sandbox (discarded): " + ", ".join(r["outside"][:4]))
    return md_escape(what), md_escape("; ".join(notes))


def report(versions, args, started) -> str:
    shown, skip = [], False
    for a in args.argv:  # the regenerating command, without the options that only add outputs
        if skip:
            skip = False
        elif a in ("--json", "--keep") or a.startswith("--json="):
            skip = a == "--json"
        else:
            shown.append(a)
    cmd = " ".join(shlex.quote(a) for a in shown)
    out = [
        "# verl's example scripts replayed against `verl run --dry-run`",
        "",
        f"Generated {started:%Y-%m-%d} by `scripts/replay_verl_examples.py` with `{args.verl_bin}` "
        f"({args.verl_version}; {args.verl_build}); regenerate with:",
        "",
        "```sh",
        "source scripts/env.sh",
        f"python3 scripts/replay_verl_examples.py {cmd}",
        "```",
        "",
        "Each `examples/**/*.sh` that launches `verl.trainer.main_ppo` runs with `bash` on a machine "
        "without GPUs, `python3 -m verl.trainer.main_ppo ARGS` (also through `uv run`, `ray job submit --`, "
        "`srun`) replaced by `verl run --dry-run ARGS`. Model paths point at folders named after the HF id "
        "holding the model's real config.json (architecture, heads, KV heads, layers, experts, vocab; "
        "table in the script) and a tiny tokenizer; data files are verl-format rows from `verl data arith`, "
        "with an `images` (or `videos`) column for image/video datasets and VL scripts. GPU counts, nodes and "
        "the scripts' own defaults (INFER_BACKEND, ...) stay as the scripts set them, so every dry run lists "
        "`not checked GPUs` (multi-node jobs also `not checked launch`); loggers are checked "
        "with WANDB_MODE=offline / SWANLAB_MODE=offline. A variable a script requires without a default gets "
        "a placeholder, an sbatch script gets the SLURM_* its #SBATCH lines ask for; both are said in the row. "
        f"Timeout {args.timeout:g} s per script{'; each script ran in its own mount namespace over an overlay of /, so what it wrote outside its sandbox was discarded' if args.isolate_effective else ''}.",
        "",
        "Outcomes: **ok** exit 0 (the `ignored` warnings listed); **refused** exit ≠ 0 and every error line "
        "is one line naming the key; **error** anything else (cause given).",
        "",
    ]
    out += ["| verl | commit | scripts | ok | refused | error |", "|---|---|---|---|---|---|"]
    for v in versions:
        c = {k: sum(1 for r in v["results"] if r["outcome"] == k) for k in ("ok", "refused", "error")}
        out.append(f"| {v['label']} | `{v['commit'][:12]}` | {len(v['results'])} | {c['ok']} | {c['refused']} | {c['error']} |")
    out.append("")
    for v in versions:
        results = v["results"]
        counts = {k: sum(1 for r in results if r["outcome"] == k) for k in ("ok", "refused", "error")}
        out += [
            f"## {v['label']}",
            "",
            f"verl commit `{v['commit']}`; {len(results)} scripts replayed: **{counts['ok']} ok, "
            f"{counts['refused']} refused, {counts['error']} error**. "
            f"{len(v['others'])} other .sh files launch something else (SFT, generation, fully-async, ...) "
            "and are not replayed.",
            "",
            "| script | outcome | keys refused / warnings / error | note |",
            "|---|---|---|---|",
        ]
        for r in results:
            what, note = row_text(r)
            out.append(f"| `{r['script']}` | {r['outcome']} | {what} | {note} |")
        out.append("")
        errors = [r for r in results if r["outcome"] == "error"]
        if errors:
            out += [f"### Errors ({v['label']})", ""]
            for r in errors:
                out.append(f"- `{r['script']}` — {r['cause']}:")
                out.append("")
                out.append("  ```")
                for l in (r.get("detail") or "").splitlines()[:6]:
                    out.append("  " + l[:300] + ("…" if len(l) > 300 else ""))
                out.append("  ```")
            out.append("")
    out += ["## Model configs", "",
            "config.json values the model folders get (the first row matching the script's model path). "
            "`HF config.json`: the values of the model's published config.json (Seed-OSS, DeepSeek-V3, Qwen3-30B-A3B "
            "and Qwen3-235B-A22B checked against copies on GitHub); `THUDM/slime ...`: that repository's Megatron "
            "model arguments; `approx`: the model's own config.json was not found and the closest family member's "
            "numbers are used. verl-rs builds llama, mistral, qwen2, qwen3, mixtral, qwen2_moe and qwen3_moe; the "
            "other architectures are kept as they are, so a refusal of them is the honest outcome.",
            "",
            "| HF id | architecture | hidden | layers | heads / KV | experts (top-k) | vocab | source |",
            "|---|---|---|---|---|---|---|---|"]
    seen = set()
    for _, hf_id, c, src in MODELS:
        if hf_id in seen:
            continue
        seen.add(hf_id)
        experts = c.get("num_experts") or c.get("n_routed_experts") or c.get("num_local_experts")
        topk = c.get("num_experts_per_tok") or c.get("moe_topk")
        out.append(f"| {hf_id} | {c['architectures'][0]} | {c['hidden_size']} | {c['num_hidden_layers']} | "
                   f"{c['num_attention_heads']} / {c['num_key_value_heads']} | "
                   f"{f'{experts} ({topk})' if experts else '-'} | {c['vocab_size']} | {src} |")
    out.append("")
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------
def build_info(binary: Path) -> str:
    """The verl-rs commit the binary's workspace is at, whether its tree had changes, the build time."""
    binary = binary.resolve()
    built = datetime.datetime.fromtimestamp(binary.stat().st_mtime, datetime.timezone.utc)
    repo = next((p for p in binary.parents if (p / ".git").exists()), None)
    info = f"built {built:%Y-%m-%d %H:%M} UTC"
    if repo:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        info = f"verl-rs {head}{' with uncommitted changes' if dirty else ''}, {info}"
    return info


def git_commit(path: Path) -> str:
    r = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else "unknown"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verl-checkout", action="append", default=[], metavar="DIR[=LABEL]",
                    help="a directory holding verl's examples/ (repeatable)")
    ap.add_argument("--verl-git", action="append", default=[], metavar="REPO@REV",
                    help="a verl git repository and revision, extracted with git archive (repeatable)")
    ap.add_argument("--verl-bin", required=True, help="the verl binary (plugins next to it)")
    ap.add_argument("--out", required=True, help="the Markdown report")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per script")
    ap.add_argument("--only", default=None, help="regex: replay only matching script paths")
    ap.add_argument("--isolate", choices=["auto", "on", "off"], default="auto",
                    help="run each script over an overlay of / in its own mount namespace (root)")
    ap.add_argument("--keep", action="store_true", help="keep the sandboxes (printed at the end)")
    ap.add_argument("--json", default=None, help="also write the raw results as JSON")
    ap.add_argument("--verl-python", default=None,
                    help="the interpreter verl's logger sidecars and python -c use (default: python3 on PATH)")
    ap.add_argument("--data-python", default=None,
                    help="an interpreter with pyarrow, for image/video rows (default: --verl-python)")
    ap.add_argument("--env", action="append", default=[], metavar="K=V",
                    help="extra environment for every script (repeatable)")
    args = ap.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    args.env_extra = dict(e.split("=", 1) for e in args.env)
    if not args.verl_checkout and not args.verl_git:
        ap.error("give --verl-checkout or --verl-git")
    args.verl_python = args.verl_python or shutil.which("python3") or sys.executable
    args.data_python = args.data_python or args.verl_python
    if subprocess.run([args.data_python, "-c", "import pyarrow"], capture_output=True).returncode != 0:
        ap.error(f"{args.data_python} has no pyarrow (needed for image/video rows): pass --data-python")
    args.verl_version = subprocess.run([args.verl_bin, "--version"], capture_output=True,
                                       text=True).stdout.strip()
    args.verl_build = build_info(Path(args.verl_bin))
    started = datetime.datetime.now()
    scratch = Path(tempfile.mkdtemp(prefix="verl-replay-"))
    args.isolate_effective = {"on": True, "off": False}.get(args.isolate) if args.isolate != "auto" \
        else isolation_works(scratch)
    if args.isolate == "on" and not isolation_works(scratch):
        ap.error("--isolate on: unshare/overlayfs is not available (run as root)")
    targets = []
    for spec in args.verl_git:
        repo, _, rev = spec.rpartition("@")
        commit = subprocess.run(["git", "-C", repo, "rev-parse", f"{rev}^{{commit}}"], check=True,
                                capture_output=True, text=True).stdout.strip()
        dest = scratch / f"verl-{rev.replace('/', '_')}"
        dest.mkdir()
        archive = subprocess.Popen(["git", "-C", repo, "archive", commit], stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout, check=True)
        archive.wait()
        label = f"verl {rev}" if rev != "HEAD" else "verl current snapshot (HEAD)"
        targets.append((dest, label, commit))
    for spec in args.verl_checkout:
        d, _, label = spec.partition("=")
        targets.append((Path(d), label or f"verl checkout {d}", git_commit(Path(d))))
    versions = []
    for n, (checkout, label, commit) in enumerate(targets):
        replay, others = discover(checkout)
        if args.only:
            replay = [s for s in replay if re.search(args.only, str(s.relative_to(checkout)))]
        rp = Replayer(args, checkout, label, scratch / f"run-{n}")
        results = []
        for i, sh in enumerate(replay):
            r = rp.run_script(i, sh)
            results.append(r)
            print(f"[{label}] {i + 1}/{len(replay)} {r['script']}: {r['outcome']}"
                  f"{' (' + r['cause'][:100] + ')' if r['outcome'] == 'error' else ''} {r['seconds']}s",
                  file=sys.stderr, flush=True)
        versions.append({"label": label, "commit": commit, "results": results,
                         "others": [str(o.relative_to(checkout)) for o in others]})
    Path(args.out).write_text(report(versions, args, started))
    if args.json:
        Path(args.json).write_text(json.dumps(versions, indent=1, default=str))
    if args.keep:
        print(f"sandboxes kept in {scratch}", file=sys.stderr)
    else:
        shutil.rmtree(scratch, ignore_errors=True)
    for v in versions:
        c = {k: sum(1 for r in v["results"] if r["outcome"] == k) for k in ("ok", "refused", "error")}
        print(f"{v['label']}: {len(v['results'])} scripts, {c['ok']} ok, {c['refused']} refused, "
              f"{c['error']} error", file=sys.stderr)


if __name__ == "__main__":
    main()
