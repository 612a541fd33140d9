//! The loop itself: verl's `RayPPOTrainer.fit` on one data-parallel rank. [`fit`] sets the run
//! up ([`Trainer::setup`], from the parts in `setup.rs`, resuming through `checkpoint.rs`),
//! validates before training, then runs one `Trainer::step` (`step.rs`) per batch of prompts.
//! Across ranks (`FitOptions::group`) every batch-wide quantity is reduced through [`Ranks`]
//! (`reduce.rs`).

use std::sync::Arc;

use verl_config::{validate_batches, BatchPlan, Config, Layout};
use verl_data::{DataConfig, DataLoader, Dataset, LoaderOptions, Split};
use verl_metrics::{MetricsLogger, ValGeneration};

use super::agent::AgentLoop;
use super::checkpoint::Checkpoints;
use super::options::{FitOptions, FitSummary};
use super::plugins::JobPlugins;
use super::prompts::{tokenizer_dir, PromptEncoder};
use super::reduce::Ranks;
use super::reward::RewardRouter;
use super::setup::{
    check_ranks, create_logger, create_roles, data_config, load_split, Algorithm, DataLayout,
};
use super::workers::Workers;

/// Runs the PPO/GRPO loop the config describes and returns when `trainer.total_training_steps`
/// (or `trainer.total_epochs`) is done.
pub fn fit(cfg: &Config, plugins: &JobPlugins, opts: &FitOptions) -> anyhow::Result<FitSummary> {
    // Roles, data, the checkpoint to resume from, loggers.
    let mut trainer = Trainer::setup(cfg, plugins, opts)?;
    if trainer.validate_before_training()? {
        return trainer.finish();
    }
    trainer.global_step += 1;
    while trainer.global_step <= trainer.total_steps {
        let Some(data) = trainer.loader.next_batch() else {
            break;
        };
        trainer.step(&data)?;
        if trainer.is_last_step() {
            break;
        }
        trainer.global_step += 1;
    }
    trainer.finish()
}

/// A run in progress: the job, this rank's roles and reward functions, the data, the loggers,
/// and where the loop is.
pub(super) struct Trainer<'a> {
    pub(super) cfg: &'a Config,
    pub(super) opts: &'a FitOptions,
    pub(super) ranks: Ranks<'a>,
    pub(super) global_step: u64,
    pub(super) total_steps: u64,
    pub(super) summary: FitSummary,
    // Dropped in this order, as the loop's parts always were: loggers first, the roles late.
    /// Rank 0's; `None` on the others.
    pub(super) logger: Option<MetricsLogger>,
    pub(super) loader: DataLoader,
    pub(super) checkpoints: Checkpoints,
    pub(super) workers: Workers,
    pub(super) rewards: RewardRouter,
    pub(super) val_ds: Option<Arc<Dataset>>,
    pub(super) dcfg: DataConfig,
    pub(super) enc: PromptEncoder,
    /// `multi_turn.enable`: the agent loop (also in `enc`, which renders tool prompts).
    pub(super) agent: Option<Arc<AgentLoop>>,
    pub(super) algo: Algorithm,
    pub(super) plan: BatchPlan,
    pub(super) dp: DataLayout,
}

impl<'a> Trainer<'a> {
    /// Checks the job against this process's place in it, then builds everything a run needs,
    /// resuming from the checkpoint `trainer.resume_mode` picks.
    pub(super) fn setup(
        cfg: &'a Config,
        plugins: &JobPlugins,
        opts: &'a FitOptions,
    ) -> anyhow::Result<Self> {
        let t = &cfg.trainer;
        let (rank, world) = (opts.rank, opts.world_size.max(1));
        let ranks = check_ranks(opts)?;
        let dp = DataLayout::new(cfg, rank, world)?;
        ranks.set_data_ranks(&dp.holds_data)?;
        let plan = validate_batches(
            cfg,
            Layout {
                world_size: world as u64,
                ..Layout::data_parallel(dp.dp_size as u64)
            },
        )?;
        let mut algo = Algorithm::new(cfg)?;

        let mut enc = PromptEncoder::new(cfg, &tokenizer_dir(cfg))?;
        let agent = AgentLoop::from_config(cfg, |path| {
            Ok(crate::tools::ToolSet::load(path, &plugins.tools)?)
        })?
        .map(Arc::new);
        enc.agent = agent.clone();
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

        let (mut workers, rewards) = create_roles(cfg, plugins, opts)?;
        let checkpoints = Checkpoints::new(cfg, world);
        let resumed = checkpoints.resume(cfg, &mut workers, &mut algo.kl_ctrl)?;

        let loader = DataLoader::with_options(
            train_ds,
            LoaderOptions::train(&dcfg, Some(t.total_epochs)),
            resumed.loader,
        )?;
        let total_steps = t
            .total_training_steps
            .unwrap_or_else(|| loader.total_steps(t.total_epochs));
        let (logger, jsonl_path) = create_logger(cfg, opts)?;
        let summary = FitSummary {
            global_step: resumed.global_step,
            total_training_steps: total_steps,
            resumed_from: resumed.from,
            jsonl_path,
            plan: Some(plan.clone()),
            ..FitSummary::default()
        };
        Ok(Trainer {
            cfg,
            opts,
            ranks,
            dp,
            plan,
            algo,
            enc,
            agent,
            dcfg,
            val_ds,
            workers,
            rewards,
            checkpoints,
            loader,
            logger,
            global_step: resumed.global_step,
            total_steps,
            summary,
        })
    }
}

impl Trainer<'_> {
    /// `trainer.val_before_train` (and `trainer.val_only`): validation at the resumed step.
    /// Returns whether the run ends there (`val_only`).
    fn validate_before_training(&mut self) -> anyhow::Result<bool> {
        let t = &self.cfg.trainer;
        let Some(ds) = self.val_ds.clone() else {
            return Ok(false);
        };
        if !(t.val_before_train || t.val_only) {
            return Ok(false);
        }
        let v = self.validate(&ds)?;
        self.log(&v.metrics, &v.generations)?;
        self.summary.last_validation = Some(v.metrics);
        Ok(t.val_only)
    }

    /// Whether the current step is the run's last (`trainer.total_training_steps`).
    pub(super) fn is_last_step(&self) -> bool {
        self.global_step >= self.total_steps
    }

    /// Logs metrics at the current step, and the validation samples
    /// `trainer.log_val_generations` selected (rank 0 only).
    pub(super) fn log(
        &mut self,
        metrics: &[(String, f64)],
        generations: &[ValGeneration],
    ) -> anyhow::Result<()> {
        if let Some(l) = self.logger.as_mut() {
            l.log(self.global_step, metrics)?;
            if !generations.is_empty() {
                l.log_generations(self.global_step, generations)?;
            }
        }
        Ok(())
    }

    /// Closes the loggers and reports the run.
    fn finish(mut self) -> anyhow::Result<FitSummary> {
        if let Some(l) = self.logger.as_mut() {
            l.finish()?;
        }
        Ok(self.summary)
    }
}
