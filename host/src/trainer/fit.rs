//! The loop itself: verl's `RayPPOTrainer.fit`, `_validate`, `_save_checkpoint` and
//! `_load_checkpoint`, on one data-parallel rank.
//!
//! Across ranks (`FitOptions::group`), what verl computes on its driver over the whole batch is
//! computed over the whole batch here too, through the host's collectives: data metrics (the
//! ranks' rows gathered in rank order, so they equal a 1-rank run's), whitening and the KL
//! controller's input (sums over ranks), validation (rows gathered before the per-source
//! reduction). Plugin metrics that differ between ranks are averaged (`*/max` and `*/min` take
//! the max and min); identical ones are kept. Timings are the slowest rank's per phase, which is
//! what verl's driver measures while it waits for its workers.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use verl_algos::{
    apply_kl_penalty_across, compute_advantage_across, compute_rollout_correction_across,
    masked_mean, AdvantageEstimator, AdvantageInputs, AdvantageParams, Grid, Groups, KlController,
    KlPenalty,
};
use verl_checkpoint::{
    CheckpointManager, KeepPolicy, ResumeDecision, ResumeMode, Role as CkptRole, RoleWriter,
    WriterError,
};
use verl_config::{validate_batches, BatchPlan, Config, Layout};
use verl_data::{DataLoader, DataLoaderState, Dataset, LoaderOptions, Sample, Split};
use verl_metrics::{
    compute_throughput_metrics, compute_timing_metrics, process_validation_metrics,
    select_val_generations, validation_metrics, InfoColumn, LoggerOptions, MetricsLogger, StepData,
    Timings, ValGeneration, BOOTSTRAP_SEED,
};
use verl_plugin_api::client::{ActorClient, CriticClient};
use verl_plugin_api::{
    col, Batch, GenerateOptions, InitArgs, LogProbOptions, Role, Tensor, UpdateOptions,
    ValueOptions,
};

use super::dump::{dump_generations, DumpRows};
use super::error::TrainerError;
use super::plugins::JobPlugins;
use super::prompts::{tokenizer_dir, PromptEncoder};
use super::reward::{RewardInput, RewardOutput, RewardRouter};
use crate::dist::{HostGroup, ReduceOp};
use verl_algos::{CrossRankSum, LocalOnly, MASKED_MEAN_EPS};
use verl_checkpoint::{DATA_STATE_FILE, TRAINER_STATE_FILE};
use verl_metrics::StepSummary;
use verl_plugin_api::Rendezvous;

/// How this process takes part in the job.
#[derive(Debug, Clone)]
pub struct FitOptions {
    /// Data-parallel rank of this process; it trains on its slice of whole prompt groups.
    pub rank: u32,
    pub world_size: u32,
    /// The GPU index of this rank on its node (torchrun's `LOCAL_RANK`).
    pub local_rank: u32,
    /// Where the backend's communicator meets its peers (world > 1).
    pub rendezvous: Option<Rendezvous>,
    /// The job's ranks, for the host-side collectives; required when `world_size > 1`.
    pub group: Option<Arc<HostGroup>>,
    /// Where metrics go; `None`: `trainer.logger` with verl's file locations. Only rank 0 logs.
    pub logger: Option<LoggerOptions>,
    /// One progress line per step on stderr.
    pub progress: bool,
}

impl Default for FitOptions {
    fn default() -> Self {
        FitOptions {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            rendezvous: None,
            group: None,
            logger: None,
            progress: true,
        }
    }
}

/// What a finished `fit` reports.
#[derive(Debug, Clone, Default)]
pub struct FitSummary {
    /// The last global step trained (the resumed step when nothing was left to train).
    pub global_step: u64,
    /// `trainer.total_training_steps` as resolved (override or epochs × batches per epoch).
    pub total_training_steps: u64,
    /// The checkpoint step this run resumed from.
    pub resumed_from: Option<u64>,
    /// Steps saved by this run.
    pub checkpoints: Vec<u64>,
    /// The last step's metrics, as logged.
    pub last_metrics: Vec<(String, f64)>,
    /// The last validation's metrics.
    pub last_validation: Option<Vec<(String, f64)>>,
    /// The JSONL metrics file, when the `file` logger is on.
    pub jsonl_path: Option<PathBuf>,
    pub plan: Option<BatchPlan>,
}

/// Loop state that a checkpoint must restore beyond the roles and the data loader.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct TrainerState {
    global_step: u64,
    epoch: u64,
    kl_coef: f64,
    /// `kl_coef`'s bits: JSON text does not always parse back to the same float, and a resumed
    /// run must continue bit for bit.
    kl_coef_bits: u64,
}

/// The seed of one generation call: a function of the job seed and the step only, so a resumed
/// run samples exactly what the uninterrupted one did. It must not depend on the rank: with
/// `GenerateOptions::row_offset` every prompt samples by its global index, so a batch split over
/// ranks generates exactly what one rank would.
fn call_seed(seed: u64, step: u64, salt: u64) -> u64 {
    let mut x = seed ^ 0xD1B5_4A32_D192_ED03;
    for v in [step, salt] {
        x = (x ^ v).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        x ^= x >> 29;
    }
    x
}

const SALT_TRAIN: u64 = 1;
const SALT_GREEDY: u64 = 2;
const SALT_VAL: u64 = 3;

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

fn load_split(
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

/// This rank's contiguous slice of a batch of `len` prompts. Whole prompts (and so whole
/// GRPO groups) stay on one rank.
fn rank_slice(len: usize, rank: u32, world: u32) -> anyhow::Result<std::ops::Range<usize>> {
    let world = world.max(1) as usize;
    if !len.is_multiple_of(world) {
        return Err(TrainerError::Rank {
            rank,
            world_size: world as u32,
            message: format!("{len} prompts do not split evenly over {world} data-parallel ranks"),
        }
        .into());
    }
    let per = len / world;
    Ok(rank as usize * per..(rank as usize + 1) * per)
}

fn tensor_f32(b: &Batch, name: &str, call: &str) -> anyhow::Result<Tensor<f32>> {
    Ok(b.tensor_in::<f32>(call, name)?)
}

fn grid_f64(t: &Tensor<f32>) -> anyhow::Result<Grid<f64>> {
    Ok(Grid::from_f32(t.rows(), t.cols(), &t.data)?)
}

fn mask_grid(t: &Tensor<i64>) -> anyhow::Result<Grid<f64>> {
    Ok(Grid::new(
        t.rows(),
        t.cols(),
        t.data.iter().map(|&m| (m != 0) as u8 as f64).collect(),
    )?)
}

fn to_f32(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| x as f32).collect()
}

/// A step's generation after [`balance_rollout`]: this rank's rows, and the step's prompts they
/// answer (positions in the step's batch; the batch's `prompt_index` points into this list).
struct Balanced {
    batch: Batch,
    prompts: Vec<usize>,
    metrics: Vec<(String, f64)>,
}

/// verl's `trainer.balance_batch`: reorder the step's responses so data-parallel ranks get equal
/// work (verl's `_balance_batch`, by `calculate_workload` of prompt + response lengths). One rank
/// keeps its rows in verl's order (sorted by workload, then zigzagged, which decides the
/// mini-batches); several ranks trade whole prompt groups (verl's PrefixGrouper rule), so each
/// rank's advantages still see whole groups. Reports verl's `global_seqlen/*` metrics.
fn balance_rollout(
    cfg: &Config,
    batch: Batch,
    slice: std::ops::Range<usize>,
    dp: &DataLayout,
    group: Option<&HostGroup>,
) -> anyhow::Result<Balanced> {
    let call = "balance_batch";
    let lengths = |b: &Batch| -> anyhow::Result<Vec<i64>> {
        let pm = b.tensor_in::<i64>(call, col::PROMPT_MASK)?;
        let rm = b.tensor_in::<i64>(call, col::RESPONSE_MASK)?;
        Ok((0..pm.rows())
            .map(|r| {
                let ones = |row: &[i64]| row.iter().filter(|&&m| m != 0).count() as i64;
                ones(pm.row(r)) + ones(rm.row(r))
            })
            .collect())
    };
    // Rows answer prompts by their position in the step's whole batch from here on.
    let mut batch = batch;
    let global: Vec<i64> = batch
        .tensor_in::<i64>(call, col::PROMPT_INDEX)?
        .data
        .iter()
        .map(|&i| i + slice.start as i64)
        .collect();
    batch.insert_tensor(col::PROMPT_INDEX, &[global.len()], &global);
    let (all, mine) = match group.filter(|_| dp.dp_size > 1) {
        None => {
            let groups = cfg
                .actor_rollout_ref
                .actor
                .use_prefix_grouper
                .then(|| Groups::from_keys(&global));
            let balanced = verl_algos::balance_batch(&lengths(&batch)?, 1, groups.as_ref())?;
            (balanced, batch)
        }
        Some(g) => {
            // Every rank gathers every replica's rows (a few MB; the gather returns one part per
            // replica, in data-parallel order) and keeps its own share; the partition is
            // computed identically everywhere.
            let parts = g.all_gather_bytes(&batch.to_bytes())?;
            let replicas: Vec<Batch> = parts
                .iter()
                .map(|p| Batch::from_bytes(p))
                .collect::<Result<_, _>>()?;
            let whole = Batch::concat(&replicas)?;
            let ids: Vec<i64> = whole.tensor_in::<i64>(call, col::PROMPT_INDEX)?.data;
            let groups = Groups::from_keys(&ids);
            let balanced =
                verl_algos::balance_batch(&lengths(&whole)?, dp.dp_size as usize, Some(&groups))?;
            (balanced, whole)
        }
    };
    let rank = if dp.dp_size > 1 {
        dp.dp_rank as usize
    } else {
        0
    };
    let mut mine = mine.select_rows(&all.ranks[rank]);
    // The prompts these rows answer, in first-seen order, and each row's place in that list.
    let ids = mine.tensor_in::<i64>(call, col::PROMPT_INDEX)?.data;
    let mut prompts: Vec<usize> = Vec::new();
    let local: Vec<i64> = ids
        .iter()
        .map(|&p| {
            let p = p as usize;
            let at = prompts.iter().position(|&q| q == p).unwrap_or_else(|| {
                prompts.push(p);
                prompts.len() - 1
            });
            at as i64
        })
        .collect();
    mine.insert_tensor(col::PROMPT_INDEX, &[local.len()], &local);
    Ok(Balanced {
        batch: mine,
        prompts,
        metrics: all.metrics,
    })
}

/// Everything one generation needs to be scored: texts and sample metadata per response row.
struct Rollout {
    responses: Tensor<i64>,
    response_mask: Tensor<i64>,
    prompt_index: Vec<usize>,
    reward: RewardOutput,
    prompt_text: Vec<String>,
    response_text: Vec<String>,
    ground_truth: Vec<serde_json::Value>,
}

impl Rollout {
    /// Rows `keep` as verl's generation dump rows, `score(r)` giving row r's score.
    fn dump_rows(
        &self,
        keep: impl IntoIterator<Item = usize>,
        score: impl Fn(usize) -> f64,
    ) -> DumpRows {
        let mut rows = DumpRows::default();
        for r in keep {
            rows.push(
                self.prompt_text[r].clone(),
                self.response_text[r].clone(),
                self.ground_truth[r].clone(),
                score(r),
                self.reward
                    .extra
                    .iter()
                    .map(|(k, v)| (k.clone(), v.get(r).copied().unwrap_or(f64::NAN))),
            );
        }
        rows
    }
}

struct Roles {
    actor: ActorClient,
    reference: Option<ActorClient>,
    critic: Option<CriticClient>,
    rewards: RewardRouter,
}

/// Generate for `samples` with `gen`, decode, and score.
fn generate_and_score(
    cfg: &Config,
    roles: &mut Roles,
    enc: &PromptEncoder,
    samples: &[&Sample],
    indices: &[usize],
    gen: &GenerateOptions,
) -> anyhow::Result<Rollout> {
    let prompts = enc.encode(samples, indices)?;
    let batch = roles.actor.generate(&prompts, gen)?;
    score_rollout(cfg, roles, enc, samples, &batch)
}

/// A training step's generation: `rollout.*` sampling, `rollout.response_length` tokens.
fn generate_options(cfg: &Config, eos: &[i64], pad: i64, seed: u64) -> GenerateOptions {
    let r = &cfg.actor_rollout_ref.rollout;
    GenerateOptions {
        n: r.n as u32,
        max_new_tokens: r.response_length as u32,
        temperature: r.temperature,
        top_p: r.top_p,
        top_k: r.top_k,
        do_sample: r.do_sample,
        seed: Some(seed),
        row_offset: 0,
        eos_token_ids: eos.to_vec(),
        pad_token_id: pad,
        ignore_eos: r.ignore_eos,
        return_log_probs: true,
        validate: false,
    }
}

/// A validation generation: `rollout.val_kwargs` sampling, otherwise as training.
fn validation_options(cfg: &Config, eos: &[i64], pad: i64, seed: u64) -> GenerateOptions {
    let vk = &cfg.actor_rollout_ref.rollout.val_kwargs;
    GenerateOptions {
        n: vk.n as u32,
        temperature: vk.temperature,
        top_p: vk.top_p,
        top_k: vk.top_k,
        do_sample: vk.do_sample,
        validate: true,
        ..generate_options(cfg, eos, pad, seed)
    }
}

/// `algorithm.*`: the advantage estimator's parameters and the in-reward KL penalty.
fn algorithm_settings(cfg: &Config) -> anyhow::Result<(AdvantageParams, KlPenalty, KlController)> {
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

/// Runs the PPO/GRPO loop the config describes and returns when `trainer.total_training_steps`
/// (or `trainer.total_epochs`) is done.
pub fn fit(cfg: &Config, plugins: &JobPlugins, opts: &FitOptions) -> anyhow::Result<FitSummary> {
    let t = &cfg.trainer;
    let (rank, world) = (opts.rank, opts.world_size.max(1));
    let group = opts.group.as_deref();
    match group {
        Some(g) if g.rank() != rank as usize || g.world_size() != world as usize => {
            return Err(TrainerError::Rank {
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
        None if world > 1 => {
            return Err(TrainerError::Rank {
                rank,
                world_size: world,
                message:
                    "a multi-rank fit needs FitOptions::group (the job's store) for its collectives"
                        .into(),
            }
            .into())
        }
        _ => {}
    }
    let dp = DataLayout::new(cfg, rank, world)?;
    if let Some(g) = group {
        g.set_data_ranks(dp.holds_data.clone())?;
    }
    let plan = validate_batches(
        cfg,
        Layout {
            world_size: world as u64,
            ..Layout::data_parallel(dp.dp_size as u64)
        },
    )?;
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
    let (adv_params, kl_penalty, mut kl_ctrl) = algorithm_settings(cfg)?;
    let correction = super::rollout_corr::rollout_correction(cfg)?;
    let bypass = correction.as_ref().is_some_and(|c| c.bypass_mode);

    let enc = PromptEncoder::new(cfg, &tokenizer_dir(cfg))?;
    let dcfg = data_config(cfg)?;
    let train_ds = Arc::new(load_split(
        &cfg.data.train_files.to_vec(),
        &dcfg,
        Split::Train,
        &enc,
    )?);
    let wants_val = t.test_freq > 0 || t.val_before_train || t.val_only;
    let val_ds = if wants_val {
        Some(Arc::new(load_split(
            &cfg.data.val_files.to_vec(),
            &dcfg,
            Split::Val,
            &enc,
        )?))
    } else {
        None
    };

    // Roles.
    let config_json = serde_json::to_value(cfg).context("serialising the config for plugins")?;
    let init = |role: Role| InitArgs {
        rank,
        world_size: world,
        local_rank: opts.local_rank,
        rendezvous: opts.rendezvous.clone(),
        ..InitArgs::new(role, config_json.clone())
    };
    let backend = &plugins.backend;
    let actor = backend
        .create_actor(&init(Role::Actor))
        .with_context(|| format!("creating the actor of backend `{}`", backend.name()))?;
    let reference = if cfg.need_reference_policy() {
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
            super::reward::PluginClient::Isolated(Box::new(
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
    let mut roles = Roles {
        actor,
        reference,
        critic,
        rewards: RewardRouter::new(reward_clients, models, cfg)?,
    };

    // Resume.
    let mut ckpt = CheckpointManager::new(
        &t.default_local_dir,
        KeepPolicy::from_verl(
            t.max_actor_ckpt_to_keep.map(|v| v as i64),
            t.max_critic_ckpt_to_keep.map(|v| v as i64),
        ),
    );
    if world > 1 {
        // Every rank writes its shard into the same pending folder, so they must agree on its
        // name; a non-numeric tag also lets the next run clean up after a crashed one.
        ckpt = ckpt.with_temp_tag("spmd");
    }
    let mode = ResumeMode::from_verl(&t.resume_mode, t.resume_from_path.as_deref())?;
    let mut global_step = 0u64;
    let mut loader_state: Option<DataLoaderState> = None;
    let mut resumed_from = None;
    match ckpt.resolve_resume(&mode)? {
        ResumeDecision::Fresh { note } => {
            if let Some(note) = note {
                tracing::warn!("{note}");
            }
        }
        ResumeDecision::Resume(point) => {
            let actor_dir = point.require_role(CkptRole::Actor)?;
            roles
                .actor
                .load(&actor_dir)
                .with_context(|| format!("restoring the actor from {}", actor_dir.display()))?;
            if let Some(critic) = roles.critic.as_mut() {
                let dir = point.require_role(CkptRole::Critic)?;
                critic
                    .load(&dir)
                    .with_context(|| format!("restoring the critic from {}", dir.display()))?;
            }
            if let Some(state) = &point.data_state {
                loader_state = Some(serde_json::from_value(state.clone()).map_err(|e| {
                    TrainerError::Checkpoint {
                        path: point.dir.clone(),
                        message: format!("data.json is not a data-loader state: {e}"),
                    }
                })?);
            }
            if let Some(state) = &point.trainer_state {
                let st: TrainerState = serde_json::from_value(state.clone()).map_err(|e| {
                    TrainerError::Checkpoint {
                        path: point.dir.clone(),
                        message: format!("trainer_state.json is not a trainer state: {e}"),
                    }
                })?;
                let coef = f64::from_bits(st.kl_coef_bits);
                kl_ctrl = match kl_ctrl {
                    KlController::Fixed { .. } => KlController::fixed(coef),
                    KlController::Adaptive {
                        target, horizon, ..
                    } => KlController::adaptive(coef, target, horizon as i64)?,
                };
            }
            global_step = point.global_step;
            resumed_from = Some(point.global_step);
            tracing::info!(step = global_step, dir = %point.dir.display(), "resumed from checkpoint");
        }
    }

    let mut loader = DataLoader::with_options(
        train_ds,
        LoaderOptions::train(&dcfg, Some(t.total_epochs)),
        loader_state,
    )?;
    let total_steps = t
        .total_training_steps
        .unwrap_or_else(|| loader.total_steps(t.total_epochs));

    let mut logger_opts = opts.logger.clone().unwrap_or_else(|| {
        LoggerOptions::from_verl(&t.project_name, &t.experiment_name, &t.logger.to_vec())
    });
    if logger_opts.tracking.config.is_null() {
        // verl gives wandb/mlflow/swanlab the whole resolved config.
        logger_opts.tracking.config = serde_json::to_value(cfg)?;
    }
    let mut logger = if rank == 0 {
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
    let mut summary = FitSummary {
        global_step,
        total_training_steps: total_steps,
        resumed_from,
        jsonl_path,
        plan: Some(plan.clone()),
        ..FitSummary::default()
    };
    // A step's metrics, and the validation samples `trainer.log_val_generations` selected.
    let mut log = |step: u64, m: &[(String, f64)], gens: &[ValGeneration]| -> anyhow::Result<()> {
        if let Some(l) = logger.as_mut() {
            l.log(step, m)?;
            if !gens.is_empty() {
                l.log_generations(step, gens)?;
            }
        }
        Ok(())
    };

    let ctx = Ctx {
        cfg,
        enc: &enc,
        rank,
        dp: &dp,
        group,
    };
    if let Some(ds) = &val_ds {
        if t.val_before_train || t.val_only {
            let v = validate(&ctx, &mut roles, ds, &dcfg, global_step)?;
            log(global_step, &v.metrics, &v.generations)?;
            summary.last_validation = Some(v.metrics);
            if t.val_only {
                finish(logger.as_mut())?;
                return Ok(summary);
            }
        }
    }

    global_step += 1;
    while global_step <= total_steps {
        let Some(data) = loader.next_batch() else {
            break;
        };
        let step_start = Instant::now();
        let mut timings = Timings::new();
        let slice = rank_slice(data.samples.len(), dp.dp_rank, dp.dp_size)?;
        let mut samples: Vec<&Sample> = data.samples[slice.clone()].iter().collect();
        let mut indices: Vec<usize> = data.indices[slice.clone()].to_vec();
        let mut metrics: Vec<(String, f64)> = Vec::new();

        // Rollout + reward.
        let gen = GenerateOptions {
            row_offset: slice.start as u64,
            ..generate_options(
                cfg,
                &enc.eos_ids,
                enc.pad_id,
                call_seed(t.seed, global_step, SALT_TRAIN),
            )
        };
        let t0 = Instant::now();
        let prompts = enc.encode(&samples, &indices)?;
        let mut batch = roles.actor.generate(&prompts, &gen)?;
        timings.add("gen", t0.elapsed().as_secs_f64());
        if t.balance_batch {
            let balanced = balance_rollout(cfg, batch, slice.clone(), &dp, group)?;
            batch = balanced.batch;
            samples = balanced.prompts.iter().map(|&p| &data.samples[p]).collect();
            indices = balanced.prompts.iter().map(|&p| data.indices[p]).collect();
            metrics.extend(balanced.metrics);
        }
        // What the rollout engine reports about itself (KV budget, pool use, preemptions).
        let rollout_meta: Vec<(String, f64)> = batch
            .meta()
            .into_iter()
            .filter(|(k, _)| k.starts_with("rollout/"))
            .filter_map(|(k, v)| v.as_f64().map(|x| (k, x)))
            .collect();
        metrics.extend(combine_rank_metrics(group, rollout_meta)?);

        let baselines = if estimator.needs_reward_baselines() {
            let t0 = Instant::now();
            let greedy = GenerateOptions {
                n: 1,
                do_sample: false,
                seed: Some(call_seed(t.seed, global_step, SALT_GREEDY)),
                ..gen.clone()
            };
            let base = generate_and_score(cfg, &mut roles, &enc, &samples, &indices, &greedy)?;
            timings.add("gen_max", t0.elapsed().as_secs_f64());
            let mut per_prompt = vec![0.0; samples.len()];
            for (r, &p) in base.prompt_index.iter().enumerate() {
                per_prompt[p] = base.reward.token_level_scores
                    [r * base.responses.cols()..(r + 1) * base.responses.cols()]
                    .iter()
                    .sum();
            }
            Some(per_prompt)
        } else {
            None
        };

        let t0 = Instant::now();
        let rollout = score_rollout(cfg, &mut roles, &enc, &samples, &batch)?;
        timings.add("reward", t0.elapsed().as_secs_f64());
        metrics.extend(combine_rank_metrics(group, rollout.reward.metrics.clone())?);
        let rows = rollout.responses.rows();
        let width = rollout.responses.cols();
        let mask = mask_grid(&rollout.response_mask)?;

        // Old log-probs (+ entropy), reference, values.
        let lp_opts = LogProbOptions {
            temperature: cfg.actor_rollout_ref.rollout.temperature,
            with_entropy: true,
        };
        // On-policy steps never read the old log-probs (the update takes the ratio against its
        // own detached log-probs, as verl does), so the pass is skipped unless something else
        // needs them; the update then reports actor/entropy from its own forward (same weights).
        // The rollout-vs-training log-prob metrics need the pass: verl reports them with
        // `rollout.calculate_log_probs`, and so the pass runs then.
        // Bypass mode (algorithm.rollout_correction.bypass_mode) takes the rollout's log-probs
        // as the old log-probs on every step, as verl does, and never runs the pass.
        let skip_old = bypass
            || (on_policy_old_log_prob_unused(cfg, &plan.actor)
                && t.critic_warmup <= global_step
                && !cfg.actor_rollout_ref.rollout.calculate_log_probs);
        let old_lp = if bypass {
            let rl = tensor_f32(&batch, col::ROLLOUT_LOG_PROBS, "rollout (bypass mode)")?;
            batch.insert_tensor(col::OLD_LOG_PROBS, &[rows, width], &rl.data);
            Some(rl)
        } else if skip_old {
            None
        } else {
            let t0 = Instant::now();
            let old = roles.actor.compute_log_prob(&batch, &lp_opts)?;
            timings.add("old_log_prob", t0.elapsed().as_secs_f64());
            let actor_call = format!("{}.actor.compute_log_prob", roles.actor.plugin());
            let old_lp = tensor_f32(&old, col::LOG_PROBS, &actor_call)?;
            let entropy = tensor_f32(&old, col::ENTROPY, &actor_call)?;
            let entropy_mean = match group {
                None => masked_mean(&grid_f64(&entropy)?, &mask)?,
                Some(g) => global_masked_mean(&grid_f64(&entropy)?, &mask, g)?,
            };
            metrics.push(("actor/entropy".into(), entropy_mean));
            if batch.contains(col::ROLLOUT_LOG_PROBS) {
                let rl = tensor_f32(&batch, col::ROLLOUT_LOG_PROBS, "rollout")?;
                metrics.extend(rollout_probs_diff(&rl.data, &old_lp.data, &mask, group)?);
            }
            batch.insert_tensor(col::OLD_LOG_PROBS, &[rows, width], &old_lp.data);
            Some(old_lp)
        };

        let ref_lp = if let Some(reference) = roles.reference.as_mut() {
            let t0 = Instant::now();
            let out = reference.compute_log_prob(
                &batch,
                &LogProbOptions {
                    with_entropy: false,
                    ..lp_opts.clone()
                },
            )?;
            timings.add("ref", t0.elapsed().as_secs_f64());
            let lp = tensor_f32(&out, col::LOG_PROBS, "reference.compute_log_prob")?;
            batch.insert_tensor(col::REF_LOG_PROBS, &[rows, width], &lp.data);
            Some(lp)
        } else {
            None
        };
        let values = if let Some(critic) = roles.critic.as_mut() {
            let t0 = Instant::now();
            let out = critic.compute_values(&batch, &ValueOptions::default())?;
            timings.add("values", t0.elapsed().as_secs_f64());
            let v = tensor_f32(&out, col::VALUES, "critic.compute_values")?;
            batch.insert_tensor(col::VALUES, &[rows, width], &v.data);
            Some(grid_f64(&v)?)
        } else {
            None
        };

        // Token rewards and advantages.
        let t0 = Instant::now();
        let scores = Grid::new(rows, width, rollout.reward.token_level_scores.clone())?;
        let token_rewards = match (&ref_lp, &old_lp, cfg.algorithm.use_kl_in_reward) {
            (Some(ref_lp), Some(old_lp), true) => {
                let (old_g, ref_g) = (grid_f64(old_lp)?, grid_f64(ref_lp)?);
                let out = with_reducer(group, |reducer| {
                    apply_kl_penalty_across(
                        &scores,
                        &old_g,
                        &ref_g,
                        &mask,
                        &mut kl_ctrl,
                        kl_penalty,
                        reducer,
                    )
                })?;
                metrics.extend(out.metrics.to_named().map(|(k, v)| (k.to_string(), v)));
                out.token_level_rewards
            }
            _ => scores.clone(),
        };
        // Decoupled rollout correction: importance weights and rejection against the recomputed
        // old log-probs, before the advantages (which, like the losses, skip rejected tokens).
        let loss_mask = match (&correction, &old_lp) {
            (Some(c), Some(old)) if c.corrects_in_trainer() => {
                let rl = tensor_f32(&batch, col::ROLLOUT_LOG_PROBS, "rollout")?;
                let (old_g, rl_g) = (grid_f64(old)?, grid_f64(&rl)?);
                let out = with_reducer(group, |reducer| {
                    compute_rollout_correction_across(c, &old_g, &rl_g, &mask, reducer)
                })?;
                metrics.extend(out.metrics);
                if let Some(w) = &out.weights {
                    batch.insert_tensor(col::ROLLOUT_IS_WEIGHTS, &[rows, width], &w.to_f32());
                }
                if !c.rs.is_empty() {
                    let m: Vec<i64> = out
                        .response_mask
                        .as_slice()
                        .iter()
                        .map(|&v| v as i64)
                        .collect();
                    batch.insert_tensor(col::LOSS_MASK, &[rows, width], &m);
                }
                out.response_mask
            }
            _ => mask.clone(),
        };
        let groups = Groups::from_keys(&rollout.prompt_index);
        let mut inputs = AdvantageInputs::new(&token_rewards, &loss_mask).with_index(&groups);
        if let Some(v) = &values {
            inputs = inputs.with_values(v);
        }
        let row_baselines: Option<Vec<f64>> = baselines
            .as_ref()
            .map(|b| rollout.prompt_index.iter().map(|&p| b[p]).collect());
        if let Some(b) = &row_baselines {
            inputs = inputs.with_reward_baselines(b);
        }
        let adv = with_reducer(group, |reducer| {
            compute_advantage_across(estimator, &inputs, &adv_params, reducer)
        })?;
        batch.insert_tensor(
            col::ADVANTAGES,
            &[rows, width],
            &to_f32(adv.advantages.as_slice()),
        );
        batch.insert_tensor(
            col::RETURNS,
            &[rows, width],
            &to_f32(adv.returns.as_slice()),
        );
        timings.add("adv", t0.elapsed().as_secs_f64());
        if let Some(dir) = &t.rollout_data_dir {
            let t0 = Instant::now();
            let seq = token_rewards_rowsum(&scores);
            dump_generations(
                dir,
                global_step,
                rollout.dump_rows(0..rows, |r| seq[r]),
                group,
            )?;
            timings.add("dump_rollout_generations", t0.elapsed().as_secs_f64());
        }

        // Updates.
        let update = UpdateOptions {
            global_step,
            temperature: Some(cfg.actor_rollout_ref.rollout.temperature),
            // verl injects the resolved step count into the optimiser config for LR schedules.
            // Without the old-log-prob pass the update reports actor/entropy itself.
            extra: serde_json::json!({
                "total_training_steps": total_steps,
                "entropy_metric": skip_old,
                "bypass_mode": bypass,
            }),
        };
        if let Some(critic) = roles.critic.as_mut() {
            let t0 = Instant::now();
            let m = critic.update(&batch, &update)?;
            timings.add("update_critic", t0.elapsed().as_secs_f64());
            metrics.extend(combine_rank_metrics(group, m)?);
        }
        if t.critic_warmup <= global_step {
            let t0 = Instant::now();
            let m = roles.actor.update(&batch, &update)?;
            timings.add("update_actor", t0.elapsed().as_secs_f64());
            metrics.extend(combine_rank_metrics(group, m)?);
        }

        let is_last = global_step >= total_steps;
        let mut val_generations = Vec::new();
        if let Some(ds) = &val_ds {
            if t.test_freq > 0 && (is_last || global_step.is_multiple_of(t.test_freq as u64)) {
                let t0 = Instant::now();
                let v = validate(&ctx, &mut roles, ds, &dcfg, global_step)?;
                timings.add("testing", t0.elapsed().as_secs_f64());
                metrics.extend(v.metrics.iter().cloned());
                val_generations = v.generations;
                summary.last_validation = Some(v.metrics);
            }
        }
        if t.save_freq > 0 && (is_last || global_step.is_multiple_of(t.save_freq as u64)) {
            let t0 = Instant::now();
            let state = TrainerState {
                global_step,
                epoch: data.epoch,
                kl_coef: kl_ctrl.value(),
                kl_coef_bits: kl_ctrl.value().to_bits(),
            };
            let hf = cfg
                .actor_rollout_ref
                .actor
                .checkpoint
                .save_contents
                .iter()
                .any(|c| c == "hf_model");
            match group {
                None => {
                    save_checkpoint(&ckpt, &mut roles, global_step, &loader.state(), &state, hf)?
                }
                Some(g) => save_checkpoint_spmd(
                    &ckpt,
                    &mut roles,
                    global_step,
                    &loader.state(),
                    &state,
                    g,
                    hf,
                )?,
            }
            timings.add("save_checkpoint", t0.elapsed().as_secs_f64());
            summary.checkpoints.push(global_step);
        }
        timings.add("step", step_start.elapsed().as_secs_f64());

        // Metrics, verl's order: training/*, data, timing, throughput.
        let prompt_mask = batch.tensor::<i64>(col::PROMPT_MASK)?;
        let prompt_lengths: Vec<usize> = (0..rows)
            .map(|r| prompt_mask.row(r).iter().filter(|&&m| m != 0).count())
            .collect();
        let response_lengths: Vec<usize> = (0..rows)
            .map(|r| {
                rollout
                    .response_mask
                    .row(r)
                    .iter()
                    .filter(|&&m| m != 0)
                    .count()
            })
            .collect();
        let sequence_scores: Vec<f64> = token_rewards_rowsum(&scores);
        let step_data = StepData {
            max_response_length: width,
            max_prompt_length: prompt_mask.cols(),
            sequence_scores: &sequence_scores,
            token_level_rewards: token_rewards.as_slice(),
            advantages: adv.advantages.as_slice(),
            returns: adv.returns.as_slice(),
            values: values.as_ref().map(|v| v.as_slice()),
            response_mask: mask.as_slice(),
            prompt_lengths: &prompt_lengths,
            response_lengths: &response_lengths,
            num_turns: None,
            tool_call_counts: None,
        };
        let summary_here = StepSummary::from_step(&step_data)?;
        let step_summary = match group {
            None => summary_here,
            Some(g) => {
                let parts = g.all_gather_f64(&summary_here.to_f64s())?;
                let parts = parts
                    .iter()
                    .map(|p| StepSummary::from_f64s(p))
                    .collect::<Result<Vec<_>, _>>()?;
                StepSummary::concat(parts)?
            }
        };
        if let Some(g) = group {
            timings = slowest_timings(&timings, g)?;
        }
        let mut all = vec![
            ("training/global_step".to_string(), global_step as f64),
            ("training/epoch".to_string(), data.epoch as f64),
        ];
        merge(&mut all, metrics);
        merge(&mut all, step_summary.metrics()?);
        let tokens = step_summary.token_counts();
        merge(&mut all, compute_timing_metrics(&timings, tokens));
        merge(
            &mut all,
            compute_throughput_metrics(&timings, tokens, world as usize)?,
        );
        log(global_step, &all, &val_generations)?;
        if opts.progress && rank == 0 {
            let get = |k: &str| all.iter().find(|(n, _)| n == k).map(|(_, v)| *v);
            eprintln!(
                "step {global_step}/{total_steps} epoch {}: score/mean {:.4} response_length/mean {:.1} {:.2}s",
                data.epoch,
                get("critic/score/mean").unwrap_or(f64::NAN),
                get("response_length/mean").unwrap_or(f64::NAN),
                get("timing_s/step").unwrap_or(f64::NAN),
            );
        }
        summary.global_step = global_step;
        summary.last_metrics = all;
        if is_last {
            break;
        }
        global_step += 1;
    }
    finish(logger.as_mut())?;
    Ok(summary)
}

/// verl collects a step's metrics in a dict: a later value under the same name (the actor
/// update's `actor/entropy` after the old-log-prob pass's) replaces the earlier one in place.
fn merge(into: &mut Vec<(String, f64)>, more: impl IntoIterator<Item = (String, f64)>) {
    for (k, v) in more {
        match into.iter_mut().find(|(n, _)| *n == k) {
            Some(slot) => slot.1 = v,
            None => into.push((k, v)),
        }
    }
}

fn finish(logger: Option<&mut MetricsLogger>) -> anyhow::Result<()> {
    if let Some(l) = logger {
        l.finish()?;
    }
    Ok(())
}

fn token_rewards_rowsum(g: &Grid<f64>) -> Vec<f64> {
    g.iter_rows().map(|r| r.iter().sum()).collect()
}

/// verl's `training/rollout_probs_diff_*`: how far the sampler's token probabilities are from
/// the trainer's recomputation, over the whole batch (every rank takes part in the reductions,
/// even one without a valid token).
fn rollout_probs_diff(
    rollout: &[f32],
    old: &[f32],
    mask: &Grid<f64>,
    group: Option<&HostGroup>,
) -> anyhow::Result<Vec<(String, f64)>> {
    let diffs: Vec<f64> = rollout
        .iter()
        .zip(old)
        .zip(mask.as_slice())
        .filter(|(_, &m)| m != 0.0)
        .map(|((&a, &b), _)| ((a as f64).exp() - (b as f64).exp()).abs())
        .collect();
    let mut first = [diffs.iter().sum::<f64>(), diffs.len() as f64];
    let mut max = [diffs.iter().cloned().fold(0.0, f64::max)];
    if let Some(g) = group {
        g.all_reduce_f64(&mut first, ReduceOp::Sum)?;
        g.all_reduce_f64(&mut max, ReduceOp::Max)?;
    }
    let [sum, n] = first;
    let mean = sum / n.max(1.0);
    // Centred on the batch-wide mean, as a single-process two-pass variance is.
    let mut centred = [diffs.iter().map(|d| (d - mean).powi(2)).sum::<f64>()];
    if let Some(g) = group {
        g.all_reduce_f64(&mut centred, ReduceOp::Sum)?;
    }
    if n == 0.0 {
        return Ok(Vec::new());
    }
    let var = if n > 1.0 { centred[0] / (n - 1.0) } else { 0.0 };
    Ok(vec![
        ("training/rollout_probs_diff_max".into(), max[0]),
        ("training/rollout_probs_diff_mean".into(), mean),
        ("training/rollout_probs_diff_std".into(), var.sqrt()),
    ])
}

/// Runs `f` with the reducer that makes `verl_algos`' batch statistics span every rank.
fn with_reducer<T>(group: Option<&HostGroup>, f: impl FnOnce(&mut dyn CrossRankSum) -> T) -> T {
    match group {
        None => f(&mut LocalOnly),
        Some(g) => {
            let mut g = g;
            f(&mut g)
        }
    }
}

/// verl's `masked_mean` over the whole batch of a multi-rank job.
fn global_masked_mean(
    values: &Grid<f64>,
    mask: &Grid<f64>,
    group: &HostGroup,
) -> anyhow::Result<f64> {
    let mut sums = [
        verl_algos::masked_sum(values, mask)?,
        mask.as_slice().iter().sum::<f64>(),
    ];
    group.all_reduce_f64(&mut sums, ReduceOp::Sum)?;
    Ok(sums[0] / (sums[1] + MASKED_MEAN_EPS))
}

/// A plugin's per-rank metrics as one set: values every rank agrees on stay as they are (the
/// learning rate, a grad norm the backend already reduced, counts), others are averaged over
/// ranks, or take the max/min for `*/max`/`*/min`. Names in rank 0's order; a name only some
/// ranks report is reduced over those.
fn combine_rank_metrics(
    group: Option<&HostGroup>,
    mine: Vec<(String, f64)>,
) -> anyhow::Result<Vec<(String, f64)>> {
    let Some(g) = group else {
        return Ok(mine);
    };
    // Bits, not JSON numbers: a value must come back exactly to compare equal across ranks.
    let bits: Vec<(String, u64)> = mine.iter().map(|(k, v)| (k.clone(), v.to_bits())).collect();
    let all = g.all_gather_json(&bits)?;
    let mut names: Vec<&String> = Vec::new();
    for part in &all {
        for (k, _) in part {
            if !names.contains(&k) {
                names.push(k);
            }
        }
    }
    Ok(names
        .into_iter()
        .map(|k| {
            let vals: Vec<f64> = all
                .iter()
                .filter_map(|p| p.iter().find(|(n, _)| n == k))
                .map(|(_, b)| f64::from_bits(*b))
                .collect();
            let v = if vals.iter().all(|v| v.to_bits() == vals[0].to_bits()) {
                vals[0]
            } else if k.ends_with("/max") {
                vals.iter().cloned().fold(f64::NEG_INFINITY, f64::max)
            } else if k.ends_with("/min") {
                vals.iter().cloned().fold(f64::INFINITY, f64::min)
            } else {
                vals.iter().sum::<f64>() / vals.len() as f64
            };
            (k.clone(), v)
        })
        .collect())
}

/// Each phase's time on the slowest rank (every rank records the same phases in the same order).
fn slowest_timings(timings: &Timings, group: &HostGroup) -> anyhow::Result<Timings> {
    let mut secs: Vec<f64> = timings.iter().map(|(_, s)| s).collect();
    group.all_reduce_f64(&mut secs, ReduceOp::Max)?;
    let mut out = Timings::new();
    for ((name, _), s) in timings.iter().zip(secs) {
        out.add(name, s);
    }
    Ok(out)
}

/// Decode and score an already generated batch.
fn score_rollout(
    cfg: &Config,
    roles: &mut Roles,
    enc: &PromptEncoder,
    samples: &[&Sample],
    batch: &Batch,
) -> anyhow::Result<Rollout> {
    let call = format!("{}.actor.generate", roles.actor.plugin());
    let responses = batch.tensor_in::<i64>(&call, col::RESPONSES)?;
    let response_mask = batch.tensor_in::<i64>(&call, col::RESPONSE_MASK)?;
    let prompt_ids = batch.tensor_in::<i64>(&call, col::PROMPTS)?;
    let prompt_mask = batch.tensor_in::<i64>(&call, col::PROMPT_MASK)?;
    let prompt_index: Vec<usize> = batch
        .tensor_in::<i64>(&call, col::PROMPT_INDEX)?
        .data
        .iter()
        .map(|&i| i as usize)
        .collect();
    if let Some(bad) = prompt_index.iter().find(|&&i| i >= samples.len()) {
        bail!(
            "{call}: prompt_index {bad} is out of range for {} prompts",
            samples.len()
        );
    }
    let prompt_text = enc.decode_rows(&prompt_ids, &prompt_mask)?;
    let response_text = enc.decode_rows(&responses, &response_mask)?;
    let s = |r: usize| samples[prompt_index[r]];
    let n = prompt_index.len();
    let data_source: Vec<String> = (0..n).map(|r| s(r).data_source.clone()).collect();
    let ground_truth: Vec<serde_json::Value> = (0..n)
        .map(|r| s(r).reward_model.ground_truth.clone())
        .collect();
    let extra_info: Vec<serde_json::Value> = (0..n).map(|r| s(r).extra_info.clone()).collect();
    let raw_prompt: Vec<&[verl_data::Message]> = (0..n).map(|r| s(r).prompt.as_slice()).collect();
    let reward = roles.rewards.score(
        cfg,
        &RewardInput {
            prompt_text: &prompt_text,
            response_text: &response_text,
            data_source: &data_source,
            ground_truth: &ground_truth,
            extra_info: &extra_info,
            responses: &responses,
            response_mask: &response_mask,
            raw_prompt: &raw_prompt,
            prompts: &prompt_ids,
            prompt_mask: &prompt_mask,
            policy_tokenizer: &enc.tokenizer,
        },
    )?;
    Ok(Rollout {
        responses,
        response_mask,
        prompt_index,
        reward,
        prompt_text,
        response_text,
        ground_truth,
    })
}

struct Ctx<'a> {
    cfg: &'a Config,
    enc: &'a PromptEncoder,
    rank: u32,
    dp: &'a DataLayout,
    group: Option<&'a HostGroup>,
}

/// How the job's ranks split into data-parallel replicas. The FSDP backend is data-parallel
/// only; the Megatron backend groups `tensor × context × pipeline` ranks into one replica that
/// sees the same prompts (Megatron's rank order: tensor fastest, then context, data, pipeline).
#[derive(Debug, Clone)]
struct DataLayout {
    dp_rank: u32,
    dp_size: u32,
    /// Per rank: the first rank of its replica (the one whose data counts in host statistics).
    holds_data: Vec<bool>,
}

impl DataLayout {
    fn new(cfg: &Config, rank: u32, world: u32) -> anyhow::Result<DataLayout> {
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

/// One validation batch's scored rows on one rank, as sent to the others (floats as bits, so
/// the gathered table is exactly the one a single rank would build).
#[derive(Debug, Default, Serialize, Deserialize)]
struct ValRows {
    /// Prompt and response texts, for `trainer.log_val_generations` (empty when it is 0).
    inputs: Vec<String>,
    outputs: Vec<String>,
    sources: Vec<String>,
    uids: Vec<String>,
    scores: Vec<u64>,
    extra: Vec<(String, Vec<u64>)>,
}

/// verl's `_validate`: generate with `rollout.val_kwargs` over the whole validation set, score,
/// and reduce per data source to `val-core/...` / `val-aux/...`.
fn validate(
    ctx: &Ctx<'_>,
    roles: &mut Roles,
    ds: &Arc<Dataset>,
    dcfg: &verl_data::DataConfig,
    global_step: u64,
) -> anyhow::Result<Validation> {
    let cfg = ctx.cfg;
    let world = ctx.dp.dp_size.max(1) as usize;
    let mut loader =
        DataLoader::with_options(ds.clone(), LoaderOptions::validation(dcfg, ds.len()), None)?;
    let (mut sources, mut uids, mut scores) = (Vec::new(), Vec::new(), Vec::new());
    let mut generations = Vec::new();
    let mut extra: std::collections::BTreeMap<String, Vec<f64>> = Default::default();
    let mut batch_no = 0u64;
    let mut dump = DumpRows::default();
    while let Some(b) = loader.next_batch() {
        let real = b.samples.len();
        // verl pads a validation batch to a multiple of the data-parallel size by repeating its first
        // prompts, and drops what the padding generated.
        let padded = real.div_ceil(world) * world;
        let all: Vec<&Sample> = (0..padded).map(|i| &b.samples[i % real]).collect();
        let all_indices: Vec<usize> = (0..padded).map(|i| b.indices[i % real]).collect();
        let slice = rank_slice(padded, ctx.dp.dp_rank, ctx.dp.dp_size)?;
        let samples = &all[slice.clone()];
        let gen = GenerateOptions {
            row_offset: slice.start as u64,
            ..validation_options(
                cfg,
                &ctx.enc.eos_ids,
                ctx.enc.pad_id,
                call_seed(cfg.trainer.seed, batch_no, SALT_VAL),
            )
        };
        let r = generate_and_score(
            cfg,
            roles,
            ctx.enc,
            samples,
            &all_indices[slice.clone()],
            &gen,
        )?;
        let keep: Vec<usize> = (0..r.prompt_index.len())
            .filter(|&row| slice.start + r.prompt_index[row] < real)
            .collect();
        let texts = |t: &[String]| -> Vec<String> {
            if cfg.trainer.log_val_generations > 0 {
                keep.iter().map(|&row| t[row].clone()).collect()
            } else {
                Vec::new()
            }
        };
        let mine = ValRows {
            inputs: texts(&r.prompt_text),
            outputs: texts(&r.response_text),
            sources: keep
                .iter()
                .map(|&row| samples[r.prompt_index[row]].data_source.clone())
                .collect(),
            uids: keep
                .iter()
                .map(|&row| all_indices[slice.start + r.prompt_index[row]].to_string())
                .collect(),
            scores: keep
                .iter()
                .map(|&row| r.reward.scores[row].to_bits())
                .collect(),
            extra: r
                .reward
                .extra
                .iter()
                .map(|(k, v)| {
                    let col = keep
                        .iter()
                        .map(|&row| v.get(row).copied().unwrap_or(f64::NAN).to_bits())
                        .collect();
                    (k.clone(), col)
                })
                .collect(),
        };
        if cfg.trainer.validation_data_dir.is_some() {
            let part = r.dump_rows(keep.iter().copied(), |row| r.reward.scores[row]);
            let mut parts = match ctx.group {
                None => vec![part],
                Some(g) => g.all_gather_json(&part)?,
            };
            if ctx.rank == 0 {
                for p in parts.drain(..) {
                    dump.append(p);
                }
            }
        }
        let parts = match ctx.group {
            None => vec![mine],
            Some(g) => g.all_gather_json(&mine)?,
        };
        for part in parts {
            let before = scores.len();
            for ((input, output), &score) in
                part.inputs.into_iter().zip(part.outputs).zip(&part.scores)
            {
                generations.push(ValGeneration::new(input, output, f64::from_bits(score)));
            }
            sources.extend(part.sources);
            uids.extend(part.uids);
            scores.extend(part.scores.into_iter().map(f64::from_bits));
            for (k, v) in part.extra {
                let col = extra.entry(k).or_insert_with(|| vec![f64::NAN; before]);
                col.resize(before, f64::NAN);
                col.extend(v.into_iter().map(f64::from_bits));
            }
        }
        batch_no += 1;
    }
    let mut infos = vec![("reward".to_string(), InfoColumn::Numbers(scores.clone()))];
    for (k, mut v) in extra {
        v.resize(scores.len(), f64::NAN);
        if k != "reward" {
            infos.push((k, InfoColumn::Numbers(v)));
        }
    }
    if let Some(dir) = &cfg.trainer.validation_data_dir {
        // The rows were gathered batch by batch above; rank 0 holds them all.
        if ctx.rank == 0 {
            dump_generations(dir, global_step, dump, None)?;
        }
    }
    let table = process_validation_metrics(&sources, &uids, &infos, BOOTSTRAP_SEED)?;
    let n = cfg.trainer.log_val_generations as usize;
    Ok(Validation {
        metrics: validation_metrics(&table, None),
        generations: select_val_generations(generations, n),
    })
}

/// One validation: verl's `val-core/...` metrics, and the samples `trainer.log_val_generations`
/// asks to log (verl's selection; empty when it is 0).
struct Validation {
    metrics: Vec<(String, f64)>,
    generations: Vec<ValGeneration>,
}

/// The actor's part of a checkpoint: its state, and with `hf` (verl's `hf_model` in
/// `checkpoint.save_contents`) an HF export of the policy in `huggingface/` beside it.
fn save_actor(actor: &mut ActorClient, dir: &Path, hf: bool) -> Result<(), WriterError> {
    actor.save(dir).map_err(|e| Box::new(e) as WriterError)?;
    if hf {
        actor
            .export_hf(&dir.join(HF_EXPORT_DIR))
            .map_err(|e| Box::new(e) as WriterError)?;
    }
    Ok(())
}

/// Where an `hf_model` checkpoint puts the policy's HF export, inside the actor's folder (as verl).
const HF_EXPORT_DIR: &str = "huggingface";

/// verl's `_save_checkpoint`: the roles fill `actor/` and `critic/`, then the loader position and
/// the loop state, then the tracker file (atomically, by the checkpoint crate).
fn save_checkpoint(
    ckpt: &CheckpointManager,
    roles: &mut Roles,
    step: u64,
    loader: &DataLoaderState,
    state: &TrainerState,
    hf: bool,
) -> anyhow::Result<()> {
    let actor = &mut roles.actor;
    let mut writers: Vec<(CkptRole, RoleWriter<'_>)> = vec![(
        CkptRole::Actor,
        Box::new(move |dir: &Path| save_actor(actor, dir, hf)),
    )];
    if let Some(critic) = roles.critic.as_mut() {
        writers.push((
            CkptRole::Critic,
            Box::new(move |dir: &Path| critic.save(dir).map_err(|e| Box::new(e) as WriterError)),
        ));
    }
    let data = serde_json::to_value(loader)?;
    let st = serde_json::to_value(state)?;
    let saved = ckpt
        .save(step, writers, Some(&data), Some(&st))
        .with_context(|| format!("saving the checkpoint of step {step}"))?;
    tracing::info!(step, dir = %saved.dir.display(), "checkpoint saved");
    Ok(())
}

/// [`save_checkpoint`] for a multi-rank job: rank 0 opens the pending step folder, every rank's
/// roles write their shards into it, then rank 0 alone writes the host state and commits (the
/// atomic rename and tracker update) once every shard is written. No rank goes on before the
/// commit, so a later failure never finds a half-published step.
fn save_checkpoint_spmd(
    ckpt: &CheckpointManager,
    roles: &mut Roles,
    step: u64,
    loader: &DataLoaderState,
    state: &TrainerState,
    group: &HostGroup,
    hf: bool,
) -> anyhow::Result<()> {
    let context = || format!("saving the checkpoint of step {step}");
    let mut role_dirs = vec![CkptRole::Actor];
    if roles.critic.is_some() {
        role_dirs.push(CkptRole::Critic);
    }
    if group.rank() == 0 {
        let mut pending = ckpt.begin(step).with_context(context)?;
        for role in &role_dirs {
            let dir = pending.role_dir(*role);
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        group.barrier("checkpoint-begin")?;
        let actor = &mut roles.actor;
        pending
            .write_role(CkptRole::Actor, |dir: &Path| save_actor(actor, dir, hf))
            .with_context(context)?;
        if let Some(critic) = roles.critic.as_mut() {
            pending
                .write_role(CkptRole::Critic, |dir: &Path| {
                    critic.save(dir).map_err(|e| Box::new(e) as WriterError)
                })
                .with_context(context)?;
        }
        group.barrier("checkpoint-written")?;
        pending
            .write_json(DATA_STATE_FILE, &serde_json::to_value(loader)?)
            .with_context(context)?;
        pending
            .write_json(TRAINER_STATE_FILE, &serde_json::to_value(state)?)
            .with_context(context)?;
        let saved = pending.commit().with_context(context)?;
        tracing::info!(step, dir = %saved.dir.display(), "checkpoint saved");
        group.barrier("checkpoint-committed")?;
    } else {
        group.barrier("checkpoint-begin")?;
        let tmp = ckpt.temp_dir(step);
        let dir = tmp.join(CkptRole::Actor.dir_name());
        save_actor(&mut roles.actor, &dir, hf)
            .map_err(|e| anyhow::anyhow!("{e}"))
            .with_context(|| format!("saving the actor's shard into {}", dir.display()))?;
        if let Some(critic) = roles.critic.as_mut() {
            let dir = tmp.join(CkptRole::Critic.dir_name());
            critic
                .save(&dir)
                .with_context(|| format!("saving the critic's shard into {}", dir.display()))?;
        }
        group.barrier("checkpoint-written")?;
        group.barrier("checkpoint-committed")?;
    }
    Ok(())
}

/// Whether the old-log-prob pass computes nothing the step uses: one mini-batch and one epoch
/// (the update is on-policy and, like verl's, takes the PPO ratio against its own detached
/// log-probs), no KL penalty in the reward (which reads them), and
/// `trainer.skip_on_policy_old_log_prob` (verl-rs extension, default true) not turned off.
pub(crate) fn on_policy_old_log_prob_unused(cfg: &Config, actor: &verl_config::UpdatePlan) -> bool {
    cfg.trainer.skip_on_policy_old_log_prob
        && actor.ppo_epochs == 1
        && actor.mini_batches_per_step == 1
        && !cfg.algorithm.use_kl_in_reward
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The config accepts exactly the estimators the trainer computes (the two crates do not
    /// depend on each other, so the lists are compared here).
    #[test]
    fn the_config_accepts_the_estimators_the_trainer_computes() {
        assert_eq!(
            verl_config::IMPLEMENTED_ESTIMATORS,
            verl_algos::AdvantageEstimator::NAMES
        );
        for name in verl_config::IMPLEMENTED_ESTIMATORS {
            assert!(verl_config::ADV_ESTIMATORS.contains(name), "{name}");
        }
    }

    #[test]
    fn call_seeds_depend_on_step_and_purpose_only() {
        assert_eq!(call_seed(42, 3, SALT_TRAIN), call_seed(42, 3, SALT_TRAIN));
        let all = [
            call_seed(42, 3, SALT_TRAIN),
            call_seed(42, 4, SALT_TRAIN),
            call_seed(42, 3, SALT_GREEDY),
            call_seed(42, 3, SALT_VAL),
            call_seed(43, 3, SALT_TRAIN),
        ];
        for i in 0..all.len() {
            for j in i + 1..all.len() {
                assert_ne!(all[i], all[j], "{i} vs {j}");
            }
        }
    }

    fn job(overrides: &[&str]) -> Config {
        Config::from_overrides(overrides).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn data_keys_reach_the_data_loader() {
        let d = data_config(&job(&[
            "data.prompt_key=question",
            "data.reward_fn_key=source",
            "data.max_prompt_length=77",
            "data.filter_overlong_prompts=true",
            "data.truncation=middle",
            "data.train_max_samples=100",
            "data.val_max_samples=20",
            "data.shuffle=false",
            "data.seed=9",
            "data.train_batch_size=12",
            "data.val_batch_size=5",
            "data.validation_shuffle=true",
            "data.image_key=pictures",
            "data.video_key=clips",
            "data.audio_key=sounds",
        ]))
        .unwrap();
        assert_eq!(d.prompt_key, "question");
        assert_eq!(d.reward_fn_key, "source");
        assert_eq!(d.max_prompt_length, 77);
        assert!(d.filter_overlong_prompts);
        assert_eq!(d.truncation, verl_data::Truncation::Middle);
        assert_eq!((d.train_max_samples, d.val_max_samples), (100, 20));
        assert!(!d.shuffle && d.validation_shuffle);
        assert_eq!(d.seed, Some(9));
        assert_eq!((d.train_batch_size, d.val_batch_size), (12, Some(5)));
        let columns: Vec<&str> = d.media_columns.iter().map(|(_, c)| c.as_str()).collect();
        assert_eq!(columns, ["pictures", "clips", "sounds"]);
        // verl seeds the sampler with data.seed; unset, verl-rs uses its own trainer.seed.
        let d = data_config(&job(&["trainer.seed=5"])).unwrap();
        assert_eq!(d.seed, Some(5));
    }

    #[test]
    fn rollout_keys_reach_generation() {
        let cfg = job(&[
            "actor_rollout_ref.rollout.n=3",
            "actor_rollout_ref.rollout.temperature=0.7",
            "actor_rollout_ref.rollout.top_p=0.9",
            "actor_rollout_ref.rollout.top_k=20",
            "actor_rollout_ref.rollout.do_sample=false",
            "actor_rollout_ref.rollout.ignore_eos=true",
            "data.max_response_length=64",
            "actor_rollout_ref.rollout.val_kwargs.n=4",
            "actor_rollout_ref.rollout.val_kwargs.temperature=0.5",
            "actor_rollout_ref.rollout.val_kwargs.top_p=0.8",
            "actor_rollout_ref.rollout.val_kwargs.top_k=5",
            "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
        ]);
        let g = generate_options(&cfg, &[7, 8], 0, 11);
        assert_eq!((g.n, g.max_new_tokens), (3, 64));
        assert_eq!((g.temperature, g.top_p, g.top_k), (0.7, 0.9, 20));
        assert!(!g.do_sample && g.ignore_eos && !g.validate);
        assert_eq!((g.eos_token_ids.clone(), g.seed), (vec![7, 8], Some(11)));
        let v = validation_options(&cfg, &[7], 0, 12);
        assert_eq!((v.n, v.max_new_tokens), (4, 64));
        assert_eq!((v.temperature, v.top_p, v.top_k), (0.5, 0.8, 5));
        assert!(v.do_sample && v.validate);
        // rollout.response_length follows data.max_response_length unless set itself.
        let cfg = job(&["actor_rollout_ref.rollout.response_length=32"]);
        assert_eq!(generate_options(&cfg, &[1], 0, 1).max_new_tokens, 32);
    }

    #[test]
    fn algorithm_keys_reach_the_advantage_and_kl_settings() {
        let (p, penalty, ctrl) = algorithm_settings(&job(&[
            "algorithm.gamma=0.9",
            "algorithm.lam=0.8",
            "algorithm.norm_adv_by_std_in_grpo=false",
            "algorithm.kl_penalty=low_var_kl",
            "algorithm.kl_ctrl.type=adaptive",
            "algorithm.kl_ctrl.kl_coef=0.2",
            "algorithm.kl_ctrl.target_kl=0.05",
            "algorithm.kl_ctrl.horizon=500",
        ]))
        .unwrap();
        assert_eq!(
            (p.gamma, p.lam, p.norm_adv_by_std_in_grpo),
            (0.9, 0.8, false)
        );
        assert_eq!(penalty, KlPenalty::LowVarKl);
        assert_eq!(
            ctrl,
            KlController::Adaptive {
                value: 0.2,
                target: 0.05,
                horizon: 500.0
            }
        );
        let (_, penalty, ctrl) = algorithm_settings(&job(&[
            "algorithm.kl_penalty=mse",
            "algorithm.kl_ctrl.kl_coef=0.3",
        ]))
        .unwrap();
        assert_eq!(penalty, KlPenalty::Mse);
        assert_eq!(ctrl, KlController::fixed(0.3));
    }

    /// A generation output of `n = 2` samples per prompt with these prompt / response lengths.
    fn generated(lengths: &[(usize, usize)], first_prompt: usize) -> Batch {
        let (pw, rw) = (12, 12);
        let rows = lengths.len();
        let mut pm = vec![0i64; rows * pw];
        let mut rm = vec![0i64; rows * rw];
        for (r, &(p, q)) in lengths.iter().enumerate() {
            pm[r * pw + pw - p..(r + 1) * pw].fill(1);
            rm[r * rw..r * rw + q].fill(1);
        }
        let mut b = Batch::new();
        b.insert_tensor(col::PROMPT_MASK, &[rows, pw], &pm);
        b.insert_tensor(col::RESPONSE_MASK, &[rows, rw], &rm);
        let ids: Vec<i64> = (0..rows).map(|r| (r / 2) as i64).collect();
        b.insert_tensor(col::PROMPT_INDEX, &[rows], &ids);
        // The row's global number, to see where it went.
        let tag: Vec<i64> = (0..rows).map(|r| (first_prompt * 2 + r) as i64).collect();
        b.insert_tensor("tag", &[rows], &tag);
        b
    }

    const LENGTHS: [(usize, usize); 8] = [
        (6, 4),
        (2, 1),
        (4, 3),
        (3, 2),
        (5, 4),
        (1, 1),
        (5, 3),
        (2, 2),
    ];

    #[test]
    fn one_rank_keeps_its_rows_in_verls_balanced_order() {
        let cfg = job(&[]);
        let dp = DataLayout::new(&cfg, 0, 1).unwrap();
        let b = balance_rollout(&cfg, generated(&LENGTHS, 0), 0..4, &dp, None).unwrap();
        // Sequence lengths 10 3 7 5 9 2 8 4: sorted by workload 5 1 7 3 2 6 4 0, then verl's
        // zigzag (even positions, then the odd ones reversed).
        assert_eq!(
            b.batch.tensor::<i64>("tag").unwrap().data,
            vec![5, 7, 2, 4, 0, 6, 3, 1]
        );
        // The rows answer prompts 2 3 1 2 0 3 1 0, listed in first-seen order.
        assert_eq!(b.prompts, vec![2, 3, 1, 0]);
        assert_eq!(
            b.batch.tensor::<i64>(col::PROMPT_INDEX).unwrap().data,
            vec![0, 1, 2, 0, 3, 1, 2, 3]
        );
        let m: std::collections::BTreeMap<_, _> = b.metrics.into_iter().collect();
        assert_eq!(m["global_seqlen/min"], 48.0);
        assert_eq!(m["global_seqlen/balanced_max"], 48.0);
        assert_eq!(m["global_seqlen/mean"], 48.0);
    }

    #[test]
    fn ranks_trade_whole_prompt_groups_until_their_work_is_equal() {
        use verl_store::{StoreClient, StoreServer};
        let cfg = job(&["trainer.n_gpus_per_node=2"]);
        let server = StoreServer::bind("127.0.0.1:0").unwrap();
        let addr = server.connect_addr();
        let outs: Vec<Balanced> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..2usize)
                .map(|r| {
                    let cfg = &cfg;
                    s.spawn(move || {
                        let c = StoreClient::connect_as(addr, r, std::time::Duration::from_secs(5))
                            .unwrap();
                        let g =
                            HostGroup::new(Arc::new(c), r, 2, std::time::Duration::from_secs(10));
                        let dp = DataLayout::new(cfg, r as u32, 2).unwrap();
                        let mine = &LENGTHS[r * 4..(r + 1) * 4];
                        let slice = r * 2..(r + 1) * 2;
                        balance_rollout(cfg, generated(mine, r * 2), slice, &dp, Some(&g)).unwrap()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        // Group sizes 13 12 11 12 tokens: before, ranks hold 25 and 23; after, 24 and 24.
        let tokens = |b: &Balanced| -> usize {
            b.batch
                .tensor::<i64>("tag")
                .unwrap()
                .data
                .iter()
                .map(|&t| LENGTHS[t as usize].0 + LENGTHS[t as usize].1)
                .sum()
        };
        assert_eq!((tokens(&outs[0]), tokens(&outs[1])), (24, 24));
        let mut all: Vec<i64> = outs
            .iter()
            .flat_map(|b| b.batch.tensor::<i64>("tag").unwrap().data)
            .collect();
        all.sort();
        assert_eq!(
            all,
            (0..8).collect::<Vec<i64>>(),
            "every row on exactly one rank"
        );
        for b in &outs {
            // Whole groups: each prompt's two samples on the same rank.
            assert_eq!(b.prompts.len(), 2);
            let tags = b.batch.tensor::<i64>("tag").unwrap().data;
            for p in &b.prompts {
                assert_eq!(tags.iter().filter(|&&t| t as usize / 2 == *p).count(), 2);
            }
        }
        assert_eq!(outs[0].metrics, outs[1].metrics);
        let m: std::collections::BTreeMap<_, _> = outs[0].metrics.iter().cloned().collect();
        assert_eq!(
            (m["global_seqlen/min"], m["global_seqlen/max"]),
            (23.0, 25.0)
        );
        assert_eq!(
            (
                m["global_seqlen/balanced_min"],
                m["global_seqlen/balanced_max"]
            ),
            (24.0, 24.0)
        );
    }

    #[test]
    fn ranks_get_disjoint_whole_prompt_slices() {
        assert_eq!(rank_slice(8, 0, 1).unwrap(), 0..8);
        assert_eq!(rank_slice(8, 1, 4).unwrap(), 2..4);
        let err = rank_slice(6, 0, 4).unwrap_err().to_string();
        assert!(err.contains("6 prompts") && err.contains("4"), "{err}");
    }

    #[test]
    fn later_metrics_replace_earlier_ones_in_place() {
        let mut m = vec![("a".to_string(), 1.0), ("b".to_string(), 2.0)];
        merge(&mut m, vec![("a".to_string(), 3.0), ("c".to_string(), 4.0)]);
        assert_eq!(
            m,
            vec![
                ("a".to_string(), 3.0),
                ("b".to_string(), 2.0),
                ("c".to_string(), 4.0)
            ]
        );
    }

    #[test]
    fn probs_diff_ignores_padding() {
        let mask = Grid::new(1, 3, vec![1.0, 1.0, 0.0]).unwrap();
        let m = rollout_probs_diff(&[0.0, -1.0, -5.0], &[0.0, -1.0, 0.0], &mask, None).unwrap();
        assert_eq!(m[0], ("training/rollout_probs_diff_max".to_string(), 0.0));
    }
}
