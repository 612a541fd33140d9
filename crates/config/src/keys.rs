//! A user's keys against the schema and the rules: the rule for a key, and why a key the schema
//! lacks is unknown (with a suggestion) or refused (it asks for something verl-rs does not do).

use serde_yaml::Value;

use crate::aliases::canonical;
use crate::error::ConfigError;
use crate::rule::{Class, Rule};
use crate::rules::RULES;
use crate::tree::{
    describe, is_free_form, join, key_str, schema_lookup, sibling_suggestion, suggest, Origins,
    SchemaNode,
};

/// The rule for a key (older names use the rule of verl 0.10's name).
pub fn rule_for(key: &str) -> Option<&'static Rule> {
    let canon = canonical(key);
    let key = canon.as_deref().unwrap_or(key);
    let segs: Vec<&str> = key.split('.').collect();
    RULES
        .iter()
        .filter_map(|r| r.match_specificity(&segs).map(|s| (s, r)))
        .max_by_key(|(s, _)| *s)
        .map(|(_, r)| r)
}

/// verl's other training engines: their sections (`actor_rollout_ref.actor.veomni.*`, ...) are
/// not in verl-rs's schema, and setting them asks for an engine verl-rs does not have.
pub const OTHER_ENGINES: &[(&str, &str)] = &[
    ("veomni", "VeOmni"),
    ("torchtitan", "TorchTitan"),
    ("automodel", "NeMo AutoModel"),
];

/// Why a key the schema does not have is refused rather than reported unknown: it configures
/// one of verl's engines verl-rs does not have ([`OTHER_ENGINES`]), or it lies in a section
/// verl-rs refuses as a whole (`distillation.**`: verl's named teacher models are keys of their
/// own). A near spelling of a sibling stays an unknown key with its suggestion.
pub(crate) fn refusal_of_unknown(
    defaults: &Value,
    path: &[String],
    index: usize,
) -> Option<String> {
    let key = join(path);
    if let Some((_, name)) = OTHER_ENGINES.iter().find(|(seg, _)| path[index] == *seg) {
        return Some(format!(
            "`{key}` configures verl's {name} engine, which verl-rs does not have; verl-rs trains with FSDP (model_engine=dp, settings in `*.fsdp_config`) or Megatron (model_engine=megatron, settings in `*.megatron`)"
        ));
    }
    if sibling_suggestion(defaults, path, index).is_some() {
        return None;
    }
    let rule = rule_for(&key)?;
    let section = rule.pattern.strip_suffix(".**")?;
    let whole_section = rule.class == Class::Refused
        && !section.contains('*')
        && !section.contains('|')
        && key.starts_with(&format!("{section}."));
    whole_section.then(|| {
        format!(
            "`{key}` belongs to {}, which verl-rs does not do; {}",
            rule.what, rule.instead
        )
    })
}

/// Checks every key of a user tree rooted at `prefix` against the schema; records origins.
pub(crate) fn check_keys(
    user: &Value,
    defaults: &Value,
    prefix: &mut Vec<String>,
    origin: &str,
    origins: &mut Origins,
    errors: &mut Vec<ConfigError>,
) {
    let Some(map) = user.as_mapping() else { return };
    for (k, v) in map {
        let Value::String(name) = k else {
            prefix.push(key_str(k));
            errors.push(ConfigError::TypeMismatch {
                key: join(prefix),
                expected: "a string key".into(),
                found: describe(k),
                origin: origin.into(),
            });
            prefix.pop();
            continue;
        };
        prefix.push(name.clone());
        origins.record(prefix, origin);
        match schema_lookup(defaults, prefix) {
            SchemaNode::Unknown { index } => {
                errors.push(match refusal_of_unknown(defaults, prefix, index) {
                    Some(message) => ConfigError::Refused {
                        key: join(prefix),
                        origin: origin.into(),
                        message,
                    },
                    None => ConfigError::UnknownKey {
                        key: join(prefix),
                        origin: origin.into(),
                        suggestion: suggest(defaults, prefix, index),
                    },
                })
            }
            SchemaNode::FreeForm => {}
            SchemaNode::Known(d) => {
                if d.is_mapping() && !is_free_form(name) {
                    check_keys(v, defaults, prefix, origin, origins, errors);
                }
            }
        }
        prefix.pop();
    }
}
