//! Loading: defaults + job file + overrides → interpolation → type checks → typed [`Config`].

use std::path::Path;
use std::sync::OnceLock;

use serde_yaml::Value;

use crate::defaults::defaults_tree;
use crate::error::{ConfigError, Result};
use crate::interp::resolve_tree;
use crate::keys::check_keys;
use crate::overrides::{Override, OverrideKind};
use crate::schema::Config;
use crate::tree::{
    describe, get_path, is_free_form, join, key_str, merge, schema_lookup, split_key,
    strip_markers, suggest, Origins, SchemaNode, STRING_OR_LIST,
};

/// The defaults with their interpolations resolved; the reference for type checks.
fn resolved_defaults() -> &'static Value {
    static TREE: OnceLock<Value> = OnceLock::new();
    TREE.get_or_init(|| {
        resolve_tree(defaults_tree(), defaults_tree()).expect("defaults resolve (tested)")
    })
}

impl Default for Config {
    /// verl's defaults (no job file, no overrides).
    fn default() -> Self {
        Config::from_overrides::<&str>(&[]).expect("the defaults load (tested)")
    }
}

impl Config {
    /// Loads a verl job YAML (possibly partial: missing keys take verl's defaults) and applies
    /// Hydra-style overrides (`a.b=v`, `+a.b=v`, `~a.b`) on top, in order.
    pub fn load<P: AsRef<Path>, S: AsRef<str>>(path: P, overrides: &[S]) -> Result<Config> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Config::from_yaml_str(&text, &path.display().to_string(), overrides)
    }

    /// [`Config::load`] without overrides.
    pub fn load_file<P: AsRef<Path>>(path: P) -> Result<Config> {
        Config::load::<P, &str>(path, &[])
    }

    /// Like [`Config::load`] with the YAML given as text; `origin` names it in messages.
    pub fn from_yaml_str<S: AsRef<str>>(
        text: &str,
        origin: &str,
        overrides: &[S],
    ) -> Result<Config> {
        let user = parse_yaml(text, origin)?;
        build(Some((user, origin)), overrides)
    }

    /// verl's defaults with overrides only (verl's `main_ppo key=value ...` usage).
    pub fn from_overrides<S: AsRef<str>>(overrides: &[S]) -> Result<Config> {
        build(None, overrides)
    }

    /// The fully resolved config as a YAML tree.
    pub fn to_value(&self) -> Result<Value> {
        serde_yaml::to_value(self).map_err(|e| ConfigError::Serialize {
            what: "config".into(),
            message: e.to_string(),
        })
    }

    /// The fully resolved config as YAML text (every key, interpolations replaced by values).
    pub fn to_yaml(&self) -> Result<String> {
        serde_yaml::to_string(self).map_err(|e| ConfigError::Serialize {
            what: "config".into(),
            message: e.to_string(),
        })
    }

    /// The value at a dotted key (`trainer.total_epochs`, `actor_rollout_ref`, ...).
    pub fn get_path(&self, key: &str) -> Result<Value> {
        let tree = self.to_value()?;
        let path = split_key(key);
        if key.is_empty() {
            return Ok(tree);
        }
        match get_path(&tree, &path) {
            Some(v) => Ok(v.clone()),
            None => {
                let suggestion = match schema_lookup(defaults_tree(), &path) {
                    SchemaNode::Unknown { index } => suggest(defaults_tree(), &path, index),
                    _ => None,
                };
                Err(ConfigError::NoSuchPath {
                    key: key.to_string(),
                    suggestion,
                })
            }
        }
    }

    /// The value at a dotted key, for printing: scalars as plain text, subtrees as YAML.
    pub fn get_path_text(&self, key: &str) -> Result<String> {
        Ok(match self.get_path(key)? {
            Value::Null => "null".into(),
            Value::Bool(b) => b.to_string(),
            Value::Number(n) => n.to_string(),
            Value::String(s) => s,
            other => to_yaml_text(&other, key)?,
        })
    }

    /// A subtree as YAML text, e.g. `section_yaml("actor_rollout_ref")` for a backend plugin.
    pub fn section_yaml(&self, key: &str) -> Result<String> {
        to_yaml_text(&self.get_path(key)?, key)
    }

    /// A subtree as JSON text.
    pub fn section_json(&self, key: &str) -> Result<String> {
        let v = self.get_path(key)?;
        serde_json::to_string(&v).map_err(|e| ConfigError::Serialize {
            what: key.to_string(),
            message: e.to_string(),
        })
    }

    /// The backend plugin to load: `plugins.backend` if set, else from `actor.strategy`
    /// (`fsdp`/`fsdp2` → `fsdp`, `megatron` → `megatron`).
    pub fn backend_plugin(&self) -> String {
        if let Some(b) = &self.plugins.backend {
            return b.clone();
        }
        match self.actor_rollout_ref.actor.strategy.as_str() {
            "fsdp" | "fsdp2" => "fsdp".into(),
            other => other.to_string(),
        }
    }

    /// The reward plugin that scores samples of `data_source`.
    pub fn reward_plugin_for(&self, data_source: &str) -> &str {
        self.plugins
            .reward
            .routes
            .get(data_source)
            .unwrap_or(&self.plugins.reward.default)
    }

    /// verl's rule: a critic runs when `critic.enable` says so, else exactly for GAE.
    pub fn need_critic(&self) -> bool {
        self.critic
            .enable
            .unwrap_or(self.algorithm.adv_estimator == "gae")
    }

    /// verl's rule: a reference policy runs for KL in the reward or a KL loss.
    pub fn need_reference_policy(&self) -> bool {
        self.algorithm.use_kl_in_reward || self.actor_rollout_ref.actor.use_kl_loss
    }

    /// Whether the policy trains LoRA adapters (`lora_rank > 0` or an adapter folder); then the
    /// reference policy is the actor's base with the adapters off (verl's `ref_in_actor`), not a
    /// role of its own.
    pub fn policy_lora(&self) -> bool {
        let m = &self.actor_rollout_ref.model;
        lora_on(m.lora_rank, m.lora_adapter_path.as_deref())
    }

    /// Whether the critic's model trains LoRA adapters (`critic.model.lora_rank > 0` or an
    /// adapter folder).
    pub fn critic_lora(&self) -> bool {
        let m = &self.critic.model;
        lora_on(m.lora_rank, m.lora_adapter_path.as_deref())
    }
}

/// A model section trains LoRA adapters: a rank, or an adapter folder to start from.
fn lora_on(rank: u64, adapter_path: Option<&str>) -> bool {
    rank > 0 || adapter_path.is_some_and(|p| !p.is_empty())
}

fn to_yaml_text(v: &Value, what: &str) -> Result<String> {
    serde_yaml::to_string(v).map_err(|e| ConfigError::Serialize {
        what: what.to_string(),
        message: e.to_string(),
    })
}

fn parse_yaml(text: &str, origin: &str) -> Result<Value> {
    let value: Value = serde_yaml::from_str(text).map_err(|e| {
        let (line, column) = e
            .location()
            .map(|l| (l.line(), l.column()))
            .unwrap_or((0, 0));
        let message = e.to_string();
        // serde_yaml appends " at line L column C"; the location is already in front.
        let message = match message.find(" at line ") {
            Some(i) => message[..i].to_string(),
            None => message,
        };
        ConfigError::Syntax {
            file: origin.to_string(),
            line,
            column,
            message,
        }
    })?;
    match value {
        Value::Null => Ok(Value::Mapping(Default::default())),
        Value::Mapping(_) => Ok(value),
        other => Err(ConfigError::TopLevelNotMapping {
            file: origin.to_string(),
            found: describe(&other),
        }),
    }
}

fn build<S: AsRef<str>>(user: Option<(Value, &str)>, overrides: &[S]) -> Result<Config> {
    let defaults = defaults_tree();
    let mut origins = Origins::default();
    let mut errors = Vec::new();
    let mut tree = defaults.clone();
    let mut notes = Vec::new();

    if let Some((mut user, origin)) = user {
        // Hydra's composition list and its own runtime settings, before they are dropped.
        if let Some(m) = user.as_mapping_mut() {
            if let Some(list) = m.get("defaults") {
                if let Some(engine) = crate::compose::read_defaults(list, origin)? {
                    // The list's choice of engine is a default the file's own keys may override.
                    let sets_engine = m.contains_key("model_engine")
                        || get_path(&user, &split_key("actor_rollout_ref.actor.strategy"))
                            .is_some();
                    if !sets_engine {
                        let m = user.as_mapping_mut().expect("checked above");
                        m.insert("model_engine".into(), engine.into());
                    }
                }
            }
            if let Some(h) = user.as_mapping().and_then(|m| m.get("hydra")) {
                if !h.is_null() {
                    notes.push(format!(
                        "{origin}: the `hydra:` section is ignored: it configures Hydra's output folders and logging, which verl-rs does not use"
                    ));
                }
            }
        }
        strip_markers(&mut user, true);
        check_keys(
            &user,
            defaults,
            &mut Vec::new(),
            origin,
            &mut origins,
            &mut errors,
        );
        if errors.is_empty() {
            merge(&mut tree, user);
        }
    }
    // Packages whose config group the command line pointed at a file verl-rs does not have:
    // the keys that file would have brought are not reported one by one.
    let mut foreign_packages: Vec<String> = Vec::new();
    for text in overrides {
        let text = text.as_ref();
        let parsed = match Override::parse(text) {
            Ok(o) => o,
            Err(e) => {
                errors.push(e);
                continue;
            }
        };
        let key = join(&parsed.key);
        if let (Some((_, package)), Some(Value::String(choice))) =
            (key.split_once('@'), parsed.value.as_ref())
        {
            match crate::compose::group_choice(&key, choice, text) {
                Ok(Some(engine)) => {
                    let choose = Override {
                        kind: OverrideKind::Set,
                        key: vec!["model_engine".into()],
                        value: Some(engine.into()),
                        text: text.to_string(),
                    };
                    if let Err(e) = choose.apply(&mut tree, defaults, &mut origins) {
                        errors.push(e);
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    foreign_packages.push(format!("{package}."));
                    errors.push(e);
                }
            }
            continue;
        }
        if parsed.key[0] == "hydra" {
            notes.push(format!(
                "override `{text}` is ignored: it configures Hydra itself (output folders, logging, search path), which verl-rs does not use"
            ));
            continue;
        }
        if let Err(e) = parsed.apply(&mut tree, defaults, &mut origins) {
            errors.push(e);
        }
    }
    errors.retain(|e| match e {
        ConfigError::OverrideMissingKey { key, .. }
        | ConfigError::OverrideAddNotAllowed { key, .. } => {
            !foreign_packages.iter().any(|p| key.starts_with(p.as_str()))
        }
        _ => true,
    });
    ConfigError::from_list(errors)?;
    ConfigError::from_list(crate::aliases::unify(&mut tree, defaults, &origins))?;

    // Before resolution, so a `???` copied by interpolations is reported once, where it is set.
    let mut errors = Vec::new();
    find_mandatory(&tree, &mut Vec::new(), &mut errors);
    ConfigError::from_list(errors)?;

    let mut resolved = resolve_tree(&tree, defaults)?;

    let mut errors = Vec::new();
    check_types(
        &mut resolved,
        resolved_defaults(),
        &mut Vec::new(),
        &origins,
        &mut errors,
    );
    ConfigError::from_list(errors)?;

    let mut config: Config =
        serde_path_to_error::deserialize(resolved.clone()).map_err(|e| serde_error(e, &origins))?;
    ConfigError::from_list(check_choices(&config, &origins))?;
    notes.extend(
        crate::surface::check(&config, &resolved, &tree, defaults, &origins)
            .map_err(ConfigError::from_errors)?,
    );
    config.warnings = notes;
    Ok(config)
}

fn find_mandatory(v: &Value, path: &mut Vec<String>, errors: &mut Vec<ConfigError>) {
    match v {
        Value::String(s) if s == "???" => {
            errors.push(ConfigError::MissingMandatory { key: join(path) })
        }
        Value::Mapping(m) => {
            for (k, child) in m {
                path.push(key_str(k));
                find_mandatory(child, path, errors);
                path.pop();
            }
        }
        _ => {}
    }
}

/// Checks each user value against the kind of its (resolved) default, converting where verl
/// (OmegaConf's typed nodes) would: a number or boolean where a string is expected becomes that
/// string, and a numeric string (YAML 1.1 leaves `1e-6` a string) where a number is expected
/// becomes the number. Keys with a `null` default are left to the typed layer.
fn check_types(
    value: &mut Value,
    default: &Value,
    path: &mut Vec<String>,
    origins: &Origins,
    errors: &mut Vec<ConfigError>,
) {
    if value.is_null() || default.is_null() {
        return;
    }
    let leaf = path.last().map(String::as_str).unwrap_or("");
    let mismatch = |expected: &str, value: &Value, path: &[String]| {
        let key = join(path);
        ConfigError::TypeMismatch {
            origin: origins.of(&key),
            key,
            expected: expected.to_string(),
            found: describe(value),
        }
    };
    match default {
        Value::Mapping(dm) => {
            if is_free_form(leaf) {
                if !value.is_mapping() {
                    errors.push(mismatch("a mapping of keyword arguments", value, path));
                }
                return;
            }
            let Some(vm) = value.as_mapping_mut() else {
                let keys: Vec<String> = dm.keys().take(5).map(key_str).collect();
                errors.push(mismatch(
                    &format!(
                        "a mapping (a section with keys such as {})",
                        keys.join(", ")
                    ),
                    value,
                    path,
                ));
                return;
            };
            for (k, child) in vm.iter_mut() {
                if let Some(d) = dm.get(k) {
                    path.push(key_str(k));
                    check_types(child, d, path, origins, errors);
                    path.pop();
                }
            }
        }
        Value::Bool(_) => {
            if !value.is_bool() {
                errors.push(mismatch("a boolean (true or false)", value, path));
            }
        }
        Value::Number(n) => match value {
            Value::Number(_) => {}
            // verl's thresholds that also take text (`"lower_upper"`) or one per rule.
            Value::String(s)
                if NUMBER_OR_TEXT.contains(&leaf) && s.trim().parse::<f64>().is_err() => {}
            Value::Sequence(_) if NUMBER_OR_TEXT.contains(&leaf) => {}
            Value::String(s) => match s.trim().parse::<f64>() {
                Ok(f) if n.is_f64() || f.fract() != 0.0 => *value = Value::Number(f.into()),
                Ok(f) if f >= 0.0 && f <= u64::MAX as f64 => {
                    *value = Value::Number((f as u64).into())
                }
                Ok(f) => *value = Value::Number((f as i64).into()),
                Err(_) => errors.push(mismatch(
                    if n.is_f64() { "a number" } else { "an integer" },
                    value,
                    path,
                )),
            },
            _ => errors.push(mismatch(
                if n.is_f64() { "a number" } else { "an integer" },
                value,
                path,
            )),
        },
        Value::String(_) => match value {
            Value::String(_) => {}
            Value::Number(n) => *value = Value::String(n.to_string()),
            Value::Bool(b) => *value = Value::String(b.to_string()),
            Value::Sequence(_) if STRING_OR_LIST.contains(&leaf) => {}
            _ => errors.push(mismatch("a string", value, path)),
        },
        Value::Sequence(_) => match value {
            Value::Sequence(_) => {}
            Value::String(_) if STRING_OR_LIST.contains(&leaf) => {}
            _ => errors.push(mismatch("a list", value, path)),
        },
        Value::Null | Value::Tagged(_) => {}
    }
}

fn serde_error(e: serde_path_to_error::Error<serde_yaml::Error>, origins: &Origins) -> ConfigError {
    let key = e.path().to_string();
    let origin = origins.of(&key);
    let message = e.inner().to_string();
    let detail = message
        .strip_prefix("invalid type: ")
        .or_else(|| message.strip_prefix("invalid value: "));
    if let Some((found, expected)) = detail.and_then(|d| d.rsplit_once(", expected ")) {
        return ConfigError::TypeMismatch {
            key,
            expected: expected.to_string(),
            found: found.to_string(),
            origin,
        };
    }
    ConfigError::Invalid {
        key,
        message,
        origin,
    }
}

/// Keys whose default is a number but that verl also accepts as text or a list.
const NUMBER_OR_TEXT: &[&str] = &["rollout_is_threshold", "rollout_rs_threshold"];

const STRATEGIES: &[&str] = &["fsdp", "fsdp2", "megatron"];
const LOSS_AGG_MODES: &[&str] = &[
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
];
const KL_PENALTIES: &[&str] = &[
    "kl",
    "k1",
    "abs",
    "mse",
    "k2",
    "low_var_kl",
    "k3",
    "full",
    "kl+",
    "k1+",
    "abs+",
    "mse+",
    "k2+",
    "low_var_kl+",
    "k3+",
    "full+",
];
/// verl's `AdvantageEstimator` names.
pub const ADV_ESTIMATORS: &[&str] = &[
    "gae",
    "grpo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "rloo",
    "opo",
    "grpo_passk",
    "gpg",
    "rloo_vectorized",
    "grpo_vectorized",
    "optimal_token_baseline",
    "tir_optimal_token_baseline",
    "gdpo",
];

/// Keys whose string value must be one of a closed set.
fn check_choices(c: &Config, origins: &Origins) -> Vec<ConfigError> {
    let arr = &c.actor_rollout_ref;
    let mut checks: Vec<(&str, &str, &[&str])> = vec![
        (
            "actor_rollout_ref.actor.loss_agg_mode",
            &arr.actor.loss_agg_mode,
            LOSS_AGG_MODES,
        ),
        (
            "critic.loss_agg_mode",
            &c.critic.loss_agg_mode,
            LOSS_AGG_MODES,
        ),
        (
            "actor_rollout_ref.actor.kl_loss_type",
            &arr.actor.kl_loss_type,
            KL_PENALTIES,
        ),
        (
            "algorithm.kl_penalty",
            &c.algorithm.kl_penalty,
            KL_PENALTIES,
        ),
        (
            "algorithm.adv_estimator",
            &c.algorithm.adv_estimator,
            ADV_ESTIMATORS,
        ),
        (
            "algorithm.kl_ctrl.type",
            &c.algorithm.kl_ctrl.kind,
            &["fixed", "adaptive"],
        ),
        (
            "trainer.resume_mode",
            &c.trainer.resume_mode,
            &["auto", "disable", "resume_path"],
        ),
        (
            "data.truncation",
            &c.data.truncation,
            &["error", "left", "right", "middle"],
        ),
        ("trainer.device", &c.trainer.device, &["cuda", "npu", "cpu"]),
    ];
    // With an explicit backend plugin, `strategy` is that plugin's business.
    if c.plugins.backend.is_none() {
        checks.push((
            "actor_rollout_ref.actor.strategy",
            &arr.actor.strategy,
            STRATEGIES,
        ));
        checks.push((
            "actor_rollout_ref.ref.strategy",
            &arr.reference.strategy,
            STRATEGIES,
        ));
        checks.push(("critic.strategy", &c.critic.strategy, STRATEGIES));
    }
    checks
        .into_iter()
        .filter(|(_, found, allowed)| !allowed.contains(found))
        .map(|(key, found, allowed)| {
            let suggestion = allowed
                .iter()
                .map(|a| (strsim::jaro_winkler(found, a), *a))
                .filter(|(s, _)| *s >= 0.7)
                .max_by(|a, b| a.0.total_cmp(&b.0))
                .map(|(_, a)| a.to_string());
            ConfigError::InvalidChoice {
                key: key.to_string(),
                allowed: allowed.join(", "),
                found: found.to_string(),
                suggestion,
                origin: origins.of(key),
            }
        })
        .collect()
}
