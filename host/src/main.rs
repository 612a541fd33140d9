//! The `verl` command line. Errors end here: one line on stderr, exit code 1.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{CommandFactory, Parser, Subcommand};
use tracing_subscriber::EnvFilter;
use verl_config::{validate_batches, Config, Layout};
use verl_host::doctor::{self, Status};
use verl_host::launch::{self, EnvSource, LaunchMode};
use verl_host::{LoadError, LoadedPlugin, Loader};
use verl_plugin_api::{PluginKind, Role};

mod bench_cmd;
mod init_model;
mod sft_cmd;

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
    Bench(bench_cmd::BenchCmd),
    /// Internal: serve a reward plugin's score calls over stdin/stdout (`plugins.reward.isolate`).
    #[command(name = "__reward-worker", hide = true)]
    RewardWorker { plugin: String },
    /// The same job on two backends or with two settings, one after the other, compared in
    /// `DIR/report.html`: `verl ab JOB.yaml --a fsdp --b megatron --steps 3`.
    Ab(AbArgs),
}

#[derive(clap::Args)]
struct AbArgs {
    /// A job file and/or overrides common to both arms (as `verl run` takes them).
    #[arg(value_name = "[JOB.yaml] [KEY=VALUE]")]
    args: Vec<String>,
    /// Arm a: `fsdp`, `megatron`, a backend plugin (path or name) and/or overrides, space-separated.
    #[arg(long)]
    a: String,
    /// Arm b, as --a.
    #[arg(long)]
    b: String,
    /// Training steps of each arm.
    #[arg(long, default_value_t = 3)]
    steps: u64,
    /// Where the arms run and the report goes.
    #[arg(long, default_value = "runs/ab")]
    out: PathBuf,
    /// Relative tolerance of the verdicts (default: 1e-5 when both arms compute in fp32, 5e-2
    /// otherwise).
    #[arg(long)]
    rtol: Option<f64>,
}

#[derive(clap::Args)]
struct RunArgs {
    /// A job file (verl YAML) and/or overrides like `actor_rollout_ref.actor.optim.lr=1e-6`,
    /// `trainer.logger=[console]`, as `python3 -m verl.trainer.main_ppo` takes them.
    #[arg(value_name = "[JOB.yaml] [KEY=VALUE]")]
    args: Vec<String>,
    /// Hydra's `--config-name`: `ppo_trainer` (default), `ppo_megatron_trainer` (the Megatron
    /// engine), or the name of a job YAML in `--config-path`.
    #[arg(long, value_name = "NAME")]
    config_name: Option<String>,
    /// Hydra's `--config-path`: the folder of `--config-name`'s YAML.
    #[arg(long, value_name = "DIR")]
    config_path: Option<PathBuf>,
    /// Check everything a run needs (config, plugins, batch arithmetic and parallel layout, data
    /// files, model folder, loggers) and train nothing. Checks that need the job's GPUs are
    /// listed as not made when this machine lacks them.
    #[arg(long)]
    dry_run: bool,
}

impl RunArgs {
    /// The job file and the overrides, however the job was given.
    fn job(&self) -> anyhow::Result<(Option<PathBuf>, Vec<String>)> {
        let is_override = |a: &str| {
            a.contains('=') || a.starts_with('+') || (a.starts_with('~') && !a.starts_with("~/"))
        };
        let (mut job, rest) = match self.args.split_first() {
            Some((first, rest)) if !is_override(first) => (Some(PathBuf::from(first)), rest),
            _ => (None, &self.args[..]),
        };
        if let Some(bad) = rest.iter().find(|a| !is_override(a)) {
            bail!("`{bad}` is neither a job file (it must come first) nor an override `key=value`");
        }
        let mut overrides = Vec::new();
        match self.config_name.as_deref() {
            None => {}
            Some(name) => match verl_config::engine_of_config_name(name) {
                // verl's own trainer configs: their engine, as the first (weakest) override.
                Some(engine) => overrides.push(format!("model_engine={engine}")),
                None => {
                    let dir = self
                        .config_path
                        .clone()
                        .unwrap_or_else(|| PathBuf::from("."));
                    let file = [name.to_string(), format!("{name}.yaml")]
                        .into_iter()
                        .map(|n| dir.join(n))
                        .find(|p| p.is_file())
                        .with_context(|| {
                            format!(
                                "--config-name {name}: no {name}.yaml in {} (verl's own configs are ppo_trainer and ppo_megatron_trainer)",
                                dir.display()
                            )
                        })?;
                    if let Some(j) = &job {
                        bail!(
                            "the job is given twice: {} and --config-name {name} ({})",
                            j.display(),
                            file.display()
                        );
                    }
                    job = Some(file);
                }
            },
        }
        overrides.extend(rest.iter().cloned());
        Ok((job, overrides))
    }

    fn load(&self) -> anyhow::Result<(Config, String)> {
        let (job, overrides) = self.job()?;
        let n = overrides.len();
        Ok(match job {
            Some(path) => (
                Config::load(&path, &overrides)?,
                format!("{} ({n} override(s))", path.display()),
            ),
            None => (
                Config::from_overrides(&overrides)?,
                format!("verl's defaults ({n} override(s))"),
            ),
        })
    }
}

#[derive(Subcommand)]
enum ConfigCmd {
    /// What verl-rs does with every key of verl's config: acts, harmless or refused.
    Keys {
        /// Print the Markdown page (docs/config-keys.md) instead of one line per key.
        #[arg(long)]
        markdown: bool,
    },
    /// Print a job's fully resolved config as YAML: `verl config show [JOB.yaml] [key=value ...]`.
    Show(RunArgs),
}

#[derive(Subcommand)]
enum PluginCmd {
    /// Print a plugin's header (name, version, kind, roles, build) and check it can be loaded.
    Inspect { plugin: String },
    /// List the plugins on the plugin path.
    List,
    /// Start a plugin crate: `verl plugin new reward NAME [--dir DIR] [--api-path PLUGIN_API]`
    /// writes the skeleton of `examples/reward-plugin` (a row scorer and its unit test).
    New {
        /// What kind of plugin: `reward`.
        kind: String,
        name: String,
        /// Where the crate folder is created.
        #[arg(long, default_value = ".")]
        dir: PathBuf,
        /// The verl-rs checkout's `plugin-api` folder to depend on.
        #[arg(long)]
        api_path: Option<PathBuf>,
    },
}

#[derive(clap::Args)]
struct GenerateArgs {
    /// An HF model folder (config.json, safetensors, tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    /// A prompt (repeatable).
    #[arg(long, conflicts_with = "prompts")]
    prompt: Vec<String>,
    /// A JSONL file of prompts (strings, or objects with `prompt`/`text`).
    #[arg(long)]
    prompts: Option<PathBuf>,
    /// Apply the model's chat template (each prompt as one user message).
    #[arg(long)]
    chat: bool,
    #[arg(long, default_value_t = 64)]
    max_new_tokens: u32,
    /// Samples per prompt.
    #[arg(long, default_value_t = 1)]
    n: u32,
    #[arg(long, default_value_t = 1.0)]
    temperature: f64,
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    #[arg(long, default_value_t = -1)]
    top_k: i64,
    /// Greedy decoding (no sampling).
    #[arg(long)]
    greedy: bool,
    #[arg(long)]
    seed: Option<u64>,
    /// Print the log-prob of each generated token.
    #[arg(long)]
    logprobs: bool,
    /// Print one JSON object per response instead of text.
    #[arg(long)]
    json: bool,
    /// `cpu` or `cuda`.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Extra verl config overrides for the backend, e.g. `actor_rollout_ref.model.dtype=bfloat16`.
    #[arg(long = "set")]
    overrides: Vec<String>,
}

#[derive(Subcommand)]
enum DataCmd {
    /// Turn GSM8K's raw `train.jsonl`/`test.jsonl` into verl-format parquet (the rows verl's
    /// `examples/data_preprocess/gsm8k.py` writes).
    Gsm8k { raw_dir: PathBuf, out_dir: PathBuf },
    /// Turn a raw copy of DigitalLearningGmbH/MATH-lighteval (`data/{train,test}-*.parquet`, as
    /// `huggingface-cli download` leaves it, or `train.jsonl`/`test.jsonl`) into the verl-format
    /// parquet and `*_example.json` that verl's `examples/data_preprocess/math_dataset.py` writes.
    Math { raw_dir: PathBuf, out_dir: PathBuf },
    /// Generate seeded arithmetic word problems as verl GSM8K-format parquet (train.parquet,
    /// val.parquet; data_source openai/gsm8k) plus SFT pairs (sft_train/sft_val.parquet).
    Arith {
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 2000)]
        train: usize,
        #[arg(long, default_value_t = 128)]
        val: usize,
        #[arg(long, default_value_t = 7)]
        seed: u64,
        /// Fewest operations per problem.
        #[arg(long, default_value_t = 1)]
        min_ops: usize,
        /// Most operations per problem.
        #[arg(long, default_value_t = 2)]
        max_ops: usize,
        /// Operands are drawn from 1..=max_operand.
        #[arg(long, default_value_t = 9)]
        max_operand: u32,
        /// A deliberately noisy SFT teacher: this fraction of the SFT training answers ends in a
        /// final `#### N` one too high (RL/validation ground truth always correct).
        #[arg(long, default_value_t = 0.0)]
        sft_noise: f64,
    },
}

#[derive(clap::Args)]
struct InitModelArgs {
    /// The HF folder to write.
    #[arg(long)]
    out: PathBuf,
    /// Data files whose text trains the tokenizer (repeatable).
    #[arg(long, required = true)]
    data: Vec<PathBuf>,
    #[arg(long, default_value_t = 512)]
    vocab: usize,
    #[arg(long, default_value_t = 128)]
    hidden: usize,
    #[arg(long, default_value_t = 256)]
    intermediate: usize,
    #[arg(long, default_value_t = 2)]
    layers: usize,
    #[arg(long, default_value_t = 4)]
    heads: usize,
    #[arg(long, default_value_t = 2)]
    kv_heads: usize,
    #[arg(long, default_value_t = 256)]
    max_positions: usize,
    #[arg(long, default_value_t = 0.02)]
    init_std: f64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

#[derive(Subcommand)]
enum RewardCmd {
    /// Score a JSONL file (`data_source`, `solution_str`, `ground_truth`[, `extra_info`]) and
    /// print accuracy per data_source. The reward plugin is `--plugin` (default: `rewards`).
    ///
    /// With `--model RM_DIR`: score `{prompt, response}` rows with a reward model
    /// (`*ForSequenceClassification`, `Qwen2ForRewardModel`) held by a backend plugin (`--plugin`,
    /// default `fsdp`); `prompt` is a string or a chat list of {role, content}.
    Score {
        input: PathBuf,
        #[arg(long)]
        out: Option<PathBuf>,
        /// Reward kwargs as JSON, e.g. '{"method": "flexible"}'.
        #[arg(long, default_value = "null")]
        kwargs: String,
        #[arg(long, default_value_t = 256)]
        batch_size: usize,
        /// A reward model's HF folder: score each row with it.
        #[arg(long)]
        model: Option<PathBuf>,
        /// With --model: render prompt + response as a chat with the model's own template.
        #[arg(long, requires = "model")]
        chat: bool,
        /// With --model: print one JSON object per row (`{"row", "score"}`).
        #[arg(long, requires = "model")]
        json: bool,
        /// With --model: `cpu` or `cuda`.
        #[arg(long, default_value = "cpu", requires = "model")]
        device: String,
        /// With --model: bfloat16, float32 or float16.
        #[arg(long, default_value = "float32", requires = "model")]
        dtype: String,
        /// With --model: cut each input to this many tokens (from the right).
        #[arg(long, requires = "model")]
        max_length: Option<usize>,
    },
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
    match &cli.command {
        Command::Run(args) => run(cli, args),
        Command::Config(ConfigCmd::Keys { markdown }) => {
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
        Command::Config(ConfigCmd::Show(args)) => {
            let (cfg, _) = args.load()?;
            for w in &cfg.warnings {
                eprintln!("warning: {w}");
            }
            print!("{}", cfg.to_yaml()?);
            Ok(ExitCode::SUCCESS)
        }
        Command::Plugin(PluginCmd::Inspect { plugin }) => inspect(plugin),
        Command::Plugin(PluginCmd::List) => list(),
        Command::Plugin(PluginCmd::New {
            kind,
            name,
            dir,
            api_path,
        }) => {
            if kind != "reward" {
                bail!("`verl plugin new {kind}`: the skeleton is for reward plugins (`verl plugin new reward NAME`); a backend starts from plugins/fsdp");
            }
            let krate = verl_host::plugin_new::new_reward(name, dir, api_path.as_deref())?;
            println!(
                "{} (cargo test; cargo build --release; verl --plugin target/release/lib{}.so run job.yaml plugins.reward.default={name})",
                krate.display(),
                name.replace('-', "_")
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Doctor => Ok(doctor_cmd()),
        Command::Reward(RewardCmd::Score {
            input,
            out,
            kwargs,
            batch_size,
            model: Some(model),
            chat,
            json,
            device,
            dtype,
            max_length,
        }) => {
            if out.is_some() || kwargs != "null" {
                bail!("--out and --kwargs belong to reward plugins; with --model the scores are printed (--json for one object per row)");
            }
            let req = verl_host::reward_cmd::ModelScoreRequest {
                model: model.clone(),
                chat: *chat,
                device: device.clone(),
                dtype: dtype.clone(),
                max_length: *max_length,
                batch_size: *batch_size,
            };
            reward_score_model(cli, input, &req, *json)
        }
        Command::Reward(RewardCmd::Score {
            input,
            out,
            kwargs,
            batch_size,
            ..
        }) => reward_score(cli, input, out.as_deref(), kwargs, *batch_size),
        Command::Generate(args) => generate(cli, args),
        Command::Data(DataCmd::Gsm8k { raw_dir, out_dir }) => {
            let out = verl_data::gsm8k_preprocess(raw_dir, out_dir)?;
            println!("{} ({} rows)", out.train.display(), out.train_rows);
            println!("{} ({} rows)", out.test.display(), out.test_rows);
            Ok(ExitCode::SUCCESS)
        }
        Command::Data(DataCmd::Math { raw_dir, out_dir }) => {
            let out = verl_data::math_preprocess(raw_dir, out_dir)?;
            println!("{} ({} rows)", out.train.display(), out.train_rows);
            println!("{} ({} rows)", out.test.display(), out.test_rows);
            Ok(ExitCode::SUCCESS)
        }
        Command::Data(DataCmd::Arith {
            out,
            train,
            val,
            seed,
            min_ops,
            max_ops,
            max_operand,
            sft_noise,
        }) => {
            let cfg = verl_data::ArithConfig {
                train: *train,
                val: *val,
                seed: *seed,
                min_ops: *min_ops,
                max_ops: *max_ops,
                max_operand: *max_operand,
                sft_noise: *sft_noise,
            };
            let o = verl_data::arith_write(out, &cfg)?;
            println!("{} ({} rows)", o.train.display(), o.train_rows);
            println!("{} ({} rows)", o.val.display(), o.val_rows);
            println!("{} ({} rows)", o.sft_train.display(), o.train_rows);
            println!("{} ({} rows)", o.sft_val.display(), o.val_rows);
            Ok(ExitCode::SUCCESS)
        }
        Command::InitModel(a) => {
            let spec = init_model::ModelSpec {
                vocab: a.vocab,
                hidden: a.hidden,
                intermediate: a.intermediate,
                layers: a.layers,
                heads: a.heads,
                kv_heads: a.kv_heads,
                max_positions: a.max_positions,
                init_std: a.init_std,
                seed: a.seed,
            };
            let o = init_model::init_model(&a.out, &a.data, &spec)?;
            println!(
                "{} (vocab {}, {} parameters)",
                o.dir.display(),
                o.vocab,
                o.parameters
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Sft { job, overrides } => sft(cli, job, overrides),
        Command::Plot { run, metrics, out } => {
            let out = out.clone().unwrap_or_else(|| {
                if run.is_dir() {
                    run.join("metrics.png")
                } else {
                    run.with_extension("png")
                }
            });
            let names: Vec<&str> = metrics.iter().map(String::as_str).collect();
            let plotted = verl_metrics::plot_run(run, &names, &out)?;
            println!(
                "{} ({} metric(s): {})",
                out.display(),
                plotted.len(),
                plotted.join(", ")
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Ab(a) => ab(cli, a),
        Command::RewardWorker { plugin } => {
            verl_host::isolated_reward::serve(plugin)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench(bench_cmd::BenchCmd::Grpo(a)) => {
            bench_cmd::run(&cli.plugins, a)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Completions { shell } => {
            clap_complete::generate(*shell, &mut Cli::command(), "verl", &mut std::io::stdout());
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn mark(s: &Status) -> &'static str {
    match s {
        Status::Ok => "✓",
        Status::Warn => "!",
        Status::Fail => "✗",
    }
}

fn doctor_cmd() -> ExitCode {
    let loader = Loader::new(&[]);
    let checks = doctor::run(&loader);
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

fn inspect(spec: &str) -> anyhow::Result<ExitCode> {
    let mut loader = Loader::new(&[]);
    let i = loader.inspect(spec)?;
    let h = &i.header;
    println!("path          {}", i.path.display());
    println!("name          {}", h.name);
    println!("version       {}", h.version);
    println!("kind          {}", h.kind);
    if !h.description.is_empty() {
        println!("description   {}", h.description);
    }
    println!(
        "plugin-api    {} (this verl: {})",
        h.api_version,
        verl_plugin_api::API_VERSION
    );
    println!("roles");
    for c in &h.capabilities {
        let state = if c.implemented {
            "ready"
        } else {
            "not implemented"
        };
        let note = if c.note.is_empty() {
            String::new()
        } else {
            format!(" — {}", c.note)
        };
        println!("  {:<10} {state}{note}", c.role.as_str());
    }
    println!("build");
    println!(
        "  libtorch   {}",
        h.build
            .libtorch
            .as_deref()
            .unwrap_or("none (does not link libtorch)")
    );
    println!("  device     {}", h.build.device);
    if let Some(cuda) = &h.build.cuda {
        println!("  cuda       {cuda}");
    }
    println!("  profile    {}", h.build.profile);
    println!("  target     {}", h.build.target);
    if let Some(t) = &i.torch {
        println!(
            "libtorch      {} preloaded from {} ({})",
            t.version.as_deref().unwrap_or("unknown version"),
            t.lib_dir.display(),
            t.found_by
        );
        if let (Some(built), Some(found)) = (h.build.libtorch.as_deref(), t.base_version()) {
            if built.split('+').next() != Some(found) {
                bail!(
                    "{}: plugin `{}` was built against libtorch {built} but the libtorch found is {found}; install torch=={built} or rebuild the plugin",
                    i.path.display(),
                    h.name
                );
            }
        }
    }
    if let Err(why) = &i.compatible {
        bail!(
            "{}: plugin `{}` is incompatible: {why}; rebuild it against verl-plugin-api {}",
            i.path.display(),
            h.name,
            verl_plugin_api::API_VERSION
        );
    }
    // Full handshake: the root module's layout and initialisation.
    loader.load(spec)?;
    println!("compatible    yes (header, plugin-api semver and root-module layout checked)");
    Ok(ExitCode::SUCCESS)
}

fn list() -> anyhow::Result<ExitCode> {
    let loader = Loader::new(&[]);
    for f in loader.discover() {
        match loader.inspect(&f.display().to_string()) {
            Ok(i) => println!(
                "{} {:<10} {:<8} {:<8} {}",
                if i.compatible.is_ok() { "✓" } else { "✗" },
                i.header.name,
                i.header.version,
                i.header.kind.to_string(),
                i.path.display()
            ),
            Err(LoadError::NotAPlugin { .. }) => {}
            Err(e) => println!("✗ {e}"),
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The plugins a job uses: `--plugin`s first (by kind), then names from the config.
struct JobPlugins {
    backend: LoadedPlugin,
    rewards: Vec<(String, LoadedPlugin)>,
}

fn load_job_plugins(loader: &mut Loader, cli: &Cli, cfg: &Config) -> anyhow::Result<JobPlugins> {
    let mut backend: Option<LoadedPlugin> = None;
    let mut explicit_rewards = Vec::new();
    for spec in &cli.plugins {
        let p = loader.load(spec)?;
        match p.header.kind {
            PluginKind::Backend => {
                if let Some(b) = &backend {
                    bail!(
                        "two backend plugins given ({} and {}); `verl run` uses one backend (compare two with `verl ab JOB --a {} --b {}`)",
                        b.path.display(),
                        p.path.display(),
                        b.path.display(),
                        p.path.display()
                    );
                }
                backend = Some(p);
            }
            PluginKind::Reward => explicit_rewards.push(p),
        }
    }
    let backend = match backend {
        Some(b) => b,
        None => {
            let name = cfg.backend_plugin();
            loader.load(&name).with_context(|| {
                format!(
                    "loading backend `{name}` (from actor_rollout_ref.actor.strategy={} / plugins.backend)",
                    cfg.actor_rollout_ref.actor.strategy
                )
            })?
        }
    };
    let mut rewards = Vec::new();
    for p in explicit_rewards {
        rewards.push((p.header.name.clone(), p));
    }
    let mut wanted: Vec<String> = vec![cfg.plugins.reward.default.clone()];
    wanted.extend(cfg.plugins.reward.routes.values().cloned());
    for name in wanted {
        if rewards.iter().any(|(n, _)| *n == name) {
            continue;
        }
        // The job's reward model and Python reward function are routed to by name; they are not
        // plugins to load.
        if (cfg.reward.reward_model.enable && name == verl_host::trainer::REWARD_MODEL)
            || (cfg.reward.custom_reward_function.path.is_some()
                && name == verl_host::trainer::CUSTOM_REWARD_FUNCTION)
        {
            continue;
        }
        let p = loader
            .load(&name)
            .with_context(|| format!("loading reward plugin `{name}` (plugins.reward)"))?;
        rewards.push((name, p));
    }
    Ok(JobPlugins { backend, rewards })
}

fn run(cli: &Cli, args: &RunArgs) -> anyhow::Result<ExitCode> {
    let dry_run = args.dry_run;
    let (cfg, described) = args.load()?;
    let layout = Layout::from_config(&cfg)?;
    // What a dry run cannot check on this machine (the job's GPUs, its nodes), said at the end.
    let mut not_checked: Vec<String> = Vec::new();
    let mode = match launch::detect(
        |k| std::env::var(k).ok(),
        cfg.trainer.nnodes,
        cfg.trainer.n_gpus_per_node,
    ) {
        Ok(mode) => mode,
        Err(e @ launch::LaunchError::MultiNode { .. }) if dry_run => {
            not_checked.push(format!("launch: {e}"));
            LaunchMode::Launcher {
                world: layout.world_size as usize,
            }
        }
        Err(e) => return Err(e.into()),
    };
    if matches!(mode, LaunchMode::Launcher { .. }) && cfg.trainer.device.starts_with("cuda") {
        // One GPU per local rank, checked before anything is loaded or spawned.
        match launch::check_gpus(cfg.trainer.n_gpus_per_node) {
            Ok(()) => {}
            Err(e) if dry_run => not_checked.push(format!("GPUs: {e}")),
            Err(e) => return Err(e.into()),
        }
    }
    // Under our launcher the launcher reports; under torchrun/SLURM rank 0 does.
    let quiet = matches!(&mode, LaunchMode::Rank { env, source } if env.rank != 0 || *source == EnvSource::Verl);
    let mut out = String::new();
    macro_rules! outln {
        ($($arg:tt)*) => {{
            use std::fmt::Write as _;
            let _ = writeln!(out, $($arg)*);
        }};
    }
    let plan = validate_batches(&cfg, layout)?;
    let correction = verl_host::trainer::rollout_correction(&cfg)?;
    let search: Vec<PathBuf> = cfg.plugins.search_path.iter().map(PathBuf::from).collect();
    let mut loader = Loader::new(&search);
    let plugins = load_job_plugins(&mut loader, cli, &cfg)?;

    outln!("config        {described} ✓");
    for w in &cfg.warnings {
        outln!("  ignored     {w}");
    }
    let b = &plugins.backend.header;
    outln!(
        "backend       {} {} ({}) ✓",
        b.name,
        b.version,
        plugins.backend.path.display()
    );
    let mut needed = vec![Role::Actor];
    if cfg.need_reference_policy() {
        needed.push(Role::Reference);
    }
    if cfg.need_critic() {
        needed.push(Role::Critic);
    }
    if let Some(head) = verl_host::checks::reward_model_head(&cfg) {
        // A discriminative reward model is the backend's reward_model role; a generative one
        // (a judge) a frozen policy, its reference role.
        let role = match head {
            verl_host::trainer::reward_model::ModelHead::Score => Role::RewardModel,
            verl_host::trainer::reward_model::ModelHead::Generate => Role::Reference,
        };
        if !needed.contains(&role) {
            needed.push(role);
        }
    }
    let mut missing = Vec::new();
    for role in &needed {
        if b.provides(*role) {
            outln!("  {:<11} ✓", role.as_str());
        } else {
            let note = b
                .capabilities
                .iter()
                .find(|c| c.role == *role)
                .map(|c| c.note.clone())
                .unwrap_or_default();
            outln!(
                "  {:<11} ! not implemented by {} {note}",
                role.as_str(),
                b.name
            );
            missing.push(*role);
        }
    }
    for (name, p) in &plugins.rewards {
        outln!(
            "reward        {name}: {} {} ({}) ✓",
            p.header.name,
            p.header.version,
            p.path.display()
        );
    }
    outln!(
        "batch         {} prompts × n={} = {} responses per step over {} rank(s) ({} per rank)",
        plan.prompts_per_step,
        plan.rollout_n,
        plan.responses_per_step,
        plan.layout.world_size,
        plan.responses_per_rank
    );
    outln!(
        "  actor       mini-batch {} prompts = {} responses ({} per rank), {} mini-batch(es) × {} epoch(s) = {} optimizer step(s) per step{}",
        plan.actor.mini_batch_prompts,
        plan.actor.mini_batch_responses,
        plan.actor.mini_batch_per_rank,
        plan.actor.mini_batches_per_step,
        plan.actor.ppo_epochs,
        plan.actor.optimizer_steps_per_step,
        match (plan.actor.micro_batch_per_gpu, plan.actor.grad_accumulation_steps) {
            (Some(m), Some(g)) => format!(", micro-batch {m} → {g} accumulation step(s)"),
            _ if plan.actor.dynamic_bsz => format!(
                ", dynamic micro-batches ≤ {} tokens",
                plan.actor.max_token_len_per_gpu.unwrap_or(0)
            ),
            _ => String::new(),
        }
    );
    if let Some(c) = &correction {
        if c.bypass_mode {
            outln!("  correction  bypass mode: the rollout's log-probs are the old log-probs (no old-log-prob pass)");
        } else {
            let is = match c.is {
                Some(spec) => format!("{:?} importance weights ({:?})", spec.level, spec.threshold),
                None => "no importance weights".into(),
            };
            let rs: Vec<&str> = c.rs.iter().map(|r| r.name.as_str()).collect();
            outln!(
                "  correction  decoupled: {is}; rejection: {}",
                if rs.is_empty() {
                    "none".to_string()
                } else {
                    rs.join(", ")
                }
            );
        }
    }
    if let Some(c) = &plan.critic {
        outln!(
            "  critic      mini-batch {} responses, {} optimizer step(s) per step",
            c.mini_batch_responses,
            c.optimizer_steps_per_step
        );
    }
    for w in &plan.warnings {
        outln!("  ! {w}");
    }
    // A dry run reads the model folder before the backend lays it out, so a model verl-rs cannot
    // train is named as such rather than as a layout the backend does not know.
    let model_line = if dry_run {
        Some(verl_host::checks::check_policy_model(&cfg)?)
    } else {
        None
    };
    // The backend's own layout check (heads, layers, experts against the parallel sizes), from
    // the model's config.json alone: a bad layout fails here, once, before any rank starts.
    let roles: Vec<&str> = needed
        .iter()
        .filter(|r| !missing.contains(r))
        .map(|r| r.as_str())
        .collect();
    let layout_init = verl_plugin_api::InitArgs {
        world_size: u32::try_from(plan.layout.world_size).unwrap_or(u32::MAX),
        extra: serde_json::json!({ "roles": roles }),
        ..verl_plugin_api::InitArgs::new(
            Role::Actor,
            serde_json::to_value(&cfg).context("serialising the config for plugins")?,
        )
    };
    if let Some(summary) = plugins.backend.validate_layout(&layout_init) {
        let summary = summary.with_context(|| {
            format!(
                "the `{}` backend cannot lay out this job (model actor_rollout_ref.model.path={})",
                b.name, cfg.actor_rollout_ref.model.path
            )
        })?;
        for line in summary.lines() {
            outln!("layout        {line} ✓");
        }
    }
    match &mode {
        LaunchMode::Single => outln!("launch        1 process on {}", cfg.trainer.device),
        LaunchMode::Launcher { world } => outln!(
            "launch        {world} local rank(s) on {} (trainer.n_gpus_per_node={}), spawned by this verl run",
            cfg.trainer.device,
            cfg.trainer.n_gpus_per_node
        ),
        LaunchMode::Rank { env, source } => outln!(
            "launch        rank {} of {} (local rank {}) from the {} environment, store {}:{}",
            env.rank,
            env.world_size,
            env.local_rank,
            source.name(),
            env.master_addr,
            env.master_port
        ),
    }
    if !quiet {
        print!("{out}");
        out.clear();
    }
    if dry_run {
        if !missing.is_empty() {
            let roles: Vec<&str> = missing.iter().map(|r| r.as_str()).collect();
            bail!(
                "backend `{}` does not implement the {} role(s) this job needs (see `verl plugin inspect {}`)",
                b.name,
                roles.join(", "),
                plugins.backend.path.display()
            );
        }
        // What a real run would read first: the data, the model folders, the loggers. Each line
        // that passed is shown even when a later check fails.
        let mut checks = || -> anyhow::Result<()> {
            for (name, split) in [
                ("train", verl_data::Split::Train),
                ("val", verl_data::Split::Val),
            ] {
                let line = verl_host::checks::check_data(&cfg, split)?;
                outln!("data          {name}: {line} ✓");
            }
            if let Some(line) = &model_line {
                outln!("model         {line} ✓");
            }
            if cfg.need_critic() {
                let line = verl_host::checks::check_model(
                    "critic.model.path",
                    &cfg.critic.model.path,
                    None,
                )?;
                outln!("critic model  {line} ✓");
            }
            if cfg.reward.reward_model.enable {
                let line = verl_host::checks::check_reward_model(&cfg)?;
                outln!("reward model  {line} ✓");
            }
            if let Some(line) = verl_host::checks::check_python_reward(&cfg)? {
                outln!("reward fn     {line} ✓");
            }
            if let Some(o) = verl_host::trainer::reward::Overlong::from_config(&cfg)? {
                outln!(
                    "reward mgr    dapo: overlong buffer {} of max_resp_len {}, penalty factor {}{} ✓",
                    o.len,
                    o.max_resp_len,
                    o.penalty_factor,
                    if o.log { ", logged" } else { "" }
                );
            }
            let t = &cfg.trainer;
            let loggers = verl_metrics::LoggerOptions::from_verl(
                &t.project_name,
                &t.experiment_name,
                &t.logger.to_vec(),
            );
            for line in verl_metrics::check_loggers(&loggers)? {
                outln!("logger        {line} ✓");
            }
            for line in &not_checked {
                outln!("not checked   {line} (this machine cannot; a real run checks it first)");
            }
            Ok(())
        };
        let checked = checks();
        if checked.is_err() && !quiet {
            print!("{out}");
        }
        checked?;
        outln!("dry run       ok: nothing trained");
        if !quiet {
            print!("{out}");
        }
        return Ok(ExitCode::SUCCESS);
    }
    if !missing.is_empty() {
        let roles: Vec<&str> = missing.iter().map(|r| r.as_str()).collect();
        bail!(
            "backend `{}` does not implement the {} role(s) this job needs (see `verl plugin inspect {}`)",
            b.name,
            roles.join(", "),
            plugins.backend.path.display()
        );
    }
    let (rank_env, quiet) = match mode {
        LaunchMode::Single => (None, false),
        LaunchMode::Launcher { world } => {
            // The children load their own plugins; the launcher only supervises.
            drop(plugins);
            let master_port =
                match std::env::var("MASTER_PORT") {
                    Ok(p) => Some(p.trim().parse::<u16>().with_context(|| {
                        format!("MASTER_PORT={p}: expected a TCP port (0-65535)")
                    })?),
                    Err(_) => None,
                };
            let code = launch::launch(&launch::LaunchOptions {
                world,
                args: std::env::args_os().skip(1).collect(),
                verbose: cli.verbose > 0,
                master_port,
            })?;
            return Ok(ExitCode::from(code.clamp(0, 255) as u8));
        }
        LaunchMode::Rank { env, .. } => {
            // Rank 0 reports the result, also under our launcher (its stdout is the job's).
            let quiet = env.rank != 0;
            (Some(env), quiet)
        }
    };
    let job_plugins = verl_host::trainer::JobPlugins::new(plugins.backend, plugins.rewards);
    let summary = match rank_env {
        None => {
            let opts = verl_host::trainer::FitOptions {
                progress: true,
                ..Default::default()
            };
            verl_host::trainer::fit(&cfg, &job_plugins, &opts)?
        }
        Some(env) => fit_as_rank(&cfg, &job_plugins, &env)?,
    };
    if quiet {
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "done          {} step(s) of {}{}",
        summary.global_step,
        summary.total_training_steps,
        summary
            .resumed_from
            .as_ref()
            .map(|r| format!(" (resumed from step {r})"))
            .unwrap_or_default()
    );
    if let Some(p) = &summary.jsonl_path {
        println!("metrics       {}", p.display());
    }
    if let Some(last) = summary.checkpoints.last() {
        println!(
            "checkpoint    {}/global_step_{last}",
            cfg.trainer.default_local_dir
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// One rank of an SPMD job: meet the others at the store, train this rank's slice, and leave
/// together. A failure is posted to the store first, so every other rank stops at once.
fn fit_as_rank(
    cfg: &Config,
    plugins: &verl_host::trainer::JobPlugins,
    env: &verl_store::DistEnv,
) -> anyhow::Result<verl_host::trainer::FitSummary> {
    let (rank, world) = (env.rank, env.world_size);
    let who = format!("rank {rank} of {world}");
    let timeout = launch::rendezvous_timeout()?;
    let store = format!("{}:{}", env.master_addr, env.master_port);
    // Rank 0 may host the store (torchrun, SLURM): it must outlive the job.
    let (_server, client) = env
        .join(timeout)
        .with_context(|| format!("{who}: joining the rendezvous store at {store}"))?;
    let client = Arc::new(client);
    client
        .barrier("verl/start", rank, world, timeout)
        .with_context(|| format!("{who}: waiting for all ranks at {store}"))?;
    watch_for_failures(&client, rank, world);
    let group = Arc::new(verl_host::dist::HostGroup::new(
        client.clone(),
        rank,
        world,
        timeout.max(Duration::from_secs(1800)),
    ));
    let opts = verl_host::trainer::FitOptions {
        rank: rank as u32,
        world_size: world as u32,
        local_rank: env.local_rank as u32,
        rendezvous: Some(verl_plugin_api::Rendezvous {
            master_addr: env.master_addr.clone(),
            master_port: env.master_port,
            timeout_s: timeout.as_secs().max(1),
        }),
        group: Some(group.clone()),
        progress: true,
        logger: None,
    };
    let result = verl_host::trainer::fit(cfg, plugins, &opts).and_then(|summary| {
        group.barrier("done")?;
        leave_together(&client, rank, world, _server.is_some())?;
        Ok(summary)
    });
    result.map_err(|e| {
        let _ = client.set_error(rank, &format!("{e:#}"));
        e.context(who)
    })
}

/// After the last barrier: a rank that hosts the store keeps it up until every other rank has
/// read its reply and said it is leaving, so none of them sees the store vanish mid-request.
fn leave_together(
    client: &verl_store::StoreClient,
    rank: usize,
    world: usize,
    hosts_store: bool,
) -> anyhow::Result<()> {
    const LEFT: &str = "verl/left";
    if !hosts_store {
        client.add(LEFT, 1)?;
        return Ok(());
    }
    let others = (world - 1) as i64;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while std::time::Instant::now() < deadline {
        let left = client
            .try_get(LEFT)?
            .and_then(|v| String::from_utf8(v).ok()?.parse::<i64>().ok())
            .unwrap_or(0);
        if left >= others {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    tracing::warn!(
        rank,
        "not every rank said goodbye within 30s; stopping the store anyway"
    );
    Ok(())
}

/// Ends this rank soon after another one fails, even while it computes and so cannot see the
/// failure at a collective (SLURM and hand-started ranks have no launcher to kill them).
fn watch_for_failures(client: &verl_store::StoreClient, rank: usize, world: usize) {
    let Ok(watcher) = client.duplicate(Duration::from_secs(10)) else {
        return;
    };
    let _ = std::thread::Builder::new()
        .name("verl-failure-watch".into())
        .spawn(move || loop {
            match watcher.wait_error(Duration::from_secs(3600)) {
                Ok(()) => continue,
                Err(verl_store::StoreError::RankFailed { rank: failed, message }) => {
                    if failed == rank {
                        return;
                    }
                    // The main thread reports the failure itself when it is in a collective.
                    std::thread::sleep(Duration::from_secs(5));
                    eprintln!(
                        "error: rank {rank} of {world}: stopping because rank {failed} failed: {message}"
                    );
                    // SAFETY: ending the process without unwinding or atexit handlers, which
                    // could block on a backend's device state.
                    unsafe { libc::_exit(1) };
                }
                // The store is gone: the job is over.
                Err(_) => return,
            }
        });
}

fn ab(cli: &Cli, args: &AbArgs) -> anyhow::Result<ExitCode> {
    use verl_host::ab::{self, compare, report::Report, ArmSpec};
    let run_args = RunArgs {
        args: args.args.clone(),
        config_name: None,
        config_path: None,
        dry_run: false,
    };
    let (job, common) = run_args.job()?;
    let req = ab::AbRequest {
        job: job.clone(),
        common,
        a: ArmSpec::parse(&args.a).context("--a")?,
        b: ArmSpec::parse(&args.b).context("--b")?,
        steps: args.steps.max(1),
        out: args.out.clone(),
        rtol: args.rtol,
        verl: std::env::current_exe().context("locating the verl binary")?,
        plugins: cli.plugins.clone(),
    };
    let (a, b, ca, cb) = req.run_arms()?;
    let rtol = req.tolerance(&ca, &cb);
    let report = Report {
        a: &a,
        b: &b,
        job: job
            .map(|j| j.display().to_string())
            .unwrap_or_else(|| "verl's defaults".into()),
        steps: req.steps,
        rtol,
        machine: ab::machine(),
        diffs: compare::compare(&a.metrics, &b.metrics, rtol),
        timings: compare::phases(&a.metrics, &b.metrics, compare::Kind::Timing),
        perf: compare::phases(&a.metrics, &b.metrics, compare::Kind::Perf),
    };
    let html = args.out.join("report.html");
    std::fs::write(&html, report.html()).with_context(|| format!("writing {}", html.display()))?;
    let json = args.out.join("summary.json");
    std::fs::write(&json, serde_json::to_string_pretty(&report.summary_json())?)
        .with_context(|| format!("writing {}", json.display()))?;
    print!("{}", report.console());
    println!("\nreport: {}\nsummary: {}", html.display(), json.display());
    Ok(ExitCode::SUCCESS)
}

fn reward_score_model(
    cli: &Cli,
    input: &std::path::Path,
    req: &verl_host::reward_cmd::ModelScoreRequest,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let mut loader = Loader::new(&[]);
    let spec = match cli.plugins.as_slice() {
        [] => "fsdp".to_string(),
        [one] => one.clone(),
        _ => bail!("`verl reward score --model` takes one --plugin (a backend)"),
    };
    let backend = loader.load(&spec)?;
    let scores = verl_host::reward_cmd::score_file_with_model(&backend, input, req)?;
    for (i, s) in scores.iter().enumerate() {
        if json {
            println!("{}", serde_json::json!({"row": i, "score": s}));
        } else {
            println!("{i}\t{s}");
        }
    }
    if !json {
        let mean = scores.iter().map(|&s| s as f64).sum::<f64>() / scores.len() as f64;
        println!("rows {}, mean score {mean:.6}", scores.len());
    }
    Ok(ExitCode::SUCCESS)
}

fn reward_score(
    cli: &Cli,
    input: &std::path::Path,
    out: Option<&std::path::Path>,
    kwargs: &str,
    batch_size: usize,
) -> anyhow::Result<ExitCode> {
    let kwargs: serde_json::Value = serde_json::from_str(kwargs)
        .context("--kwargs must be JSON, e.g. '{\"method\": \"flexible\"}'")?;
    let mut loader = Loader::new(&[]);
    let spec = match cli.plugins.as_slice() {
        [] => "rewards".to_string(),
        [one] => one.clone(),
        _ => bail!("`verl reward score` takes one --plugin"),
    };
    let plugin = loader.load(&spec)?;
    let stats = verl_host::reward_cmd::score_file(&plugin, input, out, kwargs, batch_size)?;
    println!(
        "{:<40} {:>7} {:>10} {:>9}",
        "data_source", "rows", "mean", "accuracy"
    );
    let (mut rows, mut correct) = (0usize, 0usize);
    for (src, s) in &stats {
        println!(
            "{:<40} {:>7} {:>10.4} {:>9.4}",
            src,
            s.rows,
            s.score_sum / s.rows as f64,
            s.correct as f64 / s.rows as f64
        );
        rows += s.rows;
        correct += s.correct;
    }
    println!(
        "{:<40} {:>7} {:>10} {:>9.4}",
        "all",
        rows,
        "",
        correct as f64 / rows as f64
    );
    Ok(ExitCode::SUCCESS)
}

fn generate(cli: &Cli, a: &GenerateArgs) -> anyhow::Result<ExitCode> {
    use verl_host::generate_cmd::{read_prompts_jsonl, GenerateRequest};
    let prompts = match (&a.prompts, a.prompt.is_empty()) {
        (Some(file), _) => read_prompts_jsonl(file)?,
        (None, false) => a.prompt.clone(),
        (None, true) => bail!("give --prompt TEXT (repeatable) or --prompts FILE.jsonl"),
    };
    let mut loader = Loader::new(&[]);
    let spec = match cli.plugins.as_slice() {
        [] => "fsdp".to_string(),
        [one] => one.clone(),
        _ => bail!("`verl generate` takes one backend --plugin"),
    };
    let backend = loader.load(&spec)?;
    let req = GenerateRequest {
        model: a.model.clone(),
        prompts: prompts.clone(),
        chat: a.chat,
        options: verl_plugin_api::GenerateOptions {
            n: a.n,
            max_new_tokens: a.max_new_tokens,
            temperature: a.temperature,
            top_p: a.top_p,
            top_k: a.top_k,
            do_sample: !a.greedy,
            seed: a.seed,
            return_log_probs: true,
            ..Default::default()
        },
        device: a.device.clone(),
        overrides: a.overrides.clone(),
    };
    let out = verl_host::generate_cmd::generate(&backend, &req)?;
    for g in &out {
        if a.json {
            println!("{}", serde_json::to_string(g)?);
            continue;
        }
        println!("### prompt {}: {}", g.prompt_index, prompts[g.prompt_index]);
        println!("{}", g.text);
        if a.logprobs {
            if let Some(lp) = &g.log_probs {
                let parts: Vec<String> = g
                    .token_ids
                    .iter()
                    .zip(lp)
                    .map(|(t, l)| format!("{t}:{l:.4}"))
                    .collect();
                println!("logprobs: {}", parts.join(" "));
            }
        }
        if let Some(r) = &g.finish_reason {
            println!("(finish: {r}, {} tokens)", g.token_ids.len());
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn sft(cli: &Cli, job: &std::path::Path, overrides: &[String]) -> anyhow::Result<ExitCode> {
    let cfg = sft_cmd::SftConfig::load(job, overrides)?;
    let mut loader = Loader::new(&[]);
    let spec = match cli.plugins.as_slice() {
        [] => cfg.model.strategy.replace("fsdp2", "fsdp"),
        [one] => one.clone(),
        _ => bail!("`verl sft` takes one backend --plugin"),
    };
    let backend = loader
        .load(&spec)
        .with_context(|| format!("loading backend `{spec}` (model.strategy / --plugin)"))?;
    let s = sft_cmd::run_sft(&backend, &cfg)?;
    println!(
        "done          {} SFT step(s) in {:.1}s, train/loss {}, val/loss {}",
        s.steps,
        s.seconds,
        s.last_train_loss
            .map(|l| format!("{l:.4}"))
            .unwrap_or_else(|| "-".into()),
        s.val_loss
            .map(|l| format!("{l:.4}"))
            .unwrap_or_else(|| "-".into())
    );
    if let Some(p) = &s.metrics_file {
        println!("metrics       {}", p.display());
    }
    println!("model         {}", s.final_model.display());
    Ok(ExitCode::SUCCESS)
}
