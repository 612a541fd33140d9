//! Hydra-style command-line overrides: `a.b=v`, `+a.b=v`, `++a.b=v`, `~a.b`, and the value
//! grammar they share with `${oc.select:key,default}` defaults.

use serde_yaml::{Mapping, Number, Value};

use crate::error::{ConfigError, Result};
use crate::tree::{
    check_keys, get_path_mut, is_free_form, join, schema_lookup, set_path, split_key, suggest,
    Origins, SchemaNode,
};

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
            if let Some(message) = crate::surface::refusal_of_unknown(defaults, &self.key, index) {
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

/// Parses an override value: `null`, booleans, integers, floats (`1e-6`, `.5`, `inf`), quoted
/// strings, `[a, b]` lists, `{k: v}` maps, and anything else as a bare string (trimmed).
pub fn parse_value(text: &str) -> std::result::Result<Value, String> {
    let mut p = Parser {
        chars: text.chars().collect(),
        pos: 0,
    };
    p.skip_ws();
    if p.at_end() {
        return Ok(Value::String(String::new()));
    }
    let v = p.element(true)?;
    p.skip_ws();
    match p.peek() {
        None => Ok(v),
        Some(',') => Err(
            "a top-level `,` makes a Hydra sweep, which verl-rs does not run; write a list as `[a,b]`"
                .into(),
        ),
        Some(c) => Err(format!(
            "unexpected `{c}` at column {} of the value",
            p.pos + 1
        )),
    }
}

struct Parser {
    chars: Vec<char>,
    pos: usize,
}

impl Parser {
    fn peek(&self) -> Option<char> {
        self.chars.get(self.pos).copied()
    }

    fn at_end(&self) -> bool {
        self.pos >= self.chars.len()
    }

    fn skip_ws(&mut self) {
        while self.peek().is_some_and(char::is_whitespace) {
            self.pos += 1;
        }
    }

    fn element(&mut self, top: bool) -> std::result::Result<Value, String> {
        self.skip_ws();
        match self.peek() {
            Some('[') => self.list(),
            Some('{') => self.map(),
            Some(q @ ('\'' | '"')) => {
                let s = self.quoted(q)?;
                Ok(Value::String(s))
            }
            _ => {
                let raw = self.primitive(top, false)?;
                Ok(classify(&raw))
            }
        }
    }

    fn quoted(&mut self, q: char) -> std::result::Result<String, String> {
        let start = self.pos;
        self.pos += 1;
        let mut out = String::new();
        while let Some(c) = self.peek() {
            self.pos += 1;
            match c {
                '\\' => match self.peek() {
                    Some(n) if n == q || n == '\\' => {
                        out.push(n);
                        self.pos += 1;
                    }
                    _ => out.push('\\'),
                },
                c if c == q => return Ok(out),
                c => out.push(c),
            }
        }
        Err(format!(
            "unterminated {q}-quoted string starting at column {}",
            start + 1
        ))
    }

    /// A bare token: up to a `,`, `]` or `}` outside `${...}` (at the top level only `,` stops
    /// it, and only so the caller can report a sweep); a map key also stops at `:`. As in Hydra,
    /// a backslash makes the next special character (`\{`, `\}`, `\[`, `\]`, `\(`, `\)`, `\:`, `\=`,
    /// `\,`, `\ `, `\\`) literal.
    fn primitive(&mut self, top: bool, key: bool) -> std::result::Result<String, String> {
        let mut out = String::new();
        let mut depth = 0usize;
        while let Some(c) = self.peek() {
            if c == '\\' {
                if let Some(&n) = self.chars.get(self.pos + 1) {
                    if "{}[]():=, \t\\".contains(n) {
                        out.push(n);
                        self.pos += 2;
                        continue;
                    }
                }
            }
            if depth == 0 {
                if c == ',' || (!top && (c == ']' || c == '}')) {
                    break;
                }
                if key && c == ':' {
                    break;
                }
            }
            if c == '$' && self.chars.get(self.pos + 1) == Some(&'{') {
                depth += 1;
                out.push_str("${");
                self.pos += 2;
                continue;
            }
            if depth > 0 && c == '{' {
                depth += 1;
            }
            if depth > 0 && c == '}' {
                depth -= 1;
            }
            out.push(c);
            self.pos += 1;
        }
        if depth > 0 {
            return Err("unterminated `${` interpolation".into());
        }
        Ok(out.trim().to_string())
    }

    fn list(&mut self) -> std::result::Result<Value, String> {
        self.pos += 1;
        let mut items = Vec::new();
        self.skip_ws();
        if self.peek() == Some(']') {
            self.pos += 1;
            return Ok(Value::Sequence(items));
        }
        loop {
            items.push(self.element(false)?);
            self.skip_ws();
            match self.peek() {
                Some(',') => self.pos += 1,
                Some(']') => {
                    self.pos += 1;
                    return Ok(Value::Sequence(items));
                }
                Some(c) => return Err(format!("expected `,` or `]` in a list, found `{c}`")),
                None => return Err("unterminated list: missing `]`".into()),
            }
        }
    }

    fn map(&mut self) -> std::result::Result<Value, String> {
        self.pos += 1;
        let mut map = Mapping::new();
        self.skip_ws();
        if self.peek() == Some('}') {
            self.pos += 1;
            return Ok(Value::Mapping(map));
        }
        loop {
            self.skip_ws();
            let key = match self.peek() {
                Some(q @ ('\'' | '"')) => self.quoted(q)?,
                _ => self.primitive(false, true)?,
            };
            if key.is_empty() {
                return Err("a map entry has an empty key".into());
            }
            self.skip_ws();
            if self.peek() != Some(':') {
                return Err(format!("expected `:` after map key `{key}`"));
            }
            self.pos += 1;
            let value = self.element(false)?;
            map.insert(Value::String(key), value);
            self.skip_ws();
            match self.peek() {
                Some(',') => self.pos += 1,
                Some('}') => {
                    self.pos += 1;
                    return Ok(Value::Mapping(map));
                }
                Some(c) => return Err(format!("expected `,` or `}}` in a map, found `{c}`")),
                None => return Err("unterminated map: missing `}`".into()),
            }
        }
    }
}

/// Types a bare token the way Hydra does.
fn classify(raw: &str) -> Value {
    let lower = raw.to_ascii_lowercase();
    match lower.as_str() {
        "null" | "~" => return Value::Null,
        "true" => return Value::Bool(true),
        "false" => return Value::Bool(false),
        "inf" | "+inf" => return Value::Number(Number::from(f64::INFINITY)),
        "-inf" => return Value::Number(Number::from(f64::NEG_INFINITY)),
        "nan" => return Value::Number(Number::from(f64::NAN)),
        _ => {}
    }
    let digits: String = raw.chars().filter(|c| *c != '_').collect();
    let body = digits.trim_start_matches(['+', '-']);
    let numeric = !body.is_empty()
        && body.starts_with(|c: char| c.is_ascii_digit() || c == '.')
        && body
            .chars()
            .all(|c| c.is_ascii_digit() || matches!(c, '.' | 'e' | 'E' | '+' | '-'));
    if numeric {
        if body.chars().all(|c| c.is_ascii_digit()) {
            if let Ok(i) = digits.parse::<i64>() {
                return Value::Number(Number::from(i));
            }
            if let Ok(u) = digits.parse::<u64>() {
                return Value::Number(Number::from(u));
            }
        }
        if let Ok(f) = digits.parse::<f64>() {
            return Value::Number(Number::from(f));
        }
    }
    Value::String(raw.to_string())
}
