//! What every training backend shares, so that a backend is an engine and not a fork: verl's config
//! sections and the plans resolved from them, sequences and micro-batching, the PPO update loop over a
//! backend's [`update::UpdateEngine`] with its loss composition, generate calls in and out, the KV
//! budget, metrics and their reductions, AdamW and its schedule, the data-parallel group, host copies
//! of parameters, the reward-model role, process-wide device settings, and the one error type.

pub mod bench;
pub mod budget;
pub mod config;
pub mod data;
pub mod device;
pub mod dp;
pub mod error;
pub mod generation;
pub mod host_params;
pub mod hybrid;
pub mod metrics;
pub mod model_files;
pub mod optim;
pub mod policy;
pub mod reward_model;
pub mod update;

pub use error::{BackendError, Result};
pub use reward_model::RewardModelRole;
