//! The fused row kernels: NVRTC compiles them for sm_80 and sm_90 on any machine; on a GPU they
//! match the torch formulas (sampling's inverse CDF, log-softmax, entropy and their gradient by
//! autograd). The GPU tests are `…_on_cuda`, ignored ("needs CUDA") and run by `make test-gpu`;
//! the NVRTC ones need torch-ext built with the CUDA headers (`bash scripts/setup.sh`), no GPU.

use tch::{Device, Kind, Tensor};
use verl_test_support::cuda::cuda_device;
use verl_torch_ext::{
    add_rms_norm, add_rms_norm_accumulating, add_rms_norm_autograd, add_rms_norm_autograd_applies,
    cuda_graphs_compiled, gather_rows, gather_rows_inverse, rope, rope_autograd, rope_store,
    row_kernels_available, row_kernels_compile_check, sample_rows, silu_mul, swiglu, token_stats,
    token_stats_grad,
};

#[test]
fn compiles_for_ampere_and_hopper() {
    assert_cuda_build();
    for arch in [80, 90] {
        let log = row_kernels_compile_check(arch).unwrap_or_else(|e| panic!("sm_{arch}: {e}"));
        assert!(
            log.contains(&format!("sm_{arch}")) || log.contains("compute_"),
            "{log}"
        );
        assert!(
            !log.contains("spill stores") || log.contains("0 bytes spill stores"),
            "{log}"
        );
    }
}

/// torch-ext built with the CUDA headers (what `bash scripts/setup.sh` sets up; no GPU needed),
/// or a failure saying so.
fn assert_cuda_build() {
    assert!(
        cuda_graphs_compiled(),
        "this test needs torch-ext built with the CUDA headers (not a GPU): it was built without \
         them (VERL_TORCH_EXT_NO_CUDA set, or no cuda_runtime.h found; `bash scripts/setup.sh` \
         installs them)"
    );
}

/// No compute capability where there is no GPU. Only checks something without one; on a GPU
/// machine it says so and returns (the `_on_cuda` test is the check there).
#[test]
fn cuda_arch_is_none_without_a_device() {
    if tch::Cuda::is_available() {
        eprintln!("not applicable: this machine has a GPU (see the `_on_cuda` test)");
        return;
    }
    let arch = verl_torch_ext::cuda_arch(0);
    assert_eq!(arch, None);
}

/// The driver's compute capability where there is a GPU.
#[test]
#[ignore = "needs CUDA"]
fn cuda_arch_is_the_devices_on_cuda() {
    cuda_device();
    let arch = verl_torch_ext::cuda_arch(0);
    let a = arch.expect("a GPU has a compute capability");
    assert!((50..=200).contains(&a), "compute capability {a}");
    assert_eq!(verl_torch_ext::cuda_arch(0), Some(a), "cached value");
}

/// The GPU, where the row kernels run (or a failure saying why not).
fn gpu() -> Device {
    let d = cuda_device();
    assert!(
        row_kernels_available(d),
        "a CUDA device but the row kernels are unavailable on it (torch-ext built without the \
         CUDA headers?)"
    );
    d
}

fn max_abs(a: &Tensor, b: &Tensor) -> f64 {
    (a.to_kind(Kind::Double) - b.to_kind(Kind::Double))
        .abs()
        .max()
        .double_value(&[])
}

/// The torch sampler's inverse CDF in vocabulary order (what `verl_rollout`'s sampler computes
/// without top-k/top-p), in fp64 so that its boundaries are exact.
fn torch_inverse_cdf(logits: &Tensor, u: &Tensor, t: f64) -> Tensor {
    let probs = (logits.to_kind(Kind::Double) / t).softmax(-1, Kind::Double);
    let cdf = probs.cumsum(-1, Kind::Double);
    let total = cdf.narrow(1, cdf.size()[1] - 1, 1);
    let target = u.to_kind(Kind::Double).unsqueeze(-1) * total;
    cdf.le_tensor(&target)
        .sum_dim_intlist([-1i64].as_slice(), false, Kind::Int64)
        .clamp_max(cdf.size()[1] - 1)
}

#[test]
#[ignore = "needs CUDA"]
fn sampling_matches_the_inverse_cdf_and_greedy_argmax_on_cuda() {
    let dev = gpu();
    tch::manual_seed(11);
    for (rows, vocab, t) in [(7i64, 151_936i64, 1.0f64), (300, 1000, 0.7), (1, 5, 1.3)] {
        let logits = Tensor::randn([rows, vocab], (Kind::Float, dev)) * 3.0;
        let u = Tensor::rand([rows], (Kind::Float, dev));
        let (tok, lp) = sample_rows(&logits, Some(&u), t, true).unwrap();
        let want = torch_inverse_cdf(&logits, &u, t);
        let same = tok.eq_tensor(&want).sum(Kind::Int64).int64_value(&[]);
        // fp32 sums in another order than fp64's: a draw within rounding of a boundary may pick
        // the neighbour, never anything else.
        assert!(
            same >= rows - 1,
            "{same} of {rows} rows agree (vocab {vocab}, T {t})"
        );
        let off = (&tok - &want).abs().max().int64_value(&[]);
        assert!(off <= 1, "a draw {off} tokens from the fp64 one");
        let want_lp = (logits.to_kind(Kind::Double) / t)
            .log_softmax(-1, Kind::Double)
            .gather(-1, &want.unsqueeze(-1), false)
            .squeeze_dim(-1);
        let lp = lp.unwrap();
        let (again, _) = sample_rows(&logits, Some(&u), t, false).unwrap();
        assert!(again.equal(&tok), "sampling is deterministic");
        let diff = (lp.to_kind(Kind::Double) - want_lp)
            .abs()
            .masked_select(&want.eq_tensor(&tok))
            .max()
            .double_value(&[]);
        assert!(diff < 1e-4, "log-prob differs by {diff}");
        // Greedy: the first maximal logit, and its log-prob.
        let (g, glp) = sample_rows(&logits, None, t, true).unwrap();
        assert_eq!(
            Vec::<i64>::try_from(&g).unwrap(),
            Vec::<i64>::try_from(&logits.argmax(-1, false)).unwrap()
        );
        let want_g = (logits.to_kind(Kind::Double) / t)
            .log_softmax(-1, Kind::Double)
            .gather(-1, &g.unsqueeze(-1), false)
            .squeeze_dim(-1);
        assert!(max_abs(&glp.unwrap(), &want_g) < 1e-4);
    }
    // Extremes: u = 0 takes the first token with mass, u just below 1 the last one; a
    // one-hot row always gives its token.
    let mut logits = Tensor::full([3, 4096], f64::NEG_INFINITY, (Kind::Float, dev));
    let _ = logits.get(0).narrow(0, 100, 3).fill_(0.0);
    let _ = logits.get(1).narrow(0, 100, 3).fill_(0.0);
    let _ = logits.get(2).narrow(0, 4000, 1).fill_(5.0);
    let u = Tensor::from_slice(&[0.0f32, 0.999_999_9, 0.5]).to_device(dev);
    let (tok, lp) = sample_rows(&logits, Some(&u), 1.0, true).unwrap();
    assert_eq!(Vec::<i64>::try_from(&tok).unwrap(), vec![100, 102, 4000]);
    let lp = Vec::<f32>::try_from(&lp.unwrap()).unwrap();
    assert!(
        (lp[0] - (1.0f32 / 3.0).ln()).abs() < 1e-6 && lp[2].abs() < 1e-6,
        "{lp:?}"
    );
    logits = logits.zeros_like();
    let (tok, _) = sample_rows(&logits, None, 1.0, false).unwrap();
    assert_eq!(
        Vec::<i64>::try_from(&tok).unwrap(),
        vec![0, 0, 0],
        "ties: first index"
    );
}

#[test]
#[ignore = "needs CUDA"]
fn stats_and_gradient_match_autograd_on_cuda() {
    let dev = gpu();
    tch::manual_seed(12);
    for (rows, vocab, t) in [(64i64, 151_936i64, 1.0f64), (33, 777, 0.6), (16, 4096, 0.7)] {
        let logits = Tensor::randn([rows, vocab], (Kind::Float, dev)) * 2.0;
        let targets = Tensor::randint(vocab, [rows], (Kind::Int64, dev));
        let s = token_stats(&logits, &targets, t, true).unwrap();
        // autograd reference in fp64
        let x = logits
            .to_kind(Kind::Double)
            .detach()
            .set_requires_grad(true);
        let xs = &x / t;
        let lse = xs.logsumexp([-1i64].as_slice(), false);
        let lp = xs.gather(-1, &targets.unsqueeze(-1), false).squeeze_dim(-1) - &lse;
        let p = xs.softmax(-1, Kind::Double);
        let mean = (&p * &xs).sum_dim_intlist([-1i64].as_slice(), false, Kind::Double);
        let ent = &lse - &mean;
        assert!(max_abs(&s.log_probs, &lp) < 1e-4, "log-probs");
        assert!(max_abs(s.entropy.as_ref().unwrap(), &ent) < 1e-4, "entropy");
        assert!(max_abs(&s.lse, &lse) < 1e-4, "lse");
        assert!(max_abs(&s.mean, &mean) < 1e-4, "mean");
        let g_lp = Tensor::randn([rows], (Kind::Float, dev));
        let g_ent = Tensor::randn([rows], (Kind::Float, dev));
        let obj = (&lp * g_lp.to_kind(Kind::Double)).sum(Kind::Double)
            + (&ent * g_ent.to_kind(Kind::Double)).sum(Kind::Double);
        // The graph is kept: the entropy-free objective below differentiates it again.
        let want = Tensor::run_backward(&[&obj], &[&x], true, false)[0].shallow_clone();
        for kind in [Kind::Float, Kind::BFloat16] {
            let g = token_stats_grad(
                &logits,
                &targets,
                &s.lse,
                &s.mean,
                &g_lp,
                Some(&g_ent),
                t,
                kind,
            )
            .unwrap();
            assert_eq!(g.kind(), kind);
            let scale = want.abs().max().double_value(&[]);
            let tol = if kind == Kind::Float { 1e-5 } else { 1e-2 };
            let d = max_abs(&g, &want);
            assert!(
                d <= tol * scale.max(1.0),
                "{kind:?}: gradient differs by {d}"
            );
        }
        // Without the entropy term.
        let g = token_stats_grad(
            &logits,
            &targets,
            &s.lse,
            &s.mean,
            &g_lp,
            None,
            t,
            Kind::Float,
        )
        .unwrap();
        let obj = (&lp * g_lp.to_kind(Kind::Double)).sum(Kind::Double);
        let want = Tensor::run_backward(&[&obj], &[&x], false, false)[0].shallow_clone();
        assert!(max_abs(&g, &want) < 1e-5);
    }
}

#[test]
#[ignore = "needs CUDA"]
fn bad_inputs_name_the_argument_on_cuda() {
    let dev = gpu();
    let logits = Tensor::zeros([4, 10], (Kind::BFloat16, dev));
    let e = sample_rows(&logits, None, 1.0, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("logits") && e.contains("dtype"), "{e}");
    let logits = Tensor::zeros([4, 10], (Kind::Float, dev));
    let u = Tensor::zeros([3], (Kind::Float, dev));
    let e = sample_rows(&logits, Some(&u), 1.0, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("uniforms"), "{e}");
    let e = sample_rows(&logits, None, 0.0, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("temperature"), "{e}");
}

/// The rotary kernel against the torch op sequence it replaces: bit-identical in every dtype,
/// from a transposed (non-contiguous) input as the attention layer passes it, written in that
/// input's layout.
#[test]
#[ignore = "needs CUDA"]
fn rope_is_bit_identical_to_the_torch_ops_on_cuda() {
    let dev = gpu();
    tch::manual_seed(13);
    for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
        for (b, h, t, d, wide) in [
            (3i64, 5i64, 7i64, 64i64, false),
            (512, 14, 1, 64, false),
            (2, 4, 9, 128, false),
            (6, 4, 11, 16, false),
            (6, 4, 1, 16, true),
            (6, 2, 11, 16, true),
            (5, 3, 4, 32, true),
        ] {
            // [B, T, H, D] projection output viewed as [B, H, T, D]; `wide`: the first H heads of
            // a wider (fused q/k/v) projection.
            let width = if wide { 3 * h * d } else { h * d };
            let x = Tensor::randn([b, t, width], (Kind::Float, dev))
                .to_kind(kind)
                .narrow(-1, 0, h * d)
                .view([b, t, h, d])
                .transpose(1, 2);
            let pos = Tensor::randint(4000, [b, t], (Kind::Int64, dev)).to_kind(Kind::Float);
            let inv = Tensor::arange_start_step(0, d, 2, (Kind::Float, dev)) / d as f64;
            let inv = Tensor::from(10000.0f64)
                .to_device(dev)
                .pow(&inv)
                .reciprocal();
            let freqs = pos.unsqueeze(-1) * inv;
            let emb = Tensor::cat(&[&freqs, &freqs], -1);
            let (cos, sin) = (emb.cos().to_kind(kind), emb.sin().to_kind(kind));
            let (c4, s4) = (cos.unsqueeze(1), sin.unsqueeze(1));
            let x1 = x.narrow(-1, 0, d / 2);
            let x2 = x.narrow(-1, d / 2, d / 2);
            let rot = Tensor::cat(&[&x2.neg(), &x1], -1);
            let want = &x * &c4 + rot * &s4;
            let got = rope(&x, &cos, &sin).unwrap();
            // In the projection's layout: back to [B, T, H, D] it is contiguous.
            assert!(got.transpose(1, 2).is_contiguous(), "{:?}", got.stride());
            let same = got.eq_tensor(&want).all().int64_value(&[]) == 1;
            assert!(
                same,
                "{kind:?} [{b},{h},{t},{d}]: max diff {}",
                max_abs(&got, &want)
            );
        }
    }
}

fn rope_tables(b: i64, t: i64, d: i64, kind: Kind, dev: Device) -> (Tensor, Tensor) {
    let pos = Tensor::randint(4000, [b, t], (Kind::Int64, dev)).to_kind(Kind::Float);
    let inv = Tensor::arange_start_step(0, d, 2, (Kind::Float, dev)) / d as f64;
    let inv = Tensor::from(1e6f64).to_device(dev).pow(&inv).reciprocal();
    let freqs = pos.unsqueeze(-1) * inv;
    let emb = Tensor::cat(&[&freqs, &freqs], -1);
    (emb.cos().to_kind(kind), emb.sin().to_kind(kind))
}

fn bits_equal(a: &Tensor, b: &Tensor) -> bool {
    a.size() == b.size() && a.eq_tensor(b).all().int64_value(&[]) == 1
}

/// The training rotary embedding (recorded by autograd) against the torch op sequence under
/// autograd: output and the gradient reaching x bit-identical in every dtype, from a transposed
/// projection view, with the output and the gradient in that view's memory layout; also from a
/// narrow (non-dense) view, and a gradient that arrives strided.
#[test]
#[ignore = "needs CUDA"]
fn rope_autograd_matches_the_torch_ops_and_their_backward_on_cuda() {
    let dev = gpu();
    tch::manual_seed(23);
    for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
        for (b, h, t, d) in [(3i64, 5i64, 7i64, 64i64), (16, 14, 96, 64), (2, 4, 9, 128)] {
            let (cos, sin) = rope_tables(b, t, d, kind, dev);
            let (c4, s4) = (cos.unsqueeze(1), sin.unsqueeze(1));
            let base = Tensor::randn([b, t, h * d], (Kind::Float, dev)).to_kind(kind);
            let leaf = |_: ()| base.detach().set_requires_grad(true);
            let (xa, xb) = (leaf(()), leaf(()));
            let view = |x: &Tensor| x.view([b, t, h, d]).transpose(1, 2);
            let g = Tensor::randn([b, h, t, d], (Kind::Float, dev)).to_kind(kind);

            let x = view(&xa);
            let x1 = x.narrow(-1, 0, d / 2);
            let x2 = x.narrow(-1, d / 2, d / 2);
            let want = &x * &c4 + Tensor::cat(&[&x2.neg(), &x1], -1) * &s4;
            (&want * &g).sum(Kind::Float).backward();

            let got = rope_autograd(&view(&xb), &cos, &sin).unwrap();
            assert!(got.requires_grad());
            assert_eq!(got.stride(), view(&xb).stride(), "output keeps x's layout");
            assert!(
                bits_equal(&got, &want),
                "{kind:?} [{b},{h},{t},{d}] forward: max diff {}",
                max_abs(&got, &want)
            );
            (&got * &g).sum(Kind::Float).backward();
            let (ga, gb) = (xa.grad(), xb.grad());
            assert!(
                bits_equal(&gb, &ga),
                "{kind:?} [{b},{h},{t},{d}] backward: max diff {}",
                max_abs(&gb, &ga)
            );
        }
        // A non-dense input (q out of a fused q/k/v projection) and a gradient from an expand.
        let (b, h, t, d) = (2i64, 3i64, 5i64, 64i64);
        let (cos, sin) = rope_tables(b, t, d, kind, dev);
        let (c4, s4) = (cos.unsqueeze(1), sin.unsqueeze(1));
        let base = Tensor::randn([b, t, 2 * h * d], (Kind::Float, dev)).to_kind(kind);
        let (xa, xb) = (
            base.detach().set_requires_grad(true),
            base.detach().set_requires_grad(true),
        );
        let view = |x: &Tensor| x.narrow(-1, 0, h * d).view([b, t, h, d]).transpose(1, 2);
        let x = view(&xa);
        let x1 = x.narrow(-1, 0, d / 2);
        let x2 = x.narrow(-1, d / 2, d / 2);
        let want = &x * &c4 + Tensor::cat(&[&x2.neg(), &x1], -1) * &s4;
        want.sum(Kind::Float).backward();
        let got = rope_autograd(&view(&xb), &cos, &sin).unwrap();
        assert!(bits_equal(&got, &want), "{kind:?} narrow view forward");
        got.sum(Kind::Float).backward();
        assert!(
            bits_equal(&xb.grad(), &xa.grad()),
            "{kind:?} narrow view backward"
        );
    }
    let (cos, sin) = rope_tables(1, 2, 8, Kind::Float, dev);
    let x = Tensor::randn([1, 1, 2, 8], (Kind::Float, dev)).set_requires_grad(true);
    let e = rope_autograd(&x, &cos.set_requires_grad(true), &sin)
        .unwrap_err()
        .to_string();
    assert!(e.contains("cos/sin"), "{e}");
}

/// The training SwiGLU (recorded by autograd) against `silu(gate) * up` under autograd:
/// output and both gradients bit-identical in every dtype, on the vectorised and scalar paths.
#[test]
#[ignore = "needs CUDA"]
fn silu_mul_matches_the_torch_ops_and_their_backward_on_cuda() {
    let dev = gpu();
    tch::manual_seed(29);
    for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
        for shape in [
            vec![4i64, 96, 4864],
            vec![3, 13],
            vec![2, 5, 24],
            vec![1, 8],
        ] {
            let mk = || (Tensor::randn(shape.as_slice(), (Kind::Float, dev)) * 4.0).to_kind(kind);
            let (g0, u0) = (mk(), mk());
            let go = mk();
            let (ga, ua) = (
                g0.detach().set_requires_grad(true),
                u0.detach().set_requires_grad(true),
            );
            let want = ga.silu() * &ua;
            (&want * &go).sum(Kind::Float).backward();
            let (gb, ub) = (
                g0.detach().set_requires_grad(true),
                u0.detach().set_requires_grad(true),
            );
            let got = silu_mul(&gb, &ub).unwrap();
            assert!(
                bits_equal(&got, &want),
                "{kind:?} {shape:?} forward: max diff {}",
                max_abs(&got, &want)
            );
            (&got * &go).sum(Kind::Float).backward();
            assert!(
                bits_equal(&gb.grad(), &ga.grad()),
                "{kind:?} {shape:?} d gate: max diff {}",
                max_abs(&gb.grad(), &ga.grad())
            );
            assert!(
                bits_equal(&ub.grad(), &ua.grad()),
                "{kind:?} {shape:?} d up: max diff {}",
                max_abs(&ub.grad(), &ua.grad())
            );
        }
    }
    let e = silu_mul(
        &Tensor::zeros([4, 8], (Kind::Float, dev)),
        &Tensor::zeros([4, 7], (Kind::Float, dev)),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("silu_mul"), "{e}");
}

/// The SwiGLU kernel against `silu(gate) * up` in torch ops: bit-identical in every dtype, on the
/// vectorised path (16-bit dtypes, I % 8 == 0), the scalar path (odd I, fp32) and a strided row
/// view (a narrow of a wider projection output); bad shapes name the argument.
#[test]
#[ignore = "needs CUDA"]
fn swiglu_is_bit_identical_to_the_torch_ops_on_cuda() {
    let dev = gpu();
    tch::manual_seed(17);
    for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
        for (rows, inter) in [(512i64, 8960i64), (3, 13), (7, 64), (1, 24)] {
            let x = (Tensor::randn([rows, 2 * inter], (Kind::Float, dev)) * 4.0).to_kind(kind);
            let want = x.narrow(-1, 0, inter).silu() * x.narrow(-1, inter, inter);
            let got = swiglu(&x).unwrap();
            assert_eq!(got.size(), vec![rows, inter]);
            let same = got.eq_tensor(&want).all().int64_value(&[]) == 1;
            assert!(
                same,
                "{kind:?} [{rows}, {inter}]: max diff {}",
                max_abs(&got, &want)
            );
        }
        // [B, T, 2I] input, and a row-strided view (extra columns after the gate/up halves).
        let wide = Tensor::randn([6, 2 * 16 + 8], (Kind::Float, dev)).to_kind(kind);
        let x = wide.narrow(-1, 0, 32);
        let want = x.narrow(-1, 0, 16).silu() * x.narrow(-1, 16, 16);
        let got = swiglu(&x).unwrap();
        assert_eq!(
            got.eq_tensor(&want).all().int64_value(&[]),
            1,
            "{kind:?} strided"
        );
        let x3 = Tensor::randn([2, 3, 48], (Kind::Float, dev)).to_kind(kind);
        let want = x3.narrow(-1, 0, 24).silu() * x3.narrow(-1, 24, 24);
        assert_eq!(swiglu(&x3).unwrap().size(), vec![2, 3, 24]);
        assert_eq!(
            swiglu(&x3).unwrap().eq_tensor(&want).all().int64_value(&[]),
            1
        );
    }
    let e = swiglu(&Tensor::zeros([4, 7], (Kind::Float, dev)))
        .unwrap_err()
        .to_string();
    assert!(e.contains("swiglu x"), "{e}");
}

/// The residual add + RMSNorm kernel: the sum bit-identical to torch's add; the norm within one
/// rounding of an f64 reference (and of libtorch's `rms_norm`); every row's result independent
/// of the other rows of the call (a subset of rows gives the same bits); the element-wise path
/// (a hidden size that is not a multiple of 8) and the plain norm (no delta) too; bad inputs named.
#[test]
#[ignore = "needs CUDA"]
fn add_rms_norm_matches_the_sum_and_norm_on_cuda() {
    let dev = gpu();
    tch::manual_seed(23);
    for kind in [Kind::BFloat16, Kind::Half, Kind::Float] {
        for (rows, hidden) in [(512i64, 1536i64), (37, 896), (5, 4096), (9, 100), (3, 8)] {
            let x = (Tensor::randn([rows, hidden], (Kind::Float, dev)) * 3.0).to_kind(kind);
            let d = Tensor::randn([rows, hidden], (Kind::Float, dev)).to_kind(kind);
            let w = (Tensor::rand([hidden], (Kind::Float, dev)) + 0.5).to_kind(kind);
            let eps = 1e-6;
            let (sum, out) = add_rms_norm(&x, Some(&d), &w, eps).unwrap();
            let sum = sum.expect("a sum with a delta");
            let want_sum = &x + &d;
            assert!(
                bits_equal(&sum, &want_sum),
                "{kind:?} [{rows}, {hidden}] sum"
            );
            let h = want_sum.to_kind(Kind::Double);
            let rstd = (h.square().mean_dim([-1i64].as_slice(), true, Kind::Double) + eps).rsqrt();
            let want = &h * rstd * w.to_kind(Kind::Double);
            let tol = match kind {
                Kind::BFloat16 => 1e-2,
                Kind::Half => 2e-3,
                _ => 1e-5,
            };
            let err = ((out.to_kind(Kind::Double) - &want).abs() / (want.abs() + 1.0))
                .max()
                .double_value(&[]);
            assert!(
                err < tol,
                "{kind:?} [{rows}, {hidden}]: norm differs by {err}"
            );
            let torch = want_sum.rms_norm([hidden].as_slice(), Some(&w), eps);
            let err = ((out.to_kind(Kind::Double) - torch.to_kind(Kind::Double)).abs()
                / (torch.to_kind(Kind::Double).abs() + 1.0))
                .max()
                .double_value(&[]);
            assert!(err < tol, "{kind:?} [{rows}, {hidden}]: vs rms_norm {err}");
            // Row consistency: the last rows alone, in a fresh call.
            let k = (rows / 2).max(1);
            let (s2, o2) = add_rms_norm(
                &x.narrow(0, rows - k, k),
                Some(&d.narrow(0, rows - k, k)),
                &w,
                eps,
            )
            .unwrap();
            assert!(bits_equal(&s2.unwrap(), &sum.narrow(0, rows - k, k)));
            assert!(
                bits_equal(&o2, &out.narrow(0, rows - k, k)),
                "{kind:?} [{rows}, {hidden}]: rows depend on the call"
            );
            // No delta: the norm of the sum, bit for bit the same as with the delta.
            let (none, o3) = add_rms_norm(&sum, None, &w, eps).unwrap();
            assert!(none.is_none());
            assert!(
                bits_equal(&o3, &out),
                "{kind:?} [{rows}, {hidden}]: plain norm"
            );
        }
    }
    // [B, T, H] keeps its shape.
    let x = Tensor::randn([2, 3, 64], (Kind::BFloat16, dev));
    let (s, o) = add_rms_norm(
        &x,
        Some(&x),
        &Tensor::ones([64], (Kind::BFloat16, dev)),
        1e-5,
    )
    .unwrap();
    assert_eq!(s.unwrap().size(), vec![2, 3, 64]);
    assert_eq!(o.size(), vec![2, 3, 64]);
    let w = Tensor::ones([63], (Kind::BFloat16, dev));
    let e = add_rms_norm(&x, None, &w, 1e-5).unwrap_err().to_string();
    assert!(e.contains("add_rms_norm weight"), "{e}");
    let e = add_rms_norm(&x, Some(&x.narrow(-1, 0, 32)), &w, 1e-5)
        .unwrap_err()
        .to_string();
    assert!(e.contains("add_rms_norm delta"), "{e}");
}

/// max |a - b| over max |b| (1 where b is all zero).
fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    let b = b.to_kind(Kind::Double);
    let scale = b.abs().max().double_value(&[]).max(1e-30);
    max_abs(a, &b) / scale
}

/// The training add + RMSNorm (recorded by autograd) against the same math in fp64 through
/// autograd: the sum and the norm bit for bit the no-grad kernel's, x and delta one gradient
/// (the sum's own plus the norm's), the weight's gradient summed over every row; with the sum or
/// the norm unused, and without a delta; hidden sizes taking each of the backward's register
/// layouts (one, two and four 8-element chunks per thread).
#[test]
#[ignore = "needs CUDA"]
fn add_rms_norm_autograd_matches_fp64_autograd_on_cuda() {
    let dev = gpu();
    tch::manual_seed(31);
    let eps = 1e-6;
    for kind in [Kind::BFloat16, Kind::Half] {
        let tol = if kind == Kind::BFloat16 { 1e-2 } else { 2e-3 };
        for shape in [
            vec![4i64, 97, 1536],
            vec![3, 896],
            vec![1000, 64],
            vec![7, 3584],
            vec![2, 3, 8192],
        ] {
            let hidden = *shape.last().unwrap();
            let mk = |scale: f64| {
                (Tensor::randn(shape.as_slice(), (Kind::Float, dev)) * scale).to_kind(kind)
            };
            let (x0, d0, gy, gh) = (mk(2.0), mk(1.0), mk(1.0), mk(0.5));
            let w0 = (Tensor::rand([hidden], (Kind::Float, dev)) + 0.5).to_kind(kind);
            assert!(add_rms_norm_autograd_applies(&x0, &w0));
            // (use the sum, use the norm) for each case, and with or without a delta.
            for (use_sum, use_norm, with_delta) in [
                (true, true, true),
                (false, true, true),
                (true, false, true),
                (false, true, false),
            ] {
                let leaf = |t: &Tensor| t.detach().set_requires_grad(true);
                let (x, d, w) = (leaf(&x0), leaf(&d0), leaf(&w0));
                let (sum, out) =
                    add_rms_norm_autograd(&x, with_delta.then_some(&d), &w, eps).unwrap();
                let (want_sum, want_out) =
                    add_rms_norm(&x0, with_delta.then_some(&d0), &w0, eps).unwrap();
                assert_eq!(sum.is_some(), with_delta);
                if let (Some(s), Some(ws)) = (&sum, &want_sum) {
                    assert!(bits_equal(s, ws), "{kind:?} {shape:?}: sum");
                }
                assert!(bits_equal(&out, &want_out), "{kind:?} {shape:?}: norm");
                let mut loss = Tensor::zeros([], (Kind::Float, dev));
                if use_norm {
                    loss += (&out * &gy).sum(Kind::Float);
                }
                if use_sum {
                    loss += (sum.as_ref().unwrap() * &gh).sum(Kind::Float);
                }
                loss.backward();

                // fp64 reference on the rounded sum (rounding passes gradients through).
                let h = match with_delta {
                    true => (&x0 + &d0).to_kind(Kind::Double),
                    false => x0.to_kind(Kind::Double),
                }
                .set_requires_grad(true);
                let wd = w0.to_kind(Kind::Double).set_requires_grad(true);
                let rstd =
                    (h.square().mean_dim([-1i64].as_slice(), true, Kind::Double) + eps).rsqrt();
                let y = &h * rstd * &wd;
                let mut loss = Tensor::zeros([], (Kind::Double, dev));
                if use_norm {
                    loss += (&y * gy.to_kind(Kind::Double)).sum(Kind::Double);
                }
                if use_sum {
                    loss += (&h * gh.to_kind(Kind::Double)).sum(Kind::Double);
                }
                loss.backward();
                let case = format!("{kind:?} {shape:?} sum {use_sum} norm {use_norm}");
                let err = rel_err(&x.grad(), &h.grad());
                assert!(err < tol, "{case}: d x differs by {err}");
                if with_delta {
                    assert!(bits_equal(&x.grad(), &d.grad()), "{case}: d delta != d x");
                }
                if use_norm {
                    let err = rel_err(&w.grad(), &wd.grad());
                    assert!(err < tol, "{case}: d weight differs by {err}");
                } else {
                    assert!(
                        !w.grad().defined() || w.grad().abs().max().double_value(&[]) == 0.0,
                        "{case}: a weight gradient without the norm"
                    );
                }
            }
        }
    }
    // Bad inputs name the argument.
    let x = Tensor::randn([2, 64], (Kind::BFloat16, dev));
    let e = add_rms_norm_autograd(&x, Some(&x.narrow(1, 0, 32)), &x.narrow(0, 0, 1), 1e-6)
        .unwrap_err()
        .to_string();
    assert!(e.contains("add_rms_norm delta"), "{e}");
    assert!(!add_rms_norm_autograd_applies(
        &Tensor::randn([2, 60], (Kind::BFloat16, dev)),
        &Tensor::ones([60], (Kind::BFloat16, dev))
    ));
    assert!(!add_rms_norm_autograd_applies(
        &Tensor::randn([2, 64], (Kind::Float, dev)),
        &Tensor::ones([64], (Kind::Float, dev))
    ));
}

/// `add_rms_norm_accumulating`: the same forward and input gradients as `add_rms_norm_autograd`
/// (bit for bit), and the weight's gradient summed straight into `weight.grad` over three
/// micro-batches (made on the first; one rounding each), as fp64 autograd accumulates it; autograd
/// itself hands the weight nothing.
#[test]
#[ignore = "needs CUDA"]
fn add_rms_norm_accumulating_sums_the_weight_gradient_into_grad_on_cuda() {
    let dev = gpu();
    tch::manual_seed(37);
    let eps = 1e-6;
    for (kind, hidden) in [
        (Kind::BFloat16, 1536i64),
        (Kind::Half, 3584),
        (Kind::BFloat16, 64),
    ] {
        let w0 = (Tensor::rand([hidden], (Kind::Float, dev)) + 0.5).to_kind(kind);
        let w = w0.detach().copy().set_requires_grad(true);
        let w_auto = w0.detach().copy().set_requires_grad(true);
        let wd = w0.to_kind(Kind::Double).set_requires_grad(true);
        for mb in 0..3 {
            let mk = |scale: f64| {
                (Tensor::randn([300, hidden], (Kind::Float, dev)) * scale).to_kind(kind)
            };
            let (x0, d0, gy) = (mk(2.0), mk(1.0), mk(1.0));
            let leaf = |t: &Tensor| t.detach().copy().set_requires_grad(true);
            let (x, x_auto) = (leaf(&x0), leaf(&x0));
            let (_, out) = add_rms_norm_accumulating(&x, Some(&d0), &w, eps).unwrap();
            let (_, out_auto) = add_rms_norm_autograd(&x_auto, Some(&d0), &w_auto, eps).unwrap();
            assert!(
                bits_equal(&out, &out_auto),
                "{kind:?} {hidden} forward {mb}"
            );
            (&out * &gy).sum(Kind::Float).backward();
            (&out_auto * &gy).sum(Kind::Float).backward();
            assert!(
                bits_equal(&x.grad(), &x_auto.grad()),
                "{kind:?} {hidden}: d x {mb}"
            );
            let h = (&x0 + &d0).to_kind(Kind::Double);
            let rstd = (h.square().mean_dim([-1i64].as_slice(), true, Kind::Double) + eps).rsqrt();
            (&h * rstd * &wd * gy.to_kind(Kind::Double))
                .sum(Kind::Double)
                .backward();
            let err = rel_err(&w.grad(), &wd.grad());
            assert!(
                err < 1e-2,
                "{kind:?} {hidden}: weight .grad after {mb} differs by {err}"
            );
            assert_eq!(w.grad().kind(), kind);
            // Close to autograd's accumulation (which rounds each micro-batch's sum before
            // adding it).
            let err = rel_err(&w.grad(), &w_auto.grad());
            assert!(
                err < 1e-2,
                "{kind:?} {hidden}: vs autograd's .grad after {mb}: {err}"
            );
        }
        // The weight gets nothing through autograd itself.
        let x = Tensor::randn([5, hidden], (kind, dev)).set_requires_grad(true);
        let wl = w0.detach().copy().set_requires_grad(true);
        let (_, out) = add_rms_norm_accumulating(&x, None, &wl, eps).unwrap();
        let got = Tensor::run_backward(&[out.sum(Kind::Float)], &[&x, &wl], false, true);
        assert!(got[0].defined());
        assert!(!got[1].defined() || got[1].abs().max().double_value(&[]) == 0.0);
    }
}

/// The row gather with the atomics-free backward: the forward is `index_select` bit for bit; the
/// backward sums each row's readers (a shared prompt read by every sample, rows read once, rows
/// never read) as the fp64 `index_add` does, to the dtype's rounding, on the vector path
/// (16-bit, 8 | row length) and the element path (fp32, odd row length).
#[test]
#[ignore = "needs CUDA"]
fn gather_rows_backward_sums_each_rows_readers_on_cuda() {
    let dev = gpu();
    tch::manual_seed(37);
    // 5 stream rows: 0..2 a prompt read by three sequences, 3 read once, 4 never read.
    let index: Vec<i64> = vec![0, 1, 2, 3, 0, 1, 2, 0, 1, 2];
    let (offsets, sources) = gather_rows_inverse(&index, 5).unwrap();
    let up = |v: &[i64]| Tensor::from_slice(v).to_device(dev);
    let (idx, off, src) = (up(&index), up(&offsets), up(&sources));
    for (kind, tail, tol) in [
        (Kind::BFloat16, vec![2i64, 64], 1e-2),
        (Kind::Half, vec![2, 128], 2e-3),
        (Kind::Float, vec![3, 5], 1e-6),
    ] {
        let mut shape = vec![5i64];
        shape.extend(&tail);
        let x0 = Tensor::randn(shape.as_slice(), (Kind::Float, dev)).to_kind(kind);
        let x = x0.detach().set_requires_grad(true);
        let y = gather_rows(&x, &idx, &off, &src).unwrap();
        assert!(
            bits_equal(&y, &x0.index_select(0, &idx)),
            "{kind:?} forward"
        );
        let g = Tensor::randn(y.size().as_slice(), (Kind::Float, dev)).to_kind(kind);
        (&y * &g).sum(Kind::Float).backward();
        let want = Tensor::zeros(shape.as_slice(), (Kind::Double, dev)).index_add(
            0,
            &idx,
            &g.to_kind(Kind::Double),
        );
        let err = rel_err(&x.grad(), &want);
        assert!(err < tol, "{kind:?}: backward differs by {err}");
        assert_eq!(
            x.grad().get(4).abs().max().double_value(&[]),
            0.0,
            "{kind:?}: an unread row has a gradient"
        );
    }
    let x = Tensor::randn([4, 8], (Kind::BFloat16, dev));
    let e = gather_rows(&x, &idx, &off, &src).unwrap_err().to_string();
    assert!(e.contains("gather_rows offsets"), "{e}");
}

/// The decode step's fused rotary embedding + KV-cache write against `rope` and `index_copy_`:
/// q rotated bit-identically, k rotated and v copied into exactly their slots (every other cache
/// row untouched), from q/k/v slices of one fused projection output as the model passes them.
#[test]
#[ignore = "needs CUDA"]
fn rope_store_equals_rope_then_the_cache_write_on_cuda() {
    let dev = gpu();
    tch::manual_seed(19);
    for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
        for (s, h, kvh, d) in [(5i64, 4i64, 2i64, 64i64), (512, 12, 2, 128), (3, 14, 2, 64)] {
            let qkv = Tensor::randn([s, (h + 2 * kvh) * d], (Kind::Float, dev)).to_kind(kind);
            let q = qkv.narrow(1, 0, h * d).view([s, h, d]);
            let k = qkv.narrow(1, h * d, kvh * d).view([s, kvh, d]);
            let v = qkv.narrow(1, (h + kvh) * d, kvh * d).view([s, kvh, d]);
            let pos = Tensor::randint(4000, [s], (Kind::Int64, dev)).to_kind(Kind::Float);
            let inv = Tensor::arange_start_step(0, d, 2, (Kind::Float, dev)) / d as f64;
            let inv = Tensor::from(10000.0f64)
                .to_device(dev)
                .pow(&inv)
                .reciprocal();
            let freqs = pos.unsqueeze(-1) * inv;
            let emb = Tensor::cat(&[&freqs, &freqs], -1);
            let (cos, sin) = (emb.cos().to_kind(kind), emb.sin().to_kind(kind));
            let rows = 4 * s + 3;
            let slots = Tensor::randperm(rows, (Kind::Int64, dev)).narrow(0, 0, s);
            let k_cache = Tensor::randn([rows, kvh, d], (Kind::Float, dev)).to_kind(kind);
            let v_cache = Tensor::randn([rows, kvh, d], (Kind::Float, dev)).to_kind(kind);
            // Reference: rope on [B=S, heads, T=1, D] views, then index_copy_ into copies.
            let as4 = |x: &Tensor| x.unsqueeze(2);
            let want_q = rope(&as4(&q), &cos.unsqueeze(1), &sin.unsqueeze(1))
                .unwrap()
                .squeeze_dim(2);
            let want_k = rope(&as4(&k), &cos.unsqueeze(1), &sin.unsqueeze(1))
                .unwrap()
                .squeeze_dim(2);
            let mut want_kc = k_cache.copy();
            let mut want_vc = v_cache.copy();
            let _ = want_kc.index_copy_(0, &slots, &want_k);
            let _ = want_vc.index_copy_(0, &slots, &v.contiguous());
            let got_q = rope_store(&q, &k, &v, &cos, &sin, &slots, &k_cache, &v_cache).unwrap();
            let same = |a: &Tensor, b: &Tensor| a.eq_tensor(b).all().int64_value(&[]) == 1;
            let what = format!("{kind:?} s={s} h={h}/{kvh} d={d}");
            assert!(got_q.is_contiguous());
            assert!(same(&got_q, &want_q), "{what}: q differs");
            assert!(same(&k_cache, &want_kc), "{what}: k cache differs");
            assert!(same(&v_cache, &want_vc), "{what}: v cache differs");
        }
    }
    // A cache of the wrong head count is named.
    let q = Tensor::zeros([2, 4, 8], (Kind::Float, dev));
    let k = Tensor::zeros([2, 2, 8], (Kind::Float, dev));
    let cs = Tensor::zeros([2, 8], (Kind::Float, dev));
    let slots = Tensor::zeros([2], (Kind::Int64, dev));
    let bad = Tensor::zeros([4, 3, 8], (Kind::Float, dev));
    let e = rope_store(&q, &k, &k, &cs, &cs, &slots, &bad, &bad)
        .unwrap_err()
        .to_string();
    assert!(e.contains("cache"), "{e}");
}

/// `inject_grads` with `b_into_grad`: b's gradient `gb · g` goes into `b.grad` (written on the
/// first backward, added in one rounding after), a's still through autograd; a non-leaf `b` is
/// refused. Runs on the CPU wherever the extension was built with CUDA (the function's
/// requirement; libtorch's in-place op in row blocks there) and on a GPU in the `_on_cuda` test
/// (one kernel there), in bf16 and fp16.
#[test]
fn inject_grads_into_grad_adds_into_the_leafs_grad() {
    assert_cuda_build();
    for kind in [Kind::BFloat16, Kind::Half] {
        inject_into_grad_case(Device::Cpu, kind);
    }
}

#[test]
#[ignore = "needs CUDA"]
fn inject_grads_into_grad_adds_into_the_leafs_grad_on_cuda() {
    let dev = gpu();
    for kind in [Kind::BFloat16, Kind::Half] {
        inject_into_grad_case(dev, kind);
    }
}

fn inject_into_grad_case(dev: Device, kind: Kind) {
    use verl_torch_ext::inject_grads;
    tch::manual_seed(31);
    let f32c = (Kind::Float, dev);
    // 40 rows of 24: the GPU kernel's 8-wide path.
    let w = Tensor::randn([40, 24], f32c)
        .to_kind(kind)
        .set_requires_grad(true);
    let a = Tensor::randn([2, 3], f32c).set_requires_grad(true);
    let value = Tensor::zeros([], f32c);
    let mut want: Option<Tensor> = None;
    for mb in 0..3 {
        let ga = Tensor::randn([2, 3], f32c);
        let gb = Tensor::randn([40, 24], f32c);
        let out = inject_grads(&value, &a, Some(&ga), &w, Some(&gb), true).unwrap();
        (out * 0.5).backward();
        let w_new = match &want {
            None => (&gb * 0.5).to_kind(kind),
            Some(prev) => (prev.to_kind(Kind::Float) + &gb * 0.5).to_kind(kind),
        };
        assert!(
            bits_equal(&w.grad(), &w_new),
            "{dev:?} {kind:?} micro-batch {mb}"
        );
        want = Some(w_new);
        if mb == 0 {
            assert!(
                bits_equal(&a.grad(), &(&ga * 0.5)),
                "a's gradient through autograd"
            );
        }
    }
    // Without: autograd's accumulation gets b's gradient.
    let w2 = Tensor::zeros([3, 4], (kind, dev)).set_requires_grad(true);
    let gb = Tensor::randn([3, 4], f32c);
    let ga = Tensor::randn([2, 3], f32c);
    let out = inject_grads(&value, &a, Some(&ga), &w2, Some(&gb), false).unwrap();
    (out * 2.0).backward();
    assert!(bits_equal(&w2.grad(), &(&gb * 2.0).to_kind(kind)));
    // No gradient for a (or for b): that input gets none, the other its own.
    let a2 = Tensor::randn([2, 3], f32c).set_requires_grad(true);
    let w3 = Tensor::zeros([3, 4], (kind, dev)).set_requires_grad(true);
    let out = inject_grads(&value, &a2, None, &w3, Some(&gb), true).unwrap();
    out.backward();
    assert!(!a2.grad().defined());
    assert!(bits_equal(&w3.grad(), &gb.to_kind(kind)));
    let out = inject_grads(&value, &a2, Some(&ga), &w3, None, false).unwrap();
    out.backward();
    assert!(bits_equal(&a2.grad(), &ga));
    assert!(bits_equal(&w3.grad(), &gb.to_kind(kind)), "b untouched");
    // A non-leaf cannot take its gradient into .grad.
    let nonleaf = &w2 * 1.0;
    let e = inject_grads(&value, &a, Some(&ga), &nonleaf, Some(&gb), true)
        .unwrap_err()
        .to_string();
    assert!(e.contains("leaf"), "{e}");
}

/// `inject_grads_product`: b's gradient `lhsᵀ·rhs` scaled by the arriving gradient, into `.grad`
/// (one GEMM accumulating into it on CUDA, written where there is none yet) or to autograd; `a`
/// gets its own gradient either way. Against the product in f64, within one rounding of the dtype.
#[test]
fn inject_grads_product_adds_the_product_into_grad() {
    assert_cuda_build();
    for kind in [Kind::BFloat16, Kind::Half] {
        inject_product_case(Device::Cpu, kind, 40, 24, 33);
    }
}

#[test]
#[ignore = "needs CUDA"]
fn inject_grads_product_adds_the_product_into_grad_on_cuda() {
    let dev = gpu();
    for kind in [Kind::BFloat16, Kind::Half] {
        inject_product_case(dev, kind, 40, 24, 33);
        // The LM head's shape class: a long vocabulary side, more tokens than one tile.
        inject_product_case(dev, kind, 3000, 64, 700);
    }
}

fn inject_product_case(dev: Device, kind: Kind, rows: i64, cols: i64, k: i64) {
    use verl_torch_ext::inject_grads_product;
    tch::manual_seed(47);
    let f32c = (Kind::Float, dev);
    let w = (Tensor::randn([rows, cols], f32c) * 0.1)
        .to_kind(kind)
        .set_requires_grad(true);
    let a = Tensor::randn([2, 3], f32c).set_requires_grad(true);
    let value = Tensor::zeros([], f32c);
    // Within one rounding of the dtype of the f64 value, plus fp32 accumulation error (a few fp32
    // ulps of the sum of the terms' magnitudes, `mag`).
    let close = |got: &Tensor, want: &Tensor, mag: &Tensor, what: &str| {
        let want64 = want.to_kind(Kind::Double);
        let err = (got.to_kind(Kind::Double) - &want64).abs();
        let ulp = if kind == Kind::BFloat16 {
            2f64.powi(-8)
        } else {
            2f64.powi(-11)
        };
        let bound = want64.abs() * ulp + mag * 2f64.powi(-16) + 1e-30;
        let worst = (err - bound).max().double_value(&[]);
        assert!(
            worst <= 0.0,
            "{dev:?} {kind:?} {what}: beyond one rounding by {worst:e}"
        );
    };
    let mut want: Option<Tensor> = None;
    for mb in 0..3 {
        let lhs = (Tensor::randn([k, rows], f32c) * 0.3).to_kind(kind);
        let rhs = (Tensor::randn([k, cols], f32c) * 0.3).to_kind(kind);
        let ga = Tensor::randn([2, 3], f32c);
        let out = inject_grads_product(&value, &a, Some(&ga), &w, &lhs, &rhs, true).unwrap();
        (out * 0.5).backward();
        let prod = lhs
            .to_kind(Kind::Double)
            .tr()
            .matmul(&rhs.to_kind(Kind::Double))
            * 0.5;
        let mag = lhs
            .to_kind(Kind::Double)
            .abs()
            .tr()
            .matmul(&rhs.to_kind(Kind::Double).abs())
            * 0.5;
        let exact = match &want {
            None => prod,
            Some(prev) => prev.to_kind(Kind::Double) + prod,
        };
        let mag = match &want {
            None => mag,
            Some(prev) => prev.to_kind(Kind::Double).abs() + mag,
        };
        close(&w.grad(), &exact, &mag, &format!("micro-batch {mb}"));
        if let (Some(prev), true) = (&want, dev.is_cuda()) {
            // What libtorch's own accumulating GEMM gives (informational: how cuBLAS rounds).
            let theirs = prev.addmm(&lhs.tr(), &(&rhs * 0.5));
            let differ = theirs
                .ne_tensor(&w.grad())
                .sum(Kind::Int64)
                .int64_value(&[]);
            eprintln!("{dev:?} {kind:?} {rows}x{cols}: {differ} elements differ from addmm");
        }
        // The next micro-batch adds to what is there, rounded as stored.
        want = Some(w.grad().copy());
        if mb == 0 {
            assert!(bits_equal(&a.grad(), &(&ga * 0.5)), "a's gradient");
        }
    }
    // Without `b_into_grad`: autograd's accumulation gets the product.
    let w2 = Tensor::zeros([rows, cols], (kind, dev)).set_requires_grad(true);
    let lhs = (Tensor::randn([k, rows], f32c) * 0.3).to_kind(kind);
    let rhs = (Tensor::randn([k, cols], f32c) * 0.3).to_kind(kind);
    let out = inject_grads_product(&value, &a, None, &w2, &lhs, &rhs, false).unwrap();
    (out * 2.0).backward();
    let exact = lhs
        .to_kind(Kind::Double)
        .tr()
        .matmul(&rhs.to_kind(Kind::Double))
        * 2.0;
    let mag = lhs
        .to_kind(Kind::Double)
        .abs()
        .tr()
        .matmul(&rhs.to_kind(Kind::Double).abs())
        * 2.0;
    close(&w2.grad(), &exact, &mag, "through autograd");
    // Factors that do not make b's shape are refused, naming both.
    let e = inject_grads_product(&value, &a, None, &w2, &rhs, &lhs, true)
        .unwrap_err()
        .to_string();
    assert!(e.contains("product") && e.contains("rhs"), "{e}");
}
