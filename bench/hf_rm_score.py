"""HF transformers scoring the reward-model batch of `verl bench grpo --rm-arch`, for a side-by-side.

    python bench/hf_rm_score.py --arch llama3-8b --rows 512 --len 768 --micro-batch 32 [--steps 2]

Builds `<arch>ForSequenceClassification` (num_labels 1) from the shapes of `trl_grpo.py`'s ARCHS,
random weights, bf16, sdpa attention, on the GPU, and scores `rows` random sequences of `len`
tokens in micro-batches of `micro-batch` rows under `torch.no_grad()`, the head read at the last
token: what verl's legacy FSDP reward-model worker does (without its CPU offload) and what verl-rs's
reward_model role does. The last step is reported (the first warms up), as one JSON line: seconds,
tokens/s, MFU against `--peak-tflops` (verl bench's measured peak), peak memory.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForSequenceClassification  # noqa: E402

from trl_grpo import ARCHS  # noqa: E402


def flops(shape, rows, length):
    h, L = shape["hidden_size"], shape["num_hidden_layers"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = h // heads
    a, kvd, i = heads * d, kv * d, shape["intermediate_size"]
    n = L * (h * a + 2 * h * kvd + a * h + 3 * h * i) + h  # decoder matmuls + the 1-output head
    return 2.0 * n * rows * length + 4.0 * L * a * length * length * rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="llama3-8b")
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--len", type=int, default=768)
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--peak-tflops", type=float, default=0.0)
    args = p.parse_args()
    dev = torch.device("cuda")
    shape = dict(ARCHS[args.arch])
    model_type = shape.pop("model_type")
    cfg = AutoConfig.for_model(model_type, num_labels=1, **shape)
    cfg.pad_token_id = shape["vocab_size"] - 1
    with torch.device(dev):
        try:
            model = AutoModelForSequenceClassification.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
        except TypeError:
            model = AutoModelForSequenceClassification.from_config(cfg, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval()
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, shape["vocab_size"] - 1, (args.rows, args.len), generator=g).to(dev)
    times = []
    for _ in range(args.steps):
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = []
        with torch.no_grad():
            for s in range(0, args.rows, args.micro_batch):
                out.append(model(input_ids=ids[s : s + args.micro_batch]).logits[:, 0].float())
        scores = torch.cat(out).cpu()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    assert scores.shape[0] == args.rows
    sec = times[-1]
    f = flops(ARCHS[args.arch], args.rows, args.len)
    res = {
        "system": "hf_transformers",
        "arch": args.arch,
        "rows": args.rows,
        "tokens": args.rows * args.len,
        "score_s": round(sec, 4),
        "tokens_per_s": round(args.rows * args.len / sec),
        "mfu": round(f / sec / (args.peak_tflops * 1e12), 4) if args.peak_tflops else None,
        "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "per_step": [round(t, 4) for t in times],
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
    }
    print(json.dumps(res))


if __name__ == "__main__":
    main()
