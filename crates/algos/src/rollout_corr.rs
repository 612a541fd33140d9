//! verl's rollout correction (`algorithm.rollout_correction`, `rollout_corr_helper.py`): importance
//! weights and rejection masks that correct for the gap between the policy that sampled the
//! rollout (`rollout_log_probs`, recorded by the generation engine) and the policy the update is
//! anchored to (`old_log_probs`), plus verl's off-policy diagnostics.
//!
//! Decoupled mode (the default) runs here, on the host, between the old-log-prob pass and the
//! advantages: [`compute_rollout_correction_across`] returns the per-token weights (the update's
//! `rollout_is_weights` column, multiplied into the policy loss) and the response mask with the
//! rejected tokens removed (used by the advantages and the update). Bypass mode
//! ([`RolloutCorrection::bypass_mode`]) instead takes the rollout log-probs as the old log-probs
//! and skips the old-log-prob pass.
//!
//! With `r = π_old / π_rollout` per token and `log r` clamped to ±20 (verl's safety bound):
//! * `rollout_is: token`: `w = exp(log r)`; `sequence`: `w = exp(clamp(Σ log r))` on every token of
//!   the sequence. Then `w` is truncated at `rollout_is_threshold` (or, for a `"lower_upper"`
//!   threshold, zeroed outside the band) and, with `rollout_is_batch_normalize`, divided by its
//!   batch mean.
//! * `rollout_rs`: a comma list of `{token,seq_sum,seq_mean,seq_max}_k{1,2,3}` rules on
//!   `k1 = -log r`, `k2 = ½ (log r)²`, `k3 = r - 1 - log r`; k1 keeps `log lower ≤ k1 ≤ log upper`,
//!   k2/k3 keep `k ≤ upper`. Rules combine with AND.

use std::collections::BTreeMap;

use crate::error::{AlgoError, Result};
use crate::grid::Grid;
use crate::stats::{self, CrossRankSum, MASKED_MEAN_EPS};

/// verl's clamp on log importance ratios before `exp`.
pub const SAFETY_BOUND: f64 = 20.0;

const OP: &str = "compute_rollout_correction";
const KEY_IS: &str = "algorithm.rollout_correction.rollout_is";
const KEY_IS_THR: &str = "algorithm.rollout_correction.rollout_is_threshold";
const KEY_RS: &str = "algorithm.rollout_correction.rollout_rs";
const KEY_RS_THR: &str = "algorithm.rollout_correction.rollout_rs_threshold";
const KEY_LOSS: &str = "algorithm.rollout_correction.loss_type";

/// Aggregation level of the importance weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IsLevel {
    /// One weight per token.
    Token,
    /// One weight per sequence (product of the token ratios), on each of its tokens.
    Sequence,
}

/// What `rollout_is_threshold` does to the weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum IsThreshold {
    /// A number: weights above it are clamped to it (truncated importance sampling).
    Truncate(f64),
    /// `"lower_upper"`: weights outside `[lower, upper]` are set to 0 (verl's IcePop form).
    Band {
        /// Smallest weight kept.
        lower: f64,
        /// Largest weight kept.
        upper: f64,
    },
}

impl IsThreshold {
    /// The band metrics and the std/ESS clamp use: `[1/t, t]` or `[lower, upper]`.
    pub fn bounds(&self) -> (f64, f64) {
        match *self {
            IsThreshold::Truncate(t) => (1.0 / t, t),
            IsThreshold::Band { lower, upper } => (lower, upper),
        }
    }
}

/// Importance-weight settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IsSpec {
    /// Token or sequence weights.
    pub level: IsLevel,
    /// Truncation or band.
    pub threshold: IsThreshold,
}

/// The per-token divergence statistic a rejection rule reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RsStat {
    /// `-log r`.
    K1,
    /// `½ (log r)²`.
    K2,
    /// `r - 1 - log r`.
    K3,
}

/// Where a rejection rule aggregates its statistic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RsAgg {
    /// Each token on its own.
    Token,
    /// Sum over the sequence's tokens; the decision applies to the whole sequence.
    SeqSum,
    /// Mean over the sequence's tokens (for k1: the geometric-mean ratio).
    SeqMean,
    /// Maximum over the sequence's tokens (k2, k3).
    SeqMax,
}

/// One rejection rule of `rollout_rs`.
#[derive(Debug, Clone, PartialEq)]
pub struct RsRule {
    /// Its name in the config and the metrics (`seq_mean_k1`).
    pub name: String,
    /// Aggregation.
    pub agg: RsAgg,
    /// Statistic.
    pub stat: RsStat,
    /// Smallest statistic kept (k1: `log lower`; k2/k3: none).
    pub low: Option<f64>,
    /// Largest statistic kept (k1: `log upper`; k2/k3: the threshold).
    pub high: f64,
}

impl RsRule {
    fn keeps(&self, v: f64) -> bool {
        v <= self.high && self.low.is_none_or(|lo| v >= lo)
    }
}

/// The policy loss bypass mode trains with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CorrectionLoss {
    /// PPO's clipped surrogate, anchored at the rollout policy.
    PpoClip,
    /// REINFORCE with importance weights (no ratio, no clipping).
    Reinforce,
}

/// `algorithm.rollout_correction` as verl's keys spell it (numbers as text: a float or
/// `"lower_upper"`; `rollout_rs` as a comma list).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RolloutCorrectionKeys {
    /// `null`, `token` or `sequence`.
    pub rollout_is: Option<String>,
    /// A number, or `"lower_upper"`.
    pub rollout_is_threshold: Option<String>,
    /// Divide the weights by their batch mean.
    pub rollout_is_batch_normalize: bool,
    /// Comma list of rejection rules.
    pub rollout_rs: Option<String>,
    /// One threshold per rule, or one shared (comma list; k1 entries may be `"lower_upper"`).
    pub rollout_rs_threshold: Option<String>,
    /// Use the rollout log-probs as the old log-probs.
    pub bypass_mode: bool,
    /// `ppo_clip` or `reinforce`.
    pub loss_type: String,
}

/// A parsed, checked `algorithm.rollout_correction`.
#[derive(Debug, Clone, PartialEq)]
pub struct RolloutCorrection {
    /// Importance weights, when `rollout_is` is set.
    pub is: Option<IsSpec>,
    /// `rollout_is_batch_normalize`.
    pub batch_normalize: bool,
    /// Rejection rules (empty: none).
    pub rs: Vec<RsRule>,
    /// `bypass_mode`.
    pub bypass_mode: bool,
    /// `loss_type`.
    pub loss: CorrectionLoss,
}

fn invalid(key: &'static str, found: impl Into<String>, expected: &'static str) -> AlgoError {
    AlgoError::InvalidParam {
        key,
        found: found.into(),
        expected,
    }
}

fn positive(key: &'static str, text: &str, expected: &'static str) -> Result<f64> {
    match text.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(invalid(key, format!("`{text}`"), expected)),
    }
}

/// `"lower_upper"` with `0 < lower ≤ upper`, or `None` when `text` has no `_`.
fn band(key: &'static str, text: &str) -> Result<Option<(f64, f64)>> {
    const EXPECTED: &str = "\"lower_upper\" with 0 < lower <= upper";
    let Some((lo, hi)) = text.split_once('_') else {
        return Ok(None);
    };
    let (lo, hi) = (positive(key, lo, EXPECTED)?, positive(key, hi, EXPECTED)?);
    if lo > hi {
        return Err(invalid(key, format!("`{text}`"), EXPECTED));
    }
    Ok(Some((lo, hi)))
}

const RS_NAMES: [&str; 11] = [
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
];

fn rs_rule(name: &str, threshold: &str) -> Result<RsRule> {
    let (agg, stat) = match name {
        "token_k1" => (RsAgg::Token, RsStat::K1),
        "token_k2" => (RsAgg::Token, RsStat::K2),
        "token_k3" => (RsAgg::Token, RsStat::K3),
        "seq_sum_k1" => (RsAgg::SeqSum, RsStat::K1),
        "seq_sum_k2" => (RsAgg::SeqSum, RsStat::K2),
        "seq_sum_k3" => (RsAgg::SeqSum, RsStat::K3),
        "seq_mean_k1" => (RsAgg::SeqMean, RsStat::K1),
        "seq_mean_k2" => (RsAgg::SeqMean, RsStat::K2),
        "seq_mean_k3" => (RsAgg::SeqMean, RsStat::K3),
        "seq_max_k2" => (RsAgg::SeqMax, RsStat::K2),
        "seq_max_k3" => (RsAgg::SeqMax, RsStat::K3),
        other => {
            let reason = match other {
                "token" | "sequence" | "geometric" => {
                    "verl's pre-2026 names; verl now spells them token_k1, seq_sum_k1 and seq_mean_k1"
                }
                "seq_max_k1" => "verl has no seq_max_k1 (k1 can be negative); use seq_max_k2 or seq_max_k3",
                _ => "",
            };
            if reason.is_empty() {
                return Err(AlgoError::UnknownName {
                    key: KEY_RS,
                    found: other.into(),
                    expected: &RS_NAMES,
                });
            }
            return Err(AlgoError::Unsupported {
                key: KEY_RS,
                found: other.into(),
                reason,
            });
        }
    };
    let (low, high) = if stat == RsStat::K1 {
        let (lo, hi) = match band(KEY_RS_THR, threshold)? {
            Some(b) => b,
            None => {
                let u = positive(
                    KEY_RS_THR,
                    threshold,
                    "a number > 0 or \"lower_upper\" for a k1 rule",
                )?;
                (1.0 / u, u)
            }
        };
        (Some(lo.ln()), hi.ln())
    } else {
        if threshold.contains('_') {
            return Err(invalid(
                KEY_RS_THR,
                format!("`{threshold}` for `{name}`"),
                "one number > 0 for a k2/k3 rule (only k1 rules take \"lower_upper\")",
            ));
        }
        (
            None,
            positive(KEY_RS_THR, threshold, "a number > 0 for a k2/k3 rule")?,
        )
    };
    Ok(RsRule {
        name: name.to_string(),
        agg,
        stat,
        low,
        high,
    })
}

impl RolloutCorrection {
    /// Parses and checks the keys; `None` when nothing is switched on (no weights, no rejection,
    /// no bypass), which is verl's default.
    pub fn from_keys(k: &RolloutCorrectionKeys) -> Result<Option<Self>> {
        let set = |o: &Option<String>| {
            o.as_deref()
                .map(str::trim)
                .filter(|s| !s.is_empty() && *s != "null" && *s != "None")
                .map(str::to_string)
        };
        let loss = match k.loss_type.as_str() {
            "ppo_clip" => CorrectionLoss::PpoClip,
            "reinforce" => CorrectionLoss::Reinforce,
            other => {
                return Err(AlgoError::UnknownName {
                    key: KEY_LOSS,
                    found: other.into(),
                    expected: &["ppo_clip", "reinforce"],
                })
            }
        };
        let is = match set(&k.rollout_is) {
            None => None,
            Some(level) => {
                let level = match level.as_str() {
                    "token" => IsLevel::Token,
                    "sequence" => IsLevel::Sequence,
                    other => {
                        return Err(AlgoError::UnknownName {
                            key: KEY_IS,
                            found: other.into(),
                            expected: &["null", "token", "sequence"],
                        })
                    }
                };
                let text = set(&k.rollout_is_threshold).ok_or_else(|| {
                    invalid(
                        KEY_IS_THR,
                        "null",
                        "a number > 0 or \"lower_upper\" when rollout_is is set",
                    )
                })?;
                let threshold = match band(KEY_IS_THR, &text)? {
                    Some((lower, upper)) => IsThreshold::Band { lower, upper },
                    None => IsThreshold::Truncate(positive(
                        KEY_IS_THR,
                        &text,
                        "a number > 0 or \"lower_upper\"",
                    )?),
                };
                Some(IsSpec { level, threshold })
            }
        };
        let mut rs = Vec::new();
        if let Some(list) = set(&k.rollout_rs) {
            let names: Vec<&str> = list
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .collect();
            // Names first: a misspelt rule is the better error than its missing threshold.
            for name in &names {
                rs_rule(name, "2")?;
            }
            let thr = set(&k.rollout_rs_threshold).ok_or_else(|| {
                invalid(
                    KEY_RS_THR,
                    "null",
                    "a threshold for the rollout_rs rules (one per rule, or one shared)",
                )
            })?;
            let thrs: Vec<&str> = thr.split(',').map(str::trim).collect();
            if thrs.len() != 1 && thrs.len() != names.len() {
                return Err(invalid(
                    KEY_RS_THR,
                    format!(
                        "{} threshold(s) `{thr}` for {} rule(s)",
                        thrs.len(),
                        names.len()
                    ),
                    "one threshold per rollout_rs rule, or one shared by all",
                ));
            }
            for (i, name) in names.iter().enumerate() {
                if rs.iter().any(|r: &RsRule| r.name == *name) {
                    return Err(invalid(
                        KEY_RS,
                        format!("`{list}`"),
                        "each rule at most once",
                    ));
                }
                rs.push(rs_rule(name, thrs[if thrs.len() == 1 { 0 } else { i }])?);
            }
        }
        if is.is_none() && rs.is_empty() && !k.bypass_mode {
            return Ok(None);
        }
        Ok(Some(RolloutCorrection {
            is,
            batch_normalize: k.rollout_is_batch_normalize,
            rs,
            bypass_mode: k.bypass_mode,
            loss,
        }))
    }

    /// Whether the host computes weights or a rejection mask before the update (decoupled mode).
    pub fn corrects_in_trainer(&self) -> bool {
        !self.bypass_mode && (self.is.is_some() || !self.rs.is_empty())
    }
}

/// What [`compute_rollout_correction_across`] returns.
#[derive(Debug, Clone, PartialEq)]
pub struct RolloutCorrectionOutput {
    /// `rollout_is_weights` (0 on padding), when importance weights are on.
    pub weights: Option<Grid<f64>>,
    /// The response mask with the rejected tokens set to 0.
    pub response_mask: Grid<f64>,
    /// `rollout_corr/*` metrics, under verl's names.
    pub metrics: Vec<(String, f64)>,
}

/// Sums (one cross-rank reduction) and maxima (another) collected under names, so every metric
/// is a batch-wide statistic however the rows are split over ranks. Every name is declared up
/// front from the configuration alone, so all ranks reduce the same vector.
#[derive(Default)]
struct Stats {
    sums: BTreeMap<String, f64>,
    maxs: BTreeMap<String, f64>,
}

impl Stats {
    fn declare(c: &RolloutCorrection) -> Self {
        let mut st = Stats::default();
        let mut sums: Vec<String> = [
            "tokens",
            "seqs",
            "rows",
            "kl",
            "k3_kl",
            "chi2_token",
            "chi2_seq",
            "training_log_ppl",
            "training_ppl",
            "rollout_log_ppl",
            "rollout_ppl",
            "log_ppl_diff",
            "log_ppl_abs_diff",
            "ppl_ratio",
        ]
        .map(String::from)
        .to_vec();
        let mut maxs: Vec<String> = vec!["log_ppl_diff_max".into(), "log_ppl_diff_min".into()];
        if c.is.is_some() {
            sums.extend(
                [
                    "is_sum",
                    "is_c_sum",
                    "is_c_sq",
                    "is_high",
                    "is_low",
                    "is_seq_sum",
                    "is_seq_sq",
                    "is_seq_high",
                    "is_seq_low",
                ]
                .map(String::from),
            );
            maxs.extend(
                ["is_max", "is_min", "is_seq_max", "is_seq_min", "is_seq_dev"].map(String::from),
            );
        }
        for rule in &c.rs {
            for m in ["sum", "rejected", "seq_rejected"] {
                sums.push(format!("rs/{}/{m}", rule.name));
            }
            for m in ["max", "min"] {
                maxs.push(format!("rs/{}/{m}", rule.name));
            }
        }
        if !c.rs.is_empty() {
            sums.extend(["rs_rejected", "rs_seq_rejected"].map(String::from));
        }
        st.sums = sums.into_iter().map(|k| (k, 0.0)).collect();
        st.maxs = maxs.into_iter().map(|k| (k, f64::NEG_INFINITY)).collect();
        st
    }
    fn sum(&mut self, name: &str, v: f64) {
        *self
            .sums
            .get_mut(name)
            .unwrap_or_else(|| panic!("undeclared sum {name}")) += v;
    }
    /// A batch maximum; minima are stored negated.
    fn max(&mut self, name: &str, v: f64) {
        let m = self
            .maxs
            .get_mut(name)
            .unwrap_or_else(|| panic!("undeclared maximum {name}"));
        *m = m.max(v);
    }
    fn reduce(&mut self, reducer: &mut dyn CrossRankSum) -> Result<()> {
        let mut s: Vec<f64> = self.sums.values().copied().collect();
        stats::reduce(reducer, OP, &mut s)?;
        self.sums.values_mut().zip(s).for_each(|(x, v)| *x = v);
        let mut m: Vec<f64> = self.maxs.values().copied().collect();
        stats::reduce_max(reducer, OP, &mut m)?;
        self.maxs.values_mut().zip(m).for_each(|(x, v)| *x = v);
        Ok(())
    }
    fn s(&self, name: &str) -> f64 {
        self.sums[name]
    }
    fn m(&self, name: &str) -> f64 {
        self.maxs[name]
    }
}

/// Unbiased standard deviation from a count, a sum and a sum of squares.
fn std_of(n: f64, sum: f64, sq: f64) -> f64 {
    if n < 2.0 {
        return 0.0;
    }
    let mean = sum / n;
    ((sq - n * mean * mean).max(0.0) / (n - 1.0)).sqrt()
}

fn finite_or_zero(v: f64) -> f64 {
    if v.is_finite() {
        v
    } else {
        0.0
    }
}

/// verl's decoupled-mode rollout correction over this rank's rows, with batch-wide statistics
/// through `reducer`: importance weights against `old_log_probs`, the rejection mask, and the
/// `rollout_corr/*` metrics (importance weights, rejection, and the off-policy diagnostics
/// `kl`, `k3_kl`, `*_ppl`, `log_ppl_*`, `chi2_*`).
pub fn compute_rollout_correction_across(
    c: &RolloutCorrection,
    old_log_probs: &Grid<f64>,
    rollout_log_probs: &Grid<f64>,
    response_mask: &Grid<f64>,
    reducer: &mut dyn CrossRankSum,
) -> Result<RolloutCorrectionOutput> {
    old_log_probs.check_same_shape(rollout_log_probs, OP, "rollout_log_probs", "old_log_probs")?;
    old_log_probs.check_same_shape(response_mask, OP, "response_mask", "old_log_probs")?;
    let (rows, cols) = old_log_probs.shape();
    let valid = |r: usize, t: usize| response_mask[(r, t)] != 0.0;
    let lr = |r: usize, t: usize| old_log_probs[(r, t)] - rollout_log_probs[(r, t)];
    let lrc = |r: usize, t: usize| lr(r, t).clamp(-SAFETY_BOUND, SAFETY_BOUND);
    let counts: Vec<usize> = (0..rows)
        .map(|r| (0..cols).filter(|&t| valid(r, t)).count())
        .collect();
    let seq_lr: Vec<f64> = (0..rows)
        .map(|r| (0..cols).filter(|&t| valid(r, t)).map(|t| lr(r, t)).sum())
        .collect();

    let mut st = Stats::declare(c);
    let tokens: f64 = counts.iter().sum::<usize>() as f64;
    let seqs = counts.iter().filter(|&&n| n > 0).count() as f64;
    st.sum("tokens", tokens);
    st.sum("seqs", seqs);
    st.sum("rows", rows as f64);

    // ---- off-policy diagnostics ---------------------------------------------------------------
    for r in (0..rows).filter(|&r| counts[r] > 0) {
        let n = counts[r] as f64;
        let (mut train, mut roll) = (0.0, 0.0);
        for t in (0..cols).filter(|&t| valid(r, t)) {
            train += old_log_probs[(r, t)];
            roll += rollout_log_probs[(r, t)];
            let x = lr(r, t);
            st.sum("kl", -x);
            st.sum("k3_kl", x.exp() - 1.0 - x);
            st.sum("chi2_token", (2.0 * lrc(r, t)).exp() - 1.0);
        }
        let (train, roll) = (train / n, roll / n);
        st.sum("training_log_ppl", -train);
        st.sum("training_ppl", (-train).exp());
        st.sum("rollout_log_ppl", -roll);
        st.sum("rollout_ppl", (-roll).exp());
        let d = roll - train;
        st.sum("log_ppl_diff", d);
        st.sum("log_ppl_abs_diff", d.abs());
        st.sum("ppl_ratio", d.exp());
        st.max("log_ppl_diff_max", d);
        st.max("log_ppl_diff_min", -d);
        st.sum(
            "chi2_seq",
            (2.0 * seq_lr[r].clamp(-SAFETY_BOUND, SAFETY_BOUND)).exp() - 1.0,
        );
    }

    // ---- importance weights (before truncation: the metrics read these) -----------------------
    let mut weights = c.is.map(|spec| {
        let mut w = Grid::filled(rows, cols, 0.0);
        for r in 0..rows {
            for t in (0..cols).filter(|&t| valid(r, t)) {
                w[(r, t)] = match spec.level {
                    IsLevel::Token => lrc(r, t).exp(),
                    IsLevel::Sequence => seq_lr[r].clamp(-SAFETY_BOUND, SAFETY_BOUND).exp(),
                };
            }
        }
        w
    });
    if let (Some(spec), Some(w)) = (c.is, weights.as_ref()) {
        let (lo, hi) = spec.threshold.bounds();
        for r in (0..rows).filter(|&r| counts[r] > 0) {
            let mut row_sum = 0.0;
            for t in (0..cols).filter(|&t| valid(r, t)) {
                let v = w[(r, t)];
                row_sum += v;
                st.sum("is_sum", v);
                let vc = v.clamp(lo, hi);
                st.sum("is_c_sum", vc);
                st.sum("is_c_sq", vc * vc);
                if spec.level == IsLevel::Token {
                    st.sum("is_high", f64::from(v > hi));
                    st.sum("is_low", f64::from(v < lo));
                    st.max("is_max", v);
                    st.max("is_min", -v);
                }
            }
            let m = row_sum / counts[r] as f64;
            st.sum("is_seq_sum", m);
            st.sum("is_seq_sq", m * m);
            st.max("is_seq_max", m);
            st.max("is_seq_min", -m);
            st.max("is_seq_dev", (m - 1.0).abs());
            st.sum("is_seq_high", f64::from(m > hi));
            st.sum("is_seq_low", f64::from(m < lo));
            if spec.level == IsLevel::Sequence {
                let s = seq_lr[r];
                st.max("is_max", s);
                st.max("is_min", -s);
                st.sum("is_high", f64::from(s > hi.ln()));
                st.sum("is_low", f64::from(s < lo.ln()));
            }
        }
    }

    // ---- rejection ---------------------------------------------------------------------------
    let stat_of = |rule: &RsRule, r: usize, t: usize| {
        let x = lrc(r, t);
        match rule.stat {
            RsStat::K1 => -x,
            RsStat::K2 => 0.5 * x * x,
            RsStat::K3 => x.exp() - 1.0 - x,
        }
    };
    let mut keep = Grid::filled(rows, cols, 1.0);
    for rule in &c.rs {
        let key = |m: &str| format!("rs/{}/{m}", rule.name);
        for r in (0..rows).filter(|&r| counts[r] > 0) {
            let idx: Vec<usize> = (0..cols).filter(|&t| valid(r, t)).collect();
            let vals: Vec<f64> = idx.iter().map(|&t| stat_of(rule, r, t)).collect();
            let seq_value = match rule.agg {
                RsAgg::Token => None,
                RsAgg::SeqSum => Some(vals.iter().sum::<f64>()),
                RsAgg::SeqMean => Some(vals.iter().sum::<f64>() / vals.len() as f64),
                RsAgg::SeqMax => Some(vals.iter().cloned().fold(f64::NEG_INFINITY, f64::max)),
            };
            let mut rejected_here = 0.0;
            for (i, &t) in idx.iter().enumerate() {
                let v = seq_value.unwrap_or(vals[i]);
                st.sum(&key("sum"), v);
                if seq_value.is_none() {
                    st.max(&key("max"), v);
                    st.max(&key("min"), -v);
                }
                if !rule.keeps(v) {
                    rejected_here += 1.0;
                    keep[(r, t)] = 0.0;
                }
            }
            if let Some(v) = seq_value {
                st.max(&key("max"), v);
                st.max(&key("min"), -v);
            }
            st.sum(&key("rejected"), rejected_here);
            st.sum(&key("seq_rejected"), f64::from(rejected_here > 0.0));
        }
    }
    let mut new_mask = response_mask.clone();
    if !c.rs.is_empty() {
        for r in 0..rows {
            let mut any = false;
            for t in (0..cols).filter(|&t| valid(r, t)) {
                if keep[(r, t)] == 0.0 {
                    new_mask[(r, t)] = 0.0;
                    st.sum("rs_rejected", 1.0);
                    any = true;
                }
            }
            st.sum("rs_seq_rejected", f64::from(any));
        }
    }

    st.reduce(reducer)?;
    let (tokens, seqs, all_rows) = (st.s("tokens"), st.s("seqs"), st.s("rows"));
    let tok_mean = |v: f64| v / (tokens + MASKED_MEAN_EPS);
    let seq_mean = |v: f64| if seqs > 0.0 { v / seqs } else { 0.0 };
    let mut metrics: Vec<(String, f64)> = Vec::new();
    let mut put = |name: &str, v: f64| metrics.push((format!("rollout_corr/{name}"), v));

    if let (Some(spec), Some(w)) = (c.is, weights.as_mut()) {
        let (lo, hi) = spec.threshold.bounds();
        put("rollout_is_mean", tok_mean(st.s("is_sum")));
        let (hi_frac, lo_frac) = match spec.level {
            IsLevel::Token => (tok_mean(st.s("is_high")), tok_mean(st.s("is_low"))),
            IsLevel::Sequence => (
                st.s("is_high") / all_rows.max(1.0),
                st.s("is_low") / all_rows.max(1.0),
            ),
        };
        put("rollout_is_ratio_fraction_high", hi_frac);
        put("rollout_is_ratio_fraction_low", lo_frac);
        let (max, min) = match spec.level {
            IsLevel::Token => (st.m("is_max"), -st.m("is_min")),
            IsLevel::Sequence => (
                st.m("is_max").min(SAFETY_BOUND).exp(),
                (-st.m("is_min")).max(-SAFETY_BOUND).exp(),
            ),
        };
        put("rollout_is_max", finite_or_zero(max));
        put("rollout_is_min", finite_or_zero(min));
        put(
            "rollout_is_std",
            std_of(tokens, st.s("is_c_sum"), st.s("is_c_sq")),
        );
        let mc = tok_mean(st.s("is_c_sum")) + MASKED_MEAN_EPS;
        let second = tok_mean(st.s("is_c_sq")) / (mc * mc);
        put(
            "rollout_is_eff_sample_size",
            if second > 0.0 { 1.0 / second } else { 0.0 },
        );
        put("rollout_is_seq_mean", seq_mean(st.s("is_seq_sum")));
        put(
            "rollout_is_seq_std",
            std_of(seqs, st.s("is_seq_sum"), st.s("is_seq_sq")),
        );
        put("rollout_is_seq_max", finite_or_zero(st.m("is_seq_max")));
        put("rollout_is_seq_min", finite_or_zero(-st.m("is_seq_min")));
        put(
            "rollout_is_seq_max_deviation",
            finite_or_zero(st.m("is_seq_dev")),
        );
        put(
            "rollout_is_seq_fraction_high",
            seq_mean(st.s("is_seq_high")),
        );
        put("rollout_is_seq_fraction_low", seq_mean(st.s("is_seq_low")));

        // Truncation or band, then the optional batch normalisation.
        let mut zeroed = 0.0;
        for r in 0..rows {
            for t in (0..cols).filter(|&t| valid(r, t)) {
                let v = &mut w[(r, t)];
                match spec.threshold {
                    IsThreshold::Truncate(thr) => *v = v.min(thr),
                    IsThreshold::Band { lower, upper } => {
                        if *v < lower || *v > upper {
                            *v = 0.0;
                            zeroed += 1.0;
                        }
                    }
                }
            }
        }
        let mut sums = [zeroed, 0.0, 0.0];
        if c.batch_normalize {
            for r in (0..rows).filter(|&r| counts[r] > 0) {
                let row: f64 = (0..cols).filter(|&t| valid(r, t)).map(|t| w[(r, t)]).sum();
                sums[1] += row;
                sums[2] += row / counts[r] as f64;
            }
        }
        stats::reduce(reducer, OP, &mut sums)?;
        if matches!(spec.threshold, IsThreshold::Band { .. }) {
            put("rollout_is_oob_ratio", tok_mean(sums[0]));
        }
        if c.batch_normalize {
            let mean = match spec.level {
                IsLevel::Token => tok_mean(sums[1]),
                IsLevel::Sequence => sums[2] / seqs.max(MASKED_MEAN_EPS),
            };
            put("rollout_is_batch_norm_factor", mean);
            if mean > MASKED_MEAN_EPS {
                w.as_mut_slice().iter_mut().for_each(|v| *v /= mean);
            }
        }
        let _ = (lo, hi);
    }

    for rule in &c.rs {
        let key = |m: &str| format!("rs/{}/{m}", rule.name);
        let p = format!("rollout_rs_{}", rule.name);
        put(&format!("{p}_mean"), tok_mean(st.s(&key("sum"))));
        put(&format!("{p}_max"), finite_or_zero(st.m(&key("max"))));
        put(&format!("{p}_min"), finite_or_zero(-st.m(&key("min"))));
        put(
            &format!("{p}_masked_fraction"),
            tok_mean(st.s(&key("rejected"))),
        );
        put(
            &format!("{p}_seq_masked_fraction"),
            seq_mean(st.s(&key("seq_rejected"))),
        );
    }
    if !c.rs.is_empty() {
        put("rollout_rs_masked_fraction", tok_mean(st.s("rs_rejected")));
        put(
            "rollout_rs_seq_masked_fraction",
            st.s("rs_seq_rejected") / all_rows.max(1.0),
        );
    }

    put("training_ppl", seq_mean(st.s("training_ppl")));
    put("training_log_ppl", seq_mean(st.s("training_log_ppl")));
    put("rollout_ppl", seq_mean(st.s("rollout_ppl")));
    put("rollout_log_ppl", seq_mean(st.s("rollout_log_ppl")));
    put("kl", tok_mean(st.s("kl")));
    put("k3_kl", tok_mean(st.s("k3_kl")));
    put("log_ppl_diff", seq_mean(st.s("log_ppl_diff")));
    put("log_ppl_abs_diff", seq_mean(st.s("log_ppl_abs_diff")));
    put("log_ppl_diff_max", finite_or_zero(st.m("log_ppl_diff_max")));
    put(
        "log_ppl_diff_min",
        finite_or_zero(-st.m("log_ppl_diff_min")),
    );
    put("ppl_ratio", seq_mean(st.s("ppl_ratio")));
    put("chi2_token", tok_mean(st.s("chi2_token")));
    put("chi2_seq", seq_mean(st.s("chi2_seq")));

    Ok(RolloutCorrectionOutput {
        weights,
        response_mask: new_mask,
        metrics,
    })
}

#[cfg(test)]
mod tests;
