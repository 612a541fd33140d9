//! verl-plugin-api: the stable ABI between the `verl` host and its plugins (abi_stable), and the
//! SDK plugin authors use. It owns the contracts — root modules, the Actor/Critic/Reward role
//! objects, the Tool object, the `Batch` carrier and its checks, the header — and must never
//! link libtorch.
//!
//! A plugin author implements [`sdk::BackendPlugin`] (+ [`sdk::Actor`], [`sdk::Critic`]),
//! [`sdk::RewardPlugin`] (+ [`sdk::Reward`]) or [`sdk::ToolPlugin`] (+ [`sdk::Tool`]) and calls
//! [`export_backend_plugin!`] / [`export_reward_plugin!`] / [`export_tool_plugin!`]; [`testing`]
//! runs it in-process for unit tests.
#![allow(non_local_definitions)]

pub mod batch;
pub mod client;
pub mod contract;
pub mod error;
pub mod ffi;
pub mod header;
mod log;
pub mod sdk;
pub mod services;
pub mod testing;
pub mod turns;

pub use batch::{Batch, Column, ColumnSpec, ColumnType, DType, Dim, Element, Tensor};
pub use contract::{
    col, GenerateOptions, InitArgs, LogProbOptions, Rendezvous, RewardModelSpec, ScoreOptions,
    ToolInit, ToolOutput, UpdateOptions, ValueOptions,
};
pub use error::{Error, ErrorKind, Result};
pub use ffi::DataParallel;
pub use header::{
    api_compatible, BuildInfo, Capability, PluginHeader, PluginInfo, PluginKind, Role, API_VERSION,
    FEATURE_LORA, FEATURE_MULTI_TURN,
};
pub use log::{current_max_level, forward_to_tracing};
pub use sdk::{
    Actor, BackendPlugin, Critic, Reward, RewardPlugin, RewardRow, RowReward, Tool, ToolPlugin,
};
pub use services::{ModelInfo, ModelKind, ModelProvider, ModelServices, TextGenerateOptions};

/// Metrics a call returns: (verl metric name, value), in order.
pub type Metrics = Vec<(String, f64)>;

#[doc(hidden)]
pub mod __private {
    pub use abi_stable;
}
