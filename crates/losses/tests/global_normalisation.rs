//! With the global normaliser, accumulating micro-batch gradients (and averaging them over DP ranks)
//! reproduces the one-shot mini-batch loss and gradient exactly, for every aggregation mode; the per-micro-batch
//! normalisation verl's legacy actor uses (issue #5625) does not.

mod common;

use tch::{Kind, Tensor};
use verl_losses::{
    ActorInputs, ActorLoss, ActorLossConfig, AggSpec, CriticLoss, CriticLossConfig, LossAggMode,
    LossScale, MaskCounts, Normaliser, PolicyLossSection, ValueInputs,
};

use common::Lcg;

const B: i64 = 12;
const T: i64 = 9;
/// Micro-batch row counts: unequal, as dynamic batching produces.
const MICRO: [i64; 4] = [5, 2, 1, 4];
/// Two DP ranks: rank 0 owns micro-batches 0..2, rank 1 owns 2..4.
const RANK_OF_MICRO: [usize; 4] = [0, 0, 1, 1];

struct Batch {
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    ref_log_prob: Tensor,
    entropy_base: Tensor,
    returns: Tensor,
    values: Tensor,
}

/// Response lengths vary from 0 (a fully masked row, which seq-mean modes must skip) to T.
fn batch() -> Batch {
    let mut rng = Lcg(7);
    let lengths = [9, 1, 4, 0, 7, 2, 9, 3, 5, 8, 1, 6];
    let mut m = Vec::new();
    for len in lengths {
        for t in 0..T {
            m.push(if t < len { 1.0 } else { 0.0 });
        }
    }
    let mask = Tensor::from_slice(&m).reshape([B, T]);
    let old_log_prob = rng.tensor(&[B, T], 1.0).f_sub_scalar(1.5).unwrap();
    // Sequence-level advantages of mixed sign, like GRPO's.
    let adv_rows: Vec<f64> = (0..B).map(|_| rng.signed() * 2.0).collect();
    let advantages = Tensor::from_slice(&adv_rows)
        .reshape([B, 1])
        .expand([B, T], false)
        .contiguous();
    Batch {
        old_log_prob,
        advantages,
        mask,
        ref_log_prob: rng.tensor(&[B, T], 1.0).f_sub_scalar(1.5).unwrap(),
        entropy_base: rng.tensor(&[B, T], 0.5).f_add_scalar(1.0).unwrap(),
        returns: rng.tensor(&[B, T], 1.0),
        values: rng.tensor(&[B, T], 1.0),
    }
}

/// The "parameters": a per-token offset to the old log-probs (so ratios move off 1 and clipping is exercised).
fn theta() -> Tensor {
    Lcg(99).tensor(&[B, T], 0.4).set_requires_grad(true)
}

fn rows(t: &Tensor, start: i64, len: i64) -> Tensor {
    t.narrow(0, start, len)
}

fn micro_ranges() -> Vec<(i64, i64)> {
    let mut start = 0;
    MICRO
        .iter()
        .map(|&len| {
            let r = (start, len);
            start += len;
            r
        })
        .collect()
}

fn actor(loss_mode: &str, agg: LossAggMode) -> ActorLoss {
    ActorLoss::from_config(&ActorLossConfig {
        policy_loss: PolicyLossSection {
            loss_mode: loss_mode.into(),
        },
        clip_ratio_low: Some(0.2),
        clip_ratio_high: Some(0.28),
        loss_agg_mode: agg.name().into(),
        // A constant horizon, as the module docs require for seq-mean-token-sum-norm with a global normaliser.
        loss_scale_factor: Some(T as f64),
        entropy_coeff: 0.01,
        use_kl_loss: true,
        kl_loss_coef: 0.1,
        kl_loss_type: "low_var_kl+".into(),
        ..ActorLossConfig::default()
    })
    .expect("valid config")
}

/// The actor loss on rows `start..start+len`, differentiable with respect to `theta`.
fn actor_loss(
    loss: &ActorLoss,
    b: &Batch,
    theta: &Tensor,
    start: i64,
    len: i64,
    norm: &Normaliser,
) -> Tensor {
    let th = rows(theta, start, len);
    let old = rows(&b.old_log_prob, start, len);
    let log_prob = &old + &th;
    // Entropy depends on the parameters too, so the entropy term contributes to the gradient.
    let entropy = rows(&b.entropy_base, start, len) * (th.exp() * 0.5 + 0.5);
    let out = loss
        .compute(
            &ActorInputs {
                old_log_prob: &old,
                log_prob: &log_prob,
                advantages: &rows(&b.advantages, start, len),
                response_mask: &rows(&b.mask, start, len),
                entropy: Some(&entropy),
                ref_log_prob: Some(&rows(&b.ref_log_prob, start, len)),
                rollout_is_weights: None,
            },
            norm,
        )
        .expect("actor loss");
    out.loss
}

/// Loss value and gradient of the one-shot computation on the whole mini-batch.
fn one_shot(f: &dyn Fn(&Tensor, i64, i64, &Normaliser) -> Tensor) -> (f64, Vec<f64>) {
    let theta = theta();
    let loss = f(&theta, 0, B, &Normaliser::Local);
    loss.backward();
    (loss.double_value(&[]), common::to_vec(&theta.grad()))
}

/// Micro-batches over two DP ranks with the global normaliser: each rank sums its micro-batch gradients,
/// then the ranks' gradients are averaged (what FSDP/DDP do), and the logged loss is summed over micro-batches
/// and averaged over ranks.
fn accumulated_global(
    b: &Batch,
    f: &dyn Fn(&Tensor, i64, i64, &Normaliser) -> Tensor,
) -> (f64, Vec<f64>) {
    let dp_size = 2;
    let counts: MaskCounts = micro_ranges()
        .iter()
        .map(|&(s, l)| MaskCounts::of_mask(&rows(&b.mask, s, l)).unwrap())
        .sum();
    let norm = Normaliser::Global(LossScale::new(counts, dp_size));
    let mut rank_grads: Vec<Tensor> = (0..dp_size)
        .map(|_| Tensor::zeros([B, T], (Kind::Double, tch::Device::Cpu)))
        .collect();
    let mut rank_loss = vec![0.0; dp_size];
    for (i, &(s, l)) in micro_ranges().iter().enumerate() {
        let r = RANK_OF_MICRO[i];
        // Each rank has its own copy of the parameters.
        let theta = theta();
        let loss = f(&theta, s, l, &norm);
        loss.backward();
        rank_grads[r] = &rank_grads[r] + theta.grad();
        rank_loss[r] += loss.double_value(&[]);
    }
    let grad = (&rank_grads[0] + &rank_grads[1]) / dp_size as f64;
    let loss = rank_loss.iter().sum::<f64>() / dp_size as f64;
    (loss, common::to_vec(&grad))
}

/// verl's legacy FSDP actor: each micro-batch normalised by its own counts, scaled by its share of rows.
fn accumulated_naive(f: &dyn Fn(&Tensor, i64, i64, &Normaliser) -> Tensor) -> (f64, Vec<f64>) {
    let theta = theta();
    let mut total = 0.0;
    for (s, l) in micro_ranges() {
        let loss = f(&theta, s, l, &Normaliser::Local) * (l as f64 / B as f64);
        loss.backward();
        total += loss.double_value(&[]);
    }
    (total, common::to_vec(&theta.grad()))
}

fn max_abs_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

fn check(label: &str, b: &Batch, f: &dyn Fn(&Tensor, i64, i64, &Normaliser) -> Tensor) {
    let (full_loss, full_grad) = one_shot(f);
    assert!(
        full_grad.iter().any(|g| g.abs() > 1e-6),
        "{label}: zero gradient, test would prove nothing"
    );

    let (acc_loss, acc_grad) = accumulated_global(b, f);
    assert!(
        (acc_loss - full_loss).abs() <= 1e-10,
        "{label}: accumulated loss {acc_loss} != one-shot {full_loss}"
    );
    let d = max_abs_diff(&acc_grad, &full_grad);
    assert!(
        d <= 1e-10,
        "{label}: accumulated gradient differs from one-shot by {d:e}"
    );

    let (naive_loss, naive_grad) = accumulated_naive(f);
    let dl = (naive_loss - full_loss).abs();
    let dg = max_abs_diff(&naive_grad, &full_grad);
    assert!(
        dl > 1e-4 && dg > 1e-4,
        "{label}: per-micro-batch normalisation should be visibly wrong here (loss diff {dl:e}, grad diff {dg:e})"
    );
    eprintln!(
        "{label}: global exact (grad diff {d:.1e}); naive loss off by {dl:.2e}, grad by {dg:.2e}"
    );
}

#[test]
fn actor_loss_accumulates_exactly_for_every_agg_mode() {
    let b = batch();
    for mode in LossAggMode::ALL {
        let loss = actor("vanilla", mode);
        check(&format!("vanilla/{mode}"), &b, &|th, s, l, n| {
            actor_loss(&loss, &b, th, s, l, n)
        });
    }
}

#[test]
fn every_policy_loss_accumulates_exactly() {
    let b = batch();
    for name in verl_losses::POLICY_LOSS_MODES {
        let loss = actor(name, LossAggMode::TokenMean);
        check(name, &b, &|th, s, l, n| actor_loss(&loss, &b, th, s, l, n));
    }
}

#[test]
fn value_loss_accumulates_exactly_for_every_agg_mode() {
    let b = batch();
    for mode in LossAggMode::ALL {
        let critic = CriticLoss::from_config(&CriticLossConfig {
            cliprange_value: 0.2,
            loss_agg_mode: mode.name().into(),
            loss_scale_factor: Some(T as f64),
        })
        .expect("valid critic config");
        check(&format!("value/{mode}"), &b, &|th, s, l, n| {
            let vpreds = rows(&b.values, s, l) + rows(th, s, l);
            critic
                .compute(
                    &ValueInputs {
                        vpreds: &vpreds,
                        returns: &rows(&b.returns, s, l),
                        values: &rows(&b.values, s, l),
                        response_mask: &rows(&b.mask, s, l),
                    },
                    n,
                )
                .expect("value loss")
                .loss
        });
    }
}

#[test]
fn global_normaliser_with_single_micro_batch_equals_local() {
    let b = batch();
    let counts = MaskCounts::of_mask(&b.mask).unwrap();
    assert_eq!(counts.seqs, 11.0, "one of the 12 rows is fully masked");
    let norm = Normaliser::Global(LossScale::new(counts, 1));
    for mode in LossAggMode::ALL {
        let spec = AggSpec {
            mode,
            loss_scale_factor: Some(T as f64),
        };
        let x = b.values.shallow_clone();
        let local = verl_losses::agg_loss(&x, &b.mask, spec, &Normaliser::Local).unwrap();
        let global = verl_losses::agg_loss(&x, &b.mask, spec, &norm).unwrap();
        assert!(
            (local.double_value(&[]) - global.double_value(&[])).abs() < 1e-14,
            "{mode}"
        );
    }
}
