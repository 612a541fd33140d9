//! KL estimators between the policy and the reference policy (verl's `kl_penalty`), used as the actor's KL
//! loss (`actor.kl_loss_type`, `actor.kl_loss_coef`). See J. Schulman, "Approximating KL divergence" (2020).

use std::fmt;

use tch::Tensor;

use crate::agg::check_same_shape;
use crate::error::{LossError, Result, TorchContext};

/// k3 clamps its log-ratio and its result (verl's constants) so a token far off the reference cannot explode.
const K3_LOG_RATIO_CLAMP: f64 = 20.0;
const K3_VALUE_CLAMP: f64 = 10.0;

/// The per-token estimator whose value is reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KlEstimator {
    /// `log π - log π_ref` ("kl", "k1").
    K1,
    /// `|log π - log π_ref|` ("abs").
    Abs,
    /// `½ (log π - log π_ref)²` ("mse", "k2").
    K2,
    /// `exp(log π_ref - log π) - (log π_ref - log π) - 1`, clamped ("low_var_kl", "k3").
    K3,
}

/// A KL penalty as configured: an estimator, optionally with k2's gradient (the "+" names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KlPenalty {
    pub estimator: KlEstimator,
    /// Straight-through: the value is the estimator's, the gradient is k2's. k1 and k3 are unbiased for the
    /// KL value but their expected gradient is not the KL's gradient; k2's is.
    pub k2_gradient: bool,
}

const NAMES: [(&str, KlEstimator); 7] = [
    ("kl", KlEstimator::K1),
    ("k1", KlEstimator::K1),
    ("abs", KlEstimator::Abs),
    ("mse", KlEstimator::K2),
    ("k2", KlEstimator::K2),
    ("low_var_kl", KlEstimator::K3),
    ("k3", KlEstimator::K3),
];

impl KlPenalty {
    /// Every name accepted (verl's, plus each with a trailing "+").
    pub fn valid_names() -> Vec<&'static str> {
        const PLUS: [&str; 7] = ["kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+"];
        NAMES.iter().map(|(n, _)| *n).chain(PLUS).collect()
    }

    /// Parses a verl name (`kl`, `k1`, `abs`, `mse`, `k2`, `low_var_kl`, `k3`, each optionally followed by
    /// `+`); `key` is the config key the value came from. `full` is rejected as in verl.
    pub fn parse(key: &'static str, name: &str) -> Result<Self> {
        let (base, plus) = match name.strip_suffix('+') {
            Some(b) => (b, true),
            None => (name, false),
        };
        let estimator = NAMES
            .iter()
            .find(|(n, _)| *n == base)
            .map(|(_, e)| *e)
            .ok_or_else(|| LossError::UnknownName {
                key,
                found: name.to_string(),
                valid: Self::valid_names(),
                note: (base == "full").then(|| {
                    "\"full\" needs the whole vocabulary distribution; verl does not implement it either"
                        .to_string()
                }),
            })?;
        Ok(KlPenalty {
            estimator,
            // k2 already has k2's gradient, so "k2+" is k2.
            k2_gradient: plus && estimator != KlEstimator::K2,
        })
    }

    /// Per-token penalty, same shape as the inputs; differentiable with respect to `log_prob` (and `ref_log_prob`).
    pub fn compute(&self, log_prob: &Tensor, ref_log_prob: &Tensor) -> Result<Tensor> {
        const OP: &str = "kl_penalty";
        check_same_shape(OP, "ref_log_prob", ref_log_prob, "log_prob", log_prob)?;
        let forward = estimate(self.estimator, log_prob, ref_log_prob)?;
        if !self.k2_gradient {
            return Ok(forward);
        }
        let k2 = estimate(KlEstimator::K2, log_prob, ref_log_prob)?;
        // k2 - sg(k2) + sg(forward): the value of `forward`, the gradient of k2.
        k2.f_sub(&k2.f_detach().op(OP)?)
            .op(OP)?
            .f_add(&forward.f_detach().op(OP)?)
            .op(OP)
    }
}

fn estimate(e: KlEstimator, log_prob: &Tensor, ref_log_prob: &Tensor) -> Result<Tensor> {
    const OP: &str = "kl_penalty";
    let diff = log_prob.f_sub(ref_log_prob).op(OP)?;
    match e {
        KlEstimator::K1 => Ok(diff),
        KlEstimator::Abs => diff.f_abs().op(OP),
        KlEstimator::K2 => diff.f_square().op(OP)?.f_mul_scalar(0.5).op(OP),
        KlEstimator::K3 => {
            let kl = diff
                .f_neg()
                .op(OP)?
                .f_clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
                .op(OP)?;
            kl.f_exp()
                .op(OP)?
                .f_sub(&kl)
                .op(OP)?
                .f_sub_scalar(1.0)
                .op(OP)?
                .f_clamp(-K3_VALUE_CLAMP, K3_VALUE_CLAMP)
                .op(OP)
        }
    }
}

impl fmt::Display for KlPenalty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let base = match self.estimator {
            KlEstimator::K1 => "k1",
            KlEstimator::Abs => "abs",
            KlEstimator::K2 => "k2",
            KlEstimator::K3 => "k3",
        };
        write!(f, "{base}{}", if self.k2_gradient { "+" } else { "" })
    }
}
