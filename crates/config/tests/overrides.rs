//! Hydra-style overrides: value grammar, `+`, `~`, and errors.

use serde_yaml::Value;
use verl_config::{parse_value, Config, ConfigError, OneOrMany, Override, OverrideKind};

fn v(text: &str) -> Value {
    parse_value(text).unwrap_or_else(|e| panic!("{text}: {e}"))
}

fn yaml(text: &str) -> Value {
    serde_yaml::from_str(text).unwrap()
}

#[test]
fn scalars_are_typed_like_hydra() {
    assert_eq!(v("42"), Value::from(42));
    assert_eq!(v("-7"), Value::from(-7));
    assert_eq!(v("1_000"), Value::from(1000));
    assert_eq!(v("1e-6"), Value::from(1e-6));
    assert_eq!(v("3.5E+2"), Value::from(350.0));
    assert_eq!(v(".5"), Value::from(0.5));
    assert_eq!(v("-0.25"), Value::from(-0.25));
    assert_eq!(v("inf"), Value::from(f64::INFINITY));
    assert_eq!(v("true"), Value::Bool(true));
    assert_eq!(v("False"), Value::Bool(false));
    assert_eq!(v("null"), Value::Null);
    assert_eq!(v("NULL"), Value::Null);
    assert_eq!(v("vllm"), Value::from("vllm"));
    assert_eq!(
        v("~/models/Qwen2.5-0.5B"),
        Value::from("~/models/Qwen2.5-0.5B")
    );
    assert_eq!(v("1.2.3"), Value::from("1.2.3"));
    assert_eq!(v("  padded  "), Value::from("padded"));
    assert_eq!(v(""), Value::from(""));
    assert_eq!(v("'42'"), Value::from("42"));
    assert_eq!(v("\"a, b\""), Value::from("a, b"));
    assert_eq!(v(r#""say \"hi\"""#), Value::from("say \"hi\""));
    assert_eq!(
        v("${trainer.project_name}"),
        Value::from("${trainer.project_name}")
    );
    assert_eq!(v("${oc.select:a.b,{}}"), Value::from("${oc.select:a.b,{}}"));
}

#[test]
fn lists_and_maps() {
    assert_eq!(v("[1,2,x]"), yaml("[1, 2, x]"));
    assert_eq!(v("[]"), yaml("[]"));
    assert_eq!(v("['console', \"wandb\"]"), yaml("[console, wandb]"));
    assert_eq!(v("[[1, 2], [3]]"), yaml("[[1, 2], [3]]"));
    assert_eq!(
        v("[0.9, 1e-3, null, true]"),
        yaml("[0.9, 0.001, null, true]")
    );
    assert_eq!(v("{k: v, n: 3}"), yaml("{k: v, n: 3}"));
    assert_eq!(v("{}"), yaml("{}"));
    assert_eq!(
        v("{url: http://host:8080/x, ids: [1, 2]}"),
        yaml("{url: 'http://host:8080/x', ids: [1, 2]}")
    );
    assert_eq!(v("{'quoted key': 1}"), yaml("{quoted key: 1}"));
}

#[test]
fn malformed_values_are_explained() {
    for (text, needle) in [
        ("a,b", "sweep"),
        ("[1, 2", "missing `]`"),
        ("{a: 1", "missing `}`"),
        ("{a 1}", "expected `:`"),
        ("'open", "unterminated"),
        ("[1] x", "unexpected `x`"),
        ("${a.b", "unterminated `${`"),
    ] {
        let e = parse_value(text).unwrap_err();
        assert!(e.contains(needle), "{text}: {e}");
    }
}

#[test]
fn override_kinds_parse() {
    let o = Override::parse("+a.b=1").unwrap();
    assert_eq!(
        (o.kind, o.key.clone(), o.value.clone()),
        (
            OverrideKind::Add,
            vec!["a".into(), "b".into()],
            Some(Value::from(1))
        )
    );
    assert_eq!(
        Override::parse("++a=x").unwrap().kind,
        OverrideKind::ForceAdd
    );
    let d = Override::parse("~a.b").unwrap();
    assert_eq!((d.kind, d.value), (OverrideKind::Delete, None));
    assert_eq!(
        Override::parse("a.b=c=d").unwrap().value,
        Some(Value::from("c=d"))
    );
    for bad in ["a.b", "=3", "a..b=1", "a b=1", ".a=1"] {
        assert!(
            matches!(
                Override::parse(bad),
                Err(ConfigError::OverrideSyntax { .. })
            ),
            "{bad}"
        );
    }
}

#[test]
fn overrides_set_typed_values() {
    let c = Config::from_overrides(&[
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.optim.betas=[0.9,0.95]",
        "trainer.logger=['console','wandb']",
        "trainer.experiment_name=2024",
        "trainer.total_training_steps=null",
        "trainer.val_before_train=False",
        "data.train_files=/data/train.parquet",
        "data.val_batch_size=64",
        "actor_rollout_ref.rollout.temperature=0.7",
        "actor_rollout_ref.rollout.val_kwargs={n: 4, do_sample: true}",
        "algorithm.kl_ctrl.type=adaptive",
        "plugins.reward.routes={openai/gsm8k: rewards, math: mathrw}",
    ])
    .unwrap();
    let arr = &c.actor_rollout_ref;
    assert_eq!(arr.actor.optim.lr, 1e-6);
    assert_eq!(arr.actor.optim.betas, vec![0.9, 0.95]);
    assert_eq!(c.trainer.logger.to_vec(), vec!["console", "wandb"]);
    assert_eq!(c.trainer.experiment_name, "2024");
    assert_eq!(c.trainer.total_training_steps, None);
    assert!(!c.trainer.val_before_train);
    assert_eq!(
        c.data.train_files,
        OneOrMany::One("/data/train.parquet".into())
    );
    assert_eq!(c.data.val_batch_size, Some(64));
    assert_eq!(arr.rollout.temperature, 0.7);
    // A `{...}` on a structured section merges: the keys not given keep their values.
    assert_eq!(arr.rollout.val_kwargs.n, 4);
    assert!(arr.rollout.val_kwargs.do_sample);
    assert_eq!(arr.rollout.val_kwargs.top_p, 1.0);
    assert_eq!(c.reward_plugin_for("math"), "mathrw");
}

#[test]
fn overrides_apply_in_order_after_the_file() {
    let c = Config::from_yaml_str(
        "trainer:\n  total_epochs: 3\n",
        "job.yaml",
        &["trainer.total_epochs=5", "trainer.total_epochs=7"],
    )
    .unwrap();
    assert_eq!(c.trainer.total_epochs, 7);
}

#[test]
fn override_of_a_missing_key_suggests_the_right_one() {
    let err = Config::from_overrides(&["trainer.totl_epochs=3"]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "override `trainer.totl_epochs=3`: there is no key `trainer.totl_epochs` in the config; did you mean `trainer.total_epochs`?"
    );
    match Config::from_overrides(&["actor_rollout_ref.rollout.ppo_mini_batch_size=3"]).unwrap_err()
    {
        ConfigError::OverrideMissingKey { suggestion, .. } => assert_eq!(
            suggestion.as_deref(),
            Some("actor_rollout_ref.actor.ppo_mini_batch_size")
        ),
        other => panic!("{other:?}"),
    }
    // Keys given inside a `{...}` value are schema-checked too.
    let err = Config::from_overrides(&["algorithm.kl_ctrl={kl_coeff: 0.1}"]).unwrap_err();
    assert!(
        matches!(err, ConfigError::UnknownKey { ref key, .. } if key == "algorithm.kl_ctrl.kl_coeff"),
        "{err}"
    );
}

#[test]
fn override_with_a_wrong_type_names_the_override() {
    match Config::from_overrides(&["trainer.total_epochs=many"]).unwrap_err() {
        ConfigError::TypeMismatch { key, origin, .. } => {
            assert_eq!(key, "trainer.total_epochs");
            assert_eq!(origin, "override `trainer.total_epochs=many`");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn plus_adds_keys_only_inside_free_form_maps() {
    let c = Config::from_overrides(&[
        "+actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=4",
        "+custom_reward_function.reward_kwargs.method=flexible",
        "+data.apply_chat_template_kwargs.enable_thinking=false",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
        // `+` on a key the schema has is accepted as a plain set (verl's scripts do this).
        "+actor_rollout_ref.actor.fsdp_config.model_dtype=bf16",
    ])
    .unwrap();
    let arr = &c.actor_rollout_ref;
    assert_eq!(
        arr.rollout.engine_kwargs["vllm"]["swap_space"],
        Value::from(4)
    );
    assert_eq!(
        c.custom_reward_function.reward_kwargs["method"],
        Value::from("flexible")
    );
    assert_eq!(
        c.reward.custom_reward_function.reward_kwargs["method"],
        Value::from("flexible"),
        "verl 0.10's name of the setting carries it too"
    );
    assert_eq!(
        c.data.apply_chat_template_kwargs["enable_thinking"],
        Value::Bool(false)
    );
    assert_eq!(
        arr.actor.fsdp_config.mixed_precision["param_dtype"],
        Value::from("bf16")
    );
    assert_eq!(arr.actor.fsdp_config.model_dtype, "bf16");
    // The section handed to a plugin carries the added keys.
    assert!(c
        .section_yaml("actor_rollout_ref.rollout")
        .unwrap()
        .contains("swap_space: 4"));

    let err = Config::from_overrides(&["+trainer.my_flag=1"]).unwrap_err();
    assert!(
        matches!(err, ConfigError::OverrideAddNotAllowed { ref key, .. } if key == "trainer.my_flag"),
        "{err}"
    );
    assert!(err.to_string().contains("free-form map"), "{err}");
    let err = Config::from_overrides(&["+trainer.total_epoch=1"]).unwrap_err();
    assert!(
        err.to_string()
            .contains("did you mean `trainer.total_epochs`"),
        "{err}"
    );
}

#[test]
fn tilde_deletes_back_to_the_default() {
    let c = Config::from_yaml_str(
        "trainer:\n  total_epochs: 3\nactor_rollout_ref:\n  rollout:\n    engine_kwargs:\n      vllm:\n        swap_space: 4\n",
        "job.yaml",
        &["~trainer.total_epochs", "~actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space"],
    )
    .unwrap();
    assert_eq!(c.trainer.total_epochs, 30);
    assert!(c.actor_rollout_ref.rollout.engine_kwargs["vllm"]
        .as_mapping()
        .unwrap()
        .is_empty());
    // Deleting a whole section restores all of it, interpolations included.
    let c = Config::from_yaml_str(
        "critic:\n  ppo_mini_batch_size: 8\n",
        "job.yaml",
        &["actor_rollout_ref.actor.ppo_mini_batch_size=64", "~critic"],
    )
    .unwrap();
    assert_eq!(c.critic.ppo_mini_batch_size, 64);

    let err = Config::from_overrides(&["~trainer.totl_epochs"]).unwrap_err();
    assert!(
        matches!(err, ConfigError::OverrideMissingKey { .. }),
        "{err}"
    );
    let err =
        Config::from_overrides(&["~actor_rollout_ref.rollout.engine_kwargs.vllm.nothing_here"])
            .unwrap_err();
    assert!(
        matches!(err, ConfigError::OverrideMissingKey { .. }),
        "{err}"
    );
}

#[test]
fn every_bad_override_is_reported() {
    let err = Config::from_overrides(&["trainer.totl_epochs=1", "data.train_bach_size=2", "bad"])
        .unwrap_err();
    assert_eq!(err.errors().len(), 3, "{err}");
}

#[test]
fn plus_turns_a_null_free_form_default_into_a_map() {
    // override_optimizer_config defaults to null; `+` makes it a map, which verl-rs then refuses
    // by name (Megatron-LM optimizer overrides).
    let e = Config::from_overrides(&[
        "+actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload=true",
    ])
    .unwrap_err()
    .to_string();
    assert!(
        e.contains(
            "actor_rollout_ref.actor.optim.override_optimizer_config={\"optimizer_cpu_offload\":true}"
        ),
        "{e}"
    );
}

#[test]
fn a_backslash_makes_a_special_character_literal_as_in_hydra() {
    // verl's fsdp_turbo examples: a map key with braces in a free-form map.
    assert_eq!(
        v(r"{model.visual.blocks.\{*\}:{},lm_head:{}}"),
        yaml("{'model.visual.blocks.{*}': {}, lm_head: {}}")
    );
    assert_eq!(v(r"a\,b"), Value::from("a,b"));
    assert_eq!(v(r"x\=1\ y"), Value::from("x=1 y"));
    // A backslash before anything else stays (a Windows-style path).
    assert_eq!(v(r"C:\models\qwen"), Value::from(r"C:\models\qwen"));
    // The escaped map reaches a free-form key unchanged.
    let c = Config::from_overrides(&[
        r"+actor_rollout_ref.actor.fsdp_config.turbo_config.fsdp_plan.apply_modules={model.layers.\{*\}:{}}",
    ])
    .unwrap();
    assert!(
        c.warnings.iter().any(|w| w.contains("turbo_config")),
        "{:?}",
        c.warnings
    );
}
