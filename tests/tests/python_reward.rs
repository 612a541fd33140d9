//! verl's `custom_reward_function` through the real binary: a user's Python file, unchanged,
//! scores a GRPO job; rewards that hang, crash or eat memory end the step with one error naming
//! the function and the limit, or, with `plugins.reward.on_error=zero`, score 0 and are counted.

use std::path::Path;

use serde_json::Value;
use verl_e2e::*;

const USER_REWARD: &str = r#"
# A reward function written for verl: keyword arguments, a dict with `score` and extras.
def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    return {"score": (len(solution_str) % 7) / 7.0 + bonus, "chars": len(solution_str)}

def one(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0

def sleeps(data_source, solution_str, ground_truth, extra_info=None):
    import time
    time.sleep(3600)

def aborts(data_source, solution_str, ground_truth, extra_info=None):
    import os
    os.abort()

def spins(data_source, solution_str, ground_truth, extra_info=None):
    while True:
        pass

def hungry(data_source, solution_str, ground_truth, extra_info=None):
    hoard = []
    while True:
        hoard.append(bytearray(10 ** 7))
"#;

fn job_args(dir: &Path, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = vec!["run".into()];
    a.extend(tiny_inputs().overrides());
    a.extend(
        [
            "trainer.device=cpu",
            "trainer.n_gpus_per_node=1",
            "trainer.logger=[console,file]",
            "trainer.total_training_steps=1",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            "trainer.save_freq=-1",
            "algorithm.adv_estimator=grpo",
            "data.train_batch_size=4",
            "data.max_prompt_length=128",
            "data.max_response_length=8",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
            "reward.num_workers=2",
        ]
        .iter()
        .map(|s| s.to_string()),
    );
    a.push(format!(
        "trainer.default_local_dir={}",
        dir.join("ckpt").display()
    ));
    a.push(format!(
        "trainer.rollout_data_dir={}",
        dir.join("rollouts").display()
    ));
    a.push(format!("plugins.reward.python={}", python().display()));
    a.push(format!(
        "custom_reward_function.path={}",
        dir.join("my_reward.py").display()
    ));
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

fn verl_run(dir: &Path, extra: &[&str]) -> std::process::Output {
    let inst = install(&["libverl_fsdp.so", "libverl_rewards.so"]);
    std::fs::write(dir.join("my_reward.py"), USER_REWARD).unwrap();
    let args = job_args(dir, extra);
    std::process::Command::new(inst.path().join("verl"))
        .args(&args)
        .current_dir(dir)
        .env_remove("VERL_PLUGIN_PATH")
        .env("VERL_FILE_LOGGER_ROOT", dir.join("logs"))
        .output()
        .unwrap()
}

#[test]
fn a_grpo_job_scores_with_the_users_python_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    // The dry run imports the file in the job's Python.
    std::fs::write(dir.join("my_reward.py"), USER_REWARD).unwrap();
    let o = run(
        &install(&["libverl_fsdp.so", "libverl_rewards.so"])
            .path()
            .join("verl"),
        &job_args(
            dir,
            &[
                "+custom_reward_function.reward_kwargs.bonus=0.25",
                "--dry-run",
            ],
        )
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>(),
    );
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    assert!(
        stdout(&o).contains("reward fn") && stdout(&o).contains("compute_score imports"),
        "{}",
        stdout(&o)
    );

    let o = verl_run(dir, &["+custom_reward_function.reward_kwargs.bonus=0.25"]);
    assert!(o.status.success(), "{}\n{}", stdout(&o), stderr(&o));
    // Every row's score is what the file computes from the response, with the kwarg; the
    // dict's extra key comes along.
    let rows: Vec<Value> = std::fs::read_to_string(dir.join("rollouts/1.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 8);
    for r in &rows {
        let out = r["output"].as_str().unwrap();
        let n = out.chars().count();
        let want = (n % 7) as f64 / 7.0 + 0.25;
        assert!((r["score"].as_f64().unwrap() - want).abs() < 1e-9, "{r}");
        assert_eq!(r["chars"].as_f64(), Some(n as f64), "{r}");
    }
    let m: Value = serde_json::from_str(
        std::fs::read_to_string(metrics_jsonl(&dir.join("logs")))
            .unwrap()
            .lines()
            .next()
            .unwrap(),
    )
    .unwrap();
    let mean = rows
        .iter()
        .map(|r| r["score"].as_f64().unwrap())
        .sum::<f64>()
        / 8.0;
    assert!((m["data"]["critic/score/mean"].as_f64().unwrap() - mean).abs() < 1e-6);
}

#[test]
fn a_hanging_crashing_or_hungry_reward_ends_the_step_by_name_or_scores_zero() {
    let cases: [(&str, &[&str], &[&str]); 4] = [
        (
            "sleeps",
            &["plugins.reward.timeout_s=2"],
            &["`sleeps`", "timeout of 2 s", "plugins.reward.timeout_s"],
        ),
        ("aborts", &[], &["`aborts`", "crashed", "SIGABRT"]),
        (
            "hungry",
            &["plugins.reward.memory_mb=400"],
            &["`hungry`", "MemoryError", "memory limit of 400 MB"],
        ),
        (
            "spins",
            &["plugins.reward.cpu_s=1"],
            &["`spins`", "SIGXCPU", "CPU-time limit of 1 s"],
        ),
    ];
    for (name, limits, needles) in cases {
        let tmp = tempfile::tempdir().unwrap();
        let fn_name = format!("custom_reward_function.name={name}");
        let mut extra: Vec<&str> = vec![&fn_name];
        extra.extend_from_slice(limits);
        let o = verl_run(tmp.path(), &extra);
        assert!(!o.status.success(), "{name}: the run should fail");
        let err = stderr(&o);
        for n in needles {
            assert!(err.contains(n), "{name}: missing `{n}` in:\n{err}");
        }
        // With on_error=zero the step completes, those rows score 0 and are counted.
        let tmp = tempfile::tempdir().unwrap();
        extra.push("plugins.reward.on_error=zero");
        let o = verl_run(tmp.path(), &extra);
        assert!(o.status.success(), "{name} (on_error=zero): {}", stderr(&o));
        let m: Value = serde_json::from_str(
            std::fs::read_to_string(metrics_jsonl(&tmp.path().join("logs")))
                .unwrap()
                .lines()
                .next()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(
            m["data"]["reward/error_ratio"].as_f64(),
            Some(1.0),
            "{name}: {m}"
        );
        assert_eq!(m["data"]["critic/score/max"].as_f64(), Some(0.0), "{name}");
    }
}

#[test]
fn the_dapo_manager_adds_verls_overlong_penalty() {
    // Responses of up to 8 tokens against max_resp_len 8 with a buffer of 4: every token past
    // the 4th costs 0.25. The function scores 1, so each row's reward is 1 + its penalty.
    let tmp = tempfile::tempdir().unwrap();
    let o = verl_run(
        tmp.path(),
        &[
            "custom_reward_function.name=one",
            "reward.reward_manager.name=dapo",
            "+reward.reward_kwargs.overlong_buffer_cfg.enable=true",
            "+reward.reward_kwargs.overlong_buffer_cfg.len=4",
            "+reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
            "+reward.reward_kwargs.overlong_buffer_cfg.log=true",
            "+reward.reward_kwargs.max_resp_len=8",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let rows: Vec<Value> = std::fs::read_to_string(tmp.path().join("rollouts/1.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let mut penalised = 0;
    for r in &rows {
        let pen = r["overlong_reward"].as_f64().unwrap();
        assert!(
            (r["score"].as_f64().unwrap() - (1.0 + pen)).abs() < 1e-12,
            "{r}"
        );
        assert!(
            (-1.0..=0.0).contains(&pen) && (pen * 4.0).fract() == 0.0,
            "{r}"
        );
        assert_eq!(
            r["overlong"].as_f64(),
            Some((pen < 0.0) as u8 as f64),
            "{r}"
        );
        penalised += (pen < 0.0) as usize;
    }
    assert!(
        penalised > 0,
        "an untrained policy writes past 4 tokens: {rows:?}"
    );
}

/// The job of [`job_args`] without the Python function: rewards from the faulty fixture plugin.
fn faulty_run(dir: &Path, extra: &[&str]) -> std::process::Output {
    let inst = install(&["libverl_fsdp.so", "libfaulty_plugin.so"]);
    let mut args: Vec<String> = vec![
        "--plugin".into(),
        inst.path()
            .join("libfaulty_plugin.so")
            .display()
            .to_string(),
    ];
    args.extend(job_args(dir, &[]).into_iter().filter(|a| {
        !a.starts_with("custom_reward_function.") && !a.starts_with("plugins.reward.python")
    }));
    args.push("plugins.reward.default=faulty".into());
    args.push("plugins.reward.isolate=true".into());
    args.extend(extra.iter().map(|s| s.to_string()));
    std::process::Command::new(inst.path().join("verl"))
        .args(&args)
        .current_dir(dir)
        .env_remove("VERL_PLUGIN_PATH")
        .env("VERL_FILE_LOGGER_ROOT", dir.join("logs"))
        .output()
        .unwrap()
}

#[test]
fn an_isolated_plugin_that_aborts_or_hangs_costs_its_worker_not_the_job() {
    // Isolated and well-behaved, it scores as in-process (the response length).
    let tmp = tempfile::tempdir().unwrap();
    let o = faulty_run(tmp.path(), &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    for l in std::fs::read_to_string(tmp.path().join("rollouts/1.jsonl"))
        .unwrap()
        .lines()
    {
        let r: Value = serde_json::from_str(l).unwrap();
        assert_eq!(
            r["score"].as_f64(),
            Some(r["output"].as_str().unwrap().len() as f64),
            "{r}"
        );
    }
    let cases: [(&str, &[&str], &[&str]); 2] = [
        (
            "abort",
            &[],
            &["reward plugin `faulty`", "isolated", "crashed", "SIGABRT"],
        ),
        (
            "hang",
            &["plugins.reward.timeout_s=2"],
            &["reward plugin `faulty`", "timeout of 2 s"],
        ),
    ];
    for (mode, limits, needles) in cases {
        let kw = format!("+custom_reward_function.reward_kwargs.faulty={mode}");
        let mut extra: Vec<&str> = vec![&kw];
        extra.extend_from_slice(limits);
        let tmp = tempfile::tempdir().unwrap();
        let o = faulty_run(tmp.path(), &extra);
        // The host ends the step with an error; it was not taken down with the worker.
        assert_eq!(o.status.code(), Some(1), "{mode}: {}", stderr(&o));
        let err = stderr(&o);
        for n in needles {
            assert!(err.contains(n), "{mode}: missing `{n}` in:\n{err}");
        }
        extra.push("plugins.reward.on_error=zero");
        let tmp = tempfile::tempdir().unwrap();
        let o = faulty_run(tmp.path(), &extra);
        assert!(o.status.success(), "{mode} (on_error=zero): {}", stderr(&o));
        let m: Value = serde_json::from_str(
            std::fs::read_to_string(metrics_jsonl(&tmp.path().join("logs")))
                .unwrap()
                .lines()
                .next()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(
            m["data"]["reward/error_ratio"].as_f64(),
            Some(1.0),
            "{mode}: {m}"
        );
    }
}
