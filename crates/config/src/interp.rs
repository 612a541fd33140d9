//! OmegaConf-style interpolation, as verl's own YAML uses it: `${a.b.c}` (absolute),
//! `${.x}` / `${..x}` (relative to the mapping holding the value), `${oc.select:key,default}`
//! (default when the key is absent) and `${oc.env:VAR,default}`. A value that is exactly one
//! interpolation takes the referenced node as is (any type); interpolations inside a longer
//! string are rendered as text.

use std::borrow::Cow;

use serde_yaml::{Mapping, Value};

use crate::error::{ConfigError, Result};
use crate::tree::{join, key_str, split_key, suggest};
use crate::value::parse_value;

/// Resolves every interpolation in `root`, returning a tree without any.
pub(crate) fn resolve_tree(root: &Value, schema: &Value) -> Result<Value> {
    let mut r = Resolver {
        root,
        schema,
        stack: Vec::new(),
    };
    r.resolve_node(&[], root)
}

/// Resolves one value as if it stood at `path` of `root` (e.g. a key's default interpolation,
/// evaluated against the user's tree).
pub(crate) fn resolve_at(
    root: &Value,
    schema: &Value,
    path: &[String],
    node: &Value,
) -> Result<Value> {
    let mut r = Resolver {
        root,
        schema,
        stack: Vec::new(),
    };
    r.resolve_node(path, node)
}

struct Resolver<'a> {
    root: &'a Value,
    schema: &'a Value,
    /// Keys being resolved, innermost last: a key met again is a cycle.
    stack: Vec<String>,
}

enum Piece {
    Text(String),
    Interp(String),
}

impl Resolver<'_> {
    fn resolve_node(&mut self, path: &[String], node: &Value) -> Result<Value> {
        match node {
            Value::String(s) if s.contains("${") => self.resolve_string(path, s),
            Value::Mapping(m) => {
                let mut out = Mapping::with_capacity(m.len());
                for (k, v) in m {
                    let mut p = path.to_vec();
                    p.push(key_str(k));
                    out.insert(k.clone(), self.resolve_node(&p, v)?);
                }
                Ok(Value::Mapping(out))
            }
            Value::Sequence(seq) => {
                let mut out = Vec::with_capacity(seq.len());
                for (i, v) in seq.iter().enumerate() {
                    let mut p = path.to_vec();
                    p.push(i.to_string());
                    out.push(self.resolve_node(&p, v)?);
                }
                Ok(Value::Sequence(out))
            }
            other => Ok(other.clone()),
        }
    }

    fn resolve_string(&mut self, path: &[String], s: &str) -> Result<Value> {
        let key = join(path);
        if let Some(pos) = self.stack.iter().position(|k| *k == key) {
            let mut chain: Vec<String> = self.stack[pos..].to_vec();
            chain.push(key.clone());
            return Err(ConfigError::InterpolationCycle {
                key,
                chain: chain.join(" -> "),
            });
        }
        let pieces = split_pieces(s).map_err(|reason| ConfigError::InterpolationInvalid {
            key: key.clone(),
            expr: s.to_string(),
            reason,
        })?;
        self.stack.push(key.clone());
        let result = (|| {
            if let [Piece::Interp(expr)] = pieces.as_slice() {
                return self.eval(path, expr);
            }
            let mut out = String::new();
            for piece in &pieces {
                match piece {
                    Piece::Text(t) => out.push_str(t),
                    Piece::Interp(expr) => {
                        let v = self.eval(path, expr)?;
                        out.push_str(&render_scalar(&v).ok_or_else(|| {
                            ConfigError::InterpolationInvalid {
                                key: key.clone(),
                                expr: format!("${{{expr}}}"),
                                reason: "it is a mapping or list and cannot be part of a string"
                                    .into(),
                            }
                        })?);
                    }
                }
            }
            Ok(Value::String(out))
        })();
        self.stack.pop();
        result
    }

    fn eval(&mut self, path: &[String], expr: &str) -> Result<Value> {
        let key = join(path);
        let expr = expr.trim();
        let invalid = |reason: String| ConfigError::InterpolationInvalid {
            key: key.clone(),
            expr: format!("${{{expr}}}"),
            reason,
        };
        if let Some(args) = expr.strip_prefix("oc.select:") {
            let (target, default) = split_default(args);
            return match self.lookup(path, target.trim())? {
                Some(v) => Ok(v),
                None => match default {
                    Some(d) => {
                        let v = parse_value(d).map_err(&invalid)?;
                        self.resolve_node(path, &v)
                    }
                    None => Ok(Value::Null),
                },
            };
        }
        if let Some(args) = expr.strip_prefix("oc.env:") {
            let (var, default) = split_default(args);
            return match std::env::var(var.trim()) {
                Ok(v) => Ok(Value::String(v)),
                Err(_) => match default {
                    Some(d) => parse_value(d).map_err(&invalid),
                    None => Err(invalid(format!(
                        "environment variable `{}` is not set and no default is given",
                        var.trim()
                    ))),
                },
            };
        }
        if let Some((resolver, _)) = expr.split_once(':') {
            return Err(invalid(format!(
                "unknown resolver `{resolver}` (supported: oc.select, oc.env)"
            )));
        }
        match self.lookup(path, expr)? {
            Some(v) => Ok(v),
            None => {
                let target = absolute(path, expr);
                let segs = split_key(&target);
                let suggestion = match crate::tree::schema_lookup(self.schema, &segs) {
                    crate::tree::SchemaNode::Unknown { index } => {
                        suggest(self.schema, &segs, index)
                    }
                    _ => None,
                };
                Err(ConfigError::InterpolationMissing {
                    key,
                    expr: format!("${{{expr}}}"),
                    target,
                    suggestion,
                })
            }
        }
    }

    /// The fully resolved value at `target` (absolute or relative to `path`), or `None` when
    /// no such key exists. Interpolations met on the way are resolved first.
    fn lookup(&mut self, path: &[String], target: &str) -> Result<Option<Value>> {
        let abs = split_key(&absolute(path, target));
        // Borrow from the tree until an interpolation has to be resolved on the way.
        let mut cur: Cow<'_, Value> = Cow::Borrowed(self.root);
        let mut cur_path: Vec<String> = Vec::new();
        for seg in &abs {
            let next = match cur {
                Cow::Borrowed(v) => child(v, seg).map(Cow::Borrowed),
                Cow::Owned(ref v) => child(v, seg).cloned().map(Cow::Owned),
            };
            let Some(next) = next else { return Ok(None) };
            cur_path.push(seg.clone());
            cur = match next.as_ref() {
                Value::String(s) if s.contains("${") => {
                    Cow::Owned(self.resolve_string(&cur_path, &s.clone())?)
                }
                _ => next,
            };
        }
        Ok(Some(self.resolve_node(&cur_path, &cur)?))
    }
}

fn child<'v>(v: &'v Value, seg: &str) -> Option<&'v Value> {
    match v {
        Value::Mapping(m) => m.get(seg),
        Value::Sequence(s) => seg.parse::<usize>().ok().and_then(|i| s.get(i)),
        _ => None,
    }
}

/// Turns a relative reference (`.x`, `..x`) into an absolute dotted key. The base of `.x` is
/// the mapping that holds the value at `path`; each further dot goes one level up.
fn absolute(path: &[String], target: &str) -> String {
    let dots = target.chars().take_while(|c| *c == '.').count();
    if dots == 0 {
        return target.to_string();
    }
    let parent_len = path.len().saturating_sub(1);
    let base_len = parent_len.saturating_sub(dots - 1);
    let mut segs: Vec<String> = path[..base_len].to_vec();
    let rest = &target[dots..];
    if !rest.is_empty() {
        segs.extend(split_key(rest));
    }
    join(&segs)
}

/// Splits `key,default` at the first comma outside brackets, braces and quotes.
fn split_default(args: &str) -> (&str, Option<&str>) {
    let mut depth = 0i32;
    let mut quote: Option<char> = None;
    for (i, c) in args.char_indices() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '\'' | '"') => quote = Some(c),
            (None, '[' | '{') => depth += 1,
            (None, ']' | '}') => depth -= 1,
            (None, ',') if depth == 0 => return (&args[..i], Some(&args[i + 1..])),
            _ => {}
        }
    }
    (args, None)
}

fn split_pieces(s: &str) -> std::result::Result<Vec<Piece>, String> {
    let chars: Vec<char> = s.chars().collect();
    let mut pieces = Vec::new();
    let mut text = String::new();
    let mut i = 0;
    while i < chars.len() {
        if chars[i] == '\\' && chars.get(i + 1) == Some(&'$') {
            text.push('$');
            i += 2;
            continue;
        }
        if chars[i] == '$' && chars.get(i + 1) == Some(&'{') {
            let start = i + 2;
            let mut depth = 1;
            let mut j = start;
            while j < chars.len() && depth > 0 {
                match chars[j] {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    _ => {}
                }
                j += 1;
            }
            if depth > 0 {
                return Err("missing the closing `}`".into());
            }
            if !text.is_empty() {
                pieces.push(Piece::Text(std::mem::take(&mut text)));
            }
            pieces.push(Piece::Interp(chars[start..j - 1].iter().collect()));
            i = j;
            continue;
        }
        text.push(chars[i]);
        i += 1;
    }
    if !text.is_empty() {
        pieces.push(Piece::Text(text));
    }
    Ok(pieces)
}

fn render_scalar(v: &Value) -> Option<String> {
    match v {
        Value::Null => Some("None".into()),
        Value::Bool(b) => Some(if *b { "True" } else { "False" }.into()),
        Value::Number(n) => Some(n.to_string()),
        Value::String(s) => Some(s.clone()),
        _ => None,
    }
}
