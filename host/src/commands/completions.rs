//! `verl completions SHELL`: the shell completion script of the whole command line.

use std::process::ExitCode;

/// Prints the completion script of `cli` (the `verl` command) for `shell`.
pub fn run(shell: clap_complete::Shell, mut cli: clap::Command) -> ExitCode {
    clap_complete::generate(shell, &mut cli, "verl", &mut std::io::stdout());
    ExitCode::SUCCESS
}
