//! Metric accumulation with verl's reductions: `dp_actor` / `dp_critic` add the loss values of every
//! micro-batch into one running sum (`pg_loss`, `kl_loss`, `vf_loss`), append the other per-micro-batch
//! and per-mini-batch values to lists, and the trainer averages each list.

//!
//! Across data-parallel ranks ([`MetricAcc::reduce`]): a running sum holds this rank's share of a
//! loss normalised by the global counts, so the shares are summed; a list metric becomes the mean
//! over every rank's entries (what one rank would report had it run all the micro-batches);
//! values already equal on every rank (grad norm, lr) are kept as they are.

use std::collections::BTreeMap;

use tch::Device;

use crate::dp::Dp;
use crate::error::{FsdpError, Result};

/// `perf/gpu_memory_used_gb`: device-level used memory (`cuMemGetInfo`: total − free, GiB) at the
/// end of an update, the maximum over the ranks. It counts everything on the GPU: the CUDA
/// context, the caching allocator's reserve, other processes. verl's
/// `perf/max_memory_allocated_gb` / `perf/max_memory_reserved_gb` need the caching allocator's
/// statistics, which tch does not bind. Nothing is added on the CPU.
pub fn push_gpu_memory(acc: &mut MetricAcc, dp: &Dp, device: Device) -> Result<()> {
    let Device::Cuda(gpu) = device else {
        return Ok(());
    };
    let used = verl_comm::nccl::cuda_context(gpu)
        .ok()
        .and_then(|ctx| ctx.mem_get_info().ok())
        .map(|(free, total)| total.saturating_sub(free) as f64 / (1u64 << 30) as f64);
    // Every rank takes part in the reduction, even one whose query failed (-1).
    let mut v = [used.unwrap_or(-1.0)];
    dp.all_reduce_max(&mut v)?;
    if v[0] >= 0.0 {
        acc.push_global("perf/gpu_memory_used_gb", v[0]);
    }
    Ok(())
}

#[derive(Debug, Default)]
pub struct MetricAcc {
    sums: BTreeMap<String, f64>,
    lists: BTreeMap<String, Vec<f64>>,
    global: BTreeMap<String, Vec<f64>>,
}

impl MetricAcc {
    pub fn add(&mut self, name: &str, v: f64) {
        *self.sums.entry(name.to_string()).or_default() += v;
    }
    pub fn push(&mut self, name: &str, v: f64) {
        self.lists.entry(name.to_string()).or_default().push(v);
    }
    /// A value that is already the same on every rank (averaged like a list, never reduced).
    pub fn push_global(&mut self, name: &str, v: f64) {
        self.global.entry(name.to_string()).or_default().push(v);
    }

    /// Combines the metrics of every rank of `dp` (all ranks call it, with the same names).
    pub fn reduce(&mut self, dp: &Dp) -> Result<()> {
        if !dp.is_sharded() {
            return Ok(());
        }
        // The names travel as a count and a checksum so that a rank with other names fails
        // loudly instead of summing unrelated values.
        let names: Vec<&String> = self.sums.keys().chain(self.lists.keys()).collect();
        let checksum = names.iter().flat_map(|n| n.bytes()).fold(0u32, |h, b| {
            h.wrapping_mul(31).wrapping_add(b as u32) % 1_000_003
        });
        let mut shape = [names.len() as f64, checksum as f64];
        let mut lo = [-shape[0], -shape[1]];
        let local = shape;
        dp.all_reduce_max(&mut shape)?;
        dp.all_reduce_max(&mut lo)?;
        if shape != local || lo != [-local[0], -local[1]] {
            return Err(FsdpError::Api(verl_plugin_api::Error::failed(format!(
                "rank {}: update metrics differ between ranks (this rank has {:?})",
                dp.rank, names
            ))));
        }
        let mut v: Vec<f64> = self.sums.values().copied().collect();
        for l in self.lists.values() {
            v.push(l.iter().sum());
            v.push(l.len() as f64);
        }
        dp.all_reduce_sum(&mut v)?;
        let n = self.sums.len();
        for (dst, x) in self.sums.values_mut().zip(&v) {
            *dst = *x;
        }
        for (i, l) in self.lists.values_mut().enumerate() {
            let (sum, count) = (v[n + 2 * i], v[n + 2 * i + 1]);
            *l = if count > 0.0 {
                vec![sum / count]
            } else {
                vec![]
            };
        }
        Ok(())
    }

    pub fn into_metrics(self) -> Vec<(String, f64)> {
        let mut out: BTreeMap<String, f64> = self.sums;
        for (k, v) in self.lists.into_iter().chain(self.global) {
            if !v.is_empty() {
                out.insert(k, v.iter().sum::<f64>() / v.len() as f64);
            }
        }
        out.into_iter().collect()
    }
}
