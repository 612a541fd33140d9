//! A backend plugin built against plugin-api 0.1.0, before the reward model role: it has an
//! upfront layout check and no roles.

use verl_plugin_api::{BackendPlugin, BuildInfo, InitArgs, PluginInfo, Result};

pub struct OldBackend;

impl BackendPlugin for OldBackend {
    fn info() -> PluginInfo {
        PluginInfo {
            name: "old_api_backend".into(),
            version: "0.1.0".into(),
            description: "no roles (built against plugin-api 0.1.0)".into(),
            capabilities: vec![],
            build: BuildInfo::plain(),
        }
    }
    fn validate(_: &InitArgs) -> Option<Result<String>> {
        Some(Ok("old backend: layout fits".into()))
    }
}

verl_plugin_api::export_backend_plugin!(OldBackend);
