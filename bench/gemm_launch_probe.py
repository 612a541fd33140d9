#!/usr/bin/env python3
"""Host launch cost and row invariance of libtorch's GEMMs under the settings of
`actor_rollout_ref.rollout.consistent_attention` (see the README's "Exact rollout log-probs").

    python3 bench/gemm_launch_probe.py            # runs every setting in a child process each

For each setting it prints the host time one GEMM launch takes while the GPU is busy (so launches
never wait for the device): `linear` without and with a bias, and a weight-gradient GEMM; and how
many (shape, rows) cases give rows that differ from the same rows of a 4096-row GEMM (split-K
kernels chosen for few rows sum in another order). Shapes: Qwen2.5-0.5B / 1.5B projections and LM
heads. Needs a CUDA GPU and torch; nothing else.
"""
import os
import subprocess
import sys
import time

SETTINGS = {
    "cuBLAS default (no consistency)": {},
    "no cuBLAS workspace (earlier scheme)": {
        "CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0", "TORCH_CUBLASLT_WORKSPACE_SIZE": "0"},
    "cuBLASLt, 1 KiB workspace (current scheme)": {
        "TORCH_BLAS_PREFER_CUBLASLT": "1", "CUBLASLT_WORKSPACE_SIZE": "1", "TORCH_CUBLASLT_WORKSPACE_SIZE": "1"},
}
SHAPES = [(896, 1152), (896, 896), (896, 9728), (4864, 896), (1536, 2048), (1536, 1536), (1536, 17920),
          (8960, 1536), (896, 151936), (1536, 151936)]


def child(name):
    import torch
    import torch.nn.functional as F

    dev = "cuda"
    torch.manual_seed(0)

    def host_us(fn, n=200):
        fn()
        torch.cuda.synchronize()
        torch.cuda._sleep(int(2e9))  # keep the GPU busy: a launch never waits for it
        t = time.perf_counter()
        for _ in range(n):
            fn()
        dt = (time.perf_counter() - t) / n * 1e6
        torch.cuda.synchronize()
        return dt

    a = torch.randn(8704, 896, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4864, 896, device=dev, dtype=torch.bfloat16)
    b = torch.randn(4864, device=dev, dtype=torch.bfloat16)
    g = torch.randn(8704, 4864, device=dev, dtype=torch.bfloat16)
    cost = [host_us(lambda: F.linear(a, w)), host_us(lambda: F.linear(a, w, b)), host_us(lambda: g.t().mm(a))]
    differ = []
    for k, n in SHAPES:
        x = torch.randn(4096, k, device=dev, dtype=torch.bfloat16)
        ww = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        full = F.linear(x, ww)
        for m in (1, 3, 8, 24, 64, 100, 200, 512):
            if not torch.equal(F.linear(x[:m], ww), full[:m]):
                differ.append(f"{k}x{n}@{m}")
    print(f"{name:44s} {cost[0]:7.1f} {cost[1]:7.1f} {cost[2]:7.1f}   {len(differ):3d} {' '.join(differ[:6])}")


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return
    print(f"{'setting':44s} {'host us per launch':>23s}   rows differing from a 4096-row GEMM")
    print(f"{'':44s} {'linear':>7s} {'+bias':>7s} {'grad_w':>7s}")
    for name, env in SETTINGS.items():
        e = {k: v for k, v in os.environ.items()
             if k not in ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE", "TORCH_CUBLASLT_WORKSPACE_SIZE",
                          "TORCH_BLAS_PREFER_CUBLASLT")}
        e.update(env)
        r = subprocess.run([sys.executable, __file__, "--child", name], env=e, capture_output=True, text=True)
        out = r.stdout.strip() or f"{name:44s} failed: {r.stderr.strip().splitlines()[-1:]}"
        print(out)


if __name__ == "__main__":
    main()
