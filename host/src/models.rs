//! The models a job lends: its reward model (verl's `reward_model.*`), scored by the reward
//! router and by reward plugins, and generation models (a generative reward model / judge) that
//! reward plugins prompt through the model services.
//!
//! Text is the host's business: a reward model's input is rendered with the reward model's own
//! tokenizer and chat template, truncated and padded here, and only token ids cross into the
//! backend plugin that holds the weights.

use std::path::Path;
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context};
use serde::Serialize;
use verl_chat::{ChatOptions, Tokenizer};
use verl_plugin_api::client::{ActorClient, RewardModelClient};
use verl_plugin_api::{
    col, contract::prompt_batch, Batch, Error as ApiError, ErrorKind, GenerateOptions, ModelInfo,
    ModelKind, ModelProvider, TextGenerateOptions,
};

/// A reward model: its tokenizer and template, its input length, the backend role.
pub struct ScoringModel {
    tokenizer: Tokenizer,
    /// Inputs are cut to this many tokens from the right (verl's `reward_model.max_length`;
    /// `None`: the caller's default, see [`ScoringModel::limit`]).
    max_length: Option<usize>,
    pad_id: i64,
    client: RewardModelClient,
}

impl ScoringModel {
    /// `dir` holds the reward model's tokenizer (`tokenizer.json`, `tokenizer_config.json`).
    pub fn new(
        dir: &Path,
        max_length: Option<usize>,
        client: RewardModelClient,
    ) -> anyhow::Result<Self> {
        let tokenizer = Tokenizer::from_dir(dir).with_context(|| {
            format!(
                "loading the reward model's tokenizer from {}",
                dir.display()
            )
        })?;
        let pad_id = i64::from(tokenizer.padding_id());
        Ok(ScoringModel {
            tokenizer,
            max_length: max_length.map(|m| m.max(1)),
            pad_id,
            client,
        })
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The chat as the reward model reads it: its own template, no generation prompt (verl's
    /// `apply_chat_template(chat, add_generation_prompt=False, tokenize=False)`).
    pub fn render<M: Serialize>(&self, chat: &[M]) -> anyhow::Result<String> {
        self.tokenizer
            .apply_chat_template(chat, &ChatOptions::default())
            .context("rendering a chat with the reward model's chat template")
    }

    /// The input length: `reward_model.max_length`, else `default` (verl: the policy's prompt +
    /// response length), else no limit.
    pub fn limit(&self, default: Option<usize>) -> usize {
        self.max_length.or(default).unwrap_or(usize::MAX)
    }

    /// Token ids of rendered texts (`add_special_tokens=false`, the template holds them) or of
    /// raw texts (`true`, as `tokenizer(text)`), cut to `limit` tokens from the right.
    pub fn encode(
        &self,
        texts: &[String],
        add_special_tokens: bool,
        limit: usize,
    ) -> anyhow::Result<Vec<Vec<i64>>> {
        texts
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let ids = self
                    .tokenizer
                    .encode(t, add_special_tokens)
                    .with_context(|| format!("tokenizing reward-model input {i}"))?;
                Ok(ids.iter().take(limit).map(|&x| x as i64).collect())
            })
            .collect()
    }

    /// Scores of token id rows (right-padded here).
    pub fn score_ids(&mut self, rows: &[Vec<i64>]) -> anyhow::Result<Vec<f32>> {
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let rows: Vec<&[i64]> = rows.iter().map(|r| r.as_slice()).collect();
        if let Some(i) = rows.iter().position(|r| r.is_empty()) {
            bail!("reward-model input {i} has no tokens");
        }
        let w = rows.iter().map(|r| r.len()).max().unwrap_or(1);
        let mut ids = vec![self.pad_id; rows.len() * w];
        let mut mask = vec![0i64; rows.len() * w];
        for (r, row) in rows.iter().enumerate() {
            ids[r * w..r * w + row.len()].copy_from_slice(row);
            mask[r * w..r * w + row.len()].fill(1);
        }
        let mut b = Batch::new();
        b.insert_tensor(col::INPUT_IDS, &[rows.len(), w], &ids);
        b.insert_tensor(col::ATTENTION_MASK, &[rows.len(), w], &mask);
        Ok(self.client.score(&b)?)
    }

    /// Scores of chats (each a list of `{role, content}` messages); `default_length` as in
    /// [`ScoringModel::limit`].
    pub fn score_chats<M: Serialize>(
        &mut self,
        chats: &[Vec<M>],
        default_length: Option<usize>,
    ) -> anyhow::Result<Vec<f32>> {
        let texts = chats
            .iter()
            .map(|c| self.render(c))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let ids = self.encode(&texts, false, self.limit(default_length))?;
        self.score_ids(&ids)
    }

    /// Scores of raw texts (tokenized as `tokenizer(text)`, special tokens added).
    pub fn score_texts(
        &mut self,
        texts: &[String],
        default_length: Option<usize>,
    ) -> anyhow::Result<Vec<f32>> {
        let ids = self.encode(texts, true, self.limit(default_length))?;
        self.score_ids(&ids)
    }

    /// Keeps the weights on the device until [`ScoringModel::release`] (a reward phase).
    pub fn hold(&mut self) -> anyhow::Result<()> {
        self.residency("onload")
    }

    /// Lets the weights leave the device again (when the job offloads them).
    pub fn release(&mut self) -> anyhow::Result<()> {
        self.residency("offload")
    }

    /// A backend whose reward model does not move its weights answers "not implemented": it
    /// keeps them where they are, which is fine.
    fn residency(&mut self, method: &str) -> anyhow::Result<()> {
        match self.client.call(method, &serde_json::Value::Null) {
            Err(e) if e.kind() == ErrorKind::NotImplemented => Ok(()),
            r => r.map(|_| ()).map_err(Into::into),
        }
    }
}

/// A generation model (a generative reward model or judge): a backend's frozen policy role.
pub struct GenerationModel {
    tokenizer: Tokenizer,
    pad_id: i64,
    eos_ids: Vec<i64>,
    client: ActorClient,
}

impl GenerationModel {
    pub fn new(dir: &Path, client: ActorClient) -> anyhow::Result<Self> {
        let tokenizer = Tokenizer::from_dir(dir)
            .with_context(|| format!("loading the tokenizer of {}", dir.display()))?;
        let eos_ids: Vec<i64> = tokenizer
            .eos_token_ids()
            .iter()
            .map(|&i| i as i64)
            .collect();
        let pad_id = i64::from(tokenizer.padding_id());
        Ok(GenerationModel {
            tokenizer,
            pad_id,
            eos_ids,
            client,
        })
    }

    /// One completion per prompt (token ids), decoded without special tokens.
    pub fn generate_ids(
        &mut self,
        prompts: &[Vec<u32>],
        opts: &TextGenerateOptions,
    ) -> anyhow::Result<Vec<String>> {
        if prompts.is_empty() {
            return Ok(Vec::new());
        }
        let rows: Vec<Vec<i64>> = prompts
            .iter()
            .map(|p| p.iter().map(|&t| t as i64).collect())
            .collect();
        let refs: Vec<&[i64]> = rows.iter().map(|r| r.as_slice()).collect();
        let batch = prompt_batch(&refs, self.pad_id);
        let out = self.client.generate(
            &batch,
            &GenerateOptions {
                n: 1,
                max_new_tokens: opts.max_new_tokens,
                temperature: opts.temperature,
                top_p: opts.top_p,
                top_k: opts.top_k,
                do_sample: opts.do_sample,
                seed: opts.seed,
                row_offset: 0,
                eos_token_ids: self.eos_ids.clone(),
                pad_token_id: self.pad_id,
                ignore_eos: false,
                return_log_probs: false,
                validate: true,
            },
        )?;
        let ids = out.tensor::<i64>(col::RESPONSES)?;
        let mask = out.tensor::<i64>(col::RESPONSE_MASK)?;
        (0..ids.rows())
            .map(|r| {
                let toks: Vec<u32> = ids
                    .row(r)
                    .iter()
                    .zip(mask.row(r))
                    .filter(|(_, &m)| m != 0)
                    .map(|(&t, _)| t as u32)
                    .collect();
                Ok(self.tokenizer.decode(&toks, true)?)
            })
            .collect()
    }

    /// One completion per chat (the template's generation prompt added).
    pub fn generate_chats<M: Serialize>(
        &mut self,
        chats: &[Vec<M>],
        opts: &TextGenerateOptions,
    ) -> anyhow::Result<Vec<String>> {
        let prompts = chats
            .iter()
            .map(|c| {
                self.tokenizer
                    .apply_chat_template_ids(c, &ChatOptions::with_generation_prompt())
                    .context("rendering a judge prompt with the model's chat template")
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        self.generate_ids(&prompts, opts)
    }

    /// One completion per raw text prompt (special tokens added as `tokenizer(text)`).
    pub fn generate_texts(
        &mut self,
        texts: &[String],
        opts: &TextGenerateOptions,
    ) -> anyhow::Result<Vec<String>> {
        let prompts = texts
            .iter()
            .map(|t| Ok(self.tokenizer.encode(t, true)?))
            .collect::<anyhow::Result<Vec<_>>>()?;
        self.generate_ids(&prompts, opts)
    }
}

pub enum LentModel {
    Score(ScoringModel),
    Generate(GenerationModel),
}

impl LentModel {
    pub fn kind(&self) -> ModelKind {
        match self {
            LentModel::Score(_) => ModelKind::Score,
            LentModel::Generate(_) => ModelKind::Generate,
        }
    }
}

/// The job's lent models by name, shared by the reward router and the reward plugins' model
/// services. A call locks them for its duration.
#[derive(Clone, Default)]
pub struct SharedModels(Arc<Mutex<Vec<(String, LentModel)>>>);

impl SharedModels {
    pub fn new(models: Vec<(String, LentModel)>) -> Self {
        SharedModels(Arc::new(Mutex::new(models)))
    }

    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(String, LentModel)>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn kind_of(&self, name: &str) -> Option<ModelKind> {
        self.lock()
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, m)| m.kind())
    }

    pub fn names(&self) -> Vec<String> {
        self.lock().iter().map(|(n, _)| n.clone()).collect()
    }

    /// Runs `f` on the reward model `name`.
    pub fn with_scoring<T>(
        &self,
        name: &str,
        f: impl FnOnce(&mut ScoringModel) -> anyhow::Result<T>,
    ) -> anyhow::Result<T> {
        let mut models = self.lock();
        match models.iter_mut().find(|(n, _)| n == name) {
            Some((_, LentModel::Score(m))) => f(m),
            Some((_, LentModel::Generate(_))) => bail!(
                "model `{name}` is a generation model (a judge): it generates text and has no \
                 score head; a reward plugin prompts it through the model services"
            ),
            None => bail!("no model named `{name}` (lent: {})", names(&models)),
        }
    }

    pub fn with_generation<T>(
        &self,
        name: &str,
        f: impl FnOnce(&mut GenerationModel) -> anyhow::Result<T>,
    ) -> anyhow::Result<T> {
        let mut models = self.lock();
        match models.iter_mut().find(|(n, _)| n == name) {
            Some((_, LentModel::Generate(m))) => f(m),
            Some((_, LentModel::Score(_))) => {
                bail!("model `{name}` is a reward model (a score head): use the `score` service")
            }
            None => bail!("no model named `{name}` (lent: {})", names(&models)),
        }
    }

    /// Holds every reward model's weights on the device for a reward phase.
    pub fn hold_all(&self) -> anyhow::Result<()> {
        for (_, m) in self.lock().iter_mut() {
            if let LentModel::Score(s) = m {
                s.hold()?;
            }
        }
        Ok(())
    }

    pub fn release_all(&self) -> anyhow::Result<()> {
        for (_, m) in self.lock().iter_mut() {
            if let LentModel::Score(s) = m {
                s.release()?;
            }
        }
        Ok(())
    }
}

fn names(models: &[(String, LentModel)]) -> String {
    if models.is_empty() {
        return "none".into();
    }
    models
        .iter()
        .map(|(n, _)| n.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Chats of a service call: `messages` (JSON lists of messages) or `text` (raw strings).
enum ServiceInput {
    Chats(Vec<Vec<serde_json::Value>>),
    Texts(Vec<String>),
}

fn service_input(batch: &Batch) -> anyhow::Result<ServiceInput> {
    if batch.contains(col::MESSAGES) {
        let rows = batch.json(col::MESSAGES)?;
        let chats = rows
            .into_iter()
            .enumerate()
            .map(|(i, v)| match v {
                serde_json::Value::Array(m) => Ok(m),
                other => bail!(
                    "column `messages`, row {i}: expected a list of {{role, content}} messages, found {other}"
                ),
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(ServiceInput::Chats(chats))
    } else if batch.contains(col::TEXT) {
        Ok(ServiceInput::Texts(batch.strings(col::TEXT)?))
    } else {
        bail!(
            "expected a `messages` (chats) or `text` (strings) column, found: {}",
            batch.column_names().join(", ")
        )
    }
}

impl ModelProvider for SharedModels {
    fn models(&self) -> Vec<ModelInfo> {
        self.lock()
            .iter()
            .map(|(n, m)| ModelInfo {
                name: n.clone(),
                kind: m.kind(),
            })
            .collect()
    }

    fn call(
        &self,
        model: &str,
        method: &str,
        batch: &Batch,
        options: &serde_json::Value,
    ) -> verl_plugin_api::Result<Batch> {
        let run = || -> anyhow::Result<Batch> {
            let input = service_input(batch)?;
            let mut out = Batch::new();
            match method {
                "score" => {
                    let s = self.with_scoring(model, |m| match &input {
                        ServiceInput::Chats(c) => m.score_chats(c, None),
                        ServiceInput::Texts(t) => m.score_texts(t, None),
                    })?;
                    out.insert_tensor(col::SCORES, &[s.len()], &s);
                }
                "generate" => {
                    let opts: TextGenerateOptions = if options.is_null() {
                        TextGenerateOptions::default()
                    } else {
                        serde_json::from_value(options.clone())
                            .context("generate options (max_new_tokens, temperature, ...)")?
                    };
                    let t = self.with_generation(model, |m| match &input {
                        ServiceInput::Chats(c) => m.generate_chats(c, &opts),
                        ServiceInput::Texts(t) => m.generate_texts(t, &opts),
                    })?;
                    out.insert_strings(col::RESPONSE_TEXT, &t);
                }
                other => bail!("model service `{other}`: the services are `score` and `generate`"),
            }
            Ok(out)
        };
        run().map_err(|e| {
            ApiError::with_kind(
                ErrorKind::InvalidInput,
                format!("model `{model}` {method}: {e:#}"),
            )
        })
    }
}
