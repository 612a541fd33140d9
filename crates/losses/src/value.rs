//! The critic's clipped value loss (verl's `compute_value_loss`).

use std::collections::BTreeMap;

use tch::Tensor;

use crate::agg::{agg_loss, check_2d, check_same_shape, masked_mean, AggSpec, Normaliser};
use crate::error::{LossError, Result, TorchContext};

/// Tensors the value loss reads; all `[batch, response_len]`.
pub struct ValueInputs<'a> {
    /// The critic's current predictions; the loss is differentiable with respect to them.
    pub vpreds: &'a Tensor,
    /// Returns (targets).
    pub returns: &'a Tensor,
    /// The values predicted when the batch was collected (the clipping centre).
    pub values: &'a Tensor,
    pub response_mask: &'a Tensor,
}

/// Diagnostics named as verl logs them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ValueMetrics {
    /// `critic/vf_loss`.
    pub vf_loss: f64,
    /// `critic/vf_clipfrac`: share of tokens where the clipped prediction gave the larger loss.
    pub vf_clipfrac: f64,
    /// `critic/vpred_mean`: masked mean of the predictions.
    pub vpred_mean: f64,
}

impl ValueMetrics {
    pub fn named(&self) -> BTreeMap<String, f64> {
        BTreeMap::from([
            ("critic/vf_loss".to_string(), self.vf_loss),
            ("critic/vf_clipfrac".to_string(), self.vf_clipfrac),
            ("critic/vpred_mean".to_string(), self.vpred_mean),
        ])
    }
}

pub struct ValueOutput {
    pub loss: Tensor,
    pub metrics: ValueMetrics,
}

/// `½ · agg(max((v - R)², (clip(v, v_old ± c) - R)²))`: the prediction may not profit from moving more than
/// `cliprange_value` away from the value it had at collection time.
pub fn value_loss(
    x: &ValueInputs<'_>,
    cliprange_value: f64,
    agg: AggSpec,
    norm: &Normaliser,
) -> Result<ValueOutput> {
    const OP: &str = "value_loss";
    if !(cliprange_value.is_finite() && cliprange_value >= 0.0) {
        return Err(LossError::InvalidValue {
            key: "critic.cliprange_value",
            expected: "a finite number >= 0",
            found: cliprange_value,
        });
    }
    check_2d(OP, "vpreds", x.vpreds)?;
    check_same_shape(OP, "returns", x.returns, "vpreds", x.vpreds)?;
    check_same_shape(OP, "values", x.values, "vpreds", x.vpreds)?;
    check_same_shape(OP, "response_mask", x.response_mask, "vpreds", x.vpreds)?;

    let lo = x.values.f_sub_scalar(cliprange_value).op(OP)?;
    let hi = x.values.f_add_scalar(cliprange_value).op(OP)?;
    // max(min(v, hi), lo), as verl's clip_by_value: lo wins if the bounds ever cross.
    let clipped = x.vpreds.f_minimum(&hi).op(OP)?.f_maximum(&lo).op(OP)?;
    let l1 = x.vpreds.f_sub(x.returns).op(OP)?.f_square().op(OP)?;
    let l2 = clipped.f_sub(x.returns).op(OP)?.f_square().op(OP)?;
    let per_token = l1.f_maximum(&l2).op(OP)?;
    let loss = agg_loss(&per_token, x.response_mask, agg, norm)?
        .f_mul_scalar(0.5)
        .op(OP)?;
    let clipfrac = masked_mean(
        &l2.f_gt_tensor(&l1).op(OP)?.f_to_kind(l1.kind()).op(OP)?,
        x.response_mask,
    )?;
    let vpred_mean = masked_mean(&x.vpreds.f_detach().op(OP)?, x.response_mask)?;
    let value = |t: &Tensor| t.f_double_value(&[]).op(OP);
    let metrics = ValueMetrics {
        vf_loss: value(&loss.f_detach().op(OP)?)?,
        vf_clipfrac: value(&clipfrac)?,
        vpred_mean: value(&vpred_mean)?,
    };
    Ok(ValueOutput { loss, metrics })
}
