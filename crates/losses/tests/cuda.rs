//! The same computations on a CUDA device (ignored as "needs CUDA": `make test-gpu`): the chunked
//! LM head in bf16 against full fp32 logits at a realistic vocabulary size, and the policy / agg
//! losses against the CPU.

mod common;

use tch::{Device, Kind, Tensor};
use verl_losses::{
    logprobs_from_logits, ActorInputs, ActorLoss, ActorLossConfig, ChunkedLmHead, LossScale,
    MaskCounts, Normaliser, PolicyLossSection,
};
use verl_test_support::cuda::cuda_device;

use common::{max_rel_err, to_vec, Lcg};

#[test]
#[ignore = "needs CUDA"]
fn chunked_bf16_lm_head_matches_fp32_full_logits_on_cuda() {
    let dev = cuda_device();
    tch::manual_seed(0);
    let (n, h, v) = (4096i64, 512i64, 32000i64);
    let hidden32 = (Tensor::randn([n, h], (Kind::Float, dev)) * 0.5).set_requires_grad(true);
    let w32 = (Tensor::randn([v, h], (Kind::Float, dev)) * 0.05).set_requires_grad(true);
    let targets = Tensor::randint(v, [n], (Kind::Int64, dev));
    let adv = Tensor::randn([n], (Kind::Float, dev));
    let temperature = 0.8;

    // Reference: fp32 logits of the bf16-rounded operands, all [n, v] at once.
    let hb = hidden32.detach().to_kind(Kind::BFloat16);
    let wb = w32.detach().to_kind(Kind::BFloat16);
    let h_ref = hb.to_kind(Kind::Float).set_requires_grad(true);
    let w_ref = wb.to_kind(Kind::Float).set_requires_grad(true);
    let logits = h_ref.matmul(&w_ref.tr()) / temperature;
    let lp_ref = logprobs_from_logits(&logits, &targets).unwrap();
    (&lp_ref * &adv).mean(Kind::Float).neg().backward();

    let h = hb.set_requires_grad(true);
    let w = wb.set_requires_grad(true);
    let head = ChunkedLmHead::new(1024, temperature, true);
    let (_loss, stats) = head
        .loss_and_backward(&h, &w, &targets, |lp, _| {
            Ok((lp * &adv).mean(Kind::Float).neg())
        })
        .unwrap();
    let lp_err = max_rel_err(&to_vec(&stats.log_probs), &to_vec(&lp_ref), 1.0);
    // bf16 matmul accumulates in fp32 on tensor cores; differences come from the logits' bf16 output rounding.
    assert!(lp_err < 5e-2, "log-prob abs err {lp_err}");
    let gh = max_rel_err(&to_vec(&h.grad()), &to_vec(&h_ref.grad()), 1e-3);
    let gw = max_rel_err(&to_vec(&w.grad()), &to_vec(&w_ref.grad()), 1e-3);
    eprintln!("cuda bf16 chunked: logπ abs err {lp_err:.2e}, grad hidden rel {gh:.2e}, grad W rel {gw:.2e}");
    assert!(gh < 5e-2 && gw < 5e-2, "grad errors {gh} {gw}");
}

#[test]
#[ignore = "needs CUDA"]
fn actor_loss_matches_cpu_in_f64_on_cuda() {
    let dev = cuda_device();
    let (b, t) = (8i64, 16i64);
    let mut rng = Lcg(5);
    let old = rng.tensor(&[b, t], 1.0) - 1.0;
    let theta = rng.tensor(&[b, t], 0.5);
    let adv = rng.tensor(&[b, 1], 2.0).expand([b, t], false).contiguous();
    let lens: Vec<f64> = (0..b * t)
        .map(|i| if i % t < 1 + (i / t) * 2 { 1.0 } else { 0.0 })
        .collect();
    let mask = Tensor::from_slice(&lens).reshape([b, t]);
    let refl = rng.tensor(&[b, t], 1.0) - 1.0;
    let loss = ActorLoss::from_config(&ActorLossConfig {
        policy_loss: PolicyLossSection {
            loss_mode: "vanilla".into(),
        },
        use_kl_loss: true,
        kl_loss_type: "low_var_kl".into(),
        ..ActorLossConfig::default()
    })
    .unwrap();
    let norm = Normaliser::Global(LossScale::new(MaskCounts::of_mask(&mask).unwrap(), 1));
    let run = |d: Device| {
        // A fresh leaf per device: `to_device(Cpu)` on a CPU tensor would alias `theta` itself.
        let th = theta.to_device(d).detach().set_requires_grad(true);
        let o = old.to_device(d);
        let lp = &o + &th;
        let out = loss
            .compute(
                &ActorInputs {
                    old_log_prob: &o,
                    log_prob: &lp,
                    advantages: &adv.to_device(d),
                    response_mask: &mask.to_device(d),
                    entropy: None,
                    ref_log_prob: Some(&refl.to_device(d)),
                    rollout_is_weights: None,
                },
                &norm,
            )
            .unwrap();
        out.loss.backward();
        (out.metrics, to_vec(&th.grad()))
    };
    let (m_cpu, g_cpu) = run(Device::Cpu);
    let (m_gpu, g_gpu) = run(dev);
    for (k, v) in &m_cpu {
        assert!(
            (v - m_gpu[k]).abs() <= 1e-12 * v.abs().max(1.0),
            "{k}: cpu {v} cuda {}",
            m_gpu[k]
        );
    }
    assert!(max_rel_err(&g_gpu, &g_cpu, 1e-12) < 1e-10);
}

/// On CUDA the chunked head runs the fused kernels (statistics in one pass, the logits' gradient
/// in one more, the head's GEMMs by hand): in fp32 they must match full-logits autograd in fp64,
/// entropy term and temperature included, across several chunks.
#[test]
#[ignore = "needs CUDA"]
fn fused_lm_head_matches_full_logits_autograd_in_fp32_on_cuda() {
    let dev = cuda_device();
    tch::manual_seed(4);
    let (n, h, v) = (300i64, 64i64, 5000i64);
    let hidden = Tensor::randn([n, h], (Kind::Float, dev));
    let w = Tensor::randn([v, h], (Kind::Float, dev)) * 0.1;
    let targets = Tensor::randint(v, [n], (Kind::Int64, dev));
    let adv = Tensor::randn([n], (Kind::Float, dev));
    let temperature = 0.7;

    let h64 = hidden.to_kind(Kind::Double).set_requires_grad(true);
    let w64 = w.to_kind(Kind::Double).set_requires_grad(true);
    let x = h64.matmul(&w64.tr()) / temperature;
    let lse = x.logsumexp([-1i64].as_slice(), false);
    let lp_ref = x.gather(-1, &targets.unsqueeze(-1), false).squeeze_dim(-1) - &lse;
    let ent_ref = &lse
        - (x.softmax(-1, Kind::Double) * &x).sum_dim_intlist(
            [-1i64].as_slice(),
            false,
            Kind::Double,
        );
    let adv64 = adv.to_kind(Kind::Double);
    ((&lp_ref * &adv64).mean(Kind::Double).neg() + ent_ref.mean(Kind::Double) * 0.01).backward();

    let hl = hidden.set_requires_grad(true);
    let wl = w.set_requires_grad(true);
    let head = ChunkedLmHead::new(128, temperature, true);
    let (_loss, stats) = head
        .loss_and_backward(&hl, &wl, &targets, |lp, ent| {
            Ok((lp * &adv).mean(Kind::Float).neg() + ent.unwrap().mean(Kind::Float) * 0.01)
        })
        .unwrap();
    let lp_err = max_rel_err(&to_vec(&stats.log_probs), &to_vec(&lp_ref), 1.0);
    let ent_err = max_rel_err(&to_vec(&stats.entropy.unwrap()), &to_vec(&ent_ref), 1.0);
    let gh = max_rel_err(&to_vec(&hl.grad()), &to_vec(&h64.grad()), 1e-4);
    let gw = max_rel_err(&to_vec(&wl.grad()), &to_vec(&w64.grad()), 1e-4);
    eprintln!(
        "fused fp32 head: lp {lp_err:.1e} entropy {ent_err:.1e} grad h {gh:.1e} grad W {gw:.1e}"
    );
    assert!(lp_err < 1e-4 && ent_err < 1e-4, "values {lp_err} {ent_err}");
    assert!(gh < 1e-3 && gw < 1e-3, "grads {gh} {gw}");
}

/// The fused head's surrogate on CUDA (gradients handed to hidden and weight by one autograd
/// node) with a tied weight: the hidden states are an embedding lookup of the same weight, so
/// the weight's gradient sums the head's and the embedding's, as full-logits autograd on the
/// CPU computes it; a bf16 weight gets it in bf16.
#[test]
#[ignore = "needs CUDA"]
fn fused_surrogate_with_a_tied_weight_matches_the_cpu_on_cuda() {
    let dev = cuda_device();
    tch::manual_seed(5);
    let (n, h, v) = (260i64, 32i64, 3000i64);
    let w0 = Tensor::randn([v, h], (Kind::Float, Device::Cpu)) * 0.2;
    let ids = Tensor::randint(v, [n], (Kind::Int64, Device::Cpu));
    let targets = Tensor::randint(v, [n], (Kind::Int64, Device::Cpu));
    let adv = Tensor::randn([n], (Kind::Float, Device::Cpu));
    let run = |dev: Device, kind: Kind| -> (Tensor, Tensor) {
        let w = w0
            .to_device(dev)
            .to_kind(kind)
            .detach()
            .set_requires_grad(true);
        let hidden = Tensor::embedding(&w, &ids.to_device(dev), -1, false, false) * 1.5;
        let head = ChunkedLmHead::new(64, 0.9, true);
        let adv = adv.to_device(dev);
        let (surrogate, stats) = head
            .loss_and_surrogate(&hidden, &w, &targets.to_device(dev), |lp, ent| {
                Ok((lp * &adv).mean(Kind::Float).neg() + ent.unwrap().mean(Kind::Float) * 0.01)
            })
            .unwrap();
        surrogate.backward();
        (w.grad(), stats.log_probs)
    };
    let (g_cpu, lp_cpu) = run(Device::Cpu, Kind::Float);
    let (g_cuda, lp_cuda) = run(dev, Kind::Float);
    let lp_err = max_rel_err(&to_vec(&lp_cuda), &to_vec(&lp_cpu), 1.0);
    let gw = max_rel_err(&to_vec(&g_cuda), &to_vec(&g_cpu), 1e-4);
    assert!(
        lp_err < 1e-4 && gw < 1e-3,
        "fp32: log-probs {lp_err}, tied grad {gw}"
    );
    let (g_bf16, _) = run(dev, Kind::BFloat16);
    assert_eq!(g_bf16.kind(), Kind::BFloat16);
    let gb = max_rel_err(&to_vec(&g_bf16), &to_vec(&g_cpu), 1e-2);
    assert!(gb < 5e-2, "bf16 tied grad {gb}");
}

/// Logits kept from the forward for the backward (a budget for two of three chunks) give the
/// same log-probs and bit-identical gradients as recomputing them.
#[test]
#[ignore = "needs CUDA"]
fn kept_logits_give_the_recomputed_gradients_on_cuda() {
    let dev = cuda_device();
    tch::manual_seed(6);
    let (n, h, v) = (300i64, 64i64, 4000i64);
    let hidden = (Tensor::randn([n, h], (Kind::Float, dev)) * 0.5).to_kind(Kind::BFloat16);
    let w = (Tensor::randn([v, h], (Kind::Float, dev)) * 0.1).to_kind(Kind::BFloat16);
    let targets = Tensor::randint(v, [n], (Kind::Int64, dev));
    let adv = Tensor::randn([n], (Kind::Float, dev));
    let run = |budget: u64| {
        let hl = hidden.detach().set_requires_grad(true);
        let wl = w.detach().set_requires_grad(true);
        let head = ChunkedLmHead::new(100, 0.8, true).with_kept_logits(budget);
        let (_, stats) = head
            .loss_and_backward(&hl, &wl, &targets, |lp, ent| {
                Ok((lp * &adv).mean(Kind::Float).neg() + ent.unwrap().mean(Kind::Float) * 0.01)
            })
            .unwrap();
        (stats.log_probs, hl.grad(), wl.grad())
    };
    let (lp0, gh0, gw0) = run(0);
    let (lp1, gh1, gw1) = run(2 * 100 * 4000 * 4);
    for (a, b, what) in [
        (&lp0, &lp1, "log-probs"),
        (&gh0, &gh1, "grad hidden"),
        (&gw0, &gw1, "grad W"),
    ] {
        assert!(a.eq_tensor(b).all().int64_value(&[]) == 1, "{what} differ");
    }
}
