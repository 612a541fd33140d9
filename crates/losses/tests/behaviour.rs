//! Behaviour of each loss on hand-built inputs where the right answer is known in closed form.

mod common;

use tch::{Kind, Tensor};
use verl_losses::{
    agg_loss, entropy_from_logits, logprobs_from_logits, ActorInputs, ActorLoss, ActorLossConfig,
    AggSpec, KlPenalty, LossAggMode, LossError, LossScale, Normaliser, PolicyInputs, PolicyLoss,
    PolicyLossSection,
};

fn t2(rows: &[&[f64]]) -> Tensor {
    let cols = rows[0].len() as i64;
    let flat: Vec<f64> = rows.iter().flat_map(|r| r.iter().copied()).collect();
    Tensor::from_slice(&flat).reshape([rows.len() as i64, cols])
}

fn config(mode: &str) -> ActorLossConfig {
    ActorLossConfig {
        policy_loss: PolicyLossSection {
            loss_mode: mode.into(),
        },
        ..ActorLossConfig::default()
    }
}

fn policy(
    loss: PolicyLoss,
    lp: &Tensor,
    old: &Tensor,
    adv: &Tensor,
    mask: &Tensor,
) -> verl_losses::PolicyOutput {
    loss.compute(
        &PolicyInputs {
            old_log_prob: old,
            log_prob: lp,
            advantages: adv,
            response_mask: mask,
            rollout_is_weights: None,
        },
        AggSpec::new(LossAggMode::TokenMean),
        &Normaliser::Local,
    )
    .expect("policy loss")
}

fn grad_of(loss: &Tensor, x: &Tensor) -> Vec<f64> {
    loss.backward();
    common::to_vec(&x.grad())
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * b.abs().max(1.0)
}

#[test]
fn unknown_loss_mode_names_the_key_and_lists_valid_modes() {
    let err = PolicyLoss::from_config(&config("ppo")).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("actor.policy_loss.loss_mode"), "{msg}");
    assert!(msg.contains("\"ppo\""), "{msg}");
    for name in verl_losses::POLICY_LOSS_MODES {
        assert!(msg.contains(name), "{msg}");
    }
    let msg = PolicyLoss::from_config(&config("clip_cov"))
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("exists in verl but is not implemented"),
        "{msg}"
    );
}

#[test]
fn unknown_agg_mode_and_kl_type_are_rejected_with_valid_names() {
    let mut cfg = config("vanilla");
    cfg.loss_agg_mode = "token_mean".into();
    let msg = ActorLoss::from_config(&cfg).unwrap_err().to_string();
    assert!(
        msg.contains("actor.loss_agg_mode") && msg.contains("seq-mean-token-sum-norm"),
        "{msg}"
    );

    let mut cfg = config("vanilla");
    cfg.use_kl_loss = true;
    cfg.kl_loss_type = "k4".into();
    let msg = ActorLoss::from_config(&cfg).unwrap_err().to_string();
    assert!(
        msg.contains("actor.kl_loss_type") && msg.contains("low_var_kl+"),
        "{msg}"
    );
}

#[test]
fn dual_clip_bound_must_exceed_one() {
    let mut cfg = config("vanilla");
    cfg.clip_ratio_c = 1.0;
    match PolicyLoss::from_config(&cfg) {
        Err(LossError::InvalidValue { key, .. }) => assert_eq!(key, "actor.clip_ratio_c"),
        other => panic!("expected InvalidValue, got {other:?}"),
    }
}

#[test]
fn clip_ratio_low_and_high_fall_back_to_clip_ratio() {
    let mut cfg = config("vanilla");
    cfg.clip_ratio = 0.3;
    cfg.clip_ratio_low = None;
    cfg.clip_ratio_high = Some(0.4);
    assert_eq!(
        PolicyLoss::from_config(&cfg).unwrap(),
        PolicyLoss::Vanilla {
            clip_ratio_low: 0.3,
            clip_ratio_high: 0.4,
            clip_ratio_c: 3.0
        }
    );
}

#[test]
fn config_deserialises_from_a_verl_actor_section_with_verl_defaults() {
    let cfg: ActorLossConfig = serde_json::from_value(serde_json::json!({
        "strategy": "fsdp",
        "ppo_mini_batch_size": 256,
        "policy_loss": {"loss_mode": "gspo", "clip_cov_ratio": 0.0002},
        "clip_ratio_low": 0.0003,
        "clip_ratio_high": 0.0004,
        "use_kl_loss": true
    }))
    .unwrap();
    assert_eq!(cfg.policy_loss.loss_mode, "gspo");
    assert_eq!(cfg.clip_ratio_c, 3.0);
    assert_eq!(cfg.tau_neg, 1.05);
    assert_eq!(cfg.kl_loss_type, "low_var_kl");
    let loss = ActorLoss::from_config(&cfg).unwrap();
    assert_eq!(loss.kl.unwrap().1, 0.001);
    assert_eq!(loss.agg.mode, LossAggMode::TokenMean);
}

#[test]
fn vanilla_dual_clip_caps_the_loss_of_negative_advantages() {
    // ratio = e² ≈ 7.39 > clip_ratio_c = 3 with A = -1: the loss is capped at c·|A| and the gradient vanishes.
    let lp = t2(&[&[2.0]]).set_requires_grad(true);
    let old = t2(&[&[0.0]]);
    let adv = t2(&[&[-1.0]]);
    let mask = t2(&[&[1.0]]);
    let loss = PolicyLoss::from_config(&config("vanilla")).unwrap();
    let out = policy(loss, &lp, &old, &adv, &mask);
    assert!(close(out.metrics.pg_loss, 3.0), "{}", out.metrics.pg_loss);
    assert!(out.metrics.pg_clipfrac_lower.unwrap() > 0.99);
    assert_eq!(grad_of(&out.loss, &lp), vec![0.0]);
}

#[test]
fn vanilla_asymmetric_clip_uses_the_high_bound_for_positive_advantages() {
    let ratio: f64 = 1.25;
    let old = t2(&[&[0.0]]);
    let adv = t2(&[&[1.0]]);
    let mask = t2(&[&[1.0]]);
    let clipped = PolicyLoss::Vanilla {
        clip_ratio_low: 0.2,
        clip_ratio_high: 0.2,
        clip_ratio_c: 3.0,
    };
    let wide = PolicyLoss::Vanilla {
        clip_ratio_low: 0.2,
        clip_ratio_high: 0.28,
        clip_ratio_c: 3.0,
    };
    let lp = t2(&[&[ratio.ln()]]).set_requires_grad(true);
    let out = policy(clipped, &lp, &old, &adv, &mask);
    assert!(close(out.metrics.pg_loss, -1.2));
    assert_eq!(grad_of(&out.loss, &lp), vec![0.0], "clipped: no gradient");

    let lp = t2(&[&[ratio.ln()]]).set_requires_grad(true);
    let out = policy(wide, &lp, &old, &adv, &mask);
    assert!(close(out.metrics.pg_loss, -ratio));
    let g = grad_of(&out.loss, &lp);
    assert!(close(g[0], -ratio), "d(-A·r)/dlogπ = -A·r, got {g:?}");
}

#[test]
fn cispo_gradient_is_the_clipped_weight_times_advantage() {
    // ratio 2 is clipped to 1.28; the weight is a constant, so d loss / d logπ = -1.28·A / tokens.
    let lp = t2(&[&[2f64.ln(), 0.0]]).set_requires_grad(true);
    let old = t2(&[&[0.0, 0.0]]);
    let adv = t2(&[&[0.5, 0.5]]);
    let mask = t2(&[&[1.0, 1.0]]);
    let loss = PolicyLoss::Cispo {
        clip_ratio_low: 0.2,
        clip_ratio_high: 0.28,
    };
    let out = policy(loss, &lp, &old, &adv, &mask);
    assert!(close(
        out.metrics.pg_clipfrac.unwrap(),
        0.5 / (1.0 + 0.5e-8)
    ));
    let g = grad_of(&out.loss, &lp);
    assert!(
        close(g[0], -1.28 * 0.5 / 2.0) && close(g[1], -0.5 / 2.0),
        "{g:?}"
    );
}

#[test]
fn gspo_ratio_is_the_geometric_mean_over_the_sequence() {
    // Log-ratios 0.1 and -0.3 (mean -0.1); masked third token ignored. Wide clip range: no clipping.
    let lp = t2(&[&[0.1, -0.3, 5.0]]).set_requires_grad(true);
    let old = t2(&[&[0.0, 0.0, 0.0]]);
    let adv = t2(&[&[1.0, 1.0, 1.0]]);
    let mask = t2(&[&[1.0, 1.0, 0.0]]);
    let loss = PolicyLoss::Gspo {
        clip_ratio_low: 0.9,
        clip_ratio_high: 0.9,
    };
    let out = policy(loss, &lp, &old, &adv, &mask);
    let s = (-0.1f64).exp();
    // GSPO always aggregates seq-mean-token-mean, whose per-sequence mean divides by (tokens + 1e-8).
    let len = 2.0 + 1e-8;
    assert!(
        close(out.metrics.pg_loss, -2.0 * s / len),
        "{} vs {}",
        out.metrics.pg_loss,
        -s
    );
    // Each valid token's gradient is -A·s/len (sg on the sequence ratio, straight-through token log-prob).
    let g = grad_of(&out.loss, &lp);
    assert!(
        close(g[0], -s / len) && close(g[1], -s / len) && g[2] == 0.0,
        "{g:?}"
    );
}

#[test]
fn sapo_gate_has_unit_slope_at_ratio_one() {
    let lp = t2(&[&[0.0, 0.0]]).set_requires_grad(true);
    let old = t2(&[&[0.0, 0.0]]);
    let adv = t2(&[&[1.0, -1.0]]);
    let mask = t2(&[&[1.0, 1.0]]);
    let loss = PolicyLoss::Sapo {
        tau_pos: 1.0,
        tau_neg: 1.05,
    };
    let out = policy(loss, &lp, &old, &adv, &mask);
    // gates at r = 1 are 2/τ: loss = mean(-2/1·1, -2/1.05·-1), SAPO's seq-mean-token-mean dividing by 2 + 1e-8.
    let len = 2.0 + 1e-8;
    assert!(close(out.metrics.pg_loss, (-2.0 + 2.0 / 1.05) / len));
    let g = grad_of(&out.loss, &lp);
    assert!(close(g[0], -1.0 / len) && close(g[1], 1.0 / len), "{g:?}");
}

#[test]
fn gpg_reports_only_pg_loss() {
    let lp = t2(&[&[-1.0, -2.0]]);
    let out = policy(
        PolicyLoss::Gpg,
        &lp,
        &lp,
        &t2(&[&[1.0, 1.0]]),
        &t2(&[&[1.0, 0.0]]),
    );
    assert!(close(out.metrics.pg_loss, 1.0));
    assert_eq!(
        out.metrics.named().keys().collect::<Vec<_>>(),
        vec!["actor/pg_loss"]
    );
}

#[test]
fn straight_through_kl_has_the_value_of_its_estimator_and_the_gradient_of_k2() {
    let lp = t2(&[&[-0.5, -2.0, -1.0]]);
    let rf = t2(&[&[-1.0, -1.0, -1.0]]);
    for (plain, plus) in [
        ("k1", "k1+"),
        ("low_var_kl", "low_var_kl+"),
        ("abs", "abs+"),
    ] {
        let x = lp.copy().set_requires_grad(true);
        let v_plain = common::to_vec(
            &KlPenalty::parse("k", plain)
                .unwrap()
                .compute(&x, &rf)
                .unwrap(),
        );
        let kl = KlPenalty::parse("k", plus)
            .unwrap()
            .compute(&x, &rf)
            .unwrap();
        assert_eq!(common::to_vec(&kl), v_plain, "{plus}: value");
        let g = grad_of(&kl.sum(Kind::Double), &x);
        assert_eq!(
            g,
            vec![0.5, -1.0, 0.0],
            "{plus}: gradient of ½(logπ - logπ_ref)² is logπ - logπ_ref"
        );
    }
    assert_eq!(
        KlPenalty::parse("k", "k2+").unwrap(),
        KlPenalty::parse("k", "mse").unwrap(),
        "k2 already has k2's gradient"
    );
    let err = KlPenalty::parse("actor.kl_loss_type", "full")
        .unwrap_err()
        .to_string();
    assert!(err.contains("vocabulary"), "{err}");
}

#[test]
fn k3_is_clamped_for_far_off_tokens() {
    let kl = KlPenalty::parse("k", "k3")
        .unwrap()
        .compute(&t2(&[&[-50.0]]), &t2(&[&[0.0]]))
        .unwrap();
    assert_eq!(kl.double_value(&[0, 0]), 10.0);
}

#[test]
fn agg_loss_ignores_nan_padding_in_value_and_gradient() {
    let x = t2(&[&[1.0, f64::NAN], &[3.0, 5.0]]).set_requires_grad(true);
    let mask = t2(&[&[1.0, 0.0], &[1.0, 1.0]]);
    for mode in LossAggMode::ALL {
        let x = x.detach().copy().set_requires_grad(true);
        let loss = agg_loss(&x, &mask, AggSpec::new(mode), &Normaliser::Local).unwrap();
        assert!(loss.double_value(&[]).is_finite(), "{mode}");
        let g = grad_of(&loss, &x);
        assert!(
            g.iter().all(|v| v.is_finite()) && g[1] == 0.0,
            "{mode}: {g:?}"
        );
    }
    let token_mean = agg_loss(
        &x,
        &mask,
        AggSpec::new(LossAggMode::TokenMean),
        &Normaliser::Local,
    )
    .unwrap();
    assert!(close(token_mean.double_value(&[]), 3.0));
}

#[test]
fn an_all_masked_micro_batch_contributes_zero_not_nan() {
    let x = t2(&[&[1.0, 2.0]]);
    let mask = t2(&[&[0.0, 0.0]]);
    for mode in LossAggMode::ALL {
        let loss = agg_loss(&x, &mask, AggSpec::new(mode), &Normaliser::Local).unwrap();
        assert_eq!(loss.double_value(&[]), 0.0, "{mode}");
    }
}

#[test]
fn global_normaliser_rejects_empty_counts() {
    let x = t2(&[&[1.0]]);
    let norm = Normaliser::Global(LossScale {
        global_tokens: 0.0,
        global_seqs: 1.0,
        dp_size: 1,
    });
    let msg = agg_loss(&x, &x, AggSpec::new(LossAggMode::TokenMean), &norm)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("global_tokens"), "{msg}");
}

#[test]
fn shape_mismatch_names_the_argument() {
    let a = t2(&[&[1.0, 2.0]]);
    let b = t2(&[&[1.0, 2.0, 3.0]]);
    let err = policy_err(&a, &b);
    assert!(
        err.contains("advantages") && err.contains("[1, 3]") && err.contains("[1, 2]"),
        "{err}"
    );
}

fn policy_err(a: &Tensor, b: &Tensor) -> String {
    match PolicyLoss::Gpg.compute(
        &PolicyInputs {
            old_log_prob: a,
            log_prob: a,
            advantages: b,
            response_mask: a,
            rollout_is_weights: None,
        },
        AggSpec::new(LossAggMode::TokenMean),
        &Normaliser::Local,
    ) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("shape mismatch accepted"),
    }
}

#[test]
fn actor_loss_combines_terms_with_their_coefficients() {
    let lp = t2(&[&[-1.0, -2.0]]);
    let rf = t2(&[&[-1.5, -1.0]]);
    let ent = t2(&[&[2.0, 4.0]]);
    let mask = t2(&[&[1.0, 1.0]]);
    let adv = t2(&[&[1.0, 1.0]]);
    let mut cfg = config("gpg");
    cfg.entropy_coeff = 0.1;
    cfg.use_kl_loss = true;
    cfg.kl_loss_coef = 0.5;
    cfg.kl_loss_type = "k1".into();
    let loss = ActorLoss::from_config(&cfg).unwrap();
    let inputs = ActorInputs {
        old_log_prob: &lp,
        log_prob: &lp,
        advantages: &adv,
        response_mask: &mask,
        entropy: Some(&ent),
        ref_log_prob: Some(&rf),
        rollout_is_weights: None,
    };
    let out = loss.compute(&inputs, &Normaliser::Local).unwrap();
    // pg = mean(-logπ·A) = 1.5; entropy = 3; k1 = mean(0.5, -1) = -0.25
    assert!(close(out.metrics["actor/pg_loss"], 1.5));
    assert!(close(out.metrics["actor/entropy"], 3.0));
    assert!(close(out.metrics["actor/kl_loss"], -0.25));
    assert_eq!(out.metrics["actor/kl_coef"], 0.5);
    assert!(close(
        out.loss.double_value(&[]),
        1.5 - 0.1 * 3.0 + 0.5 * -0.25
    ));

    let missing = ActorInputs {
        ref_log_prob: None,
        ..inputs
    };
    let msg = loss
        .compute(&missing, &Normaliser::Local)
        .err()
        .unwrap()
        .to_string();
    assert!(
        msg.contains("ref_log_prob") && msg.contains("use_kl_loss"),
        "{msg}"
    );
}

#[test]
fn entropy_is_stable_for_extreme_logits() {
    let logits = Tensor::from_slice(&[1e4f64, -1e4, 0.0, 0.0, 0.0, 0.0]).reshape([2, 3]);
    let e = common::to_vec(&entropy_from_logits(&logits).unwrap());
    assert!(
        e[0].abs() < 1e-12,
        "a one-hot distribution has zero entropy: {e:?}"
    );
    assert!(
        close(e[1], 3f64.ln()),
        "uniform over 3 has entropy ln 3: {e:?}"
    );
    let f32_logits = Tensor::from_slice(&[80f32, -80.0, 0.0]).reshape([1, 3]);
    assert!(entropy_from_logits(&f32_logits)
        .unwrap()
        .double_value(&[0])
        .is_finite());
}

#[test]
fn logprobs_from_logits_gathers_log_softmax() {
    let logits = common::Lcg(3).tensor(&[2, 3, 5], 3.0);
    let labels = Tensor::from_slice(&[0i64, 4, 2, 1, 3, 3]).reshape([2, 3]);
    let got = logprobs_from_logits(&logits, &labels).unwrap();
    let want = logits
        .log_softmax(-1, Kind::Double)
        .gather(-1, &labels.unsqueeze(-1), false)
        .squeeze_dim(-1);
    let d = common::max_rel_err(&common::to_vec(&got), &common::to_vec(&want), 1e-12);
    assert!(d < 1e-12, "{d}");
    let bad = Tensor::from_slice(&[0i64, 1]);
    let msg = logprobs_from_logits(&logits, &bad).unwrap_err().to_string();
    assert!(msg.contains("labels") && msg.contains("[2, 3]"), "{msg}");
}
