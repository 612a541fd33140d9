//! `verl sft JOB.yaml [overrides]`: supervised fine-tuning with verl's SFT trainer semantics
//! (`verl/trainer/fsdp_sft_trainer.py`, keys of `sft_trainer.yaml`): (prompt, response) pairs from
//! parquet, the prompt rendered with the model's chat template, the response followed by EOS, the
//! loss on response tokens only; or, with `data.multiturn.enable`, conversations (verl's
//! `MultiTurnSFTDataset`: each message rendered on its own, the row's tools with the first, the
//! loss on the assistant messages' tokens only, their headers excluded); seeded shuffling per epoch with `drop_last`, `train_batch_size`
//! rows per optimizer step in `micro_batch_size_per_gpu` micro-batches, warmup + cosine/constant
//! LR, validation loss each `test_freq` steps and at the end, HF checkpoints each `save_freq` steps
//! and at the end, metrics through the `trainer.logger` sinks.
//!
//! The training itself runs in the backend plugin's actor role through
//! `Actor.call("sft_update" | "sft_eval")`; this module owns data, schedule and bookkeeping only.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Context};
use serde::Deserialize;
use serde_yaml::Value;
use verl_chat::{ChatOptions, Tokenizer};
use verl_config::{Override, OverrideKind};
use verl_metrics::{LoggerOptions, MetricsLogger};
use verl_plugin_api::{client::ActorClient, col, Batch, InitArgs, Role};

use super::single_plugin;
use crate::paths::expand_home;
use crate::{LoadedPlugin, Loader};

/// `verl sft JOB.yaml [overrides]` on the backend `model.strategy` names (or `--plugin`).
pub fn run(plugins: &[String], job: &Path, overrides: &[String]) -> anyhow::Result<ExitCode> {
    let cfg = SftConfig::load(job, overrides)?;
    let mut loader = Loader::new(&[]);
    let spec = single_plugin(
        plugins,
        &cfg.model.strategy.replace("fsdp2", "fsdp"),
        "`verl sft` takes one backend --plugin",
    )?;
    let backend = loader
        .load(&spec)
        .with_context(|| format!("loading backend `{spec}` (model.strategy / --plugin)"))?;
    let s = run_sft(&backend, &cfg)?;
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

/// verl's `sft_trainer.yaml` keys this trainer reads (others there are accepted and ignored, so a
/// verl SFT config runs unchanged), with verl's defaults.
const DEFAULTS: &str = r#"
data:
  train_batch_size: 256
  micro_batch_size: null
  micro_batch_size_per_gpu: 4
  train_files: ~/data/gsm8k/train.parquet
  val_files: ~/data/gsm8k/test.parquet
  prompt_key: question
  response_key: answer
  prompt_dict_keys: null
  response_dict_keys: null
  multiturn:
    enable: false
    messages_key: messages
    tools_key: tools
    enable_thinking_key: enable_thinking
  ignore_input_ids_mismatch: false
  max_length: 1024
  truncation: error
  chat_template: null
model:
  partial_pretrain: ~/models/gemma-1.1-7b-it
  enable_gradient_checkpointing: true
  fsdp_config:
    model_dtype: fp32
    dtype: null
    seed: 0
  strategy: fsdp
optim:
  lr: 1.0e-5
  betas: [0.9, 0.95]
  weight_decay: 0.01
  warmup_steps_ratio: 0.1
  clip_grad: 1.0
  lr_scheduler: cosine
trainer:
  default_local_dir: null
  project_name: gsm8k-sft
  experiment_name: test
  total_epochs: 4
  total_training_steps: null
  logger: [console]
  seed: 1
  save_freq: -1
  test_freq: -1
  n_gpus_per_node: 1
  nnodes: 1
  device: cuda
"#;

#[derive(Debug, Deserialize)]
pub struct SftConfig {
    pub data: DataSection,
    pub model: ModelSection,
    pub optim: OptimSection,
    pub trainer: TrainerSection,
    /// The whole resolved tree (defaults, job file, overrides), for the loggers' run config.
    #[serde(skip)]
    pub resolved: serde_json::Value,
}

#[derive(Debug, Deserialize)]
pub struct DataSection {
    pub train_batch_size: usize,
    pub micro_batch_size_per_gpu: usize,
    pub train_files: OneOrMany,
    pub val_files: Option<OneOrMany>,
    pub prompt_key: String,
    pub response_key: String,
    pub prompt_dict_keys: Option<Vec<String>>,
    pub response_dict_keys: Option<Vec<String>>,
    pub max_length: usize,
    pub truncation: String,
    pub multiturn: MultiturnSection,
    /// Multi-turn: accept (with a warning) a conversation whose message-by-message tokens differ
    /// from the whole conversation's rendering, instead of failing (verl's key).
    pub ignore_input_ids_mismatch: bool,
}

/// `data.multiturn`: verl's switch to `MultiTurnSFTDataset` and its column names.
#[derive(Debug, Deserialize)]
pub struct MultiturnSection {
    pub enable: bool,
    pub messages_key: String,
    pub tools_key: String,
    pub enable_thinking_key: String,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    fn paths(&self) -> Vec<PathBuf> {
        match self {
            OneOrMany::One(s) => vec![expand_home(s)],
            OneOrMany::Many(v) => v.iter().map(|s| expand_home(s)).collect(),
        }
    }
}

#[derive(Debug, Deserialize)]
pub struct ModelSection {
    pub partial_pretrain: String,
    pub enable_gradient_checkpointing: bool,
    pub fsdp_config: serde_json::Value,
    pub strategy: String,
}

#[derive(Debug, Deserialize)]
pub struct OptimSection {
    pub lr: f64,
    pub betas: Vec<f64>,
    pub weight_decay: f64,
    pub warmup_steps_ratio: f64,
    pub clip_grad: f64,
    pub lr_scheduler: String,
}

#[derive(Debug, Deserialize)]
pub struct TrainerSection {
    pub default_local_dir: Option<String>,
    pub project_name: String,
    pub experiment_name: String,
    pub total_epochs: usize,
    pub total_training_steps: Option<usize>,
    pub logger: Vec<String>,
    pub seed: u64,
    pub save_freq: i64,
    pub test_freq: i64,
    pub n_gpus_per_node: usize,
    pub nnodes: usize,
    pub device: String,
}

fn merge(base: &mut Value, patch: Value) {
    match (base, patch) {
        (Value::Mapping(b), Value::Mapping(p)) => {
            for (k, v) in p {
                match b.get_mut(&k) {
                    Some(slot) => merge(slot, v),
                    None => {
                        b.insert(k, v);
                    }
                }
            }
        }
        (b, p) => *b = p,
    }
}

fn apply_override(tree: &mut Value, o: &Override) -> anyhow::Result<()> {
    let (last, parents) = o.key.split_last().context("empty override key")?;
    let mut node = &mut *tree;
    for (i, k) in parents.iter().enumerate() {
        let map = node.as_mapping_mut().with_context(|| {
            format!(
                "override `{}`: `{}` is not a section",
                o.text,
                o.key[..i].join(".")
            )
        })?;
        let key = Value::String(k.clone());
        if !map.contains_key(&key) {
            if o.kind == OverrideKind::Set {
                bail!(
                    "override `{}`: unknown key `{}` (use `+{}` to add one)",
                    o.text,
                    o.key.join("."),
                    o.text
                );
            }
            map.insert(key.clone(), Value::Mapping(Default::default()));
        }
        node = map.get_mut(&key).expect("inserted above");
    }
    let map = node.as_mapping_mut().with_context(|| {
        format!(
            "override `{}`: `{}` is not a section",
            o.text,
            parents.join(".")
        )
    })?;
    let key = Value::String(last.clone());
    match o.kind {
        OverrideKind::Delete => {
            map.remove(&key);
        }
        OverrideKind::Set if !map.contains_key(&key) => {
            let known: Vec<String> = map
                .keys()
                .filter_map(|k| k.as_str().map(str::to_string))
                .collect();
            bail!(
                "override `{}`: unknown key `{}`; keys there: {} (use `+{}` to add one)",
                o.text,
                o.key.join("."),
                known.join(", "),
                o.text
            );
        }
        _ => {
            map.insert(key, o.value.clone().unwrap_or(Value::Null));
        }
    }
    Ok(())
}

impl SftConfig {
    /// verl's defaults, then the job file, then the overrides.
    pub fn load(job: &Path, overrides: &[String]) -> anyhow::Result<SftConfig> {
        let mut tree: Value = serde_yaml::from_str(DEFAULTS).expect("valid defaults");
        let text = std::fs::read_to_string(job)
            .with_context(|| format!("cannot read {}", job.display()))?;
        let file: Value = serde_yaml::from_str(&text)
            .with_context(|| format!("{}: invalid YAML", job.display()))?;
        if !file.is_null() {
            merge(&mut tree, file);
        }
        for o in overrides {
            apply_override(&mut tree, &Override::parse(o)?)?;
        }
        let resolved = serde_json::to_value(&tree)
            .with_context(|| format!("{}: SFT config as JSON", job.display()))?;
        let mut cfg: SftConfig = serde_yaml::from_value(tree)
            .with_context(|| format!("{}: SFT config", job.display()))?;
        cfg.resolved = resolved;
        if cfg.data.micro_batch_size_per_gpu == 0 || cfg.data.train_batch_size == 0 {
            bail!(
                "data.train_batch_size ({}) and data.micro_batch_size_per_gpu ({}) must be at least 1",
                cfg.data.train_batch_size,
                cfg.data.micro_batch_size_per_gpu
            );
        }
        if cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes != 1 {
            bail!(
                "trainer.n_gpus_per_node × trainer.nnodes = {}: `verl sft` runs on one rank in this build",
                cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
            );
        }
        if !["error", "left", "right"].contains(&cfg.data.truncation.as_str()) {
            bail!(
                "data.truncation: expected error, left or right, found `{}`",
                cfg.data.truncation
            );
        }
        Ok(cfg)
    }

    /// The backend's view: the keys of `actor_rollout_ref` its actor reads.
    fn backend_config(&self, total_steps: usize) -> serde_json::Value {
        let mut fsdp = self.model.fsdp_config.clone();
        if fsdp.get("dtype").is_none_or(|d| d.is_null()) {
            let dtype = if self.trainer.device == "cpu" {
                "fp32"
            } else {
                "bf16"
            };
            fsdp["dtype"] = serde_json::json!(dtype);
        }
        serde_json::json!({
            "trainer": {"device": self.trainer.device, "seed": self.trainer.seed,
                        "total_training_steps": total_steps},
            "actor_rollout_ref": {
                "model": {"path": expand_home(&self.model.partial_pretrain),
                          "enable_gradient_checkpointing": self.model.enable_gradient_checkpointing},
                "actor": {
                    "strategy": self.model.strategy,
                    "ppo_mini_batch_size": 1,
                    "grad_clip": self.optim.clip_grad,
                    "optim": {"lr": self.optim.lr, "betas": self.optim.betas,
                              "weight_decay": self.optim.weight_decay,
                              "lr_warmup_steps_ratio": self.optim.warmup_steps_ratio,
                              "lr_scheduler_type": self.optim.lr_scheduler,
                              "total_training_steps": total_steps},
                    "fsdp_config": fsdp,
                },
            },
        })
    }

    fn output_dir(&self) -> PathBuf {
        match &self.trainer.default_local_dir {
            Some(d) => expand_home(d),
            None => Path::new("checkpoints")
                .join(&self.trainer.project_name)
                .join(&self.trainer.experiment_name),
        }
    }
}

/// One tokenized example: prompt ids (chat template, generation prompt) and response ids (+ EOS);
/// for a conversation, the ids before its first trained token and the rest, with `loss_mask`
/// marking the trained (assistant) tokens of the rest.
struct Example {
    prompt: Vec<i64>,
    response: Vec<i64>,
    loss_mask: Option<Vec<i64>>,
}

fn tokenize(cfg: &SftConfig, tok: &Tokenizer, files: &[PathBuf]) -> anyhow::Result<Vec<Example>> {
    if cfg.data.multiturn.enable {
        return tokenize_conversations(cfg, tok, files);
    }
    let keys = verl_data::SftKeys {
        prompt_key: cfg.data.prompt_key.clone(),
        response_key: cfg.data.response_key.clone(),
        prompt_dict_keys: cfg.data.prompt_dict_keys.clone().unwrap_or_default(),
        response_dict_keys: cfg.data.response_dict_keys.clone().unwrap_or_default(),
    };
    let pairs = verl_data::read_sft_pairs(files, &keys)?;
    let eos = *tok
        .eos_token_ids()
        .first()
        .context("the tokenizer has no EOS token (tokenizer_config.json `eos_token`); SFT appends it to every response")?;
    let opts = ChatOptions {
        add_generation_prompt: true,
        ..ChatOptions::default()
    };
    let max = cfg.data.max_length;
    let mut out = Vec::with_capacity(pairs.len());
    for (i, p) in pairs.iter().enumerate() {
        let msgs = [serde_json::json!({"role": "user", "content": p.prompt})];
        let mut prompt: Vec<i64> = tok
            .apply_chat_template_ids(&msgs, &opts)?
            .into_iter()
            .map(i64::from)
            .collect();
        let mut response: Vec<i64> = tok
            .encode(&p.response, false)?
            .into_iter()
            .map(i64::from)
            .collect();
        response.push(eos as i64);
        let len = prompt.len() + response.len();
        if len > max {
            match cfg.data.truncation.as_str() {
                "left" => {
                    let cut = (len - max).min(prompt.len().saturating_sub(1));
                    prompt.drain(..cut);
                    response.truncate(max - prompt.len());
                }
                "right" => {
                    if prompt.len() >= max {
                        prompt.truncate(max - 1);
                    }
                    response.truncate(max - prompt.len());
                }
                _ => bail!(
                    "{files:?} pair {i}: {len} tokens (prompt {} + response {}) exceed data.max_length={max} \
                     (data.truncation=error; raise max_length or set truncation to left/right)",
                    prompt.len(),
                    response.len()
                ),
            }
        }
        out.push(Example {
            prompt,
            response,
            loss_mask: None,
        });
    }
    Ok(out)
}

/// The token ids of `messages` rendered with `opts`.
fn ids(
    tok: &Tokenizer,
    messages: &[serde_json::Value],
    opts: &ChatOptions,
) -> anyhow::Result<Vec<i64>> {
    Ok(tok
        .apply_chat_template_ids(messages, opts)?
        .into_iter()
        .map(i64::from)
        .collect())
}

/// One conversation as verl's `MultiTurnSFTDataset` tokenizes it: each message rendered on its
/// own (the tools with the first; later messages without the system prompt the template puts
/// before every rendering), concatenated; the loss mask is 1 on an assistant message's tokens
/// after the generation prompt (its content, end-of-turn marker and what follows it).
fn conversation_ids(
    tok: &Tokenizer,
    c: &verl_data::SftConversation,
    base: &ChatOptions,
    system_prompt: usize,
    generation_prompt: usize,
) -> anyhow::Result<(Vec<i64>, Vec<i64>)> {
    let (mut input, mut mask) = (Vec::new(), Vec::new());
    for (i, m) in c.messages.iter().enumerate() {
        let opts = ChatOptions {
            tools: if i == 0 { c.tools.clone() } else { None },
            ..base.clone()
        };
        let mut part = ids(tok, std::slice::from_ref(m), &opts)?;
        let role = m["role"].as_str().unwrap_or_default();
        if i != 0 && role != "system" {
            part.drain(..system_prompt.min(part.len()));
        }
        let trained = if role == "assistant" { 1 } else { 0 };
        mask.extend((0..part.len()).map(|k| if k < generation_prompt { 0 } else { trained }));
        input.extend(part);
    }
    Ok((input, mask))
}

/// `data.multiturn.enable`: the conversations of `files` as examples.
fn tokenize_conversations(
    cfg: &SftConfig,
    tok: &Tokenizer,
    files: &[PathBuf],
) -> anyhow::Result<Vec<Example>> {
    let mt = &cfg.data.multiturn;
    let keys = verl_data::MultiturnKeys {
        messages_key: mt.messages_key.clone(),
        tools_key: mt.tools_key.clone(),
        enable_thinking_key: mt.enable_thinking_key.clone(),
    };
    let conversations = verl_data::read_sft_conversations(files, &keys)?;
    // verl's `extract_system_prompt_and_generation`: what the template puts before any message
    // and what it appends for a generation prompt, from renderings of empty user turns.
    let empty = serde_json::json!({"role": "user", "content": ""});
    let plain = ChatOptions::default();
    let one = ids(tok, std::slice::from_ref(&empty), &plain)?;
    let two = ids(tok, &[empty.clone(), empty.clone()], &plain)?;
    let system_prompt = one
        .len()
        .saturating_sub(two.len().saturating_sub(one.len()));
    let generation_prompt = ids(
        tok,
        std::slice::from_ref(&empty),
        &ChatOptions::with_generation_prompt(),
    )?
    .len()
    .saturating_sub(one.len());
    let max = cfg.data.max_length;
    let mut warned = false;
    let mut out = Vec::with_capacity(conversations.len());
    for (i, c) in conversations.iter().enumerate() {
        let mut base = ChatOptions::default();
        if let Some(t) = c.enable_thinking {
            base.extra_vars
                .insert("enable_thinking".into(), serde_json::Value::Bool(t));
        }
        let (mut input, mut mask) =
            conversation_ids(tok, c, &base, system_prompt, generation_prompt)?;
        let whole = ids(
            tok,
            &c.messages,
            &ChatOptions {
                tools: c.tools.clone(),
                ..base.clone()
            },
        )?;
        if whole != input {
            let msg = format!(
                "{files:?} conversation {i}: its messages tokenized one by one ({} tokens) differ \
                 from the whole conversation's rendering ({} tokens); the chat template renders a \
                 message differently in context",
                input.len(),
                whole.len()
            );
            if !cfg.data.ignore_input_ids_mismatch {
                bail!("{msg} (set data.ignore_input_ids_mismatch=true to train on the message-by-message tokens)");
            }
            if !warned {
                tracing::warn!("{msg}; training on the message-by-message tokens");
                warned = true;
            }
        }
        if input.len() > max {
            match cfg.data.truncation.as_str() {
                "left" => {
                    input.drain(..input.len() - max);
                    mask.drain(..mask.len() - max);
                }
                "right" => {
                    input.truncate(max);
                    mask.truncate(max);
                }
                _ => bail!(
                    "{files:?} conversation {i}: {} tokens exceed data.max_length={max} \
                     (data.truncation=error; raise max_length or set truncation to left/right)",
                    input.len()
                ),
            }
        }
        let Some(first) = mask.iter().position(|&m| m == 1) else {
            bail!(
                "{files:?} conversation {i}: no assistant tokens to train on (after truncation to \
                 data.max_length={max}); each conversation needs an assistant message"
            );
        };
        // The first token is always context: it predicts nothing.
        let split = first.max(1);
        let response = input.split_off(split);
        out.push(Example {
            prompt: input,
            response,
            loss_mask: Some(mask.split_off(split)),
        });
    }
    Ok(out)
}

/// The sequence batch of `rows`: left-padded prompts, right-padded responses (mask = loss mask,
/// or a `loss_mask` column beside it when the examples carry one).
fn batch_of(examples: &[Example], rows: &[usize], pad: i64) -> Batch {
    let pw = rows
        .iter()
        .map(|&r| examples[r].prompt.len())
        .max()
        .unwrap_or(1);
    let rw = rows
        .iter()
        .map(|&r| examples[r].response.len())
        .max()
        .unwrap_or(1);
    let with_loss_mask = rows.iter().any(|&r| examples[r].loss_mask.is_some());
    let (mut p, mut pm, mut r, mut rm, mut lm) = (vec![], vec![], vec![], vec![], vec![]);
    for &i in rows {
        let e = &examples[i];
        let padn = pw - e.prompt.len();
        p.extend(std::iter::repeat_n(pad, padn).chain(e.prompt.iter().copied()));
        pm.extend(std::iter::repeat_n(0i64, padn).chain(std::iter::repeat_n(1, e.prompt.len())));
        let rpad = rw - e.response.len();
        r.extend(
            e.response
                .iter()
                .copied()
                .chain(std::iter::repeat_n(pad, rpad)),
        );
        rm.extend(std::iter::repeat_n(1i64, e.response.len()).chain(std::iter::repeat_n(0, rpad)));
        if with_loss_mask {
            match &e.loss_mask {
                Some(m) => lm.extend(m.iter().copied()),
                None => lm.extend(std::iter::repeat_n(1i64, e.response.len())),
            }
            lm.extend(std::iter::repeat_n(0i64, rpad));
        }
    }
    let mut b = Batch::new();
    b.insert_tensor(col::PROMPTS, &[rows.len(), pw], &p);
    b.insert_tensor(col::PROMPT_MASK, &[rows.len(), pw], &pm);
    b.insert_tensor(col::RESPONSES, &[rows.len(), rw], &r);
    b.insert_tensor(col::RESPONSE_MASK, &[rows.len(), rw], &rm);
    if with_loss_mask {
        b.insert_tensor(col::LOSS_MASK, &[rows.len(), rw], &lm);
    }
    b
}

/// A seeded permutation of `0..n` (Fisher–Yates on splitmix64), one per (seed, epoch).
fn permutation(n: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mut state = seed ^ epoch.wrapping_mul(0xA076_1D64_78BD_642F);
    let mut next = || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut v: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
    v
}

fn meta_f64(b: &Batch, key: &str) -> anyhow::Result<f64> {
    b.meta()
        .get(key)
        .and_then(|v| v.as_f64())
        .with_context(|| format!("the backend's SFT call returned no `{key}` in its result meta"))
}

/// What the run did.
#[derive(Debug)]
pub struct SftSummary {
    pub steps: usize,
    pub last_train_loss: Option<f64>,
    pub val_loss: Option<f64>,
    /// The HF folder of the last checkpoint (loadable as `actor_rollout_ref.model.path`).
    pub final_model: PathBuf,
    pub metrics_file: Option<PathBuf>,
    pub seconds: f64,
}

fn validate(
    actor: &mut ActorClient,
    cfg: &SftConfig,
    val: &[Example],
    pad: i64,
) -> anyhow::Result<f64> {
    let (mut nll, mut tokens) = (0.0, 0.0);
    let rows: Vec<usize> = (0..val.len()).collect();
    let opts = serde_json::json!({"micro_batch_size_per_gpu": cfg.data.micro_batch_size_per_gpu});
    for chunk in rows.chunks(cfg.data.train_batch_size) {
        let out = actor.call("sft_eval", &batch_of(val, chunk, pad), &opts)?;
        nll += meta_f64(&out, "nll_sum")?;
        tokens += meta_f64(&out, "tokens")?;
    }
    Ok(nll / tokens)
}

fn save(actor: &mut ActorClient, out_dir: &Path, step: usize) -> anyhow::Result<PathBuf> {
    let dir = out_dir.join(format!("global_step_{step}"));
    actor
        .export_hf(&dir)
        .with_context(|| format!("exporting the HF checkpoint to {}", dir.display()))?;
    let tracker = out_dir.join("latest_checkpointed_iteration.txt");
    std::fs::write(&tracker, format!("{step}\n"))
        .with_context(|| format!("cannot write {}", tracker.display()))?;
    Ok(dir)
}

pub fn run_sft(backend: &LoadedPlugin, cfg: &SftConfig) -> anyhow::Result<SftSummary> {
    let started = Instant::now();
    let model_dir = expand_home(&cfg.model.partial_pretrain);
    let tok = Tokenizer::from_dir(&model_dir).with_context(|| {
        format!(
            "loading the tokenizer of model.partial_pretrain={}",
            model_dir.display()
        )
    })?;
    let pad = i64::from(tok.padding_id());
    let train = tokenize(cfg, &tok, &cfg.data.train_files.paths()).context("data.train_files")?;
    let val = match &cfg.data.val_files {
        Some(v) => tokenize(cfg, &tok, &v.paths()).context("data.val_files")?,
        None => Vec::new(),
    };
    let bs = cfg.data.train_batch_size;
    let per_epoch = train.len() / bs;
    if per_epoch == 0 {
        bail!(
            "data.train_batch_size={bs} is larger than the {} training pairs (batches drop the remainder, as verl's)",
            train.len()
        );
    }
    let total = cfg
        .trainer
        .total_training_steps
        .unwrap_or(per_epoch * cfg.trainer.total_epochs);
    let init = InitArgs::new(Role::Actor, cfg.backend_config(total));
    let mut actor = backend.create_actor(&init)?;
    let mut logger_opts = LoggerOptions::from_verl(
        &cfg.trainer.project_name,
        &cfg.trainer.experiment_name,
        &cfg.trainer.logger,
    )
    .with_run_config(cfg.resolved.clone());
    logger_opts.console_full = true;
    let mut logger = MetricsLogger::new(&logger_opts)?;
    for w in logger.warnings() {
        tracing::warn!("{w}");
    }
    let metrics_file = cfg
        .trainer
        .logger
        .iter()
        .any(|l| l == "file" || l == "jsonl")
        .then(|| logger_opts.jsonl_path.clone());
    let out_dir = cfg.output_dir();
    let opts = |step: usize| {
        serde_json::json!({"micro_batch_size_per_gpu": cfg.data.micro_batch_size_per_gpu,
                           "total_training_steps": total, "global_step": step})
    };
    let mut step = 0;
    let mut last_loss = None;
    let mut val_loss = None;
    let mut final_model = None;
    'epochs: for epoch in 0.. {
        let order = permutation(train.len(), cfg.trainer.seed, epoch);
        for rows in order.chunks_exact(bs) {
            if step >= total {
                break 'epochs;
            }
            step += 1;
            let t0 = Instant::now();
            let out = actor
                .call("sft_update", &batch_of(&train, rows, pad), &opts(step))
                .with_context(|| format!("SFT step {step}"))?;
            let loss = meta_f64(&out, "train/loss")?;
            last_loss = Some(loss);
            let mut m = vec![
                ("train/loss".to_string(), loss),
                ("train/lr".to_string(), meta_f64(&out, "train/lr")?),
                (
                    "train/grad_norm".to_string(),
                    meta_f64(&out, "train/grad_norm")?,
                ),
                ("train/epoch".to_string(), epoch as f64),
                ("timing_s/step".to_string(), t0.elapsed().as_secs_f64()),
            ];
            let last = step == total;
            if !val.is_empty()
                && (last
                    || (cfg.trainer.test_freq > 0 && step % cfg.trainer.test_freq as usize == 0))
            {
                let v = validate(&mut actor, cfg, &val, pad)?;
                val_loss = Some(v);
                m.push(("val/loss".to_string(), v));
            }
            logger.log(step as u64, &m)?;
            if last || (cfg.trainer.save_freq > 0 && step % cfg.trainer.save_freq as usize == 0) {
                final_model = Some(save(&mut actor, &out_dir, step)?);
            }
        }
    }
    logger.finish()?;
    let final_model = match final_model {
        Some(d) => d,
        None => save(&mut actor, &out_dir, step)?,
    };
    Ok(SftSummary {
        steps: step,
        last_train_loss: last_loss,
        val_loss,
        final_model,
        metrics_file,
        seconds: started.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutation_is_seeded_and_complete() {
        let a = permutation(50, 1, 0);
        let mut s = a.clone();
        s.sort_unstable();
        assert_eq!(s, (0..50).collect::<Vec<_>>());
        assert_eq!(a, permutation(50, 1, 0));
        assert_ne!(a, permutation(50, 1, 1));
    }

    #[test]
    fn config_layers_defaults_file_and_overrides_and_names_unknown_keys() {
        let dir = tempfile::tempdir().unwrap();
        let job = dir.path().join("sft.yaml");
        std::fs::write(&job, "data:\n  train_batch_size: 8\noptim:\n  lr: 1.0e-3\n").unwrap();
        let cfg = SftConfig::load(
            &job,
            &["optim.clip_grad=0.5".into(), "trainer.device=cpu".into()],
        )
        .unwrap();
        assert_eq!(cfg.data.train_batch_size, 8);
        assert_eq!(cfg.data.micro_batch_size_per_gpu, 4);
        assert_eq!(cfg.optim.lr, 1e-3);
        assert_eq!(cfg.optim.clip_grad, 0.5);
        let b = cfg.backend_config(10);
        assert_eq!(
            b["actor_rollout_ref"]["actor"]["optim"]["lr_warmup_steps_ratio"],
            0.1
        );
        assert_eq!(
            b["actor_rollout_ref"]["actor"]["fsdp_config"]["dtype"],
            "fp32"
        );
        let e = SftConfig::load(&job, &["optim.learning_rate=1".into()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("optim.learning_rate") && e.contains("clip_grad"),
            "{e}"
        );
    }

    /// A model folder from `verl init-model` on the tool variant's data, and a config reading it
    /// as multi-turn conversations.
    fn tool_setup(dir: &Path) -> (Tokenizer, SftConfig, PathBuf) {
        let data = verl_data::arith_write(
            &dir.join("data"),
            &verl_data::ArithConfig {
                train: 64,
                val: 4,
                min_operand: 100,
                max_operand: 9999,
                tool_rate: Some(0.5),
                ..verl_data::ArithConfig::default()
            },
        )
        .unwrap();
        let spec = crate::commands::init_model::ModelSpec {
            vocab: 1024,
            hidden: 16,
            intermediate: 32,
            heads: 2,
            kv_heads: 1,
            digit_group: Some(1),
            ..Default::default()
        };
        let model = dir.join("model");
        crate::commands::init_model::init_model(
            &model,
            std::slice::from_ref(&data.sft_train),
            &spec,
        )
        .unwrap();
        let job = dir.join("sft.yaml");
        std::fs::write(
            &job,
            "data:\n  multiturn:\n    enable: true\n  max_length: 400\n",
        )
        .unwrap();
        let cfg = SftConfig::load(&job, &[]).unwrap();
        (Tokenizer::from_dir(&model).unwrap(), cfg, data.sft_train)
    }

    #[test]
    fn multiturn_trains_on_assistant_turns_only() {
        let dir = tempfile::tempdir().unwrap();
        let (tok, cfg, file) = tool_setup(dir.path());
        let examples = tokenize(&cfg, &tok, std::slice::from_ref(&file)).unwrap();
        let rows =
            verl_data::read_sft_conversations(&[&file], &verl_data::MultiturnKeys::default())
                .unwrap();
        assert_eq!(examples.len(), rows.len());
        let text = |ids: &[i64]| {
            let ids: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
            tok.decode(&ids, false).unwrap()
        };
        let mut calls = 0;
        for (e, c) in examples.iter().zip(&rows) {
            let mask = e.loss_mask.as_ref().unwrap();
            assert_eq!(mask.len(), e.response.len());
            // The prompt is the tools block, the user turn and the assistant header.
            let full = tok
                .apply_chat_template(
                    &c.messages,
                    &ChatOptions {
                        tools: c.tools.clone(),
                        ..Default::default()
                    },
                )
                .unwrap();
            let prompt = text(&e.prompt);
            assert!(prompt.ends_with("<|im_start|>assistant\n"), "{prompt}");
            assert_eq!(prompt.clone() + &text(&e.response), full);
            // Trained: exactly the assistant messages' text, each with its `<|im_end|>\n`.
            let trained: Vec<i64> = e
                .response
                .iter()
                .zip(mask)
                .filter(|(_, &m)| m == 1)
                .map(|(&t, _)| t)
                .collect();
            let assistant: String = c
                .messages
                .iter()
                .filter(|m| m["role"] == "assistant")
                .map(|m| format!("{}<|im_end|>\n", m["content"].as_str().unwrap()))
                .collect();
            assert_eq!(text(&trained), assistant);
            if c.messages.len() == 4 {
                calls += 1;
                // The tool's turn is context, not trained.
                let untrained: Vec<i64> = e
                    .response
                    .iter()
                    .zip(mask)
                    .filter(|(_, &m)| m == 0)
                    .map(|(&t, _)| t)
                    .collect();
                assert!(text(&untrained).contains("<tool_response>"));
            }
        }
        assert!(calls > 0);
        // The loss mask travels as its own column beside the response mask.
        let b = batch_of(&examples, &[0, 1, 2], 0);
        assert!(b.contains(col::LOSS_MASK));
    }

    #[test]
    fn multiturn_names_conversations_over_max_length() {
        let dir = tempfile::tempdir().unwrap();
        let (tok, mut cfg, file) = tool_setup(dir.path());
        cfg.data.max_length = 20;
        let e = tokenize(&cfg, &tok, std::slice::from_ref(&file))
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("conversation 0") && e.contains("data.max_length=20"),
            "{e}"
        );
    }
}
