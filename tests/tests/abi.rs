//! Calls through the ABI with real shared libraries loaded by the host's loader, in one process:
//! two plugins of the same kind side by side, init failures, and the contract checks.

use verl_e2e::plugin;
use verl_host::Loader;
use verl_plugin_api::{col, testing, InitArgs, Role, ScoreOptions};

fn init(extra: serde_json::Value) -> InitArgs {
    InitArgs {
        extra,
        ..InitArgs::new(Role::Reward, serde_json::json!({}))
    }
}

#[test]
fn two_reward_plugins_live_in_one_process_and_answer_independently() {
    let mut loader = Loader::new(&[]);
    let rules = loader
        .load(plugin("libverl_rewards.so").to_str().unwrap())
        .unwrap();
    let faulty = loader
        .load(plugin("libfaulty_plugin.so").to_str().unwrap())
        .unwrap();
    assert_eq!(rules.header.name, "rewards");
    assert_eq!(faulty.header.name, "faulty");

    let batch = testing::reward_batch(&[
        ("openai/gsm8k", "#### 42", "42"),
        ("openai/gsm8k", "#### 41", "42"),
    ]);
    let mut a = rules
        .create_reward(&init(serde_json::Value::Null), None)
        .unwrap();
    let mut b = faulty
        .create_reward(&init(serde_json::Value::Null), None)
        .unwrap();
    let sa = a.score(&batch, &ScoreOptions::default()).unwrap();
    let sb = b.score(&batch, &ScoreOptions::default()).unwrap();
    // The rule reward checks the answer; the fixture scores the response length.
    assert_eq!(sa.tensor::<f32>(col::SCORES).unwrap().data, vec![1.0, 0.0]);
    assert_eq!(sb.tensor::<f32>(col::SCORES).unwrap().data, vec![7.0, 7.0]);

    // Loading the same file again returns the same plugin, not a second copy.
    let again = loader
        .load(plugin("libverl_rewards.so").to_str().unwrap())
        .unwrap();
    assert_eq!(again.path, rules.path);
}

#[test]
fn a_plugin_whose_init_fails_names_itself_and_the_reason() {
    let mut loader = Loader::new(&[]);
    let faulty = loader
        .load(plugin("libfaulty_plugin.so").to_str().unwrap())
        .unwrap();
    let err = faulty
        .create_reward(&init(serde_json::json!({"fail_init": true})), None)
        .err()
        .expect("init must fail");
    let msg = format!("{err:#}");
    assert!(msg.contains("plugin `faulty` create_reward"), "{msg}");
    assert!(msg.contains("cannot open reward model weights"), "{msg}");
}

#[test]
fn a_backend_plugin_is_refused_where_a_reward_plugin_is_needed() {
    let mut loader = Loader::new(&[]);
    let fsdp = loader
        .load(plugin("libverl_fsdp.so").to_str().unwrap())
        .unwrap();
    let err = fsdp
        .create_reward(&init(serde_json::Value::Null), None)
        .err()
        .unwrap();
    let msg = format!("{err:#}");
    assert!(
        msg.contains("is a backend plugin, but a reward plugin is needed"),
        "{msg}"
    );
    // A bad config reaches the plugin and comes back naming the key.
    let err = fsdp
        .create_actor(&InitArgs::new(
            Role::Actor,
            serde_json::json!({"trainer": {"device": "tpu"}}),
        ))
        .err()
        .unwrap();
    assert!(format!("{err:#}").contains("trainer.device"), "{err:#}");
    // The second backend answers through the same ABI, naming what its config lacks.
    let megatron = loader
        .load(plugin("libverl_megatron.so").to_str().unwrap())
        .unwrap();
    let err = megatron
        .create_actor(&InitArgs::new(
            Role::Actor,
            serde_json::json!({"trainer": {"device": "cpu"}}),
        ))
        .err()
        .unwrap();
    assert!(
        format!("{err:#}").contains("actor_rollout_ref.model.path"),
        "{err:#}"
    );
}

#[test]
fn malformed_input_batches_are_rejected_before_the_plugin_runs() {
    let mut loader = Loader::new(&[]);
    let rules = loader
        .load(plugin("libverl_rewards.so").to_str().unwrap())
        .unwrap();
    let mut r = rules
        .create_reward(&init(serde_json::Value::Null), None)
        .unwrap();
    let mut batch = testing::reward_batch(&[("openai/gsm8k", "#### 1", "1")]);
    batch.remove(col::DATA_SOURCE);
    let msg = r
        .score(&batch, &ScoreOptions::default())
        .unwrap_err()
        .to_string();
    assert!(msg.contains("input of rewards.reward.score"), "{msg}");
    assert!(msg.contains("`data_source` is missing"), "{msg}");
}

/// The plugins of `tests/fixtures-api-0.1`: built against a frozen copy of plugin-api 0.1.0 from
/// before reward models and model services were appended to the ABI.
fn old_api_plugins() -> std::path::PathBuf {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let target = verl_e2e::build_dir().join("..").join("fixtures-api-0.1");
    let o = std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["build", "--offline", "--manifest-path"])
        .arg(root.join("fixtures-api-0.1/Cargo.toml"))
        .arg("--target-dir")
        .arg(&target)
        .output()
        .expect("run cargo");
    assert!(
        o.status.success(),
        "building the plugin-api 0.1.0 fixtures: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    target.join("debug")
}

#[test]
fn plugins_built_against_the_api_before_reward_models_still_load() {
    let dir = old_api_plugins();
    let mut loader = Loader::new(&[]);
    let old = loader
        .load(dir.join("libold_api_reward.so").to_str().unwrap())
        .unwrap();
    // Created without model services (it has no entry point that takes them), it scores as
    // it always did.
    let mut r = old
        .create_reward(&init(serde_json::Value::Null), None)
        .unwrap();
    let batch = testing::reward_batch(&[("a", "four", ""), ("b", "seven!!", "")]);
    let s = r.score(&batch, &ScoreOptions::default()).unwrap();
    assert_eq!(s.tensor::<f32>(col::SCORES).unwrap().data, vec![4.0, 7.0]);
    // Offered the services, the host falls back to the old entry point.
    let models = verl_host::models::SharedModels::default();
    let services = verl_plugin_api::services::services_box(models);
    let mut r = old
        .create_reward(&init(serde_json::Value::Null), Some(services))
        .unwrap();
    let s = r.score(&batch, &ScoreOptions::default()).unwrap();
    assert_eq!(s.tensor::<f32>(col::SCORES).unwrap().data, vec![4.0, 7.0]);

    // An old backend keeps its upfront check and has no reward model role, said by name.
    let backend = loader
        .load(dir.join("libold_api_backend.so").to_str().unwrap())
        .unwrap();
    let summary = backend
        .validate_layout(&InitArgs::new(Role::Actor, serde_json::json!({})))
        .unwrap()
        .unwrap();
    assert_eq!(summary, "old backend: layout fits");
    let e = backend
        .create_reward_model(&InitArgs::new(Role::RewardModel, serde_json::json!({})))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("old_api_backend") && e.contains("no reward model role"),
        "{e}"
    );
}

/// A turn driver that must never be called: the old plugin has no multi-turn generation.
struct NeverCalled;

impl verl_plugin_api::turns::TurnDriver for NeverCalled {
    fn turns(
        &mut self,
        _: Vec<verl_plugin_api::turns::TurnEnd>,
        _: bool,
    ) -> verl_plugin_api::Result<Vec<verl_plugin_api::turns::Resume>> {
        panic!("an old plugin called the turn driver")
    }
}

#[test]
fn an_actor_built_before_multi_turn_generates_and_refuses_turns_by_name() {
    let dir = old_api_plugins();
    let mut loader = Loader::new(&[]);
    let backend = loader
        .load(dir.join("libold_api_backend.so").to_str().unwrap())
        .unwrap();
    assert!(!backend
        .header
        .supports(Role::Actor, verl_plugin_api::FEATURE_MULTI_TURN));
    let mut actor = backend
        .create_actor(&InitArgs::new(Role::Actor, serde_json::json!({})))
        .unwrap();
    let prompts = verl_plugin_api::contract::prompt_batch(&[&[5, 6, 7], &[9]], 0);
    let opts = verl_plugin_api::GenerateOptions {
        n: 2,
        ..Default::default()
    };
    // Its vtable ends before `generate_turns`: the calls it has still work ...
    let out = actor.generate(&prompts, &opts).unwrap();
    assert_eq!(
        out.tensor::<i64>(col::RESPONSES).unwrap().data,
        vec![7, 7, 9, 9]
    );
    // ... and the appended one answers with its default: not implemented, naming the plugin.
    let e = actor
        .generate_turns(&prompts, &opts, &mut NeverCalled)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("old_api_backend")
            && e.contains("generate_turns")
            && e.contains("not implemented"),
        "{e}"
    );
}
