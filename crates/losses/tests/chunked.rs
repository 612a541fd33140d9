//! The chunked LM-head path gives the same values and the same parameter gradients as materialising all
//! logits and differentiating through them.

mod common;

use tch::{Kind, Tensor};
use verl_losses::{entropy_from_logits, logprobs_from_logits, ChunkedLmHead, LossError};

use common::{max_rel_err, to_vec, Lcg};

const N: i64 = 37;
const H: i64 = 8;
const V: i64 = 50;
const TEMPERATURE: f64 = 0.7;

struct Model {
    /// A stand-in for the transformer: hidden = x · A.
    a: Tensor,
    /// The LM head `[V, H]`.
    w: Tensor,
    x: Tensor,
    targets: Tensor,
    adv: Tensor,
}

fn model() -> Model {
    let mut rng = Lcg(11);
    let targets: Vec<i64> = (0..N).map(|i| (i * 7 + 3) % V).collect();
    Model {
        a: rng.tensor(&[H, H], 0.8).set_requires_grad(true),
        w: rng.tensor(&[V, H], 1.5).set_requires_grad(true),
        x: rng.tensor(&[N, H], 1.0),
        targets: Tensor::from_slice(&targets),
        adv: rng.tensor(&[N], 1.0),
    }
}

/// A loss using both outputs, shaped like the actor's: -mean(A·logπ) - 0.05·mean(entropy).
fn loss_of(lp: &Tensor, ent: Option<&Tensor>, adv: &Tensor) -> Tensor {
    let pg = (lp * adv).mean(Kind::Double).neg();
    match ent {
        Some(e) => pg - e.mean(Kind::Double) * 0.05,
        None => pg,
    }
}

#[test]
fn chunked_values_and_gradients_match_full_logits() {
    // Reference: full [N, V] logits through autograd.
    let m = model();
    let hidden = m.x.matmul(&m.a);
    let logits = hidden.matmul(&m.w.tr()) / TEMPERATURE;
    let lp_ref = logprobs_from_logits(&logits, &m.targets).unwrap();
    let ent_ref = entropy_from_logits(&logits).unwrap();
    let loss_ref = loss_of(&lp_ref, Some(&ent_ref), &m.adv);
    loss_ref.backward();
    let (ga_ref, gw_ref) = (to_vec(&m.a.grad()), to_vec(&m.w.grad()));

    for chunk in [1, 5, 16, N, 1000] {
        let m2 = model();
        let hidden = m2.x.matmul(&m2.a);
        let head = ChunkedLmHead::new(chunk, TEMPERATURE, true);
        let (loss, stats) = head
            .loss_and_backward(&hidden, &m2.w, &m2.targets, |lp, ent| {
                Ok(loss_of(lp, ent, &m2.adv))
            })
            .unwrap();
        let tol = 1e-10;
        assert!(
            (loss.double_value(&[]) - loss_ref.double_value(&[])).abs() < tol,
            "chunk {chunk}: loss"
        );
        assert!(
            max_rel_err(&to_vec(&stats.log_probs), &to_vec(&lp_ref), 1e-9) < tol,
            "chunk {chunk}: logπ"
        );
        let ent = stats.entropy.as_ref().expect("entropy requested");
        assert!(
            max_rel_err(&to_vec(ent), &to_vec(&ent_ref), 1e-9) < tol,
            "chunk {chunk}: entropy"
        );
        let da = max_rel_err(&to_vec(&m2.a.grad()), &ga_ref, 1e-9);
        let dw = max_rel_err(&to_vec(&m2.w.grad()), &gw_ref, 1e-9);
        assert!(
            da < tol && dw < tol,
            "chunk {chunk}: grad A rel err {da:e}, grad W rel err {dw:e}"
        );
    }
}

#[test]
fn chunked_forward_keeps_no_graph_and_matches_without_entropy() {
    let m = model();
    let hidden = m.x.matmul(&m.a);
    let stats = ChunkedLmHead::new(8, 1.0, false)
        .forward(&hidden, &m.w, &m.targets)
        .unwrap();
    assert!(stats.entropy.is_none());
    assert!(
        !stats.log_probs.requires_grad(),
        "forward is for log-prob computation only"
    );
    let want = logprobs_from_logits(&hidden.matmul(&m.w.tr()), &m.targets).unwrap();
    assert!(max_rel_err(&to_vec(&stats.log_probs), &to_vec(&want), 1e-9) < 1e-10);
}

#[test]
fn bf16_hidden_states_are_computed_in_fp32() {
    let m = model();
    let hidden = m.x.matmul(&m.a).detach().to_kind(Kind::BFloat16);
    let w = m.w.detach().to_kind(Kind::BFloat16);
    let stats = ChunkedLmHead::new(10, 1.0, true)
        .forward(&hidden, &w, &m.targets)
        .unwrap();
    assert_eq!(stats.log_probs.kind(), Kind::Float);
    let want =
        logprobs_from_logits(&hidden.matmul(&w.tr()).to_kind(Kind::Float), &m.targets).unwrap();
    let d = max_rel_err(&to_vec(&stats.log_probs), &to_vec(&want), 1e-3);
    assert!(d < 1e-5, "{d}");
}

#[test]
fn bad_arguments_are_errors_not_panics() {
    let m = model();
    let hidden = m.x.matmul(&m.a);
    let wrong_w = Tensor::zeros([V, H + 1], (Kind::Double, tch::Device::Cpu));
    match ChunkedLmHead::new(4, 1.0, false).forward(&hidden, &wrong_w, &m.targets) {
        Err(LossError::Shape { arg, .. }) => assert_eq!(arg, "weight"),
        other => panic!("expected a shape error, got {other:?}"),
    }
    match ChunkedLmHead::new(4, 0.0, false).forward(&hidden, &m.w, &m.targets) {
        Err(LossError::InvalidValue { key, .. }) => assert_eq!(key, "temperature"),
        other => panic!("expected an invalid temperature, got {other:?}"),
    }
    let float_targets = m.targets.to_kind(Kind::Float);
    assert!(ChunkedLmHead::new(4, 1.0, false)
        .forward(&hidden, &m.w, &float_targets)
        .is_err());
}

#[test]
fn frozen_head_and_unused_entropy_still_give_exact_model_gradients() {
    let m = model();
    let w = m.w.detach();
    let hidden = m.x.matmul(&m.a);
    let logits = hidden.matmul(&w.tr());
    loss_of(
        &logprobs_from_logits(&logits, &m.targets).unwrap(),
        None,
        &m.adv,
    )
    .backward();
    let ga_ref = to_vec(&m.a.grad());

    let m2 = model();
    let hidden = m2.x.matmul(&m2.a);
    // Entropy is computed (e.g. for logging) but the loss does not use it.
    let (_loss, _stats) = ChunkedLmHead::new(6, 1.0, true)
        .loss_and_backward(&hidden, &w, &m2.targets, |lp, _| {
            Ok(loss_of(lp, None, &m2.adv))
        })
        .unwrap();
    let d = max_rel_err(&to_vec(&m2.a.grad()), &ga_ref, 1e-9);
    assert!(d < 1e-10, "{d:e}");
    assert!(
        !m2.w.grad().defined(),
        "the head's own parameter was not part of this graph"
    );
}

#[test]
fn surrogate_carries_the_full_logits_gradients_and_the_loss_value() {
    let m = model();
    let hidden = m.x.matmul(&m.a);
    let logits = hidden.matmul(&m.w.tr()) / TEMPERATURE;
    let lp_ref = logprobs_from_logits(&logits, &m.targets).unwrap();
    let ent_ref = entropy_from_logits(&logits).unwrap();
    let loss_ref = loss_of(&lp_ref, Some(&ent_ref), &m.adv);
    loss_ref.backward();
    let (ga_ref, gw_ref) = (to_vec(&m.a.grad()), to_vec(&m.w.grad()));

    for chunk in [1, 6, 1000] {
        let m2 = model();
        let hidden = m2.x.matmul(&m2.a);
        let mut computed = None;
        let (surrogate, stats) = ChunkedLmHead::new(chunk, TEMPERATURE, true)
            .loss_and_surrogate(&hidden, &m2.w, &m2.targets, |lp, ent| {
                let l = loss_of(lp, ent, &m2.adv);
                computed = Some(l.double_value(&[]));
                Ok(l)
            })
            .unwrap();
        // Nothing has been differentiated yet: the caller owns the backward.
        assert!(!m2.a.grad().defined() && !m2.w.grad().defined());
        assert_eq!(
            Some(surrogate.double_value(&[])),
            computed,
            "chunk {chunk}: the surrogate's value is the loss, bit for bit"
        );
        assert!((surrogate.double_value(&[]) - loss_ref.double_value(&[])).abs() < 1e-10);
        assert!(max_rel_err(&to_vec(&stats.log_probs), &to_vec(&lp_ref), 1e-9) < 1e-10);
        surrogate.backward();
        let da = max_rel_err(&to_vec(&m2.a.grad()), &ga_ref, 1e-9);
        let dw = max_rel_err(&to_vec(&m2.w.grad()), &gw_ref, 1e-9);
        assert!(
            da < 1e-10 && dw < 1e-10,
            "chunk {chunk}: grad A rel err {da:e}, grad W rel err {dw:e}"
        );
    }
}

#[test]
fn surrogate_of_no_tokens_still_reaches_the_inputs_with_zero_gradient() {
    let m = model();
    let hidden = m.x.matmul(&m.a).narrow(0, 0, 0);
    let targets = m.targets.narrow(0, 0, 0);
    let (surrogate, stats) = ChunkedLmHead::new(4, 1.0, false)
        .loss_and_surrogate(&hidden, &m.w, &targets, |lp, _| Ok(lp.sum(Kind::Double)))
        .unwrap();
    assert_eq!(stats.log_probs.size(), vec![0]);
    assert_eq!(surrogate.double_value(&[]), 0.0);
    surrogate.backward();
    assert_eq!(m.w.grad().abs().sum(Kind::Double).double_value(&[]), 0.0);
    assert_eq!(m.a.grad().abs().sum(Kind::Double).double_value(&[]), 0.0);
}
