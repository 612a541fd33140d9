//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// The workspace root: the nearest ancestor of this crate whose Cargo.toml declares
/// `[workspace]`. The manifest dir is canonicalised first so a symlinked checkout still finds
/// the real tree (and the `shared` folder beside it).
pub fn workspace_root() -> PathBuf {
    let here = std::fs::canonicalize(env!("CARGO_MANIFEST_DIR"))
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    for dir in here.ancestors() {
        let manifest = dir.join("Cargo.toml");
        if let Ok(text) = std::fs::read_to_string(&manifest) {
            if text.lines().any(|l| l.trim() == "[workspace]") && dir != here {
                return dir.to_path_buf();
            }
        }
    }
    here.join("../..")
}

/// The shared reference data, one helper for every crate's tests (std only, included by path):
/// skipped when absent, a failure under `VERL_REQUIRE_SHARED=1` (CI).
#[path = "../../../../crates/test-support/src/shared.rs"]
mod shared;

/// `rel` under `$VERL_SHARED_DIR`, else `<workspace root>/../shared`; `None` (after printing
/// why) when it does not exist, so tests can skip, or a panic under `VERL_REQUIRE_SHARED=1`.
pub fn shared_file(rel: &str) -> Option<PathBuf> {
    shared::shared_path(rel)
}

/// A readable report of where two strings first differ.
pub fn first_difference(want: &str, got: &str) -> String {
    let common = want
        .char_indices()
        .zip(got.chars())
        .find(|((_, a), b)| a != b)
        .map(|((i, _), _)| i)
        .unwrap_or_else(|| want.len().min(got.len()));
    let ctx_start = floor_char_boundary(want, common.saturating_sub(60));
    let show = |s: &str| {
        let start = floor_char_boundary(s, ctx_start.min(s.len()));
        let end = floor_char_boundary(s, (common + 60).min(s.len()));
        format!("{:?}", &s[start..end])
    };
    format!(
        "first difference at byte {common} (want {} bytes, got {} bytes)\n  want: …{}…\n  got:  …{}…",
        want.len(),
        got.len(),
        show(want),
        show(got)
    )
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

pub fn write(dir: &Path, name: &str, text: &str) {
    std::fs::write(dir.join(name), text).unwrap();
}
