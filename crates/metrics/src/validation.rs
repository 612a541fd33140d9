//! verl's validation metrics (`process_validation_metrics` and the trainer's `val-core`/`val-aux` naming).
//!
//! `best@n`/`worst@n`/`maj@n` are bootstrap estimates like verl's (1000 resamples of size `n` with
//! replacement, seed 42), but drawn with this crate's own generator rather than NumPy's, so they agree with
//! verl's in distribution, not digit for digit. `mean@N` and `std@N` are exact.

use std::collections::BTreeMap;

use crate::compute::Metrics;
use crate::error::{MetricsError, Result};

/// One reward-info column of the validation set: numbers get statistics, labels (such as `pred`) only vote.
#[derive(Debug, Clone, PartialEq)]
pub enum InfoColumn {
    /// Numeric values (score, acc, reward, ...), one per sample.
    Numbers(Vec<f64>),
    /// String values, one per sample; skipped for statistics, used as the vote for `maj@n` when named `pred`.
    Labels(Vec<String>),
}

impl InfoColumn {
    fn len(&self) -> usize {
        match self {
            InfoColumn::Numbers(v) => v.len(),
            InfoColumn::Labels(v) => v.len(),
        }
    }

    fn vote_key(&self, i: usize) -> String {
        match self {
            InfoColumn::Numbers(v) => format!("{:?}", v[i]),
            InfoColumn::Labels(v) => v[i].clone(),
        }
    }
}

/// data source → variable → metric name (`mean@4`, `best@2/std`, ...) → value averaged over prompts.
pub type ValidationTable = BTreeMap<String, BTreeMap<String, BTreeMap<String, f64>>>;

const N_BOOTSTRAP: usize = 1000;
/// verl's default seed for the bootstrap.
pub const BOOTSTRAP_SEED: u64 = 42;

/// The sample-size ladder verl bootstraps at: 2, 4, 8, ... below `n`, then `n` itself.
fn bootstrap_sizes(n: usize) -> Vec<usize> {
    if n <= 1 {
        return Vec::new();
    }
    let mut ns = Vec::new();
    let mut k = 2;
    while k < n {
        ns.push(k);
        k *= 2;
    }
    ns.push(n);
    ns
}

/// SplitMix64: small, seedable, good enough for resampling indices.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }
}

/// Population mean and standard deviation (NumPy's `np.std`, ddof 0).
fn mean_std(v: &[f64]) -> (f64, f64) {
    let m = v.iter().sum::<f64>() / v.len() as f64;
    let var = v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / v.len() as f64;
    (m, var.sqrt())
}

/// verl's `calc_maj_val`: the value of the first sample voting for the most common answer; ties go to the
/// answer seen first.
fn majority_value(sample: &[usize], vals: &[f64], votes: &[String]) -> f64 {
    let mut tally: Vec<(&str, usize, f64)> = Vec::new();
    for &i in sample {
        match tally.iter_mut().find(|(k, _, _)| *k == votes[i]) {
            Some(t) => t.1 += 1,
            None => tally.push((&votes[i], 1, vals[i])),
        }
    }
    let mut best = tally[0];
    for t in &tally[1..] {
        if t.1 > best.1 {
            best = *t;
        }
    }
    best.2
}

/// Per-prompt metrics of one variable: `mean@N`, `std@N` and the bootstrap ladder.
fn prompt_metrics(vals: &[f64], votes: Option<&[String]>, seed: u64) -> Vec<(String, f64)> {
    let n = vals.len();
    let mut out = vec![(format!("mean@{n}"), mean_std(vals).0)];
    if n <= 1 {
        return out;
    }
    out.push((format!("std@{n}"), mean_std(vals).1));
    for k in bootstrap_sizes(n) {
        // verl reseeds every bootstrap call, so every statistic at every size sees the same index stream.
        let mut rng = Rng(seed);
        let mut best = Vec::with_capacity(N_BOOTSTRAP);
        let mut worst = Vec::with_capacity(N_BOOTSTRAP);
        let mut maj = Vec::with_capacity(N_BOOTSTRAP);
        let mut sample = vec![0usize; k];
        for _ in 0..N_BOOTSTRAP {
            sample.iter_mut().for_each(|i| *i = rng.below(n));
            let picked = sample.iter().map(|&i| vals[i]);
            best.push(picked.clone().fold(f64::NEG_INFINITY, f64::max));
            worst.push(picked.fold(f64::INFINITY, f64::min));
            if let Some(votes) = votes {
                maj.push(majority_value(&sample, vals, votes));
            }
        }
        let (bm, bs) = mean_std(&best);
        let (wm, ws) = mean_std(&worst);
        out.push((format!("best@{k}/mean"), bm));
        out.push((format!("best@{k}/std"), bs));
        out.push((format!("worst@{k}/mean"), wm));
        out.push((format!("worst@{k}/std"), ws));
        if votes.is_some() {
            let (mm, ms) = mean_std(&maj);
            out.push((format!("maj@{k}/mean"), mm));
            out.push((format!("maj@{k}/std"), ms));
        }
    }
    out
}

/// verl's `process_validation_metrics`: group samples by data source and prompt uid, compute per-prompt
/// statistics of every numeric column, and average each statistic over the prompts of a data source.
pub fn process_validation_metrics<S: AsRef<str>, U: AsRef<str>>(
    data_sources: &[S],
    sample_uids: &[U],
    infos: &[(String, InfoColumn)],
    seed: u64,
) -> Result<ValidationTable> {
    const OP: &str = "process_validation_metrics";
    let rows = data_sources.len();
    if sample_uids.len() != rows {
        return Err(MetricsError::Length {
            op: OP,
            input: "sample_uids",
            expected: rows,
            found: sample_uids.len(),
            why: "one per entry of `data_sources`",
        });
    }
    for (name, col) in infos {
        if col.len() != rows {
            return Err(MetricsError::ColumnLength {
                op: OP,
                column: name.clone(),
                expected: rows,
                found: col.len(),
            });
        }
    }
    let pred = infos.iter().find(|(n, _)| n == "pred").map(|(_, c)| c);

    // data source → uid → sample indices, uids in first-seen order (as verl's dicts keep them).
    let mut groups: BTreeMap<&str, Vec<(&str, Vec<usize>)>> = BTreeMap::new();
    for i in 0..rows {
        let uids = groups.entry(data_sources[i].as_ref()).or_default();
        let uid = sample_uids[i].as_ref();
        match uids.iter_mut().find(|(u, _)| *u == uid) {
            Some((_, idx)) => idx.push(i),
            None => uids.push((uid, vec![i])),
        }
    }

    let mut table = ValidationTable::new();
    for (source, uids) in groups {
        let mut per_metric: BTreeMap<String, BTreeMap<String, Vec<f64>>> = BTreeMap::new();
        for (_, idx) in &uids {
            let votes: Option<Vec<String>> =
                pred.map(|p| idx.iter().map(|&i| p.vote_key(i)).collect());
            for (name, col) in infos {
                let InfoColumn::Numbers(all) = col else {
                    continue;
                };
                let vals: Vec<f64> = idx.iter().map(|&i| all[i]).collect();
                for (metric, v) in prompt_metrics(&vals, votes.as_deref(), seed) {
                    per_metric
                        .entry(name.clone())
                        .or_default()
                        .entry(metric)
                        .or_default()
                        .push(v);
                }
            }
        }
        let vars = table.entry(source.to_string()).or_default();
        for (var, metrics) in per_metric {
            let out = vars.entry(var).or_default();
            for (metric, vals) in metrics {
                out.insert(metric, mean_std(&vals).0);
            }
        }
    }
    Ok(table)
}

/// The `N` of `mean@N`, `best@N/std`, ...
fn metric_n(name: &str) -> Option<usize> {
    name.rsplit('@').next()?.split('/').next()?.parse().ok()
}

/// The trainer's naming of a [`ValidationTable`] (`_val_metrics_update`): the core variable (`acc` when
/// present, else `reward`) at the largest `N` for `mean`, `maj` and `best` goes to
/// `val-core/<source>/<var>/<metric>`; everything else to `val-aux/...`. `num_turns` adds
/// `val-aux/num_turns/{min,max,mean}`.
pub fn validation_metrics(table: &ValidationTable, num_turns: Option<&[f64]>) -> Metrics {
    let mut out = Metrics::new();
    for (source, vars) in table {
        let core_var = if vars.contains_key("acc") {
            "acc"
        } else {
            "reward"
        };
        for (var, metrics) in vars {
            let n_max = metrics
                .keys()
                .filter_map(|m| metric_n(m))
                .max()
                .unwrap_or(0);
            let at_max = format!("@{n_max}");
            for (metric, &v) in metrics {
                let core = var == core_var
                    && ["mean", "maj", "best"]
                        .iter()
                        .any(|p| metric.starts_with(p))
                    && metric.contains(&at_max);
                let section = if core { "val-core" } else { "val-aux" };
                out.push((format!("{section}/{source}/{var}/{metric}"), v));
            }
        }
    }
    if let Some(turns) = num_turns.filter(|t| !t.is_empty()) {
        out.push((
            "val-aux/num_turns/min".into(),
            turns.iter().copied().fold(f64::INFINITY, f64::min),
        ));
        out.push((
            "val-aux/num_turns/max".into(),
            turns.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        ));
        out.push(("val-aux/num_turns/mean".into(), mean_std(turns).0));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bootstrap_sizes_follow_verl_ladder() {
        assert_eq!(bootstrap_sizes(1), Vec::<usize>::new());
        assert_eq!(bootstrap_sizes(2), vec![2]);
        assert_eq!(bootstrap_sizes(5), vec![2, 4, 5]);
        assert_eq!(bootstrap_sizes(8), vec![2, 4, 8]);
    }

    #[test]
    fn majority_ties_go_to_the_first_answer_and_return_its_first_value() {
        let votes: Vec<String> = ["A", "B", "A", "B"].iter().map(|s| s.to_string()).collect();
        let vals = [0.9, 0.1, 0.7, 0.2];
        assert_eq!(majority_value(&[1, 0, 2, 3], &vals, &votes), 0.1);
        assert_eq!(majority_value(&[0, 2, 1], &vals, &votes), 0.9);
    }

    #[test]
    fn metric_n_reads_the_sample_count() {
        assert_eq!(metric_n("mean@16"), Some(16));
        assert_eq!(metric_n("best@4/std"), Some(4));
        assert_eq!(metric_n("mean"), None);
    }
}
