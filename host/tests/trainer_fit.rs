//! The RL loop end to end on a tiny job: a HF-style model folder built on the fly (trained BPE
//! tokenizer, ChatML template, config.json), a GSM8K-style JSONL dataset, the toy backend loaded
//! from its cdylib through the host `Loader`, and the real rule rewards in-process.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde_json::{json, Value};
use verl_config::Config;
use verl_host::trainer::{fit, FitOptions, FitSummary, InProcessReward, JobPlugins};
use verl_host::{LoadedPlugin, Loader};
use verl_metrics::{LoggerOptions, TrackingOptions};
use verl_plugin_api::{
    col, Batch, BuildInfo, Capability, InitArgs, PluginInfo, Reward, RewardPlugin, Role,
    ScoreOptions,
};

const CORPUS: &[&str] = &[
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May? Let's think step by step.",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.",
    "output the final answer after #### 72 #### 10 the answer is",
    "system user assistant",
];
const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
const CHATML: &str = "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

fn toy_backend() -> LoadedPlugin {
    static PLUGIN: OnceLock<PathBuf> = OnceLock::new();
    // Cargo builds the fixture's cdylib as a dev-dependency next to this test binary.
    let path = PLUGIN.get_or_init(|| {
        let dir = std::env::current_exe()
            .unwrap()
            .parent()
            .unwrap()
            .to_path_buf();
        let p = dir.join("libtoy_backend.so");
        assert!(p.is_file(), "toy backend not built at {}", p.display());
        p
    });
    Loader::new(&[]).load(path.to_str().unwrap()).unwrap()
}

fn write_model(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let tok = verl_chat::train_bpe(CORPUS, 300, &SPECIALS).unwrap();
    tok.save(dir.join("tokenizer.json"), false).unwrap();
    let vocab = tok.get_vocab_size(true);
    let tc = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": null, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": CHATML,
    });
    std::fs::write(dir.join("tokenizer_config.json"), tc.to_string()).unwrap();
    std::fs::write(
        dir.join("config.json"),
        json!({"vocab_size": vocab}).to_string(),
    )
    .unwrap();
}

fn write_data(path: &Path, rows: usize, split: &str) {
    let rows: Vec<Value> = (0..rows)
        .map(|i| {
            json!({
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": format!("Natalia sold {} clips. How many clips? Let's think step by step and output the final answer after \"####\".", 40 + i)}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": format!("{}", 40 + i)},
                "extra_info": {"split": split, "index": i},
            })
        })
        .collect();
    verl_data::write_jsonl(path, rows.iter()).unwrap();
}

struct Job {
    _tmp: tempfile::TempDir,
    root: PathBuf,
}

impl Job {
    fn new() -> Job {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().to_path_buf();
        write_model(&root.join("model"));
        write_data(&root.join("train.jsonl"), 8, "train");
        write_data(&root.join("val.jsonl"), 3, "test");
        Job { _tmp: tmp, root }
    }

    fn config(&self, extra: &[String]) -> Config {
        let r = self.root.display();
        let yaml = format!(
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
    optim: {{lr: 0.05}}
  rollout:
    n: 2
    log_prob_micro_batch_size_per_gpu: 4
    val_kwargs: {{n: 2, do_sample: true, temperature: 1.0}}
  ref:
    log_prob_micro_batch_size_per_gpu: 4
critic:
  ppo_mini_batch_size: 2
  ppo_micro_batch_size_per_gpu: 2
  forward_micro_batch_size_per_gpu: 4
  optim: {{lr: 0.05}}
algorithm:
  adv_estimator: grpo
trainer:
  total_epochs: 2
  total_training_steps: 3
  logger: [file]
  save_freq: 2
  test_freq: 2
  val_before_train: true
  n_gpus_per_node: 1
  project_name: p
  experiment_name: e
  default_local_dir: {r}/ckpt
plugins:
  reward:
    default: rewards
"#
        );
        Config::from_yaml_str(&yaml, "trainer_fit.rs", extra).unwrap()
    }
}

fn options(jsonl: &Path) -> FitOptions {
    FitOptions {
        logger: Some(LoggerOptions {
            backends: vec!["file".into()],
            console_full: false,
            jsonl_path: jsonl.to_path_buf(),
            tensorboard_dir: jsonl.with_extension("tb"),
            tracking: TrackingOptions::new("proj", "exp"),
        }),
        progress: false,
        ..FitOptions::default()
    }
}

fn plugins() -> JobPlugins {
    JobPlugins::new(toy_backend(), vec![]).with_reward(
        "rewards",
        Box::new(InProcessReward::<verl_rewards::RulesRewardPlugin>::default()),
    )
}

/// The metrics file: (step, metrics) per line.
type Lines = Vec<(u64, serde_json::Map<String, Value>)>;

fn read_jsonl(path: &Path) -> Lines {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            (
                v["step"].as_u64().unwrap(),
                v["data"].as_object().unwrap().clone(),
            )
        })
        .collect()
}

fn run(job: &Job, extra: &[&str], jsonl: &str) -> (FitSummary, Lines) {
    let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
    let cfg = job.config(&extra);
    let path = job.root.join(jsonl);
    let summary = fit(&cfg, &plugins(), &options(&path)).unwrap();
    (summary, read_jsonl(&path))
}

/// Metrics that depend on the clock.
fn deterministic(m: &serde_json::Map<String, Value>) -> Vec<(String, Value)> {
    m.iter()
        .filter(|(k, _)| {
            !k.starts_with("timing_s/")
                && !k.starts_with("timing_per_token_ms/")
                && *k != "perf/time_per_step"
                && *k != "perf/throughput"
        })
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

#[test]
fn grpo_three_steps_log_verl_metrics_checkpoint_and_match_the_batch_plan() {
    let job = Job::new();
    let (summary, lines) = run(
        &job,
        &["actor_rollout_ref.actor.use_kl_loss=true"],
        "m.jsonl",
    );
    assert_eq!(summary.global_step, 3);
    assert_eq!(summary.checkpoints, vec![2, 3]);
    let steps: Vec<u64> = lines.iter().map(|(s, _)| *s).collect();
    // val_before_train at step 0, then three training steps.
    assert_eq!(steps, vec![0, 1, 2, 3]);
    assert!(
        lines[0]
            .1
            .contains_key("val-core/openai/gsm8k/reward/mean@2"),
        "{:?}",
        lines[0].1.keys()
    );
    for (step, m) in &lines[1..] {
        for key in [
            "training/global_step",
            "training/epoch",
            "actor/entropy",
            "actor/pg_loss",
            "actor/kl_loss",
            "critic/score/mean",
            "critic/rewards/mean",
            "critic/advantages/mean",
            "response_length/mean",
            "response_length/clip_ratio",
            "prompt_length/mean",
            "timing_s/gen",
            "timing_s/reward",
            "timing_s/old_log_prob",
            "timing_s/ref",
            "timing_s/adv",
            "timing_s/update_actor",
            "timing_s/step",
            "perf/throughput",
            "perf/total_num_tokens",
        ] {
            assert!(
                m.contains_key(key),
                "step {step}: missing {key} in {:?}",
                m.keys()
            );
        }
        assert_eq!(m["training/global_step"].as_f64(), Some(*step as f64));
        // 8 prompts / 4 per step = 2 steps per epoch.
        assert_eq!(m["training/epoch"].as_f64(), Some(((step - 1) / 2) as f64));
        let plan = summary.plan.as_ref().unwrap();
        assert_eq!(
            m["actor/mini_batches"].as_f64(),
            Some(plan.actor.mini_batches_per_step as f64)
        );
        assert_eq!(
            m["actor/optimizer_steps"].as_f64(),
            Some(plan.actor.optimizer_steps_per_step as f64)
        );
        assert!(!m.contains_key("timing_s/values"), "no critic for grpo");
        assert!(m["response_length/mean"].as_f64().unwrap() > 0.0);
        assert!(m["actor/pg_loss"].as_f64().unwrap().is_finite());
    }
    assert!(lines[2]
        .1
        .contains_key("val-core/openai/gsm8k/reward/mean@2"));
    assert!(lines[2].1.contains_key("timing_s/testing"));
    assert!(lines[2].1.contains_key("timing_s/save_checkpoint"));
    for step in [2, 3] {
        let dir = job.root.join(format!("ckpt/global_step_{step}"));
        assert!(
            dir.join("actor/toy_actor.json").is_file(),
            "{}",
            dir.display()
        );
        assert!(dir.join("data.json").is_file());
    }
    assert_eq!(
        std::fs::read_to_string(job.root.join("ckpt/latest_checkpointed_iteration.txt"))
            .unwrap()
            .trim(),
        "3"
    );
}

#[test]
fn gae_resume_from_step_two_continues_identically() {
    let gae = [
        "algorithm.adv_estimator=gae",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=adaptive",
        "trainer.val_before_train=false",
    ];
    // The rule reward is 0 for a bigram policy; a dense reward makes every step move the weights.
    let plugins = || {
        plugins().with_reward(
            "vowels",
            Box::new(InProcessReward::<VowelRewards>::default()),
        )
    };
    let run = |job: &Job, extra: &[&str], jsonl: &str| {
        let mut extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        extra.push("plugins.reward.routes={openai/gsm8k: vowels}".into());
        let path = job.root.join(jsonl);
        let summary = fit(&job.config(&extra), &plugins(), &options(&path)).unwrap();
        (summary, read_jsonl(&path))
    };
    let full_job = Job::new();
    let (full, full_lines) = run(&full_job, &gae, "full.jsonl");
    assert_eq!(full.global_step, 3);
    let step3 = &full_lines.iter().find(|(s, _)| *s == 3).unwrap().1;
    for key in [
        "critic/vf_loss",
        "critic/values/mean",
        "timing_s/values",
        "timing_s/update_critic",
        "actor/reward_kl_penalty_coeff",
    ] {
        assert!(step3.contains_key(key), "missing {key}");
    }
    // The comparison below means something only if the weights moved and the KL grew.
    let f = |k: &str| step3[k].as_f64().unwrap();
    assert!(
        f("actor/grad_norm") > 0.0 && f("critic/grad_norm") > 0.0,
        "{step3:?}"
    );
    assert!(f("actor/reward_kl_penalty") != 0.0, "{step3:?}");
    assert!(f("critic/score/max") > f("critic/score/min"), "{step3:?}");

    // Same job interrupted after step 2, then resumed (trainer.resume_mode=auto).
    let job = Job::new();
    let mut first: Vec<&str> = gae.to_vec();
    first.push("trainer.total_training_steps=2");
    let (a, _) = run(&job, &first, "a.jsonl");
    assert_eq!((a.global_step, a.checkpoints.clone()), (2, vec![2]));
    let (b, b_lines) = run(&job, &gae, "b.jsonl");
    assert_eq!(b.resumed_from, Some(2));
    assert_eq!(b_lines.iter().map(|(s, _)| *s).collect::<Vec<_>>(), vec![3]);
    let resumed3 = &b_lines[0].1;
    if std::env::var_os("VERL_TRAINER_TEST_DUMP").is_some() {
        eprintln!("{}", serde_json::to_string_pretty(resumed3).unwrap());
    }
    assert!(deterministic(step3).len() > 40, "{:?}", step3.keys());
    assert_eq!(deterministic(step3), deterministic(resumed3));
    // The model folders differ only in path, so the saved actors are bit-identical too.
    let read =
        |root: &Path| std::fs::read(root.join("ckpt/global_step_3/actor/toy_actor.json")).unwrap();
    assert!(
        read(&full_job.root) == read(&job.root),
        "actor weights after step 3 differ"
    );
}

#[test]
fn remax_runs_with_a_greedy_baseline() {
    let job = Job::new();
    let (summary, lines) = run(
        &job,
        &[
            "algorithm.adv_estimator=remax",
            "trainer.val_before_train=false",
            "trainer.save_freq=-1",
            "trainer.test_freq=-1",
            "trainer.total_training_steps=1",
        ],
        "r.jsonl",
    );
    assert_eq!(summary.global_step, 1);
    assert!(lines[0].1.contains_key("timing_s/gen_max"));
    assert!(summary.checkpoints.is_empty());
}

/// A dense reward: the share of vowels in the response text.
struct VowelRewards;
struct VowelReward;

impl RewardPlugin for VowelRewards {
    fn info() -> PluginInfo {
        PluginInfo {
            name: "vowels".into(),
            version: "0".into(),
            description: "share of vowels".into(),
            capabilities: vec![Capability::ready(Role::Reward)],
            build: BuildInfo::plain(),
        }
    }
    fn create_reward(_: &InitArgs) -> verl_plugin_api::Result<Box<dyn Reward>> {
        Ok(Box::new(VowelReward))
    }
}

impl Reward for VowelReward {
    fn score(&mut self, batch: &Batch, _: &ScoreOptions) -> verl_plugin_api::Result<Batch> {
        let scores: Vec<f32> = batch
            .strings(col::RESPONSE_TEXT)?
            .iter()
            .map(|t| {
                let v = t.chars().filter(|c| "aeiouAEIOU".contains(*c)).count();
                v as f32 / t.chars().count().max(1) as f32
            })
            .collect();
        let mut out = Batch::new();
        out.insert_tensor(col::SCORES, &[scores.len()], &scores);
        Ok(out)
    }
}

/// A reward plugin that misbehaves: `MODE` 0 answers NaN, 1 one score too few, 2 an error.
struct BadRewards<const MODE: u8>;
struct BadReward(u8);

impl<const MODE: u8> RewardPlugin for BadRewards<MODE> {
    fn info() -> PluginInfo {
        PluginInfo {
            name: format!("bad-rewards-{MODE}"),
            version: "0".into(),
            description: "misbehaves".into(),
            capabilities: vec![Capability::ready(Role::Reward)],
            build: BuildInfo::plain(),
        }
    }
    fn create_reward(_: &InitArgs) -> verl_plugin_api::Result<Box<dyn Reward>> {
        Ok(Box::new(BadReward(MODE)))
    }
}

impl Reward for BadReward {
    fn score(&mut self, batch: &Batch, _: &ScoreOptions) -> verl_plugin_api::Result<Batch> {
        let rows = match self.0 {
            1 => batch.rows() - 1,
            2 => return Err(verl_plugin_api::Error::failed("grader service unreachable")),
            _ => batch.rows(),
        };
        let mut out = Batch::new();
        out.insert_tensor(col::SCORES, &[rows], &vec![f32::NAN; rows]);
        Ok(out)
    }
}

#[test]
fn a_bad_reward_fails_the_step_naming_the_plugin() {
    let job = Job::new();
    let cfg = job.config(&[
        "trainer.val_before_train=false".to_string(),
        "plugins.reward.routes={openai/gsm8k: bad}".to_string(),
    ]);
    let cases: [(Box<dyn verl_host::trainer::RewardFactory>, &str); 3] = [
        (
            Box::new(InProcessReward::<BadRewards<0>>::default()),
            "non-finite",
        ),
        (
            Box::new(InProcessReward::<BadRewards<1>>::default()),
            "rows",
        ),
        (
            Box::new(InProcessReward::<BadRewards<2>>::default()),
            "grader service unreachable",
        ),
    ];
    for (i, (factory, what)) in cases.into_iter().enumerate() {
        let plugins = plugins().with_reward("bad", factory);
        let err = fit(&cfg, &plugins, &options(&job.root.join("n.jsonl"))).unwrap_err();
        let msg = format!("{err:#}");
        assert!(
            msg.contains(&format!("bad-rewards-{i}")) && msg.contains(what),
            "{msg}"
        );
        assert!(msg.contains("reward plugin `bad`"), "{msg}");
    }
    assert!(!job
        .root
        .join("ckpt/latest_checkpointed_iteration.txt")
        .exists());
}

#[test]
fn val_only_validates_once_and_trains_nothing() {
    let job = Job::new();
    let (summary, lines) = run(&job, &["trainer.val_only=true"], "v.jsonl");
    assert_eq!(summary.global_step, 0);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0].0, 0);
    assert!(lines[0]
        .1
        .contains_key("val-core/openai/gsm8k/reward/mean@2"));
    assert!(!lines[0].1.contains_key("actor/pg_loss"));
    assert!(summary.checkpoints.is_empty());
    assert!(!job.root.join("ckpt").exists());
}

#[test]
fn critic_warmup_holds_the_actor_until_its_step() {
    let job = Job::new();
    let (summary, lines) = run(
        &job,
        &[
            "algorithm.adv_estimator=gae",
            "trainer.critic_warmup=2",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            "trainer.save_freq=-1",
        ],
        "w.jsonl",
    );
    assert_eq!(summary.global_step, 3);
    let at = |step: u64| &lines.iter().find(|(s, _)| *s == step).unwrap().1;
    // verl: the actor updates once global_step >= critic_warmup; the critic from the start.
    assert!(at(1).contains_key("critic/vf_loss"));
    assert!(!at(1).contains_key("actor/pg_loss"), "{:?}", at(1).keys());
    assert!(!at(1).contains_key("timing_s/update_actor"));
    for step in [2, 3] {
        assert!(at(step).contains_key("actor/pg_loss"), "step {step}");
        assert!(at(step).contains_key("critic/vf_loss"), "step {step}");
    }
}

#[test]
fn total_epochs_bound_the_run_when_no_step_count_is_set() {
    let job = Job::new();
    // 8 training rows, 4 prompts per step: one epoch is two steps.
    let (summary, lines) = run(
        &job,
        &[
            "trainer.total_training_steps=null",
            "trainer.total_epochs=1",
            "trainer.val_before_train=false",
        ],
        "e.jsonl",
    );
    assert_eq!((summary.global_step, summary.total_training_steps), (2, 2));
    assert_eq!(
        lines.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
        vec![1, 2]
    );
    let (summary, _) = run(
        &Job::new(),
        &[
            "trainer.total_training_steps=null",
            "trainer.total_epochs=2",
            "trainer.val_before_train=false",
        ],
        "e.jsonl",
    );
    assert_eq!(summary.global_step, 4);
}

#[test]
fn checkpoints_are_kept_and_resumed_as_the_trainer_keys_say() {
    let job = Job::new();
    let gae = [
        "algorithm.adv_estimator=gae",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=1",
        "trainer.max_actor_ckpt_to_keep=2",
        "trainer.max_critic_ckpt_to_keep=1",
    ];
    let (summary, _) = run(&job, &gae, "k.jsonl");
    assert_eq!(summary.checkpoints, vec![1, 2, 3]);
    let ckpt = |step: u64, role: &str| {
        job.root
            .join(format!("ckpt/global_step_{step}/{role}"))
            .is_dir()
    };
    // The newest two actors and the newest critic stay; an emptied step folder goes.
    assert!(!job.root.join("ckpt/global_step_1").exists());
    assert!(ckpt(2, "actor") && !ckpt(2, "critic"));
    assert!(ckpt(3, "actor") && ckpt(3, "critic"));

    // resume_mode=resume_path starts from the named step, not the latest.
    let mut resume: Vec<&str> = gae.to_vec();
    resume.push("trainer.max_critic_ckpt_to_keep=null");
    resume.push("trainer.resume_mode=resume_path");
    let from = job.root.join("ckpt/global_step_3");
    let from = format!("trainer.resume_from_path={}", from.display());
    resume.push(&from);
    resume.push("trainer.total_training_steps=4");
    let (summary, lines) = run(&job, &resume, "r.jsonl");
    assert_eq!(summary.resumed_from, Some(3));
    assert_eq!(lines.iter().map(|(s, _)| *s).collect::<Vec<_>>(), vec![4]);
}

#[test]
fn generations_are_dumped_where_the_job_says() {
    let job = Job::new();
    let rollouts = job.root.join("rollouts");
    let vals = job.root.join("vals");
    let a = format!("trainer.rollout_data_dir={}", rollouts.display());
    let b = format!("trainer.validation_data_dir={}", vals.display());
    run(&job, &[&a, &b, "trainer.total_training_steps=2"], "d.jsonl");
    for step in [1, 2] {
        let text = std::fs::read_to_string(rollouts.join(format!("{step}.jsonl"))).unwrap();
        // 4 prompts x rollout.n=2 responses, one line each, with verl's fields.
        assert_eq!(text.lines().count(), 8, "{text}");
        let row: Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
        for field in ["input", "output", "gts", "score", "step"] {
            assert!(row.get(field).is_some(), "{field} missing in {row}");
        }
    }
    // Validation at step 0 (val_before_train) and at step 2 (test_freq).
    for step in [0, 2] {
        assert!(vals.join(format!("{step}.jsonl")).is_file(), "step {step}");
    }
}

#[test]
fn hf_model_in_save_contents_exports_the_policy_with_each_checkpoint() {
    let job = Job::new();
    let (summary, _) = run(
        &job,
        &[
            "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
            "trainer.val_before_train=false",
        ],
        "h.jsonl",
    );
    assert_eq!(summary.checkpoints, vec![2, 3]);
    for step in [2, 3] {
        let actor = job.root.join(format!("ckpt/global_step_{step}/actor"));
        // verl's place for the HF export: the actor's folder, `huggingface/`.
        assert!(
            actor.join("huggingface/config.json").is_file(),
            "step {step}"
        );
        assert_eq!(
            std::fs::read(actor.join("huggingface/toy_actor.json")).unwrap(),
            std::fs::read(actor.join("toy_actor.json")).unwrap(),
            "the export is the checkpointed policy"
        );
    }
    // Without hf_model there is no export.
    let plain = Job::new();
    run(&plain, &["trainer.val_before_train=false"], "p.jsonl");
    assert!(!plain
        .root
        .join("ckpt/global_step_3/actor/huggingface")
        .exists());
}

#[test]
fn balance_batch_reorders_the_batch_like_verl() {
    // The same job with and without verl's balancing: the same responses (sampling is keyed by
    // prompt and sample, not by row), in another order, and verl's global_seqlen metrics.
    let dumps = |balance: &str| {
        let job = Job::new();
        let dir = job.root.join("rollouts");
        let d = format!("trainer.rollout_data_dir={}", dir.display());
        let (_, lines) = run(
            &job,
            &[
                &d,
                balance,
                "trainer.total_training_steps=1",
                "trainer.val_before_train=false",
            ],
            "b.jsonl",
        );
        let rows: Vec<String> = std::fs::read_to_string(dir.join("1.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                let v: Value = serde_json::from_str(l).unwrap();
                format!("{}|{}", v["input"], v["output"])
            })
            .collect();
        (rows, lines[0].1.clone())
    };
    let (plain, off) = dumps("trainer.balance_batch=false");
    let (balanced, on) = dumps("trainer.balance_batch=true");
    assert_ne!(plain, balanced, "balancing reorders the rows");
    let sorted = |mut v: Vec<String>| {
        v.sort();
        v
    };
    assert_eq!(sorted(plain), sorted(balanced), "and keeps every response");
    assert!(!off.contains_key("global_seqlen/mean"));
    for key in [
        "global_seqlen/min",
        "global_seqlen/max",
        "global_seqlen/minmax_diff",
        "global_seqlen/balanced_min",
        "global_seqlen/balanced_max",
        "global_seqlen/mean",
    ] {
        assert!(on.contains_key(key), "missing {key}");
    }
    // One rank: one partition holding every token of the step.
    assert_eq!(on["global_seqlen/mean"], on["global_seqlen/balanced_max"]);
    assert_eq!(on["global_seqlen/minmax_diff"].as_f64(), Some(0.0));
}

#[test]
fn validation_generations_are_logged_like_verl() {
    // verl logs `trainer.log_val_generations` samples to the trackers (TensorBoard here: a text
    // summary per validation), chosen by its fixed-seed selection from the validation rows.
    let job = Job::new();
    let tb = job.root.join("tb");
    let cfg = job.config(&[
        "trainer.log_val_generations=2".to_string(),
        "trainer.total_training_steps=2".to_string(),
    ]);
    let options = FitOptions {
        logger: Some(LoggerOptions {
            backends: vec!["tensorboard".into()],
            console_full: false,
            jsonl_path: job.root.join("unused.jsonl"),
            tensorboard_dir: tb.clone(),
            tracking: TrackingOptions::new("proj", "exp"),
        }),
        progress: false,
        ..FitOptions::default()
    };
    fit(&cfg, &plugins(), &options).unwrap();
    let file = std::fs::read_dir(&tb)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().contains("tfevents"))
        .unwrap();
    let texts: Vec<(i64, String)> = verl_metrics::tfevents::read_events(&file)
        .unwrap()
        .into_iter()
        .flat_map(|e| e.texts.into_iter().map(move |(_, t)| (e.step, t)))
        .collect();
    // Validation before training (step 0) and at step 2 (test_freq, last step).
    let steps: Vec<i64> = texts.iter().map(|(s, _)| *s).collect();
    assert_eq!(steps, vec![0, 2], "{texts:?}");
    for (step, text) in &texts {
        assert!(
            text.contains(&format!("Generation Results - Step {step}")),
            "{text}"
        );
        assert_eq!(text.matches("### Sample").count(), 2, "{text}");
        assert!(
            text.contains("Natalia sold"),
            "the prompts are logged: {text}"
        );
    }
    // Without the key, nothing of the kind.
    let plain = Job::new();
    let cfg = plain.config(&["trainer.total_training_steps=1".to_string()]);
    let options = FitOptions {
        logger: Some(LoggerOptions {
            backends: vec!["tensorboard".into()],
            console_full: false,
            jsonl_path: plain.root.join("unused.jsonl"),
            tensorboard_dir: plain.root.join("tb"),
            tracking: TrackingOptions::new("proj", "exp"),
        }),
        progress: false,
        ..FitOptions::default()
    };
    fit(&cfg, &plugins(), &options).unwrap();
    let file = std::fs::read_dir(plain.root.join("tb"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().contains("tfevents"))
        .unwrap();
    assert!(verl_metrics::tfevents::read_events(&file)
        .unwrap()
        .iter()
        .all(|e| e.texts.is_empty()));
}
