//! The advantage estimators of verl's `core_algos.py`, one function each.
//!
//! Conventions shared by all of them, as in verl:
//! - an *outcome* score is the sum of a row's `token_level_rewards` over **all** columns (the reward sits on
//!   the last response token, and padding carries zeros);
//! - a group of one sample has baseline 0 (and std 1 where a std is used), so a lone sample keeps its score;
//! - group statistics use torch's defaults: arithmetic mean and Bessel-corrected std;
//! - results are per-token grids; outcome estimators broadcast the row scalar and multiply by the mask.

use super::Advantages;
use crate::error::{AlgoError, Result};
use crate::grid::Grid;
use crate::groups::Groups;
use crate::stats::{self, CrossRankSum};

fn check_mask(op: &'static str, rewards: &Grid<f64>, mask: &Grid<f64>) -> Result<()> {
    rewards.check_same_shape(mask, op, "token_level_rewards", "response_mask")
}

fn check_groups(op: &'static str, rewards: &Grid<f64>, groups: &Groups) -> Result<()> {
    if groups.num_rows() != rewards.rows() {
        return Err(AlgoError::LengthMismatch {
            op,
            input: "index",
            reference: "token_level_rewards",
            expected: rewards.rows(),
            found: groups.num_rows(),
        });
    }
    Ok(())
}

/// Row sums of the rewards: verl's `token_level_rewards.sum(dim=-1)`.
fn outcome_scores(rewards: &Grid<f64>) -> Vec<f64> {
    rewards.iter_rows().map(|r| r.iter().sum()).collect()
}

/// Per-group mean with verl's "a group of one has mean 0" rule.
fn group_means(scores: &[f64], groups: &Groups) -> Vec<f64> {
    groups
        .iter()
        .map(|rows| match rows.len() {
            1 => 0.0,
            n => rows.iter().map(|&r| scores[r]).sum::<f64>() / n as f64,
        })
        .collect()
}

/// Per-group Bessel-corrected std (`torch.std`) with verl's "a group of one has std 1" rule.
fn group_stds(scores: &[f64], groups: &Groups, means: &[f64]) -> Vec<f64> {
    groups
        .iter()
        .zip(means)
        .map(|(rows, &mean)| match rows.len() {
            1 => 1.0,
            n => {
                let ss: f64 = rows
                    .iter()
                    .map(|&r| (scores[r] - mean) * (scores[r] - mean))
                    .sum();
                (ss / (n - 1) as f64).sqrt()
            }
        })
        .collect()
}

/// Broadcasts one scalar per row across its tokens, times the mask: verl's `scores.unsqueeze(-1) * mask`.
fn broadcast_masked(per_row: &[f64], mask: &Grid<f64>) -> Grid<f64> {
    let mut out = mask.clone();
    for (r, &s) in per_row.iter().enumerate() {
        out.row_mut(r).iter_mut().for_each(|m| *m *= s);
    }
    out
}

fn same_twice(advantages: Grid<f64>) -> Advantages {
    Advantages {
        returns: advantages.clone(),
        advantages,
    }
}

/// Generalised Advantage Estimation with a critic. Mirrors verl `compute_gae_advantage_return`.
///
/// Tokens where the mask is 0 are skipped by the recursion (the value and the running advantage pass through
/// them unchanged), `returns = advantages + values` before whitening, and the advantages are then whitened
/// over the batch (every element, masked or not, as verl does).
pub fn compute_gae_advantage_return(
    token_level_rewards: &Grid<f64>,
    values: &Grid<f64>,
    response_mask: &Grid<f64>,
    gamma: f64,
    lam: f64,
    reducer: &mut dyn CrossRankSum,
) -> Result<Advantages> {
    const OP: &str = "compute_gae_advantage_return";
    check_mask(OP, token_level_rewards, response_mask)?;
    token_level_rewards.check_same_shape(values, OP, "token_level_rewards", "values")?;

    let (rows, cols) = token_level_rewards.shape();
    let mut raw = Grid::filled(rows, cols, 0.0);
    for r in 0..rows {
        let (rew, val, mask) = (
            token_level_rewards.row(r),
            values.row(r),
            response_mask.row(r),
        );
        let out = raw.row_mut(r);
        let (mut next_value, mut last_gae_lam) = (0.0, 0.0);
        for t in (0..cols).rev() {
            let delta = rew[t] + gamma * next_value - val[t];
            let gae_lam = delta + gamma * lam * last_gae_lam;
            next_value = val[t] * mask[t] + (1.0 - mask[t]) * next_value;
            last_gae_lam = gae_lam * mask[t] + (1.0 - mask[t]) * last_gae_lam;
            out[t] = last_gae_lam;
        }
    }
    let mut returns = raw.clone();
    returns
        .as_mut_slice()
        .iter_mut()
        .zip(values.as_slice())
        .for_each(|(a, v)| *a += v);
    let advantages = stats::masked_whiten_across(&raw, response_mask, true, reducer)?;
    Ok(Advantages {
        advantages,
        returns,
    })
}

/// GRPO: each score minus its group mean, divided by `group std + epsilon` when `norm_adv_by_std_in_grpo`
/// (Dr.GRPO when false). Mirrors verl `compute_grpo_outcome_advantage`; returns equal advantages.
pub fn compute_grpo_outcome_advantage(
    token_level_rewards: &Grid<f64>,
    response_mask: &Grid<f64>,
    index: &Groups,
    epsilon: f64,
    norm_adv_by_std_in_grpo: bool,
) -> Result<Advantages> {
    const OP: &str = "compute_grpo_outcome_advantage";
    check_mask(OP, token_level_rewards, response_mask)?;
    check_groups(OP, token_level_rewards, index)?;
    let scores = outcome_scores(token_level_rewards);
    let means = group_means(&scores, index);
    let stds = group_stds(&scores, index, &means);
    let adv: Vec<f64> = scores
        .iter()
        .enumerate()
        .map(|(r, &s)| {
            let g = index.group_of(r);
            if norm_adv_by_std_in_grpo {
                (s - means[g]) / (stds[g] + epsilon)
            } else {
                s - means[g]
            }
        })
        .collect();
    Ok(same_twice(broadcast_masked(&adv, response_mask)))
}

/// RLOO: leave-one-out baseline, `n/(n−1)·(score − group mean)`; a group of one keeps its raw score.
/// Mirrors verl `compute_rloo_outcome_advantage`; returns equal advantages.
pub fn compute_rloo_outcome_advantage(
    token_level_rewards: &Grid<f64>,
    response_mask: &Grid<f64>,
    index: &Groups,
) -> Result<Advantages> {
    const OP: &str = "compute_rloo_outcome_advantage";
    check_mask(OP, token_level_rewards, response_mask)?;
    check_groups(OP, token_level_rewards, index)?;
    let scores = outcome_scores(token_level_rewards);
    let means = group_means(&scores, index);
    let adv: Vec<f64> = scores
        .iter()
        .enumerate()
        .map(|(r, &s)| {
            let g = index.group_of(r);
            let n = index.members(g).len() as f64;
            if n > 1.0 {
                // verl's evaluation order, `s * n / (n - 1) - mean * n / (n - 1)`, kept for bitwise closeness.
                s * n / (n - 1.0) - means[g] * n / (n - 1.0)
            } else {
                s
            }
        })
        .collect();
    Ok(same_twice(broadcast_masked(&adv, response_mask)))
}

/// OPO: the baseline is the group's response-length-weighted mean score. Mirrors verl
/// `compute_opo_outcome_advantage`; returns equal advantages.
pub fn compute_opo_outcome_advantage(
    token_level_rewards: &Grid<f64>,
    response_mask: &Grid<f64>,
    index: &Groups,
) -> Result<Advantages> {
    const OP: &str = "compute_opo_outcome_advantage";
    check_mask(OP, token_level_rewards, response_mask)?;
    check_groups(OP, token_level_rewards, index)?;
    let scores = outcome_scores(token_level_rewards);
    let lengths: Vec<f64> = response_mask.iter_rows().map(|m| m.iter().sum()).collect();
    let baselines: Vec<f64> = index
        .iter()
        .map(|rows| match rows.len() {
            1 => 0.0,
            _ => {
                let weighted: f64 = rows.iter().map(|&r| lengths[r] * scores[r]).sum();
                let total: f64 = rows.iter().map(|&r| lengths[r]).sum();
                weighted / total
            }
        })
        .collect();
    let adv: Vec<f64> = scores
        .iter()
        .enumerate()
        .map(|(r, &s)| s - baselines[index.group_of(r)])
        .collect();
    Ok(same_twice(broadcast_masked(&adv, response_mask)))
}

/// REINFORCE++: discounted reward-to-go per token (the running return is reset wherever the mask is 0),
/// whitened over the batch and masked. Mirrors verl `compute_reinforce_plus_plus_outcome_advantage`; the
/// returns are the un-whitened reward-to-go.
pub fn compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: &Grid<f64>,
    response_mask: &Grid<f64>,
    gamma: f64,
    reducer: &mut dyn CrossRankSum,
) -> Result<Advantages> {
    const OP: &str = "compute_reinforce_plus_plus_outcome_advantage";
    check_mask(OP, token_level_rewards, response_mask)?;
    let (rows, cols) = token_level_rewards.shape();
    let mut returns = Grid::filled(rows, cols, 0.0);
    for r in 0..rows {
        let (rew, mask) = (token_level_rewards.row(r), response_mask.row(r));
        let out = returns.row_mut(r);
        let mut running = 0.0;
        for t in (0..cols).rev() {
            running = rew[t] + gamma * running;
            out[t] = running;
            running *= mask[t];
        }
    }
    let mut advantages = stats::masked_whiten_across(&returns, response_mask, true, reducer)?;
    multiply_in_place(&mut advantages, response_mask);
    Ok(Advantages {
        advantages,
        returns,
    })
}

/// REINFORCE++ with a group-mean baseline: `score − group mean` on every response token, whitened over the
/// batch and masked. Mirrors verl `compute_reinforce_plus_plus_baseline_outcome_advantage`; returns equal
/// advantages.
pub fn compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: &Grid<f64>,
    response_mask: &Grid<f64>,
    index: &Groups,
    reducer: &mut dyn CrossRankSum,
) -> Result<Advantages> {
    const OP: &str = "compute_reinforce_plus_plus_baseline_outcome_advantage";
    check_mask(OP, token_level_rewards, response_mask)?;
    check_groups(OP, token_level_rewards, index)?;
    let scores = outcome_scores(token_level_rewards);
    let means = group_means(&scores, index);
    let centred: Vec<f64> = scores
        .iter()
        .enumerate()
        .map(|(r, &s)| s - means[index.group_of(r)])
        .collect();
    let tiled = broadcast_masked(&centred, response_mask);
    let mut advantages = stats::masked_whiten_across(&tiled, response_mask, true, reducer)?;
    multiply_in_place(&mut advantages, response_mask);
    Ok(same_twice(advantages))
}

/// ReMax: reward-to-go of the masked rewards (no discount) minus the greedy rollout's reward on every
/// response token. Mirrors verl `compute_remax_outcome_advantage`; the returns are the reward-to-go.
pub fn compute_remax_outcome_advantage(
    token_level_rewards: &Grid<f64>,
    reward_baselines: &[f64],
    response_mask: &Grid<f64>,
) -> Result<Advantages> {
    const OP: &str = "compute_remax_outcome_advantage";
    check_mask(OP, token_level_rewards, response_mask)?;
    if reward_baselines.len() != token_level_rewards.rows() {
        return Err(AlgoError::LengthMismatch {
            op: OP,
            input: "reward_baselines",
            reference: "token_level_rewards",
            expected: token_level_rewards.rows(),
            found: reward_baselines.len(),
        });
    }
    let (rows, cols) = token_level_rewards.shape();
    let mut returns = Grid::filled(rows, cols, 0.0);
    let mut advantages = Grid::filled(rows, cols, 0.0);
    for (r, &baseline) in reward_baselines.iter().enumerate() {
        let (rew, mask) = (token_level_rewards.row(r), response_mask.row(r));
        let mut to_go = 0.0;
        for t in (0..cols).rev() {
            to_go += rew[t] * mask[t];
            returns.row_mut(r)[t] = to_go;
            advantages.row_mut(r)[t] = to_go - baseline * mask[t];
        }
    }
    Ok(Advantages {
        advantages,
        returns,
    })
}

/// GPG: `α·(score − group mean)/f_norm` with `α = batch size / max(#non-zero scores, 1)` over the whole
/// batch. Mirrors verl `compute_gpg_outcome_advantage` (whose `alpha` argument is always overwritten, so it
/// is not taken here); returns equal advantages.
pub fn compute_gpg_outcome_advantage(
    token_level_rewards: &Grid<f64>,
    response_mask: &Grid<f64>,
    index: &Groups,
    f_norm: f64,
    reducer: &mut dyn CrossRankSum,
) -> Result<Advantages> {
    const OP: &str = "compute_gpg_outcome_advantage";
    check_mask(OP, token_level_rewards, response_mask)?;
    check_groups(OP, token_level_rewards, index)?;
    let scores = outcome_scores(token_level_rewards);
    let mut counts = [
        scores.len() as f64,
        scores.iter().filter(|&&s| s != 0.0).count() as f64,
    ];
    stats::reduce(reducer, OP, &mut counts)?;
    let alpha = counts[0] / counts[1].max(1.0);
    let means = group_means(&scores, index);
    let adv: Vec<f64> = scores
        .iter()
        .enumerate()
        .map(|(r, &s)| alpha * (s - means[index.group_of(r)]) / f_norm)
        .collect();
    Ok(same_twice(broadcast_masked(&adv, response_mask)))
}

fn multiply_in_place(values: &mut Grid<f64>, mask: &Grid<f64>) {
    values
        .as_mut_slice()
        .iter_mut()
        .zip(mask.as_slice())
        .for_each(|(v, m)| *v *= m);
}
