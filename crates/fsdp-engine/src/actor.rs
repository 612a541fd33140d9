//! The Actor role (policy: generate, log-probs, PPO update, checkpoints, HF export) and the Reference
//! role (the same model class, frozen: log-probs only).

use std::path::Path;

use tch::{Device, Kind, Tensor};
use verl_losses::{fetch_scalars, ActorLoss, ChunkedLmHead, DeferredMetrics, Normaliser};
use verl_nn::{HeadKind, ModelOptions, SaveOptions, Transformer};
use verl_plugin_api::{
    Actor, Batch, DataParallel, Error as ApiError, GenerateOptions, InitArgs, LogProbOptions,
    Metrics, Result as ApiResult, UpdateOptions,
};

use crate::forward::{layout_token_stats, lm_head, per_micro_batch_layout};
use crate::packing::{prompt_group_micro_batches, Padding, PromptGroups, RowLayout};
use crate::shard::{MemoryStats, Offload};
use crate::train::{Sharding, TrainableModel};
use verl_backend_kit::budget::head_chunk_tokens;
use verl_backend_kit::config::{
    self, section, ActorSection, ActorSettings, ActorUpdatePlan, LogProbSection,
    RolloutEngineSection,
};
use verl_backend_kit::data::{index_tensor, micro_batches, MicroBatch, Sequences};
use verl_backend_kit::dp::Dp;
use verl_backend_kit::error::{BackendError, Result, TorchContext};
use verl_backend_kit::generation::{derive_seed, GenerateCall};
use verl_backend_kit::host_params::HostParams;
use verl_backend_kit::update::{
    log_prob_batch, run_update, total_training_steps, ActorUpdateInputs, MicroOutcome,
    MiniBatch as UpdateMiniBatch, UpdateEngine, UpdateRole,
};

mod loss;
pub use loss::{actor_micro_batch_loss, MicroBatchLoss};
use verl_backend_kit::budget::{
    kept_logits_budget, kv_budget, same_micro_batch_count, same_rows_on_every_rank,
};
use verl_backend_kit::device::{batch_invariant_gemms, expandable_segments};
use verl_backend_kit::model_files::{copy_tokenizer_files, random_init_seed};

type Weights = verl_backend_kit::update::RoleWeights<TrainableModel, Transformer>;

pub struct FsdpActor {
    /// Paths, log-prob micro-batching, the update plan and the generation seeds.
    settings: ActorSettings,
    weights: Weights,
    dp: Dp,
    device: Device,
    /// `actor_rollout_ref.model.use_remove_padding` and `actor_rollout_ref.actor.use_prefix_grouper`
    /// (for the actor's and the reference's passes, as verl).
    padding: Padding,
    /// Selected response tokens per LM-head chunk.
    head_chunk: i64,
    /// The generation engine's memory and scheduling keys.
    engine: RolloutEngineSection,
    /// The reference's parameters in host memory between calls
    /// (`actor_rollout_ref.ref.fsdp_config.param_offload` on a GPU).
    host_params: Option<HostParams>,
    /// `actor_rollout_ref.rollout.tensor_model_parallel_size`: rollout groups of this many
    /// consecutive ranks, each generating its members' prompts together on one tensor-parallel
    /// shard per rank ([`verl_backend_kit::hybrid`]); 1: each rank its own prompts, whole model.
    rollout_tp: usize,
    /// The rollout group's communicator, made by the first generate call.
    rollout_group: Option<std::sync::Arc<Dp>>,
}

pub(crate) fn load_model(
    dir: &Path,
    device: Device,
    dtype: Kind,
    head: HeadKind,
    seed: u64,
) -> Result<Transformer> {
    // A freshly initialised head (a critic built from a causal-LM checkpoint) draws from the
    // global generator; seed it so every rank and every run starts from the same weights.
    tch::manual_seed(seed as i64);
    Ok(Transformer::from_pretrained(
        dir,
        &ModelOptions {
            device,
            dtype,
            head,
        },
    )?)
}

/// The role's model: from the checkpoint, or (with `random_init`) freshly initialised from the
/// folder's config.json with the global generator seeded, so roles built with one seed (actor and
/// reference) get identical weights.
fn role_model(
    dir: &Path,
    device: Device,
    dtype: Kind,
    seed: u64,
    random_init: Option<u64>,
) -> Result<Transformer> {
    match random_init {
        None => load_model(dir, device, dtype, HeadKind::CausalLm, seed),
        Some(s) => {
            let cfg = verl_nn::ModelConfig::from_dir(dir)?;
            tch::manual_seed(s as i64);
            Ok(Transformer::new(
                cfg,
                &ModelOptions {
                    device,
                    dtype,
                    head: HeadKind::CausalLm,
                },
            )?)
        }
    }
}

impl FsdpActor {
    pub fn create(init: &InitArgs, reference: bool) -> Result<FsdpActor> {
        let cfg = &init.config;
        let random_init = random_init_seed(init)?;
        let (trainer, device) = config::trainer_device(init)?;
        let dp = Dp::join(init, if reference { "reference" } else { "actor" }, device)?;
        let dp_size = dp.size;
        let (model_cfg, dirs) = config::actor_model_dirs(cfg)?;
        let actor: ActorSection = section(cfg, "actor_rollout_ref.actor")?;
        let rollout: LogProbSection = section(cfg, "actor_rollout_ref.rollout")?;
        let engine: RolloutEngineSection = section(cfg, "actor_rollout_ref.rollout")?;
        if device.is_cuda() {
            expandable_segments(dp_size);
        }
        if engine.consistent_attention && device.is_cuda() {
            batch_invariant_gemms();
        }
        let padding = Padding::from_flags(
            model_cfg.use_remove_padding.unwrap_or(true),
            actor.use_prefix_grouper,
        );
        let lora = model_cfg.lora("actor_rollout_ref.model")?;
        if reference {
            if lora.is_some() {
                return Err(BackendError::Api(ApiError::failed(
                    "with LoRA (actor_rollout_ref.model.lora_rank / lora_adapter_path) the \
                     reference policy is the actor's base model with its adapters off: the host \
                     asks the actor (LogProbOptions.base_model) instead of creating a reference",
                )));
            }
            let reference: LogProbSection = section(cfg, "actor_rollout_ref.ref")?;
            let fsdp = reference
                .fsdp_config
                .clone()
                .unwrap_or_else(|| actor.fsdp_config.clone());
            let precision = fsdp.precision("actor_rollout_ref.ref.fsdp_config")?;
            let mut model = role_model(&dirs.0, device, precision.compute, fsdp.seed, random_init)?;
            model.set_requires_grad(false)?;
            let head_chunk = head_chunk_tokens(model.config().vocab_size);
            // On a GPU the parameters wait in (pinned) host memory and visit the device for each
            // log-prob call; on the CPU they are in host memory already.
            // (Unit tests take the GPU's path on the CPU.)
            let host_params = if fsdp.param_offload && (device.is_cuda() || cfg!(test)) {
                Some(HostParams::offload(&model, device)?)
            } else {
                None
            };
            return Ok(FsdpActor {
                weights: Weights::Frozen(Box::new(model)),
                dp,
                device,
                padding,
                head_chunk,
                engine,
                host_params,
                rollout_tp: 1,
                rollout_group: None,
                settings: ActorSettings::resolve(cfg, None, dirs, &trainer, dp_size, fsdp.seed)?,
            });
        }
        let precision = actor
            .fsdp_config
            .precision("actor_rollout_ref.actor.fsdp_config")?;
        let mut model = role_model(
            &dirs.0,
            device,
            precision.compute,
            actor.fsdp_config.seed,
            random_init,
        )?;
        if let Some(lora) = &lora {
            lora.apply(&mut model, "actor", actor.fsdp_config.seed)?;
        }
        model.set_activation_checkpointing(model_cfg.enable_gradient_checkpointing);
        model.set_consistent_attention(engine.consistent_attention);
        if engine.consistent_attention && !verl_torch_ext::paged_attention_available(device) {
            tracing::warn!(
                "actor_rollout_ref.rollout.consistent_attention has no effect on {device:?}: it \
                 needs the CUDA paged-attention kernel; attention runs as usual"
            );
        }
        let plan = ActorUpdatePlan::resolve(cfg, &actor, &rollout, dp.size)?;
        let tp1_because = crate::validate::tp1_because(cfg, lora.is_some(), model.config());
        let rollout_tp = verl_backend_kit::hybrid::data_parallel_rollout_tp(
            cfg,
            dp.size,
            model.config(),
            tp1_because,
        )?;
        let head_chunk = head_chunk_tokens(model.config().vocab_size);
        let offload = Offload {
            params: actor.fsdp_config.param_offload,
            optimizer: actor.fsdp_config.optimizer_offload,
        };
        let offload = if dp.is_sharded() {
            offload
        } else {
            crate::train::one_rank_offload(
                offload,
                precision,
                device,
                "actor_rollout_ref.actor.fsdp_config",
            )
        };
        let train = TrainableModel::new_on(
            model,
            precision,
            actor.optim.clone(),
            "actor_rollout_ref.actor.optim",
            actor.grad_clip,
            &dp,
            Sharding {
                offload,
                reshard_after_forward: actor.fsdp_config.reshard_after_forward,
                reduce: actor
                    .fsdp_config
                    .reduce_dtype("actor_rollout_ref.actor.fsdp_config")?,
            },
        )?;
        Ok(FsdpActor {
            weights: Weights::Train(Box::new(train)),
            dp,
            device,
            padding,
            head_chunk,
            engine,
            host_params: None,
            rollout_tp,
            rollout_group: None,
            settings: ActorSettings::resolve(
                cfg,
                Some(plan),
                dirs,
                &trainer,
                dp_size,
                actor.fsdp_config.seed,
            )?,
        })
    }

    fn model(&self) -> &Transformer {
        match &self.weights {
            Weights::Train(t) => &t.model,
            Weights::Frozen(m) => m,
        }
    }

    /// Runs `f` on the whole model; a sharded model is gathered once for the call and freed
    /// after it (see [`TrainableModel::with_full`]).
    fn run_model<T>(&mut self, f: impl FnOnce(&Transformer) -> Result<T>) -> Result<T> {
        match &mut self.weights {
            Weights::Train(t) => t.with_full(&self.dp, f),
            Weights::Frozen(m) => f(m),
        }
    }

    /// Bytes this rank holds in parameters, gradients and optimizer state (the frozen reference:
    /// its parameters only).
    pub fn memory(&self) -> MemoryStats {
        match &self.weights {
            Weights::Train(t) => t.memory(),
            Weights::Frozen(m) => {
                let params = crate::shard::sum_bytes(m.named_parameters().iter().map(|(_, p)| p));
                MemoryStats {
                    params,
                    peak_gathered: params,
                    ..MemoryStats::default()
                }
            }
        }
    }

    /// On several ranks an error ends the group: the others' collectives fail naming this rank.
    fn spmd<T>(&self, r: Result<T>) -> Result<T> {
        r.map_err(|e| self.dp.fail(e))
    }

    /// A generate call; with a `driver`, multi-turn (`Actor.generate_turns`).
    fn do_generate(
        &mut self,
        prompts: &Batch,
        o: &GenerateOptions,
        driver: Option<&mut dyn verl_plugin_api::turns::TurnDriver>,
    ) -> Result<Batch> {
        let seed = derive_seed(self.settings.seed, self.settings.generate_calls);
        let eos = self.model().config().eos_token_ids.clone();
        let call = GenerateCall::new(prompts, o, self.device, &eos, seed)?;
        self.settings.generate_calls += 1;
        let (engine_keys, device) = (self.engine.clone(), self.device);
        if self.rollout_tp > 1 && driver.is_none() {
            return self.generate_tensor_parallel(call);
        }
        // Hybrid engine: the engine reads the live training weights; its KV cache lives only for
        // this call and is dropped before returning. The KV budget is taken once the weights are
        // resident (gathered, on several ranks), so they count as memory in use.
        let (gen, mut meta) = self.run_model(|model| {
            let budget = kv_budget(model, device, &engine_keys, &call.mask, &call.params)?;
            let (gen, stats) = call.run(model, &budget.config, driver)?;
            Ok((gen, budget.metrics(&stats)))
        })?;
        meta.insert("rollout/tp".into(), 1.into());
        call.into_batch(&gen, &meta)
    }

    /// Generation at rollout TP > 1: the rollout group's members' prompts generated together,
    /// each rank on its shard of the weights, resharded unit by unit from the FSDP shards for
    /// this call and dropped after it.
    fn generate_tensor_parallel(&mut self, call: GenerateCall) -> Result<Batch> {
        use verl_backend_kit::hybrid::{self, DpTpComm};
        let (world, tp, rank) = (self.dp.size, self.rollout_tp, self.dp.rank);
        if self.rollout_group.is_none() {
            let g = self.dp.subgroup(&hybrid::data_parallel_groups(world, tp))?;
            self.rollout_group = Some(std::sync::Arc::new(g));
        }
        let group = self.rollout_group.clone().expect("made above");
        let start = std::time::Instant::now();
        let comm: std::sync::Arc<dyn verl_nn::TpComm> =
            std::sync::Arc::new(DpTpComm(group.clone()));
        let (model, moved) = match &mut self.weights {
            Weights::Train(t) => t.rollout_shard(&self.dp, comm)?,
            Weights::Frozen(_) => {
                return Err(BackendError::Api(ApiError::failed(
                    "the reference role does not generate",
                )))
            }
        };
        let reshard_s = start.elapsed().as_secs_f64();
        let shared = hybrid::share(
            &call,
            &self.dp,
            hybrid::data_parallel_placement(rank, world, tp),
        )?;
        let mut budget = kv_budget(
            &model,
            self.device,
            &self.engine,
            &shared.call.mask,
            &shared.call.params,
        )?;
        // The group runs the engine in lock-step: one pool size for all (the smallest).
        let mut tokens = [-(budget
            .config
            .kv_cache_tokens
            .unwrap_or(budget.all_sequences_tokens) as f64)];
        group.all_reduce_max(&mut tokens)?;
        budget.config.kv_cache_tokens = Some((-tokens[0]) as usize);
        let (gen, stats) = shared.run(|c| c.run(&model, &budget.config, None))?;
        drop(model);
        let gen = shared.gather_back(&gen, &self.dp)?;
        let mut meta = budget.metrics(&stats);
        meta.insert("rollout/tp".into(), tp.into());
        meta.insert("rollout/group_prompts".into(), shared.prompts().into());
        meta.insert("rollout/reshard_mb".into(), (moved / 1e6).into());
        meta.insert("rollout/reshard_s".into(), reshard_s.into());
        call.into_batch(&gen, &meta)
    }

    /// Generation's tensor-parallel size (`actor_rollout_ref.rollout.tensor_model_parallel_size`
    /// as resolved for this job).
    pub fn rollout_tp(&self) -> usize {
        self.rollout_tp
    }

    fn do_log_prob(&mut self, batch: &Batch, o: &LogProbOptions) -> Result<Batch> {
        if !o.base_model {
            return self.with_params_on_device(|s| s.log_prob_on_device(batch, o));
        }
        // The base model's log-probs (a LoRA job's reference policy): the adapters off for the
        // call, on again afterwards whatever happened.
        if self.model().lora_config().is_none() {
            return Err(BackendError::Api(ApiError::failed(
                "compute_log_prob with base_model=true asks for the base model of a LoRA actor, \
                 and this actor has no adapters (actor_rollout_ref.model.lora_rank=0)",
            )));
        }
        self.model().set_adapters_enabled(false);
        let r = self.log_prob_on_device(batch, o);
        self.model().set_adapters_enabled(true);
        r
    }

    /// Runs `f` with an offloaded reference's parameters on the device (see [`HostParams`]);
    /// they go back to host memory afterwards, also when `f` failed (its error wins).
    fn with_params_on_device<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        let (Some(hp), Weights::Frozen(model)) = (self.host_params.as_mut(), &self.weights) else {
            return f(self);
        };
        hp.load(model)?;
        let r = f(self);
        let back = match (self.host_params.as_mut(), &self.weights) {
            (Some(hp), Weights::Frozen(model)) => hp.unload(model),
            _ => Ok(()),
        };
        let out = r?;
        back?;
        Ok(out)
    }

    fn log_prob_on_device(&mut self, batch: &Batch, o: &LogProbOptions) -> Result<Batch> {
        let seqs = Sequences::from_batch(batch, "Actor.compute_log_prob", self.device)?;
        let outputs = if o.with_entropy { 2 } else { 1 };
        let (micro, key) = (self.settings.log_prob_micro, self.settings.log_prob_key);
        let (padding, chunk) = (self.padding, self.head_chunk);
        let res = self.run_model(|model| {
            per_micro_batch_layout(&seqs, micro, padding, key, outputs, |layout| {
                let (lp, ent) =
                    layout_token_stats(model, layout, o.temperature, o.with_entropy, chunk)?;
                Ok(std::iter::once(lp).chain(ent).collect())
            })
        })?;
        log_prob_batch(
            seqs.rows(),
            seqs.response_len as usize,
            &res[0],
            res.get(1).filter(|_| o.with_entropy),
        )
    }

    fn do_update(&mut self, batch: &Batch, o: &UpdateOptions) -> Result<Metrics> {
        const CALL: &str = "Actor.update";
        let device = self.device;
        let (plan, train, inputs) =
            self.settings
                .begin_update(&mut self.weights, batch, device, o)?;
        let lr = train.lr(total_training_steps(o, self.settings.trainer_total_steps))?;
        same_rows_on_every_rank(&self.dp, inputs.seqs.rows(), CALL)?;
        // Shared prompts: micro-batches keep a prompt's rows together.
        let groups = match self.padding {
            Padding::SharedPrompt => Some(PromptGroups::of(&inputs.seqs)?),
            Padding::Keep | Padding::Remove => None,
        };
        let mut engine = ActorEngine {
            train,
            dp: &self.dp,
            plan,
            lengths: inputs.seqs.row_lengths()?,
            inputs: &inputs,
            groups: groups.as_ref(),
            padding: self.padding,
            head_chunk: self.head_chunk,
            temperature: o.temperature.unwrap_or(self.settings.default_temperature),
            kept_logits_bytes: kept_logits_budget(device),
            device,
        };
        let mut acc = run_update(&mut engine, &plan.spec(o, &inputs, lr))?;
        train.updates += 1;
        verl_backend_kit::metrics::push_gpu_memory(&mut acc, &self.dp, device)?;
        acc.reduce(&self.dp)?;
        if let Some(r) = verl_nn::profile::take_report() {
            tracing::info!("actor update phases (VERL_PROFILE):\n{r}");
        }
        Ok(acc.into_metrics())
    }

    fn rng_state(&self) -> serde_json::Value {
        self.settings.rng_state()
    }

    fn do_save(&mut self, dir: &Path) -> Result<()> {
        let state = self.rng_state();
        match &mut self.weights {
            Weights::Train(t) => t.save_on(&self.dp, dir, self.settings.role, state),
            Weights::Frozen(_) => Err(BackendError::Api(ApiError::not_implemented(
                "the reference policy is frozen: it is rebuilt from the model path, not checkpointed",
            ))),
        }
    }

    fn do_load(&mut self, dir: &Path) -> Result<()> {
        let role = self.settings.role;
        let extra = match &mut self.weights {
            Weights::Train(t) => t.load(dir, role)?,
            Weights::Frozen(_) => {
                return Err(BackendError::Api(ApiError::not_implemented(
                    "the reference policy is frozen: it is rebuilt from the model path, not checkpointed",
                )))
            }
        };
        self.settings.restore_rng_state(&extra);
        Ok(())
    }

    /// Every rank takes part (the parameters are gathered); rank 0 writes.
    fn do_export(&mut self, dir: &Path) -> Result<()> {
        let rank0 = self.dp.rank == 0;
        let base = self.settings.model_dir.display().to_string();
        self.run_model(|model| {
            if rank0 {
                // With LoRA: the merged weights (a plain HF model), and the adapters apart in
                // PEFT's format under lora_adapter/.
                let opts = SaveOptions {
                    merge_lora: true,
                    ..SaveOptions::default()
                };
                model.save_pretrained(dir, &opts)?;
                if model.lora_config().is_some() {
                    model.save_adapter(&dir.join(crate::ckpt_files::LORA_DIR), &base)?;
                }
            }
            Ok(())
        })?;
        if rank0 {
            copy_tokenizer_files(&self.settings.tokenizer_dir, dir)?;
            if self.settings.tokenizer_dir != self.settings.model_dir {
                copy_tokenizer_files(&self.settings.model_dir, dir)?;
            }
        }
        self.dp.barrier("export barrier")
    }
}

/// The FSDP actor in the shared update loop: each micro-batch's forward and backward through the
/// sharded model (shared prompts laid out once), its loss through the chunked LM head; losses and
/// metrics are fetched once per mini-batch, so the host never waits for the device in between.
struct ActorEngine<'a> {
    train: &'a mut TrainableModel,
    dp: &'a Dp,
    plan: &'a ActorUpdatePlan,
    inputs: &'a ActorUpdateInputs,
    lengths: Vec<i64>,
    groups: Option<&'a PromptGroups>,
    padding: Padding,
    head_chunk: i64,
    temperature: f64,
    kept_logits_bytes: u64,
    device: Device,
}

impl UpdateEngine for ActorEngine<'_> {
    type Error = BackendError;

    fn dp(&self) -> &Dp {
        self.dp
    }

    fn zero_grad(&mut self) -> Result<()> {
        self.train.zero_grad()
    }

    fn forward_backward(&mut self, mini: &UpdateMiniBatch<'_>) -> Result<Vec<MicroOutcome>> {
        const BUDGET_KEY: &str = "actor_rollout_ref.actor.ppo_max_token_len_per_gpu";
        let (device, seqs, padding) = (self.device, &self.inputs.seqs, self.padding);
        let parts = match self.groups {
            Some(g) => prompt_group_micro_batches(
                mini.rows,
                g,
                &self.lengths,
                self.plan.micro,
                BUDGET_KEY,
            )?,
            None => micro_batches(mini.rows, &self.lengths, self.plan.micro, BUDGET_KEY)?,
        };
        let parts = same_micro_batch_count(self.dp, parts)?;
        let prepare = |part: &[usize]| -> Result<(Tensor, RowLayout)> {
            Ok((
                index_tensor(part, device)?,
                RowLayout::new(seqs, part, padding)?,
            ))
        };
        let mut next = parts.first().map(|mb| prepare(&mb.rows)).transpose()?;
        let on_policy = self.inputs.anchor.on_policy;
        // Each micro-batch's loss and metrics, fetched together after the last one is queued.
        let mut pending: Vec<(usize, Tensor, DeferredMetrics)> = Vec::new();
        for (ui, MicroBatch { rows: part, dummy }) in parts.iter().enumerate() {
            let mut timer = verl_nn::profile::start(device);
            let dummy = *dummy;
            let (idx, layout) = match next.take() {
                Some(v) => v,
                None => prepare(part)?,
            };
            let micro = self.inputs.micro(&idx)?;
            let terms = micro.terms();
            // Taken before the call: on several ranks the head unit holds its full values while
            // the loss runs.
            let weight = lm_head(&self.train.model)?;
            verl_nn::profile::lap(&mut timer, "train/micro_prep");
            let (loss, m) = self.train.forward_backward_layout_with(
                self.dp,
                &layout,
                "actor loss",
                |hidden| {
                    actor_micro_batch_loss(
                        &layout,
                        hidden,
                        &weight,
                        &MicroBatchLoss {
                            loss: &self.plan.loss,
                            norm: mini.norm,
                            old: terms.old,
                            advantages: terms.advantages,
                            ref_log_prob: terms.ref_log_prob,
                            rollout_is_weights: terms.rollout_is_weights,
                            on_policy,
                            dummy,
                            need_entropy: self.inputs.need_entropy,
                            temperature: self.temperature,
                            chunk_tokens: self.head_chunk,
                            kept_logits_bytes: self.kept_logits_bytes,
                        },
                    )
                },
            )?;
            // The next micro-batch is laid out on the host while the device still runs this
            // one's backward.
            next = parts.get(ui + 1).map(|mb| prepare(&mb.rows)).transpose()?;
            let mut timer = verl_nn::profile::start(device);
            if dummy {
                continue;
            }
            self.train.after_backward()?;
            verl_nn::profile::lap(&mut timer, "train/after_backward");
            pending.push((ui, loss.f_detach().ctx("loss value")?, m));
        }
        let values = fetch_scalars(
            &pending
                .iter()
                .flat_map(|(_, l, m)| std::iter::once(l).chain(m.device_values()))
                .collect::<Vec<_>>(),
        )?;
        let mut at = 0;
        let mut out = Vec::with_capacity(pending.len());
        for (ui, _, m) in pending {
            let n = 1 + m.device_len();
            out.push(MicroOutcome {
                micro: ui,
                loss: Some(values[at]),
                metrics: m.with_values(&values[at + 1..at + n]).into_iter().collect(),
            });
            at += n;
        }
        Ok(out)
    }

    fn optimizer_step(&mut self, lr: f64, step: u64, mini: &UpdateMiniBatch<'_>) -> Result<f64> {
        let mut timer = verl_nn::profile::start(self.device);
        let grad_norm =
            self.train
                .finish_mini_batch(self.dp, lr, mini.step_at(UpdateRole::Actor, step))?;
        verl_nn::profile::lap(&mut timer, "train/optimizer_step");
        Ok(grad_norm)
    }
}

impl Actor for FsdpActor {
    fn generate(&mut self, prompts: &Batch, options: &GenerateOptions) -> ApiResult<Batch> {
        let _trace = verl_nn::profile::trace("generate", self.device);
        let r = self.with_params_on_device(|s| s.do_generate(prompts, options, None));
        Ok(self.spmd(r)?)
    }
    fn generate_turns(
        &mut self,
        prompts: &Batch,
        options: &GenerateOptions,
        driver: &mut dyn verl_plugin_api::turns::TurnDriver,
    ) -> ApiResult<Batch> {
        let _trace = verl_nn::profile::trace("generate", self.device);
        let r = self.with_params_on_device(|s| s.do_generate(prompts, options, Some(driver)));
        Ok(self.spmd(r)?)
    }
    fn compute_log_prob(&mut self, batch: &Batch, options: &LogProbOptions) -> ApiResult<Batch> {
        let _trace = verl_nn::profile::trace("log_prob", self.device);
        let r = self.do_log_prob(batch, options);
        Ok(self.spmd(r)?)
    }
    fn update(&mut self, batch: &Batch, options: &UpdateOptions) -> ApiResult<Metrics> {
        let _trace = verl_nn::profile::trace("update", self.device);
        let r = self.do_update(batch, options);
        Ok(self.spmd(r)?)
    }
    fn save(&mut self, dir: &Path) -> ApiResult<()> {
        let r = self.do_save(dir);
        Ok(self.spmd(r)?)
    }
    fn load(&mut self, dir: &Path) -> ApiResult<()> {
        let r = self.do_load(dir);
        Ok(self.spmd(r)?)
    }
    fn export_hf(&mut self, dir: &Path) -> ApiResult<()> {
        let r = self.do_export(dir);
        Ok(self.spmd(r)?)
    }
    fn data_parallel(&self) -> DataParallel {
        DataParallel {
            rank: self.dp.rank as u32,
            size: self.dp.size as u32,
        }
    }
    fn call(
        &mut self,
        method: &str,
        batch: &Batch,
        options: &serde_json::Value,
    ) -> ApiResult<Batch> {
        let r = match (method, &mut self.weights) {
            (crate::sft::SFT_UPDATE, Weights::Train(t)) => {
                crate::sft::update(t, &self.dp, self.device, batch, options)
            }
            (crate::sft::SFT_EVAL, Weights::Train(t)) => {
                crate::sft::eval(t, &self.dp, self.device, batch, options)
            }
            (verl_backend_kit::bench::CALIBRATE, _) => verl_backend_kit::bench::calibrate(self.device, options),
            (verl_backend_kit::bench::MEMORY, _) => verl_backend_kit::bench::memory(self.device, self.memory().total()),
            _ => {
                return Err(ApiError::not_implemented(format!(
                    "{} call `{method}` (the actor role answers `sft_update`, `sft_eval`, `calibrate` and `memory`; the reference `calibrate` and `memory`)",
                    self.settings.role
                )))
            }
        };
        Ok(self.spmd(r)?)
    }
}

#[cfg(test)]
mod tests;
