//! Prompt side of a step: chat template → token ids → `data.truncation` → left padding to
//! `data.max_prompt_length` (verl's `RLHFDataset` + collate), and decoding of what comes back.

use std::path::{Path, PathBuf};

use anyhow::Context;
use verl_chat::{ChatOptions, Tokenizer};
use verl_config::Config;
use verl_data::{Sample, Truncation};
use verl_plugin_api::{col, Batch, Tensor};

/// The tokenizer folder of the job: `data.tokenizer`, else `model.tokenizer_path`, else the
/// model folder (verl's order).
pub fn tokenizer_dir(cfg: &Config) -> PathBuf {
    let m = &cfg.actor_rollout_ref.model;
    let dir = cfg
        .data
        .tokenizer
        .as_deref()
        .or(m.tokenizer_path.as_deref())
        .unwrap_or(&m.path);
    crate::paths::expand_home(dir)
}

pub(crate) struct PromptEncoder {
    pub tokenizer: Tokenizer,
    pub chat: ChatOptions,
    /// A multi-turn job's agent loop: a tool agent's prompt is rendered with the tool schemas.
    pub agent: Option<std::sync::Arc<super::agent::AgentLoop>>,
    max_len: usize,
    truncation: Truncation,
    pub pad_id: i64,
    pub eos_ids: Vec<i64>,
}

impl PromptEncoder {
    pub fn new(cfg: &Config, dir: &Path) -> anyhow::Result<Self> {
        let mut tokenizer = Tokenizer::from_dir(dir)
            .with_context(|| format!("loading the tokenizer of {}", dir.display()))?;
        if let Some(t) = &cfg.actor_rollout_ref.model.custom_chat_template {
            tokenizer = tokenizer
                .with_chat_template(t)
                .context("actor_rollout_ref.model.custom_chat_template")?;
        }
        let mut chat = ChatOptions::with_generation_prompt();
        let kwargs = serde_json::to_value(&cfg.data.apply_chat_template_kwargs)
            .context("data.apply_chat_template_kwargs is not a JSON object")?;
        if let serde_json::Value::Object(map) = kwargs {
            chat.extra_vars.extend(map);
        }
        let truncation: Truncation = cfg.data.truncation.parse()?;
        let eos_ids: Vec<i64> = tokenizer
            .eos_token_ids()
            .iter()
            .map(|&i| i as i64)
            .collect();
        let pad_id = i64::from(tokenizer.padding_id());
        Ok(PromptEncoder {
            tokenizer,
            chat,
            agent: None,
            max_len: cfg.data.max_prompt_length as usize,
            truncation,
            pad_id,
            eos_ids,
        })
    }

    /// Token ids of one sample's prompt before truncation (the overlong filter's length).
    pub fn raw_ids(&self, sample: &Sample) -> anyhow::Result<Vec<u32>> {
        let tools = match &self.agent {
            Some(a) => a.prompt_tools(sample)?,
            None => None,
        };
        let with_tools;
        let chat = match tools {
            Some(t) => {
                with_tools = ChatOptions {
                    tools: Some(t),
                    ..self.chat.clone()
                };
                &with_tools
            }
            None => &self.chat,
        };
        self.tokenizer
            .apply_chat_template_ids(&sample.prompt, chat)
            .with_context(|| {
                format!(
                    "applying the chat template to row {} of {}",
                    sample.origin.row,
                    sample.origin.path.display()
                )
            })
    }

    /// Left-padded `prompts`/`prompt_mask` of width `data.max_prompt_length`.
    pub fn encode(&self, samples: &[&Sample], indices: &[usize]) -> anyhow::Result<Batch> {
        let w = self.max_len;
        let mut ids = vec![self.pad_id; samples.len() * w];
        let mut mask = vec![0i64; samples.len() * w];
        for (r, (s, &index)) in samples.iter().zip(indices).enumerate() {
            let raw = self.raw_ids(s)?;
            let kept = verl_data::truncate(&raw, w, self.truncation, index)?;
            let start = r * w + (w - kept.len());
            for (k, &t) in kept.iter().enumerate() {
                ids[start + k] = t as i64;
                mask[start + k] = 1;
            }
        }
        let mut b = Batch::new();
        b.insert_tensor(col::PROMPTS, &[samples.len(), w], &ids);
        b.insert_tensor(col::PROMPT_MASK, &[samples.len(), w], &mask);
        Ok(b)
    }

    /// Text of the masked-in tokens of each row (special tokens skipped, as verl decodes).
    pub fn decode_rows(
        &self,
        ids: &Tensor<i64>,
        mask: &Tensor<i64>,
    ) -> anyhow::Result<Vec<String>> {
        (0..ids.rows())
            .map(|r| {
                let toks: Vec<u32> = ids
                    .row(r)
                    .iter()
                    .zip(mask.row(r))
                    .filter(|(_, &m)| m != 0)
                    .map(|(&t, _)| t as u32)
                    .collect();
                self.tokenizer
                    .decode(&toks, true)
                    .with_context(|| format!("decoding row {r}"))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const CHATML: &str = "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

    fn folder() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let tok = verl_chat::train_bpe(
            &["one two three four five six seven", "user assistant"],
            300,
            &["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        )
        .unwrap();
        tok.save(dir.path().join("tokenizer.json"), false).unwrap();
        let tc = json!({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML});
        std::fs::write(dir.path().join("tokenizer_config.json"), tc.to_string()).unwrap();
        dir
    }

    fn sample(text: &str) -> Sample {
        let row = json!({
            "prompt": [{"role": "user", "content": text}],
            "data_source": "d", "reward_model": {"style": "rule", "ground_truth": "1"},
        });
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("one.jsonl");
        verl_data::write_jsonl(&path, [&row]).unwrap();
        let ds = verl_data::Dataset::load(&[&path], &verl_data::DataConfig::default()).unwrap();
        ds.samples()[0].clone()
    }

    #[test]
    fn prompts_are_templated_truncated_and_left_padded() {
        let dir = folder();
        let cfg =
            Config::from_overrides(&["data.max_prompt_length=12", "data.truncation=left"]).unwrap();
        let enc = PromptEncoder::new(&cfg, dir.path()).unwrap();
        let short = sample("one");
        let long = sample("one two three four five six seven one two three four five six seven");
        let raw_short = enc.raw_ids(&short).unwrap();
        assert!(raw_short.len() < 12 && enc.raw_ids(&long).unwrap().len() > 12);
        let b = enc.encode(&[&short, &long], &[0, 1]).unwrap();
        let ids = b.tensor::<i64>(col::PROMPTS).unwrap();
        let mask = b.tensor::<i64>(col::PROMPT_MASK).unwrap();
        assert_eq!(ids.shape, vec![2, 12]);
        let pad = 12 - raw_short.len();
        assert!(mask.row(0)[..pad].iter().all(|&m| m == 0));
        assert!(ids.row(0)[..pad].iter().all(|&t| t == enc.pad_id));
        let kept: Vec<u32> = ids.row(0)[pad..].iter().map(|&t| t as u32).collect();
        assert_eq!(kept, raw_short);
        assert!(mask.row(1).iter().all(|&m| m == 1));
        // Left truncation keeps the generation prompt at the end.
        let text = enc.decode_rows(&ids, &mask).unwrap();
        assert!(text[1].ends_with("assistant\n"), "{:?}", text[1]);
        assert_eq!(
            enc.eos_ids.first().copied(),
            enc.tokenizer.token_to_id("<|im_end|>").map(i64::from)
        );

        let strict = Config::from_overrides(&["data.max_prompt_length=12"]).unwrap();
        let enc = PromptEncoder::new(&strict, dir.path()).unwrap();
        let err = format!("{:#}", enc.encode(&[&long], &[5]).unwrap_err());
        assert!(err.contains('5') && err.contains("12"), "{err}");
    }

    #[test]
    fn prompt_keys_choose_the_tokenizer_and_the_template() {
        // verl's order: data.tokenizer, then model.tokenizer_path, then model.path.
        let pick = |o: &[&str]| tokenizer_dir(&Config::from_overrides(o).unwrap());
        assert_eq!(
            pick(&["actor_rollout_ref.model.path=/m"]),
            PathBuf::from("/m")
        );
        assert_eq!(
            pick(&[
                "actor_rollout_ref.model.path=/m",
                "actor_rollout_ref.model.tokenizer_path=/t"
            ]),
            PathBuf::from("/t")
        );
        assert_eq!(
            pick(&[
                "actor_rollout_ref.model.path=/m",
                "actor_rollout_ref.model.tokenizer_path=/t",
                "data.tokenizer=/d"
            ]),
            PathBuf::from("/d")
        );

        let dir = folder();
        let text = |o: &[&str]| {
            let cfg = Config::from_overrides(o).unwrap();
            let enc = PromptEncoder::new(&cfg, dir.path()).unwrap();
            enc.tokenizer
                .apply_chat_template(&sample("one").prompt, &enc.chat)
                .unwrap()
        };
        assert_eq!(
            text(&[]),
            "<|im_start|>user\none<|im_end|>\n<|im_start|>assistant\n"
        );
        // A custom template replaces the folder's; template kwargs reach it as variables.
        let custom = "{% for m in messages %}[{{ m.role }}|{{ m.content }}]{% endfor %}{% if greeting %}{{ greeting }}{% endif %}";
        let o = format!("actor_rollout_ref.model.custom_chat_template='{custom}'");
        assert_eq!(text(&[&o]), "[user|one]");
        assert_eq!(
            text(&[&o, "+data.apply_chat_template_kwargs.greeting=hello"]),
            "[user|one]hello"
        );
    }
}
