//! The actor's loss on one micro-batch, and what anchors its ratio (on-policy, the old log-probs, bypass mode's rollout log-probs).

use super::*;

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

/// Bytes of fp32 LM-head logits an update may keep from a micro-batch's forward for its backward
/// (saving one head GEMM per chunk): a quarter of the device memory no tensor holds now
/// ([`unheld_device_memory`]), so keeping them cannot take the last of it; 0 off CUDA or when
/// the query fails.
pub fn kept_logits_budget(device: Device) -> u64 {
    let Device::Cuda(gpu) = device else { return 0 };
    unheld_device_memory(gpu, false).map_or(0, |(free, _)| free as u64 / 4)
}

/// `(bytes no tensor holds, total bytes)` of CUDA device `gpu`: `cuMemGetInfo`'s free bytes plus
/// the caching allocator's releasable segments ([`verl_torch_ext::CudaMemoryStats::releasable`],
/// what `empty_cache` would hand back, counted without paying for the release). Where the
/// allocator keeps no statistics, the cache is emptied first with `empty_otherwise` (else its
/// segments count as held). `None` when the query fails.
pub(super) fn unheld_device_memory(gpu: usize, empty_otherwise: bool) -> Option<(usize, usize)> {
    let releasable = match verl_torch_ext::cuda_memory_stats(gpu) {
        Ok(s) => s.releasable,
        Err(_) if !empty_otherwise => 0,
        Err(e) => {
            tracing::debug!("allocator statistics unavailable ({e}); emptying the cache");
            verl_torch_ext::cuda_empty_cache().ok()?;
            0
        }
    };
    verl_comm::nccl::cuda_context(gpu)
        .ok()
        .and_then(|ctx| ctx.mem_get_info().ok())
        .map(|(free, total)| (free.saturating_add(releasable as usize), total))
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
        let terms = crate::update::ActorTerms {
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
    let loss = crate::update::zero_if_dummy(surrogate, m.dummy)?;
    let metrics = metrics
        .ok_or_else(|| FsdpError::Api(ApiError::failed("the actor loss was not computed")))?;
    Ok((loss, metrics))
}

pub(super) fn check_temperature(temperature: f64) -> Result<()> {
    if temperature.is_finite() && temperature > 0.0 {
        return Ok(());
    }
    Err(FsdpError::config(
        "actor_rollout_ref.rollout.temperature",
        "a finite temperature > 0",
        temperature,
    ))
}

/// The update's old log-probs `[rows, R]`: the `old_log_probs` column, or, on an on-policy step
/// whose old-log-prob pass the host skipped (the column is absent), a placeholder shaped like
/// `like` that the loss never reads (it takes the ratio against the detached current log-probs,
/// as verl does). Off-policy (`minis_epochs`: mini-batches and epochs) the column is required.
pub(super) fn old_log_probs_for_update(
    batch: &Batch,
    call: &'static str,
    device: Device,
    like: &Tensor,
    on_policy: bool,
    minis_epochs: (usize, usize),
) -> Result<Tensor> {
    if batch.contains(col::OLD_LOG_PROBS) || !on_policy {
        return column::<f32>(batch, call, col::OLD_LOG_PROBS, device).map_err(|e| match on_policy {
            true => e,
            false => FsdpError::Api(ApiError::invalid_input(format!(
                "{e} (the update is not on-policy: {} mini-batch(es) × {} epoch(s) need the old-log-prob pass)",
                minis_epochs.0, minis_epochs.1
            ))),
        });
    }
    like.f_zeros_like().ctx("old log-prob placeholder")
}

/// What the update's policy loss is anchored to.
pub struct PolicyAnchor {
    /// One mini-batch and one epoch, outside bypass mode: the ratio is taken against the
    /// detached current log-probs (exactly 1), as verl's actor does.
    pub on_policy: bool,
    /// `[rows, R]`: see [`old_log_probs_for_update`].
    pub old_log_probs: Tensor,
    /// Rollout-correction importance weights, when the host sent them.
    pub is_weights: Option<Tensor>,
}

/// The update's [`PolicyAnchor`] for `minis_epochs` (mini-batches, epochs), shared by the
/// backends: verl takes a single mini-batch and epoch as on-policy (the policy is still the one
/// that produced the old log-probs), except in bypass mode, where the rollout's log-probs are
/// the anchor.
pub fn policy_anchor(
    batch: &Batch,
    call: &'static str,
    device: Device,
    like: &Tensor,
    minis_epochs: (usize, usize),
    o: &UpdateOptions,
) -> Result<PolicyAnchor> {
    let on_policy = minis_epochs == (1, 1) && !bypass_mode_requested(o);
    Ok(PolicyAnchor {
        on_policy,
        old_log_probs: old_log_probs_for_update(
            batch,
            call,
            device,
            like,
            on_policy,
            minis_epochs,
        )?,
        is_weights: rollout_is_weights(batch, call, device)?,
    })
}

/// Whether the host runs verl's rollout-correction bypass mode: `old_log_probs` are the rollout's
/// log-probs and anchor the PPO ratio even on an on-policy update (one mini-batch, one epoch),
/// where the ratio is otherwise taken against the current log-probs.
pub(super) fn bypass_mode_requested(o: &UpdateOptions) -> bool {
    o.extra
        .get("bypass_mode")
        .and_then(serde_json::Value::as_bool)
        .unwrap_or(false)
}

/// The update's optional `rollout_is_weights` column (rollout-correction importance weights).
pub(super) fn rollout_is_weights(
    batch: &Batch,
    call: &'static str,
    device: Device,
) -> Result<Option<Tensor>> {
    match batch.contains(col::ROLLOUT_IS_WEIGHTS) {
        true => Ok(Some(column::<f32>(
            batch,
            call,
            col::ROLLOUT_IS_WEIGHTS,
            device,
        )?)),
        false => Ok(None),
    }
}

/// Whether the host asked the update to report `actor/entropy` (it skipped the old-log-prob pass,
/// which reports it otherwise).
pub fn entropy_metric_requested(o: &UpdateOptions) -> bool {
    o.extra
        .get("entropy_metric")
        .and_then(serde_json::Value::as_bool)
        .unwrap_or(false)
}
