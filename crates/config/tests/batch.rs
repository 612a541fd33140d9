//! Batch-size arithmetic: a valid plan's numbers, and one failing case per rule with its
//! suggestion checked.

use verl_config::{validate_batches, BatchPlan, Config, ConfigError, Layout};

fn cfg(overrides: &[&str]) -> Config {
    Config::from_overrides(overrides).unwrap_or_else(|e| panic!("{e}"))
}

fn plan(overrides: &[&str], world: u64) -> Result<BatchPlan, ConfigError> {
    validate_batches(&cfg(overrides), Layout::data_parallel(world))
}

/// The batch error's key, message and suggested value.
fn batch_err(overrides: &[&str], world: u64) -> (String, String, Option<u64>) {
    match plan(overrides, world) {
        Err(e @ ConfigError::BatchSize { .. }) => {
            let msg = e.to_string();
            let ConfigError::BatchSize { key, suggested, .. } = e else {
                unreachable!()
            };
            (key, msg, suggested)
        }
        other => {
            panic!("{overrides:?} on {world} ranks: expected a batch-size error, got {other:?}")
        }
    }
}

/// Applying the suggestion must make that key's error go away.
fn assert_suggestion_fixes(overrides: &[&str], world: u64) -> u64 {
    let (key, msg, suggested) = batch_err(overrides, world);
    let s = suggested.unwrap_or_else(|| panic!("no suggestion in: {msg}"));
    let mut fixed: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    fixed.push(format!("{key}={s}"));
    let fixed: Vec<&str> = fixed.iter().map(String::as_str).collect();
    if let Err(ConfigError::BatchSize { key: k2, .. }) = plan(&fixed, world) {
        assert_ne!(k2, key, "suggestion {key}={s} did not fix: {msg}");
    }
    s
}

const GRPO: &[&str] = &[
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "data.train_batch_size=1024",
    "actor_rollout_ref.rollout.n=5",
    "actor_rollout_ref.actor.ppo_mini_batch_size=256",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=32",
];

fn with(base: &[&'static str], extra: &[&'static str]) -> Vec<&'static str> {
    base.iter().chain(extra).copied().collect()
}

#[test]
fn grpo_plan_numbers() {
    let p = plan(&with(GRPO, &["actor_rollout_ref.actor.ppo_epochs=2"]), 8).unwrap();
    assert_eq!(p.prompts_per_step, 1024);
    assert_eq!(p.responses_per_step, 5120);
    assert_eq!(p.prompts_per_rank, 128);
    assert_eq!(p.responses_per_rank, 640);
    let a = &p.actor;
    assert_eq!(a.mini_batch_responses, 1280);
    assert_eq!(a.mini_batch_per_rank, 160);
    assert_eq!(a.mini_batches_per_step, 4);
    assert_eq!(a.optimizer_steps_per_step, 8, "4 mini-batches × 2 epochs");
    assert_eq!(a.micro_batch_per_gpu, Some(16));
    assert_eq!(a.micro_batches_per_mini_batch, Some(10));
    assert_eq!(a.grad_accumulation_steps, Some(10));
    assert_eq!(p.old_log_prob.micro_batches_per_rank, Some(20));
    assert_eq!(
        p.ref_log_prob.as_ref().unwrap().micro_batches_per_rank,
        Some(20)
    );
    assert!(p.critic.is_none() && p.critic_values.is_none());
    assert!(p.warnings.is_empty(), "{:?}", p.warnings);
}

#[test]
fn ppo_plan_with_critic() {
    let p = plan(
        &[
            "data.train_batch_size=256",
            "actor_rollout_ref.actor.ppo_mini_batch_size=64",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
            "critic.ppo_micro_batch_size_per_gpu=8",
            "critic.ppo_epochs=2",
        ],
        8,
    )
    .unwrap();
    assert!(p.ref_log_prob.is_none(), "no KL: no reference policy");
    let c = p.critic.unwrap();
    assert_eq!(c.mini_batch_prompts, 64, "inherited from the actor");
    assert_eq!(c.mini_batch_per_rank, 8);
    assert_eq!(c.micro_batches_per_mini_batch, Some(1));
    assert_eq!(c.optimizer_steps_per_step, 8);
    let v = p.critic_values.unwrap();
    assert_eq!(
        (
            v.responses_per_rank,
            v.micro_batch_per_gpu,
            v.micro_batches_per_rank
        ),
        (32, Some(8), Some(4))
    );
}

#[test]
fn mini_batch_times_n_not_divisible_by_dp() {
    let base = [
        "algorithm.adv_estimator=grpo",
        "data.train_batch_size=30",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=6",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
    ];
    let (key, msg, suggested) = batch_err(&base, 5);
    assert_eq!(key, "actor_rollout_ref.actor.ppo_mini_batch_size");
    assert!(
        msg.starts_with("actor_rollout_ref.actor.ppo_mini_batch_size=6 × rollout.n=4 = 24 responses is not divisible by the actor data-parallel size 5"),
        "{msg}"
    );
    assert_eq!(suggested, Some(5));
    assert!(
        msg.ends_with("a valid choice is actor_rollout_ref.actor.ppo_mini_batch_size=5"),
        "{msg}"
    );
    assert_suggestion_fixes(&base, 5);
}

#[test]
fn train_batch_not_divisible_by_dp() {
    let base = [
        "data.train_batch_size=100",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=20",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=5",
        "critic.enable=false",
    ];
    let (key, msg, suggested) = batch_err(&base, 8);
    assert_eq!(key, "data.train_batch_size");
    assert!(msg.contains("data.train_batch_size=100 prompts (× rollout.n=2 = 200 responses) cannot be split evenly over the actor data-parallel size 8: 100 mod 8 = 4"), "{msg}");
    // Multiples of lcm(8, 20) = 40 nearest 100: 80 and 120, the larger preferred.
    assert_eq!(suggested, Some(120));
    assert_suggestion_fixes(&base, 8);
    plan(&with(&base, &["data.train_batch_size=120"]), 8).unwrap();
}

#[test]
fn train_batch_not_a_whole_number_of_mini_batches() {
    let base = [
        "critic.enable=false",
        "data.train_batch_size=96",
        "actor_rollout_ref.actor.ppo_mini_batch_size=40",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    ];
    let (key, msg, suggested) = batch_err(&base, 4);
    assert_eq!(key, "actor_rollout_ref.actor.ppo_mini_batch_size");
    assert!(msg.contains("96 mod 40 = 16"), "{msg}");
    assert_eq!(suggested, Some(32));
    assert_suggestion_fixes(&base, 4);
}

#[test]
fn mini_batch_larger_than_train_batch() {
    let base = [
        "critic.enable=false",
        "data.train_batch_size=64",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
    ];
    // The default ppo_mini_batch_size is 256.
    let (key, msg, suggested) = batch_err(&base, 8);
    assert_eq!(key, "actor_rollout_ref.actor.ppo_mini_batch_size");
    assert!(
        msg.contains("=256 prompts must be between 1 and data.train_batch_size=64"),
        "{msg}"
    );
    assert_eq!(suggested, Some(64));
}

#[test]
fn micro_batch_does_not_divide_the_per_rank_mini_batch() {
    let base = [
        "critic.enable=false",
        "data.train_batch_size=64",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    ];
    let (key, msg, suggested) = batch_err(&base, 8);
    assert_eq!(key, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu");
    assert!(msg.contains("16 × rollout.n=4 / data-parallel size 8 = 8 responses, which does not split into micro-batches of 3: 8 mod 3 = 2"), "{msg}");
    assert_eq!(suggested, Some(2));
    assert_suggestion_fixes(&base, 8);
    // Larger than the per-rank mini-batch: as in verl, one micro-batch of all the rank's rows.
    let p = plan(
        &with(
            &base,
            &[
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64",
            ],
        ),
        8,
    )
    .unwrap();
    assert_eq!(p.actor.micro_batch_per_gpu, Some(8));
    assert_eq!(p.actor.micro_batches_per_mini_batch, Some(1));
    assert_eq!(p.old_log_prob.micro_batch_per_gpu, Some(32));
    assert_eq!(p.old_log_prob.micro_batches_per_rank, Some(1));
}

#[test]
fn micro_batch_required_unless_dynamic() {
    let base = [
        "critic.enable=false",
        "data.train_batch_size=64",
        "actor_rollout_ref.actor.ppo_mini_batch_size=32",
    ];
    let (key, msg, suggested) = batch_err(&base, 8);
    assert_eq!(key, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu");
    assert!(msg.contains("use_dynamic_bsz"), "{msg}");
    assert_eq!(suggested, Some(4));
    // Dynamic batch sizes need no micro-batch size for any pass.
    let p = plan(
        &with(&base, &["actor_rollout_ref.actor.use_dynamic_bsz=true"]),
        8,
    )
    .unwrap();
    assert_eq!(p.actor.micro_batch_per_gpu, None);
    assert_eq!(p.actor.grad_accumulation_steps, None);
    assert_eq!(p.actor.max_token_len_per_gpu, Some(16384));
    assert!(p.old_log_prob.dynamic_bsz);
}

#[test]
fn deprecated_global_micro_batch() {
    let base = [
        "critic.enable=false",
        "data.train_batch_size=64",
        "actor_rollout_ref.actor.ppo_mini_batch_size=32",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    ];
    // verl divides the global size by the data-parallel size: 16 / 8 = 2 per GPU.
    let p = plan(
        &with(&base, &["actor_rollout_ref.actor.ppo_micro_batch_size=16"]),
        8,
    )
    .unwrap();
    assert_eq!(p.actor.micro_batch_per_gpu, Some(2));
    assert_eq!(p.actor.micro_batches_per_mini_batch, Some(2));
    let (key, msg, suggested) = batch_err(
        &with(&base, &["actor_rollout_ref.actor.ppo_micro_batch_size=12"]),
        8,
    );
    assert_eq!(key, "actor_rollout_ref.actor.ppo_micro_batch_size");
    assert!(
        msg.contains("not divisible by the actor data-parallel size 8"),
        "{msg}"
    );
    assert_eq!(suggested, Some(16));
    let (_, msg, _) = batch_err(
        &with(
            &base,
            &[
                "actor_rollout_ref.actor.ppo_micro_batch_size=16",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            ],
        ),
        8,
    );
    assert!(
        msg.contains("remove actor_rollout_ref.actor.ppo_micro_batch_size"),
        "{msg}"
    );
}

#[test]
fn log_prob_micro_batches() {
    let base = [
        "critic.enable=false",
        "data.train_batch_size=64",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    ];
    // Unset and not dynamic.
    let (key, _, s) = batch_err(&base, 8);
    assert_eq!(
        key,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"
    );
    assert_eq!(s, Some(4));
    // 64 × 4 / 8 = 32 per rank; 5 does not divide it.
    let bad = with(
        &base,
        &["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=5"],
    );
    let (key, msg, s) = batch_err(&bad, 8);
    assert_eq!(
        key,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"
    );
    assert!(
        msg.contains("= 32 responses, which does not split into micro-batches of 5"),
        "{msg}"
    );
    assert_eq!(s, Some(4));
    assert_suggestion_fixes(&bad, 8);
    // The reference policy's, once a KL term needs it.
    let ok = with(
        &base,
        &[
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.actor.use_kl_loss=true",
        ],
    );
    let (key, _, _) = batch_err(&ok, 8);
    assert_eq!(
        key,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"
    );
    let bad_ref = with(
        &ok,
        &["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=6"],
    );
    assert_eq!(assert_suggestion_fixes(&bad_ref, 8), 4);
}

#[test]
fn critic_rules() {
    let base = [
        "data.train_batch_size=48",
        "actor_rollout_ref.actor.ppo_mini_batch_size=24",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=6",
        "critic.ppo_micro_batch_size_per_gpu=3",
    ];
    plan(&base, 8).unwrap();
    let bad = with(&base, &["critic.ppo_mini_batch_size=12"]);
    let (key, msg, s) = batch_err(&bad, 8);
    assert_eq!(key, "critic.ppo_mini_batch_size");
    assert!(msg.contains("critic.ppo_mini_batch_size=12 × rollout.n=1 = 12 responses is not divisible by the critic data-parallel size 8"), "{msg}");
    assert_eq!(s, Some(24));
    // Each rank's critic mini-batch is 24 / 8 = 3 responses; the smaller divisor is preferred.
    let bad = with(&base, &["critic.ppo_micro_batch_size_per_gpu=2"]);
    assert_eq!(assert_suggestion_fixes(&bad, 8), 1);
    // The value pass: forward micro-batches must divide each rank's 6 responses.
    let bad = with(&base, &["critic.forward_micro_batch_size_per_gpu=4"]);
    let (key, _, s) = batch_err(&bad, 8);
    assert_eq!(
        (key.as_str(), s),
        ("critic.forward_micro_batch_size_per_gpu", Some(3))
    );
    // A different critic layout.
    let p = validate_batches(
        &cfg(&base),
        Layout {
            world_size: 8,
            dp_size_actor: 8,
            dp_size_critic: 4,
            dp_size_ref: 8,
        },
    )
    .unwrap();
    assert_eq!(p.critic.unwrap().mini_batch_per_rank, 6);
}

#[test]
fn dynamic_batches_need_room_for_one_sequence() {
    let base = [
        "critic.enable=false",
        "data.train_batch_size=64",
        "actor_rollout_ref.actor.ppo_mini_batch_size=32",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "data.max_prompt_length=1024",
        "data.max_response_length=4096",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
    ];
    let (key, msg, s) = batch_err(&base, 8);
    assert_eq!(key, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu");
    assert!(
        msg.contains("rollout.prompt_length=1024 + rollout.response_length=4096 = 5120 tokens"),
        "{msg}"
    );
    assert_eq!(s, Some(5120));
    // Ulysses sequence parallelism is refused by name, not planned around.
    let sp = with(
        &base,
        &["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"],
    );
    let e = Config::from_overrides(&sp).unwrap_err().to_string();
    assert!(
        e.contains("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2")
            && e.contains("Ulysses"),
        "{e}"
    );
}

#[test]
fn validation_batches_are_padded_not_rejected() {
    let base = [
        "critic.enable=false",
        "data.train_batch_size=64",
        "actor_rollout_ref.actor.ppo_mini_batch_size=32",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.rollout.val_kwargs.n=2",
    ];
    let p = plan(&with(&base, &["data.val_batch_size=100"]), 8).unwrap();
    let v = p.validation;
    assert_eq!(
        (
            v.prompts_per_batch,
            v.responses_per_batch,
            v.prompts_per_rank,
            v.padding_prompts
        ),
        (Some(100), Some(200), Some(13), Some(4))
    );
    assert!(
        p.warnings
            .iter()
            .any(|w| w.contains("padded with 4 prompt(s)")),
        "{:?}",
        p.warnings
    );
    let whole = plan(&base, 8).unwrap().validation;
    assert_eq!(whole.prompts_per_batch, None);
    let (key, _, _) = batch_err(&with(&base, &["data.val_batch_size=0"]), 8);
    assert_eq!(key, "data.val_batch_size");
}

#[test]
fn zero_sizes_are_rejected() {
    let (key, _, s) = batch_err(&["actor_rollout_ref.rollout.n=0"], 8);
    assert_eq!((key.as_str(), s), ("actor_rollout_ref.rollout.n", Some(1)));
    let (key, _, _) = batch_err(&["data.train_batch_size=0"], 8);
    assert_eq!(key, "data.train_batch_size");
}

#[test]
fn grpo_with_one_sample_warns() {
    let p = plan(
        &[
            "algorithm.adv_estimator=grpo",
            "data.train_batch_size=64",
            "actor_rollout_ref.actor.ppo_mini_batch_size=32",
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
        ],
        8,
    )
    .unwrap();
    assert!(
        p.warnings
            .iter()
            .any(|w| w.contains("every advantage will be 0")),
        "{:?}",
        p.warnings
    );
}

#[test]
fn layout_from_config() {
    let c = cfg(&["trainer.nnodes=2", "trainer.n_gpus_per_node=8"]);
    assert_eq!(Layout::from_config(&c).unwrap(), Layout::data_parallel(16));
    let c = Config::load(
        format!(
            "{}/tests/fixtures/megatron_grpo.yaml",
            env!("CARGO_MANIFEST_DIR")
        ),
        &[] as &[&str],
    )
    .unwrap();
    let l = Layout::from_config(&c).unwrap();
    assert_eq!((l.world_size, l.dp_size_actor, l.dp_size_ref), (8, 2, 2));
    let p = validate_batches(&c, l).unwrap();
    // 16 prompts × 8 samples / DP 2 = 64 responses per rank per mini-batch.
    assert_eq!(p.actor.mini_batch_per_rank, 64);
    assert_eq!(p.actor.micro_batches_per_mini_batch, Some(32));
    let bad = cfg(&[
        "actor_rollout_ref.actor.strategy=megatron",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3",
    ]);
    let err = Layout::from_config(&bad).unwrap_err();
    assert!(
        err.to_string().contains(
            "8 GPUs cannot be split into model-parallel groups of tensor_model_parallel_size=3"
        ),
        "{err}"
    );
    let err = Layout::from_config(&cfg(&["trainer.n_gpus_per_node=0"])).unwrap_err();
    assert!(matches!(err, ConfigError::Layout { .. }));
}

/// Over a grid of sizes, every suggestion given is one that clears its own rule.
#[test]
fn suggestions_always_clear_their_rule() {
    let mut checked = 0;
    for world in [1u64, 3, 4, 8] {
        for tbs in [6u64, 12, 30, 100] {
            for n in [1u64, 4] {
                for mini in [5u64, 6, 16] {
                    for micro in [1u64, 3] {
                        let ovs = [
                            "critic.enable=false".to_string(),
                            format!("data.train_batch_size={tbs}"),
                            format!("actor_rollout_ref.rollout.n={n}"),
                            format!("actor_rollout_ref.actor.ppo_mini_batch_size={mini}"),
                            format!("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}"),
                            format!("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}"),
                        ];
                        let ovs: Vec<&str> = ovs.iter().map(String::as_str).collect();
                        if let Err(ConfigError::BatchSize {
                            suggested: Some(_), ..
                        }) = plan(&ovs, world)
                        {
                            assert_suggestion_fixes(&ovs, world);
                            checked += 1;
                        }
                    }
                }
            }
        }
    }
    assert!(
        checked > 40,
        "only {checked} failing combinations exercised"
    );
}
