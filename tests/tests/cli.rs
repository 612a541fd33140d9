//! The `verl` command end to end: plugin inspection, the doctor, dry runs, and every class of bad
//! input giving one clear line and a non-zero exit code.

use std::path::{Path, PathBuf};

use verl_e2e::*;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// `run <quickstart job> <its inputs> extra...` (the tiny data and model of `tiny_inputs`).
fn quickstart_args(extra: &[&str]) -> Vec<String> {
    let mut args = vec!["run".to_string(), quickstart_job()];
    args.extend(tiny_inputs().overrides());
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

fn run_args(bin: &Path, args: &[String]) -> std::process::Output {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run(bin, &args)
}

fn quickstart_job() -> String {
    repo()
        .join("examples/quickstart/job.yaml")
        .display()
        .to_string()
}

#[test]
fn inspect_describes_each_real_plugin() {
    let verl = verl_bin();
    let rewards = run(
        &verl,
        &[
            "plugin",
            "inspect",
            plugin("libverl_rewards.so").to_str().unwrap(),
        ],
    );
    assert!(rewards.status.success(), "{}", stderr(&rewards));
    let out = stdout(&rewards);
    assert!(out.contains("name          rewards"), "{out}");
    assert!(out.contains("kind          reward"), "{out}");
    assert!(out.contains("reward     ready"), "{out}");
    assert!(out.contains("compatible    yes"), "{out}");

    for (file, name, actor) in [
        ("libverl_fsdp.so", "fsdp", "actor      ready"),
        ("libverl_megatron.so", "megatron", "actor      ready"),
    ] {
        let o = run(
            &verl,
            &["plugin", "inspect", plugin(file).to_str().unwrap()],
        );
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        let out = stdout(&o);
        assert!(out.contains(&format!("name          {name}")), "{out}");
        assert!(out.contains("kind          backend"), "{out}");
        assert!(out.contains(actor), "{out}");
        assert!(out.contains("libtorch   2.11"), "{out}");
        assert!(out.contains("preloaded from"), "{out}");
    }
}

#[test]
fn plugins_are_found_by_name_next_to_the_binary() {
    let inst = install(&["libverl_rewards.so"]);
    let o = run(&inst.path().join("verl"), &["plugin", "inspect", "rewards"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains(&inst.path().join("libverl_rewards.so").display().to_string()));
}

#[test]
fn the_built_in_tools_are_found_by_name_and_inspected() {
    let inst = install(&["libverl_tools.so"]);
    let o = run(&inst.path().join("verl"), &["plugin", "inspect", "tools"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("kind          tool"), "{out}");
    assert!(
        out.contains("tools         calculator, gsm8k, verl.tools.gsm8k_tool.Gsm8kTool, python"),
        "{out}"
    );
    assert!(out.contains("compatible    yes"), "{out}");
    assert!(
        out.contains("`calculator`: Evaluate an arithmetic expression"),
        "{out}"
    );
    assert!(
        out.contains("`calc_gsm8k_reward`: A tool for calculating"),
        "{out}"
    );
    assert!(out.contains("`python`: Run Python 3 code"), "{out}");
}

#[test]
fn plugin_path_env_is_searched_first() {
    let inst = install(&[]);
    let o = std::process::Command::new(inst.path().join("verl"))
        .args(["plugin", "inspect", "rewards"])
        .env("VERL_PLUGIN_PATH", build_dir())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn doctor_reports_libtorch_and_plugins() {
    let inst = install(&[
        "libverl_rewards.so",
        "libverl_fsdp.so",
        "libverl_megatron.so",
    ]);
    let o = run(&inst.path().join("verl"), &["doctor"]);
    let out = stdout(&o);
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    assert!(out.contains("✓ libtorch  2.11.0"), "{out}");
    assert!(
        out.contains("✓ plugin    rewards 0.1.0 (reward plugin: reward)"),
        "{out}"
    );
    assert!(
        out.contains(
            "✓ plugin    fsdp 0.1.0 (backend plugin: actor, reference, critic, reward_model)"
        ),
        "{out}"
    );
    assert!(
        out.contains(
            "✓ plugin    megatron 0.1.0 (backend plugin: actor, reference, critic, reward_model)"
        ),
        "{out}"
    );
    assert!(out.contains("CUDA"), "{out}");
}

#[test]
fn doctor_marks_an_incompatible_plugin_with_a_fix() {
    let inst = install(&["libverl_rewards.so", "libfuture_api_plugin.so"]);
    let o = run(&inst.path().join("verl"), &["doctor"]);
    let out = stdout(&o);
    assert!(!o.status.success(), "{out}");
    assert!(out.contains("✗ plugin    future 3.1.4"), "{out}");
    assert!(out.contains("plugin-api 9.0.0"), "{out}");
    assert!(out.contains("  fix: rebuild future"), "{out}");
}

#[test]
fn dry_run_of_the_quickstart_checks_config_plugins_and_batches() {
    let inst = install(&["libverl_rewards.so", "libverl_fsdp.so"]);
    let o = run_args(&inst.path().join("verl"), &quickstart_args(&["--dry-run"]));
    let out = stdout(&o);
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    assert!(out.contains("backend       fsdp 0.1.0"), "{out}");
    assert!(
        out.contains("reward        rewards: rewards 0.1.0"),
        "{out}"
    );
    assert!(
        out.contains("16 prompts × n=8 = 128 responses per step over 1 rank(s)"),
        "{out}"
    );
    assert!(
        out.contains("1 mini-batch(es) × 1 epoch(s) = 1 optimizer step(s) per step"),
        "{out}"
    );
    // What a run reads first: the data files (rows, data sources), the model and tokenizer.
    assert!(
        out.contains("data          train: 64 rows in 1 file(s), data sources: openai/gsm8k ✓"),
        "{out}"
    );
    assert!(out.contains("data          val: 16 rows"), "{out}");
    assert!(out.contains("(Qwen2ForCausalLM), tokenizer"), "{out}");
    assert!(out.contains("logger        console: ok ✓"), "{out}");
    assert!(out.contains("dry run       ok"), "{out}");
    // The fsdp backend reads the model's config.json upfront, and says how generation is laid
    // out (verl's default rollout TP 2 does not fit one rank).
    assert!(
        out.contains(
            "layout        actor: qwen2, 1 layers, hidden 32; 1 rank(s); generation at \
             tensor-parallel size 1 in 1 rollout group(s) ✓"
        ),
        "{out}"
    );
}

#[test]
fn dry_run_refuses_an_architecture_the_backend_cannot_build() {
    let inst = install(&["libverl_rewards.so", "libverl_fsdp.so"]);
    let args = quickstart_args(&["--dry-run"]);
    let model = args
        .iter()
        .find_map(|a| a.strip_prefix("actor_rollout_ref.model.path="))
        .expect("the quickstart arguments name the model")
        .to_string();
    // The same folder, but its config.json names an architecture verl-rs does not build.
    let tmp = tempfile::tempdir().unwrap();
    let copy = tmp.path().join("gpt-oss");
    std::fs::create_dir_all(&copy).unwrap();
    for entry in std::fs::read_dir(&model).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, copy.join(p.file_name().unwrap())).unwrap();
    }
    let cfg_path = copy.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["model_type"] = "gpt_oss".into();
    cfg["architectures"] = serde_json::json!(["GptOssForCausalLM"]);
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let mut args: Vec<String> = args
        .into_iter()
        .filter(|a| !a.starts_with("actor_rollout_ref.model.path="))
        .collect();
    args.push(format!("actor_rollout_ref.model.path={}", copy.display()));
    let o = run_args(&inst.path().join("verl"), &args);
    let err = stderr(&o);
    assert!(!o.status.success(), "{}", stdout(&o));
    assert!(
        err.contains("actor_rollout_ref.model.path")
            && err.contains("gpt_oss")
            && err.contains("config.json"),
        "{err}"
    );
}

#[test]
fn overrides_change_the_dry_run_arithmetic() {
    let inst = install(&["libverl_rewards.so", "libverl_fsdp.so"]);
    let o = run_args(
        &inst.path().join("verl"),
        &quickstart_args(&[
            "data.train_batch_size=32",
            "actor_rollout_ref.rollout.n=16",
            "--dry-run",
        ]),
    );
    let out = stdout(&o);
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    assert!(out.contains("32 prompts × n=16 = 512 responses"), "{out}");
    assert!(out.contains("2 mini-batch(es)"), "{out}");
}

#[test]
fn bad_plugin_paths_each_give_one_line() {
    let verl = verl_bin();
    let dir = tempfile::tempdir().unwrap();
    let text = write(dir.path(), "notes.txt", "hello");
    let cases: Vec<(String, Vec<&str>)> = vec![
        (
            "/no/such/libplugin.so".into(),
            vec!["plugin not found", "/no/such/libplugin.so"],
        ),
        (
            text.display().to_string(),
            vec!["is not a shared library", "notes.txt"],
        ),
        (
            plugin("libnot_a_plugin.so").display().to_string(),
            vec!["not a verl plugin", "verl_plugin_header"],
        ),
        (
            plugin("libfuture_api_plugin.so").display().to_string(),
            vec![
                "`future`",
                "plugin-api 9.0.0",
                "rebuild it against verl-plugin-api 0.1",
            ],
        ),
        (
            plugin("liblayout_mismatch_plugin.so").display().to_string(),
            vec!["`skewed`", "root module does not match", "--verbose"],
        ),
    ];
    for (path, needles) in cases {
        let o = run(&verl, &["plugin", "inspect", &path]);
        assert_one_line_error(&o, &needles);
    }
}

#[test]
fn layout_mismatch_shows_the_full_report_with_verbose() {
    let o = run(
        &verl_bin(),
        &[
            "-v",
            "plugin",
            "inspect",
            plugin("liblayout_mismatch_plugin.so").to_str().unwrap(),
        ],
    );
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(
        err.lines().count() > 3,
        "expected abi_stable's report:\n{err}"
    );
}

#[test]
fn a_torch_plugin_without_libtorch_says_how_to_fix_it() {
    let inst = install(&["libverl_fsdp.so"]);
    let o = std::process::Command::new(inst.path().join("verl"))
        .args(["plugin", "inspect", "fsdp"])
        .env_remove("LIBTORCH")
        .env("VERL_PYTHON", "/nonexistent/python3")
        .output()
        .unwrap();
    assert_one_line_error(&o, &["needs libtorch", "scripts/setup.sh", "LIBTORCH"]);
}

fn job_with(dir: &Path, yaml: &str) -> String {
    write(dir, "job.yaml", yaml).display().to_string()
}

#[test]
fn config_errors_each_give_one_line() {
    let verl = verl_bin();
    let dir = tempfile::tempdir().unwrap();
    let syntax = job_with(dir.path(), "data:\n  train_batch_size: [1, 2\n");
    assert_one_line_error(
        &run(&verl, &["run", &syntax, "--dry-run"]),
        &["job.yaml:3:1", "YAML syntax error"],
    );

    let d2 = tempfile::tempdir().unwrap();
    let unknown = job_with(d2.path(), "trainer:\n  totl_epochs: 3\n");
    assert_one_line_error(
        &run(&verl, &["run", &unknown, "--dry-run"]),
        &["trainer.totl_epochs", "trainer.total_epochs"],
    );

    let d3 = tempfile::tempdir().unwrap();
    let wrong = job_with(d3.path(), "data:\n  train_batch_size: lots\n");
    assert_one_line_error(
        &run(&verl, &["run", &wrong, "--dry-run"]),
        &["data.train_batch_size"],
    );

    let o = run(
        &verl,
        &[
            "run",
            &quickstart_job(),
            "actor_rollout_ref.actor.optim.lrr=1e-6",
            "--dry-run",
        ],
    );
    assert_one_line_error(
        &o,
        &[
            "actor_rollout_ref.actor.optim.lrr",
            "actor_rollout_ref.actor.optim.lr",
        ],
    );
}

#[test]
fn batch_sizes_that_do_not_divide_show_the_arithmetic() {
    let o = run(
        &verl_bin(),
        &[
            "run",
            &quickstart_job(),
            "actor_rollout_ref.actor.ppo_mini_batch_size=5",
            "--dry-run",
        ],
    );
    assert_one_line_error(&o, &["ppo_mini_batch_size", "valid"]);
}

fn jsonl(dir: &Path, rows: &[serde_json::Value]) -> String {
    let text: Vec<String> = rows.iter().map(|r| r.to_string()).collect();
    write(dir, "in.jsonl", &(text.join("\n") + "\n"))
        .display()
        .to_string()
}

#[test]
fn reward_score_prints_accuracy_per_data_source_and_writes_scores() {
    let dir = tempfile::tempdir().unwrap();
    let input = jsonl(
        dir.path(),
        &[
            serde_json::json!({"data_source": "openai/gsm8k", "solution_str": "so #### 72", "ground_truth": "72"}),
            serde_json::json!({"data_source": "openai/gsm8k", "solution_str": "#### 70", "ground_truth": "72"}),
            serde_json::json!({"data_source": "lighteval/MATH", "solution_str": "\\boxed{\\frac{1}{2}}", "ground_truth": "\\frac12"}),
        ],
    );
    let out = dir.path().join("out.jsonl");
    let o = run(
        &verl_bin(),
        &["reward", "score", &input, "--out", out.to_str().unwrap()],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let table = stdout(&o);
    assert!(
        table.contains("openai/gsm8k") && table.contains("0.5000"),
        "{table}"
    );
    assert!(table.contains("lighteval/MATH"), "{table}");
    let written = std::fs::read_to_string(out).unwrap();
    let scores: Vec<f64> = written
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["score"]
                .as_f64()
                .unwrap()
        })
        .collect();
    assert_eq!(scores, vec![1.0, 0.0, 1.0]);
}

#[test]
fn a_plugin_that_panics_fails_the_call_with_its_name() {
    let dir = tempfile::tempdir().unwrap();
    let input = jsonl(
        dir.path(),
        &[serde_json::json!({"data_source": "panic", "solution_str": "x", "ground_truth": "1"})],
    );
    let faulty = plugin("libfaulty_plugin.so");
    let o = run(
        &verl_bin(),
        &[
            "--plugin",
            faulty.to_str().unwrap(),
            "reward",
            "score",
            &input,
        ],
    );
    assert_one_line_error(&o, &["plugin `faulty`", "panicked", "boom while scoring"]);
}

#[test]
fn a_reward_plugin_returning_nan_or_too_few_scores_is_caught() {
    let faulty = plugin("libfaulty_plugin.so");
    for (source, needles) in [
        ("nan", vec!["plugin `faulty`", "non-finite score"]),
        ("short", vec!["faulty.reward.score", "`scores`", "rows=1"]),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let input = jsonl(
            dir.path(),
            &[serde_json::json!({"data_source": source, "solution_str": "x", "ground_truth": "1"})],
        );
        let o = run(
            &verl_bin(),
            &[
                "--plugin",
                faulty.to_str().unwrap(),
                "reward",
                "score",
                &input,
            ],
        );
        assert_one_line_error(&o, &needles);
    }
}

#[test]
fn plugin_tracing_events_reach_the_host_log() {
    let dir = tempfile::tempdir().unwrap();
    let input = jsonl(
        dir.path(),
        &[serde_json::json!({"data_source": "log", "solution_str": "x", "ground_truth": "1"})],
    );
    let faulty = plugin("libfaulty_plugin.so");
    let o = run(
        &verl_bin(),
        &[
            "--plugin",
            faulty.to_str().unwrap(),
            "reward",
            "score",
            &input,
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("hello from inside the faulty plugin"), "{err}");
    assert!(
        err.contains("plugin=\"faulty\"") || err.contains("plugin=faulty"),
        "{err}"
    );
}

#[test]
fn completions_and_version() {
    let v = run(&verl_bin(), &["--version"]);
    assert!(stdout(&v).starts_with("verl "), "{}", stdout(&v));
    let c = run(&verl_bin(), &["completions", "bash"]);
    assert!(c.status.success());
    assert!(
        stdout(&c).contains("_verl()"),
        "bash completion function missing"
    );
}

#[test]
fn data_gsm8k_writes_verl_format_parquet() {
    // Absent: a skip, or a failure under VERL_REQUIRE_SHARED=1 (CI).
    let Some(test) = verl_test_support::shared_path("data/gsm8k/test.jsonl") else {
        return;
    };
    let shared = test.parent().unwrap();
    let out = tempfile::tempdir().unwrap();
    let o = run(
        &verl_bin(),
        &[
            "data",
            "gsm8k",
            shared.to_str().unwrap(),
            out.path().to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains("train.parquet (7473 rows)"), "{text}");
    assert!(text.contains("test.parquet (1319 rows)"), "{text}");
}

#[test]
fn data_math_writes_verl_format_parquet_and_examples() {
    let raw = repo().join("crates/data/tests/fixtures/math/raw");
    let out = tempfile::tempdir().unwrap();
    let o = run(
        &verl_bin(),
        &[
            "data",
            "math",
            raw.to_str().unwrap(),
            out.path().to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains("train.parquet (41 rows)"), "{text}");
    assert!(text.contains("test.parquet (38 rows)"), "{text}");
    assert!(out.path().join("test_example.json").is_file());

    // A bad row is one line naming the file, row and column, and a non-zero exit.
    let bad = tempfile::tempdir().unwrap();
    let row = r#"{"problem": "p", "level": "L", "solution": "It is 5.", "type": "x"}"#;
    for split in ["train", "test"] {
        std::fs::write(bad.path().join(format!("{split}.jsonl")), row).unwrap();
    }
    let o = run(
        &verl_bin(),
        &[
            "data",
            "math",
            bad.path().to_str().unwrap(),
            out.path().to_str().unwrap(),
        ],
    );
    assert_one_line_error(&o, &["train.jsonl", "row 0, column `solution`"]);
}

#[test]
fn plot_draws_chosen_metrics_from_a_metrics_file() {
    let dir = tempfile::tempdir().unwrap();
    let mut lines = String::new();
    for step in 1..=5 {
        lines.push_str(
            &serde_json::json!({"step": step, "data": {"critic/score/mean": step as f64 / 5.0, "actor/pg_loss": 0.1}})
                .to_string(),
        );
        lines.push('\n');
    }
    let jsonl = write(dir.path(), "metrics.jsonl", &lines);
    let out = dir.path().join("curves.svg");
    let o = run(
        &verl_bin(),
        &[
            "plot",
            jsonl.to_str().unwrap(),
            "-m",
            "critic/score/mean",
            "-o",
            out.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let svg = std::fs::read_to_string(&out).unwrap();
    assert!(
        svg.contains("<svg") && svg.contains("critic/score/mean"),
        "svg lacks the metric"
    );
    let missing = run(
        &verl_bin(),
        &["plot", jsonl.to_str().unwrap(), "-m", "no/such/metric"],
    );
    assert_one_line_error(&missing, &["no/such/metric"]);
}

/// A model folder holding a config.json of this shape and a tokenizer, no weights: the dry run's
/// layout and model checks need nothing else.
fn config_only_model(dir: &Path, config: serde_json::Value) -> String {
    tiny_inputs()
        .model_with_config(dir, &config)
        .display()
        .to_string()
}

fn tiny_qwen2(heads: i64, kv_heads: i64, layers: i64) -> serde_json::Value {
    serde_json::json!({
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 128,
        "tie_word_embeddings": true,
    })
}

fn tiny_mixtral(experts: i64) -> serde_json::Value {
    serde_json::json!({
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
        "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_local_experts": experts, "num_experts_per_tok": 2,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 128,
    })
}

/// `verl run <quickstart> --dry-run` on the megatron backend with `model` and extra overrides.
fn megatron_dry_run(model: &str, world: u32, extra: &[&str]) -> std::process::Output {
    let inst = install(&["libverl_rewards.so", "libverl_megatron.so"]);
    let job = quickstart_job();
    let path = format!("actor_rollout_ref.model.path={model}");
    let gpus = format!("trainer.n_gpus_per_node={world}");
    let data: Vec<String> = tiny_inputs().overrides()[..2].to_vec();
    let mut args = vec![
        "run",
        job.as_str(),
        data[0].as_str(),
        data[1].as_str(),
        "actor_rollout_ref.actor.strategy=megatron",
        path.as_str(),
        gpus.as_str(),
    ];
    args.extend_from_slice(extra);
    args.push("--dry-run");
    run(&inst.path().join("verl"), &args)
}

#[test]
fn megatron_dry_run_rejects_a_tensor_parallel_size_that_does_not_divide_the_heads() {
    let dir = tempfile::tempdir().unwrap();
    let model = config_only_model(&dir.path().join("model"), tiny_qwen2(4, 2, 2));
    let o = megatron_dry_run(
        &model,
        3,
        &["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3"],
    );
    assert_one_line_error(
        &o,
        &[
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size",
            "tensor_model_parallel_size=3 does not divide num_attention_heads=4",
            "valid: 1, 2, 4",
        ],
    );
}

#[test]
fn megatron_dry_run_rejects_experts_that_do_not_split_over_expert_parallel_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let model = config_only_model(&dir.path().join("model"), tiny_mixtral(4));
    let o = megatron_dry_run(
        &model,
        3,
        &[
            "actor_rollout_ref.actor.megatron.expert_model_parallel_size=3",
            // Batches that split over the 3 data-parallel ranks, so the layout is what fails.
            "data.train_batch_size=24",
            "actor_rollout_ref.actor.ppo_mini_batch_size=24",
        ],
    );
    assert_one_line_error(
        &o,
        &[
            "actor_rollout_ref.actor.megatron.expert_model_parallel_size",
            "expert_model_parallel_size=3 does not divide num_experts=4",
            "4 experts / 3 ranks = 1.33 experts per rank",
            "valid",
        ],
    );
}

#[test]
fn megatron_dry_run_prints_each_roles_layout() {
    let dir = tempfile::tempdir().unwrap();
    let model = config_only_model(&dir.path().join("model"), tiny_qwen2(4, 2, 4));
    let o = megatron_dry_run(
        &model,
        4,
        &[
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
            "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1",
            "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=1",
            "actor_rollout_ref.ref.megatron.virtual_pipeline_model_parallel_size=null",
        ],
    );
    let out = stdout(&o);
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    assert!(
        out.contains(
            "layout        actor: TP 2 × PP 2 (VPP 2) × CP 1 × DP 1 = 4 rank(s); sequence parallel; distributed optimizer"
        ),
        "{out}"
    );
    assert!(
        out.contains("layout        reference: TP 1 × PP 1 × CP 1 × DP 4 = 4 rank(s)"),
        "{out}"
    );
    assert!(out.contains("dry run       ok"), "{out}");

    // A mixture-of-experts model shows its expert grid.
    let moe = config_only_model(&dir.path().join("moe"), tiny_mixtral(4));
    let o = megatron_dry_run(
        &moe,
        4,
        &[
            "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32",
        ],
    );
    let out = stdout(&o);
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    assert!(
        out.contains("layout        actor: TP 1 × PP 1 × CP 1 × DP 4 = 4 rank(s); experts: EP 2 × ETP 1 × EDP 2"),
        "{out}"
    );
}
