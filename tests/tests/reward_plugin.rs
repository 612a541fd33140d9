//! The reward-plugin template third parties copy: `examples/reward-plugin` (a workspace member)
//! scores a GRPO job through `--plugin`, and `verl plugin new reward NAME` writes a crate that
//! builds on its own and scores through the real binary.

use std::path::Path;

use serde_json::Value;
use verl_e2e::*;

/// The example's rule, restated: 1 when the response ends with the ground truth, minus 0.1 per
/// word past `max_words`.
fn keyword(response: &str, truth: &str, max_words: usize) -> f64 {
    let hit = response.trim_end().ends_with(truth) as u8 as f64;
    let over = response
        .split_whitespace()
        .count()
        .saturating_sub(max_words);
    hit - 0.1 * over as f64
}

#[test]
fn the_example_reward_plugin_scores_a_grpo_job_through_plugin() {
    let inst = install(&["libverl_fsdp.so"]);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut args: Vec<String> = vec![
        "--plugin".into(),
        plugin("libkeyword_reward.so").display().to_string(),
        "run".into(),
    ];
    args.extend(tiny_inputs().overrides());
    for a in [
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=1",
        "trainer.logger=[console]",
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
        "plugins.reward.default=keyword",
        "+custom_reward_function.reward_kwargs.max_words=0",
    ] {
        args.push(a.into());
    }
    args.push(format!(
        "trainer.default_local_dir={}",
        dir.join("ckpt").display()
    ));
    args.push(format!(
        "trainer.rollout_data_dir={}",
        dir.join("rollouts").display()
    ));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = run(&inst.path().join("verl"), &args);
    assert!(o.status.success(), "{}\n{}", stdout(&o), stderr(&o));
    let rows: Vec<Value> = std::fs::read_to_string(dir.join("rollouts/1.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 8);
    let mut penalised = 0;
    for r in &rows {
        let want = keyword(r["output"].as_str().unwrap(), r["gts"].as_str().unwrap(), 0);
        assert!((r["score"].as_f64().unwrap() - want).abs() < 1e-6, "{r}");
        penalised += (want < 0.0) as usize;
    }
    assert!(penalised > 0, "the kwarg reached the plugin: {rows:?}");
}

#[test]
fn verl_plugin_new_writes_a_skeleton_that_builds_and_scores() {
    let inst = install(&[]);
    let verl = inst.path().join("verl");
    let tmp = tempfile::tempdir().unwrap();
    let api = Path::new(env!("CARGO_MANIFEST_DIR")).join("../plugin-api");
    let o = run(
        &verl,
        &[
            "plugin",
            "new",
            "reward",
            "my-score",
            "--dir",
            tmp.path().to_str().unwrap(),
            "--api-path",
            api.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let krate = tmp.path().join("my-score");
    let lib = std::fs::read_to_string(krate.join("src/lib.rs")).unwrap();
    assert!(
        lib.contains("pub struct MyScore")
            && lib.contains("const NAME: &'static str = \"my-score\""),
        "{lib}"
    );
    // It builds on its own (its own workspace), as a third party builds it.
    let target = build_dir().join("..").join("plugin-skeletons");
    let o = std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["build", "--offline", "--manifest-path"])
        .arg(krate.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&target)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "cargo build: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let so = target.join("debug/libmy_score.so");
    let rows = tmp.path().join("rows.jsonl");
    std::fs::write(
        &rows,
        "{\"data_source\": \"s\", \"solution_str\": \"the answer is 42\", \"ground_truth\": \"42\"}\n\
         {\"data_source\": \"s\", \"solution_str\": \"the answer is 41\", \"ground_truth\": \"42\"}\n",
    )
    .unwrap();
    let out = tmp.path().join("scored.jsonl");
    let o = run(
        &verl,
        &[
            "--plugin",
            so.to_str().unwrap(),
            "reward",
            "score",
            rows.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let scores: Vec<f64> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["score"]
                .as_f64()
                .unwrap()
        })
        .collect();
    assert_eq!(scores, vec![1.0, 0.0]);
}
