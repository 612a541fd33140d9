//! `verl generate`: text in, text out, through a backend plugin's actor (so it exercises the ABI,
//! the tokenizer and chat template in the host, and the plugin's generation engine).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context};
use verl_chat::{ChatOptions, Tokenizer};
use verl_config::Config;
use verl_plugin_api::{col, Batch, GenerateOptions, InitArgs, Role};

use super::single_plugin;
use crate::loader::{LoadedPlugin, Loader};

#[derive(clap::Args)]
pub struct GenerateArgs {
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

/// `verl generate`: the prompts' responses, as text or JSON lines.
pub fn run(plugins: &[String], a: &GenerateArgs) -> anyhow::Result<ExitCode> {
    let prompts = match (&a.prompts, a.prompt.is_empty()) {
        (Some(file), _) => read_prompts_jsonl(file)?,
        (None, false) => a.prompt.clone(),
        (None, true) => bail!("give --prompt TEXT (repeatable) or --prompts FILE.jsonl"),
    };
    let mut loader = Loader::new(&[]);
    let spec = single_plugin(
        plugins,
        "fsdp",
        "`verl generate` takes one backend --plugin",
    )?;
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
    let out = generate(&backend, &req)?;
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

/// What to generate and how.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub model: PathBuf,
    pub prompts: Vec<String>,
    /// Wrap each prompt as one user message and apply the model's chat template.
    pub chat: bool,
    pub options: GenerateOptions,
    /// `cpu` or `cuda`.
    pub device: String,
    /// Extra config overrides (verl keys) for the backend.
    pub overrides: Vec<String>,
}

/// One response.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GeneratedText {
    pub prompt_index: usize,
    pub text: String,
    pub token_ids: Vec<i64>,
    pub log_probs: Option<Vec<f32>>,
    pub finish_reason: Option<String>,
}

/// Read prompts from a JSONL file: each line a JSON string, or an object with `prompt` (string or
/// a verl chat list of {role, content}) or `text`.
pub fn read_prompts_jsonl(path: &Path) -> anyhow::Result<Vec<String>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not JSON", path.display(), i + 1))?;
        let prompt = match &v {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Object(o) => match o.get("prompt").or_else(|| o.get("text")) {
                Some(serde_json::Value::String(s)) => s.clone(),
                Some(serde_json::Value::Array(msgs)) => msgs
                    .iter()
                    .rev()
                    .find(|m| m.get("role").and_then(|r| r.as_str()) == Some("user"))
                    .and_then(|m| m.get("content").and_then(|c| c.as_str()))
                    .map(str::to_string)
                    .with_context(|| {
                        format!(
                            "{}:{}: `prompt` list has no user message",
                            path.display(),
                            i + 1
                        )
                    })?,
                _ => bail!(
                    "{}:{}: expected a string or an object with `prompt`/`text`",
                    path.display(),
                    i + 1
                ),
            },
            _ => bail!(
                "{}:{}: expected a string or an object",
                path.display(),
                i + 1
            ),
        };
        out.push(prompt);
    }
    if out.is_empty() {
        bail!("{}: no prompts", path.display());
    }
    Ok(out)
}

pub fn generate(
    backend: &LoadedPlugin,
    req: &GenerateRequest,
) -> anyhow::Result<Vec<GeneratedText>> {
    let tok = Tokenizer::from_dir(&req.model)
        .with_context(|| format!("loading the tokenizer of {}", req.model.display()))?;
    let mut rows: Vec<Vec<i64>> = Vec::with_capacity(req.prompts.len());
    for p in &req.prompts {
        let ids = if req.chat {
            let msgs = [serde_json::json!({"role": "user", "content": p})];
            let opts = ChatOptions {
                add_generation_prompt: true,
                ..ChatOptions::default()
            };
            tok.apply_chat_template_ids(&msgs, &opts)?
        } else {
            tok.encode(p, true)?
        };
        if ids.is_empty() {
            bail!("prompt {:?} encodes to no tokens", p);
        }
        rows.push(ids.into_iter().map(i64::from).collect());
    }
    let pad = i64::from(tok.padding_id());
    let refs: Vec<&[i64]> = rows.iter().map(|r| r.as_slice()).collect();
    let batch = verl_plugin_api::contract::prompt_batch(&refs, pad);

    let mut overrides = vec![
        format!("actor_rollout_ref.model.path={}", req.model.display()),
        format!("trainer.device={}", req.device),
    ];
    overrides.extend(req.overrides.iter().cloned());
    let cfg = Config::from_overrides(&overrides)?;
    let init = InitArgs::new(Role::Actor, serde_json::to_value(&cfg)?);
    let mut actor = backend.create_actor(&init)?;
    let mut options = req.options.clone();
    if options.eos_token_ids.is_empty() {
        options.eos_token_ids = tok.eos_token_ids().iter().map(|&e| e as i64).collect();
    }
    options.pad_token_id = pad;
    let out: Batch = actor.generate(&batch, &options)?;
    decode(&tok, &out)
}

fn decode(tok: &Tokenizer, out: &Batch) -> anyhow::Result<Vec<GeneratedText>> {
    let responses = out.tensor::<i64>(col::RESPONSES)?;
    let mask = out.tensor::<i64>(col::RESPONSE_MASK)?;
    let index = out.tensor::<i64>(col::PROMPT_INDEX)?;
    let lps = out.tensor::<f32>(col::ROLLOUT_LOG_PROBS).ok();
    let reasons = out.strings(col::FINISH_REASON).ok();
    let mut res = Vec::with_capacity(responses.rows());
    for i in 0..responses.rows() {
        let valid: Vec<usize> = (0..responses.cols())
            .filter(|&j| mask.row(i)[j] != 0)
            .collect();
        let ids: Vec<i64> = valid.iter().map(|&j| responses.row(i)[j]).collect();
        let u32s: Vec<u32> = ids.iter().map(|&t| t as u32).collect();
        res.push(GeneratedText {
            prompt_index: index.data[i] as usize,
            text: tok.decode(&u32s, true)?,
            token_ids: ids,
            log_probs: lps
                .as_ref()
                .map(|l| valid.iter().map(|&j| l.row(i)[j]).collect()),
            finish_reason: reasons.as_ref().map(|r| r[i].clone()),
        });
    }
    Ok(res)
}
