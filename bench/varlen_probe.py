#!/usr/bin/env python3
"""Attention of a shared-prompt stream (the actor's `use_prefix_grouper` layout) two ways, on a GPU:

* rows (the layout's first form): queries, keys and values gathered into `[rows, len]` padded rows
  (every row repeats its group's prompt), dense causal SDPA, and the stream's outputs gathered back;
* varlen: the stream's queries as they are (one segment per row: the group's first row owns the
  prompt's queries, the others only their responses), keys/values gathered per row without padding,
  and flash attention's variable-length kernel with a bottom-right causal mask (what the actor runs
  in bf16/fp16 on CUDA).

    python3 bench/varlen_probe.py [--arch 0.5b|1.5b] [--groups 2] [--n 8] [--prompt 256] [--response 512]

Prints the largest difference of the outputs and of q/k/v gradients from a first run of the rows
form (the rows form against itself shows the run-to-run spread of its gathers' atomic bf16
backward), and the forward + backward time of each (CUDA events, median of 20). libtorch 2.11's
cuDNN ragged path (`_cudnn_attention_forward` with offsets) refuses this layout; the rows form is also
timed with each SDPA backend forced (flash, cuDNN, memory-efficient). Needs a CUDA GPU and torch.
"""
import argparse

import torch
import torch.nn.functional as F

ARCH = {"0.5b": (14, 2, 64), "1.5b": (12, 2, 128), "7b": (28, 4, 128)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="1.5b", choices=sorted(ARCH))
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--response", type=int, default=512)
    a = ap.parse_args()
    h, kvh, d = ARCH[a.arch]
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    # Stream: per group [prompt, resp_0, ..., resp_{n-1}]; responses of varying length.
    gather, scatter, kv_gather, cu_q, cu_k = [], [], [], [0], [0]
    segs = []
    at = 0
    lens = []
    for g in range(a.groups):
        p_at, plen = at, a.prompt - 7 * g
        at += plen
        for j in range(a.n):
            rl = a.response - 13 * j
            segs.append((p_at, plen, at, rl, j == 0))
            at += rl
    n_tok = at
    length = max(plen + rl for (_, plen, _, rl, _) in segs)
    scatter = [0] * n_tok
    for i, (p_at, plen, r_at, rl, owner) in enumerate(segs):
        cols = list(range(p_at, p_at + plen)) + list(range(r_at, r_at + rl))
        gather += cols + [0] * (length - len(cols))
        kv_gather += cols
        for c, t in enumerate(cols):
            if owner or c >= plen:
                scatter[t] = i * length + c
        cu_q.append(cu_q[-1] + (plen + rl if owner else rl))
        cu_k.append(cu_k[-1] + plen + rl)
    rows = len(segs)
    assert cu_q[-1] == n_tok
    max_q = max(cu_q[i + 1] - cu_q[i] for i in range(rows))
    max_k = max(cu_k[i + 1] - cu_k[i] for i in range(rows))
    idx = lambda v: torch.tensor(v, device=dev, dtype=torch.long)
    gather, scatter, kv_gather = idx(gather), idx(scatter), idx(kv_gather)
    cu_q32 = torch.tensor(cu_q, device=dev, dtype=torch.int32)
    cu_k32 = torch.tensor(cu_k, device=dev, dtype=torch.int32)

    q0 = torch.randn(n_tok, h, d, device=dev, dtype=dt)
    k0 = torch.randn(n_tok, kvh, d, device=dev, dtype=dt)
    v0 = torch.randn(n_tok, kvh, d, device=dev, dtype=dt)
    go = torch.randn(n_tok, h, d, device=dev, dtype=dt)

    def rows_form(q, k, v):
        qa = q.index_select(0, gather).view(rows, length, h, d).transpose(1, 2)
        ka = k.index_select(0, gather).view(rows, length, kvh, d).transpose(1, 2)
        va = v.index_select(0, gather).view(rows, length, kvh, d).transpose(1, 2)
        o = F.scaled_dot_product_attention(qa, ka, va, is_causal=True, enable_gqa=True)
        return o.transpose(1, 2).reshape(rows * length, h, d).index_select(0, scatter)

    def rows_with(backend):
        def form(q, k, v):
            with torch.nn.attention.sdpa_kernel([backend]):
                return rows_form(q, k, v)
        return form

    def flash_form(q, k, v):
        ka, va = k.index_select(0, kv_gather), v.index_select(0, kv_gather)
        return torch.ops.aten._flash_attention_forward(
            q, ka, va, cu_q32, cu_k32, max_q, max_k, 0.0, True, False)[0]

    def run(form):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        o = form(q, k, v)
        o.backward(go)
        return o.detach(), q.grad, k.grad, v.grad

    def timed(form, iters=20):
        ts = []
        for i in range(iters + 3):
            q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            form(q, k, v).backward(go)
            e.record()
            torch.cuda.synchronize()
            if i >= 3:
                ts.append(s.elapsed_time(e))
        ts.sort()
        return ts[len(ts) // 2]

    ref = run(rows_form)
    print(f"arch {a.arch}: {rows} rows, stream {n_tok} tokens, padded rows of {length}")
    B = torch.nn.attention.SDPBackend
    forms = [("rows (padded, SDPA)", rows_form), ("rows, flash", rows_with(B.FLASH_ATTENTION)),
             ("rows, cuDNN", rows_with(B.CUDNN_ATTENTION)),
             ("rows, efficient", rows_with(B.EFFICIENT_ATTENTION)), ("varlen flash", flash_form)]
    for name, form in forms:
        try:
            got = run(form)
            diffs = " ".join(f"{w} {(x.float() - y.float()).abs().max().item():.2e}"
                             for w, x, y in zip(("out", "dq", "dk", "dv"), got, ref))
            print(f"{name:22s} fwd+bwd {timed(form):7.3f} ms   max |diff| vs rows: {diffs}")
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"{name:22s} failed: {str(e).splitlines()[0][:200]}")


if __name__ == "__main__":
    main()
