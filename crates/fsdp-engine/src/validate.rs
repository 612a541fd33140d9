//! The upfront check (`verl run --dry-run`, and the launcher before it spawns ranks): each role's
//! model folder holds a `config.json` of an architecture the model code builds, read without
//! touching a device or the weights. A model verl-rs cannot build fails here, naming the key and
//! the folder, rather than when the first rank loads it.

use verl_nn::ModelConfig;
use verl_plugin_api::InitArgs;

use verl_backend_kit::config::{self, section, CriticSection, ModelSection};
use verl_backend_kit::error::Result;

/// One line per role the job creates (`init.extra.roles`; the actor alone when absent), e.g.
/// `actor: qwen2, 24 layers, hidden 896; 2 rank(s)`, or the first role's error.
pub fn validate(init: &InitArgs) -> Result<String> {
    let cfg = &init.config;
    let roles: Vec<&str> = match init.extra.get("roles").and_then(|r| r.as_array()) {
        Some(r) => r.iter().filter_map(|v| v.as_str()).collect(),
        None => vec!["actor"],
    };
    let actor_model = || -> Result<ModelConfig> {
        let sec: ModelSection = section(cfg, "actor_rollout_ref.model")?;
        let dir = config::model_dir("actor_rollout_ref.model.path", &sec.path)?;
        Ok(ModelConfig::from_dir(&dir)?)
    };
    let mut lines = Vec::new();
    for role in ["actor", "reference", "critic"] {
        if !roles.contains(&role) {
            continue;
        }
        let model = if role == "critic" {
            // The critic's model: `critic.model.path`, else the actor's (as the critic reads it).
            let critic: CriticSection = section(cfg, "critic")?;
            if critic.model.path.is_empty() {
                actor_model()?
            } else {
                ModelConfig::from_dir(config::model_dir("critic.model.path", &critic.model.path)?)?
            }
        } else {
            actor_model()?
        };
        let generation = match role {
            "actor" => {
                let sec: ModelSection = section(cfg, "actor_rollout_ref.model")?;
                // Whether LoRA is asked for (the adapter folder itself is read when the ranks
                // load the model).
                let lora = sec.lora_rank > 0
                    || sec
                        .lora_adapter_path
                        .as_deref()
                        .is_some_and(|p| !p.is_empty());
                let world = init.world_size.max(1) as usize;
                let tp = verl_backend_kit::hybrid::data_parallel_rollout_tp(
                    cfg,
                    world,
                    &model,
                    tp1_because(cfg, lora, &model),
                )?;
                format!(
                    "; generation at tensor-parallel size {tp} in {} rollout group(s)",
                    world / tp
                )
            }
            _ => String::new(),
        };
        lines.push(format!(
            "{role}: {}, {} layers, hidden {}{}; {} rank(s){generation}",
            model.arch,
            model.num_hidden_layers,
            model.hidden_size,
            match &model.moe {
                Some(_) => ", mixture of experts",
                None => "",
            },
            init.world_size.max(1)
        ));
    }
    Ok(lines.join("\n"))
}

/// What makes this actor generate at rollout TP 1 whatever
/// `actor_rollout_ref.rollout.tensor_model_parallel_size` asks: LoRA adapters, MoE blocks and
/// multi-turn conversations are not split for generation.
pub fn tp1_because(
    cfg: &serde_json::Value,
    lora: bool,
    model: &ModelConfig,
) -> Option<&'static str> {
    let multi_turn = cfg
        .pointer("/actor_rollout_ref/rollout/multi_turn/enable")
        .and_then(serde_json::Value::as_bool)
        .unwrap_or(false);
    if lora {
        Some("a LoRA actor (its adapters are not split for generation)")
    } else if model.moe.is_some() {
        Some("a mixture-of-experts model (its MoE blocks are not split for generation)")
    } else if multi_turn {
        Some("a multi-turn rollout (multi_turn.enable)")
    } else {
        None
    }
}
