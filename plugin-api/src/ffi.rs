//! What actually crosses the ABI: the `#[sabi_trait]` role objects and the versioned root modules.
//!
//! Append-only: new trait methods go after the `last_prefix_field` method (with a default body),
//! new root-module fields after the `last_prefix_field` field. Options and init arguments travel as
//! JSON text so they can grow without layout changes. abi_stable accepts a plugin whose root module
//! has more fields than the host's, not fewer: the loader checks an older backend plugin against
//! the frozen prefix [`v1`] instead, and its appended fields read as absent.

use abi_stable::{
    declare_root_module_statics,
    library::RootModule,
    package_version_strings, sabi_trait,
    sabi_types::VersionStrings,
    std_types::{RBox, ROption, RResult, RStr, RString, RVec, Tuple2},
    StableAbi,
};

use crate::batch::Batch;
use crate::error::FfiError;

/// Metrics as they cross the ABI: ordered (name, value) pairs.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Default)]
pub struct FfiMetrics {
    pub entries: RVec<Tuple2<RString, f64>>,
}

/// Which data-parallel shard a rank owns.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataParallel {
    pub rank: u32,
    pub size: u32,
}

/// The policy (and, in eval mode, the reference policy).
#[sabi_trait]
pub trait ActorFfi: Send {
    fn generate(&mut self, prompts: &Batch, options: RStr<'_>) -> RResult<Batch, FfiError>;
    fn compute_log_prob(&mut self, batch: &Batch, options: RStr<'_>) -> RResult<Batch, FfiError>;
    fn update(&mut self, batch: &Batch, options: RStr<'_>) -> RResult<FfiMetrics, FfiError>;
    fn save(&mut self, dir: RStr<'_>) -> RResult<(), FfiError>;
    fn load(&mut self, dir: RStr<'_>) -> RResult<(), FfiError>;
    fn export_hf(&mut self, dir: RStr<'_>) -> RResult<(), FfiError>;
    fn data_parallel(&self) -> DataParallel;
    /// Extension point: a named call with a batch and JSON options (collectives, memory release, ...).
    #[sabi(last_prefix_field)]
    fn call(
        &mut self,
        method: RStr<'_>,
        batch: &Batch,
        options: RStr<'_>,
    ) -> RResult<Batch, FfiError>;
}

/// The value model.
#[sabi_trait]
pub trait CriticFfi: Send {
    fn compute_values(&mut self, batch: &Batch, options: RStr<'_>) -> RResult<Batch, FfiError>;
    fn update(&mut self, batch: &Batch, options: RStr<'_>) -> RResult<FfiMetrics, FfiError>;
    fn save(&mut self, dir: RStr<'_>) -> RResult<(), FfiError>;
    fn load(&mut self, dir: RStr<'_>) -> RResult<(), FfiError>;
    fn data_parallel(&self) -> DataParallel;
    #[sabi(last_prefix_field)]
    fn call(
        &mut self,
        method: RStr<'_>,
        batch: &Batch,
        options: RStr<'_>,
    ) -> RResult<Batch, FfiError>;
}

/// A reward function or model.
#[sabi_trait]
pub trait RewardFfi: Send {
    fn score(&mut self, batch: &Batch, options: RStr<'_>) -> RResult<Batch, FfiError>;
    #[sabi(last_prefix_field)]
    fn call(
        &mut self,
        method: RStr<'_>,
        batch: &Batch,
        options: RStr<'_>,
    ) -> RResult<Batch, FfiError>;
}

/// Models the host lends a reward plugin (handed over when it is created): `call(model,
/// "score" | "generate", batch, options)` runs the host's reward model or generation model
/// `model`; `models()` lists them as JSON (`[{"name", "kind"}]`). Text in, text or scores out: the
/// host applies each model's own tokenizer and chat template.
#[sabi_trait]
pub trait ModelServicesFfi: Send + Sync {
    fn models(&self) -> RString;
    #[sabi(last_prefix_field)]
    fn call(
        &self,
        model: RStr<'_>,
        method: RStr<'_>,
        batch: &Batch,
        options: RStr<'_>,
    ) -> RResult<Batch, FfiError>;
}

/// A tool the model calls in a multi-turn rollout (verl's `BaseTool`). Every method takes
/// `&self`: one tool object serves the calls of many trajectories at once, each on its own
/// instance. JSON text in and out, so the contract grows without layout changes.
#[sabi_trait]
pub trait ToolFfi: Send + Sync {
    /// The OpenAI function schema (`{"type": "function", "function": {name, description,
    /// parameters}}`) as JSON: what the chat template's `tools` gets.
    fn schema(&self) -> RString;
    /// Starts an instance for one trajectory's call; `create_kwargs` is the JSON object of the
    /// row's `tools_kwargs[name].create_kwargs` (`{}` when it has none). Returns the instance id.
    fn create(&self, create_kwargs: RStr<'_>) -> RResult<RString, FfiError>;
    /// Runs the call with the model's `arguments` (a JSON object). Returns the JSON of
    /// [`crate::contract::ToolOutput`]: `{"text", "reward"?, "metrics"?}`.
    fn execute(&self, instance_id: RStr<'_>, arguments: RStr<'_>) -> RResult<RString, FfiError>;
    fn release(&self, instance_id: RStr<'_>) -> RResult<(), FfiError>;
    /// Extension point: a named call with JSON options and a JSON answer (`calc_reward` with
    /// `{"instance_id"}` answers `{"reward"}`).
    #[sabi(last_prefix_field)]
    fn call(&self, method: RStr<'_>, options: RStr<'_>) -> RResult<RString, FfiError>;
}

pub type ActorBox = ActorFfi_TO<'static, RBox<()>>;
pub type ModelServicesBox = ModelServicesFfi_TO<'static, RBox<()>>;
pub type CriticBox = CriticFfi_TO<'static, RBox<()>>;
pub type RewardBox = RewardFfi_TO<'static, RBox<()>>;
pub type ToolBox = ToolFfi_TO<'static, RBox<()>>;

/// Log levels as they cross the ABI.
pub mod level {
    pub const ERROR: u8 = 1;
    pub const WARN: u8 = 2;
    pub const INFO: u8 = 3;
    pub const DEBUG: u8 = 4;
    pub const TRACE: u8 = 5;
}

/// Functions the host lends a plugin. Handed over once, right after loading.
#[repr(C)]
#[derive(StableAbi, Clone, Copy)]
pub struct HostCallbacks {
    /// Most verbose level the host wants (a [`level`] constant); the plugin filters before formatting.
    pub max_level: u8,
    /// Receives the plugin's `tracing` events: level, plugin name, event target, formatted message.
    pub log: extern "C" fn(level: u8, plugin: RStr<'_>, target: RStr<'_>, message: RStr<'_>),
}

/// Root module of a backend plugin (actor / reference / critic).
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = BackendModuleRef)))]
#[sabi(missing_field(panic))]
pub struct BackendModule {
    /// The same JSON header as the C symbol, for callers that only hold the module.
    pub header: extern "C" fn() -> RString,
    pub set_host: extern "C" fn(HostCallbacks),
    /// `init` is the JSON of [`crate::contract::InitArgs`].
    pub create_actor: extern "C" fn(init: RStr<'_>) -> RResult<ActorBox, FfiError>,
    pub create_reference: extern "C" fn(init: RStr<'_>) -> RResult<ActorBox, FfiError>,
    #[sabi(last_prefix_field)]
    pub create_critic: extern "C" fn(init: RStr<'_>) -> RResult<CriticBox, FfiError>,
    /// Checks the job's parallel layout against the world size and the model (`verl run
    /// --dry-run`, and before a real run launches its ranks) without creating anything or loading
    /// weights. `init` is the JSON of [`crate::contract::InitArgs`]: the whole job config, the
    /// job's world size, and in `extra.roles` the roles the job will create (`["actor",
    /// "reference", "critic"]`). `ROk(RSome(summary))`: the layout fits, one line per role;
    /// `ROk(RNone)`: the backend has no upfront check; `RErr`: the layout does not fit (the message
    /// names the key and shows the arithmetic).
    ///
    /// After the last prefix field: plugins built before it existed still load, and the host
    /// reads it through the generated accessor, which returns `None` for them.
    #[sabi(missing_field(option))]
    pub validate: extern "C" fn(init: RStr<'_>) -> RResult<ROption<RString>, FfiError>,
    /// Creates the backend's reward model role: a sequence-scoring model (HF
    /// `*ForSequenceClassification` / `*ForRewardModel`) whose `score` takes
    /// [`crate::contract::RM_SCORE_IN`] and returns [`crate::contract::RM_SCORE_OUT`]; `call`
    /// answers `offload` / `onload` (weights to host memory and back). `init` is the JSON of
    /// [`crate::contract::InitArgs`] with `extra.reward_model` naming the model folder, dtype and
    /// micro-batching. Absent on plugins built before it existed.
    #[sabi(missing_field(option))]
    pub create_reward_model: extern "C" fn(init: RStr<'_>) -> RResult<RewardBox, FfiError>,
    /// Multi-turn generation by an actor this plugin created ([`crate::turns`]): like the
    /// actor's `generate`, but a sequence that stops waits for `driver`'s answer. Returns
    /// [`crate::contract::GENERATE_TURNS_OUT`]. A root-module function rather than an actor
    /// method because abi_stable's layout check refuses a host whose trait vtable has more
    /// methods than an older plugin's. Absent on plugins built before it existed.
    #[sabi(missing_field(option))]
    pub generate_turns: extern "C" fn(
        actor: &mut ActorBox,
        prompts: &Batch,
        options: RStr<'_>,
        driver: crate::turns::TurnDriverRef<'_>,
    ) -> RResult<Batch, FfiError>,
}

/// [`BackendModule::generate_turns`].
pub type GenerateTurnsFn = extern "C" fn(
    actor: &mut ActorBox,
    prompts: &Batch,
    options: RStr<'_>,
    driver: crate::turns::TurnDriverRef<'_>,
) -> RResult<Batch, FfiError>;

impl RootModule for BackendModuleRef {
    declare_root_module_statics! {BackendModuleRef}
    const BASE_NAME: &'static str = "verl_backend";
    const NAME: &'static str = "verl_backend";
    const VERSION_STRINGS: VersionStrings = package_version_strings!();
}

/// The backend root module as plugins built before any field was appended to it have it (its
/// prefix, frozen). abi_stable's layout check lets a host load a plugin whose prefix type has *more*
/// fields than the host's, never fewer, so the loader checks a plugin that fails against
/// [`BackendModule`] against this prefix instead; when that passes and the plugin's own metadata
/// says it has none of the appended fields, it is used as a [`BackendModuleRef`] whose appended
/// fields' accessors return `None` ([`as_current`]).
pub mod v1 {
    use abi_stable::{
        declare_root_module_statics,
        library::RootModule,
        package_version_strings,
        sabi_types::VersionStrings,
        std_types::{RResult, RStr, RString},
        StableAbi,
    };

    use super::{ActorBox, CriticBox, HostCallbacks};
    use crate::error::FfiError;

    #[repr(C)]
    #[derive(StableAbi)]
    #[sabi(kind(Prefix(prefix_ref = BackendModuleRef)))]
    #[sabi(missing_field(panic))]
    pub struct BackendModule {
        pub header: extern "C" fn() -> RString,
        pub set_host: extern "C" fn(HostCallbacks),
        pub create_actor: extern "C" fn(init: RStr<'_>) -> RResult<ActorBox, FfiError>,
        pub create_reference: extern "C" fn(init: RStr<'_>) -> RResult<ActorBox, FfiError>,
        #[sabi(last_prefix_field)]
        pub create_critic: extern "C" fn(init: RStr<'_>) -> RResult<CriticBox, FfiError>,
    }

    impl RootModule for BackendModuleRef {
        declare_root_module_statics! {BackendModuleRef}
        const BASE_NAME: &'static str = "verl_backend";
        const NAME: &'static str = "verl_backend";
        const VERSION_STRINGS: VersionStrings = package_version_strings!();
    }

    /// The module as the current [`super::BackendModuleRef`], when it has none of the fields
    /// appended since (`None` otherwise: then its appended fields did not pass the full layout
    /// check, and it must not be used).
    pub fn as_current(m: BackendModuleRef) -> Option<super::BackendModuleRef> {
        // SAFETY: both are a `PrefixRef` to the same module behind its prefix metadata: a
        // pointer whose prefix (the fields above) was checked against this layout. The appended
        // fields' accessors read the plugin's own metadata, which says they are absent.
        let current: super::BackendModuleRef = unsafe { std::mem::transmute(m) };
        (current.validate().is_none()
            && current.create_reward_model().is_none()
            && current.generate_turns().is_none())
        .then_some(current)
    }
}

/// The backend root module as plugins built with `validate` but before `create_reward_model`
/// have it (frozen; see [`v1`]).
pub mod v2 {
    use abi_stable::{
        declare_root_module_statics,
        library::RootModule,
        package_version_strings,
        sabi_types::VersionStrings,
        std_types::{ROption, RResult, RStr, RString},
        StableAbi,
    };

    use super::{ActorBox, CriticBox, HostCallbacks};
    use crate::error::FfiError;

    #[repr(C)]
    #[derive(StableAbi)]
    #[sabi(kind(Prefix(prefix_ref = BackendModuleRef)))]
    #[sabi(missing_field(panic))]
    pub struct BackendModule {
        pub header: extern "C" fn() -> RString,
        pub set_host: extern "C" fn(HostCallbacks),
        pub create_actor: extern "C" fn(init: RStr<'_>) -> RResult<ActorBox, FfiError>,
        pub create_reference: extern "C" fn(init: RStr<'_>) -> RResult<ActorBox, FfiError>,
        #[sabi(last_prefix_field)]
        pub create_critic: extern "C" fn(init: RStr<'_>) -> RResult<CriticBox, FfiError>,
        #[sabi(missing_field(option))]
        pub validate: extern "C" fn(init: RStr<'_>) -> RResult<ROption<RString>, FfiError>,
    }

    impl RootModule for BackendModuleRef {
        declare_root_module_statics! {BackendModuleRef}
        const BASE_NAME: &'static str = "verl_backend";
        const NAME: &'static str = "verl_backend";
        const VERSION_STRINGS: VersionStrings = package_version_strings!();
    }

    /// The module as the current [`super::BackendModuleRef`] when it has no field appended
    /// after `validate` (see [`super::v1::as_current`]).
    pub fn as_current(m: BackendModuleRef) -> Option<super::BackendModuleRef> {
        // SAFETY: as in `v1::as_current`; this prefix's fields passed the layout check.
        let current: super::BackendModuleRef = unsafe { std::mem::transmute(m) };
        (current.create_reward_model().is_none() && current.generate_turns().is_none())
            .then_some(current)
    }
}

/// The backend root module as plugins built with `create_reward_model` but before
/// `generate_turns` have it (frozen; see [`v1`]).
pub mod v3 {
    use abi_stable::{
        declare_root_module_statics,
        library::RootModule,
        package_version_strings,
        sabi_types::VersionStrings,
        std_types::{ROption, RResult, RStr, RString},
        StableAbi,
    };

    use super::{ActorBox, CriticBox, HostCallbacks, RewardBox};
    use crate::error::FfiError;

    #[repr(C)]
    #[derive(StableAbi)]
    #[sabi(kind(Prefix(prefix_ref = BackendModuleRef)))]
    #[sabi(missing_field(panic))]
    pub struct BackendModule {
        pub header: extern "C" fn() -> RString,
        pub set_host: extern "C" fn(HostCallbacks),
        pub create_actor: extern "C" fn(init: RStr<'_>) -> RResult<ActorBox, FfiError>,
        pub create_reference: extern "C" fn(init: RStr<'_>) -> RResult<ActorBox, FfiError>,
        #[sabi(last_prefix_field)]
        pub create_critic: extern "C" fn(init: RStr<'_>) -> RResult<CriticBox, FfiError>,
        #[sabi(missing_field(option))]
        pub validate: extern "C" fn(init: RStr<'_>) -> RResult<ROption<RString>, FfiError>,
        #[sabi(missing_field(option))]
        pub create_reward_model: extern "C" fn(init: RStr<'_>) -> RResult<RewardBox, FfiError>,
    }

    impl RootModule for BackendModuleRef {
        declare_root_module_statics! {BackendModuleRef}
        const BASE_NAME: &'static str = "verl_backend";
        const NAME: &'static str = "verl_backend";
        const VERSION_STRINGS: VersionStrings = package_version_strings!();
    }

    /// The module as the current [`super::BackendModuleRef`] when it has no field appended
    /// after `create_reward_model` (see [`super::v1::as_current`]).
    pub fn as_current(m: BackendModuleRef) -> Option<super::BackendModuleRef> {
        // SAFETY: as in `v1::as_current`; this prefix's fields passed the layout check.
        let current: super::BackendModuleRef = unsafe { std::mem::transmute(m) };
        current.generate_turns().is_none().then_some(current)
    }
}

/// Root module of a reward plugin.
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = RewardModuleRef)))]
#[sabi(missing_field(panic))]
pub struct RewardModule {
    pub header: extern "C" fn() -> RString,
    pub set_host: extern "C" fn(HostCallbacks),
    #[sabi(last_prefix_field)]
    pub create_reward: extern "C" fn(init: RStr<'_>) -> RResult<RewardBox, FfiError>,
    /// `create_reward` with the host's model services ([`ModelServicesFfi`]) handed to the
    /// plugin, so it can score with the job's reward models and generate with its judge models.
    /// Absent on plugins built before it existed (the host then calls `create_reward`).
    #[sabi(missing_field(option))]
    pub create_reward_with_services:
        extern "C" fn(init: RStr<'_>, services: ModelServicesBox) -> RResult<RewardBox, FfiError>,
}

impl RootModule for RewardModuleRef {
    declare_root_module_statics! {RewardModuleRef}
    const BASE_NAME: &'static str = "verl_reward";
    const NAME: &'static str = "verl_reward";
    const VERSION_STRINGS: VersionStrings = package_version_strings!();
}

/// The reward root module as plugins built before `create_reward_with_services` have it
/// (frozen; the loader falls back to it as for backends, see [`v1`]).
pub mod reward_v1 {
    use abi_stable::{
        declare_root_module_statics,
        library::RootModule,
        package_version_strings,
        sabi_types::VersionStrings,
        std_types::{RResult, RStr, RString},
        StableAbi,
    };

    use super::{HostCallbacks, RewardBox};
    use crate::error::FfiError;

    #[repr(C)]
    #[derive(StableAbi)]
    #[sabi(kind(Prefix(prefix_ref = RewardModuleRef)))]
    #[sabi(missing_field(panic))]
    pub struct RewardModule {
        pub header: extern "C" fn() -> RString,
        pub set_host: extern "C" fn(HostCallbacks),
        #[sabi(last_prefix_field)]
        pub create_reward: extern "C" fn(init: RStr<'_>) -> RResult<RewardBox, FfiError>,
    }

    impl RootModule for RewardModuleRef {
        declare_root_module_statics! {RewardModuleRef}
        const BASE_NAME: &'static str = "verl_reward";
        const NAME: &'static str = "verl_reward";
        const VERSION_STRINGS: VersionStrings = package_version_strings!();
    }

    /// The module as the current [`super::RewardModuleRef`] when it has none of the appended
    /// fields (see [`super::v1::as_current`]).
    pub fn as_current(m: RewardModuleRef) -> Option<super::RewardModuleRef> {
        // SAFETY: as in `v1::as_current`.
        let current: super::RewardModuleRef = unsafe { std::mem::transmute(m) };
        current
            .create_reward_with_services()
            .is_none()
            .then_some(current)
    }
}

/// Root module of a tool plugin: one library may serve several tool classes (the header's
/// `tools` lists their `class_name`s).
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = ToolModuleRef)))]
#[sabi(missing_field(panic))]
pub struct ToolModule {
    pub header: extern "C" fn() -> RString,
    pub set_host: extern "C" fn(HostCallbacks),
    /// `init` is the JSON of [`crate::contract::ToolInit`]: verl's tool config entry
    /// (`class_name`, `config`, `tool_schema`).
    #[sabi(last_prefix_field)]
    pub create_tool: extern "C" fn(init: RStr<'_>) -> RResult<ToolBox, FfiError>,
}

impl RootModule for ToolModuleRef {
    declare_root_module_statics! {ToolModuleRef}
    const BASE_NAME: &'static str = "verl_tool";
    const NAME: &'static str = "verl_tool";
    const VERSION_STRINGS: VersionStrings = package_version_strings!();
}

#[cfg(test)]
mod tests {
    use super::*;
    use abi_stable::abi_stability::abi_checking::check_layout_compatibility;
    use abi_stable::prefix_type::PrefixTypeTrait;

    extern "C" fn header() -> RString {
        RString::new()
    }
    extern "C" fn set_host(_: HostCallbacks) {}
    extern "C" fn create_actor(_: RStr<'_>) -> RResult<ActorBox, FfiError> {
        unreachable!()
    }
    extern "C" fn create_critic(_: RStr<'_>) -> RResult<CriticBox, FfiError> {
        unreachable!()
    }
    extern "C" fn validate(_: RStr<'_>) -> RResult<ROption<RString>, FfiError> {
        unreachable!()
    }
    extern "C" fn create_reward_model(_: RStr<'_>) -> RResult<RewardBox, FfiError> {
        unreachable!()
    }

    #[test]
    fn a_plugin_built_before_validate_passes_the_prefix_check_and_has_no_validate() {
        // abi_stable refuses a plugin with fewer prefix-type fields than the host expects ...
        assert!(check_layout_compatibility(
            <BackendModuleRef as StableAbi>::LAYOUT,
            <v1::BackendModuleRef as StableAbi>::LAYOUT,
        )
        .is_err());
        // ... so the loader checks it against the frozen prefix, which it passes (as does a
        // current plugin: an interface may have fewer fields than the implementation).
        check_layout_compatibility(
            <v1::BackendModuleRef as StableAbi>::LAYOUT,
            <v1::BackendModuleRef as StableAbi>::LAYOUT,
        )
        .unwrap();
        check_layout_compatibility(
            <v1::BackendModuleRef as StableAbi>::LAYOUT,
            <BackendModuleRef as StableAbi>::LAYOUT,
        )
        .unwrap();
        let old = v1::BackendModule {
            header,
            set_host,
            create_actor,
            create_reference: create_actor,
            create_critic,
        }
        .leak_into_prefix();
        let seen = v1::as_current(old).expect("an old plugin is usable");
        assert!(seen.validate().is_none());
        let init = crate::contract::InitArgs::new(crate::Role::Actor, serde_json::json!({}));
        assert!(crate::client::validate_layout(seen, "old", &init).is_none());

        // A current plugin seen through the old prefix is not taken for an old one.
        let new = BackendModule {
            header,
            set_host,
            create_actor,
            create_reference: create_actor,
            create_critic,
            validate,
            create_reward_model,
            generate_turns,
        }
        .leak_into_prefix();
        let through_v1: v1::BackendModuleRef = unsafe { std::mem::transmute(new) };
        assert!(v1::as_current(through_v1).is_none());
    }

    #[test]
    fn a_plugin_built_before_create_reward_model_passes_the_v2_prefix_and_has_no_reward_model() {
        assert!(check_layout_compatibility(
            <BackendModuleRef as StableAbi>::LAYOUT,
            <v2::BackendModuleRef as StableAbi>::LAYOUT,
        )
        .is_err());
        check_layout_compatibility(
            <v2::BackendModuleRef as StableAbi>::LAYOUT,
            <BackendModuleRef as StableAbi>::LAYOUT,
        )
        .unwrap();
        let old = v2::BackendModule {
            header,
            set_host,
            create_actor,
            create_reference: create_actor,
            create_critic,
            validate,
        }
        .leak_into_prefix();
        let seen = v2::as_current(old).expect("a v2 plugin is usable");
        assert!(seen.validate().is_some());
        assert!(seen.create_reward_model().is_none());
    }

    extern "C" fn generate_turns(
        _: &mut ActorBox,
        _: &Batch,
        _: RStr<'_>,
        _: crate::turns::TurnDriverRef<'_>,
    ) -> RResult<Batch, FfiError> {
        unreachable!()
    }

    #[test]
    fn a_plugin_built_before_generate_turns_passes_the_v3_prefix_and_has_none() {
        assert!(check_layout_compatibility(
            <BackendModuleRef as StableAbi>::LAYOUT,
            <v3::BackendModuleRef as StableAbi>::LAYOUT,
        )
        .is_err());
        check_layout_compatibility(
            <v3::BackendModuleRef as StableAbi>::LAYOUT,
            <BackendModuleRef as StableAbi>::LAYOUT,
        )
        .unwrap();
        let old = v3::BackendModule {
            header,
            set_host,
            create_actor,
            create_reference: create_actor,
            create_critic,
            validate,
            create_reward_model,
        }
        .leak_into_prefix();
        let seen = v3::as_current(old).expect("a v3 plugin is usable");
        assert!(seen.create_reward_model().is_some());
        assert!(seen.generate_turns().is_none());
        // A current plugin seen through the v3 prefix is not taken for an old one.
        let new = BackendModule {
            header,
            set_host,
            create_actor,
            create_reference: create_actor,
            create_critic,
            validate,
            create_reward_model,
            generate_turns,
        }
        .leak_into_prefix();
        let through_v3: v3::BackendModuleRef = unsafe { std::mem::transmute(new) };
        assert!(v3::as_current(through_v3).is_none());
    }

    extern "C" fn create_reward(_: RStr<'_>) -> RResult<RewardBox, FfiError> {
        unreachable!()
    }
    extern "C" fn create_reward_with_services(
        _: RStr<'_>,
        _: ModelServicesBox,
    ) -> RResult<RewardBox, FfiError> {
        unreachable!()
    }

    #[test]
    fn a_reward_plugin_built_before_model_services_passes_its_prefix_and_has_none() {
        assert!(check_layout_compatibility(
            <RewardModuleRef as StableAbi>::LAYOUT,
            <reward_v1::RewardModuleRef as StableAbi>::LAYOUT,
        )
        .is_err());
        let old = reward_v1::RewardModule {
            header,
            set_host,
            create_reward,
        }
        .leak_into_prefix();
        let seen = reward_v1::as_current(old).expect("an old reward plugin is usable");
        assert!(seen.create_reward_with_services().is_none());
        let new = RewardModule {
            header,
            set_host,
            create_reward,
            create_reward_with_services,
        }
        .leak_into_prefix();
        let through_v1: reward_v1::RewardModuleRef = unsafe { std::mem::transmute(new) };
        assert!(reward_v1::as_current(through_v1).is_none());
    }
}
