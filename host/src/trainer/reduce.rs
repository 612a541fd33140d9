//! Every cross-rank reduction of the trainer, as methods of one type.
//!
//! What verl computes on its driver over the whole batch is computed over the whole batch here
//! too, through the host's collectives: data metrics (the ranks' rows gathered in rank order, so
//! they equal a 1-rank run's), whitening and the KL controller's input (sums over ranks),
//! validation (rows gathered before the per-source reduction). Plugin metrics that differ
//! between ranks are averaged (`*/max` and `*/min` take the max and min); identical ones are
//! kept. Timings are the slowest rank's per phase, which is what verl's driver measures while it
//! waits for its workers. With one rank (no group) every method is the local computation.
//!
//! Each method is a collective: every rank calls the same ones in the same order.

use serde::de::DeserializeOwned;
use serde::Serialize;
use verl_algos::{masked_mean, CrossRankSum, Grid, LocalOnly, MASKED_MEAN_EPS};
use verl_metrics::{StepSummary, Timings};
use verl_plugin_api::Batch;

use crate::dist::{HostGroup, ReduceOp};

/// The job's ranks as the trainer reduces over them.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Ranks<'a> {
    group: Option<&'a HostGroup>,
}

impl<'a> Ranks<'a> {
    /// Over `group`'s ranks; `None`: this process alone.
    pub(crate) fn new(group: Option<&'a HostGroup>) -> Self {
        Ranks { group }
    }

    /// The group, for what is coordination rather than a reduction (a checkpoint's barriers).
    pub(crate) fn group(&self) -> Option<&'a HostGroup> {
        self.group
    }

    /// Whether this process is the job's only rank.
    pub(crate) fn is_single(&self) -> bool {
        self.group.is_none()
    }

    /// Whether this is rank 0 (the one that writes what all ranks gathered).
    pub(crate) fn is_first(&self) -> bool {
        self.group.is_none_or(|g| g.rank() == 0)
    }

    /// Declares which ranks hold distinct data (see [`HostGroup::set_data_ranks`]).
    pub(crate) fn set_data_ranks(&self, holds_data: &[bool]) -> anyhow::Result<()> {
        if let Some(g) = self.group {
            g.set_data_ranks(holds_data.to_vec())?;
        }
        Ok(())
    }

    /// Runs `f` with the reducer that makes `verl_algos`' batch statistics span every rank.
    pub(crate) fn reducer<T>(&self, f: impl FnOnce(&mut dyn CrossRankSum) -> T) -> T {
        match self.group {
            None => f(&mut LocalOnly),
            Some(mut g) => f(&mut g),
        }
    }

    /// Element-wise sums over ranks, in place.
    pub(crate) fn sum(&self, values: &mut [f64]) -> anyhow::Result<()> {
        self.reduce(values, ReduceOp::Sum)
    }

    /// Element-wise maxima over ranks, in place.
    pub(crate) fn max(&self, values: &mut [f64]) -> anyhow::Result<()> {
        self.reduce(values, ReduceOp::Max)
    }

    fn reduce(&self, values: &mut [f64], op: ReduceOp) -> anyhow::Result<()> {
        if let Some(g) = self.group {
            g.all_reduce_f64(values, op)?;
        }
        Ok(())
    }

    /// verl's `masked_mean` over the whole batch.
    pub(crate) fn masked_mean(&self, values: &Grid<f64>, mask: &Grid<f64>) -> anyhow::Result<f64> {
        let Some(g) = self.group else {
            return Ok(masked_mean(values, mask)?);
        };
        let mut sums = [
            verl_algos::masked_sum(values, mask)?,
            mask.as_slice().iter().sum::<f64>(),
        ];
        g.all_reduce_f64(&mut sums, ReduceOp::Sum)?;
        Ok(sums[0] / (sums[1] + MASKED_MEAN_EPS))
    }

    /// Every rank's `mine`, in rank order (JSON on the wire); `[mine]` alone.
    pub(crate) fn gather<T: Serialize + DeserializeOwned>(
        &self,
        mine: T,
    ) -> anyhow::Result<Vec<T>> {
        Ok(match self.group {
            None => vec![mine],
            Some(g) => g.all_gather_json(&mine)?,
        })
    }

    /// Every data-parallel replica's rows, concatenated in rank order, on every rank.
    pub(crate) fn concat_batches(&self, mine: Batch) -> anyhow::Result<Batch> {
        let Some(g) = self.group else {
            return Ok(mine);
        };
        let parts = g.all_gather_bytes(&mine.to_bytes())?;
        let replicas: Vec<Batch> = parts
            .iter()
            .map(|p| Batch::from_bytes(p))
            .collect::<Result<_, _>>()?;
        Ok(Batch::concat(&replicas)?)
    }

    /// A plugin's per-rank metrics as one set: values every rank agrees on stay as they are (the
    /// learning rate, a grad norm the backend already reduced, counts), others are averaged over
    /// ranks, or take the max/min for `*/max`/`*/min`. Names in rank 0's order; a name only some
    /// ranks report is reduced over those.
    pub(crate) fn metrics(&self, mine: Vec<(String, f64)>) -> anyhow::Result<Vec<(String, f64)>> {
        let Some(g) = self.group else {
            return Ok(mine);
        };
        // Bits, not JSON numbers: a value must come back exactly to compare equal across ranks.
        let bits: Vec<(String, u64)> = mine.iter().map(|(k, v)| (k.clone(), v.to_bits())).collect();
        let all = g.all_gather_json(&bits)?;
        let mut names: Vec<&String> = Vec::new();
        for part in &all {
            for (k, _) in part {
                if !names.contains(&k) {
                    names.push(k);
                }
            }
        }
        Ok(names
            .into_iter()
            .map(|k| {
                let vals: Vec<f64> = all
                    .iter()
                    .filter_map(|p| p.iter().find(|(n, _)| n == k))
                    .map(|(_, b)| f64::from_bits(*b))
                    .collect();
                let v = if vals.iter().all(|v| v.to_bits() == vals[0].to_bits()) {
                    vals[0]
                } else if k.ends_with("/max") {
                    vals.iter().cloned().fold(f64::NEG_INFINITY, f64::max)
                } else if k.ends_with("/min") {
                    vals.iter().cloned().fold(f64::INFINITY, f64::min)
                } else {
                    vals.iter().sum::<f64>() / vals.len() as f64
                };
                (k.clone(), v)
            })
            .collect())
    }

    /// The step's data-metric inputs of every rank, concatenated in rank order.
    pub(crate) fn step_summary(&self, mine: StepSummary) -> anyhow::Result<StepSummary> {
        let Some(g) = self.group else {
            return Ok(mine);
        };
        let parts = g.all_gather_f64(&mine.to_f64s())?;
        let parts = parts
            .iter()
            .map(|p| StepSummary::from_f64s(p))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(StepSummary::concat(parts)?)
    }

    /// Each phase's time on the slowest rank (every rank records the same phases in the same
    /// order).
    pub(crate) fn slowest(&self, timings: Timings) -> anyhow::Result<Timings> {
        let Some(g) = self.group else {
            return Ok(timings);
        };
        let mut secs: Vec<f64> = timings.iter().map(|(_, s)| s).collect();
        g.all_reduce_f64(&mut secs, ReduceOp::Max)?;
        let mut out = Timings::new();
        for ((name, _), s) in timings.iter().zip(secs) {
            out.add(name, s);
        }
        Ok(out)
    }
}
