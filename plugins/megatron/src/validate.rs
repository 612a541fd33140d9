//! The upfront layout check (`verl run --dry-run`, and the launcher before it spawns ranks): each
//! role's `*.megatron.*` layout validated against the job's world size and the model's
//! config.json, through the same code the roles run when they are created ([`common::role_layout`],
//! [`crate::rollout::resolve`]), without joining groups, touching a device or reading weights.

use verl_backend_kit::config::{self, section, CriticSection, ModelSection, RolloutEngineSection};
use verl_nn::ModelConfig;
use verl_plugin_api::InitArgs;

use crate::common::{self, megatron_section};
use crate::error::Result;
use crate::layout::Layout;

/// One line per role the job creates (`init.extra.roles`; the actor alone when absent), e.g.
/// `actor: TP 2 × PP 2 (VPP 2) × CP 1 × DP 1 = 4 ranks; ...`, or the first role's layout error.
pub fn validate(init: &InitArgs) -> Result<String> {
    let cfg = &init.config;
    let engine: RolloutEngineSection = section(cfg, "actor_rollout_ref.rollout")?;
    if engine.consistent_attention {
        return Err(crate::error::MegatronError::config(
            "actor_rollout_ref.rollout.consistent_attention",
            "false with the megatron backend (the fsdp backend implements it)",
            "true",
        ));
    }
    if cfg
        .pointer("/actor_rollout_ref/actor/use_prefix_grouper")
        .and_then(|v| v.as_bool())
        == Some(true)
    {
        return Err(crate::error::MegatronError::config(
            "actor_rollout_ref.actor.use_prefix_grouper",
            "false with the megatron backend (the fsdp backend implements it)",
            "true",
        ));
    }
    let roles: Vec<&str> = match init.extra.get("roles").and_then(|r| r.as_array()) {
        Some(r) => r.iter().filter_map(|v| v.as_str()).collect(),
        None => vec!["actor"],
    };
    let mut lines = Vec::new();
    let mut actor_model: Option<ModelConfig> = None;
    let mut actor_model_cfg = || -> Result<ModelConfig> {
        if let Some(m) = &actor_model {
            return Ok(m.clone());
        }
        let sec: ModelSection = section(cfg, "actor_rollout_ref.model")?;
        let dir = config::model_dir("actor_rollout_ref.model.path", &sec.path)?;
        let m = ModelConfig::from_dir(&dir)?;
        actor_model = Some(m.clone());
        Ok(m)
    };
    for role in ["actor", "reference", "critic"] {
        if !roles.contains(&role) {
            continue;
        }
        let line = match role {
            "actor" => {
                let model = actor_model_cfg()?;
                let prefix = "actor_rollout_ref.actor.megatron";
                let mg = megatron_section(cfg, prefix, None)?;
                let layout = common::role_layout(&mg, prefix, init, &model)?;
                let rollout = crate::rollout::resolve(cfg, &layout, &model)?;
                let generation = format!(
                    "; generation at tensor-parallel size {} in {} rollout groups",
                    rollout.grid.tp,
                    rollout.grid.groups()
                );
                format!("{}{generation}", summary(&layout))
            }
            "reference" => {
                let model = actor_model_cfg()?;
                let prefix = "actor_rollout_ref.ref.megatron";
                let mg = megatron_section(cfg, prefix, Some("actor_rollout_ref.actor.megatron"))?;
                summary(&common::role_layout(&mg, prefix, init, &model)?)
            }
            _ => {
                // The critic's model: `critic.model.path`, else the actor's (as the critic reads it).
                let critic: CriticSection = section(cfg, "critic")?;
                let model = if critic.model.path.is_empty() {
                    actor_model_cfg()?
                } else {
                    ModelConfig::from_dir(config::model_dir(
                        "critic.model.path",
                        &critic.model.path,
                    )?)?
                };
                let prefix = "critic.megatron";
                let mg = megatron_section(cfg, prefix, None)?;
                summary(&common::role_layout(&mg, prefix, init, &model)?)
            }
        };
        lines.push(format!("{role}: {line}"));
    }
    Ok(lines.join("\n"))
}

/// `TP 2 × PP 2 (VPP 2) × CP 1 × DP 1 = 4 ranks; EP 2 × ETP 1 × EDP 2; sequence parallel;
/// distributed optimizer`.
pub fn summary(l: &Layout) -> String {
    let mut s = format!("TP {} × PP {}", l.tp, l.pp);
    if l.vpp > 1 {
        s.push_str(&format!(" (VPP {})", l.vpp));
    }
    s.push_str(&format!(
        " × CP {} × DP {} = {} rank(s)",
        l.cp,
        l.dp,
        l.world()
    ));
    if l.moe {
        s.push_str(&format!(
            "; experts: EP {} × ETP {} × EDP {}",
            l.ep,
            l.etp,
            l.expert_dp_size()
        ));
    }
    if l.sequence_parallel {
        s.push_str("; sequence parallel");
    }
    if l.distributed_optimizer {
        s.push_str("; distributed optimizer");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use verl_plugin_api::Role;

    fn model_dir(config: serde_json::Value) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("config.json"), config.to_string()).unwrap();
        d
    }

    fn qwen2(heads: i64, kv: i64, layers: i64) -> serde_json::Value {
        serde_json::json!({
            "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv,
            "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "tie_word_embeddings": true
        })
    }

    fn init(dir: &std::path::Path, world: u32, megatron: serde_json::Value) -> InitArgs {
        let cfg = serde_json::json!({
            "trainer": {"device": "cpu"},
            "actor_rollout_ref": {
                "model": {"path": dir.display().to_string()},
                "actor": {"megatron": megatron},
            },
        });
        InitArgs {
            world_size: world,
            extra: serde_json::json!({"roles": ["actor", "reference", "critic"]}),
            ..InitArgs::new(Role::Actor, cfg)
        }
    }

    #[test]
    fn summarises_each_role_from_config_json_alone() {
        let d = model_dir(qwen2(4, 2, 4));
        let s = validate(&init(
            d.path(),
            8,
            serde_json::json!({"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}),
        ))
        .unwrap();
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines.len(), 3, "{s}");
        assert!(
            lines[0].starts_with("actor: TP 2 × PP 2 × CP 1 × DP 2 = 8 rank(s); sequence parallel"),
            "{s}"
        );
        assert!(lines[1].starts_with("reference: TP 2 × PP 2"), "{s}");
        assert!(
            lines[2].starts_with("critic: TP 1 × PP 1 × CP 1 × DP 8"),
            "{s}"
        );
    }

    #[test]
    fn a_bad_layout_returns_the_layout_error() {
        let d = model_dir(qwen2(4, 2, 4));
        let e = validate(&init(
            d.path(),
            3,
            serde_json::json!({"tensor_model_parallel_size": 3}),
        ))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("actor_rollout_ref.actor.megatron.tensor_model_parallel_size"),
            "{e}"
        );
        assert!(e.contains("num_attention_heads=4"), "{e}");
    }

    #[test]
    fn consistent_attention_and_prefix_grouper_are_refused_by_name() {
        let d = model_dir(qwen2(4, 2, 4));
        let mut args = init(d.path(), 1, serde_json::json!({}));
        args.config["actor_rollout_ref"]["rollout"] =
            serde_json::json!({"consistent_attention": true});
        let e = validate(&args).unwrap_err().to_string();
        assert!(
            e.contains("actor_rollout_ref.rollout.consistent_attention"),
            "{e}"
        );
        args.config["actor_rollout_ref"]["rollout"] =
            serde_json::json!({"consistent_attention": false});
        validate(&args).unwrap();
        args.config["actor_rollout_ref"]["actor"]["use_prefix_grouper"] = serde_json::json!(true);
        let e = validate(&args).unwrap_err().to_string();
        assert!(
            e.contains("actor_rollout_ref.actor.use_prefix_grouper"),
            "{e}"
        );
    }
}
