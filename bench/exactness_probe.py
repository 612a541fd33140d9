#!/usr/bin/env python3
"""How far apart are two equally valid bf16 computations of the same log-probs? (issue 8, exactness)

`verl bench grpo` reports `rollout_logprob_abs_diff_mean`: mean |rollout log-prob - training-forward log-prob| over
the response tokens of its warm-up step. This script measures the same quantity for HF transformers on the same
random-init architecture and workload, plus the gaps that each single change of kernel produces inside HF's own
training forward, so our number can be read against a floor:

  gen_vs_forward     log-probs recorded during `model.generate` (KV cache, one token per step) vs a forward over
                     the finished sequences (micro-batch --micro-batch); both take log_softmax of bf16 logits,
                     as HF does
  microbatch         the forward with micro-batch --micro-batch vs micro-batch --micro-batch // 2 (GEMM shapes)
  attn_math          the forward with sdpa's default kernel (flash) vs sdpa's math kernel
  attn_efficient     flash vs sdpa's memory-efficient kernel
  fp32_logits        logits rounded to bf16 (HF) vs the same hidden states times the LM head in fp32

Prints one JSON line per architecture on stdout (means and maxima of |delta|), progress on stderr.

  python3 bench/exactness_probe.py --arch qwen2.5-0.5b [--prompts 64 --n 8 --prompt-len 256 --response-len 512]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trl_grpo as ref  # noqa: E402  (shapes, model and prompt builders; imports torch/transformers only)

import torch  # noqa: E402
import transformers  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402


class Recorder(transformers.LogitsProcessor):
    """Keeps log_softmax of the previous step's scores and, at each step, picks the log-prob of the token that
    step sampled (the last column of input_ids). The last token's log-prob is picked by `finish`."""

    def __init__(self):
        self.prev = None
        self.picked = []

    def __call__(self, input_ids, scores):
        if self.prev is not None:
            self.picked.append(self.prev.gather(1, input_ids[:, -1:]))
        self.prev = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, seqs: torch.Tensor) -> torch.Tensor:
        self.picked.append(self.prev.gather(1, seqs[:, -1:]))
        out = torch.cat(self.picked, dim=1)
        self.prev, self.picked = None, []
        return out


def forward_logprobs(model, seqs, resp_len, mb, fp32_head=False):
    out = []
    with torch.no_grad():
        for i in range(0, seqs.shape[0], mb):
            ids = seqs[i:i + mb]
            hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[:, -resp_len - 1:-1]
            w = model.lm_head.weight
            logits = hidden.float() @ w.float().t() if fp32_head else (hidden @ w.t()).float()
            targets = ids[:, -resp_len:]
            picked = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1)
            out.append(picked - torch.logsumexp(logits, dim=-1))
    return torch.cat(out)


def gap(a, b):
    if a is None or b is None:
        return None
    d = (a - b).abs()
    return {"mean": d.mean().item(), "max": d.max().item()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen2.5-0.5b", choices=sorted(ref.ARCHS))
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--response-len", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()

    device = torch.device(args.device)
    vocab = ref.ARCHS[args.arch]["vocab_size"]
    eos_id = vocab - 1
    torch.manual_seed(args.seed)
    model = ref.build_model(args.arch, device, torch.bfloat16, eos_id).eval()
    prompts = ref.random_prompt_ids(args.prompts, args.prompt_len, vocab, args.seed).repeat_interleave(args.n, 0)
    prompts = prompts.to(device)
    rec = Recorder()
    gen_cfg = transformers.GenerationConfig(
        do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=args.response_len,
        min_new_tokens=args.response_len, eos_token_id=eos_id, pad_token_id=eos_id, bos_token_id=None,
        use_cache=True, disable_compile=True)
    ref.log(f"{args.arch}: generate {prompts.shape[0]} x {args.response_len}")
    with torch.no_grad():
        seqs = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), generation_config=gen_cfg,
                              logits_processor=transformers.LogitsProcessorList([rec]))
    r = args.response_len
    if seqs.shape[1] != args.prompt_len + r:
        raise SystemExit(f"generate returned {seqs.shape[1] - args.prompt_len} response tokens, expected {r}")
    gen_lp = rec.finish(seqs)

    ref.log("forwards")
    mb = args.micro_batch
    base = forward_logprobs(model, seqs, r, mb)
    half = forward_logprobs(model, seqs, r, max(1, mb // 2))

    def with_backend(backend):
        try:
            with sdpa_kernel(backend):
                return forward_logprobs(model, seqs, r, mb)
        except RuntimeError as e:  # e.g. no memory-efficient kernel on the CPU
            ref.log(f"{backend}: {e}")
            return None

    math = with_backend(SDPBackend.MATH)
    eff = with_backend(SDPBackend.EFFICIENT_ATTENTION)
    fp32 = forward_logprobs(model, seqs, r, mb, fp32_head=True)
    out = {
        "arch": args.arch, "system": "hf-transformers", "dtype": "bf16",
        "workload": {k: getattr(args, k) for k in ("prompts", "n", "prompt_len", "response_len", "micro_batch")},
        "gen_vs_forward": gap(gen_lp, base),
        "microbatch": gap(base, half),
        "attn_math": gap(base, math),
        "attn_efficient": gap(base, eff),
        "fp32_logits": gap(base, fp32),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
