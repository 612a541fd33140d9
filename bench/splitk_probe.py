"""Split-K by hand for the decode step's down projection: speed and row consistency (GPU, torch only).

`rollout.consistent_attention` keeps cuBLAS's split-K kernels out of every GEMM (their reduction
order depends on the row count), so a 512-row down projection (K = 8,960 for 1.5B) runs one wave of
small tiles. A split of K the rollout and the training forward both make the same way keeps them
equal: `y = bf16(P_0 + ... + P_{S-1})`, `P_s = x[:, K_s] W[:, K_s]^T` in fp32 (one batched GEMM).
This probe times, per (hidden, intermediate) shape and row count, libtorch's `linear` against the
split (S = 2, 4) with the weights cold (28 layers' copies, more than L2, replayed in a CUDA graph),
and checks that the split's rows at each row count equal the same rows of a training-size GEMM.

    python3 bench/splitk_probe.py [--shapes 896x4864,1536x8960] [--rows 1,8,64,256,512] [--train-rows 8704]

Runs under the GEMM settings `consistent_attention` sets (cuBLASLt preferred, 1-byte workspace).
"""

import argparse
import json
import os

os.environ.setdefault("TORCH_CUBLASLT_WORKSPACE_SIZE", "1")
os.environ.setdefault("CUBLASLT_WORKSPACE_SIZE", "1")

import torch  # noqa: E402


def split_linear(x, w, s):
    m, k = x.shape
    n = w.shape[0]
    xs = x.view(m, s, k // s).transpose(0, 1)  # [s, m, k/s], row stride k
    ws = w.view(n, s, k // s).permute(1, 2, 0)  # [s, k/s, n]
    p = torch.bmm(xs, ws, out_dtype=torch.float32)
    acc = p[0]
    for i in range(1, s):
        acc = acc + p[i]
    return acc.to(x.dtype)


def timed(fn, layers, reps=20):
    """Mean µs of one call over `layers` distinct weights, replayed as one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            for lw in layers:
                fn(lw)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for lw in layers:
            fn(lw)
    g.replay()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(reps):
            g.replay()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) * 1000 / reps / len(layers))
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="896x4864,1536x8960,3584x18944")
    ap.add_argument("--rows", default="1,8,32,64,128,256,512")
    ap.add_argument("--train-rows", type=int, default=8704)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--splits", default="2,4")
    a = ap.parse_args()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    dev = torch.device("cuda")
    print("gpu", torch.cuda.get_device_name(0), "torch", torch.__version__)
    splits = [int(s) for s in a.splits.split(",")]
    rows = [int(r) for r in a.rows.split(",")]
    for shape in a.shapes.split(","):
        hidden, inter = (int(v) for v in shape.split("x"))
        g = torch.Generator(device=dev).manual_seed(0)
        ws = [torch.randn(hidden, inter, device=dev, generator=g).mul_(0.02).to(torch.bfloat16) for _ in range(a.layers)]
        xt = torch.randn(a.train_rows, inter, device=dev, generator=g).to(torch.bfloat16)
        ref = {s: split_linear(xt, ws[0], s) for s in splits}
        ref[1] = torch.nn.functional.linear(xt, ws[0])
        for m in rows:
            x = xt[:m].contiguous()
            row = {"shape": f"{hidden}<-{inter}", "rows": m}
            row["linear_us"] = round(timed(lambda w: torch.nn.functional.linear(x, w), ws), 2)
            row["linear_rows_equal"] = bool(torch.equal(torch.nn.functional.linear(x, ws[0]), ref[1][:m]))
            for s in splits:
                row[f"split{s}_us"] = round(timed(lambda w, s=s: split_linear(x, w, s), ws), 2)
                row[f"split{s}_rows_equal"] = bool(torch.equal(split_linear(x, ws[0], s), ref[s][:m]))
            print(json.dumps(row), flush=True)
        exact = (xt.double() @ ws[0].double().t())
        for s in [1] + splits:
            err = (ref[s].double() - exact).abs().mean().item()
            print(json.dumps({"shape": f"{hidden}<-{inter}", "split": s, "mean_abs_err_vs_fp64": err}))


if __name__ == "__main__":
    main()
