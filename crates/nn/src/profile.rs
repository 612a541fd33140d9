//! Opt-in phase timing for finding where GPU time goes (`VERL_PROFILE=1`).
//!
//! A [`Timer`] synchronises the device at every lap, so each phase's time is its own device work
//! plus the host work between laps; the synchronisations cost speed, so this is off unless the
//! environment asks for it, and then every call is a no-op returning `None`. Phases accumulate in
//! one process-wide table (per shared library: each plugin keeps its own) that
//! [`take_report`] prints and clears.
//!
//! [`trace`] (`VERL_TRACE_DIR=dir`) records a phase's CUDA kernels with libtorch's profiler into
//! a Chrome trace, for per-kernel attribution without Nsight.

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use tch::Device;

static ENABLED: OnceLock<bool> = OnceLock::new();
static TABLE: Mutex<BTreeMap<&'static str, (f64, u64)>> = Mutex::new(BTreeMap::new());

/// Whether `VERL_PROFILE` is set to something other than `0` (read once).
pub fn enabled() -> bool {
    *ENABLED.get_or_init(|| std::env::var("VERL_PROFILE").is_ok_and(|v| !v.is_empty() && v != "0"))
}

fn sync(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

/// Times consecutive phases on one device.
pub struct Timer {
    device: Device,
    last: Instant,
}

/// A timer starting now (after the device's queued work), or `None` when profiling is off.
pub fn start(device: Device) -> Option<Timer> {
    if !enabled() {
        return None;
    }
    sync(device);
    Some(Timer {
        device,
        last: Instant::now(),
    })
}

impl Timer {
    /// Ends phase `name` here (after the device's queued work) and starts the next one.
    pub fn lap(&mut self, name: &'static str) {
        sync(self.device);
        let now = Instant::now();
        let secs = now.duration_since(self.last).as_secs_f64();
        self.last = now;
        let mut t = TABLE.lock().unwrap_or_else(|e| e.into_inner());
        let e = t.entry(name).or_insert((0.0, 0));
        e.0 += secs;
        e.1 += 1;
    }
}

/// [`Timer::lap`] on an optional timer.
pub fn lap(timer: &mut Option<Timer>, name: &'static str) {
    if let Some(t) = timer {
        t.lap(name);
    }
}

/// The phases timed since the last report (total seconds, count, mean milliseconds), as a text
/// table, and clears them; `None` when nothing was timed.
pub fn take_report() -> Option<String> {
    let mut t = TABLE.lock().unwrap_or_else(|e| e.into_inner());
    if t.is_empty() {
        return None;
    }
    let mut s = format!(
        "{:<28} {:>10} {:>8} {:>10}\n",
        "phase", "total s", "count", "mean ms"
    );
    for (name, (secs, n)) in t.iter() {
        s.push_str(&format!(
            "{name:<28} {secs:>10.4} {n:>8} {:>10.3}\n",
            secs * 1e3 / *n as f64
        ));
    }
    t.clear();
    Some(s)
}

/// A libtorch (kineto) trace of one phase, written when dropped; see [`trace`].
pub struct Trace {
    device: Device,
    path: std::path::PathBuf,
}

/// Whether `VERL_TRACE_PHASES` (comma-separated phase names, e.g. `update,log_prob`) lets phase
/// `name` be traced; unset or empty: every phase.
fn phase_traced(name: &str) -> bool {
    phase_listed(std::env::var("VERL_TRACE_PHASES").ok().as_deref(), name)
}

fn phase_listed(list: Option<&str>, name: &str) -> bool {
    match list.map(str::trim).filter(|l| !l.is_empty()) {
        None => true,
        Some(l) => l.split(',').any(|p| p.trim() == name),
    }
}

/// With `VERL_TRACE_DIR` set (and the phase in `VERL_TRACE_PHASES`, when that is set), traces the
/// CUDA kernels (and with `VERL_TRACE_CPU=1` the aten ops)
/// from now until the returned guard drops, into `$VERL_TRACE_DIR/{name}-{n}.json` (a Chrome
/// trace; `n` counts this name's calls from 0). `None` when unset or on a CPU device. A trace
/// that cannot start or be written is logged and skipped: it never fails the phase.
pub fn trace(name: &str, device: Device) -> Option<Trace> {
    static COUNTS: Mutex<BTreeMap<String, usize>> = Mutex::new(BTreeMap::new());
    let dir = std::env::var_os("VERL_TRACE_DIR").filter(|d| !d.is_empty())?;
    if !matches!(device, Device::Cuda(_)) || !phase_traced(name) {
        return None;
    }
    let n = {
        let mut c = COUNTS.lock().unwrap_or_else(|e| e.into_inner());
        let e = c.entry(name.to_string()).or_insert(0);
        *e += 1;
        *e - 1
    };
    let dir = std::path::PathBuf::from(dir);
    if let Err(e) = std::fs::create_dir_all(&dir) {
        tracing::warn!("VERL_TRACE_DIR {}: {e}; no trace", dir.display());
        return None;
    }
    sync(device);
    let cpu = std::env::var("VERL_TRACE_CPU").as_deref() == Ok("1");
    if let Err(e) = verl_torch_ext::trace_start(cpu) {
        tracing::warn!("trace {name}: {e}");
        return None;
    }
    Some(Trace {
        device,
        // Ranks of a multi-process job share the environment: each names its own files.
        path: dir.join(match std::env::var("RANK") {
            Ok(r) if !r.is_empty() => format!("{name}-rank{r}-{n}.json"),
            _ => format!("{name}-{n}.json"),
        }),
    })
}

impl Drop for Trace {
    fn drop(&mut self) {
        sync(self.device);
        match verl_torch_ext::trace_stop(&self.path) {
            Ok(()) => tracing::info!("trace written to {}", self.path.display()),
            Err(e) => tracing::warn!("trace {}: {e}", self.path.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn laps_accumulate_into_the_report() {
        // The table is process-wide; this test is the only one in the crate that writes to it.
        let mut t = Some(Timer {
            device: Device::Cpu,
            last: Instant::now(),
        });
        lap(&mut t, "a");
        lap(&mut t, "b");
        lap(&mut t, "a");
        let r = take_report().unwrap();
        let a = r.lines().find(|l| l.starts_with("a ")).unwrap();
        let b = r.lines().find(|l| l.starts_with("b ")).unwrap();
        assert!(a.split_whitespace().nth(2) == Some("2"), "{r}");
        assert!(b.split_whitespace().nth(2) == Some("1"), "{r}");
        assert!(take_report().is_none());
        let mut none: Option<Timer> = None;
        lap(&mut none, "c");
        assert!(take_report().is_none());
    }

    #[test]
    fn trace_phases_filter_by_name() {
        assert!(phase_listed(None, "update"));
        assert!(phase_listed(Some(" "), "update"));
        assert!(phase_listed(Some("update, log_prob"), "log_prob"));
        assert!(phase_listed(Some("update"), "update"));
        assert!(!phase_listed(Some("update,log_prob"), "generate"));
        assert!(!phase_listed(Some("updates"), "update"));
    }
}
