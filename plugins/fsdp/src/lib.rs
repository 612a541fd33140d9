//! verl-fsdp: the `fsdp` backend plugin (`libverl_fsdp.so`). The backend itself lives in
//! `verl-fsdp-core`, so other crates (the megatron backend reuses its batching, optimizer and
//! losses) can link it without a second copy of the plugin entry points; this crate only
//! re-exports it and exports [`FsdpPlugin`] through the stable ABI.
//!
//! Its upfront check ([`verl_fsdp_core::validate`]) reads each role's model config.json: an
//! architecture the model code does not build fails there, before any rank starts.

pub use verl_fsdp_core::*;

verl_plugin_api::export_backend_plugin!(FsdpPlugin);

#[cfg(test)]
mod tests {
    use super::*;
    use verl_plugin_api::{testing, InitArgs, Role};

    #[test]
    fn the_upfront_check_refuses_an_architecture_it_cannot_build() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 64}"#,
        )
        .unwrap();
        let path = dir.path().to_str().unwrap();
        let init = InitArgs::new(
            Role::Actor,
            serde_json::json!({"actor_rollout_ref": {"model": {"path": path}}}),
        );
        let e = testing::validate::<FsdpPlugin>(&init)
            .expect("the fsdp backend checks its models upfront")
            .unwrap_err()
            .to_string();
        assert!(e.contains("gpt_oss") && e.contains("config.json"), "{e}");
        // A missing folder names the key.
        let init = InitArgs::new(
            Role::Actor,
            serde_json::json!({"actor_rollout_ref": {"model": {"path": "/nonexistent/m"}}}),
        );
        let e = testing::validate::<FsdpPlugin>(&init)
            .unwrap()
            .unwrap_err()
            .to_string();
        assert!(e.contains("actor_rollout_ref.model.path"), "{e}");
    }
}
