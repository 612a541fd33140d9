//! verl-tools: the built-in tools of multi-turn rollouts, exported as the `tools` tool plugin
//! (`libverl_tools.so`, found next to the `verl` binary): `calculator`, verl's GSM8K tool and a
//! sandboxed `python` runner.
//!
//! Each tool owns its semantics only (arguments in, text and step reward out); the host owns
//! the tool config, the call lifecycle, deadlines and truncation. It must never link libtorch.

pub mod calculator;
pub mod gsm8k;
mod plugin;
pub mod pyrepr;
pub mod python;

pub use plugin::BuiltinTools;

verl_plugin_api::export_tool_plugin!(plugin::BuiltinTools);
