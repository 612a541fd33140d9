//! What anchors an actor update's ratio: on-policy (one mini-batch, one epoch), the old log-probs,
//! bypass mode's rollout log-probs; rollout-correction weights; whether entropy is asked for.

use tch::{Device, Tensor};
use verl_plugin_api::{col, Batch, Error as ApiError, UpdateOptions};

use crate::data::column;
use crate::error::{BackendError, Result, TorchContext};

pub fn check_temperature(temperature: f64) -> Result<()> {
    if temperature.is_finite() && temperature > 0.0 {
        return Ok(());
    }
    Err(BackendError::config(
        "actor_rollout_ref.rollout.temperature",
        "a finite temperature > 0",
        temperature,
    ))
}

/// The update's old log-probs `[rows, R]`: the `old_log_probs` column, or, on an on-policy step
/// whose old-log-prob pass the host skipped (the column is absent), a placeholder shaped like
/// `like` that the loss never reads (it takes the ratio against the detached current log-probs,
/// as verl does). Off-policy (`minis_epochs`: mini-batches and epochs) the column is required.
pub(crate) fn old_log_probs_for_update(
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
            false => BackendError::Api(ApiError::invalid_input(format!(
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
pub(crate) fn bypass_mode_requested(o: &UpdateOptions) -> bool {
    o.extra
        .get("bypass_mode")
        .and_then(serde_json::Value::as_bool)
        .unwrap_or(false)
}

/// The update's optional `rollout_is_weights` column (rollout-correction importance weights).
pub(crate) fn rollout_is_weights(
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
