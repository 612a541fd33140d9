//! A model being trained: the live compute-dtype [`Transformer`] (what generation and forward passes
//! use), the fp32 master weights and their AdamW state, gradient accumulation, clipping, the LR
//! schedule, and the checkpoint files of all of it.
//!
//! On one rank: when the compute dtype equals the master dtype the masters *are* the model's
//! parameters (shared storage, no copy). Otherwise each micro-batch's gradients are added into fp32
//! accumulators, the optimizer steps the fp32 masters, and the masters are cast back into the live
//! model.
//!
//! One rank's `param_offload` (mixed precision: the fp32 masters) and `optimizer_offload` (the AdamW
//! moments) keep that state in host memory; the optimizer step brings it to the device a chunk at a
//! time ([`OFFLOAD_CHUNK_BYTES`]), steps the chunk and copies it back, bit for bit the step it would
//! take on the device.
//!
//! On several ranks ([`crate::shard`]): each rank holds 1/world of the masters, gradient
//! accumulators and AdamW state; the live model's parameters are empty except while a unit (or a
//! whole call, see [`TrainableModel::with_full`]) uses them. Gradients are summed over ranks (not
//! averaged), so the loss must use the global normaliser with `dp_size = 1`.

use std::path::Path;

use tch::{Device, Kind, Tensor};
use verl_nn::{Checkpoint, NnError, SaveOptions, Transformer};

use crate::packing::RowLayout;
use crate::shard::{
    read_named, sum_bytes, Gate, Layout, MemoryStats, Offload, ShardState, Source, What,
};
use verl_backend_kit::config::{OptimSection, Precision};
use verl_backend_kit::dp::Dp;
use verl_backend_kit::error::{BackendError, Result, TorchContext};
use verl_backend_kit::host_params::{host_buffers, Fill};
use verl_backend_kit::optim::{clip_grad_norm, AdamW, LrSchedule};
use verl_backend_kit::update::StepAt;

mod checkpoint;

pub use crate::ckpt_files::{
    LORA_DIR, MASTER_FILE, MODEL_DIR, OFFLOAD_CHUNK_BYTES, OPTIM_FILE, STATE_FILE,
};
const FORMAT: &str = "verl-fsdp/1";

pub struct TrainableModel {
    pub model: Transformer,
    pub precision: Precision,
    /// Indices into `model.named_parameters()` of the trained parameters: all of them, or a LoRA
    /// model's adapters (the base stays frozen in the compute dtype: no master, no gradient, no
    /// optimizer state).
    trained: Vec<usize>,
    /// Their names; `masters`, `accum` and the optimizer state follow this order.
    names: Vec<String>,
    masters: Vec<Tensor>,
    /// fp32 gradient accumulators (mixed precision only): allocated by the first backward of a
    /// mini-batch and dropped by its optimizer step, so between updates (while the rollout engine
    /// sizes its KV cache) they hold no device memory.
    accum: Vec<Tensor>,
    /// Whether the master dtype differs from the compute dtype (one rank: separate fp32 masters).
    mixed: bool,
    /// One rank: what lives in host memory between optimizer steps (see [`Offload`]).
    host: Offload,
    /// Master-dtype bytes per host round trip of an offloaded step ([`OFFLOAD_CHUNK_BYTES`]).
    offload_chunk_bytes: usize,
    optim: AdamW,
    optim_cfg: OptimSection,
    optim_key: String,
    schedule: Option<LrSchedule>,
    /// `update` calls completed (the scheduler's step).
    pub updates: u64,
    pub grad_clip: f64,
    /// ZeRO-3 state when the role runs on several ranks (then `masters` and `accum` are empty).
    shard: Option<ShardState>,
}

/// What a forward-backward hands its loss function: the head output or the final hidden states.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LossInput {
    Head,
    Hidden,
}

/// How a multi-rank model is sharded (`*.fsdp_config`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sharding {
    pub offload: Offload,
    pub reshard_after_forward: bool,
    /// The dtype gradients are reduce-scattered in (`mixed_precision.reduce_dtype`).
    pub reduce: Kind,
}

impl Default for Sharding {
    fn default() -> Self {
        Sharding {
            offload: Offload::default(),
            reshard_after_forward: true,
            reduce: Kind::Float,
        }
    }
}

/// What one rank keeps in host memory for `offload` (the `*.fsdp_config` keys): the AdamW moments
/// for `optimizer_offload`; the fp32 masters for `param_offload` only when they are separate from
/// the model (mixed precision). Without mixed precision the masters are the parameters generation
/// and the forward passes use, which stay on the device: then `param_offload` is dropped with a
/// warning naming `{section}.param_offload`. Nothing is offloaded for a CPU job (the state is in
/// host memory already).
pub fn one_rank_offload(
    offload: Offload,
    precision: Precision,
    device: Device,
    section: &str,
) -> Offload {
    if !device.is_cuda() {
        return Offload::default();
    }
    let mixed = precision.master != precision.compute;
    if offload.params && !mixed {
        tracing::warn!(
            "{section}.param_offload=true has no effect with one data-parallel rank when the \
             master dtype equals the compute dtype ({:?}): the parameters are the model's, which \
             generation and the forward passes use on the device",
            precision.master
        );
    }
    Offload {
        params: offload.params && mixed,
        optimizer: offload.optimizer,
    }
}

impl TrainableModel {
    /// A model trained on one rank.
    pub fn new(
        model: Transformer,
        precision: Precision,
        optim_cfg: OptimSection,
        optim_key: &str,
        grad_clip: f64,
    ) -> Result<TrainableModel> {
        Self::new_on(
            model,
            precision,
            optim_cfg,
            optim_key,
            grad_clip,
            &Dp::single(),
            Sharding::default(),
        )
    }

    /// A model trained on the ranks of `dp`: sharded (ZeRO-3) when there are several. Every rank
    /// must pass the same model (rank 0's weights win) and call this at the same point.
    pub fn new_on(
        mut model: Transformer,
        precision: Precision,
        optim_cfg: OptimSection,
        optim_key: &str,
        grad_clip: f64,
        dp: &Dp,
        sharding: Sharding,
    ) -> Result<TrainableModel> {
        // A LoRA model arrives with its base frozen (`Transformer::add_lora`).
        if model.lora_config().is_none() {
            model.set_requires_grad(true)?;
        }
        let trained = model.trainable_parameters();
        let names: Vec<String> = trained
            .iter()
            .map(|&i| model.named_parameters()[i].0.clone())
            .collect();
        if dp.is_sharded() {
            let shard = ShardState::new(
                &model,
                dp,
                precision.master,
                sharding.offload,
                sharding.reshard_after_forward,
                sharding.reduce,
            )?;
            // The fused kernel follows the compute device, wherever the blocks wait between steps.
            let mut optim = AdamW::without_state(&optim_cfg, optim_key, model.device().is_cuda())?;
            let odev = shard.optimizer_device();
            let blocks: Vec<&Tensor> = shard.masters.iter().collect();
            for state in [&mut optim.exp_avg, &mut optim.exp_avg_sq] {
                *state = if odev == Device::Cpu {
                    // Page-locked on a GPU (one flat buffer), as one rank's offloaded state.
                    host_buffers(&blocks, None, Fill::Zeros, model.device())?
                } else {
                    shard
                        .masters
                        .iter()
                        .map(|m| Tensor::f_zeros(m.size(), (m.kind(), odev)))
                        .collect::<std::result::Result<_, _>>()
                        .ctx("optimizer state")?
                };
            }
            return Ok(TrainableModel {
                model,
                precision,
                trained,
                names,
                masters: Vec::new(),
                accum: Vec::new(),
                mixed: precision.master != precision.compute,
                host: Offload::default(),
                offload_chunk_bytes: OFFLOAD_CHUNK_BYTES,
                optim,
                optim_cfg,
                optim_key: optim_key.to_string(),
                schedule: None,
                updates: 0,
                grad_clip,
                shard: Some(shard),
            });
        }
        let mixed = precision.master != model.dtype();
        let device = model.device();
        // `sharding.offload` as the caller resolved it for one rank ([`one_rank_offload`]);
        // masters can only live on the host when they are not the model's parameters.
        let host = Offload {
            params: sharding.offload.params && mixed,
            optimizer: sharding.offload.optimizer,
        };
        let params: Vec<&Tensor> = trained
            .iter()
            .map(|&i| &model.named_parameters()[i].1)
            .collect();
        let masters: Vec<Tensor> = if host.params {
            // Cast into (pinned) host buffers: no fp32 copy of the model passes the device.
            host_buffers(&params, Some(precision.master), Fill::Copy, device)?
        } else {
            params
                .iter()
                .map(|p| {
                    if mixed {
                        p.f_detach()
                            .and_then(|x| x.f_to_kind(precision.master))
                            .ctx("master weights")
                    } else {
                        Ok(p.shallow_clone())
                    }
                })
                .collect::<Result<_>>()?
        };
        let mut optim = AdamW::without_state(&optim_cfg, optim_key, device.is_cuda())?;
        let masters_ref: Vec<&Tensor> = masters.iter().collect();
        let zeros = || -> Result<Vec<Tensor>> {
            if host.optimizer {
                host_buffers(&masters_ref, None, Fill::Zeros, device)
            } else {
                masters
                    .iter()
                    .map(|m| Tensor::f_zeros(m.size(), (m.kind(), device)).ctx("optimizer state"))
                    .collect()
            }
        };
        optim.exp_avg = zeros()?;
        optim.exp_avg_sq = zeros()?;
        // Parameters in the master dtype: micro-batch gradients accumulate in `.grad`, so the
        // weight-gradient GEMMs add into it themselves.
        let mut model = model;
        model.set_grad_accumulation_fusion(!mixed);
        Ok(TrainableModel {
            model,
            precision,
            trained,
            names,
            masters,
            accum: Vec::new(),
            mixed,
            host,
            offload_chunk_bytes: OFFLOAD_CHUNK_BYTES,
            optim,
            optim_cfg,
            optim_key: optim_key.to_string(),
            schedule: None,
            updates: 0,
            grad_clip,
            shard: None,
        })
    }

    fn mixed(&self) -> bool {
        self.mixed
    }

    /// The trained parameters (all, or a LoRA model's adapters), in `names` order.
    fn trained_parameters(&self) -> Vec<&Tensor> {
        let named = self.model.named_parameters();
        self.trained.iter().map(|&i| &named[i].1).collect()
    }

    /// Position in `names` (and `masters`, the optimizer state) of parameter `i` of
    /// `model.named_parameters()`.
    fn trained_slot(&self, i: usize) -> Result<usize> {
        self.trained.iter().position(|&t| t == i).ok_or_else(|| {
            BackendError::Api(verl_plugin_api::Error::failed(format!(
                "parameter {} is not trained",
                self.model.named_parameters()[i].0
            )))
        })
    }

    /// What this one-rank model keeps in host memory between optimizer steps (nothing when
    /// sharded: see the shards' own placement).
    pub fn host_offload(&self) -> Offload {
        self.host
    }

    pub fn is_sharded(&self) -> bool {
        self.shard.is_some()
    }

    /// Forward, `loss_fn`, backward of one micro-batch; gradients accumulate (into `.grad` /
    /// the fp32 accumulators on one rank, reduce-scattered into this rank's shard otherwise).
    pub fn forward_backward<F>(
        &mut self,
        dp: &Dp,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        position_ids: Option<&Tensor>,
        loss_fn: F,
    ) -> Result<Tensor>
    where
        F: FnOnce(&Tensor) -> verl_nn::Result<Tensor>,
    {
        self.forward_backward_to(
            LossInput::Head,
            dp,
            input_ids,
            attention_mask,
            position_ids,
            loss_fn,
        )
    }

    /// [`TrainableModel::forward_backward`] with `loss_fn` on the final hidden states `[B, T, H]`
    /// instead of the head output (the caller applies the head, e.g. chunk by chunk: take
    /// [`Transformer::lm_head_weight`] before the call; on several ranks it holds full values
    /// while `loss_fn` runs).
    pub fn forward_backward_hidden<F>(
        &mut self,
        dp: &Dp,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        position_ids: Option<&Tensor>,
        loss_fn: F,
    ) -> Result<Tensor>
    where
        F: FnOnce(&Tensor) -> verl_nn::Result<Tensor>,
    {
        self.forward_backward_to(
            LossInput::Hidden,
            dp,
            input_ids,
            attention_mask,
            position_ids,
            loss_fn,
        )
    }

    /// [`TrainableModel::forward_backward_hidden_with`] of a micro-batch laid out by `layout`
    /// (a padded, unpadded or shared-prompt [`RowLayout`]).
    pub fn forward_backward_layout_with<T>(
        &mut self,
        dp: &Dp,
        layout: &RowLayout,
        what: &'static str,
        loss_fn: impl FnOnce(&Tensor) -> Result<(Tensor, T)>,
    ) -> Result<(Tensor, T)> {
        let Some(rows) = &layout.attention_rows else {
            return self.forward_backward_hidden_with(
                dp,
                &layout.input_ids,
                layout.model_mask(),
                Some(&layout.position_ids),
                what,
                loss_fn,
            );
        };
        let (ids, pos) = (&layout.input_ids, &layout.position_ids);
        with_side_values(what, loss_fn, |loss_fn| {
            let Some(shard) = self.shard.as_mut() else {
                return Ok(self
                    .model
                    .forward_backward_hidden_rows(ids, pos, rows, loss_fn)?);
            };
            let mut gate = Gate::new(shard, dp);
            let res = self
                .model
                .forward_backward_gated_hidden_rows(ids, pos, rows, &mut gate, loss_fn);
            finish_gated(gate.error.take(), shard_release(self.shard.as_mut()), res)
        })
    }

    fn forward_backward_to<F>(
        &mut self,
        input: LossInput,
        dp: &Dp,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        position_ids: Option<&Tensor>,
        loss_fn: F,
    ) -> Result<Tensor>
    where
        F: FnOnce(&Tensor) -> verl_nn::Result<Tensor>,
    {
        let Some(shard) = self.shard.as_mut() else {
            let m = &self.model;
            return Ok(match input {
                LossInput::Head => {
                    m.forward_backward(input_ids, attention_mask, position_ids, loss_fn)?
                }
                LossInput::Hidden => {
                    m.forward_backward_hidden(input_ids, attention_mask, position_ids, loss_fn)?
                }
            });
        };
        let mut gate = Gate::new(shard, dp);
        let res = match input {
            LossInput::Head => self.model.forward_backward_gated(
                input_ids,
                attention_mask,
                position_ids,
                &mut gate,
                loss_fn,
            ),
            LossInput::Hidden => self.model.forward_backward_gated_hidden(
                input_ids,
                attention_mask,
                position_ids,
                &mut gate,
                loss_fn,
            ),
        };
        finish_gated(gate.error.take(), shard_release(self.shard.as_mut()), res)
    }

    /// [`TrainableModel::forward_backward`] for a loss function that fails with this crate's error and
    /// returns side values (its metrics) next to the loss. The model only sees a loss, so the error and
    /// the side values are carried around it here, once for every role; `what` names the loss if the
    /// model fails instead.
    pub fn forward_backward_with<T>(
        &mut self,
        dp: &Dp,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        position_ids: Option<&Tensor>,
        what: &'static str,
        loss_fn: impl FnOnce(&Tensor) -> Result<(Tensor, T)>,
    ) -> Result<(Tensor, T)> {
        self.forward_backward_with_to(
            LossInput::Head,
            dp,
            input_ids,
            attention_mask,
            position_ids,
            what,
            loss_fn,
        )
    }

    /// [`TrainableModel::forward_backward_with`] on the final hidden states (see
    /// [`TrainableModel::forward_backward_hidden`]).
    pub fn forward_backward_hidden_with<T>(
        &mut self,
        dp: &Dp,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        position_ids: Option<&Tensor>,
        what: &'static str,
        loss_fn: impl FnOnce(&Tensor) -> Result<(Tensor, T)>,
    ) -> Result<(Tensor, T)> {
        self.forward_backward_with_to(
            LossInput::Hidden,
            dp,
            input_ids,
            attention_mask,
            position_ids,
            what,
            loss_fn,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn forward_backward_with_to<T>(
        &mut self,
        input: LossInput,
        dp: &Dp,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        position_ids: Option<&Tensor>,
        what: &'static str,
        loss_fn: impl FnOnce(&Tensor) -> Result<(Tensor, T)>,
    ) -> Result<(Tensor, T)> {
        with_side_values(what, loss_fn, |f| {
            self.forward_backward_to(input, dp, input_ids, attention_mask, position_ids, f)
        })
    }

    /// Runs `f` on the whole model. On several ranks every parameter is gathered for the call
    /// (one all-gather per unit, all units resident at once) and freed afterwards: generation,
    /// log-probs and values run the model many times per call, and re-gathering per layer per
    /// decode step would cost far more than the memory it saves at these sizes.
    pub fn with_full<T>(
        &mut self,
        dp: &Dp,
        f: impl FnOnce(&Transformer) -> Result<T>,
    ) -> Result<T> {
        let Some(shard) = self.shard.as_mut() else {
            return f(&self.model);
        };
        if let Err(e) = shard.acquire_all(dp) {
            let _ = shard.release_all();
            return Err(e);
        }
        let r = f(&self.model);
        let released = shard_release(self.shard.as_mut());
        let v = r?;
        released?;
        Ok(v)
    }

    /// This rank's shard (`comm.rank()` of `comm.size()`, rank `q` of the job holding shard
    /// `q % comm.size()`) of the live weights as a tensor-parallel generation model talking over
    /// `comm`. On several ranks each group's shard comes from the ZeRO-3 master blocks by one
    /// all-to-all that moves exactly what every rank's shard needs
    /// ([`crate::shard::ShardState::tensor_parallel_shards`]): no rank gathers a whole unit.
    /// Returns the model and the bytes this rank received. Every rank calls it together.
    pub fn rollout_shard(
        &mut self,
        dp: &Dp,
        comm: std::sync::Arc<dyn verl_nn::TpComm>,
    ) -> Result<(Transformer, f64)> {
        let (rank, size) = (comm.rank(), comm.size());
        let out = Transformer::tp_shard(
            self.model.config().clone(),
            &verl_nn::ModelOptions {
                device: self.model.device(),
                dtype: self.model.dtype(),
                head: verl_nn::HeadKind::CausalLm,
            },
            comm,
        )?;
        let names = self.model.named_parameters();
        let mut weights = std::collections::HashMap::new();
        let mut moved = 0.0;
        match self.shard.as_ref() {
            None => {
                for (name, full) in names {
                    weights.insert(name.clone(), verl_nn::tp::shard_of(full, name, rank, size)?);
                }
            }
            Some(shard) => {
                for g in 0..shard.layout.groups.len() {
                    let (pieces, bytes) =
                        shard.tensor_parallel_shards(dp, g, size, |q| q % size)?;
                    moved += bytes;
                    for (i, t) in pieces {
                        weights.insert(names[i].0.clone(), t);
                    }
                }
            }
        }
        // The received shards become the model's weights without a copy (a parameter outside
        // every ZeRO-3 group, a frozen one, is named as missing).
        out.share_parameters(&weights)?;
        Ok((out, moved))
    }

    /// Bytes this rank holds in parameters, gradients and optimizer state.
    pub fn memory(&self) -> MemoryStats {
        if let Some(s) = &self.shard {
            return s.memory(&self.optim);
        }
        let params: Vec<&Tensor> = self
            .model
            .named_parameters()
            .iter()
            .map(|(_, p)| p)
            .collect();
        let model_bytes = sum_bytes(params.iter().copied());
        let grads: Vec<Tensor> = params.iter().map(|p| p.grad()).collect();
        MemoryStats {
            params: model_bytes
                + if self.mixed() {
                    sum_bytes(&self.masters)
                } else {
                    0
                },
            grads: sum_bytes(&grads) + sum_bytes(&self.accum),
            optimizer: sum_bytes(self.optim.exp_avg.iter().chain(&self.optim.exp_avg_sq)),
            peak_gathered: model_bytes,
        }
    }

    /// Starts a new peak count of gathered parameters.
    pub fn reset_peak_memory(&mut self) {
        if let Some(s) = &mut self.shard {
            s.reset_peak();
        }
    }

    /// The LR schedule, built on first use so the host can pass the total step count with the first
    /// update (`UpdateOptions.extra.total_training_steps`).
    pub fn lr(&mut self, fallback_total: Option<i64>) -> Result<f64> {
        verl_backend_kit::optim::scheduled_lr(
            &mut self.schedule,
            &self.optim_cfg,
            &self.optim_key,
            fallback_total,
            self.updates,
        )
    }

    /// Clears the gradients. `.grad` is dropped (torch's `zero_grad(set_to_none=True)`, as verl's
    /// optimizer calls it) rather than zero-filled: the next backward's gradient becomes `.grad`
    /// as it is, and between updates (while the rollout engine sizes its KV cache) the gradient
    /// buffers hold no device memory.
    pub fn zero_grad(&mut self) -> Result<()> {
        if let Some(s) = &mut self.shard {
            return s.zero_grad();
        }
        verl_torch_ext::clear_grads(self.model.named_parameters().iter().map(|(_, p)| p))?;
        // The accumulators are allocated again (zeroed) by the next backward.
        self.accum.clear();
        Ok(())
    }

    /// Called after each micro-batch backward: moves compute-dtype gradients into fp32.
    pub fn after_backward(&mut self) -> Result<()> {
        if self.is_sharded() || !self.mixed() {
            return Ok(());
        }
        let params: Vec<Tensor> = self
            .trained_parameters()
            .into_iter()
            .map(Tensor::shallow_clone)
            .collect();
        if self.accum.is_empty() {
            let device = self.model.device();
            self.accum = self
                .masters
                .iter()
                .map(|m| Tensor::f_zeros(m.size(), (m.kind(), device)))
                .collect::<std::result::Result<_, _>>()
                .ctx("gradient accumulators")?;
        }
        tch::no_grad(|| -> Result<()> {
            for (p, a) in params.iter().zip(&mut self.accum) {
                let g = p.grad();
                if g.defined() {
                    // fp32 += bf16 in one kernel: the widening is exact, so this equals adding
                    // the gradient cast to fp32, without the cast's temporary.
                    let _ = a.f_add_(&g).ctx("accumulate gradient")?;
                }
            }
            Ok(())
        })?;
        // `.grad = None` rather than zeroing it: the next backward's gradient becomes `.grad` as
        // it is instead of being added into a zero-filled buffer.
        Ok(verl_torch_ext::clear_grads(params.iter())?)
    }

    /// The accumulated fp32 gradients (zeros for parameters that got none).
    fn grads(&self) -> Result<Vec<Tensor>> {
        if self.mixed() {
            if self.accum.is_empty() {
                // No backward since the last step: every gradient is zero.
                let device = self.model.device();
                return self
                    .masters
                    .iter()
                    .map(|m| Tensor::f_zeros(m.size(), (m.kind(), device)))
                    .collect::<std::result::Result<_, _>>()
                    .ctx("missing gradient");
            }
            return Ok(self.accum.iter().map(|a| a.shallow_clone()).collect());
        }
        self.trained_parameters()
            .into_iter()
            .map(|p| {
                let g = p.grad();
                if g.defined() {
                    Ok(g)
                } else {
                    p.f_zeros_like().ctx("missing gradient")
                }
            })
            .collect()
    }

    /// Clips the gradients and returns their global norm; the caller decides whether to
    /// [`TrainableModel::apply`] (a non-finite norm must not be applied). Sharded: the norm is
    /// `sqrt(Σ_ranks Σ shard²)` and the returned list is empty (the shards stay in place).
    pub fn clip(&mut self, dp: &Dp) -> Result<(Vec<Tensor>, f64)> {
        let clip = self.grad_clip;
        if let Some(s) = &mut self.shard {
            let mut sq = [s.local_grad_sq()?];
            dp.all_reduce_sum(&mut sq)?;
            let norm = sq[0].sqrt();
            if norm.is_finite() && clip > 0.0 {
                let coef = clip / (norm + 1e-6);
                if coef < 1.0 {
                    s.scale_grads(coef)?;
                }
            }
            return Ok((Vec::new(), norm));
        }
        let grads = self.grads()?;
        let norm = clip_grad_norm(&grads, clip)?;
        Ok((grads, norm))
    }

    /// The end of a mini-batch, shared by actor and critic: reduce and clip the gradients and, if
    /// the norm is finite, take the optimizer step. A non-finite norm clears the gradients, leaves
    /// the weights untouched and fails naming `role`, step, epoch, mini-batch and `<role>/grad_norm`.
    /// Returns the gradient norm.
    pub fn finish_mini_batch(&mut self, dp: &Dp, lr: f64, at: StepAt) -> Result<f64> {
        let (grads, grad_norm) = self.clip(dp)?;
        if !grad_norm.is_finite() {
            let _ = self.zero_grad();
            return Err(at.non_finite_grad_norm(grad_norm));
        }
        self.apply(&grads, lr)?;
        Ok(grad_norm)
    }

    /// One optimizer step with clipped gradients, then the live model refreshed from the masters.
    pub fn apply(&mut self, grads: &[Tensor], lr: f64) -> Result<()> {
        if let Some(s) = &mut self.shard {
            // The live parameters are empty; the next gather publishes the new weights.
            return s.step(&mut self.optim, lr);
        }
        self.one_rank_step(grads, lr)?;
        // The step consumed the accumulated gradients: free them until the next backward.
        self.accum.clear();
        Ok(())
    }

    /// One rank's AdamW step (all parameters in one fused call on a GPU); state in host memory
    /// visits the device [`OFFLOAD_CHUNK_BYTES`] at a time (see [`AdamW::step_visiting`]); with
    /// mixed precision the live model takes the new masters from their device copies.
    fn one_rank_step(&mut self, grads: &[Tensor], lr: f64) -> Result<()> {
        let device = self.model.device();
        let c = self.optim.begin_step(lr);
        let params = self.trained_parameters();
        let mixed = self.mixed;
        let host = (self.host.params, self.host.optimizer);
        let chunk = if host.0 || host.1 {
            self.offload_chunk_bytes
        } else {
            usize::MAX
        };
        self.optim
            .step_visiting(&c, device, &self.masters, grads, host, chunk, |i, p| {
                if mixed {
                    params[i]
                        .shallow_clone()
                        .f_copy_(p)
                        .ctx("masters → live model")?;
                }
                Ok(())
            })
    }
}

fn shard_release(shard: Option<&mut ShardState>) -> Result<()> {
    match shard {
        Some(s) => s.release_all(),
        None => Ok(()),
    }
}

fn write_json(path: &Path, json: &serde_json::Value) -> Result<()> {
    std::fs::write(
        path,
        serde_json::to_string_pretty(json).expect("json") + "\n",
    )
    .map_err(|source| BackendError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn copy_named(
    path: &Path,
    saved: &std::collections::HashMap<String, Tensor>,
    prefix: &str,
    names: &[String],
    dst: &[Tensor],
) -> Result<()> {
    tch::no_grad(|| -> Result<()> {
        for (n, d) in names.iter().zip(dst) {
            let key = format!("{prefix}{n}");
            let src = saved.get(&key).ok_or_else(|| BackendError::Checkpoint {
                path: path.to_path_buf(),
                message: format!("tensor `{key}` missing"),
            })?;
            if src.size() != d.size() {
                return Err(BackendError::Checkpoint {
                    path: path.to_path_buf(),
                    message: format!(
                        "tensor `{key}` has shape {:?}, expected {:?}",
                        src.size(),
                        d.size()
                    ),
                });
            }
            d.shallow_clone().f_copy_(src).ctx("restore tensor")?;
        }
        Ok(())
    })
}

/// The result of a sharded forward-backward: the gate's kept error first, then the model's, then
/// the release of the gathered parameters.
fn finish_gated(
    kept: Option<BackendError>,
    released: Result<()>,
    res: verl_nn::Result<Tensor>,
) -> Result<Tensor> {
    match (kept, res) {
        (Some(e), _) => Err(e),
        (None, Err(e)) => Err(e.into()),
        (None, Ok(loss)) => {
            released?;
            Ok(loss)
        }
    }
}

/// Runs `run` with a model-facing loss function made from `loss_fn`, which fails with this crate's
/// error and returns side values: the model only sees a loss, so the error and the side values are
/// carried around it here; `what` names the loss if the model fails instead.
fn with_side_values<T, L>(
    what: &'static str,
    loss_fn: L,
    run: impl FnOnce(&mut dyn FnMut(&Tensor) -> verl_nn::Result<Tensor>) -> Result<Tensor>,
) -> Result<(Tensor, T)>
where
    L: FnOnce(&Tensor) -> Result<(Tensor, T)>,
{
    let mut captured: Option<Result<T>> = None;
    let mut loss_fn = Some(loss_fn);
    let loss = run(&mut |out: &Tensor| {
        let f = loss_fn.take().ok_or_else(|| NnError::InvalidInput {
            what: what.into(),
            expected: "one loss call".into(),
            found: "a second".into(),
        })?;
        match f(out) {
            Ok((loss, side)) => {
                captured = Some(Ok(side));
                Ok(loss)
            }
            Err(e) => {
                captured = Some(Err(e));
                Err(NnError::InvalidInput {
                    what: what.into(),
                    expected: "a loss".into(),
                    found: "an error (reported separately)".into(),
                })
            }
        }
    });
    match (loss, captured) {
        (_, Some(Err(e))) | (Err(e), _) => Err(e),
        (Ok(loss), Some(Ok(side))) => Ok((loss, side)),
        (Ok(_), None) => Err(BackendError::Api(verl_plugin_api::Error::failed(
            "the model returned a loss without running the loss function",
        ))),
    }
}

#[cfg(test)]
mod tests;
