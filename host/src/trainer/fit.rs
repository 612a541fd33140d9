//! The loop itself: verl's `RayPPOTrainer.fit` on one data-parallel rank. [`fit`] sets the run
//! up (`setup.rs`, which resumes through `checkpoint.rs`), validates before training, then runs
//! one [`Trainer::step`] (`step.rs`) per batch of prompts. Across ranks (`FitOptions::group`)
//! every batch-wide quantity is reduced through [`Ranks`] (`reduce.rs`).

use std::path::PathBuf;
use std::sync::Arc;

use verl_config::{BatchPlan, Config};
use verl_data::{DataConfig, DataLoader, Dataset};
use verl_metrics::{LoggerOptions, MetricsLogger, ValGeneration};
use verl_plugin_api::Rendezvous;

use super::checkpoint::Checkpoints;
use super::plugins::JobPlugins;
use super::prompts::PromptEncoder;
use super::reduce::Ranks;
use super::reward::RewardRouter;
use super::setup::{Algorithm, DataLayout};
use super::workers::Workers;
use crate::dist::HostGroup;

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
    pub(super) algo: Algorithm,
    pub(super) plan: BatchPlan,
    pub(super) dp: DataLayout,
}

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
