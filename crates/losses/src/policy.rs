//! Policy-gradient losses, selected by verl's `actor.policy_loss.loss_mode`.

use std::collections::BTreeMap;

use tch::{Kind, Tensor};

use crate::agg::{
    agg_loss, check_2d, check_same_shape, mask_as, masked_mean, seq_mean, zero_outside, AggSpec,
    LossAggMode, Normaliser,
};
use crate::deferred::DeferredMetrics;
use crate::error::{LossError, Result, TorchContext};

/// verl clamps `log π - log π_old` to this range before `exp` so one wild token cannot overflow the ratio.
const LOG_RATIO_CLAMP: f64 = 20.0;
/// GSPO's clamp on the log of the sequence-level ratio.
const GSPO_LOG_RATIO_MAX: f64 = 10.0;

/// verl's policy-loss names this crate implements.
pub const POLICY_LOSS_MODES: [&str; 8] = [
    "vanilla", "gspo", "sapo", "gpg", "cispo", "geo_mean", "dppo_tv", "dppo_kl",
];
/// Names in verl's registry that this crate does not implement (they are rejected with a note, not as typos).
pub(crate) const VERL_ONLY_MODES: [&str; 5] =
    ["clip_cov", "kl_cov", "dro", "bypass_mode", "reinforce"];
/// verl's epsilon in GMPO's per-sequence means.
const GEO_MEAN_EPS: f64 = 1e-8;
/// verl's epsilon inside DPPO-KL's `log((1 - p_old) / (1 - p))`.
const DPPO_KL_EPS: f64 = 1e-8;
/// verl's epsilon under the log of GMPO's rollout importance weights.
const GEO_MEAN_IS_EPS: f64 = 1e-10;

/// A policy loss with its parameters resolved (verl's fallbacks applied).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PolicyLoss {
    /// PPO clipped surrogate with asymmetric clip range and dual-clip for negative advantages.
    Vanilla {
        clip_ratio_low: f64,
        clip_ratio_high: f64,
        clip_ratio_c: f64,
    },
    /// Sequence-level importance ratio (geometric mean over the sequence), always `seq-mean-token-mean`.
    Gspo {
        clip_ratio_low: f64,
        clip_ratio_high: f64,
    },
    /// Soft sigmoid gate on the token ratio instead of a hard clip, always `seq-mean-token-mean`.
    Sapo { tau_pos: f64, tau_neg: f64 },
    /// Plain `-A · log π` (no ratio).
    Gpg,
    /// `-sg(clip(ratio)) · A · log π`: clipped, stop-gradient importance weights.
    Cispo {
        clip_ratio_low: f64,
        clip_ratio_high: f64,
    },
    /// GMPO: the geometric mean of the token ratios (each clipped in log space on the side the
    /// advantage's sign selects) times the sequence's mean advantage, one term per sequence; the
    /// mean is over sequences, whatever `loss_agg_mode` says.
    GeoMean {
        clip_ratio_low: f64,
        clip_ratio_high: f64,
    },
    /// DPPO (`dppo_tv`, `dppo_kl`): `-A · sg(min(ratio, c)) · log π`, dropped for tokens that left
    /// the trust region: moved up past `clip_ratio_high` (A > 0) or down past `clip_ratio_low`
    /// (A ≤ 0) in the chosen divergence.
    Dppo {
        divergence: DppoDivergence,
        clip_ratio_low: f64,
        clip_ratio_high: f64,
        clip_ratio_c: f64,
    },
}

/// The divergence that bounds DPPO's trust region around the old policy, per sampled token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DppoDivergence {
    /// `dppo_tv`: the change of the token's probability (total variation of the binary distribution).
    Tv,
    /// `dppo_kl`: the binary KL divergence of the token's probability, one-sided.
    Kl,
}

/// Tensors a policy loss reads; all `[batch, response_len]`, floating point, same dtype.
pub struct PolicyInputs<'a> {
    pub old_log_prob: &'a Tensor,
    /// The current policy's log-probs; the returned loss is differentiable with respect to it.
    pub log_prob: &'a Tensor,
    pub advantages: &'a Tensor,
    pub response_mask: &'a Tensor,
    /// Rollout-correction importance weights, multiplied into the per-token loss as in verl.
    pub rollout_is_weights: Option<&'a Tensor>,
}

/// Diagnostics of one policy-loss call, named as verl logs them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PolicyMetrics {
    /// The aggregated loss value (`actor/pg_loss`).
    pub pg_loss: f64,
    /// `actor/pg_clipfrac`; `None` where verl reports nothing (gpg).
    pub pg_clipfrac: Option<f64>,
    /// `actor/pg_clipfrac_lower`.
    pub pg_clipfrac_lower: Option<f64>,
    /// `actor/ppo_kl`: masked mean of `log π_old - log π`.
    pub ppo_kl: Option<f64>,
}

impl PolicyMetrics {
    /// The metrics under verl's names, only those verl reports for this loss.
    pub fn named(&self) -> BTreeMap<String, f64> {
        let mut m = BTreeMap::new();
        m.insert("actor/pg_loss".to_string(), self.pg_loss);
        let optional = [
            ("actor/pg_clipfrac", self.pg_clipfrac),
            ("actor/pg_clipfrac_lower", self.pg_clipfrac_lower),
            ("actor/ppo_kl", self.ppo_kl),
        ];
        for (name, v) in optional {
            if let Some(v) = v {
                m.insert(name.to_string(), v);
            }
        }
        m
    }
}

/// A differentiable scalar loss and its metrics.
pub struct PolicyOutput {
    pub loss: Tensor,
    pub metrics: PolicyMetrics,
}

impl PolicyLoss {
    /// verl's name for this loss.
    pub fn name(&self) -> &'static str {
        match self {
            PolicyLoss::Vanilla { .. } => "vanilla",
            PolicyLoss::Gspo { .. } => "gspo",
            PolicyLoss::Sapo { .. } => "sapo",
            PolicyLoss::Gpg => "gpg",
            PolicyLoss::Cispo { .. } => "cispo",
            PolicyLoss::GeoMean { .. } => "geo_mean",
            PolicyLoss::Dppo {
                divergence: DppoDivergence::Tv,
                ..
            } => "dppo_tv",
            PolicyLoss::Dppo {
                divergence: DppoDivergence::Kl,
                ..
            } => "dppo_kl",
        }
    }

    /// Rejects parameters for which the loss is undefined (verl asserts `clip_ratio_c > 1`).
    pub fn validate(&self) -> Result<()> {
        let clip = |key: &'static str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(LossError::InvalidValue {
                    key,
                    expected: "a finite number >= 0",
                    found: v,
                })
            }
        };
        match *self {
            PolicyLoss::Vanilla {
                clip_ratio_low,
                clip_ratio_high,
                clip_ratio_c,
            } => {
                clip("actor.clip_ratio_low", clip_ratio_low)?;
                clip("actor.clip_ratio_high", clip_ratio_high)?;
                if !clip_ratio_c.is_finite() || clip_ratio_c <= 1.0 {
                    return Err(LossError::InvalidValue {
                        key: "actor.clip_ratio_c",
                        expected: "a finite number > 1.0 (dual-clip lower bound)",
                        found: clip_ratio_c,
                    });
                }
            }
            PolicyLoss::Gspo {
                clip_ratio_low,
                clip_ratio_high,
            }
            | PolicyLoss::Cispo {
                clip_ratio_low,
                clip_ratio_high,
            }
            | PolicyLoss::GeoMean {
                clip_ratio_low,
                clip_ratio_high,
            } => {
                clip("actor.clip_ratio_low", clip_ratio_low)?;
                clip("actor.clip_ratio_high", clip_ratio_high)?;
            }
            PolicyLoss::Dppo {
                clip_ratio_low,
                clip_ratio_high,
                clip_ratio_c,
                ..
            } => {
                clip("actor.clip_ratio_low", clip_ratio_low)?;
                clip("actor.clip_ratio_high", clip_ratio_high)?;
                if !(clip_ratio_c.is_finite() && clip_ratio_c > 0.0) {
                    return Err(LossError::InvalidValue {
                        key: "actor.clip_ratio_c",
                        expected: "a finite number > 0 (DPPO's truncation of the ratio)",
                        found: clip_ratio_c,
                    });
                }
            }
            PolicyLoss::Sapo { tau_pos, tau_neg } => {
                for (key, v) in [("actor.tau_pos", tau_pos), ("actor.tau_neg", tau_neg)] {
                    if !(v.is_finite() && v > 0.0) {
                        return Err(LossError::InvalidValue {
                            key,
                            expected: "a finite number > 0",
                            found: v,
                        });
                    }
                }
            }
            PolicyLoss::Gpg => {}
        }
        Ok(())
    }

    /// Computes the loss. `agg` is the configured aggregation; GSPO and SAPO override the mode with
    /// `seq-mean-token-mean` exactly as verl does (the normaliser is still honoured).
    pub fn compute(
        &self,
        x: &PolicyInputs<'_>,
        agg: AggSpec,
        norm: &Normaliser,
    ) -> Result<PolicyOutput> {
        let (loss, metrics) = self.compute_deferred(x, agg, norm)?;
        let m = metrics.resolve()?;
        let metrics = PolicyMetrics {
            pg_loss: m.get("actor/pg_loss").copied().unwrap_or(f64::NAN),
            pg_clipfrac: m.get("actor/pg_clipfrac").copied(),
            pg_clipfrac_lower: m.get("actor/pg_clipfrac_lower").copied(),
            ppo_kl: m.get("actor/ppo_kl").copied(),
        };
        Ok(PolicyOutput { loss, metrics })
    }

    /// [`PolicyLoss::compute`] with the metrics (verl's names, as [`PolicyMetrics::named`]) left
    /// on the device: the host does not wait for the device here.
    pub fn compute_deferred(
        &self,
        x: &PolicyInputs<'_>,
        agg: AggSpec,
        norm: &Normaliser,
    ) -> Result<(Tensor, DeferredMetrics)> {
        check_inputs(x)?;
        let op = self.name();
        let mask = x.response_mask;
        let adv = x.advantages;

        // A token-level loss matrix, weighted by the rollout-correction weights and aggregated.
        let token_loss = |pg: Tensor, agg: AggSpec| -> Result<Tensor> {
            let pg = match x.rollout_is_weights {
                Some(w) => pg.f_mul(w).op(op)?,
                None => pg,
            };
            agg_loss(&pg, mask, agg, norm)
        };
        let (loss, clipfrac, clipfrac_lower, ppo_kl) = match *self {
            PolicyLoss::Vanilla {
                clip_ratio_low,
                clip_ratio_high,
                clip_ratio_c,
            } => {
                let (ratio, ppo_kl) = clamped_ratio(x, op)?;
                let neg_adv = adv.f_neg().op(op)?;
                let l1 = neg_adv.f_mul(&ratio).op(op)?;
                let l2 = neg_adv
                    .f_mul(
                        &ratio
                            .f_clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
                            .op(op)?,
                    )
                    .op(op)?;
                let clipped1 = l1.f_maximum(&l2).op(op)?;
                let clipfrac = masked_mean(
                    &l2.f_gt_tensor(&l1).op(op)?.f_to_kind(adv.kind()).op(op)?,
                    mask,
                )?;
                let l3 = neg_adv.f_mul_scalar(clip_ratio_c).op(op)?;
                let clipped2 = l3.f_minimum(&clipped1).op(op)?;
                let negative = adv.f_lt(0.0).op(op)?;
                let lower_hit = clipped1
                    .f_gt_tensor(&l3)
                    .op(op)?
                    .f_logical_and(&negative)
                    .op(op)?
                    .f_to_kind(adv.kind())
                    .op(op)?;
                let clipfrac_lower = masked_mean(&lower_hit, mask)?;
                let pg = clipped2.f_where_self(&negative, &clipped1).op(op)?;
                (
                    token_loss(pg, agg)?,
                    Some(clipfrac),
                    Some(clipfrac_lower),
                    Some(ppo_kl),
                )
            }
            PolicyLoss::Gspo {
                clip_ratio_low,
                clip_ratio_high,
            } => {
                let neg_kl = x.log_prob.f_sub(x.old_log_prob).op(op)?;
                let m = mask.f_to_kind(adv.kind()).op(op)?;
                let seq_len = m
                    .f_sum_dim_intlist(-1, false, adv.kind())
                    .op(op)?
                    .f_clamp_min(1.0)
                    .op(op)?;
                let seq_neg_kl = neg_kl
                    .f_mul(&m)
                    .op(op)?
                    .f_sum_dim_intlist(-1, false, adv.kind())
                    .op(op)?
                    .f_div(&seq_len)
                    .op(op)?;
                // Value: the sequence ratio; gradient: that of the token's own log-prob (sg[s_i] · π/sg[π]).
                let log_ratio = x
                    .log_prob
                    .f_sub(&x.log_prob.f_detach().op(op)?)
                    .op(op)?
                    .f_add(&seq_neg_kl.f_detach().op(op)?.f_unsqueeze(-1).op(op)?)
                    .op(op)?
                    .f_clamp_max(GSPO_LOG_RATIO_MAX)
                    .op(op)?;
                let ratio = log_ratio.f_exp().op(op)?;
                let neg_adv = adv.f_neg().op(op)?;
                let l1 = neg_adv.f_mul(&ratio).op(op)?;
                let l2 = neg_adv
                    .f_mul(
                        &ratio
                            .f_clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
                            .op(op)?,
                    )
                    .op(op)?;
                let pg = l1.f_maximum(&l2).op(op)?;
                let clipfrac = masked_mean(
                    &l2.f_gt_tensor(&l1).op(op)?.f_to_kind(adv.kind()).op(op)?,
                    mask,
                )?;
                let ppo_kl = masked_mean(&neg_kl.f_neg().op(op)?, mask)?;
                let agg = AggSpec {
                    mode: LossAggMode::SeqMeanTokenMean,
                    ..agg
                };
                (
                    token_loss(pg, agg)?,
                    Some(clipfrac),
                    Some(zero(adv)?),
                    Some(ppo_kl),
                )
            }
            PolicyLoss::Sapo { tau_pos, tau_neg } => {
                let (ratio, ppo_kl) = clamped_ratio(x, op)?;
                let positive = adv.f_gt(0.0).op(op)?;
                // Built in the advantages' dtype so f64 runs see exactly the configured temperatures.
                let taus = adv
                    .f_full_like(tau_pos)
                    .op(op)?
                    .f_where_self(&positive, &adv.f_full_like(tau_neg).op(op)?)
                    .op(op)?;
                // Gate f(r) = sigmoid(τ (r - 1)) · 4/τ: slope 1 at r = 1, like the unclipped surrogate.
                let gates = taus
                    .f_mul(&ratio.f_sub_scalar(1.0).op(op)?)
                    .op(op)?
                    .f_sigmoid()
                    .op(op)?
                    .f_mul(&taus.f_reciprocal().op(op)?.f_mul_scalar(4.0).op(op)?)
                    .op(op)?;
                let pg = gates.f_mul(adv).op(op)?.f_neg().op(op)?;
                let agg = AggSpec {
                    mode: LossAggMode::SeqMeanTokenMean,
                    ..agg
                };
                (
                    token_loss(pg, agg)?,
                    Some(zero(adv)?),
                    Some(zero(adv)?),
                    Some(ppo_kl),
                )
            }
            PolicyLoss::Gpg => {
                let pg = x.log_prob.f_mul(adv).op(op)?.f_neg().op(op)?;
                (token_loss(pg, agg)?, None, None, None)
            }
            PolicyLoss::Cispo {
                clip_ratio_low,
                clip_ratio_high,
            } => {
                let (ratio, ppo_kl) = clamped_ratio(x, op)?;
                let clipped = ratio
                    .f_clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
                    .op(op)?;
                // The weight is a constant: gradient flows only through log π (the CISPO objective).
                let pg = clipped
                    .f_detach()
                    .op(op)?
                    .f_mul(adv)
                    .op(op)?
                    .f_mul(x.log_prob)
                    .op(op)?
                    .f_neg()
                    .op(op)?;
                let clipfrac = masked_mean(
                    &ratio
                        .f_ne_tensor(&clipped)
                        .op(op)?
                        .f_to_kind(adv.kind())
                        .op(op)?,
                    mask,
                )?;
                (
                    token_loss(pg, agg)?,
                    Some(clipfrac),
                    Some(zero(adv)?),
                    Some(ppo_kl),
                )
            }
            PolicyLoss::GeoMean {
                clip_ratio_low,
                clip_ratio_high,
            } => {
                let (loss, clipfrac, clipfrac_lower, ppo_kl) =
                    geo_mean(x, clip_ratio_low, clip_ratio_high, norm)?;
                (loss, Some(clipfrac), Some(clipfrac_lower), Some(ppo_kl))
            }
            PolicyLoss::Dppo {
                divergence,
                clip_ratio_low,
                clip_ratio_high,
                clip_ratio_c,
            } => {
                let (ratio, ppo_kl) = clamped_ratio(x, op)?;
                // Truncated importance sampling in place of the dual clip; a constant weight.
                let truncated = ratio.f_clamp_max(clip_ratio_c).op(op)?.f_detach().op(op)?;
                let prob = x.log_prob.f_exp().op(op)?;
                let old_prob = x.old_log_prob.f_exp().op(op)?;
                let (up_ok, down_ok) = if divergence == DppoDivergence::Tv {
                    let moved = prob.f_sub(&old_prob).op(op)?;
                    (
                        moved.f_le(clip_ratio_high).op(op)?,
                        moved.f_ge(-clip_ratio_low).op(op)?,
                    )
                } else {
                    let binary_kl = binary_kl(&old_prob, &prob, x, op)?;
                    (
                        binary_kl
                            .f_le(clip_ratio_high)
                            .op(op)?
                            .f_logical_or(&prob.f_le_tensor(&old_prob).op(op)?)
                            .op(op)?,
                        binary_kl
                            .f_le(clip_ratio_low)
                            .op(op)?
                            .f_logical_or(&prob.f_ge_tensor(&old_prob).op(op)?)
                            .op(op)?,
                    )
                };
                let positive = adv.f_gt(0.0).op(op)?;
                let valid = up_ok
                    .f_where_self(&positive, &down_ok)
                    .op(op)?
                    .f_to_kind(adv.kind())
                    .op(op)?;
                let pg = adv
                    .f_neg()
                    .op(op)?
                    .f_mul(&truncated)
                    .op(op)?
                    .f_mul(x.log_prob)
                    .op(op)?
                    .f_mul(&valid)
                    .op(op)?;
                let clipfrac = masked_mean(&valid.f_neg().op(op)?.f_add_scalar(1.0).op(op)?, mask)?;
                let truncated_hit = ratio
                    .f_gt(clip_ratio_c)
                    .op(op)?
                    .f_to_kind(adv.kind())
                    .op(op)?
                    .f_mul(&valid)
                    .op(op)?;
                let clipfrac_lower = masked_mean(&truncated_hit, mask)?;
                (
                    token_loss(pg, agg)?,
                    Some(clipfrac),
                    Some(clipfrac_lower),
                    Some(ppo_kl),
                )
            }
        };

        let mut metrics = DeferredMetrics::default();
        metrics.push("actor/pg_loss", &loss)?;
        let optional = [
            ("actor/pg_clipfrac", clipfrac),
            ("actor/pg_clipfrac_lower", clipfrac_lower),
            ("actor/ppo_kl", ppo_kl),
        ];
        for (name, v) in optional {
            if let Some(v) = v {
                metrics.push(name, &v)?;
            }
        }
        Ok((loss, metrics))
    }
}

/// GMPO (verl's `geo_mean`): the loss value and `pg_clipfrac`, `pg_clipfrac_lower`, `ppo_kl`.
///
/// Each sequence contributes `-Ā · exp(mean_t clip_A(log r_t))`, where `Ā` is its mean advantage and
/// `clip_A` clamps the log-ratio to `[-low, high]` only on the side that would raise the objective
/// (`sign(A) · min(sign(A) · x, sign(A) · clamp(x))`). Rollout-correction weights enter as their
/// geometric mean over the sequence. The sequences are averaged with [`seq_mean`]: verl's plain
/// `torch.mean` over the micro-batch, made exact under micro-batching and DP like every other loss
/// here (a sequence with no valid token counts in neither numerator nor denominator).
fn geo_mean(
    x: &PolicyInputs<'_>,
    clip_ratio_low: f64,
    clip_ratio_high: f64,
    norm: &Normaliser,
) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
    const OP: &str = "geo_mean";
    let (adv, mask) = (x.advantages, x.response_mask);
    let kind = adv.kind();
    let m = mask_as(mask, kind, OP)?;
    // Per-sequence masked means, NaN-safe outside the mask, with verl's epsilon.
    let seq_tokens = m.f_sum_dim_intlist(-1, false, kind).op(OP)?;
    let denom = seq_tokens.f_add_scalar(GEO_MEAN_EPS).op(OP)?;
    let seq_avg = |t: &Tensor| -> Result<Tensor> {
        zero_outside(t, mask, &m, OP)?
            .f_sum_dim_intlist(-1, false, kind)
            .op(OP)?
            .f_div(&denom)
            .op(OP)
    };
    let neg_kl = x.log_prob.f_sub(x.old_log_prob).op(OP)?;
    let ppo_kl = masked_mean(&neg_kl.f_neg().op(OP)?, mask)?;
    let sign = adv.f_sign().op(OP)?;
    let clamped = neg_kl.f_clamp(-clip_ratio_low, clip_ratio_high).op(OP)?;
    let kept = sign
        .f_mul(&neg_kl)
        .op(OP)?
        .f_minimum(&sign.f_mul(&clamped).op(OP)?)
        .op(OP)?
        .f_mul(&sign)
        .op(OP)?;
    let ratio = seq_avg(&kept)?.f_exp().op(OP)?;
    let mut seq_losses = seq_avg(adv)?.f_neg().op(OP)?.f_mul(&ratio).op(OP)?;
    if let Some(w) = x.rollout_is_weights {
        let log_w = w.f_add_scalar(GEO_MEAN_IS_EPS).op(OP)?.f_log().op(OP)?;
        seq_losses = seq_losses.f_mul(&seq_avg(&log_w)?.f_exp().op(OP)?).op(OP)?;
    }
    let loss = seq_mean(&seq_losses, &seq_tokens.f_gt(0.0).op(OP)?, norm)?;
    let clipped = neg_kl.f_ne_tensor(&clamped).op(OP)?;
    let clipped_where = |side: Tensor| -> Result<Tensor> {
        let hit = clipped
            .f_logical_and(&side)
            .op(OP)?
            .f_to_kind(kind)
            .op(OP)?;
        masked_mean(&hit, mask)
    };
    let clipfrac = clipped_where(adv.f_gt(0.0).op(OP)?)?;
    let clipfrac_lower = clipped_where(adv.f_lt(0.0).op(OP)?)?;
    Ok((loss, clipfrac, clipfrac_lower, ppo_kl))
}

/// DPPO-KL's per-token binary KL divergence between the old and the current probability of the
/// sampled token: `p_old · (log p_old - log p) + (1 - p_old) · log((1 - p_old + ε) / (1 - p + ε))`.
fn binary_kl(
    old_prob: &Tensor,
    prob: &Tensor,
    x: &PolicyInputs<'_>,
    op: &'static str,
) -> Result<Tensor> {
    let rest = |p: &Tensor| -> Result<Tensor> { p.f_neg().op(op)?.f_add_scalar(1.0).op(op) };
    let odds = rest(old_prob)?
        .f_add_scalar(DPPO_KL_EPS)
        .op(op)?
        .f_div(&rest(prob)?.f_add_scalar(DPPO_KL_EPS).op(op)?)
        .op(op)?
        .f_log()
        .op(op)?;
    old_prob
        .f_mul(&x.old_log_prob.f_sub(x.log_prob).op(op)?)
        .op(op)?
        .f_add(&rest(old_prob)?.f_mul(&odds).op(op)?)
        .op(op)
}

/// The token ratio `exp(clamp(log π - log π_old, ±20))` and `ppo_kl`, the masked mean of
/// `log π_old - log π` (of the clamped log-ratio, as verl's vanilla, SAPO, CISPO and DPPO report it).
fn clamped_ratio(x: &PolicyInputs<'_>, op: &'static str) -> Result<(Tensor, Tensor)> {
    let neg_kl = x
        .log_prob
        .f_sub(x.old_log_prob)
        .op(op)?
        .f_clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        .op(op)?;
    let ratio = neg_kl.f_exp().op(op)?;
    let ppo_kl = masked_mean(&neg_kl.f_neg().op(op)?, x.response_mask)?;
    Ok((ratio, ppo_kl))
}

fn zero(like: &Tensor) -> Result<Tensor> {
    crate::agg::scalar(0.0, like)
}

fn check_inputs(x: &PolicyInputs<'_>) -> Result<()> {
    const OP: &str = "policy_loss";
    check_2d(OP, "log_prob", x.log_prob)?;
    if !matches!(
        x.log_prob.kind(),
        Kind::Float | Kind::Double | Kind::BFloat16 | Kind::Half
    ) {
        return Err(LossError::Dtype {
            op: OP,
            arg: "log_prob",
            expected: "a floating-point dtype",
            found: format!("{:?}", x.log_prob.kind()),
        });
    }
    check_same_shape(OP, "old_log_prob", x.old_log_prob, "log_prob", x.log_prob)?;
    check_same_shape(OP, "advantages", x.advantages, "log_prob", x.log_prob)?;
    check_same_shape(OP, "response_mask", x.response_mask, "log_prob", x.log_prob)?;
    if let Some(w) = x.rollout_is_weights {
        check_same_shape(OP, "rollout_is_weights", w, "log_prob", x.log_prob)?;
    }
    Ok(())
}
