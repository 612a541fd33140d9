use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::config::{DataConfig, Split};
use crate::error::{DataError, Result};
use crate::read::read_table;
use crate::sample::Sample;
use crate::shuffle;

/// Error type a prompt-length function may return; anything `?`-convertible fits.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Measures a prompt in tokens *after* the chat template (the host plugs in its tokenizer
/// and template; this crate does not tokenize).
pub type PromptLenFn<'a> = dyn Fn(&Sample) -> std::result::Result<usize, BoxError> + 'a;

/// What overlong-prompt filtering did, for the host's log line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FilterReport {
    pub before: usize,
    pub kept: usize,
    pub removed: usize,
    pub max_prompt_length: usize,
    /// Length of the shortest removed prompt, a hint for choosing `max_prompt_length`.
    pub shortest_removed: Option<usize>,
}

/// Rows of one or more verl-format files, in file order then row order.
#[derive(Clone, Debug)]
pub struct Dataset {
    samples: Vec<Sample>,
    files: Vec<PathBuf>,
}

/// verl-rs trains text-only models: a row carrying images, videos or audio would be trained on
/// its text alone, so it is refused by name instead.
fn refuse_media(
    row: &serde_json::Map<String, serde_json::Value>,
    cfg: &DataConfig,
    path: &Path,
    row_index: usize,
) -> Result<()> {
    use serde_json::Value;
    for (key, column) in &cfg.media_columns {
        let carries = match row.get(column) {
            None | Some(Value::Null) => false,
            Some(Value::Array(a)) => !a.is_empty(),
            Some(Value::Object(o)) => !o.is_empty(),
            Some(Value::String(s)) => !s.is_empty(),
            Some(_) => true,
        };
        if carries {
            return Err(DataError::MultimodalRow {
                path: path.to_path_buf(),
                row: row_index,
                column: column.clone(),
                key: key.clone(),
            });
        }
    }
    Ok(())
}

impl Dataset {
    /// Reads and concatenates `paths` (parquet, Arrow IPC or JSONL, mixed freely).
    /// No row selection or filtering: see [`Dataset::prepare`] for verl's full pipeline.
    pub fn load<P: AsRef<Path>>(paths: &[P], cfg: &DataConfig) -> Result<Self> {
        if paths.is_empty() {
            return Err(DataError::NoFiles);
        }
        let mut samples = Vec::new();
        let mut files = Vec::with_capacity(paths.len());
        for path in paths {
            let path = path.as_ref();
            let table = read_table(path)?;
            let shared = Arc::new(path.to_path_buf());
            // Checking the schema once gives one clear error instead of one per row.
            if let Some(columns) = &table.columns {
                for required in [
                    cfg.prompt_key.as_str(),
                    cfg.reward_fn_key.as_str(),
                    "reward_model",
                ] {
                    if !columns.iter().any(|c| c == required) {
                        return Err(DataError::MissingColumn {
                            path: path.to_path_buf(),
                            row: None,
                            column: required.to_string(),
                            present: columns.clone(),
                        });
                    }
                }
            }
            samples.reserve(table.rows.len());
            for (row_index, row) in table.rows.into_iter().enumerate() {
                refuse_media(&row, cfg, path, row_index)?;
                samples.push(Sample::from_row(
                    row,
                    &cfg.prompt_key,
                    &cfg.reward_fn_key,
                    &shared,
                    row_index,
                )?);
            }
            files.push(path.to_path_buf());
        }
        if samples.is_empty() {
            return Err(DataError::EmptyDataset { paths: files });
        }
        Ok(Self { samples, files })
    }

    /// verl's `RLHFDataset` construction: load, keep `*_max_samples` rows (random ones when
    /// `shuffle`, else the first ones), then drop prompts longer than `max_prompt_length` when
    /// `filter_overlong_prompts`. `prompt_len` is required only for that filter.
    pub fn prepare<P: AsRef<Path>>(
        paths: &[P],
        cfg: &DataConfig,
        split: Split,
        prompt_len: Option<&PromptLenFn<'_>>,
    ) -> Result<(Self, Option<FilterReport>)> {
        if cfg.filter_overlong_prompts && prompt_len.is_none() {
            return Err(DataError::MissingPromptLengthFn);
        }
        let mut ds = Self::load(paths, cfg)?;
        ds.select_max_samples(cfg.max_samples(split), cfg.shuffle, cfg.seed);
        let report = match (cfg.filter_overlong_prompts, prompt_len) {
            (true, Some(f)) => Some(ds.filter_overlong(cfg.max_prompt_length, f)?),
            _ => None,
        };
        Ok((ds, report))
    }

    /// Builds a dataset from samples already in memory (tests, generated data).
    pub fn from_samples(samples: Vec<Sample>) -> Self {
        let mut files: Vec<PathBuf> = Vec::new();
        for s in &samples {
            if files.last().map(|f| f.as_path()) != Some(s.path()) {
                files.push(s.path().to_path_buf());
            }
        }
        Self { samples, files }
    }

    /// Keeps `max` rows when `0 < max < len`: a random selection (in random order, like
    /// numpy's `choice(replace=False)`) when `shuffle`, otherwise the first `max`.
    /// The selection's randomness is ours (ChaCha8), so the rows differ from verl's numpy pick.
    pub fn select_max_samples(&mut self, max: i64, shuffle: bool, seed: Option<u64>) {
        let total = self.samples.len();
        if max <= 0 || max as u64 >= total as u64 {
            return;
        }
        let max = max as usize;
        if !shuffle {
            self.samples.truncate(max);
            return;
        }
        let seed = seed.unwrap_or_else(shuffle::fresh_seed);
        let picked = shuffle::random_selection(total, max, seed);
        let mut slots: Vec<Option<Sample>> = std::mem::take(&mut self.samples)
            .into_iter()
            .map(Some)
            .collect();
        self.samples = picked
            .into_iter()
            .map(|i| slots[i].take().expect("selection indices are distinct"))
            .collect();
    }

    /// Drops samples whose templated prompt is longer than `max_prompt_length` tokens.
    /// A failing length function is an error (naming the sample), not a silent drop.
    pub fn filter_overlong(
        &mut self,
        max_prompt_length: usize,
        prompt_len: &PromptLenFn<'_>,
    ) -> Result<FilterReport> {
        let before = self.samples.len();
        let mut keep = Vec::with_capacity(before);
        let mut shortest_removed: Option<usize> = None;
        for (index, sample) in self.samples.iter().enumerate() {
            let len = prompt_len(sample).map_err(|source| DataError::PromptLength {
                index,
                path: sample.path().to_path_buf(),
                row: sample.origin.row,
                source,
            })?;
            let ok = len <= max_prompt_length;
            if !ok {
                shortest_removed = Some(shortest_removed.map_or(len, |s| s.min(len)));
            }
            keep.push(ok);
        }
        let mut flags = keep.into_iter();
        self.samples.retain(|_| flags.next().unwrap_or(false));
        let kept = self.samples.len();
        if kept == 0 {
            return Err(DataError::EmptyAfterFilter {
                paths: self.files.clone(),
                total: before,
                filtered: before,
                reason: format!(
                    "data.filter_overlong_prompts: every prompt is longer than \
                     max_prompt_length={max_prompt_length} tokens after the chat template; \
                     the shortest has {} tokens",
                    shortest_removed.unwrap_or(0)
                ),
            });
        }
        Ok(FilterReport {
            before,
            kept,
            removed: before - kept,
            max_prompt_length,
            shortest_removed,
        })
    }

    pub fn len(&self) -> usize {
        self.samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    pub fn get(&self, index: usize) -> Option<&Sample> {
        self.samples.get(index)
    }

    pub fn samples(&self) -> &[Sample] {
        &self.samples
    }

    pub fn iter(&self) -> std::slice::Iter<'_, Sample> {
        self.samples.iter()
    }

    /// The files the rows came from, in load order.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }
}

impl std::ops::Index<usize> for Dataset {
    type Output = Sample;
    fn index(&self, index: usize) -> &Sample {
        &self.samples[index]
    }
}

impl<'a> IntoIterator for &'a Dataset {
    type Item = &'a Sample;
    type IntoIter = std::slice::Iter<'a, Sample>;
    fn into_iter(self) -> Self::IntoIter {
        self.samples.iter()
    }
}
