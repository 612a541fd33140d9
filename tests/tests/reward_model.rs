//! Reward models end to end: checkpoints of every architecture users ship reward models in,
//! built by transformers, scored through the real binary and backend plugins and compared with
//! transformers' own scores; and a GRPO job that trains against a reward model whose tokenizer
//! and chat template are not the policy's, beside a data source that keeps its rule reward.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde_json::{json, Value};
use verl_e2e::*;

/// The architectures of `tests/py/reward_models.py`.
const CASES: [&str; 5] = ["llama", "mistral", "qwen2", "qwen3", "qwen2_rm"];

fn rows() -> Vec<Value> {
    vec![
        json!({"prompt": "What is 12 + 7?", "response": "The answer is 19."}),
        json!({"prompt": [{"role": "system", "content": "You are a helpful assistant."},
                          {"role": "user", "content": "Compute 3 * 4."}],
               "response": "Three times four is twelve. #### 12"}),
        json!({"prompt": "Explain 5 - 2", "response": "2"}),
        json!({"prompt": "The quick brown fox", "response": "jumps over the lazy dog 0123456789 and then some more words to make this the longest row"}),
        json!({"prompt": [{"role": "user", "content": "#### 42?"}], "response": ""}),
    ]
}

struct ReferenceModels {
    _dir: tempfile::TempDir,
    root: PathBuf,
    rows: PathBuf,
    expected: BTreeMap<String, Vec<f64>>,
}

/// Tiny reward models and transformers' scores of [`rows`], made once per test binary.
fn reference() -> &'static ReferenceModels {
    static R: OnceLock<ReferenceModels> = OnceLock::new();
    R.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let rows_path = dir.path().join("rows.jsonl");
        let text: String = rows().iter().map(|r| format!("{r}\n")).collect();
        std::fs::write(&rows_path, text).unwrap();
        let root = dir.path().join("rms");
        let o = std::process::Command::new(python())
            .arg(py_script("reward_models.py"))
            .args(["make", root.to_str().unwrap(), rows_path.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "reward_models.py: {}{}",
            stdout(&o),
            stderr(&o)
        );
        let expected: BTreeMap<String, Vec<f64>> =
            serde_json::from_str(&std::fs::read_to_string(root.join("expected.json")).unwrap())
                .unwrap();
        ReferenceModels {
            _dir: dir,
            root,
            rows: rows_path,
            expected,
        }
    })
}

/// `verl reward score --model DIR --chat --json` through `plugin`: one score per row.
fn score_with(inst: &Path, plugin: &str, model: &Path, rows: &Path, extra: &[&str]) -> Vec<f64> {
    let mut args = vec![
        "--plugin",
        plugin,
        "reward",
        "score",
        "--model",
        model.to_str().unwrap(),
        "--chat",
        "--json",
        rows.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let o = run(&inst.join("verl"), &args);
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    stdout(&o)
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["score"]
                .as_f64()
                .unwrap()
        })
        .collect()
}

fn assert_close(case: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{case}: {got:?} vs {want:?}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol,
            "{case} row {i}: ours {g}, transformers {w} (|Δ| {} > {tol})",
            (g - w).abs()
        );
    }
}

#[test]
fn scores_equal_transformers_for_every_reward_model_architecture() {
    let r = reference();
    let inst = install(&["libverl_fsdp.so", "libverl_megatron.so"]);
    for case in CASES {
        let model = r.root.join(case);
        // Two rows per forward: right padding and the last-real-token read are exercised.
        let got = score_with(inst.path(), "fsdp", &model, &r.rows, &["--batch-size", "2"]);
        assert_close(case, &got, &r.expected[case], 1e-4);
        // Scores do not vary across the scale of the head.
        assert!(
            got.iter().any(|&s| (s - got[0]).abs() > 1e-3),
            "{case}: {got:?}"
        );
    }
    // The Megatron backend's reward model role reads the same checkpoint the same way.
    let model = r.root.join("qwen2_rm");
    let got = score_with(inst.path(), "megatron", &model, &r.rows, &[]);
    assert_close("qwen2_rm (megatron)", &got, &r.expected["qwen2_rm"], 1e-4);
}

#[test]
fn a_causal_lm_or_a_missing_head_is_not_scored_as_a_reward_model() {
    let inputs = tiny_inputs();
    let r = reference();
    let inst = install(&["libverl_fsdp.so"]);
    let o = run(
        &inst.path().join("verl"),
        &[
            "--plugin",
            "fsdp",
            "reward",
            "score",
            "--model",
            inputs.model.to_str().unwrap(),
            "--json",
            r.rows.to_str().unwrap(),
            "--chat",
        ],
    );
    assert_one_line_error(
        &o,
        &["--model", "ForSequenceClassification", "Qwen2ForCausalLM"],
    );
    // A classifier checkpoint without its `score` weights would score with a random head.
    let tmp = tempfile::tempdir().unwrap();
    let headless = tmp.path().join("headless");
    std::fs::create_dir_all(&headless).unwrap();
    for e in std::fs::read_dir(&inputs.model).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, headless.join(p.file_name().unwrap())).unwrap();
    }
    let cfg_path = headless.join("config.json");
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    cfg["architectures"] = json!(["Qwen2ForSequenceClassification"]);
    cfg["num_labels"] = json!(1);
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let o = run(
        &inst.path().join("verl"),
        &[
            "--plugin",
            "fsdp",
            "reward",
            "score",
            "--model",
            headless.to_str().unwrap(),
            r.rows.to_str().unwrap(),
            "--chat",
        ],
    );
    assert_one_line_error(&o, &["score head", "score.weight"]);
}

const RM_SOURCE: &str = "chat/helpfulness";
const RULE_SOURCE: &str = "openai/gsm8k";

/// Rows of two data sources: arithmetic with a rule-checkable answer, and open questions only a
/// reward model can score (their prompts start with `RM:`).
fn write_two_source_data(path: &Path, rows: usize) {
    let mut text = String::new();
    for i in 0..rows {
        let (source, content, gt) = if i % 2 == 0 {
            (
                RULE_SOURCE,
                format!("What is {} + {}? Answer after \"####\".", i, 3),
                format!("{}", i + 3),
            )
        } else {
            (
                RM_SOURCE,
                format!("RM: say something kind about the number {i}."),
                String::new(),
            )
        };
        let row = json!({
            "data_source": source,
            "prompt": [{"role": "user", "content": content}],
            "ability": "chat",
            "reward_model": {"style": "rule", "ground_truth": gt},
            "extra_info": {"index": i},
        });
        text.push_str(&format!("{row}\n"));
    }
    std::fs::write(path, text).unwrap();
}

#[test]
fn grpo_trains_against_a_reward_model_with_another_tokenizer_beside_a_rule_reward() {
    let inputs = tiny_inputs();
    let r = reference();
    // The policy speaks ChatML with its own 300-token vocabulary; the reward model is a Llama
    // with a Llama-3 template and another vocabulary.
    let rm = r.root.join("llama");
    let inst = install(&["libverl_fsdp.so", "libverl_rewards.so"]);
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    write_two_source_data(&root.join("train.jsonl"), 8);
    write_two_source_data(&root.join("val.jsonl"), 4);
    let dump = root.join("rollouts");
    let job = write(
        root,
        "job.yaml",
        &format!(
            r#"
data: {{train_files: {r}/train.jsonl, val_files: {r}/val.jsonl, train_batch_size: 4,
        max_prompt_length: 64, max_response_length: 8, seed: 1}}
actor_rollout_ref:
  model: {{path: {policy}}}
  actor: {{ppo_mini_batch_size: 4, ppo_micro_batch_size_per_gpu: 4, optim: {{lr: 1.0e-3}},
          fsdp_config: {{model_dtype: fp32, dtype: fp32}}}}
  rollout: {{n: 2, log_prob_micro_batch_size_per_gpu: 8}}
algorithm: {{adv_estimator: grpo}}
reward_model:
  enable: true
  model: {{path: {rm}}}
  use_dynamic_bsz: true
  forward_max_token_len_per_gpu: 96
  max_length: 80
reward:
  reward_model:
    rollout: {{dtype: float32}}
plugins:
  reward:
    routes: {{"{RULE_SOURCE}": rewards}}
trainer:
  device: cpu
  n_gpus_per_node: 1
  total_training_steps: 2
  logger: [file]
  test_freq: -1
  save_freq: -1
  val_before_train: false
  rollout_data_dir: {dump}
  project_name: e2e
  experiment_name: rm
  default_local_dir: {r}/ckpt
"#,
            r = root.display(),
            policy = inputs.model.display(),
            rm = rm.display(),
            dump = dump.display(),
        ),
    );
    // The dry run reads the reward model's folder and says what it scores.
    let o = run(
        &inst.path().join("verl"),
        &["run", job.to_str().unwrap(), "--dry-run"],
    );
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    assert!(
        stdout(&o).contains("reward model  ")
            && stdout(&o).contains("(LlamaForSequenceClassification)")
            && stdout(&o).contains("reward_model ✓"),
        "{}",
        stdout(&o)
    );
    let o = std::process::Command::new(inst.path().join("verl"))
        .args(["run", job.to_str().unwrap()])
        .current_dir(root)
        .env_remove("VERL_PLUGIN_PATH")
        .env("VERL_FILE_LOGGER_ROOT", root.join("logs"))
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "stdout:\n{}\nstderr:\n{}",
        stdout(&o),
        stderr(&o)
    );

    // Every scored row of step 1, and the step's metrics.
    let rows: Vec<Value> = std::fs::read_to_string(dump.join("1.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 8, "4 prompts × 2 samples");
    let (rm_rows, rule_rows): (Vec<&Value>, Vec<&Value>) = rows
        .iter()
        .partition(|row| row["input"].as_str().unwrap().contains("RM:"));
    assert!(!rm_rows.is_empty() && !rule_rows.is_empty());

    // The rule data source keeps its rule scores: what the rewards plugin gives the same text.
    let rule_jsonl = root.join("rule_rows.jsonl");
    let text: String = rule_rows
        .iter()
        .map(|row| {
            format!(
                "{}\n",
                json!({"data_source": RULE_SOURCE, "solution_str": row["output"], "ground_truth": row["gts"]})
            )
        })
        .collect();
    std::fs::write(&rule_jsonl, text).unwrap();
    let out = root.join("rule_scored.jsonl");
    let o = run(
        &inst.path().join("verl"),
        &[
            "reward",
            "score",
            rule_jsonl.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let rescored: Vec<f64> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["score"]
                .as_f64()
                .unwrap()
        })
        .collect();
    for (row, want) in rule_rows.iter().zip(&rescored) {
        assert_eq!(row["score"].as_f64().unwrap(), *want, "{row}");
    }

    // The reward model's rows carry the reward model's score of (prompt messages + response),
    // rendered with its own Llama-3 template. The dump's text drops special tokens the reward
    // model reads (the policy may sample one mid-response), so a few rows may differ; a broken
    // template switch, tokenizer or head would make them all differ.
    let rm_jsonl = root.join("rm_rows.jsonl");
    let text: String = rm_rows
        .iter()
        .map(|row| {
            let input = row["input"].as_str().unwrap();
            let start = input.find("RM:").unwrap();
            let end = input[start..].find('.').unwrap() + start + 1;
            format!(
                "{}\n",
                json!({"prompt": [{"role": "user", "content": &input[start..end]}], "response": row["output"]})
            )
        })
        .collect();
    std::fs::write(&rm_jsonl, text).unwrap();
    let rescored = score_with(inst.path(), "fsdp", &rm, &rm_jsonl, &["--max-length", "80"]);
    let same = rm_rows
        .iter()
        .zip(&rescored)
        .filter(|(row, want)| (row["score"].as_f64().unwrap() - **want).abs() < 1e-4)
        .count();
    eprintln!(
        "{same} of {} reward-model rows equal a re-score",
        rm_rows.len()
    );
    assert!(
        same * 4 >= rm_rows.len() * 3,
        "{same} of {} reward-model rows equal a re-score: {:?} vs {rescored:?}",
        rm_rows.len(),
        rm_rows
            .iter()
            .map(|r| r["score"].as_f64().unwrap())
            .collect::<Vec<_>>()
    );

    // Two CPU ranks: each holds its own copy of the reward model and scores its own rows; the
    // step's rows come out as one rank scored them.
    let dump2 = root.join("rollouts-2ranks");
    let o = std::process::Command::new(inst.path().join("verl"))
        .args([
            "run",
            job.to_str().unwrap(),
            "trainer.n_gpus_per_node=2",
            "trainer.total_training_steps=1",
            &format!("trainer.rollout_data_dir={}", dump2.display()),
            &format!("trainer.default_local_dir={}", root.join("ckpt2").display()),
        ])
        .current_dir(root)
        .env_remove("VERL_PLUGIN_PATH")
        .env("VERL_FILE_LOGGER_ROOT", root.join("logs2"))
        .output()
        .unwrap();
    assert!(o.status.success(), "2 ranks: {}{}", stdout(&o), stderr(&o));
    let rows2: Vec<Value> = std::fs::read_to_string(dump2.join("1.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows2.len(), rows.len());
    // `trainer.balance_batch` orders rows by rank; the rows themselves are the same.
    let sorted = |r: &[Value]| {
        let mut v = r.to_vec();
        v.sort_by_key(|x| format!("{}{}", x["input"], x["output"]));
        v
    };
    for (a, b) in sorted(&rows).iter().zip(&sorted(&rows2)) {
        assert_eq!(a["output"], b["output"]);
        let (x, y) = (a["score"].as_f64().unwrap(), b["score"].as_f64().unwrap());
        assert!((x - y).abs() < 1e-5, "1 rank {x}, 2 ranks {y}: {a}");
    }

    // critic/score/* are those scores.
    let metrics = std::fs::read_to_string(metrics_jsonl(&root.join("logs"))).unwrap();
    let step1: Value = metrics
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .find(|v| v["step"] == 1 && v["data"].get("critic/score/mean").is_some())
        .unwrap();
    let mean = rows
        .iter()
        .map(|r| r["score"].as_f64().unwrap())
        .sum::<f64>()
        / rows.len() as f64;
    let logged = step1["data"]["critic/score/mean"].as_f64().unwrap();
    assert!((logged - mean).abs() < 1e-6, "{logged} vs {mean}");
}

#[test]
fn a_pure_rust_genrm_plugin_judges_with_the_hosts_generation_model() {
    let inputs = tiny_inputs();
    // The judge: a causal LM behind `reward.reward_model.model_path`, prompted by the plugin.
    let judge = &inputs.model;
    let inst = install(&["libverl_fsdp.so", "libverl_rewards.so"]);
    let genrm = plugin("libgenrm_reward.so");
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    write_two_source_data(&root.join("train.jsonl"), 4);
    let dump = root.join("rollouts");
    let log = root.join("judge.jsonl");
    let job = write(
        root,
        "job.yaml",
        &format!(
            r#"
data: {{train_files: {r}/train.jsonl, val_files: {r}/train.jsonl, train_batch_size: 4,
        max_prompt_length: 64, max_response_length: 6, seed: 1}}
actor_rollout_ref:
  model: {{path: {policy}}}
  actor: {{ppo_mini_batch_size: 4, ppo_micro_batch_size_per_gpu: 4, optim: {{lr: 1.0e-3}},
          fsdp_config: {{model_dtype: fp32, dtype: fp32}}}}
  rollout: {{n: 2, log_prob_micro_batch_size_per_gpu: 8}}
algorithm: {{adv_estimator: grpo}}
reward:
  reward_model: {{enable: true, model_path: {judge}, rollout: {{dtype: float32}}}}
plugins:
  reward: {{default: genrm}}
trainer:
  device: cpu
  n_gpus_per_node: 1
  total_training_steps: 1
  logger: [file]
  test_freq: -1
  save_freq: -1
  val_before_train: false
  rollout_data_dir: {dump}
  project_name: e2e
  experiment_name: genrm
  default_local_dir: {r}/ckpt
"#,
            r = root.display(),
            policy = inputs.model.display(),
            judge = judge.display(),
            dump = dump.display(),
        ),
    );
    let o = std::process::Command::new(inst.path().join("verl"))
        .args([
            "--plugin",
            genrm.to_str().unwrap(),
            "run",
            job.to_str().unwrap(),
        ])
        .current_dir(root)
        .env_remove("VERL_PLUGIN_PATH")
        .env("VERL_FILE_LOGGER_ROOT", root.join("logs"))
        .env("GENRM_FIXTURE_LOG", &log)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "stdout:\n{}\nstderr:\n{}",
        stdout(&o),
        stderr(&o)
    );
    let judged: Vec<Value> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(judged.len(), 8, "4 prompts × 2 samples, each judged once");

    // The same questions through `verl generate` on the judge (greedy, fp32): the verdicts the
    // plugin got are the judge's.
    let prompts = root.join("questions.jsonl");
    let text: String = judged
        .iter()
        .map(|j| format!("{}\n", json!({"prompt": j["question"]})))
        .collect();
    std::fs::write(&prompts, text).unwrap();
    let o = run(
        &inst.path().join("verl"),
        &[
            "generate",
            "--model",
            judge.to_str().unwrap(),
            "--prompts",
            prompts.to_str().unwrap(),
            "--chat",
            "--greedy",
            "--max-new-tokens",
            "6",
            "--json",
            "--set",
            "actor_rollout_ref.actor.fsdp_config.dtype=fp32",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let generated: Vec<String> = stdout(&o)
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(generated.len(), judged.len());
    for (j, g) in judged.iter().zip(&generated) {
        assert_eq!(j["verdict"].as_str().unwrap(), g, "{j}");
        let want = g
            .chars()
            .find(|c| c.is_ascii_digit())
            .map(|c| c.to_digit(10).unwrap() as f64 / 9.0)
            .unwrap_or(0.0);
        assert!((j["score"].as_f64().unwrap() - want).abs() < 1e-6, "{j}");
    }
    // And the step's rewards are the plugin's scores, row for row.
    let rows: Vec<Value> = std::fs::read_to_string(dump.join("1.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for (row, j) in rows.iter().zip(&judged) {
        assert!((row["score"].as_f64().unwrap() - j["score"].as_f64().unwrap()).abs() < 1e-6);
        assert!(j["question"]
            .as_str()
            .unwrap()
            .contains(row["output"].as_str().unwrap()));
    }
}
