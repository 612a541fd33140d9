//! verl jobs as users bring them, through the real binary: every key acts or is refused with one
//! clear line, `verl run` takes overrides alone as verl's `main_ppo` does, and `--dry-run` checks
//! what a real run would read first.

use std::path::Path;

use verl_e2e::*;

fn repo() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A small GRPO job on one CPU rank, as overrides of verl's defaults.
const CPU_JOB: &[&str] = &[
    "trainer.device=cpu",
    "trainer.n_gpus_per_node=1",
    "trainer.logger=[console]",
    "algorithm.adv_estimator=grpo",
    "data.train_batch_size=16",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.rollout.n=2",
    "data.max_prompt_length=128",
];

/// `verl run` with verl's defaults, the tiny inputs, a CPU job, `extra` and `--dry-run`.
fn dry_run(extra: &[&str]) -> std::process::Output {
    let inst = install(&["libverl_rewards.so", "libverl_fsdp.so"]);
    let mut args: Vec<String> = vec!["run".into()];
    args.extend(tiny_inputs().overrides());
    args.extend(CPU_JOB.iter().map(|s| s.to_string()));
    args.push("data.max_response_length=16".into());
    args.extend(extra.iter().map(|s| s.to_string()));
    args.push("--dry-run".into());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run(&inst.path().join("verl"), &args)
}

fn refused(extra: &[&str], needles: &[&str]) {
    assert_one_line_error(&dry_run(extra), needles);
}

#[test]
fn a_job_of_overrides_alone_dry_runs_like_verls_main_ppo() {
    let o = dry_run(&[]);
    let out = stdout(&o);
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    assert!(out.contains("config        verl's defaults ("), "{out}");
    assert!(out.contains("dry run       ok"), "{out}");
}

#[test]
fn a_reward_model_is_checked_by_the_dry_run_and_a_separate_pool_is_refused() {
    // A missing folder is named by its key (either layout's spelling sets it).
    for enable in [
        "reward_model.enable=true",
        "reward.reward_model.enable=true",
    ] {
        let o = dry_run(&[enable, "reward_model.model.path=/nonexistent/rm"]);
        let err = stderr(&o);
        assert!(!o.status.success(), "{err}");
        assert!(
            err.contains("reward.reward_model.model_path") && err.contains("/nonexistent/rm"),
            "{err}"
        );
    }
    // The policy is a causal LM: as a reward model it is a generative judge, which needs a
    // reward plugin to prompt it.
    let policy = tiny_inputs().model.to_str().unwrap().to_string();
    let o = dry_run(&[
        "reward_model.enable=true",
        &format!("reward_model.model.path={policy}"),
    ]);
    assert!(
        stderr(&o).contains("generative model") && stderr(&o).contains("plugins.reward.default"),
        "{}",
        stderr(&o)
    );
    // verl's separate reward-model GPU pool is not how verl-rs runs it.
    refused(
        &["reward.reward_model.enable_resource_pool=true"],
        &["reward.reward_model.enable_resource_pool=true", "colocated"],
    );
}

#[test]
fn a_missing_python_reward_file_is_named_by_the_dry_run() {
    let o = dry_run(&["custom_reward_function.path=/nonexistent/my_reward.py"]);
    let err = stderr(&o);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("custom_reward_function.path=/nonexistent/my_reward.py")
            && err.contains("no such file"),
        "{err}"
    );
    // A custom Python reward *manager* is still refused.
    refused(
        &["reward.reward_manager.module.path=/nonexistent/manager.py"],
        &[
            "reward.reward_manager.module.path",
            "custom Python reward manager",
        ],
    );
}

#[test]
fn lora_dry_runs_on_fsdp_and_is_refused_by_name_where_it_cannot_act() {
    let o = dry_run(&["actor_rollout_ref.model.lora_rank=64"]);
    let out = stdout(&o);
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    assert!(
        out.contains("lora          rank 64 alpha 16 on \"all-linear\""),
        "{out}"
    );
    refused(
        &[
            "actor_rollout_ref.model.lora_rank=64",
            "actor_rollout_ref.actor.strategy=megatron",
        ],
        &["actor_rollout_ref.model.lora_rank=64", "Megatron"],
    );
    refused(
        &[
            "algorithm.adv_estimator=gae",
            "critic.model.lora_rank=8",
            "actor_rollout_ref.actor.strategy=megatron",
            "critic.strategy=megatron",
        ],
        &["critic.model.lora_rank=8", "Megatron"],
    );
    let o = dry_run(&[
        "algorithm.adv_estimator=gae",
        "critic.model.lora_rank=8",
        "critic.ppo_micro_batch_size_per_gpu=4",
        "critic.forward_micro_batch_size_per_gpu=4",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    refused(
        &["+actor_rollout_ref.model.lora.rank=8"],
        &["actor_rollout_ref.model.lora.rank=8", "lora_rank"],
    );
}

#[test]
fn multi_turn_dry_runs_with_its_tools_and_is_refused_by_name_where_it_cannot_act() {
    // The dry run loads the tool config (the built-in plugin next to the binary) and says what
    // the agent loop will run.
    let inst = install(&["libverl_rewards.so", "libverl_fsdp.so", "libverl_tools.so"]);
    let tools = repo().join("examples/quickstart/tools.yaml");
    let tool_key = format!(
        "actor_rollout_ref.rollout.multi_turn.tool_config_path={}",
        tools.display()
    );
    let mut args: Vec<String> = vec!["run".into()];
    args.extend(tiny_inputs().overrides());
    args.extend(CPU_JOB.iter().map(|s| s.to_string()));
    args.extend([
        "data.max_response_length=16".to_string(),
        "actor_rollout_ref.rollout.multi_turn.enable=true".into(),
        tool_key.clone(),
        "--dry-run".into(),
    ]);
    let a: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = run(&inst.path().join("verl"), &a);
    let out = stdout(&o);
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    assert!(
        out.contains("multi-turn    hermes format, rows without agent_name run single_turn_agent; tools: calculator (calculator)"),
        "{out}"
    );
    // What verl-rs's agent loop does not have is refused by key.
    let on = "actor_rollout_ref.rollout.multi_turn.enable=true";
    refused(
        &[on, "actor_rollout_ref.actor.strategy=megatron"],
        &["actor_rollout_ref.rollout.multi_turn.enable", "fsdp"],
    );
    refused(
        &[
            on,
            "actor_rollout_ref.rollout.multi_turn.format=llama3_json",
        ],
        &["actor_rollout_ref.rollout.multi_turn.format", "hermes"],
    );
    refused(
        &[
            on,
            "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template=true",
        ],
        &["use_inference_chat_template", "leave it false"],
    );
    refused(
        &[
            on,
            "actor_rollout_ref.rollout.multi_turn.function_tool_path=tools.py",
        ],
        &["function_tool_path", "tool_config_path"],
    );
    refused(
        &[
            on,
            "actor_rollout_ref.rollout.agent.default_agent_loop=react_agent",
        ],
        &["default_agent_loop", "tool_agent"],
    );
}

#[test]
fn the_dapo_reward_manager_and_its_overlong_buffer_are_checked_by_the_dry_run() {
    let dapo = [
        "reward_model.reward_manager=dapo",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=true",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.len=512",
    ];
    // verl's manager needs max_resp_len with the buffer on; the dry run says so by key.
    let o = dry_run(&dapo);
    let err = stderr(&o);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("reward.reward_kwargs.max_resp_len"), "{err}");
    let mut ok = dapo.to_vec();
    ok.push("+reward_model.reward_kwargs.max_resp_len=2048");
    let o = dry_run(&ok);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("reward mgr    dapo: overlong buffer 512"),
        "{}",
        stdout(&o)
    );
    // Other managers are refused by name.
    refused(
        &["reward_model.reward_manager=prime"],
        &["reward_model.reward_manager=prime", "dapo"],
    );
}

#[test]
fn ulysses_and_hybrid_sharding_are_refused_by_name() {
    refused(
        &["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"],
        &["ulysses_sequence_parallel_size=2", "Ulysses"],
    );
    refused(
        &[
            "trainer.n_gpus_per_node=4",
            "trainer.device=cpu",
            "actor_rollout_ref.actor.fsdp_config.fsdp_size=2",
        ],
        &["fsdp_size=2", "hybrid sharding"],
    );
}

#[test]
fn multimodal_rows_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let row = serde_json::json!({
        "prompt": [{"role": "user", "content": "<image>What is shown?"}],
        "data_source": "hiyouga/geometry3k", "reward_model": {"style": "rule", "ground_truth": "3"},
        "images": [{"bytes": "iVBORw0KGgo="}],
    });
    let file = write(dir.path(), "vl.jsonl", &format!("{row}\n"));
    let files = format!("data.train_files={}", file.display());
    refused(
        &[&files, "data.image_key=images"],
        &[
            "vl.jsonl",
            "row 0",
            "`images`",
            "data.image_key",
            "text-only",
        ],
    );
}

#[test]
fn the_dry_run_checks_the_data_files_and_the_model_folder() {
    refused(
        &["data.train_files=/nonexistent/train.parquet"],
        &[
            "data.train_files",
            "/nonexistent/train.parquet",
            "does not exist",
        ],
    );
    let dir = tempfile::tempdir().unwrap();
    let bad = write(dir.path(), "train.parquet", "not a parquet file");
    let files = format!("data.train_files={}", bad.display());
    refused(&[&files], &["data.train_files", "train.parquet", "parquet"]);
    refused(
        &["actor_rollout_ref.model.path=/nonexistent/model"],
        &["actor_rollout_ref.model.path", "/nonexistent/model"],
    );
}

#[test]
fn a_gpu_job_dry_runs_here_and_says_what_it_could_not_check() {
    let o = dry_run(&[
        "trainer.device=cuda",
        "trainer.n_gpus_per_node=8",
        "data.train_batch_size=64",
        "actor_rollout_ref.actor.ppo_mini_batch_size=32",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    ]);
    let out = stdout(&o);
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    assert!(
        out.contains("64 prompts × n=2 = 128 responses per step over 8 rank(s) (16 per rank)"),
        "{out}"
    );
    assert!(out.contains("not checked   GPUs:"), "{out}");
    assert!(out.contains("dry run       ok"), "{out}");
    // Two nodes without torchrun/SLURM: the arithmetic is checked, the launch is not.
    let o = dry_run(&[
        "trainer.device=cuda",
        "trainer.nnodes=2",
        "trainer.n_gpus_per_node=8",
        "data.train_batch_size=64",
        "actor_rollout_ref.actor.ppo_mini_batch_size=32",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    ]);
    let out = stdout(&o);
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    assert!(out.contains("over 16 rank(s)"), "{out}");
    assert!(out.contains("not checked   launch:"), "{out}");
}

#[test]
fn engine_knobs_are_one_warning_each_in_the_dry_run() {
    let o = dry_run(&[
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.enable_chunked_prefill=false",
    ]);
    let out = stdout(&o);
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    let ignored: Vec<&str> = out.lines().filter(|l| l.contains("ignored")).collect();
    assert_eq!(ignored.len(), 2, "{out}");
    assert!(
        ignored
            .iter()
            .any(|l| l.contains("actor_rollout_ref.rollout.name=vllm") && l.contains("vLLM")),
        "{out}"
    );
}

#[test]
fn hydras_config_name_picks_verls_trainer_config() {
    let inst = install(&["libverl_rewards.so", "libverl_megatron.so"]);
    let mut args: Vec<String> = vec![
        "run".into(),
        "--config-path=config".into(),
        "--config-name=ppo_megatron_trainer".into(),
    ];
    args.extend(tiny_inputs().overrides());
    args.extend(CPU_JOB.iter().map(|s| s.to_string()));
    args.push("--dry-run".into());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = run(&inst.path().join("verl"), &args);
    let out = stdout(&o);
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    assert!(out.contains("backend       megatron"), "{out}");
    assert!(out.contains("layout        actor: TP 1"), "{out}");
}

#[test]
fn plugins_search_path_is_searched_before_the_binary_dir() {
    // A bare install (no plugins next to the binary) finds them on plugins.search_path.
    let inst = install(&[]);
    let search = format!("plugins.search_path=[{}]", build_dir().display());
    let mut args: Vec<String> = vec!["run".into()];
    args.extend(tiny_inputs().overrides());
    args.push(search.clone());
    args.extend(CPU_JOB.iter().map(|s| s.to_string()));
    args.push("--dry-run".into());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = run(&inst.path().join("verl"), &args);
    let out = stdout(&o);
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    assert!(
        out.contains(&format!("({}/libverl_fsdp.so)", build_dir().display())),
        "{out}"
    );
    // Without it, the bare install finds nothing.
    let args: Vec<&str> = args
        .into_iter()
        .filter(|a| !a.starts_with("plugins."))
        .collect();
    assert_one_line_error(&run(&inst.path().join("verl"), &args), &["fsdp"]);
}

#[test]
fn config_keys_lists_every_key_with_its_class() {
    let o = run(&verl_bin(), &["config", "keys"]);
    let out = stdout(&o);
    assert!(o.status.success(), "{}", stderr(&o));
    for line in [
        "actor_rollout_ref.model.lora_rank\tacts",
        "critic.model.lora_rank\tacts",
        "actor_rollout_ref.rollout.gpu_memory_utilization\tacts",
        "actor_rollout_ref.rollout.enable_chunked_prefill\tharmless",
        "actor_rollout_ref.actor.fsdp_config.param_offload\tacts (fsdp)",
        "trainer.balance_batch\tacts",
    ] {
        assert!(out.lines().any(|l| l == line), "missing {line:?}");
    }
    let md = run(&verl_bin(), &["config", "keys", "--markdown"]);
    let committed = std::fs::read_to_string(repo().join("docs/config-keys.md")).unwrap();
    assert_eq!(stdout(&md), committed, "docs/config-keys.md is stale");
}
