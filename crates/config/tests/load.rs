//! Loading job files: defaults, partial configs, schema errors, interpolation, helpers.

use serde_yaml::Value;
use verl_config::{Config, ConfigError, OneOrMany};

const NONE: &[&str] = &[];

fn fixture(name: &str) -> String {
    format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"))
}

fn yaml(text: &str) -> Result<Config, ConfigError> {
    Config::from_yaml_str(text, "job.yaml", NONE)
}

fn num(v: Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v:?}"))
}

#[test]
fn defaults_equal_verls_for_a_sample_of_keys() {
    let c = Config::default();
    let expect_num = [
        ("data.train_batch_size", 1024.0),
        ("data.max_prompt_length", 512.0),
        ("data.max_response_length", 512.0),
        ("actor_rollout_ref.actor.ppo_mini_batch_size", 256.0),
        ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", 16384.0),
        ("actor_rollout_ref.actor.optim.lr", 1e-6),
        ("actor_rollout_ref.actor.optim.weight_decay", 0.01),
        ("actor_rollout_ref.actor.clip_ratio", 0.2),
        ("actor_rollout_ref.actor.clip_ratio_c", 3.0),
        ("actor_rollout_ref.actor.kl_loss_coef", 0.001),
        ("actor_rollout_ref.actor.ppo_epochs", 1.0),
        ("actor_rollout_ref.rollout.n", 1.0),
        ("actor_rollout_ref.rollout.temperature", 1.0),
        ("actor_rollout_ref.rollout.top_p", 1.0),
        ("actor_rollout_ref.rollout.top_k", -1.0),
        ("actor_rollout_ref.rollout.prompt_length", 512.0),
        ("actor_rollout_ref.rollout.response_length", 512.0),
        ("actor_rollout_ref.rollout.gpu_memory_utilization", 0.5),
        ("actor_rollout_ref.rollout.tensor_model_parallel_size", 2.0),
        ("actor_rollout_ref.rollout.val_kwargs.temperature", 0.0),
        ("actor_rollout_ref.rollout.val_kwargs.n", 1.0),
        (
            "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
            16384.0,
        ),
        ("critic.optim.lr", 1e-5),
        ("critic.ppo_mini_batch_size", 256.0),
        ("critic.ppo_max_token_len_per_gpu", 32768.0),
        ("critic.forward_max_token_len_per_gpu", 32768.0),
        ("critic.cliprange_value", 0.5),
        ("algorithm.gamma", 1.0),
        ("algorithm.lam", 1.0),
        ("algorithm.kl_ctrl.kl_coef", 0.001),
        ("algorithm.kl_ctrl.horizon", 10000.0),
        ("algorithm.kl_ctrl.target_kl", 0.1),
        ("trainer.total_epochs", 30.0),
        ("trainer.nnodes", 1.0),
        ("trainer.n_gpus_per_node", 8.0),
        ("trainer.save_freq", -1.0),
        ("trainer.test_freq", -1.0),
        ("trainer.critic_warmup", 0.0),
    ];
    for (key, want) in expect_num {
        assert_eq!(num(c.get_path(key).unwrap()), want, "{key}");
    }
    let expect_text = [
        ("actor_rollout_ref.actor.strategy", "fsdp"),
        ("actor_rollout_ref.ref.strategy", "fsdp"),
        ("actor_rollout_ref.actor.loss_agg_mode", "token-mean"),
        ("actor_rollout_ref.actor.kl_loss_type", "low_var_kl"),
        ("actor_rollout_ref.actor.policy_loss.loss_mode", "vanilla"),
        ("actor_rollout_ref.rollout.do_sample", "true"),
        ("actor_rollout_ref.rollout.val_kwargs.do_sample", "false"),
        ("algorithm.adv_estimator", "gae"),
        ("algorithm.norm_adv_by_std_in_grpo", "true"),
        ("algorithm.use_kl_in_reward", "false"),
        ("algorithm.kl_penalty", "kl"),
        ("algorithm.kl_ctrl.type", "fixed"),
        ("trainer.project_name", "verl_examples"),
        ("trainer.experiment_name", "gsm8k"),
        (
            "trainer.default_local_dir",
            "checkpoints/verl_examples/gsm8k",
        ),
        ("trainer.resume_mode", "auto"),
        ("trainer.val_before_train", "true"),
        ("trainer.device", "cuda"),
        ("trainer.total_training_steps", "null"),
        ("trainer.max_actor_ckpt_to_keep", "null"),
        ("data.val_batch_size", "null"),
        ("data.prompt_key", "prompt"),
        ("data.reward_fn_key", "data_source"),
        ("reward_manager.name", "naive"),
        ("custom_reward_function.name", "compute_score"),
        (
            "critic.model.tokenizer_path",
            "~/models/deepseek-llm-7b-chat",
        ),
    ];
    for (key, want) in expect_text {
        assert_eq!(c.get_path_text(key).unwrap(), want, "{key}");
    }
    assert_eq!(
        c.trainer.logger,
        OneOrMany::Many(vec!["console".into(), "wandb".into()])
    );
    assert_eq!(
        c.actor_rollout_ref.actor.checkpoint.load_contents,
        vec!["model", "optimizer", "extra"]
    );
    assert_eq!(c.critic.enable, None);
    assert!(c.need_critic(), "gae needs a critic");
    assert!(!c.need_reference_policy());
}

/// The typed structs and `defaults.yaml` must describe the same keys: everything in the
/// resolved defaults survives a trip through the structs, and nothing is added.
#[test]
fn typed_schema_covers_exactly_the_default_keys() {
    fn same(a: &Value, b: &Value, path: &str) {
        match (a, b) {
            (Value::Mapping(x), Value::Mapping(y)) => {
                let kx: Vec<_> = x.keys().collect();
                let ky: Vec<_> = y.keys().collect();
                assert_eq!(kx, ky, "keys differ under `{path}`");
                for (k, v) in x {
                    same(v, &y[k], &format!("{path}.{}", k.as_str().unwrap()));
                }
            }
            (Value::Number(x), Value::Number(y)) => {
                assert_eq!(x.as_f64(), y.as_f64(), "value differs at `{path}`")
            }
            _ => assert_eq!(a, b, "value differs at `{path}`"),
        }
    }
    let from_yaml = yaml("").unwrap().to_value().unwrap();
    let mut expected = verl_config::defaults_tree().clone();
    // Resolve the defaults' interpolations by loading them as a job file.
    expected = Config::from_yaml_str(&serde_yaml::to_string(&expected).unwrap(), "defaults", NONE)
        .unwrap()
        .to_value()
        .unwrap();
    same(&expected, &from_yaml, "");
    // And the key set equals the raw defaults tree's (no key is only in the structs).
    fn keys(v: &Value, p: String, out: &mut Vec<String>) {
        if let Value::Mapping(m) = v {
            for (k, c) in m {
                let p = format!("{p}.{}", k.as_str().unwrap());
                out.push(p.clone());
                keys(c, p, out);
            }
        }
    }
    let (mut a, mut b) = (Vec::new(), Vec::new());
    keys(verl_config::defaults_tree(), String::new(), &mut a);
    keys(&from_yaml, String::new(), &mut b);
    // Interpolated defaults that point at whole sections expand into keys; compare the
    // schema's own keys only.
    let missing: Vec<_> = a.iter().filter(|k| !b.contains(k)).collect();
    assert!(
        missing.is_empty(),
        "schema keys lost by the structs: {missing:?}"
    );
}

#[test]
fn partial_grpo_job_takes_defaults_for_the_rest() {
    let c = Config::load(fixture("grpo_gsm8k.yaml"), NONE).unwrap();
    let arr = &c.actor_rollout_ref;
    assert_eq!(c.algorithm.adv_estimator, "grpo");
    assert_eq!(arr.rollout.n, 5);
    assert_eq!(arr.rollout.name.as_deref(), Some("vllm"));
    assert_eq!(arr.actor.optim.lr, 1e-6);
    assert_eq!(arr.actor.ppo_micro_batch_size_per_gpu, Some(16));
    assert!(arr.reference.fsdp_config.param_offload);
    assert_eq!(
        arr.rollout.response_length, 1024,
        "follows data.max_response_length"
    );
    assert_eq!(arr.rollout.top_k, -1, "default");
    assert_eq!(c.trainer.total_epochs, 15);
    assert_eq!(
        c.trainer.default_local_dir,
        "checkpoints/verl_grpo_example_gsm8k/qwen2.5_3b_function_rm"
    );
    assert!(!c.need_critic());
    assert!(c.need_reference_policy());
    assert_eq!(c.backend_plugin(), "fsdp");
}

#[test]
fn ppo_job_with_plugin_routing() {
    let c = Config::load(fixture("ppo_gsm8k.yaml"), NONE).unwrap();
    assert_eq!(
        c.data.train_files.to_vec(),
        vec!["~/data/gsm8k/train.parquet", "~/data/math/train.parquet"]
    );
    assert_eq!(
        c.data.val_files,
        OneOrMany::One("~/data/gsm8k/test.parquet".into())
    );
    assert_eq!(c.trainer.logger.to_vec(), vec!["console"]);
    assert_eq!(c.critic.ppo_mini_batch_size, 64, "follows the actor's");
    assert_eq!(
        c.critic.forward_micro_batch_size_per_gpu,
        Some(8),
        "follows ppo_micro_batch_size_per_gpu"
    );
    assert_eq!(
        c.plugins.search_path,
        vec!["./target/release", "/opt/verl-rs/plugins"]
    );
    assert_eq!(c.reward_plugin_for("lighteval/MATH"), "math_rewards");
    assert_eq!(c.reward_plugin_for("openai/gsm8k"), "rewards");
    assert_eq!(c.reward_plugin_for("unrouted"), "rewards");
    assert!(c.need_critic());
}

#[test]
fn megatron_job_maps_to_the_megatron_plugin() {
    let c = Config::load(fixture("megatron_grpo.yaml"), NONE).unwrap();
    let arr = &c.actor_rollout_ref;
    assert_eq!(c.backend_plugin(), "megatron");
    assert_eq!(
        arr.reference.strategy, "megatron",
        "ref follows the actor's strategy"
    );
    assert_eq!(arr.reference.megatron.tensor_model_parallel_size, 2);
    assert_eq!(arr.reference.megatron.pipeline_model_parallel_size, 2);
    assert_eq!(
        arr.reference.megatron.override_transformer_config["recompute_granularity"],
        Value::from("full")
    );
    assert_eq!(
        c.model_engine, "megatron",
        "the strategy sets verl 0.10's engine switch"
    );
    assert_eq!(
        c.critic.strategy, "megatron",
        "the critic follows the engine"
    );
    let fsdp2 = Config::from_overrides(&["actor_rollout_ref.actor.strategy=fsdp2"]).unwrap();
    assert_eq!(fsdp2.backend_plugin(), "fsdp");
    let custom = Config::from_overrides(&["plugins.backend=./libmy_backend.so"]).unwrap();
    assert_eq!(custom.backend_plugin(), "./libmy_backend.so");
}

#[test]
fn verl_printed_configs_with_targets_and_hydra_defaults_load() {
    let c = Config::load_file(fixture("verl_generated_style.yaml")).unwrap();
    assert_eq!(c.actor_rollout_ref.actor.optim.lr, 2e-6);
    assert_eq!(c.actor_rollout_ref.rollout.n, 4);
    assert_eq!(c.actor_rollout_ref.rollout.val_kwargs.temperature, 0.6);
    assert_eq!(c.algorithm.kl_ctrl.kind, "adaptive");
    assert_eq!(c.trainer.default_local_dir, "/ckpt/verl_examples/gsm8k");
    assert!(!c.to_yaml().unwrap().contains("_target_"));
    // The defaults list is read (ppo_trainer: the FSDP engine); Hydra's own settings are not
    // used, and the job is told so.
    assert_eq!(c.model_engine, "dp");
    assert!(
        c.warnings
            .iter()
            .any(|w| w.contains("`hydra:` section is ignored")),
        "{:?}",
        c.warnings
    );
    let meg = Config::from_yaml_str(
        "defaults: [ppo_megatron_trainer, _self_]\n",
        "meg.yaml",
        &[] as &[&str],
    )
    .unwrap();
    assert_eq!(meg.actor_rollout_ref.actor.strategy, "megatron");
}

#[test]
fn empty_file_is_all_defaults() {
    assert_eq!(yaml("").unwrap(), Config::default());
    assert_eq!(yaml("# nothing\n").unwrap(), Config::default());
    // An empty section means "no changes", not "no section".
    assert_eq!(yaml("trainer:\n").unwrap(), Config::default());
}

#[test]
fn yaml_syntax_error_names_file_line_and_column() {
    let path = fixture("syntax_error.yaml");
    let err = Config::load(&path, NONE).unwrap_err();
    match &err {
        ConfigError::Syntax {
            file, line, column, ..
        } => {
            assert_eq!(file, &path);
            assert_eq!((*line, *column), (6, 10));
        }
        other => panic!("expected a syntax error, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.starts_with(&format!("{path}:6:10: YAML syntax error")),
        "{msg}"
    );
}

#[test]
fn missing_file_names_the_path() {
    let err = Config::load("/nonexistent/job.yaml", NONE).unwrap_err();
    assert!(matches!(err, ConfigError::Io { .. }));
    assert!(err.to_string().contains("/nonexistent/job.yaml"), "{err}");
}

#[test]
fn top_level_must_be_a_mapping() {
    let err = yaml("- a\n- b\n").unwrap_err();
    assert!(
        matches!(err, ConfigError::TopLevelNotMapping { .. }),
        "{err}"
    );
}

#[test]
fn unknown_key_is_rejected_with_a_suggestion() {
    let path = fixture("unknown_key.yaml");
    let err = Config::load(&path, NONE).unwrap_err();
    let msg = err.to_string();
    assert_eq!(
        msg,
        format!("{path}: unknown key `trainer.totl_epochs`; did you mean `trainer.total_epochs`?")
    );
    match err {
        ConfigError::UnknownKey {
            key, suggestion, ..
        } => {
            assert_eq!(key, "trainer.totl_epochs");
            assert_eq!(suggestion.as_deref(), Some("trainer.total_epochs"));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn misplaced_and_misspelt_sections_get_suggestions() {
    let cases = [
        (
            "trainer:\n  ppo_mini_batch_size: 8\n",
            "trainer.ppo_mini_batch_size",
            Some("actor_rollout_ref.actor.ppo_mini_batch_size"),
        ),
        ("trainr:\n  total_epochs: 2\n", "trainr", Some("trainer")),
        (
            "actor_rollout_ref:\n  rollout:\n    temprature: 0.7\n",
            "actor_rollout_ref.rollout.temprature",
            Some("actor_rollout_ref.rollout.temperature"),
        ),
        (
            "algorithm:\n  kl_ctrl:\n    kl_coeff: 0.1\n",
            "algorithm.kl_ctrl.kl_coeff",
            Some("algorithm.kl_ctrl.kl_coef"),
        ),
        ("data:\n  qqqqqqqqqq: 1\n", "data.qqqqqqqqqq", None),
    ];
    for (text, key, want) in cases {
        match yaml(text).unwrap_err() {
            ConfigError::UnknownKey {
                key: k, suggestion, ..
            } => {
                assert_eq!(k, key);
                assert_eq!(suggestion.as_deref(), want, "{text}");
            }
            other => panic!("{text}: {other:?}"),
        }
    }
}

#[test]
fn every_unknown_key_is_reported_at_once() {
    let err = yaml("trainer:\n  totl_epochs: 1\ndata:\n  train_bach_size: 2\n").unwrap_err();
    let all = err.errors();
    assert_eq!(all.len(), 2, "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("`trainer.total_epochs`") && msg.contains("`data.train_batch_size`"),
        "{msg}"
    );
}

#[test]
fn wrong_type_names_key_expected_and_found() {
    let path = fixture("wrong_type.yaml");
    match Config::load(&path, NONE).unwrap_err() {
        ConfigError::TypeMismatch {
            key,
            expected,
            found,
            origin,
        } => {
            assert_eq!(key, "trainer.total_epochs");
            assert_eq!(expected, "an integer");
            assert_eq!(found, "string \"ten\"");
            assert_eq!(origin, path);
        }
        other => panic!("{other:?}"),
    }
    let cases = [
        (
            "actor_rollout_ref:\n  actor:\n    use_kl_loss: maybe\n",
            "actor_rollout_ref.actor.use_kl_loss",
            "boolean",
        ),
        ("trainer: 5\n", "trainer", "mapping"),
        (
            "actor_rollout_ref:\n  actor:\n    optim:\n      lr: fast\n",
            "actor_rollout_ref.actor.optim.lr",
            "number",
        ),
        ("trainer:\n  logger: {a: 1}\n", "trainer.logger", "list"),
        // null default: the typed layer decides.
        (
            "data:\n  val_batch_size: lots\n",
            "data.val_batch_size",
            "u64",
        ),
        (
            "data:\n  train_batch_size: -4\n",
            "data.train_batch_size",
            "u64",
        ),
    ];
    for (text, key, expected) in cases {
        match yaml(text).unwrap_err() {
            ConfigError::TypeMismatch {
                key: k,
                expected: e,
                ..
            } => {
                assert_eq!(k, key, "{text}");
                assert!(
                    e.contains(expected),
                    "{text}: expected {e:?} to mention {expected}"
                );
            }
            other => panic!("{text}: {other:?}"),
        }
    }
}

#[test]
fn values_are_coerced_where_verl_would() {
    let c = yaml("trainer:\n  experiment_name: 2024\ndata:\n  max_prompt_length: '1024'\nactor_rollout_ref:\n  actor:\n    optim:\n      lr: '3e-6'\n").unwrap();
    assert_eq!(c.trainer.experiment_name, "2024");
    assert_eq!(c.data.max_prompt_length, 1024);
    assert_eq!(c.actor_rollout_ref.actor.optim.lr, 3e-6);
}

#[test]
fn nulls_where_verl_allows_them() {
    let c = yaml("data:\n  val_batch_size: null\ntrainer:\n  total_training_steps: ~\n  resume_from_path: null\ncritic:\n  enable: null\n").unwrap();
    assert_eq!(c.data.val_batch_size, None);
    assert_eq!(c.trainer.total_training_steps, None);
    let err = yaml("trainer:\n  total_epochs: null\n").unwrap_err();
    assert!(
        matches!(err, ConfigError::TypeMismatch { ref key, .. } if key == "trainer.total_epochs"),
        "{err}"
    );
}

#[test]
fn interpolations_resolve_after_merging() {
    let c = Config::load(fixture("interpolation.yaml"), NONE).unwrap();
    assert_eq!(c.trainer.experiment_name, "run_32");
    assert_eq!(c.trainer.default_local_dir, "checkpoints/my_proj/run_32");
    let arr = &c.actor_rollout_ref;
    assert_eq!(arr.actor.ppo_max_token_len_per_gpu, 2048);
    // Chains: ref and rollout follow the actor, which follows data.
    assert_eq!(arr.reference.log_prob_max_token_len_per_gpu, 2048);
    assert_eq!(arr.rollout.log_prob_max_token_len_per_gpu, 2048);
    assert_eq!(arr.rollout.response_length, 2048);
    assert_eq!(c.critic.ppo_mini_batch_size, 16);
    assert_eq!(
        c.critic.ppo_epochs, 3,
        "a user value replaces the interpolated default"
    );
    // Relative: `${.ppo_max_token_len_per_gpu}`.
    assert_eq!(c.critic.forward_max_token_len_per_gpu, 32768);
    // An override of the source propagates to every interpolated default.
    let c = Config::load(
        fixture("interpolation.yaml"),
        &[
            "data.train_batch_size=64",
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "critic.ppo_max_token_len_per_gpu=1000",
        ],
    )
    .unwrap();
    assert_eq!(c.trainer.experiment_name, "run_64");
    assert!(c.actor_rollout_ref.reference.log_prob_use_dynamic_bsz);
    assert!(c.critic.use_dynamic_bsz);
    assert_eq!(c.critic.forward_max_token_len_per_gpu, 1000);
}

#[test]
fn interpolation_forms() {
    std::env::set_var("VERL_CONFIG_TEST_HOME", "/home/tester");
    let c = yaml(concat!(
        "trainer:\n",
        "  default_local_dir: ${oc.env:VERL_CONFIG_TEST_HOME}/ckpt\n",
        "  project_name: ${oc.env:VERL_CONFIG_TEST_SURELY_UNSET,fallback}\n",
        "  experiment_name: ${oc.select:trainer.no_such_key,'quoted, default'}\n",
        "  rollout_data_dir: \\${literal}\n",
        "data:\n",
        "  val_batch_size: ${oc.select:data.train_batch_size,1}\n",
    ))
    .unwrap();
    assert_eq!(c.trainer.default_local_dir, "/home/tester/ckpt");
    assert_eq!(c.trainer.project_name, "fallback");
    assert_eq!(c.trainer.experiment_name, "quoted, default");
    assert_eq!(c.trainer.rollout_data_dir.as_deref(), Some("${literal}"));
    assert_eq!(c.data.val_batch_size, Some(1024));
}

#[test]
fn interpolation_errors() {
    match yaml("trainer:\n  project_name: ${trainer.experimnt_name}\n").unwrap_err() {
        ConfigError::InterpolationMissing {
            key,
            target,
            suggestion,
            ..
        } => {
            assert_eq!(key, "trainer.project_name");
            assert_eq!(target, "trainer.experimnt_name");
            assert_eq!(suggestion.as_deref(), Some("trainer.experiment_name"));
        }
        other => panic!("{other:?}"),
    }
    let err = yaml("trainer:\n  project_name: ${trainer.experiment_name}\n  experiment_name: x${trainer.project_name}\n").unwrap_err();
    assert!(
        matches!(err, ConfigError::InterpolationCycle { .. }),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("trainer.project_name -> trainer.experiment_name -> trainer.project_name"),
        "{err}"
    );
    let err = yaml("trainer:\n  project_name: ${oc.decode:x}\n").unwrap_err();
    assert!(
        err.to_string().contains("unknown resolver `oc.decode`"),
        "{err}"
    );
    let err = yaml("trainer:\n  project_name: ${trainer.experiment_name\n").unwrap_err();
    assert!(
        matches!(err, ConfigError::InterpolationInvalid { .. }),
        "{err}"
    );
    let err = yaml("trainer:\n  project_name: p_${actor_rollout_ref.actor.optim}\n").unwrap_err();
    assert!(
        err.to_string().contains("cannot be part of a string"),
        "{err}"
    );
}

#[test]
fn mandatory_values_must_be_given() {
    let err = yaml("actor_rollout_ref:\n  model:\n    path: ???\n").unwrap_err();
    assert!(
        matches!(err, ConfigError::MissingMandatory { ref key } if key == "actor_rollout_ref.model.path"),
        "{err}"
    );
    assert!(yaml("actor_rollout_ref:\n  model:\n    path: ???\n").is_err());
    Config::from_yaml_str(
        "actor_rollout_ref:\n  model:\n    path: ???\n",
        "job.yaml",
        &["actor_rollout_ref.model.path=/models/qwen"],
    )
    .unwrap();
}

#[test]
fn closed_choices_are_checked_with_suggestions() {
    let cases = [
        (
            "algorithm.adv_estimator=grop",
            "algorithm.adv_estimator",
            Some("grpo"),
        ),
        (
            "actor_rollout_ref.actor.strategy=fdsp",
            "actor_rollout_ref.actor.strategy",
            Some("fsdp"),
        ),
        (
            "actor_rollout_ref.actor.loss_agg_mode=token_mean",
            "actor_rollout_ref.actor.loss_agg_mode",
            Some("token-mean"),
        ),
        (
            "algorithm.kl_ctrl.type=adaptve",
            "algorithm.kl_ctrl.type",
            Some("adaptive"),
        ),
        ("trainer.resume_mode=xyz", "trainer.resume_mode", None),
    ];
    for (ov, key, want) in cases {
        let err = Config::from_overrides(&[ov]).unwrap_err();
        let found = err
            .errors()
            .into_iter()
            .find_map(|e| match e {
                ConfigError::InvalidChoice {
                    key: k, suggestion, ..
                } if k == key => Some(suggestion.clone()),
                _ => None,
            })
            .unwrap_or_else(|| panic!("{ov}: {err}"));
        assert_eq!(found.as_deref(), want, "{ov}");
    }
    // `k3+` is verl's straight-through variant, for the KL loss; the in-reward penalty takes no
    // gradient, so there it is refused by name.
    Config::from_overrides(&["actor_rollout_ref.actor.kl_loss_type=k3+"]).unwrap();
    let e = Config::from_overrides(&["algorithm.kl_penalty=low_var_kl+"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("algorithm.kl_penalty=low_var_kl+"), "{e}");
    // With an explicit backend plugin, the strategy name is the plugin's business.
    Config::from_overrides(&[
        "actor_rollout_ref.actor.strategy=my_strategy",
        "critic.strategy=my_strategy",
        "plugins.backend=mine",
    ])
    .unwrap();
}

#[test]
fn to_yaml_round_trips_and_is_fully_resolved() {
    let c = Config::load(fixture("ppo_gsm8k.yaml"), &["trainer.total_epochs=2"]).unwrap();
    let text = c.to_yaml().unwrap();
    assert!(!text.contains("${"), "interpolations left in:\n{text}");
    assert_eq!(Config::from_yaml_str(&text, "dump.yaml", NONE).unwrap(), c);
}

#[test]
fn sections_and_paths_for_plugins_and_printing() {
    let c = Config::load(fixture("grpo_gsm8k.yaml"), NONE).unwrap();
    let section: Value =
        serde_yaml::from_str(&c.section_yaml("actor_rollout_ref").unwrap()).unwrap();
    assert_eq!(section["actor"]["ppo_mini_batch_size"], Value::from(256));
    assert_eq!(
        section["ref"]["log_prob_micro_batch_size_per_gpu"],
        Value::from(32)
    );
    assert_eq!(section["rollout"]["n"], Value::from(5));
    let json: serde_json::Value =
        serde_json::from_str(&c.section_json("actor_rollout_ref.actor.optim").unwrap()).unwrap();
    assert_eq!(json["lr"], serde_json::json!(1e-6));
    assert_eq!(c.get_path_text("trainer.total_epochs").unwrap(), "15");
    assert_eq!(
        c.get_path_text("actor_rollout_ref.rollout.name").unwrap(),
        "vllm"
    );
    assert!(c
        .get_path_text("trainer.logger")
        .unwrap()
        .contains("- wandb"));
    match c.get_path("trainer.totl_epochs").unwrap_err() {
        ConfigError::NoSuchPath { suggestion, .. } => {
            assert_eq!(suggestion.as_deref(), Some("trainer.total_epochs"))
        }
        other => panic!("{other:?}"),
    }
}

fn override_error(overrides: &[&str]) -> String {
    Config::from_overrides(overrides).unwrap_err().to_string()
}

#[test]
fn keys_of_verls_other_engines_are_refused_naming_the_engine() {
    for (key, engine) in [
        (
            "actor_rollout_ref.actor.veomni.param_offload=True",
            "VeOmni",
        ),
        ("actor_rollout_ref.ref.torchtitan.fsdp_size=8", "TorchTitan"),
        ("critic.automodel.tp_size=2", "NeMo AutoModel"),
    ] {
        let e = override_error(&[key]);
        let k = key.split('=').next().unwrap();
        assert!(
            e.contains(&format!("`{k}` configures verl's {engine} engine"))
                && e.contains("model_engine=dp")
                && e.contains("model_engine=megatron"),
            "{e}"
        );
    }
    // In a job file too.
    let e = yaml("actor_rollout_ref:\n  actor:\n    veomni:\n      fsdp_size: 8\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("VeOmni engine"), "{e}");
}

#[test]
fn keys_inside_a_refused_section_are_refused_not_unknown() {
    // verl names its teacher models freely (`teacher_models.<name>.*`).
    let e = override_error(&["distillation.teacher_models.gsm8k.model_path=Qwen/Qwen3-1.7B"]);
    assert!(
        e.contains(
            "`distillation.teacher_models.gsm8k.model_path` belongs to on-policy distillation"
        ),
        "{e}"
    );
    // A near spelling of a real key in such a section is still a typo with a suggestion.
    let e = override_error(&["distillation.enabeld=true"]);
    assert!(e.contains("did you mean `distillation.enabled`?"), "{e}");
}

#[test]
fn a_misplaced_added_key_suggests_the_nearest_real_one() {
    // verl's SAPO example adds tau_pos under policy_loss; SAPO reads actor.tau_pos.
    let e = override_error(&["+actor_rollout_ref.actor.policy_loss.tau_pos=1.0"]);
    assert!(
        e.contains("did you mean `actor_rollout_ref.actor.tau_pos`?"),
        "{e}"
    );
    let e = override_error(&["actor_rollout_ref.ref.fsdp_config.param_offlod=true"]);
    assert!(
        e.contains("did you mean `actor_rollout_ref.ref.fsdp_config.param_offload`?"),
        "{e}"
    );
}

#[test]
fn gdpo_is_a_verl_estimator_verl_rs_refuses() {
    let e = override_error(&[
        "algorithm.adv_estimator=gdpo",
        "+algorithm.gdpo_reward_keys=[accuracy_reward,format_reward]",
    ]);
    assert!(
        e.contains("algorithm.adv_estimator=gdpo") && e.contains("algorithm.gdpo_reward_keys"),
        "{e}"
    );
    assert!(!e.contains("did you mean"), "{e}");
}

#[test]
fn config_group_choices_on_the_command_line() {
    // verl's stock choice selects its engine, as in a `defaults:` list.
    let c = Config::from_overrides(&["actor@actor_rollout_ref.actor=megatron_actor"]).unwrap();
    assert_eq!(c.model_engine, "megatron");
    // A file from another package (verl_mlite on hydra.searchpath) is refused by name, and the
    // keys it would have brought are not listed one by one.
    let e = override_error(&[
        "hydra.searchpath=[pkg://verl_mlite.config]",
        "actor@actor_rollout_ref.actor=mlite_actor",
        "actor_rollout_ref.actor.engine.tp=8",
        "+actor_rollout_ref.actor.engine.impl_cfg.recompute=[full]",
    ]);
    assert!(
        e.contains("`actor@actor_rollout_ref.actor=mlite_actor`")
            && e.contains("dp_actor, megatron_actor")
            && !e.contains("engine.tp"),
        "{e}"
    );
    // Hydra's own settings alone are a warning.
    let c = Config::from_overrides(&["hydra.run.dir=outputs/x"]).unwrap();
    assert!(
        c.warnings
            .iter()
            .any(|w| w.contains("hydra.run.dir") && w.contains("Hydra itself")),
        "{:?}",
        c.warnings
    );
}

#[test]
fn kernel_switches_in_megatron_transformer_overrides_warn_and_numerics_refuse() {
    let c = Config::from_overrides(&[
        "model_engine=megatron",
        "+actor_rollout_ref.actor.megatron.override_transformer_config.use_flash_attn=true",
        "+actor_rollout_ref.actor.megatron.override_transformer_config.use_fused_rmsnorm=true",
        "+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full",
    ])
    .unwrap();
    assert!(
        c.warnings
            .iter()
            .any(|w| w.contains("use_flash_attn") && w.contains("use_fused_rmsnorm")),
        "{:?}",
        c.warnings
    );
    let e = override_error(&[
        "model_engine=megatron",
        "+actor_rollout_ref.actor.megatron.override_transformer_config.use_flash_attn=true",
        "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_z_loss_coeff=0.001",
    ]);
    assert!(e.contains("does not read: moe_z_loss_coeff;"), "{e}");
}

/// `clip_ratio_c` and SAPO's `tau_pos` / `tau_neg` are read by some policy losses only; set for
/// another one, the job is told they are ignored (one warning each, naming the loss mode).
#[test]
fn loss_keys_the_chosen_policy_loss_does_not_read_are_named_as_ignored() {
    let warnings = |mode: &str| {
        Config::from_overrides(&[
            format!("actor_rollout_ref.actor.policy_loss.loss_mode={mode}"),
            "actor_rollout_ref.actor.clip_ratio_c=10000.0".into(),
            "actor_rollout_ref.actor.tau_pos=2.0".into(),
            "actor_rollout_ref.actor.tau_neg=1.5".into(),
        ])
        .unwrap()
        .warnings
    };
    let ignored = |w: &[String], key: &str| {
        w.iter().any(|l| {
            l.contains(&format!("`actor_rollout_ref.actor.{key}=")) && l.contains("is ignored")
        })
    };
    for mode in ["geo_mean", "gspo", "cispo"] {
        let w = warnings(mode);
        for key in ["clip_ratio_c", "tau_pos", "tau_neg"] {
            assert!(ignored(&w, key), "{mode}: no warning for {key}: {w:#?}");
        }
        assert!(w.iter().any(|l| l.contains(&format!("`{mode}`"))), "{w:#?}");
    }
    for mode in ["vanilla", "dppo_tv", "dppo_kl"] {
        let w = warnings(mode);
        assert!(!ignored(&w, "clip_ratio_c"), "{mode}: {w:#?}");
        assert!(ignored(&w, "tau_pos"), "{mode}: {w:#?}");
    }
    let w = warnings("sapo");
    assert!(
        ignored(&w, "clip_ratio_c") && !ignored(&w, "tau_pos") && !ignored(&w, "tau_neg"),
        "{w:#?}"
    );
}
