//! The untyped config tree: schema look-ups against the defaults, unknown-key detection with
//! suggestions, and merging. The defaults tree *is* the schema (see `defaults.yaml`).

use std::collections::HashMap;
use std::sync::OnceLock;

use serde_yaml::{Mapping, Value};

/// Keys whose value is a free-form map handed to some engine or function as keyword arguments:
/// any key below them is accepted (and `+key=value` may add to them).
pub(crate) const FREE_FORM: &[&str] = &[
    "apply_chat_template_kwargs",
    "override_config",
    "override_optimizer_config",
    "wrap_policy",
    "mixed_precision",
    "override_transformer_config",
    "override_ddp_config",
    "override_mcore_model_config",
    "engine_kwargs",
    "reward_kwargs",
    "routes",
    "ray_init",
    "global_tool_config",
    "kw_args",
    "mm_processor_kwargs",
    "mbridge_config",
    "sampler_kwargs",
    "turbo_config",
];

/// Keys verl accepts either as one string or as a list of strings.
pub(crate) const STRING_OR_LIST: &[&str] = &[
    "train_files",
    "val_files",
    "logger",
    "target_modules",
    "exclude_modules",
];

/// Top-level keys of a Hydra job file that are about composition, not values. verl-rs composes
/// nothing: its defaults already are verl's composed `ppo_trainer` config.
pub(crate) const HYDRA_KEYS: &[&str] = &["defaults", "hydra"];

pub(crate) fn is_free_form(name: &str) -> bool {
    FREE_FORM.contains(&name)
}

pub(crate) fn join(path: &[String]) -> String {
    path.join(".")
}

pub(crate) fn is_interpolation(v: &Value) -> bool {
    matches!(v, Value::String(s) if s.contains("${"))
}

pub(crate) fn key_str(k: &Value) -> String {
    match k {
        Value::String(s) => s.clone(),
        other => serde_yaml::to_string(other)
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "?".into()),
    }
}

/// What the schema says about a dotted path.
#[derive(Debug)]
pub(crate) enum SchemaNode<'a> {
    /// The path is a schema key; its default value.
    Known(&'a Value),
    /// The path lies inside a free-form map (or below a default that is itself an
    /// interpolation, whose shape is only known after resolution).
    FreeForm,
    /// `path[index]` is not a key of the schema.
    Unknown { index: usize },
}

pub(crate) fn schema_lookup<'a>(defaults: &'a Value, path: &[String]) -> SchemaNode<'a> {
    let mut cur = defaults;
    for (i, seg) in path.iter().enumerate() {
        let Some(next) = cur.as_mapping().and_then(|m| m.get(seg.as_str())) else {
            return SchemaNode::Unknown { index: i };
        };
        let last = i + 1 == path.len();
        if !last && (is_free_form(seg) || is_interpolation(next)) {
            return SchemaNode::FreeForm;
        }
        cur = next;
    }
    SchemaNode::Known(cur)
}

/// Every dotted key of the schema (not descending into free-form maps), in schema order.
fn schema_paths(defaults: &Value) -> &'static [Vec<String>] {
    static PATHS: OnceLock<Vec<Vec<String>>> = OnceLock::new();
    PATHS.get_or_init(|| {
        fn walk(v: &Value, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
            if let Some(m) = v.as_mapping() {
                for (k, child) in m {
                    prefix.push(key_str(k));
                    out.push(prefix.clone());
                    if !is_free_form(&key_str(k)) {
                        walk(child, prefix, out);
                    }
                    prefix.pop();
                }
            }
        }
        let mut out = Vec::new();
        walk(defaults, &mut Vec::new(), &mut out);
        out
    })
}

fn similarity(a: &str, b: &str) -> f64 {
    strsim::jaro_winkler(a, b).max(strsim::normalized_damerau_levenshtein(a, b))
}

/// A sibling of `path[index]` spelled nearly the same (`trainer.totl_epochs` →
/// `trainer.total_epochs`), with the rest of the path kept.
pub(crate) fn sibling_suggestion(
    defaults: &Value,
    path: &[String],
    index: usize,
) -> Option<String> {
    let bad = &path[index];
    let parent = &path[..index];
    let mut cur = defaults;
    for seg in parent {
        cur = cur.as_mapping()?.get(seg.as_str())?;
    }
    let (_, k) = cur
        .as_mapping()?
        .keys()
        .map(key_str)
        .map(|k| (similarity(bad, &k), k))
        .filter(|(s, _)| *s >= 0.8)
        .max_by(|a, b| a.0.total_cmp(&b.0))?;
    let mut out = parent.to_vec();
    out.push(k);
    out.extend_from_slice(&path[index + 1..]);
    Some(join(&out))
}

/// The closest valid key for `path`, whose segment `index` is not in the schema.
///
/// First a sibling spelled nearly the same (`trainer.totl_epochs` → `trainer.total_epochs`),
/// then the same leaf elsewhere in the schema (`trainer.ppo_mini_batch_size` →
/// `actor_rollout_ref.actor.ppo_mini_batch_size`), then a near spelling of the leaf anywhere;
/// among equals, the key sharing the longest prefix with `path`
/// (`actor_rollout_ref.actor.policy_loss.tau_pos` → `actor_rollout_ref.actor.tau_pos`).
pub(crate) fn suggest(defaults: &Value, path: &[String], index: usize) -> Option<String> {
    if let Some(s) = sibling_suggestion(defaults, path, index) {
        return Some(s);
    }
    let shared = |p: &[String]| p.iter().zip(path).take_while(|(a, b)| a == b).count();
    let leaf = path.last()?;
    let all = schema_paths(defaults);
    let tail = &path[index..];
    // The longest shared prefix wins; among equals, the first in schema order.
    let best = |keep: &dyn Fn(&Vec<String>) -> bool| {
        all.iter()
            .enumerate()
            .filter(|(_, p)| keep(p))
            .max_by_key(|(i, p)| (shared(p), std::cmp::Reverse(*i)))
            .map(|(_, p)| join(p))
    };
    if let Some(p) = best(&|p| p.ends_with(tail)) {
        return Some(p);
    }
    if tail.len() > 1 {
        if let Some(p) = best(&|p| p.last() == Some(leaf)) {
            return Some(p);
        }
    }
    all.iter()
        .filter_map(|p| {
            let s = similarity(leaf, p.last()?);
            (s >= 0.9).then_some((s, shared(p), p))
        })
        .max_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)))
        .map(|(_, _, p)| join(p))
}

/// Where each user-set path came from (a file name or an override), for error messages.
#[derive(Debug, Default, Clone)]
pub(crate) struct Origins {
    map: HashMap<String, String>,
}

impl Origins {
    pub(crate) fn record(&mut self, path: &[String], origin: &str) {
        self.map.insert(join(path), origin.to_string());
    }

    /// Whether the user set `key` itself or a key below it (not merely a section above it).
    pub(crate) fn set_at_or_below(&self, key: &str) -> bool {
        self.map.keys().any(|k| {
            k == key
                || k.strip_prefix(key)
                    .is_some_and(|rest| rest.starts_with('.'))
        })
    }

    /// Every key the user set (sections as well as leaves).
    pub(crate) fn keys(&self) -> impl Iterator<Item = &str> {
        self.map.keys().map(String::as_str)
    }

    /// The origin of the nearest user-set ancestor of `key` (or of `key` itself).
    pub(crate) fn of(&self, key: &str) -> String {
        let mut k = key;
        loop {
            if let Some(o) = self.map.get(k) {
                return o.clone();
            }
            match k.rfind('.') {
                Some(i) => k = &k[..i],
                None => return "config".to_string(),
            }
        }
    }
}

/// Removes verl's `_target_` class markers (meaningless here) and Hydra composition keys.
pub(crate) fn strip_markers(v: &mut Value, top: bool) {
    if let Value::Mapping(m) = v {
        m.remove("_target_");
        if top {
            for k in HYDRA_KEYS {
                m.remove(*k);
            }
        }
        for (_, child) in m.iter_mut() {
            strip_markers(child, false);
        }
    }
}

/// Merges `over` into `base`: mappings key by key, anything else replaced. A null over a
/// mapping keeps the mapping, because an empty YAML section (`trainer:` with every line
/// commented out) means "no changes", not "no trainer".
pub(crate) fn merge(base: &mut Value, over: Value) {
    match (base, over) {
        (Value::Mapping(b), Value::Mapping(o)) => {
            for (k, v) in o {
                match b.get_mut(&k) {
                    Some(slot) => merge(slot, v),
                    None => {
                        b.insert(k, v);
                    }
                }
            }
        }
        (Value::Mapping(_), Value::Null) => {}
        (b, o) => *b = o,
    }
}

/// Sets `path` in `tree`, creating (or replacing non-mapping) intermediate nodes.
pub(crate) fn set_path(tree: &mut Value, path: &[String], value: Value) {
    let mut cur = tree;
    for seg in &path[..path.len() - 1] {
        if !cur.is_mapping() {
            *cur = Value::Mapping(Mapping::new());
        }
        let m = cur.as_mapping_mut().expect("just made a mapping");
        if !m.contains_key(seg.as_str()) {
            m.insert(Value::String(seg.clone()), Value::Mapping(Mapping::new()));
        }
        cur = m.get_mut(seg.as_str()).expect("just inserted");
    }
    if !cur.is_mapping() {
        *cur = Value::Mapping(Mapping::new());
    }
    let m = cur.as_mapping_mut().expect("just made a mapping");
    m.insert(Value::String(path[path.len() - 1].clone()), value);
}

pub(crate) fn get_path<'a>(tree: &'a Value, path: &[String]) -> Option<&'a Value> {
    let mut cur = tree;
    for seg in path {
        cur = match cur {
            Value::Mapping(m) => m.get(seg.as_str())?,
            Value::Sequence(s) => s.get(seg.parse::<usize>().ok()?)?,
            _ => return None,
        };
    }
    Some(cur)
}

pub(crate) fn get_path_mut<'a>(tree: &'a mut Value, path: &[String]) -> Option<&'a mut Value> {
    let mut cur = tree;
    for seg in path {
        cur = cur.as_mapping_mut()?.get_mut(seg.as_str())?;
    }
    Some(cur)
}

/// A short description of a value for "found ..." in messages.
pub(crate) fn describe(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("boolean `{b}`"),
        Value::Number(n) if n.is_f64() => format!("float `{n}`"),
        Value::Number(n) => format!("integer `{n}`"),
        Value::String(s) => format!("string {s:?}"),
        Value::Sequence(s) => format!("a list of {} item(s)", s.len()),
        Value::Mapping(m) => {
            let keys: Vec<String> = m.keys().take(4).map(key_str).collect();
            format!("a mapping with keys [{}]", keys.join(", "))
        }
        Value::Tagged(t) => format!("a value tagged {}", t.tag),
    }
}

pub(crate) fn split_key(key: &str) -> Vec<String> {
    key.split('.').map(str::to_string).collect()
}
