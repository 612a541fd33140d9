//! The `verl` command line: the arguments as clap parses them, and each subcommand handed to its
//! module in `verl_host::commands`. Errors end here: one line on stderr, exit code 1.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};
use tracing_subscriber::EnvFilter;
use verl_host::commands::ab::AbArgs;
use verl_host::commands::bench::BenchCmd;
use verl_host::commands::config::ConfigCmd;
use verl_host::commands::data::DataCmd;
use verl_host::commands::generate::GenerateArgs;
use verl_host::commands::init_model::InitModelArgs;
use verl_host::commands::plugin::PluginCmd;
use verl_host::commands::reward::RewardCmd;
use verl_host::commands::run::RunArgs;
use verl_host::commands::{self as cmd};
use verl_host::LoadError;

#[derive(Parser)]
#[command(
    name = "verl",
    version,
    about = "RL post-training for LLMs (PPO, GRPO, ...): verl's loop in Rust, backends as plugins",
    propagate_version = true
)]
struct Cli {
    /// Load a plugin from this path (repeatable); names are looked up on VERL_PLUGIN_PATH, then
    /// next to the verl binary.
    #[arg(long = "plugin", global = true, value_name = "PATH|NAME")]
    plugins: Vec<String>,
    /// More output (-v debug, -vv trace); also full reports for load errors.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a job: `verl run [JOB.yaml] [key=value ...]` (verl's defaults when no job file is
    /// given; Hydra-style overrides, `+key=v`, `~key`).
    Run(RunArgs),
    /// The config: `verl config keys` (what verl-rs does with every key), `verl config show`.
    #[command(subcommand)]
    Config(ConfigCmd),
    /// Plugin tools.
    #[command(subcommand)]
    Plugin(PluginCmd),
    /// Check the environment: libtorch, CUDA, NCCL, plugins; each problem with its fix.
    Doctor,
    /// Reward tools.
    #[command(subcommand)]
    Reward(RewardCmd),
    /// Generate text with a model through a backend plugin (default: `fsdp`, or `--plugin`).
    Generate(GenerateArgs),
    /// Data preparation.
    #[command(subcommand)]
    Data(DataCmd),
    /// Plot metrics of a run (its metrics JSONL / TensorBoard folder) to PNG or SVG.
    Plot {
        /// A run folder, a metrics `.jsonl` file or a TensorBoard event file.
        run: PathBuf,
        /// Metric names (a trailing `*` matches a prefix, e.g. `val-core/*`); default: the key metrics.
        #[arg(long = "metric", short = 'm')]
        metrics: Vec<String>,
        /// Output file (`.png` or `.svg`); default `<run>/metrics.png`.
        #[arg(long, short = 'o')]
        out: Option<PathBuf>,
    },
    /// Build a tiny HF model folder for the data: a byte-level BPE tokenizer trained on its text, a
    /// ChatML template, a Qwen2 config and random weights.
    InitModel(InitModelArgs),
    /// Supervised fine-tuning with verl's SFT trainer keys: `verl sft JOB.yaml [key=value ...]`.
    Sft {
        job: PathBuf,
        overrides: Vec<String>,
    },
    /// Print a shell completion script: `verl completions bash > /etc/bash_completion.d/verl`.
    Completions { shell: clap_complete::Shell },
    /// Benchmarks: `verl bench grpo --arch qwen2.5-0.5b --ignore-eos --json`.
    #[command(subcommand)]
    Bench(BenchCmd),
    /// Internal: serve a reward plugin's score calls over stdin/stdout (`plugins.reward.isolate`).
    #[command(name = "__reward-worker", hide = true)]
    RewardWorker { plugin: String },
    /// The same job on two backends or with two settings, one after the other, compared in
    /// `DIR/report.html`: `verl ab JOB.yaml --a fsdp --b megatron --steps 3`.
    Ab(AbArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing(cli.verbose);
    match dispatch(&cli) {
        Ok(code) => code,
        Err(e) => {
            let mut line = format!("{e:#}");
            if cli.verbose > 0 {
                if let Some(detail) = e.downcast_ref::<LoadError>().and_then(LoadError::detail) {
                    line.push_str("\n\n");
                    line.push_str(detail);
                }
            }
            eprintln!("error: {line}");
            ExitCode::FAILURE
        }
    }
}

fn init_tracing(verbose: u8) {
    let default = match verbose {
        0 => "info",
        1 => "debug",
        _ => "trace",
    };
    let filter = EnvFilter::try_from_env("VERL_LOG")
        .or_else(|_| EnvFilter::try_new(default))
        .expect("valid filter");
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .try_init();
}

fn dispatch(cli: &Cli) -> anyhow::Result<ExitCode> {
    let plugins = &cli.plugins;
    match &cli.command {
        Command::Run(args) => cmd::run::run(plugins, cli.verbose, args),
        Command::Config(c) => cmd::config::run(c),
        Command::Plugin(c) => cmd::plugin::run(c),
        Command::Doctor => Ok(cmd::doctor::run()),
        Command::Reward(c) => cmd::reward::run(plugins, c),
        Command::Generate(args) => cmd::generate::run(plugins, args),
        Command::Data(c) => cmd::data::run(c),
        Command::Plot { run, metrics, out } => cmd::plot::run(run, metrics, out.as_ref()),
        Command::InitModel(args) => cmd::init_model::run(args),
        Command::Sft { job, overrides } => cmd::sft::run(plugins, job, overrides),
        Command::Completions { shell } => Ok(cmd::completions::run(*shell, Cli::command())),
        Command::Bench(c) => cmd::bench::run(plugins, c),
        Command::RewardWorker { plugin } => cmd::reward::worker(plugin),
        Command::Ab(args) => cmd::ab::run(plugins, args),
    }
}
