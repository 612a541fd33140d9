//! `verl bench grpo`: one GRPO step's phases (generate, old log-prob, reference log-prob, update)
//! on a random-init real architecture through a backend plugin, timed per ABI call, with FLOP and
//! byte models for MFU and the decode HBM roofline. `--json` prints one line with the keys of
//! `bench/trl_grpo.py` so `bench/ratio_table.py` can set the two side by side.
//!
//! Timing: every phase is one ABI call whose outputs cross into host memory (so the device has
//! finished), followed by the plugin's `memory` call, which synchronises the device first (the
//! update returns only metrics). Its cost (microseconds) is inside the phase's time.

use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context};
use serde_json::{json, Value};
use verl_config::Config;
use verl_plugin_api::{
    col, contract, Batch, GenerateOptions, InitArgs, LogProbOptions, Role, UpdateOptions,
};

use super::single_plugin;
use crate::Loader;

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
}

/// The shapes of one architecture (from its public config.json).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shape {
    pub name: &'static str,
    pub model_type: &'static str,
    pub vocab: u64,
    pub hidden: u64,
    pub intermediate: u64,
    pub layers: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub max_positions: u64,
    pub rope_theta: f64,
    pub rms_norm_eps: f64,
    pub tie_embeddings: bool,
}

/// The same numbers as `bench/trl_grpo.py`'s ARCHS.
pub const ARCHS: &[Shape] = &[
    Shape {
        name: "tiny",
        model_type: "qwen2",
        vocab: 1024,
        hidden: 64,
        intermediate: 128,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        max_positions: 4096,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-6,
        tie_embeddings: false,
    },
    Shape {
        name: "qwen2.5-0.5b",
        model_type: "qwen2",
        vocab: 151936,
        hidden: 896,
        intermediate: 4864,
        layers: 24,
        heads: 14,
        kv_heads: 2,
        max_positions: 32768,
        rope_theta: 1000000.0,
        rms_norm_eps: 1e-6,
        tie_embeddings: true,
    },
    Shape {
        name: "qwen2.5-1.5b",
        model_type: "qwen2",
        vocab: 151936,
        hidden: 1536,
        intermediate: 8960,
        layers: 28,
        heads: 12,
        kv_heads: 2,
        max_positions: 32768,
        rope_theta: 1000000.0,
        rms_norm_eps: 1e-6,
        tie_embeddings: true,
    },
    Shape {
        name: "qwen2.5-7b",
        model_type: "qwen2",
        vocab: 152064,
        hidden: 3584,
        intermediate: 18944,
        layers: 28,
        heads: 28,
        kv_heads: 4,
        max_positions: 32768,
        rope_theta: 1000000.0,
        rms_norm_eps: 1e-6,
        tie_embeddings: false,
    },
    Shape {
        name: "llama3-8b",
        model_type: "llama",
        vocab: 128256,
        hidden: 4096,
        intermediate: 14336,
        layers: 32,
        heads: 32,
        kv_heads: 8,
        max_positions: 8192,
        rope_theta: 500000.0,
        rms_norm_eps: 1e-5,
        tie_embeddings: false,
    },
];

pub fn shape(name: &str) -> anyhow::Result<Shape> {
    ARCHS
        .iter()
        .copied()
        .find(|s| s.name == name)
        .with_context(|| {
            let names: Vec<&str> = ARCHS.iter().map(|s| s.name).collect();
            format!("--arch {name:?}: expected one of {}", names.join(", "))
        })
}

/// bf16: two bytes per parameter and per cached K/V element.
const BF16_BYTES: u64 = 2;

impl Shape {
    pub fn head_dim(&self) -> u64 {
        self.hidden / self.heads
    }
    /// Width of the attention (heads × head_dim).
    pub fn attn_dim(&self) -> u64 {
        self.heads * self.head_dim()
    }
    fn kv_dim(&self) -> u64 {
        self.kv_heads * self.head_dim()
    }
    fn qkv_bias(&self) -> bool {
        self.model_type == "qwen2"
    }
    /// Weights of the matmuls one token goes through: every decoder layer's projections plus the
    /// LM head (tied or not: the head matmul runs either way). The embedding lookup is no matmul.
    pub fn matmul_params(&self) -> u64 {
        let (h, a, kv, i) = (
            self.hidden,
            self.attn_dim(),
            self.kv_dim(),
            self.intermediate,
        );
        let layer = h * a + 2 * h * kv + a * h + 3 * h * i;
        self.layers * layer + self.vocab * h
    }
    /// Every parameter, each once (what `sum(p.numel() for p in model.parameters())` counts).
    pub fn n_params(&self) -> u64 {
        let (h, a, kv) = (self.hidden, self.attn_dim(), self.kv_dim());
        let bias = if self.qkv_bias() { a + 2 * kv } else { 0 };
        let norms = 2 * h;
        let head = if self.tie_embeddings {
            0
        } else {
            self.vocab * h
        };
        self.vocab * h + self.layers * (self.matmul_params_per_layer() + bias + norms) + h + head
    }
    fn matmul_params_per_layer(&self) -> u64 {
        (self.matmul_params() - self.vocab * self.hidden) / self.layers
    }
    /// Bytes of K and V cached per token (all layers).
    pub fn kv_bytes_per_token(&self) -> u64 {
        2 * self.layers * self.kv_dim() * BF16_BYTES
    }

    /// HF `config.json` of this architecture (EOS = pad = the last id, like `bench/trl_grpo.py`).
    pub fn config_json(&self) -> Value {
        let class = match self.model_type {
            "llama" => "LlamaForCausalLM",
            _ => "Qwen2ForCausalLM",
        };
        let mut c = json!({
            "architectures": [class],
            "model_type": self.model_type,
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "max_position_embeddings": self.max_positions,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_embeddings,
            "hidden_act": "silu",
            "initializer_range": 0.02,
            "torch_dtype": "bfloat16",
            "eos_token_id": self.vocab - 1,
            "pad_token_id": self.vocab - 1,
            "use_cache": true,
        });
        if self.model_type == "llama" {
            c["attention_bias"] = json!(false);
            c["mlp_bias"] = json!(false);
        }
        c
    }
}

/// FLOPs of one forward pass over `seqs` sequences of `len` tokens:
/// `2·N·tokens` (N = [`Shape::matmul_params`]) plus attention `4·layers·attn_dim·len²` per sequence
/// (Q·Kᵀ and P·V, the full square counted, causal masking not halved — the PaLM/Megatron convention).
pub fn forward_flops(s: &Shape, seqs: u64, len: u64) -> f64 {
    let linear = 2.0 * s.matmul_params() as f64 * (seqs * len) as f64;
    let attn = 4.0 * (s.layers * s.attn_dim()) as f64 * (len * len) as f64 * seqs as f64;
    linear + attn
}

/// FLOPs of a reward model's forward over `seqs` sequences of `len` tokens: [`forward_flops`]
/// with a one-output score head instead of the vocabulary head.
pub fn rm_forward_flops(s: &Shape, seqs: u64, len: u64) -> f64 {
    let tokens = (seqs * len) as f64;
    forward_flops(s, seqs, len) - 2.0 * (s.vocab * s.hidden) as f64 * tokens
        + 2.0 * s.hidden as f64 * tokens
}

/// FLOPs of a training pass (forward + backward = 3 × forward): `6·N·tokens +
/// 12·layers·attn_dim·len²` per sequence. Activation recompute is not counted.
pub fn train_flops(s: &Shape, seqs: u64, len: u64) -> f64 {
    3.0 * forward_flops(s, seqs, len)
}

/// FLOPs of generating `resp` tokens for each of `seqs` sequences after a `prompt`-token prefill:
/// the prefill ([`forward_flops`] over the prompt) yields the first token; each of the `resp − 1`
/// decode steps runs one token through the matmuls (`2·N`) and attends over its context
/// (`4·layers·attn_dim·ctx`, ctx = prompt + k for step k = 1..resp−1).
pub fn generate_flops(s: &Shape, seqs: u64, prompt: u64, resp: u64) -> f64 {
    let steps = resp.saturating_sub(1);
    let ctx_sum = (steps * prompt + steps * (steps + 1) / 2) as f64;
    forward_flops(s, seqs, prompt)
        + seqs as f64
            * (2.0 * s.matmul_params() as f64 * steps as f64
                + 4.0 * (s.layers * s.attn_dim()) as f64 * ctx_sum)
}

/// Bytes a decode step must read from device memory at least: every matmul weight once (bf16)
/// plus the K/V cache of `seqs` sequences at context `ctx`.
pub fn decode_step_bytes(s: &Shape, seqs: u64, ctx: f64) -> f64 {
    (s.matmul_params() * BF16_BYTES) as f64 + seqs as f64 * ctx * s.kv_bytes_per_token() as f64
}

/// The decode steps' memory-roofline time: `(resp − 1)` steps × [`decode_step_bytes`] at the mean
/// context of those steps (prompt + resp/2) over the bandwidth `gbps` (1e9 B/s).
pub fn decode_roofline_s(s: &Shape, seqs: u64, prompt: u64, resp: u64, gbps: f64) -> f64 {
    let steps = resp.saturating_sub(1);
    let mean_ctx = prompt as f64 + resp as f64 / 2.0;
    steps as f64 * decode_step_bytes(s, seqs, mean_ctx) / (gbps * 1e9)
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

const PHASES: [&str; 4] = ["gen", "old_log_prob", "ref", "update"];

#[derive(Debug, Clone, Default)]
struct StepTimes {
    gen: f64,
    old_log_prob: f64,
    /// On-policy step: the old-log-prob pass did not run (see `trainer.skip_on_policy_old_log_prob`).
    old_skipped: bool,
    reference: f64,
    other: f64,
    update: f64,
    step: f64,
}

impl StepTimes {
    fn phase(&self, name: &str) -> f64 {
        match name {
            "gen" => self.gen,
            "old_log_prob" => self.old_log_prob,
            "ref" => self.reference,
            "update" => self.update,
            "other" => self.other,
            _ => self.step,
        }
    }
    fn to_json(&self) -> Value {
        json!({
            "gen": round4(self.gen), "old_log_prob": round4(self.old_log_prob),
            "old_log_prob_skipped": self.old_skipped,
            "ref": round4(self.reference), "other": round4(self.other),
            "update": round4(self.update), "step": round4(self.step),
        })
    }
}

/// Three significant digits at least, one decimal for large values.
fn sig(x: f64) -> String {
    if x.abs() >= 100.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.3}")
    }
}

fn round4(x: f64) -> f64 {
    (x * 1e4).round() / 1e4
}

/// One phase's memory readings (GiB): device memory in use after it, the peak held by tensors
/// during it, and (held by tensors, free inside partly used cached segments) after it.
type PhaseMemory = (Option<f64>, Option<f64>, Option<(f64, f64)>);

fn meta_f64(b: &Batch, key: &str) -> Option<f64> {
    b.meta().get(key).and_then(Value::as_f64)
}

/// `verl bench SUBCOMMAND`; `plugins` is the CLI's `--plugin` list.
pub fn run(plugins: &[String], cmd: &BenchCmd) -> anyhow::Result<ExitCode> {
    match cmd {
        BenchCmd::Grpo(a) => grpo(plugins, a)?,
    }
    Ok(ExitCode::SUCCESS)
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
    let bypass = match crate::trainer::rollout_correction(&cfg)? {
        None => false,
        Some(c) if c.bypass_mode => true,
        Some(_) => anyhow::bail!(
            "verl bench grpo: algorithm.rollout_correction supports bypass_mode only here \
             (importance weights and rejection need rewards; use `verl run`)"
        ),
    };
    // The trainer's rule (one mini-batch = the whole step here unless overridden).
    let skip_old_pass = {
        let actor = &cfg.actor_rollout_ref.actor;
        cfg.trainer.skip_on_policy_old_log_prob
            && actor.ppo_epochs == 1
            && actor.ppo_mini_batch_size >= a.prompts as u64
            && !cfg.algorithm.use_kl_in_reward
    };
    let consistent = cfg.actor_rollout_ref.rollout.consistent_attention;
    let cfg_json = serde_json::to_value(&cfg)?;
    let extra = json!({"random_init": {"seed": a.seed}});
    let mut init = InitArgs::new(Role::Actor, cfg_json.clone());
    init.extra = extra.clone();
    let t = Instant::now();
    let mut actor = backend.create_actor(&init)?;
    let mut init = InitArgs::new(Role::Reference, cfg_json);
    init.extra = extra;
    let mut reference = backend.create_reference(&init)?;
    let mut rm = match &a.rm_arch {
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
    let calib = actor.call("calibrate", &Batch::new(), &calib_opts)?;
    let peak_tflops = meta_f64(&calib, "peak_tflops").context("calibrate: no peak_tflops")?;
    let hbm_gbps = meta_f64(&calib, "hbm_gbps").context("calibrate: no hbm_gbps")?;
    eprintln!(
        "[bench] measured peak {} TFLOP/s (bf16 matmul), {} GB/s (device copy)",
        sig(peak_tflops),
        sig(hbm_gbps)
    );

    let mut peak_mem: f64 = 0.0;
    let mut peak_alloc: Option<f64> = None;
    let mut mem_source = String::new();
    // The device memory in use after a phase (GiB), folded into the peak, and the allocator's
    // peak held by tensors during the phase (CUDA; the `memory` call resets it each time); then
    // what tensors hold after the phase and the allocator's cached segments that are partly in
    // use (not releasable: the next generation's KV budget counts them as used).
    let mut probe =
        |actor: &mut verl_plugin_api::client::ActorClient| -> anyhow::Result<PhaseMemory> {
            let m = actor.call("memory", &Batch::new(), &json!({}))?;
            let used = meta_f64(&m, "peak_gb").or_else(|| meta_f64(&m, "used_gb"));
            if let Some(u) = used {
                peak_mem = peak_mem.max(u);
            }
            let alloc = meta_f64(&m, "max_allocated_gb");
            if let Some(p) = alloc {
                peak_alloc = Some(peak_alloc.map_or(p, |q| q.max(p)));
            }
            if let Some(src) = m.meta().get("source").and_then(Value::as_str) {
                mem_source = src.to_string();
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
        };
    probe(&mut actor)?;

    let mut rng = Rng(a.seed ^ 0x5EED);
    let (pad, eos) = ((s.vocab - 1) as i64, (s.vocab - 1) as i64);
    let mut per_step = Vec::new();
    let mut exactness: Option<(f64, f64)> = None;
    // FNV-1a over the warm-up step's sampled response tokens: two builds (or settings) that
    // should sample the same tokens from the same seed print the same digest. Later steps sample
    // from weights an update changed, and a GPU update is not bit-reproducible (atomic adds in
    // backward kernels), so they are left out.
    let mut digest: u64 = 0xcbf2_9ce4_8422_2325;
    for step in 0..a.steps {
        let t_step = Instant::now();
        let mut other = 0.0;
        let t = Instant::now();
        let prompts: Vec<Vec<i64>> = (0..a.prompts)
            .map(|_| {
                (0..a.prompt_len)
                    .map(|_| 1 + (rng.next() % (s.vocab - 2)) as i64)
                    .collect()
            })
            .collect();
        let refs: Vec<&[i64]> = prompts.iter().map(Vec::as_slice).collect();
        let batch = contract::prompt_batch(&refs, pad);
        other += t.elapsed().as_secs_f64();

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
            // The warm-up step also returns the sampler's log-probs, to measure how far they are
            // from the training forward's on the same tokens; timed steps skip that work.
            return_log_probs: step == 0 || bypass,
            ..Default::default()
        };
        let t = Instant::now();
        let gen = actor.generate(&batch, &opts)?;
        let mut mem = vec![("gen", probe(&mut actor)?)];
        let t_gen = t.elapsed().as_secs_f64();
        if step == 0 {
            for &tok in &gen.tensor::<i64>(col::RESPONSES)?.data {
                for byte in tok.to_le_bytes() {
                    digest = (digest ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
                }
            }
        }

        if let Some(rm) = rm.as_mut() {
            rm.score(&gen)?;
            mem.push(("reward", probe(&mut actor)?));
        }

        let lp_opts = LogProbOptions {
            temperature: 1.0,
            with_entropy: false,
        };
        // As the trainer: an on-policy step skips the old-log-prob pass (the warm-up step keeps
        // it, to measure the rollout's log-prob exactness against it).
        let skip_old = step > 0 && (skip_old_pass || bypass);
        let (old, t_old) = if skip_old {
            (None, 0.0)
        } else {
            let t = Instant::now();
            let old = actor.compute_log_prob(&gen, &lp_opts)?;
            mem.push(("old", probe(&mut actor)?));
            (Some(old), t.elapsed().as_secs_f64())
        };

        if let (0, Some(old)) = (step, &old) {
            exactness = Some(logprob_gap(&gen, old)?);
        }
        let t = Instant::now();
        let rf = reference.compute_log_prob(&gen, &lp_opts)?;
        mem.push(("ref", probe(&mut actor)?));
        let t_ref = t.elapsed().as_secs_f64();

        let t = Instant::now();
        let mut upd = update_batch(&gen, old.as_ref(), &rf, a.n, &mut rng)?;
        if bypass {
            // Bypass mode: the rollout's log-probs are the PPO anchor.
            let rl = gen.tensor::<f32>(col::ROLLOUT_LOG_PROBS)?;
            upd.insert_tensor(col::OLD_LOG_PROBS, &[rl.rows(), rl.cols()], &rl.data);
        }
        other += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let metrics = actor.update(
            &upd,
            &UpdateOptions {
                global_step: step as u64 + 1,
                temperature: Some(1.0),
                extra: json!({ "entropy_metric": skip_old, "bypass_mode": bypass }),
            },
        )?;
        mem.push(("update", probe(&mut actor)?));
        let t_upd = t.elapsed().as_secs_f64();
        let times = StepTimes {
            gen: t_gen,
            old_log_prob: t_old,
            old_skipped: skip_old,
            reference: t_ref,
            other,
            update: t_upd,
            step: t_step.elapsed().as_secs_f64(),
        };
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
        per_step.push(times);
    }

    let last = per_step.last().cloned().unwrap_or_default();
    let report = Report::new(&s, a, &last, peak_tflops, hbm_gbps);
    let mut out = report.json(&s, a, peak_mem, &mem_source);
    out["per_step"] = Value::Array(per_step.iter().map(StepTimes::to_json).collect());
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

/// Mean and max `|rollout log-prob − training log-prob|` over the response tokens.
fn logprob_gap(gen: &Batch, old: &Batch) -> anyhow::Result<(f64, f64)> {
    let rollout = gen.tensor::<f32>(col::ROLLOUT_LOG_PROBS)?;
    let train = old.tensor::<f32>(col::LOG_PROBS)?;
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

/// The update's input: the rollout plus old/ref log-probs and a GRPO-like advantage per row
/// (random, centred within each prompt's group of n), broadcast over the response tokens.
fn update_batch(
    gen: &Batch,
    old: Option<&Batch>,
    rf: &Batch,
    n: usize,
    rng: &mut Rng,
) -> anyhow::Result<Batch> {
    let mut b = gen.clone();
    let ref_lp = rf.tensor::<f32>(col::LOG_PROBS)?;
    let (rows, rl) = (ref_lp.rows(), ref_lp.cols());
    let shape = [rows, rl];
    if let Some(old) = old {
        let old_lp = old.tensor::<f32>(col::LOG_PROBS)?;
        b.insert_tensor(col::OLD_LOG_PROBS, &shape, &old_lp.data);
    }
    b.insert_tensor(col::REF_LOG_PROBS, &shape, &ref_lp.data);
    let mut per_row: Vec<f64> = (0..rows).map(|_| rng.unit() * 2.0 - 1.0).collect();
    for g in per_row.chunks_mut(n.max(1)) {
        let mean = g.iter().sum::<f64>() / g.len() as f64;
        g.iter_mut().for_each(|x| *x -= mean);
    }
    let adv: Vec<f32> = per_row
        .iter()
        .flat_map(|&x| std::iter::repeat_n(x as f32, rl))
        .collect();
    b.insert_tensor(col::ADVANTAGES, &shape, &adv);
    Ok(b)
}

/// FLOPs, throughput and utilisation of one step.
struct Report {
    times: StepTimes,
    flops: [f64; 4],
    tokens: [u64; 4],
    peak_tflops: f64,
    hbm_gbps: f64,
    roofline_s: f64,
}

impl Report {
    fn new(s: &Shape, a: &GrpoArgs, t: &StepTimes, peak_tflops: f64, hbm_gbps: f64) -> Report {
        let rows = (a.prompts * a.n) as u64;
        let (p, r) = (a.prompt_len as u64, a.response_len as u64);
        let seq = p + r;
        let fwd = forward_flops(s, rows, seq);
        Report {
            times: t.clone(),
            flops: [
                generate_flops(s, rows, p, r),
                fwd,
                fwd,
                train_flops(s, rows, seq),
            ],
            tokens: [rows * r, rows * seq, rows * seq, rows * seq],
            peak_tflops,
            hbm_gbps,
            roofline_s: decode_roofline_s(s, rows, p, r, hbm_gbps),
        }
    }
    fn mfu(&self, flops: f64, secs: f64) -> f64 {
        if secs > 0.0 {
            flops / secs / (self.peak_tflops * 1e12)
        } else {
            0.0
        }
    }
    /// FLOPs of the phases that ran.
    fn step_flops(&self) -> f64 {
        let old = if self.times.old_skipped {
            self.flops[1]
        } else {
            0.0
        };
        self.flops.iter().sum::<f64>() - old
    }
    fn decode_fraction(&self) -> f64 {
        if self.times.gen > 0.0 {
            self.roofline_s / self.times.gen
        } else {
            0.0
        }
    }
    fn table(&self, peak_mem: f64, mem_source: &str) -> String {
        let mut o = format!(
            "{:<13} {:>9} {:>12} {:>7} {:>9}\n",
            "phase", "seconds", "tokens/s", "MFU", "HBM roof"
        );
        for (i, name) in PHASES.iter().enumerate() {
            let secs = self.times.phase(name);
            if i == 1 && self.times.old_skipped {
                o.push_str(&format!(
                    "{name:<13} {:>9} (on-policy step, or bypass mode: the update takes its own or the rollout's log-probs, as the trainer)\n",
                    "skipped"
                ));
                continue;
            }
            let roof = if i == 0 {
                format!("{:.1}%", 100.0 * self.decode_fraction())
            } else {
                "-".into()
            };
            o.push_str(&format!(
                "{:<13} {:>9.3} {:>12.0} {:>6.1}% {:>9}\n",
                name,
                secs,
                self.tokens[i] as f64 / secs.max(1e-12),
                100.0 * self.mfu(self.flops[i], secs),
                roof
            ));
        }
        let total = self.step_flops();
        o.push_str(&format!(
            "{:<13} {:>9.3} {:>12.0} {:>6.1}% {:>9}\n",
            "step",
            self.times.step,
            self.tokens[3] as f64 / self.times.step.max(1e-12),
            100.0 * self.mfu(total, self.times.step),
            "-"
        ));
        o.push_str(&format!(
            "peak: {} TFLOP/s bf16 matmul, {} GB/s copy (measured); peak memory {:.2} GiB ({mem_source}, sampled after each phase)\n",
            sig(self.peak_tflops), sig(self.hbm_gbps), peak_mem
        ));
        o.push_str(
            "FLOPs: forward 2·N·tokens + 4·layers·attn_dim·len² per sequence; update 3× forward; gen = prefill forward + decode 2·N + 4·layers·attn_dim·ctx per token (N = matmul weights incl. LM head). HBM roof: decode steps × (weight bytes + KV bytes at mean context) / bandwidth, over the whole gen time (prefill included).\n",
        );
        o
    }
    fn json(&self, s: &Shape, a: &GrpoArgs, peak_mem: f64, mem_source: &str) -> Value {
        let rows = (a.prompts * a.n) as u64;
        let t = &self.times;
        let total = self.step_flops();
        let tokens = rows * (a.prompt_len + a.response_len) as u64;
        let resp = rows * a.response_len as u64;
        json!({
            "system": "verl-rs",
            "arch": a.arch,
            "device": a.device,
            "dtype": "bf16",
            "prompts": a.prompts,
            "n": a.n,
            "prompt_len": a.prompt_len,
            "response_len": a.response_len,
            "ignore_eos": a.ignore_eos,
            "micro_batch": a.micro_batch,
            "logprob_micro_batch": a.logprob_micro_batch,
            "steps": a.steps,
            "n_params": s.n_params(),
            "gen": round4(t.gen),
            "old_log_prob": round4(t.old_log_prob),
            "old_log_prob_skipped": t.old_skipped,
            "ref": round4(t.reference),
            "other": round4(t.other),
            "update": round4(t.update),
            "step": round4(t.step),
            "tokens": tokens,
            "response_tokens": resp,
            "tokens_per_s": (tokens as f64 / t.step.max(1e-12) * 10.0).round() / 10.0,
            "gen_tokens_per_s": (resp as f64 / t.gen.max(1e-12) * 10.0).round() / 10.0,
            "peak_mem_gb": (peak_mem * 1000.0).round() / 1000.0,
            "peak_mem_source": format!("{mem_source}, max over samples after each phase"),
            "mfu_gen": self.mfu(self.flops[0], t.gen),
            "mfu_old_log_prob": self.mfu(self.flops[1], t.old_log_prob),
            "mfu_ref": self.mfu(self.flops[2], t.reference),
            "mfu_update": self.mfu(self.flops[3], t.update),
            "mfu_step": self.mfu(total, t.step),
            "decode_hbm_fraction": self.decode_fraction(),
            "decode_roofline_s": self.roofline_s,
            "peak_tflops": self.peak_tflops,
            "hbm_gbps": self.hbm_gbps,
            "flops": {"gen": self.flops[0], "old_log_prob": self.flops[1], "ref": self.flops[2], "update": self.flops[3]},
        })
    }
}

/// The reward model of `--rm-arch`: a backend reward_model role on random weights.
struct BenchRm {
    shape: Shape,
    client: verl_plugin_api::client::RewardModelClient,
    offload: bool,
    /// Per timed step: (onload, score, offload) seconds, and the rows and tokens scored.
    times: Vec<(f64, f64, f64)>,
    rows: usize,
    tokens: usize,
}

impl BenchRm {
    fn create(
        backend: &crate::LoadedPlugin,
        arch: &str,
        cfg: &Config,
        dir: &std::path::Path,
        seed: u64,
    ) -> anyhow::Result<BenchRm> {
        let shape = shape(arch)?;
        std::fs::create_dir_all(dir)?;
        let mut c = shape.config_json();
        c["architectures"] = json!([match shape.model_type {
            "llama" => "LlamaForSequenceClassification",
            _ => "Qwen2ForSequenceClassification",
        }]);
        c["num_labels"] = json!(1);
        std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&c)?)?;
        let spec = crate::trainer::reward_model::reward_model_spec(cfg, &dir.to_string_lossy(), 1);
        let offload = spec.offload;
        let mut init = InitArgs::new(Role::RewardModel, serde_json::to_value(cfg)?);
        init.extra = json!({"reward_model": spec, "random_init": {"seed": seed + 1}});
        let client = backend.create_reward_model(&init)?;
        Ok(BenchRm {
            shape,
            client,
            offload,
            times: Vec::new(),
            rows: 0,
            tokens: 0,
        })
    }

    /// The reward phase on a generated batch: prompt + response ids (folded into the reward
    /// model's vocabulary, as a re-tokenisation would give ids of its own), right-padded.
    fn score(&mut self, gen: &Batch) -> anyhow::Result<()> {
        let p = gen.tensor::<i64>(col::PROMPTS)?;
        let pm = gen.tensor::<i64>(col::PROMPT_MASK)?;
        let r = gen.tensor::<i64>(col::RESPONSES)?;
        let rm = gen.tensor::<i64>(col::RESPONSE_MASK)?;
        let fold = (self.shape.vocab - 1) as i64;
        let rows: Vec<Vec<i64>> = (0..r.rows())
            .map(|i| {
                let prompt = p.row(i).iter().zip(pm.row(i)).filter(|(_, &m)| m != 0);
                let resp = r.row(i).iter().zip(rm.row(i)).filter(|(_, &m)| m != 0);
                prompt.chain(resp).map(|(&t, _)| t % fold).collect()
            })
            .collect();
        let w = rows.iter().map(Vec::len).max().unwrap_or(1);
        let mut ids = vec![fold; rows.len() * w];
        let mut mask = vec![0i64; rows.len() * w];
        for (i, row) in rows.iter().enumerate() {
            ids[i * w..i * w + row.len()].copy_from_slice(row);
            mask[i * w..i * w + row.len()].fill(1);
        }
        let mut b = Batch::new();
        b.insert_tensor(col::INPUT_IDS, &[rows.len(), w], &ids);
        b.insert_tensor(col::ATTENTION_MASK, &[rows.len(), w], &mask);
        let t = Instant::now();
        self.client.call("onload", &Value::Null)?;
        // The `memory` answer is read after the device finished the copy.
        self.client.call("memory", &Value::Null)?;
        let t_on = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let scores = self.client.score(&b)?;
        let t_score = t.elapsed().as_secs_f64();
        let t = Instant::now();
        self.client.call("offload", &Value::Null)?;
        self.client.call("memory", &Value::Null)?;
        let t_off = t.elapsed().as_secs_f64();
        anyhow::ensure!(
            scores.len() == rows.len(),
            "reward model: wrong score count"
        );
        self.times.push((t_on, t_score, t_off));
        self.rows = rows.len();
        self.tokens = rows.iter().map(Vec::len).sum();
        Ok(())
    }

    fn report(&self, peak_tflops: f64, peak_mem: f64) -> (String, Value) {
        let (on, sc, off) = self.times.last().copied().unwrap_or_default();
        let flops = rm_forward_flops(
            &self.shape,
            self.rows as u64,
            (self.tokens / self.rows.max(1)) as u64,
        );
        let mfu = flops / sc.max(1e-12) / (peak_tflops * 1e12);
        let tps = self.tokens as f64 / sc.max(1e-12);
        let table = format!(
            "reward model {} ({} M params, bf16 unless set): {} rows, {} tokens; score {:.3}s \
             ({:.0} tokens/s, MFU {:.1}%), onload {:.3}s, offload {:.3}s (weights {} between \
             steps), phase {:.3}s; process peak {:.1} GiB\n",
            self.shape.name,
            sig(self.shape.n_params() as f64 / 1e6),
            self.rows,
            self.tokens,
            sc,
            tps,
            100.0 * mfu,
            on,
            off,
            if self.offload {
                "in host memory"
            } else {
                "on the GPU"
            },
            on + sc + off,
            peak_mem
        );
        let json = json!({
            "arch": self.shape.name, "rows": self.rows, "tokens": self.tokens,
            "onload_s": round4(on), "score_s": round4(sc), "offload_s": round4(off),
            "phase_s": round4(on + sc + off), "tokens_per_s": tps.round(), "mfu": (mfu * 1e4).round() / 1e4,
            "offloaded_between_steps": self.offload,
            "per_step": self.times.iter().map(|(a, b, c)| json!([round4(*a), round4(*b), round4(*c)])).collect::<Vec<_>>(),
        });
        (table, json)
    }
}

fn tempfile_dir() -> anyhow::Result<std::path::PathBuf> {
    let base = std::env::temp_dir().join(format!("verl-bench-{}", std::process::id()));
    std::fs::create_dir_all(&base).with_context(|| format!("creating {}", base.display()))?;
    Ok(base)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toy() -> Shape {
        // hidden 4, 2 heads (head_dim 2), 1 kv head, intermediate 8, 1 layer, vocab 10, llama.
        Shape {
            name: "toy",
            model_type: "llama",
            vocab: 10,
            hidden: 4,
            intermediate: 8,
            layers: 1,
            heads: 2,
            kv_heads: 1,
            max_positions: 64,
            rope_theta: 1e4,
            rms_norm_eps: 1e-6,
            tie_embeddings: false,
        }
    }

    #[test]
    fn parameter_counts_by_hand() {
        let s = toy();
        // q 4·4 + k 4·2 + v 4·2 + o 4·4 = 48; mlp 3·4·8 = 96; head 10·4 = 40.
        assert_eq!(s.matmul_params(), 48 + 96 + 40);
        // + embedding 40 + 2 layer norms 8 + final norm 4.
        assert_eq!(s.n_params(), 184 + 40 + 8 + 4);
        // k and v: 2 · 1 layer · 2 (kv dim) · 2 bytes.
        assert_eq!(s.kv_bytes_per_token(), 8);
        // Qwen2.5-0.5B: 494,032,768 parameters (the published count).
        assert_eq!(shape("qwen2.5-0.5b").unwrap().n_params(), 494_032_768);
        // Llama-3-8B: 8,030,261,248.
        assert_eq!(shape("llama3-8b").unwrap().n_params(), 8_030_261_248);
    }

    #[test]
    fn flop_and_byte_formulas_by_hand() {
        let s = toy();
        // 2 sequences of 3 tokens: 2·184·6 = 2208 linear; attention 4·1·4·9·2 = 288.
        assert_eq!(forward_flops(&s, 2, 3), 2208.0 + 288.0);
        assert_eq!(train_flops(&s, 2, 3), 3.0 * 2496.0);
        // prompt 3, 3 new tokens, 1 sequence: prefill 2·184·3 + 4·4·9 = 1248;
        // 2 decode steps at ctx 4 and 5: 2·(2·184) + 4·4·(4+5) = 736 + 144.
        assert_eq!(generate_flops(&s, 1, 3, 3), 1248.0 + 736.0 + 144.0);
        // Decode step bytes: weights 184·2 = 368 + 2 seqs · ctx 4 · 8 B = 64.
        assert_eq!(decode_step_bytes(&s, 2, 4.0), 432.0);
        // 2 steps at mean ctx 3 + 3/2 = 4.5: 2·(368 + 2·4.5·8) = 880 bytes at 1e-9 GB/s → 880 s.
        assert!((decode_roofline_s(&s, 2, 3, 3, 1e-9) - 880.0).abs() < 1e-9);
    }

    #[test]
    fn configs_match_the_python_reference_shapes() {
        let c = shape("qwen2.5-1.5b").unwrap().config_json();
        assert_eq!(c["hidden_size"], 1536);
        assert_eq!(c["tie_word_embeddings"], true);
        assert!(shape("gpt2").is_err());
    }
}
