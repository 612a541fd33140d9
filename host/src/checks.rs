//! What `verl run --dry-run` checks beyond the config and the batch arithmetic: that the data
//! files exist and parse as verl-format rows, and that the model folders hold a config and a
//! tokenizer the job can use. Each check returns one line for the report, or an error naming
//! the key and the file.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use verl_config::Config;
use verl_data::{Dataset, Split};

use crate::paths::expand_home as expand;

/// One split's files: every file exists and every row is a verl-format row (prompt column,
/// `data.reward_fn_key`, `reward_model.ground_truth`; no media). Returns the report line.
pub fn check_data(cfg: &Config, split: Split) -> anyhow::Result<String> {
    let (key, files) = match split {
        Split::Train => ("data.train_files", cfg.data.train_files.to_vec()),
        Split::Val => ("data.val_files", cfg.data.val_files.to_vec()),
    };
    if files.is_empty() {
        bail!("{key}: no files given");
    }
    let paths: Vec<PathBuf> = files.iter().map(|f| expand(f)).collect();
    for p in &paths {
        if !p.is_file() {
            bail!("{key}: {} does not exist (or is not a file)", p.display());
        }
    }
    let dcfg = crate::trainer::data_config(cfg)?;
    let ds = Dataset::load(&paths, &dcfg).with_context(|| key.to_string())?;
    let sources: std::collections::BTreeSet<&str> =
        ds.iter().map(|s| s.data_source.as_str()).collect();
    Ok(format!(
        "{} rows in {} file(s), data sources: {}",
        ds.len(),
        paths.len(),
        sources.into_iter().collect::<Vec<_>>().join(", ")
    ))
}

/// A model folder: `config.json` parses and names an architecture, and (for the policy, whose
/// tokenizer encodes the prompts) the tokenizer loads with a chat template. Returns the report
/// line.
pub fn check_model(key: &str, path: &str, tokenizer: Option<&Path>) -> anyhow::Result<String> {
    let dir = expand(path);
    if !dir.is_dir() {
        bail!("{key}: {} is not a folder", dir.display());
    }
    let config_path = dir.join("config.json");
    let text = std::fs::read_to_string(&config_path)
        .with_context(|| format!("{key}: reading {}", config_path.display()))?;
    let config: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{key}: {} is not JSON", config_path.display()))?;
    let arch = config
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(|a| a.as_str())
        .or_else(|| config.get("model_type").and_then(|t| t.as_str()))
        .with_context(|| {
            format!(
                "{key}: {} names neither `architectures` nor `model_type`",
                config_path.display()
            )
        })?
        .to_string();
    if config.get("vision_config").is_some() || config.get("audio_config").is_some() {
        bail!(
            "{key}: {} is a multimodal model ({arch}: its config.json has a vision/audio tower); verl-rs trains text-only causal LMs (images and videos in the data are refused too): use the text model of the family (e.g. Qwen2.5-7B-Instruct for Qwen2.5-VL-7B-Instruct)",
            dir.display()
        );
    }
    let mut line = format!("{} ({arch})", dir.display());
    if let Some(tok_dir) = tokenizer {
        let tok = verl_chat::Tokenizer::from_dir(tok_dir)
            .with_context(|| format!("loading the tokenizer of {}", tok_dir.display()))?;
        if tok.chat_templates().is_empty() {
            bail!(
                "{}: the tokenizer has no chat template (tokenizer_config.json `chat_template` or chat_template.jinja); set actor_rollout_ref.model.custom_chat_template",
                tok_dir.display()
            );
        }
        line.push_str(&format!(
            ", tokenizer {} ({} tokens, chat template)",
            tok_dir.display(),
            tok.inner().get_vocab_size(true)
        ));
    }
    Ok(line)
}

/// The head of the job's reward model folder, when `reward_model.enable` and it can be read.
pub fn reward_model_head(cfg: &Config) -> Option<crate::trainer::reward_model::ModelHead> {
    let r = &cfg.reward.reward_model;
    if !r.enable {
        return None;
    }
    let dir = expand(r.model_path.as_deref()?);
    crate::trainer::reward_model::model_head(&dir, "reward.reward_model.model_path").ok()
}

/// The reward model's folder (`reward.reward_model.model_path` / `reward_model.model.path`): a
/// score head, or a causal LM that a reward plugin prompts; its tokenizer and chat template.
pub fn check_reward_model(cfg: &Config) -> anyhow::Result<String> {
    use crate::trainer::reward_model::{model_head, ModelHead};
    let key = "reward.reward_model.model_path";
    let Some(path) = cfg.reward.reward_model.model_path.as_deref() else {
        bail!("reward.reward_model.enable=true (reward_model.enable) needs the reward model's HF folder in {key} (reward_model.model.path)");
    };
    let dir = expand(path);
    let line = check_model(key, path, Some(&dir))?;
    match model_head(&dir, key)? {
        ModelHead::Score => Ok(format!(
            "{line}; scores {}",
            if cfg.plugins.reward.default == "rewards" {
                "every data source without a plugins.reward.routes entry"
            } else {
                "for reward plugins (plugins.reward.default is a plugin)"
            }
        )),
        ModelHead::Generate if cfg.plugins.reward.default == "rewards" => {
            Err(crate::trainer::TrainerError::GenerativeRmNeedsPlugin.into())
        }
        ModelHead::Generate => Ok(format!(
            "{line}; a generative judge lent to reward plugins as `reward_model`"
        )),
    }
}

/// verl's `custom_reward_function`: the file imports in the job's Python and has the function
/// (one worker started and stopped). `None` when the job gives none.
pub fn check_python_reward(cfg: &Config) -> anyhow::Result<Option<String>> {
    let mut one = cfg.clone();
    one.reward.num_workers = 1;
    let Some(_worker) = crate::trainer::reward::python_reward(&one)? else {
        return Ok(None);
    };
    let f = &cfg.reward.custom_reward_function;
    Ok(Some(format!(
        "{}::{} imports ({} worker(s), timeout {} s, on_error {})",
        f.path.as_deref().unwrap_or(""),
        f.name,
        cfg.reward.num_workers,
        cfg.plugins.reward.timeout_s,
        cfg.plugins.reward.on_error
    )))
}

/// The policy's model folder and the folder of its prompt tokenizer.
pub fn check_policy_model(cfg: &Config) -> anyhow::Result<String> {
    let tok = crate::trainer::tokenizer_dir(cfg);
    check_model(
        "actor_rollout_ref.model.path",
        &cfg.actor_rollout_ref.model.path,
        Some(&tok),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_data_and_model_folders_are_named() {
        let cfg = Config::from_overrides(&[
            "data.train_files=/nonexistent/train.parquet",
            "actor_rollout_ref.model.path=/nonexistent/model",
        ])
        .unwrap();
        let e = format!("{:#}", check_data(&cfg, Split::Train).unwrap_err());
        assert!(
            e.contains("data.train_files") && e.contains("/nonexistent/train.parquet"),
            "{e}"
        );
        let e = format!("{:#}", check_policy_model(&cfg).unwrap_err());
        assert!(
            e.contains("actor_rollout_ref.model.path") && e.contains("/nonexistent/model"),
            "{e}"
        );
    }

    #[test]
    fn a_vision_language_model_is_refused_naming_the_key() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "vision_config": {"depth": 32}}"#,
        )
        .unwrap();
        let e = format!(
            "{:#}",
            check_model(
                "actor_rollout_ref.model.path",
                dir.path().to_str().unwrap(),
                None
            )
            .unwrap_err()
        );
        assert!(
            e.starts_with("actor_rollout_ref.model.path: ")
                && e.contains("Qwen2_5_VLForConditionalGeneration")
                && e.contains("text-only"),
            "{e}"
        );
    }

    #[test]
    fn a_file_that_is_not_parquet_or_a_folder_without_config_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let bad = dir.path().join("train.parquet");
        std::fs::write(&bad, "not parquet").unwrap();
        let cfg = Config::from_overrides(&[format!("data.train_files={}", bad.display())]).unwrap();
        let e = format!("{:#}", check_data(&cfg, Split::Train).unwrap_err());
        assert!(
            e.contains("data.train_files") && e.contains("train.parquet"),
            "{e}"
        );
        let e = format!(
            "{:#}",
            check_model("critic.model.path", &dir.path().to_string_lossy(), None).unwrap_err()
        );
        assert!(
            e.contains("critic.model.path") && e.contains("config.json"),
            "{e}"
        );
    }
}
