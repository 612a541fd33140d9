//! `verl-algos`: verl's advantage estimators (`core_algos.py`), reward-side KL penalty and KL controllers, and
//! the masked statistics they rest on (`torch_functional.py`), computed in `f64` on the host's rollout batch.
//!
//! It owns the maths only: no I/O, no config files, no tensors or devices, and it must never link libtorch.
//! Losses that need gradients (policy, value, entropy, KL loss) belong to the losses plugin.
//!
//! The host loop calls, per step: [`apply_kl_penalty`] (when `algorithm.use_kl_in_reward`), then
//! [`compute_advantage`], reading names and numbers from config through [`AdvantageEstimator`],
//! [`AdvantageParams`], [`KlPenalty`] and [`KlCtrlConfig`]. Batch-wide statistics take a [`CrossRankSum`] in
//! the `*_across` variants so a data-parallel shard sees the statistics of the whole batch, as verl's driver
//! does. With `trainer.balance_batch`, [`balance_batch`] decides which rows each data-parallel rank gets
//! (verl's sequence-length balancing, partition for partition).
//!
//! ```
//! use verl_algos::{
//!     apply_kl_penalty, compute_advantage, AdvantageEstimator, AdvantageInputs, AdvantageParams, Grid,
//!     Groups, KlController, KlCtrlConfig, KlPenalty,
//! };
//!
//! // Two samples of one prompt, response length 3; the rule reward sits on each response's last token.
//! let scores = Grid::from_rows(&[[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])?;
//! let mask = Grid::from_rows(&[[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])?;
//! let old_log_probs = Grid::filled(2, 3, -1.0);
//! let ref_log_prob = Grid::filled(2, 3, -1.1);
//!
//! let mut kl_ctrl = KlController::from_config(&KlCtrlConfig::default())?;
//! let kl = apply_kl_penalty(&scores, &old_log_probs, &ref_log_prob, &mask, &mut kl_ctrl, KlPenalty::LowVarKl)?;
//!
//! let uids = Groups::from_keys(&["prompt-0", "prompt-0"]);
//! let inputs = AdvantageInputs::new(&kl.token_level_rewards, &mask).with_index(&uids);
//! let estimator: AdvantageEstimator = "grpo".parse()?;
//! let out = compute_advantage(estimator, &inputs, &AdvantageParams::default())?;
//! assert!(out.advantages[(0, 0)] > 0.0 && out.advantages[(1, 0)] < 0.0);
//! assert_eq!(out.advantages[(1, 2)], 0.0); // past EOS
//! # Ok::<(), verl_algos::AlgoError>(())
//! ```

#![warn(missing_docs)]

mod advantage;
mod balance;
mod error;
mod grid;
mod groups;
mod kl;
mod rollout_corr;
mod stats;

pub use advantage::{
    compute_advantage, compute_advantage_across, compute_gae_advantage_return,
    compute_gpg_outcome_advantage, compute_grpo_outcome_advantage, compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage, compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage, AdvantageEstimator, AdvantageInputs, AdvantageParams,
    Advantages,
};
pub use balance::{
    balance_batch, calculate_workload, get_group_balanced_partitions,
    get_seqlen_balanced_partitions, karmarkar_karp, log_seqlen_unbalance, BalancedBatch,
    GLOBAL_SEQLEN_PREFIX,
};
pub use error::{AlgoError, Result};
pub use grid::Grid;
pub use groups::Groups;
pub use kl::{
    apply_kl_penalty, apply_kl_penalty_across, kl_penalty, KlController, KlCtrlConfig, KlCtrlType,
    KlMetrics, KlPenalty, KlPenaltyOutput, METRIC_REWARD_KL_PENALTY,
    METRIC_REWARD_KL_PENALTY_COEFF,
};
pub use rollout_corr::{
    compute_rollout_correction_across, CorrectionLoss, IsLevel, IsSpec, IsThreshold,
    RolloutCorrection, RolloutCorrectionKeys, RolloutCorrectionOutput, RsAgg, RsRule, RsStat,
    SAFETY_BOUND,
};
pub use stats::{
    masked_mean, masked_mean_per_row, masked_sum, masked_var, masked_whiten, masked_whiten_across,
    CrossRankSum, LocalOnly, MASKED_MEAN_EPS, WHITEN_VAR_EPS,
};
