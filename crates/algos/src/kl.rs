//! Reward-side KL: the per-token estimators ([`KlPenalty`], verl `kl_penalty`), the KL-in-reward step
//! ([`apply_kl_penalty`], verl `ray_trainer.apply_kl_penalty`) and the coefficient controllers
//! ([`KlController`], verl `FixedKLController` / `AdaptiveKLController`).
//!
//! Nothing here takes gradients: the actor's KL *loss* lives in the losses plugin.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{AlgoError, Result};
use crate::grid::Grid;
use crate::stats::{self, CrossRankSum, LocalOnly};

/// Metric name verl logs for the batch-mean KL (`actor/reward_kl_penalty`).
pub const METRIC_REWARD_KL_PENALTY: &str = "actor/reward_kl_penalty";
/// Metric name verl logs for the coefficient used this step (`actor/reward_kl_penalty_coeff`).
pub const METRIC_REWARD_KL_PENALTY_COEFF: &str = "actor/reward_kl_penalty_coeff";

const PENALTY_KEY: &str = "algorithm.kl_penalty";
const CTRL_TYPE_KEY: &str = "algorithm.kl_ctrl.type";

/// A per-token KL estimator (Schulman's k1/k2/k3 and the absolute difference), named as in verl.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "&'static str")]
pub enum KlPenalty {
    /// `"kl"` / `"k1"`: `logprob − ref_logprob`.
    Kl,
    /// `"abs"`: `|logprob − ref_logprob|`.
    Abs,
    /// `"mse"` / `"k2"`: `½ (logprob − ref_logprob)²`.
    Mse,
    /// `"low_var_kl"` / `"k3"`: `exp(ref − logprob) − (ref − logprob) − 1`, with the log-ratio clamped to
    /// ±20 and the result to ±10 for numerical stability, as verl does.
    LowVarKl,
}

impl KlPenalty {
    /// Every accepted name (aliases included).
    pub const NAMES: &'static [&'static str] =
        &["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"];

    /// verl's canonical name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Kl => "kl",
            Self::Abs => "abs",
            Self::Mse => "mse",
            Self::LowVarKl => "low_var_kl",
        }
    }

    /// The estimate for one token. Mirrors verl `kl_penalty_forward` elementwise.
    pub fn estimate(self, logprob: f64, ref_logprob: f64) -> f64 {
        match self {
            Self::Kl => logprob - ref_logprob,
            Self::Abs => (logprob - ref_logprob).abs(),
            Self::Mse => 0.5 * (logprob - ref_logprob) * (logprob - ref_logprob),
            Self::LowVarKl => {
                let log_ratio = (ref_logprob - logprob).clamp(-20.0, 20.0);
                (log_ratio.exp() - log_ratio - 1.0).clamp(-10.0, 10.0)
            }
        }
    }
}

impl fmt::Display for KlPenalty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl From<KlPenalty> for &'static str {
    fn from(p: KlPenalty) -> Self {
        p.name()
    }
}

impl FromStr for KlPenalty {
    type Err = AlgoError;

    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "kl" | "k1" => Self::Kl,
            "abs" => Self::Abs,
            "mse" | "k2" => Self::Mse,
            "low_var_kl" | "k3" => Self::LowVarKl,
            "full" => return Err(AlgoError::Unsupported {
                key: PENALTY_KEY,
                found: s.to_owned(),
                reason:
                    "the full-vocabulary KL needs every token's logits, not the sampled log-probs \
                             (verl raises NotImplementedError too)",
            }),
            _ if s.ends_with('+') => {
                return Err(AlgoError::Unsupported {
                    key: PENALTY_KEY,
                    found: s.to_owned(),
                    reason:
                        "the `+` straight-through variants only change gradients; they belong to \
                             `actor_rollout_ref.actor.kl_loss_type`, not to the reward-side penalty",
                })
            }
            _ => {
                return Err(AlgoError::UnknownName {
                    key: PENALTY_KEY,
                    found: s.to_owned(),
                    expected: Self::NAMES,
                })
            }
        })
    }
}

impl TryFrom<String> for KlPenalty {
    type Error = AlgoError;
    fn try_from(s: String) -> Result<Self> {
        s.parse()
    }
}

/// The per-token KL estimate of a whole batch. Mirrors verl `core_algos.kl_penalty` (forward value).
pub fn kl_penalty(
    logprob: &Grid<f64>,
    ref_logprob: &Grid<f64>,
    penalty: KlPenalty,
) -> Result<Grid<f64>> {
    logprob.check_same_shape(ref_logprob, "kl_penalty", "logprob", "ref_logprob")?;
    let data = logprob
        .as_slice()
        .iter()
        .zip(ref_logprob.as_slice())
        .map(|(&lp, &rp)| penalty.estimate(lp, rp));
    Grid::new(logprob.rows(), logprob.cols(), data.collect())
}

/// What [`apply_kl_penalty`] reports, under verl's metric names.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KlMetrics {
    /// `actor/reward_kl_penalty`: the batch mean of each response's masked-mean KL.
    pub reward_kl_penalty: f64,
    /// `actor/reward_kl_penalty_coeff`: the coefficient used for this batch (before the controller update).
    pub reward_kl_penalty_coeff: f64,
}

impl KlMetrics {
    /// `(verl metric name, value)` pairs, ready for the metrics logger.
    pub fn to_named(&self) -> [(&'static str, f64); 2] {
        [
            (METRIC_REWARD_KL_PENALTY, self.reward_kl_penalty),
            (METRIC_REWARD_KL_PENALTY_COEFF, self.reward_kl_penalty_coeff),
        ]
    }
}

/// The result of [`apply_kl_penalty`].
#[derive(Debug, Clone, PartialEq)]
pub struct KlPenaltyOutput {
    /// `token_level_scores − β · KL · response_mask`.
    pub token_level_rewards: Grid<f64>,
    /// The step's KL metrics.
    pub metrics: KlMetrics,
}

/// KL-in-reward (`algorithm.use_kl_in_reward`): subtracts `β·KL` from every response token's score, with `β`
/// the controller's current value, then lets the controller adapt to the batch's mean KL with
/// `n_steps = batch size`. Mirrors verl `ray_trainer.apply_kl_penalty`.
pub fn apply_kl_penalty(
    token_level_scores: &Grid<f64>,
    old_log_probs: &Grid<f64>,
    ref_log_prob: &Grid<f64>,
    response_mask: &Grid<f64>,
    kl_ctrl: &mut KlController,
    penalty: KlPenalty,
) -> Result<KlPenaltyOutput> {
    apply_kl_penalty_across(
        token_level_scores,
        old_log_probs,
        ref_log_prob,
        response_mask,
        kl_ctrl,
        penalty,
        &mut LocalOnly,
    )
}

/// [`apply_kl_penalty`] on one data-parallel shard: the mean KL and the batch size fed to the controller are
/// those of the whole batch (summed over ranks with `reducer`), so every rank's controller stays identical.
pub fn apply_kl_penalty_across(
    token_level_scores: &Grid<f64>,
    old_log_probs: &Grid<f64>,
    ref_log_prob: &Grid<f64>,
    response_mask: &Grid<f64>,
    kl_ctrl: &mut KlController,
    penalty: KlPenalty,
    reducer: &mut dyn CrossRankSum,
) -> Result<KlPenaltyOutput> {
    const OP: &str = "apply_kl_penalty";
    let check = |input, g: &Grid<f64>| {
        token_level_scores.check_same_shape(g, OP, "token_level_scores", input)
    };
    check("old_log_probs", old_log_probs)?;
    check("ref_log_prob", ref_log_prob)?;
    check("response_mask", response_mask)?;

    let mut kld = kl_penalty(old_log_probs, ref_log_prob, penalty)?;
    kld.as_mut_slice()
        .iter_mut()
        .zip(response_mask.as_slice())
        .for_each(|(k, m)| *k *= m);
    let beta = kl_ctrl.value();
    let mut token_level_rewards = token_level_scores.clone();
    token_level_rewards
        .as_mut_slice()
        .iter_mut()
        .zip(kld.as_slice())
        .for_each(|(r, k)| *r -= beta * k);

    let per_row = stats::masked_mean_per_row(&kld, response_mask)?;
    let mut totals = [per_row.iter().sum::<f64>(), per_row.len() as f64];
    stats::reduce(reducer, OP, &mut totals)?;
    let [kl_sum, batch_size] = totals;
    if batch_size == 0.0 {
        // verl would log NaN and poison an adaptive coefficient; an empty batch is a caller bug.
        return Err(AlgoError::InvalidParam {
            key: "token_level_scores",
            found: "an empty batch (0 rows)".into(),
            expected: "at least one response",
        });
    }
    let current_kl = kl_sum / batch_size;
    // Batch sizes are far below 2^53, so the float count is exact.
    kl_ctrl.update(current_kl, batch_size as usize);

    Ok(KlPenaltyOutput {
        token_level_rewards,
        metrics: KlMetrics {
            reward_kl_penalty: current_kl,
            reward_kl_penalty_coeff: beta,
        },
    })
}

/// `algorithm.kl_ctrl.type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(try_from = "String", into = "&'static str")]
pub enum KlCtrlType {
    /// The coefficient never changes.
    #[default]
    Fixed,
    /// The coefficient tracks `target_kl` (Ziegler et al. 2019).
    Adaptive,
}

impl KlCtrlType {
    /// Accepted names.
    pub const NAMES: &'static [&'static str] = &["fixed", "adaptive"];

    /// verl's name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Fixed => "fixed",
            Self::Adaptive => "adaptive",
        }
    }
}

impl From<KlCtrlType> for &'static str {
    fn from(t: KlCtrlType) -> Self {
        t.name()
    }
}

impl FromStr for KlCtrlType {
    type Err = AlgoError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "fixed" => Ok(Self::Fixed),
            "adaptive" => Ok(Self::Adaptive),
            _ => Err(AlgoError::UnknownName {
                key: CTRL_TYPE_KEY,
                found: s.to_owned(),
                expected: Self::NAMES,
            }),
        }
    }
}

impl TryFrom<String> for KlCtrlType {
    type Error = AlgoError;
    fn try_from(s: String) -> Result<Self> {
        s.parse()
    }
}

/// `algorithm.kl_ctrl`, with verl's `KLControlConfig` defaults.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct KlCtrlConfig {
    /// `type`: `fixed` or `adaptive`.
    #[serde(rename = "type")]
    pub kind: KlCtrlType,
    /// `kl_coef`: the (initial) coefficient β.
    pub kl_coef: f64,
    /// `horizon`: adaptive only; how many samples it takes to move β by the full proportional error.
    pub horizon: i64,
    /// `target_kl`: adaptive only; the KL β is steered towards.
    pub target_kl: f64,
}

impl Default for KlCtrlConfig {
    fn default() -> Self {
        Self {
            kind: KlCtrlType::Fixed,
            kl_coef: 0.001,
            horizon: 10000,
            target_kl: 0.1,
        }
    }
}

/// The KL coefficient β and how it evolves. Mirrors verl `FixedKLController` / `AdaptiveKLController`.
#[derive(Debug, Clone, PartialEq)]
pub enum KlController {
    /// β never changes.
    Fixed {
        /// β.
        value: f64,
    },
    /// β is multiplied by `1 + clip(kl/target − 1, ±0.2) · n_steps / horizon` after each batch.
    Adaptive {
        /// β.
        value: f64,
        /// `target_kl`.
        target: f64,
        /// `horizon`.
        horizon: f64,
    },
}

impl KlController {
    /// A controller that keeps β at `kl_coef`.
    pub fn fixed(kl_coef: f64) -> Self {
        Self::Fixed { value: kl_coef }
    }

    /// An adaptive controller starting at `init_kl_coef`. Fails unless `horizon > 0` (as verl asserts) and
    /// `target_kl > 0` (verl would divide by zero on the first update).
    pub fn adaptive(init_kl_coef: f64, target_kl: f64, horizon: i64) -> Result<Self> {
        if horizon <= 0 {
            return Err(AlgoError::InvalidParam {
                key: "algorithm.kl_ctrl.horizon",
                found: horizon.to_string(),
                expected: "an integer > 0 for the adaptive controller",
            });
        }
        if target_kl.is_nan() || target_kl <= 0.0 {
            return Err(AlgoError::InvalidParam {
                key: "algorithm.kl_ctrl.target_kl",
                found: target_kl.to_string(),
                expected: "a number > 0 for the adaptive controller",
            });
        }
        // i64 → f64 is exact for any sensible horizon; verl divides in float too.
        Ok(Self::Adaptive {
            value: init_kl_coef,
            target: target_kl,
            horizon: horizon as f64,
        })
    }

    /// Builds the controller `config` describes. Mirrors verl `get_kl_controller`.
    pub fn from_config(config: &KlCtrlConfig) -> Result<Self> {
        match config.kind {
            KlCtrlType::Fixed => Ok(Self::fixed(config.kl_coef)),
            KlCtrlType::Adaptive => {
                Self::adaptive(config.kl_coef, config.target_kl, config.horizon)
            }
        }
    }

    /// The current coefficient β (verl's `kl_ctrl.value`).
    pub fn value(&self) -> f64 {
        match *self {
            Self::Fixed { value } | Self::Adaptive { value, .. } => value,
        }
    }

    /// Feeds one batch's mean KL and size to the controller. A no-op for [`KlController::Fixed`].
    /// Mirrors verl `AdaptiveKLController.update(current_kl, n_steps)`.
    pub fn update(&mut self, current_kl: f64, n_steps: usize) {
        if let Self::Adaptive {
            value,
            target,
            horizon,
        } = self
        {
            let proportional_error = (current_kl / *target - 1.0).clamp(-0.2, 0.2);
            // Batch sizes are far below 2^53, so the float count is exact.
            let mult = 1.0 + proportional_error * n_steps as f64 / *horizon;
            *value *= mult;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grid(rows: &[&[f64]]) -> Grid<f64> {
        Grid::from_rows(rows).unwrap()
    }

    #[test]
    fn estimators_match_their_formulas() {
        let (lp, rp) = (-1.0, -1.5);
        assert_eq!(KlPenalty::Kl.estimate(lp, rp), 0.5);
        assert_eq!(KlPenalty::Abs.estimate(rp, lp), 0.5);
        assert_eq!(KlPenalty::Mse.estimate(lp, rp), 0.125);
        let k3 = (-0.5f64).exp() + 0.5 - 1.0;
        assert!((KlPenalty::LowVarKl.estimate(lp, rp) - k3).abs() < 1e-15);
        assert_eq!(KlPenalty::LowVarKl.estimate(-2.0, -2.0), 0.0);
    }

    #[test]
    fn low_var_kl_is_clamped_like_verl() {
        // ref − logprob = 30 is clamped to 20 first, then exp(20) − 21 is clamped to 10.
        assert_eq!(KlPenalty::LowVarKl.estimate(-40.0, -10.0), 10.0);
        // A very negative log-ratio: clamp to −20 gives exp(−20) + 19, clamped to 10.
        assert_eq!(KlPenalty::LowVarKl.estimate(0.0, -100.0), 10.0);
        // Inside the range nothing is clamped.
        let v = KlPenalty::LowVarKl.estimate(0.0, -2.0);
        assert!((v - ((-2.0f64).exp() + 1.0)).abs() < 1e-15);
    }

    #[test]
    fn names_and_aliases_parse_and_serialise_canonically() {
        for (name, p) in [
            ("kl", KlPenalty::Kl),
            ("k1", KlPenalty::Kl),
            ("abs", KlPenalty::Abs),
            ("mse", KlPenalty::Mse),
            ("k2", KlPenalty::Mse),
            ("low_var_kl", KlPenalty::LowVarKl),
            ("k3", KlPenalty::LowVarKl),
        ] {
            assert_eq!(name.parse::<KlPenalty>().unwrap(), p, "{name}");
        }
        let json = serde_json::to_string(&KlPenalty::LowVarKl).unwrap();
        assert_eq!(json, "\"low_var_kl\"");
        assert_eq!(
            serde_json::from_str::<KlPenalty>("\"k3\"").unwrap(),
            KlPenalty::LowVarKl
        );
    }

    #[test]
    fn full_kl_is_a_clear_unsupported_error() {
        let err = "full".parse::<KlPenalty>().unwrap_err();
        assert!(
            matches!(
                err,
                AlgoError::Unsupported {
                    key: "algorithm.kl_penalty",
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("logits"), "{err}");
        let err = "k3+".parse::<KlPenalty>().unwrap_err();
        assert!(err.to_string().contains("kl_loss_type"), "{err}");
    }

    #[test]
    fn unknown_penalty_lists_the_valid_names_even_through_serde() {
        let err = serde_json::from_str::<KlPenalty>("\"kl_div\"")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`algorithm.kl_penalty`: unknown value `kl_div`"),
            "{err}"
        );
        assert!(
            err.contains("kl, k1, abs, mse, k2, low_var_kl, k3"),
            "{err}"
        );
    }

    #[test]
    fn kl_penalty_rejects_mismatched_shapes() {
        let err = kl_penalty(
            &Grid::filled(2, 3, 0.0),
            &Grid::filled(2, 2, 0.0),
            KlPenalty::Kl,
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "kl_penalty: `ref_logprob` has shape [2, 2], expected [2, 3] (the shape of `logprob`)"
        );
    }

    #[test]
    fn apply_kl_penalty_subtracts_beta_kl_on_the_mask_and_reports_metrics() {
        let scores = grid(&[&[0.0, 0.0, 1.0], &[0.0, 2.0, 0.0]]);
        let old = grid(&[&[-1.0, -1.0, -1.0], &[-1.0, -1.0, -1.0]]);
        let reference = grid(&[&[-1.5, -2.0, -1.0], &[-0.5, -1.25, -9.0]]);
        let mask = grid(&[&[1.0, 1.0, 1.0], &[1.0, 1.0, 0.0]]);
        let mut ctrl = KlController::fixed(0.1);
        let out =
            apply_kl_penalty(&scores, &old, &reference, &mask, &mut ctrl, KlPenalty::Kl).unwrap();
        // KL per token: row0 = [0.5, 1.0, 0.0]; row1 = [-0.5, 0.25, (8.0 masked out)].
        let expected = [[-0.05, -0.1, 1.0], [0.05, 2.0 - 0.025, 0.0]];
        for (r, row) in expected.iter().enumerate() {
            for (c, e) in row.iter().enumerate() {
                assert!(
                    (out.token_level_rewards[(r, c)] - e).abs() < 1e-12,
                    "({r},{c})"
                );
            }
        }
        // Per-row masked means 0.5 and -0.125; batch mean 0.1875.
        assert!((out.metrics.reward_kl_penalty - 0.1875).abs() < 1e-8);
        assert_eq!(out.metrics.reward_kl_penalty_coeff, 0.1);
        let named = out.metrics.to_named();
        assert_eq!(named[0].0, "actor/reward_kl_penalty");
        assert_eq!(named[1], ("actor/reward_kl_penalty_coeff", 0.1));
        assert_eq!(ctrl.value(), 0.1, "a fixed controller never moves");
    }

    #[test]
    fn apply_kl_penalty_reports_the_pre_update_coefficient_and_updates_with_the_batch_size() {
        let zeros = Grid::filled(4, 2, 0.0);
        let old = Grid::filled(4, 2, -1.0);
        let reference = Grid::filled(4, 2, -1.2); // KL 0.2 everywhere.
        let mask = Grid::filled(4, 2, 1.0);
        let mut ctrl = KlController::adaptive(0.5, 0.1, 100).unwrap();
        let out =
            apply_kl_penalty(&zeros, &old, &reference, &mask, &mut ctrl, KlPenalty::Kl).unwrap();
        assert_eq!(out.metrics.reward_kl_penalty_coeff, 0.5);
        // error clip(0.2/0.1 − 1) = 0.2; mult = 1 + 0.2·4/100.
        assert!(
            (ctrl.value() - 0.5 * 1.008).abs() < 1e-12,
            "{}",
            ctrl.value()
        );
    }

    #[test]
    fn apply_kl_penalty_names_the_mismatched_input() {
        let g = Grid::filled(2, 3, 0.0);
        let bad = Grid::filled(2, 4, 1.0);
        let mut ctrl = KlController::fixed(0.1);
        let err = apply_kl_penalty(&g, &g, &g, &bad, &mut ctrl, KlPenalty::Kl).unwrap_err();
        assert_eq!(
            err,
            AlgoError::ShapeMismatch {
                op: "apply_kl_penalty",
                input: "response_mask",
                reference: "token_level_scores",
                expected: (2, 3),
                found: (2, 4)
            }
        );
        let err = apply_kl_penalty(&g, &bad, &g, &g, &mut ctrl, KlPenalty::Kl).unwrap_err();
        assert!(err.to_string().contains("`old_log_probs`"), "{err}");
    }

    #[test]
    fn apply_kl_penalty_refuses_an_empty_batch() {
        let g = Grid::filled(0, 3, 0.0);
        let mut ctrl = KlController::adaptive(0.1, 0.1, 10).unwrap();
        assert!(apply_kl_penalty(&g, &g, &g, &g, &mut ctrl, KlPenalty::Kl).is_err());
        assert_eq!(ctrl.value(), 0.1);
    }

    /// Two ranks of two rows each: the metric and the controller's `n_steps` are those of all four rows.
    #[test]
    fn apply_kl_penalty_across_ranks_uses_whole_batch_kl_and_size() {
        struct OtherRank {
            kl_sum: f64,
            rows: f64,
        }
        impl CrossRankSum for OtherRank {
            fn sum_in_place(&mut self, values: &mut [f64]) -> std::result::Result<(), String> {
                match values {
                    [kl_sum, rows] => {
                        *kl_sum += self.kl_sum;
                        *rows += self.rows;
                        Ok(())
                    }
                    _ => Err(format!("expected 2 values, got {}", values.len())),
                }
            }
        }
        let zeros = Grid::filled(2, 2, 0.0);
        let old = Grid::filled(2, 2, -1.0);
        let reference = Grid::filled(2, 2, -1.1); // KL 0.1 per token here.
        let mask = Grid::filled(2, 2, 1.0);
        let mut ctrl = KlController::adaptive(1.0, 0.2, 10).unwrap();
        // The other rank's two rows have mean KL 0.5 each.
        let mut other = OtherRank {
            kl_sum: 1.0,
            rows: 2.0,
        };
        let out = apply_kl_penalty_across(
            &zeros,
            &old,
            &reference,
            &mask,
            &mut ctrl,
            KlPenalty::Kl,
            &mut other,
        )
        .unwrap();
        let expected_kl = (0.1 * 2.0 + 1.0) / 4.0;
        assert!((out.metrics.reward_kl_penalty - expected_kl).abs() < 1e-8);
        // error clip(0.3/0.2 − 1) = 0.2, n_steps = 4 → mult 1.08.
        assert!((ctrl.value() - 1.08).abs() < 1e-12, "{}", ctrl.value());
    }

    #[test]
    fn adaptive_controller_follows_verl_update_rule() {
        let mut c = KlController::adaptive(0.2, 0.1, 1000).unwrap();
        // KL far above target: error clipped to +0.2.
        c.update(1.0, 100);
        assert!((c.value() - 0.2 * 1.02).abs() < 1e-15);
        // KL far below target: error clipped to −0.2.
        c.update(0.0, 100);
        assert!((c.value() - 0.2 * 1.02 * 0.98).abs() < 1e-15);
        // Inside the clip: error = 0.11/0.1 − 1 = 0.1.
        let before = c.value();
        c.update(0.11, 50);
        assert!((c.value() - before * (1.0 + 0.1 * 50.0 / 1000.0)).abs() < 1e-15);
        // On target: no change.
        let before = c.value();
        c.update(0.1, 500);
        assert_eq!(c.value(), before);
    }

    #[test]
    fn fixed_controller_ignores_updates() {
        let mut c = KlController::fixed(0.001);
        c.update(123.0, 1024);
        assert_eq!(c.value(), 0.001);
    }

    #[test]
    fn controller_from_config_uses_verl_defaults_and_validates() {
        let cfg: KlCtrlConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(cfg, KlCtrlConfig::default());
        assert_eq!(
            KlController::from_config(&cfg).unwrap(),
            KlController::fixed(0.001)
        );

        let cfg: KlCtrlConfig = serde_json::from_str(
            r#"{"type": "adaptive", "kl_coef": 0.05, "horizon": 500, "target_kl": 0.02}"#,
        )
        .unwrap();
        assert_eq!(
            KlController::from_config(&cfg).unwrap(),
            KlController::Adaptive {
                value: 0.05,
                target: 0.02,
                horizon: 500.0
            }
        );

        let bad = KlCtrlConfig {
            kind: KlCtrlType::Adaptive,
            horizon: 0,
            ..KlCtrlConfig::default()
        };
        let err = KlController::from_config(&bad).unwrap_err().to_string();
        assert_eq!(err, "`algorithm.kl_ctrl.horizon`: got 0, expected an integer > 0 for the adaptive controller");
        // A fixed controller does not care about the horizon, as in verl.
        let fixed = KlCtrlConfig {
            horizon: 0,
            ..KlCtrlConfig::default()
        };
        assert!(KlController::from_config(&fixed).is_ok());

        let bad = KlCtrlConfig {
            kind: KlCtrlType::Adaptive,
            target_kl: 0.0,
            ..KlCtrlConfig::default()
        };
        assert!(KlController::from_config(&bad)
            .unwrap_err()
            .to_string()
            .contains("target_kl"));
    }

    #[test]
    fn unknown_controller_type_lists_the_valid_ones() {
        let err = serde_json::from_str::<KlCtrlConfig>(r#"{"type": "pid"}"#)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(
                "`algorithm.kl_ctrl.type`: unknown value `pid`, expected one of: fixed, adaptive"
            ),
            "{err}"
        );
    }
}
