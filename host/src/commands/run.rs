//! `verl run`: a job's config, plugins and layout checked (the dry run stops there), then trained
//! in this process, as one rank of a job launched by torchrun/SLURM/`verl run` itself, or as the
//! launcher of its local ranks.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use verl_config::{validate_batches, Config, Layout};
use verl_plugin_api::{PluginKind, Role};

use crate::launch::{self, EnvSource, LaunchMode};
use crate::{LoadedPlugin, Loader};

#[derive(clap::Args)]
pub struct RunArgs {
    /// A job file (verl YAML) and/or overrides like `actor_rollout_ref.actor.optim.lr=1e-6`,
    /// `trainer.logger=[console]`, as `python3 -m verl.trainer.main_ppo` takes them.
    #[arg(value_name = "[JOB.yaml] [KEY=VALUE]")]
    pub(crate) args: Vec<String>,
    /// Hydra's `--config-name`: `ppo_trainer` (default), `ppo_megatron_trainer` (the Megatron
    /// engine), or the name of a job YAML in `--config-path`.
    #[arg(long, value_name = "NAME")]
    pub(crate) config_name: Option<String>,
    /// Hydra's `--config-path`: the folder of `--config-name`'s YAML.
    #[arg(long, value_name = "DIR")]
    pub(crate) config_path: Option<PathBuf>,
    /// Check everything a run needs (config, plugins, batch arithmetic and parallel layout, data
    /// files, model folder, loggers) and train nothing. Checks that need the job's GPUs are
    /// listed as not made when this machine lacks them.
    #[arg(long)]
    pub(crate) dry_run: bool,
}

impl RunArgs {
    /// The job file and the overrides, however the job was given.
    pub(crate) fn job(&self) -> anyhow::Result<(Option<PathBuf>, Vec<String>)> {
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

    pub(crate) fn load(&self) -> anyhow::Result<(Config, String)> {
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

/// The plugins a job uses: `--plugin`s first (by kind), then names from the config.
struct JobPlugins {
    backend: LoadedPlugin,
    rewards: Vec<(String, LoadedPlugin)>,
    /// Tool plugins given with `--plugin` (the tool config's classes are looked for there
    /// first).
    tools: Vec<LoadedPlugin>,
}

fn load_job_plugins(
    loader: &mut Loader,
    plugins: &[String],
    cfg: &Config,
) -> anyhow::Result<JobPlugins> {
    let mut backend: Option<LoadedPlugin> = None;
    let mut explicit_rewards = Vec::new();
    let mut tools = Vec::new();
    for spec in plugins {
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
            // Tool plugins serve the classes of the multi-turn tool config (`ToolSet::load`).
            PluginKind::Tool => tools.push(p),
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
        if (cfg.reward.reward_model.enable && name == crate::trainer::REWARD_MODEL)
            || (cfg.reward.custom_reward_function.path.is_some()
                && name == crate::trainer::CUSTOM_REWARD_FUNCTION)
        {
            continue;
        }
        let p = loader
            .load(&name)
            .with_context(|| format!("loading reward plugin `{name}` (plugins.reward)"))?;
        rewards.push((name, p));
    }
    Ok(JobPlugins {
        backend,
        rewards,
        tools,
    })
}

/// `verl run`: checks the job (and with `--dry-run` stops there), then trains it in this
/// process, as one rank of a launched job, or as the launcher of its local ranks.
pub fn run(cli_plugins: &[String], verbose: u8, args: &RunArgs) -> anyhow::Result<ExitCode> {
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
    let correction = crate::trainer::rollout_correction(&cfg)?;
    let search: Vec<PathBuf> = cfg.plugins.search_path.iter().map(PathBuf::from).collect();
    let mut loader = Loader::new(&search);
    let plugins = load_job_plugins(&mut loader, cli_plugins, &cfg)?;

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
    let lora = crate::trainer::lora_backend(&cfg, &plugins.backend)?;
    if cfg.need_reference_policy() && !lora {
        needed.push(Role::Reference);
    }
    if lora {
        let m = &cfg.actor_rollout_ref.model;
        outln!(
            "lora          {}{}{}",
            match &m.lora_adapter_path {
                Some(p) => format!("adapters from {p}"),
                None => format!("rank {} alpha {}", m.lora_rank, m.lora_alpha),
            },
            if m.lora_adapter_path.is_none() {
                format!(
                    " on {}",
                    serde_json::to_string(&m.target_modules).unwrap_or_default()
                )
            } else {
                String::new()
            },
            if cfg.need_reference_policy() {
                "; the reference policy is the base with the adapters off"
            } else {
                ""
            }
        );
    }
    if crate::trainer::multi_turn_backend(&cfg, &plugins.backend)? {
        let mt = cfg.multi_turn();
        let tools = match &mt.tool_config_path {
            Some(p) => {
                let set = crate::tools::ToolSet::load(
                    &crate::paths::expand_home(p),
                    &crate::tools::ToolPlugins::new(plugins.tools.clone(), search.clone()),
                )
                .with_context(|| {
                    format!("actor_rollout_ref.rollout.multi_turn.tool_config_path={p}")
                })?;
                set.names()
                    .iter()
                    .map(|n| format!("{n} ({})", set.class_name(n).unwrap_or("?")))
                    .collect::<Vec<_>>()
                    .join(", ")
            }
            None => "none (no tool_config_path: tool agents answer in one turn)".into(),
        };
        outln!(
            "multi-turn    {} format, rows without agent_name run {}; tools: {tools}",
            mt.format,
            mt.default_agent_loop
        );
    }
    if cfg.need_critic() {
        needed.push(Role::Critic);
    }
    if let Some(head) = crate::checks::reward_model_head(&cfg) {
        // A discriminative reward model is the backend's reward_model role; a generative one
        // (a judge) a frozen policy, its reference role.
        let role = match head {
            crate::trainer::reward_model::ModelHead::Score => Role::RewardModel,
            crate::trainer::reward_model::ModelHead::Generate => Role::Reference,
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
        Some(crate::checks::check_policy_model(&cfg)?)
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
                let line = crate::checks::check_data(&cfg, split)?;
                outln!("data          {name}: {line} ✓");
            }
            if let Some(line) = &model_line {
                outln!("model         {line} ✓");
            }
            if cfg.need_critic() {
                let line =
                    crate::checks::check_model("critic.model.path", &cfg.critic.model.path, None)?;
                outln!("critic model  {line} ✓");
            }
            if cfg.reward.reward_model.enable {
                let line = crate::checks::check_reward_model(&cfg)?;
                outln!("reward model  {line} ✓");
            }
            if let Some(line) = crate::checks::check_python_reward(&cfg)? {
                outln!("reward fn     {line} ✓");
            }
            if let Some(o) = crate::trainer::reward::Overlong::from_config(&cfg)? {
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
                verbose: verbose > 0,
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
    let search: Vec<PathBuf> = cfg.plugins.search_path.iter().map(PathBuf::from).collect();
    let job_plugins = crate::trainer::JobPlugins::new(plugins.backend, plugins.rewards)
        .with_tools(crate::tools::ToolPlugins::new(plugins.tools, search));
    let summary = match rank_env {
        None => {
            let opts = crate::trainer::FitOptions {
                progress: true,
                ..Default::default()
            };
            crate::trainer::fit(&cfg, &job_plugins, &opts)?
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
    plugins: &crate::trainer::JobPlugins,
    env: &verl_store::DistEnv,
) -> anyhow::Result<crate::trainer::FitSummary> {
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
    let group = Arc::new(crate::dist::HostGroup::new(
        client.clone(),
        rank,
        world,
        timeout.max(Duration::from_secs(1800)),
    ));
    let opts = crate::trainer::FitOptions {
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
    let result = crate::trainer::fit(cfg, plugins, &opts).and_then(|summary| {
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
