//! `verl doctor`: a structured ✓/✗/! report of what a run needs, each ✗ with the command that fixes it.

use std::path::PathBuf;
use std::process::ExitCode;

use crate::loader::Loader;
use crate::torchlib;

/// One line of the report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Status {
    Ok,
    Warn,
    Fail,
}

#[derive(Debug, Clone)]
pub struct Check {
    pub status: Status,
    pub what: String,
    pub detail: String,
    /// The exact command (or action) that fixes a ✗ / !.
    pub fix: Option<String>,
}

impl Check {
    fn new(status: Status, what: &str, detail: impl Into<String>, fix: Option<String>) -> Self {
        Check {
            status,
            what: what.into(),
            detail: detail.into(),
            fix,
        }
    }
}

/// Run every check.
pub fn checks(loader: &Loader) -> Vec<Check> {
    let mut out = Vec::new();
    let torch = torchlib::find();
    match &torch {
        Ok(t) => {
            let v = t.version.clone().unwrap_or_else(|| "unknown version".into());
            let expected = "2.11.0";
            if t.base_version().is_some_and(|b| b != expected) {
                out.push(Check::new(
                    Status::Fail,
                    "libtorch",
                    format!("{v} at {} (found by {}), but the torch plugins are built for {expected}", t.lib_dir.display(), t.found_by),
                    Some(format!("pip install torch=={expected}  # or: bash scripts/setup.sh")),
                ));
            } else {
                out.push(Check::new(
                    Status::Ok,
                    "libtorch",
                    format!("{v} at {} (found by {})", t.lib_dir.display(), t.found_by),
                    None,
                ));
            }
        }
        Err(tried) => out.push(Check::new(
            Status::Fail,
            "libtorch",
            format!("not found ({tried})"),
            Some("bash scripts/setup.sh && source scripts/env.sh   # or: export LIBTORCH=/path/to/libtorch".into()),
        )),
    }
    out.push(cuda_check());
    out.push(nccl_check(torch.as_ref().ok()));
    let files = loader.discover();
    if files.is_empty() {
        out.push(Check::new(
            Status::Warn,
            "plugins",
            format!(
                "no plugin libraries on the plugin path ({})",
                dirs(loader.search_path())
            ),
            Some("make build   # builds the plugins next to the verl binary; or set VERL_PLUGIN_PATH".into()),
        ));
    }
    for f in files {
        let spec = f.display().to_string();
        match loader.inspect(&spec) {
            Ok(i) => {
                let roles: Vec<String> = i
                    .header
                    .capabilities
                    .iter()
                    .map(|c| {
                        if c.implemented {
                            c.role.to_string()
                        } else {
                            format!("{} (not implemented)", c.role)
                        }
                    })
                    .collect();
                let serves = if i.header.tools.is_empty() {
                    roles.join(", ")
                } else {
                    i.header.tools.join(", ")
                };
                let detail = format!(
                    "{} {} ({} plugin: {}) at {}",
                    i.header.name,
                    i.header.version,
                    i.header.kind,
                    serves,
                    i.path.display()
                );
                match i.compatible {
                    Ok(()) => out.push(Check::new(Status::Ok, "plugin", detail, None)),
                    Err(why) => out.push(Check::new(
                        Status::Fail,
                        "plugin",
                        format!("{detail}: {why}"),
                        Some(format!(
                            "rebuild {} against this verl (make build)",
                            i.header.name
                        )),
                    )),
                }
            }
            Err(crate::loader::LoadError::NotAPlugin { .. }) => {}
            Err(e) => out.push(Check::new(
                Status::Fail,
                "plugin",
                e.to_string(),
                Some("make build   # or remove the file from the plugin path".into()),
            )),
        }
    }
    out
}

fn dirs(d: &[PathBuf]) -> String {
    d.iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(":")
}

fn cuda_check() -> Check {
    // SAFETY: libcuda's entry points are plain C; we call cuInit and cuDeviceGetCount only.
    let lib = unsafe { libloading::Library::new("libcuda.so.1") };
    let Ok(lib) = lib else {
        return Check::new(
            Status::Warn,
            "CUDA",
            "no CUDA driver (libcuda.so.1): CPU only (set trainer.device=cpu)",
            Some("install the NVIDIA driver to use GPUs".into()),
        );
    };
    type InitFn = unsafe extern "C" fn(u32) -> i32;
    type CountFn = unsafe extern "C" fn(*mut i32) -> i32;
    let res = unsafe {
        let init: Result<libloading::Symbol<InitFn>, _> = lib.get(b"cuInit");
        let count: Result<libloading::Symbol<CountFn>, _> = lib.get(b"cuDeviceGetCount");
        match (init, count) {
            (Ok(init), Ok(count)) => {
                let rc = init(0);
                if rc != 0 {
                    Err(format!("cuInit failed with CUresult {rc}"))
                } else {
                    let mut n = 0i32;
                    let rc = count(&mut n);
                    if rc != 0 {
                        Err(format!("cuDeviceGetCount failed with CUresult {rc}"))
                    } else {
                        Ok(n)
                    }
                }
            }
            _ => Err("libcuda.so.1 lacks cuInit/cuDeviceGetCount".into()),
        }
    };
    std::mem::forget(lib);
    match res {
        Ok(n) if n > 0 => Check::new(
            Status::Ok,
            "CUDA",
            format!("driver loaded, {n} GPU(s)"),
            None,
        ),
        Ok(_) => Check::new(
            Status::Warn,
            "CUDA",
            "driver loaded but no GPU visible: CPU only",
            Some("check CUDA_VISIBLE_DEVICES and nvidia-smi".into()),
        ),
        Err(e) => Check::new(
            Status::Warn,
            "CUDA",
            format!("driver present but unusable: {e}"),
            Some("nvidia-smi   # check the driver".into()),
        ),
    }
}

fn nccl_check(torch: Option<&torchlib::TorchLib>) -> Check {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(t) = torch {
        if let Some(site) = t.lib_dir.parent().and_then(|p| p.parent()) {
            candidates.push(site.join("nvidia/nccl/lib/libnccl.so.2"));
        }
    }
    candidates.push(PathBuf::from("libnccl.so.2"));
    candidates.push(PathBuf::from("libnccl.so"));
    for c in &candidates {
        // SAFETY: NCCL's ncclGetVersion(int*) is a plain C call with no side effects.
        let Ok(lib) = (unsafe { libloading::Library::new(c) }) else {
            continue;
        };
        let version = unsafe {
            lib.get::<unsafe extern "C" fn(*mut i32) -> i32>(b"ncclGetVersion")
                .ok()
                .and_then(|f| {
                    let mut v = 0i32;
                    (f(&mut v) == 0).then_some(v)
                })
        };
        std::mem::forget(lib);
        let v = version
            .map(|v| format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100))
            .unwrap_or_else(|| "unknown version".into());
        return Check::new(Status::Ok, "NCCL", format!("{v} ({})", c.display()), None);
    }
    Check::new(
        Status::Warn,
        "NCCL",
        "libnccl not found: multi-GPU runs unavailable (CPU ranks still work)",
        Some("pip install nvidia-nccl-cu13   # or install libnccl2".into()),
    )
}

fn mark(s: &Status) -> &'static str {
    match s {
        Status::Ok => "✓",
        Status::Warn => "!",
        Status::Fail => "✗",
    }
}

/// `verl doctor`: every check, each problem with its fix; fails when one fails.
pub fn run() -> ExitCode {
    let loader = Loader::new(&[]);
    let checks = checks(&loader);
    let mut failed = false;
    for c in &checks {
        println!("{} {:<9} {}", mark(&c.status), c.what, c.detail);
        if let Some(fix) = &c.fix {
            if c.status != Status::Ok {
                println!("  fix: {fix}");
            }
        }
        failed |= c.status == Status::Fail;
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
