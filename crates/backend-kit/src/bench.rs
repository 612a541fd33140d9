//! Extension calls for `verl bench`: `calibrate` (measured peak matmul FLOP/s and memory bandwidth
//! of this role's device) and `memory` (device memory in use now). Results come back in the
//! returned batch's `meta` object (it has no columns).
//!
//! Every timed region ends with a device synchronisation, so the numbers are of work that ran.

use std::time::Instant;

use tch::{Device, Kind, Tensor};
use verl_plugin_api::Batch;

use crate::error::{Result, TorchContext};

/// The call that measures the device (`Actor.call("calibrate", …)`).
pub const CALIBRATE: &str = "calibrate";
/// The call that reports device memory (`Actor.call("memory", …)`).
pub const MEMORY: &str = "memory";

fn sync(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

fn opt_i64(options: &serde_json::Value, key: &str, default: i64) -> i64 {
    options.get(key).and_then(|v| v.as_i64()).unwrap_or(default)
}

/// Times `iters` runs of `f` after `warmup` untimed ones, with a device sync before and after.
fn timed(
    device: Device,
    warmup: i64,
    iters: i64,
    mut f: impl FnMut() -> Result<()>,
) -> Result<f64> {
    for _ in 0..warmup {
        f()?;
    }
    sync(device);
    let t = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    sync(device);
    Ok(t.elapsed().as_secs_f64())
}

/// Peak dense matmul throughput and memory bandwidth of `device`.
///
/// Options (all optional): `matmul_n` (square size; default 8192 on CUDA, 512 on the CPU),
/// `matmul_iters` (default 20 / 3), `copy_mib` (bytes copied per iteration; default 2048 / 64),
/// `copy_iters` (default 20 / 3). Meta: `peak_tflops` (2·n³ per matmul, bf16 inputs),
/// `hbm_gbps` (2 × bytes per copy — one read, one write — over the time, 1e9 bytes/s), and the
/// sizes used.
pub fn calibrate(device: Device, options: &serde_json::Value) -> Result<Batch> {
    let cuda = device.is_cuda();
    let n = opt_i64(options, "matmul_n", if cuda { 8192 } else { 512 }).max(16);
    let mm_iters = opt_i64(options, "matmul_iters", if cuda { 20 } else { 3 }).max(1);
    let copy_mib = opt_i64(options, "copy_mib", if cuda { 2048 } else { 64 }).max(1);
    let copy_iters = opt_i64(options, "copy_iters", if cuda { 20 } else { 3 }).max(1);
    let (tflops, gbps) = tch::no_grad(|| -> Result<(f64, f64)> {
        let opts = (Kind::BFloat16, device);
        let a = Tensor::f_randn([n, n], opts).ctx("calibrate: matmul input")?;
        let b = Tensor::f_randn([n, n], opts).ctx("calibrate: matmul input")?;
        let c = Tensor::f_empty([n, n], opts).ctx("calibrate: matmul output")?;
        let secs = timed(device, 3, mm_iters, || {
            let _ = a.f_mm_out(&c, &b).ctx("calibrate: matmul")?;
            Ok(())
        })?;
        let tflops = 2.0 * (n as f64).powi(3) * mm_iters as f64 / secs / 1e12;
        drop((a, b, c));
        let bytes = copy_mib * (1 << 20);
        let src = Tensor::f_ones([bytes], (Kind::Uint8, device)).ctx("calibrate: copy source")?;
        let mut dst =
            Tensor::f_empty([bytes], (Kind::Uint8, device)).ctx("calibrate: copy dest")?;
        let secs = timed(device, 2, copy_iters, || {
            dst.f_copy_(&src).ctx("calibrate: copy")?;
            Ok(())
        })?;
        let gbps = 2.0 * bytes as f64 * copy_iters as f64 / secs / 1e9;
        Ok((tflops, gbps))
    })?;
    Ok(meta_batch(serde_json::json!({
        "peak_tflops": tflops,
        "hbm_gbps": gbps,
        "matmul_n": n,
        "matmul_iters": mm_iters,
        "matmul_dtype": "bf16",
        "copy_mib": copy_mib,
        "device": format!("{device:?}"),
    })))
}

/// Device memory now. On CUDA: `used_gb` = total − free from `cuMemGetInfo` (GiB): everything on
/// the GPU — CUDA context, the caching allocator's reserve (which keeps what a phase used), other
/// processes; and the caching allocator's own readings (where it keeps statistics):
/// `allocated_gb` (held by tensors now), `reserved_gb` (segments held from the driver now),
/// `releasable_gb` (the part of those segments that holds no tensor at all, which the KV cache's
/// budget counts as free) and
/// `max_allocated_gb` (the peak held by tensors since the previous `memory` call, which resets it:
/// called after each phase, the phase's own peak, as `torch.cuda.max_memory_allocated` after
/// `reset_peak_memory_stats`). On the CPU:
/// this process's resident set now and its high-water mark (`/proc/self/status` VmRSS / VmHWM).
/// `params_gb`: the bytes this role holds in parameters, gradients and optimizer state.
pub fn memory(device: Device, role_bytes: usize) -> Result<Batch> {
    let gib = (1u64 << 30) as f64;
    let mut m = serde_json::Map::new();
    m.insert("role_state_gb".into(), (role_bytes as f64 / gib).into());
    match device {
        Device::Cuda(gpu) => {
            let info = verl_comm::nccl::cuda_context(gpu)
                .ok()
                .and_then(|ctx| ctx.mem_get_info().ok());
            if let Some((free, total)) = info {
                m.insert(
                    "used_gb".into(),
                    (total.saturating_sub(free) as f64 / gib).into(),
                );
                m.insert("total_gb".into(), (total as f64 / gib).into());
                m.insert("source".into(), "cuMemGetInfo total-free".into());
            }
            if let Ok(st) = verl_torch_ext::cuda_memory_stats(gpu) {
                m.insert("allocated_gb".into(), (st.allocated as f64 / gib).into());
                m.insert(
                    "max_allocated_gb".into(),
                    (st.max_allocated as f64 / gib).into(),
                );
                m.insert("reserved_gb".into(), (st.reserved as f64 / gib).into());
                m.insert("releasable_gb".into(), (st.releasable as f64 / gib).into());
                // The next call's peak is the next phase's.
                let _ = verl_torch_ext::cuda_reset_peak_memory_stats(gpu);
            }
        }
        _ => {
            let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
            let kib = |key: &str| -> Option<f64> {
                status
                    .lines()
                    .find(|l| l.starts_with(key))
                    .and_then(|l| l.split_whitespace().nth(1))
                    .and_then(|v| v.parse::<f64>().ok())
            };
            if let (Some(rss), Some(hwm)) = (kib("VmRSS:"), kib("VmHWM:")) {
                m.insert("used_gb".into(), (rss * 1024.0 / gib).into());
                m.insert("peak_gb".into(), (hwm * 1024.0 / gib).into());
                m.insert("source".into(), "/proc/self/status VmRSS/VmHWM".into());
            }
        }
    }
    Ok(meta_batch(serde_json::Value::Object(m)))
}

fn meta_batch(v: serde_json::Value) -> Batch {
    let mut b = Batch::new();
    if let serde_json::Value::Object(map) = v {
        b.set_meta(&map);
    }
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calibrate_and_memory_on_cpu() {
        let opts =
            serde_json::json!({"matmul_n": 64, "matmul_iters": 1, "copy_mib": 1, "copy_iters": 1});
        let b = calibrate(Device::Cpu, &opts).unwrap();
        let m = b.meta();
        assert!(m["peak_tflops"].as_f64().unwrap() > 0.0, "{m:?}");
        assert!(m["hbm_gbps"].as_f64().unwrap() > 0.0, "{m:?}");
        let mem = memory(Device::Cpu, 1 << 30).unwrap().meta();
        assert_eq!(mem["role_state_gb"].as_f64().unwrap(), 1.0);
        assert!(mem["peak_gb"].as_f64().unwrap() > 0.0, "{mem:?}");
    }
}
