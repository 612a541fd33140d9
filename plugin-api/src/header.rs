//! The plugin header: read by the host through one C symbol before anything else is touched
//! (like pgrx's module magic), so even an incompatible plugin can be described precisely.
//!
//! The header is JSON behind a `extern "C" fn verl_plugin_header() -> *const c_char`, so it can grow
//! without breaking older hosts; unknown fields are ignored, missing optional fields default.

use serde::{Deserialize, Serialize};

/// The exported symbol that returns the NUL-terminated JSON header.
pub const HEADER_SYMBOL: &str = "verl_plugin_header";
/// Value of the `magic` field.
pub const MAGIC: &str = "verl-plugin";
/// Layout version of the header JSON itself.
pub const HEADER_VERSION: u32 = 1;
/// The plugin-api version this crate is (plugins record the one they were built against).
pub const API_VERSION: &str = env!("CARGO_PKG_VERSION");

/// Which root module a plugin exports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PluginKind {
    Backend,
    Reward,
    /// Tools a model calls in multi-turn rollouts; the header's `tools` lists their class names.
    Tool,
}

impl std::fmt::Display for PluginKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PluginKind::Backend => "backend",
            PluginKind::Reward => "reward",
            PluginKind::Tool => "tool",
        })
    }
}

/// Roles a plugin can provide.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Actor,
    Reference,
    Critic,
    Reward,
    /// A backend's sequence-scoring model (verl's discriminative reward model).
    #[serde(rename = "reward_model")]
    RewardModel,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Actor => "actor",
            Role::Reference => "reference",
            Role::Critic => "critic",
            Role::Reward => "reward",
            Role::RewardModel => "reward_model",
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A role and whether it works yet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capability {
    pub role: Role,
    /// `false` for a role that is declared but answers "not implemented".
    #[serde(default = "yes")]
    pub implemented: bool,
    /// Free-form details ("CPU and CUDA", "generation not implemented yet", ...).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub note: String,
    /// Optional abilities of the role the host may ask for: [`FEATURE_LORA`] (an actor that
    /// trains LoRA adapters and answers `LogProbOptions::base_model`). A plugin built before a
    /// feature existed declares none, and the host refuses a job that needs one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub features: Vec<String>,
}

/// An actor that trains LoRA adapters (`actor_rollout_ref.model.lora_rank`) and computes the
/// base model's log-probs with them off; on a critic, one that trains adapters from
/// `critic.model.lora_rank`.
pub const FEATURE_LORA: &str = "lora";
/// An actor that runs multi-turn rollouts (`Actor.generate_turns`, [`crate::turns`]).
pub const FEATURE_MULTI_TURN: &str = "multi_turn";

fn yes() -> bool {
    true
}

impl Capability {
    pub fn ready(role: Role) -> Self {
        Capability {
            role,
            implemented: true,
            note: String::new(),
            features: Vec::new(),
        }
    }
    pub fn planned(role: Role, note: impl Into<String>) -> Self {
        Capability {
            role,
            implemented: false,
            note: note.into(),
            features: Vec::new(),
        }
    }
}

/// Facts about how the plugin was built.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildInfo {
    /// libtorch version the plugin was compiled against (`None` for plugins without libtorch).
    #[serde(default)]
    pub libtorch: Option<String>,
    /// `"cuda"`, `"cpu"` or `"none"` (no tensor library).
    #[serde(default = "none_device")]
    pub device: String,
    /// CUDA version of the libtorch build, when it has one.
    #[serde(default)]
    pub cuda: Option<String>,
    /// `debug` or `release`.
    #[serde(default)]
    pub profile: String,
    /// Target triple.
    #[serde(default)]
    pub target: String,
}

fn none_device() -> String {
    "none".into()
}

impl BuildInfo {
    /// Build facts for a plugin that does not link libtorch.
    pub fn plain() -> Self {
        BuildInfo {
            libtorch: None,
            device: "none".into(),
            cuda: None,
            profile: if cfg!(debug_assertions) {
                "debug".into()
            } else {
                "release".into()
            },
            target: format!("{}-{}", std::env::consts::ARCH, std::env::consts::OS),
        }
    }
}

/// What a plugin author describes about the plugin (the SDK adds the rest of the header).
#[derive(Debug, Clone)]
pub struct PluginInfo {
    pub name: String,
    pub version: String,
    pub description: String,
    pub capabilities: Vec<Capability>,
    pub build: BuildInfo,
}

/// The header as it is read by the host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PluginHeader {
    pub magic: String,
    pub header_version: u32,
    /// The plugin-api semver the plugin was built against.
    pub api_version: String,
    pub name: String,
    pub version: String,
    pub kind: PluginKind,
    #[serde(default)]
    pub description: String,
    #[serde(default)]
    pub capabilities: Vec<Capability>,
    #[serde(default)]
    pub build: BuildInfo,
    /// A tool plugin's tool classes: the `class_name`s of verl's tool config it serves.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<String>,
}

impl PluginHeader {
    pub fn from_info(info: PluginInfo, kind: PluginKind) -> Self {
        PluginHeader {
            magic: MAGIC.into(),
            header_version: HEADER_VERSION,
            api_version: API_VERSION.into(),
            name: info.name,
            version: info.version,
            kind,
            description: info.description,
            capabilities: info.capabilities,
            build: info.build,
            tools: Vec::new(),
        }
    }

    /// Whether this is a tool plugin serving `class_name`.
    pub fn provides_tool(&self, class_name: &str) -> bool {
        self.kind == PluginKind::Tool && self.tools.iter().any(|t| t == class_name)
    }

    /// Whether the plugin provides `role` (declared and implemented).
    pub fn provides(&self, role: Role) -> bool {
        self.capabilities
            .iter()
            .any(|c| c.role == role && c.implemented)
    }

    /// Whether the plugin's `role` declares `feature` (see [`Capability::features`]).
    pub fn supports(&self, role: Role, feature: &str) -> bool {
        self.capabilities
            .iter()
            .any(|c| c.role == role && c.implemented && c.features.iter().any(|f| f == feature))
    }

    /// Parse and sanity-check a header read from a library.
    pub fn parse(json: &str) -> Result<Self, String> {
        let value: serde_json::Value =
            serde_json::from_str(json).map_err(|e| format!("header is not JSON: {e}"))?;
        if value.get("magic").and_then(|m| m.as_str()) != Some(MAGIC) {
            return Err(format!("header lacks the `{MAGIC}` magic"));
        }
        serde_json::from_value(value).map_err(|e| format!("malformed header: {e}"))
    }
}

/// Semver compatibility of a plugin's plugin-api with this host's, the abi_stable way:
/// for 0.x the minor must match; from 1.0 the major must match. Patch levels never matter.
pub fn api_compatible(plugin_api: &str, host_api: &str) -> Result<(), String> {
    let parse = |v: &str| -> Option<(u64, u64, u64)> {
        let core = v.split(['-', '+']).next()?;
        let mut it = core.split('.').map(|p| p.parse::<u64>().ok());
        Some((it.next()??, it.next()??, it.next().flatten().unwrap_or(0)))
    };
    let p = parse(plugin_api)
        .ok_or_else(|| format!("unparseable plugin-api version `{plugin_api}`"))?;
    let h = parse(host_api)
        .ok_or_else(|| format!("unparseable host plugin-api version `{host_api}`"))?;
    let ok = if h.0 == 0 {
        p.0 == 0 && p.1 == h.1
    } else {
        p.0 == h.0
    };
    if ok {
        Ok(())
    } else {
        let want = if h.0 == 0 {
            format!("0.{}.x", h.1)
        } else {
            format!("{}.x", h.0)
        };
        Err(format!(
            "built against plugin-api {plugin_api}, this verl speaks plugin-api {host_api} (compatible: {want})"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn semver_rules() {
        assert!(api_compatible("0.1.0", "0.1.7").is_ok());
        assert!(api_compatible("0.2.0", "0.1.0").is_err());
        assert!(api_compatible("1.0.0", "0.1.0").is_err());
        assert!(api_compatible("1.4.0", "1.2.0").is_ok());
        assert!(api_compatible("2.0.0", "1.2.0").is_err());
        let msg = api_compatible("9.0.0", "0.1.0").unwrap_err();
        assert!(msg.contains("compatible: 0.1.x"), "{msg}");
    }

    #[test]
    fn header_round_trip_and_magic() {
        let info = PluginInfo {
            name: "x".into(),
            version: "1.0.0".into(),
            description: String::new(),
            capabilities: vec![
                Capability::ready(Role::Actor),
                Capability::planned(Role::Critic, "later"),
            ],
            build: BuildInfo::plain(),
        };
        let h = PluginHeader::from_info(info, PluginKind::Backend);
        let json = serde_json::to_string(&h).unwrap();
        let back = PluginHeader::parse(&json).unwrap();
        assert_eq!(back, h);
        assert!(back.provides(Role::Actor));
        assert!(!back.provides(Role::Critic));
        assert!(PluginHeader::parse(r#"{"name":"x"}"#)
            .unwrap_err()
            .contains("magic"));
    }

    #[test]
    fn a_tool_header_lists_its_classes_and_older_headers_list_none() {
        let info = PluginInfo {
            name: "tools".into(),
            version: "0.1.0".into(),
            description: String::new(),
            capabilities: vec![],
            build: BuildInfo::plain(),
        };
        let mut h = PluginHeader::from_info(info, PluginKind::Tool);
        h.tools = vec!["calculator".into()];
        let json = serde_json::to_string(&h).unwrap();
        assert!(json.contains(r#""kind":"tool""#), "{json}");
        let back = PluginHeader::parse(&json).unwrap();
        assert!(back.provides_tool("calculator"));
        assert!(!back.provides_tool("python"));
        // A header written before `tools` existed (a reward plugin) reads with none.
        let old = r#"{"magic":"verl-plugin","header_version":1,"api_version":"0.1.0","name":"r","version":"1","kind":"reward"}"#;
        let old = PluginHeader::parse(old).unwrap();
        assert!(old.tools.is_empty() && !old.provides_tool("calculator"));
    }
}
