//! Hydra composition, as far as verl jobs use it. verl-rs's defaults already are verl's composed
//! `ppo_trainer` config (with the Megatron groups merged in), so a job file's `defaults:` list may
//! only name what verl's own trainer configs compose: `ppo_trainer`, `ppo_megatron_trainer`
//! (which selects the Megatron engine), `_self_`, and verl's config groups at their stock choices.
//! Anything else would be composition verl-rs cannot do, and is refused by name.

use serde_yaml::Value;

use crate::error::ConfigError;

/// The engine a verl trainer config name selects: `ppo_trainer` → `dp`,
/// `ppo_megatron_trainer` → `megatron` (with or without `.yaml`); `None` for other names.
pub fn engine_of_config_name(name: &str) -> Option<&'static str> {
    match name
        .trim()
        .trim_end_matches(".yaml")
        .trim_end_matches(".yml")
    {
        "ppo_trainer" => Some("dp"),
        "ppo_megatron_trainer" => Some("megatron"),
        _ => None,
    }
}

/// verl's config groups and the choices its trainer configs make for them (a `${model_engine}`
/// choice stands for the engine's own file).
const GROUPS: &[(&str, &[&str])] = &[
    (
        "actor@actor_rollout_ref.actor",
        &["dp_actor", "megatron_actor"],
    ),
    ("ref@actor_rollout_ref.ref", &["dp_ref", "megatron_ref"]),
    ("critic@critic", &["dp_critic", "megatron_critic"]),
    ("data@data", &["legacy_data"]),
    ("rollout@actor_rollout_ref.rollout", &["rollout"]),
    ("model@actor_rollout_ref.model", &["hf_model"]),
    ("model@critic.model", &["hf_model"]),
    ("reward@reward", &["reward"]),
    (
        "reward_model@reward_model",
        &["dp_reward_loop", "megatron_reward_loop"],
    ),
    (
        "algorithm@algorithm.rollout_correction",
        &["rollout_correction"],
    ),
    ("distillation@distillation", &["distillation"]),
    ("transfer_queue@transfer_queue", &["transfer_queue"]),
    ("npu_profile@npu_profile", &["npu_profile"]),
];

/// Reads a job file's `defaults:` list. Returns the engine it selects, if any.
pub(crate) fn read_defaults(
    list: &Value,
    origin: &str,
) -> Result<Option<&'static str>, ConfigError> {
    let bad = |entry: String, why: &str| {
        ConfigError::Invalid {
        key: "defaults".into(),
        message: format!(
            "`{entry}` {why}; verl-rs composes verl's ppo_trainer config itself: put the settings in the job file (or use model_engine=megatron for ppo_megatron_trainer)"
        ),
        origin: origin.to_string(),
    }
    };
    let Some(entries) = list.as_sequence() else {
        return Err(bad(
            serde_yaml::to_string(list)
                .unwrap_or_default()
                .trim()
                .into(),
            "is not a list",
        ));
    };
    let mut engine = None;
    let mut choose = |e: &'static str| engine = Some(e);
    for entry in entries {
        match entry {
            Value::String(s) => match s.as_str() {
                "_self_" | "legacy_reward_impl" => {}
                name => match engine_of_config_name(name) {
                    Some(e) => choose(e),
                    None => return Err(bad(name.into(), "is not a verl trainer config")),
                },
            },
            Value::Mapping(m) => {
                for (k, v) in m {
                    let key = k.as_str().unwrap_or_default();
                    let group = key.trim_start_matches("override ").trim();
                    let value = v.as_str().unwrap_or_default();
                    if group == "model_engine" {
                        match value {
                            "dp" => choose("dp"),
                            "megatron" => choose("megatron"),
                            other => {
                                return Err(bad(
                                    format!("{key}: {other}"),
                                    "selects an engine verl-rs does not have (dp, megatron)",
                                ))
                            }
                        }
                        continue;
                    }
                    let known = GROUPS.iter().find(|(g, _)| *g == group);
                    let stock = known.is_some_and(|(_, choices)| {
                        choices.contains(&value) || value.starts_with("${model_engine}")
                    });
                    if !stock {
                        return Err(bad(
                            format!("{key}: {value}"),
                            "is not one of verl's stock config-group choices",
                        ));
                    }
                    if value.starts_with("megatron_") {
                        choose("megatron");
                    }
                }
            }
            other => {
                return Err(bad(
                    serde_yaml::to_string(other)
                        .unwrap_or_default()
                        .trim()
                        .into(),
                    "is not a config name or a group choice",
                ))
            }
        }
    }
    Ok(engine)
}

/// A config-group choice given on the command line (`actor@actor_rollout_ref.actor=megatron_actor`).
/// verl's stock choices are accepted (a `megatron_*` / `dp_*` choice selects that engine, as in
/// a `defaults:` list); anything else would load a config file verl-rs does not have (usually
/// from a package on `hydra.searchpath`, such as a third-party engine) and is refused by name.
/// Returns the engine the choice selects, if any.
pub(crate) fn group_choice(
    group: &str,
    value: &str,
    text: &str,
) -> Result<Option<&'static str>, ConfigError> {
    let known = GROUPS.iter().find(|(g, _)| *g == group);
    match known {
        Some((_, choices)) if choices.contains(&value) => Ok(if value.starts_with("megatron_") {
            Some("megatron")
        } else if value.starts_with("dp_") {
            Some("dp")
        } else {
            None
        }),
        Some((_, choices)) => Err(ConfigError::Refused {
            key: group.to_string(),
            origin: format!("override `{text}`"),
            message: format!(
                "`{group}={value}` selects the config file `{value}`, which is not one of verl's stock choices for this group ({}); verl-rs composes verl's own config (a file from another package on `hydra.searchpath`, such as a third-party engine's, cannot be loaded): use model_engine=dp or model_engine=megatron and set the keys directly",
                choices.join(", ")
            ),
        }),
        None => Err(ConfigError::Refused {
            key: group.to_string(),
            origin: format!("override `{text}`"),
            message: format!(
                "`{group}` is not one of verl's config groups ({}); verl-rs composes verl's own config: set the keys directly",
                GROUPS.iter().map(|(g, _)| *g).collect::<Vec<_>>().join(", ")
            ),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(yaml: &str) -> Result<Option<&'static str>, ConfigError> {
        read_defaults(&serde_yaml::from_str(yaml).unwrap(), "job.yaml")
    }

    #[test]
    fn verl_trainer_configs_and_stock_groups_compose() {
        assert_eq!(read("[ppo_trainer, _self_]").unwrap(), None.or(Some("dp")));
        assert_eq!(
            read("[ppo_megatron_trainer, _self_]").unwrap(),
            Some("megatron")
        );
        assert_eq!(
            read("[{override model_engine: megatron}]").unwrap(),
            Some("megatron")
        );
        assert_eq!(
            read("[{actor@actor_rollout_ref.actor: megatron_actor}, _self_]").unwrap(),
            Some("megatron")
        );
        assert_eq!(
            read("[{actor@actor_rollout_ref.actor: '${model_engine}_actor'}, legacy_reward_impl]")
                .unwrap(),
            None
        );
    }

    #[test]
    fn other_composition_is_refused_by_name() {
        let e = read("[my_base_config, _self_]").unwrap_err().to_string();
        assert!(
            e.contains("`my_base_config`") && e.contains("job.yaml"),
            "{e}"
        );
        let e = read("[{override model_engine: veomni}]")
            .unwrap_err()
            .to_string();
        assert!(e.contains("veomni"), "{e}");
        let e = read("[{critic@critic: my_critic}]")
            .unwrap_err()
            .to_string();
        assert!(e.contains("critic@critic: my_critic"), "{e}");
    }
}
