//! One module per `verl` subcommand: its arguments (as clap parses them) and what it does. The
//! binary's `main.rs` only parses the command line and calls the command's `run`.

pub mod ab;
pub mod bench;
pub mod completions;
pub mod config;
pub mod data;
pub mod doctor;
pub mod generate;
pub mod init_model;
pub mod plot;
pub mod plugin;
pub mod reward;
pub mod run;
pub mod sft;

/// The one plugin a command runs on: the `--plugin` given, else `default`; several are refused
/// with `too_many`.
fn single_plugin(plugins: &[String], default: &str, too_many: &str) -> anyhow::Result<String> {
    match plugins {
        [] => Ok(default.to_string()),
        [one] => Ok(one.clone()),
        _ => anyhow::bail!("{too_many}"),
    }
}
