//! verl-fsdp: the `fsdp` backend plugin (`libverl_fsdp.so`). The backend itself lives in
//! `verl-fsdp-core`, so other crates (the megatron backend reuses its batching, optimizer and
//! losses) can link it without a second copy of the plugin entry points; this crate only
//! re-exports it and exports [`FsdpPlugin`] through the stable ABI.

pub use verl_fsdp_core::*;

verl_plugin_api::export_backend_plugin!(FsdpPlugin);
