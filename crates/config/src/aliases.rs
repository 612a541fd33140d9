//! verl's two config layouts. verl 0.8-0.10 renamed a few settings (rewards moved under
//! `reward.*`, the critic's FSDP block to `critic.fsdp`, the backend to `model_engine`) and still
//! accept the old names, migrating them (verl's `migrate_legacy_reward_impl`). Here each group of
//! names is one setting: whichever name the user gives sets all of them, so code may read either
//! and a dumped config is consistent. Two names of one setting given different values is an
//! error naming both.

use serde_yaml::Value;

use crate::error::{ConfigError, SetKey};
use crate::tree::{get_path, is_free_form, join, key_str, set_path, split_key, Origins};

/// Groups of keys that are one setting: verl 0.10's name first, then the older names. A group
/// may name whole sections; their keys pair up by their path below the section.
pub const ALIASES: &[&[&str]] = &[
    &["reward.reward_model.enable", "reward_model.enable"],
    &[
        "reward.reward_model.enable_resource_pool",
        "reward_model.enable_resource_pool",
    ],
    &[
        "reward.reward_model.n_gpus_per_node",
        "reward_model.n_gpus_per_node",
    ],
    &["reward.reward_model.nnodes", "reward_model.nnodes"],
    &["reward.reward_model.model_path", "reward_model.model.path"],
    &["reward.reward_model.rollout", "reward_model.rollout"],
    &["reward.num_workers", "reward_model.num_workers"],
    &[
        "reward.reward_manager.name",
        "reward_model.reward_manager",
        "reward_manager.name",
    ],
    &[
        "reward.reward_manager.source",
        "reward_model.reward_loop_source",
        "reward_manager.source",
    ],
    &[
        "reward.reward_manager.module.path",
        "reward_model.reward_loop_module_path",
        "reward_manager.module.path",
    ],
    &[
        "reward.reward_manager.module.name",
        "reward_model.reward_loop_class_name",
        "reward_manager.module.name",
    ],
    &[
        "reward.custom_reward_function.path",
        "custom_reward_function.path",
    ],
    &[
        "reward.custom_reward_function.name",
        "custom_reward_function.name",
    ],
    &["reward.reward_kwargs", "reward_model.reward_kwargs"],
    &[
        "reward.sandbox_fusion",
        "sandbox_fusion",
        "reward_model.sandbox_fusion",
    ],
    &["critic.fsdp", "critic.model.fsdp_config"],
    &[
        "reward.custom_reward_function.reward_kwargs",
        "custom_reward_function.reward_kwargs",
    ],
    &[
        "actor_rollout_ref.actor.optim.clip_grad",
        "actor_rollout_ref.actor.grad_clip",
    ],
    &["critic.optim.clip_grad", "critic.grad_clip"],
];

/// verl 0.10's name of `key` when `key` is an older name of it (or lies below one), else `None`.
pub fn canonical(key: &str) -> Option<String> {
    for group in ALIASES {
        for old in &group[1..] {
            if key == *old {
                return Some(group[0].to_string());
            }
            if let Some(rest) = key.strip_prefix(old).and_then(|r| r.strip_prefix('.')) {
                return Some(format!("{}.{rest}", group[0]));
            }
        }
    }
    None
}

/// Every key below `section` in the schema (the section itself when it is a leaf or a free-form
/// map), as paths relative to it.
fn leaf_suffixes(defaults: &Value, section: &[String]) -> Vec<Vec<String>> {
    fn walk(v: &Value, name: &str, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
        match v.as_mapping() {
            Some(m) if !is_free_form(name) && !m.is_empty() => {
                for (k, child) in m {
                    let k = key_str(k);
                    prefix.push(k.clone());
                    walk(child, &k, prefix, out);
                    prefix.pop();
                }
            }
            _ => out.push(prefix.clone()),
        }
    }
    let mut out = Vec::new();
    if let Some(node) = get_path(defaults, section) {
        let name = section.last().map(String::as_str).unwrap_or("");
        walk(node, name, &mut Vec::new(), &mut out);
    }
    out
}

/// Makes every group of [`ALIASES`] agree on the merged (unresolved) tree: a name the user set
/// gives its value to the others; with no name set, the others take verl 0.10's. Also unifies
/// `model_engine` with the strategies. Returns the conflicts.
pub(crate) fn unify(tree: &mut Value, defaults: &Value, origins: &Origins) -> Vec<ConfigError> {
    let mut errors = Vec::new();
    for group in ALIASES {
        let members: Vec<Vec<String>> = group.iter().map(|k| split_key(k)).collect();
        let mut suffixes: Vec<Vec<String>> = Vec::new();
        for m in &members {
            for s in leaf_suffixes(defaults, m) {
                if !suffixes.contains(&s) {
                    suffixes.push(s);
                }
            }
        }
        for suffix in suffixes {
            let paths: Vec<Vec<String>> = members
                .iter()
                .map(|m| m.iter().chain(&suffix).cloned().collect())
                .filter(|p: &Vec<String>| get_path(defaults, p).is_some())
                .collect();
            let given: Vec<(&Vec<String>, Value)> = paths
                .iter()
                .filter(|p| origins.set_at_or_below(&join(p)))
                .filter_map(|p| get_path(tree, p).map(|v| (p, v.clone())))
                .collect();
            let value = match given.split_first() {
                Some(((first, v), rest)) => {
                    if let Some((other, w)) = rest.iter().find(|(_, w)| w != v) {
                        let (a, b) = (join(first), join(other));
                        errors.push(ConfigError::Conflict {
                            a: SetKey::new(a.as_str(), show(v), origins.of(&a)),
                            b: SetKey::new(b.as_str(), show(w), origins.of(&b)),
                        });
                        continue;
                    }
                    v.clone()
                }
                None => match get_path(tree, &paths[0]) {
                    Some(v) => v.clone(),
                    None => continue,
                },
            };
            for p in &paths {
                set_path(tree, p, value.clone());
            }
        }
    }
    errors.extend(unify_engine(tree, origins));
    errors
}

/// verl 0.10 picks the backend with `model_engine` (`dp` = FSDP, `megatron`); older configs
/// with `actor_rollout_ref.actor.strategy`. Either sets the other; the critic follows unless the
/// user set its strategy. Other engines of verl 0.10 are refused by the surface check.
fn unify_engine(tree: &mut Value, origins: &Origins) -> Vec<ConfigError> {
    const ENGINE: &str = "model_engine";
    const ACTOR: &str = "actor_rollout_ref.actor.strategy";
    const CRITIC: &str = "critic.strategy";
    let text = |tree: &Value, key: &str| {
        get_path(tree, &split_key(key))
            .and_then(Value::as_str)
            .map(str::to_string)
    };
    let engine_set = origins.set_at_or_below(ENGINE);
    let actor_set = origins.set_at_or_below(ACTOR);
    let engine = text(tree, ENGINE).unwrap_or_default();
    let strategy = text(tree, ACTOR).unwrap_or_default();
    let engine_of = |strategy: &str| match strategy {
        "fsdp" | "fsdp2" => Some("dp"),
        "megatron" => Some("megatron"),
        _ => None,
    };
    let strategy_of = |engine: &str| match engine {
        "dp" => Some("fsdp"),
        "megatron" => Some("megatron"),
        _ => None,
    };
    let chosen = match (engine_set, actor_set) {
        (true, true) => {
            if engine_of(&strategy).is_some_and(|e| e != engine) {
                return vec![ConfigError::Conflict {
                    a: SetKey::new(ENGINE, engine.clone(), origins.of(ENGINE)),
                    b: SetKey::new(ACTOR, strategy, origins.of(ACTOR)),
                }];
            }
            strategy.clone()
        }
        (true, false) => match strategy_of(&engine) {
            Some(s) => {
                set_path(tree, &split_key(ACTOR), Value::String(s.into()));
                s.to_string()
            }
            None => return Vec::new(),
        },
        (false, _) => {
            if let Some(e) = engine_of(&strategy) {
                set_path(tree, &split_key(ENGINE), Value::String(e.into()));
            }
            strategy.clone()
        }
    };
    let mut errors = Vec::new();
    // Every role runs on the one backend plugin: a role's strategy of the other family is a
    // request verl-rs cannot serve (the surface check misses it when it equals the default).
    for role in [CRITIC, "actor_rollout_ref.ref.strategy"] {
        if !origins.set_at_or_below(role) {
            continue;
        }
        let theirs = text(tree, role).unwrap_or_default();
        if let (Some(a), Some(b)) = (engine_of(&theirs), engine_of(&chosen)) {
            if a != b {
                errors.push(ConfigError::Refused {
                    key: role.into(),
                    origin: origins.of(role),
                    message: format!(
                        "`{role}={theirs}`: every role runs on the job's one backend ({ACTOR}={chosen}); use {chosen} or drop the key"
                    ),
                });
            }
        }
    }
    if !origins.set_at_or_below(CRITIC) && engine_of(&chosen).is_some() {
        set_path(tree, &split_key(CRITIC), Value::String(chosen));
    }
    errors
}

fn show(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "null".into(),
        other => serde_yaml::to_string(other)
            .map(|s| s.trim().replace('\n', " "))
            .unwrap_or_else(|_| "?".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::defaults::defaults_tree;

    #[test]
    fn older_names_map_to_verl_0_10_names() {
        assert_eq!(
            canonical("reward_model.enable").as_deref(),
            Some("reward.reward_model.enable")
        );
        assert_eq!(
            canonical("critic.model.fsdp_config.param_offload").as_deref(),
            Some("critic.fsdp.param_offload")
        );
        assert_eq!(
            canonical("reward_model.sandbox_fusion.url").as_deref(),
            Some("reward.sandbox_fusion.url")
        );
        assert_eq!(canonical("reward.reward_model.enable"), None);
        assert_eq!(canonical("critic.model.fsdp"), None);
    }

    #[test]
    fn every_name_of_a_setting_is_in_the_schema_with_the_same_default() {
        let d = defaults_tree();
        for group in ALIASES {
            let first = split_key(group[0]);
            assert!(get_path(d, &first).is_some(), "{} is not a key", group[0]);
            for other in &group[1..] {
                let o = split_key(other);
                assert!(get_path(d, &o).is_some(), "{other} is not a key");
                for s in leaf_suffixes(d, &o) {
                    let a: Vec<String> = first.iter().chain(&s).cloned().collect();
                    let b: Vec<String> = o.iter().chain(&s).cloned().collect();
                    assert_eq!(
                        get_path(d, &a),
                        get_path(d, &b),
                        "{} and {} name one setting but have different defaults",
                        join(&a),
                        join(&b)
                    );
                }
            }
        }
    }
}
