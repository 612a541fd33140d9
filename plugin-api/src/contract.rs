//! The contracts in words the host and plugins share: column names, what each call takes and
//! returns (checked at every crossing), and the typed options that travel as JSON.

use serde::{Deserialize, Serialize};

use crate::batch::{ColumnSpec, DType, Dim, ROWS};
use crate::header::Role;

/// Column names (verl's where verl has one).
pub mod col {
    /// Left-padded prompt token ids `[rows, prompt_length]`, i64.
    pub const PROMPTS: &str = "prompts";
    /// 1 for real prompt tokens, 0 for padding `[rows, prompt_length]`, i64.
    pub const PROMPT_MASK: &str = "prompt_mask";
    /// Right-padded response token ids `[rows, response_length]`, i64.
    pub const RESPONSES: &str = "responses";
    /// 1 for real response tokens `[rows, response_length]`, i64.
    pub const RESPONSE_MASK: &str = "response_mask";
    /// Log-probs of the sampled tokens under the sampling distribution, f32.
    pub const ROLLOUT_LOG_PROBS: &str = "rollout_log_probs";
    /// Why each response ended: `stop` (EOS/stop token) or `length`.
    pub const FINISH_REASON: &str = "finish_reason";
    /// Which input prompt row each response belongs to `[rows]`, i64.
    pub const PROMPT_INDEX: &str = "prompt_index";
    /// Per-token log-probs returned by `compute_log_prob`, f32.
    pub const LOG_PROBS: &str = "log_probs";
    /// Per-token entropy returned by `compute_log_prob` when asked for, f32.
    pub const ENTROPY: &str = "entropy";
    /// Inputs of `update`. `old_log_probs` is absent on on-policy steps (one mini-batch, one
    /// epoch), where the host skips the old-log-prob pass: the update then takes the PPO ratio
    /// against its own detached log-probs (as verl's actor does whenever it is on-policy), and
    /// reports `actor/entropy` when `UpdateOptions.extra.entropy_metric` is true.
    pub const OLD_LOG_PROBS: &str = "old_log_probs";
    pub const REF_LOG_PROBS: &str = "ref_log_prob";
    /// Optional input of `update` `[rows, response_length]`, f32: per-token importance weights
    /// multiplied into the policy loss (verl's rollout correction, `rollout_is`).
    pub const ROLLOUT_IS_WEIGHTS: &str = "rollout_is_weights";
    /// Optional input of `update` `[rows, response_length]`, i64: the response tokens the losses
    /// count, a subset of `response_mask` (verl's rollout-correction rejection sampling removes
    /// tokens here). `response_mask` still says which tokens exist; absent: `response_mask`.
    pub const LOSS_MASK: &str = "loss_mask";
    pub const ADVANTAGES: &str = "advantages";
    pub const RETURNS: &str = "returns";
    pub const VALUES: &str = "values";
    /// Reward inputs.
    pub const PROMPT_TEXT: &str = "prompt_text";
    pub const RESPONSE_TEXT: &str = "response_text";
    pub const DATA_SOURCE: &str = "data_source";
    pub const GROUND_TRUTH: &str = "ground_truth";
    pub const EXTRA_INFO: &str = "extra_info";
    /// Reward outputs: one score per row (f32), optional per-token scores.
    pub const SCORES: &str = "scores";
    pub const TOKEN_SCORES: &str = "token_level_scores";
    /// Prefix of per-row f32 columns a reward plugin may add as extra metrics (`reward_extra/acc`).
    pub const REWARD_EXTRA_PREFIX: &str = "reward_extra/";
    /// A reward model's input: right-padded token ids of whole sequences `[rows, seq_len]`, i64,
    /// rendered and tokenized by the host with the reward model's own tokenizer and template.
    pub const INPUT_IDS: &str = "input_ids";
    /// 1 for real tokens of `input_ids`, 0 for padding, i64.
    pub const ATTENTION_MASK: &str = "attention_mask";
    /// Model-service inputs: one chat (a JSON list of `{role, content}` messages) per row ...
    pub const MESSAGES: &str = "messages";
    /// ... or one already rendered text per row (scored / continued as it is).
    pub const TEXT: &str = "text";
}

const PL: Dim = Dim::Named("prompt_length");
const RL: Dim = Dim::Named("response_length");

/// `Actor.generate` input.
pub const GENERATE_IN: &[ColumnSpec] = &[
    ColumnSpec::tensor(col::PROMPTS, DType::I64, &[ROWS, PL]),
    ColumnSpec::tensor(col::PROMPT_MASK, DType::I64, &[ROWS, PL]),
];
/// `Actor.generate` output: `rows = input rows × n`, grouped by prompt (prompt 0's n samples first).
pub const GENERATE_OUT: &[ColumnSpec] = &[
    ColumnSpec::tensor(col::PROMPTS, DType::I64, &[ROWS, PL]),
    ColumnSpec::tensor(col::PROMPT_MASK, DType::I64, &[ROWS, PL]),
    ColumnSpec::tensor(col::RESPONSES, DType::I64, &[ROWS, RL]),
    ColumnSpec::tensor(col::RESPONSE_MASK, DType::I64, &[ROWS, RL]),
    ColumnSpec::tensor(col::PROMPT_INDEX, DType::I64, &[ROWS]),
    ColumnSpec::tensor(col::ROLLOUT_LOG_PROBS, DType::F32, &[ROWS, RL]).optional(),
    ColumnSpec::strings(col::FINISH_REASON).optional(),
];
/// `Actor.generate_turns` output: [`GENERATE_OUT`] where `responses` holds every turn and what
/// the host appended between turns, and `loss_mask` is 1 on the tokens the model sampled.
pub const GENERATE_TURNS_OUT: &[ColumnSpec] = &[
    ColumnSpec::tensor(col::PROMPTS, DType::I64, &[ROWS, PL]),
    ColumnSpec::tensor(col::PROMPT_MASK, DType::I64, &[ROWS, PL]),
    ColumnSpec::tensor(col::RESPONSES, DType::I64, &[ROWS, RL]),
    ColumnSpec::tensor(col::RESPONSE_MASK, DType::I64, &[ROWS, RL]),
    ColumnSpec::tensor(col::LOSS_MASK, DType::I64, &[ROWS, RL]),
    ColumnSpec::tensor(col::PROMPT_INDEX, DType::I64, &[ROWS]),
    ColumnSpec::tensor(col::ROLLOUT_LOG_PROBS, DType::F32, &[ROWS, RL]).optional(),
    ColumnSpec::strings(col::FINISH_REASON).optional(),
];
/// Input of every call that scores a whole (prompt, response) sequence.
pub const SEQUENCE_IN: &[ColumnSpec] = &[
    ColumnSpec::tensor(col::PROMPTS, DType::I64, &[ROWS, PL]),
    ColumnSpec::tensor(col::PROMPT_MASK, DType::I64, &[ROWS, PL]),
    ColumnSpec::tensor(col::RESPONSES, DType::I64, &[ROWS, RL]),
    ColumnSpec::tensor(col::RESPONSE_MASK, DType::I64, &[ROWS, RL]),
];
pub const LOG_PROB_OUT: &[ColumnSpec] = &[
    ColumnSpec::tensor(col::LOG_PROBS, DType::F32, &[ROWS, RL]),
    ColumnSpec::tensor(col::ENTROPY, DType::F32, &[ROWS, RL]).optional(),
];
pub const ACTOR_UPDATE_IN: &[ColumnSpec] = &[
    ColumnSpec::tensor(col::PROMPTS, DType::I64, &[ROWS, PL]),
    ColumnSpec::tensor(col::PROMPT_MASK, DType::I64, &[ROWS, PL]),
    ColumnSpec::tensor(col::RESPONSES, DType::I64, &[ROWS, RL]),
    ColumnSpec::tensor(col::RESPONSE_MASK, DType::I64, &[ROWS, RL]),
    ColumnSpec::tensor(col::OLD_LOG_PROBS, DType::F32, &[ROWS, RL]).optional(),
    ColumnSpec::tensor(col::ADVANTAGES, DType::F32, &[ROWS, RL]),
    ColumnSpec::tensor(col::REF_LOG_PROBS, DType::F32, &[ROWS, RL]).optional(),
    ColumnSpec::tensor(col::ROLLOUT_LOG_PROBS, DType::F32, &[ROWS, RL]).optional(),
    ColumnSpec::tensor(col::ROLLOUT_IS_WEIGHTS, DType::F32, &[ROWS, RL]).optional(),
    ColumnSpec::tensor(col::LOSS_MASK, DType::I64, &[ROWS, RL]).optional(),
];
pub const VALUES_OUT: &[ColumnSpec] = &[ColumnSpec::tensor(col::VALUES, DType::F32, &[ROWS, RL])];
pub const CRITIC_UPDATE_IN: &[ColumnSpec] = &[
    ColumnSpec::tensor(col::PROMPTS, DType::I64, &[ROWS, PL]),
    ColumnSpec::tensor(col::PROMPT_MASK, DType::I64, &[ROWS, PL]),
    ColumnSpec::tensor(col::RESPONSES, DType::I64, &[ROWS, RL]),
    ColumnSpec::tensor(col::RESPONSE_MASK, DType::I64, &[ROWS, RL]),
    ColumnSpec::tensor(col::VALUES, DType::F32, &[ROWS, RL]),
    ColumnSpec::tensor(col::RETURNS, DType::F32, &[ROWS, RL]),
    ColumnSpec::tensor(col::LOSS_MASK, DType::I64, &[ROWS, RL]).optional(),
];
pub const REWARD_IN: &[ColumnSpec] = &[
    ColumnSpec::strings(col::PROMPT_TEXT),
    ColumnSpec::strings(col::RESPONSE_TEXT),
    ColumnSpec::strings(col::DATA_SOURCE),
    ColumnSpec::json(col::GROUND_TRUTH),
    ColumnSpec::json(col::EXTRA_INFO),
    ColumnSpec::tensor(col::RESPONSES, DType::I64, &[ROWS, RL]).optional(),
    ColumnSpec::tensor(col::RESPONSE_MASK, DType::I64, &[ROWS, RL]).optional(),
];
const SL: Dim = Dim::Named("seq_len");

/// A backend reward model's `score` input (the [`crate::Role::RewardModel`] role).
pub const RM_SCORE_IN: &[ColumnSpec] = &[
    ColumnSpec::tensor(col::INPUT_IDS, DType::I64, &[ROWS, SL]),
    ColumnSpec::tensor(col::ATTENTION_MASK, DType::I64, &[ROWS, SL]),
];
/// A backend reward model's `score` output: the head's output at each row's last real token.
pub const RM_SCORE_OUT: &[ColumnSpec] = &[ColumnSpec::tensor(col::SCORES, DType::F32, &[ROWS])];

pub const REWARD_OUT: &[ColumnSpec] = &[
    ColumnSpec::tensor(col::SCORES, DType::F32, &[ROWS]),
    ColumnSpec::tensor(col::TOKEN_SCORES, DType::F32, &[ROWS, RL]).optional(),
];

/// Everything a plugin gets when one of its roles is created (JSON across the ABI).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InitArgs {
    pub role: Role,
    /// The whole resolved job config (verl's schema) as JSON; the plugin reads its own sections.
    pub config: serde_json::Value,
    /// Global rank, world size and local rank of this process (SPMD).
    #[serde(default)]
    pub rank: u32,
    #[serde(default = "one")]
    pub world_size: u32,
    #[serde(default)]
    pub local_rank: u32,
    /// Where the job's ranks meet (`world_size > 1`): the TCP store the host joined. A backend
    /// connects its own communicator there; `None` on a single-rank job.
    #[serde(default)]
    pub rendezvous: Option<Rendezvous>,
    /// Role-specific extra arguments (e.g. a reward plugin's per-route options).
    #[serde(default)]
    pub extra: serde_json::Value,
}

/// The rendezvous store of an SPMD job (torchrun's `MASTER_ADDR:MASTER_PORT`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rendezvous {
    pub master_addr: String,
    pub master_port: u16,
    /// How long a collective or rendezvous may wait for a peer before failing, in seconds.
    #[serde(default = "rendezvous_timeout_s")]
    pub timeout_s: u64,
}

fn rendezvous_timeout_s() -> u64 {
    300
}

fn one() -> u32 {
    1
}

impl InitArgs {
    pub fn new(role: Role, config: serde_json::Value) -> Self {
        InitArgs {
            role,
            config,
            rank: 0,
            world_size: 1,
            local_rank: 0,
            rendezvous: None,
            extra: serde_json::Value::Null,
        }
    }
}

/// Sampling options of `Actor.generate` (verl's rollout keys).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct GenerateOptions {
    /// Samples per prompt.
    pub n: u32,
    pub max_new_tokens: u32,
    pub temperature: f64,
    pub top_p: f64,
    /// `-1` / `0` disables top-k (verl uses -1).
    pub top_k: i64,
    /// `false` = greedy.
    pub do_sample: bool,
    /// Base seed; sample `i` of prompt `j` uses a seed derived from it, so results are reproducible.
    pub seed: Option<u64>,
    /// Global index of the first prompt of this call (its data-parallel rank's offset in the
    /// step's batch): prompt `i` samples as prompt `row_offset + i` would, so the split of a batch
    /// over ranks does not change what is generated.
    pub row_offset: u64,
    pub eos_token_ids: Vec<i64>,
    pub pad_token_id: i64,
    /// Keep generating past EOS (fixed-length benchmarks).
    pub ignore_eos: bool,
    /// Return `rollout_log_probs`.
    pub return_log_probs: bool,
    /// A validation pass (verl's `val_kwargs`); backends may skip training-only bookkeeping.
    pub validate: bool,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            n: 1,
            max_new_tokens: 16,
            temperature: 1.0,
            top_p: 1.0,
            top_k: -1,
            do_sample: true,
            seed: None,
            row_offset: 0,
            eos_token_ids: vec![],
            pad_token_id: 0,
            ignore_eos: false,
            return_log_probs: true,
            validate: false,
        }
    }
}

/// Options of `compute_log_prob`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LogProbOptions {
    /// Logits are divided by this before the softmax (verl: the rollout temperature).
    pub temperature: f64,
    pub with_entropy: bool,
    /// The log-probs of the actor's base model: a LoRA actor's adapters off (verl's
    /// `no_lora_adapter`, the reference policy of a LoRA job). Only asked of an actor whose
    /// backend declares the `lora` feature ([`crate::Capability::features`]).
    pub base_model: bool,
}

impl Default for LogProbOptions {
    fn default() -> Self {
        LogProbOptions {
            temperature: 1.0,
            with_entropy: false,
            base_model: false,
        }
    }
}

/// Per-step options of `update` (the static ones come from the config at init).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct UpdateOptions {
    pub global_step: u64,
    pub temperature: Option<f64>,
    /// Free-form extras for backend-specific switches.
    pub extra: serde_json::Value,
}

/// Options of `Critic.compute_values`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ValueOptions {}

/// What a backend's reward model role loads and how it batches (`InitArgs.extra["reward_model"]`;
/// the host fills it from verl's `reward_model.*` / `reward.reward_model.*` keys).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RewardModelSpec {
    /// HF folder of a `*ForSequenceClassification` / `*ForRewardModel` checkpoint.
    pub path: String,
    /// The config key that named `path` (for errors).
    #[serde(default)]
    pub path_key: String,
    /// Compute dtype: `bfloat16`, `float32` or `float16`.
    #[serde(default = "bf16")]
    pub dtype: String,
    /// Rows per forward (`None`: all rows at once) unless `use_dynamic_bsz`.
    #[serde(default)]
    pub micro_batch_size_per_gpu: Option<u64>,
    /// Micro-batches by token budget: at most `max_token_len_per_gpu` real tokens each (a
    /// longer row alone).
    #[serde(default)]
    pub use_dynamic_bsz: bool,
    #[serde(default = "token_budget")]
    pub max_token_len_per_gpu: u64,
    /// Weights wait in (pinned) host memory outside `onload` … `offload` and each `score`.
    #[serde(default)]
    pub offload: bool,
}

fn bf16() -> String {
    "bfloat16".into()
}

fn token_budget() -> u64 {
    32768
}

/// Options of `Reward.score`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ScoreOptions {
    /// Free-form per-call options (e.g. reward kwargs from `custom_reward_function.reward_kwargs`).
    pub kwargs: serde_json::Value,
}

/// The `Actor.generate` input for token id rows of different lengths: left-padded with `pad`
/// (`prompts`) and the matching `prompt_mask`.
pub fn prompt_batch(rows: &[&[i64]], pad: i64) -> crate::Batch {
    let width = rows.iter().map(|r| r.len()).max().unwrap_or(0);
    let mut ids = Vec::with_capacity(rows.len() * width);
    let mut mask = Vec::with_capacity(rows.len() * width);
    for r in rows {
        let padn = width - r.len();
        ids.extend(std::iter::repeat_n(pad, padn));
        mask.extend(std::iter::repeat_n(0i64, padn));
        ids.extend_from_slice(r);
        mask.extend(std::iter::repeat_n(1i64, r.len()));
    }
    let mut b = crate::Batch::new();
    b.insert_tensor(col::PROMPTS, &[rows.len(), width], &ids);
    b.insert_tensor(col::PROMPT_MASK, &[rows.len(), width], &mask);
    b
}

// ---------------------------------------------------------------------------------------------
// Tools (multi-turn rollouts): verl's tool config entries and what a call returns.

/// Keys of a tool's `config` the host acts on for every tool, built-in or plugin: `type` (verl's
/// tool type; only `native` exists) and `timeout` (seconds the host waits for one call before it
/// answers with a timed-out error). A tool accepts them beside its own keys.
pub const HOST_TOOL_KEYS: &[&str] = &["type", "timeout"];

/// What a tool plugin's `create_tool` gets: one entry of verl's tool config YAML
/// (`tools: [{class_name, config, tool_schema}]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolInit {
    pub class_name: String,
    /// The entry's `config` object (verl hands it to the tool's constructor); `{}` when absent.
    #[serde(default = "empty_object")]
    pub config: serde_json::Value,
    /// The entry's `tool_schema` (an OpenAI function schema), when given: it names the tool and
    /// is what the model sees, in place of the tool's default schema (as in verl).
    #[serde(default)]
    pub tool_schema: Option<serde_json::Value>,
}

fn empty_object() -> serde_json::Value {
    serde_json::Value::Object(Default::default())
}

impl ToolInit {
    pub fn new(class_name: impl Into<String>, config: serde_json::Value) -> Self {
        ToolInit {
            class_name: class_name.into(),
            config,
            tool_schema: None,
        }
    }

    pub fn with_schema(mut self, tool_schema: serde_json::Value) -> Self {
        self.tool_schema = Some(tool_schema);
        self
    }

    /// The config's `tool_schema` when given, else the tool's `default`.
    pub fn schema_or(&self, default: serde_json::Value) -> serde_json::Value {
        self.tool_schema.clone().unwrap_or(default)
    }

    /// The config as an object, refusing a key that is neither in `known` nor one the host acts
    /// on ([`HOST_TOOL_KEYS`]): every key acts or is refused.
    pub fn config_object(
        &self,
        known: &[&str],
    ) -> crate::Result<serde_json::Map<String, serde_json::Value>> {
        let obj = match &self.config {
            serde_json::Value::Null => return Ok(Default::default()),
            serde_json::Value::Object(m) => m,
            other => {
                return Err(crate::Error::invalid_input(format!(
                    "tool `{}`: `config` must be a mapping, found {other}",
                    self.class_name
                )))
            }
        };
        if let Some(key) = obj
            .keys()
            .find(|k| !known.contains(&k.as_str()) && !HOST_TOOL_KEYS.contains(&k.as_str()))
        {
            let mut accepted: Vec<&str> = known.to_vec();
            accepted.extend(HOST_TOOL_KEYS);
            return Err(crate::Error::invalid_input(format!(
                "tool `{}`: unknown config key `config.{key}` (accepted: {})",
                self.class_name,
                accepted.join(", ")
            )));
        }
        Ok(obj.clone())
    }
}

/// What one tool call returns (verl's `(ToolResponse, step reward, metrics)`), JSON across the
/// ABI.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ToolOutput {
    /// The text the model sees as the tool message (before the host's length truncation).
    pub text: String,
    /// The call's step reward (verl's `tool_reward`), when the tool gives one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reward: Option<f64>,
    /// The tool's metrics for this call (verl's `res` dict).
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub metrics: serde_json::Map<String, serde_json::Value>,
}

impl ToolOutput {
    pub fn text(text: impl Into<String>) -> Self {
        ToolOutput {
            text: text.into(),
            ..Default::default()
        }
    }
    pub fn with_reward(mut self, reward: f64) -> Self {
        self.reward = Some(reward);
        self
    }
}

/// A tool schema that verl would refuse: which key, what was expected, what was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchemaProblem {
    /// The key inside the schema, e.g. `function.name`.
    pub key: String,
    pub expected: &'static str,
    pub found: String,
}

impl std::fmt::Display for SchemaProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "`{}`: expected {}, found {}",
            self.key, self.expected, self.found
        )
    }
}

/// Checks an OpenAI function schema as verl's `OpenAIFunctionToolSchema` does (a `type`, a
/// `function` with a non-empty `name`, a `description` and, when present, a boolean `strict`;
/// `parameters`, when present, an object schema whose properties each have a `type`) and
/// returns the tool's name.
pub fn tool_schema_name(schema: &serde_json::Value) -> Result<String, SchemaProblem> {
    use serde_json::Value;
    let problem = |key: &str, expected: &'static str, found: Option<&Value>| SchemaProblem {
        key: key.into(),
        expected,
        found: found.map_or("nothing".into(), |v| v.to_string()),
    };
    let obj = schema
        .as_object()
        .ok_or_else(|| problem("tool_schema", "a mapping", Some(schema)))?;
    match obj.get("type") {
        Some(Value::String(t)) if t == "function" => {}
        other => return Err(problem("type", "\"function\"", other)),
    }
    let f = match obj.get("function") {
        Some(Value::Object(f)) => f,
        other => return Err(problem("function", "a mapping", other)),
    };
    let name = match f.get("name") {
        Some(Value::String(n)) if !n.trim().is_empty() => n.clone(),
        other => return Err(problem("function.name", "a non-empty string", other)),
    };
    if !matches!(f.get("description"), Some(Value::String(_))) {
        return Err(problem(
            "function.description",
            "a string",
            f.get("description"),
        ));
    }
    if let Some(strict) = f.get("strict") {
        if !strict.is_boolean() {
            return Err(problem("function.strict", "true or false", Some(strict)));
        }
    }
    if let Some(p) = f.get("parameters") {
        let p = p
            .as_object()
            .ok_or_else(|| problem("function.parameters", "a mapping", Some(p)))?;
        if !matches!(p.get("type"), Some(Value::String(_))) {
            return Err(problem(
                "function.parameters.type",
                "a string (\"object\")",
                p.get("type"),
            ));
        }
        let props = match p.get("properties") {
            Some(Value::Object(m)) => m,
            other => {
                return Err(problem(
                    "function.parameters.properties",
                    "a mapping",
                    other,
                ))
            }
        };
        for (k, v) in props {
            let typed = match v.get("type") {
                Some(Value::String(_)) => true,
                Some(Value::Array(a)) => a.iter().all(Value::is_string),
                _ => false,
            };
            if !typed {
                return Err(SchemaProblem {
                    key: format!("function.parameters.properties.{k}.type"),
                    expected: "a type name or a list of them",
                    found: v.get("type").map_or("nothing".into(), |t| t.to_string()),
                });
            }
        }
        if let Some(r) = p.get("required") {
            if !r.as_array().is_some_and(|a| a.iter().all(Value::is_string)) {
                return Err(problem(
                    "function.parameters.required",
                    "a list of parameter names",
                    Some(r),
                ));
            }
        }
    }
    Ok(name)
}

#[cfg(test)]
mod tool_tests {
    use super::*;
    use serde_json::json;

    fn schema() -> serde_json::Value {
        json!({"type": "function", "function": {
            "name": "calculator", "description": "evaluates arithmetic",
            "parameters": {"type": "object",
                "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}})
    }

    #[test]
    fn a_verl_function_schema_names_its_tool() {
        assert_eq!(tool_schema_name(&schema()).unwrap(), "calculator");
        let mut bare = schema();
        bare["function"]
            .as_object_mut()
            .unwrap()
            .remove("parameters");
        assert_eq!(tool_schema_name(&bare).unwrap(), "calculator");
    }

    #[test]
    fn a_schema_verl_would_refuse_names_the_key() {
        let mut s = schema();
        s["function"]["name"] = json!("");
        assert_eq!(tool_schema_name(&s).unwrap_err().key, "function.name");
        let mut s = schema();
        s["function"].as_object_mut().unwrap().remove("description");
        assert_eq!(
            tool_schema_name(&s).unwrap_err().key,
            "function.description"
        );
        let mut s = schema();
        s["function"]["parameters"]["properties"]["expression"] = json!({"description": "x"});
        let p = tool_schema_name(&s).unwrap_err();
        assert_eq!(p.key, "function.parameters.properties.expression.type");
        assert!(p.to_string().contains("found nothing"), "{p}");
        assert_eq!(
            tool_schema_name(&json!({"function": {}})).unwrap_err().key,
            "type"
        );
    }

    #[test]
    fn config_keys_act_or_are_refused() {
        let init = ToolInit::new(
            "calculator",
            json!({"type": "native", "timeout": 3, "precision": 2}),
        );
        let e = init.config_object(&[]).unwrap_err().to_string();
        assert!(e.contains("`config.precision`"), "{e}");
        assert!(e.contains("accepted: type, timeout"), "{e}");
        let ok = init.config_object(&["precision"]).unwrap();
        assert_eq!(ok["precision"], 2);
        assert!(ToolInit::new("x", serde_json::Value::Null)
            .config_object(&[])
            .unwrap()
            .is_empty());
    }
}
