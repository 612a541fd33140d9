"""Probe: can libtorch's cuDNN variable-length attention replace flash attention in the training passes?

    python3 bench/cudnn_varlen_probe.py        (CUDA, torch only)

Builds the prefix grouper's layout for one 16-row micro-batch (Qwen2.5-1.5B heads: 12 query / 2 kv heads,
head_dim 128; groups of 8 samples sharing a 256-token prompt, 512-token responses: a group's first sample
queries prompt + response, the others their response only, every sample's keys are prompt + response, so
queries are shorter than keys and the causal mask must be aligned bottom-right), checks flash attention's and
cuDNN's (`_cudnn_attention_forward` with cumulative lengths) outputs against an fp32 reference and times the
forward and backward of each. See bench/README.md (2026-11-28, session 26) for what it printed on an H200.
"""

import sys
import time

import torch

HEADS, KV_HEADS, HEAD_DIM = 12, 2, 128
PROMPT, RESPONSE, GROUP, SAMPLES = 256, 512, 8, 16


def timed_us(fn, iters=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def main():
    if not torch.cuda.is_available():
        sys.exit("cudnn_varlen_probe: needs a CUDA device")
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    q_lens = [PROMPT + RESPONSE if s % GROUP == 0 else RESPONSE for s in range(SAMPLES)]
    k_lens = [PROMPT + RESPONSE] * SAMPLES
    cu_q = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32).to(dev)
    cu_k = torch.tensor([0] + k_lens).cumsum(0).to(torch.int32).to(dev)
    max_q, max_k = max(q_lens), max(k_lens)
    scale = HEAD_DIM**-0.5
    q = torch.randn(sum(q_lens), HEADS, HEAD_DIM, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(sum(k_lens), KV_HEADS, HEAD_DIM, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(sum(k_lens), KV_HEADS, HEAD_DIM, device=dev, dtype=dt, requires_grad=True)
    groups = HEADS // KV_HEADS

    def reference():
        """fp32 attention per sample, queries aligned to the end of the keys (bottom-right)."""
        outs = []
        for s in range(SAMPLES):
            qs = q[cu_q[s] : cu_q[s + 1]].float().transpose(0, 1)
            ks = k[cu_k[s] : cu_k[s + 1]].float().repeat_interleave(groups, 1).transpose(0, 1)
            vs = v[cu_k[s] : cu_k[s + 1]].float().repeat_interleave(groups, 1).transpose(0, 1)
            lq, lk = qs.shape[1], ks.shape[1]
            scores = qs @ ks.transpose(1, 2) * scale
            row = torch.arange(lq, device=dev)[:, None] + (lk - lq)
            col = torch.arange(lk, device=dev)[None, :]
            scores = scores.masked_fill(col > row, float("-inf"))
            outs.append((scores.softmax(-1) @ vs).transpose(0, 1))
        return torch.cat(outs)

    def flash_fwd():
        return torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale
        )

    def cudnn_fwd():
        return torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, cu_q, cu_k, max_q, max_k, True, 0.0, True, scale=scale
        )

    with torch.no_grad():
        want = reference()
        print("flash forward: max |err|", (flash_fwd()[0].float() - want).abs().max().item())
        print("flash forward: us", round(timed_us(flash_fwd), 1))
        try:
            got = cudnn_fwd()[0]
            print("cudnn forward: max |err|", (got.float() - want).abs().max().item())
            print("cudnn forward: us", round(timed_us(cudnn_fwd), 1))
        except Exception as e:  # noqa: BLE001 - report whatever the op refuses
            print("cudnn forward failed:", repr(e)[:600])

    grad_out = torch.randn_like(q)
    out, lse, rng, _, _ = flash_fwd()
    empty = torch.empty(0, device=dev)

    def flash_bwd():
        return torch.ops.aten._flash_attention_backward(
            grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, True, rng, empty, scale=scale
        )

    flash_grads = flash_bwd()
    print("flash backward: us", round(timed_us(flash_bwd), 1))
    try:
        res = cudnn_fwd()

        def cudnn_bwd():
            return torch.ops.aten._cudnn_attention_backward(
                grad_out, q, k, v, res[0], res[1], res[6], res[7], empty, cu_q, cu_k, max_q, max_k,
                0.0, True, scale=scale,
            )

        for name, a, b in zip(("dq", "dk", "dv"), flash_grads, cudnn_bwd()):
            print(f"cudnn {name}: max |cudnn - flash|", (a.float() - b.float()).abs().max().item())
        print("cudnn backward: us", round(timed_us(cudnn_bwd), 1))
    except Exception as e:  # noqa: BLE001
        print("cudnn backward failed:", repr(e)[:800])


if __name__ == "__main__":
    main()
