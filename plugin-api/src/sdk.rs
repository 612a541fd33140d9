//! The plugin author's side: implement ordinary Rust traits, then call one export macro.
//!
//! The adapters here turn those traits into the ABI objects of [`crate::ffi`], and they own the
//! safety rules: every call is wrapped in `catch_unwind` (a panic becomes an error naming the call,
//! never an abort of the host), input batches are checked before the plugin sees them, outputs
//! before they leave, and the plugin's `tracing` events are forwarded to the host.

use std::cell::RefCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::OnceLock;

use abi_stable::{
    sabi_trait::TD_Opaque,
    std_types::{RErr, RNone, ROk, ROption, RResult, RSome, RStr, RString, Tuple2},
};
use serde::de::DeserializeOwned;

use crate::batch::Batch;
use crate::contract::{
    GenerateOptions, InitArgs, LogProbOptions, ScoreOptions, ToolInit, ToolOutput, UpdateOptions,
    ValueOptions,
};
use crate::error::{Error, ErrorKind, FfiError, Result};
use crate::ffi::ModelServicesBox;
use crate::ffi::{
    ActorBox, ActorFfi, ActorFfi_TO, BackendModule, BackendModuleRef, CriticBox, CriticFfi,
    CriticFfi_TO, DataParallel, FfiMetrics, HostCallbacks, RewardBox, RewardFfi, RewardFfi_TO,
    RewardModule, RewardModuleRef, ToolBox, ToolFfi, ToolFfi_TO, ToolModule, ToolModuleRef,
};
use crate::header::{PluginHeader, PluginInfo, PluginKind};
use crate::services::ModelServices;
use crate::Metrics;

/// The policy. Also used, in eval mode, as the reference policy.
pub trait Actor: Send + 'static {
    fn generate(&mut self, prompts: &Batch, options: &GenerateOptions) -> Result<Batch>;
    fn compute_log_prob(&mut self, batch: &Batch, options: &LogProbOptions) -> Result<Batch>;
    fn update(&mut self, _batch: &Batch, _options: &UpdateOptions) -> Result<Metrics> {
        Err(Error::not_implemented("this actor cannot be trained"))
    }
    fn save(&mut self, _dir: &Path) -> Result<()> {
        Err(Error::not_implemented("checkpoint save"))
    }
    fn load(&mut self, _dir: &Path) -> Result<()> {
        Err(Error::not_implemented("checkpoint load"))
    }
    fn export_hf(&mut self, _dir: &Path) -> Result<()> {
        Err(Error::not_implemented("HF export"))
    }
    fn data_parallel(&self) -> DataParallel {
        DataParallel { rank: 0, size: 1 }
    }
    fn call(
        &mut self,
        method: &str,
        _batch: &Batch,
        _options: &serde_json::Value,
    ) -> Result<Batch> {
        Err(Error::not_implemented(format!("call `{method}`")))
    }
    /// Multi-turn generation ([`crate::turns`]): like `generate`, but a sequence that stops waits
    /// for `driver`'s answer. Returns [`crate::contract::GENERATE_TURNS_OUT`]. A backend that
    /// implements it declares [`crate::FEATURE_MULTI_TURN`].
    fn generate_turns(
        &mut self,
        _prompts: &Batch,
        _options: &GenerateOptions,
        _driver: &mut dyn crate::turns::TurnDriver,
    ) -> Result<Batch> {
        Err(Error::not_implemented("multi-turn generation"))
    }
}

/// The value model.
pub trait Critic: Send + 'static {
    fn compute_values(&mut self, batch: &Batch, options: &ValueOptions) -> Result<Batch>;
    fn update(&mut self, batch: &Batch, options: &UpdateOptions) -> Result<Metrics>;
    fn save(&mut self, _dir: &Path) -> Result<()> {
        Err(Error::not_implemented("checkpoint save"))
    }
    fn load(&mut self, _dir: &Path) -> Result<()> {
        Err(Error::not_implemented("checkpoint load"))
    }
    fn data_parallel(&self) -> DataParallel {
        DataParallel { rank: 0, size: 1 }
    }
    fn call(
        &mut self,
        method: &str,
        _batch: &Batch,
        _options: &serde_json::Value,
    ) -> Result<Batch> {
        Err(Error::not_implemented(format!("call `{method}`")))
    }
}

/// A reward function or model.
pub trait Reward: Send + 'static {
    fn score(&mut self, batch: &Batch, options: &ScoreOptions) -> Result<Batch>;
    fn call(
        &mut self,
        method: &str,
        _batch: &Batch,
        _options: &serde_json::Value,
    ) -> Result<Batch> {
        Err(Error::not_implemented(format!("call `{method}`")))
    }
}

/// A backend plugin: describes itself and creates its roles.
pub trait BackendPlugin: 'static {
    fn info() -> PluginInfo;
    fn create_actor(_init: &InitArgs) -> Result<Box<dyn Actor>> {
        Err(Error::not_implemented("the actor role"))
    }
    fn create_reference(_init: &InitArgs) -> Result<Box<dyn Actor>> {
        Err(Error::not_implemented("the reference role"))
    }
    fn create_critic(_init: &InitArgs) -> Result<Box<dyn Critic>> {
        Err(Error::not_implemented("the critic role"))
    }
    /// Checks the job's parallel layout upfront (`verl run --dry-run`, and before a real run
    /// launches its ranks) without creating a role or loading weights. `init.config` is the whole
    /// job config, `init.world_size` the job's world size and `init.extra["roles"]` the roles the
    /// job will create (`"actor"`, `"reference"`, `"critic"`). `Some(Ok(summary))`: the layout fits
    /// (one line per role, printed by the host); `Some(Err(..))`: it does not (name the key, show
    /// the arithmetic). `None`, the default: this backend has no upfront check.
    fn validate(_init: &InitArgs) -> Option<Result<String>> {
        None
    }
    /// The reward model role: a frozen sequence-scoring model whose `score` takes
    /// [`crate::contract::RM_SCORE_IN`] (token ids the host rendered with the model's own
    /// template) and returns one score per row; `call("offload" | "onload")` moves its weights
    /// off and back onto the device. `init.extra["reward_model"]` says which model and how.
    fn create_reward_model(_init: &InitArgs) -> Result<Box<dyn Reward>> {
        Err(Error::not_implemented("the reward_model role"))
    }
}

/// A reward plugin. Implement `create_reward`, or `create_reward_with` when the plugin uses the
/// models the host lends ([`ModelServices`]: reward models to score with, judges to generate
/// with).
pub trait RewardPlugin: 'static {
    fn info() -> PluginInfo;
    fn create_reward(_init: &InitArgs) -> Result<Box<dyn Reward>> {
        Err(Error::not_implemented(
            "create_reward: this plugin needs the host's model services (create_reward_with)",
        ))
    }
    fn create_reward_with(init: &InitArgs, _services: ModelServices) -> Result<Box<dyn Reward>> {
        Self::create_reward(init)
    }
}

/// A tool the model calls in multi-turn rollouts (verl's `BaseTool`). One object serves every
/// trajectory, calls arrive in parallel (`&self`), and each call runs on its own instance:
/// `create` (with the row's `tools_kwargs[name].create_kwargs`) → `execute` → `release`. A
/// stateless tool implements `schema` and `execute` only.
pub trait Tool: Send + Sync + 'static {
    /// The OpenAI function schema the model sees; use [`ToolInit::schema_or`] so a `tool_schema`
    /// in the job's tool config wins, as in verl.
    fn schema(&self) -> serde_json::Value;
    /// Starts an instance; returns its id (default: a fresh id, no state).
    fn create(&self, _create_kwargs: &serde_json::Value) -> Result<String> {
        Ok(next_instance_id())
    }
    /// Runs one call with the model's arguments (a JSON object). An `Err` becomes verl's
    /// `Error executing tool '<name>': <message>` text for the model.
    fn execute(&self, instance_id: &str, arguments: &serde_json::Value) -> Result<ToolOutput>;
    /// verl's `calc_reward`: the instance's reward so far (default 0.0).
    fn calc_reward(&self, _instance_id: &str) -> Result<f64> {
        Ok(0.0)
    }
    fn release(&self, _instance_id: &str) -> Result<()> {
        Ok(())
    }
    fn call(&self, method: &str, _options: &serde_json::Value) -> Result<serde_json::Value> {
        Err(Error::not_implemented(format!("call `{method}`")))
    }
}

/// A tool plugin: describes itself, lists the tool classes it serves (the `class_name`s of verl's
/// tool config) and creates a tool from one config entry.
pub trait ToolPlugin: 'static {
    fn info() -> PluginInfo;
    /// The `class_name`s this plugin serves (they go into its header, so the host finds it).
    fn tool_classes() -> Vec<String>;
    fn create_tool(init: &ToolInit) -> Result<Box<dyn Tool>>;
}

/// A process-unique instance id, for tools that keep per-instance state.
pub fn next_instance_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    format!("instance-{}", NEXT.fetch_add(1, Ordering::Relaxed))
}

// ---------------------------------------------------------------------------------------------
// Panic guard and log forwarding.

thread_local! {
    static LAST_PANIC: RefCell<Option<String>> = const { RefCell::new(None) };
}

static HOST: OnceLock<HostCallbacks> = OnceLock::new();
static PLUGIN_NAME: OnceLock<String> = OnceLock::new();
static PANIC_HOOK: OnceLock<()> = OnceLock::new();

fn install_panic_hook() {
    PANIC_HOOK.get_or_init(|| {
        // Each cdylib has its own std, so this hook only sees this plugin's panics. It records the
        // message (with location) for the error returned to the host and logs it through the host
        // instead of writing to stderr.
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let payload = info.payload();
            let msg = if let Some(s) = payload.downcast_ref::<&str>() {
                (*s).to_string()
            } else if let Some(s) = payload.downcast_ref::<String>() {
                s.clone()
            } else {
                "non-string panic payload".to_string()
            };
            let full = match info.location() {
                Some(l) => format!("{msg} (at {}:{})", l.file(), l.line()),
                None => msg,
            };
            if let Some(h) = HOST.get() {
                let name = PLUGIN_NAME.get().map(String::as_str).unwrap_or("plugin");
                // The panic also comes back as the call's error; the log line is for -v.
                (h.log)(
                    crate::ffi::level::DEBUG,
                    name.into(),
                    "panic".into(),
                    full.as_str().into(),
                );
            } else {
                // In-process (tests, `testing`): keep the usual report.
                previous(info);
            }
            LAST_PANIC.with(|p| *p.borrow_mut() = Some(full));
        }));
    });
}

/// Run one plugin call: panics become [`ErrorKind::Panic`] errors.
pub fn guard<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    install_panic_hook();
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let msg = LAST_PANIC
                .with(|p| p.borrow_mut().take())
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Err(Error::with_kind(ErrorKind::Panic, msg))
        }
    }
}

fn ffi<T>(call: &str, f: impl FnOnce() -> Result<T>) -> RResult<T, FfiError> {
    match guard(f) {
        Ok(v) => ROk(v),
        Err(e) => {
            let _ = call;
            RErr(e.into_ffi())
        }
    }
}

fn parse_options<T: DeserializeOwned>(call: &str, json: RStr<'_>) -> Result<T> {
    let s = json.as_str();
    let s = if s.trim().is_empty() { "{}" } else { s };
    serde_json::from_str(s).map_err(|e| Error::Options {
        call: call.into(),
        message: e.to_string(),
    })
}

/// Hand the host's callbacks to the SDK (called once by the host right after loading).
pub fn set_host(callbacks: HostCallbacks, plugin_name: &str) {
    let _ = PLUGIN_NAME.set(plugin_name.to_string());
    if HOST.set(callbacks).is_ok() {
        crate::log::install_forwarder(callbacks, plugin_name);
    }
    install_panic_hook();
}

// ---------------------------------------------------------------------------------------------
// Adapters: Rust traits → ABI objects.

struct ActorAdapter(Box<dyn Actor>);

impl ActorFfi for ActorAdapter {
    fn generate(&mut self, prompts: &Batch, options: RStr<'_>) -> RResult<Batch, FfiError> {
        ffi("Actor.generate", || {
            prompts.validate("Actor.generate input")?;
            let opts: GenerateOptions = parse_options("Actor.generate", options)?;
            let out = self.0.generate(prompts, &opts)?;
            out.validate("Actor.generate output")?;
            Ok(out)
        })
    }
    fn compute_log_prob(&mut self, batch: &Batch, options: RStr<'_>) -> RResult<Batch, FfiError> {
        ffi("Actor.compute_log_prob", || {
            batch.validate("Actor.compute_log_prob input")?;
            let opts: LogProbOptions = parse_options("Actor.compute_log_prob", options)?;
            let out = self.0.compute_log_prob(batch, &opts)?;
            out.validate("Actor.compute_log_prob output")?;
            Ok(out)
        })
    }
    fn update(&mut self, batch: &Batch, options: RStr<'_>) -> RResult<FfiMetrics, FfiError> {
        ffi("Actor.update", || {
            batch.validate("Actor.update input")?;
            let opts: UpdateOptions = parse_options("Actor.update", options)?;
            Ok(metrics_to_ffi(self.0.update(batch, &opts)?))
        })
    }
    fn save(&mut self, dir: RStr<'_>) -> RResult<(), FfiError> {
        ffi("Actor.save", || self.0.save(Path::new(dir.as_str())))
    }
    fn load(&mut self, dir: RStr<'_>) -> RResult<(), FfiError> {
        ffi("Actor.load", || self.0.load(Path::new(dir.as_str())))
    }
    fn export_hf(&mut self, dir: RStr<'_>) -> RResult<(), FfiError> {
        ffi("Actor.export_hf", || {
            self.0.export_hf(Path::new(dir.as_str()))
        })
    }
    fn data_parallel(&self) -> DataParallel {
        guard(|| Ok(self.0.data_parallel())).unwrap_or(DataParallel { rank: 0, size: 1 })
    }
    fn call(
        &mut self,
        method: RStr<'_>,
        batch: &Batch,
        options: RStr<'_>,
    ) -> RResult<Batch, FfiError> {
        ffi("Actor.call", || {
            let opts: serde_json::Value = parse_options("Actor.call", options)?;
            self.0.call(method.as_str(), batch, &opts)
        })
    }
}

struct CriticAdapter(Box<dyn Critic>);

impl CriticFfi for CriticAdapter {
    fn compute_values(&mut self, batch: &Batch, options: RStr<'_>) -> RResult<Batch, FfiError> {
        ffi("Critic.compute_values", || {
            batch.validate("Critic.compute_values input")?;
            let opts: ValueOptions = parse_options("Critic.compute_values", options)?;
            let out = self.0.compute_values(batch, &opts)?;
            out.validate("Critic.compute_values output")?;
            Ok(out)
        })
    }
    fn update(&mut self, batch: &Batch, options: RStr<'_>) -> RResult<FfiMetrics, FfiError> {
        ffi("Critic.update", || {
            batch.validate("Critic.update input")?;
            let opts: UpdateOptions = parse_options("Critic.update", options)?;
            Ok(metrics_to_ffi(self.0.update(batch, &opts)?))
        })
    }
    fn save(&mut self, dir: RStr<'_>) -> RResult<(), FfiError> {
        ffi("Critic.save", || self.0.save(Path::new(dir.as_str())))
    }
    fn load(&mut self, dir: RStr<'_>) -> RResult<(), FfiError> {
        ffi("Critic.load", || self.0.load(Path::new(dir.as_str())))
    }
    fn data_parallel(&self) -> DataParallel {
        guard(|| Ok(self.0.data_parallel())).unwrap_or(DataParallel { rank: 0, size: 1 })
    }
    fn call(
        &mut self,
        method: RStr<'_>,
        batch: &Batch,
        options: RStr<'_>,
    ) -> RResult<Batch, FfiError> {
        ffi("Critic.call", || {
            let opts: serde_json::Value = parse_options("Critic.call", options)?;
            self.0.call(method.as_str(), batch, &opts)
        })
    }
}

struct RewardAdapter(Box<dyn Reward>);

impl RewardFfi for RewardAdapter {
    fn score(&mut self, batch: &Batch, options: RStr<'_>) -> RResult<Batch, FfiError> {
        ffi("Reward.score", || {
            batch.validate("Reward.score input")?;
            let opts: ScoreOptions = parse_options("Reward.score", options)?;
            let out = self.0.score(batch, &opts)?;
            out.validate("Reward.score output")?;
            Ok(out)
        })
    }
    fn call(
        &mut self,
        method: RStr<'_>,
        batch: &Batch,
        options: RStr<'_>,
    ) -> RResult<Batch, FfiError> {
        ffi("Reward.call", || {
            let opts: serde_json::Value = parse_options("Reward.call", options)?;
            self.0.call(method.as_str(), batch, &opts)
        })
    }
}

struct ToolAdapter(Box<dyn Tool>);

impl ToolFfi for ToolAdapter {
    fn schema(&self) -> RString {
        guard(|| Ok(self.0.schema().to_string()))
            .unwrap_or_default()
            .into()
    }
    fn create(&self, create_kwargs: RStr<'_>) -> RResult<RString, FfiError> {
        ffi("Tool.create", || {
            let kwargs: serde_json::Value = parse_options("Tool.create", create_kwargs)?;
            self.0.create(&kwargs).map(RString::from)
        })
    }
    fn execute(&self, instance_id: RStr<'_>, arguments: RStr<'_>) -> RResult<RString, FfiError> {
        ffi("Tool.execute", || {
            let args: serde_json::Value = parse_options("Tool.execute", arguments)?;
            let out = self.0.execute(instance_id.as_str(), &args)?;
            if let Some(r) = out.reward.filter(|r| !r.is_finite()) {
                return Err(Error::failed(format!("the tool's reward is {r}")));
            }
            Ok(serde_json::to_string(&out)
                .expect("tool output serialises")
                .into())
        })
    }
    fn release(&self, instance_id: RStr<'_>) -> RResult<(), FfiError> {
        ffi("Tool.release", || self.0.release(instance_id.as_str()))
    }
    fn call(&self, method: RStr<'_>, options: RStr<'_>) -> RResult<RString, FfiError> {
        ffi("Tool.call", || {
            let opts: serde_json::Value = parse_options("Tool.call", options)?;
            let answer = match method.as_str() {
                "calc_reward" => {
                    let id = opts
                        .get("instance_id")
                        .and_then(serde_json::Value::as_str)
                        .ok_or_else(|| {
                            Error::invalid_input("calc_reward: options need `instance_id`")
                        })?;
                    serde_json::json!({ "reward": self.0.calc_reward(id)? })
                }
                other => self.0.call(other, &opts)?,
            };
            Ok(answer.to_string().into())
        })
    }
}

fn metrics_to_ffi(m: Metrics) -> FfiMetrics {
    FfiMetrics {
        entries: m
            .into_iter()
            .map(|(k, v)| Tuple2(RString::from(k), v))
            .collect(),
    }
}

fn parse_init(init: RStr<'_>) -> Result<InitArgs> {
    serde_json::from_str(init.as_str()).map_err(|e| Error::Options {
        call: "create".into(),
        message: format!("init arguments: {e}"),
    })
}

// ---------------------------------------------------------------------------------------------
// Functions the export macros instantiate per plugin type.

#[doc(hidden)]
pub fn header_json<P: BackendPlugin>() -> String {
    serde_json::to_string(&PluginHeader::from_info(P::info(), PluginKind::Backend))
        .expect("header serialises")
}

#[doc(hidden)]
pub fn reward_header_json<P: RewardPlugin>() -> String {
    serde_json::to_string(&PluginHeader::from_info(P::info(), PluginKind::Reward))
        .expect("header serialises")
}

#[doc(hidden)]
pub fn tool_header_json<P: ToolPlugin>() -> String {
    let mut header = PluginHeader::from_info(P::info(), PluginKind::Tool);
    header.tools = P::tool_classes();
    serde_json::to_string(&header).expect("header serialises")
}

#[doc(hidden)]
pub fn tool_box(tool: Box<dyn Tool>) -> ToolBox {
    ToolFfi_TO::from_value(ToolAdapter(tool), TD_Opaque)
}

#[doc(hidden)]
pub fn actor_box(actor: Box<dyn Actor>) -> ActorBox {
    // Downcastable: the root module's `generate_turns` finds the actor behind the object.
    ActorFfi_TO::from_value(ActorAdapter(actor), abi_stable::sabi_trait::TD_CanDowncast)
}

/// [`crate::ffi::BackendModule::generate_turns`] of every SDK plugin: the actor behind `actor`
/// (one this plugin created) runs [`Actor::generate_turns`].
extern "C" fn generate_turns(
    actor: &mut ActorBox,
    prompts: &Batch,
    options: RStr<'_>,
    driver: crate::turns::TurnDriverRef<'_>,
) -> RResult<Batch, FfiError> {
    ffi("Actor.generate_turns", || {
        let adapter = actor.obj.downcast_as_mut::<ActorAdapter>().map_err(|_| {
            Error::invalid_input("generate_turns was given an actor this plugin did not create")
        })?;
        prompts.validate("Actor.generate_turns input")?;
        let opts: GenerateOptions = parse_options("Actor.generate_turns", options)?;
        let mut remote = crate::turns::RemoteDriver(driver);
        let out = adapter.0.generate_turns(prompts, &opts, &mut remote)?;
        out.validate("Actor.generate_turns output")?;
        Ok(out)
    })
}

#[doc(hidden)]
pub fn critic_box(critic: Box<dyn Critic>) -> CriticBox {
    CriticFfi_TO::from_value(CriticAdapter(critic), TD_Opaque)
}

#[doc(hidden)]
pub fn reward_box(reward: Box<dyn Reward>) -> RewardBox {
    RewardFfi_TO::from_value(RewardAdapter(reward), TD_Opaque)
}

#[doc(hidden)]
pub fn backend_module<P: BackendPlugin>() -> BackendModuleRef {
    extern "C" fn header<P: BackendPlugin>() -> RString {
        guard(|| Ok(header_json::<P>())).unwrap_or_default().into()
    }
    extern "C" fn set_host_cb<P: BackendPlugin>(cb: HostCallbacks) {
        let _ = guard(|| {
            set_host(cb, &P::info().name);
            Ok(())
        });
    }
    extern "C" fn create_actor<P: BackendPlugin>(init: RStr<'_>) -> RResult<ActorBox, FfiError> {
        ffi("create_actor", || {
            Ok(actor_box(P::create_actor(&parse_init(init)?)?))
        })
    }
    extern "C" fn create_reference<P: BackendPlugin>(
        init: RStr<'_>,
    ) -> RResult<ActorBox, FfiError> {
        ffi("create_reference", || {
            Ok(actor_box(P::create_reference(&parse_init(init)?)?))
        })
    }
    extern "C" fn create_critic<P: BackendPlugin>(init: RStr<'_>) -> RResult<CriticBox, FfiError> {
        ffi("create_critic", || {
            Ok(critic_box(P::create_critic(&parse_init(init)?)?))
        })
    }
    extern "C" fn validate<P: BackendPlugin>(
        init: RStr<'_>,
    ) -> RResult<ROption<RString>, FfiError> {
        ffi("validate", || {
            let init = parse_init(init)?;
            match P::validate(&init) {
                None => Ok(RNone),
                Some(r) => r.map(|s| RSome(RString::from(s))),
            }
        })
    }
    extern "C" fn create_reward_model<P: BackendPlugin>(
        init: RStr<'_>,
    ) -> RResult<RewardBox, FfiError> {
        ffi("create_reward_model", || {
            Ok(reward_box(P::create_reward_model(&parse_init(init)?)?))
        })
    }
    use abi_stable::prefix_type::PrefixTypeTrait;
    BackendModule {
        header: header::<P>,
        set_host: set_host_cb::<P>,
        create_actor: create_actor::<P>,
        create_reference: create_reference::<P>,
        create_critic: create_critic::<P>,
        validate: validate::<P>,
        create_reward_model: create_reward_model::<P>,
        generate_turns,
    }
    .leak_into_prefix()
}

#[doc(hidden)]
pub fn reward_module<P: RewardPlugin>() -> RewardModuleRef {
    extern "C" fn header<P: RewardPlugin>() -> RString {
        guard(|| Ok(reward_header_json::<P>()))
            .unwrap_or_default()
            .into()
    }
    extern "C" fn set_host_cb<P: RewardPlugin>(cb: HostCallbacks) {
        let _ = guard(|| {
            set_host(cb, &P::info().name);
            Ok(())
        });
    }
    extern "C" fn create_reward<P: RewardPlugin>(init: RStr<'_>) -> RResult<RewardBox, FfiError> {
        ffi("create_reward", || {
            Ok(reward_box(P::create_reward_with(
                &parse_init(init)?,
                ModelServices::none(),
            )?))
        })
    }
    extern "C" fn create_reward_with_services<P: RewardPlugin>(
        init: RStr<'_>,
        services: ModelServicesBox,
    ) -> RResult<RewardBox, FfiError> {
        ffi("create_reward", || {
            Ok(reward_box(P::create_reward_with(
                &parse_init(init)?,
                ModelServices::from_box(services),
            )?))
        })
    }
    use abi_stable::prefix_type::PrefixTypeTrait;
    RewardModule {
        header: header::<P>,
        set_host: set_host_cb::<P>,
        create_reward: create_reward::<P>,
        create_reward_with_services: create_reward_with_services::<P>,
    }
    .leak_into_prefix()
}

#[doc(hidden)]
pub fn tool_module<P: ToolPlugin>() -> ToolModuleRef {
    extern "C" fn header<P: ToolPlugin>() -> RString {
        guard(|| Ok(tool_header_json::<P>()))
            .unwrap_or_default()
            .into()
    }
    extern "C" fn set_host_cb<P: ToolPlugin>(cb: HostCallbacks) {
        let _ = guard(|| {
            set_host(cb, &P::info().name);
            Ok(())
        });
    }
    extern "C" fn create_tool<P: ToolPlugin>(init: RStr<'_>) -> RResult<ToolBox, FfiError> {
        ffi("create_tool", || {
            let init: ToolInit =
                serde_json::from_str(init.as_str()).map_err(|e| Error::Options {
                    call: "create_tool".into(),
                    message: format!("init arguments: {e}"),
                })?;
            Ok(tool_box(P::create_tool(&init)?))
        })
    }
    use abi_stable::prefix_type::PrefixTypeTrait;
    ToolModule {
        header: header::<P>,
        set_host: set_host_cb::<P>,
        create_tool: create_tool::<P>,
    }
    .leak_into_prefix()
}

#[doc(hidden)]
pub fn header_cstr(
    cell: &'static OnceLock<std::ffi::CString>,
    json: fn() -> String,
) -> *const std::os::raw::c_char {
    cell.get_or_init(|| {
        let s = guard(|| Ok(json())).unwrap_or_default();
        std::ffi::CString::new(s).unwrap_or_default()
    })
    .as_ptr()
}

#[doc(hidden)]
pub fn metrics_from_ffi(m: FfiMetrics) -> Metrics {
    m.entries
        .into_iter()
        .map(|Tuple2(k, v)| (k.into_string(), v))
        .collect()
}

/// Export a backend plugin: `verl_plugin_api::export_backend_plugin!(MyPlugin);` where
/// `MyPlugin: BackendPlugin`. Emits the header symbol and the abi_stable root module.
#[macro_export]
macro_rules! export_backend_plugin {
    ($plugin:ty) => {
        #[no_mangle]
        pub extern "C" fn verl_plugin_header() -> *const ::std::os::raw::c_char {
            static HEADER: ::std::sync::OnceLock<::std::ffi::CString> =
                ::std::sync::OnceLock::new();
            $crate::sdk::header_cstr(&HEADER, $crate::sdk::header_json::<$plugin>)
        }
        $crate::__export_root_module!(
            $crate::ffi::BackendModuleRef,
            $crate::sdk::backend_module::<$plugin>
        );
    };
}

/// Export a reward plugin: `verl_plugin_api::export_reward_plugin!(MyRewards);`.
#[macro_export]
macro_rules! export_reward_plugin {
    ($plugin:ty) => {
        #[no_mangle]
        pub extern "C" fn verl_plugin_header() -> *const ::std::os::raw::c_char {
            static HEADER: ::std::sync::OnceLock<::std::ffi::CString> =
                ::std::sync::OnceLock::new();
            $crate::sdk::header_cstr(&HEADER, $crate::sdk::reward_header_json::<$plugin>)
        }
        $crate::__export_root_module!(
            $crate::ffi::RewardModuleRef,
            $crate::sdk::reward_module::<$plugin>
        );
    };
}

/// Export a tool plugin: `verl_plugin_api::export_tool_plugin!(MyTools);` where
/// `MyTools: ToolPlugin`.
#[macro_export]
macro_rules! export_tool_plugin {
    ($plugin:ty) => {
        #[no_mangle]
        pub extern "C" fn verl_plugin_header() -> *const ::std::os::raw::c_char {
            static HEADER: ::std::sync::OnceLock<::std::ffi::CString> =
                ::std::sync::OnceLock::new();
            $crate::sdk::header_cstr(&HEADER, $crate::sdk::tool_header_json::<$plugin>)
        }
        $crate::__export_root_module!(
            $crate::ffi::ToolModuleRef,
            $crate::sdk::tool_module::<$plugin>
        );
    };
}

/// What abi_stable's `#[export_root_module]` expands to, spelled through our re-export so plugin
/// crates need no direct `abi_stable` dependency. The symbol name is abi_stable 0.11's
/// `ROOT_MODULE_LOADER_NAME` (a unit test pins it).
#[doc(hidden)]
#[macro_export]
macro_rules! __export_root_module {
    ($module:ty, $ctor:expr) => {
        #[export_name = "_1as_0lib_1header_0root_bmodule_bloader"]
        pub static VERL_ROOT_MODULE_LOADER: $crate::__private::abi_stable::library::LibHeader = {
            extern "C" fn erased() -> $crate::__private::abi_stable::library::RootModuleResult {
                fn ctor() -> $module {
                    ($ctor)()
                }
                $crate::__private::abi_stable::library::__call_root_module_loader(ctor)
            }
            unsafe {
                $crate::__private::abi_stable::library::LibHeader::from_constructor::<$module>(
                    erased,
                    $crate::__private::abi_stable::library::CheckTypeLayout::Yes,
                )
            }
        };
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{testing, BuildInfo};
    use serde_json::json;

    /// A tool plugin in a dozen lines: `echo` repeats its `text`, panics on `panic`, and counts
    /// calls per instance (its `calc_reward`).
    struct Echo;
    struct EchoTool {
        schema: serde_json::Value,
        calls: std::sync::Mutex<std::collections::HashMap<String, f64>>,
    }

    impl ToolPlugin for Echo {
        fn info() -> PluginInfo {
            PluginInfo {
                name: "echo".into(),
                version: "0.1.0".into(),
                description: String::new(),
                capabilities: vec![],
                build: BuildInfo::plain(),
            }
        }
        fn tool_classes() -> Vec<String> {
            vec!["echo".into()]
        }
        fn create_tool(init: &ToolInit) -> Result<Box<dyn Tool>> {
            init.config_object(&[])?;
            Ok(Box::new(EchoTool {
                schema: init.schema_or(json!({"type": "function", "function": {
                    "name": "echo", "description": "repeats its text"}})),
                calls: Default::default(),
            }))
        }
    }

    impl Tool for EchoTool {
        fn schema(&self) -> serde_json::Value {
            self.schema.clone()
        }
        fn create(&self, _kwargs: &serde_json::Value) -> Result<String> {
            let id = next_instance_id();
            self.calls.lock().unwrap().insert(id.clone(), 0.0);
            Ok(id)
        }
        fn execute(&self, id: &str, args: &serde_json::Value) -> Result<ToolOutput> {
            let text = args["text"].as_str().unwrap_or_default();
            if text == "panic" {
                panic!("echo was asked to panic");
            }
            *self.calls.lock().unwrap().get_mut(id).unwrap() += 1.0;
            let reward = if text == "nan" { f64::NAN } else { 0.5 };
            Ok(ToolOutput::text(text).with_reward(reward))
        }
        fn calc_reward(&self, id: &str) -> Result<f64> {
            Ok(self.calls.lock().unwrap()[id])
        }
    }

    #[test]
    fn a_tool_plugin_runs_its_lifecycle_through_the_abi() {
        let h = testing::tool_header::<Echo>().unwrap();
        assert_eq!(h.kind, crate::PluginKind::Tool);
        assert!(h.provides_tool("echo"));
        let tool =
            testing::tool::<Echo>(&ToolInit::new("echo", json!({"type": "native"}))).unwrap();
        assert_eq!(tool.name(), "echo");
        let id = tool.create(&json!({})).unwrap();
        let out = tool.execute(&id, &json!({"text": "hi"})).unwrap();
        assert_eq!(out, ToolOutput::text("hi").with_reward(0.5));
        assert_eq!(tool.calc_reward(&id).unwrap(), 1.0);
        tool.release(&id).unwrap();
        let e = tool.call("frobnicate", &json!({})).unwrap_err().to_string();
        assert!(
            e.contains("plugin `echo` echo.frobnicate: not implemented"),
            "{e}"
        );
    }

    #[test]
    fn a_tool_schema_from_the_config_names_the_tool() {
        let init = ToolInit::new("echo", json!({})).with_schema(json!({"type": "function",
            "function": {"name": "say", "description": "says it"}}));
        assert_eq!(testing::tool::<Echo>(&init).unwrap().name(), "say");
    }

    #[test]
    fn a_panicking_tool_and_a_bad_reward_come_back_as_named_errors() {
        let tool = testing::tool::<Echo>(&ToolInit::new("echo", json!({}))).unwrap();
        let id = tool.create(&json!({})).unwrap();
        let e = tool.execute(&id, &json!({"text": "panic"})).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Panic);
        let msg = e.to_string();
        assert!(
            msg.contains("plugin `echo` echo.execute: panicked: echo was asked to panic"),
            "{msg}"
        );
        let msg = tool
            .execute(&id, &json!({"text": "nan"}))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("reward is NaN"), "{msg}");
        let msg = testing::tool::<Echo>(&ToolInit::new("echo", json!({"colour": "red"})))
            .err()
            .unwrap()
            .to_string();
        assert!(
            msg.contains("plugin `echo` create_tool") && msg.contains("`config.colour`"),
            "{msg}"
        );
    }

    #[test]
    fn root_module_symbol_matches_abi_stable() {
        assert_eq!(
            abi_stable::library::ROOT_MODULE_LOADER_NAME,
            "_1as_0lib_1header_0root_bmodule_bloader"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Row rewards: one row in, one score out.

/// One row of a reward batch, as a [`RowReward`] sees it.
#[derive(Debug, Clone, Copy)]
pub struct RewardRow<'a> {
    pub data_source: &'a str,
    /// The prompt as the policy saw it (chat template applied, special tokens dropped).
    pub prompt: &'a str,
    /// The response text (verl's `solution_str`).
    pub response: &'a str,
    /// `reward_model.ground_truth` of the row (any JSON).
    pub ground_truth: &'a serde_json::Value,
    pub extra_info: &'a serde_json::Value,
    /// The job's reward keyword arguments (`custom_reward_function.reward_kwargs`).
    pub kwargs: &'a serde_json::Value,
}

impl RewardRow<'_> {
    /// The ground truth as text (a JSON string's content, anything else as JSON).
    pub fn ground_truth_str(&self) -> String {
        match self.ground_truth {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        }
    }
}

/// The smallest reward plugin: score one row. The SDK does the batching, the columns and the ABI;
/// export it with [`crate::export_row_reward!`].
pub trait RowReward: Default + Send + 'static {
    /// The plugin's name (what `plugins.reward.default` / `plugins.reward.routes` name).
    const NAME: &'static str;
    const VERSION: &'static str = "0.1.0";
    const DESCRIPTION: &'static str = "";
    fn score(&mut self, row: &RewardRow<'_>) -> Result<f32>;
}

/// The [`RewardPlugin`] of a [`RowReward`].
pub struct RowRewardPlugin<R>(std::marker::PhantomData<fn() -> R>);

struct RowAdapter<R>(R);

impl<R: RowReward> RewardPlugin for RowRewardPlugin<R> {
    fn info() -> PluginInfo {
        PluginInfo {
            name: R::NAME.into(),
            version: R::VERSION.into(),
            description: R::DESCRIPTION.into(),
            capabilities: vec![crate::Capability::ready(crate::Role::Reward)],
            build: crate::BuildInfo::plain(),
        }
    }
    fn create_reward(_init: &InitArgs) -> Result<Box<dyn Reward>> {
        Ok(Box::new(RowAdapter(R::default())))
    }
}

impl<R: RowReward> Reward for RowAdapter<R> {
    fn score(&mut self, batch: &Batch, options: &ScoreOptions) -> Result<Batch> {
        use crate::contract::col;
        let prompts = batch.strings(col::PROMPT_TEXT)?;
        let responses = batch.strings(col::RESPONSE_TEXT)?;
        let sources = batch.strings(col::DATA_SOURCE)?;
        let truths = batch.json(col::GROUND_TRUTH)?;
        let extras = batch.json(col::EXTRA_INFO)?;
        let mut scores = Vec::with_capacity(responses.len());
        for i in 0..responses.len() {
            let row = RewardRow {
                data_source: &sources[i],
                prompt: &prompts[i],
                response: &responses[i],
                ground_truth: &truths[i],
                extra_info: &extras[i],
                kwargs: &options.kwargs,
            };
            scores.push(self.0.score(&row).map_err(|e| {
                Error::failed(format!("row {i} (data_source `{}`): {e}", sources[i]))
            })?);
        }
        let mut out = Batch::new();
        out.insert_tensor(col::SCORES, &[scores.len()], &scores);
        Ok(out)
    }
}

/// Export a [`RowReward`] as a reward plugin: `verl_plugin_api::export_row_reward!(MyScorer);`.
#[macro_export]
macro_rules! export_row_reward {
    ($row:ty) => {
        $crate::export_reward_plugin!($crate::sdk::RowRewardPlugin<$row>);
    };
}
