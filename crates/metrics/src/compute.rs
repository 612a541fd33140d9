//! verl's per-step training metrics (`metric_utils.py`): data, timing and throughput metrics, and
//! `reduce_metrics`.

use std::collections::BTreeMap;
use std::time::Instant;

use crate::error::{MetricsError, Result};

/// Named scalar metrics in the order they were produced.
pub type Metrics = Vec<(String, f64)>;

/// One training step's rollout batch, as the host holds it after advantages are computed.
///
/// Token-level inputs are row-major `rows × max_response_length` (one row per response); a mask entry is valid
/// when non-zero, as verl's `.bool()` reads it.
#[derive(Debug, Clone, Copy)]
pub struct StepData<'a> {
    /// Width of the response block (`responses.shape[-1]`); a response this long counts as clipped.
    pub max_response_length: usize,
    /// Width of the prompt block (the padded prompt length); a prompt this long counts as clipped.
    pub max_prompt_length: usize,
    /// Per row: the summed token-level scores (the reward function's score).
    pub sequence_scores: &'a [f64],
    /// Per token: rewards after the KL penalty (summed per row for `critic/rewards/*`).
    pub token_level_rewards: &'a [f64],
    /// Per token.
    pub advantages: &'a [f64],
    /// Per token.
    pub returns: &'a [f64],
    /// Per token; `None` without a critic (then no `critic/values/*` nor `critic/vf_explained_var`).
    pub values: Option<&'a [f64]>,
    /// Per token: which response tokens count (verl's `response_mask`).
    pub response_mask: &'a [f64],
    /// Per row: prompt tokens under the attention mask.
    pub prompt_lengths: &'a [usize],
    /// Per row: response tokens under the attention mask (0 = aborted).
    pub response_lengths: &'a [usize],
    /// Per row, multi-turn rollouts only: `num_turns/{min,max,mean}`.
    pub num_turns: Option<&'a [f64]>,
    /// Per row, tool-using rollouts only: `tool_call_counts/{min,max,mean}`.
    pub tool_call_counts: Option<&'a [f64]>,
}

impl StepData<'_> {
    /// Number of responses.
    pub fn rows(&self) -> usize {
        self.response_lengths.len()
    }

    /// Prompt and response tokens of the batch, for timing and throughput metrics.
    pub fn token_counts(&self) -> TokenCounts {
        TokenCounts {
            prompt: self.prompt_lengths.iter().map(|&n| n as u64).sum(),
            response: self.response_lengths.iter().map(|&n| n as u64).sum(),
        }
    }

    fn check(&self) -> Result<()> {
        const OP: &str = "compute_data_metrics";
        let rows = self.rows();
        let tokens = rows * self.max_response_length;
        let per_row: [(&'static str, usize); 3] = [
            ("sequence_scores", self.sequence_scores.len()),
            ("prompt_lengths", self.prompt_lengths.len()),
            ("response_lengths", rows),
        ];
        for (input, found) in per_row {
            if found != rows {
                return Err(MetricsError::Length {
                    op: OP,
                    input,
                    expected: rows,
                    found,
                    why: "one per row of `response_lengths`",
                });
            }
        }
        let mut per_token = vec![
            ("token_level_rewards", self.token_level_rewards.len()),
            ("advantages", self.advantages.len()),
            ("returns", self.returns.len()),
            ("response_mask", self.response_mask.len()),
        ];
        if let Some(v) = self.values {
            per_token.push(("values", v.len()));
        }
        for (input, found) in per_token {
            if found != tokens {
                return Err(MetricsError::Length {
                    op: OP,
                    input,
                    expected: tokens,
                    found,
                    why: "rows × max_response_length",
                });
            }
        }
        let optional = [
            ("num_turns", self.num_turns),
            ("tool_call_counts", self.tool_call_counts),
        ];
        for (input, v) in optional {
            if let Some(v) = v {
                if v.len() != rows {
                    return Err(MetricsError::Length {
                        op: OP,
                        input,
                        expected: rows,
                        found: v.len(),
                        why: "one per row of `response_lengths`",
                    });
                }
            }
        }
        Ok(())
    }
}

/// Token totals of one batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TokenCounts {
    /// Sum of prompt lengths.
    pub prompt: u64,
    /// Sum of response lengths.
    pub response: u64,
}

impl TokenCounts {
    /// Prompt plus response tokens (verl's `global_token_num` summed).
    pub fn total(&self) -> u64 {
        self.prompt + self.response
    }
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

fn max(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::NEG_INFINITY, f64::max)
}

fn min(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}

/// `torch.var` (unbiased, N − 1).
fn var_unbiased(v: &[f64]) -> f64 {
    let m = mean(v);
    v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (v.len() as f64 - 1.0)
}

fn push_mean_max_min(out: &mut Metrics, prefix: &str, v: &[f64]) {
    out.push((format!("{prefix}/mean"), mean(v)));
    out.push((format!("{prefix}/max"), max(v)));
    out.push((format!("{prefix}/min"), min(v)));
}

fn nonempty(op: &'static str, what: &str, v: &[f64]) -> Result<()> {
    if v.is_empty() {
        return Err(MetricsError::Empty {
            op,
            what: what.to_string(),
        });
    }
    Ok(())
}

/// verl's `compute_data_metrics`: score, reward, advantage, return (and value) statistics, response and prompt
/// lengths, aborted samples, and the multi-turn counters when given.
///
/// Scores and rewards are taken over non-aborted rows (response length > 0); advantages, returns and values
/// over tokens under `response_mask`.
pub fn compute_data_metrics(data: &StepData<'_>) -> Result<Metrics> {
    StepSummary::from_step(data)?.metrics()
}

/// What [`compute_data_metrics`] needs of a step, and nothing more: per-row values and the
/// tokens under the response mask. A data-parallel rank holds a slice of the batch; the ranks'
/// summaries, concatenated in rank order, give exactly the metrics of the whole batch, which is
/// what verl's driver reports.
#[derive(Debug, Clone, PartialEq)]
pub struct StepSummary {
    /// See [`StepData::max_response_length`].
    pub max_response_length: usize,
    /// See [`StepData::max_prompt_length`].
    pub max_prompt_length: usize,
    /// Per row.
    pub sequence_scores: Vec<f64>,
    /// Per row: the summed token-level rewards.
    pub rewards: Vec<f64>,
    /// Per row.
    pub prompt_lengths: Vec<usize>,
    /// Per row.
    pub response_lengths: Vec<usize>,
    /// Tokens under the response mask, row-major.
    pub advantages: Vec<f64>,
    /// Tokens under the response mask, row-major.
    pub returns: Vec<f64>,
    /// Tokens under the response mask, row-major.
    pub values: Option<Vec<f64>>,
    /// Per row.
    pub num_turns: Option<Vec<f64>>,
    /// Per row.
    pub tool_call_counts: Option<Vec<f64>>,
}

/// First word of [`StepSummary::to_f64s`], so a peer running another version fails loudly.
const SUMMARY_FORMAT: f64 = 1.0;
const SUMMARY_HEADER: usize = 8;

impl StepSummary {
    /// Checks `data` (as [`compute_data_metrics`] does) and keeps what the metrics need.
    pub fn from_step(data: &StepData<'_>) -> Result<Self> {
        data.check()?;
        let width = data.max_response_length;
        let masked = |v: &[f64]| -> Vec<f64> {
            v.iter()
                .zip(data.response_mask)
                .filter(|(_, &m)| m != 0.0)
                .map(|(&x, _)| x)
                .collect()
        };
        Ok(StepSummary {
            max_response_length: width,
            max_prompt_length: data.max_prompt_length,
            sequence_scores: data.sequence_scores.to_vec(),
            rewards: (0..data.rows())
                .map(|r| {
                    data.token_level_rewards[r * width..(r + 1) * width]
                        .iter()
                        .sum()
                })
                .collect(),
            prompt_lengths: data.prompt_lengths.to_vec(),
            response_lengths: data.response_lengths.to_vec(),
            advantages: masked(data.advantages),
            returns: masked(data.returns),
            values: data.values.map(masked),
            num_turns: data.num_turns.map(<[f64]>::to_vec),
            tool_call_counts: data.tool_call_counts.map(<[f64]>::to_vec),
        })
    }

    /// Number of responses.
    pub fn rows(&self) -> usize {
        self.response_lengths.len()
    }

    /// Prompt and response tokens, for timing and throughput metrics.
    pub fn token_counts(&self) -> TokenCounts {
        TokenCounts {
            prompt: self.prompt_lengths.iter().map(|&n| n as u64).sum(),
            response: self.response_lengths.iter().map(|&n| n as u64).sum(),
        }
    }

    /// The rows of `parts` one after the other (the ranks' slices in rank order). Widths are the
    /// widest part's: a rank whose responses were padded less still counts against the limit.
    pub fn concat(parts: Vec<StepSummary>) -> Result<Self> {
        const OP: &str = "StepSummary::concat";
        let mut it = parts.into_iter();
        let Some(mut out) = it.next() else {
            return Err(MetricsError::Empty {
                op: OP,
                what: "step summaries".into(),
            });
        };
        for (i, p) in it.enumerate() {
            let optional = [
                ("values", out.values.is_some(), p.values.is_some()),
                ("num_turns", out.num_turns.is_some(), p.num_turns.is_some()),
                (
                    "tool_call_counts",
                    out.tool_call_counts.is_some(),
                    p.tool_call_counts.is_some(),
                ),
            ];
            for (input, first, this) in optional {
                if first != this {
                    return Err(MetricsError::Length {
                        op: OP,
                        input,
                        expected: first as usize,
                        found: this as usize,
                        why: if i == 0 {
                            "every part must have it or none (part 1 differs from part 0)"
                        } else {
                            "every part must have it or none"
                        },
                    });
                }
            }
            out.max_response_length = out.max_response_length.max(p.max_response_length);
            out.max_prompt_length = out.max_prompt_length.max(p.max_prompt_length);
            out.sequence_scores.extend(p.sequence_scores);
            out.rewards.extend(p.rewards);
            out.prompt_lengths.extend(p.prompt_lengths);
            out.response_lengths.extend(p.response_lengths);
            out.advantages.extend(p.advantages);
            out.returns.extend(p.returns);
            if let (Some(a), Some(b)) = (out.values.as_mut(), p.values) {
                a.extend(b);
            }
            if let (Some(a), Some(b)) = (out.num_turns.as_mut(), p.num_turns) {
                a.extend(b);
            }
            if let (Some(a), Some(b)) = (out.tool_call_counts.as_mut(), p.tool_call_counts) {
                a.extend(b);
            }
        }
        Ok(out)
    }

    /// A flat, bit-exact encoding for sending a summary between processes.
    pub fn to_f64s(&self) -> Vec<f64> {
        let flag = |b: bool| b as u8 as f64;
        let mut out = vec![
            SUMMARY_FORMAT,
            self.max_response_length as f64,
            self.max_prompt_length as f64,
            self.rows() as f64,
            self.advantages.len() as f64,
            flag(self.values.is_some()),
            flag(self.num_turns.is_some()),
            flag(self.tool_call_counts.is_some()),
        ];
        out.extend(&self.sequence_scores);
        out.extend(&self.rewards);
        out.extend(self.prompt_lengths.iter().map(|&n| n as f64));
        out.extend(self.response_lengths.iter().map(|&n| n as f64));
        out.extend(&self.advantages);
        out.extend(&self.returns);
        for v in [&self.values, &self.num_turns, &self.tool_call_counts]
            .into_iter()
            .flatten()
        {
            out.extend(v);
        }
        out
    }

    /// Decodes [`StepSummary::to_f64s`].
    pub fn from_f64s(v: &[f64]) -> Result<Self> {
        const OP: &str = "StepSummary::from_f64s";
        let bad = |expected: usize, why: &'static str| MetricsError::Length {
            op: OP,
            input: "encoded summary",
            expected,
            found: v.len(),
            why,
        };
        if v.len() < SUMMARY_HEADER || v[0] != SUMMARY_FORMAT {
            return Err(bad(
                SUMMARY_HEADER,
                "a header of format 1 (same verl version on every rank)",
            ));
        }
        let n = |x: f64| x as usize;
        let (rows, tokens) = (n(v[3]), n(v[4]));
        let (has_values, has_turns, has_tools) = (v[5] != 0.0, v[6] != 0.0, v[7] != 0.0);
        let expected = SUMMARY_HEADER
            + 4 * rows
            + (2 + has_values as usize) * tokens
            + (has_turns as usize + has_tools as usize) * rows;
        if v.len() != expected {
            return Err(bad(expected, "header + its rows and tokens"));
        }
        let mut at = SUMMARY_HEADER;
        let mut take = |len: usize| {
            let s = v[at..at + len].to_vec();
            at += len;
            s
        };
        let lens = |s: Vec<f64>| s.into_iter().map(n).collect::<Vec<usize>>();
        Ok(StepSummary {
            max_response_length: n(v[1]),
            max_prompt_length: n(v[2]),
            sequence_scores: take(rows),
            rewards: take(rows),
            prompt_lengths: lens(take(rows)),
            response_lengths: lens(take(rows)),
            advantages: take(tokens),
            returns: take(tokens),
            values: has_values.then(|| take(tokens)),
            num_turns: has_turns.then(|| take(rows)),
            tool_call_counts: has_tools.then(|| take(rows)),
        })
    }

    /// verl's `compute_data_metrics` over these rows.
    pub fn metrics(&self) -> Result<Metrics> {
        const OP: &str = "compute_data_metrics";
        let rows = self.rows();
        let width = self.max_response_length;
        if rows == 0 {
            return Err(MetricsError::Empty {
                op: OP,
                what: "rows".into(),
            });
        }

        let non_aborted: Vec<usize> = (0..rows)
            .filter(|&r| self.response_lengths[r] > 0)
            .collect();
        if non_aborted.is_empty() {
            return Err(MetricsError::AllAborted { rows });
        }
        let scores: Vec<f64> = non_aborted
            .iter()
            .map(|&r| self.sequence_scores[r])
            .collect();
        let rewards: Vec<f64> = non_aborted.iter().map(|&r| self.rewards[r]).collect();
        let adv = &self.advantages;
        let ret = &self.returns;
        nonempty(OP, "tokens under response_mask", adv)?;

        let mut out = Metrics::new();
        push_mean_max_min(&mut out, "critic/score", &scores);
        push_mean_max_min(&mut out, "critic/rewards", &rewards);
        push_mean_max_min(&mut out, "critic/advantages", adv);
        push_mean_max_min(&mut out, "critic/returns", ret);
        if let Some(val) = &self.values {
            push_mean_max_min(&mut out, "critic/values", val);
            let diff: Vec<f64> = ret.iter().zip(val).map(|(r, v)| r - v).collect();
            let explained = 1.0 - var_unbiased(&diff) / (var_unbiased(ret) + 1e-5);
            out.push(("critic/vf_explained_var".into(), explained));
        }

        let resp_len: Vec<f64> = self.response_lengths.iter().map(|&n| n as f64).collect();
        let clip_ratio = |lens: &[f64], limit: usize| {
            lens.iter().filter(|&&n| n == limit as f64).count() as f64 / lens.len() as f64
        };
        push_mean_max_min(&mut out, "response_length", &resp_len);
        out.push((
            "response_length/clip_ratio".into(),
            clip_ratio(&resp_len, width),
        ));
        let kept: Vec<f64> = non_aborted.iter().map(|&r| resp_len[r]).collect();
        push_mean_max_min(&mut out, "response_length_non_aborted", &kept);
        out.push((
            "response_length_non_aborted/clip_ratio".into(),
            clip_ratio(&kept, width),
        ));
        out.push((
            "response/aborted_ratio".into(),
            (rows - non_aborted.len()) as f64 / rows as f64,
        ));

        let prompt_len: Vec<f64> = self.prompt_lengths.iter().map(|&n| n as f64).collect();
        push_mean_max_min(&mut out, "prompt_length", &prompt_len);
        out.push((
            "prompt_length/clip_ratio".into(),
            clip_ratio(&prompt_len, self.max_prompt_length),
        ));

        // verl's order for these two is min, max, mean.
        for (name, v) in [
            ("num_turns", &self.num_turns),
            ("tool_call_counts", &self.tool_call_counts),
        ] {
            if let Some(v) = v {
                out.push((format!("{name}/min"), min(v)));
                out.push((format!("{name}/max"), max(v)));
                out.push((format!("{name}/mean"), mean(v)));
            }
        }
        Ok(out)
    }
}

/// Seconds spent per phase of a step, accumulated like verl's `marked_timer` (a phase timed twice adds up).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Timings {
    sections: Vec<(String, f64)>,
}

impl Timings {
    /// No phases yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Add `seconds` to phase `name`.
    pub fn add(&mut self, name: &str, seconds: f64) {
        match self.sections.iter_mut().find(|(n, _)| n == name) {
            Some((_, s)) => *s += seconds,
            None => self.sections.push((name.to_string(), seconds)),
        }
    }

    /// Run `f`, adding its wall-clock time to phase `name`.
    pub fn time<T>(&mut self, name: &str, f: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = f();
        self.add(name, start.elapsed().as_secs_f64());
        out
    }

    /// The seconds recorded for `name`.
    pub fn get(&self, name: &str) -> Option<f64> {
        self.sections
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, s)| *s)
    }

    /// Phases in first-recorded order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, f64)> {
        self.sections.iter().map(|(n, s)| (n.as_str(), *s))
    }
}

/// Which token count verl divides a phase's time by: generation by response tokens, the phases that run over
/// whole sequences by all tokens; other phases get no per-token metric.
fn tokens_of_section(name: &str, tokens: TokenCounts) -> Option<u64> {
    match name {
        "gen" => Some(tokens.response),
        "ref" | "values" | "adv" | "update_critic" | "update_actor" => Some(tokens.total()),
        _ => None,
    }
}

/// verl's `compute_timing_metrics`: `timing_s/<phase>` for every phase, and `timing_per_token_ms/<phase>` for
/// `gen` (per response token) and `ref`, `values`, `adv`, `update_critic`, `update_actor` (per prompt+response
/// token). A phase over zero tokens gets no per-token metric (verl would divide by zero).
pub fn compute_timing_metrics(timings: &Timings, tokens: TokenCounts) -> Metrics {
    let mut out: Metrics = timings
        .iter()
        .map(|(name, s)| (format!("timing_s/{name}"), s))
        .collect();
    for (name, s) in timings.iter() {
        if let Some(n) = tokens_of_section(name, tokens).filter(|&n| n > 0) {
            out.push((format!("timing_per_token_ms/{name}"), s * 1000.0 / n as f64));
        }
    }
    out
}

/// verl's `compute_throughout_metrics`: `perf/total_num_tokens`, `perf/time_per_step` (the `step` phase) and
/// `perf/throughput` in tokens per second per GPU.
pub fn compute_throughput_metrics(
    timings: &Timings,
    tokens: TokenCounts,
    n_gpus: usize,
) -> Result<Metrics> {
    let time = timings
        .get("step")
        .ok_or_else(|| MetricsError::MissingTiming {
            op: "compute_throughput_metrics",
            section: "step",
            found: timings
                .iter()
                .map(|(n, _)| n)
                .collect::<Vec<_>>()
                .join(", "),
        })?;
    let total = tokens.total() as f64;
    Ok(vec![
        ("perf/total_num_tokens".into(), total),
        ("perf/time_per_step".into(), time),
        (
            "perf/throughput".into(),
            total / (time * n_gpus.max(1) as f64),
        ),
    ])
}

/// verl's `reduce_metrics` (`verl/utils/metric/utils.py`): a key containing `max` keeps the largest value, one
/// containing `min` the smallest, any other the mean. Keys with no values are dropped.
pub fn reduce_metrics(metrics: &BTreeMap<String, Vec<f64>>) -> BTreeMap<String, f64> {
    metrics
        .iter()
        .filter(|(_, v)| !v.is_empty())
        .map(|(k, v)| {
            let value = if k.contains("max") {
                max(v)
            } else if k.contains("min") {
                min(v)
            } else {
                mean(v)
            };
            (k.clone(), value)
        })
        .collect()
}

/// Collects per-micro-batch metric lists (verl's `append_to_dict`) for [`reduce_metrics`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MetricLists(pub BTreeMap<String, Vec<f64>>);

impl MetricLists {
    /// Append each value to its key's list.
    pub fn append<'k>(&mut self, metrics: impl IntoIterator<Item = (&'k str, f64)>) {
        for (k, v) in metrics {
            self.0.entry(k.to_string()).or_default().push(v);
        }
    }

    /// [`reduce_metrics`] of the lists.
    pub fn reduce(&self) -> BTreeMap<String, f64> {
        reduce_metrics(&self.0)
    }
}

#[cfg(test)]
mod summary_tests {
    use super::*;

    /// Three rows of width 3 with a critic; rows 0..split and split.. as two "ranks".
    fn step(rows: std::ops::Range<usize>) -> StepSummary {
        let all_mask = [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0];
        let adv = [0.3, -0.1, 9.0, 1.5, 9.0, 9.0, -2.0, 0.25, 0.5];
        let ret = [1.0, 2.0, 9.0, -1.0, 9.0, 9.0, 0.5, 0.5, 3.0];
        let val = [0.1, 0.7, 9.0, 0.2, 9.0, 9.0, -0.3, 0.9, 1.1];
        let rew = [0.0, 1.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.25];
        let (a, b) = (rows.start * 3, rows.end * 3);
        let scores = [1.0, 0.5, 0.25];
        let plen = [4usize, 7, 7];
        let rlen = [2usize, 1, 3];
        StepSummary::from_step(&StepData {
            max_response_length: 3,
            max_prompt_length: 7,
            sequence_scores: &scores[rows.clone()],
            token_level_rewards: &rew[a..b],
            advantages: &adv[a..b],
            returns: &ret[a..b],
            values: Some(&val[a..b]),
            response_mask: &all_mask[a..b],
            prompt_lengths: &plen[rows.clone()],
            response_lengths: &rlen[rows],
            num_turns: None,
            tool_call_counts: None,
        })
        .unwrap()
    }

    #[test]
    fn concatenated_rank_slices_give_the_whole_batch_metrics_bit_for_bit() {
        let whole = step(0..3).metrics().unwrap();
        let parts = StepSummary::concat(vec![step(0..1), step(1..3)]).unwrap();
        assert_eq!(parts.metrics().unwrap(), whole);
        let get = |k: &str| whole.iter().find(|(n, _)| n == k).unwrap().1;
        assert_eq!(get("response_length/clip_ratio"), 1.0 / 3.0);
        assert_eq!(get("critic/advantages/max"), 1.5);
    }

    #[test]
    fn the_flat_encoding_round_trips_and_rejects_truncation() {
        let s = step(0..3);
        let v = s.to_f64s();
        assert_eq!(StepSummary::from_f64s(&v).unwrap(), s);
        let err = StepSummary::from_f64s(&v[..v.len() - 1])
            .unwrap_err()
            .to_string();
        assert!(err.contains("encoded summary"), "{err}");
        assert!(StepSummary::from_f64s(&[]).is_err());
    }

    #[test]
    fn concat_refuses_parts_with_and_without_values() {
        let mut b = step(1..3);
        b.values = None;
        let err = StepSummary::concat(vec![step(0..1), b])
            .unwrap_err()
            .to_string();
        assert!(err.contains("`values`"), "{err}");
    }
}
