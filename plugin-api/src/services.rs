//! Model services: the models a host lends its reward plugins.
//!
//! A reward plugin with no libtorch of its own can still score with the job's reward models and
//! generate with its judge models: the host hands it a [`ModelServices`] when it creates the
//! plugin ([`crate::sdk::RewardPlugin::create_reward_with`]). Calls are text in, scores or text
//! out; the host renders each chat with the model's own tokenizer and chat template.
//!
//! ```ignore
//! let prompts: Vec<serde_json::Value> = rows.iter().map(|r| judge_chat(r)).collect();
//! let verdicts = services.generate("judge", &prompts, &TextGenerateOptions::greedy(16))?;
//! ```
//!
//! The host implements [`ModelProvider`]; [`services_box`] turns it into the ABI object.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use abi_stable::{
    sabi_trait::TD_Opaque,
    std_types::{RErr, ROk, RResult, RStr, RString},
};
use serde::{Deserialize, Serialize};

use crate::batch::Batch;
use crate::contract::col;
use crate::error::{Error, ErrorKind, FfiError, Result};
use crate::ffi::{ModelServicesBox, ModelServicesFfi, ModelServicesFfi_TO};

/// What a lent model does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelKind {
    /// A sequence-scoring reward model: `score`.
    Score,
    /// A generation model (a judge): `generate`.
    Generate,
}

/// One model the host lends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelInfo {
    pub name: String,
    pub kind: ModelKind,
}

/// Sampling options of a `generate` service call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TextGenerateOptions {
    pub max_new_tokens: u32,
    pub temperature: f64,
    pub top_p: f64,
    /// `-1` disables top-k.
    pub top_k: i64,
    /// `false` = greedy.
    pub do_sample: bool,
    pub seed: Option<u64>,
}

impl Default for TextGenerateOptions {
    fn default() -> Self {
        TextGenerateOptions {
            max_new_tokens: 64,
            temperature: 1.0,
            top_p: 1.0,
            top_k: -1,
            do_sample: false,
            seed: None,
        }
    }
}

impl TextGenerateOptions {
    /// Greedy decoding of at most `max_new_tokens` tokens.
    pub fn greedy(max_new_tokens: u32) -> Self {
        TextGenerateOptions {
            max_new_tokens,
            ..Default::default()
        }
    }
}

/// The host's side: answers model-service calls.
pub trait ModelProvider: Send + Sync + 'static {
    fn models(&self) -> Vec<ModelInfo>;
    /// `method` is `score` (input: [`col::MESSAGES`] or [`col::TEXT`]; output: [`col::SCORES`])
    /// or `generate` (input: [`col::MESSAGES`] or [`col::TEXT`]; output: [`col::RESPONSE_TEXT`]).
    fn call(
        &self,
        model: &str,
        method: &str,
        batch: &Batch,
        options: &serde_json::Value,
    ) -> Result<Batch>;
}

struct ProviderAdapter<P>(P);

impl<P: ModelProvider> ModelServicesFfi for ProviderAdapter<P> {
    fn models(&self) -> RString {
        let list = catch_unwind(AssertUnwindSafe(|| self.0.models())).unwrap_or_default();
        serde_json::to_string(&list)
            .unwrap_or_else(|_| "[]".into())
            .into()
    }
    fn call(
        &self,
        model: RStr<'_>,
        method: RStr<'_>,
        batch: &Batch,
        options: RStr<'_>,
    ) -> RResult<Batch, FfiError> {
        let run = || -> Result<Batch> {
            let s = options.as_str();
            let opts: serde_json::Value = if s.trim().is_empty() {
                serde_json::Value::Null
            } else {
                serde_json::from_str(s).map_err(|e| Error::Options {
                    call: format!("model service {method}"),
                    message: e.to_string(),
                })?
            };
            self.0.call(model.as_str(), method.as_str(), batch, &opts)
        };
        match catch_unwind(AssertUnwindSafe(run)) {
            Ok(Ok(b)) => ROk(b),
            Ok(Err(e)) => RErr(e.into_ffi()),
            Err(_) => RErr(
                Error::with_kind(ErrorKind::Panic, "the host's model service panicked").into_ffi(),
            ),
        }
    }
}

/// The ABI object for a host's [`ModelProvider`].
pub fn services_box(provider: impl ModelProvider) -> ModelServicesBox {
    ModelServicesFfi_TO::from_value(ProviderAdapter(provider), TD_Opaque)
}

/// The plugin's side: the models the host lent it. Cheap to clone.
#[derive(Clone, Default)]
pub struct ModelServices {
    inner: Option<Arc<ModelServicesBox>>,
}

impl std::fmt::Debug for ModelServices {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelServices")
            .field("lent", &self.inner.is_some())
            .finish()
    }
}

impl ModelServices {
    /// No models (a host that lends none, or a plugin created through `create_reward`).
    pub fn none() -> Self {
        ModelServices { inner: None }
    }

    pub fn from_box(b: ModelServicesBox) -> Self {
        ModelServices {
            inner: Some(Arc::new(b)),
        }
    }

    /// In-process services (tests, embedders).
    pub fn from_provider(p: impl ModelProvider) -> Self {
        Self::from_box(services_box(p))
    }

    fn inner(&self, what: &str) -> Result<&ModelServicesBox> {
        self.inner.as_deref().ok_or_else(|| {
            Error::with_kind(
                ErrorKind::InvalidInput,
                format!(
                    "{what}: the host lent this plugin no models (a host older than model \
                     services, or a plugin created without them)"
                ),
            )
        })
    }

    /// The models the host lends (empty when it lends none).
    pub fn models(&self) -> Vec<ModelInfo> {
        match &self.inner {
            None => Vec::new(),
            Some(b) => serde_json::from_str(b.models().as_str()).unwrap_or_default(),
        }
    }

    /// A raw service call; the typed helpers below build the batches.
    pub fn call(
        &self,
        model: &str,
        method: &str,
        batch: &Batch,
        options: &serde_json::Value,
    ) -> Result<Batch> {
        let b = self.inner(&format!("model service `{method}` on `{model}`"))?;
        b.call(
            RStr::from_str(model),
            RStr::from_str(method),
            batch,
            RStr::from_str(&options.to_string()),
        )
        .into_result()
        .map_err(|e| Error::from_ffi(e, "host", &format!("model `{model}` {method}")))
    }

    /// Scores of chats (each a JSON list of `{role, content}` messages, the last one usually the
    /// assistant's answer) under reward model `model`, one per chat.
    pub fn score(&self, model: &str, chats: &[serde_json::Value]) -> Result<Vec<f32>> {
        let mut b = Batch::new();
        b.insert_json(col::MESSAGES, chats);
        self.scores_of(model, &b, chats.len())
    }

    /// Scores of texts already in the reward model's format, one per text.
    pub fn score_texts(&self, model: &str, texts: &[&str]) -> Result<Vec<f32>> {
        let mut b = Batch::new();
        b.insert_strings(col::TEXT, texts);
        self.scores_of(model, &b, texts.len())
    }

    fn scores_of(&self, model: &str, b: &Batch, rows: usize) -> Result<Vec<f32>> {
        let out = self.call(model, "score", b, &serde_json::Value::Null)?;
        let s = out.tensor::<f32>(col::SCORES)?.data;
        if s.len() != rows {
            return Err(Error::failed(format!(
                "model `{model}` score: {rows} rows in, {} scores out",
                s.len()
            )));
        }
        Ok(s)
    }

    /// One completion per chat from generation model `model` (the chat template's generation
    /// prompt is added), decoded without special tokens.
    pub fn generate(
        &self,
        model: &str,
        chats: &[serde_json::Value],
        options: &TextGenerateOptions,
    ) -> Result<Vec<String>> {
        let mut b = Batch::new();
        b.insert_json(col::MESSAGES, chats);
        self.texts_of(model, &b, chats.len(), options)
    }

    /// One completion per raw prompt text (no chat template).
    pub fn generate_texts(
        &self,
        model: &str,
        prompts: &[&str],
        options: &TextGenerateOptions,
    ) -> Result<Vec<String>> {
        let mut b = Batch::new();
        b.insert_strings(col::TEXT, prompts);
        self.texts_of(model, &b, prompts.len(), options)
    }

    fn texts_of(
        &self,
        model: &str,
        b: &Batch,
        rows: usize,
        options: &TextGenerateOptions,
    ) -> Result<Vec<String>> {
        let opts = serde_json::to_value(options).expect("options serialise");
        let out = self.call(model, "generate", b, &opts)?;
        let t = out.strings(col::RESPONSE_TEXT)?;
        if t.len() != rows {
            return Err(Error::failed(format!(
                "model `{model}` generate: {rows} prompts in, {} texts out",
                t.len()
            )));
        }
        Ok(t)
    }
}
