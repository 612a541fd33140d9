"""Training-pass attention: libtorch's FlashAttention-2 varlen kernel (what the FSDP backend calls for the
shared-prompt layout) against cuDNN's fused SDPA on the same work padded to whole sequences.

One micro-batch of the bench's update: B responses of R tokens, each attending its P-token prompt (bottom-right
causal). FA2 varlen: queries [B*R, Hq, D], keys [B*(P+R), Hkv, D]. cuDNN: every sequence padded to P+R queries
(the prompt's own causal rows computed too, 1/8 more pairs), [B, H, P+R, D], top-left causal. Prints µs for the
forward and forward+backward, and the response rows' max |Δ| against an fp32 reference.
    python3 bench/cudnn_sdpa_probe.py
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timeit(fn, iters=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) * 1000 / iters


def case(name, B, P, R, hq, hkv, d):
    dev, dt = "cuda", torch.bfloat16
    L = P + R
    torch.manual_seed(0)
    q = torch.randn(B, hq, L, d, device=dev, dtype=dt)
    k = torch.randn(B, hkv, L, d, device=dev, dtype=dt)
    v = torch.randn(B, hkv, L, d, device=dev, dtype=dt)
    go = torch.randn(B, hq, L, d, device=dev, dtype=dt)
    go[:, :, :P] = 0
    # FA2 varlen layout
    qv = q[:, :, P:].permute(0, 2, 1, 3).reshape(B * R, hq, d).contiguous().requires_grad_()
    kv_ = k.permute(0, 2, 1, 3).reshape(B * L, hkv, d).contiguous().requires_grad_()
    vv = v.permute(0, 2, 1, 3).reshape(B * L, hkv, d).contiguous().requires_grad_()
    gov = go[:, :, P:].permute(0, 2, 1, 3).reshape(B * R, hq, d).contiguous()
    cu_q = torch.arange(0, B + 1, device=dev, dtype=torch.int32) * R
    cu_k = torch.arange(0, B + 1, device=dev, dtype=torch.int32) * L

    def fa2():
        return torch.ops.aten._flash_attention_forward(qv, kv_, vv, cu_q, cu_k, R, L, 0.0, True, False)[0]

    def fa2_fb():
        o = fa2()
        torch.autograd.grad(o, (qv, kv_, vv), gov)

    qp, kp, vp = (t.detach().clone().requires_grad_() for t in (q, k, v))

    def cud(expand):
        kk, vvv = kp, vp
        if expand:
            kk = kk.repeat_interleave(hq // hkv, dim=1)
            vvv = vvv.repeat_interleave(hq // hkv, dim=1)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            if expand:
                return F.scaled_dot_product_attention(qp, kk, vvv, is_causal=True)
            return F.scaled_dot_product_attention(qp, kk, vvv, is_causal=True, enable_gqa=True)

    def cud_fb(expand):
        o = cud(expand)
        torch.autograd.grad(o, (qp, kp, vp), go)

    with torch.no_grad():
        ref = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(hq // hkv, 1),
                                             v.float().repeat_interleave(hq // hkv, 1), is_causal=True)
        ref_r = ref[:, :, P:].permute(0, 2, 1, 3).reshape(B * R, hq, d)
        e_fa = (fa2().float() - ref_r).abs().max().item()
    print(f"{name}: FA2 varlen fwd {timeit(lambda: fa2()):.1f} us, fwd+bwd {timeit(fa2_fb):.1f} us, err {e_fa:.2e}")
    for expand in (False, True):
        try:
            with torch.no_grad():
                o = cud(expand)
            e = (o[:, :, P:].float() - ref[:, :, P:]).abs().max().item()
            print(f"{name}: cuDNN {'expanded K/V' if expand else 'gqa'} fwd {timeit(lambda: cud(expand)):.1f} us, "
                  f"fwd+bwd {timeit(lambda: cud_fb(expand)):.1f} us, err {e:.2e}")
        except Exception as ex:  # noqa: BLE001
            print(f"{name}: cuDNN {'expanded' if expand else 'gqa'} failed: {str(ex).splitlines()[0][:200]}")


if __name__ == "__main__":
    print(torch.__version__, torch.backends.cudnn.version(), torch.cuda.get_device_name(0))
    case("1.5B heads", 16, 256, 512, 12, 2, 128)
    case("0.5B heads", 16, 256, 512, 14, 2, 64)
    case("7B heads", 8, 256, 512, 28, 4, 128)
