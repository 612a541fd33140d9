//! The Critic role: a value-head model (`critic.model.path`, default the actor's), values at the
//! response positions, the clipped value-loss update, checkpoints.

use std::path::Path;

use tch::{Device, Tensor};
use verl_losses::CriticLoss;
use verl_nn::HeadKind;
use verl_plugin_api::{
    Batch, Critic, DataParallel, InitArgs, Metrics, Result as ApiResult, UpdateOptions,
    ValueOptions,
};

use crate::actor::load_model;
use crate::forward::{layout_values, per_micro_batch_layout};
use crate::packing::{Padding, RowLayout};
use crate::shard::{MemoryStats, Offload};
use crate::train::{Sharding, TrainableModel};
use verl_backend_kit::budget::{same_micro_batch_count, same_rows_on_every_rank};
use verl_backend_kit::config::{
    self, section, CriticSection, CriticUpdatePlan, LogProbSection, MicroBatching, ModelSection,
};
use verl_backend_kit::data::{index_tensor, micro_batches, MicroBatch, Sequences};
use verl_backend_kit::dp::Dp;
use verl_backend_kit::error::{BackendError, Result, TorchContext};
use verl_backend_kit::update::{
    run_update, total_training_steps, CriticUpdateInputs, MicroOutcome,
    MiniBatch as UpdateMiniBatch, UpdateEngine, UpdateRole,
};

pub struct FsdpCritic {
    train: TrainableModel,
    dp: Dp,
    device: Device,
    /// Micro-batching of the value forwards and the update, mini-batches, epochs, the loss.
    plan: CriticUpdatePlan,
    /// `critic.model.use_remove_padding`.
    padding: Padding,
}

impl FsdpCritic {
    pub fn create(init: &InitArgs) -> Result<FsdpCritic> {
        let cfg = &init.config;
        let (trainer, device) = config::trainer_device(init)?;
        let dp = Dp::join(init, "critic", device)?;
        let dp_size = dp.size;
        if device.is_cuda() {
            verl_backend_kit::device::expandable_segments(dp_size);
        }
        let critic: CriticSection = section(cfg, "critic")?;
        let actor_model: ModelSection = section(cfg, "actor_rollout_ref.model")?;
        let rollout: LogProbSection = section(cfg, "actor_rollout_ref.rollout")?;
        let dir = config::critic_model_dir(&critic, &actor_model)?;
        let fsdp = critic.model.fsdp_config.clone().unwrap_or_default();
        let precision = fsdp.precision("critic.model.fsdp_config")?;
        let mut model = load_model(&dir, device, precision.compute, HeadKind::Value, fsdp.seed)?;
        if let Some(mut lora) = critic.model.lora("critic.model")? {
            // The value head trains in full beside the adapters (PEFT's modules_to_save for a
            // token-classification head); an adapter folder says for itself.
            if lora.adapter.is_none() {
                lora.config.modules_to_save = vec!["score".into()];
            }
            lora.apply(&mut model, "critic", fsdp.seed)?;
        }
        model.set_activation_checkpointing(critic.model.enable_gradient_checkpointing);
        let plan = CriticUpdatePlan::resolve(cfg, &critic, &rollout, &trainer, dp.size)?;
        let offload = Offload {
            params: fsdp.param_offload,
            optimizer: fsdp.optimizer_offload,
        };
        let offload = if dp.is_sharded() {
            offload
        } else {
            crate::train::one_rank_offload(offload, precision, device, "critic.model.fsdp_config")
        };
        let train = TrainableModel::new_on(
            model,
            precision,
            critic.optim.clone(),
            "critic.optim",
            critic.grad_clip,
            &dp,
            Sharding {
                offload,
                reshard_after_forward: fsdp.reshard_after_forward,
                reduce: fsdp.reduce_dtype("critic.model.fsdp_config")?,
            },
        )?;
        Ok(FsdpCritic {
            train,
            dp,
            device,
            plan,
            padding: Padding::from_flag(critic.model.use_remove_padding.unwrap_or(false)),
        })
    }

    fn do_values(&mut self, batch: &Batch) -> Result<Batch> {
        let seqs = Sequences::from_batch(batch, "Critic.compute_values", self.device)?;
        let (micro, padding) = (self.plan.forward_micro, self.padding);
        let res = self.train.with_full(&self.dp, |model| {
            per_micro_batch_layout(
                &seqs,
                micro,
                padding,
                "critic.forward_max_token_len_per_gpu",
                1,
                |layout| Ok(vec![layout_values(model, layout)?]),
            )
        })?;
        verl_backend_kit::update::values_batch(&seqs, &res[0])
    }

    fn do_update(&mut self, batch: &Batch, o: &UpdateOptions) -> Result<Metrics> {
        const CALL: &str = "Critic.update";
        let device = self.device;
        let inputs = CriticUpdateInputs::from_batch(batch, CALL, device)?;
        let lr = self
            .train
            .lr(total_training_steps(o, self.plan.trainer_total_steps))?;
        same_rows_on_every_rank(&self.dp, inputs.seqs.rows(), CALL)?;
        let mut engine = CriticEngine {
            train: &mut self.train,
            dp: &self.dp,
            lengths: inputs.seqs.row_lengths()?,
            inputs: &inputs,
            micro: self.plan.update_micro,
            loss: &self.plan.loss,
            padding: self.padding,
            device,
        };
        let mut acc = run_update(&mut engine, &self.plan.spec(o, &inputs, lr))?;
        self.train.updates += 1;
        verl_backend_kit::metrics::push_gpu_memory(&mut acc, &self.dp, device)?;
        acc.reduce(&self.dp)?;
        Ok(acc.into_metrics())
    }

    /// Bytes this rank holds in parameters, gradients and optimizer state.
    pub fn memory(&self) -> MemoryStats {
        self.train.memory()
    }

    /// On several ranks an error ends the group: the others' collectives fail naming this rank.
    fn spmd<T>(&self, r: Result<T>) -> Result<T> {
        r.map_err(|e| self.dp.fail(e))
    }
}

/// The FSDP critic in the shared update loop: each micro-batch's forward and backward through the
/// sharded value model, the value loss at the response positions.
struct CriticEngine<'a> {
    train: &'a mut TrainableModel,
    dp: &'a Dp,
    inputs: &'a CriticUpdateInputs,
    lengths: Vec<i64>,
    micro: MicroBatching,
    loss: &'a CriticLoss,
    padding: Padding,
    device: Device,
}

impl UpdateEngine for CriticEngine<'_> {
    type Error = BackendError;

    fn dp(&self) -> &Dp {
        self.dp
    }

    fn zero_grad(&mut self) -> Result<()> {
        self.train.zero_grad()
    }

    fn forward_backward(&mut self, mini: &UpdateMiniBatch<'_>) -> Result<Vec<MicroOutcome>> {
        let (device, seqs, padding) = (self.device, &self.inputs.seqs, self.padding);
        let parts = micro_batches(
            mini.rows,
            &self.lengths,
            self.micro,
            "critic.ppo_max_token_len_per_gpu",
        )?;
        let parts = same_micro_batch_count(self.dp, parts)?;
        let prepare = |part: &[usize]| -> Result<(Tensor, RowLayout)> {
            Ok((
                index_tensor(part, device)?,
                RowLayout::new(seqs, part, padding)?,
            ))
        };
        let mut next = parts.first().map(|mb| prepare(&mb.rows)).transpose()?;
        let mut out = Vec::new();
        for (ui, MicroBatch { rows: part, dummy }) in parts.iter().enumerate() {
            let dummy = *dummy;
            let (idx, layout) = match next.take() {
                Some(v) => v,
                None => prepare(part)?,
            };
            let micro = self.inputs.micro(&idx)?;
            let loss_fn = self.loss;
            let (_, metrics) = self.train.forward_backward_with(
                self.dp,
                &layout.input_ids,
                layout.model_mask(),
                Some(&layout.position_ids),
                "critic loss",
                |out| {
                    let vpreds = layout
                        .scatter(&layout.gather(out)?)
                        .ctx("values at response positions")?;
                    micro.loss(loss_fn, mini.norm, &vpreds, &layout.response_mask, dummy)
                },
            )?;
            // Laid out on the host while the device runs this micro-batch's backward.
            next = parts.get(ui + 1).map(|mb| prepare(&mb.rows)).transpose()?;
            if dummy {
                continue;
            }
            self.train.after_backward()?;
            out.push(MicroOutcome {
                micro: ui,
                metrics,
                loss: None,
            });
        }
        Ok(out)
    }

    fn optimizer_step(&mut self, lr: f64, step: u64, mini: &UpdateMiniBatch<'_>) -> Result<f64> {
        self.train
            .finish_mini_batch(self.dp, lr, mini.step_at(UpdateRole::Critic, step))
    }
}

impl Critic for FsdpCritic {
    fn compute_values(&mut self, batch: &Batch, _options: &ValueOptions) -> ApiResult<Batch> {
        let r = self.do_values(batch);
        Ok(self.spmd(r)?)
    }
    fn update(&mut self, batch: &Batch, options: &UpdateOptions) -> ApiResult<Metrics> {
        let r = self.do_update(batch, options);
        Ok(self.spmd(r)?)
    }
    fn save(&mut self, dir: &Path) -> ApiResult<()> {
        let r = self
            .train
            .save_on(&self.dp, dir, "critic", serde_json::Value::Null);
        Ok(self.spmd(r)?)
    }
    fn load(&mut self, dir: &Path) -> ApiResult<()> {
        let r = self.train.load(dir, "critic").map(|_| ());
        Ok(self.spmd(r)?)
    }
    fn data_parallel(&self) -> DataParallel {
        DataParallel {
            rank: self.dp.rank as u32,
            size: self.dp.size as u32,
        }
    }
}
