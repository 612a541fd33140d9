//! `verl config`: what verl-rs does with every key (`keys`), a job's resolved config (`show`).

use std::process::ExitCode;

use clap::Subcommand;

use super::run::RunArgs;

#[derive(Subcommand)]
pub enum ConfigCmd {
    /// What verl-rs does with every key of verl's config: acts, harmless or refused.
    Keys {
        /// Print the Markdown page (docs/config-keys.md) instead of one line per key.
        #[arg(long)]
        markdown: bool,
    },
    /// Print a job's fully resolved config as YAML: `verl config show [JOB.yaml] [key=value ...]`.
    Show(RunArgs),
}

pub fn run(cmd: &ConfigCmd) -> anyhow::Result<ExitCode> {
    match cmd {
        ConfigCmd::Keys { markdown } => {
            let defaults = verl_config::defaults_tree();
            if *markdown {
                print!("{}", verl_config::surface::markdown(defaults));
            } else {
                for key in verl_config::surface::surface_keys(defaults) {
                    let class = verl_config::surface::rule_for(&key)
                        .map(|r| match r.backend {
                            Some(b) => format!("{} ({b})", r.class.name()),
                            None => r.class.name().to_string(),
                        })
                        .unwrap_or_else(|| "unclassified".into());
                    println!("{key}\t{class}");
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        ConfigCmd::Show(args) => {
            let (cfg, _) = args.load()?;
            for w in &cfg.warnings {
                eprintln!("warning: {w}");
            }
            print!("{}", cfg.to_yaml()?);
            Ok(ExitCode::SUCCESS)
        }
    }
}
