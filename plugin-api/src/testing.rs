//! Test support for plugin authors: run a plugin in-process, through the same ABI adapters and
//! the same contract checks the host uses, without building or loading a shared library.
//!
//! ```ignore
//! let mut actor = verl_plugin_api::testing::actor::<MyPlugin>(&InitArgs::new(Role::Actor, cfg))?;
//! let out = actor.generate(&testing::prompts(&[&[1, 2, 3]], 0), &GenerateOptions::default())?;
//! ```

use abi_stable::std_types::RStr;

use crate::batch::Batch;
use crate::client::{ActorClient, CriticClient, RewardClient, RewardModelClient, ToolClient};
use crate::contract::{col, InitArgs, ToolInit};
use crate::error::{Error, Result};
use crate::header::{api_compatible, PluginHeader, API_VERSION};
use crate::sdk::{
    backend_module, reward_module, tool_module, BackendPlugin, RewardPlugin, ToolPlugin,
};
use crate::services::{services_box, ModelProvider};

fn init_json(init: &InitArgs) -> String {
    serde_json::to_string(init).expect("init args serialise")
}

/// The plugin's header as the host would read it, checked for compatibility.
pub fn backend_header<P: BackendPlugin>() -> Result<PluginHeader> {
    let m = backend_module::<P>();
    check_header((m.header())().as_str())
}

/// The reward plugin's header as the host would read it, checked for compatibility.
pub fn reward_header<P: RewardPlugin>() -> Result<PluginHeader> {
    let m = reward_module::<P>();
    check_header((m.header())().as_str())
}

/// The tool plugin's header as the host would read it, checked for compatibility.
pub fn tool_header<P: ToolPlugin>() -> Result<PluginHeader> {
    let m = tool_module::<P>();
    check_header((m.header())().as_str())
}

/// Create one tool of the plugin through the ABI adapter, from a tool config entry.
pub fn tool<P: ToolPlugin>(init: &ToolInit) -> Result<ToolClient> {
    let m = tool_module::<P>();
    let name = P::info().name;
    let json = serde_json::to_string(init).expect("tool init serialises");
    let obj = (m.create_tool())(RStr::from_str(&json))
        .into_result()
        .map_err(|e| Error::from_ffi(e, &name, "create_tool"))?;
    ToolClient::new(obj, name)
}

fn check_header(json: &str) -> Result<PluginHeader> {
    let h = PluginHeader::parse(json).map_err(Error::failed)?;
    api_compatible(&h.api_version, API_VERSION).map_err(Error::failed)?;
    Ok(h)
}

/// The plugin's upfront layout check through the ABI adapter (`None`: it has none).
pub fn validate<P: BackendPlugin>(init: &InitArgs) -> Option<Result<String>> {
    crate::client::validate_layout(backend_module::<P>(), &P::info().name, init)
}

/// Create the plugin's actor through the ABI adapter.
pub fn actor<P: BackendPlugin>(init: &InitArgs) -> Result<ActorClient> {
    let m = backend_module::<P>();
    let name = P::info().name;
    let obj = (m.create_actor())(RStr::from_str(&init_json(init)))
        .into_result()
        .map_err(|e| Error::from_ffi(e, &name, "create_actor"))?;
    Ok(ActorClient::of_module(obj, m, name, "actor"))
}

/// Create the plugin's reference policy through the ABI adapter.
pub fn reference<P: BackendPlugin>(init: &InitArgs) -> Result<ActorClient> {
    let m = backend_module::<P>();
    let name = P::info().name;
    let obj = (m.create_reference())(RStr::from_str(&init_json(init)))
        .into_result()
        .map_err(|e| Error::from_ffi(e, &name, "create_reference"))?;
    Ok(ActorClient::of_module(obj, m, name, "reference"))
}

/// Create the plugin's critic through the ABI adapter.
pub fn critic<P: BackendPlugin>(init: &InitArgs) -> Result<CriticClient> {
    let m = backend_module::<P>();
    let name = P::info().name;
    let obj = (m.create_critic())(RStr::from_str(&init_json(init)))
        .into_result()
        .map_err(|e| Error::from_ffi(e, &name, "create_critic"))?;
    Ok(CriticClient::new(obj, name))
}

/// Create the plugin's reward model role through the ABI adapter.
pub fn reward_model<P: BackendPlugin>(init: &InitArgs) -> Result<RewardModelClient> {
    let m = backend_module::<P>();
    let name = P::info().name;
    let create = m
        .create_reward_model()
        .ok_or_else(|| Error::not_implemented("the reward_model role"))?;
    let obj = create(RStr::from_str(&init_json(init)))
        .into_result()
        .map_err(|e| Error::from_ffi(e, &name, "create_reward_model"))?;
    Ok(RewardModelClient::new(obj, name))
}

/// Create the reward plugin's scorer through the ABI adapter, lending it `models`.
pub fn reward_with<P: RewardPlugin>(
    init: &InitArgs,
    models: impl ModelProvider,
) -> Result<RewardClient> {
    let m = reward_module::<P>();
    let name = P::info().name;
    let create = m
        .create_reward_with_services()
        .ok_or_else(|| Error::not_implemented("create_reward_with_services"))?;
    let obj = create(RStr::from_str(&init_json(init)), services_box(models))
        .into_result()
        .map_err(|e| Error::from_ffi(e, &name, "create_reward"))?;
    Ok(RewardClient::new(obj, name))
}

/// Create the reward plugin's scorer through the ABI adapter.
pub fn reward<P: RewardPlugin>(init: &InitArgs) -> Result<RewardClient> {
    let m = reward_module::<P>();
    let name = P::info().name;
    let obj = (m.create_reward())(RStr::from_str(&init_json(init)))
        .into_result()
        .map_err(|e| Error::from_ffi(e, &name, "create_reward"))?;
    Ok(RewardClient::new(obj, name))
}

/// A prompt batch from token id rows of different lengths, left-padded with `pad`.
pub fn prompts(rows: &[&[i64]], pad: i64) -> Batch {
    crate::contract::prompt_batch(rows, pad)
}

/// A reward-input batch from (data_source, response text, ground truth) triples.
pub fn reward_batch(rows: &[(&str, &str, &str)]) -> Batch {
    let mut b = Batch::new();
    let n = rows.len();
    b.insert_strings(col::PROMPT_TEXT, &vec![""; n]);
    b.insert_strings(
        col::RESPONSE_TEXT,
        &rows.iter().map(|r| r.1).collect::<Vec<_>>(),
    );
    b.insert_strings(
        col::DATA_SOURCE,
        &rows.iter().map(|r| r.0).collect::<Vec<_>>(),
    );
    b.insert_json(
        col::GROUND_TRUTH,
        &rows
            .iter()
            .map(|r| serde_json::Value::String(r.2.to_string()))
            .collect::<Vec<_>>(),
    );
    b.insert_json(col::EXTRA_INFO, &vec![serde_json::Value::Null; n]);
    b
}
