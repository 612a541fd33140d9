//! The caller's side of the contracts: safe handles over the ABI objects that check every batch
//! going in and coming out against [`crate::contract`], and name the plugin and call in every error.
//! Used by the host and by [`crate::testing`].

use std::path::Path;

use abi_stable::std_types::RStr;
use serde::Serialize;

use crate::batch::Batch;
use crate::contract::{
    self, GenerateOptions, InitArgs, LogProbOptions, ScoreOptions, UpdateOptions, ValueOptions,
};
use crate::error::{Error, Result};
use crate::ffi::{ActorBox, BackendModuleRef, CriticBox, DataParallel, RewardBox, ToolBox};
use crate::sdk::metrics_from_ffi;
use crate::Metrics;

fn to_json<T: Serialize>(v: &T) -> String {
    serde_json::to_string(v).expect("options serialise")
}

fn path_str<'a>(call: &str, p: &'a Path) -> Result<&'a str> {
    p.to_str().ok_or_else(|| Error::Options {
        call: call.into(),
        message: format!("path {} is not UTF-8", p.display()),
    })
}

/// Calls a backend's upfront layout check ([`crate::ffi::BackendModule::validate`]). `None`: the
/// backend has no check (a plugin built before the field existed, or one that does not provide
/// it); `Some(Ok(summary))`: the layout fits; `Some(Err(..))`: the plugin's error, naming the
/// plugin and the call.
pub fn validate_layout(
    module: BackendModuleRef,
    plugin: &str,
    init: &InitArgs,
) -> Option<Result<String>> {
    let f = module.validate()?;
    let json = to_json(init);
    match f(RStr::from_str(&json)).into_result() {
        Ok(summary) => summary.into_option().map(|s| Ok(s.into_string())),
        Err(e) => Some(Err(Error::from_ffi(e, plugin, "layout validation"))),
    }
}

/// A loaded actor (or reference) role.
pub struct ActorClient {
    obj: ActorBox,
    plugin: String,
    role: &'static str,
    /// The plugin's [`crate::ffi::BackendModule::generate_turns`], when it has one.
    turns: Option<crate::ffi::GenerateTurnsFn>,
}

impl ActorClient {
    pub fn new(obj: ActorBox, plugin: impl Into<String>, role: &'static str) -> Self {
        ActorClient {
            obj,
            plugin: plugin.into(),
            role,
            turns: None,
        }
    }

    /// The actor of a backend module: its multi-turn generation comes from the module.
    pub fn of_module(
        obj: ActorBox,
        module: BackendModuleRef,
        plugin: impl Into<String>,
        role: &'static str,
    ) -> Self {
        ActorClient {
            turns: module.generate_turns(),
            ..ActorClient::new(obj, plugin, role)
        }
    }

    pub fn plugin(&self) -> &str {
        &self.plugin
    }

    fn call_name(&self, method: &str) -> String {
        format!("{}.{}.{}", self.plugin, self.role, method)
    }

    /// Generate `options.n` responses per prompt row.
    pub fn generate(&mut self, prompts: &Batch, options: &GenerateOptions) -> Result<Batch> {
        let call = self.call_name("generate");
        prompts.check(&format!("input of {call}"), contract::GENERATE_IN, &[])?;
        let out = self
            .obj
            .generate(prompts, RStr::from_str(&to_json(options)))
            .into_result()
            .map_err(|e| Error::from_ffi(e, &self.plugin, &format!("{}.generate", self.role)))?;
        let rows = prompts.rows() as u64 * options.n.max(1) as u64;
        out.check(&call, contract::GENERATE_OUT, &[("rows", rows)])?;
        Ok(out)
    }

    /// Multi-turn generation: `options.n` conversations per prompt row, continued by `driver`
    /// (see [`crate::turns`]).
    pub fn generate_turns(
        &mut self,
        prompts: &Batch,
        options: &GenerateOptions,
        driver: &mut dyn crate::turns::TurnDriver,
    ) -> Result<Batch> {
        let call = self.call_name("generate_turns");
        prompts.check(&format!("input of {call}"), contract::GENERATE_IN, &[])?;
        let Some(f) = self.turns else {
            return Err(Error::from_ffi(
                Error::not_implemented(
                    "multi-turn generation (the plugin has no generate_turns: built before it, \
                     or not created through its backend module)",
                )
                .into_ffi(),
                &self.plugin,
                &format!("{}.generate_turns", self.role),
            ));
        };
        let json = to_json(options);
        let obj = &mut self.obj;
        let out = crate::turns::with_driver(driver, |d| {
            f(obj, prompts, RStr::from_str(&json), d).into_result()
        })
        .map_err(|e| Error::from_ffi(e, &self.plugin, &format!("{}.generate_turns", self.role)))?;
        let rows = prompts.rows() as u64 * options.n.max(1) as u64;
        out.check(&call, contract::GENERATE_TURNS_OUT, &[("rows", rows)])?;
        Ok(out)
    }

    /// Per-token log-probs (and optionally entropy) of `responses` given `prompts`.
    pub fn compute_log_prob(&mut self, batch: &Batch, options: &LogProbOptions) -> Result<Batch> {
        let call = self.call_name("compute_log_prob");
        batch.check(&format!("input of {call}"), contract::SEQUENCE_IN, &[])?;
        let out = self
            .obj
            .compute_log_prob(batch, RStr::from_str(&to_json(options)))
            .into_result()
            .map_err(|e| {
                Error::from_ffi(e, &self.plugin, &format!("{}.compute_log_prob", self.role))
            })?;
        let (rows, rl) = (batch.rows() as u64, response_len(batch));
        out.check(
            &call,
            contract::LOG_PROB_OUT,
            &[("rows", rows), ("response_length", rl)],
        )?;
        if options.with_entropy && !out.contains(contract::col::ENTROPY) {
            return Err(Error::MissingColumn {
                call,
                column: contract::col::ENTROPY.into(),
                present: out.column_names().join(", "),
            });
        }
        Ok(out)
    }

    pub fn update(&mut self, batch: &Batch, options: &UpdateOptions) -> Result<Metrics> {
        let call = self.call_name("update");
        batch.check(&format!("input of {call}"), contract::ACTOR_UPDATE_IN, &[])?;
        let m = self
            .obj
            .update(batch, RStr::from_str(&to_json(options)))
            .into_result()
            .map_err(|e| Error::from_ffi(e, &self.plugin, &format!("{}.update", self.role)))?;
        Ok(metrics_from_ffi(m))
    }

    pub fn save(&mut self, dir: &Path) -> Result<()> {
        let d = path_str("save", dir)?;
        self.obj
            .save(RStr::from_str(d))
            .into_result()
            .map_err(|e| Error::from_ffi(e, &self.plugin, &format!("{}.save", self.role)))
    }

    pub fn load(&mut self, dir: &Path) -> Result<()> {
        let d = path_str("load", dir)?;
        self.obj
            .load(RStr::from_str(d))
            .into_result()
            .map_err(|e| Error::from_ffi(e, &self.plugin, &format!("{}.load", self.role)))
    }

    pub fn export_hf(&mut self, dir: &Path) -> Result<()> {
        let d = path_str("export_hf", dir)?;
        self.obj
            .export_hf(RStr::from_str(d))
            .into_result()
            .map_err(|e| Error::from_ffi(e, &self.plugin, &format!("{}.export_hf", self.role)))
    }

    pub fn data_parallel(&self) -> DataParallel {
        self.obj.data_parallel()
    }

    /// A named extension call.
    pub fn call(
        &mut self,
        method: &str,
        batch: &Batch,
        options: &serde_json::Value,
    ) -> Result<Batch> {
        let out = self
            .obj
            .call(
                RStr::from_str(method),
                batch,
                RStr::from_str(&options.to_string()),
            )
            .into_result()
            .map_err(|e| Error::from_ffi(e, &self.plugin, &format!("{}.{method}", self.role)))?;
        out.validate(&self.call_name(method))?;
        Ok(out)
    }
}

fn response_len(b: &Batch) -> u64 {
    b.column(contract::col::RESPONSES)
        .and_then(|c| c.shape().get(1).copied())
        .unwrap_or(0)
}

/// A loaded critic role.
pub struct CriticClient {
    obj: CriticBox,
    plugin: String,
}

impl CriticClient {
    pub fn new(obj: CriticBox, plugin: impl Into<String>) -> Self {
        CriticClient {
            obj,
            plugin: plugin.into(),
        }
    }

    pub fn plugin(&self) -> &str {
        &self.plugin
    }

    pub fn compute_values(&mut self, batch: &Batch, options: &ValueOptions) -> Result<Batch> {
        let call = format!("{}.critic.compute_values", self.plugin);
        batch.check(&format!("input of {call}"), contract::SEQUENCE_IN, &[])?;
        let out = self
            .obj
            .compute_values(batch, RStr::from_str(&to_json(options)))
            .into_result()
            .map_err(|e| Error::from_ffi(e, &self.plugin, "critic.compute_values"))?;
        let (rows, rl) = (batch.rows() as u64, response_len(batch));
        out.check(
            &call,
            contract::VALUES_OUT,
            &[("rows", rows), ("response_length", rl)],
        )?;
        Ok(out)
    }

    pub fn update(&mut self, batch: &Batch, options: &UpdateOptions) -> Result<Metrics> {
        let call = format!("{}.critic.update", self.plugin);
        batch.check(&format!("input of {call}"), contract::CRITIC_UPDATE_IN, &[])?;
        let m = self
            .obj
            .update(batch, RStr::from_str(&to_json(options)))
            .into_result()
            .map_err(|e| Error::from_ffi(e, &self.plugin, "critic.update"))?;
        Ok(metrics_from_ffi(m))
    }

    pub fn save(&mut self, dir: &Path) -> Result<()> {
        let d = path_str("save", dir)?;
        self.obj
            .save(RStr::from_str(d))
            .into_result()
            .map_err(|e| Error::from_ffi(e, &self.plugin, "critic.save"))
    }

    pub fn load(&mut self, dir: &Path) -> Result<()> {
        let d = path_str("load", dir)?;
        self.obj
            .load(RStr::from_str(d))
            .into_result()
            .map_err(|e| Error::from_ffi(e, &self.plugin, "critic.load"))
    }

    pub fn data_parallel(&self) -> DataParallel {
        self.obj.data_parallel()
    }
}

/// A loaded reward role.
pub struct RewardClient {
    obj: RewardBox,
    plugin: String,
}

impl RewardClient {
    pub fn new(obj: RewardBox, plugin: impl Into<String>) -> Self {
        RewardClient {
            obj,
            plugin: plugin.into(),
        }
    }

    pub fn plugin(&self) -> &str {
        &self.plugin
    }

    /// Score rows; checks the count, dtype and finiteness of what comes back.
    pub fn score(&mut self, batch: &Batch, options: &ScoreOptions) -> Result<Batch> {
        let call = format!("{}.reward.score", self.plugin);
        batch.check(&format!("input of {call}"), contract::REWARD_IN, &[])?;
        let out = self
            .obj
            .score(batch, RStr::from_str(&to_json(options)))
            .into_result()
            .map_err(|e| Error::from_ffi(e, &self.plugin, "reward.score"))?;
        let mut bind = vec![("rows", batch.rows() as u64)];
        if batch.contains(contract::col::RESPONSES) {
            bind.push(("response_length", response_len(batch)));
        }
        out.check(&call, contract::REWARD_OUT, &bind)?;
        let scores = out.tensor::<f32>(contract::col::SCORES)?;
        if let Some((i, v)) = scores.data.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(Error::Plugin {
                plugin: self.plugin.clone(),
                call: "reward.score".into(),
                kind: crate::ErrorKind::InvalidInput,
                message: format!("returned a non-finite score {v} for row {i}"),
            });
        }
        Ok(out)
    }
}

/// A backend's reward model role (sequence scoring).
pub struct RewardModelClient {
    obj: RewardBox,
    plugin: String,
}

impl RewardModelClient {
    pub fn new(obj: RewardBox, plugin: impl Into<String>) -> Self {
        RewardModelClient {
            obj,
            plugin: plugin.into(),
        }
    }

    pub fn plugin(&self) -> &str {
        &self.plugin
    }

    /// One score per row of `input_ids` / `attention_mask` ([`contract::RM_SCORE_IN`]).
    pub fn score(&mut self, batch: &Batch) -> Result<Vec<f32>> {
        let call = format!("{}.reward_model.score", self.plugin);
        batch.check(&format!("input of {call}"), contract::RM_SCORE_IN, &[])?;
        let out = self
            .obj
            .score(batch, RStr::from_str("{}"))
            .into_result()
            .map_err(|e| Error::from_ffi(e, &self.plugin, "reward_model.score"))?;
        out.check(
            &call,
            contract::RM_SCORE_OUT,
            &[("rows", batch.rows() as u64)],
        )?;
        let scores = out.tensor::<f32>(contract::col::SCORES)?.data;
        if let Some((i, v)) = scores.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            return Err(Error::Plugin {
                plugin: self.plugin.clone(),
                call: "reward_model.score".into(),
                kind: crate::ErrorKind::InvalidInput,
                message: format!("returned a non-finite score {v} for row {i}"),
            });
        }
        Ok(scores)
    }

    /// A named call (`offload`, `onload`, `memory`).
    pub fn call(&mut self, method: &str, options: &serde_json::Value) -> Result<Batch> {
        self.obj
            .call(
                RStr::from_str(method),
                &Batch::new(),
                RStr::from_str(&options.to_string()),
            )
            .into_result()
            .map_err(|e| Error::from_ffi(e, &self.plugin, &format!("reward_model.{method}")))
    }
}

/// A created tool: its checked schema, and its lifecycle calls with the plugin and the tool named
/// in every error. `&self` throughout: one client serves parallel calls.
pub struct ToolClient {
    obj: ToolBox,
    plugin: String,
    name: String,
    schema: serde_json::Value,
}

impl ToolClient {
    /// Wraps a created tool, reading its schema once (it names the tool); a schema verl would
    /// refuse is an error naming the key.
    pub fn new(obj: ToolBox, plugin: impl Into<String>) -> Result<Self> {
        let plugin = plugin.into();
        let text = obj.schema().into_string();
        let bad = |message: String| Error::Plugin {
            plugin: plugin.clone(),
            call: "tool schema".into(),
            kind: crate::ErrorKind::InvalidInput,
            message,
        };
        let schema: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("not JSON ({e}): {text}")))?;
        let name = contract::tool_schema_name(&schema).map_err(|p| bad(p.to_string()))?;
        Ok(ToolClient {
            obj,
            plugin,
            name,
            schema,
        })
    }

    pub fn plugin(&self) -> &str {
        &self.plugin
    }

    /// The tool's name: what the model calls (`function.name` of its schema).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The OpenAI function schema.
    pub fn schema(&self) -> &serde_json::Value {
        &self.schema
    }

    fn err(&self, e: crate::error::FfiError, method: &str) -> Error {
        Error::from_ffi(e, &self.plugin, &format!("{}.{method}", self.name))
    }

    /// Starts an instance; `create_kwargs` is the row's `tools_kwargs[name].create_kwargs`.
    pub fn create(&self, create_kwargs: &serde_json::Value) -> Result<String> {
        let kwargs = match create_kwargs {
            serde_json::Value::Null => "{}".to_string(),
            other => other.to_string(),
        };
        self.obj
            .create(RStr::from_str(&kwargs))
            .into_result()
            .map(|id| id.into_string())
            .map_err(|e| self.err(e, "create"))
    }

    /// Runs one call on an instance; a reply that is not a [`contract::ToolOutput`] is an error.
    pub fn execute(
        &self,
        instance_id: &str,
        arguments: &serde_json::Value,
    ) -> Result<contract::ToolOutput> {
        let out = self
            .obj
            .execute(
                RStr::from_str(instance_id),
                RStr::from_str(&arguments.to_string()),
            )
            .into_result()
            .map_err(|e| self.err(e, "execute"))?;
        serde_json::from_str(out.as_str()).map_err(|e| Error::Plugin {
            plugin: self.plugin.clone(),
            call: format!("{}.execute", self.name),
            kind: crate::ErrorKind::InvalidInput,
            message: format!("the reply is not {{text, reward?, metrics?}} ({e}): {out}"),
        })
    }

    pub fn release(&self, instance_id: &str) -> Result<()> {
        self.obj
            .release(RStr::from_str(instance_id))
            .into_result()
            .map_err(|e| self.err(e, "release"))
    }

    /// verl's `calc_reward`: the instance's reward so far.
    pub fn calc_reward(&self, instance_id: &str) -> Result<f64> {
        let v = self.call(
            "calc_reward",
            &serde_json::json!({ "instance_id": instance_id }),
        )?;
        v.get("reward")
            .and_then(serde_json::Value::as_f64)
            .ok_or_else(|| Error::Plugin {
                plugin: self.plugin.clone(),
                call: format!("{}.calc_reward", self.name),
                kind: crate::ErrorKind::InvalidInput,
                message: format!("expected {{\"reward\": number}}, found {v}"),
            })
    }

    /// The extension call: `method` with JSON options, a JSON answer.
    pub fn call(&self, method: &str, options: &serde_json::Value) -> Result<serde_json::Value> {
        let out = self
            .obj
            .call(RStr::from_str(method), RStr::from_str(&options.to_string()))
            .into_result()
            .map_err(|e| self.err(e, method))?;
        serde_json::from_str(out.as_str()).map_err(|e| Error::Plugin {
            plugin: self.plugin.clone(),
            call: format!("{}.{method}", self.name),
            kind: crate::ErrorKind::InvalidInput,
            message: format!("the reply is not JSON ({e}): {out}"),
        })
    }
}
