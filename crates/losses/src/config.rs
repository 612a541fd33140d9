//! The slices of verl's `actor` / `critic` config this crate reads, with verl's defaults, and the actor's
//! complete update loss (policy loss − entropy bonus + KL loss) built from them.

use std::collections::BTreeMap;

use serde::Deserialize;
use tch::Tensor;

use crate::agg::{agg_loss, AggSpec, LossAggMode, Normaliser};
use crate::deferred::DeferredMetrics;
use crate::error::{LossError, Result, TorchContext};
use crate::kl::KlPenalty;
use crate::policy::{DppoDivergence, PolicyInputs, PolicyLoss, POLICY_LOSS_MODES};
use crate::value::{value_loss, ValueInputs, ValueOutput};

/// `actor.policy_loss`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct PolicyLossSection {
    pub loss_mode: String,
}

impl Default for PolicyLossSection {
    fn default() -> Self {
        PolicyLossSection {
            loss_mode: "vanilla".into(),
        }
    }
}

/// The keys of verl's `actor_rollout_ref.actor` section that shape the update loss. Deserialize it from the
/// whole section: other keys are ignored. Defaults are verl's `actor.yaml`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct ActorLossConfig {
    pub policy_loss: PolicyLossSection,
    pub clip_ratio: f64,
    pub clip_ratio_low: Option<f64>,
    pub clip_ratio_high: Option<f64>,
    pub clip_ratio_c: f64,
    pub tau_pos: f64,
    pub tau_neg: f64,
    pub loss_agg_mode: String,
    pub loss_scale_factor: Option<f64>,
    pub entropy_coeff: f64,
    pub use_kl_loss: bool,
    pub kl_loss_coef: f64,
    pub kl_loss_type: String,
}

impl Default for ActorLossConfig {
    fn default() -> Self {
        ActorLossConfig {
            policy_loss: PolicyLossSection::default(),
            clip_ratio: 0.2,
            clip_ratio_low: Some(0.2),
            clip_ratio_high: Some(0.2),
            clip_ratio_c: 3.0,
            tau_pos: 1.0,
            tau_neg: 1.05,
            loss_agg_mode: "token-mean".into(),
            loss_scale_factor: None,
            entropy_coeff: 0.0,
            use_kl_loss: false,
            kl_loss_coef: 0.001,
            kl_loss_type: "low_var_kl".into(),
        }
    }
}

/// The keys of verl's `critic` section that shape the value loss.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default)]
pub struct CriticLossConfig {
    pub cliprange_value: f64,
    pub loss_agg_mode: String,
    pub loss_scale_factor: Option<f64>,
}

impl Default for CriticLossConfig {
    fn default() -> Self {
        CriticLossConfig {
            cliprange_value: 0.5,
            loss_agg_mode: "token-mean".into(),
            loss_scale_factor: None,
        }
    }
}

/// The critic's loss, resolved from [`CriticLossConfig`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CriticLoss {
    pub cliprange_value: f64,
    pub agg: AggSpec,
}

impl CriticLoss {
    pub fn from_config(cfg: &CriticLossConfig) -> Result<Self> {
        Ok(CriticLoss {
            cliprange_value: cfg.cliprange_value,
            agg: AggSpec {
                mode: LossAggMode::parse("critic.loss_agg_mode", &cfg.loss_agg_mode)?,
                loss_scale_factor: cfg.loss_scale_factor,
            },
        })
    }

    pub fn compute(&self, x: &ValueInputs<'_>, norm: &Normaliser) -> Result<ValueOutput> {
        value_loss(x, self.cliprange_value, self.agg, norm)
    }
}

/// The actor's update loss, resolved from [`ActorLossConfig`]: every name parsed, every fallback applied.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ActorLoss {
    pub policy: PolicyLoss,
    pub agg: AggSpec,
    pub entropy_coeff: f64,
    /// `Some((penalty, kl_loss_coef))` when `use_kl_loss` is set.
    pub kl: Option<(KlPenalty, f64)>,
}

/// Per-micro-batch tensors of the actor update; all `[batch, response_len]`.
pub struct ActorInputs<'a> {
    pub old_log_prob: &'a Tensor,
    pub log_prob: &'a Tensor,
    pub advantages: &'a Tensor,
    pub response_mask: &'a Tensor,
    /// Per-token entropy of the current policy; needed when `entropy_coeff != 0`, logged when given.
    pub entropy: Option<&'a Tensor>,
    /// Reference policy log-probs; needed when `use_kl_loss`.
    pub ref_log_prob: Option<&'a Tensor>,
    pub rollout_is_weights: Option<&'a Tensor>,
}

pub struct ActorOutput {
    /// `pg_loss - entropy_coeff · entropy + kl_loss_coef · kl_loss`, differentiable; call `backward()` on it.
    pub loss: Tensor,
    /// verl's names: `actor/pg_loss`, `actor/pg_clipfrac`, `actor/pg_clipfrac_lower`, `actor/ppo_kl`,
    /// `actor/entropy` (when entropy is given), `actor/kl_loss` and `actor/kl_coef` (with `use_kl_loss`).
    pub metrics: BTreeMap<String, f64>,
}

impl ActorLoss {
    pub fn from_config(cfg: &ActorLossConfig) -> Result<Self> {
        let policy = PolicyLoss::from_config(cfg)?;
        let agg = AggSpec {
            mode: LossAggMode::parse("actor.loss_agg_mode", &cfg.loss_agg_mode)?,
            loss_scale_factor: cfg.loss_scale_factor,
        };
        if !cfg.entropy_coeff.is_finite() {
            return Err(LossError::InvalidValue {
                key: "actor.entropy_coeff",
                expected: "a finite number",
                found: cfg.entropy_coeff,
            });
        }
        let kl = if cfg.use_kl_loss {
            if !cfg.kl_loss_coef.is_finite() {
                return Err(LossError::InvalidValue {
                    key: "actor.kl_loss_coef",
                    expected: "a finite number",
                    found: cfg.kl_loss_coef,
                });
            }
            Some((
                KlPenalty::parse("actor.kl_loss_type", &cfg.kl_loss_type)?,
                cfg.kl_loss_coef,
            ))
        } else {
            None
        };
        Ok(ActorLoss {
            policy,
            agg,
            entropy_coeff: cfg.entropy_coeff,
            kl,
        })
    }

    /// Whether the backend must compute per-token entropy for [`ActorLoss::compute`].
    pub fn needs_entropy(&self) -> bool {
        self.entropy_coeff != 0.0
    }

    /// One micro-batch's loss. Every term is aggregated with the same normaliser, so with
    /// [`Normaliser::Global`] the sum over micro-batches is the mini-batch loss (see [`crate::agg`]).
    pub fn compute(&self, x: &ActorInputs<'_>, norm: &Normaliser) -> Result<ActorOutput> {
        let (loss, metrics) = self.compute_deferred(x, norm)?;
        Ok(ActorOutput {
            loss,
            metrics: metrics.resolve()?,
        })
    }

    /// [`ActorLoss::compute`] with the metrics left on the device (the host does not wait for
    /// the device): a backend fetches them once for all its micro-batches.
    pub fn compute_deferred(
        &self,
        x: &ActorInputs<'_>,
        norm: &Normaliser,
    ) -> Result<(Tensor, DeferredMetrics)> {
        const OP: &str = "actor_loss";
        let (mut loss, mut metrics) = self.policy.compute_deferred(
            &PolicyInputs {
                old_log_prob: x.old_log_prob,
                log_prob: x.log_prob,
                advantages: x.advantages,
                response_mask: x.response_mask,
                rollout_is_weights: x.rollout_is_weights,
            },
            self.agg,
            norm,
        )?;

        match (x.entropy, self.needs_entropy()) {
            (None, true) => {
                return Err(LossError::MissingInput {
                    op: OP,
                    input: "entropy",
                    reason: "actor.entropy_coeff is non-zero",
                })
            }
            (None, false) => {}
            (Some(entropy), _) => {
                let ent = agg_loss(entropy, x.response_mask, self.agg, norm)?;
                metrics.push("actor/entropy", &ent)?;
                if self.needs_entropy() {
                    loss = loss
                        .f_sub(&ent.f_mul_scalar(self.entropy_coeff).op(OP)?)
                        .op(OP)?;
                }
            }
        }

        if let Some((penalty, coef)) = self.kl {
            let ref_lp = x.ref_log_prob.ok_or(LossError::MissingInput {
                op: OP,
                input: "ref_log_prob",
                reason: "actor.use_kl_loss is set",
            })?;
            let kld = penalty.compute(x.log_prob, ref_lp)?;
            let kl_loss = agg_loss(&kld, x.response_mask, self.agg, norm)?;
            metrics.push("actor/kl_loss", &kl_loss)?;
            metrics.push_host("actor/kl_coef", coef);
            loss = loss.f_add(&kl_loss.f_mul_scalar(coef).op(OP)?).op(OP)?;
        }
        Ok((loss, metrics))
    }
}

impl PolicyLoss {
    /// Resolves a loss from verl's `actor` keys. `clip_ratio_low/high` fall back to `clip_ratio` as in verl.
    pub fn from_config(cfg: &ActorLossConfig) -> Result<Self> {
        let low = cfg.clip_ratio_low.unwrap_or(cfg.clip_ratio);
        let high = cfg.clip_ratio_high.unwrap_or(cfg.clip_ratio);
        let mode = cfg.policy_loss.loss_mode.as_str();
        let loss = match mode {
            "vanilla" => PolicyLoss::Vanilla {
                clip_ratio_low: low,
                clip_ratio_high: high,
                clip_ratio_c: cfg.clip_ratio_c,
            },
            "gspo" => PolicyLoss::Gspo {
                clip_ratio_low: low,
                clip_ratio_high: high,
            },
            "sapo" => PolicyLoss::Sapo {
                tau_pos: cfg.tau_pos,
                tau_neg: cfg.tau_neg,
            },
            "gpg" => PolicyLoss::Gpg,
            "cispo" => PolicyLoss::Cispo {
                clip_ratio_low: low,
                clip_ratio_high: high,
            },
            "geo_mean" => PolicyLoss::GeoMean {
                clip_ratio_low: low,
                clip_ratio_high: high,
            },
            "dppo_tv" | "dppo_kl" => PolicyLoss::Dppo {
                divergence: if mode == "dppo_tv" {
                    DppoDivergence::Tv
                } else {
                    DppoDivergence::Kl
                },
                clip_ratio_low: low,
                clip_ratio_high: high,
                clip_ratio_c: cfg.clip_ratio_c,
            },
            other => {
                let note = crate::policy::VERL_ONLY_MODES.contains(&other).then(|| {
                    format!("{other:?} exists in verl but is not implemented by verl-losses")
                });
                return Err(LossError::UnknownName {
                    key: "actor.policy_loss.loss_mode",
                    found: other.to_string(),
                    valid: POLICY_LOSS_MODES.to_vec(),
                    note,
                });
            }
        };
        loss.validate()?;
        Ok(loss)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kl::KlEstimator;

    /// The actor's and critic's loss keys, each set away from its default, arrive in the losses
    /// the backends build (under verl's names, with verl's clip-range fallback).
    #[test]
    fn loss_configs_read_the_verl_keys_they_name() {
        let actor: ActorLossConfig = serde_json::from_value(serde_json::json!({
            "policy_loss": {"loss_mode": "vanilla"},
            "clip_ratio": 0.3, "clip_ratio_low": 0.1, "clip_ratio_high": 0.28, "clip_ratio_c": 4.0,
            "loss_agg_mode": "seq-mean-token-sum-norm", "loss_scale_factor": 512.0,
            "entropy_coeff": 0.01, "use_kl_loss": true, "kl_loss_coef": 0.05,
            "kl_loss_type": "k3+", "tau_pos": 1.5, "tau_neg": 2.0
        }))
        .unwrap();
        let loss = ActorLoss::from_config(&actor).unwrap();
        assert_eq!(
            loss.policy,
            PolicyLoss::Vanilla {
                clip_ratio_low: 0.1,
                clip_ratio_high: 0.28,
                clip_ratio_c: 4.0
            }
        );
        assert_eq!(loss.agg.mode, LossAggMode::SeqMeanTokenSumNorm);
        assert_eq!(loss.agg.loss_scale_factor, Some(512.0));
        assert_eq!(loss.entropy_coeff, 0.01);
        let (kl, coef) = loss.kl.unwrap();
        assert_eq!(
            (kl.estimator, kl.k2_gradient, coef),
            (KlEstimator::K3, true, 0.05)
        );

        // Null clip_ratio_low/high fall back to clip_ratio; SAPO reads tau_pos/tau_neg.
        let mut v = serde_json::json!({
            "policy_loss": {"loss_mode": "vanilla"}, "clip_ratio": 0.3,
            "clip_ratio_low": null, "clip_ratio_high": null, "use_kl_loss": false
        });
        let fallback: ActorLossConfig = serde_json::from_value(v.clone()).unwrap();
        let loss = ActorLoss::from_config(&fallback).unwrap();
        assert_eq!(
            loss.policy,
            PolicyLoss::Vanilla {
                clip_ratio_low: 0.3,
                clip_ratio_high: 0.3,
                clip_ratio_c: 3.0
            }
        );
        assert!(loss.kl.is_none());
        v["policy_loss"]["loss_mode"] = "sapo".into();
        v["tau_pos"] = 1.5.into();
        v["tau_neg"] = 2.0.into();
        let sapo: ActorLossConfig = serde_json::from_value(v).unwrap();
        assert_eq!(
            ActorLoss::from_config(&sapo).unwrap().policy,
            PolicyLoss::Sapo {
                tau_pos: 1.5,
                tau_neg: 2.0
            }
        );

        let critic: CriticLossConfig = serde_json::from_value(serde_json::json!({
            "cliprange_value": 0.2, "loss_agg_mode": "seq-mean-token-mean",
            "loss_scale_factor": 64.0
        }))
        .unwrap();
        let c = CriticLoss::from_config(&critic).unwrap();
        assert_eq!(c.cliprange_value, 0.2);
        assert_eq!(c.agg.mode, LossAggMode::SeqMeanTokenMean);
        assert_eq!(c.agg.loss_scale_factor, Some(64.0));
    }
}
