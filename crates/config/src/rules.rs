//! The rules of [`crate::surface`]: for every key of verl's config, what verl-rs does with it.
//! The page users read (`docs/config-keys.md`) is generated from this list, and tests check that
//! every key has exactly one most specific rule and that every test named here exists.
//!
//! Keys of the older layout (verl 0.7's `reward_model.*`, `critic.model.fsdp_config.*`, ...)
//! follow the rule of verl 0.10's name for them (`aliases.rs`), so only the newer names appear.

use serde_yaml::Value;

use crate::rule::{Rule, Verdict};
use crate::schema::Config;

// Patterns for keys that recur in several sections.
macro_rules! fsdp {
    ($k:literal) => {
        concat!("actor_rollout_ref.*.fsdp_config.", $k, "|critic.fsdp.", $k)
    };
}
macro_rules! meg {
    ($k:literal) => {
        concat!("actor_rollout_ref.*.megatron.", $k, "|critic.megatron.", $k)
    };
}
macro_rules! model {
    ($k:literal) => {
        concat!("actor_rollout_ref.model.", $k, "|critic.model.", $k)
    };
}
macro_rules! optim {
    ($k:literal) => {
        concat!("actor_rollout_ref.actor.optim.", $k, "|critic.optim.", $k)
    };
}
macro_rules! trained {
    ($k:literal) => {
        concat!("actor_rollout_ref.actor.", $k, "|critic.", $k)
    };
}
macro_rules! role {
    ($k:literal) => {
        concat!(
            "actor_rollout_ref.actor.",
            $k,
            "|actor_rollout_ref.ref.",
            $k,
            "|critic.",
            $k
        )
    };
}

// Tests cited by many rules.
const FIT_GRPO: &str =
    "host/tests/trainer_fit.rs::grpo_three_steps_log_verl_metrics_checkpoint_and_match_the_batch_plan";
const FIT_GAE: &str = "host/tests/trainer_fit.rs::gae_resume_from_step_two_continues_identically";
const FIT_DATA: &str = "host/src/trainer/tests.rs::data_keys_reach_the_data_loader";
const FIT_ROLLOUT: &str = "host/src/trainer/tests.rs::rollout_keys_reach_generation";
const FIT_ALGO: &str =
    "host/src/trainer/tests.rs::algorithm_keys_reach_the_advantage_and_kl_settings";
const PROMPTS: &str =
    "host/src/trainer/prompts.rs::tests::prompt_keys_choose_the_tokenizer_and_the_template";
const SECTIONS: &str =
    "crates/backend-kit/src/config.rs::tests::sections_read_the_verl_keys_they_name";
const LOSSES: &str =
    "crates/losses/src/config.rs::tests::loss_configs_read_the_verl_keys_they_name";
const BATCH_GRPO: &str = "crates/config/tests/batch.rs::grpo_plan_numbers";
const OPTIM_COSINE: &str = "crates/backend-kit/src/optim.rs::cosine_decays_to_min_ratio";
const TRAIN_TP_PP: &str =
    "tests/tests/train.rs::megatron_tensor_and_pipeline_parallel_ranks_train_like_one_fsdp_rank";
const MEG_DRY_RUN: &str = "tests/tests/cli.rs::megatron_dry_run_prints_each_roles_layout";
const MEG_OFFLOAD: &str =
    "plugins/megatron/tests/offload.rs::offload_moves_exactly_the_parameters_gradients_and_optimizer_state";
const MEG_SECTION: &str =
    "plugins/megatron/src/layout.rs::tests::megatron_section_reads_the_verl_keys_it_names";
const ENGINE_KEYS: &str =
    "plugins/fsdp/tests/speed_parity.rs::engine_keys_shape_generation_but_not_its_outputs";

// Why keys are harmless.
const VLLM: &str =
    "a vLLM/SGLang engine setting; verl-rs generates with its own engine inside the backend plugin";
const RAY: &str = "a Ray/cluster setting; verl-rs runs one process per GPU without Ray";
const PROFILER: &str = "a verl profiler setting; verl-rs has no verl profiler hooks (time phases with timing_s/* metrics, or run nsys around `verl run`)";
const KERNEL: &str =
    "a kernel/compilation choice that leaves the numbers as they are; verl-rs uses its own kernels";
const MEMORY: &str = "a memory-saving switch that leaves the numbers as they are; verl-rs manages its own activation memory";
const MEGATRON_PLUMBING: &str = "Megatron-LM plumbing (checkpoint conversion, bridges, DDP buckets) that verl-rs's Megatron backend does its own way";
const REF_NO_OPTIMIZER: &str =
    "the reference policy is frozen: it has no gradients or optimizer for this to apply to";
const ASYNC_ONLY: &str = "a setting of verl 0.10's asynchronous trainer modes, which verl-rs does not run (trainer.v1.trainer_mode is refused unless sync)";
const SPEC_DECODE: &str =
    "a speculative-decoding setting of vLLM/SGLang; verl-rs's engine does not speculate";

// What refused keys ask for, and what to use instead.
const RM_POOL: &str = "a separate GPU pool for the reward model";
const RM_POOL_INSTEAD: &str = "leave reward.reward_model.enable_resource_pool=false: the reward model is colocated with the actor and its weights leave the GPU between reward phases (reward.reward_model.rollout.free_cache_engine)";
const RM_ENGINE: &str = "a vLLM/SGLang server setting of verl's reward-model replicas; verl-rs runs the reward model as a backend role (one copy per rank, micro-batched by reward_model.micro_batch_size_per_gpu / forward_max_token_len_per_gpu)";
const RM_TESTS: &[&str] = &["tests/tests/reward_model.rs::grpo_trains_against_a_reward_model_with_another_tokenizer_beside_a_rule_reward", "tests/tests/reward_model.rs::a_pure_rust_genrm_plugin_judges_with_the_hosts_generation_model"];
const RM_SWITCH: &str = "host/src/trainer/reward/tests.rs::the_reward_model_reads_the_response_in_its_own_template_cut_to_max_length";
const RM_MICRO: &str =
    "crates/backend-kit/src/reward_model.rs::tests::micro_batching_leaves_the_scores_as_they_are";
const RM_SPEC: &str =
    "host/src/trainer/reward_model.rs::tests::the_backend_spec_follows_verls_keys";
const CUSTOM_FN_INSTEAD: &str = "give the reward as a function (custom_reward_function.path / name, verl's naive manager calls it) or write a reward plugin";
const PY_TESTS: &[&str] =
    &["tests/tests/python_reward.rs::a_grpo_job_scores_with_the_users_python_file"];
const PY_LIMITS: &[&str] = &["tests/tests/python_reward.rs::a_hanging_crashing_or_hungry_reward_ends_the_step_by_name_or_scores_zero"];
const LORA_TESTS: &[&str] = &[
    "crates/backend-kit/src/config.rs::tests::lora_keys_make_the_adapter_plan",
    "tests/tests/quickstart.rs::grpo_with_lora_learns_keeps_the_base_and_refers_to_it",
    "plugins/fsdp/tests/roles.rs::lora_actor_trains_its_adapters_and_its_base_is_the_reference",
];
const LORA_MODULES_TESTS: &[&str] = &[
    "crates/backend-kit/src/config.rs::tests::lora_keys_make_the_adapter_plan",
    "crates/nn/tests/lora.rs::target_and_exclude_modules_select_projections_as_peft_does",
];
const LORA_ADAPTER_TESTS: &[&str] = &[
    "crates/backend-kit/src/config.rs::tests::lora_keys_make_the_adapter_plan",
    "plugins/fsdp/tests/roles.rs::lora_actor_trains_its_adapters_and_its_base_is_the_reference",
];
const CRITIC_LORA_TESTS: &[&str] =
    &["plugins/fsdp/tests/roles.rs::critic_lora_trains_its_adapters_and_value_head_only"];
const MULTI_TURN: &str = "a multi-turn setting verl-rs does not have";
const MULTI_TURN_INSTEAD: &str = "verl-rs runs verl's tool agent loop with the multi_turn keys listed on this page; leave this one unset";
const MT_CONFIG: &str =
    "crates/config/src/multi_turn.rs::tests::multi_turn_reads_verls_keys_with_verls_defaults";
const MT_TOKENS: &str =
    "host/src/trainer/agent/tests.rs::tool_turns_are_the_tokens_one_pass_over_the_conversation_gives";
const MT_LIMITS: &str =
    "host/src/trainer/agent/tests.rs::conversations_end_where_verls_loop_ends_them";
const MT_E2E: &str =
    "tests/tests/multi_turn.rs::grpo_with_a_calculator_trains_on_the_models_own_tokens";
const MT_TRUNCATE: &str =
    "host/src/trainer/agent/tests.rs::tool_responses_are_cut_as_verl_cuts_them";
const MT_PARSE: &str =
    "host/src/trainer/agent/tests.rs::hermes_calls_are_parsed_as_verl_parses_them";
const ULYSSES: &str = "Ulysses sequence parallelism";
const ULYSSES_INSTEAD: &str =
    "set it to 1 (with Megatron, long sequences can be split with tensor/pipeline parallelism)";
const VL: &str = "multimodal (image/video/audio) inputs";
const VL_INSTEAD: &str = "verl-rs trains text-only models; drop the multimodal keys";
const MTP: &str = "multi-token prediction";
const MTP_INSTEAD: &str = "set it to false";
const QAT: &str = "quantization-aware training";
const QAT_INSTEAD: &str = "set qat.enable=false";
const DISTILL: &str = "on-policy distillation from teacher models";
const DISTILL_INSTEAD: &str = "set distillation.enabled=false";
const DAPO_FILTER: &str = "DAPO's dynamic sampling (regenerate until groups have reward variance)";
const DAPO_FILTER_INSTEAD: &str = "set algorithm.filter_groups.enable=false";
const ROLLOUT_CACHE: &str = "replaying cached rollouts instead of generating";
const ROLLOUT_CACHE_INSTEAD: &str = "leave the rollout cache off";
const DIST_CKPT: &str = "loading weights from a Megatron distributed checkpoint";
const DIST_CKPT_INSTEAD: &str = "verl-rs loads HF safetensors from model.path";
const MCORE_LR: &str = "Megatron-LM's learning-rate schedule keys";
const MCORE_LR_INSTEAD: &str = "verl-rs's Megatron backend takes verl's FSDP schedule keys: optim.lr_scheduler_type (constant, cosine), optim.min_lr_ratio, optim.lr_warmup_steps(_ratio), optim.num_cycles";
const MCORE_OPT: &str = "a Megatron-LM optimizer variant (precision-aware, layer-wise, Muon)";
const MCORE_OPT_INSTEAD: &str = "verl-rs trains with AdamW over fp32 master weights";
const ROUTER_REPLAY: &str = "MoE router replay";
const ROUTER_REPLAY_INSTEAD: &str = "leave router replay disabled";

pub static RULES: &[Rule] = &[
    // ---- the backend ----
    Rule::acts(
        "model_engine",
        "picks the backend: dp (FSDP) or megatron; one setting with actor_rollout_ref.actor.strategy",
        &["crates/config/tests/layouts.rs::model_engine_and_strategy_are_one_setting"],
    )
    .checked(engine),
    Rule::acts(
        "actor_rollout_ref.actor.strategy",
        "picks the backend plugin (fsdp/fsdp2 -> fsdp, megatron -> megatron) unless plugins.backend names one",
        &[
            "crates/config/tests/load.rs::megatron_job_maps_to_the_megatron_plugin",
            MEG_DRY_RUN,
        ],
    ),
    Rule::acts(
        "actor_rollout_ref.ref.strategy|critic.strategy",
        "must name the actor's backend: every role runs on the one backend plugin",
        &["crates/config/tests/layouts.rs::roles_run_on_one_backend"],
    )
    .checked(same_backend),
    Rule::harmless(fsdp!("strategy"), "the engine block's copy of the role's strategy"),
    Rule::refused(
        "actor_rollout_ref.hybrid_engine",
        "separate rollout and training workers",
        "verl-rs always generates with the training weights (hybrid engine); set it to true",
    ),
    Rule::harmless("actor_rollout_ref.nccl_timeout|critic.nccl_timeout", "collective timeouts come from the host's rendezvous; a larger timeout changes no numbers"),
    // ---- data ----
    Rule::acts("data.train_files", "training parquet/JSONL files", &[FIT_GRPO]),
    Rule::acts("data.val_files", "validation files", &[FIT_GRPO]),
    Rule::acts("data.tokenizer", "the tokenizer folder (before model.tokenizer_path and model.path)", &[PROMPTS]),
    Rule::acts("data.prompt_key", "the column holding the chat messages", &[FIT_DATA, "crates/data/tests/load.rs::plain_string_prompt_column_and_custom_prompt_key"]),
    Rule::acts("data.reward_fn_key", "the column whose value routes a row to its reward (verl's data_source)", &[FIT_DATA, "crates/data/tests/load.rs::reward_fn_key_names_the_column_that_routes_rewards"]),
    Rule::acts("data.max_prompt_length", "prompt width: longer prompts are truncated or filtered, shorter ones left-padded", &["host/src/trainer/prompts.rs::tests::prompts_are_templated_truncated_and_left_padded", FIT_DATA]),
    Rule::acts("data.max_response_length", "response length (the default of rollout.response_length)", &[FIT_ROLLOUT]),
    Rule::acts("data.train_batch_size", "prompts per step", &[FIT_GRPO, BATCH_GRPO, FIT_DATA]),
    Rule::acts("data.val_batch_size", "prompts per validation batch (null: the whole set)", &[FIT_DATA, "crates/data/tests/loader.rs::validation_loader_keeps_the_tail_and_defaults_to_one_batch"]),
    Rule::acts("data.train_max_samples", "at most this many training rows (-1: all)", &[FIT_DATA, "crates/data/tests/load.rs::prepare_applies_max_samples_then_filter"]),
    Rule::acts("data.val_max_samples", "at most this many validation rows (-1: all)", &[FIT_DATA, "crates/data/tests/load.rs::prepare_applies_max_samples_then_filter"]),
    Rule::acts("data.shuffle", "shuffles the training rows each epoch", &[FIT_DATA, "crates/data/tests/loader.rs::train_options_follow_verl_config"]),
    Rule::acts("data.seed", "the shuffle seed (null: trainer.seed)", &[FIT_DATA, "crates/data/tests/loader.rs::shuffle_is_reproducible_per_seed_and_differs_across_seeds_and_epochs"]),
    Rule::acts("data.validation_shuffle", "shuffles the validation rows", &[FIT_DATA]),
    Rule::acts("data.filter_overlong_prompts", "drops prompts longer than data.max_prompt_length after the chat template", &[FIT_DATA, "crates/data/tests/load.rs::prepare_applies_max_samples_then_filter"]),
    Rule::acts("data.truncation", "error, left, right or middle truncation of long prompts", &[FIT_DATA, "crates/data/src/config.rs::tests::left_keeps_the_tail_right_keeps_the_head"]),
    Rule::acts("data.apply_chat_template_kwargs", "extra variables for the chat template (e.g. enable_thinking)", &[PROMPTS]),
    Rule::harmless("data.use_shm", "loads through shared memory; verl-rs reads files directly"),
    Rule::harmless("data.dataloader_num_workers", "verl-rs's host loads data in-process"),
    Rule::harmless("data.filter_overlong_prompts_workers", "verl-rs's host filters in-process"),
    Rule::harmless("data.trust_remote_code", "verl-rs runs no Python model or tokenizer code"),
    Rule::harmless("data.return_raw_input_ids", "a field of verl's Python dataset rows; verl-rs's host keeps what its plugins need"),
    Rule::harmless("data.return_raw_chat", "a field of verl's Python dataset rows; verl-rs's host keeps the chat for every row"),
    Rule::harmless("data.return_full_prompt", "a field of verl's Python dataset rows; verl-rs's host keeps what its plugins need"),
    Rule::acts("data.image_key", "the column of images; rows carrying images are refused (text-only models)", &["crates/data/tests/load.rs::rows_with_images_videos_or_audio_are_refused_by_name"]),
    Rule::acts("data.video_key", "the column of videos; rows carrying videos are refused (text-only models)", &["crates/data/tests/load.rs::rows_with_images_videos_or_audio_are_refused_by_name"]),
    Rule::acts("data.audio_key", "the column of audio; rows carrying audio are refused (text-only models)", &["crates/data/tests/load.rs::rows_with_images_videos_or_audio_are_refused_by_name"]),
    Rule::harmless("data.image_patch_size", "an image preprocessing setting; rows with images are refused"),
    Rule::harmless("data.return_multi_modal_inputs", "an image preprocessing setting; rows with images are refused"),
    Rule::refused("data.mm_processor_kwargs", VL, VL_INSTEAD),
    Rule::refused("data.custom_cls.*", "a custom Python dataset class", "convert the data to verl-format parquet (prompt, data_source, reward_model.ground_truth, extra_info)"),
    Rule::refused("data.sampler.*", "a custom Python sampler (curriculum)", "verl-rs samples with data.shuffle and data.seed"),
    Rule::refused("data.datagen.*", "a Python data generator", "generate the data into parquet before training"),
    Rule::acts("data.tool_config_path", "the overlong-prompt filter renders a tool agent's prompt with the tools of actor_rollout_ref.rollout.multi_turn.tool_config_path (verl's default for this key)", &[MT_TOKENS]).checked(same_tool_config),
    Rule::refused("data.function_tool_path", "Python @function_tool functions", "declare the tools in actor_rollout_ref.rollout.multi_turn.tool_config_path: the built-ins (calculator, gsm8k, python) or a tool plugin"),
    Rule::refused("data.gen_batch_size", "generating for a different number of prompts than data.train_batch_size (DAPO)", "leave it null"),
    Rule::refused("data.continuous_token.*", "continuous-token training", "leave data.continuous_token.enable=false"),
    // ---- model ----
    Rule::acts(model!("path"), "the HF model folder", &["crates/fsdp-engine/src/lib.rs::missing_model_path_names_the_key", FIT_GRPO]),
    Rule::acts("actor_rollout_ref.model.tokenizer_path", "the tokenizer folder (after data.tokenizer, before model.path)", &[PROMPTS]),
    Rule::harmless("critic.model.tokenizer_path", "the critic reads no text"),
    Rule::acts("actor_rollout_ref.model.custom_chat_template", "a Jinja chat template replacing the tokenizer's", &[PROMPTS]),
    Rule::harmless("critic.model.custom_chat_template", "the critic reads no text"),
    Rule::refused(model!("hf_config_path"), "a model config from another folder", "put the config.json in model.path"),
    Rule::refused(model!("external_lib"), "importing a Python module to register a model", "verl-rs supports the architectures `verl plugin inspect` lists"),
    Rule::refused(model!("override_config"), "overriding the HF model config", "edit the model folder's config.json"),
    Rule::harmless(model!("use_shm"), "loads the model through shared memory; verl-rs reads the files directly"),
    Rule::harmless(model!("trust_remote_code"), "verl-rs runs no Python model code"),
    Rule::acts(model!("enable_gradient_checkpointing"), "recomputes activations in the backward pass (FSDP; Megatron uses override_transformer_config.recompute_*)", &[SECTIONS, "plugins/fsdp/tests/roles.rs::gradient_accumulation_does_not_depend_on_micro_batch_boundaries"]).checked(fsdp_acts_megatron_warns),
    Rule::harmless(model!("enable_activation_offload"), MEMORY),
    Rule::acts(model!("use_remove_padding"), "drops padding from the log-prob, value and update passes (FSDP; Megatron always packs)", &[SECTIONS, "plugins/fsdp/tests/speed_parity.rs::remove_padding_trains_like_the_padded_path"]).checked(fsdp_acts_megatron_warns),
    Rule::acts("actor_rollout_ref.model.lora_rank", "LoRA adapters of this rank on the policy (FSDP): the base frozen, the reference is the base with adapters off", LORA_TESTS).checked(lora_on_fsdp),
    Rule::acts("actor_rollout_ref.model.lora_alpha", "the LoRA scale alpha / rank", LORA_TESTS).checked(lora_setting),
    Rule::acts("actor_rollout_ref.model.target_modules", "the projections that get adapters (PEFT's all-linear, names or a regex)", LORA_MODULES_TESTS).checked(lora_setting),
    Rule::acts("actor_rollout_ref.model.exclude_modules", "projections left without adapters (PEFT's matching)", LORA_MODULES_TESTS).checked(lora_setting),
    Rule::acts("actor_rollout_ref.model.lora_adapter_path", "a PEFT adapter folder the policy's adapters start from (its adapter_config.json decides rank, alpha and modules)", LORA_ADAPTER_TESTS).checked(lora_on_fsdp),
    Rule::acts("critic.model.lora_rank", "LoRA adapters of this rank on the critic (FSDP): its base frozen, the value head trained in full", CRITIC_LORA_TESTS).checked(critic_lora_on_fsdp),
    Rule::acts("critic.model.lora_adapter_path", "a PEFT adapter folder the critic's adapters start from", CRITIC_LORA_TESTS).checked(critic_lora_on_fsdp),
    Rule::acts("critic.model.lora_alpha|critic.model.target_modules|critic.model.exclude_modules", "the critic's LoRA scale and projections, as the policy's", CRITIC_LORA_TESTS).checked(critic_lora_setting),
    Rule::harmless("actor_rollout_ref.model.lora.merge", "how verl hands LoRA weights to vLLM/SGLang (merged into the base, or as adapters); verl-rs's engine decodes with the adapters in place and syncs no weights"),
    Rule::refused(model!("lora.**"), "Megatron-Bridge's LoRA block (model.lora.*)", "on the FSDP backend set actor_rollout_ref.model.lora_rank / lora_alpha / target_modules; the Megatron backend has no LoRA"),
    Rule::harmless(model!("use_liger"), KERNEL),
    Rule::harmless(model!("use_fused_kernels"), KERNEL),
    Rule::harmless(model!("fused_kernel_options.*"), KERNEL),
    Rule::harmless(model!("tiled_mlp.*"), MEMORY),
    Rule::refused(model!("mtp.*"), MTP, MTP_INSTEAD),
    Rule::harmless(model!("mtp.speculative_algorithm"), SPEC_DECODE),
    Rule::harmless(model!("mtp.speculative_num_steps"), SPEC_DECODE),
    Rule::harmless(model!("mtp.speculative_eagle_topk"), SPEC_DECODE),
    Rule::harmless(model!("mtp.speculative_num_draft_tokens"), SPEC_DECODE),
    Rule::harmless(model!("mtp.method"), SPEC_DECODE),
    Rule::harmless(model!("mtp.num_speculative_tokens"), SPEC_DECODE),
    // ---- actor: batches and loss ----
    Rule::acts("actor_rollout_ref.actor.rollout_n", "responses per prompt the update assumes (rollout.n)", &[SECTIONS]).checked(equals_rollout_n),
    Rule::acts("actor_rollout_ref.actor.ppo_mini_batch_size", "prompts per optimizer step", &[BATCH_GRPO, SECTIONS, "tests/tests/train.rs::on_policy_steps_skip_the_old_log_prob_pass_without_changing_any_metric"]),
    Rule::acts("actor_rollout_ref.actor.ppo_micro_batch_size", "deprecated global micro-batch (divided by the data-parallel size)", &["crates/config/tests/batch.rs::deprecated_global_micro_batch", SECTIONS]),
    Rule::acts("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "rows per gradient-accumulation micro-batch", &["crates/config/tests/batch.rs::micro_batch_does_not_divide_the_per_rank_mini_batch", SECTIONS]),
    Rule::acts("actor_rollout_ref.actor.use_dynamic_bsz", "packs micro-batches by token budget", &["crates/config/tests/batch.rs::micro_batch_required_unless_dynamic", SECTIONS]),
    Rule::acts("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "the token budget of dynamic micro-batches", &["crates/config/tests/batch.rs::dynamic_batches_need_room_for_one_sequence", SECTIONS]),
    Rule::acts("actor_rollout_ref.actor.ppo_epochs", "passes over each step's batch", &[BATCH_GRPO, SECTIONS]),
    Rule::acts("actor_rollout_ref.actor.clip_ratio", "the PPO clip range where clip_ratio_low/high are null (verl's rule)", &["crates/losses/tests/behaviour.rs::clip_ratio_low_and_high_fall_back_to_clip_ratio", LOSSES]).checked(clip_ratio_fallback),
    Rule::acts("actor_rollout_ref.actor.clip_ratio_low", "the lower PPO clip range", &["crates/losses/tests/golden.rs::every_owned_golden_case_matches_verl", LOSSES]),
    Rule::acts("actor_rollout_ref.actor.clip_ratio_high", "the upper PPO clip range (DAPO's clip-higher)", &["crates/losses/tests/behaviour.rs::clip_ratio_low_and_high_fall_back_to_clip_ratio", LOSSES]),
    Rule::acts("actor_rollout_ref.actor.clip_ratio_c", "the dual-clip bound (vanilla); the importance-ratio truncation (dppo_tv, dppo_kl)", &["crates/losses/tests/behaviour.rs::dual_clip_bound_must_exceed_one", LOSSES, "crates/config/tests/load.rs::loss_keys_the_chosen_policy_loss_does_not_read_are_named_as_ignored"]).checked(clip_ratio_c_use),
    Rule::acts("actor_rollout_ref.actor.tau_pos", "SAPO's gate temperature for positive advantages", &[LOSSES, "crates/config/tests/load.rs::loss_keys_the_chosen_policy_loss_does_not_read_are_named_as_ignored"]).checked(sapo_only),
    Rule::acts("actor_rollout_ref.actor.tau_neg", "SAPO's gate temperature for negative advantages", &[LOSSES, "crates/config/tests/load.rs::loss_keys_the_chosen_policy_loss_does_not_read_are_named_as_ignored"]).checked(sapo_only),
    Rule::acts("actor_rollout_ref.actor.policy_loss.loss_mode", "the policy loss: vanilla, gspo, sapo, gpg, cispo, geo_mean, dppo_tv, dppo_kl", &["crates/losses/tests/behaviour.rs::unknown_loss_mode_names_the_key_and_lists_valid_modes", "crates/losses/tests/golden.rs::every_owned_golden_case_matches_verl", "crates/losses/tests/golden.rs::gmpo_and_dppo_match_verl_with_their_gradients"]).checked(loss_mode),
    Rule::refused("actor_rollout_ref.actor.policy_loss.*", "a setting of a policy loss verl-rs does not have (clip_cov, kl_cov, dro)", "use policy_loss.loss_mode vanilla, gspo, sapo, gpg, cispo, geo_mean, dppo_tv or dppo_kl"),
    Rule::acts(trained!("loss_agg_mode"), "how token losses are aggregated", &["crates/losses/tests/behaviour.rs::unknown_agg_mode_and_kl_type_are_rejected_with_valid_names", LOSSES]),
    Rule::acts(trained!("loss_scale_factor"), "the divisor of seq-mean-token-sum-norm", &[LOSSES]),
    Rule::acts("actor_rollout_ref.actor.entropy_coeff", "the entropy bonus", &["crates/losses/tests/behaviour.rs::actor_loss_combines_terms_with_their_coefficients", LOSSES]),
    Rule::acts("actor_rollout_ref.actor.calculate_entropy", "computes the entropy in the update (actor/entropy)", &[SECTIONS]),
    Rule::acts("actor_rollout_ref.actor.use_kl_loss", "adds a KL loss against the reference (and creates the reference)", &["plugins/fsdp/tests/roles.rs::kl_loss_and_entropy_metrics_with_their_inputs", LOSSES]),
    Rule::acts("actor_rollout_ref.actor.kl_loss_coef", "the KL loss weight", &["crates/losses/tests/behaviour.rs::actor_loss_combines_terms_with_their_coefficients", LOSSES]),
    Rule::acts("actor_rollout_ref.actor.kl_loss_type", "the KL estimator of the KL loss", &["crates/losses/tests/behaviour.rs::unknown_agg_mode_and_kl_type_are_rejected_with_valid_names", LOSSES]).checked(kl_loss_type),
    Rule::acts("actor_rollout_ref.actor.use_prefix_grouper", "the samples of a prompt share its forward (FSDP; Megatron refuses it)", &["plugins/megatron/src/validate.rs::consistent_attention_and_prefix_grouper_are_refused_by_name", SECTIONS]),
    Rule::refused(trained!("shuffle"), "shuffling the rows of each mini-batch split", "leave it false: verl-rs splits mini-batches in order, as verl's actor does"),
    Rule::refused(trained!("data_loader_seed"), "a seed for shuffled mini-batches", "leave it at its default (mini-batches are not shuffled)"),
    Rule::acts(optim!("clip_grad"), "the gradient-norm clip (one setting with grad_clip)", &["crates/config/tests/layouts.rs::grad_clip_and_clip_grad_are_one_setting"]),
    Rule::harmless("**.use_torch_compile", KERNEL),
    Rule::harmless("actor_rollout_ref.actor.use_fused_kernels", KERNEL),
    Rule::harmless("**.entropy_from_logits_with_chunking", MEMORY),
    Rule::harmless("**.entropy_from_logits_chunk_size", MEMORY),
    Rule::harmless("**.entropy_checkpointing", MEMORY),
    Rule::harmless("**.pad_to_length", KERNEL),
    Rule::harmless("**.pad_to_length_bucket", KERNEL),
    Rule::harmless("actor_rollout_ref.actor.use_remove_padding", "a copy of model.use_remove_padding, which is the key that acts"),
    Rule::refused(role!("ulysses_sequence_parallel_size"), ULYSSES, ULYSSES_INSTEAD),
    Rule::refused(fsdp!("ulysses_sequence_parallel_size"), ULYSSES, ULYSSES_INSTEAD),
    Rule::refused("actor_rollout_ref.actor.calculate_sum_pi_squared", "the sum of squared token probabilities (optimal-token-baseline estimators)", "leave it false"),
    Rule::refused("actor_rollout_ref.actor.sum_pi_squared_checkpointing", "the sum of squared token probabilities (optimal-token-baseline estimators)", "leave it false"),
    Rule::refused(role!("load_weight"), "a randomly initialised model", "verl-rs loads the weights in model.path; leave load_weight=true"),
    Rule::refused("actor_rollout_ref.actor.freeze_vision_tower", VL, VL_INSTEAD),
    Rule::refused("actor_rollout_ref.actor.qat.*", QAT, QAT_INSTEAD),
    Rule::refused(fsdp!("qat.*"), QAT, QAT_INSTEAD),
    Rule::refused(meg!("qat.*"), QAT, QAT_INSTEAD),
    Rule::refused("actor_rollout_ref.rollout.qat", QAT, QAT_INSTEAD),
    Rule::refused("actor_rollout_ref.*.router_replay.*", ROUTER_REPLAY, ROUTER_REPLAY_INSTEAD),
    Rule::refused(meg!("router_replay.*"), ROUTER_REPLAY, ROUTER_REPLAY_INSTEAD),
    // ---- checkpoints ----
    Rule::acts(trained!("checkpoint.save_contents"), "what a checkpoint holds: model, optimizer, extra (always) and hf_model (an HF export)", &["crates/config/tests/layouts.rs::checkpoint_contents_are_the_full_set_plus_an_hf_export", "host/tests/trainer_fit.rs::hf_model_in_save_contents_exports_the_policy_with_each_checkpoint"]).checked(save_contents),
    Rule::acts(trained!("checkpoint.load_contents"), "what a resume loads: model, optimizer and extra", &["crates/config/tests/layouts.rs::checkpoint_contents_are_the_full_set_plus_an_hf_export"]).checked(load_contents),
    Rule::harmless(trained!("checkpoint.async_save"), "writes checkpoints in the background; verl-rs writes them synchronously (same files)"),
    Rule::harmless(trained!("checkpoint.strict"), "verl-rs always loads checkpoints strictly"),
    Rule::harmless(trained!("checkpoint.mbridge_config"), MEGATRON_PLUMBING),
    // ---- optimizer ----
    Rule::acts(optim!("optimizer"), "the optimizer: AdamW", &["plugins/fsdp/tests/roles.rs::config_errors_name_the_key"]).checked(optimizer),
    Rule::harmless(optim!("optimizer_impl"), "where verl imports the optimizer from; verl-rs has its own AdamW"),
    Rule::acts(optim!("lr"), "the learning rate", &["crates/backend-kit/src/optim.rs::constant_with_warmup_ratio", SECTIONS]),
    Rule::acts(optim!("lr_warmup_steps_ratio"), "warm-up as a fraction of the training steps", &["crates/backend-kit/src/optim.rs::constant_with_warmup_ratio", SECTIONS]),
    Rule::acts(optim!("lr_warmup_steps"), "warm-up steps (>= 0 wins over the ratio)", &[OPTIM_COSINE, SECTIONS]),
    Rule::acts(optim!("total_training_steps"), "the schedule's length (-1: the trainer's)", &[OPTIM_COSINE, SECTIONS]),
    Rule::acts(optim!("weight_decay"), "AdamW's decoupled weight decay", &["crates/backend-kit/src/optim.rs::adamw_matches_the_closed_form_first_step", SECTIONS]),
    Rule::acts(optim!("betas"), "AdamW's betas", &[SECTIONS]),
    Rule::acts(optim!("min_lr_ratio"), "the cosine schedule's floor", &[OPTIM_COSINE, SECTIONS]),
    Rule::acts(optim!("num_cycles"), "the cosine schedule's cycles", &[SECTIONS]),
    Rule::acts(optim!("lr_scheduler_type"), "constant or cosine", &[OPTIM_COSINE, SECTIONS]).checked(scheduler),
    Rule::acts(optim!("warmup_style"), "deprecated spelling of lr_scheduler_type (wins when set)", &[SECTIONS]).checked(scheduler),
    Rule::refused(optim!("override_optimizer_config"), "Megatron-LM optimizer overrides (CPU offload fractions, precision-aware optimizers)", "use megatron.optimizer_offload to keep the optimizer on the host"),
    Rule::harmless(optim!("zero_indexed_step"), "verl-rs's schedules count steps from 0, verl's default"),
    Rule::refused(optim!("lr_warmup_init"), MCORE_LR, MCORE_LR_INSTEAD),
    Rule::refused(optim!("lr_decay_steps"), MCORE_LR, MCORE_LR_INSTEAD),
    Rule::refused(optim!("lr_decay_style"), MCORE_LR, MCORE_LR_INSTEAD),
    Rule::refused(optim!("min_lr"), MCORE_LR, MCORE_LR_INSTEAD),
    Rule::refused(optim!("weight_decay_incr_style"), MCORE_LR, MCORE_LR_INSTEAD),
    Rule::refused(optim!("lr_wsd_decay_style"), MCORE_LR, MCORE_LR_INSTEAD),
    Rule::refused(optim!("lr_wsd_decay_steps"), MCORE_LR, MCORE_LR_INSTEAD),
    Rule::refused(optim!("use_checkpoint_opt_param_scheduler"), MCORE_LR, MCORE_LR_INSTEAD),
    Rule::refused(optim!("use_precision_aware_optimizer"), MCORE_OPT, MCORE_OPT_INSTEAD),
    Rule::refused(optim!("main_grads_dtype"), MCORE_OPT, MCORE_OPT_INSTEAD),
    Rule::refused(optim!("exp_avg_dtype"), MCORE_OPT, MCORE_OPT_INSTEAD),
    Rule::refused(optim!("exp_avg_sq_dtype"), MCORE_OPT, MCORE_OPT_INSTEAD),
    Rule::refused(optim!("use_layer_wise_distributed_optimizer"), MCORE_OPT, MCORE_OPT_INSTEAD),
    Rule::refused(optim!("muon_*"), MCORE_OPT, MCORE_OPT_INSTEAD),
    // ---- FSDP engine blocks (actor, ref, critic) ----
    Rule::acts(fsdp!("param_offload"), "keeps fp32 master weights on the host between steps", &[SECTIONS, "crates/fsdp-engine/src/actor/tests.rs::an_offloaded_reference_scores_on_loaded_parameters_and_puts_them_back"]).with("fsdp"),
    Rule::acts(fsdp!("optimizer_offload"), "keeps AdamW's state on the host between steps", &[SECTIONS]).with("fsdp"),
    Rule::acts(fsdp!("reshard_after_forward"), "frees gathered weights after each unit's forward (ZeRO-3) or keeps them for the backward", &[SECTIONS]).with("fsdp"),
    Rule::acts(fsdp!("model_dtype"), "the dtype of the master weights and optimizer state", &[SECTIONS]).with("fsdp"),
    Rule::acts(fsdp!("dtype"), "the compute dtype", &[SECTIONS, "plugins/fsdp/tests/roles.rs::config_errors_name_the_key"]).with("fsdp"),
    Rule::acts(fsdp!("mixed_precision"), "param_dtype (compute) and reduce_dtype (gradient reduce-scatter)", &["plugins/fsdp/tests/sharded.rs::bf16_gradient_reduction_follows_reduce_dtype", "crates/backend-kit/src/config.rs::tests::reduce_dtype_is_fp32_unless_mixed_precision_says_otherwise"]).with("fsdp"),
    Rule::acts(fsdp!("seed"), "the seed of weights the checkpoint lacks (a fresh value head)", &[SECTIONS]).with("fsdp"),
    Rule::acts(fsdp!("fsdp_size"), "the sharding group: -1 (or the world size) shards over every rank", &["crates/config/tests/layouts.rs::fsdp_size_shards_over_every_rank_or_is_refused"]).with("fsdp").checked(fsdp_size),
    Rule::harmless(fsdp!("wrap_policy"), "how verl groups modules into FSDP units; verl-rs shards per layer"),
    Rule::harmless(fsdp!("offload_policy"), MEMORY),
    Rule::harmless(fsdp!("forward_prefetch"), "verl-rs always prefetches the next unit's all-gather"),
    Rule::harmless(fsdp!("use_orig_params"), "an FSDP1 detail with no counterpart in verl-rs"),
    Rule::harmless(fsdp!("full_determinism"), "verl-rs has no deterministic-kernel switch: CPU runs repeat exactly, CUDA runs are not promised bitwise"),
    Rule::harmless(fsdp!("forward_only"), "the role decides (the reference never trains)"),
    Rule::harmless(meg!("forward_only"), "the role decides (the reference never trains)"),
    Rule::harmless(fsdp!("turbo_config.**"), "settings of verl's fsdp_turbo engine, which verl-rs does not have"),
    // ---- Megatron engine blocks ----
    Rule::acts(meg!("param_offload"), "parameters on the host between calls", &[MEG_OFFLOAD, MEG_SECTION]).with("megatron"),
    Rule::acts(meg!("grad_offload"), "gradient buffers on the host between updates", &[MEG_OFFLOAD, MEG_SECTION]).with("megatron"),
    Rule::acts(meg!("optimizer_offload"), "master weights and AdamW moments on the host between updates", &[MEG_OFFLOAD, MEG_SECTION]).with("megatron"),
    Rule::acts(meg!("tensor_model_parallel_size"), "tensor parallelism", &["plugins/megatron/tests/tp.rs::tp1_tp2_and_their_data_parallel_actor_updates_equal_one_fsdp_rank", MEG_DRY_RUN]).with("megatron"),
    Rule::acts(meg!("pipeline_model_parallel_size"), "pipeline parallelism", &["plugins/megatron/tests/pp.rs::pp2_tp2_pp2_and_pp2_dp2_actor_updates_equal_one_rank", MEG_DRY_RUN]).with("megatron"),
    Rule::acts(meg!("virtual_pipeline_model_parallel_size"), "interleaved pipeline chunks", &["plugins/megatron/tests/vpp.rs::checkpoints_move_between_pp2_vpp2_and_pp1", MEG_DRY_RUN]).with("megatron"),
    Rule::acts(meg!("expert_model_parallel_size"), "expert parallelism (MoE)", &["plugins/megatron/tests/moe.rs::bad_expert_layouts_name_the_key_and_the_valid_sizes", MEG_DRY_RUN]).with("megatron"),
    Rule::acts(meg!("expert_tensor_parallel_size"), "expert tensor parallelism (MoE; null: the TP size)", &["plugins/megatron/tests/etp.rs::expert_layout_errors_name_the_key_and_the_valid_sizes"]).with("megatron"),
    Rule::refused(meg!("context_parallel_size"), "context parallelism", "set it to 1"),
    Rule::acts(meg!("sequence_parallel"), "Megatron sequence parallelism (with TP > 1)", &["plugins/megatron/tests/sp.rs::tp2_with_and_without_sp_and_tp2_pp2_with_sp_equal_one_rank", MEG_SECTION]).with("megatron"),
    Rule::acts(meg!("use_distributed_optimizer"), "shards the optimizer state over data-parallel ranks", &[MEG_SECTION]).with("megatron"),
    Rule::acts(meg!("seed"), "the seed of weights the checkpoint lacks", &[MEG_SECTION]).with("megatron"),
    Rule::acts(meg!("dtype"), "the compute dtype", &[TRAIN_TP_PP, MEG_SECTION]).with("megatron"),
    Rule::acts(meg!("override_transformer_config"), "recompute_granularity/method/num_layers and moe_aux_loss_coeff act; kernel and fusion switches are ignored with a warning", &["plugins/megatron/tests/tp.rs::recomputed_and_kept_layers_update_alike"]).with("megatron").checked(transformer_overrides),
    Rule::refused(meg!("override_mcore_model_config"), "Megatron model-config overrides", "edit the model folder's config.json"),
    Rule::harmless(meg!("override_ddp_config"), MEGATRON_PLUMBING),
    Rule::refused(meg!("use_dist_checkpointing"), DIST_CKPT, DIST_CKPT_INSTEAD),
    Rule::refused(meg!("dist_checkpointing_path"), DIST_CKPT, DIST_CKPT_INSTEAD),
    Rule::harmless(meg!("dist_checkpointing_prefix"), MEGATRON_PLUMBING),
    Rule::harmless(meg!("use_mbridge"), MEGATRON_PLUMBING),
    Rule::harmless(meg!("vanilla_mbridge"), MEGATRON_PLUMBING),
    Rule::harmless(meg!("use_remove_padding"), "verl-rs's Megatron backend always packs sequences"),
    Rule::harmless(meg!("dist_ckpt_optim_fully_reshardable"), MEGATRON_PLUMBING),
    Rule::harmless(meg!("distrib_optim_fully_reshardable_mem_efficient"), MEGATRON_PLUMBING),
    Rule::harmless(meg!("pad_bshd_to_minibatch_max"), KERNEL),
    Rule::refused(meg!("dynamic_context_parallel"), "context parallelism", "leave it false"),
    Rule::refused(meg!("max_seqlen_per_dp_cp_rank"), "context parallelism", "leave it null"),
    Rule::refused(meg!("use_megatron_fsdp"), "Megatron-FSDP", "use model_engine=dp for FSDP, or megatron without it"),
    // The reference never trains: its optimizer and gradient settings mean nothing.
    Rule::harmless("actor_rollout_ref.ref.fsdp_config.optimizer_offload", REF_NO_OPTIMIZER),
    Rule::harmless("actor_rollout_ref.ref.fsdp_config.reshard_after_forward", REF_NO_OPTIMIZER),
    Rule::harmless("actor_rollout_ref.ref.fsdp_config.model_dtype", REF_NO_OPTIMIZER),
    Rule::harmless("actor_rollout_ref.ref.megatron.grad_offload", REF_NO_OPTIMIZER),
    Rule::harmless("actor_rollout_ref.ref.megatron.optimizer_offload", REF_NO_OPTIMIZER),
    Rule::harmless("actor_rollout_ref.ref.megatron.use_distributed_optimizer", REF_NO_OPTIMIZER),
    Rule::harmless("actor_rollout_ref.ref.megatron.override_transformer_config", "recomputation and auxiliary losses shape training; the reference only scores"),
    // ---- reference ----
    Rule::harmless("actor_rollout_ref.ref.rollout_n", "the reference scores each response once; rollout.n sets the count"),
    Rule::acts("actor_rollout_ref.*.log_prob_micro_batch_size", "deprecated global micro-batch of the log-prob pass", &["crates/config/tests/batch.rs::log_prob_micro_batches", SECTIONS]),
    Rule::acts("actor_rollout_ref.*.log_prob_micro_batch_size_per_gpu", "rows per log-prob micro-batch", &["crates/config/tests/batch.rs::log_prob_micro_batches", SECTIONS]),
    Rule::acts("actor_rollout_ref.*.log_prob_use_dynamic_bsz", "packs log-prob micro-batches by token budget", &[SECTIONS]),
    Rule::acts("actor_rollout_ref.*.log_prob_max_token_len_per_gpu", "the token budget of dynamic log-prob micro-batches", &[SECTIONS]),
    // ---- rollout ----
    Rule::harmless("actor_rollout_ref.rollout.name", VLLM),
    Rule::harmless("actor_rollout_ref.rollout.mode", VLLM),
    Rule::refused("actor_rollout_ref.rollout.nnodes", "a separate pool of rollout nodes", "verl-rs generates on the training ranks; leave it 0"),
    Rule::harmless("actor_rollout_ref.rollout.n_gpus_per_node", "the rollout runs on the training ranks (trainer.n_gpus_per_node)"),
    Rule::acts("actor_rollout_ref.rollout.n", "responses per prompt", &[BATCH_GRPO, FIT_ROLLOUT]),
    Rule::acts("actor_rollout_ref.rollout.temperature", "sampling temperature (also of the log-prob passes)", &[FIT_ROLLOUT]),
    Rule::acts("actor_rollout_ref.rollout.top_k", "top-k sampling", &[FIT_ROLLOUT, "crates/rollout/tests/generate.rs::top_k_one_and_tiny_top_p_equal_greedy"]),
    Rule::acts("actor_rollout_ref.rollout.top_p", "nucleus sampling", &[FIT_ROLLOUT, "crates/rollout/tests/generate.rs::top_k_one_and_tiny_top_p_equal_greedy"]),
    Rule::acts("actor_rollout_ref.rollout.do_sample", "false: greedy decoding", &[FIT_ROLLOUT]),
    Rule::acts("actor_rollout_ref.rollout.ignore_eos", "generates to the full length past EOS", &[FIT_ROLLOUT, "crates/rollout/tests/generate.rs::eos_stops_rows_pads_and_masks"]),
    Rule::acts("actor_rollout_ref.rollout.response_length", "the most tokens generated per response", &[FIT_ROLLOUT]),
    Rule::refused("actor_rollout_ref.rollout.prompt_length", "a rollout prompt width other than data.max_prompt_length", "set data.max_prompt_length (verl-rs pads and truncates prompts to it)"),
    Rule::acts("actor_rollout_ref.rollout.val_kwargs.*", "sampling of validation generations", &[FIT_ROLLOUT]),
    Rule::acts("actor_rollout_ref.rollout.gpu_memory_utilization", "the GPU memory fraction the KV cache may fill", &[SECTIONS, "plugins/fsdp/tests/speed_parity.rs::kv_budget_rejects_a_utilization_outside_zero_one"]),
    Rule::acts("actor_rollout_ref.rollout.max_num_seqs", "the most sequences decoding at once", &[ENGINE_KEYS, SECTIONS]),
    Rule::acts("actor_rollout_ref.rollout.max_num_batched_tokens", "the most prompt tokens per prefill", &[ENGINE_KEYS, SECTIONS]),
    Rule::acts("actor_rollout_ref.rollout.enforce_eager", "false: decode steps replay CUDA graphs", &[SECTIONS]),
    Rule::acts("actor_rollout_ref.rollout.cudagraph_capture_sizes", "the batch sizes decode graphs are captured for", &[SECTIONS]),
    Rule::acts("actor_rollout_ref.rollout.consistent_attention", "verl-rs: rollout and log-prob passes share one attention kernel (FSDP)", &[SECTIONS, "plugins/megatron/src/validate.rs::consistent_attention_and_prefix_grouper_are_refused_by_name"]),
    Rule::acts("actor_rollout_ref.rollout.calculate_log_probs", "reports rollout-vs-training log-prob metrics (runs the old-log-prob pass)", &["tests/tests/train.rs::on_policy_steps_skip_the_old_log_prob_pass_without_changing_any_metric"]),
    Rule::acts("actor_rollout_ref.rollout.tensor_model_parallel_size", "generation's tensor-parallel size, resharded from the training layout; each rollout group generates its own share of the prompts", &["plugins/megatron/tests/reshard.rs::every_rollout_tp_over_every_training_layout_generates_what_one_rank_does", "plugins/fsdp/tests/reshard.rs::every_rollout_tp_over_four_fsdp_ranks_generates_what_one_rank_does", "plugins/megatron/tests/tp_generate.rs::a_rollout_tp_the_layout_cannot_take_is_refused"]).checked(rollout_tp),
    Rule::acts("actor_rollout_ref.rollout.dtype", "must be the actor's compute dtype (generation uses the training weights)", &["crates/config/tests/layouts.rs::rollout_dtype_must_be_the_compute_dtype"]).checked(rollout_dtype),
    Rule::acts("actor_rollout_ref.rollout.logprobs_mode", "rollout log-probs are the training forward's (processed)", &["crates/config/tests/layouts.rs::raw_rollout_log_probs_are_refused"]).checked(logprobs_mode),
    Rule::refused("actor_rollout_ref.rollout.seed", "a rollout sampling seed of its own", "set trainer.seed: verl-rs seeds every sampling call from it"),
    Rule::harmless("actor_rollout_ref.rollout.full_determinism", "verl-rs's engine has no deterministic-kernel switch"),
    Rule::harmless("actor_rollout_ref.rollout.data_parallel_size", VLLM),
    Rule::harmless("actor_rollout_ref.rollout.expert_parallel_size", VLLM),
    Rule::harmless("actor_rollout_ref.rollout.moe_tensor_parallel_size", "TensorRT-LLM's MoE tensor parallelism (verl-rs has its own rollout engine)"),
    Rule::harmless("actor_rollout_ref.rollout.pipeline_model_parallel_size", VLLM),
    Rule::harmless("actor_rollout_ref.rollout.max_model_len", VLLM),
    Rule::harmless("actor_rollout_ref.rollout.free_cache_engine", "verl-rs's engine frees its KV cache after every generation"),
    Rule::harmless("actor_rollout_ref.rollout.enable_chunked_prefill", VLLM),
    Rule::harmless("actor_rollout_ref.rollout.enable_prefix_caching", "verl-rs's engine shares each prompt's prefill among its samples"),
    Rule::harmless("actor_rollout_ref.rollout.scheduling_policy", VLLM),
    Rule::harmless("actor_rollout_ref.rollout.load_format", VLLM),
    Rule::harmless("actor_rollout_ref.rollout.disable_log_stats", VLLM),
    Rule::harmless("actor_rollout_ref.rollout.multi_stage_wake_up", VLLM),
    Rule::harmless("actor_rollout_ref.rollout.skip_tokenizer_init", VLLM),
    Rule::harmless("actor_rollout_ref.rollout.engine_kwargs", VLLM),
    Rule::harmless("actor_rollout_ref.rollout.layered_summon", VLLM),
    Rule::harmless("actor_rollout_ref.rollout.layer_name_map.*", VLLM),
    Rule::harmless("actor_rollout_ref.rollout.prometheus.*", VLLM),
    Rule::harmless("actor_rollout_ref.rollout.checkpoint_engine.*", "how verl syncs weights into vLLM; verl-rs generates with the training weights"),
    Rule::harmless("actor_rollout_ref.rollout.disaggregation.*", VLLM),
    Rule::harmless("actor_rollout_ref.rollout.moe_load_balance_metrics_interval", VLLM),
    Rule::harmless("actor_rollout_ref.rollout.trace.*", "rollout tracing to weave/mlflow traces, which verl-rs does not have"),
    Rule::refused("actor_rollout_ref.rollout.quantization", "quantized (e.g. fp8) generation", "leave it null: verl-rs generates in the compute dtype"),
    Rule::refused("actor_rollout_ref.rollout.quantization_config_file", "quantized generation", "leave it null"),
    Rule::refused("actor_rollout_ref.rollout.over_sample_rate", "over-sampling (dropping the slowest rollouts)", "leave it 0"),
    Rule::refused("actor_rollout_ref.rollout.multi_turn.*", MULTI_TURN, MULTI_TURN_INSTEAD),
    Rule::acts("actor_rollout_ref.rollout.multi_turn.enable", "rolls out conversations: verl's tool agent loop on the host, token in / token out, the engine serving every other sequence while tools run", &[MT_CONFIG, MT_E2E]).checked(multi_turn_backend),
    Rule::acts("actor_rollout_ref.rollout.multi_turn.tool_config_path", "verl's tool YAML: the built-in tools (calculator, verl's gsm8k tool, a sandboxed python runner) and tools from tool plugins", &[MT_CONFIG, MT_E2E]),
    Rule::acts("actor_rollout_ref.rollout.multi_turn.max_assistant_turns|actor_rollout_ref.rollout.multi_turn.max_user_turns", "ends a conversation after that many model / tool turns (null: no limit)", &[MT_CONFIG, MT_LIMITS]),
    Rule::acts("actor_rollout_ref.rollout.multi_turn.max_parallel_calls", "the tool calls of one turn that run (the rest are dropped, as verl drops them)", &[MT_CONFIG, MT_LIMITS]),
    Rule::acts("actor_rollout_ref.rollout.multi_turn.max_tool_response_length|actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side", "cuts tool responses to that many characters, keeping the left, right or both ends", &[MT_CONFIG, MT_TRUNCATE]),
    Rule::acts("actor_rollout_ref.rollout.multi_turn.format", "the tool-call format parsed from the model's turns", &[MT_PARSE]).checked(hermes_format),
    Rule::acts("actor_rollout_ref.rollout.multi_turn.use_inference_chat_template", "false: trains on the token ids the model generated (verl-rs's only way)", &[MT_TOKENS]).checked(token_ids_only),
    Rule::harmless("actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode", "verl re-tokenises each turn and compares it with the whole conversation; verl-rs never re-tokenises what the model wrote (only the tool turns are tokenized, starting at the model's end-of-turn token), so there is nothing to compare"),
    Rule::refused("actor_rollout_ref.rollout.multi_turn.function_tool_path", "Python @function_tool functions", "declare the tools in multi_turn.tool_config_path: the built-ins (calculator, gsm8k, python) or a tool plugin"),
    Rule::refused("actor_rollout_ref.rollout.multi_turn.interaction_config_path", "interactions (a scripted user answering between turns)", "leave it null: verl-rs continues conversations with tool responses only"),
    Rule::refused("actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts", "repeating each multi-turn rollout", "leave it null and set actor_rollout_ref.rollout.n"),
    Rule::refused("actor_rollout_ref.rollout.agent.*", "a setting of verl's Python agent-loop workers", "leave it unset: verl-rs's agent loop runs on the host"),
    Rule::acts("actor_rollout_ref.rollout.agent.default_agent_loop", "the agent of rows without an agent_name column: single_turn_agent or tool_agent", &[MT_LIMITS]).checked(agent_loop_name),
    Rule::refused("actor_rollout_ref.rollout.agent.agent_loop_config_path", "custom Python agent loops", "use tool_agent (rows' agent_name or agent.default_agent_loop) with tools in multi_turn.tool_config_path"),
    Rule::refused("actor_rollout_ref.rollout.agent.custom_async_server.*", "a custom rollout server", "verl-rs generates with its own engine"),
    Rule::harmless("actor_rollout_ref.rollout.agent.num_workers", "agent-loop workers; verl-rs generates in the backend plugin"),
    Rule::refused("actor_rollout_ref.rollout.enable_rollout_routing_replay", ROUTER_REPLAY, ROUTER_REPLAY_INSTEAD),
    Rule::refused("actor_rollout_ref.rollout.mtp", MTP, MTP_INSTEAD),
    Rule::refused("actor_rollout_ref.rollout.skip_rollout", ROLLOUT_CACHE, ROLLOUT_CACHE_INSTEAD),
    Rule::harmless("actor_rollout_ref.rollout.skip_dump_dir", "the rollout cache's folder (the cache itself is refused)"),
    Rule::refused("actor_rollout_ref.rollout.skip.*", ROLLOUT_CACHE, ROLLOUT_CACHE_INSTEAD),
    Rule::refused("skip.**", ROLLOUT_CACHE, ROLLOUT_CACHE_INSTEAD),
    // ---- critic ----
    Rule::acts("critic.enable", "runs a critic (null: only for GAE)", &["crates/config/tests/batch.rs::train_batch_not_divisible_by_dp"]),
    Rule::acts("critic.rollout_n", "responses per prompt the critic update assumes (rollout.n)", &[SECTIONS]).checked(equals_rollout_n),
    Rule::acts("critic.ppo_mini_batch_size", "prompts per critic optimizer step", &["crates/config/tests/batch.rs::critic_rules", SECTIONS]),
    Rule::acts("critic.ppo_micro_batch_size", "deprecated global micro-batch of the critic update", &["crates/config/tests/batch.rs::critic_rules", SECTIONS]),
    Rule::acts("critic.ppo_micro_batch_size_per_gpu", "rows per critic micro-batch", &["crates/config/tests/batch.rs::critic_rules", SECTIONS]),
    Rule::acts("critic.use_dynamic_bsz", "packs critic micro-batches by token budget", &[SECTIONS]),
    Rule::acts("critic.ppo_max_token_len_per_gpu", "the critic update's token budget", &[SECTIONS]),
    Rule::acts("critic.forward_max_token_len_per_gpu", "the value pass's token budget", &[SECTIONS]),
    Rule::acts("critic.forward_micro_batch_size", "deprecated global micro-batch of the value pass", &[SECTIONS]),
    Rule::acts("critic.forward_micro_batch_size_per_gpu", "rows per value-pass micro-batch", &["crates/config/tests/batch.rs::critic_rules", SECTIONS]),
    Rule::acts("critic.ppo_epochs", "passes over each step's batch", &["crates/config/tests/batch.rs::ppo_plan_with_critic", SECTIONS]),
    Rule::acts("critic.cliprange_value", "the value clip range", &["crates/losses/tests/golden.rs::every_owned_golden_case_matches_verl", LOSSES]),
    // ---- rewards ----
    Rule::acts("reward.reward_model.enable", "scores responses with the reward model (every data_source without a plugins.reward.routes entry)", RM_TESTS),
    Rule::acts("reward.reward_model.model_path", "the reward model's HF folder (*ForSequenceClassification, Qwen2ForRewardModel)", RM_TESTS),
    Rule::refused("reward.reward_model.enable_resource_pool", RM_POOL, RM_POOL_INSTEAD),
    Rule::harmless("reward.reward_model.n_gpus_per_node|reward.reward_model.nnodes", "the size of a separate reward-model GPU pool, which verl-rs does not use (the reward model is colocated)"),
    Rule::acts("reward.reward_model.rollout.dtype", "the reward model's compute dtype (bfloat16, float32, float16)", &[RM_SPEC, "tests/tests/reward_model.rs::grpo_trains_against_a_reward_model_with_another_tokenizer_beside_a_rule_reward"]),
    Rule::acts("reward.reward_model.rollout.free_cache_engine", "true: the reward model's weights wait in pinned host memory outside the reward phase; false: they stay on the GPU", &[RM_SPEC, "crates/backend-kit/src/reward_model.rs::tests::an_offloaded_reward_model_scores_the_same_and_leaves_the_device"]),
    Rule::harmless("reward.reward_model.rollout.**", RM_ENGINE),
    Rule::harmless("reward_model.strategy", "the reward model runs in the job's backend plugin, whole on each rank; its scores do not depend on the strategy"),
    Rule::acts("reward_model.model.input_tokenizer", "the policy's tokenizer: responses are decoded with it and re-rendered with the reward model's own chat template (null: the reward model reads the policy's token ids as they are)", &[RM_SWITCH]),
    Rule::refused("reward_model.model.external_lib", "importing a Python module to register a model", "verl-rs supports the architectures `verl plugin inspect` lists"),
    Rule::refused("reward_model.model.override_config", "overriding the reward model's HF config", "edit the model folder's config.json"),
    Rule::harmless("reward_model.model.trust_remote_code", "verl-rs runs no Python model code (Qwen2ForRewardModel is built in)"),
    Rule::harmless("reward_model.model.use_shm|reward_model.model.use_remove_padding|reward_model.model.use_fused_kernels", "a loading or kernel switch that leaves the scores as they are"),
    Rule::harmless("reward_model.model.fsdp_config.**", "FSDP wrapping of the reward model; verl-rs holds one copy per rank and moves it off the GPU per reward.reward_model.rollout.free_cache_engine"),
    Rule::acts("reward_model.micro_batch_size", "deprecated global micro-batch of the reward model (divided by the world size)", &[RM_SPEC]),
    Rule::acts("reward_model.micro_batch_size_per_gpu", "rows per reward-model forward", &[RM_SPEC, RM_MICRO]),
    Rule::acts("reward_model.max_length", "the reward model's input is cut to this many tokens, from the right (null: the policy's prompt + response length)", &[RM_SWITCH]),
    Rule::acts("reward_model.use_dynamic_bsz", "packs reward-model micro-batches by token budget", &[RM_SPEC, RM_MICRO]),
    Rule::acts("reward_model.forward_max_token_len_per_gpu", "the reward model's token budget per forward", &[RM_SPEC, "tests/tests/reward_model.rs::grpo_trains_against_a_reward_model_with_another_tokenizer_beside_a_rule_reward"]),
    Rule::refused("reward_model.ulysses_sequence_parallel_size", ULYSSES, ULYSSES_INSTEAD),
    Rule::harmless("reward_model.megatron.**", "Megatron parallelism of the reward model; verl-rs holds the whole reward model on each rank"),
    Rule::harmless("reward_model.profiler.**|reward_model.nccl_timeout|reward_model.load_weight|reward_model.use_reward_loop|reward_model.launch_reward_fn_async", "plumbing of verl's reward workers that verl-rs does not have"),
    Rule::acts("reward.custom_reward_function.path", "the user's Python reward file, run unchanged in worker processes; it scores every data source without a plugins.reward.routes entry", PY_TESTS),
    Rule::acts("reward.custom_reward_function.name", "the function in custom_reward_function.path (default compute_score)", PY_TESTS),
    Rule::acts("reward.custom_reward_function.reward_kwargs", "keyword arguments of the Python reward function, or of the rule rewards (method, format_score, ...)", &["plugins/rewards/tests/golden_rewards.rs::reward_kwargs_reach_the_rule_rewards", "host/src/python_reward.rs::tests::a_users_file_scores_with_kwargs_dicts_and_async_functions"]),
    Rule::acts("reward.reward_manager.name", "verl's reward manager: naive, dapo (naive + the overlong penalty of reward.reward_kwargs), or batch (custom_reward_function called with lists)", &["crates/config/tests/layouts.rs::reward_managers_other_than_naive_and_dapo_are_refused", "host/src/python_reward.rs::tests::the_batch_manager_calls_the_function_once_with_lists"]).checked(reward_manager),
    Rule::acts("reward.reward_manager.source", "register: verl's built-in managers", &["crates/config/tests/layouts.rs::reward_managers_other_than_naive_and_dapo_are_refused"]).checked(reward_manager_source),
    Rule::refused("reward.reward_manager.module.*", "a custom Python reward manager", CUSTOM_FN_INSTEAD),
    Rule::acts("reward.reward_kwargs", "the dapo reward manager's overlong_buffer_cfg {enable, len, penalty_factor, log} and max_resp_len", &["host/src/trainer/reward/tests.rs::dapo_overlong_penalties_equal_verls_golden_cases", "crates/config/tests/layouts.rs::reward_managers_other_than_naive_and_dapo_are_refused"]).checked(reward_kwargs),
    Rule::acts("reward.num_workers", "Python reward worker processes (custom_reward_function); rule and plugin rewards score in the host", PY_TESTS),
    Rule::refused("reward.sandbox_fusion.url", "code execution in a Sandbox Fusion service", "leave it null"),
    Rule::harmless("reward.sandbox_fusion.*", "a Sandbox Fusion limit (the sandbox itself is refused)"),
    // ---- algorithm ----
    Rule::acts("algorithm.adv_estimator", "the advantage estimator", &[FIT_GRPO, FIT_GAE, "host/tests/trainer_fit.rs::remax_runs_with_a_greedy_baseline"]).checked(adv_estimator),
    Rule::acts("algorithm.gamma", "the discount (GAE, REINFORCE++)", &[FIT_ALGO, "crates/algos/src/advantage/tests.rs::gae_returns_are_lambda_returns_and_padding_is_skipped"]),
    Rule::acts("algorithm.lam", "GAE's lambda", &[FIT_ALGO, "crates/algos/src/advantage/tests.rs::gae_returns_are_lambda_returns_and_padding_is_skipped"]),
    Rule::acts("algorithm.norm_adv_by_std_in_grpo", "GRPO divides by the group's std (false: Dr. GRPO)", &[FIT_ALGO, "crates/algos/src/advantage/tests.rs::grpo_without_std_is_dr_grpo_mean_centering"]),
    Rule::acts("algorithm.use_kl_in_reward", "subtracts a KL penalty from the token rewards (and creates the reference)", &[FIT_GAE]),
    Rule::acts("algorithm.kl_penalty", "the KL estimator of the in-reward penalty", &[FIT_ALGO, "crates/algos/src/kl.rs::tests::estimators_match_their_formulas"]).checked(kl_penalty),
    Rule::acts("algorithm.kl_ctrl.type", "fixed or adaptive KL coefficient", &[FIT_ALGO, "crates/algos/src/kl.rs::tests::adaptive_controller_follows_verl_update_rule"]),
    Rule::acts("algorithm.kl_ctrl.kl_coef", "the (initial) KL coefficient", &[FIT_ALGO]),
    Rule::acts("algorithm.kl_ctrl.horizon", "the adaptive controller's horizon", &[FIT_ALGO, "crates/algos/src/kl.rs::tests::adaptive_controller_follows_verl_update_rule"]),
    Rule::acts("algorithm.kl_ctrl.target_kl", "the adaptive controller's target", &[FIT_ALGO, "crates/algos/src/kl.rs::tests::adaptive_controller_follows_verl_update_rule"]),
    Rule::refused("algorithm.filter_groups.*", DAPO_FILTER, DAPO_FILTER_INSTEAD),
    Rule::refused("algorithm.use_pf_ppo", "PF-PPO's reward-weighted resampling", "set it to false"),
    Rule::refused("algorithm.pf_ppo.*", "PF-PPO's reward-weighted resampling", "leave algorithm.use_pf_ppo=false"),
    Rule::refused("algorithm.gdpo_reward_keys|algorithm.gdpo_reward_weights", "GDPO's advantages normalized per reward dimension", "use adv_estimator=grpo on the total score"),
    Rule::acts("algorithm.rollout_correction.rollout_is", "importance weights against the rollout policy (token, sequence)", &["tests/tests/train.rs::rollout_correction_bypasses_the_old_pass_and_corrects_through_the_plugins", "host/src/trainer/rollout_corr.rs::tests::verl_config_forms_parse"]),
    Rule::acts("algorithm.rollout_correction.rollout_is_threshold", "the importance weights' truncation or band", &["host/src/trainer/rollout_corr.rs::tests::verl_config_forms_parse", "crates/algos/src/rollout_corr/tests.rs::token_weights_are_truncated_ratios_and_zero_on_padding"]),
    Rule::acts("algorithm.rollout_correction.rollout_is_batch_normalize", "rescales the importance weights to mean 1", &["crates/algos/src/rollout_corr/tests.rs::band_threshold_zeroes_weights_outside_it_and_batch_normalisation_rescales"]),
    Rule::acts("algorithm.rollout_correction.rollout_rs", "rejection sampling rules", &["tests/tests/train.rs::rollout_correction_bypasses_the_old_pass_and_corrects_through_the_plugins", "host/src/trainer/rollout_corr.rs::tests::verl_config_forms_parse"]),
    Rule::acts("algorithm.rollout_correction.rollout_rs_threshold", "the rejection thresholds", &["tests/tests/train.rs::rollout_correction_bypasses_the_old_pass_and_corrects_through_the_plugins", "host/src/trainer/rollout_corr.rs::tests::verl_config_forms_parse"]),
    Rule::acts("algorithm.rollout_correction.bypass_mode", "the rollout's log-probs are the old log-probs", &["tests/tests/train.rs::rollout_correction_bypasses_the_old_pass_and_corrects_through_the_plugins"]),
    Rule::acts("algorithm.rollout_correction.loss_type", "bypass mode's loss: ppo_clip", &["host/src/trainer/rollout_corr.rs::tests::bypass_mode_refuses_what_it_does_not_do_by_name"]),
    Rule::refused("distillation.**", DISTILL, DISTILL_INSTEAD),
    // ---- trainer ----
    Rule::acts("trainer.total_epochs", "epochs over the training data", &["host/tests/trainer_fit.rs::total_epochs_bound_the_run_when_no_step_count_is_set"]),
    Rule::acts("trainer.total_training_steps", "steps to run (null: total_epochs x batches)", &[FIT_GRPO]),
    Rule::acts("trainer.project_name", "the run's project (loggers, checkpoint folder)", &["crates/config/tests/load.rs::partial_grpo_job_takes_defaults_for_the_rest"]),
    Rule::acts("trainer.experiment_name", "the run's name (loggers, checkpoint folder)", &["crates/config/tests/load.rs::partial_grpo_job_takes_defaults_for_the_rest"]),
    Rule::acts("trainer.logger", "where metrics go: console, file, tensorboard, wandb, mlflow, swanlab", &["crates/metrics/tests/logging.rs::backends_are_selected_by_verl_names_once_each_and_unknown_ones_are_errors", "crates/metrics/tests/tracking.rs::wandb_offline_run_records_the_config_and_every_step", "tests/tests/train.rs::grpo_trains_checkpoints_and_resumes_identically_through_the_fsdp_plugin"]),
    Rule::acts("trainer.log_val_generations", "logs this many validation samples to wandb, mlflow and tensorboard", &["host/tests/trainer_fit.rs::validation_generations_are_logged_like_verl"]),
    Rule::acts("trainer.rollout_data_dir", "dumps each step's generations as JSONL", &["host/tests/trainer_fit.rs::generations_are_dumped_where_the_job_says"]),
    Rule::acts("trainer.validation_data_dir", "dumps each validation's generations as JSONL", &["host/tests/trainer_fit.rs::generations_are_dumped_where_the_job_says"]),
    Rule::acts("trainer.nnodes", "nodes (world = nnodes x n_gpus_per_node)", &["tests/tests/spmd.rs::layouts_the_launcher_cannot_serve_are_explained", "crates/config/tests/batch.rs::layout_from_config"]),
    Rule::acts("trainer.n_gpus_per_node", "ranks per node, spawned by `verl run`", &["tests/tests/train.rs::grpo_on_two_and_four_cpu_ranks_equals_one_rank_and_resumes_across_world_sizes"]),
    Rule::acts("trainer.save_freq", "checkpoint every this many steps (and at the end)", &[FIT_GRPO]),
    Rule::acts("trainer.test_freq", "validate every this many steps (and at the end)", &[FIT_GRPO]),
    Rule::acts("trainer.val_before_train", "validates before the first step", &[FIT_GRPO]),
    Rule::acts("trainer.val_only", "validates once and stops", &["host/tests/trainer_fit.rs::val_only_validates_once_and_trains_nothing"]),
    Rule::acts("trainer.critic_warmup", "updates only the critic for this many steps", &["host/tests/trainer_fit.rs::critic_warmup_holds_the_actor_until_its_step"]),
    Rule::acts("trainer.resume_mode", "auto, disable or resume_path", &[FIT_GAE, "crates/checkpoint/tests/checkpoint.rs::resume_path_loads_the_named_step_and_rejects_bad_paths"]),
    Rule::acts("trainer.resume_from_path", "the checkpoint to resume with resume_mode=resume_path", &["host/tests/trainer_fit.rs::checkpoints_are_kept_and_resumed_as_the_trainer_keys_say"]),
    Rule::acts("trainer.default_local_dir", "the checkpoint folder", &[FIT_GRPO]),
    Rule::acts("trainer.max_actor_ckpt_to_keep", "keeps only the newest actor checkpoints", &["host/tests/trainer_fit.rs::checkpoints_are_kept_and_resumed_as_the_trainer_keys_say"]),
    Rule::acts("trainer.max_critic_ckpt_to_keep", "keeps only the newest critic checkpoints", &["host/tests/trainer_fit.rs::checkpoints_are_kept_and_resumed_as_the_trainer_keys_say"]),
    Rule::acts("trainer.balance_batch", "reorders each step's responses by verl's workload (one rank: verl's order, which sets the mini-batches; several ranks: whole prompt groups traded until the work is equal, verl's PrefixGrouper rule)", &["host/tests/trainer_fit.rs::balance_batch_reorders_the_batch_like_verl", "host/src/trainer/tests.rs::ranks_trade_whole_prompt_groups_until_their_work_is_equal", "crates/algos/tests/golden.rs::seqlen_balanced_partitions_match_verl"]),
    Rule::acts("trainer.device", "cpu or cuda", &["plugins/fsdp/tests/roles.rs::config_errors_name_the_key"]).checked(device),
    Rule::acts("trainer.seed", "verl-rs: the seed of sampling and of the data order (when data.seed is null)", &["host/src/trainer/tests.rs::call_seeds_depend_on_step_and_purpose_only"]),
    Rule::acts("trainer.skip_on_policy_old_log_prob", "verl-rs: skips the old-log-prob pass on on-policy steps", &["tests/tests/train.rs::on_policy_steps_skip_the_old_log_prob_pass_without_changing_any_metric"]),
    Rule::refused("trainer.default_hdfs_dir", "copying checkpoints to HDFS", "copy trainer.default_local_dir yourself"),
    Rule::refused("trainer.del_local_ckpt_after_load", "deleting the local checkpoint after resuming", "leave it false"),
    Rule::harmless("trainer.esi_redundant_time", "a cloud platform's expiry-triggered save"),
    Rule::harmless("trainer.ray_wait_register_center_timeout", RAY),
    Rule::harmless("trainer.use_legacy_worker_impl", "chooses between verl's two worker implementations; verl-rs has one"),
    Rule::harmless("trainer.use_v1", "chooses between verl's trainer loops; verl-rs runs verl's synchronous loop"),
    Rule::acts("trainer.v1.trainer_mode", "sync: on-policy steps", &["crates/config/tests/layouts.rs::asynchronous_trainer_modes_are_refused"]).checked(trainer_mode),
    Rule::harmless("trainer.v1.**", ASYNC_ONLY),
    Rule::harmless("trainer.v1.sync", "options of verl's synchronous replay buffer, which verl-rs does not have"),
    Rule::refused("trainer.v1.sampler.custom_sampler.*", "a custom Python replay buffer", "leave it null"),
    Rule::refused("trainer.v1.sampler.sync_refill_failed_groups", "refilling groups whose rollouts failed", "leave it false"),
    Rule::harmless("trainer.v1.sampler.sampler_kwargs", "arguments of a custom replay buffer (refused)"),
    // ---- infrastructure verl-rs does not have ----
    Rule::harmless("global_profiler.**", PROFILER),
    Rule::harmless("**.profiler.**", PROFILER),
    Rule::harmless("ray_kwargs.**", RAY),
    Rule::refused("transfer_queue.enable", "verl's TransferQueue data plane", "leave it false"),
    Rule::harmless("transfer_queue.**", "a TransferQueue setting (the queue itself is refused)"),
    // ---- verl-rs extensions ----
    Rule::acts("plugins.search_path", "folders searched for plugins first", &["tests/tests/surface.rs::plugins_search_path_is_searched_before_the_binary_dir"]),
    Rule::acts("plugins.backend", "the backend plugin (null: from the strategy)", &["crates/config/tests/load.rs::megatron_job_maps_to_the_megatron_plugin"]),
    Rule::acts("plugins.reward.default", "the reward plugin of unrouted data sources", &["crates/config/tests/load.rs::ppo_job_with_plugin_routing"]),
    Rule::acts("plugins.reward.routes", "data_source -> reward plugin", &["host/src/trainer/reward/tests.rs::routes_by_data_source_and_puts_the_score_on_the_last_valid_token"]),
    Rule::acts("plugins.reward.python", "the Python that runs custom_reward_function (null: $VERL_PYTHON, else python3)", PY_TESTS),
    Rule::acts("plugins.reward.timeout_s", "seconds a Python reward call may take before its worker is killed", PY_LIMITS),
    Rule::acts("plugins.reward.memory_mb", "address-space limit of each Python reward worker", PY_LIMITS),
    Rule::acts("plugins.reward.cpu_s", "CPU-time limit of each Python reward worker", PY_LIMITS),
    Rule::acts("plugins.reward.isolate", "reward plugin libraries run in worker processes under the timeout and limits", &["tests/tests/python_reward.rs::an_isolated_plugin_that_aborts_or_hangs_costs_its_worker_not_the_job"]),
    Rule::acts("plugins.reward.on_error", "fail: a failed reward ends the step; zero: its rows score 0, counted in reward/error_ratio", PY_LIMITS).checked(on_error),
];

// ---- value checks ----

fn text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => serde_json::to_string(other).unwrap_or_default(),
    }
}

fn engine(v: &Value, _: &Config) -> Verdict {
    match text(v).as_str() {
        "dp" | "megatron" => Verdict::Acts,
        other => Verdict::Refused(format!(
            "the `{other}` engine; verl-rs has dp (FSDP) and megatron"
        )),
    }
}

fn family(strategy: &str) -> Option<&'static str> {
    match strategy {
        "fsdp" | "fsdp2" => Some("fsdp"),
        "megatron" => Some("megatron"),
        _ => None,
    }
}

fn same_backend(v: &Value, cfg: &Config) -> Verdict {
    let actor = &cfg.actor_rollout_ref.actor.strategy;
    let this = text(v);
    match (family(&this), family(actor)) {
        (Some(a), Some(b)) if a != b => Verdict::Refused(format!(
            "every role runs on the job's one backend (actor_rollout_ref.actor.strategy={actor}); a {a} role next to a {b} actor is not possible: use {actor} or drop the key"
        )),
        _ => Verdict::Acts,
    }
}

fn fsdp_acts_megatron_warns(_: &Value, cfg: &Config) -> Verdict {
    if cfg.actor_rollout_ref.actor.strategy == "megatron" {
        Verdict::Ignored(
            "an FSDP setting; the Megatron backend recomputes with override_transformer_config.recompute_* and always packs sequences".into(),
        )
    } else {
        Verdict::Acts
    }
}

fn lora_on_fsdp(_: &Value, cfg: &Config) -> Verdict {
    lora_verdict(cfg, false, false)
}

fn lora_setting(_: &Value, cfg: &Config) -> Verdict {
    lora_verdict(cfg, false, true)
}

fn critic_lora_on_fsdp(_: &Value, cfg: &Config) -> Verdict {
    lora_verdict(cfg, true, false)
}

fn critic_lora_setting(_: &Value, cfg: &Config) -> Verdict {
    lora_verdict(cfg, true, true)
}

/// LoRA keys of the policy's (or, `critic`, the critic's) model section: they act on the FSDP
/// backend (the Megatron backend has no adapters); a critic's mean nothing without a critic, and
/// a `setting` (alpha, modules) nothing while that role's LoRA is off.
fn lora_verdict(cfg: &Config, critic: bool, setting: bool) -> Verdict {
    let (on, section) = if critic {
        (cfg.critic_lora(), "critic.model")
    } else {
        (cfg.policy_lora(), "actor_rollout_ref.model")
    };
    if critic && !cfg.need_critic() {
        Verdict::Ignored(format!(
            "the job has no critic (algorithm.adv_estimator={}, critic.enable unset or false)",
            cfg.algorithm.adv_estimator
        ))
    } else if setting && !on {
        Verdict::Ignored(format!(
            "LoRA is off ({section}.lora_rank=0 and no lora_adapter_path)"
        ))
    } else if cfg.actor_rollout_ref.actor.strategy == "megatron" {
        Verdict::Refused(format!(
            "LoRA adapters ({section}.lora_*) on the Megatron backend, which has none; use actor_rollout_ref.actor.strategy=fsdp for LoRA"
        ))
    } else {
        Verdict::Acts
    }
}

fn multi_turn_backend(v: &Value, cfg: &Config) -> Verdict {
    if v.as_bool() == Some(true) && cfg.actor_rollout_ref.actor.strategy == "megatron" {
        Verdict::Refused(
            "multi-turn rollouts on the Megatron backend, whose actor has no multi-turn generation; use actor_rollout_ref.actor.strategy=fsdp".into(),
        )
    } else {
        Verdict::Acts
    }
}

fn hermes_format(v: &Value, _: &Config) -> Verdict {
    match text(v).as_str() {
        "hermes" => Verdict::Acts,
        other => Verdict::Refused(format!(
            "the `{other}` tool-call format, which verl-rs does not parse; use hermes (<tool_call>{{\"name\": ..., \"arguments\": ...}}</tool_call>)"
        )),
    }
}

fn token_ids_only(v: &Value, _: &Config) -> Verdict {
    if v.as_bool() == Some(true) {
        Verdict::Refused("re-rendering the model's turns with the inference chat template (training on tokens the model did not generate); leave it false".into())
    } else {
        Verdict::Acts
    }
}

fn agent_loop_name(v: &Value, _: &Config) -> Verdict {
    match text(v).as_str() {
        "single_turn_agent" | "tool_agent" => Verdict::Acts,
        other => Verdict::Refused(format!(
            "the `{other}` agent loop, which verl-rs does not have; use single_turn_agent or tool_agent"
        )),
    }
}

fn same_tool_config(v: &Value, cfg: &Config) -> Verdict {
    let mt = cfg.multi_turn().tool_config_path;
    match (v, mt) {
        (Value::Null, _) => Verdict::Acts,
        (v, Some(p)) if text(v) == p => Verdict::Acts,
        (v, p) => Verdict::Refused(format!(
            "a dataset tool config ({}) other than actor_rollout_ref.rollout.multi_turn.tool_config_path ({}); set only multi_turn.tool_config_path",
            text(v),
            p.unwrap_or_else(|| "null".into())
        )),
    }
}

fn equals_rollout_n(v: &Value, cfg: &Config) -> Verdict {
    let n = cfg.actor_rollout_ref.rollout.n;
    match v.as_u64() {
        Some(x) if x == n => Verdict::Acts,
        _ => Verdict::Refused(format!(
            "a response count other than actor_rollout_ref.rollout.n={n}; set rollout.n (the roles' copies follow it)"
        )),
    }
}

fn clip_ratio_fallback(_: &Value, cfg: &Config) -> Verdict {
    let a = &cfg.actor_rollout_ref.actor;
    if a.clip_ratio_low.is_some() && a.clip_ratio_high.is_some() {
        Verdict::Ignored(
            "clip_ratio only applies where clip_ratio_low / clip_ratio_high are null (verl's rule), and both are set: set them (or null them)".into(),
        )
    } else {
        Verdict::Acts
    }
}

const LOSS_MODES: &[&str] = &[
    "vanilla", "gspo", "sapo", "gpg", "cispo", "geo_mean", "dppo_tv", "dppo_kl",
];

fn loss_mode(v: &Value, _: &Config) -> Verdict {
    let m = text(v);
    if LOSS_MODES.contains(&m.as_str()) {
        Verdict::Acts
    } else {
        Verdict::Refused(format!(
            "the `{m}` policy loss, which verl-rs does not have; use one of {}",
            LOSS_MODES.join(", ")
        ))
    }
}

/// `Ignored` when the job's policy loss is not one of `modes`, which read the key (`what` it is to them).
fn loss_mode_reads(cfg: &Config, modes: &[&str], what: &str) -> Verdict {
    let mode = &cfg.actor_rollout_ref.actor.policy_loss.loss_mode;
    if modes.contains(&mode.as_str()) {
        Verdict::Acts
    } else {
        Verdict::Ignored(format!(
            "{what}; this job's actor_rollout_ref.actor.policy_loss.loss_mode is `{mode}`"
        ))
    }
}

fn clip_ratio_c_use(_: &Value, cfg: &Config) -> Verdict {
    loss_mode_reads(
        cfg,
        &["vanilla", "dppo_tv", "dppo_kl"],
        "it is the dual-clip bound of loss_mode=vanilla and the ratio truncation of dppo_tv and dppo_kl",
    )
}

fn sapo_only(_: &Value, cfg: &Config) -> Verdict {
    loss_mode_reads(cfg, &["sapo"], "it is a temperature of loss_mode=sapo")
}

fn kl_loss_type(v: &Value, _: &Config) -> Verdict {
    let t = text(v);
    if t.trim_end_matches('+') == "full" {
        Verdict::Refused("the full-vocabulary KL, which needs every logit; use low_var_kl, kl, mse or abs (with `+` for the straight-through variants)".into())
    } else {
        Verdict::Acts
    }
}

fn kl_penalty(v: &Value, _: &Config) -> Verdict {
    let t = text(v);
    if t.trim_end_matches('+') == "full" {
        Verdict::Refused(
            "the full-vocabulary KL, which needs every logit; use kl, low_var_kl, mse or abs"
                .into(),
        )
    } else if t.ends_with('+') {
        Verdict::Refused(format!(
            "a straight-through estimator (`{t}`), which only has meaning in a loss; use {} for the in-reward penalty",
            t.trim_end_matches('+')
        ))
    } else {
        Verdict::Acts
    }
}

/// The advantage estimators `verl_algos` implements (a host test keeps the two lists equal).
pub const IMPLEMENTED_ESTIMATORS: &[&str] = &[
    "gae",
    "grpo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "rloo",
    "opo",
    "gpg",
];

fn adv_estimator(v: &Value, _: &Config) -> Verdict {
    let e = text(v);
    if IMPLEMENTED_ESTIMATORS.contains(&e.as_str()) {
        Verdict::Acts
    } else {
        Verdict::Refused(format!(
            "the `{e}` advantage estimator, which verl-rs does not implement; use one of {}",
            IMPLEMENTED_ESTIMATORS.join(", ")
        ))
    }
}

fn contents(v: &Value) -> Vec<String> {
    v.as_sequence()
        .map(|s| s.iter().map(text).collect())
        .unwrap_or_default()
}

fn save_contents(v: &Value, _: &Config) -> Verdict {
    let c = contents(v);
    let missing: Vec<&str> = ["model", "optimizer", "extra"]
        .into_iter()
        .filter(|k| !c.iter().any(|x| x == k))
        .collect();
    let unknown: Vec<&String> = c
        .iter()
        .filter(|x| !["model", "optimizer", "extra", "hf_model"].contains(&x.as_str()))
        .collect();
    if !unknown.is_empty() {
        return Verdict::Refused(format!(
            "unknown checkpoint contents {unknown:?}; use model, optimizer, extra and hf_model"
        ));
    }
    if !missing.is_empty() {
        return Verdict::Refused(format!(
            "checkpoints without {}; verl-rs always saves model, optimizer and extra so a run can resume exactly (add hf_model for an HF export)",
            missing.join(", ")
        ));
    }
    Verdict::Acts
}

fn load_contents(v: &Value, _: &Config) -> Verdict {
    let c = contents(v);
    if ["model", "optimizer", "extra"]
        .iter()
        .all(|k| c.iter().any(|x| x == k))
    {
        Verdict::Acts
    } else {
        Verdict::Refused(
            "resuming only part of a checkpoint; verl-rs resumes model, optimizer and extra together (start from an HF export with model.path instead)".into(),
        )
    }
}

fn optimizer(v: &Value, _: &Config) -> Verdict {
    match text(v).to_ascii_lowercase().as_str() {
        "adamw" | "adam" => Verdict::Acts,
        other => Verdict::Refused(format!(
            "the `{other}` optimizer; verl-rs trains with AdamW (`adam` in Megatron's spelling)"
        )),
    }
}

fn scheduler(v: &Value, _: &Config) -> Verdict {
    match v {
        Value::Null => Verdict::Acts,
        _ => match text(v).as_str() {
            "constant" | "cosine" => Verdict::Acts,
            other => Verdict::Refused(format!(
                "the `{other}` learning-rate schedule; verl-rs has constant and cosine (with warm-up)"
            )),
        },
    }
}

fn world_size(cfg: &Config) -> u64 {
    cfg.trainer.nnodes.max(1) * cfg.trainer.n_gpus_per_node.max(1)
}

fn fsdp_size(v: &Value, cfg: &Config) -> Verdict {
    let world = world_size(cfg);
    match v.as_i64() {
        Some(-1) => Verdict::Acts,
        Some(n) if n > 0 && n as u64 >= world => Verdict::Acts,
        Some(n) => Verdict::Refused(format!(
            "hybrid sharding (shard within groups of {n} of the {world} ranks, replicate across them), which verl-rs does not do; use -1 to shard over every rank"
        )),
        None => Verdict::Refused("an fsdp_size that is not an integer; use -1".into()),
    }
}

fn transformer_overrides(v: &Value, _: &Config) -> Verdict {
    const ACTS: &[&str] = &[
        "recompute_granularity",
        "recompute_method",
        "recompute_num_layers",
        "moe_aux_loss_coeff",
    ];
    const HARMLESS: &[&str] = &[
        "recompute_modules",
        "attention_backend",
        "apply_rope_fusion",
        "gradient_accumulation_fusion",
        "moe_permute_fusion",
        "moe_router_dtype",
        "moe_token_dispatcher_type",
        "moe_grouped_gemm",
        "moe_enable_deepep",
        "masked_softmax_fusion",
        "bias_activation_fusion",
        "bias_dropout_fusion",
        "persist_layer_norm",
        "deallocate_pipeline_outputs",
        "account_for_embedding_in_pipeline_split",
        "account_for_loss_in_pipeline_split",
        "cross_entropy_loss_fusion",
        "cross_entropy_fusion_impl",
        "use_flash_attn",
        "use_fused_rmsnorm",
        "use_fused_swiglu",
        "use_fused_mhc",
        "use_triton_gdn",
        "use_ascend_gdn",
        "apply_dsa_kernel_fusion",
        "moe_shared_expert_overlap",
    ];
    let Some(map) = v.as_mapping() else {
        return Verdict::Refused("a mapping is expected".into());
    };
    // The block's defaults (verl's recompute_modules / attention_backend) are no request.
    let defaults = crate::tree::get_path(
        crate::defaults::defaults_tree(),
        &crate::tree::split_key("actor_rollout_ref.actor.megatron.override_transformer_config"),
    )
    .and_then(Value::as_mapping)
    .cloned()
    .unwrap_or_default();
    let mut ignored = Vec::new();
    let mut refused = Vec::new();
    for (k, val) in map {
        let k = text(k);
        if ACTS.contains(&k.as_str()) {
            if k == "recompute_granularity" && text(val) == "selective" {
                ignored.push(
                    "recompute_granularity=selective (recomputes nothing; use full)".to_string(),
                );
            }
        } else if HARMLESS.contains(&k.as_str()) {
            if !val.is_null() && defaults.get(k.as_str()) != Some(val) {
                ignored.push(k);
            }
        } else {
            refused.push(k);
        }
    }
    if !refused.is_empty() {
        Verdict::Refused(format!(
            "Megatron transformer settings verl-rs does not read: {}; it reads recompute_granularity, recompute_method, recompute_num_layers and moe_aux_loss_coeff",
            refused.join(", ")
        ))
    } else if !ignored.is_empty() {
        Verdict::Ignored(format!(
            "these kernel/fusion switches change no numbers in verl-rs: {}",
            ignored.join(", ")
        ))
    } else {
        Verdict::Acts
    }
}

fn rollout_tp(v: &Value, cfg: &Config) -> Verdict {
    let arr = &cfg.actor_rollout_ref;
    let asked = v.as_u64().unwrap_or(1);
    if asked <= 1 {
        return Verdict::Acts;
    }
    let multi_turn = cfg.multi_turn().enable;
    if arr.actor.strategy != "megatron" && arr.model.lora_rank > 0 {
        Verdict::Ignored("a LoRA actor generates at rollout TP 1, each rank its own prompts (same samples, a speed and memory layout)".into())
    } else if arr.actor.strategy != "megatron" && multi_turn {
        Verdict::Ignored("multi-turn rollouts generate at rollout TP 1, each rank its own prompts (same samples, a speed and memory layout)".into())
    } else {
        Verdict::Acts
    }
}

fn dtype_name(s: &str) -> Option<&'static str> {
    match s.to_ascii_lowercase().as_str() {
        "bf16" | "bfloat16" => Some("bf16"),
        "fp16" | "float16" | "half" => Some("fp16"),
        "fp32" | "float32" | "float" => Some("fp32"),
        _ => None,
    }
}

fn rollout_dtype(v: &Value, cfg: &Config) -> Verdict {
    let a = &cfg.actor_rollout_ref.actor;
    let compute = if a.strategy == "megatron" {
        a.megatron.dtype.clone()
    } else {
        a.fsdp_config
            .mixed_precision
            .get("param_dtype")
            .and_then(Value::as_str)
            .map(str::to_string)
            .unwrap_or_else(|| a.fsdp_config.dtype.clone())
    };
    let want = text(v);
    match (dtype_name(&want), dtype_name(&compute)) {
        (Some(x), Some(y)) if x == y => Verdict::Acts,
        _ => Verdict::Refused(format!(
            "generating in {want} while the actor computes in {compute}; verl-rs generates with the training weights in the compute dtype: set the actor's dtype instead"
        )),
    }
}

fn logprobs_mode(v: &Value, _: &Config) -> Verdict {
    let m = text(v);
    if m.starts_with("raw") {
        Verdict::Refused(format!(
            "`{m}` (log-probs before temperature); verl-rs's rollout log-probs are the training forward's, after temperature: use processed_logprobs"
        ))
    } else {
        Verdict::Acts
    }
}

fn reward_manager(v: &Value, cfg: &Config) -> Verdict {
    match text(v).as_str() {
        "naive" | "dapo" => Verdict::Acts,
        "batch"
            if cfg.reward.custom_reward_function.path.is_some()
                || cfg.custom_reward_function.path.is_some() =>
        {
            Verdict::Acts
        }
        "batch" => Verdict::Refused(
            "the `batch` reward manager without a batch function: it calls custom_reward_function with lists; give custom_reward_function.path".into(),
        ),
        other => Verdict::Refused(format!(
            "the `{other}` reward manager; verl-rs has naive (one score per response), dapo (naive + the overlong penalty) and batch (custom_reward_function called with lists)"
        )),
    }
}

/// `reward.reward_kwargs`: what verl's dapo manager reads, and only with it.
fn reward_kwargs(v: &Value, cfg: &Config) -> Verdict {
    let Some(m) = v.as_mapping() else {
        return Verdict::Refused("reward manager arguments that are not a mapping".into());
    };
    if m.is_empty() {
        return Verdict::Acts;
    }
    if cfg.reward.reward_manager.name != "dapo" {
        return Verdict::Refused(format!(
            "reward-manager arguments ({}) for the `{}` manager, which reads none; they are the dapo manager's (reward.reward_manager.name=dapo), and a reward function's go in custom_reward_function.reward_kwargs",
            m.keys().map(text).collect::<Vec<_>>().join(", "),
            cfg.reward.reward_manager.name
        ));
    }
    let unknown: Vec<String> = m
        .keys()
        .map(text)
        .filter(|k| k != "overlong_buffer_cfg" && k != "max_resp_len")
        .collect();
    if unknown.is_empty() {
        Verdict::Acts
    } else {
        Verdict::Refused(format!(
            "dapo manager arguments {} it does not read (it reads overlong_buffer_cfg and max_resp_len)",
            unknown.join(", ")
        ))
    }
}

fn on_error(v: &Value, _: &Config) -> Verdict {
    match text(v).as_str() {
        "fail" | "zero" => Verdict::Acts,
        other => Verdict::Refused(format!("on_error `{other}`; use fail or zero")),
    }
}

fn reward_manager_source(v: &Value, _: &Config) -> Verdict {
    match text(v).as_str() {
        "register" => Verdict::Acts,
        other => Verdict::Refused(format!(
            "reward managers from `{other}` (a Python module); {CUSTOM_FN_INSTEAD}"
        )),
    }
}

fn device(v: &Value, _: &Config) -> Verdict {
    match text(v).as_str() {
        "cpu" | "cuda" | "gpu" => Verdict::Acts,
        other => Verdict::Refused(format!("the `{other}` device; verl-rs runs on cpu or cuda")),
    }
}

fn trainer_mode(v: &Value, _: &Config) -> Verdict {
    match text(v).as_str() {
        "sync" => Verdict::Acts,
        other => Verdict::Refused(format!(
            "verl 0.10's `{other}` trainer (off-policy partial rollouts); verl-rs runs synchronous on-policy steps: use sync"
        )),
    }
}
