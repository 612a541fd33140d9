//! Multi-turn GRPO with a tool through the real binary and plugins (fsdp, rewards, and the
//! built-in `tools` plugin) on CPU: the tool quickstart's pipeline, shortened (`verl data arith
//! --tools calculator` → `verl init-model` → a short multi-turn `verl sft` → `verl run
//! examples/quickstart/tools_job.yaml`). The SFT model calls the calculator in some of its
//! samples, so the rollouts have real tool turns. The run must:
//! - report verl's turn and tool metrics, with calls that ran;
//! - dump responses holding the calculator's answers as tool turns;
//! - train on the model's own tokens only, with rollout log-probs equal to the training forward's
//!   across turns: the rollout-vs-training probability metrics (which count the tokens of
//!   `loss_mask`) stay at fp32 rounding, where counting a tool turn's tokens (no rollout log-prob:
//!   0) would put them near 1.

use std::path::Path;

use serde_json::Value;
use verl_e2e::*;

/// Enough SFT steps for well-formed calls (the calling format is learnt long before the model
/// copies numbers well; the quickstart's 1000 steps are for that).
const SFT_STEPS: usize = 250;

fn examples() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/quickstart")
}

#[test]
fn grpo_with_a_calculator_trains_on_the_models_own_tokens() {
    let inst = install(&["libverl_fsdp.so", "libverl_rewards.so", "libverl_tools.so"]);
    let tmp = tempfile::tempdir().unwrap();
    let cwd = tmp.path();
    let d = |p: &str| cwd.join(p).display().to_string();
    let inst = inst.path();
    assert_ok(
        &run_in(
            inst,
            cwd,
            &[
                "data",
                "arith",
                "--out",
                &d("data"),
                "--train",
                "1000",
                "--val",
                "16",
                "--seed",
                "7",
                "--min-operand",
                "100",
                "--max-operand",
                "9999",
                "--max-ops",
                "2",
                "--tools",
                "calculator",
                "--tool-rate",
                "0.5",
            ],
        ),
        "verl data arith --tools calculator",
    );
    assert_ok(
        &run_in(
            inst,
            cwd,
            &[
                "init-model",
                "--out",
                &d("init"),
                "--data",
                &d("data/train.parquet"),
                "--data",
                &d("data/sft_train.parquet"),
                "--vocab",
                "1024",
                "--digit-group",
                "1",
                "--hidden",
                "128",
                "--intermediate",
                "128",
                "--layers",
                "3",
                "--heads",
                "8",
                "--kv-heads",
                "4",
                "--max-positions",
                "512",
                "--seed",
                "7",
            ],
        ),
        "verl init-model",
    );
    assert_ok(
        &run_in(
            inst,
            cwd,
            &[
                "sft",
                examples().join("tools_sft.yaml").to_str().unwrap(),
                &format!("data.train_files={}", d("data/sft_train.parquet")),
                &format!("data.val_files={}", d("data/sft_val.parquet")),
                &format!("model.partial_pretrain={}", d("init")),
                &format!("trainer.default_local_dir={}", d("sft")),
                &format!("trainer.total_training_steps={SFT_STEPS}"),
                "trainer.test_freq=-1",
                "trainer.logger=[file]",
            ],
        ),
        "verl sft (multi-turn)",
    );
    let run = run_in(
        inst,
        cwd,
        &[
            "run",
            examples().join("tools_job.yaml").to_str().unwrap(),
            &format!("data.train_files={}", d("data/train.parquet")),
            &format!("data.val_files={}", d("data/val.parquet")),
            &format!(
                "actor_rollout_ref.model.path={}",
                d(&format!("sft/global_step_{SFT_STEPS}"))
            ),
            &format!("trainer.default_local_dir={}", d("ckpt")),
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            &format!(
                "actor_rollout_ref.rollout.multi_turn.tool_config_path={}",
                examples().join("tools.yaml").display()
            ),
            &format!("trainer.rollout_data_dir={}", d("rollouts")),
            "trainer.total_training_steps=2",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            "trainer.save_freq=-1",
            "trainer.logger=[file]",
            // The old-log-prob pass runs and the rollout-vs-training metrics are reported, in fp32
            // (bf16 rounding alone moves them by a few 1e-2).
            "actor_rollout_ref.rollout.calculate_log_probs=true",
            "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
            "actor_rollout_ref.actor.fsdp_config.dtype=fp32",
        ],
    );
    assert_ok(&run, "verl run with the tool agent loop");
    let metrics = cwd.join("logs/verl_rs_quickstart/arith_tools_grpo_cpu.jsonl");
    let text = std::fs::read_to_string(&metrics).unwrap();
    let steps: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["data"].clone())
        .filter(|d| d.get("timing_s/step").is_some())
        .collect();
    assert_eq!(steps.len(), 2, "{text}");
    let (mut calls, mut tool_turns) = (0.0, 0.0);
    for d in &steps {
        let num = |k: &str| d[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {d}"));
        // Per-tool metrics exist once the tool was called.
        let maybe = |k: &str| d[k].as_f64().unwrap_or(0.0);
        // verl's count: 2 for a single turn, 2 more per tool turn.
        assert!(
            num("num_turns/min") >= 2.0 && num("num_turns/max") <= 6.0,
            "{d}"
        );
        calls += maybe("tools/calculator/calls");
        tool_turns += num("tool_call_counts/mean");
        assert_eq!(num("tools/calls"), maybe("tools/calculator/calls"));
        // Only the model's tokens are compared: a tool turn counted would give a difference
        // of a probability, near 1.
        let diff = num("training/rollout_probs_diff_max");
        assert!(
            diff < 1e-4,
            "rollout vs training probs differ by {diff} on CPU in fp32"
        );
        assert!(maybe("rollout/continued_turns") <= num("tools/calls"));
    }
    assert!(
        calls >= 4.0 && tool_turns > 0.0,
        "the SFT model made too few calls to test ({calls})"
    );
    // The dumped rollouts hold the calculator's answers as tool turns (as the reward reads them).
    let dumps: String = std::fs::read_dir(cwd.join("rollouts"))
        .unwrap()
        .map(|e| std::fs::read_to_string(e.unwrap().path()).unwrap())
        .collect();
    assert!(
        dumps.contains("<tool_response>") && dumps.contains("<tool_call>"),
        "no tool turn in the dumped rollouts"
    );
}
