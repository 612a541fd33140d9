//! verl-fsdp-engine: the FSDP backend behind the `fsdp` plugin (`plugins/fsdp` exports it) — Actor (generate on the live training weights, log-probs, PPO
//! update with AdamW on fp32 master weights, checkpoints, HF export), Reference (frozen log-probs) and
//! Critic (values, clipped value-loss update, checkpoints) on libtorch.
//!
//! It owns the training mechanics of a role: micro/mini-batching with verl's keys, gradient
//! accumulation under verl-losses' global normaliser, mixed precision, clipping, LR schedules and
//! the backend's checkpoint files. It must not contain RL-loop logic (advantages, rewards, KL
//! control, step scheduling: the host drives those), tokenize, or let a panic or tch exception cross
//! the ABI. A role runs on one rank or, data-parallel, on several ([`dp::Dp`], one communicator per
//! role instance): the actor and critic then shard their fp32 masters, gradients and AdamW state
//! ZeRO-3 style ([`shard`]), gathering each unit's parameters around its use; the frozen reference
//! keeps a full copy per rank.

pub mod actor;
pub mod ckpt_files;
pub mod critic;
pub mod forward;
pub mod packing;
pub mod sft;
pub mod shard;
pub mod train;
pub mod validate;

use verl_plugin_api::{
    Actor, BackendPlugin, BuildInfo, Capability, Critic, InitArgs, PluginInfo, Result, Reward, Role,
};

pub use actor::FsdpActor;
pub use critic::FsdpCritic;
pub use verl_backend_kit::{BackendError, RewardModelRole};

pub struct FsdpPlugin;

const PARALLELISM: &str =
    "one rank or data-parallel ZeRO-3 (params/grads/optimizer sharded; CPU or NCCL collectives)";

impl BackendPlugin for FsdpPlugin {
    fn info() -> PluginInfo {
        PluginInfo {
            name: "fsdp".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            description: format!(
                "FSDP backend: actor (hybrid-engine generation, PPO update), reference and critic ({PARALLELISM})"
            ),
            capabilities: vec![
                Capability {
                    features: vec![
                        verl_plugin_api::FEATURE_LORA.into(),
                        verl_plugin_api::FEATURE_MULTI_TURN.into(),
                    ],
                    ..ready(Role::Actor)
                },
                ready(Role::Reference),
                Capability {
                    features: vec![verl_plugin_api::FEATURE_LORA.into()],
                    ..ready(Role::Critic)
                },
                Capability::ready(Role::RewardModel),
            ],
            build: BuildInfo {
                libtorch: Some(env!("VERL_LIBTORCH_VERSION").into()),
                device: env!("VERL_LIBTORCH_DEVICE").into(),
                ..BuildInfo::plain()
            },
        }
    }
    /// Each role's model folder against the architectures the model code builds ([`validate`]).
    fn validate(init: &InitArgs) -> Option<Result<String>> {
        Some(validate::validate(init).map_err(Into::into))
    }
    fn create_actor(init: &InitArgs) -> Result<Box<dyn Actor>> {
        Ok(Box::new(FsdpActor::create(init, false)?))
    }
    fn create_reference(init: &InitArgs) -> Result<Box<dyn Actor>> {
        Ok(Box::new(FsdpActor::create(init, true)?))
    }
    fn create_critic(init: &InitArgs) -> Result<Box<dyn Critic>> {
        Ok(Box::new(FsdpCritic::create(init)?))
    }
    fn create_reward_model(init: &InitArgs) -> Result<Box<dyn Reward>> {
        Ok(Box::new(RewardModelRole::create(init)?))
    }
}

fn ready(role: Role) -> Capability {
    Capability {
        note: PARALLELISM.into(),
        ..Capability::ready(role)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use verl_plugin_api::testing;

    #[test]
    fn header_lists_ready_roles_and_libtorch() {
        let h = testing::backend_header::<FsdpPlugin>().unwrap();
        assert_eq!(h.name, "fsdp");
        assert!(h.provides(Role::Actor));
        assert!(h.provides(Role::Reference));
        assert!(h.provides(Role::Critic));
        assert!(h.build.libtorch.as_deref().unwrap().starts_with("2.11"));
    }

    #[test]
    fn missing_model_path_names_the_key() {
        let init = InitArgs::new(
            Role::Actor,
            serde_json::json!({"trainer": {"device": "cpu"}}),
        );
        let e = testing::actor::<FsdpPlugin>(&init).err().unwrap();
        assert!(
            e.to_string().contains("actor_rollout_ref.model.path"),
            "{e}"
        );
    }

    #[test]
    fn the_upfront_check_refuses_an_architecture_it_cannot_build() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 64}"#,
        )
        .unwrap();
        let path = dir.path().to_str().unwrap();
        let init = InitArgs::new(
            Role::Actor,
            serde_json::json!({"actor_rollout_ref": {"model": {"path": path}}}),
        );
        let e = testing::validate::<FsdpPlugin>(&init)
            .expect("the fsdp backend checks its models upfront")
            .unwrap_err()
            .to_string();
        assert!(e.contains("gpt_oss") && e.contains("config.json"), "{e}");
        // A missing folder names the key.
        let init = InitArgs::new(
            Role::Actor,
            serde_json::json!({"actor_rollout_ref": {"model": {"path": "/nonexistent/m"}}}),
        );
        let e = testing::validate::<FsdpPlugin>(&init)
            .unwrap()
            .unwrap_err()
            .to_string();
        assert!(e.contains("actor_rollout_ref.model.path"), "{e}");
    }
}
