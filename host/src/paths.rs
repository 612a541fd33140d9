//! Paths as verl jobs write them.

use std::path::PathBuf;

/// `~/...` under `$HOME`, as verl's defaults and users' jobs write data and model paths (Hydra
/// leaves the tilde to the code that opens the file). Other paths as given.
pub fn expand_home(path: &str) -> PathBuf {
    match (path.strip_prefix("~/"), std::env::var_os("HOME")) {
        (Some(rest), Some(home)) => PathBuf::from(home).join(rest),
        _ => PathBuf::from(path),
    }
}
