//! The parts of a run that exist before its first step (verl's `__init__` and `init_workers`):
//! the ranks' layout, the algorithm, the data, the roles and reward functions, the loggers.
//! `Trainer::setup` (`fit.rs`) puts them together.

use std::path::PathBuf;

use anyhow::{bail, Context};
use verl_algos::{AdvantageEstimator, AdvantageParams, KlController, KlPenalty, RolloutCorrection};
use verl_config::Config;
use verl_data::{Dataset, Sample, Split};
use verl_metrics::{LoggerOptions, MetricsLogger};
use verl_plugin_api::{InitArgs, Role};

use super::error::TrainerError;
use super::options::FitOptions;
use super::plugins::{BackendFactory, JobPlugins};
use super::prompts::PromptEncoder;
use super::reduce::Ranks;
use super::reward::{PluginClient, RewardRouter};
use super::workers::Workers;

/// `algorithm.*` as the step uses it.
pub(super) struct Algorithm {
    pub(super) estimator: AdvantageEstimator,
    pub(super) adv_params: AdvantageParams,
    pub(super) kl_penalty: KlPenalty,
    /// The in-reward KL coefficient's controller; its value is checkpointed.
    pub(super) kl_ctrl: KlController,
    /// `algorithm.rollout_correction`, `None` when off.
    pub(super) correction: Option<RolloutCorrection>,
    /// Its bypass mode: the rollout's log-probs are the old log-probs.
    pub(super) bypass: bool,
}

/// The collectives' group must be the one `FitOptions` says this rank is in.
pub(super) fn check_ranks(opts: &FitOptions) -> anyhow::Result<Ranks<'_>> {
    let (rank, world) = (opts.rank, opts.world_size.max(1));
    let group = opts.group.as_deref();
    match group {
        Some(g) if g.rank() != rank as usize || g.world_size() != world as usize => {
            Err(TrainerError::Rank {
                rank,
                world_size: world,
                message: format!(
                    "FitOptions says rank {rank} of {world} but its group is rank {} of {}",
                    g.rank(),
                    g.world_size()
                ),
            }
            .into())
        }
        None if world > 1 => Err(TrainerError::Rank {
            rank,
            world_size: world,
            message:
                "a multi-rank fit needs FitOptions::group (the job's store) for its collectives"
                    .into(),
        }
        .into()),
        _ => Ok(Ranks::new(group)),
    }
}

impl Algorithm {
    pub(super) fn new(cfg: &Config) -> anyhow::Result<Self> {
        let estimator: AdvantageEstimator = cfg.algorithm.adv_estimator.parse()?;
        if estimator.needs_values() && !cfg.need_critic() {
            return Err(TrainerError::Config {
                key: "critic.enable",
                value: format!("{:?}", cfg.critic.enable),
                message: format!(
                    "algorithm.adv_estimator={} needs a critic",
                    estimator.name()
                ),
            }
            .into());
        }
        let (adv_params, kl_penalty, kl_ctrl) = algorithm_settings(cfg)?;
        let correction = super::rollout_corr::rollout_correction(cfg)?;
        let bypass = correction.as_ref().is_some_and(|c| c.bypass_mode);
        Ok(Algorithm {
            estimator,
            adv_params,
            kl_penalty,
            kl_ctrl,
            correction,
            bypass,
        })
    }
}

/// verl's `init_workers`: the backend's actor, reference and critic, the reward models it lends,
/// and the reward plugins (in worker processes with `plugins.reward.isolate`).
pub(super) fn create_roles(
    cfg: &Config,
    plugins: &JobPlugins,
    opts: &FitOptions,
) -> anyhow::Result<(Workers, RewardRouter)> {
    let config_json = serde_json::to_value(cfg).context("serialising the config for plugins")?;
    let init = |role: Role| InitArgs {
        rank: opts.rank,
        world_size: opts.world_size.max(1),
        local_rank: opts.local_rank,
        rendezvous: opts.rendezvous.clone(),
        ..InitArgs::new(role, config_json.clone())
    };
    let backend = &plugins.backend;
    multi_turn_backend(cfg, backend.as_ref())?;
    let actor = backend
        .create_actor(&init(Role::Actor))
        .with_context(|| format!("creating the actor of backend `{}`", backend.name()))?;
    let lora = lora_backend(cfg, backend.as_ref())?;
    let reference = if cfg.need_reference_policy() && !lora {
        Some(
            backend
                .create_reference(&init(Role::Reference))
                .with_context(|| {
                    format!("creating the reference of backend `{}`", backend.name())
                })?,
        )
    } else {
        None
    };
    let critic = if cfg.need_critic() {
        Some(
            backend
                .create_critic(&init(Role::Critic))
                .with_context(|| format!("creating the critic of backend `{}`", backend.name()))?,
        )
    } else {
        None
    };
    let models = super::reward_model::lent_models(cfg, backend.as_ref(), &config_json, &init)?;
    // With a Python reward function, custom_reward_function.reward_kwargs are its arguments
    // (verl passes them to it alone), not the rule rewards'.
    let reward_init = || {
        let mut a = init(Role::Reward);
        if cfg.reward.custom_reward_function.path.is_some() {
            for path in [
                &["custom_reward_function"][..],
                &["reward", "custom_reward_function"],
            ] {
                let mut v = &mut a.config;
                for k in path {
                    v = &mut v[*k];
                }
                if v.is_object() {
                    v["reward_kwargs"] = serde_json::json!({});
                }
            }
        }
        a
    };
    let mut reward_clients = Vec::new();
    for (name, f) in &plugins.rewards {
        let client = if cfg.plugins.reward.isolate {
            let Some(lib) = f.library() else {
                bail!("plugins.reward.isolate=true: reward plugin `{name}` is linked into this process, not a library a worker can load");
            };
            let verl = std::env::current_exe().context("locating the verl binary")?;
            PluginClient::Isolated(Box::new(
                crate::isolated_reward::IsolatedReward::start(
                    verl,
                    lib,
                    name,
                    reward_init(),
                    super::reward::limits(cfg),
                )
                .with_context(|| {
                    format!(
                        "creating reward plugin `{name}` ({}) in a worker process",
                        f.name()
                    )
                })?,
            ))
        } else {
            f.create_reward(&reward_init(), &models)
                .with_context(|| format!("creating reward plugin `{name}` ({})", f.name()))?
                .into()
        };
        reward_clients.push((name.clone(), client));
    }
    let rewards = RewardRouter::new(reward_clients, models, cfg)?;
    let mut workers = Workers::new(actor, reference, critic, ());
    workers.ref_in_actor = lora && cfg.need_reference_policy();
    Ok((workers, rewards))
}

/// Whether the policy trains LoRA adapters; an error when it asks for them and the backend's
/// actor does not declare the `lora` feature (a backend without LoRA would train every weight).
pub(crate) fn lora_backend(cfg: &Config, backend: &dyn BackendFactory) -> anyhow::Result<bool> {
    if cfg.need_critic()
        && cfg.critic_lora()
        && !backend.supports(Role::Critic, verl_plugin_api::FEATURE_LORA)
    {
        bail!(
            "critic.model.lora_rank={} asks for LoRA adapters on the critic, and backend `{}` \
             does not train them (its critic declares no `lora` feature): use the fsdp backend, \
             or drop critic.model.lora_* to train every weight",
            cfg.critic.model.lora_rank,
            backend.name()
        );
    }
    if !cfg.policy_lora() {
        return Ok(false);
    }
    if !backend.supports(Role::Actor, verl_plugin_api::FEATURE_LORA) {
        let m = &cfg.actor_rollout_ref.model;
        bail!(
            "actor_rollout_ref.model.lora_rank={}{} asks for LoRA adapters, and backend `{}` does \
             not train them (its actor declares no `lora` feature): use the fsdp backend, or drop \
             the LoRA keys to train every weight",
            m.lora_rank,
            m.lora_adapter_path
                .as_deref()
                .map(|p| format!(" / lora_adapter_path={p}"))
                .unwrap_or_default(),
            backend.name()
        );
    }
    Ok(true)
}

/// Whether the job rolls out conversations (`multi_turn.enable`); an error when it does and the
/// backend's actor does not declare the `multi_turn` feature (it could only answer single turns).
pub(crate) fn multi_turn_backend(
    cfg: &Config,
    backend: &dyn BackendFactory,
) -> anyhow::Result<bool> {
    if !cfg.multi_turn().enable {
        return Ok(false);
    }
    if !backend.supports(Role::Actor, verl_plugin_api::FEATURE_MULTI_TURN) {
        bail!(
            "actor_rollout_ref.rollout.multi_turn.enable=true asks for multi-turn rollouts with \
             tools, and backend `{}` does not run them (its actor declares no `multi_turn` \
             feature): use the fsdp backend, or set multi_turn.enable=false",
            backend.name()
        );
    }
    Ok(true)
}

/// Rank 0's metrics logger (`FitOptions::logger`, else `trainer.logger` where verl puts its
/// files), and the JSONL file it writes when the `file` logger is on.
pub(super) fn create_logger(
    cfg: &Config,
    opts: &FitOptions,
) -> anyhow::Result<(Option<MetricsLogger>, Option<PathBuf>)> {
    let t = &cfg.trainer;
    let mut logger_opts = opts.logger.clone().unwrap_or_else(|| {
        LoggerOptions::from_verl(&t.project_name, &t.experiment_name, &t.logger.to_vec())
    });
    if logger_opts.tracking.config.is_null() {
        // verl gives wandb/mlflow/swanlab the whole resolved config.
        logger_opts.tracking.config = serde_json::to_value(cfg)?;
    }
    let logger = if opts.rank == 0 {
        let l = MetricsLogger::new(&logger_opts)?;
        for w in l.warnings() {
            tracing::warn!("{w}");
        }
        Some(l)
    } else {
        None
    };
    let jsonl_path = logger_opts
        .backends
        .iter()
        .any(|b| b == "file" || b == "jsonl")
        .then(|| logger_opts.jsonl_path.clone());
    Ok((logger, jsonl_path))
}

/// `data.*` as the data crate takes it.
pub fn data_config(cfg: &Config) -> anyhow::Result<verl_data::DataConfig> {
    let d = &cfg.data;
    Ok(verl_data::DataConfig {
        prompt_key: d.prompt_key.clone(),
        reward_fn_key: d.reward_fn_key.clone(),
        media_columns: vec![
            ("data.image_key".into(), d.image_key.clone()),
            ("data.video_key".into(), d.video_key.clone()),
            ("data.audio_key".into(), d.audio_key.clone()),
        ],
        max_prompt_length: d.max_prompt_length as usize,
        filter_overlong_prompts: d.filter_overlong_prompts,
        truncation: d.truncation.parse()?,
        train_max_samples: d.train_max_samples,
        val_max_samples: d.val_max_samples,
        shuffle: d.shuffle,
        // verl seeds its sampler with `data.seed` (1 when unset); the host seed is ours.
        seed: Some(d.seed.unwrap_or(cfg.trainer.seed)),
        train_batch_size: d.train_batch_size as usize,
        gen_batch_size: None,
        val_batch_size: d.val_batch_size.map(|v| v as usize),
        validation_shuffle: d.validation_shuffle,
    })
}

pub(super) fn load_split(
    files: &[String],
    dcfg: &verl_data::DataConfig,
    split: Split,
    enc: &PromptEncoder,
) -> anyhow::Result<Dataset> {
    let len_fn = |s: &Sample| -> Result<usize, verl_data::BoxError> {
        enc.raw_ids(s)
            .map(|ids| ids.len())
            .map_err(|e| format!("{e:#}").into())
    };
    let paths: Vec<PathBuf> = files.iter().map(|f| crate::paths::expand_home(f)).collect();
    let (ds, report) = Dataset::prepare(&paths, dcfg, split, Some(&len_fn))
        .with_context(|| format!("loading {split:?} data from {}", files.join(", ")))?;
    if let Some(r) = report {
        if r.removed > 0 {
            tracing::info!(
                kept = r.kept,
                removed = r.removed,
                max = r.max_prompt_length,
                "filtered overlong prompts ({split:?})"
            );
        }
    }
    Ok(ds)
}

/// `algorithm.*`: the advantage estimator's parameters and the in-reward KL penalty.
pub(super) fn algorithm_settings(
    cfg: &Config,
) -> anyhow::Result<(AdvantageParams, KlPenalty, KlController)> {
    let a = &cfg.algorithm;
    let params = AdvantageParams {
        gamma: a.gamma,
        lam: a.lam,
        norm_adv_by_std_in_grpo: a.norm_adv_by_std_in_grpo,
        ..AdvantageParams::default()
    };
    let kl_penalty: KlPenalty = a.kl_penalty.parse()?;
    let kc = &a.kl_ctrl;
    let kl_ctrl = match kc.kind.as_str() {
        "adaptive" => KlController::adaptive(kc.kl_coef, kc.target_kl, kc.horizon as i64)?,
        "fixed" => KlController::fixed(kc.kl_coef),
        other => {
            return Err(TrainerError::Config {
                key: "algorithm.kl_ctrl.type",
                value: other.into(),
                message: "expected fixed or adaptive".into(),
            }
            .into())
        }
    };
    Ok((params, kl_penalty, kl_ctrl))
}

/// How the job's ranks split into data-parallel replicas. The FSDP backend is data-parallel
/// only; the Megatron backend groups `tensor × context × pipeline` ranks into one replica that
/// sees the same prompts (Megatron's rank order: tensor fastest, then context, data, pipeline).
#[derive(Debug, Clone)]
pub(super) struct DataLayout {
    pub(super) dp_rank: u32,
    pub(super) dp_size: u32,
    /// Per rank: the first rank of its replica (the one whose data counts in host statistics).
    pub(super) holds_data: Vec<bool>,
}

impl DataLayout {
    pub(super) fn new(cfg: &Config, rank: u32, world: u32) -> anyhow::Result<DataLayout> {
        let sizes = |mg: &verl_config::MegatronConfig| {
            (
                mg.tensor_model_parallel_size.max(1),
                mg.context_parallel_size.max(1),
                mg.pipeline_model_parallel_size.max(1),
            )
        };
        let arr = &cfg.actor_rollout_ref;
        let (tp, cp, pp) = if arr.actor.strategy == "megatron" {
            sizes(&arr.actor.megatron)
        } else {
            (1, 1, 1)
        };
        if cfg.need_critic() && cfg.critic.strategy == "megatron" {
            let c = sizes(&cfg.critic.megatron);
            if c != (tp, cp, pp) {
                return Err(TrainerError::Config {
                    key: "critic.megatron.tensor_model_parallel_size",
                    value: format!("TP={} CP={} PP={}", c.0, c.1, c.2),
                    message: format!(
                        "the critic must split the ranks like the actor (TP={tp} CP={cp} PP={pp}): every rank's host feeds one prompt slice to all its roles"
                    ),
                }
                .into());
            }
        }
        let mp = (tp * cp * pp) as u32;
        if !world.is_multiple_of(mp) {
            return Err(TrainerError::Config {
                key: "actor_rollout_ref.actor.megatron.tensor_model_parallel_size",
                value: format!("TP={tp} CP={cp} PP={pp}"),
                message: format!(
                    "{world} ranks do not split into model-parallel groups of {tp} × {cp} × {pp} = {mp}"
                ),
            }
            .into());
        }
        let dp_size = world / mp;
        let (tp, cp) = (tp as u32, cp as u32);
        let coords = |r: u32| {
            (
                r % tp,
                (r / tp) % cp,
                (r / (tp * cp)) % dp_size,
                r / (tp * cp * dp_size),
            )
        };
        let holds_data = (0..world)
            .map(|r| {
                let (t, c, _, p) = coords(r);
                t == 0 && c == 0 && p == 0
            })
            .collect();
        Ok(DataLayout {
            dp_rank: coords(rank).2,
            dp_size,
            holds_data,
        })
    }
}
