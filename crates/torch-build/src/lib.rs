//! Build-script helper shared by the crates that link libtorch (call from `build.rs`).
//! It owns two facts: rustc's `--as-needed` must not drop `libtorch_cuda` (or CUDA silently
//! disappears), and the plugin header needs the libtorch version and device it was built for.

use std::path::PathBuf;
use std::process::Command;

/// Emit the link arguments and `VERL_LIBTORCH_VERSION` / `VERL_LIBTORCH_DEVICE` env vars.
pub fn configure() {
    let (version, lib_dir) = locate();
    let has_cuda = lib_dir
        .as_ref()
        .is_some_and(|d| d.join("libtorch_cuda.so").exists());
    if has_cuda {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
    }
    println!(
        "cargo:rustc-env=VERL_LIBTORCH_VERSION={}",
        version.unwrap_or_else(|| "unknown".into())
    );
    println!(
        "cargo:rustc-env=VERL_LIBTORCH_DEVICE={}",
        if has_cuda { "cuda" } else { "cpu" }
    );
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=LIBTORCH_USE_PYTORCH");
}

fn locate() -> (Option<String>, Option<PathBuf>) {
    if let Ok(root) = std::env::var("LIBTORCH") {
        let root = PathBuf::from(root);
        let v = std::fs::read_to_string(root.join("build-version"))
            .ok()
            .map(|s| s.trim().to_string());
        return (v, Some(root.join("lib")));
    }
    let python = std::env::var("PYTHON_SYS_EXECUTABLE").unwrap_or_else(|_| "python3".into());
    let out = Command::new(python)
        .args([
            "-c",
            "import torch,os;print(torch.__version__);print(os.path.join(os.path.dirname(torch.__file__),'lib'))",
        ])
        .output();
    match out {
        Ok(o) if o.status.success() => {
            let s = String::from_utf8_lossy(&o.stdout).to_string();
            let mut lines = s.lines();
            let v = lines.next().map(|l| l.trim().to_string());
            let d = lines.next().map(|l| PathBuf::from(l.trim()));
            (v, d)
        }
        _ => (None, None),
    }
}
