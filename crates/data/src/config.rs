use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{DataError, Result};

/// What to do with a prompt longer than `max_prompt_length` tokens (verl `data.truncation`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Truncation {
    /// Fail, naming the sample and its length.
    #[default]
    Error,
    /// Keep the last `max` tokens.
    Left,
    /// Keep the first `max` tokens.
    Right,
    /// Keep the first `max / 2` and the last `max - max / 2` tokens.
    Middle,
}

impl FromStr for Truncation {
    type Err = DataError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "error" => Ok(Truncation::Error),
            "left" => Ok(Truncation::Left),
            "right" => Ok(Truncation::Right),
            "middle" => Ok(Truncation::Middle),
            other => Err(DataError::InvalidConfig {
                key: "data.truncation".into(),
                expected: "one of error, left, right, middle".into(),
                found: other.into(),
            }),
        }
    }
}

impl fmt::Display for Truncation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Truncation::Error => "error",
            Truncation::Left => "left",
            Truncation::Right => "right",
            Truncation::Middle => "middle",
        })
    }
}

/// Shortens a prompt's token ids to `max` tokens the way verl does (`postprocess_data`).
/// `sample_index` only feeds the error message of [`Truncation::Error`].
pub fn truncate(
    ids: &[u32],
    max: usize,
    mode: Truncation,
    sample_index: usize,
) -> Result<Vec<u32>> {
    if ids.len() <= max {
        return Ok(ids.to_vec());
    }
    // Note: for max == 0 Python's `ids[-0:]` would keep everything; an empty prompt is the
    // only sensible reading of "at most 0 tokens".
    Ok(match mode {
        Truncation::Error => {
            return Err(DataError::PromptTooLong {
                index: sample_index,
                length: ids.len(),
                max,
            })
        }
        Truncation::Left => ids[ids.len() - max..].to_vec(),
        Truncation::Right => ids[..max].to_vec(),
        Truncation::Middle => {
            let head = max / 2;
            let tail = max - head;
            let mut out = Vec::with_capacity(max);
            out.extend_from_slice(&ids[..head]);
            out.extend_from_slice(&ids[ids.len() - tail..]);
            out
        }
    })
}

/// Which split a dataset is loaded for: picks `train_max_samples` or `val_max_samples`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    Train,
    Val,
}

/// The `data.*` options of verl that this crate acts on. The host maps verl's config keys
/// into it; field names are verl's keys, defaults are verl's (`legacy_data.yaml`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DataConfig {
    /// Column holding the chat messages (or a plain string prompt).
    pub prompt_key: String,
    /// Column whose value routes a row to its reward (verl's `data.reward_fn_key`); read into
    /// [`crate::Sample::data_source`].
    pub reward_fn_key: String,
    /// `(config key, column)` of the multimodal columns (`data.image_key`, `data.video_key`,
    /// `data.audio_key`): a row with media in one of them is refused, as verl-rs trains
    /// text-only models.
    pub media_columns: Vec<(String, String)>,
    /// Token budget of a prompt after the chat template.
    pub max_prompt_length: usize,
    /// Drop prompts longer than `max_prompt_length` at load time.
    pub filter_overlong_prompts: bool,
    pub truncation: Truncation,
    /// `<= 0` keeps all rows; otherwise that many rows, chosen at random when `shuffle`.
    pub train_max_samples: i64,
    pub val_max_samples: i64,
    /// Shuffle the training loader (and the `*_max_samples` selection).
    pub shuffle: bool,
    /// `None`: a random seed, recorded in the loader state so a resume keeps the order.
    pub seed: Option<u64>,
    pub train_batch_size: usize,
    /// verl's loader uses `gen_batch_size` when set (DAPO-style over-sampling).
    pub gen_batch_size: Option<usize>,
    /// `None`: the whole validation set in one batch.
    pub val_batch_size: Option<usize>,
    pub validation_shuffle: bool,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            prompt_key: "prompt".into(),
            reward_fn_key: "data_source".into(),
            media_columns: vec![
                ("data.image_key".into(), "images".into()),
                ("data.video_key".into(), "videos".into()),
                ("data.audio_key".into(), "audios".into()),
            ],
            max_prompt_length: 512,
            filter_overlong_prompts: false,
            truncation: Truncation::Error,
            train_max_samples: -1,
            val_max_samples: -1,
            shuffle: true,
            seed: None,
            train_batch_size: 1024,
            gen_batch_size: None,
            val_batch_size: None,
            validation_shuffle: false,
        }
    }
}

impl DataConfig {
    pub fn max_samples(&self, split: Split) -> i64 {
        match split {
            Split::Train => self.train_max_samples,
            Split::Val => self.val_max_samples,
        }
    }

    /// Prompts per training step as verl's loader sees it.
    pub fn train_loader_batch_size(&self) -> usize {
        self.gen_batch_size.unwrap_or(self.train_batch_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const IDS: [u32; 10] = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9];

    #[test]
    fn short_prompts_are_untouched_in_every_mode() {
        for mode in [
            Truncation::Error,
            Truncation::Left,
            Truncation::Right,
            Truncation::Middle,
        ] {
            assert_eq!(truncate(&IDS, 10, mode, 0).unwrap(), IDS.to_vec());
            assert_eq!(truncate(&IDS, 11, mode, 0).unwrap(), IDS.to_vec());
        }
    }

    #[test]
    fn left_keeps_the_tail_right_keeps_the_head() {
        assert_eq!(
            truncate(&IDS, 4, Truncation::Left, 0).unwrap(),
            vec![6, 7, 8, 9]
        );
        assert_eq!(
            truncate(&IDS, 4, Truncation::Right, 0).unwrap(),
            vec![0, 1, 2, 3]
        );
    }

    #[test]
    fn middle_splits_floor_half_head_rest_tail() {
        assert_eq!(
            truncate(&IDS, 4, Truncation::Middle, 0).unwrap(),
            vec![0, 1, 8, 9]
        );
        // Odd budget: head gets max/2 (floor), the tail the rest.
        assert_eq!(
            truncate(&IDS, 5, Truncation::Middle, 0).unwrap(),
            vec![0, 1, 7, 8, 9]
        );
        assert_eq!(truncate(&IDS, 1, Truncation::Middle, 0).unwrap(), vec![9]);
        assert!(truncate(&IDS, 0, Truncation::Middle, 0).unwrap().is_empty());
        assert!(truncate(&IDS, 0, Truncation::Left, 0).unwrap().is_empty());
    }

    #[test]
    fn error_mode_names_sample_and_lengths() {
        let err = truncate(&IDS, 4, Truncation::Error, 17)
            .unwrap_err()
            .to_string();
        assert!(err.contains("sample 17"), "{err}");
        assert!(err.contains("10 tokens"), "{err}");
        assert!(err.contains("max_prompt_length=4"), "{err}");
    }

    #[test]
    fn truncation_parses_verl_spellings() {
        assert_eq!("middle".parse::<Truncation>().unwrap(), Truncation::Middle);
        let err = "center".parse::<Truncation>().unwrap_err().to_string();
        assert!(
            err.contains("data.truncation") && err.contains("center"),
            "{err}"
        );
        let cfg: DataConfig = serde_json::from_str(r#"{"truncation": "left", "seed": 7}"#).unwrap();
        assert_eq!(cfg.truncation, Truncation::Left);
        assert_eq!(cfg.seed, Some(7));
        assert_eq!(cfg.prompt_key, "prompt");
    }
}
