//! JSON helpers for test configs.

use serde_json::Value;

/// Merges `patch` into `base`: objects key by key (recursively), anything else replaced.
pub fn merge(base: &mut Value, patch: &Value) {
    match (base, patch) {
        (Value::Object(b), Value::Object(p)) => {
            for (k, v) in p {
                merge(b.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
        (b, p) => *b = p.clone(),
    }
}
