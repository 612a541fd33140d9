#!/usr/bin/env python3
"""Time the GEMMs of one training micro-batch (forward, input gradient, weight gradient) under three
cuBLAS settings, each in a child process (libtorch reads the workspace sizes once per process):

  lt-ws1      cuBLASLt with a 1-byte workspace: what `rollout.consistent_attention` sets for the whole
              process (no split-K anywhere, so a row's bits do not depend on the batch)
  lt-default  cuBLASLt with libtorch's default workspace
  cublas      libtorch's default BLAS backend (cuBLAS) and workspace

    python3 bench/train_gemm_probe.py [--arch 1.5b|0.5b] [--tokens 8704] [--lm-tokens 8192]

The default token counts are one 16-row micro-batch of the bench's 1.5B update with the prefix grouper
(2 prompts of 256 tokens, 16 responses of 512). The weight gradients accumulate into fp32 (as the
actor's `linear_into` does); the LM head's forward writes fp32 logits. For each shape it prints µs and
TFLOP/s per setting, then the update's total (each layer GEMM x layers x micro-batches, the LM head x
micro-batches) and an 8192³ GEMM as the peak of the same process. GPU, torch only.
"""
import argparse
import json
import os
import subprocess
import sys

ARCH = {  # hidden, intermediate, q heads x head_dim, kv heads x head_dim, vocab, layers
    "0.5b": (896, 4864, 896, 128, 151936, 24),
    "1.5b": (1536, 8960, 1536, 256, 151936, 28),
}

SETTINGS = {
    "lt-ws1": ({"TORCH_CUBLASLT_WORKSPACE_SIZE": "1", "CUBLASLT_WORKSPACE_SIZE": "1"}, True),
    "lt-default": ({}, True),
    "cublas": ({}, False),
}


def shapes(arch, t, tl):
    h, i, q, kv, v, _ = ARCH[arch]
    layer = [("qkv", h, q + 2 * kv), ("o", q, h), ("gate_up", h, 2 * i), ("down", i, h)]
    out = []
    for name, k, n in layer:
        out.append((f"{name} fwd", "fwd", t, k, n, False))
        out.append((f"{name} dX", "dx", t, n, k, False))
        out.append((f"{name} dW", "dw", t, k, n, False))
    out.append(("lm fwd (fp32 out)", "fwd32", tl, h, v, True))
    out.append(("lm dX", "dx", tl, v, h, True))
    out.append(("lm dW", "dw", tl, h, v, True))
    return out


def child(args):
    import torch

    env, lt = SETTINGS[args.child]
    if lt:
        torch.backends.cuda.preferred_blas_library("cublaslt")
    dev = "cuda"
    bf = torch.bfloat16

    def timeit(fn, reps=20):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        best = []
        for _ in range(3):
            s.record()
            for _ in range(reps):
                fn()
            e.record()
            e.synchronize()
            best.append(s.elapsed_time(e) * 1e3 / reps)
        return sorted(best)[1]

    res = {}
    for name, kind, m, k, n, _lm in shapes(args.arch, args.tokens, args.lm_tokens):
        if kind in ("fwd", "fwd32"):
            x = torch.randn(m, k, device=dev, dtype=bf)
            w = torch.randn(n, k, device=dev, dtype=bf)
            if kind == "fwd":
                fn = lambda: torch.nn.functional.linear(x, w)  # noqa: E731
            else:
                fn = lambda: torch.mm(x, w.t(), out_dtype=torch.float32)  # noqa: E731
        elif kind == "dx":  # gy [m, k] @ W [k, n]
            gy = torch.randn(m, k, device=dev, dtype=bf)
            w = torch.randn(k, n, device=dev, dtype=bf)
            fn = lambda: torch.mm(gy, w)  # noqa: E731
        else:  # acc [n, k] += gy^T [n, m] @ x [m, k]
            gy = torch.randn(m, n, device=dev, dtype=bf)
            x = torch.randn(m, k, device=dev, dtype=bf)
            acc = torch.zeros(n, k, device=dev, dtype=torch.float32)
            gt = gy.t()
            fn = lambda: torch.addmm(acc, gt, x, out_dtype=torch.float32, out=acc)  # noqa: E731
        us = timeit(fn)
        res[name] = us
        del fn
        torch.cuda.empty_cache()
    a = torch.randn(8192, 8192, device=dev, dtype=bf)
    b = torch.randn(8192, 8192, device=dev, dtype=bf)
    res["peak 8192^3"] = timeit(lambda: torch.mm(a, b))
    print(json.dumps(res))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="1.5b", choices=sorted(ARCH))
    p.add_argument("--tokens", type=int, default=8704)
    p.add_argument("--lm-tokens", type=int, default=8192)
    p.add_argument("--micro-batches", type=int, default=32)
    p.add_argument("--child", choices=sorted(SETTINGS))
    args = p.parse_args()
    if args.child:
        return child(args)
    runs = {}
    for s, (env, _) in SETTINGS.items():
        e = dict(os.environ)
        for key in ("TORCH_CUBLASLT_WORKSPACE_SIZE", "CUBLASLT_WORKSPACE_SIZE", "CUBLAS_WORKSPACE_CONFIG"):
            e.pop(key, None)
        e.update(env)
        cmd = [sys.executable, __file__, "--child", s, "--arch", args.arch, "--tokens", str(args.tokens),
               "--lm-tokens", str(args.lm_tokens)]
        out = subprocess.run(cmd, env=e, check=True, capture_output=True, text=True).stdout
        runs[s] = json.loads(out.strip().splitlines()[-1])
    layers = ARCH[args.arch][5]
    names = list(SETTINGS)
    print(f"# {args.arch}, {args.tokens} tokens ({args.lm_tokens} through the LM head), µs (TFLOP/s)")
    print("| GEMM | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    totals = {s: {"fwd": 0.0, "dx": 0.0, "dw": 0.0} for s in names}
    for name, kind, m, k, n, lm in shapes(args.arch, args.tokens, args.lm_tokens):
        flop = 2 * m * k * n
        cells = []
        for s in names:
            us = runs[s][name]
            cells.append(f"{us:.1f} ({flop / us / 1e6:.0f})")
            reps = args.micro_batches * (1 if lm else layers)
            totals[s]["fwd" if kind.startswith("fwd") else kind] += us * reps / 1e6
        print(f"| {name} | " + " | ".join(cells) + " |")
    pf = 2 * 8192**3
    print("| 8192³ | " + " | ".join(f"{runs[s]['peak 8192^3']:.1f} ({pf / runs[s]['peak 8192^3'] / 1e6:.0f})"
                                   for s in names) + " |")
    print(f"\nper update ({args.micro_batches} micro-batches), seconds:")
    for s in names:
        t = totals[s]
        print(f"  {s:11s} forward {t['fwd']:.3f}  dX {t['dx']:.3f}  dW {t['dw']:.3f}  "
              f"total {sum(t.values()):.3f}")


if __name__ == "__main__":
    main()
