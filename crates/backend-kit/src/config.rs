//! The slices of verl's resolved config this backend reads, under verl's key names and with verl's
//! defaults. Each section is deserialized on its own and leniently (unknown keys are ignored), so the
//! plugin keeps working when the host's schema grows; a key of the wrong type is an error naming it.

use std::path::PathBuf;

use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;
use tch::{Device, Kind};

use crate::error::{BackendError, Result};

/// Reads the section at `path` (dot-separated) of the whole config; absent or null means defaults.
pub fn section<T: DeserializeOwned + Default>(root: &Value, path: &str) -> Result<T> {
    let mut v = root;
    for key in path.split('.') {
        match v.get(key) {
            Some(next) => v = next,
            None => return Ok(T::default()),
        }
    }
    if v.is_null() {
        return Ok(T::default());
    }
    serde_json::from_value(v.clone()).map_err(|e| {
        BackendError::config(
            path,
            format!("a `{path}` section verl accepts"),
            format!("{e}"),
        )
    })
}

/// `*.fsdp_config`: parameter (master) dtype, compute dtype, init seed.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct FsdpSection {
    /// The dtype the parameters (and the optimizer's master copy) are held in.
    pub model_dtype: String,
    /// verl's engine-style compute dtype; used when `mixed_precision.param_dtype` is not set.
    pub dtype: Option<String>,
    /// verl's legacy FSDP mixed-precision block: `param_dtype` is the compute dtype.
    pub mixed_precision: Option<Value>,
    pub seed: u64,
    /// Keep the fp32 master shards on the CPU between optimizer steps (multi-rank).
    pub param_offload: bool,
    /// Keep the AdamW state shards on the CPU between optimizer steps (multi-rank).
    pub optimizer_offload: bool,
    /// Free a unit's gathered parameters right after its forward (`true`, ZeRO-3) or keep them
    /// until its backward (one gather fewer per unit, more memory).
    pub reshard_after_forward: bool,
}

impl Default for FsdpSection {
    fn default() -> Self {
        FsdpSection {
            model_dtype: "fp32".into(),
            dtype: None,
            mixed_precision: None,
            seed: 42,
            param_offload: false,
            optimizer_offload: false,
            reshard_after_forward: true,
        }
    }
}

/// How parameters are stored and how forward/backward compute.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Precision {
    /// Master weights and optimizer state.
    pub master: Kind,
    /// Forward / backward / generation.
    pub compute: Kind,
}

impl FsdpSection {
    /// `prefix` is the section's key path, for error messages.
    pub fn precision(&self, prefix: &str) -> Result<Precision> {
        let master = parse_dtype(&format!("{prefix}.model_dtype"), &self.model_dtype)?;
        let from_mp = self
            .mixed_precision
            .as_ref()
            .and_then(|m| m.get("param_dtype"))
            .and_then(|v| v.as_str());
        let compute = match (from_mp, &self.dtype) {
            (Some(d), _) => parse_dtype(&format!("{prefix}.mixed_precision.param_dtype"), d)?,
            (None, Some(d)) => parse_dtype(&format!("{prefix}.dtype"), d)?,
            // verl's FSDP workers compute in bf16 unless told otherwise.
            (None, None) => Kind::BFloat16,
        };
        Ok(Precision { master, compute })
    }

    /// The dtype a sharded model's gradients are reduce-scattered in: verl's
    /// `mixed_precision.reduce_dtype` (fp32 unless set; `bf16` halves the traffic, and each
    /// rank's contribution is rounded to bf16 before the sum).
    pub fn reduce_dtype(&self, prefix: &str) -> Result<Kind> {
        match self
            .mixed_precision
            .as_ref()
            .and_then(|m| m.get("reduce_dtype"))
        {
            None | Some(Value::Null) => Ok(Kind::Float),
            Some(Value::String(d)) => {
                parse_dtype(&format!("{prefix}.mixed_precision.reduce_dtype"), d)
            }
            Some(other) => Err(BackendError::config(
                format!("{prefix}.mixed_precision.reduce_dtype"),
                "one of fp32, bf16, fp16",
                other.to_string(),
            )),
        }
    }
}

pub fn parse_dtype(key: &str, s: &str) -> Result<Kind> {
    match s.to_ascii_lowercase().as_str() {
        "fp32" | "float32" | "float" | "32" => Ok(Kind::Float),
        "bf16" | "bfloat16" => Ok(Kind::BFloat16),
        "fp16" | "float16" | "half" | "16" => Ok(Kind::Half),
        other => Err(BackendError::config(
            key,
            "one of fp32, bf16, fp16 (or float32, bfloat16, float16)",
            format!("{other:?}"),
        )),
    }
}

/// `*.optim`: AdamW and the LR schedule (FSDP keys).
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct OptimSection {
    pub optimizer: String,
    pub lr: f64,
    pub betas: Vec<f64>,
    pub weight_decay: f64,
    pub eps: f64,
    pub lr_warmup_steps: i64,
    pub lr_warmup_steps_ratio: f64,
    pub total_training_steps: i64,
    pub min_lr_ratio: f64,
    pub num_cycles: f64,
    pub lr_scheduler_type: String,
    /// Deprecated spelling of `lr_scheduler_type`; wins when set, as in verl.
    pub warmup_style: Option<String>,
}

impl Default for OptimSection {
    fn default() -> Self {
        OptimSection {
            optimizer: "AdamW".into(),
            lr: 1e-6,
            betas: vec![0.9, 0.999],
            weight_decay: 0.01,
            eps: 1e-8,
            lr_warmup_steps: -1,
            lr_warmup_steps_ratio: 0.0,
            total_training_steps: -1,
            min_lr_ratio: 0.0,
            num_cycles: 0.5,
            lr_scheduler_type: "constant".into(),
            warmup_style: None,
        }
    }
}

/// `actor_rollout_ref.model` / `critic.model`.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct ModelSection {
    pub path: String,
    pub tokenizer_path: Option<String>,
    pub enable_gradient_checkpointing: bool,
    pub fsdp_config: Option<FsdpSection>,
    /// verl's `use_remove_padding`: log-prob / value / update passes drop each row's padding
    /// ([`crate::packing::Padding::Remove`]). Unset: verl's defaults, on for
    /// `actor_rollout_ref.model` (actor and reference), off for `critic.model`.
    pub use_remove_padding: Option<bool>,
    /// LoRA (verl's FSDP keys): on with `lora_rank > 0` or a `lora_adapter_path`.
    pub lora_rank: u64,
    pub lora_alpha: f64,
    /// `"all-linear"` (default), a list of module names, or a regular expression.
    pub target_modules: Value,
    pub exclude_modules: Value,
    /// A PEFT adapter folder to start from (its own `adapter_config.json` decides rank, alpha
    /// and modules, as `PeftModel.from_pretrained` in verl).
    pub lora_adapter_path: Option<String>,
}

impl Default for ModelSection {
    fn default() -> Self {
        ModelSection {
            path: String::new(),
            tokenizer_path: None,
            enable_gradient_checkpointing: false,
            fsdp_config: None,
            use_remove_padding: None,
            lora_rank: 0,
            lora_alpha: 16.0,
            target_modules: Value::from("all-linear"),
            exclude_modules: Value::Null,
            lora_adapter_path: None,
        }
    }
}

/// What a role's LoRA keys ask for.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraPlan {
    pub config: verl_nn::LoraConfig,
    /// The PEFT folder the adapters start from (else: PEFT's fresh init).
    pub adapter: Option<PathBuf>,
}

impl ModelSection {
    /// The LoRA adapters `prefix` (`actor_rollout_ref.model` / `critic.model`) asks for; `None`
    /// without LoRA.
    pub fn lora(&self, prefix: &str) -> Result<Option<LoraPlan>> {
        if let Some(path) = self.lora_adapter_path.as_deref().filter(|p| !p.is_empty()) {
            let key = format!("{prefix}.lora_adapter_path");
            let dir = expand_home(path);
            if !dir.join(verl_nn::lora::ADAPTER_CONFIG).is_file() {
                return Err(BackendError::config(
                    key,
                    "a PEFT adapter folder (adapter_config.json, adapter_model.safetensors)",
                    format!("{} without adapter_config.json", dir.display()),
                ));
            }
            let config = verl_nn::LoraConfig::from_adapter_dir(&dir)?;
            if self.lora_rank > 0 && self.lora_rank as i64 != config.rank {
                tracing::warn!(
                    "{prefix}.lora_rank={} differs from the adapter's r={} in {}: the adapter's \
                     settings are used (as PEFT's from_pretrained in verl)",
                    self.lora_rank,
                    config.rank,
                    dir.display()
                );
            }
            return Ok(Some(LoraPlan {
                config,
                adapter: Some(dir),
            }));
        }
        if self.lora_rank == 0 {
            return Ok(None);
        }
        let modules = |key: &str, v: &Value| -> Result<Option<verl_nn::LoraModules>> {
            verl_nn::LoraModules::from_json(key, v).map_err(|e| {
                BackendError::config(
                    format!("{prefix}.{key}"),
                    "\"all-linear\", a list of module names or a regular expression",
                    e.to_string(),
                )
            })
        };
        Ok(Some(LoraPlan {
            config: verl_nn::LoraConfig {
                rank: self.lora_rank as i64,
                alpha: self.lora_alpha,
                target_modules: modules("target_modules", &self.target_modules)?
                    .unwrap_or(verl_nn::LoraModules::AllLinear),
                exclude_modules: modules("exclude_modules", &self.exclude_modules)?,
                use_rslora: false,
                modules_to_save: Vec::new(),
            },
            adapter: None,
        }))
    }
}

impl LoraPlan {
    /// Adds the adapters to `model` (fresh ones drawn from `seed`; or read from the starting
    /// adapter), logging what was adapted.
    pub fn apply(&self, model: &mut verl_nn::Transformer, role: &str, seed: u64) -> Result<()> {
        let report = model.add_lora(&self.config, seed)?;
        if let Some(dir) = &self.adapter {
            model.load_adapter(dir)?;
        }
        tracing::info!(
            "{role}: LoRA rank {} alpha {} on {} projections, {} trainable parameters{}",
            self.config.rank,
            self.config.alpha,
            report.modules,
            report.trainable_params,
            self.adapter
                .as_ref()
                .map(|d| format!(", from {}", d.display()))
                .unwrap_or_default()
        );
        Ok(())
    }
}

/// The generation-engine keys of `actor_rollout_ref.rollout` (vLLM's names).
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct RolloutEngineSection {
    /// Fraction of the GPU's total memory the process may fill during generation; the KV cache
    /// gets what is left of it after everything already in use (weights, optimizer state, ...).
    pub gpu_memory_utilization: f64,
    /// Most sequences decoding at once.
    pub max_num_seqs: Option<u64>,
    /// Most prompt tokens in one prefill forward.
    pub max_num_batched_tokens: Option<u64>,
    /// `true`: every decode step launches its kernels one by one; `false` (default): decode steps
    /// replay captured CUDA graphs (CUDA, dense models).
    pub enforce_eager: bool,
    /// Batch sizes decode graphs are captured for; `null`: 1, 2, 4, 8, 16, ... up to
    /// `max_num_seqs` (at most 512).
    pub cudagraph_capture_sizes: Option<Vec<u64>>,
    /// verl-rs: the engine and the actor's log-prob passes compute attention by the same kernel
    /// in the same order (see `verl_nn::Transformer::set_consistent_attention`), so rollout
    /// log-probs match the recomputed ones up to GEMM rounding. Slower log-prob passes.
    pub consistent_attention: bool,
}

impl Default for RolloutEngineSection {
    fn default() -> Self {
        RolloutEngineSection {
            gpu_memory_utilization: 0.5,
            max_num_seqs: None,
            max_num_batched_tokens: None,
            enforce_eager: false,
            cudagraph_capture_sizes: None,
            consistent_attention: false,
        }
    }
}

/// The batching keys of `actor_rollout_ref.actor` (the loss keys are read by verl-losses).
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct ActorSection {
    pub ppo_mini_batch_size: u64,
    pub ppo_micro_batch_size: Option<u64>,
    pub ppo_micro_batch_size_per_gpu: Option<u64>,
    pub use_dynamic_bsz: bool,
    pub ppo_max_token_len_per_gpu: u64,
    pub ppo_epochs: u64,
    pub grad_clip: f64,
    pub calculate_entropy: bool,
    /// verl's PrefixGrouper: the samples of a prompt share its forward in the log-prob and update
    /// passes ([`crate::packing::Padding::SharedPrompt`]).
    pub use_prefix_grouper: bool,
    pub rollout_n: Option<u64>,
    pub optim: OptimSection,
    pub fsdp_config: FsdpSection,
}

impl Default for ActorSection {
    fn default() -> Self {
        ActorSection {
            ppo_mini_batch_size: 256,
            ppo_micro_batch_size: None,
            ppo_micro_batch_size_per_gpu: None,
            use_dynamic_bsz: false,
            ppo_max_token_len_per_gpu: 16384,
            ppo_epochs: 1,
            grad_clip: 1.0,
            calculate_entropy: false,
            use_prefix_grouper: false,
            rollout_n: None,
            optim: OptimSection::default(),
            fsdp_config: FsdpSection::default(),
        }
    }
}

/// The log-prob batching keys shared by `rollout` and `ref`.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct LogProbSection {
    pub log_prob_micro_batch_size: Option<u64>,
    pub log_prob_micro_batch_size_per_gpu: Option<u64>,
    pub log_prob_use_dynamic_bsz: bool,
    pub log_prob_max_token_len_per_gpu: u64,
    /// `rollout.n` (absent in `ref`).
    pub n: Option<u64>,
    pub temperature: Option<f64>,
    pub fsdp_config: Option<FsdpSection>,
}

impl Default for LogProbSection {
    fn default() -> Self {
        LogProbSection {
            log_prob_micro_batch_size: None,
            log_prob_micro_batch_size_per_gpu: None,
            log_prob_use_dynamic_bsz: false,
            log_prob_max_token_len_per_gpu: 16384,
            n: None,
            temperature: None,
            fsdp_config: None,
        }
    }
}

/// `critic`.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct CriticSection {
    pub rollout_n: Option<u64>,
    pub ppo_mini_batch_size: u64,
    pub ppo_micro_batch_size: Option<u64>,
    pub ppo_micro_batch_size_per_gpu: Option<u64>,
    pub use_dynamic_bsz: bool,
    pub ppo_max_token_len_per_gpu: u64,
    pub forward_max_token_len_per_gpu: u64,
    pub forward_micro_batch_size: Option<u64>,
    pub forward_micro_batch_size_per_gpu: Option<u64>,
    pub ppo_epochs: u64,
    pub grad_clip: f64,
    pub optim: OptimSection,
    pub model: ModelSection,
}

impl Default for CriticSection {
    fn default() -> Self {
        CriticSection {
            rollout_n: None,
            ppo_mini_batch_size: 256,
            ppo_micro_batch_size: None,
            ppo_micro_batch_size_per_gpu: None,
            use_dynamic_bsz: false,
            ppo_max_token_len_per_gpu: 32768,
            forward_max_token_len_per_gpu: 32768,
            forward_micro_batch_size: None,
            forward_micro_batch_size_per_gpu: None,
            ppo_epochs: 1,
            grad_clip: 1.0,
            optim: OptimSection {
                lr: 1e-5,
                ..OptimSection::default()
            },
            model: ModelSection::default(),
        }
    }
}

/// `trainer`.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct TrainerSection {
    pub device: String,
    pub total_training_steps: Option<i64>,
}

impl Default for TrainerSection {
    fn default() -> Self {
        TrainerSection {
            device: "cuda".into(),
            total_training_steps: None,
        }
    }
}

/// The job's `trainer` section and the device of this rank (`trainer.device`, the rank's local
/// GPU for CUDA).
pub fn trainer_device(init: &verl_plugin_api::InitArgs) -> Result<(TrainerSection, Device)> {
    let trainer: TrainerSection = section(&init.config, "trainer")?;
    let device = device(&trainer, init.local_rank)?;
    Ok((trainer, device))
}

/// `trainer.device` → the device this rank's model lives on.
pub fn device(trainer: &TrainerSection, local_rank: u32) -> Result<Device> {
    match trainer.device.as_str() {
        "cpu" => Ok(Device::Cpu),
        "cuda" | "gpu" => {
            if !tch::Cuda::is_available() {
                return Err(BackendError::config(
                    "trainer.device",
                    "a device this process can use (CUDA is not available here: set trainer.device=cpu)",
                    "\"cuda\"",
                ));
            }
            let n = tch::Cuda::device_count() as u32;
            if local_rank >= n {
                return Err(BackendError::config(
                    "trainer.device",
                    format!("local rank {local_rank} to have a GPU"),
                    format!("{n} visible GPUs"),
                ));
            }
            Ok(Device::Cuda(local_rank as usize))
        }
        other => Err(BackendError::config(
            "trainer.device",
            "\"cpu\" or \"cuda\"",
            format!("{other:?}"),
        )),
    }
}

/// verl's defaults spell model paths as `~/models/...`; Hydra leaves the tilde to the user code.
pub fn expand_home(path: &str) -> PathBuf {
    match (path.strip_prefix("~/"), std::env::var_os("HOME")) {
        (Some(rest), Some(home)) => PathBuf::from(home).join(rest),
        _ => PathBuf::from(path),
    }
}

/// A model folder key: non-empty and existing.
pub fn model_dir(key: &str, path: &str) -> Result<PathBuf> {
    if path.is_empty() {
        return Err(BackendError::config(
            key,
            "a HF model folder",
            "an empty path",
        ));
    }
    let p = expand_home(path);
    if !p.is_dir() {
        return Err(BackendError::config(
            key,
            "an existing HF model folder",
            format!("{} (not a directory)", p.display()),
        ));
    }
    Ok(p)
}

/// Micro-batching of a forward or update pass.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MicroBatching {
    /// At most this many rows per micro-batch.
    Rows(usize),
    /// Rows packed so each micro-batch holds at most this many real tokens (prompt + response).
    Tokens(usize),
}

/// verl's choice between a per-GPU micro batch, the deprecated global one divided by the DP size, a
/// token budget, or (none set) the whole batch at once.
pub fn micro_batching(
    dynamic: bool,
    max_tokens: u64,
    per_gpu: Option<u64>,
    global: Option<u64>,
    dp_size: usize,
) -> MicroBatching {
    if dynamic {
        return MicroBatching::Tokens(max_tokens.max(1) as usize);
    }
    match (per_gpu, global) {
        (Some(n), _) if n > 0 => MicroBatching::Rows(n as usize),
        (_, Some(n)) if n > 0 => MicroBatching::Rows(((n as usize) / dp_size).max(1)),
        _ => MicroBatching::Rows(usize::MAX),
    }
}

impl LogProbSection {
    /// How this section's log-prob (or value) forwards split a batch into micro-batches.
    pub fn micro_batching(&self, dp_size: usize) -> MicroBatching {
        micro_batching(
            self.log_prob_use_dynamic_bsz,
            self.log_prob_max_token_len_per_gpu,
            self.log_prob_micro_batch_size_per_gpu,
            self.log_prob_micro_batch_size,
            dp_size,
        )
    }
}

/// Rows per mini-batch on one data-parallel rank: verl's `ppo_mini_batch_size × rollout.n /
/// dp_size`, at least one; and the epochs, at least one. `prefix` names the keys.
fn mini_batch_rows(
    prefix: &str,
    ppo_mini_batch_size: u64,
    n: u64,
    ppo_epochs: u64,
    dp_size: usize,
) -> Result<(usize, usize)> {
    let mini = (ppo_mini_batch_size * n) as usize / dp_size;
    if mini == 0 {
        return Err(BackendError::config(
            format!("{prefix}.ppo_mini_batch_size"),
            format!(
                "at least one row per data-parallel rank (× rollout.n {n} / dp size {dp_size})"
            ),
            ppo_mini_batch_size,
        ));
    }
    if ppo_epochs == 0 {
        return Err(BackendError::config(
            format!("{prefix}.ppo_epochs"),
            "at least 1",
            0,
        ));
    }
    Ok((mini, ppo_epochs as usize))
}

/// Settings of an actor's PPO update, resolved from `actor_rollout_ref.actor`.
pub struct ActorUpdatePlan {
    /// Rows per mini-batch on this rank: `ppo_mini_batch_size × rollout.n / dp_size`.
    pub mini_batch_rows: usize,
    pub epochs: usize,
    pub micro: MicroBatching,
    pub calculate_entropy: bool,
    pub loss: verl_losses::ActorLoss,
}

impl ActorUpdatePlan {
    pub fn resolve(
        cfg: &Value,
        actor: &ActorSection,
        rollout: &LogProbSection,
        dp_size: usize,
    ) -> Result<ActorUpdatePlan> {
        const PREFIX: &str = "actor_rollout_ref.actor";
        let n = actor.rollout_n.or(rollout.n).unwrap_or(1).max(1);
        let (mini_batch_rows, epochs) = mini_batch_rows(
            PREFIX,
            actor.ppo_mini_batch_size,
            n,
            actor.ppo_epochs,
            dp_size,
        )?;
        let loss_cfg: verl_losses::ActorLossConfig = section(cfg, PREFIX)?;
        Ok(ActorUpdatePlan {
            mini_batch_rows,
            epochs,
            micro: micro_batching(
                actor.use_dynamic_bsz,
                actor.ppo_max_token_len_per_gpu,
                actor.ppo_micro_batch_size_per_gpu,
                actor.ppo_micro_batch_size,
                dp_size,
            ),
            calculate_entropy: actor.calculate_entropy,
            loss: verl_losses::ActorLoss::from_config(&loss_cfg)?,
        })
    }
}

/// What an actor or reference role keeps besides its model and its process groups.
pub struct ActorSettings {
    /// `actor` or `reference`.
    pub role: &'static str,
    pub model_dir: PathBuf,
    pub tokenizer_dir: PathBuf,
    /// Micro-batching of log-prob forwards, and the key its token budget comes from.
    pub log_prob_micro: MicroBatching,
    pub log_prob_key: &'static str,
    /// `rollout.temperature`: what log-probs and updates divide the logits by unless a call says.
    pub default_temperature: f64,
    /// The PPO update (none for the frozen reference).
    pub update: Option<ActorUpdatePlan>,
    pub trainer_total_steps: Option<i64>,
    /// Base of the per-call generation seeds; with `generate_calls` it is this role's RNG state.
    pub seed: u64,
    pub generate_calls: u64,
}

impl ActorSettings {
    /// The actor's settings (`plan`: its update) or, without a plan, the frozen reference's: the
    /// log-prob micro-batching of `actor_rollout_ref.rollout` or `actor_rollout_ref.ref`, the
    /// rollout temperature, the trainer's step count and the role's seed.
    /// `dirs`: the model and tokenizer folders ([`actor_model_dirs`]).
    pub fn resolve(
        cfg: &Value,
        plan: Option<ActorUpdatePlan>,
        dirs: (PathBuf, PathBuf),
        trainer: &TrainerSection,
        dp_size: usize,
        seed: u64,
    ) -> Result<ActorSettings> {
        let (model_dir, tokenizer_dir) = dirs;
        let rollout: LogProbSection = section(cfg, "actor_rollout_ref.rollout")?;
        let (role, log_prob, log_prob_key) = match plan {
            Some(_) => (
                "actor",
                rollout.micro_batching(dp_size),
                "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
            ),
            None => (
                "reference",
                section::<LogProbSection>(cfg, "actor_rollout_ref.ref")?.micro_batching(dp_size),
                "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
            ),
        };
        Ok(ActorSettings {
            role,
            model_dir,
            tokenizer_dir,
            log_prob_micro: log_prob,
            log_prob_key,
            default_temperature: rollout.temperature.unwrap_or(1.0),
            update: plan,
            trainer_total_steps: trainer.total_training_steps,
            seed,
            generate_calls: 0,
        })
    }
}

/// Settings of the critic's value forwards and PPO update, resolved from `critic`.
pub struct CriticUpdatePlan {
    pub forward_micro: MicroBatching,
    pub update_micro: MicroBatching,
    pub mini_batch_rows: usize,
    pub epochs: usize,
    pub loss: verl_losses::CriticLoss,
    /// `trainer.total_training_steps`, for the LR schedule when the host sends none.
    pub trainer_total_steps: Option<i64>,
}

impl CriticUpdatePlan {
    pub fn resolve(
        cfg: &Value,
        critic: &CriticSection,
        rollout: &LogProbSection,
        trainer: &TrainerSection,
        dp_size: usize,
    ) -> Result<CriticUpdatePlan> {
        let n = critic.rollout_n.or(rollout.n).unwrap_or(1).max(1);
        let (mini_batch_rows, epochs) = mini_batch_rows(
            "critic",
            critic.ppo_mini_batch_size,
            n,
            critic.ppo_epochs,
            dp_size,
        )?;
        let loss_cfg: verl_losses::CriticLossConfig = section(cfg, "critic")?;
        Ok(CriticUpdatePlan {
            forward_micro: micro_batching(
                critic.use_dynamic_bsz,
                critic.forward_max_token_len_per_gpu,
                critic.forward_micro_batch_size_per_gpu,
                critic.forward_micro_batch_size,
                dp_size,
            ),
            update_micro: micro_batching(
                critic.use_dynamic_bsz,
                critic.ppo_max_token_len_per_gpu,
                critic.ppo_micro_batch_size_per_gpu,
                critic.ppo_micro_batch_size,
                dp_size,
            ),
            mini_batch_rows,
            epochs,
            loss: verl_losses::CriticLoss::from_config(&loss_cfg)?,
            trainer_total_steps: trainer.total_training_steps,
        })
    }
}

/// The actor's model section, its model folder (`actor_rollout_ref.model.path`) and its tokenizer
/// folder (`tokenizer_path`, else the model folder).
pub fn actor_model_dirs(cfg: &Value) -> Result<(ModelSection, (PathBuf, PathBuf))> {
    let model: ModelSection = section(cfg, "actor_rollout_ref.model")?;
    let model_dir = model_dir("actor_rollout_ref.model.path", &model.path)?;
    let tokenizer_dir = model
        .tokenizer_path
        .as_deref()
        .map(expand_home)
        .unwrap_or_else(|| model_dir.clone());
    Ok((model, (model_dir, tokenizer_dir)))
}

/// The critic's model folder: `critic.model.path`, else the actor's.
pub fn critic_model_dir(critic: &CriticSection, actor_model: &ModelSection) -> Result<PathBuf> {
    let (key, path) = if critic.model.path.is_empty() {
        ("actor_rollout_ref.model.path", actor_model.path.as_str())
    } else {
        ("critic.model.path", critic.model.path.as_str())
    };
    model_dir(key, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each section of verl's config this backend reads, with every key it names set away from its
    /// default, deserialized the way the roles read it: the values arrive, under verl's names.
    #[test]
    fn sections_read_the_verl_keys_they_name() {
        let cfg = serde_json::json!({
            "actor_rollout_ref": {
                "model": {
                    "path": "/m", "tokenizer_path": "/t", "enable_gradient_checkpointing": false,
                    "use_remove_padding": false
                },
                "actor": {
                    "ppo_mini_batch_size": 7, "ppo_micro_batch_size": 6,
                    "ppo_micro_batch_size_per_gpu": 3, "use_dynamic_bsz": true,
                    "ppo_max_token_len_per_gpu": 999, "ppo_epochs": 4, "grad_clip": 0.25,
                    "calculate_entropy": true, "use_prefix_grouper": true, "rollout_n": 5,
                    "optim": {
                        "optimizer": "AdamW", "lr": 3e-5, "betas": [0.8, 0.95],
                        "weight_decay": 0.1, "lr_warmup_steps": 9, "lr_warmup_steps_ratio": 0.3,
                        "total_training_steps": 77, "min_lr_ratio": 0.05, "num_cycles": 1.5,
                        "lr_scheduler_type": "cosine", "warmup_style": "constant"
                    },
                    "fsdp_config": {
                        "model_dtype": "bf16", "dtype": "float16", "seed": 7,
                        "mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "bf16"},
                        "param_offload": true, "optimizer_offload": true,
                        "reshard_after_forward": false
                    }
                },
                "rollout": {
                    "gpu_memory_utilization": 0.8, "max_num_seqs": 33,
                    "max_num_batched_tokens": 4097, "enforce_eager": true,
                    "cudagraph_capture_sizes": [1, 3], "consistent_attention": true,
                    "log_prob_micro_batch_size": 12, "log_prob_micro_batch_size_per_gpu": 2,
                    "log_prob_use_dynamic_bsz": true, "log_prob_max_token_len_per_gpu": 555
                }
            },
            "critic": {
                "rollout_n": 5, "ppo_mini_batch_size": 9, "ppo_micro_batch_size": 8,
                "ppo_micro_batch_size_per_gpu": 4, "use_dynamic_bsz": true,
                "ppo_max_token_len_per_gpu": 1111, "forward_max_token_len_per_gpu": 2222,
                "forward_micro_batch_size": 10, "forward_micro_batch_size_per_gpu": 5,
                "ppo_epochs": 3, "grad_clip": 0.5,
                "optim": {"lr": 2e-6},
                "model": {"path": "/c", "enable_gradient_checkpointing": false, "use_remove_padding": true}
            }
        });
        let model: ModelSection = section(&cfg, "actor_rollout_ref.model").unwrap();
        assert_eq!(model.path, "/m");
        assert_eq!(model.tokenizer_path.as_deref(), Some("/t"));
        assert!(!model.enable_gradient_checkpointing);
        assert_eq!(model.use_remove_padding, Some(false));

        let a: ActorSection = section(&cfg, "actor_rollout_ref.actor").unwrap();
        assert_eq!(
            (
                a.ppo_mini_batch_size,
                a.ppo_micro_batch_size,
                a.ppo_micro_batch_size_per_gpu
            ),
            (7, Some(6), Some(3))
        );
        assert!(a.use_dynamic_bsz && a.calculate_entropy && a.use_prefix_grouper);
        assert_eq!((a.ppo_max_token_len_per_gpu, a.ppo_epochs), (999, 4));
        assert_eq!((a.grad_clip, a.rollout_n), (0.25, Some(5)));
        let o = &a.optim;
        assert_eq!(
            (o.lr, o.betas.clone(), o.weight_decay),
            (3e-5, vec![0.8, 0.95], 0.1)
        );
        assert_eq!((o.lr_warmup_steps, o.lr_warmup_steps_ratio), (9, 0.3));
        assert_eq!(
            (o.total_training_steps, o.min_lr_ratio, o.num_cycles),
            (77, 0.05, 1.5)
        );
        assert_eq!(o.lr_scheduler_type, "cosine");
        assert_eq!(o.warmup_style.as_deref(), Some("constant"));
        let f = &a.fsdp_config;
        let key = "actor_rollout_ref.actor.fsdp_config";
        assert_eq!(f.model_dtype, "bf16");
        assert_eq!(f.dtype.as_deref(), Some("float16"));
        assert_eq!(f.seed, 7);
        assert!(f.param_offload && f.optimizer_offload && !f.reshard_after_forward);
        // mixed_precision.param_dtype wins over dtype, as in verl.
        assert_eq!(
            f.precision(key).unwrap(),
            Precision {
                master: Kind::BFloat16,
                compute: Kind::BFloat16
            }
        );
        assert_eq!(f.reduce_dtype(key).unwrap(), Kind::BFloat16);

        let e: RolloutEngineSection = section(&cfg, "actor_rollout_ref.rollout").unwrap();
        assert_eq!(e.gpu_memory_utilization, 0.8);
        assert_eq!(
            (e.max_num_seqs, e.max_num_batched_tokens),
            (Some(33), Some(4097))
        );
        assert!(e.enforce_eager && e.consistent_attention);
        assert_eq!(e.cudagraph_capture_sizes, Some(vec![1, 3]));
        let lp: LogProbSection = section(&cfg, "actor_rollout_ref.rollout").unwrap();
        assert_eq!(
            (
                lp.log_prob_micro_batch_size,
                lp.log_prob_micro_batch_size_per_gpu
            ),
            (Some(12), Some(2))
        );
        assert!(lp.log_prob_use_dynamic_bsz);
        assert_eq!(lp.log_prob_max_token_len_per_gpu, 555);

        let c: CriticSection = section(&cfg, "critic").unwrap();
        assert_eq!(c.rollout_n, Some(5));
        assert_eq!(
            (
                c.ppo_mini_batch_size,
                c.ppo_micro_batch_size,
                c.ppo_micro_batch_size_per_gpu
            ),
            (9, Some(8), Some(4))
        );
        assert!(c.use_dynamic_bsz);
        assert_eq!(
            (c.ppo_max_token_len_per_gpu, c.forward_max_token_len_per_gpu),
            (1111, 2222)
        );
        assert_eq!(
            (
                c.forward_micro_batch_size,
                c.forward_micro_batch_size_per_gpu
            ),
            (Some(10), Some(5))
        );
        assert_eq!((c.ppo_epochs, c.grad_clip, c.optim.lr), (3, 0.5, 2e-6));
        assert_eq!(c.model.path, "/c");
        assert!(!c.model.enable_gradient_checkpointing);
        assert_eq!(c.model.use_remove_padding, Some(true));
    }

    #[test]
    fn reduce_dtype_is_fp32_unless_mixed_precision_says_otherwise() {
        let key = "actor_rollout_ref.actor.fsdp_config";
        let with = |mp: Option<Value>| FsdpSection {
            mixed_precision: mp,
            ..FsdpSection::default()
        };
        assert_eq!(with(None).reduce_dtype(key).unwrap(), Kind::Float);
        let mp = serde_json::json!({"param_dtype": "bf16"});
        assert_eq!(with(Some(mp)).reduce_dtype(key).unwrap(), Kind::Float);
        let mp = serde_json::json!({"reduce_dtype": null});
        assert_eq!(with(Some(mp)).reduce_dtype(key).unwrap(), Kind::Float);
        let mp = serde_json::json!({"reduce_dtype": "bf16"});
        assert_eq!(with(Some(mp)).reduce_dtype(key).unwrap(), Kind::BFloat16);
        let mp = serde_json::json!({"reduce_dtype": "float32"});
        assert_eq!(with(Some(mp)).reduce_dtype(key).unwrap(), Kind::Float);
        for bad in [
            serde_json::json!({"reduce_dtype": "int8"}),
            serde_json::json!({"reduce_dtype": 16}),
        ] {
            let e = with(Some(bad)).reduce_dtype(key).unwrap_err().to_string();
            assert!(
                e.contains("actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype"),
                "{e}"
            );
        }
    }

    /// verl's LoRA keys become the adapter plan: off at rank 0, PEFT's defaults (alpha 16,
    /// all-linear), lists and regexes as given, an adapter folder's own config winning, and a
    /// bad value or folder named by its key.
    #[test]
    fn lora_keys_make_the_adapter_plan() {
        let plan = |model: serde_json::Value| -> Result<Option<LoraPlan>> {
            let cfg = serde_json::json!({"actor_rollout_ref": {"model": model}});
            let m: ModelSection = section(&cfg, "actor_rollout_ref.model")?;
            m.lora("actor_rollout_ref.model")
        };
        assert_eq!(plan(serde_json::json!({})).unwrap(), None);
        let p = plan(serde_json::json!({"lora_rank": 8})).unwrap().unwrap();
        assert_eq!(
            (p.config.rank, p.config.alpha, &p.config.target_modules),
            (8, 16.0, &verl_nn::LoraModules::AllLinear)
        );
        assert_eq!(p.adapter, None);
        let p = plan(serde_json::json!({
            "lora_rank": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
            "exclude_modules": "model\\.layers\\.0\\..*"
        }))
        .unwrap()
        .unwrap();
        assert_eq!(
            p.config.target_modules,
            verl_nn::LoraModules::Names(vec!["q_proj".into(), "v_proj".into()])
        );
        assert_eq!(
            p.config.exclude_modules,
            Some(verl_nn::LoraModules::Regex(
                "model\\.layers\\.0\\..*".into()
            ))
        );
        let e = plan(serde_json::json!({"lora_rank": 4, "target_modules": 3}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("actor_rollout_ref.model.target_modules"), "{e}");
        // An adapter folder: its config decides, whatever lora_rank says.
        let dir = tempfile::tempdir().unwrap();
        let e = plan(serde_json::json!({"lora_adapter_path": dir.path()}))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("actor_rollout_ref.model.lora_adapter_path"),
            "{e}"
        );
        std::fs::write(
            dir.path().join("adapter_config.json"),
            r#"{"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": "all-linear"}"#,
        )
        .unwrap();
        let p = plan(serde_json::json!({"lora_rank": 8, "lora_adapter_path": dir.path()}))
            .unwrap()
            .unwrap();
        assert_eq!((p.config.rank, p.config.alpha), (16, 32.0));
        assert_eq!(p.adapter.as_deref(), Some(dir.path()));
    }
}
