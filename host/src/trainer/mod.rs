//! The RL control loop of `verl run`, mirroring verl's `RayPPOTrainer.fit`: prompts → generate
//! → reward → old/ref log-probs → values → KL-in-reward → advantages → critic/actor updates →
//! validation → checkpoint → metrics, with epochs, seeded shuffling and exact resume.
//!
//! It owns the order of calls and the host-side maths wiring (it calls `verl_algos`,
//! `verl_metrics`, `verl_checkpoint`, `verl_data`, `verl_chat`); tensors and weights stay in the
//! plugins. One process runs one data-parallel rank (`FitOptions::rank`) on its slice of whole
//! prompt groups; batch-wide statistics, metrics and validation span all ranks through the host's
//! collectives (`crate::dist::HostGroup`), every one of them a method of `reduce::Ranks`.
//!
//! `fit.rs` is the loop; `setup.rs` builds a run, `checkpoint.rs` saves and resumes it;
//! `step.rs` is one step, phase by phase; `workers.rs` holds the roles, their phase calls and
//! the phases' clock (`verl bench grpo` runs its step through the same); `rollout.rs` generates and scores; `validate.rs` validates.

mod agent;
mod checkpoint;
mod dump;
mod error;
mod fit;
mod options;
mod plugins;
mod prompts;
mod reduce;
pub mod reward;
pub mod reward_model;
mod rollout;
mod rollout_corr;
mod setup;
mod step;
mod validate;
mod workers;

pub use error::TrainerError;
pub use fit::fit;
pub use options::{FitOptions, FitSummary};
pub use plugins::{BackendFactory, InProcessBackend, InProcessReward, JobPlugins, RewardFactory};
pub use prompts::tokenizer_dir;
pub use reward::{CUSTOM_REWARD_FUNCTION, REWARD_MODEL};
pub use rollout_corr::rollout_correction;
pub use setup::data_config;
pub(crate) use setup::{lora_backend, multi_turn_backend};
pub(crate) use step::on_policy_old_log_prob_unused;
pub(crate) use workers::{PhaseEnd, Timed, Workers};

/// The reward plugin names the job routes to: `plugins.reward.default`, then each distinct
/// target of `plugins.reward.routes`. The CLI loads each and passes it as `(name, plugin)` in
/// [`JobPlugins::rewards`].
pub fn reward_plugin_names(cfg: &verl_config::Config) -> Vec<String> {
    let r = &cfg.plugins.reward;
    let mut names = vec![r.default.clone()];
    for target in r.routes.values() {
        if !names.contains(target) {
            names.push(target.clone());
        }
    }
    names
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod names_tests {
    #[test]
    fn reward_plugin_names_lists_default_then_distinct_routes() {
        let cfg = verl_config::Config::from_overrides(&[
            "plugins.reward.routes={a: math, b: math, c: rewards}",
        ])
        .unwrap();
        assert_eq!(super::reward_plugin_names(&cfg), vec!["rewards", "math"]);
    }
}
