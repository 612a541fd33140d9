//! The `fsdp` backend plugin: exports the FSDP engine (`verl-fsdp-engine`) through the plugin ABI.

pub use verl_fsdp_engine::*;

verl_plugin_api::export_backend_plugin!(FsdpPlugin);
