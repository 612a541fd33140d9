//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use tch::{Kind, Tensor};

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The Python that has torch + transformers: `$VERL_PYTHON`, else `<workspace>/.venv/bin/python`.
/// `None` (after printing why) when it is absent or lacks transformers.
pub fn python() -> Option<PathBuf> {
    let py = std::env::var_os("VERL_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join(".venv/bin/python"));
    if !py.exists() {
        eprintln!(
            "SKIP: {} not found (run scripts/setup.sh or set VERL_PYTHON); HF parity not checked",
            py.display()
        );
        return None;
    }
    let ok = Command::new(&py)
        .args(["-c", "import transformers, safetensors, torch"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok {
        eprintln!(
            "SKIP: {} cannot import transformers/safetensors/torch; HF parity not checked",
            py.display()
        );
        return None;
    }
    Some(py)
}

pub fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/hf_reference.py")
}

/// Runs the helper script; panics with its output on failure.
pub fn run_script(py: &Path, args: &[&str]) -> String {
    let out = Command::new(py)
        .arg(script())
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", py.display()));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "hf_reference.py {args:?} failed ({}):\n{text}",
        out.status
    );
    text
}

pub fn read_safetensors(path: &Path) -> std::collections::HashMap<String, Tensor> {
    Tensor::read_safetensors(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .into_iter()
        .collect()
}

pub fn max_abs(a: &Tensor, b: &Tensor) -> f64 {
    let d = a.to_kind(Kind::Double) - b.to_kind(Kind::Double);
    d.abs().max().double_value(&[])
}

/// Max abs difference over positions where `mask` (`[B, T]`) is nonzero; `a`, `b` are `[B, T, ...]`.
pub fn masked_max_abs(a: &Tensor, b: &Tensor, mask: &Tensor) -> f64 {
    let keep = mask.ne(0);
    let a = a.to_kind(Kind::Double).index(&[Some(keep.shallow_clone())]);
    let b = b.to_kind(Kind::Double).index(&[Some(keep)]);
    max_abs(&a, &b)
}
