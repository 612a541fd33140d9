//! What verl-rs does with each key of verl's config. Every key of the schema is in one of three
//! classes (the rules are in `rules.rs`, the table users read is generated from them):
//!
//! - **acts**: the value changes what verl-rs does, and a named test shows it; some keys act with
//!   one backend only (`fsdp_config.*` with FSDP, `megatron.*` with Megatron) and are refused
//!   with the other, and some act for some values and refuse the others;
//! - **harmless**: a knob of an engine verl-rs does not have (vLLM, SGLang, Ray, profilers, NPUs):
//!   setting it is a one-line warning naming the key;
//! - **refused**: a value other than the default asks for something verl-rs does not do; the
//!   config does not load, and the error names the key, what it asks for and what to use instead.
//!
//! Only keys the user set are checked, against the defaults, so a verl config dumped in full
//! (every key at its default) loads with no noise.

use std::collections::BTreeSet;

use serde_yaml::Value;

use crate::aliases::canonical;
use crate::error::ConfigError;
use crate::interp::resolve_at;
use crate::schema::Config;
use crate::tree::{get_path, is_free_form, join, key_str, split_key, Origins};

pub use crate::keys::{rule_for, OTHER_ENGINES};
pub use crate::rule::{Class, Rule, ValueCheck, Verdict};
pub use crate::rules::RULES;

/// Every key the table covers: the schema's leaves and free-form maps, in schema order.
pub fn surface_keys(defaults: &Value) -> Vec<String> {
    fn walk(v: &Value, prefix: &mut Vec<String>, out: &mut Vec<String>) {
        let name = prefix.last().cloned().unwrap_or_default();
        match v.as_mapping() {
            Some(m) if !is_free_form(&name) && !m.is_empty() => {
                for (k, child) in m {
                    prefix.push(key_str(k));
                    walk(child, prefix, out);
                    prefix.pop();
                }
            }
            _ => {
                if !prefix.is_empty() {
                    out.push(join(prefix));
                }
            }
        }
    }
    let mut out = Vec::new();
    walk(defaults, &mut Vec::new(), &mut out);
    out
}

/// The surface key a user-set path belongs to: itself when it is one, the free-form map it lies
/// in, or `None` for a section.
fn surface_key_of(path: &str, keys: &BTreeSet<String>) -> Option<String> {
    if keys.contains(path) {
        return Some(path.to_string());
    }
    let mut p = path;
    while let Some(i) = p.rfind('.') {
        p = &p[..i];
        if keys.contains(p) {
            return Some(p.to_string());
        }
    }
    None
}

fn show(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "null".into(),
        other => serde_json::to_string(other).unwrap_or_else(|_| "?".into()),
    }
}

/// The backend plugin family of a job: `fsdp`, `megatron`, or `None` for a third-party plugin
/// (whose keys are its own business).
fn first_party_backend(cfg: &Config) -> Option<&'static str> {
    match cfg.backend_plugin().as_str() {
        "fsdp" => Some("fsdp"),
        "megatron" => Some("megatron"),
        _ => None,
    }
}

/// Equal as config values: numbers by value (`16` and `16.0` are one value), lists and maps
/// element by element.
fn same(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        (Value::Sequence(x), Value::Sequence(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| same(a, b))
        }
        (Value::Mapping(x), Value::Mapping(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same(v, w)))
        }
        _ => a == b,
    }
}

/// Checks the keys the user set against [`RULES`]: refusals as errors (all of them), harmless
/// keys as warnings (one line each). A key counts as set when its value differs from what its
/// default gives in this job (an interpolated default is evaluated against the user's `merged`
/// tree, so a dumped config's resolved copies are not taken for requests).
pub(crate) fn check(
    cfg: &Config,
    resolved: &Value,
    merged: &Value,
    defaults: &Value,
    origins: &Origins,
) -> Result<Vec<String>, Vec<ConfigError>> {
    let keys: BTreeSet<String> = surface_keys(defaults).into_iter().collect();
    let mut user: Vec<String> = origins
        .keys()
        .filter_map(|p| surface_key_of(p, &keys))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    user.sort();
    let backend = first_party_backend(cfg);
    let mut warnings = Vec::new();
    let mut errors = Vec::new();
    for key in user {
        let path = split_key(&key);
        let value = get_path(resolved, &path).cloned().unwrap_or(Value::Null);
        let default = get_path(defaults, &path)
            .map(|d| resolve_at(merged, defaults, &path, d))
            .transpose()
            .ok()
            .flatten()
            .unwrap_or(Value::Null);
        if same(&value, &default) {
            continue;
        }
        let Some(rule) = rule_for(&key) else {
            // The rules test keeps this from happening; fail loudly rather than ignore.
            errors.push(ConfigError::Refused {
                origin: origins.of(&key),
                message: format!(
                    "`{key}={}` is not classified by verl-rs (a bug: please report it)",
                    show(&value)
                ),
                key,
            });
            continue;
        };
        let refuse = |message: String| ConfigError::Refused {
            key: key.clone(),
            origin: origins.of(&key),
            message,
        };
        match rule.class {
            Class::Acts => {
                if let (Some(b), Some(job)) = (rule.backend, backend) {
                    if b != job {
                        errors.push(refuse(format!(
                            "`{key}={}` configures the {b} backend, but this job runs on {job} (actor_rollout_ref.actor.strategy={} / model_engine={}); {}",
                            show(&value),
                            cfg.actor_rollout_ref.actor.strategy,
                            cfg.model_engine,
                            if b == "megatron" {
                                "use model_engine=megatron to train with Megatron, or drop the key"
                            } else {
                                "use model_engine=dp (FSDP) for it, or drop the key"
                            }
                        )));
                        continue;
                    }
                }
                if let Some(check) = rule.check {
                    match check(&value, cfg) {
                        Verdict::Acts => {}
                        Verdict::Ignored(why) => {
                            warnings.push(format!("`{key}={}` is ignored: {why}", show(&value)))
                        }
                        Verdict::Refused(why) => {
                            errors.push(refuse(format!("`{key}={}`: {why}", show(&value))))
                        }
                    }
                }
            }
            Class::Harmless => warnings.push(format!(
                "`{key}={}` is ignored: {}",
                show(&value),
                rule.what
            )),
            Class::Refused => errors.push(refuse(format!(
                "`{key}={}` asks for {}, which verl-rs does not do; {}",
                show(&value),
                rule.what,
                rule.instead
            ))),
        }
    }
    if errors.is_empty() {
        Ok(warnings)
    } else {
        Err(errors)
    }
}

/// The table of every key, as the Markdown page `docs/config-keys.md` (generated: `verl config
/// keys --markdown`).
pub fn markdown(defaults: &Value) -> String {
    let mut out = String::new();
    out.push_str(
        "# verl config keys in verl-rs\n\n\
         Generated by `verl config keys --markdown` from the rules in \
         `crates/config/src/rules.rs`; a test fails when this page and the code disagree.\n\n\
         Every key of verl's PPO trainer config (verl 0.7 and 0.10 layouts) is in one class:\n\n\
         - **acts**: the value changes what verl-rs does; the test named shows it. *acts (fsdp)* / \
         *acts (megatron)*: with that backend; with the other, a value other than the default is \
         refused.\n\
         - **harmless**: a knob of an engine verl-rs does not have; a value other than the default \
         is a one-line warning.\n\
         - **refused**: a value other than the default is an error naming the key, what it asks \
         for and what to use instead.\n\n\
         Keys verl-rs's schema does not have are errors too: those of verl's other engines \
         (`*.veomni.*`, `*.torchtitan.*`, `*.automodel.*`) and those inside a refused section \
         (`distillation.teacher_models.<name>.*`) are refused by name; a config-group choice on \
         the command line (`actor@actor_rollout_ref.actor=megatron_actor`) must be one of verl's \
         stock files; `hydra.*` overrides are a warning. \
         Only keys a job sets are checked, against their defaults. Older names of a setting \
         (verl 0.7's `reward_model.*`, `custom_reward_function.*`, `critic.model.fsdp_config.*`, \
         ...) behave as verl 0.10's name, listed in the last column.\n",
    );
    let mut section = String::new();
    for key in surface_keys(defaults) {
        let top = key.split('.').take(2).collect::<Vec<_>>();
        let head = if matches!(top[0], "actor_rollout_ref" | "reward") && top.len() > 1 {
            top.join(".")
        } else {
            top[0].to_string()
        };
        if head != section {
            section = head;
            out.push_str(&format!(
                "\n## `{section}`\n\n| key | class | what it does / asks for | tests / instead |\n|---|---|---|---|\n"
            ));
        }
        let Some(rule) = rule_for(&key) else {
            out.push_str(&format!("| `{key}` | **unclassified** | | |\n"));
            continue;
        };
        let class = match (rule.class, rule.backend) {
            (Class::Acts, Some(b)) => format!("acts ({b})"),
            (c, _) => c.name().to_string(),
        };
        let last = match rule.class {
            Class::Acts => rule
                .tests
                .iter()
                .map(|t| format!("`{t}`"))
                .collect::<Vec<_>>()
                .join("<br>"),
            Class::Refused => rule.instead.to_string(),
            Class::Harmless => String::new(),
        };
        let alias = canonical(&key)
            .map(|c| format!(" (older name of `{c}`)"))
            .unwrap_or_default();
        out.push_str(&format!(
            "| `{key}`{alias} | {class} | {} | {} |\n",
            cell(rule.what),
            cell(&last)
        ));
    }
    out
}

fn cell(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::defaults::defaults_tree;
    use crate::rule::{glob, specificity};

    #[test]
    fn patterns_match_one_segment_per_star_and_any_number_for_a_double_star() {
        let r = Rule::harmless("a.*.c", "");
        assert!(r.matches(&["a", "b", "c"]));
        assert!(!r.matches(&["a", "b", "c", "d"]));
        let r = Rule::harmless("a.**", "");
        assert!(r.matches(&["a", "b", "c", "d"]));
        assert!(r.matches(&["a"]));
        assert!(!r.matches(&["b"]));
        let r = Rule::harmless("**.x.y", "");
        assert!(r.matches(&["x", "y"]));
        assert!(r.matches(&["a", "b", "x", "y"]));
        assert!(!r.matches(&["a", "x", "y", "z"]));
        let r = Rule::harmless("a.mu_*|b.c", "");
        assert!(r.matches(&["a", "mu_momentum"]));
        assert!(r.matches(&["b", "c"]));
        assert!(!r.matches(&["a", "momentum"]));
    }

    #[test]
    fn the_most_specific_rule_wins() {
        assert!(specificity("a.b.c") > specificity("a.*.c"));
        assert!(specificity("a.*.c") > specificity("a.**"));
        assert!(specificity("reward_model.**") > specificity("**.profiler.**"));
    }

    #[test]
    fn every_key_of_the_schema_has_exactly_one_most_specific_rule() {
        let mut problems = Vec::new();
        for key in surface_keys(defaults_tree()) {
            let canon = canonical(&key).unwrap_or(key.clone());
            let segs: Vec<&str> = canon.split('.').collect();
            let matching: Vec<((usize, bool, usize), &Rule)> = RULES
                .iter()
                .filter_map(|r| r.match_specificity(&segs).map(|s| (s, r)))
                .collect();
            let Some(best) = matching.iter().map(|(s, _)| *s).max() else {
                problems.push(format!("{key}: no rule"));
                continue;
            };
            let tied: Vec<&str> = matching
                .iter()
                .filter(|(s, _)| *s == best)
                .map(|(_, r)| r.pattern)
                .collect();
            if tied.len() > 1 {
                problems.push(format!("{key}: rules tie: {tied:?}"));
            }
        }
        assert!(problems.is_empty(), "{}", problems.join("\n"));
    }

    #[test]
    fn every_rule_matches_some_key_and_acting_rules_name_tests() {
        let keys = surface_keys(defaults_tree());
        let canon: Vec<String> = keys
            .iter()
            .map(|k| canonical(k).unwrap_or(k.clone()))
            .collect();
        for rule in RULES {
            for alt in rule.pattern.split('|') {
                let pat: Vec<&str> = alt.split('.').collect();
                assert!(
                    canon
                        .iter()
                        .any(|k| glob(&pat, &k.split('.').collect::<Vec<_>>())),
                    "`{alt}` (of rule `{}`) matches no key of the schema",
                    rule.pattern
                );
            }
            match rule.class {
                Class::Acts => assert!(
                    !rule.tests.is_empty(),
                    "`{}` acts but names no test",
                    rule.pattern
                ),
                Class::Refused => assert!(
                    !rule.instead.is_empty(),
                    "`{}` is refused without saying what to use instead",
                    rule.pattern
                ),
                Class::Harmless => assert!(!rule.what.is_empty()),
            }
        }
    }
}
