//! Opt-in phase timing for finding where GPU time goes (`VERL_PROFILE=1`).
//!
//! A [`Timer`] synchronises the device at every lap, so each phase's time is its own device work
//! plus the host work between laps; the synchronisations cost speed, so this is off unless the
//! environment asks for it, and then every call is a no-op returning `None`. Phases accumulate in
//! one process-wide table (per shared library: each plugin keeps its own) that
//! [`take_report`] prints and clears.

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
}
