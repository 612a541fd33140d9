//! The actor's loss on one micro-batch through the chunked LM head, over FSDP's row layout.

use super::*;
use verl_backend_kit::policy::check_temperature;

/// What one micro-batch's actor loss needs besides the model's hidden states.
pub struct MicroBatchLoss<'a> {
    pub loss: &'a ActorLoss,
    pub norm: &'a Normaliser,
    /// `[rows, R]` log-probs of the policy that sampled (ignored `on_policy`).
    pub old: &'a Tensor,
    pub advantages: &'a Tensor,
    pub ref_log_prob: Option<&'a Tensor>,
    /// `[rows, R]` rollout-correction importance weights.
    pub rollout_is_weights: Option<&'a Tensor>,
    /// The ratio is taken against the current log-probs (one mini-batch, one epoch).
    pub on_policy: bool,
    /// A padding pass of a rank with fewer micro-batches: loss × 0.
    pub dummy: bool,
    pub need_entropy: bool,
    pub temperature: f64,
    pub chunk_tokens: i64,
    /// fp32 logits the LM head may keep from its forward for its backward (bytes); see
    /// [`kept_logits_budget`].
    pub kept_logits_bytes: u64,
}

/// The actor loss of one micro-batch from the final hidden states `[rows, L, H]`, as a surrogate
/// whose backward is the loss's: the states that predict `layout`'s tokens go through the LM head
/// `weight` in chunks (values first, then per chunk again with autograd for the gradients), so no
/// `[tokens, vocab]` fp32 logits of the whole micro-batch exist at any point. Returns the loss and
/// its metrics.
pub fn actor_micro_batch_loss(
    layout: &RowLayout,
    hidden: &Tensor,
    weight: &Tensor,
    m: &MicroBatchLoss<'_>,
) -> Result<(Tensor, DeferredMetrics)> {
    check_temperature(m.temperature)?;
    let picked = layout.gather(hidden)?;
    let head = ChunkedLmHead::new(m.chunk_tokens, m.temperature, m.need_entropy)
        .with_kept_logits(m.kept_logits_bytes);
    let mut metrics = None;
    let (surrogate, _) = head.loss_and_surrogate(&picked, weight, &layout.targets, |lp, ent| {
        let torch = |source| verl_losses::LossError::Torch {
            op: "actor loss inputs",
            source,
        };
        let lp = layout.scatter(lp).map_err(torch)?;
        let ent = match ent {
            Some(e) => Some(layout.scatter(e).map_err(torch)?),
            None => None,
        };
        let terms = verl_backend_kit::update::ActorTerms {
            old: m.old,
            advantages: m.advantages,
            ref_log_prob: m.ref_log_prob,
            rollout_is_weights: m.rollout_is_weights,
        };
        let (loss, metrics_out) = terms.loss(
            m.loss,
            m.norm,
            m.on_policy,
            &lp,
            ent.as_ref(),
            &layout.response_mask,
        )?;
        metrics = Some(metrics_out);
        Ok(loss)
    })?;
    let loss = verl_backend_kit::update::zero_if_dummy(surrogate, m.dummy)?;
    let metrics = metrics
        .ok_or_else(|| BackendError::Api(ApiError::failed("the actor loss was not computed")))?;
    Ok((loss, metrics))
}
