//! verl-megatron: the Megatron backend plugin — Actor, Reference and Critic with tensor parallelism
//! (vocab-parallel embedding and log-probs, column/row-parallel projections), pipeline parallelism
//! (decoder layers split evenly over stages, the 1F1B schedule or, with virtual pipeline
//! parallelism, Megatron's interleaved 1F1B over several model chunks per stage) and data parallelism (optionally
//! with Megatron's distributed optimizer) over the remaining ranks, and expert parallelism for
//! mixture-of-experts models (Megatron-core's expert grid: the routed experts shared out over
//! expert-parallel groups and split over expert-tensor-parallel groups, [`moe`]), in Megatron's
//! rank order and with verl's `*.megatron.*` keys.
//!
//! It owns a role's parallel layout ([`layout`]), its groups ([`parallel`]), the tensor-parallel
//! model ([`tp`]) and its pipeline stages ([`pipeline`]), its training mechanics ([`train`]) and
//! layout-independent checkpoints ([`ckpt`]); [`validate`] checks every role's layout upfront
//! (`verl run --dry-run`) from config.json alone. It must not contain RL-loop logic (advantages, rewards, KL control, step
//! scheduling: the host drives those), tokenize, or let a panic or tch exception cross the ABI.
//! Generation (the `verl_rollout` engine) runs tensor-parallel on the training shards themselves
//! (rollout TP = actor TP, the default) or on a TP=1 copy gathered from them (rollout TP = 1, and
//! pipeline-parallel or MoE models) ([`rollout`]).

pub mod actor;
pub mod ckpt;
pub mod common;
pub mod critic;
pub mod error;
pub mod layout;
pub mod moe;
pub mod offload;
pub mod parallel;
pub mod pipeline;
pub mod rollout;
pub mod source;
pub mod tp;
pub mod train;
pub mod validate;

use verl_plugin_api::{
    Actor, BackendPlugin, BuildInfo, Capability, Critic, InitArgs, PluginInfo, Result, Reward, Role,
};

pub use actor::MegatronActor;
pub use critic::MegatronCritic;
pub use error::MegatronError;

pub struct MegatronPlugin;

const PARALLELISM: &str = "tensor parallel (vocab-parallel embedding/log-probs, column/row-parallel attention and MLP, sequence parallelism: residual stream and norms sharded along the sequence with all-gather / reduce-scatter around the parallel linears) × pipeline parallel (layers split evenly over stages, 1F1B schedule, or with virtual_pipeline_model_parallel_size Megatron's interleaved 1F1B schedule over model chunks holding virtual stage chunk × pp + stage, tied embeddings shared between first and last stage) × data parallel (distributed optimizer optional) × expert parallel for Mixtral / Qwen2-MoE / Qwen3-MoE (Megatron-core's expert grid: each stage's tensor × data-parallel ranks as expert-tensor × expert × expert-data-parallel, any expert_tensor_parallel_size; all-to-all token dispatch, under sequence parallelism each rank routing its own sequence shard; Switch load-balancing loss and per-expert load metrics); generation at its own tensor-parallel size (rollout tensor_model_parallel_size: any divisor of the actor's TP, or a multiple of it the ranks split into; resharded from the training shards by all-gathers within blocks of neighbouring TP ranks, slices and pipeline-stage exchanges; each rollout group generating its own share of the prompts; MoE models at rollout TP 1); checkpoints reshard across TP/PP/VPP/DP/EP sizes";
const PLANNED: &str = "planned: context parallelism";

impl BackendPlugin for MegatronPlugin {
    fn info() -> PluginInfo {
        PluginInfo {
            name: "megatron".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            description: format!(
                "Megatron backend: actor (PPO update, generation), reference and critic — {PARALLELISM}; {PLANNED}"
            ),
            capabilities: vec![
                ready(Role::Actor),
                ready(Role::Reference),
                ready(Role::Critic),
                Capability {
                    note: "whole model on each rank".into(),
                    ..Capability::ready(Role::RewardModel)
                },
            ],
            build: BuildInfo {
                libtorch: Some(env!("VERL_LIBTORCH_VERSION").into()),
                device: env!("VERL_LIBTORCH_DEVICE").into(),
                ..BuildInfo::plain()
            },
        }
    }
    fn create_actor(init: &InitArgs) -> Result<Box<dyn Actor>> {
        Ok(Box::new(MegatronActor::create(init, false)?))
    }
    fn create_reference(init: &InitArgs) -> Result<Box<dyn Actor>> {
        Ok(Box::new(MegatronActor::create(init, true)?))
    }
    fn create_critic(init: &InitArgs) -> Result<Box<dyn Critic>> {
        Ok(Box::new(MegatronCritic::create(init)?))
    }
    /// The reward model is frozen and scores whole sequences: every rank holds the whole model
    /// and scores its own rows (the backend-neutral role of `verl-fsdp`).
    fn create_reward_model(init: &InitArgs) -> Result<Box<dyn Reward>> {
        Ok(Box::new(verl_backend_kit::RewardModelRole::create(init)?))
    }
    /// Each role's layout against the world size and the model's config.json ([`validate`]).
    fn validate(init: &InitArgs) -> Option<Result<String>> {
        Some(validate::validate(init).map_err(Into::into))
    }
}

fn ready(role: Role) -> Capability {
    Capability {
        note: format!("{PARALLELISM}; {PLANNED}"),
        ..Capability::ready(role)
    }
}

verl_plugin_api::export_backend_plugin!(MegatronPlugin);

#[cfg(test)]
mod tests {
    use super::*;
    use verl_plugin_api::testing;

    #[test]
    fn header_lists_ready_roles_supported_and_planned_parallelism() {
        let h = testing::backend_header::<MegatronPlugin>().unwrap();
        assert_eq!(h.name, "megatron");
        assert!(h.provides(Role::Actor));
        assert!(h.provides(Role::Reference));
        assert!(h.provides(Role::Critic));
        assert!(
            h.description
                .contains("pipeline parallel (layers split evenly over stages, 1F1B"),
            "{}",
            h.description
        );
        assert!(
            h.description
                .contains("interleaved 1F1B schedule over model chunks"),
            "{}",
            h.description
        );
        assert!(h.build.libtorch.as_deref().unwrap().starts_with("2.11"));
    }

    #[test]
    fn validate_through_the_abi_names_a_missing_model_path() {
        let init = InitArgs::new(
            Role::Actor,
            serde_json::json!({"trainer": {"device": "cpu"}}),
        );
        let e = testing::validate::<MegatronPlugin>(&init)
            .expect("the megatron backend validates layouts")
            .unwrap_err()
            .to_string();
        assert!(e.contains("layout validation"), "{e}");
        assert!(e.contains("actor_rollout_ref.model.path"), "{e}");
    }

    #[test]
    fn missing_model_path_names_the_key() {
        let init = InitArgs::new(
            Role::Actor,
            serde_json::json!({"trainer": {"device": "cpu"}}),
        );
        let e = testing::actor::<MegatronPlugin>(&init).err().unwrap();
        assert!(
            e.to_string().contains("actor_rollout_ref.model.path"),
            "{e}"
        );
    }
}
