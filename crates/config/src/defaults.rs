//! verl's config schema and defaults (`defaults.yaml`), parsed once.

use std::sync::OnceLock;

use serde_yaml::Value;

use crate::tree::strip_markers;

const DEFAULTS_YAML: &str = include_str!("defaults.yaml");

/// The schema and defaults, unresolved (interpolations still in place).
pub fn defaults_tree() -> &'static Value {
    static TREE: OnceLock<Value> = OnceLock::new();
    TREE.get_or_init(|| {
        let mut v: Value =
            serde_yaml::from_str(DEFAULTS_YAML).expect("defaults.yaml is valid YAML (tested)");
        strip_markers(&mut v, true);
        v
    })
}
