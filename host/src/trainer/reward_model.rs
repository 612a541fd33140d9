//! The job's reward model (verl's `reward_model.*` / `reward.reward_model.*`): created through the
//! backend plugin and lent under the name `reward_model`. A `*ForSequenceClassification` /
//! `*ForRewardModel` checkpoint scores rows itself (verl's discriminative RM); a causal LM is a
//! generative reward model (verl's GenRM) that reward plugins prompt through the model services.

use std::path::Path;

use anyhow::{bail, Context};
use verl_config::Config;
use verl_plugin_api::{InitArgs, RewardModelSpec, Role};

use super::plugins::BackendFactory;
use super::reward::REWARD_MODEL;
use crate::models::{GenerationModel, LentModel, ScoringModel, SharedModels};

/// What a model folder's `config.json` says it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelHead {
    /// `*ForSequenceClassification` / `*ForRewardModel`.
    Score,
    /// `*ForCausalLM`.
    Generate,
}

/// The head the folder's `architectures` names; `key` is the config key that named the folder.
pub fn model_head(dir: &Path, key: &str) -> anyhow::Result<ModelHead> {
    let file = dir.join("config.json");
    let text = std::fs::read_to_string(&file)
        .with_context(|| format!("{key}: cannot read {}", file.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{key}: {} is not JSON", file.display()))?;
    let class = v
        .get("architectures")
        .and_then(|a| a.as_array())
        .and_then(|a| a.first())
        .and_then(|c| c.as_str())
        .unwrap_or("");
    if class.ends_with("ForSequenceClassification") || class.ends_with("ForRewardModel") {
        Ok(ModelHead::Score)
    } else if class.ends_with("ForCausalLM") {
        Ok(ModelHead::Generate)
    } else {
        bail!(
            "{key}={}: config.json names architecture `{class}`; a reward model is a \
             *ForSequenceClassification or *ForRewardModel checkpoint (scored directly) or a \
             *ForCausalLM one (a generative judge for a reward plugin)",
            dir.display()
        )
    }
}

fn rollout_str(cfg: &Config, key: &str) -> Option<String> {
    cfg.reward
        .reward_model
        .rollout
        .get(key)
        .and_then(|v| v.as_str())
        .map(str::to_string)
}

fn rollout_bool(cfg: &Config, key: &str, default: bool) -> bool {
    cfg.reward
        .reward_model
        .rollout
        .get(key)
        .and_then(|v| v.as_bool())
        .unwrap_or(default)
}

/// The backend's reward model spec from verl's keys.
pub fn reward_model_spec(cfg: &Config, path: &str, world_size: u32) -> RewardModelSpec {
    let rm = &cfg.reward_model;
    let micro = rm.micro_batch_size_per_gpu.or(rm
        .micro_batch_size
        .map(|m| (m / world_size.max(1) as u64).max(1)));
    RewardModelSpec {
        path: path.to_string(),
        path_key: "reward.reward_model.model_path".into(),
        dtype: rollout_str(cfg, "dtype").unwrap_or_else(|| "bfloat16".into()),
        micro_batch_size_per_gpu: micro,
        use_dynamic_bsz: rm.use_dynamic_bsz,
        max_token_len_per_gpu: rm.forward_max_token_len_per_gpu,
        offload: rollout_bool(cfg, "free_cache_engine", true),
    }
}

/// The models the job lends (empty unless `reward_model.enable`). Each rank holds its own copy
/// and scores its own rows, so the roles are created rank-local (world size 1).
pub fn lent_models(
    cfg: &Config,
    backend: &dyn BackendFactory,
    config_json: &serde_json::Value,
    init: &dyn Fn(Role) -> InitArgs,
) -> anyhow::Result<SharedModels> {
    let r = &cfg.reward.reward_model;
    if !r.enable {
        return Ok(SharedModels::default());
    }
    let Some(path) = r.model_path.as_deref() else {
        bail!(
            "reward.reward_model.enable=true (reward_model.enable) needs the reward model's HF \
             folder in reward.reward_model.model_path (reward_model.model.path)"
        );
    };
    let dir = crate::paths::expand_home(path);
    let key = "reward.reward_model.model_path";
    let local = |role: Role| InitArgs {
        world_size: 1,
        rendezvous: None,
        ..init(role)
    };
    let model = match model_head(&dir, key)? {
        ModelHead::Score => {
            let world = init(Role::RewardModel).world_size;
            let spec = reward_model_spec(cfg, &dir.to_string_lossy(), world);
            let mut args = local(Role::RewardModel);
            args.extra = serde_json::json!({ "reward_model": spec });
            let client = backend.create_reward_model(&args).with_context(|| {
                format!("creating the reward model of backend `{}`", backend.name())
            })?;
            LentModel::Score(ScoringModel::new(
                &dir,
                cfg.reward_model.max_length.map(|m| m as usize),
                client,
            )?)
        }
        ModelHead::Generate => {
            // A frozen policy role of the backend on the judge's weights.
            let mut judge_cfg = config_json.clone();
            let m = &mut judge_cfg["actor_rollout_ref"]["model"];
            m["path"] = serde_json::json!(dir.to_string_lossy());
            m["tokenizer_path"] = serde_json::Value::Null;
            let fsdp = &mut judge_cfg["actor_rollout_ref"]["ref"]["fsdp_config"];
            fsdp["param_offload"] = serde_json::json!(rollout_bool(cfg, "free_cache_engine", true));
            // The reward model's dtype is the judge's compute dtype.
            fsdp["dtype"] =
                serde_json::json!(rollout_str(cfg, "dtype").unwrap_or_else(|| "bfloat16".into()));
            if let Some(o) = fsdp.as_object_mut() {
                o.remove("mixed_precision");
            }
            let args = InitArgs {
                config: judge_cfg,
                ..local(Role::Reference)
            };
            let client = backend.create_reference(&args).with_context(|| {
                format!(
                    "creating the generative reward model (a frozen policy on {}) of backend `{}`",
                    dir.display(),
                    backend.name()
                )
            })?;
            LentModel::Generate(GenerationModel::new(&dir, client)?)
        }
    };
    Ok(SharedModels::new(vec![(REWARD_MODEL.to_string(), model)]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backend_spec_follows_verls_keys() {
        let cfg = Config::from_overrides(&[
            "reward_model.enable=true",
            "reward_model.micro_batch_size=8",
            "reward_model.forward_max_token_len_per_gpu=1024",
        ])
        .unwrap();
        let s = reward_model_spec(&cfg, "/rm", 4);
        // The deprecated global micro-batch is split over the ranks; weights offloaded and bf16
        // by default (free_cache_engine, rollout.dtype).
        assert_eq!(s.micro_batch_size_per_gpu, Some(2));
        assert_eq!(s.max_token_len_per_gpu, 1024);
        assert!(s.offload && !s.use_dynamic_bsz);
        assert_eq!(s.dtype, "bfloat16");
        let cfg = Config::from_overrides(&[
            "reward_model.micro_batch_size=8",
            "reward_model.micro_batch_size_per_gpu=3",
            "reward_model.use_dynamic_bsz=true",
            "reward.reward_model.rollout.free_cache_engine=false",
            "reward.reward_model.rollout.dtype=float32",
        ])
        .unwrap();
        let s = reward_model_spec(&cfg, "/rm", 4);
        assert_eq!(s.micro_batch_size_per_gpu, Some(3));
        assert!(!s.offload && s.use_dynamic_bsz);
        assert_eq!(s.dtype, "float32");
    }
}
