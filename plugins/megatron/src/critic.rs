//! The Critic role on the tensor-parallel model: a replicated value head on the tensor-parallel
//! backbone (`critic.model.path`, default the actor's), values at the response positions, the
//! clipped value-loss update, checkpoints.

use std::path::Path;

use tch::{Device, Kind};
use verl_backend_kit::config::{
    self, section, CriticSection, CriticUpdatePlan, LogProbSection, MicroBatching, ModelSection,
};
use verl_backend_kit::data::Sequences;
use verl_losses::CriticLoss;
use verl_nn::{HeadKind, ModelConfig};
use verl_plugin_api::{
    Batch, Critic, DataParallel, InitArgs, Metrics, Result as ApiResult, UpdateOptions,
    ValueOptions,
};

use crate::common::{
    self, compute_dtype, forward_micro_batches, megatron_section, metrics_from_last_stage,
    same_rows_on_every_rank,
};
use crate::error::{MegatronError, Result, TorchContext};
use crate::offload::{on_device, Need, Offload, Place};
use crate::parallel::Parallel;
use crate::train::TpTrainer;
use verl_backend_kit::update::{
    run_update, total_training_steps, CriticUpdateInputs, MicroOutcome,
    MiniBatch as UpdateMiniBatch, NonFiniteAt, UpdateEngine, UpdateRole,
};

pub struct MegatronCritic {
    train: TpTrainer,
    par: Parallel,
    device: Device,
    /// Micro-batching of the value forwards and the update, mini-batches, epochs, the loss.
    plan: CriticUpdatePlan,
    /// `critic.megatron.param_offload` / `grad_offload` / `optimizer_offload`
    /// ([`crate::offload`]).
    offload: Offload,
}

impl MegatronCritic {
    pub fn create(init: &InitArgs) -> Result<MegatronCritic> {
        let cfg = &init.config;
        let (trainer, device) = config::trainer_device(init)?;
        let critic: CriticSection = section(cfg, "critic")?;
        let actor_model: ModelSection = section(cfg, "actor_rollout_ref.model")?;
        let rollout: LogProbSection = section(cfg, "actor_rollout_ref.rollout")?;
        let dir = config::critic_model_dir(&critic, &actor_model)?;
        let model_cfg = ModelConfig::from_dir(&dir)?;
        let prefix = "critic.megatron";
        let mg = megatron_section(cfg, prefix, None)?;
        let layout = common::role_layout(&mg, prefix, init, &model_cfg)?;
        let aux_loss_coeff = common::aux_loss_coeff(&mg, prefix, &model_cfg)?;
        let dtype = compute_dtype(&mg, prefix)?;
        if device.is_cuda() {
            // One process: expandable segments, as the FSDP backend (each generate call sizes its
            // KV cache from memory no tensor holds).
            verl_backend_kit::device::expandable_segments(init.world_size as usize);
        }
        let par = common::join(init, "critic", layout, device)?;
        let dp_size = par.dp.size;
        let mut model = common::build_model(
            &dir,
            model_cfg,
            HeadKind::Value,
            dtype,
            &par,
            mg.seed,
            common::random_init_seed(init)?,
            aux_loss_coeff,
        )?;
        common::apply_recompute(&mut model, &mg, prefix)?;
        let plan = CriticUpdatePlan::resolve(cfg, &critic, &rollout, &trainer, dp_size)?;
        let train = TpTrainer::new(
            model,
            critic.optim.clone(),
            "critic.optim",
            critic.grad_clip,
            &par,
        )?;
        let mut critic = MegatronCritic {
            train,
            par,
            device,
            plan,
            offload: Offload::of(&mg),
        };
        critic.move_offloaded(Need::Train, Place::Host)?;
        Ok(critic)
    }

    /// What this role offloads between calls.
    pub fn offload(&self) -> Offload {
        self.offload
    }

    /// Moves the offloaded parts a call needing `need` uses to `place` (see [`crate::offload`]);
    /// returns the labels of the tensors moved.
    pub fn move_offloaded(&mut self, need: Need, place: Place) -> Result<Vec<String>> {
        self.train.move_offloaded(self.offload, need, place)
    }

    /// Runs `f` with the offloaded parts it needs on the device, and sends them back afterwards.
    fn offloaded<T>(&mut self, need: Need, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        let offload = self.offload;
        on_device(
            self,
            offload,
            |s, place| s.move_offloaded(need, place).map(|_| ()),
            f,
        )
    }

    /// The devices of this rank's parameters, gradient buffers and optimizer state.
    pub fn state_devices(&self) -> (Vec<Device>, Vec<Device>, Vec<Device>) {
        let params = self
            .train
            .model
            .params
            .iter()
            .map(|p| p.local.device())
            .collect();
        let (g, o) = self.train.state_devices();
        (params, g, o)
    }

    pub fn parallel(&self) -> &Parallel {
        &self.par
    }

    fn spmd<T>(&self, r: Result<T>) -> Result<T> {
        r.map_err(|e| self.par.fail(e))
    }

    fn do_values(&mut self, batch: &Batch) -> Result<Batch> {
        let seqs = Sequences::from_batch(batch, "Critic.compute_values", self.device)?;
        let model = &self.train.model;
        let res = forward_micro_batches(
            model,
            &self.par,
            &seqs,
            self.plan.forward_micro,
            "critic.forward_max_token_len_per_gpu",
            1,
            |sub, h| {
                let v = model.values(&sub.response_slice(h)?)?;
                Ok(vec![v.f_to_kind(Kind::Float).ctx("values to fp32")?])
            },
        )?;
        Ok(verl_backend_kit::update::values_batch(&seqs, &res[0])?)
    }

    fn do_update(&mut self, batch: &Batch, o: &UpdateOptions) -> Result<Metrics> {
        const CALL: &str = "Critic.update";
        let device = self.device;
        let inputs = CriticUpdateInputs::from_batch(batch, CALL, device)?;
        let lr = self
            .train
            .lr(total_training_steps(o, self.plan.trainer_total_steps))?;
        let par = &self.par;
        same_rows_on_every_rank(&par.dp_meta, inputs.seqs.rows(), CALL)?;
        let train = &mut self.train;
        // Only this update's routing counts enter its metrics.
        train.model.take_moe_load()?;
        let mut engine = CriticEngine {
            train,
            par,
            lengths: inputs.seqs.row_lengths()?,
            inputs: &inputs,
            micro: self.plan.update_micro,
            loss: &self.plan.loss,
        };
        let mut acc = run_update(&mut engine, &self.plan.spec(o, &inputs, lr))?;
        train.updates += 1;
        // The critic's MoE metrics sit under `critic/` (the actor reports the plain `moe/` ones).
        for (name, v) in common::moe_load_metrics(&train.model, par)? {
            acc.push_global(&format!("critic/{name}"), v);
        }
        verl_backend_kit::metrics::push_gpu_memory(&mut acc, &par.dp_meta, device)?;
        acc.reduce(&par.dp_meta)?;
        metrics_from_last_stage(par, acc.into_metrics())
    }
}

/// The Megatron critic in the shared update loop: a mini-batch's micro-batches through the
/// pipeline schedule, the value loss on the last stage.
struct CriticEngine<'a> {
    train: &'a mut TpTrainer,
    par: &'a Parallel,
    inputs: &'a CriticUpdateInputs,
    lengths: Vec<i64>,
    micro: MicroBatching,
    loss: &'a CriticLoss,
}

impl UpdateEngine for CriticEngine<'_> {
    type Error = MegatronError;

    fn dp(&self) -> &verl_backend_kit::dp::Dp {
        &self.par.dp_meta
    }

    fn zero_grad(&mut self) -> Result<()> {
        self.train.zero_grad()
    }

    fn forward_backward(&mut self, mini: &UpdateMiniBatch<'_>) -> Result<Vec<MicroOutcome>> {
        let (inputs, par) = (self.inputs, self.par);
        let um = common::UpdateMicros::new(
            &self.train.model,
            &par.dp_meta,
            &inputs.seqs,
            mini.rows,
            &self.lengths,
            self.micro,
            "critic.ppo_max_token_len_per_gpu",
            |idx| Ok(inputs.micro(idx)?),
        )?;
        let (micros, model_inputs) = (&um.micros, um.inputs());
        let loss_fn = self.loss;
        let results =
            self.train
                .forward_backward_pipelined(par, &model_inputs, |ui, model, hidden| {
                    let (sub, micro, dummy) = &micros[ui];
                    let vpreds = model
                        .values(&sub.response_slice(hidden)?)?
                        .f_to_kind(Kind::Float)
                        .ctx("values to fp32")?;
                    Ok(micro.loss(loss_fn, mini.norm, &vpreds, &sub.response_mask, *dummy)?)
                })?;
        // Only the last pipeline stage sees the losses.
        let mut out = Vec::new();
        for (ui, r) in results.into_iter().enumerate() {
            let Some((_, metrics)) = r else { continue };
            if um.is_dummy(ui) {
                continue;
            }
            out.push(MicroOutcome {
                micro: ui,
                metrics,
                loss: None,
            });
        }
        Ok(out)
    }

    fn agree(&self, bad: Option<NonFiniteAt>) -> Result<Option<NonFiniteAt>> {
        common::non_finite_from_last_stage(self.par, bad)
    }

    fn optimizer_step(&mut self, lr: f64, step: u64, mini: &UpdateMiniBatch<'_>) -> Result<f64> {
        self.train
            .finish_mini_batch(self.par, lr, mini.step_at(UpdateRole::Critic, step))
    }
}

impl Critic for MegatronCritic {
    fn compute_values(&mut self, batch: &Batch, _options: &ValueOptions) -> ApiResult<Batch> {
        let r = self.offloaded(Need::Params, |s| s.do_values(batch));
        Ok(self.spmd(r)?)
    }
    fn update(&mut self, batch: &Batch, options: &UpdateOptions) -> ApiResult<Metrics> {
        let r = self.offloaded(Need::Train, |s| s.do_update(batch, options));
        Ok(self.spmd(r)?)
    }
    fn save(&mut self, dir: &Path) -> ApiResult<()> {
        let r = self.offloaded(Need::State, |s| {
            crate::ckpt::save(&s.train, &s.par, dir, "critic", serde_json::Value::Null)
        });
        Ok(self.spmd(r)?)
    }
    fn load(&mut self, dir: &Path) -> ApiResult<()> {
        let r = self.offloaded(Need::State, |s| {
            crate::ckpt::load(&mut s.train, &s.par, dir, "critic").map(|_| ())
        });
        Ok(self.spmd(r)?)
    }
    fn data_parallel(&self) -> DataParallel {
        DataParallel {
            rank: self.par.dp.rank as u32,
            size: self.par.dp.size as u32,
        }
    }
}
