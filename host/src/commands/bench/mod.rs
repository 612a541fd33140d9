//! `verl bench grpo`: one GRPO step's phases (generate, old log-prob, reference log-prob, update)
//! on a random-init real architecture through a backend plugin, timed per ABI call, with FLOP and
//! byte models for MFU and the decode HBM roofline. `--json` prints one line with the keys of
//! `bench/trl_grpo.py` so `bench/ratio_table.py` can set the two side by side.
//!
//! The phases are the trainer's own calls ([`crate::trainer`]'s `Workers`: generate, old
//! log-prob, reference log-prob, actor update), timed by the trainer's clock; what the bench adds
//! is random prompts, random advantages in place of rewards, and the measurements.
//!
//! Timing: every phase is one ABI call whose outputs cross into host memory (so the device has
//! finished), followed by the plugin's `memory` call, which synchronises the device first (the
//! update returns only metrics). Its cost (microseconds) is inside the phase's time.

mod report;
mod rm;
pub mod shape;

use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context};
use serde_json::{json, Value};
use verl_config::Config;
use verl_plugin_api::client::ActorClient;
use verl_plugin_api::{
    col, contract, Batch, GenerateOptions, InitArgs, LogProbOptions, Role, Tensor, UpdateOptions,
};

use super::single_plugin;
use crate::trainer::{on_policy_old_log_prob_unused, PhaseEnd, Timed, Workers};
use crate::{LoadedPlugin, Loader};
use report::{sig, Report, StepTimes};
use rm::BenchRm;
pub use shape::{
    decode_roofline_s, decode_step_bytes, forward_flops, generate_flops, rm_forward_flops, shape,
    train_flops, Shape, ARCHS,
};

/// Benchmarks.
#[derive(clap::Subcommand)]
pub enum BenchCmd {
    /// One GRPO step's phases on a random-init architecture: time, tokens/s, MFU, decode
    /// HBM-roofline fraction, peak memory.
    #[command(args_override_self = true)]
    Grpo(GrpoArgs),
}

#[derive(clap::Args, Debug, Clone)]
pub struct GrpoArgs {
    /// Architecture (shapes of the public config.json; random weights, nothing downloaded):
    /// tiny, qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b, llama3-8b.
    #[arg(long, default_value = "qwen2.5-0.5b")]
    pub arch: String,
    #[arg(long, default_value_t = 64)]
    pub prompts: usize,
    /// Samples per prompt.
    #[arg(long, default_value_t = 8)]
    pub n: usize,
    #[arg(long, default_value_t = 256)]
    pub prompt_len: usize,
    #[arg(long, default_value_t = 512)]
    pub response_len: usize,
    /// Generate exactly --response-len tokens (EOS does not stop a sequence).
    #[arg(long)]
    pub ignore_eos: bool,
    /// `cuda` or `cpu`.
    #[arg(long, default_value = "cuda")]
    pub device: String,
    /// GRPO steps; the last one is reported (the first warms kernels and the allocator up).
    #[arg(long, default_value_t = 2)]
    pub steps: usize,
    /// Rows per update micro-batch (`actor.ppo_micro_batch_size_per_gpu`).
    #[arg(long, default_value_t = 16)]
    pub micro_batch: usize,
    /// Rows per log-prob micro-batch (`rollout/ref.log_prob_micro_batch_size_per_gpu`).
    #[arg(long, default_value_t = 32)]
    pub logprob_micro_batch: usize,
    /// Seed of the weights (actor and reference alike), prompts and advantages.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Square size of the calibration matmul (default: the plugin's, 8192 on CUDA).
    #[arg(long)]
    pub calibrate_n: Option<usize>,
    /// Print one JSON line on stdout (the table goes to stderr).
    #[arg(long)]
    pub json: bool,
    /// Extra verl config overrides, e.g. `actor_rollout_ref.actor.fsdp_config.model_dtype=fp32`.
    #[arg(long = "set")]
    pub overrides: Vec<String>,
    /// Also score each step's rollouts with a reward model of this architecture (a
    /// `*ForSequenceClassification` head on its shapes, random weights), colocated, as the reward
    /// phase of `verl run` with `reward_model.enable`: its weights wait in host memory between
    /// steps unless `--set reward.reward_model.rollout.free_cache_engine=false`.
    #[arg(long)]
    pub rm_arch: Option<String>,
    /// Train LoRA adapters of this rank on all linear projections (`actor_rollout_ref.model.
    /// lora_rank`; alpha from `--set actor_rollout_ref.model.lora_alpha=..`, verl's default 16):
    /// the base frozen, the reference the base with adapters off. 0: every weight.
    #[arg(long, default_value_t = 0)]
    pub lora_rank: u64,
}

/// `verl bench SUBCOMMAND`; `plugins` is the CLI's `--plugin` list.
pub fn run(plugins: &[String], cmd: &BenchCmd) -> anyhow::Result<ExitCode> {
    match cmd {
        BenchCmd::Grpo(a) => grpo(plugins, a)?,
    }
    Ok(ExitCode::SUCCESS)
}

/// splitmix64: prompts and advantages without a dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// One phase's memory readings (GiB): device memory in use after it, the peak held by tensors
/// during it, and (held by tensors, free inside partly used cached segments) after it.
type PhaseMemory = (Option<f64>, Option<f64>, Option<(f64, f64)>);

fn meta_f64(b: &Batch, key: &str) -> Option<f64> {
    b.meta().get(key).and_then(Value::as_f64)
}

/// The device memory read when a phase ends (the phase-end hook of the trainer's clock): in use
/// after the phase (GiB), folded into the peak, and the allocator's peak held by tensors during
/// the phase (CUDA; the `memory` call resets it each time); then what tensors hold after the
/// phase and the allocator's cached segments that are partly in use (not releasable: the next
/// generation's KV budget counts them as used).
#[derive(Default)]
struct MemoryProbe {
    peak_mem: f64,
    peak_alloc: Option<f64>,
    source: String,
    /// The current step's readings, under the bench's phase names.
    step: Vec<(&'static str, PhaseMemory)>,
}

impl MemoryProbe {
    fn read(&mut self, actor: &mut ActorClient) -> anyhow::Result<PhaseMemory> {
        let m = actor.call("memory", &Batch::new(), &json!({}))?;
        let used = meta_f64(&m, "peak_gb").or_else(|| meta_f64(&m, "used_gb"));
        if let Some(u) = used {
            self.peak_mem = self.peak_mem.max(u);
        }
        let alloc = meta_f64(&m, "max_allocated_gb");
        if let Some(p) = alloc {
            self.peak_alloc = Some(self.peak_alloc.map_or(p, |q| q.max(p)));
        }
        if let Some(src) = m.meta().get("source").and_then(Value::as_str) {
            self.source = src.to_string();
        }
        let held = match (
            meta_f64(&m, "allocated_gb"),
            meta_f64(&m, "reserved_gb"),
            meta_f64(&m, "releasable_gb"),
        ) {
            (Some(a), Some(r), Some(f)) => Some((a, (r - a - f).max(0.0))),
            _ => None,
        };
        Ok((used, alloc, held))
    }
}

impl PhaseEnd for MemoryProbe {
    fn phase_end(&mut self, phase: &'static str, actor: &mut ActorClient) -> anyhow::Result<()> {
        let name = match phase {
            "gen" => "gen",
            "reward" => "reward",
            "old_log_prob" => "old",
            "ref" => "ref",
            "update_actor" => "update",
            _ => return Ok(()),
        };
        let m = self.read(actor)?;
        self.step.push((name, m));
        Ok(())
    }
}

/// Runs the GRPO benchmark; `plugins` is the CLI's `--plugin` list (default `fsdp`).
pub fn grpo(plugins: &[String], a: &GrpoArgs) -> anyhow::Result<()> {
    let s = shape(&a.arch)?;
    if a.prompts == 0 || a.n == 0 || a.prompt_len == 0 || a.response_len == 0 || a.steps == 0 {
        bail!("--prompts, --n, --prompt-len, --response-len and --steps must be at least 1");
    }
    if !a.ignore_eos {
        tracing::warn!(
            "without --ignore-eos responses may stop early; the FLOP/byte models assume full length"
        );
    }
    let spec = single_plugin(
        plugins,
        "fsdp",
        "`verl bench grpo` takes one backend --plugin",
    )?;
    let mut loader = Loader::new(&[]);
    let backend = loader.load(&spec)?;

    let dir = tempfile_dir()?;
    let cfg_path = dir.join("config.json");
    std::fs::write(&cfg_path, serde_json::to_string_pretty(&s.config_json())?)
        .with_context(|| format!("writing {}", cfg_path.display()))?;
    let cfg = bench_config(a, &dir, &backend)?;
    let bypass = match crate::trainer::rollout_correction(&cfg)? {
        None => false,
        Some(c) if c.bypass_mode => true,
        Some(_) => anyhow::bail!(
            "verl bench grpo: algorithm.rollout_correction supports bypass_mode only here \
             (importance weights and rejection need rewards; use `verl run`)"
        ),
    };
    // The trainer's rule: the whole step is one mini-batch unless overridden.
    let actor_cfg = &cfg.actor_rollout_ref.actor;
    let mini_batches = match actor_cfg.ppo_mini_batch_size {
        0 => u64::MAX,
        m => (a.prompts as u64).div_ceil(m),
    };
    let skip_old_pass = on_policy_old_log_prob_unused(&cfg, actor_cfg.ppo_epochs, mini_batches);
    let consistent = cfg.actor_rollout_ref.rollout.consistent_attention;
    let cfg_json = serde_json::to_value(&cfg)?;
    let extra = json!({"random_init": {"seed": a.seed}});
    let mut init = InitArgs::new(Role::Actor, cfg_json.clone());
    init.extra = extra.clone();
    let t = Instant::now();
    let actor = backend.create_actor(&init)?;
    // LoRA: the reference is the actor's base (adapters off), as in `verl run`.
    let lora = crate::trainer::lora_backend(&cfg, &backend)?;
    let reference = if lora {
        None
    } else {
        let mut init = InitArgs::new(Role::Reference, cfg_json);
        init.extra = extra;
        Some(backend.create_reference(&init)?)
    };
    let mut workers = Workers::new(actor, reference, None, MemoryProbe::default());
    workers.ref_in_actor = lora;
    let rm = match &a.rm_arch {
        Some(arch) => Some(BenchRm::create(
            &backend,
            arch,
            &cfg,
            &dir.join("rm"),
            a.seed,
        )?),
        None => None,
    };
    eprintln!(
        "[bench] {} ({} M params) built on {} by the {} backend in {:.1}s; calibrating",
        s.name,
        sig(s.n_params() as f64 / 1e6),
        a.device,
        backend.header.name,
        t.elapsed().as_secs_f64()
    );

    let mut calib_opts = json!({});
    if let Some(n) = a.calibrate_n {
        calib_opts["matmul_n"] = json!(n);
    }
    let calib = workers
        .actor
        .call("calibrate", &Batch::new(), &calib_opts)?;
    let peak_tflops = meta_f64(&calib, "peak_tflops").context("calibrate: no peak_tflops")?;
    let hbm_gbps = meta_f64(&calib, "hbm_gbps").context("calibrate: no hbm_gbps")?;
    eprintln!(
        "[bench] measured peak {} TFLOP/s (bf16 matmul), {} GB/s (device copy)",
        sig(peak_tflops),
        sig(hbm_gbps)
    );
    workers.on_phase_end.read(&mut workers.actor)?;

    let mut bench = Bench {
        a,
        s,
        workers,
        rm,
        rng: Rng(a.seed ^ 0x5EED),
        pad: (s.vocab - 1) as i64,
        eos: (s.vocab - 1) as i64,
        bypass,
        skip_old_pass,
        per_step: Vec::new(),
        exactness: None,
        digest: 0xcbf2_9ce4_8422_2325,
    };
    for step in 0..a.steps {
        bench.step(step)?;
    }

    let MemoryProbe {
        peak_mem,
        peak_alloc,
        source: mem_source,
        ..
    } = std::mem::take(&mut bench.workers.on_phase_end);
    let (rm, digest, exactness) = (&bench.rm, bench.digest, bench.exactness);
    let last = bench.per_step.last().cloned().unwrap_or_default();
    let report = Report::new(&s, a, &last, peak_tflops, hbm_gbps, lora);
    let mut out = report.json(&s, a, peak_mem, &mem_source);
    out["per_step"] = Value::Array(bench.per_step.iter().map(StepTimes::to_json).collect());
    let mut table = report.table(peak_mem, &mem_source);
    if let Some(p) = peak_alloc {
        // What TRL's script reports (`torch.cuda.max_memory_allocated`, per phase): tensors only,
        // the KV pool included, the allocator's cached segments not.
        out["peak_tensor_mem_gb"] = json!((p * 1000.0).round() / 1000.0);
        table.push_str(&format!(
            "peak memory held by tensors {p:.2} GiB (the caching allocator's max_memory_allocated, any phase)\n"
        ));
    }
    if let Some(rm) = &rm {
        let (line, j) = rm.report(peak_tflops, peak_alloc.unwrap_or(peak_mem));
        table.push_str(&line);
        out["reward_model"] = j;
    }
    out["responses_digest"] = json!(format!("{digest:016x}"));
    table.push_str(&format!(
        "responses digest {digest:016x} (FNV-1a of the warm-up step's sampled tokens; equal \
         digests: the same tokens)\n"
    ));
    if let Some((mean, max)) = exactness {
        out["rollout_logprob_abs_diff_mean"] = json!(mean);
        out["rollout_logprob_abs_diff_max"] = json!(max);
        table.push_str(&format!(
            "exactness (warm-up step): rollout log-probs vs the training forward on the same \
             tokens: mean |dlogp| {mean:.2e}, max {max:.2e} (consistent_attention {consistent})\n"
        ));
    }
    let grouper = cfg.actor_rollout_ref.actor.use_prefix_grouper;
    if grouper {
        table.push_str(
            "prefix grouper on: a prompt's samples share its forward in the log-prob and update \
             passes; MFU counts the FLOPs of the unshared workload (as the Python reference runs it)\n",
        );
    }
    out["consistent_attention"] = json!(consistent);
    out["prefix_grouper"] = json!(grouper);
    out["bypass_mode"] = json!(bypass);
    // Which backend ran (A/B runs of one workload differ only here).
    out["backend"] = json!(backend.header.name);
    if a.json {
        eprint!("{table}");
        println!("{}", serde_json::to_string(&out)?);
    } else {
        print!("{table}");
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// The bench's job: its settings as verl overrides (`--set` last), checked by the backend as
/// `verl run` checks a job.
fn bench_config(a: &GrpoArgs, dir: &Path, backend: &LoadedPlugin) -> anyhow::Result<Config> {
    let rows = a.prompts * a.n;
    let mut overrides = vec![
        format!("actor_rollout_ref.model.path={}", dir.display()),
        format!("trainer.device={}", a.device),
        format!("trainer.total_training_steps={}", a.steps),
        format!("actor_rollout_ref.rollout.n={}", a.n),
        // Every rollout decodes at once, as HF generate does for the Python reference (verl's
        // default of 256 concurrent sequences would run 512 rollouts in two waves).
        format!("actor_rollout_ref.rollout.max_num_seqs={rows}"),
        "actor_rollout_ref.rollout.temperature=1.0".into(),
        // One mini-batch = one optimizer step per rollout, as TRL's default.
        format!("actor_rollout_ref.actor.ppo_mini_batch_size={}", a.prompts),
        format!(
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={}",
            a.micro_batch.min(rows)
        ),
        format!(
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={}",
            a.logprob_micro_batch.min(rows)
        ),
        format!(
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={}",
            a.logprob_micro_batch.min(rows)
        ),
        "actor_rollout_ref.actor.use_kl_loss=true".into(),
        "actor_rollout_ref.actor.kl_loss_coef=0.001".into(),
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl".into(),
        "actor_rollout_ref.actor.optim.lr=1e-6".into(),
        // bf16 parameters (and AdamW on them), as the Python reference.
        "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16".into(),
        "actor_rollout_ref.model.enable_gradient_checkpointing=false".into(),
        // Rollout and log-prob passes share the attention kernel (exact rollout log-probs). Free
        // on the timed on-policy step, which skips the old-log-prob pass; `--set
        // actor_rollout_ref.rollout.consistent_attention=false` measures flash attention instead.
        "actor_rollout_ref.rollout.consistent_attention=true".into(),
        // The samples of a prompt share its forward in the log-prob and update passes (verl's
        // PrefixGrouper): the same results with the prompt's tokens through the weights once per
        // group; `--set actor_rollout_ref.actor.use_prefix_grouper=false` measures without.
        "actor_rollout_ref.actor.use_prefix_grouper=true".into(),
        // The rollout's log-probs, for `--set algorithm.rollout_correction.bypass_mode=true`
        // (they are the old log-probs then: no old-log-prob pass on any step).
        "actor_rollout_ref.rollout.calculate_log_probs=true".into(),
        // `--rm-arch`: the reward model's forwards take as many rows as the log-prob passes.
        format!(
            "reward_model.micro_batch_size_per_gpu={}",
            a.logprob_micro_batch.min(rows)
        ),
    ];
    if a.lora_rank > 0 {
        overrides.push(format!("actor_rollout_ref.model.lora_rank={}", a.lora_rank));
    }
    overrides.extend(a.overrides.iter().cloned());
    let mut cfg = Config::from_overrides(&overrides)?;
    // The backend's own check of the job (as `verl run` makes it). A backend without the
    // consistent attention or prefix-grouper path refuses the bench's defaults for them; unless the
    // user asked for them, the bench then measures without them (and says so) rather than report
    // a mode that did not run.
    let check = |cfg: &Config| -> anyhow::Result<Option<anyhow::Result<String>>> {
        let init = InitArgs::new(Role::Actor, serde_json::to_value(cfg)?);
        Ok(backend.validate_layout(&init))
    };
    let refused = |e: anyhow::Error| {
        e.context(format!(
            "the {} backend refused the bench job",
            backend.header.name
        ))
    };
    if let Some(Err(e)) = check(&cfg)? {
        const DEFAULTS: [&str; 2] = [
            "actor_rollout_ref.rollout.consistent_attention",
            "actor_rollout_ref.actor.use_prefix_grouper",
        ];
        let off: Vec<&str> = DEFAULTS
            .into_iter()
            .filter(|key| {
                !a.overrides
                    .iter()
                    .any(|o| o.starts_with(&format!("{key}=")))
            })
            .collect();
        if off.is_empty() {
            return Err(refused(e));
        }
        overrides.extend(off.iter().map(|key| format!("{key}=false")));
        cfg = Config::from_overrides(&overrides)?;
        if let Some(Err(e2)) = check(&cfg)? {
            return Err(refused(e2));
        }
        eprintln!(
            "[bench] the {} backend refused the bench's defaults ({e:#}); measuring with {}",
            backend.header.name,
            off.iter()
                .map(|k| format!("{k}=false"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(cfg)
}

/// The benchmark in progress: the trainer's roles (actor and reference) on the bench's clock,
/// and what the report needs from every step.
struct Bench<'a> {
    a: &'a GrpoArgs,
    s: Shape,
    workers: Workers<MemoryProbe>,
    rm: Option<BenchRm>,
    rng: Rng,
    pad: i64,
    eos: i64,
    bypass: bool,
    /// The trainer's rule for an on-policy step (no old-log-prob pass).
    skip_old_pass: bool,
    per_step: Vec<StepTimes>,
    /// The warm-up step's rollout log-probs against the training forward's: (mean, max) gap.
    exactness: Option<(f64, f64)>,
    /// FNV-1a over the warm-up step's sampled response tokens: two builds (or settings) that
    /// should sample the same tokens from the same seed print the same digest. Later steps sample
    /// from weights an update changed, and a GPU update is not bit-reproducible (atomic adds in
    /// backward kernels), so they are left out.
    digest: u64,
}

impl Bench<'_> {
    /// One GRPO step through the trainer's phases, and its line on stderr.
    fn step(&mut self, step: usize) -> anyhow::Result<()> {
        let (a, s, pad, eos, bypass) = (self.a, self.s, self.pad, self.eos, self.bypass);
        let lp_opts = LogProbOptions {
            temperature: 1.0,
            with_entropy: false,
            base_model: false,
        };
        // As the trainer: an on-policy step skips the old-log-prob pass (the warm-up step keeps
        // it, to measure the rollout's log-prob exactness against it).
        let skip_old = step > 0 && (self.skip_old_pass || bypass);
        let Bench {
            workers,
            rm,
            rng,
            digest,
            exactness,
            ..
        } = self;
        let (gen, metrics) = workers.timed("step", |w| {
            let prompts = w.timed("other", |_| Ok(random_prompts(rng, a, &s, pad)))?;
            let opts = GenerateOptions {
                n: a.n as u32,
                max_new_tokens: a.response_len as u32,
                temperature: 1.0,
                top_p: 1.0,
                top_k: -1,
                do_sample: true,
                seed: Some(a.seed.wrapping_add(step as u64)),
                eos_token_ids: vec![eos],
                pad_token_id: pad,
                ignore_eos: a.ignore_eos,
                // The warm-up step also returns the sampler's log-probs, to measure how far they
                // are from the training forward's on the same tokens; timed steps skip that work.
                return_log_probs: step == 0 || bypass,
                ..Default::default()
            };
            let mut gen = w.generate(&prompts, &opts)?;
            if step == 0 {
                for &tok in &gen.tensor::<i64>(col::RESPONSES)?.data {
                    for byte in tok.to_le_bytes() {
                        *digest = (*digest ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
                    }
                }
            }
            if let Some(rm) = rm.as_mut() {
                w.timed("reward", |_| rm.score(&gen))?;
            }
            if !skip_old {
                let (old, _) = w.old_log_prob(&mut gen, &lp_opts)?;
                if step == 0 {
                    *exactness = Some(logprob_gap(&gen, &old)?);
                }
            }
            let ref_lp = w
                .ref_log_prob(&mut gen, &lp_opts)?
                .context("the bench's reference role")?;
            w.timed("other", |_| advantages(&mut gen, &ref_lp, a.n, rng, bypass))?;
            let metrics = w.update_actor(
                &gen,
                &UpdateOptions {
                    global_step: step as u64 + 1,
                    temperature: Some(1.0),
                    extra: json!({ "entropy_metric": skip_old, "bypass_mode": bypass }),
                },
            )?;
            Ok((gen, metrics))
        })?;
        let times = StepTimes::from_clock(&self.workers.take_timings(), skip_old);
        let mem = std::mem::take(&mut self.workers.on_phase_end.step);
        let mut loss: Vec<String> = metrics
            .iter()
            .filter(|(k, _)| {
                matches!(
                    k.as_str(),
                    "actor/pg_loss" | "actor/kl_loss" | "actor/grad_norm"
                )
            })
            .map(|(k, v)| format!("{k}={v:.4}"))
            .collect();
        let used: Vec<String> = mem
            .iter()
            .filter_map(|(phase, (m, _, _))| m.map(|m| format!("{phase} {m:.1}")))
            .collect();
        if !used.is_empty() {
            loss.push(format!("memory GiB after {}", used.join(", ")));
        }
        let held: Vec<String> = mem
            .iter()
            .filter_map(|(phase, (_, p, _))| p.map(|p| format!("{phase} {p:.1}")))
            .collect();
        if !held.is_empty() {
            loss.push(format!("tensor peak GiB in {}", held.join(", ")));
        }
        let after: Vec<String> = mem
            .iter()
            .filter_map(|(phase, (_, _, h))| {
                h.map(|(a, stuck)| format!("{phase} {a:.1} + {stuck:.1}"))
            })
            .collect();
        if !after.is_empty() {
            loss.push(format!(
                "held + partly-used cache GiB after {}",
                after.join(", ")
            ));
        }
        // What the generation spent outside its decode steps' replays (CUDA only).
        if let Some(n) = meta_f64(&gen, "rollout/cuda_graphs").filter(|&n| n > 0.0) {
            loss.push(format!(
                "graphs={n} captured in {:.3}s, {} graphed steps",
                meta_f64(&gen, "rollout/cuda_graph_capture_s").unwrap_or(0.0),
                meta_f64(&gen, "rollout/cuda_graph_steps").unwrap_or(0.0)
            ));
        }
        // The KV pool the call ran with (a pool too small for every sequence at once makes the
        // engine run fewer at a time, or preempt): a later step can get less than the first,
        // once the optimizer's state exists.
        if let Some(tokens) = meta_f64(&gen, "rollout/kv_cache_tokens") {
            let mut kv = format!("kv pool {tokens:.0} tokens");
            if let Some(gb) = meta_f64(&gen, "rollout/kv_budget_gb") {
                kv.push_str(&format!(" (budget {gb:.1} GiB)"));
            }
            for (key, name) in [
                ("rollout/max_running", "max running"),
                ("rollout/preemptions", "preemptions"),
            ] {
                if let Some(v) = meta_f64(&gen, key) {
                    kv.push_str(&format!(", {name} {v:.0}"));
                }
            }
            loss.push(kv);
        }
        eprintln!(
            "[bench] step {}/{}: gen {:.3}s old {:.3}s ref {:.3}s update {:.3}s step {:.3}s {}",
            step + 1,
            a.steps,
            times.gen,
            times.old_log_prob,
            times.reference,
            times.update,
            times.step,
            loss.join(" ")
        );
        self.per_step.push(times);
        Ok(())
    }
}

/// `--prompts` prompts of `--prompt-len` random token ids (never the pad/EOS id), left-padded.
fn random_prompts(rng: &mut Rng, a: &GrpoArgs, s: &Shape, pad: i64) -> Batch {
    let prompts: Vec<Vec<i64>> = (0..a.prompts)
        .map(|_| {
            (0..a.prompt_len)
                .map(|_| 1 + (rng.next() % (s.vocab - 2)) as i64)
                .collect()
        })
        .collect();
    let refs: Vec<&[i64]> = prompts.iter().map(Vec::as_slice).collect();
    contract::prompt_batch(&refs, pad)
}

/// Mean and max `|rollout log-prob − training log-prob|` over the response tokens.
fn logprob_gap(gen: &Batch, train: &Tensor<f32>) -> anyhow::Result<(f64, f64)> {
    let rollout = gen.tensor::<f32>(col::ROLLOUT_LOG_PROBS)?;
    let mask = gen.tensor::<i64>(col::RESPONSE_MASK)?;
    let (mut sum, mut n, mut max) = (0.0f64, 0usize, 0.0f64);
    for ((&r, &t), &m) in rollout.data.iter().zip(&train.data).zip(&mask.data) {
        if m != 0 {
            let d = (r as f64 - t as f64).abs();
            sum += d;
            n += 1;
            max = max.max(d);
        }
    }
    Ok((sum / n.max(1) as f64, max))
}

/// The update's advantages in place of rewards: a GRPO-like one per row (random, centred within
/// each prompt's group of n), broadcast over the response tokens. In bypass mode the rollout's
/// log-probs become the old log-probs (the PPO anchor).
fn advantages(
    batch: &mut Batch,
    ref_lp: &Tensor<f32>,
    n: usize,
    rng: &mut Rng,
    bypass: bool,
) -> anyhow::Result<()> {
    let (rows, rl) = (ref_lp.rows(), ref_lp.cols());
    let mut per_row: Vec<f64> = (0..rows).map(|_| rng.unit() * 2.0 - 1.0).collect();
    for g in per_row.chunks_mut(n.max(1)) {
        let mean = g.iter().sum::<f64>() / g.len() as f64;
        g.iter_mut().for_each(|x| *x -= mean);
    }
    let adv: Vec<f32> = per_row
        .iter()
        .flat_map(|&x| std::iter::repeat_n(x as f32, rl))
        .collect();
    batch.insert_tensor(col::ADVANTAGES, &[rows, rl], &adv);
    if bypass {
        let rl = batch.tensor::<f32>(col::ROLLOUT_LOG_PROBS)?;
        batch.insert_tensor(col::OLD_LOG_PROBS, &[rl.rows(), rl.cols()], &rl.data);
    }
    Ok(())
}

fn tempfile_dir() -> anyhow::Result<std::path::PathBuf> {
    let base = std::env::temp_dir().join(format!("verl-bench-{}", std::process::id()));
    std::fs::create_dir_all(&base).with_context(|| format!("creating {}", base.display()))?;
    Ok(base)
}
