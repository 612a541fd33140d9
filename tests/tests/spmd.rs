//! Multi-rank `verl run` on CPU through the real binary: the launcher spawning local ranks,
//! torchrun-style environments, global metrics written by rank 0 only, sharded checkpoints and
//! resume, and the failure semantics (a dead rank ends the job with its error, a rendezvous that
//! never completes names the missing rank). The backend is the toy fixture (a pure-Rust bigram
//! policy), so these run in CI without libtorch.
//!
//! `run_job` is the helper to reuse for backend parity tests: it runs one job at N ranks and
//! returns the process output and the metrics rows by step.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};
use verl_e2e::*;

const CORPUS: &[&str] = &[
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May? Let's think step by step.",
    "output the final answer after #### 72 #### 10 the answer is",
    "system user assistant 0 1 2 3 4 5 6 7 8 9",
];
const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
const CHATML: &str = "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

const TOY: &str = "libtoy_backend.so";
const REWARDS: &str = "libverl_rewards.so";

/// The toy backend's model folder: tokenizer, chat template and `vocab_size`.
fn write_toy_model(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let tok = verl_chat::train_bpe(CORPUS, 300, &SPECIALS).unwrap();
    tok.save(dir.join("tokenizer.json"), false).unwrap();
    let tc = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": null, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": CHATML,
    });
    std::fs::write(dir.join("tokenizer_config.json"), tc.to_string()).unwrap();
    let vocab = tok.get_vocab_size(true);
    std::fs::write(
        dir.join("config.json"),
        json!({"model_type": "toy_bigram", "vocab_size": vocab}).to_string(),
    )
    .unwrap();
}

fn write_data(path: &Path, rows: usize, split: &str) {
    let mut text = String::new();
    for i in 0..rows {
        let row = json!({
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": format!("Natalia sold {} clips. How many clips? Let's think step by step and output the final answer after \"####\".", 40 + i)}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": format!("{}", 40 + i)},
            "extra_info": {"split": split, "index": i},
        });
        text.push_str(&row.to_string());
        text.push('\n');
    }
    std::fs::write(path, text).unwrap();
}

/// A tiny GRPO job with a critic-free toy policy; `n_gpus_per_node` is set per run. Validation
/// has 3 prompts, so 2 ranks exercise the padding of an uneven validation batch.
fn toy_job_yaml(root: &Path) -> String {
    let r = root.display();
    format!(
        r#"
data:
  train_files: {r}/train.jsonl
  val_files: {r}/val.jsonl
  train_batch_size: 4
  max_prompt_length: 256
  max_response_length: 6
  truncation: left
  seed: 7
actor_rollout_ref:
  model: {{path: {r}/model}}
  actor:
    ppo_mini_batch_size: 2
    ppo_micro_batch_size_per_gpu: 2
    use_kl_loss: true
    optim: {{lr: 0.05}}
  rollout:
    n: 2
    log_prob_micro_batch_size_per_gpu: 4
    val_kwargs: {{n: 2, do_sample: true, temperature: 1.0}}
  ref:
    log_prob_micro_batch_size_per_gpu: 4
algorithm:
  adv_estimator: grpo
trainer:
  device: cpu
  total_epochs: 2
  total_training_steps: 3
  logger: [file]
  save_freq: 2
  test_freq: 2
  val_before_train: true
  nnodes: 1
  n_gpus_per_node: 1
  project_name: spmd
  experiment_name: toy
plugins:
  reward:
    default: rewards
"#
    )
}

/// One job's inputs: an installed `verl` with plugins, a model and data.
struct Fixture {
    inst: tempfile::TempDir,
    _tmp: tempfile::TempDir,
    root: PathBuf,
    job: PathBuf,
}

impl Fixture {
    fn toy() -> Fixture {
        let inst = install(&[TOY, REWARDS]);
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().to_path_buf();
        write_toy_model(&root.join("model"));
        write_data(&root.join("train.jsonl"), 8, "train");
        write_data(&root.join("val.jsonl"), 3, "test");
        let job = write(&root, "job.yaml", &toy_job_yaml(&root));
        Fixture {
            inst,
            _tmp: tmp,
            root,
            job,
        }
    }

    fn verl(&self) -> PathBuf {
        self.inst.path().join("verl")
    }

    fn backend(&self) -> String {
        self.inst.path().join(TOY).display().to_string()
    }

    /// A fresh working folder for one run (its logs and checkpoints).
    fn run_dir(&self, name: &str) -> PathBuf {
        let d = self.root.join(name);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// `verl run` in `cwd` with `ranks` local ranks (`trainer.n_gpus_per_node`), overrides and
    /// environment; checkpoints go to `cwd/ckpt`, metrics under `cwd/logs`.
    fn command(&self, cwd: &Path, ranks: usize, extra: &[&str]) -> Command {
        let mut cmd = Command::new(self.verl());
        cmd.arg("--plugin")
            .arg(self.backend())
            .arg("run")
            .arg(&self.job)
            .arg(format!("trainer.n_gpus_per_node={ranks}"))
            .arg(format!(
                "trainer.default_local_dir={}",
                cwd.join("ckpt").display()
            ))
            .args(extra)
            .current_dir(cwd)
            .env_remove("VERL_PLUGIN_PATH")
            .env_remove("VERL_LOG")
            .env("VERL_FILE_LOGGER_ROOT", cwd.join("logs"));
        for v in [
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
            "SLURM_PROCID",
            "SLURM_NTASKS",
            "VERL_STORE_EXTERNAL",
            "VERL_LAUNCHED",
            "VERL_TOY_FAIL",
        ] {
            cmd.env_remove(v);
        }
        cmd
    }
}

/// Metrics rows by step.
type StepRows = BTreeMap<u64, Map<String, Value>>;

/// The outcome of one job: the process output and, when a metrics file was written, its rows
/// merged by step.
struct JobRun {
    output: Output,
    metrics: StepRows,
    /// `(step, name)`s logged more than once (two ranks logging would show here).
    repeated: Vec<(u64, String)>,
    jsonl_files: Vec<PathBuf>,
    elapsed: Duration,
}

impl JobRun {
    fn assert_ok(&self) {
        assert!(
            self.output.status.success(),
            "stdout:\n{}\nstderr:\n{}",
            stdout(&self.output),
            stderr(&self.output)
        );
    }
}

/// Runs the fixture's job at `ranks` local ranks (the launcher path) and collects its metrics.
fn run_job(fx: &Fixture, name: &str, ranks: usize, extra: &[&str], env: &[(&str, &str)]) -> JobRun {
    let cwd = fx.run_dir(name);
    let mut cmd = fx.command(&cwd, ranks, extra);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let start = Instant::now();
    let output = cmd.output().unwrap();
    collect(output, &cwd, start.elapsed())
}

fn collect(output: Output, cwd: &Path, elapsed: Duration) -> JobRun {
    let jsonl_files = jsonl_files(&cwd.join("logs"));
    let (metrics, repeated) = match jsonl_files.as_slice() {
        [one] => metrics_by_step(one),
        _ => (BTreeMap::new(), Vec::new()),
    };
    JobRun {
        output,
        metrics,
        repeated,
        jsonl_files,
        elapsed,
    }
}

fn jsonl_files(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "jsonl") {
                found.push(p);
            }
        }
    }
    found
}

/// Rows by step (a later value of a name wins, as for a resumed run appending to its file),
/// and the `(step, name)`s logged more than once.
fn metrics_by_step(path: &Path) -> (StepRows, Vec<(u64, String)>) {
    let text = std::fs::read_to_string(path).unwrap();
    let mut out = StepRows::new();
    let mut repeated = Vec::new();
    for line in text.lines() {
        let v: Value = serde_json::from_str(line).unwrap();
        let step = v["step"].as_u64().unwrap();
        let data = v["data"].as_object().cloned().unwrap_or_default();
        let slot = out.entry(step).or_default();
        for (k, val) in data {
            if slot.insert(k.clone(), val).is_some() {
                repeated.push((step, k));
            }
        }
    }
    (out, repeated)
}

/// The metrics that describe the data of a step (not the update, whose per-rank mini-batches
/// differ from a single rank's, nor timings).
fn data_metrics(m: &Map<String, Value>) -> BTreeMap<String, f64> {
    const PREFIXES: &[&str] = &[
        "critic/",
        "response_length",
        "prompt_length",
        "response/",
        "val-core/",
        "val-aux/",
        "training/",
        "actor/entropy",
    ];
    m.iter()
        .filter(|(k, _)| PREFIXES.iter().any(|p| k.starts_with(p)))
        .filter_map(|(k, v)| v.as_f64().map(|f| (k.clone(), f)))
        .collect()
}

fn assert_close(what: &str, a: &BTreeMap<String, f64>, b: &BTreeMap<String, f64>) {
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "{what}: different metric names"
    );
    for (k, va) in a {
        let vb = b[k];
        assert!(
            (va - vb).abs() <= 1e-9 * va.abs().max(1.0),
            "{what}: `{k}` is {vb} at 2 ranks, {va} at 1 rank"
        );
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn error_lines(o: &Output) -> Vec<String> {
    stderr(o)
        .lines()
        .filter(|l| l.starts_with("error:"))
        .map(str::to_string)
        .collect()
}

#[test]
fn two_ranks_log_global_metrics_once_and_checkpoint_every_shard() {
    let fx = Fixture::toy();
    let one = run_job(&fx, "one", 1, &[], &[]);
    one.assert_ok();
    let two = run_job(&fx, "two", 2, &[], &[]);
    two.assert_ok();

    // Only rank 0 logs: one metrics file, each step once.
    assert_eq!(two.jsonl_files.len(), 1, "{:?}", two.jsonl_files);
    assert!(two.repeated.is_empty(), "logged twice: {:?}", two.repeated);
    assert_eq!(
        two.metrics.keys().copied().collect::<Vec<_>>(),
        vec![0, 1, 2, 3]
    );
    let out = stdout(&two.output);
    assert!(
        out.contains("launch        2 local rank(s) on cpu"),
        "{out}"
    );
    assert_eq!(out.matches("done          3 step(s)").count(), 1, "{out}");

    // The weights are the same before the first update, so validation before training and the
    // first step's data are the same whether the batch was split or not: the logged metrics are
    // the whole batch's, not rank 0's half.
    assert_close(
        "validation before training",
        &data_metrics(&one.metrics[&0]),
        &data_metrics(&two.metrics[&0]),
    );
    assert!(one.metrics[&0]
        .keys()
        .any(|k| k.starts_with("val-core/openai/gsm8k/")));
    assert_close(
        "step 1",
        &data_metrics(&one.metrics[&1]),
        &data_metrics(&two.metrics[&1]),
    );
    assert!(two.metrics[&2].keys().any(|k| k.starts_with("val-core/")));
    for step in 1..=3 {
        for key in [
            "actor/pg_loss",
            "actor/kl_loss",
            "timing_s/step",
            "perf/throughput",
        ] {
            assert!(
                two.metrics[&step].contains_key(key),
                "step {step} lacks {key}"
            );
        }
    }

    // Every rank wrote its shard into the one step folder; rank 0 committed it.
    let ckpt = fx.root.join("two/ckpt");
    assert_eq!(
        std::fs::read_to_string(ckpt.join("latest_checkpointed_iteration.txt"))
            .unwrap()
            .trim(),
        "3"
    );
    for step in [2, 3] {
        let actor = ckpt.join(format!("global_step_{step}/actor"));
        assert!(
            actor.join("toy_actor.json").is_file(),
            "{}",
            actor.display()
        );
        assert!(
            actor.join("toy_actor.rank1.json").is_file(),
            "{}",
            actor.display()
        );
        assert!(ckpt.join(format!("global_step_{step}/data.json")).is_file());
    }
    let leftovers: Vec<_> = std::fs::read_dir(&ckpt)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "temp folders left: {leftovers:?}");

    // Resume at 2 ranks: stop after step 2, continue to 3, same step 3 as the straight run.
    let part = run_job(&fx, "resumed", 2, &["trainer.total_training_steps=2"], &[]);
    part.assert_ok();
    let rest = run_job(&fx, "resumed", 2, &[], &[]);
    rest.assert_ok();
    assert!(
        stdout(&rest.output).contains("resumed from step 2"),
        "{}",
        stdout(&rest.output)
    );
    let straight: BTreeMap<String, f64> = two.metrics[&3]
        .iter()
        .filter(|(k, _)| !k.starts_with("timing") && !k.starts_with("perf/"))
        .filter_map(|(k, v)| v.as_f64().map(|f| (k.clone(), f)))
        .collect();
    let resumed: BTreeMap<String, f64> = rest.metrics[&3]
        .iter()
        .filter(|(k, _)| !k.starts_with("timing") && !k.starts_with("perf/"))
        .filter_map(|(k, v)| v.as_f64().map(|f| (k.clone(), f)))
        .collect();
    assert_close("step 3 after a 2-rank resume", &straight, &resumed);
}

#[test]
fn torchrun_style_ranks_train_like_the_launcher() {
    let fx = Fixture::toy();
    let launched = run_job(&fx, "launched", 2, &[], &[]);
    launched.assert_ok();

    let cwd = fx.run_dir("torchrun");
    let port = free_port().to_string();
    let start = Instant::now();
    let children: Vec<_> = (0..2)
        .map(|rank| {
            let mut cmd = fx.command(&cwd, 2, &[]);
            cmd.env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("LOCAL_WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped());
            cmd.spawn().unwrap()
        })
        .collect();
    let outputs: Vec<Output> = children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    for (rank, o) in outputs.iter().enumerate() {
        assert!(
            o.status.success(),
            "rank {rank}\nstdout:\n{}\nstderr:\n{}",
            stdout(o),
            stderr(o)
        );
    }
    let rank0 = stdout(&outputs[0]);
    assert!(
        rank0.contains("rank 0 of 2") && rank0.contains("torchrun"),
        "{rank0}"
    );
    assert!(
        stdout(&outputs[1]).is_empty(),
        "rank 1 printed:\n{}",
        stdout(&outputs[1])
    );
    let run = collect(outputs[0].clone(), &cwd, start.elapsed());
    assert_eq!(run.jsonl_files.len(), 1, "{:?}", run.jsonl_files);
    assert!(run.repeated.is_empty(), "logged twice: {:?}", run.repeated);
    // Same data, same seeds, same split: every data metric equals the launcher's run.
    for step in 0..=3 {
        assert_close(
            &format!("step {step}, torchrun vs launcher"),
            &data_metrics(&launched.metrics[&step]),
            &data_metrics(&run.metrics[&step]),
        );
    }
}

#[test]
fn a_rank_that_dies_ends_the_job_quickly_with_its_name() {
    let fx = Fixture::toy();
    let run = run_job(&fx, "abort", 2, &[], &[("VERL_TOY_FAIL", "1:2:abort")]);
    // What the user sees (with --nocapture).
    eprintln!("--- stderr of the aborted job ---\n{}", stderr(&run.output));
    assert!(!run.output.status.success(), "{}", stderr(&run.output));
    assert!(
        run.elapsed < Duration::from_secs(60),
        "took {:?}",
        run.elapsed
    );
    let errors = error_lines(&run.output);
    assert_eq!(errors.len(), 1, "stderr:\n{}", stderr(&run.output));
    assert!(
        errors[0].contains("rank 1 of 2 failed") && errors[0].contains("SIGABRT"),
        "{}",
        errors[0]
    );

    // A rank whose update fails reports its own error, not the other ranks' reactions to it.
    let run = run_job(&fx, "error", 2, &[], &[("VERL_TOY_FAIL", "1:2:error")]);
    assert!(!run.output.status.success());
    assert!(
        run.elapsed < Duration::from_secs(60),
        "took {:?}",
        run.elapsed
    );
    let errors = error_lines(&run.output);
    assert_eq!(errors.len(), 1, "stderr:\n{}", stderr(&run.output));
    assert!(
        errors[0].contains("rank 1 of 2 failed") && errors[0].contains("injected failure"),
        "{}",
        errors[0]
    );
    // Metrics of step 1 were written before the failure; step 2 never completed.
    assert!(run.metrics.contains_key(&1) && !run.metrics.contains_key(&2));
}

#[test]
fn a_rendezvous_without_all_ranks_times_out_naming_the_missing_one() {
    let fx = Fixture::toy();
    let cwd = fx.run_dir("alone");
    let start = Instant::now();
    let o = fx
        .command(&cwd, 2, &[])
        .env("RANK", "0")
        .env("WORLD_SIZE", "2")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", free_port().to_string())
        .env("VERL_RENDEZVOUS_TIMEOUT", "2")
        .output()
        .unwrap();
    assert!(start.elapsed() < Duration::from_secs(30));
    let errors = error_lines(&o);
    assert_eq!(errors.len(), 1, "stderr:\n{}", stderr(&o));
    assert!(
        errors[0].contains("rank 0 of 2") && errors[0].contains("rank 1 of 2 never arrived"),
        "{}",
        errors[0]
    );
}

#[test]
fn layouts_the_launcher_cannot_serve_are_explained() {
    let fx = Fixture::toy();
    let cwd = fx.run_dir("multinode");
    let o = fx.command(&cwd, 2, &["trainer.nnodes=2"]).output().unwrap();
    assert_one_line_error(&o, &["trainer.nnodes=2", "torchrun", "srun"]);
    // A dry run checks the rest and says how the launch would have to happen.
    let o = fx
        .command(
            &cwd,
            2,
            &[
                "trainer.nnodes=2",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
                "critic.ppo_micro_batch_size_per_gpu=1",
                "critic.forward_micro_batch_size_per_gpu=1",
                "--dry-run",
            ],
        )
        .output()
        .unwrap();
    let out = stdout(&o);
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    assert!(
        out.contains("not checked   launch:") && out.contains("torchrun") && out.contains("srun"),
        "{out}"
    );

    // torchrun says 2 ranks, the config 4.
    let o = fx
        .command(&cwd, 4, &[])
        .env("RANK", "0")
        .env("WORLD_SIZE", "2")
        .env("MASTER_PORT", "1")
        .output()
        .unwrap();
    assert_one_line_error(&o, &["WORLD_SIZE=2", "n_gpus_per_node=4"]);

    // Dry run at 2 ranks shows the split.
    let o = fx.command(&cwd, 2, &["--dry-run"]).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("over 2 rank(s)") && out.contains("2 local rank(s)"),
        "{out}"
    );
}
