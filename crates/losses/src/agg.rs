//! Loss aggregation (verl's `agg_loss`) and the global normaliser that makes gradient accumulation exact.
//!
//! # The contract between a backend and [`agg_loss`] (read this before wiring an update step)
//!
//! verl normalises each micro-batch by its *own* token (or sequence) count unless the engine passes global
//! counts; the legacy FSDP actor then rescales by the micro-batch's share of *samples*. With micro-batches of
//! unequal valid-token counts, `Σ_i (sum_i / tokens_i) · (n_i / N)` is not `Σ_i sum_i / Σ_i tokens_i`, so the
//! accumulated gradient depends on how the mini-batch was cut (verl issue #5625). [`Normaliser::Global`]
//! removes that dependence. The backend must:
//!
//! 1. Before the micro-batch loop of each mini-batch, count on its DP shard of the mini-batch (all its
//!    micro-batches together) the valid tokens (`Σ response_mask`) and the sequences with at least one valid
//!    token, e.g. with [`MaskCounts::of_mask`] summed over micro-batches; then all-reduce both counts with SUM
//!    over the data-parallel group. Ranks that hold the *same* data (tensor/pipeline/sequence-parallel peers)
//!    must not be counted twice: reduce over the DP group only.
//! 2. Build [`LossScale`] with those global counts and `dp_size` = the divisor its gradient reduction applies:
//!    the DP world size when gradients are averaged across DP ranks (FSDP/DDP default, Megatron's default
//!    `average_in_collective`), 1 when they are summed.
//! 3. For every micro-batch, call the loss with [`Normaliser::Global`] and run `backward()` on the returned
//!    loss as is: no division by the number of micro-batches, gradients accumulate by summation. A Megatron
//!    pipeline schedule that divides each micro-batch loss by `num_microbatches` (and `cp_size`) must multiply
//!    by the same factor first to cancel it.
//! 4. Reduce gradients across DP with the reduction named in 2.
//!
//! Then, for every mode, the reduced gradient equals the gradient of the loss computed in one shot on the
//! whole mini-batch across all ranks, whatever the micro-batch boundaries (`tests/global_normalisation.rs`).
//! The per-micro-batch loss value is that micro-batch's *share*: sum it over micro-batches, then average over
//! DP ranks (divide the DP sum by `dp_size`), to log the mini-batch loss (`actor/pg_loss`).
//!
//! `seq-mean-token-sum-norm` additionally divides by `loss_scale_factor`; its verl default is the padded
//! response length of the tensor at hand, which differs between micro-batches under dynamic batching, so a
//! backend using that mode with [`Normaliser::Global`] should set it to a constant (verl's
//! `actor.loss_scale_factor`, or the configured max response length).

use std::fmt;
use std::str::FromStr;

use tch::{Kind, Tensor};

use crate::error::{LossError, Result, TorchContext};

/// verl's `loss_agg_mode` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LossAggMode {
    /// Mean over all valid tokens.
    TokenMean,
    /// Sum over a sequence's tokens, mean over sequences.
    SeqMeanTokenSum,
    /// Mean over a sequence's tokens, mean over sequences.
    SeqMeanTokenMean,
    /// `SeqMeanTokenSum` divided by a constant horizon (Dr. GRPO).
    SeqMeanTokenSumNorm,
}

impl LossAggMode {
    pub const ALL: [LossAggMode; 4] = [
        LossAggMode::TokenMean,
        LossAggMode::SeqMeanTokenSum,
        LossAggMode::SeqMeanTokenMean,
        LossAggMode::SeqMeanTokenSumNorm,
    ];

    /// The name verl's config uses.
    pub fn name(self) -> &'static str {
        match self {
            LossAggMode::TokenMean => "token-mean",
            LossAggMode::SeqMeanTokenSum => "seq-mean-token-sum",
            LossAggMode::SeqMeanTokenMean => "seq-mean-token-mean",
            LossAggMode::SeqMeanTokenSumNorm => "seq-mean-token-sum-norm",
        }
    }

    /// Parses a verl name; the error names `key` (the config key the value came from).
    pub fn parse(key: &'static str, name: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|m| m.name() == name)
            .ok_or_else(|| LossError::UnknownName {
                key,
                found: name.to_string(),
                valid: Self::ALL.iter().map(|m| m.name()).collect(),
                note: None,
            })
    }
}

impl fmt::Display for LossAggMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for LossAggMode {
    type Err = LossError;
    fn from_str(s: &str) -> Result<Self> {
        Self::parse("loss_agg_mode", s)
    }
}

/// Mini-batch-wide counts and the DP gradient divisor; see the module docs for what the backend must pass.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossScale {
    /// Valid tokens (`Σ response_mask`) in the whole mini-batch: all micro-batches, all DP ranks.
    pub global_tokens: f64,
    /// Sequences with at least one valid token in the whole mini-batch: all micro-batches, all DP ranks.
    pub global_seqs: f64,
    /// The factor by which the backend's cross-rank gradient reduction divides (DP size when it averages, 1
    /// when it sums).
    pub dp_size: usize,
}

impl LossScale {
    /// Global counts from the already all-reduced [`MaskCounts`].
    pub fn new(global: MaskCounts, dp_size: usize) -> Self {
        LossScale {
            global_tokens: global.tokens,
            global_seqs: global.seqs,
            dp_size,
        }
    }
}

/// Valid-token and non-empty-sequence counts of one mask (or, summed, of many). Plain numbers so a backend can
/// all-reduce them with whatever collective it has.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MaskCounts {
    pub tokens: f64,
    pub seqs: f64,
}

impl MaskCounts {
    /// Counts of a `[batch, response_len]` mask (bool or numeric, 1 = valid).
    pub fn of_mask(mask: &Tensor) -> Result<Self> {
        const OP: &str = "MaskCounts::of_mask";
        check_2d(OP, "mask", mask)?;
        let m = mask.f_to_kind(Kind::Double).op(OP)?;
        let tokens = m.f_sum(Kind::Double).op(OP)?.f_double_value(&[]).op(OP)?;
        let per_seq = m.f_sum_dim_intlist(-1, false, Kind::Double).op(OP)?;
        let seqs = per_seq
            .f_gt(0.0)
            .op(OP)?
            .f_sum(Kind::Double)
            .op(OP)?
            .f_double_value(&[])
            .op(OP)?;
        Ok(MaskCounts { tokens, seqs })
    }
}

impl std::ops::Add for MaskCounts {
    type Output = MaskCounts;
    fn add(self, rhs: MaskCounts) -> MaskCounts {
        MaskCounts {
            tokens: self.tokens + rhs.tokens,
            seqs: self.seqs + rhs.seqs,
        }
    }
}

impl std::iter::Sum for MaskCounts {
    fn sum<I: Iterator<Item = MaskCounts>>(iter: I) -> MaskCounts {
        iter.fold(MaskCounts::default(), |a, b| a + b)
    }
}

/// Which denominators [`agg_loss`] divides by.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Normaliser {
    /// verl's behaviour when `global_batch_info` is empty: this tensor's own token / sequence count, DP size 1.
    /// Exact only when the tensor is the whole mini-batch on a single rank; it reproduces verl's golden values.
    Local,
    /// Mini-batch-wide counts from the backend (see the module docs): exact under gradient accumulation and DP.
    Global(LossScale),
}

/// How to aggregate a `[batch, response_len]` loss matrix into a scalar.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AggSpec {
    pub mode: LossAggMode,
    /// Divisor of `seq-mean-token-sum-norm`; `None` means the mask's last dimension, as in verl.
    pub loss_scale_factor: Option<f64>,
}

impl AggSpec {
    pub fn new(mode: LossAggMode) -> Self {
        AggSpec {
            mode,
            loss_scale_factor: None,
        }
    }
}

/// verl's `agg_loss`: reduces `loss_mat` (`[batch, response_len]`) over the positions where `loss_mask` is
/// non-zero. Differentiable with respect to `loss_mat`; values outside the mask (even NaN) contribute neither
/// to the value nor to the gradient.
pub fn agg_loss(
    loss_mat: &Tensor,
    loss_mask: &Tensor,
    spec: AggSpec,
    norm: &Normaliser,
) -> Result<Tensor> {
    const OP: &str = "agg_loss";
    check_2d(OP, "loss_mat", loss_mat)?;
    check_same_shape(OP, "loss_mask", loss_mask, "loss_mat", loss_mat)?;
    let kind = loss_mat.kind();
    let mask = mask_as(loss_mask, kind, OP)?;
    let masked = zero_outside(loss_mat, loss_mask, &mask, OP)?;
    let dp_size = dp_factor(norm, OP)?;

    match spec.mode {
        LossAggMode::TokenMean => {
            let total = masked.f_sum(kind).op(OP)?;
            let denom = match norm {
                Normaliser::Local => local_denominator(&mask, OP)?,
                Normaliser::Global(s) => {
                    positive(OP, "global_tokens", s.global_tokens)?;
                    scalar(s.global_tokens, loss_mat)?
                }
            };
            total.f_div(&denom).op(OP)?.f_mul_scalar(dp_size).op(OP)
        }
        LossAggMode::SeqMeanTokenSum
        | LossAggMode::SeqMeanTokenSumNorm
        | LossAggMode::SeqMeanTokenMean => {
            let token_counts = mask.f_sum_dim_intlist(-1, false, kind).op(OP)?;
            let mut seq_losses = masked.f_sum_dim_intlist(-1, false, kind).op(OP)?;
            if spec.mode == LossAggMode::SeqMeanTokenMean {
                // verl's epsilon, so a fully masked row yields 0 rather than NaN.
                let denom = token_counts.f_add_scalar(1e-8).op(OP)?;
                seq_losses = seq_losses.f_div(&denom).op(OP)?;
            }
            let seq_valid = token_counts.f_gt(0.0).op(OP)?;
            let mut loss = seq_mean(&seq_losses, &seq_valid, norm)?;
            if spec.mode == LossAggMode::SeqMeanTokenSumNorm {
                let horizon = match spec.loss_scale_factor {
                    Some(f) => {
                        if !(f.is_finite() && f > 0.0) {
                            return Err(LossError::InvalidValue {
                                key: "loss_scale_factor",
                                expected: "a finite number > 0",
                                found: f,
                            });
                        }
                        f
                    }
                    None => *loss_mask.size().last().unwrap_or(&1) as f64,
                };
                loss = loss.f_div_scalar(horizon).op(OP)?;
            }
            Ok(loss)
        }
    }
}

/// The mean of per-sequence losses (`[batch]`) over the sequences where `seq_valid` is true, under
/// the normaliser: the sequence-mean half of [`agg_loss`]'s `seq-mean-*` modes, for losses that are
/// already one number per sequence (`geo_mean`). With [`Normaliser::Global`] the denominator is the
/// mini-batch's `global_seqs` and the result is scaled by `dp_size`, as in [`agg_loss`].
pub fn seq_mean(seq_losses: &Tensor, seq_valid: &Tensor, norm: &Normaliser) -> Result<Tensor> {
    const OP: &str = "seq_mean";
    check_same_shape(OP, "seq_valid", seq_valid, "seq_losses", seq_losses)?;
    let kind = seq_losses.kind();
    let seq_mask = mask_as(seq_valid, kind, OP)?;
    let total = zero_outside(seq_losses, seq_valid, &seq_mask, OP)?
        .f_sum(kind)
        .op(OP)?;
    let denom = match norm {
        Normaliser::Local => local_denominator(&seq_mask, OP)?,
        Normaliser::Global(s) => {
            positive(OP, "global_seqs", s.global_seqs)?;
            scalar(s.global_seqs, seq_losses)?
        }
    };
    total
        .f_div(&denom)
        .op(OP)?
        .f_mul_scalar(dp_factor(norm, OP)?)
        .op(OP)
}

/// The factor that undoes the gradient reduction's division by the DP size (1 for a local loss).
fn dp_factor(norm: &Normaliser, op: &'static str) -> Result<f64> {
    match norm {
        Normaliser::Local => Ok(1.0),
        Normaliser::Global(scale) if scale.dp_size == 0 => Err(LossError::Normaliser {
            op,
            field: "dp_size",
            expected: ">= 1",
            found: 0.0,
        }),
        Normaliser::Global(scale) => Ok(scale.dp_size as f64),
    }
}

/// verl's `masked_sum` over all elements: positions where `mask` is zero are dropped (NaN-safe) and the rest
/// weighted by the mask.
pub fn masked_sum(values: &Tensor, mask: &Tensor) -> Result<Tensor> {
    const OP: &str = "masked_sum";
    check_same_shape(OP, "mask", mask, "values", values)?;
    let m = mask_as(mask, values.kind(), OP)?;
    zero_outside(values, mask, &m, OP)?
        .f_sum(values.kind())
        .op(OP)
}

/// verl's `masked_mean` over all elements: `masked_sum / (Σ mask + 1e-8)`.
pub fn masked_mean(values: &Tensor, mask: &Tensor) -> Result<Tensor> {
    const OP: &str = "masked_mean";
    let s = masked_sum(values, mask)?;
    let m = mask_as(mask, values.kind(), OP)?;
    let denom = m.f_sum(values.kind()).op(OP)?.f_add_scalar(1e-8).op(OP)?;
    s.f_div(&denom).op(OP)
}

/// `values * mask` with masked-out positions forced to exactly zero first, so NaN/inf padding cannot leak into
/// sums or gradients.
pub(crate) fn zero_outside(
    values: &Tensor,
    raw_mask: &Tensor,
    mask: &Tensor,
    op: &'static str,
) -> Result<Tensor> {
    let keep = raw_mask.f_ne(0.0).op(op)?;
    values
        .f_where_scalarother(&keep, 0.0)
        .op(op)?
        .f_mul(mask)
        .op(op)
}

pub(crate) fn mask_as(mask: &Tensor, kind: Kind, op: &'static str) -> Result<Tensor> {
    if mask.kind() == kind {
        Ok(mask.shallow_clone())
    } else {
        mask.f_to_kind(kind).op(op)
    }
}

/// A local count used as a denominator; an all-masked micro-batch contributes 0 instead of verl's NaN (0/0),
/// which would poison accumulated gradients.
fn local_denominator(mask: &Tensor, op: &'static str) -> Result<Tensor> {
    let n = mask.f_sum(mask.kind()).op(op)?;
    let is_empty = n.f_eq(0.0).op(op)?;
    n.f_where_scalarother(&is_empty.f_logical_not().op(op)?, 1.0)
        .op(op)
}

fn positive(op: &'static str, field: &'static str, v: f64) -> Result<()> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(LossError::Normaliser {
            op,
            field,
            expected: "a finite count > 0",
            found: v,
        })
    }
}

pub(crate) fn scalar(v: f64, like: &Tensor) -> Result<Tensor> {
    Tensor::f_scalar_tensor(v, (like.kind(), like.device())).op("scalar")
}

pub(crate) fn check_2d(op: &'static str, arg: &'static str, t: &Tensor) -> Result<()> {
    if t.dim() == 2 {
        Ok(())
    } else {
        Err(LossError::Shape {
            op,
            arg,
            expected: "[batch, response_len]".into(),
            found: t.size(),
        })
    }
}

pub(crate) fn check_same_shape(
    op: &'static str,
    arg: &'static str,
    t: &Tensor,
    ref_arg: &'static str,
    reference: &Tensor,
) -> Result<()> {
    if t.size() == reference.size() {
        Ok(())
    } else {
        Err(LossError::Shape {
            op,
            arg,
            expected: format!("{:?} (the shape of `{ref_arg}`)", reference.size()),
            found: t.size(),
        })
    }
}
