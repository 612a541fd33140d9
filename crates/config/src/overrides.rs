//! Hydra-style command-line overrides: `a.b=v`, `+a.b=v`, `++a.b=v`, `~a.b`, and the value
//! grammar they share with `${oc.select:key,default}` defaults.

use serde_yaml::Value;

use crate::error::{ConfigError, Result};
use crate::keys::{check_keys, refusal_of_unknown};
use crate::tree::{
    get_path_mut, is_free_form, join, schema_lookup, set_path, split_key, suggest, Origins,
    SchemaNode,
};
use crate::value::parse_value;

/// What an override does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OverrideKind {
    /// `a.b=v`: set an existing key.
    Set,
    /// `+a.b=v`: add a key inside a free-form map (also accepted for an existing key).
    Add,
    /// `++a.b=v`: set or add.
    ForceAdd,
    /// `~a.b`: delete; a schema key returns to its default, a free-form key is removed.
    Delete,
}

/// One parsed override.
#[derive(Debug, Clone, PartialEq)]
pub struct Override {
    pub kind: OverrideKind,
    /// The dotted key, split.
    pub key: Vec<String>,
    /// The parsed value (`None` for a delete).
    pub value: Option<Value>,
    /// The override as the user wrote it, for messages.
    pub text: String,
}

impl Override {
    /// Parses `key=value`, `+key=value`, `++key=value` or `~key[=value]`.
    pub fn parse(text: &str) -> Result<Override> {
        let err = |reason: &str| ConfigError::OverrideSyntax {
            text: text.to_string(),
            reason: reason.to_string(),
        };
        let trimmed = text.trim();
        let (kind, rest) = if let Some(r) = trimmed.strip_prefix("++") {
            (OverrideKind::ForceAdd, r)
        } else if let Some(r) = trimmed.strip_prefix('+') {
            (OverrideKind::Add, r)
        } else if let Some(r) = trimmed.strip_prefix('~') {
            (OverrideKind::Delete, r)
        } else {
            (OverrideKind::Set, trimmed)
        };
        let (key, value) = match rest.split_once('=') {
            Some((k, v)) => (k.trim(), Some(v)),
            None if kind == OverrideKind::Delete => (rest.trim(), None),
            None => return Err(err("expected `key=value` (or `~key` to delete)")),
        };
        if key.is_empty() {
            return Err(err("the key is empty"));
        }
        if let Some(bad) = key
            .chars()
            .find(|c| !(c.is_alphanumeric() || matches!(c, '_' | '-' | '.' | '/' | '@')))
        {
            return Err(err(&format!("the key contains `{bad}`")));
        }
        let segments = split_key(key);
        if segments.iter().any(String::is_empty) {
            return Err(err(
                "the key has an empty segment (`..` or a leading/trailing `.`)",
            ));
        }
        let value = match (kind, value) {
            // Hydra's `~key=value` deletes only if the value matches; the value is only a guard.
            (OverrideKind::Delete, _) => None,
            (_, Some(v)) => Some(parse_value(v).map_err(|r| err(&r))?),
            (_, None) => unreachable!("non-delete overrides always have `=`"),
        };
        Ok(Override {
            kind,
            key: segments,
            value,
            text: text.to_string(),
        })
    }

    /// Applies the override to a merged (unresolved) tree, checking the key against the schema.
    pub(crate) fn apply(
        &self,
        tree: &mut Value,
        defaults: &Value,
        origins: &mut Origins,
    ) -> Result<()> {
        let origin = format!("override `{}`", self.text);
        let node = schema_lookup(defaults, &self.key);
        if let SchemaNode::Unknown { index } = node {
            let key = join(&self.key);
            if let Some(message) = refusal_of_unknown(defaults, &self.key, index) {
                return Err(ConfigError::Refused {
                    key,
                    origin,
                    message,
                });
            }
            let suggestion = suggest(defaults, &self.key, index);
            return Err(match self.kind {
                OverrideKind::Add | OverrideKind::ForceAdd => ConfigError::OverrideAddNotAllowed {
                    text: self.text.clone(),
                    key,
                    suggestion,
                },
                _ => ConfigError::OverrideMissingKey {
                    text: self.text.clone(),
                    key,
                    suggestion,
                },
            });
        }
        origins.record(&self.key, &origin);
        match (self.kind, node) {
            (OverrideKind::Delete, SchemaNode::Known(default)) => {
                set_path(tree, &self.key, default.clone());
            }
            (OverrideKind::Delete, _) => {
                let (leaf, parent) = self.key.split_last().expect("keys are non-empty");
                let removed = get_path_mut(tree, parent)
                    .and_then(Value::as_mapping_mut)
                    .and_then(|m| m.remove(leaf.as_str()));
                if removed.is_none() {
                    return Err(ConfigError::OverrideMissingKey {
                        text: self.text.clone(),
                        key: join(&self.key),
                        suggestion: None,
                    });
                }
            }
            (_, SchemaNode::Known(default)) => {
                let value = self.value.clone().unwrap_or(Value::Null);
                let leaf = self.key.last().expect("keys are non-empty");
                if default.is_mapping() && value.is_mapping() && !is_free_form(leaf) {
                    // A structured section given as `{k: v}`: its keys are schema keys too.
                    let mut errors = Vec::new();
                    let mut prefix = self.key.clone();
                    check_keys(&value, defaults, &mut prefix, &origin, origins, &mut errors);
                    ConfigError::from_list(errors)?;
                    let slot = get_path_mut(tree, &self.key);
                    match slot {
                        Some(slot) if slot.is_mapping() => crate::tree::merge(slot, value),
                        _ => set_path(tree, &self.key, value),
                    }
                } else {
                    set_path(tree, &self.key, value);
                }
            }
            (_, _) => {
                set_path(tree, &self.key, self.value.clone().unwrap_or(Value::Null));
            }
        }
        Ok(())
    }
}
