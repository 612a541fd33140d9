//! The Actor role (policy: generate, log-probs, PPO update, checkpoints, HF export) and the Reference
//! role (the same model class, frozen: log-probs only).

use std::path::Path;

use tch::{Device, Kind, Tensor};
use verl_losses::{fetch_scalars, ActorLoss, ChunkedLmHead, DeferredMetrics, Normaliser};
use verl_nn::{HeadKind, ModelOptions, SaveOptions, Transformer};
use verl_plugin_api::{
    col, Actor, Batch, DataParallel, Error as ApiError, GenerateOptions, InitArgs, LogProbOptions,
    Metrics, Result as ApiResult, UpdateOptions,
};

use crate::config::{
    self, section, ActorSection, ActorSettings, ActorUpdatePlan, LogProbSection, ModelSection,
    RolloutEngineSection, TrainerSection,
};
use crate::data::{
    column, equalize_micro_batches, index_tensor, micro_batches, MicroBatch, Sequences,
};
use crate::dp::Dp;
use crate::error::{FsdpError, Result, TorchContext};
use crate::forward::{head_chunk_tokens, layout_token_stats, lm_head, per_micro_batch_layout};
use crate::generation::{derive_seed, GenerateCall};
use crate::host_params::HostParams;
use crate::packing::{prompt_group_micro_batches, Padding, PromptGroups, RowLayout};
use crate::shard::{MemoryStats, Offload};
use crate::train::{Sharding, TrainableModel};
use crate::update::{
    log_prob_batch, run_update, total_training_steps, ActorUpdateInputs, MicroOutcome,
    MiniBatch as UpdateMiniBatch, UpdateEngine,
};

mod budget;
pub use budget::{kv_budget, same_micro_batch_count, same_rows_on_every_rank, KvBudget};

mod loss;
use loss::unheld_device_memory;
pub use loss::{
    actor_micro_batch_loss, entropy_metric_requested, kept_logits_budget, policy_anchor,
    MicroBatchLoss, PolicyAnchor,
};

enum Weights {
    Train(Box<TrainableModel>),
    Frozen(Box<Transformer>),
}

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

/// `InitArgs.extra.random_init.seed` (`verl bench`): build the model from the folder's config.json
/// with fresh weights instead of loading safetensors.
fn random_init_seed(init: &InitArgs) -> Result<Option<u64>> {
    let Some(r) = init.extra.get("random_init") else {
        return Ok(None);
    };
    match r.get("seed") {
        None => Ok(Some(0)),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            FsdpError::config("InitArgs.extra.random_init.seed", "an unsigned integer", v)
        }),
    }
}

/// The GEMM settings under which a GEMM sums each output in the same order whatever its number
/// of rows, for `rollout.consistent_attention`. cuBLAS chooses split-K kernels (which reduce over
/// K in pieces, a different order) only when it has a workspace, and it chooses them for the few
/// rows of a decode step, not for the thousands of a training forward: measured on an H200
/// (`verl bench grpo`, Qwen2.5-0.5B shapes), 64 decoding sequences gave rollout-vs-training
/// log-probs 8.2e-3 apart with the default workspace and 7.0e-8 without.
///
/// Taking cuBLAS's workspace away costs host time, though: every GEMM then took 76–86 µs to launch
/// (172–198 µs with a bias) against 19–29 µs, which left the GPU waiting for the host in training
/// passes (H100, libtorch 2.11). So libtorch's GEMMs go through cuBLASLt instead, with a 1 KiB
/// workspace of their own (no split-K fits in it; cuBLAS keeps its workspace): rows of
/// 1–512-row GEMMs equal the 4096-row GEMM's bit for bit on every Qwen2.5 projection shape, at
/// the default launch cost. Where cuBLASLt cannot be selected, or the user set cuBLAS's workspace
/// to zero (with which libtorch's cuBLASLt path fails), every workspace is zero instead, as
/// before. Set before the process's first GEMM (libtorch reads the sizes once); a value the user
/// set is kept, with a warning.
pub fn batch_invariant_gemms() {
    let get = |k: &str| std::env::var(k).ok();
    let mut plan = gemm_env_plan(get, true);
    if plan.prefer_lt {
        if let Err(e) = verl_torch_ext::prefer_cublaslt() {
            tracing::warn!(
                "consistent_attention: GEMMs stay on cuBLAS, without a workspace (slower to \
                 launch): {e}"
            );
            plan = gemm_env_plan(get, false);
        }
    }
    for (key, value, kept) in plan.env {
        match kept {
            None => std::env::set_var(key, value),
            Some(v) => tracing::warn!(
                "{key}={v} is kept; actor_rollout_ref.rollout.consistent_attention wants {value} \
                 (no split-K GEMMs): with room for split-K, rollout log-probs of small decode \
                 batches can differ from the training forward's by ~1e-2"
            ),
        }
    }
}

/// Turns on the CUDA caching allocator's expandable segments for a one-process job unless the
/// user configured the allocator (`PYTORCH_CUDA_ALLOC_CONF` / `PYTORCH_ALLOC_CONF`). Each
/// generate call sizes its KV cache from the device memory tensors do not hold, counting the
/// allocator's wholly free segments as free; after an update, the segments its activations and
/// the previous call's KV pool left behind are partly in use, and none of that counts. Measured
/// on one H200 (`verl bench grpo --arch llama3-8b --prompts 32 ... --micro-batch 8
/// --logprob-micro-batch 8 --set actor_rollout_ref.rollout.gpu_memory_utilization=0.9`): after the
/// first update 17.3 GiB sat in partly used segments and the second call's KV budget fell from
/// 56.4 to 39.3 GiB; with 64 prompts it fell to 22.2 GiB, too little for every sequence at once
/// (178 preemptions, generation 17.3 s against 15.6 s for the first, tuning included). With
/// `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` nothing was stranded (0.0 GiB; budget 56.8
/// and 56.6 GiB) at the same speed. Set through libtorch's run-time allocator settings
/// (`torch.cuda.memory._set_allocator_settings`), which apply to the segments created later, so
/// it belongs before the role's first CUDA tensor. Several ranks keep libtorch's default (not
/// measured with NCCL here).
pub fn expandable_segments(world: usize) {
    // Once per process (every role of a one-process job calls this).
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| apply_allocator_settings(world));
}

fn apply_allocator_settings(world: usize) {
    let get = |k: &str| std::env::var(k).ok();
    let Some(settings) = allocator_settings_plan(get, world) else {
        return;
    };
    match verl_torch_ext::set_cuda_allocator_settings(settings) {
        Ok(()) => tracing::info!(
            "CUDA caching allocator: {settings} (set by the backend for a one-process job: each \
             generate call sizes its KV cache from memory no tensor holds, which partly used \
             segments would otherwise keep; PYTORCH_CUDA_ALLOC_CONF chooses otherwise)"
        ),
        Err(e) => tracing::warn!("CUDA caching allocator: {settings} not applied: {e}"),
    }
}

/// The allocator settings [`expandable_segments`] applies, if any.
fn allocator_settings_plan(
    get: impl Fn(&str) -> Option<String>,
    world: usize,
) -> Option<&'static str> {
    let configured = ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"]
        .iter()
        .any(|k| get(k).is_some());
    (world == 1 && !configured).then_some("expandable_segments:True")
}

/// What [`batch_invariant_gemms`] does.
#[derive(Debug, PartialEq)]
struct GemmEnvPlan {
    /// Route libtorch's GEMMs through cuBLASLt.
    prefer_lt: bool,
    /// `(key, wanted, None)` to set, `(key, wanted, Some(user's value))` to keep with a warning;
    /// keys already as wanted are left out.
    env: Vec<(&'static str, &'static str, Option<String>)>,
}

/// [`GemmEnvPlan`] given the environment and whether cuBLASLt can be selected.
fn gemm_env_plan(get: impl Fn(&str) -> Option<String>, lt_available: bool) -> GemmEnvPlan {
    const LT: [(&str, &str); 2] = [
        ("TORCH_CUBLASLT_WORKSPACE_SIZE", "1"),
        ("CUBLASLT_WORKSPACE_SIZE", "1"),
    ];
    const NONE: [(&str, &str); 3] = [
        ("CUBLAS_WORKSPACE_CONFIG", ":0:0"),
        ("CUBLASLT_WORKSPACE_SIZE", "0"),
        ("TORCH_CUBLASLT_WORKSPACE_SIZE", "0"),
    ];
    let zero_cublas =
        get("CUBLAS_WORKSPACE_CONFIG").is_some_and(|v| cublas_workspace_kib(&v) == Some(0));
    let prefer_lt = lt_available && !zero_cublas;
    let vars: &[(&'static str, &'static str)] = if prefer_lt { &LT } else { &NONE };
    let env = vars
        .iter()
        .filter_map(|&(key, value)| match get(key) {
            Some(v) if v == value => None,
            other => Some((key, value, other)),
        })
        .collect();
    GemmEnvPlan { prefer_lt, env }
}

/// Total KiB of a `CUBLAS_WORKSPACE_CONFIG` value (`:SIZE:COUNT` pairs, SIZE in KiB); `None` when
/// it does not parse.
fn cublas_workspace_kib(value: &str) -> Option<u64> {
    let parts: Vec<&str> = value.strip_prefix(':')?.split(':').collect();
    if !parts.len().is_multiple_of(2) {
        return None;
    }
    parts.chunks(2).try_fold(0u64, |acc, pair| {
        let size: u64 = pair[0].trim().parse().ok()?;
        let count: u64 = pair[1].trim().parse().ok()?;
        Some(acc + size * count)
    })
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
        let trainer: TrainerSection = section(cfg, "trainer")?;
        let device = config::device(&trainer, init.local_rank)?;
        let dp = Dp::join(init, if reference { "reference" } else { "actor" }, device)?;
        let dp_size = dp.size;
        let model_cfg: ModelSection = section(cfg, "actor_rollout_ref.model")?;
        let model_dir = config::model_dir("actor_rollout_ref.model.path", &model_cfg.path)?;
        let tokenizer_dir = model_cfg
            .tokenizer_path
            .as_deref()
            .map(config::expand_home)
            .unwrap_or_else(|| model_dir.clone());
        let actor: ActorSection = section(cfg, "actor_rollout_ref.actor")?;
        let rollout: LogProbSection = section(cfg, "actor_rollout_ref.rollout")?;
        let engine: RolloutEngineSection = section(cfg, "actor_rollout_ref.rollout")?;
        if device.is_cuda() {
            expandable_segments(dp_size);
        }
        if engine.consistent_attention && device.is_cuda() {
            batch_invariant_gemms();
        }
        let default_temperature = rollout.temperature.unwrap_or(1.0);
        let padding = Padding::from_flags(
            model_cfg.use_remove_padding.unwrap_or(true),
            actor.use_prefix_grouper,
        );
        if reference {
            let reference: LogProbSection = section(cfg, "actor_rollout_ref.ref")?;
            let fsdp = reference
                .fsdp_config
                .clone()
                .unwrap_or_else(|| actor.fsdp_config.clone());
            let precision = fsdp.precision("actor_rollout_ref.ref.fsdp_config")?;
            let mut model = role_model(
                &model_dir,
                device,
                precision.compute,
                fsdp.seed,
                random_init,
            )?;
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
                settings: ActorSettings {
                    role: "reference",
                    model_dir,
                    tokenizer_dir,
                    log_prob_micro: reference.micro_batching(dp_size),
                    log_prob_key: "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
                    default_temperature,
                    update: None,
                    trainer_total_steps: trainer.total_training_steps,
                    seed: fsdp.seed,
                    generate_calls: 0,
                },
            });
        }
        let precision = actor
            .fsdp_config
            .precision("actor_rollout_ref.actor.fsdp_config")?;
        let mut model = role_model(
            &model_dir,
            device,
            precision.compute,
            actor.fsdp_config.seed,
            random_init,
        )?;
        model.set_activation_checkpointing(model_cfg.enable_gradient_checkpointing);
        model.set_consistent_attention(engine.consistent_attention);
        if engine.consistent_attention && !verl_torch_ext::paged_attention_available(device) {
            tracing::warn!(
                "actor_rollout_ref.rollout.consistent_attention has no effect on {device:?}: it \
                 needs the CUDA paged-attention kernel; attention runs as usual"
            );
        }
        let plan = ActorUpdatePlan::resolve(cfg, &actor, &rollout, dp.size)?;
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
            settings: ActorSettings {
                role: "actor",
                model_dir,
                tokenizer_dir,
                log_prob_micro: rollout.micro_batching(dp_size),
                log_prob_key: "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
                default_temperature,
                update: Some(plan),
                trainer_total_steps: trainer.total_training_steps,
                seed: actor.fsdp_config.seed,
                generate_calls: 0,
            },
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

    fn do_generate(&mut self, prompts: &Batch, o: &GenerateOptions) -> Result<Batch> {
        let seed = derive_seed(self.settings.seed, self.settings.generate_calls);
        let eos = self.model().config().eos_token_ids.clone();
        let call = GenerateCall::new(prompts, o, self.device, &eos, seed)?;
        self.settings.generate_calls += 1;
        // Hybrid engine: the engine reads the live training weights; its KV cache lives only for
        // this call and is dropped before returning. The KV budget is taken once the weights are
        // resident (gathered, on several ranks), so they count as memory in use.
        let (engine_keys, device) = (self.engine.clone(), self.device);
        let (gen, meta) = self.run_model(|model| {
            let budget = kv_budget(model, device, &engine_keys, &call.mask, &call.params)?;
            let (gen, stats) = tch::no_grad(|| {
                verl_rollout::generate_with_config(
                    model,
                    &call.ids,
                    &call.mask,
                    &call.params,
                    None,
                    &budget.config,
                )
            })
            .map_err(|e| FsdpError::Api(ApiError::failed(format!("generation: {e}"))))?;
            Ok((gen, budget.metrics(&stats)))
        })?;
        call.into_batch(&gen, &meta)
    }

    fn do_log_prob(&mut self, batch: &Batch, o: &LogProbOptions) -> Result<Batch> {
        self.with_params_on_device(|s| s.log_prob_on_device(batch, o))
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
        let plan = self.settings.trainable()?;
        let Weights::Train(train) = &mut self.weights else {
            unreachable!("a role with an update plan is trainable")
        };
        let device = self.device;
        let inputs = plan.inputs(batch, device, o)?;
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
        crate::metrics::push_gpu_memory(&mut acc, &self.dp, device)?;
        acc.reduce(&self.dp)?;
        if let Some(r) = verl_nn::profile::take_report() {
            tracing::info!("actor update phases (VERL_PROFILE):\n{r}");
        }
        Ok(acc.into_metrics())
    }

    fn rng_state(&self) -> serde_json::Value {
        serde_json::json!({"seed": self.settings.seed, "generate_calls": self.settings.generate_calls})
    }

    fn do_save(&mut self, dir: &Path) -> Result<()> {
        let state = self.rng_state();
        match &mut self.weights {
            Weights::Train(t) => t.save_on(&self.dp, dir, self.settings.role, state),
            Weights::Frozen(_) => Err(FsdpError::Api(ApiError::not_implemented(
                "the reference policy is frozen: it is rebuilt from the model path, not checkpointed",
            ))),
        }
    }

    fn do_load(&mut self, dir: &Path) -> Result<()> {
        let role = self.settings.role;
        let extra = match &mut self.weights {
            Weights::Train(t) => t.load(dir, role)?,
            Weights::Frozen(_) => {
                return Err(FsdpError::Api(ApiError::not_implemented(
                    "the reference policy is frozen: it is rebuilt from the model path, not checkpointed",
                )))
            }
        };
        if let Some(calls) = extra.get("generate_calls").and_then(|v| v.as_u64()) {
            self.settings.generate_calls = calls;
        }
        if let Some(seed) = extra.get("seed").and_then(|v| v.as_u64()) {
            self.settings.seed = seed;
        }
        Ok(())
    }

    /// Every rank takes part (the parameters are gathered); rank 0 writes.
    fn do_export(&mut self, dir: &Path) -> Result<()> {
        let rank0 = self.dp.rank == 0;
        self.run_model(|model| {
            if rank0 {
                model.save_pretrained(dir, &SaveOptions::default())?;
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

/// Files HF tokenizers and generation read next to the weights.
fn is_tokenizer_file(name: &str) -> bool {
    name.starts_with("tokenizer")
        || name.starts_with("vocab.")
        || name.starts_with("chat_template")
        || name.ends_with(".tiktoken")
        || matches!(
            name,
            "merges.txt"
                | "special_tokens_map.json"
                | "added_tokens.json"
                | "generation_config.json"
        )
}

/// Copies the tokenizer and generation files of `from` that `to` lacks (an HF folder is loadable
/// on its own).
pub fn copy_tokenizer_files(from: &Path, to: &Path) -> Result<()> {
    let entries = std::fs::read_dir(from).map_err(|source| FsdpError::Io {
        path: from.to_path_buf(),
        source,
    })?;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        if entry.path().is_file() && is_tokenizer_file(&name) && !to.join(&name).exists() {
            std::fs::copy(entry.path(), to.join(&name)).map_err(|source| FsdpError::Io {
                path: entry.path(),
                source,
            })?;
        }
    }
    Ok(())
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
    type Error = FsdpError;

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
        let grad_norm = self
            .train
            .finish_mini_batch(self.dp, lr, "actor", step, mini.epoch, mini.index)?;
        verl_nn::profile::lap(&mut timer, "train/optimizer_step");
        Ok(grad_norm)
    }
}

impl Actor for FsdpActor {
    fn generate(&mut self, prompts: &Batch, options: &GenerateOptions) -> ApiResult<Batch> {
        let _trace = verl_nn::profile::trace("generate", self.device);
        let r = self.with_params_on_device(|s| s.do_generate(prompts, options));
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
            (crate::bench::CALIBRATE, _) => crate::bench::calibrate(self.device, options),
            (crate::bench::MEMORY, _) => crate::bench::memory(self.device, self.memory().total()),
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
