//! `verl ab`: the same job on two backends (or with two settings), one arm after the other, then
//! the numbers side by side in `DIR/report.html`, `DIR/summary.json` and a console table.
//!
//! Each arm is a `verl run` of the job with the common overrides, the arm's own, and
//! `trainer.total_training_steps`; its metrics go to `DIR/<arm>/logs` (the file logger), its
//! checkpoints to `DIR/<arm>/ckpt`, its output to `DIR/<arm>/run.log`. An arm that finished with
//! the same command is not run again; an interrupted one resumes from its last checkpoint
//! (verl's `trainer.resume_mode=auto`).

pub mod compare;
pub mod report;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Instant;

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use verl_config::Config;

use compare::Steps;
use report::Report;

use super::run::RunArgs;

#[derive(clap::Args)]
pub struct AbArgs {
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

/// `verl ab`: both arms, then the report (`--plugin`s go to both arms).
pub fn run(plugins: &[String], args: &AbArgs) -> anyhow::Result<ExitCode> {
    let run_args = RunArgs {
        args: args.args.clone(),
        config_name: None,
        config_path: None,
        dry_run: false,
    };
    let (job, common) = run_args.job()?;
    let req = AbRequest {
        job: job.clone(),
        common,
        a: ArmSpec::parse(&args.a).context("--a")?,
        b: ArmSpec::parse(&args.b).context("--b")?,
        steps: args.steps.max(1),
        out: args.out.clone(),
        rtol: args.rtol,
        verl: std::env::current_exe().context("locating the verl binary")?,
        plugins: plugins.to_vec(),
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
        machine: machine(),
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

/// One side of the comparison: a backend (name or library path) and/or overrides.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArmSpec {
    /// As the user wrote it.
    pub text: String,
    /// `--plugin` for a library path or a name other than the first-party backends.
    pub plugin: Option<String>,
    pub overrides: Vec<String>,
}

fn is_override(a: &str) -> bool {
    a.contains('=') || a.starts_with('+') || (a.starts_with('~') && !a.starts_with("~/"))
}

impl ArmSpec {
    /// `fsdp`, `megatron` (the strategy keys of verl for the first-party backends), a plugin path
    /// or name, and/or `key=value` overrides, separated by spaces.
    pub fn parse(text: &str) -> anyhow::Result<ArmSpec> {
        let mut spec = ArmSpec {
            text: text.to_string(),
            plugin: None,
            overrides: Vec::new(),
        };
        for tok in text.split_whitespace() {
            if is_override(tok) {
                spec.overrides.push(tok.to_string());
                continue;
            }
            if spec.plugin.is_some() || spec.overrides.iter().any(|o| o.contains(".strategy=")) {
                bail!("arm `{text}` names two backends (`{tok}` is the second)");
            }
            match tok {
                "fsdp" | "fsdp2" | "megatron" => {
                    // verl's way to choose the engine: the strategies of the actor, reference
                    // and critic.
                    for role in ["actor_rollout_ref.actor", "critic"] {
                        spec.overrides.insert(0, format!("{role}.strategy={tok}"));
                    }
                }
                other => spec.plugin = Some(other.to_string()),
            }
        }
        if spec.plugin.is_none() && spec.overrides.is_empty() {
            bail!("an arm needs a backend (fsdp, megatron, a plugin .so) or overrides key=value");
        }
        Ok(spec)
    }
}

/// What `verl ab` was asked.
#[derive(Debug, Clone)]
pub struct AbRequest {
    pub job: Option<PathBuf>,
    pub common: Vec<String>,
    pub a: ArmSpec,
    pub b: ArmSpec,
    pub steps: u64,
    pub out: PathBuf,
    /// `None`: from the arms' dtypes (1e-5 when both compute in fp32, 5e-2 otherwise).
    pub rtol: Option<f64>,
    /// The `verl` binary that runs each arm.
    pub verl: PathBuf,
    /// `--plugin`s given to `verl ab` itself (reward plugins, say): every arm loads them.
    pub plugins: Vec<String>,
}

/// One finished arm.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ArmRun {
    pub name: String,
    pub spec: ArmSpec,
    /// The command line of its `verl run` (what decides whether a finished arm is reused).
    pub args: Vec<String>,
    pub wall_s: f64,
    /// The resolved config of the arm (verl's schema), flattened to `key → value`.
    #[serde(skip)]
    pub config: BTreeMap<String, String>,
    #[serde(skip)]
    pub metrics: Steps,
    /// `verl plugin inspect` of the arm's backend: name, version, build.
    pub backend: serde_json::Value,
    /// Checkpoint of the last step: bytes on disk, and the save's time when logged.
    pub checkpoint_bytes: Option<u64>,
}

impl AbRequest {
    fn arm_args(&self, spec: &ArmSpec, dir: &Path) -> Vec<String> {
        let mut args = Vec::new();
        for p in &self.plugins {
            args.push("--plugin".into());
            args.push(p.clone());
        }
        if let Some(p) = &spec.plugin {
            args.push("--plugin".into());
            args.push(p.clone());
        }
        args.push("run".into());
        if let Some(j) = &self.job {
            args.push(j.display().to_string());
        }
        args.extend(self.common.iter().cloned());
        args.extend(spec.overrides.iter().cloned());
        args.push(format!("trainer.total_training_steps={}", self.steps));
        // A checkpoint of the last step, for its size and time (unless the job says otherwise).
        let sets = |k: &str| {
            self.common
                .iter()
                .chain(&spec.overrides)
                .any(|o| o.starts_with(&format!("{k}=")))
        };
        if !sets("trainer.save_freq") {
            args.push(format!("trainer.save_freq={}", self.steps));
        }
        args.push(format!(
            "trainer.default_local_dir={}",
            dir.join("ckpt").display()
        ));
        args.push("trainer.resume_mode=auto".into());
        args.push("trainer.logger=[console,file]".into());
        args
    }

    /// The arm's resolved config (as `verl config show` gives it).
    fn arm_config(&self, spec: &ArmSpec, dir: &Path) -> anyhow::Result<Config> {
        let all: Vec<String> = self.arm_args(spec, dir)[..]
            .iter()
            .skip_while(|a| *a != "run")
            .skip(1)
            .filter(|a| is_override(a))
            .cloned()
            .collect();
        Ok(match &self.job {
            Some(j) => Config::load(j, &all)?,
            None => Config::from_overrides(&all)?,
        })
    }

    /// The tolerance: the user's, else from the arms' compute dtypes.
    pub fn tolerance(&self, a: &Config, b: &Config) -> f64 {
        self.rtol
            .unwrap_or(if fp32(a) && fp32(b) { 1e-5 } else { 5e-2 })
    }

    /// Runs (or reuses) both arms and loads their metrics.
    pub fn run_arms(&self) -> anyhow::Result<(ArmRun, ArmRun, Config, Config)> {
        std::fs::create_dir_all(&self.out)
            .with_context(|| format!("creating {}", self.out.display()))?;
        let mut runs = Vec::new();
        let mut cfgs = Vec::new();
        for (name, spec) in [("a", &self.a), ("b", &self.b)] {
            let dir = self.out.join(name);
            let cfg = self
                .arm_config(spec, &dir)
                .with_context(|| format!("arm {name} (`{}`)", spec.text))?;
            let run = self.run_arm(name, spec, &dir, &cfg)?;
            runs.push(run);
            cfgs.push(cfg);
        }
        let b = runs.pop().unwrap();
        let a = runs.pop().unwrap();
        let cb = cfgs.pop().unwrap();
        let ca = cfgs.pop().unwrap();
        Ok((a, b, ca, cb))
    }

    fn run_arm(
        &self,
        name: &str,
        spec: &ArmSpec,
        dir: &Path,
        cfg: &Config,
    ) -> anyhow::Result<ArmRun> {
        let args = self.arm_args(spec, dir);
        let done_file = dir.join("done.json");
        let finished: Option<ArmRun> = std::fs::read_to_string(&done_file)
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .filter(|r: &ArmRun| r.args == args);
        let mut run = match finished {
            Some(r) => {
                eprintln!("[ab] arm {name} (`{}`): finished before, reused", spec.text);
                r
            }
            None => {
                if done_file.exists() {
                    // Finished with another command: start over.
                    std::fs::remove_dir_all(dir)
                        .with_context(|| format!("clearing {}", dir.display()))?;
                }
                std::fs::create_dir_all(dir)?;
                eprintln!("[ab] arm {name} (`{}`): verl {}", spec.text, args.join(" "));
                let log = std::fs::File::create(dir.join("run.log"))?;
                let t = Instant::now();
                let status = Command::new(&self.verl)
                    .args(&args)
                    .env("VERL_FILE_LOGGER_ROOT", dir.join("logs"))
                    .stdout(log.try_clone()?)
                    .stderr(log)
                    .status()
                    .with_context(|| format!("starting {}", self.verl.display()))?;
                if !status.success() {
                    let text = std::fs::read_to_string(dir.join("run.log")).unwrap_or_default();
                    let tail: Vec<&str> = text.lines().rev().take(5).collect();
                    bail!(
                        "arm {name} (`{}`) failed ({status}); the end of {}:\n{}",
                        spec.text,
                        dir.join("run.log").display(),
                        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                    );
                }
                let r = ArmRun {
                    name: name.to_string(),
                    spec: spec.clone(),
                    args: args.clone(),
                    wall_s: t.elapsed().as_secs_f64(),
                    config: BTreeMap::new(),
                    metrics: Steps::new(),
                    backend: serde_json::Value::Null,
                    checkpoint_bytes: None,
                };
                std::fs::write(&done_file, serde_json::to_string_pretty(&r)?)?;
                r
            }
        };
        run.metrics = load_metrics(&dir.join("logs"))?;
        if run.metrics.is_empty() {
            bail!(
                "arm {name}: no metrics under {}",
                dir.join("logs").display()
            );
        }
        run.config = flatten(&serde_json::to_value(cfg)?);
        run.checkpoint_bytes = last_checkpoint_bytes(&dir.join("ckpt"));
        run.backend = backend_header(spec, cfg);
        Ok(run)
    }
}

fn fp32(cfg: &Config) -> bool {
    let v = serde_json::to_value(cfg).unwrap_or_default();
    let a = &v["actor_rollout_ref"]["actor"];
    let is32 = |s: Option<&str>| {
        matches!(
            s.map(|s| s.to_ascii_lowercase()),
            Some(ref d) if d == "fp32" || d == "float32"
        )
    };
    match a["strategy"].as_str() {
        Some("megatron") => is32(a["megatron"]["dtype"].as_str()),
        _ => is32(a["fsdp_config"]["dtype"].as_str()),
    }
}

/// `key.path → value` of a JSON tree (lists and scalars as JSON text).
pub fn flatten(v: &serde_json::Value) -> BTreeMap<String, String> {
    fn walk(v: &serde_json::Value, prefix: &str, out: &mut BTreeMap<String, String>) {
        match v {
            serde_json::Value::Object(m) if !m.is_empty() => {
                for (k, x) in m {
                    let p = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    walk(x, &p, out);
                }
            }
            other => {
                out.insert(prefix.to_string(), other.to_string());
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(v, "", &mut out);
    out
}

/// Every metrics JSONL of the file logger under `dir`, step → name → value (a step logged twice,
/// as after a resume, keeps its last values).
pub fn load_metrics(dir: &Path) -> anyhow::Result<Steps> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "jsonl") {
                files.push(p);
            }
        }
    }
    files.sort();
    let mut out = Steps::new();
    for f in files {
        let text = std::fs::read_to_string(&f)?;
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(line)
                .with_context(|| format!("{}:{}: not JSON", f.display(), i + 1))?;
            let Some(step) = v["step"].as_u64() else {
                continue;
            };
            let entry = out.entry(step).or_default();
            if let Some(m) = v["data"].as_object() {
                for (k, x) in m {
                    if let Some(x) = x.as_f64() {
                        entry.insert(k.clone(), x);
                    }
                }
            }
        }
    }
    Ok(out)
}

/// Bytes of the newest `global_step_*` folder.
fn last_checkpoint_bytes(dir: &Path) -> Option<u64> {
    let last = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("global_step_"))
        })
        .max_by_key(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.trim_start_matches("global_step_").parse::<u64>().ok())
                .unwrap_or(0)
        })?;
    fn size(p: &Path) -> u64 {
        match std::fs::metadata(p) {
            Ok(m) if m.is_dir() => std::fs::read_dir(p)
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| size(&e.path()))
                .sum(),
            Ok(m) => m.len(),
            Err(_) => 0,
        }
    }
    Some(size(&last))
}

/// The arm's backend header (name, version, build: libtorch, device), read from the library
/// without loading it.
fn backend_header(spec: &ArmSpec, cfg: &Config) -> serde_json::Value {
    let plugin = spec.plugin.clone().unwrap_or_else(|| cfg.backend_plugin());
    let search: Vec<PathBuf> = cfg.plugins.search_path.iter().map(PathBuf::from).collect();
    match crate::loader::Loader::new(&search).inspect(&plugin) {
        Ok(i) => {
            let mut v = serde_json::to_value(&i.header).unwrap_or_default();
            v["path"] = serde_json::json!(i.path.display().to_string());
            v
        }
        Err(e) => serde_json::json!({"name": plugin, "error": e.to_string()}),
    }
}

/// The machine the arms ran on: host, CPU, cores, GPUs.
pub fn machine() -> serde_json::Value {
    let host = std::fs::read_to_string("/etc/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_default();
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let gpus: Vec<String> = Command::new("nvidia-smi")
        .args(["--query-gpu=name,memory.total", "--format=csv,noheader"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .map(|l| l.trim().to_string())
                .filter(|l| !l.is_empty())
                .collect()
        })
        .unwrap_or_default();
    serde_json::json!({"host": host, "cpu": cpu, "cores": cores, "gpus": gpus})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arms_are_backends_plugins_or_overrides() {
        let a = ArmSpec::parse("megatron actor_rollout_ref.actor.megatron.dtype=float32").unwrap();
        assert_eq!(a.plugin, None);
        assert!(a
            .overrides
            .contains(&"actor_rollout_ref.actor.strategy=megatron".to_string()));
        assert!(a
            .overrides
            .contains(&"critic.strategy=megatron".to_string()));
        assert_eq!(
            a.overrides.last().unwrap(),
            "actor_rollout_ref.actor.megatron.dtype=float32"
        );
        let b = ArmSpec::parse("./libthird.so").unwrap();
        assert_eq!(b.plugin.as_deref(), Some("./libthird.so"));
        let c = ArmSpec::parse("actor_rollout_ref.actor.optim.lr=3e-3").unwrap();
        assert_eq!(c.plugin, None);
        assert_eq!(c.overrides, vec!["actor_rollout_ref.actor.optim.lr=3e-3"]);
        assert!(ArmSpec::parse("fsdp megatron").is_err());
        assert!(ArmSpec::parse("  ").is_err());
    }
}
