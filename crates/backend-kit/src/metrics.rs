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
use crate::error::{BackendError, Result};

/// The memory metrics of an update, the maximum over the ranks:
/// - `perf/gpu_memory_used_gb`: device-level used memory (`cuMemGetInfo`: total − free, GiB) at
///   the end of the update. It counts everything on the GPU: the CUDA context, the caching
///   allocator's reserve, other processes.
/// - verl's `perf/max_memory_allocated_gb` / `perf/max_memory_reserved_gb`: the caching
///   allocator's peaks since the process started (`torch.cuda.max_memory_allocated()` /
///   `max_memory_reserved()`, GiB; verl reports the first rank's, this the largest).
/// - verl's `perf/cpu_memory_used_gb`: the host's used memory as psutil's `virtual_memory().used`
///   computes it from `/proc/meminfo` (GiB).
///
/// Nothing is added on the CPU (verl's workers always run on GPUs, and runs that must match
/// metric for metric would differ in these).
pub fn push_gpu_memory(acc: &mut MetricAcc, dp: &Dp, device: Device) -> Result<()> {
    const GIB: f64 = (1u64 << 30) as f64;
    let Device::Cuda(gpu) = device else {
        return Ok(());
    };
    // Every rank takes part in the reduction, even one whose query failed (-1).
    let mut v = [-1.0f64; 4];
    if let Some((free, total)) = verl_comm::nccl::cuda_context(gpu)
        .ok()
        .and_then(|ctx| ctx.mem_get_info().ok())
    {
        v[0] = total.saturating_sub(free) as f64 / GIB;
    }
    if let Ok(s) = verl_torch_ext::cuda_memory_stats(gpu) {
        v[1] = s.max_allocated as f64 / GIB;
        v[2] = s.max_reserved as f64 / GIB;
    }
    if let Some(used) = host_memory_used() {
        v[3] = used as f64 / GIB;
    }
    dp.all_reduce_max(&mut v)?;
    let names = [
        "perf/gpu_memory_used_gb",
        "perf/max_memory_allocated_gb",
        "perf/max_memory_reserved_gb",
        "perf/cpu_memory_used_gb",
    ];
    for (name, x) in names.into_iter().zip(v) {
        if x >= 0.0 {
            acc.push_global(name, x);
        }
    }
    Ok(())
}

/// The update metrics that are a maximum over ranks (see [`push_gpu_memory`]).
pub const MEMORY_METRICS: [&str; 4] = [
    "perf/gpu_memory_used_gb",
    "perf/max_memory_allocated_gb",
    "perf/max_memory_reserved_gb",
    "perf/cpu_memory_used_gb",
];

/// The host's used memory in bytes as psutil's `virtual_memory().used` computes it on Linux, or
/// `None` where `/proc/meminfo` cannot be read.
fn host_memory_used() -> Option<u64> {
    meminfo_used(&std::fs::read_to_string("/proc/meminfo").ok()?)
}

/// psutil's Linux formula over a `/proc/meminfo` text: `total − free − cached − buffers`, with
/// `cached = Cached + SReclaimable` (`total − free` where that comes out negative, as in some
/// containers); bytes.
fn meminfo_used(text: &str) -> Option<u64> {
    let field = |key: &str| -> Option<i64> {
        text.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|v| v.parse::<i64>().ok())
            .map(|kib| kib * 1024)
    };
    let (total, free) = (field("MemTotal")?, field("MemFree")?);
    let buffers = field("Buffers").unwrap_or(0);
    let cached = field("Cached").unwrap_or(0) + field("SReclaimable").unwrap_or(0);
    let used = total - free - cached - buffers;
    Some(if used < 0 { total - free } else { used }.max(0) as u64)
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
            return Err(BackendError::Api(verl_plugin_api::Error::failed(format!(
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

#[cfg(test)]
mod tests {
    #[test]
    fn host_memory_used_is_psutils_formula() {
        let text = "MemTotal:       1000 kB\nMemFree:         100 kB\nMemAvailable:    700 kB\n\
                    Buffers:          50 kB\nCached:          300 kB\nSwapCached:        7 kB\n\
                    SReclaimable:     40 kB\n";
        assert_eq!(
            super::meminfo_used(text),
            Some((1000 - 100 - 340 - 50) * 1024)
        );
        // A container where the page cache exceeds what it sees as total: total - free.
        let text = "MemTotal: 100 kB\nMemFree: 20 kB\nBuffers: 10 kB\nCached: 90 kB\n";
        assert_eq!(super::meminfo_used(text), Some(80 * 1024));
        assert_eq!(super::meminfo_used("MemFree: 1 kB\n"), None);
        // The host this runs on: something is used.
        let used = super::host_memory_used().unwrap();
        assert!(used > 0, "{used}");
    }
}
