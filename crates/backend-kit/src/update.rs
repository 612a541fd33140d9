//! The PPO update every backend runs (verl's `dp_actor.update_policy` / `dp_critic.update_critic`
//! loop): epochs over mini-batches, each normalised by its global token and sequence counts and
//! skipped when it has no response token, the backend's forward and backward over its
//! micro-batches, a non-finite loss or metric stopping the update before the optimizer step (the
//! weights unchanged), verl's metric reductions, then the optimizer step. What differs between
//! backends (how micro-batches run through the model, pipeline stages, sharded gradients) is an
//! [`UpdateEngine`]; the per-role inputs and loss composition are [`ActorUpdateInputs`] and
//! [`CriticUpdateInputs`].

use std::collections::BTreeMap;

use tch::{Device, Tensor};
use verl_losses::{
    ActorInputs, ActorLoss, CriticLoss, DeferredMetrics, LossScale, MaskCounts, Normaliser,
    ValueInputs,
};
use verl_plugin_api::{col, Batch, UpdateOptions};

use crate::config::{ActorSettings, ActorUpdatePlan, CriticUpdatePlan};
use crate::data::{chunks, column, index_tensor, to_f32_vec, Sequences};
use crate::dp::Dp;
use crate::error::{BackendError, Result, TorchContext};
use crate::metrics::MetricAcc;
use crate::policy::{entropy_metric_requested, policy_anchor, PolicyAnchor};

/// An actor role's model: trainable (the actor, with what its engine trains: masters, optimizer
/// state, shards) or frozen (the reference, forward only).
pub enum RoleWeights<T, F> {
    Train(Box<T>),
    Frozen(Box<F>),
}

/// Which role an update trains: its metric names and how they reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpdateRole {
    Actor,
    Critic,
}

impl UpdateRole {
    pub fn name(self) -> &'static str {
        match self {
            UpdateRole::Actor => "actor",
            UpdateRole::Critic => "critic",
        }
    }

    /// Metrics summed over micro-batches (each micro-batch's share of the mini-batch loss under
    /// the global normaliser); verl's running sums.
    fn summed(self, name: &str) -> bool {
        match self {
            UpdateRole::Actor => matches!(name, "actor/pg_loss" | "actor/kl_loss"),
            UpdateRole::Critic => name == "critic/vf_loss",
        }
    }

    /// Metrics summed over the mini-batch on every rank, then once over the ranks (the
    /// mini-batch's entropy under the global normaliser).
    fn mini_batch_total(self, name: &str) -> bool {
        self == UpdateRole::Actor && name == "actor/entropy"
    }
}

/// One mini-batch as an engine runs it.
pub struct MiniBatch<'a> {
    pub epoch: usize,
    pub index: usize,
    /// Rows of the update's batch.
    pub rows: &'a [usize],
    /// The loss normaliser: the mini-batch's token and sequence counts over every rank.
    pub norm: &'a Normaliser,
}

/// One micro-batch's results on a rank that computes its loss: its loss value (where the engine
/// reports it) and metrics, in the order a non-finite value is looked for.
#[derive(Debug, Clone)]
pub struct MicroOutcome {
    pub micro: usize,
    pub metrics: Vec<(String, f64)>,
    pub loss: Option<f64>,
}

/// The first non-finite value of a mini-batch.
#[derive(Debug, Clone, PartialEq)]
pub struct NonFiniteAt {
    pub micro: usize,
    pub metric: String,
    pub value: f64,
}

/// What a backend does inside the shared update loop.
pub trait UpdateEngine {
    type Error: From<BackendError>;

    /// The data-parallel group: the mini-batch counts and the metrics reduce over it.
    fn dp(&self) -> &Dp;

    /// Sets every gradient to zero (before each mini-batch, after the last, after a failure).
    fn zero_grad(&mut self) -> std::result::Result<(), Self::Error>;

    /// Forward and backward over the mini-batch's micro-batches, accumulating their gradients;
    /// the outcome of each real (not padding) micro-batch whose loss this rank computes.
    fn forward_backward(
        &mut self,
        mini: &MiniBatch<'_>,
    ) -> std::result::Result<Vec<MicroOutcome>, Self::Error>;

    /// Every rank's view of the mini-batch's first non-finite value: this rank's own where every
    /// rank computes its losses; under pipeline parallelism, the last stage's.
    fn agree(
        &self,
        bad: Option<NonFiniteAt>,
    ) -> std::result::Result<Option<NonFiniteAt>, Self::Error> {
        Ok(bad)
    }

    /// The optimizer step after a mini-batch; returns the gradient norm.
    fn optimizer_step(
        &mut self,
        lr: f64,
        step: u64,
        mini: &MiniBatch<'_>,
    ) -> std::result::Result<f64, Self::Error>;
}

/// Where an optimizer step falls in a run, as its errors name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepAt {
    pub role: &'static str,
    pub step: u64,
    pub epoch: usize,
    pub mini_batch: usize,
}

impl StepAt {
    /// The error of a non-finite gradient norm: the step is skipped, the weights are unchanged.
    pub fn non_finite_grad_norm(&self, value: f64) -> BackendError {
        BackendError::NonFinite {
            role: self.role,
            step: self.step,
            epoch: self.epoch,
            mini_batch: self.mini_batch,
            micro: String::new(),
            metric: format!("{}/grad_norm", self.role),
            value,
        }
    }
}

impl MiniBatch<'_> {
    /// This mini-batch's optimizer step of `role` at global step `step`.
    pub fn step_at(&self, role: UpdateRole, step: u64) -> StepAt {
        StepAt {
            role: role.name(),
            step,
            epoch: self.epoch,
            mini_batch: self.index,
        }
    }
}

/// What the loop needs to know of the update.
pub struct UpdateSpec<'a> {
    pub role: UpdateRole,
    pub global_step: u64,
    pub epochs: usize,
    pub mini_batch_rows: usize,
    /// `[rows, R]` response mask of the whole batch (the counts).
    pub response_mask: &'a Tensor,
    pub lr: f64,
}

/// The update loop: returns the metrics this rank accumulated (`{role}/grad_norm` and
/// `{role}/lr` included), not yet reduced over the ranks.
pub fn run_update<E: UpdateEngine>(
    engine: &mut E,
    spec: &UpdateSpec<'_>,
) -> std::result::Result<MetricAcc, E::Error> {
    let role = spec.role.name();
    let rows: Vec<usize> = (0..spec.response_mask.size()[0] as usize).collect();
    let minis = chunks(&rows, spec.mini_batch_rows);
    let device = spec.response_mask.device();
    let mut acc = MetricAcc::default();
    for epoch in 0..spec.epochs {
        for (mi, mini) in minis.iter().enumerate() {
            let Some(norm) = mini_batch_norm(engine.dp(), spec.response_mask, mini, device)? else {
                tracing::warn!(
                    step = spec.global_step,
                    epoch,
                    mini_batch = mi,
                    "mini-batch has no response tokens; skipped"
                );
                continue;
            };
            let mb = MiniBatch {
                epoch,
                index: mi,
                rows: mini,
                norm: &norm,
            };
            engine.zero_grad()?;
            let outcomes = match engine.forward_backward(&mb) {
                Ok(v) => v,
                Err(e) => {
                    let _ = engine.zero_grad();
                    return Err(e);
                }
            };
            let mut totals: BTreeMap<String, f64> = BTreeMap::new();
            let mut bad = None;
            'micro: for o in &outcomes {
                let loss = o.loss.map(|v| ("loss".to_string(), v));
                for (name, v) in o.metrics.iter().chain(loss.iter()) {
                    if !v.is_finite() {
                        bad = Some(NonFiniteAt {
                            micro: o.micro,
                            metric: name.clone(),
                            value: *v,
                        });
                        break 'micro;
                    }
                }
                for (name, v) in &o.metrics {
                    if spec.role.summed(name) {
                        acc.add(name, *v);
                    } else if spec.role.mini_batch_total(name) {
                        *totals.entry(name.clone()).or_default() += v;
                    } else {
                        acc.push(name, *v);
                    }
                }
            }
            if let Some(b) = engine.agree(bad)? {
                let _ = engine.zero_grad();
                return Err(BackendError::NonFinite {
                    role,
                    step: spec.global_step,
                    epoch,
                    mini_batch: mi,
                    micro: format!(", micro-batch {}", b.micro),
                    metric: b.metric,
                    value: b.value,
                }
                .into());
            }
            for (name, v) in totals {
                let mut v = [v];
                engine.dp().all_reduce_sum(&mut v)?;
                acc.push_global(&name, v[0]);
            }
            let grad_norm = engine.optimizer_step(spec.lr, spec.global_step, &mb)?;
            acc.push_global(&format!("{role}/grad_norm"), grad_norm);
        }
    }
    engine.zero_grad()?;
    acc.push_global(&format!("{role}/lr"), spec.lr);
    Ok(acc)
}

/// The mini-batch's loss normaliser: its response tokens and sequences summed over the ranks
/// (gradients are summed over ranks, never averaged, so the per-rank losses add up to the one-rank
/// loss exactly); `None` when it has no response token.
fn mini_batch_norm(
    dp: &Dp,
    response_mask: &Tensor,
    mini: &[usize],
    device: Device,
) -> Result<Option<Normaliser>> {
    let idx = index_tensor(mini, device)?;
    let counts = MaskCounts::of_mask(
        &response_mask
            .f_index_select(0, &idx)
            .ctx("mini-batch mask")?,
    )?;
    let mut c = [counts.tokens, counts.seqs];
    dp.all_reduce_sum(&mut c)?;
    if c[0] == 0.0 {
        return Ok(None);
    }
    Ok(Some(Normaliser::Global(LossScale::new(
        MaskCounts {
            tokens: c[0],
            seqs: c[1],
        },
        1,
    ))))
}

/// The run's total number of training steps for the learning-rate schedule: the host's
/// `total_training_steps` for this call, else the trainer's.
pub fn total_training_steps(o: &UpdateOptions, trainer_total: Option<i64>) -> Option<i64> {
    o.extra
        .get("total_training_steps")
        .and_then(|v| v.as_i64())
        .or(trainer_total)
}

impl ActorSettings {
    /// The role's RNG state as its checkpoint keeps it: the seed and the generate calls so far.
    pub fn rng_state(&self) -> serde_json::Value {
        serde_json::json!({"seed": self.seed, "generate_calls": self.generate_calls})
    }

    /// Takes back the RNG state a checkpoint kept ([`ActorSettings::rng_state`]).
    pub fn restore_rng_state(&mut self, saved: &serde_json::Value) {
        if let Some(calls) = saved.get("generate_calls").and_then(|v| v.as_u64()) {
            self.generate_calls = calls;
        }
        if let Some(seed) = saved.get("seed").and_then(|v| v.as_u64()) {
            self.seed = seed;
        }
    }

    /// What an actor update starts from: the plan, the trainable weights and the batch's inputs on
    /// `device`. The frozen reference refuses.
    pub fn begin_update<'a, T, F>(
        &'a self,
        weights: &'a mut RoleWeights<T, F>,
        batch: &Batch,
        device: Device,
        o: &UpdateOptions,
    ) -> Result<(&'a ActorUpdatePlan, &'a mut T, ActorUpdateInputs)> {
        let plan = self.trainable()?;
        let RoleWeights::Train(train) = weights else {
            unreachable!("a role with an update plan is trainable")
        };
        Ok((plan, train, plan.inputs(batch, device, o)?))
    }

    /// The update plan of a trainable actor; the frozen reference has none.
    pub fn trainable(&self) -> Result<&ActorUpdatePlan> {
        self.update.as_ref().ok_or_else(|| {
            BackendError::Api(verl_plugin_api::Error::not_implemented(
                "the reference policy is frozen; only the actor role can be trained",
            ))
        })
    }
}

impl ActorUpdatePlan {
    /// The update's inputs from its batch.
    pub fn inputs(
        &self,
        batch: &Batch,
        device: Device,
        o: &UpdateOptions,
    ) -> Result<ActorUpdateInputs> {
        ActorUpdateInputs::from_batch(
            batch,
            "Actor.update",
            device,
            o,
            |rows| (rows.div_ceil(self.mini_batch_rows.max(1)), self.epochs),
            self.calculate_entropy || self.loss.needs_entropy(),
        )
    }

    pub fn spec<'a>(
        &self,
        o: &UpdateOptions,
        inputs: &'a ActorUpdateInputs,
        lr: f64,
    ) -> UpdateSpec<'a> {
        UpdateSpec {
            role: UpdateRole::Actor,
            global_step: o.global_step,
            epochs: self.epochs,
            mini_batch_rows: self.mini_batch_rows,
            response_mask: &inputs.seqs.response_mask,
            lr,
        }
    }
}

impl CriticUpdatePlan {
    pub fn spec<'a>(
        &self,
        o: &UpdateOptions,
        inputs: &'a CriticUpdateInputs,
        lr: f64,
    ) -> UpdateSpec<'a> {
        UpdateSpec {
            role: UpdateRole::Critic,
            global_step: o.global_step,
            epochs: self.epochs,
            mini_batch_rows: self.mini_batch_rows,
            response_mask: &inputs.seqs.response_mask,
            lr,
        }
    }
}

/// A log-prob call's output columns: `[rows, R]` log-probs, and the entropy when asked for.
pub fn log_prob_batch(
    rows: usize,
    response_len: usize,
    log_probs: &Tensor,
    entropy: Option<&Tensor>,
) -> Result<Batch> {
    let mut out = Batch::new();
    out.insert_tensor(
        col::LOG_PROBS,
        &[rows, response_len],
        &to_f32_vec(log_probs, "log-probs")?,
    );
    if let Some(e) = entropy {
        out.insert_tensor(
            col::ENTROPY,
            &[rows, response_len],
            &to_f32_vec(e, "entropy")?,
        );
    }
    Ok(out)
}

/// An actor update's batch columns on the device and what anchors its ratio.
pub struct ActorUpdateInputs {
    pub seqs: Sequences,
    pub advantages: Tensor,
    pub ref_log_prob: Option<Tensor>,
    pub anchor: PolicyAnchor,
    pub need_entropy: bool,
}

/// One micro-batch's rows of [`ActorUpdateInputs`].
pub struct ActorMicro {
    pub old: Tensor,
    pub advantages: Tensor,
    pub ref_log_prob: Option<Tensor>,
    pub rollout_is_weights: Option<Tensor>,
}

impl ActorUpdateInputs {
    /// `minis_epochs`: the update's mini-batch and epoch counts (one of each is on-policy).
    pub fn from_batch(
        batch: &Batch,
        call: &'static str,
        device: Device,
        o: &UpdateOptions,
        minis_epochs: impl FnOnce(usize) -> (usize, usize),
        entropy_by_config: bool,
    ) -> Result<ActorUpdateInputs> {
        let seqs = Sequences::from_batch(batch, call, device)?;
        let advantages = column::<f32>(batch, call, col::ADVANTAGES, device)?;
        let ref_log_prob = match batch.contains(col::REF_LOG_PROBS) {
            true => Some(column::<f32>(batch, call, col::REF_LOG_PROBS, device)?),
            false => None,
        };
        let anchor = policy_anchor(
            batch,
            call,
            device,
            &advantages,
            minis_epochs(seqs.rows()),
            o,
        )?;
        Ok(ActorUpdateInputs {
            seqs,
            advantages,
            ref_log_prob,
            anchor,
            need_entropy: entropy_by_config || entropy_metric_requested(o),
        })
    }

    /// The rows `idx` of the per-token columns.
    pub fn micro(&self, idx: &Tensor) -> Result<ActorMicro> {
        let pick = |t: &Tensor| t.f_index_select(0, idx).ctx("micro-batch rows");
        Ok(ActorMicro {
            old: pick(&self.anchor.old_log_probs)?,
            advantages: pick(&self.advantages)?,
            ref_log_prob: self.ref_log_prob.as_ref().map(pick).transpose()?,
            rollout_is_weights: self.anchor.is_weights.as_ref().map(pick).transpose()?,
        })
    }
}

impl ActorMicro {
    pub fn terms(&self) -> ActorTerms<'_> {
        ActorTerms {
            old: &self.old,
            advantages: &self.advantages,
            ref_log_prob: self.ref_log_prob.as_ref(),
            rollout_is_weights: self.rollout_is_weights.as_ref(),
        }
    }
}

/// A micro-batch's per-token inputs of the actor loss besides its current log-probs.
pub struct ActorTerms<'a> {
    /// `[rows, R]` log-probs of the policy that sampled (ignored on-policy).
    pub old: &'a Tensor,
    pub advantages: &'a Tensor,
    pub ref_log_prob: Option<&'a Tensor>,
    /// `[rows, R]` rollout-correction importance weights.
    pub rollout_is_weights: Option<&'a Tensor>,
}

impl ActorTerms<'_> {
    /// The actor loss from the micro-batch's `[rows, R]` log-probs (and entropy), with the
    /// metrics left on the device. On-policy, the ratio is taken against the detached current
    /// log-probs (exactly 1), as verl's actor does.
    pub fn loss(
        &self,
        loss: &ActorLoss,
        norm: &Normaliser,
        on_policy: bool,
        log_prob: &Tensor,
        entropy: Option<&Tensor>,
        response_mask: &Tensor,
    ) -> verl_losses::Result<(Tensor, DeferredMetrics)> {
        let old_used = if on_policy {
            log_prob
                .f_detach()
                .map_err(|source| verl_losses::LossError::Torch {
                    op: "detach",
                    source,
                })?
        } else {
            self.old.shallow_clone()
        };
        loss.compute_deferred(
            &ActorInputs {
                old_log_prob: &old_used,
                log_prob,
                advantages: self.advantages,
                response_mask,
                entropy,
                ref_log_prob: self.ref_log_prob,
                rollout_is_weights: self.rollout_is_weights,
            },
            norm,
        )
    }
}

/// Multiplies a padding micro-batch's loss by zero (its backward still runs, so every rank runs
/// the same collectives).
pub fn zero_if_dummy(loss: Tensor, dummy: bool) -> Result<Tensor> {
    match dummy {
        true => loss.f_mul_scalar(0.0).ctx("zero padding loss"),
        false => Ok(loss),
    }
}

/// A critic's `values` column from its `[rows, R]` predictions: only response tokens have values
/// (verl's), the others are zero.
pub fn values_batch(seqs: &Sequences, values: &Tensor) -> Result<Batch> {
    let v = values.f_mul(&seqs.response_mask).ctx("mask values")?;
    let mut out = Batch::new();
    out.insert_tensor(
        col::VALUES,
        &[seqs.rows(), seqs.response_len as usize],
        &to_f32_vec(&v, "values")?,
    );
    Ok(out)
}

/// A critic update's batch columns on the device.
pub struct CriticUpdateInputs {
    pub seqs: Sequences,
    pub old_values: Tensor,
    pub returns: Tensor,
}

/// One micro-batch's rows of [`CriticUpdateInputs`].
pub struct CriticMicro {
    pub old_values: Tensor,
    pub returns: Tensor,
}

impl CriticUpdateInputs {
    pub fn from_batch(batch: &Batch, call: &'static str, device: Device) -> Result<Self> {
        Ok(CriticUpdateInputs {
            seqs: Sequences::from_batch(batch, call, device)?,
            old_values: column::<f32>(batch, call, col::VALUES, device)?,
            returns: column::<f32>(batch, call, col::RETURNS, device)?,
        })
    }

    pub fn micro(&self, idx: &Tensor) -> Result<CriticMicro> {
        let pick = |t: &Tensor| t.f_index_select(0, idx).ctx("micro-batch rows");
        Ok(CriticMicro {
            old_values: pick(&self.old_values)?,
            returns: pick(&self.returns)?,
        })
    }
}

impl CriticMicro {
    /// The value loss of the micro-batch from its `[rows, R]` predictions; its metrics by name.
    pub fn loss(
        &self,
        loss: &CriticLoss,
        norm: &Normaliser,
        vpreds: &Tensor,
        response_mask: &Tensor,
        dummy: bool,
    ) -> Result<(Tensor, Vec<(String, f64)>)> {
        let out = loss.compute(
            &ValueInputs {
                vpreds,
                returns: &self.returns,
                values: &self.old_values,
                response_mask,
            },
            norm,
        )?;
        Ok((
            zero_if_dummy(out.loss, dummy)?,
            out.metrics.named().into_iter().collect(),
        ))
    }
}
