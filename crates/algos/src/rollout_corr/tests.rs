use super::*;
use crate::stats::LocalOnly;

fn keys(
    is: Option<&str>,
    thr: Option<&str>,
    rs: Option<&str>,
    rs_thr: Option<&str>,
) -> RolloutCorrectionKeys {
    RolloutCorrectionKeys {
        rollout_is: is.map(String::from),
        rollout_is_threshold: thr.map(String::from),
        rollout_is_batch_normalize: false,
        rollout_rs: rs.map(String::from),
        rollout_rs_threshold: rs_thr.map(String::from),
        bypass_mode: false,
        loss_type: "ppo_clip".into(),
    }
}

fn parse(k: &RolloutCorrectionKeys) -> RolloutCorrection {
    RolloutCorrection::from_keys(k).unwrap().unwrap()
}

fn metric(out: &RolloutCorrectionOutput, name: &str) -> f64 {
    out.metrics
        .iter()
        .find(|m| m.0 == format!("rollout_corr/{name}"))
        .unwrap_or_else(|| panic!("no metric {name} in {:?}", out.metrics))
        .1
}

fn close(a: f64, b: f64) {
    assert!((a - b).abs() < 1e-9 * (1.0 + b.abs()), "{a} != {b}");
}

/// Two rows; row 0 has three valid tokens, row 1 two (its last column is padding).
fn batch() -> (Grid<f64>, Grid<f64>, Grid<f64>) {
    let rollout = Grid::from_rows(&[[-1.0, -2.0, -0.5], [-1.0, -1.0, -9.0]]).unwrap();
    // log r = old - rollout: row 0 [0.2, -0.1, 1.0], row 1 [-0.3, 0.0, (padding)].
    let old = Grid::from_rows(&[[-0.8, -2.1, 0.5], [-1.3, -1.0, 5.0]]).unwrap();
    let mask = Grid::from_rows(&[[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]).unwrap();
    (old, rollout, mask)
}

#[test]
fn defaults_switch_nothing_on() {
    let k = RolloutCorrectionKeys {
        rollout_is_threshold: Some("2.0".into()),
        loss_type: "ppo_clip".into(),
        ..Default::default()
    };
    assert_eq!(RolloutCorrection::from_keys(&k).unwrap(), None);
}

#[test]
fn token_weights_are_truncated_ratios_and_zero_on_padding() {
    let (old, rollout, mask) = batch();
    let c = parse(&keys(Some("token"), Some("2.0"), None, None));
    let out = compute_rollout_correction_across(&c, &old, &rollout, &mask, &mut LocalOnly).unwrap();
    let w = out.weights.clone().unwrap();
    close(w[(0, 0)], 0.2f64.exp());
    close(w[(0, 1)], (-0.1f64).exp());
    close(w[(0, 2)], 2.0); // e^1 = 2.718 truncated at 2
    close(w[(1, 0)], (-0.3f64).exp());
    close(w[(1, 1)], 1.0);
    assert_eq!(w[(1, 2)], 0.0);
    assert_eq!(out.response_mask, mask, "no rejection rule: mask unchanged");
    // Metrics read the weights before truncation.
    let raw = [
        0.2f64.exp(),
        (-0.1f64).exp(),
        1f64.exp(),
        (-0.3f64).exp(),
        1.0,
    ];
    close(
        metric(&out, "rollout_is_mean"),
        raw.iter().sum::<f64>() / (5.0 + 1e-8),
    );
    close(metric(&out, "rollout_is_max"), 1f64.exp());
    close(metric(&out, "rollout_is_min"), (-0.3f64).exp());
    close(
        metric(&out, "rollout_is_ratio_fraction_high"),
        1.0 / (5.0 + 1e-8),
    );
    close(metric(&out, "rollout_is_ratio_fraction_low"), 0.0);
    // Per-sequence means of the raw weights.
    let (s0, s1) = ((raw[0] + raw[1] + raw[2]) / 3.0, (raw[3] + raw[4]) / 2.0);
    close(metric(&out, "rollout_is_seq_mean"), (s0 + s1) / 2.0);
    close(metric(&out, "rollout_is_seq_max"), s0);
    close(
        metric(&out, "rollout_is_seq_max_deviation"),
        (s0 - 1.0).abs(),
    );
    // std over the weights clamped to [1/2, 2], unbiased.
    let c5: Vec<f64> = raw.iter().map(|v| v.clamp(0.5, 2.0)).collect();
    let m = c5.iter().sum::<f64>() / 5.0;
    let var = c5.iter().map(|v| (v - m).powi(2)).sum::<f64>() / 4.0;
    close(metric(&out, "rollout_is_std"), var.sqrt());
}

#[test]
fn sequence_weights_multiply_the_token_ratios() {
    let (old, rollout, mask) = batch();
    let c = parse(&keys(Some("sequence"), Some("5.0"), None, None));
    let out = compute_rollout_correction_across(&c, &old, &rollout, &mask, &mut LocalOnly).unwrap();
    let w = out.weights.clone().unwrap();
    for t in 0..3 {
        close(w[(0, t)], 1.1f64.exp()); // 0.2 - 0.1 + 1.0
    }
    close(w[(1, 0)], (-0.3f64).exp());
    close(w[(1, 1)], (-0.3f64).exp());
    assert_eq!(w[(1, 2)], 0.0);
    close(metric(&out, "rollout_is_max"), 1.1f64.exp());
    close(metric(&out, "rollout_is_min"), (-0.3f64).exp());
    close(metric(&out, "rollout_is_ratio_fraction_high"), 0.0);
}

#[test]
fn band_threshold_zeroes_weights_outside_it_and_batch_normalisation_rescales() {
    let (old, rollout, mask) = batch();
    let mut k = keys(Some("token"), Some("0.8_1.5"), None, None);
    k.rollout_is_batch_normalize = true;
    let c = parse(&k);
    assert_eq!(
        c.is.unwrap().threshold,
        IsThreshold::Band {
            lower: 0.8,
            upper: 1.5
        }
    );
    let out = compute_rollout_correction_across(&c, &old, &rollout, &mask, &mut LocalOnly).unwrap();
    let w = out.weights.clone().unwrap();
    // e^1 > 1.5 is zeroed; e^-0.3 = 0.741 < 0.8 is zeroed.
    let kept = [0.2f64.exp(), (-0.1f64).exp(), 0.0, 0.0, 1.0];
    let mean = kept.iter().sum::<f64>() / (5.0 + 1e-8);
    close(metric(&out, "rollout_is_oob_ratio"), 2.0 / (5.0 + 1e-8));
    close(metric(&out, "rollout_is_batch_norm_factor"), mean);
    close(w[(0, 0)], kept[0] / mean);
    assert_eq!(w[(0, 2)], 0.0);
    close(w[(1, 1)], 1.0 / mean);
}

#[test]
fn rejection_rules_remove_tokens_and_sequences() {
    let (old, rollout, mask) = batch();
    // token_k1 with 2.0: keep -log r in [ln 0.5, ln 2]: log r = 1.0 → k1 = -1 < ln 0.5 → rejected.
    let c = parse(&keys(None, None, Some("token_k1"), Some("2.0")));
    let out = compute_rollout_correction_across(&c, &old, &rollout, &mask, &mut LocalOnly).unwrap();
    assert!(out.weights.is_none());
    assert_eq!(
        out.response_mask.to_rows(),
        vec![vec![1.0, 1.0, 0.0], vec![1.0, 1.0, 0.0]]
    );
    close(
        metric(&out, "rollout_rs_masked_fraction"),
        1.0 / (5.0 + 1e-8),
    );
    close(metric(&out, "rollout_rs_seq_masked_fraction"), 0.5);
    close(metric(&out, "rollout_rs_token_k1_max"), 0.3);
    close(metric(&out, "rollout_rs_token_k1_min"), -1.0);

    // seq_max_k2 at 0.1: row 0's max ½·1² = 0.5 rejects the whole row; row 1's ½·0.09 stays.
    // Combined (AND) with seq_mean_k1 "0.9_1.1": row 0's mean k1 = -1.1/3 < ln 0.9 and row 1's
    // 0.15 > ln 1.1 are both rejected.
    let c = parse(&keys(
        None,
        None,
        Some("seq_max_k2, seq_mean_k1"),
        Some("0.1,0.9_1.1"),
    ));
    let out = compute_rollout_correction_across(&c, &old, &rollout, &mask, &mut LocalOnly).unwrap();
    assert_eq!(
        out.response_mask.to_rows(),
        vec![vec![0.0, 0.0, 0.0], vec![0.0, 0.0, 0.0]]
    );
    close(
        metric(&out, "rollout_rs_seq_max_k2_seq_masked_fraction"),
        0.5,
    );
    close(
        metric(&out, "rollout_rs_seq_mean_k1_seq_masked_fraction"),
        1.0,
    );
    close(metric(&out, "rollout_rs_seq_mean_k1_max"), 0.15);
    close(metric(&out, "rollout_rs_seq_max_k2_max"), 0.5);
    close(metric(&out, "rollout_rs_seq_masked_fraction"), 1.0);
}

#[test]
fn off_policy_diagnostics_match_their_definitions() {
    let (old, rollout, mask) = batch();
    let c = parse(&keys(Some("token"), Some("2"), None, None));
    let out = compute_rollout_correction_across(&c, &old, &rollout, &mask, &mut LocalOnly).unwrap();
    let lrs = [0.2, -0.1, 1.0, -0.3, 0.0f64];
    close(metric(&out, "kl"), -lrs.iter().sum::<f64>() / (5.0 + 1e-8));
    close(
        metric(&out, "k3_kl"),
        lrs.iter().map(|x| x.exp() - 1.0 - x).sum::<f64>() / (5.0 + 1e-8),
    );
    let train: [f64; 2] = [(-0.8 - 2.1 + 0.5) / 3.0, (-1.3 - 1.0) / 2.0];
    let roll: [f64; 2] = [(-1.0 - 2.0 - 0.5) / 3.0, -1.0];
    close(
        metric(&out, "training_ppl"),
        ((-train[0]).exp() + (-train[1]).exp()) / 2.0,
    );
    close(metric(&out, "rollout_log_ppl"), -(roll[0] + roll[1]) / 2.0);
    let d = [roll[0] - train[0], roll[1] - train[1]];
    close(metric(&out, "log_ppl_diff"), (d[0] + d[1]) / 2.0);
    close(metric(&out, "log_ppl_diff_max"), d[0].max(d[1]));
    close(metric(&out, "log_ppl_diff_min"), d[0].min(d[1]));
    close(
        metric(&out, "chi2_seq"),
        ((2.2f64).exp() - 1.0 + (-0.6f64).exp() - 1.0) / 2.0,
    );
}

/// Two ranks holding one row each reduce to the one-process numbers.
#[test]
fn metrics_span_ranks() {
    use std::sync::{Arc, Mutex};
    let (old, rollout, mask) = batch();
    let c = parse(&keys(
        Some("token"),
        Some("2.0"),
        Some("token_k1"),
        Some("2.0"),
    ));
    let whole =
        compute_rollout_correction_across(&c, &old, &rollout, &mask, &mut LocalOnly).unwrap();

    // Rank 1's vectors are replayed to rank 0: run rank 1 first with a recorder.
    #[derive(Default)]
    struct Rec(Arc<Mutex<Vec<Vec<f64>>>>, bool);
    impl CrossRankSum for Rec {
        fn sum_in_place(&mut self, v: &mut [f64]) -> std::result::Result<(), String> {
            self.combine(v, |a, b| a + b)
        }
        fn max_in_place(&mut self, v: &mut [f64]) -> std::result::Result<(), String> {
            self.combine(v, f64::max)
        }
    }
    impl Rec {
        fn combine(
            &mut self,
            v: &mut [f64],
            f: fn(f64, f64) -> f64,
        ) -> std::result::Result<(), String> {
            let mut log = self.0.lock().unwrap();
            if self.1 {
                let other = log.remove(0);
                v.iter_mut().zip(other).for_each(|(a, b)| *a = f(*a, b));
            } else {
                log.push(v.to_vec());
            }
            Ok(())
        }
    }
    let row = |g: &Grid<f64>, r: usize| Grid::new(1, 3, g.row(r).to_vec()).unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    compute_rollout_correction_across(
        &c,
        &row(&old, 1),
        &row(&rollout, 1),
        &row(&mask, 1),
        &mut Rec(log.clone(), false),
    )
    .unwrap();
    let part = compute_rollout_correction_across(
        &c,
        &row(&old, 0),
        &row(&rollout, 0),
        &row(&mask, 0),
        &mut Rec(log, true),
    )
    .unwrap();
    // Rank 0 saw every statistic of the batch except the std (a sum-of-squares form): compare all.
    for (name, v) in &whole.metrics {
        let got = part.metrics.iter().find(|m| &m.0 == name).unwrap().1;
        assert!((got - v).abs() < 1e-9, "{name}: {got} vs {v}");
    }
}

#[test]
fn bad_settings_are_named() {
    let err = |k: RolloutCorrectionKeys| RolloutCorrection::from_keys(&k).unwrap_err().to_string();
    let e = err(keys(Some("tokens"), Some("2"), None, None));
    assert!(e.contains("rollout_is") && e.contains("tokens"), "{e}");
    let e = err(keys(Some("token"), None, None, None));
    assert!(e.contains("rollout_is_threshold"), "{e}");
    let e = err(keys(Some("token"), Some("2.0_1.0"), None, None));
    assert!(e.contains("lower <= upper"), "{e}");
    let e = err(keys(None, None, Some("geometric"), Some("1.001")));
    assert!(e.contains("seq_mean_k1"), "{e}");
    let e = err(keys(None, None, Some("token_k1"), None));
    assert!(e.contains("rollout_rs_threshold"), "{e}");
    let e = err(keys(None, None, Some("token_k2"), Some("0.5_2")));
    assert!(e.contains("k2/k3"), "{e}");
    let e = err(keys(
        None,
        None,
        Some("token_k1,token_k2,token_k3"),
        Some("2,0.1"),
    ));
    assert!(e.contains("one threshold per"), "{e}");
    let e = err(keys(None, None, Some("token_k4"), Some("1")));
    assert!(e.contains("token_k4") && e.contains("seq_mean_k1"), "{e}");
    let mut k = keys(None, None, None, None);
    k.loss_type = "pg".into();
    assert!(err(k).contains("loss_type"));
}
