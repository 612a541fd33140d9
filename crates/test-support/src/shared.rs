//! The shared reference data beside the checkout (`../shared`: verl's golden outputs, chat
//! templates, GSM8K): where the tests look for it, and what they do when it is absent.
//!
//! A checkout without it must still build and test, so by default a test that needs it prints
//! `SKIP: …` and passes. CI sets `VERL_REQUIRE_SHARED=1` (`.ci/run`): there a missing file is a
//! failure naming the path looked for, never a silent pass.
//!
//! Standard library only: the host crates' tests include this file by `#[path]` (they take no
//! dev-dependency on this crate), so it must not use anything else.

use std::path::{Path, PathBuf};

/// Set to `1` (anything but empty or `0`), absent shared data fails the test instead of skipping.
pub const REQUIRE_SHARED_ENV: &str = "VERL_REQUIRE_SHARED";
/// Where the shared data is, when not at `<workspace root>/../shared`.
pub const SHARED_DIR_ENV: &str = "VERL_SHARED_DIR";

/// The workspace root: the nearest ancestor of the crate being built whose Cargo.toml declares
/// `[workspace]`. The manifest dir is canonicalised first so a symlinked checkout still finds the
/// real tree (and the `shared` folder beside it).
pub fn workspace_root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let here = std::fs::canonicalize(&manifest).unwrap_or(manifest);
    here.ancestors()
        .find(|dir| {
            std::fs::read_to_string(dir.join("Cargo.toml"))
                .is_ok_and(|toml| toml.lines().any(|l| l.trim() == "[workspace]"))
        })
        .map(Path::to_path_buf)
        .unwrap_or(here)
}

/// Where the shared data is looked for: `$VERL_SHARED_DIR`, else `<workspace root>/../shared`.
pub fn shared_dir_path() -> PathBuf {
    match std::env::var_os(SHARED_DIR_ENV) {
        Some(dir) => PathBuf::from(dir),
        None => workspace_root().join("../shared"),
    }
}

/// Whether absent shared data is a failure (`VERL_REQUIRE_SHARED` set, and not to `0`).
pub fn shared_required() -> bool {
    std::env::var_os(REQUIRE_SHARED_ENV).is_some_and(|v| !v.is_empty() && v != "0")
}

/// `rel` (a file or a folder) under the shared data, when it exists. When it does not: `None`
/// after printing `SKIP: …` for the test to return; with `VERL_REQUIRE_SHARED=1`, a panic that
/// names the path looked for and `VERL_SHARED_DIR`.
pub fn shared_path(rel: &str) -> Option<PathBuf> {
    let dir = shared_dir_path();
    let path = if rel.is_empty() {
        dir.clone()
    } else {
        dir.join(rel)
    };
    if path.exists() {
        return Some(path);
    }
    let source = match std::env::var_os(SHARED_DIR_ENV) {
        Some(d) => format!("{SHARED_DIR_ENV}={}", Path::new(&d).display()),
        None => format!("{SHARED_DIR_ENV} unset, so <workspace>/../shared"),
    };
    if shared_required() {
        panic!(
            "shared reference data missing: {} not found ({source}); {REQUIRE_SHARED_ENV}=1 makes \
             this a failure: put the shared folder beside the checkout or point {SHARED_DIR_ENV} \
             at it",
            path.display()
        );
    }
    eprintln!(
        "SKIP: shared reference data not found: {} ({source}; set {SHARED_DIR_ENV}, and \
         {REQUIRE_SHARED_ENV}=1 to fail instead)",
        path.display()
    );
    None
}

/// The shared data folder itself ([`shared_path`] of `""`).
pub fn shared_dir() -> Option<PathBuf> {
    shared_path("")
}
