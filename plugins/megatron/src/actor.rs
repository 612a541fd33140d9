//! The Actor role (policy: generate, log-probs, PPO update, checkpoints, HF export) and the Reference
//! role (the same model, frozen: log-probs only) on the tensor-parallel model.
//!
//! Generation runs the `verl_rollout` engine at `actor_rollout_ref.rollout.tensor_model_parallel_size`
//! (the actor's TP by default): every rank builds a `verl_nn::Transformer` holding only its rollout
//! shard (local heads, MLP columns and vocabulary rows; its KV cache holds its key/value heads
//! only), resharded from the training shards ([`crate::rollout`]), and the ranks of a rollout group
//! run the engine in lock-step, all-reducing the row-parallel outputs and all-gathering the logits
//! before sampling, so every rank samples the same tokens. Each rollout group generates its own
//! share of the prompts. The generation model is kept between calls and rebuilt after each update
//! (with `param_offload` it is dropped at the end of every call: [`crate::offload`]).

use std::path::Path;

use tch::{Device, Tensor};
use verl_backend_kit::budget::head_chunk_tokens;
use verl_backend_kit::config::{
    self, section, ActorSection, ActorSettings, ActorUpdatePlan, LogProbSection,
    RolloutEngineSection,
};
use verl_backend_kit::data::Sequences;
use verl_losses::ChunkedLmHead;
use verl_nn::{HeadKind, ModelConfig, SaveOptions, Transformer};
use verl_plugin_api::{
    Actor, Batch, DataParallel, Error as ApiError, GenerateOptions, InitArgs, LogProbOptions,
    Metrics, Result as ApiResult, UpdateOptions,
};

use crate::common::{
    self, assemble, check_temperature, compute_dtype, copy_tokenizer_files, forward_micro_batches,
    gather_live_model, megatron_section, metrics_from_last_stage, same_rows_on_every_rank,
};
use crate::error::{MegatronError, Result, TorchContext};
use crate::offload::{move_params, on_device, HostHomes, Need, Offload, Place};
use crate::parallel::Parallel;
use crate::rollout::{Reshard, RolloutComms, RolloutLayout};
use crate::tp::TpModel;
use crate::train::TpTrainer;
use verl_backend_kit::generation::{derive_seed, GenerateCall};
use verl_backend_kit::update::{
    log_prob_batch, run_update, total_training_steps, zero_if_dummy, ActorUpdateInputs,
    MicroOutcome, MiniBatch as UpdateMiniBatch, NonFiniteAt, UpdateEngine, UpdateRole,
};

type Weights = verl_backend_kit::update::RoleWeights<TpTrainer, TpModel>;

pub struct MegatronActor {
    /// Paths, log-prob micro-batching, the update plan and the generation seeds.
    settings: ActorSettings,
    weights: Weights,
    par: Parallel,
    device: Device,
    /// The model generation runs on (this rank's rollout shard); `None` when stale.
    rollout_model: Option<Transformer>,
    /// Generation's layout ([`crate::rollout::resolve`]), its communicators (made at the first
    /// generate call) and what the last reshard moved.
    rollout: RolloutLayout,
    rollout_comms: Option<RolloutComms>,
    reshard: Reshard,
    /// The generation engine's keys (`rollout.gpu_memory_utilization`, `max_num_seqs`,
    /// `enforce_eager`, ...), as the FSDP backend reads them.
    engine: RolloutEngineSection,
    /// `*.megatron.param_offload` / `grad_offload` / `optimizer_offload` ([`crate::offload`]).
    offload: Offload,
    /// Host homes of a frozen model's offloaded parameters (a trainer keeps its own).
    homes: HostHomes,
}

impl MegatronActor {
    pub fn create(init: &InitArgs, reference: bool) -> Result<MegatronActor> {
        let cfg = &init.config;
        let random_init = common::random_init_seed(init)?;
        let (trainer, device) = config::trainer_device(init)?;
        let (_, dirs) = config::actor_model_dirs(cfg)?;
        let model_cfg = ModelConfig::from_dir(&dirs.0)?;
        let actor: ActorSection = section(cfg, "actor_rollout_ref.actor")?;
        let rollout: LogProbSection = section(cfg, "actor_rollout_ref.rollout")?;
        let (prefix, mg) = if reference {
            let p = "actor_rollout_ref.ref.megatron";
            (
                p,
                megatron_section(cfg, p, Some("actor_rollout_ref.actor.megatron"))?,
            )
        } else {
            let p = "actor_rollout_ref.actor.megatron";
            (p, megatron_section(cfg, p, None)?)
        };
        let layout = common::role_layout(&mg, prefix, init, &model_cfg)?;
        // The reference never generates: its layout is not resolved (nor warned about).
        let rollout_layout = match reference {
            true => RolloutLayout::unused(&layout),
            false => crate::rollout::resolve(cfg, &layout, &model_cfg)?,
        };
        let aux_loss_coeff = common::aux_loss_coeff(&mg, prefix, &model_cfg)?;
        let dtype = compute_dtype(&mg, prefix)?;
        let role = if reference { "reference" } else { "actor" };
        let offload = Offload::of(&mg);
        if device.is_cuda() {
            // One process: expandable segments, as the FSDP backend (each generate call sizes its
            // KV cache from memory no tensor holds).
            verl_backend_kit::device::expandable_segments(init.world_size as usize);
        }
        let par = common::join(init, role, layout, device)?;
        let dp_size = par.dp.size;
        let mut model = common::build_model(
            &dirs.0,
            model_cfg,
            HeadKind::CausalLm,
            dtype,
            &par,
            mg.seed,
            random_init,
            aux_loss_coeff,
        )?;
        if !reference {
            common::apply_recompute(&mut model, &mg, prefix)?;
        }
        if reference {
            let _r: LogProbSection = section(cfg, "actor_rollout_ref.ref")?;
            model.set_requires_grad(false)?;
            return MegatronActor {
                weights: Weights::Frozen(Box::new(model)),
                par,
                device,
                rollout_model: None,
                rollout: rollout_layout,
                rollout_comms: None,
                reshard: Reshard::default(),
                engine: section(cfg, "actor_rollout_ref.rollout")?,
                offload,
                homes: HostHomes::default(),
                settings: ActorSettings::resolve(cfg, None, dirs, &trainer, dp_size, mg.seed)?,
            }
            .offloaded_at_start();
        }
        let plan = ActorUpdatePlan::resolve(cfg, &actor, &rollout, dp_size)?;
        let train = TpTrainer::new(
            model,
            actor.optim.clone(),
            "actor_rollout_ref.actor.optim",
            actor.grad_clip,
            &par,
        )?;
        MegatronActor {
            weights: Weights::Train(Box::new(train)),
            par,
            device,
            rollout_model: None,
            rollout: rollout_layout,
            rollout_comms: None,
            reshard: Reshard::default(),
            engine: section(cfg, "actor_rollout_ref.rollout")?,
            offload,
            homes: HostHomes::default(),
            settings: ActorSettings::resolve(cfg, Some(plan), dirs, &trainer, dp_size, mg.seed)?,
        }
        .offloaded_at_start()
    }

    /// A freshly built role with its offloaded parts sent to the host.
    fn offloaded_at_start(mut self) -> Result<MegatronActor> {
        self.move_offloaded(Need::Train, Place::Host)?;
        Ok(self)
    }

    /// What this role offloads between calls.
    pub fn offload(&self) -> Offload {
        self.offload
    }

    /// Moves the offloaded parts a call needing `need` uses to `place` (see [`crate::offload`]);
    /// returns the labels of the tensors moved. Sending the parameters to the host also drops the
    /// generation copy built from them.
    pub fn move_offloaded(&mut self, need: Need, place: Place) -> Result<Vec<String>> {
        let seen = match &mut self.weights {
            Weights::Train(t) => t.move_offloaded(self.offload, need, place)?,
            Weights::Frozen(m) if self.offload.params => {
                move_params(m, place, &mut self.homes, need.param_contents())?
            }
            Weights::Frozen(_) => vec![],
        };
        if place == Place::Host && self.offload.params {
            self.rollout_model = None;
        }
        Ok(seen)
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

    /// The devices of this rank's parameters, and with a trainer of its gradient buffers and of
    /// its optimizer state (masters, moments).
    pub fn state_devices(&self) -> (Vec<Device>, Vec<Device>, Vec<Device>) {
        let params = self
            .model()
            .params
            .iter()
            .map(|p| p.local.device())
            .collect();
        match &self.weights {
            Weights::Train(t) => {
                let (g, o) = t.state_devices();
                (params, g, o)
            }
            Weights::Frozen(_) => (params, vec![], vec![]),
        }
    }

    /// Whether a generation model is currently kept.
    pub fn holds_rollout_model(&self) -> bool {
        self.rollout_model.is_some()
    }

    pub fn model(&self) -> &TpModel {
        match &self.weights {
            Weights::Train(t) => &t.model,
            Weights::Frozen(m) => m,
        }
    }

    /// The parallel groups of this role instance.
    pub fn parallel(&self) -> &Parallel {
        &self.par
    }

    /// Bytes of this rank's training state (masters, gradients, AdamW moments) plus live weights.
    pub fn memory_bytes(&self) -> usize {
        let live: usize = self
            .model()
            .params
            .iter()
            .map(|p| p.local.numel() * p.local.kind().elt_size_in_bytes())
            .sum();
        match &self.weights {
            Weights::Train(t) => live + t.memory_bytes(),
            Weights::Frozen(_) => live,
        }
    }

    fn spmd<T>(&self, r: Result<T>) -> Result<T> {
        r.map_err(|e| self.par.fail(e))
    }

    /// Generation's layout (`actor_rollout_ref.rollout.tensor_model_parallel_size`).
    pub fn rollout_layout(&self) -> &RolloutLayout {
        &self.rollout
    }

    /// What the last reshard moved into this rank (bytes) and how long it took.
    pub fn last_reshard(&self) -> Reshard {
        self.reshard
    }

    /// The model generation runs on: this rank's rollout shard, resharded from the training
    /// shards when the weights changed since the last call. Every rank of the job calls this
    /// together.
    pub fn rollout_model(&mut self) -> Result<&Transformer> {
        if self.rollout_model.is_none() {
            if self.rollout_comms.is_none() {
                let world = self.par.world_group()?;
                self.rollout_comms = Some(RolloutComms::new(world, &self.rollout.grid)?);
            }
            let comms = self.rollout_comms.as_ref().expect("made above");
            let (model, moved) = crate::rollout::reshard(
                self.model(),
                &self.rollout.grid,
                comms,
                &self.par,
                self.device,
            )?;
            self.reshard = moved;
            self.rollout_model = Some(model);
        }
        self.rollout_model.as_ref().ok_or_else(|| {
            MegatronError::Api(ApiError::failed("internal: rollout model not built"))
        })
    }

    fn do_generate(&mut self, prompts: &Batch, o: &GenerateOptions) -> Result<Batch> {
        let seed = derive_seed(self.settings.seed, self.settings.generate_calls);
        let eos = self.model().config().eos_token_ids.clone();
        let call = GenerateCall::new(prompts, o, self.device, &eos, seed)?;
        self.settings.generate_calls += 1;
        let (device, engine) = (self.device, self.engine.clone());
        let resharded = self.rollout_model.is_none();
        self.rollout_model()?;
        let layout = &self.par.layout;
        // The rollout groups are the training replicas themselves (rollout TP = actor TP, one
        // stage): each generates its own prompts. Otherwise the prompts are shared out.
        let own = self.rollout.grid.tp == layout.tp && layout.pp == 1 && layout.cp == 1;
        let placement = self.rollout.placement(layout, self.par.rank);
        let comms = self.rollout_comms.as_ref().expect("made by rollout_model");
        let model = self.rollout_model.as_ref().expect("built above");
        let shared = match own || self.par.layout.world() == 1 {
            true => None,
            false => Some(verl_backend_kit::hybrid::share(
                &call,
                &comms.world,
                placement,
            )?),
        };
        let run = shared.as_ref().map_or(&call, |s| &s.call);
        // The FSDP backend's engine configuration: KV pool from gpu_memory_utilization, CUDA
        // graphs unless enforce_eager, max_num_seqs / max_num_batched_tokens.
        let mut budget =
            verl_backend_kit::budget::kv_budget(model, device, &engine, &run.mask, &run.params)
                .map_err(|e| MegatronError::Api(ApiError::failed(format!("KV budget: {e}"))))?;
        if comms.group.size > 1 {
            // A rollout group runs the engine in lock-step: one pool size for the whole group
            // (each rank measured its own free memory).
            let mut tokens = [-(budget
                .config
                .kv_cache_tokens
                .unwrap_or(budget.all_sequences_tokens) as f64)];
            comms.group.all_reduce_max(&mut tokens)?;
            tokens[0] = -tokens[0];
            budget.config.kv_cache_tokens = Some(tokens[0] as usize);
        }
        let (gen, stats) = match &shared {
            None => call.run(model, &budget.config, None)?,
            Some(sh) => {
                let (g, stats) = sh.run(|c| c.run(model, &budget.config, None))?;
                (sh.gather_back(&g, &comms.world)?, stats)
            }
        };
        let mut meta = budget.metrics(&stats);
        self.rollout_metrics(&mut meta, resharded, shared.as_ref().map(|s| s.prompts()));
        Ok(call.into_batch(&gen, &meta)?)
    }

    /// Generation's layout metrics: the rollout TP, this rank's rollout group's prompts and, when
    /// this call resharded, the bytes it moved into this rank and the seconds it took.
    fn rollout_metrics(
        &self,
        meta: &mut serde_json::Map<String, serde_json::Value>,
        resharded: bool,
        prompts: Option<usize>,
    ) {
        meta.insert("rollout/tp".into(), self.rollout.grid.tp.into());
        if let Some(n) = prompts {
            meta.insert("rollout/group_prompts".into(), n.into());
        }
        if resharded {
            meta.insert(
                "rollout/reshard_mb".into(),
                (self.reshard.bytes_in / 1e6).into(),
            );
            meta.insert("rollout/reshard_s".into(), self.reshard.secs.into());
        }
    }

    fn do_log_prob(&mut self, batch: &Batch, o: &LogProbOptions) -> Result<Batch> {
        let seqs = Sequences::from_batch(batch, "Actor.compute_log_prob", self.device)?;
        check_temperature(o.temperature)?;
        let outputs = if o.with_entropy { 2 } else { 1 };
        let model = self.model();
        let res = forward_micro_batches(
            model,
            &self.par,
            &seqs,
            self.settings.log_prob_micro,
            self.settings.log_prob_key,
            outputs,
            |sub, hidden| {
                let hidden = sub.response_slice(hidden)?;
                let (lp, ent) = match model.whole_lm_head() {
                    Some(weight) => {
                        let (h, t) = flat_head_inputs(&hidden, &sub.responses)?;
                        let head = ChunkedLmHead::new(
                            head_chunk_tokens(weight.size()[0]),
                            o.temperature,
                            o.with_entropy,
                        );
                        let stats = head.forward(&h, weight, &t)?;
                        let shape = sub.responses.size();
                        (
                            stats.log_probs.f_view(shape.as_slice()).ctx("log-probs")?,
                            match stats.entropy {
                                Some(e) => Some(e.f_view(shape.as_slice()).ctx("entropy")?),
                                None => None,
                            },
                        )
                    }
                    None => {
                        model.token_stats(&hidden, &sub.responses, o.temperature, o.with_entropy)?
                    }
                };
                Ok(std::iter::once(lp).chain(ent).collect())
            },
        )?;
        // Padding positions hold 0, as verl's (and the FSDP backend's) padding-free forward
        // returns them.
        let masked = |t: &Tensor| t.f_mul(&seqs.response_mask).ctx("mask log-probs");
        let entropy = match o.with_entropy {
            true => Some(masked(&res[1])?),
            false => None,
        };
        Ok(log_prob_batch(
            seqs.rows(),
            seqs.response_len as usize,
            &masked(&res[0])?,
            entropy.as_ref(),
        )?)
    }

    fn do_update(&mut self, batch: &Batch, o: &UpdateOptions) -> Result<Metrics> {
        const CALL: &str = "Actor.update";
        let device = self.device;
        let (plan, train, inputs) =
            self.settings
                .begin_update(&mut self.weights, batch, device, o)?;
        let temperature = o.temperature.unwrap_or(self.settings.default_temperature);
        check_temperature(temperature)?;
        let lr = train.lr(total_training_steps(o, self.settings.trainer_total_steps))?;
        let par = &self.par;
        same_rows_on_every_rank(&par.dp_meta, inputs.seqs.rows(), CALL)?;
        self.rollout_model = None;
        // Only this update's routing counts enter its metrics.
        train.model.take_moe_load()?;
        let mut engine = ActorEngine {
            train,
            par,
            plan,
            lengths: inputs.seqs.row_lengths()?,
            inputs: &inputs,
            temperature,
            // fp32 LM-head logits kept from each micro-batch's forward for its backward (TP = 1),
            // as the FSDP backend's update keeps them: one head GEMM per chunk less.
            kept_logits_bytes: verl_backend_kit::budget::kept_logits_budget(device),
        };
        let mut acc = run_update(&mut engine, &plan.spec(o, &inputs, lr))?;
        train.updates += 1;
        for (name, v) in common::moe_load_metrics(&train.model, par)? {
            acc.push_global(&name, v);
        }
        verl_backend_kit::metrics::push_gpu_memory(&mut acc, &par.dp_meta, device)?;
        acc.reduce(&par.dp_meta)?;
        metrics_from_last_stage(par, acc.into_metrics())
    }

    fn do_save(&mut self, dir: &Path) -> Result<()> {
        let extra = self.settings.rng_state();
        match &self.weights {
            Weights::Train(t) => crate::ckpt::save(t, &self.par, dir, self.settings.role, extra),
            Weights::Frozen(_) => Err(frozen()),
        }
    }

    fn do_load(&mut self, dir: &Path) -> Result<()> {
        let extra = match &mut self.weights {
            Weights::Train(t) => crate::ckpt::load(t, &self.par, dir, self.settings.role)?,
            Weights::Frozen(_) => return Err(frozen()),
        };
        self.rollout_model = None;
        self.settings.restore_rng_state(&extra);
        Ok(())
    }

    /// Every rank takes part (the weights are gathered over the tensor-parallel group); rank 0
    /// writes an HF folder transformers loads.
    fn do_export(&mut self, dir: &Path) -> Result<()> {
        let m = self.model();
        let weights = gather_live_model(m, &self.par)?;
        if self.par.is_first() {
            let full = assemble(
                m.config(),
                HeadKind::CausalLm,
                m.dtype(),
                Device::Cpu,
                &weights,
            )?;
            full.save_pretrained(dir, &SaveOptions::default())?;
            copy_tokenizer_files(&self.settings.tokenizer_dir, dir)?;
            if self.settings.tokenizer_dir != self.settings.model_dir {
                copy_tokenizer_files(&self.settings.model_dir, dir)?;
            }
        }
        self.par.barrier("export barrier")
    }
}

fn frozen() -> MegatronError {
    MegatronError::Api(ApiError::not_implemented(
        "the reference policy is frozen: it is rebuilt from the model path, not checkpointed",
    ))
}

/// Response hidden states `[rows, R, H]` and targets `[rows, R]` as `[rows * R, H]` and
/// `[rows * R]`, for [`ChunkedLmHead`].
fn flat_head_inputs(hidden: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
    let h = hidden.size();
    let hidden = hidden
        .f_reshape([-1, h[h.len() - 1]])
        .ctx("flatten response hidden states")?;
    let targets = targets
        .f_reshape([-1])
        .and_then(|t| t.f_contiguous())
        .ctx("flatten response tokens")?;
    Ok((hidden, targets))
}

/// The Megatron actor in the shared update loop: a mini-batch's micro-batches through the
/// pipeline schedule (one stage per rank, tensor-parallel layers), the loss on the last stage
/// through the chunked LM head where the head is whole on the rank, else through the
/// tensor-parallel head's token statistics.
struct ActorEngine<'a> {
    train: &'a mut TpTrainer,
    par: &'a Parallel,
    plan: &'a ActorUpdatePlan,
    inputs: &'a ActorUpdateInputs,
    lengths: Vec<i64>,
    temperature: f64,
    kept_logits_bytes: u64,
}

impl UpdateEngine for ActorEngine<'_> {
    type Error = MegatronError;

    fn dp(&self) -> &verl_backend_kit::dp::Dp {
        &self.par.dp_meta
    }

    fn zero_grad(&mut self) -> Result<()> {
        self.train.zero_grad()
    }

    fn forward_backward(&mut self, mini: &UpdateMiniBatch<'_>) -> Result<Vec<MicroOutcome>> {
        let (plan, inputs, par) = (self.plan, self.inputs, self.par);
        let um = common::UpdateMicros::new(
            &self.train.model,
            &par.dp_meta,
            &inputs.seqs,
            mini.rows,
            &self.lengths,
            plan.micro,
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
            |idx| Ok(inputs.micro(idx)?),
        )?;
        let (micros, model_inputs) = (&um.micros, um.inputs());
        let (temperature, need_entropy) = (self.temperature, inputs.need_entropy);
        let kept_logits_bytes = self.kept_logits_bytes;
        let on_policy = inputs.anchor.on_policy;
        let results =
            self.train
                .forward_backward_pipelined(par, &model_inputs, |ui, model, hidden| {
                    let (sub, micro, dummy) = &micros[ui];
                    let terms = micro.terms();
                    let h = sub.response_slice(hidden)?;
                    let loss_of = |lp: &Tensor, ent: Option<&Tensor>| {
                        terms.loss(
                            &plan.loss,
                            mini.norm,
                            on_policy,
                            lp,
                            ent,
                            &sub.response_mask,
                        )
                    };
                    let (loss, metrics) = match model.whole_lm_head() {
                        // The loss through the chunked head: a surrogate whose gradient with
                        // respect to the hidden states and the head is the loss's.
                        Some(weight) => {
                            let (hf, t) = flat_head_inputs(&h, &sub.responses)?;
                            let shape = sub.responses.size();
                            let head = ChunkedLmHead::new(
                                head_chunk_tokens(weight.size()[0]),
                                temperature,
                                need_entropy,
                            )
                            .with_kept_logits(kept_logits_bytes);
                            let mut metrics = None;
                            let (surrogate, _) =
                                head.loss_and_surrogate(&hf, weight, &t, |lp, ent| {
                                    let torch = |source| verl_losses::LossError::Torch {
                                        op: "actor loss inputs",
                                        source,
                                    };
                                    let lp = lp.f_view(shape.as_slice()).map_err(torch)?;
                                    let ent = match ent {
                                        Some(e) => Some(e.f_view(shape.as_slice()).map_err(torch)?),
                                        None => None,
                                    };
                                    let (loss, m) = loss_of(&lp, ent.as_ref())?;
                                    metrics = Some(m.resolve()?);
                                    Ok(loss)
                                })?;
                            let metrics = metrics.ok_or_else(|| {
                                MegatronError::Api(verl_plugin_api::Error::failed(
                                    "the actor loss was not computed",
                                ))
                            })?;
                            (surrogate, metrics)
                        }
                        None => {
                            let (lp, ent) =
                                model.token_stats(&h, &sub.responses, temperature, need_entropy)?;
                            let (loss, m) = loss_of(&lp, ent.as_ref())?;
                            (loss, m.resolve()?)
                        }
                    };
                    Ok((zero_if_dummy(loss, *dummy)?, metrics))
                })?;
        // Only the last pipeline stage sees the losses.
        let mut out = Vec::new();
        for (ui, r) in results.into_iter().enumerate() {
            let Some((loss, metrics)) = r else { continue };
            if um.is_dummy(ui) {
                continue;
            }
            out.push(MicroOutcome {
                micro: ui,
                loss: Some(loss.f_double_value(&[]).ctx("loss value")?),
                metrics: metrics.into_iter().collect(),
            });
        }
        Ok(out)
    }

    /// The last stage tells the others about a non-finite value, so every stage skips the step
    /// and fails alike.
    fn agree(&self, bad: Option<NonFiniteAt>) -> Result<Option<NonFiniteAt>> {
        common::non_finite_from_last_stage(self.par, bad)
    }

    fn optimizer_step(&mut self, lr: f64, step: u64, mini: &UpdateMiniBatch<'_>) -> Result<f64> {
        self.train
            .finish_mini_batch(self.par, lr, mini.step_at(UpdateRole::Actor, step))
    }
}

impl Actor for MegatronActor {
    fn generate(&mut self, prompts: &Batch, options: &GenerateOptions) -> ApiResult<Batch> {
        let _trace = verl_nn::profile::trace("generate", self.device);
        let r = self.offloaded(Need::Params, |s| s.do_generate(prompts, options));
        Ok(self.spmd(r)?)
    }
    fn compute_log_prob(&mut self, batch: &Batch, options: &LogProbOptions) -> ApiResult<Batch> {
        let _trace = verl_nn::profile::trace("log_prob", self.device);
        let r = self.offloaded(Need::Params, |s| s.do_log_prob(batch, options));
        Ok(self.spmd(r)?)
    }
    fn update(&mut self, batch: &Batch, options: &UpdateOptions) -> ApiResult<Metrics> {
        let _trace = verl_nn::profile::trace("update", self.device);
        let r = self.offloaded(Need::Train, |s| s.do_update(batch, options));
        Ok(self.spmd(r)?)
    }
    fn save(&mut self, dir: &Path) -> ApiResult<()> {
        let r = self.offloaded(Need::State, |s| s.do_save(dir));
        Ok(self.spmd(r)?)
    }
    fn load(&mut self, dir: &Path) -> ApiResult<()> {
        let r = self.offloaded(Need::State, |s| s.do_load(dir));
        Ok(self.spmd(r)?)
    }
    fn export_hf(&mut self, dir: &Path) -> ApiResult<()> {
        let r = self.offloaded(Need::Params, |s| s.do_export(dir));
        Ok(self.spmd(r)?)
    }
    fn data_parallel(&self) -> DataParallel {
        DataParallel {
            rank: self.par.dp.rank as u32,
            size: self.par.dp.size as u32,
        }
    }
    /// `verl bench`'s device calls, as the FSDP backend answers them: `calibrate` (measured
    /// peak matmul FLOP/s and copy bandwidth of this rank's device) and `memory` (device memory
    /// in use and this rank's parameter, gradient and optimizer bytes).
    fn call(
        &mut self,
        method: &str,
        _batch: &Batch,
        options: &serde_json::Value,
    ) -> ApiResult<Batch> {
        let r: Result<Batch> = match method {
            verl_backend_kit::bench::CALIBRATE => {
                verl_backend_kit::bench::calibrate(self.device, options).map_err(Into::into)
            }
            verl_backend_kit::bench::MEMORY => {
                verl_backend_kit::bench::memory(self.device, self.memory_bytes())
                    .map_err(Into::into)
            }
            _ => Err(MegatronError::Api(ApiError::not_implemented(format!(
                "megatron {} call `{method}` (it answers `calibrate` and `memory`)",
                self.settings.role
            )))),
        };
        Ok(self.spmd(r)?)
    }
}
