//! What the caller of [`super::fit`] says about this process's part in the job, and what the
//! finished run reports.

use std::path::PathBuf;
use std::sync::Arc;

use verl_config::BatchPlan;
use verl_metrics::LoggerOptions;
use verl_plugin_api::Rendezvous;

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
