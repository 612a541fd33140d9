//! verl's two config layouts (0.7 and 0.10) name the same settings; and keys that act for some
//! values or backends only refuse the others by name.

use serde_yaml::Value;
use verl_config::Config;

fn ok(overrides: &[&str]) -> Config {
    Config::from_overrides(overrides).unwrap_or_else(|e| panic!("{overrides:?}: {e}"))
}

fn refused(overrides: &[&str]) -> String {
    match Config::from_overrides(overrides) {
        Ok(_) => panic!("{overrides:?} loaded, but should be refused"),
        Err(e) => e.to_string(),
    }
}

/// The same job in verl 0.7's and verl 0.10's spelling.
const OLD_LAYOUT: &[&str] = &[
    "custom_reward_function.reward_kwargs={method: flexible}",
    "critic.model.fsdp_config.param_offload=true",
    "critic.model.fsdp_config.model_dtype=bf16",
    "actor_rollout_ref.actor.grad_clip=0.5",
    "critic.grad_clip=0.7",
    "actor_rollout_ref.actor.strategy=fsdp",
    "reward_model.reward_manager=naive",
];
const NEW_LAYOUT: &[&str] = &[
    "reward.custom_reward_function.reward_kwargs={method: flexible}",
    "critic.fsdp.param_offload=true",
    "critic.fsdp.model_dtype=bf16",
    "actor_rollout_ref.actor.optim.clip_grad=0.5",
    "critic.optim.clip_grad=0.7",
    "model_engine=dp",
    "reward.reward_manager.name=naive",
];

#[test]
fn a_job_in_verl_0_7_and_0_10_layouts_is_the_same_config() {
    let old = ok(OLD_LAYOUT);
    let new = ok(NEW_LAYOUT);
    assert_eq!(old.to_value().unwrap(), new.to_value().unwrap());
    // Both names of each setting carry the value, whichever the job used.
    for c in [&old, &new] {
        assert!(c.critic.fsdp.param_offload && c.critic.model.fsdp_config.param_offload);
        assert_eq!(c.critic.fsdp.model_dtype, "bf16");
        assert_eq!(c.critic.model.fsdp_config.model_dtype, "bf16");
        assert_eq!(c.actor_rollout_ref.actor.grad_clip, 0.5);
        assert_eq!(c.actor_rollout_ref.actor.optim.clip_grad, 0.5);
        assert_eq!(c.critic.grad_clip, 0.7);
        assert_eq!(
            c.custom_reward_function.reward_kwargs["method"],
            Value::from("flexible")
        );
    }
}

#[test]
fn two_names_of_one_setting_with_different_values_are_an_error_naming_both() {
    let e = refused(&[
        "critic.model.fsdp_config.param_offload=true",
        "critic.fsdp.param_offload=false",
    ]);
    assert!(
        e.contains("critic.fsdp.param_offload=false")
            && e.contains("critic.model.fsdp_config.param_offload=true"),
        "{e}"
    );
    let e = refused(&[
        "actor_rollout_ref.actor.grad_clip=0.5",
        "actor_rollout_ref.actor.optim.clip_grad=1.5",
    ]);
    assert!(
        e.contains("actor_rollout_ref.actor.grad_clip") && e.contains("optim.clip_grad"),
        "{e}"
    );
    // Equal values in both spellings are fine.
    ok(&[
        "critic.model.fsdp_config.param_offload=true",
        "critic.fsdp.param_offload=true",
    ]);
}

#[test]
fn a_job_file_in_the_old_layout_and_overrides_in_the_new_one_meet() {
    let yaml = "critic:\n  model:\n    fsdp_config:\n      optimizer_offload: true\n";
    let c = Config::from_yaml_str(yaml, "job.yaml", &["critic.fsdp.param_offload=true"]).unwrap();
    assert!(c.critic.fsdp.optimizer_offload && c.critic.fsdp.param_offload);
    let e = Config::from_yaml_str(yaml, "job.yaml", &["critic.fsdp.optimizer_offload=false"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("job.yaml") && e.contains("override"), "{e}");
}

#[test]
fn model_engine_and_strategy_are_one_setting() {
    let c = ok(&["model_engine=megatron"]);
    assert_eq!(c.actor_rollout_ref.actor.strategy, "megatron");
    assert_eq!(c.actor_rollout_ref.reference.strategy, "megatron");
    assert_eq!(c.critic.strategy, "megatron");
    assert_eq!(c.backend_plugin(), "megatron");
    let c = ok(&["actor_rollout_ref.actor.strategy=megatron"]);
    assert_eq!(c.model_engine, "megatron");
    assert_eq!(c.critic.strategy, "megatron");
    let c = ok(&["actor_rollout_ref.actor.strategy=fsdp2"]);
    assert_eq!(c.model_engine, "dp");
    let c = ok(&[]);
    assert_eq!(
        (c.model_engine.as_str(), c.backend_plugin().as_str()),
        ("dp", "fsdp")
    );
    let e = refused(&[
        "model_engine=megatron",
        "actor_rollout_ref.actor.strategy=fsdp",
    ]);
    assert!(
        e.contains("model_engine=megatron") && e.contains("actor_rollout_ref.actor.strategy=fsdp"),
        "{e}"
    );
    let e = refused(&["model_engine=veomni"]);
    assert!(
        e.contains("`model_engine=veomni`") && e.contains("megatron"),
        "{e}"
    );
}

#[test]
fn roles_run_on_one_backend() {
    let e = refused(&["model_engine=megatron", "critic.strategy=fsdp"]);
    assert!(e.contains("critic.strategy=fsdp"), "{e}");
    let e = refused(&["actor_rollout_ref.ref.strategy=megatron"]);
    assert!(e.contains("actor_rollout_ref.ref.strategy=megatron"), "{e}");
    ok(&["model_engine=megatron", "critic.strategy=megatron"]);
}

#[test]
fn keys_of_the_other_backend_are_refused_by_name() {
    let e = refused(&["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"]);
    assert!(
        e.contains("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2")
            && e.contains("configures the megatron backend")
            && e.contains("model_engine=megatron"),
        "{e}"
    );
    let e = refused(&[
        "model_engine=megatron",
        "actor_rollout_ref.actor.fsdp_config.param_offload=true",
    ]);
    assert!(e.contains("configures the fsdp backend"), "{e}");
    // With a third-party backend plugin, its keys are its own business.
    ok(&[
        "plugins.backend=./libmine.so",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
    ]);
}

#[test]
fn grad_clip_and_clip_grad_are_one_setting() {
    for key in [
        "actor_rollout_ref.actor.grad_clip=0.25",
        "actor_rollout_ref.actor.optim.clip_grad=0.25",
    ] {
        let c = ok(&[key]);
        let section = c.section_json("actor_rollout_ref.actor").unwrap();
        let v: serde_json::Value = serde_json::from_str(&section).unwrap();
        // The backends read `grad_clip`; verl 0.10 spells it `optim.clip_grad`.
        assert_eq!(v["grad_clip"], 0.25, "{key}");
        assert_eq!(v["optim"]["clip_grad"], 0.25, "{key}");
    }
}

#[test]
fn fsdp_size_shards_over_every_rank_or_is_refused() {
    ok(&["actor_rollout_ref.actor.fsdp_config.fsdp_size=-1"]);
    ok(&[
        "trainer.n_gpus_per_node=4",
        "actor_rollout_ref.actor.fsdp_config.fsdp_size=4",
    ]);
    let e = refused(&[
        "trainer.n_gpus_per_node=8",
        "actor_rollout_ref.actor.fsdp_config.fsdp_size=4",
    ]);
    assert!(
        e.contains("fsdp_size=4") && e.contains("hybrid sharding") && e.contains("-1"),
        "{e}"
    );
}

#[test]
fn rollout_dtype_must_be_the_compute_dtype() {
    ok(&["actor_rollout_ref.rollout.dtype=bf16"]);
    ok(&[
        "actor_rollout_ref.actor.fsdp_config.dtype=float32",
        "actor_rollout_ref.rollout.dtype=fp32",
    ]);
    let e = refused(&["actor_rollout_ref.rollout.dtype=float16"]);
    assert!(
        e.contains("actor_rollout_ref.rollout.dtype=float16") && e.contains("bfloat16"),
        "{e}"
    );
}

#[test]
fn raw_rollout_log_probs_are_refused() {
    ok(&["actor_rollout_ref.rollout.logprobs_mode=processed_logits"]);
    let e = refused(&["actor_rollout_ref.rollout.logprobs_mode=raw_logprobs"]);
    assert!(e.contains("processed_logprobs"), "{e}");
}

#[test]
fn reward_managers_other_than_naive_and_dapo_are_refused() {
    ok(&["reward.reward_manager.name=naive"]);
    for spelling in [
        "reward_model.reward_manager=dapo",
        "reward_manager.name=dapo",
        "reward.reward_manager.name=dapo",
    ] {
        ok(&[spelling]);
    }
    // DAPO's overlong buffer, in verl's legacy spelling, with the dapo manager.
    ok(&[
        "reward_model.reward_manager=dapo",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=true",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.len=512",
        "+reward_model.reward_kwargs.max_resp_len=2048",
    ]);
    // Without it, the arguments would be read by nothing.
    let e = refused(&["+reward_model.reward_kwargs.overlong_buffer_cfg.enable=true"]);
    assert!(
        e.contains("overlong_buffer_cfg") && e.contains("naive"),
        "{e}"
    );
    let e = refused(&[
        "reward_model.reward_manager=dapo",
        "+reward.reward_kwargs.temperature=1",
    ]);
    assert!(e.contains("temperature"), "{e}");
    for spelling in [
        "reward.reward_manager.name=prime",
        "reward_manager.name=limited",
    ] {
        let e = refused(&[spelling]);
        assert!(e.contains("naive") && e.contains("dapo"), "{e}");
    }
    // The batch manager calls a batch function: only with one.
    let e = refused(&["reward_manager.name=batch"]);
    assert!(e.contains("custom_reward_function.path"), "{e}");
    ok(&[
        "custom_reward_function.path=/tmp/batch.py",
        "reward_manager.name=batch",
    ]);
    let e = refused(&["reward.reward_manager.source=importlib"]);
    assert!(e.contains("importlib"), "{e}");
}

#[test]
fn asynchronous_trainer_modes_are_refused() {
    ok(&["trainer.v1.trainer_mode=sync"]);
    let e = refused(&["trainer.v1.trainer_mode=separate_async"]);
    assert!(e.contains("separate_async") && e.contains("sync"), "{e}");
}

#[test]
fn engine_knobs_load_with_one_warning_each() {
    let c = ok(&[
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.enable_chunked_prefill=false",
        "+actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=4",
        "trainer.ray_wait_register_center_timeout=600",
    ]);
    assert_eq!(c.warnings.len(), 4, "{:#?}", c.warnings);
    for key in [
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.enable_chunked_prefill=false",
        "actor_rollout_ref.rollout.engine_kwargs=",
        "trainer.ray_wait_register_center_timeout=600",
    ] {
        assert!(
            c.warnings.iter().any(|w| w.contains(key)),
            "{key}: {:#?}",
            c.warnings
        );
    }
    // A key set to its default is no request at all.
    assert!(
        ok(&["actor_rollout_ref.rollout.enable_chunked_prefill=true"])
            .warnings
            .is_empty()
    );
}

#[test]
fn checkpoint_contents_are_the_full_set_plus_an_hf_export() {
    ok(&["actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]"]);
    ok(&["actor_rollout_ref.actor.checkpoint.load_contents=[extra,model,optimizer]"]);
    let e = refused(&["actor_rollout_ref.actor.checkpoint.save_contents=[model]"]);
    assert!(e.contains("without optimizer, extra"), "{e}");
    let e = refused(&[
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,weights]",
    ]);
    assert!(e.contains("weights"), "{e}");
    let e = refused(&["critic.checkpoint.load_contents=[model]"]);
    assert!(e.contains("critic.checkpoint.load_contents"), "{e}");
}
