use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::config::DataConfig;
use crate::dataset::Dataset;
use crate::error::{DataError, Result};
use crate::sample::Sample;
use crate::shuffle;

/// Where a loader stands, saved with a checkpoint. Restoring it continues at the exact next
/// batch with the same order: an epoch's order depends only on `(seed, epoch)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataLoaderState {
    pub epoch: u64,
    /// Samples of this epoch's order already handed out.
    pub index_in_epoch: usize,
    pub seed: u64,
    /// Dataset size when saved; a different size would silently change every order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_samples: Option<usize>,
}

/// How a loader walks its dataset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoaderOptions {
    pub batch_size: usize,
    pub shuffle: bool,
    /// `None`: pick one at random (and report it through [`DataLoader::state`]).
    pub seed: Option<u64>,
    /// Drop an epoch's last, incomplete batch (verl: true for training, false for validation).
    pub drop_last: bool,
    /// Stop after this many epochs; `None` runs until the caller stops asking.
    pub epochs: Option<u64>,
}

impl LoaderOptions {
    /// verl's training loader: `gen_batch_size` or `train_batch_size` prompts, shuffled when
    /// `data.shuffle`, incomplete last batch dropped.
    pub fn train(cfg: &DataConfig, epochs: Option<u64>) -> Self {
        Self {
            batch_size: cfg.train_loader_batch_size(),
            shuffle: cfg.shuffle,
            seed: cfg.seed,
            drop_last: true,
            epochs,
        }
    }

    /// verl's validation loader: `val_batch_size` (default: everything in one batch),
    /// `validation_shuffle`, nothing dropped, one pass.
    pub fn validation(cfg: &DataConfig, num_samples: usize) -> Self {
        Self {
            batch_size: cfg.val_batch_size.unwrap_or(num_samples).max(1),
            shuffle: cfg.validation_shuffle,
            seed: cfg.seed,
            drop_last: false,
            epochs: Some(1),
        }
    }
}

/// One step's prompts.
#[derive(Clone, Debug)]
pub struct Batch {
    pub epoch: u64,
    /// 0-based step within the epoch.
    pub step_in_epoch: usize,
    /// Positions in the dataset, in batch order.
    pub indices: Vec<usize>,
    pub samples: Vec<Sample>,
    /// No further batch in this epoch.
    pub last_in_epoch: bool,
}

impl Batch {
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }
}

/// Yields batches of prompts epoch after epoch, like verl's `StatefulDataLoader` over a
/// `RandomSampler` (shuffle) or `SequentialSampler`.
#[derive(Debug)]
pub struct DataLoader {
    dataset: Arc<Dataset>,
    opts: LoaderOptions,
    seed: u64,
    epoch: u64,
    pos: usize,
    /// Visiting order of `epoch`, computed on first use.
    order: Option<Vec<usize>>,
}

impl DataLoader {
    /// A training loader (`drop_last`, unlimited epochs), resumed from `state` when given.
    pub fn new(
        dataset: Arc<Dataset>,
        batch_size: usize,
        shuffle: bool,
        seed: Option<u64>,
        state: Option<DataLoaderState>,
    ) -> Result<Self> {
        let opts = LoaderOptions {
            batch_size,
            shuffle,
            seed,
            drop_last: true,
            epochs: None,
        };
        Self::with_options(dataset, opts, state)
    }

    pub fn with_options(
        dataset: Arc<Dataset>,
        opts: LoaderOptions,
        state: Option<DataLoaderState>,
    ) -> Result<Self> {
        let n = dataset.len();
        if opts.batch_size == 0 {
            return Err(DataError::InvalidConfig {
                key: "batch size".into(),
                expected: "a positive number of prompts".into(),
                found: "0".into(),
            });
        }
        let batches = batches_per_epoch(n, opts.batch_size, opts.drop_last);
        if batches == 0 {
            return Err(DataError::EmptyLoader {
                num_samples: n,
                batch_size: opts.batch_size,
                drop_last: opts.drop_last,
            });
        }
        let (seed, epoch, pos) = match state {
            None => (opts.seed.unwrap_or_else(shuffle::fresh_seed), 0, 0),
            Some(st) => {
                if let Some(seed) = opts.seed {
                    if opts.shuffle && seed != st.seed {
                        return Err(DataError::StateMismatch {
                            field: "seed",
                            saved: st.seed.to_string(),
                            current: seed.to_string(),
                        });
                    }
                }
                if let Some(saved) = st.num_samples {
                    if saved != n {
                        return Err(DataError::StateMismatch {
                            field: "num_samples",
                            saved: saved.to_string(),
                            current: n.to_string(),
                        });
                    }
                }
                if st.index_in_epoch > n {
                    return Err(DataError::StateMismatch {
                        field: "index_in_epoch",
                        saved: st.index_in_epoch.to_string(),
                        current: format!("at most {n} (dataset size)"),
                    });
                }
                (st.seed, st.epoch, st.index_in_epoch)
            }
        };
        let mut loader = Self {
            dataset,
            opts,
            seed,
            epoch,
            pos,
            order: None,
        };
        // A state saved right at an epoch's end (possible with another batch size) rolls over.
        loader.roll_over_if_done();
        Ok(loader)
    }

    /// The next batch, or `None` once the configured number of epochs is done.
    pub fn next_batch(&mut self) -> Option<Batch> {
        if self.finished() {
            return None;
        }
        let n = self.dataset.len();
        let take = self.opts.batch_size.min(n - self.pos);
        let epoch = self.epoch;
        let step_in_epoch = self.pos / self.opts.batch_size;
        let pos = self.pos;
        let indices: Vec<usize> = self.order_mut()[pos..pos + take].to_vec();
        self.pos += take;
        let samples = indices.iter().map(|&i| self.dataset[i].clone()).collect();
        let last_in_epoch = self.roll_over_if_done();
        Some(Batch {
            epoch,
            step_in_epoch,
            indices,
            samples,
            last_in_epoch,
        })
    }

    /// The position to save: restoring it yields exactly the batch `next_batch` would give now.
    pub fn state(&self) -> DataLoaderState {
        DataLoaderState {
            epoch: self.epoch,
            index_in_epoch: self.pos,
            seed: self.seed,
            num_samples: Some(self.dataset.len()),
        }
    }

    /// verl's `len(dataloader)`.
    pub fn batches_per_epoch(&self) -> usize {
        batches_per_epoch(
            self.dataset.len(),
            self.opts.batch_size,
            self.opts.drop_last,
        )
    }

    /// Steps for `epochs` epochs (verl's `total_training_steps` default).
    pub fn total_steps(&self, epochs: u64) -> u64 {
        self.batches_per_epoch() as u64 * epochs
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    pub fn dataset(&self) -> &Arc<Dataset> {
        &self.dataset
    }

    pub fn options(&self) -> &LoaderOptions {
        &self.opts
    }

    fn finished(&self) -> bool {
        self.opts.epochs.is_some_and(|e| self.epoch >= e)
    }

    fn order_mut(&mut self) -> &[usize] {
        let (n, seed, epoch, shuffle) =
            (self.dataset.len(), self.seed, self.epoch, self.opts.shuffle);
        self.order.get_or_insert_with(|| {
            if shuffle {
                shuffle::epoch_permutation(n, seed, epoch)
            } else {
                (0..n).collect()
            }
        })
    }

    /// Moves to the next epoch when the current one has no batch left; returns whether it did.
    fn roll_over_if_done(&mut self) -> bool {
        let remaining = self.dataset.len() - self.pos;
        let done = remaining == 0 || (self.opts.drop_last && remaining < self.opts.batch_size);
        if done {
            self.epoch += 1;
            self.pos = 0;
            self.order = None;
        }
        done
    }
}

impl Iterator for DataLoader {
    type Item = Batch;
    fn next(&mut self) -> Option<Batch> {
        self.next_batch()
    }
}

fn batches_per_epoch(n: usize, batch_size: usize, drop_last: bool) -> usize {
    if drop_last {
        n / batch_size
    } else {
        n.div_ceil(batch_size)
    }
}
