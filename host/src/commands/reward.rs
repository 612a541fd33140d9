//! `verl reward score`: score a JSONL file with a reward plugin (accuracy per data_source), or
//! with a reward model (`--model`: one score per row). Also the hidden `verl __reward-worker`
//! that serves an isolated reward plugin (`plugins.reward.isolate`).

use std::collections::BTreeMap;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context};
use clap::Subcommand;
use verl_plugin_api::{col, Batch, InitArgs, Role, ScoreOptions};

use super::single_plugin;
use crate::loader::{LoadedPlugin, Loader};

#[derive(Subcommand)]
pub enum RewardCmd {
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

pub fn run(plugins: &[String], cmd: &RewardCmd) -> anyhow::Result<ExitCode> {
    match cmd {
        RewardCmd::Score {
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
        } => {
            if out.is_some() || kwargs != "null" {
                bail!("--out and --kwargs belong to reward plugins; with --model the scores are printed (--json for one object per row)");
            }
            let req = ModelScoreRequest {
                model: model.clone(),
                chat: *chat,
                device: device.clone(),
                dtype: dtype.clone(),
                max_length: *max_length,
                batch_size: *batch_size,
            };
            reward_score_model(plugins, input, &req, *json)
        }
        RewardCmd::Score {
            input,
            out,
            kwargs,
            batch_size,
            ..
        } => reward_score(plugins, input, out.as_deref(), kwargs, *batch_size),
    }
}

/// `verl __reward-worker PLUGIN`: serves a reward plugin's score calls over stdin/stdout.
pub fn worker(plugin: &str) -> anyhow::Result<ExitCode> {
    crate::isolated_reward::serve(plugin)?;
    Ok(ExitCode::SUCCESS)
}

fn reward_score_model(
    plugins: &[String],
    input: &Path,
    req: &ModelScoreRequest,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let mut loader = Loader::new(&[]);
    let spec = single_plugin(
        plugins,
        "fsdp",
        "`verl reward score --model` takes one --plugin (a backend)",
    )?;
    let backend = loader.load(&spec)?;
    let scores = score_file_with_model(&backend, input, req)?;
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
    plugins: &[String],
    input: &Path,
    out: Option<&Path>,
    kwargs: &str,
    batch_size: usize,
) -> anyhow::Result<ExitCode> {
    let kwargs: serde_json::Value = serde_json::from_str(kwargs)
        .context("--kwargs must be JSON, e.g. '{\"method\": \"flexible\"}'")?;
    let mut loader = Loader::new(&[]);
    let spec = single_plugin(plugins, "rewards", "`verl reward score` takes one --plugin")?;
    let plugin = loader.load(&spec)?;
    let stats = score_file(&plugin, input, out, kwargs, batch_size)?;
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

/// One input row. `solution_str` (verl's name) or `response` holds the text to score.
#[derive(Debug, serde::Deserialize)]
struct Row {
    data_source: String,
    #[serde(alias = "response", alias = "solution")]
    solution_str: String,
    ground_truth: serde_json::Value,
    #[serde(default)]
    extra_info: serde_json::Value,
    #[serde(default)]
    prompt: Option<String>,
}

/// Per data_source summary.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct SourceStats {
    pub rows: usize,
    pub score_sum: f64,
    pub correct: usize,
}

pub fn score_file(
    plugin: &LoadedPlugin,
    input: &Path,
    out: Option<&Path>,
    kwargs: serde_json::Value,
    batch_size: usize,
) -> anyhow::Result<BTreeMap<String, SourceStats>> {
    let f =
        std::fs::File::open(input).with_context(|| format!("cannot open {}", input.display()))?;
    let mut rows = Vec::new();
    for (i, line) in std::io::BufReader::new(f).lines().enumerate() {
        let line =
            line.with_context(|| format!("{}: read error at line {}", input.display(), i + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        let row: Row = serde_json::from_str(&line).with_context(|| {
            format!(
                "{}:{}: expected a JSON object with data_source, solution_str (or response), ground_truth",
                input.display(),
                i + 1
            )
        })?;
        rows.push(row);
    }
    if rows.is_empty() {
        bail!("{}: no rows to score", input.display());
    }
    let mut reward =
        plugin.create_reward(&InitArgs::new(Role::Reward, serde_json::json!({})), None)?;
    let opts = ScoreOptions { kwargs };
    let mut writer = match out {
        Some(p) => Some(std::io::BufWriter::new(
            std::fs::File::create(p).with_context(|| format!("cannot create {}", p.display()))?,
        )),
        None => None,
    };
    let mut stats: BTreeMap<String, SourceStats> = BTreeMap::new();
    for chunk in rows.chunks(batch_size.max(1)) {
        let mut b = Batch::new();
        let prompts: Vec<&str> = chunk
            .iter()
            .map(|r| r.prompt.as_deref().unwrap_or(""))
            .collect();
        b.insert_strings(col::PROMPT_TEXT, &prompts);
        b.insert_strings(
            col::RESPONSE_TEXT,
            &chunk
                .iter()
                .map(|r| r.solution_str.as_str())
                .collect::<Vec<_>>(),
        );
        b.insert_strings(
            col::DATA_SOURCE,
            &chunk
                .iter()
                .map(|r| r.data_source.as_str())
                .collect::<Vec<_>>(),
        );
        b.insert_json(
            col::GROUND_TRUTH,
            &chunk
                .iter()
                .map(|r| r.ground_truth.clone())
                .collect::<Vec<_>>(),
        );
        b.insert_json(
            col::EXTRA_INFO,
            &chunk
                .iter()
                .map(|r| r.extra_info.clone())
                .collect::<Vec<_>>(),
        );
        let scored = reward.score(&b, &opts)?;
        let scores = scored.tensor::<f32>(col::SCORES)?.data;
        let acc = scored
            .tensor::<f32>(&format!("{}acc", col::REWARD_EXTRA_PREFIX))
            .ok()
            .map(|t| t.data);
        for (i, r) in chunk.iter().enumerate() {
            let s = scores[i] as f64;
            let correct = match &acc {
                Some(a) => a[i] > 0.5,
                None => s > 0.0,
            };
            let e = stats.entry(r.data_source.clone()).or_default();
            e.rows += 1;
            e.score_sum += s;
            e.correct += correct as usize;
            if let Some(w) = writer.as_mut() {
                let line = serde_json::json!({
                    "data_source": r.data_source,
                    "solution_str": r.solution_str,
                    "ground_truth": r.ground_truth,
                    "score": s,
                });
                writeln!(w, "{line}")?;
            }
        }
    }
    if let Some(mut w) = writer {
        w.flush()?;
    }
    Ok(stats)
}

/// How `verl reward score --model` reads and scores rows.
#[derive(Debug, Clone)]
pub struct ModelScoreRequest {
    pub model: std::path::PathBuf,
    /// Render `prompt` (+ `response` as the assistant turn) with the model's chat template.
    pub chat: bool,
    /// `cpu` or `cuda`.
    pub device: String,
    /// `bfloat16`, `float32` or `float16`.
    pub dtype: String,
    /// Cut inputs to this many tokens from the right.
    pub max_length: Option<usize>,
    /// Rows per forward.
    pub batch_size: usize,
}

/// One row of `verl reward score --model`: `prompt` (a string, or a chat list of {role,
/// content}) and `response`.
#[derive(Debug, serde::Deserialize)]
struct ModelRow {
    #[serde(default)]
    prompt: serde_json::Value,
    #[serde(alias = "solution_str")]
    response: String,
}

/// Scores every row of `input` with the reward model `req.model` held by `backend`.
pub fn score_file_with_model(
    backend: &LoadedPlugin,
    input: &Path,
    req: &ModelScoreRequest,
) -> anyhow::Result<Vec<f32>> {
    let text = std::fs::read_to_string(input)
        .with_context(|| format!("cannot read {}", input.display()))?;
    let mut chats: Vec<Vec<serde_json::Value>> = Vec::new();
    let mut texts: Vec<String> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{}:{}", input.display(), i + 1);
        let row: ModelRow = serde_json::from_str(line).with_context(|| {
            format!("{}: expected a JSON object with `prompt` (a string or chat messages) and `response`", at())
        })?;
        if req.chat {
            let mut chat = match row.prompt {
                serde_json::Value::String(p) => {
                    vec![serde_json::json!({"role": "user", "content": p})]
                }
                serde_json::Value::Array(m) => m,
                serde_json::Value::Null => Vec::new(),
                other => bail!(
                    "{}: `prompt` must be a string or a list of messages, found {other}",
                    at()
                ),
            };
            chat.push(serde_json::json!({"role": "assistant", "content": row.response}));
            chats.push(chat);
        } else {
            let p = match row.prompt {
                serde_json::Value::String(p) => p,
                serde_json::Value::Null => String::new(),
                _ => bail!("{}: `prompt` is a chat list: pass --chat to render it with the model's template", at()),
            };
            texts.push(p + &row.response);
        }
    }
    if chats.is_empty() && texts.is_empty() {
        bail!("{}: no rows to score", input.display());
    }
    let mut cfg = serde_json::json!({"trainer": {"device": req.device}});
    cfg["reward_model"] = serde_json::json!({});
    let mut init = InitArgs::new(Role::RewardModel, cfg);
    init.extra = serde_json::json!({"reward_model": verl_plugin_api::RewardModelSpec {
        path: req.model.to_string_lossy().into_owned(),
        path_key: "--model".into(),
        dtype: req.dtype.clone(),
        micro_batch_size_per_gpu: Some(req.batch_size.max(1) as u64),
        use_dynamic_bsz: false,
        max_token_len_per_gpu: 0,
        offload: false,
    }});
    let client = backend.create_reward_model(&init)?;
    let mut rm = crate::models::ScoringModel::new(&req.model, req.max_length, client)?;
    if req.chat {
        rm.score_chats(&chats, None)
    } else {
        rm.score_texts(&texts, None)
    }
}
