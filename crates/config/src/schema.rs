//! Typed view of verl's config. Field names are verl's key names; the values come from the
//! resolved tree (defaults in `defaults.yaml` + job file + overrides), so no field carries a
//! Rust-side default. Every struct denies unknown fields: a test checks that the structs and
//! `defaults.yaml` describe exactly the same keys.
//!
//! Sections verl-rs does not act on yet (profilers, agent loops, vLLM/SGLang engine knobs, ...)
//! are kept as untyped [`Any`] values: they are still parsed, key-checked against the schema and
//! type-checked against their defaults, and they round-trip through [`crate::Config::to_yaml`].

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// An untyped subtree (accepted and passed through, not interpreted here).
pub type Any = serde_yaml::Value;
/// A free-form map of keyword arguments.
pub type Map = serde_yaml::Mapping;

/// One string or a list of strings (verl accepts both for files, loggers, target modules).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    pub fn to_vec(&self) -> Vec<String> {
        match self {
            OneOrMany::One(s) => vec![s.clone()],
            OneOrMany::Many(v) => v.clone(),
        }
    }
}

/// The whole job configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// verl 0.8-0.10's engine switch (`dp` or `megatron`); kept equal to the strategies.
    pub model_engine: String,
    pub data: DataConfig,
    pub actor_rollout_ref: ActorRolloutRefConfig,
    pub critic: CriticConfig,
    pub reward_model: RewardModelConfig,
    pub reward_manager: RewardManagerConfig,
    pub custom_reward_function: CustomRewardFunctionConfig,
    /// The pre-0.8 top-level sandbox settings verl 0.8-0.10 still accept.
    pub sandbox_fusion: SandboxFusionConfig,
    /// verl 0.8-0.10's reward layout (one setting with the pre-0.8 keys).
    pub reward: RewardConfig,
    pub distillation: Any,
    pub skip: Any,
    pub algorithm: AlgorithmConfig,
    pub trainer: TrainerConfig,
    pub global_profiler: Any,
    pub transfer_queue: Any,
    pub ray_kwargs: Any,
    /// verl-rs extension: plugin discovery and role → plugin routing.
    pub plugins: PluginsConfig,
    /// Keys the job set that mean nothing here (engine knobs of vLLM/SGLang, profilers, ...),
    /// one line each, for the command line to show once. Not part of the config.
    #[serde(skip)]
    pub warnings: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    pub tokenizer: Option<String>,
    pub use_shm: bool,
    pub train_files: OneOrMany,
    pub val_files: OneOrMany,
    pub train_max_samples: i64,
    pub val_max_samples: i64,
    pub prompt_key: String,
    pub reward_fn_key: String,
    pub max_prompt_length: u64,
    pub max_response_length: u64,
    /// In prompts (each prompt is sampled `actor_rollout_ref.rollout.n` times).
    pub train_batch_size: u64,
    pub val_batch_size: Option<u64>,
    pub tool_config_path: Option<String>,
    pub return_raw_input_ids: bool,
    pub return_raw_chat: bool,
    pub return_full_prompt: bool,
    pub shuffle: bool,
    pub seed: Option<u64>,
    pub dataloader_num_workers: u64,
    pub image_patch_size: u64,
    pub validation_shuffle: bool,
    pub filter_overlong_prompts: bool,
    pub filter_overlong_prompts_workers: u64,
    /// `error`, `left`, `right` or `middle`.
    pub truncation: String,
    pub image_key: String,
    pub video_key: String,
    pub trust_remote_code: bool,
    pub custom_cls: ClassRef,
    pub return_multi_modal_inputs: bool,
    pub sampler: SamplerRef,
    pub datagen: ClassRef,
    pub apply_chat_template_kwargs: Map,
    pub gen_batch_size: Option<u64>,
    pub function_tool_path: Option<String>,
    pub audio_key: String,
    pub mm_processor_kwargs: Map,
    pub continuous_token: Any,
}

/// A user class or function given by file path and name.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassRef {
    pub path: Option<String>,
    pub name: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SamplerRef {
    pub class_path: Option<String>,
    pub class_name: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActorRolloutRefConfig {
    pub hybrid_engine: bool,
    pub nccl_timeout: u64,
    pub model: ModelConfig,
    pub actor: ActorConfig,
    #[serde(rename = "ref")]
    pub reference: RefConfig,
    pub rollout: RolloutConfig,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub path: String,
    pub hf_config_path: Option<String>,
    pub tokenizer_path: Option<String>,
    pub use_shm: bool,
    pub trust_remote_code: bool,
    pub custom_chat_template: Option<String>,
    pub external_lib: Option<String>,
    pub override_config: Map,
    pub enable_gradient_checkpointing: bool,
    pub enable_activation_offload: bool,
    pub use_remove_padding: bool,
    pub lora_rank: u64,
    pub lora_alpha: f64,
    pub target_modules: OneOrMany,
    pub exclude_modules: Option<OneOrMany>,
    pub lora_adapter_path: Option<String>,
    pub use_liger: bool,
    pub use_fused_kernels: bool,
    pub fused_kernel_options: FusedKernelOptions,
    pub tiled_mlp: TiledMlp,
    pub mtp: Any,
    /// Megatron-Bridge LoRA settings (megatron strategy only).
    pub lora: Any,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FusedKernelOptions {
    pub impl_backend: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TiledMlp {
    pub enabled: bool,
    pub num_shards: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActorConfig {
    /// `fsdp`, `fsdp2` or `megatron`; picks the backend plugin unless `plugins.backend` is set.
    pub strategy: String,
    pub rollout_n: u64,
    /// In prompts, like `data.train_batch_size`.
    pub ppo_mini_batch_size: u64,
    /// Deprecated global micro batch (verl divides it by the data-parallel size).
    pub ppo_micro_batch_size: Option<u64>,
    pub ppo_micro_batch_size_per_gpu: Option<u64>,
    pub use_dynamic_bsz: bool,
    pub ppo_max_token_len_per_gpu: u64,
    pub clip_ratio: f64,
    /// null: `clip_ratio` (verl's fallback).
    pub clip_ratio_low: Option<f64>,
    pub clip_ratio_high: Option<f64>,
    pub tau_pos: f64,
    pub tau_neg: f64,
    pub freeze_vision_tower: bool,
    pub policy_loss: PolicyLossConfig,
    pub clip_ratio_c: f64,
    pub loss_agg_mode: String,
    pub loss_scale_factor: Option<f64>,
    pub entropy_coeff: f64,
    pub calculate_entropy: bool,
    pub use_kl_loss: bool,
    pub use_prefix_grouper: bool,
    pub use_torch_compile: bool,
    pub kl_loss_coef: f64,
    pub kl_loss_type: String,
    pub ppo_epochs: u64,
    pub shuffle: bool,
    pub data_loader_seed: Option<u64>,
    pub checkpoint: CheckpointConfig,
    pub use_fused_kernels: bool,
    pub grad_clip: f64,
    pub ulysses_sequence_parallel_size: u64,
    pub entropy_from_logits_with_chunking: bool,
    pub entropy_from_logits_chunk_size: u64,
    pub entropy_checkpointing: bool,
    pub pad_to_length: bool,
    pub use_remove_padding: bool,
    pub qat: Any,
    pub calculate_sum_pi_squared: bool,
    pub sum_pi_squared_checkpointing: bool,
    pub load_weight: bool,
    pub optim: OptimConfig,
    pub fsdp_config: FsdpConfig,
    pub megatron: MegatronConfig,
    pub profiler: Any,
    pub router_replay: RouterReplayConfig,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyLossConfig {
    pub loss_mode: String,
    pub clip_cov_ratio: f64,
    pub clip_cov_lb: f64,
    pub clip_cov_ub: f64,
    pub kl_cov_ratio: f64,
    pub ppo_kl_coef: f64,
    pub dro_beta: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointConfig {
    pub save_contents: Vec<String>,
    pub load_contents: Vec<String>,
    pub async_save: bool,
    pub strict: bool,
    pub mbridge_config: Map,
}

/// Optimizer settings: the FSDP keys and the Megatron (mcore) keys in one section, as a user
/// may set either depending on the strategy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OptimConfig {
    pub optimizer: String,
    pub optimizer_impl: String,
    pub lr: f64,
    pub lr_warmup_steps_ratio: f64,
    pub total_training_steps: i64,
    pub weight_decay: f64,
    pub lr_warmup_steps: i64,
    pub betas: Vec<f64>,
    pub clip_grad: f64,
    pub min_lr_ratio: f64,
    pub num_cycles: f64,
    pub lr_scheduler_type: String,
    pub warmup_style: Option<String>,
    pub override_optimizer_config: Any,
    pub lr_warmup_init: f64,
    pub lr_decay_steps: Option<u64>,
    pub lr_decay_style: String,
    pub min_lr: f64,
    pub weight_decay_incr_style: String,
    pub lr_wsd_decay_style: String,
    pub lr_wsd_decay_steps: Option<u64>,
    pub use_checkpoint_opt_param_scheduler: bool,
    pub zero_indexed_step: bool,
    pub use_precision_aware_optimizer: bool,
    pub main_grads_dtype: String,
    pub exp_avg_dtype: String,
    pub exp_avg_sq_dtype: String,
    pub use_layer_wise_distributed_optimizer: bool,
    pub muon_momentum: f64,
    pub muon_nesterov: bool,
    pub muon_split_qkv: bool,
    pub muon_scale_mode: String,
    pub muon_coefficient_type: String,
    pub muon_num_ns_steps: u64,
    pub muon_tp_mode: String,
    pub muon_fp32_matmul_prec: String,
    pub muon_extra_scale_factor: f64,
    pub muon_scalar_optimizer: String,
    pub muon_match_adamw_update_rms: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FsdpConfig {
    pub wrap_policy: Map,
    pub param_offload: bool,
    pub optimizer_offload: bool,
    pub offload_policy: bool,
    pub reshard_after_forward: bool,
    pub fsdp_size: i64,
    pub forward_prefetch: bool,
    pub model_dtype: String,
    pub use_orig_params: bool,
    pub mixed_precision: Any,
    pub seed: u64,
    pub full_determinism: bool,
    pub ulysses_sequence_parallel_size: u64,
    pub entropy_from_logits_with_chunking: bool,
    pub entropy_from_logits_chunk_size: u64,
    pub use_torch_compile: bool,
    pub entropy_checkpointing: bool,
    pub pad_to_length: bool,
    pub pad_to_length_bucket: u64,
    pub forward_only: bool,
    pub strategy: String,
    pub dtype: String,
    pub qat: Any,
    pub turbo_config: Any,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MegatronConfig {
    pub param_offload: bool,
    pub grad_offload: bool,
    pub optimizer_offload: bool,
    pub tensor_model_parallel_size: u64,
    pub expert_model_parallel_size: u64,
    pub expert_tensor_parallel_size: Option<u64>,
    pub pipeline_model_parallel_size: u64,
    pub virtual_pipeline_model_parallel_size: Option<u64>,
    pub context_parallel_size: u64,
    pub sequence_parallel: bool,
    pub use_distributed_optimizer: bool,
    pub use_dist_checkpointing: bool,
    pub dist_checkpointing_path: Option<String>,
    pub dist_checkpointing_prefix: String,
    pub seed: u64,
    pub override_ddp_config: Map,
    pub override_transformer_config: Map,
    pub override_mcore_model_config: Map,
    pub use_mbridge: bool,
    pub vanilla_mbridge: bool,
    pub use_remove_padding: bool,
    pub forward_only: bool,
    pub dtype: String,
    pub dynamic_context_parallel: bool,
    pub max_seqlen_per_dp_cp_rank: Option<u64>,
    pub dist_ckpt_optim_fully_reshardable: bool,
    pub distrib_optim_fully_reshardable_mem_efficient: bool,
    pub entropy_from_logits_with_chunking: bool,
    pub entropy_from_logits_chunk_size: u64,
    pub pad_bshd_to_minibatch_max: bool,
    pub pad_to_length: bool,
    pub pad_to_length_bucket: u64,
    pub use_megatron_fsdp: bool,
    pub router_replay: RouterReplayConfig,
    pub qat: Any,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouterReplayConfig {
    pub mode: String,
    pub record_file: Option<String>,
    pub replay_file: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RefConfig {
    pub strategy: String,
    pub rollout_n: u64,
    pub use_torch_compile: bool,
    pub log_prob_micro_batch_size: Option<u64>,
    pub log_prob_micro_batch_size_per_gpu: Option<u64>,
    pub log_prob_use_dynamic_bsz: bool,
    pub log_prob_max_token_len_per_gpu: u64,
    pub ulysses_sequence_parallel_size: u64,
    pub entropy_from_logits_with_chunking: bool,
    pub entropy_from_logits_chunk_size: u64,
    pub entropy_checkpointing: bool,
    pub pad_to_length: bool,
    pub load_weight: bool,
    pub fsdp_config: FsdpConfig,
    pub megatron: MegatronConfig,
    pub profiler: Any,
    pub router_replay: RouterReplayConfig,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RolloutConfig {
    /// verl's inference engine name (vllm, sglang, hf, ...); informational in verl-rs.
    pub name: Option<String>,
    pub mode: String,
    pub nnodes: u64,
    pub n_gpus_per_node: u64,
    pub temperature: f64,
    pub top_k: i64,
    pub top_p: f64,
    pub full_determinism: bool,
    pub seed: u64,
    pub prompt_length: u64,
    pub response_length: u64,
    pub dtype: String,
    pub gpu_memory_utilization: f64,
    pub ignore_eos: bool,
    pub enforce_eager: bool,
    pub cudagraph_capture_sizes: Option<Vec<u64>>,
    pub free_cache_engine: bool,
    pub tensor_model_parallel_size: u64,
    pub data_parallel_size: u64,
    pub expert_parallel_size: u64,
    pub moe_tensor_parallel_size: u64,
    pub pipeline_model_parallel_size: u64,
    pub max_num_batched_tokens: u64,
    pub max_model_len: Option<u64>,
    pub max_num_seqs: u64,
    pub enable_chunked_prefill: bool,
    pub enable_prefix_caching: bool,
    pub logprobs_mode: String,
    pub scheduling_policy: String,
    pub load_format: String,
    pub log_prob_micro_batch_size: Option<u64>,
    pub log_prob_micro_batch_size_per_gpu: Option<u64>,
    pub log_prob_use_dynamic_bsz: bool,
    pub log_prob_max_token_len_per_gpu: u64,
    pub disable_log_stats: bool,
    pub do_sample: bool,
    /// Responses sampled per prompt.
    pub n: u64,
    pub over_sample_rate: f64,
    pub multi_stage_wake_up: bool,
    pub engine_kwargs: Map,
    pub val_kwargs: SamplingConfig,
    pub multi_turn: Any,
    pub calculate_log_probs: bool,
    /// verl-rs: rollout and log-prob passes share one attention kernel and order (rollout
    /// log-probs match the recomputed ones up to GEMM rounding); slower log-prob passes.
    pub consistent_attention: bool,
    pub agent: Any,
    pub checkpoint_engine: Any,
    pub trace: Any,
    pub skip_rollout: bool,
    pub skip_dump_dir: String,
    pub skip: Any,
    pub skip_tokenizer_init: bool,
    pub enable_rollout_routing_replay: bool,
    pub moe_load_balance_metrics_interval: u64,
    pub profiler: Any,
    pub prometheus: Any,
    pub quantization: Any,
    pub quantization_config_file: Option<String>,
    pub qat: Any,
    pub mtp: Any,
    pub layered_summon: bool,
    pub disaggregation: Any,
    pub layer_name_map: Any,
}

/// Sampling for validation generations (`rollout.val_kwargs`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SamplingConfig {
    pub top_k: i64,
    pub top_p: f64,
    pub temperature: f64,
    pub n: u64,
    pub do_sample: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CriticConfig {
    pub strategy: String,
    /// `null`: on exactly when `algorithm.adv_estimator` is `gae`.
    pub enable: Option<bool>,
    pub rollout_n: u64,
    pub ppo_mini_batch_size: u64,
    pub ppo_micro_batch_size: Option<u64>,
    pub ppo_micro_batch_size_per_gpu: Option<u64>,
    pub use_dynamic_bsz: bool,
    pub ppo_max_token_len_per_gpu: u64,
    pub forward_max_token_len_per_gpu: u64,
    pub ppo_epochs: u64,
    pub shuffle: bool,
    pub data_loader_seed: Option<u64>,
    pub cliprange_value: f64,
    pub loss_agg_mode: String,
    pub loss_scale_factor: Option<f64>,
    pub forward_micro_batch_size: Option<u64>,
    pub forward_micro_batch_size_per_gpu: Option<u64>,
    pub ulysses_sequence_parallel_size: u64,
    pub grad_clip: f64,
    pub nccl_timeout: u64,
    pub load_weight: bool,
    pub checkpoint: CheckpointConfig,
    pub optim: OptimConfig,
    /// verl 0.8-0.10's place for the critic's FSDP settings (one setting with
    /// `critic.model.fsdp_config`).
    pub fsdp: FsdpConfig,
    pub model: CriticModelConfig,
    pub megatron: MegatronConfig,
    pub profiler: Any,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CriticModelConfig {
    pub path: String,
    pub tokenizer_path: Option<String>,
    pub override_config: Map,
    pub external_lib: Option<String>,
    pub trust_remote_code: bool,
    pub use_shm: bool,
    pub enable_gradient_checkpointing: bool,
    pub enable_activation_offload: bool,
    pub use_remove_padding: bool,
    pub lora_rank: u64,
    pub lora_alpha: f64,
    pub target_modules: OneOrMany,
    pub exclude_modules: Option<OneOrMany>,
    pub lora_adapter_path: Option<String>,
    pub hf_config_path: Option<String>,
    pub custom_chat_template: Option<String>,
    pub use_liger: bool,
    pub use_fused_kernels: bool,
    pub fused_kernel_options: FusedKernelOptions,
    pub tiled_mlp: TiledMlp,
    pub mtp: Any,
    pub fsdp_config: FsdpConfig,
    pub lora: Any,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RewardModelConfig {
    pub enable: bool,
    pub enable_resource_pool: bool,
    pub n_gpus_per_node: u64,
    pub nnodes: u64,
    pub strategy: String,
    pub model: RewardModelModelConfig,
    pub micro_batch_size: Option<u64>,
    pub micro_batch_size_per_gpu: Option<u64>,
    pub max_length: Option<u64>,
    pub use_dynamic_bsz: bool,
    pub forward_max_token_len_per_gpu: u64,
    pub reward_manager: String,
    /// Keyword arguments for the reward manager / reward function.
    pub reward_kwargs: Map,
    pub reward_loop_source: String,
    pub reward_loop_module_path: Option<String>,
    pub reward_loop_class_name: Option<String>,
    pub launch_reward_fn_async: bool,
    pub sandbox_fusion: SandboxFusionConfig,
    pub profiler: Any,
    pub ulysses_sequence_parallel_size: u64,
    pub use_reward_loop: bool,
    pub num_workers: u64,
    pub nccl_timeout: u64,
    pub load_weight: bool,
    pub megatron: Any,
    pub rollout: Any,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RewardModelModelConfig {
    pub input_tokenizer: Option<String>,
    pub path: Option<String>,
    pub external_lib: Option<String>,
    pub trust_remote_code: bool,
    pub override_config: Map,
    pub use_shm: bool,
    pub use_remove_padding: bool,
    pub use_fused_kernels: bool,
    pub fsdp_config: Any,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxFusionConfig {
    pub url: Option<String>,
    pub max_concurrent: u64,
    pub memory_limit_mb: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RewardManagerConfig {
    pub source: String,
    pub name: String,
    pub module: ClassRef,
}

/// verl 0.8-0.10's `reward` section.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RewardConfig {
    pub num_workers: u64,
    pub custom_reward_function: CustomRewardFunctionConfig,
    pub reward_manager: RewardManagerConfig,
    pub reward_model: RewardModelSection,
    pub sandbox_fusion: SandboxFusionConfig,
    pub reward_kwargs: Map,
}

/// `reward.reward_model`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RewardModelSection {
    pub enable: bool,
    pub enable_resource_pool: bool,
    pub n_gpus_per_node: u64,
    pub nnodes: u64,
    pub model_path: Option<String>,
    pub rollout: Any,
}

/// verl's `custom_reward_function`: a Python file and function. verl-rs cannot call Python; the
/// section is accepted so verl configs load, and reward plugins may read it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CustomRewardFunctionConfig {
    pub path: Option<String>,
    pub name: String,
    pub reward_kwargs: Map,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AlgorithmConfig {
    pub gamma: f64,
    pub lam: f64,
    pub adv_estimator: String,
    pub norm_adv_by_std_in_grpo: bool,
    pub filter_groups: FilterGroupsConfig,
    pub use_kl_in_reward: bool,
    pub kl_penalty: String,
    pub kl_ctrl: KlControlConfig,
    pub use_pf_ppo: bool,
    pub pf_ppo: PfPpoConfig,
    pub gdpo_reward_keys: Option<Vec<String>>,
    pub gdpo_reward_weights: Option<Vec<f64>>,
    pub rollout_correction: RolloutCorrectionConfig,
}

/// A threshold verl spells as a number or as text (`"lower_upper"`, or a comma list).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum NumOrText {
    Num(f64),
    Text(String),
    /// One per rule (`[0.999_1.001, 0.01]`), the YAML form of a comma list.
    List(Vec<NumOrText>),
}

impl NumOrText {
    /// The text verl parses: a number, `"lower_upper"`, or a comma list of those.
    pub fn to_text(&self) -> String {
        match self {
            NumOrText::Num(v) => v.to_string(),
            NumOrText::Text(s) => s.clone(),
            NumOrText::List(v) => v
                .iter()
                .map(NumOrText::to_text)
                .collect::<Vec<_>>()
                .join(","),
        }
    }
}

/// verl's `algorithm.rollout_correction`: importance weights and rejection against the rollout
/// policy's log-probs (`rollout.calculate_log_probs`), or bypass mode (the rollout log-probs are
/// the old log-probs; no old-log-prob pass).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RolloutCorrectionConfig {
    /// `null`, `token` or `sequence`.
    pub rollout_is: Option<String>,
    pub rollout_is_threshold: Option<NumOrText>,
    pub rollout_is_batch_normalize: bool,
    /// Comma list (or YAML list) of `token_k1`, `seq_sum_k2`, `seq_mean_k1`, `seq_max_k3`, ...
    pub rollout_rs: Option<OneOrMany>,
    pub rollout_rs_threshold: Option<NumOrText>,
    pub bypass_mode: bool,
    /// `ppo_clip` or `reinforce`.
    pub loss_type: String,
}

/// DAPO's dynamic sampling (`algorithm.filter_groups`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilterGroupsConfig {
    pub enable: bool,
    pub metric: Option<String>,
    pub max_num_gen_batches: u64,
    pub max_inflight_gen_batches: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KlControlConfig {
    /// `fixed` or `adaptive`.
    #[serde(rename = "type")]
    pub kind: String,
    pub kl_coef: f64,
    pub horizon: u64,
    pub target_kl: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PfPpoConfig {
    pub reweight_method: String,
    pub weight_pow: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainerConfig {
    pub balance_batch: bool,
    pub total_epochs: u64,
    pub total_training_steps: Option<u64>,
    pub project_name: String,
    pub experiment_name: String,
    pub logger: OneOrMany,
    pub log_val_generations: u64,
    pub rollout_data_dir: Option<String>,
    pub validation_data_dir: Option<String>,
    pub nnodes: u64,
    pub n_gpus_per_node: u64,
    pub save_freq: i64,
    pub esi_redundant_time: f64,
    /// `auto`, `disable` or `resume_path`.
    pub resume_mode: String,
    pub resume_from_path: Option<String>,
    pub val_before_train: bool,
    pub val_only: bool,
    pub test_freq: i64,
    pub critic_warmup: u64,
    pub default_hdfs_dir: Option<String>,
    pub del_local_ckpt_after_load: bool,
    pub default_local_dir: String,
    pub max_actor_ckpt_to_keep: Option<u64>,
    pub max_critic_ckpt_to_keep: Option<u64>,
    pub ray_wait_register_center_timeout: u64,
    pub device: String,
    pub use_legacy_worker_impl: String,
    pub use_v1: bool,
    pub v1: Any,
    /// verl-rs extension (verl seeds per component): the host's seed.
    pub seed: u64,
    /// verl-rs extension: skip the old-log-prob pass on on-policy steps (one mini-batch, one
    /// epoch, no KL in the reward), whose result the update never reads.
    pub skip_on_policy_old_log_prob: bool,
}

/// verl-rs extension section `plugins:`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PluginsConfig {
    /// Directories searched for plugin libraries.
    pub search_path: Vec<String>,
    /// Backend plugin name or library path; `None`: derived from `actor.strategy`.
    pub backend: Option<String>,
    pub reward: RewardRouting,
}

/// Which reward plugin scores which `data_source`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RewardRouting {
    pub default: String,
    pub routes: BTreeMap<String, String>,
    /// The Python that runs `custom_reward_function` (null: `VERL_PYTHON`, else `python3`).
    pub python: Option<String>,
    /// Seconds a Python reward worker may take to answer one call.
    pub timeout_s: f64,
    /// Address-space limit of each Python reward worker, MB (null: none).
    pub memory_mb: Option<u64>,
    /// CPU-time limit of each Python reward worker, seconds (null: none).
    pub cpu_s: Option<u64>,
    /// `fail`: a failed reward ends the step with its error; `zero`: its rows score 0 and are
    /// counted in `reward/error_ratio`.
    pub on_error: String,
    /// Run reward plugin libraries in worker processes under the limits above (Python reward
    /// functions always are).
    pub isolate: bool,
}
