//! verl-rewards: rule-based reward scoring, verl 0.9.1's
//! `verl.utils.reward_score.default_compute_score` and the scorers it dispatches to (gsm8k,
//! hendrycks MATH, math_dapo), behind the Reward contract.
//!
//! The scoring semantics live in `verl-reward-score` (re-exported here as [`score`]); this crate
//! owns only the export glue in `plugin.rs`: batch columns in, one score (plus extra metrics) per
//! row out. It must not tokenize or load datasets; the host owns everything around a score.

pub use verl_reward_score as score;

pub use score::{
    default_compute_score, Gsm8kMethod, RewardError, ScoreOptions, ScoreOutput, Scorer,
};

mod plugin;

pub use plugin::RulesRewardPlugin;

verl_plugin_api::export_reward_plugin!(plugin::RulesRewardPlugin);
