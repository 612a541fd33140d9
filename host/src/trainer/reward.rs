//! Reward routing: each row goes to the plugin `plugins.reward` names for its `data_source`, or
//! to the job's reward model (`reward_model.enable`: every data source without a route);
//! every answer is checked for count and finiteness and failures name the plugin or model.

use std::collections::BTreeMap;

use anyhow::Context;
use verl_chat::Tokenizer;
use verl_config::Config;
use verl_data::Message;
use verl_plugin_api::client::RewardClient;
use verl_plugin_api::{col, Batch, ModelKind, ScoreOptions, Tensor};

use super::error::TrainerError;
use crate::models::SharedModels;
use crate::python_reward::{self, PythonReward, RowResult};

/// The name the job's reward model is routed and lent under.
pub const REWARD_MODEL: &str = "reward_model";
/// The name verl's `custom_reward_function` (the user's Python file) is routed under.
pub const CUSTOM_REWARD_FUNCTION: &str = "custom_reward_function";

/// One rollout's reward inputs, row-aligned.
pub(crate) struct RewardInput<'a> {
    pub prompt_text: &'a [String],
    pub response_text: &'a [String],
    pub data_source: &'a [String],
    pub ground_truth: &'a [serde_json::Value],
    pub extra_info: &'a [serde_json::Value],
    pub responses: &'a Tensor<i64>,
    pub response_mask: &'a Tensor<i64>,
    /// What a reward model reads: the prompt's chat messages (verl's `raw_prompt`), the
    /// policy's prompt tokens and its tokenizer.
    pub raw_prompt: &'a [&'a [Message]],
    pub prompts: &'a Tensor<i64>,
    pub prompt_mask: &'a Tensor<i64>,
    pub policy_tokenizer: &'a Tokenizer,
}

/// How the job's reward model reads a rollout (verl's `reward_model.model.input_tokenizer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RmInput {
    /// Decode with the policy's tokenizer, re-render with the reward model's template.
    SwitchTemplate,
    /// The policy's own prompt + response token ids (same tokenizer).
    PolicyTokens,
}

pub(crate) struct RewardOutput {
    /// One score per row.
    pub scores: Vec<f64>,
    /// `rows × response_length`: the plugin's token scores, else the score on the last valid
    /// response token (verl's reward managers).
    pub token_level_scores: Vec<f64>,
    /// `reward_extra/<name>` columns without the prefix; NaN for rows whose plugin lacks one.
    pub extra: BTreeMap<String, Vec<f64>>,
    /// Step metrics of the reward phase (`reward/error_ratio` with `on_error: zero`).
    pub metrics: Vec<(String, f64)>,
}

/// A reward plugin's role: in this process, or in a worker process (`plugins.reward.isolate`).
pub(crate) enum PluginClient {
    InProcess(RewardClient),
    Isolated(Box<crate::isolated_reward::IsolatedReward>),
}

impl From<RewardClient> for PluginClient {
    fn from(c: RewardClient) -> Self {
        PluginClient::InProcess(c)
    }
}

impl PluginClient {
    fn score(&mut self, batch: &Batch, options: &ScoreOptions) -> anyhow::Result<Batch> {
        match self {
            PluginClient::InProcess(c) => Ok(c.score(batch, options)?),
            PluginClient::Isolated(c) => c.score(batch, options),
        }
    }
}

/// The timeout, limits and failure policy of worker processes (`plugins.reward.*`).
pub(crate) fn limits(cfg: &Config) -> python_reward::Limits {
    let r = &cfg.plugins.reward;
    python_reward::Limits {
        timeout: std::time::Duration::from_secs_f64(r.timeout_s.max(0.001)),
        memory_mb: r.memory_mb,
        cpu_s: r.cpu_s,
        on_error: if r.on_error == "zero" {
            python_reward::OnError::Zero
        } else {
            python_reward::OnError::Fail
        },
    }
}

pub(crate) struct RewardRouter {
    clients: Vec<(String, PluginClient)>,
    models: SharedModels,
    /// Rows without a route go to the reward model (`reward_model.enable` with a score head and
    /// `plugins.reward.default` left at `rewards`).
    rm_default: bool,
    rm_input: RmInput,
    /// `reward_model.max_length`.
    rm_max_length: Option<usize>,
    /// verl's `custom_reward_function`, when the job gives one.
    python: Option<PythonReward>,
    /// `plugins.reward.on_error` is `zero`: failed rows score 0 and are counted.
    count_errors: bool,
    /// verl's dapo reward manager: the overlong penalty added to every row's score.
    overlong: Option<Overlong>,
    options: ScoreOptions,
}

/// The dapo reward manager's overlong buffer (`reward.reward_kwargs.overlong_buffer_cfg`,
/// `max_resp_len`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Overlong {
    pub len: f64,
    pub penalty_factor: f64,
    pub log: bool,
    pub max_resp_len: f64,
}

impl Overlong {
    /// `None` unless the dapo manager runs with the buffer enabled; its settings checked as verl's
    /// manager checks them.
    pub fn from_config(cfg: &Config) -> anyhow::Result<Option<Overlong>> {
        if cfg.reward.reward_manager.name != "dapo" {
            return Ok(None);
        }
        let kw = serde_json::to_value(&cfg.reward.reward_kwargs)
            .context("reward.reward_kwargs is not JSON")?;
        let buf = &kw["overlong_buffer_cfg"];
        if !buf["enable"].as_bool().unwrap_or(false) {
            return Ok(None);
        }
        let key = "reward.reward_kwargs.overlong_buffer_cfg";
        let num = |v: &serde_json::Value, k: &str| -> anyhow::Result<f64> {
            v.as_f64()
                .with_context(|| format!("{k}: expected a number, found {v}"))
        };
        let len = num(&buf["len"], &format!("{key}.len"))?;
        let max_resp_len = num(
            &kw["max_resp_len"],
            "reward.reward_kwargs.max_resp_len (needed with the overlong buffer enabled)",
        )?;
        if len <= 0.0 {
            anyhow::bail!("{key}.len={len}: must be positive with the overlong penalty enabled (to disable it, set {key}.enable=false)");
        }
        if max_resp_len < len {
            anyhow::bail!(
                "reward.reward_kwargs.max_resp_len={max_resp_len} must be at least {key}.len={len}"
            );
        }
        Ok(Some(Overlong {
            len,
            penalty_factor: buf["penalty_factor"].as_f64().unwrap_or(1.0),
            log: buf["log"].as_bool().unwrap_or(false),
            max_resp_len,
        }))
    }

    /// verl's DAPO penalty of a response of `valid` tokens: 0 up to `max_resp_len − len`, then
    /// falling linearly by `penalty_factor` over the buffer (and on past it).
    pub fn reward(&self, valid: usize) -> f64 {
        let exceed = valid as f64 - (self.max_resp_len - self.len);
        (-exceed / self.len * self.penalty_factor).min(0.0)
    }
}

/// Where one route's rows go.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Target {
    Plugin(usize),
    Model(String),
    Python,
}

/// verl's `custom_reward_function.{path, name, reward_kwargs}` as Python workers.
pub(crate) fn python_reward(cfg: &Config) -> anyhow::Result<Option<PythonReward>> {
    let f = &cfg.reward.custom_reward_function;
    let Some(path) = f.path.as_deref() else {
        return Ok(None);
    };
    let r = &cfg.plugins.reward;
    let python = r
        .python
        .clone()
        .or_else(|| std::env::var("VERL_PYTHON").ok())
        .unwrap_or_else(|| "python3".into());
    let kwargs = serde_json::to_value(&f.reward_kwargs)
        .context("custom_reward_function.reward_kwargs is not JSON")?;
    let limits = limits(cfg);
    let reward = PythonReward::start(
        python.into(),
        &crate::paths::expand_home(path),
        &f.name,
        kwargs,
        cfg.reward.num_workers.max(1) as usize,
        limits,
    )?;
    Ok(Some(if cfg.reward.reward_manager.name == "batch" {
        reward.batched()
    } else {
        reward
    }))
}

impl RewardRouter {
    pub fn new(
        clients: Vec<(String, PluginClient)>,
        models: SharedModels,
        cfg: &Config,
    ) -> anyhow::Result<Self> {
        let python = python_reward(cfg)?;
        // The kwargs belong to the Python function when there is one (verl), else to the rules.
        let kwargs = if python.is_some() {
            serde_json::json!({})
        } else {
            serde_json::to_value(&cfg.custom_reward_function.reward_kwargs)
                .context("custom_reward_function.reward_kwargs is not JSON")?
        };
        let rm_default = python.is_none()
            && cfg.reward.reward_model.enable
            && cfg.plugins.reward.default == "rewards"
            && models.kind_of(REWARD_MODEL) == Some(ModelKind::Score);
        if python.is_some() && cfg.plugins.reward.default != "rewards" {
            anyhow::bail!(
                "custom_reward_function.path scores every data source without a route, and \
                 plugins.reward.default={} asks for another default: route data sources with \
                 plugins.reward.routes instead (`{CUSTOM_REWARD_FUNCTION}` names the Python function there)",
                cfg.plugins.reward.default
            );
        }
        if python.is_none()
            && cfg.reward.reward_model.enable
            && cfg.plugins.reward.default == "rewards"
            && models.kind_of(REWARD_MODEL) == Some(ModelKind::Generate)
        {
            return Err(TrainerError::GenerativeRmNeedsPlugin.into());
        }
        Ok(RewardRouter {
            clients,
            models,
            rm_default,
            rm_input: if cfg.reward_model.model.input_tokenizer.is_some() {
                RmInput::SwitchTemplate
            } else {
                RmInput::PolicyTokens
            },
            rm_max_length: cfg.reward_model.max_length.map(|m| m as usize),
            count_errors: cfg.plugins.reward.on_error == "zero",
            overlong: Overlong::from_config(cfg)?,
            python,
            options: ScoreOptions { kwargs },
        })
    }

    fn target_name<'c>(&self, cfg: &'c Config, data_source: &str) -> &'c str {
        match cfg.plugins.reward.routes.get(data_source) {
            Some(t) => t,
            None if self.python.is_some() => CUSTOM_REWARD_FUNCTION,
            None if self.rm_default => REWARD_MODEL,
            None => &cfg.plugins.reward.default,
        }
    }

    fn target(&self, name: &str, data_source: &str) -> anyhow::Result<Target> {
        if let Some(i) = self.clients.iter().position(|(n, _)| n == name) {
            return Ok(Target::Plugin(i));
        }
        if name == CUSTOM_REWARD_FUNCTION && self.python.is_some() {
            return Ok(Target::Python);
        }
        if self.models.kind_of(name) == Some(ModelKind::Score) {
            return Ok(Target::Model(name.to_string()));
        }
        let mut loaded: Vec<String> = self.clients.iter().map(|(n, _)| n.clone()).collect();
        loaded.extend(self.models.names());
        Err(TrainerError::UnknownRewardPlugin {
            data_source: data_source.to_string(),
            plugin: name.to_string(),
            loaded: loaded.join(", "),
        }
        .into())
    }

    pub fn score(&mut self, cfg: &Config, input: &RewardInput<'_>) -> anyhow::Result<RewardOutput> {
        let lends = !self.models.is_empty();
        if lends {
            self.models.hold_all()?;
        }
        let out = self.score_rows(cfg, input);
        if lends {
            self.models.release_all()?;
        }
        out
    }

    fn score_rows(
        &mut self,
        cfg: &Config,
        input: &RewardInput<'_>,
    ) -> anyhow::Result<RewardOutput> {
        let rows = input.data_source.len();
        let width = input.responses.cols();
        // Rows per target, targets in first-seen order so calls are deterministic.
        let mut routes: Vec<(Target, Vec<usize>)> = Vec::new();
        for (r, ds) in input.data_source.iter().enumerate() {
            let target = self.target(self.target_name(cfg, ds), ds)?;
            match routes.iter_mut().find(|(c, _)| *c == target) {
                Some((_, v)) => v.push(r),
                None => routes.push((target, vec![r])),
            }
        }
        let mut out = RewardOutput {
            scores: vec![0.0; rows],
            token_level_scores: vec![0.0; rows * width],
            extra: BTreeMap::new(),
            metrics: Vec::new(),
        };
        let mut failed = 0usize;
        for (target, idx) in routes {
            let client = match target {
                Target::Plugin(i) => i,
                Target::Python => {
                    failed += self.score_with_python(input, &idx, &mut out)?;
                    continue;
                }
                Target::Model(name) => {
                    let scores = self.score_with_model(&name, input, &idx)?;
                    for (&r, &s) in idx.iter().zip(&scores) {
                        if !s.is_finite() {
                            return Err(TrainerError::RewardNotFinite {
                                plugin: name.clone(),
                                row: r,
                                data_source: input.data_source[r].clone(),
                                value: s,
                            }
                            .into());
                        }
                        out.scores[r] = s as f64;
                        let dst = &mut out.token_level_scores[r * width..(r + 1) * width];
                        if let Some(last) = input.response_mask.row(r).iter().rposition(|&m| m != 0)
                        {
                            dst[last] = s as f64;
                        }
                    }
                    continue;
                }
            };
            let (name, client) = &mut self.clients[client];
            let batch = sub_batch(input, &idx);
            let res = match client.score(&batch, &self.options) {
                Ok(res) => res,
                // on_error: zero: the rows keep score 0 and are counted.
                Err(e) if self.count_errors => {
                    tracing::warn!(
                        "reward plugin `{name}`: {e:#}; its {} rows score 0",
                        idx.len()
                    );
                    failed += idx.len();
                    continue;
                }
                Err(e) => {
                    return Err(e.context(format!(
                        "reward plugin `{name}` failed to score {} rows",
                        idx.len()
                    )))
                }
            };
            let scores = res.tensor::<f32>(col::SCORES)?;
            if scores.data.len() != idx.len() {
                return Err(TrainerError::RewardCount {
                    plugin: name.clone(),
                    expected: idx.len(),
                    found: scores.data.len(),
                }
                .into());
            }
            if let Some((i, &v)) = scores.data.iter().enumerate().find(|(_, v)| !v.is_finite()) {
                return Err(TrainerError::RewardNotFinite {
                    plugin: name.clone(),
                    row: idx[i],
                    data_source: input.data_source[idx[i]].clone(),
                    value: v,
                }
                .into());
            }
            let token = if res.contains(col::TOKEN_SCORES) {
                Some(res.tensor::<f32>(col::TOKEN_SCORES)?)
            } else {
                None
            };
            for (i, &r) in idx.iter().enumerate() {
                out.scores[r] = scores.data[i] as f64;
                let dst = &mut out.token_level_scores[r * width..(r + 1) * width];
                match &token {
                    Some(t) => {
                        for (d, s) in dst.iter_mut().zip(t.row(i)) {
                            *d = *s as f64;
                        }
                    }
                    None => {
                        if let Some(last) = input.response_mask.row(r).iter().rposition(|&m| m != 0)
                        {
                            dst[last] = scores.data[i] as f64;
                        }
                    }
                }
            }
            for name in res.column_names() {
                let Some(key) = name.strip_prefix(col::REWARD_EXTRA_PREFIX) else {
                    continue;
                };
                let Ok(vals) = res.tensor::<f32>(name) else {
                    continue;
                };
                let dst = out
                    .extra
                    .entry(key.to_string())
                    .or_insert_with(|| vec![f64::NAN; rows]);
                for (i, &r) in idx.iter().enumerate() {
                    if let Some(v) = vals.data.get(i) {
                        dst[r] = *v as f64;
                    }
                }
            }
        }
        if self.count_errors {
            out.metrics.push((
                "reward/error_ratio".into(),
                failed as f64 / rows.max(1) as f64,
            ));
        }
        if let Some(o) = self.overlong {
            for r in 0..rows {
                let mask = input.response_mask.row(r);
                let pen = o.reward(mask.iter().filter(|&&m| m != 0).count());
                out.scores[r] += pen;
                if let Some(last) = mask.iter().rposition(|&m| m != 0) {
                    out.token_level_scores[r * width + last] += pen;
                }
                if o.log {
                    let flag = (pen < 0.0) as u8 as f64;
                    for (k, v) in [("overlong_reward", pen), ("overlong", flag)] {
                        out.extra
                            .entry(k.into())
                            .or_insert_with(|| vec![f64::NAN; rows])[r] = v;
                    }
                }
            }
        }
        Ok(out)
    }
}

impl RewardRouter {
    /// verl's reward-model input: the response decoded with the policy's tokenizer (special
    /// tokens kept, the EOS text removed), appended to the prompt's messages as the assistant
    /// turn, rendered with the reward model's own template and cut to `reward_model.max_length`
    /// (default: the policy's prompt + response length); or, with `input_tokenizer: null`, the
    /// policy's own tokens.
    fn score_with_model(
        &self,
        name: &str,
        input: &RewardInput<'_>,
        idx: &[usize],
    ) -> anyhow::Result<Vec<f32>> {
        let src_len = input.prompts.cols() + input.responses.cols();
        let valid = |t: &Tensor<i64>, m: &Tensor<i64>, r: usize| -> Vec<i64> {
            t.row(r)
                .iter()
                .zip(m.row(r))
                .filter(|(_, &m)| m != 0)
                .map(|(&x, _)| x)
                .collect()
        };
        let scores = match self.rm_input {
            RmInput::PolicyTokens => {
                let limit = self.rm_max_length.unwrap_or(src_len);
                let rows: Vec<Vec<i64>> = idx
                    .iter()
                    .map(|&r| {
                        let mut ids = valid(input.prompts, input.prompt_mask, r);
                        ids.extend(valid(input.responses, input.response_mask, r));
                        ids.truncate(limit);
                        ids
                    })
                    .collect();
                self.models.with_scoring(name, |m| m.score_ids(&rows))?
            }
            RmInput::SwitchTemplate => {
                let eos = input.policy_tokenizer.special_tokens().eos.clone();
                let chats =
                    idx.iter()
                        .map(|&r| {
                            let ids: Vec<u32> = valid(input.responses, input.response_mask, r)
                                .iter()
                                .map(|&t| t as u32)
                                .collect();
                            let mut text = input
                                .policy_tokenizer
                                .decode(&ids, false)
                                .with_context(|| {
                                    format!("decoding response {r} for the reward model")
                                })?;
                            if let Some(e) = eos.as_deref().filter(|e| !e.is_empty()) {
                                text = text.replace(e, "");
                            }
                            let mut chat: Vec<serde_json::Value> = input.raw_prompt[r]
                                .iter()
                                .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
                                .collect();
                            chat.push(serde_json::json!({"role": "assistant", "content": text}));
                            Ok(chat)
                        })
                        .collect::<anyhow::Result<Vec<_>>>()?;
                let max = self.rm_max_length.or(Some(src_len));
                self.models
                    .with_scoring(name, |m| m.score_chats(&chats, max))?
            }
        };
        if scores.len() != idx.len() {
            return Err(TrainerError::RewardCount {
                plugin: name.to_string(),
                expected: idx.len(),
                found: scores.len(),
            }
            .into());
        }
        Ok(scores)
    }
}

impl RewardRouter {
    /// Rows `idx` through the user's Python function; returns how many failed (scored 0, with
    /// `on_error: zero`).
    fn score_with_python(
        &mut self,
        input: &RewardInput<'_>,
        idx: &[usize],
        out: &mut RewardOutput,
    ) -> anyhow::Result<usize> {
        let py = self
            .python
            .as_mut()
            .expect("a python target has a python reward");
        let rows: Vec<python_reward::Row> = idx
            .iter()
            .map(|&r| python_reward::Row {
                data_source: input.data_source[r].clone(),
                solution_str: input.response_text[r].clone(),
                ground_truth: input.ground_truth[r].clone(),
                extra_info: input.extra_info[r].clone(),
            })
            .collect();
        let results = py.score(&rows)?;
        let width = input.responses.cols();
        let n_rows = input.data_source.len();
        let mut failed = 0;
        for (&r, res) in idx.iter().zip(results) {
            let (score, extra) = match res {
                RowResult::Scored { score, extra } => (score, extra),
                RowResult::Failed(_) => {
                    failed += 1;
                    (0.0, Vec::new())
                }
            };
            if !score.is_finite() {
                return Err(TrainerError::RewardNotFinite {
                    plugin: CUSTOM_REWARD_FUNCTION.into(),
                    row: r,
                    data_source: input.data_source[r].clone(),
                    value: score as f32,
                }
                .into());
            }
            out.scores[r] = score;
            if let Some(last) = input.response_mask.row(r).iter().rposition(|&m| m != 0) {
                out.token_level_scores[r * width + last] = score;
            }
            for (k, v) in extra {
                out.extra.entry(k).or_insert_with(|| vec![f64::NAN; n_rows])[r] = v;
            }
        }
        Ok(failed)
    }
}

fn sub_batch(input: &RewardInput<'_>, idx: &[usize]) -> Batch {
    let pick_s = |v: &[String]| idx.iter().map(|&i| v[i].clone()).collect::<Vec<_>>();
    let pick_j = |v: &[serde_json::Value]| idx.iter().map(|&i| v[i].clone()).collect::<Vec<_>>();
    let pick_t = |t: &Tensor<i64>| {
        idx.iter()
            .flat_map(|&i| t.row(i).iter().copied())
            .collect::<Vec<_>>()
    };
    let w = input.responses.cols();
    let mut b = Batch::new();
    b.insert_strings(col::PROMPT_TEXT, &pick_s(input.prompt_text));
    b.insert_strings(col::RESPONSE_TEXT, &pick_s(input.response_text));
    b.insert_strings(col::DATA_SOURCE, &pick_s(input.data_source));
    b.insert_json(col::GROUND_TRUTH, &pick_j(input.ground_truth));
    b.insert_json(col::EXTRA_INFO, &pick_j(input.extra_info));
    b.insert_tensor(col::RESPONSES, &[idx.len(), w], &pick_t(input.responses));
    b.insert_tensor(
        col::RESPONSE_MASK,
        &[idx.len(), w],
        &pick_t(input.response_mask),
    );
    b
}

#[cfg(test)]
mod tests;
