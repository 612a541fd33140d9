//! Every job under `examples/` dry-runs as its one-line command says (`verl run <job>`), against
//! data and model folders laid out where the jobs expect them (`~/data/...`, `~/models/...`): the
//! models' real shapes (so the Megatron layouts are checked against real heads, layers and
//! experts), a tiny tokenizer, no weights. No example sets a key verl-rs ignores or refuses.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::json;
use verl_e2e::*;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The HF config.json of the models the examples name (their published shapes).
fn model_configs() -> Vec<(&'static str, serde_json::Value)> {
    let qwen2 = |hidden: i64, inter: i64, layers: i64, heads: i64, kv: i64, tie: bool| {
        json!({
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
            "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv,
            "vocab_size": 151936, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": tie, "torch_dtype": "bfloat16",
        })
    };
    vec![
        ("Qwen2.5-0.5B-Instruct", qwen2(896, 4864, 24, 14, 2, true)),
        ("Qwen2.5-1.5B-Instruct", qwen2(1536, 8960, 28, 12, 2, true)),
        ("Qwen2.5-7B-Instruct", qwen2(3584, 18944, 28, 28, 4, false)),
        (
            "Qwen3-30B-A3B",
            json!({
                "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                "decoder_sparse_step": 1, "norm_topk_prob": true, "vocab_size": 151936,
                "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                "tie_word_embeddings": false, "torch_dtype": "bfloat16",
            }),
        ),
    ]
}

/// A home folder holding `~/data/{gsm8k,math}/{train,test}.parquet` and `~/models/<name>`.
fn home() -> tempfile::TempDir {
    let home = tempfile::tempdir().unwrap();
    let inputs = tiny_inputs();
    for set in ["gsm8k", "math"] {
        let dir = home.path().join("data").join(set);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(&inputs.train, dir.join("train.parquet")).unwrap();
        std::fs::copy(&inputs.val, dir.join("test.parquet")).unwrap();
    }
    for (name, config) in model_configs() {
        inputs.model_with_config(&home.path().join("models").join(name), &config);
    }
    home
}

fn verl(home: &Path, args: &[&str]) -> Output {
    Command::new(verl_bin())
        .args(args)
        .current_dir(repo())
        .env("HOME", home)
        .env_remove("VERL_PLUGIN_PATH")
        .env_remove("VERL_LOG")
        .output()
        .unwrap()
}

fn example_jobs() -> Vec<PathBuf> {
    let mut jobs = Vec::new();
    for dir in std::fs::read_dir(repo().join("examples")).unwrap() {
        let dir = dir.unwrap().path();
        // The quickstarts' inputs are built by their own scripts (tests/tests/quickstart.rs,
        // tests/tests/multi_turn.rs), the GSM8K tool job's by bench/multi_turn_gsm8k.sh (an SFT
        // stage first; its tool config is checked by host/tests/tools.rs).
        if !dir.is_dir() || dir.ends_with("quickstart") || dir.ends_with("gsm8k_tools") {
            continue;
        }
        for f in std::fs::read_dir(&dir).unwrap() {
            let f = f.unwrap().path();
            if f.extension().is_some_and(|e| e == "yaml") {
                jobs.push(f);
            }
        }
    }
    jobs.sort();
    jobs
}

#[test]
fn every_example_job_dry_runs_with_its_one_line_command() {
    let home = home();
    let jobs = example_jobs();
    assert!(jobs.len() >= 12, "{jobs:?}");
    let mut failures = Vec::new();
    for job in &jobs {
        let rel = job.strip_prefix(repo()).unwrap().display().to_string();
        let o = verl(home.path(), &["run", &rel, "--dry-run"]);
        let out = stdout(&o);
        if !o.status.success() || !out.contains("dry run       ok") {
            failures.push(format!("{rel}:\n{out}\n{}", stderr(&o)));
            continue;
        }
        if let Some(line) = out.lines().find(|l| l.contains("ignored")) {
            failures.push(format!("{rel} sets a key verl-rs ignores: {line}"));
        }
        // The header's command is the one just run.
        let text = std::fs::read_to_string(job).unwrap();
        if !text.contains(&format!("verl run {rel}")) {
            failures.push(format!("{rel}: its header does not say `verl run {rel}`"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn the_multi_node_launchers_run_an_example_job_on_two_nodes() {
    let home = home();
    for script in ["torchrun.sh", "slurm.sbatch"] {
        let text =
            std::fs::read_to_string(repo().join("examples/multi_node").join(script)).unwrap();
        let job = text
            .lines()
            .find_map(|l| l.strip_prefix("JOB=${JOB:-"))
            .and_then(|l| l.strip_suffix('}'))
            .unwrap_or_else(|| panic!("{script} names no default JOB"));
        assert!(repo().join(job).is_file(), "{script}: {job}");
        assert!(
            text.contains("run \"$JOB\" trainer.nnodes=2 trainer.n_gpus_per_node=8"),
            "{script}"
        );
        // Outside torchrun/SLURM the dry run checks everything but the launch itself.
        let o = verl(
            home.path(),
            &[
                "run",
                job,
                "trainer.nnodes=2",
                "trainer.n_gpus_per_node=8",
                "--dry-run",
            ],
        );
        let out = stdout(&o);
        assert!(o.status.success(), "{out}\n{}", stderr(&o));
        assert!(out.contains("over 16 rank(s)"), "{out}");
        assert!(out.contains("not checked   launch:"), "{out}");
    }
}
