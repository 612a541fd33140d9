//! verl-fsdp: the `fsdp` backend plugin (`libverl_fsdp.so`). The backend itself lives in
//! `verl-fsdp-core`, so other crates (the megatron backend reuses its batching, optimizer and
//! losses) can link it without a second copy of the plugin entry points; this crate only
//! re-exports it and exports [`FsdpPlugin`] through the stable ABI.
//!
//! It provides no upfront layout check (`BackendPlugin::validate` stays absent): the only layout
//! keys of this backend (`ulysses_sequence_parallel_size` against the world size) are already
//! checked by the host's batch plan, and the backend itself does nothing more with them.

pub use verl_fsdp_core::*;

verl_plugin_api::export_backend_plugin!(FsdpPlugin);

#[cfg(test)]
mod tests {
    use super::*;
    use verl_plugin_api::{testing, InitArgs, Role};

    #[test]
    fn has_no_upfront_layout_check() {
        let init = InitArgs::new(Role::Actor, serde_json::json!({}));
        assert!(testing::validate::<FsdpPlugin>(&init).is_none());
    }
}
