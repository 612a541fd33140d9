//! Config-driven advantage estimation: [`AdvantageEstimator`] (verl's `algorithm.adv_estimator` names),
//! [`AdvantageParams`], [`AdvantageInputs`] and the one entry point [`compute_advantage`], mirroring verl's
//! `ray_trainer.compute_advantage`.

mod estimators;

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

pub use estimators::{
    compute_gae_advantage_return, compute_gpg_outcome_advantage, compute_grpo_outcome_advantage,
    compute_opo_outcome_advantage, compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage, compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
};

use crate::error::{AlgoError, Result};
use crate::grid::Grid;
use crate::groups::Groups;
use crate::stats::{CrossRankSum, LocalOnly};

/// The config key this enum is read from, used in error messages.
const KEY: &str = "algorithm.adv_estimator";

/// An advantage estimator, named as in verl's `AdvantageEstimator` enum.
///
/// Deserialises from (and serialises to) verl's names; an unknown name is an error listing the valid ones,
/// and the names verl has but verl-rs does not implement give an error saying so.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "&'static str")]
pub enum AdvantageEstimator {
    /// `"gae"`: GAE with a critic.
    Gae,
    /// `"grpo"`: group-normalised outcome advantage.
    Grpo,
    /// `"reinforce_plus_plus"`: whitened discounted reward-to-go.
    ReinforcePlusPlus,
    /// `"reinforce_plus_plus_baseline"`: whitened group-mean-baselined outcome.
    ReinforcePlusPlusBaseline,
    /// `"remax"`: greedy-rollout baseline.
    Remax,
    /// `"rloo"`: leave-one-out baseline.
    Rloo,
    /// `"opo"`: length-weighted group baseline.
    Opo,
    /// `"gpg"`: group policy gradient.
    Gpg,
}

impl AdvantageEstimator {
    /// Every supported estimator, in verl's enum order.
    pub const ALL: [Self; 8] = [
        Self::Gae,
        Self::Grpo,
        Self::ReinforcePlusPlus,
        Self::ReinforcePlusPlusBaseline,
        Self::Remax,
        Self::Rloo,
        Self::Opo,
        Self::Gpg,
    ];

    /// The names accepted by [`FromStr`], in [`Self::ALL`] order.
    pub const NAMES: &'static [&'static str] = &[
        "gae",
        "grpo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
        "rloo",
        "opo",
        "gpg",
    ];

    /// verl's name for this estimator.
    pub fn name(self) -> &'static str {
        match self {
            Self::Gae => "gae",
            Self::Grpo => "grpo",
            Self::ReinforcePlusPlus => "reinforce_plus_plus",
            Self::ReinforcePlusPlusBaseline => "reinforce_plus_plus_baseline",
            Self::Remax => "remax",
            Self::Rloo => "rloo",
            Self::Opo => "opo",
            Self::Gpg => "gpg",
        }
    }

    /// Whether the estimator needs a critic (`values`). Only GAE does; the host uses this to decide whether a
    /// critic must be built at all (verl's `need_critic`).
    pub fn needs_values(self) -> bool {
        matches!(self, Self::Gae)
    }

    /// Whether the estimator groups responses by prompt (`uid`), so the rollout must sample `n > 1` per prompt
    /// for it to be meaningful and whole groups must stay on one rank.
    pub fn needs_groups(self) -> bool {
        matches!(
            self,
            Self::Grpo | Self::Rloo | Self::Opo | Self::ReinforcePlusPlusBaseline | Self::Gpg
        )
    }

    /// Whether the estimator needs `reward_baselines` (the reward of a greedy rollout per prompt).
    pub fn needs_reward_baselines(self) -> bool {
        matches!(self, Self::Remax)
    }
}

impl fmt::Display for AdvantageEstimator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl From<AdvantageEstimator> for &'static str {
    fn from(e: AdvantageEstimator) -> Self {
        e.name()
    }
}

impl FromStr for AdvantageEstimator {
    type Err = AlgoError;

    fn from_str(s: &str) -> Result<Self> {
        if let Some(e) = Self::ALL.into_iter().find(|e| e.name() == s) {
            return Ok(e);
        }
        let reason = match s {
            "grpo_vectorized" => "it is verl's vectorised duplicate of `grpo`; use `grpo`",
            "rloo_vectorized" => "it is verl's vectorised duplicate of `rloo`; use `rloo`",
            "grpo_passk" | "optimal_token_baseline" | "tir_optimal_token_baseline" => {
                "verl-rs does not implement this estimator"
            }
            _ => {
                return Err(AlgoError::UnknownName {
                    key: KEY,
                    found: s.to_owned(),
                    expected: Self::NAMES,
                })
            }
        };
        Err(AlgoError::Unsupported {
            key: KEY,
            found: s.to_owned(),
            reason,
        })
    }
}

impl TryFrom<String> for AdvantageEstimator {
    type Error = AlgoError;
    fn try_from(s: String) -> Result<Self> {
        s.parse()
    }
}

/// Numeric settings of the estimators, with verl's defaults.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct AdvantageParams {
    /// `algorithm.gamma`: discount (GAE, REINFORCE++).
    pub gamma: f64,
    /// `algorithm.lam`: GAE's λ.
    pub lam: f64,
    /// `algorithm.norm_adv_by_std_in_grpo`: divide by the group std in GRPO (false = Dr.GRPO).
    pub norm_adv_by_std_in_grpo: bool,
    /// Added to the group std in GRPO. verl's trainer never overrides the function default of 1e-6.
    pub epsilon: f64,
    /// GPG's normaliser. verl's trainer never overrides the function default of 1.0.
    pub f_norm: f64,
}

impl Default for AdvantageParams {
    fn default() -> Self {
        Self {
            gamma: 1.0,
            lam: 1.0,
            norm_adv_by_std_in_grpo: true,
            epsilon: 1e-6,
            f_norm: 1.0,
        }
    }
}

/// The per-batch tensors an estimator reads. `token_level_rewards` and `response_mask` are always needed;
/// the rest depend on the estimator (see [`AdvantageEstimator::needs_values`] and friends).
#[derive(Debug, Clone, Copy)]
pub struct AdvantageInputs<'a> {
    /// `[batch × response_len]` rewards after the optional KL-in-reward penalty.
    pub token_level_rewards: &'a Grid<f64>,
    /// `[batch × response_len]`, 1 on response tokens up to and including EOS, 0 after.
    pub response_mask: &'a Grid<f64>,
    /// Critic values, `[batch × response_len]` (GAE).
    pub values: Option<&'a Grid<f64>>,
    /// Which rows answer the same prompt (verl's `uid`).
    pub index: Option<&'a Groups>,
    /// One reward per row from the greedy rollout (ReMax).
    pub reward_baselines: Option<&'a [f64]>,
}

impl<'a> AdvantageInputs<'a> {
    /// The two inputs every estimator needs.
    pub fn new(token_level_rewards: &'a Grid<f64>, response_mask: &'a Grid<f64>) -> Self {
        Self {
            token_level_rewards,
            response_mask,
            values: None,
            index: None,
            reward_baselines: None,
        }
    }

    /// Adds critic values.
    pub fn with_values(mut self, values: &'a Grid<f64>) -> Self {
        self.values = Some(values);
        self
    }

    /// Adds the prompt groups.
    pub fn with_index(mut self, index: &'a Groups) -> Self {
        self.index = Some(index);
        self
    }

    /// Adds the greedy-rollout baselines.
    pub fn with_reward_baselines(mut self, reward_baselines: &'a [f64]) -> Self {
        self.reward_baselines = Some(reward_baselines);
        self
    }
}

/// Per-token advantages and returns, as verl stores them in `batch["advantages"]` / `batch["returns"]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Advantages {
    /// What the policy loss multiplies the ratio by.
    pub advantages: Grid<f64>,
    /// The critic's regression target (equal to `advantages` for the critic-free estimators).
    pub returns: Grid<f64>,
}

/// Computes advantages and returns with `estimator` on a batch held entirely by this process.
/// Mirrors verl `ray_trainer.compute_advantage`.
pub fn compute_advantage(
    estimator: AdvantageEstimator,
    inputs: &AdvantageInputs<'_>,
    params: &AdvantageParams,
) -> Result<Advantages> {
    compute_advantage_across(estimator, inputs, params, &mut LocalOnly)
}

/// [`compute_advantage`] on one data-parallel shard: batch-wide statistics (whitening for GAE/REINFORCE++,
/// GPG's non-zero count) are summed over ranks with `reducer`. Groups must not straddle ranks.
pub fn compute_advantage_across(
    estimator: AdvantageEstimator,
    inputs: &AdvantageInputs<'_>,
    params: &AdvantageParams,
    reducer: &mut dyn CrossRankSum,
) -> Result<Advantages> {
    let rewards = inputs.token_level_rewards;
    let mask = inputs.response_mask;
    let index = || {
        inputs.index.ok_or(AlgoError::MissingInput {
            estimator: estimator.name(),
            input: "index",
            why: "it normalises each response against the other samples of its prompt (verl's `uid`)",
        })
    };
    match estimator {
        AdvantageEstimator::Gae => {
            let values = inputs.values.ok_or(AlgoError::MissingInput {
                estimator: estimator.name(),
                input: "values",
                why: "GAE bootstraps from the critic's values; is the critic enabled?",
            })?;
            compute_gae_advantage_return(rewards, values, mask, params.gamma, params.lam, reducer)
        }
        AdvantageEstimator::Grpo => compute_grpo_outcome_advantage(
            rewards,
            mask,
            index()?,
            params.epsilon,
            params.norm_adv_by_std_in_grpo,
        ),
        AdvantageEstimator::ReinforcePlusPlus => {
            compute_reinforce_plus_plus_outcome_advantage(rewards, mask, params.gamma, reducer)
        }
        AdvantageEstimator::ReinforcePlusPlusBaseline => {
            compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, index()?, reducer)
        }
        AdvantageEstimator::Remax => {
            let baselines = inputs.reward_baselines.ok_or(AlgoError::MissingInput {
                estimator: estimator.name(),
                input: "reward_baselines",
                why: "ReMax subtracts the reward of a greedy rollout of the same prompt",
            })?;
            compute_remax_outcome_advantage(rewards, baselines, mask)
        }
        AdvantageEstimator::Rloo => compute_rloo_outcome_advantage(rewards, mask, index()?),
        AdvantageEstimator::Opo => compute_opo_outcome_advantage(rewards, mask, index()?),
        AdvantageEstimator::Gpg => {
            compute_gpg_outcome_advantage(rewards, mask, index()?, params.f_norm, reducer)
        }
    }
}

#[cfg(test)]
mod tests;
