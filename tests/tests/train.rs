//! `verl run` trains: a tiny GRPO job through the real binary, the real FSDP backend plugin (CPU,
//! fp32) and the real rule-reward plugin — metrics with verl's names, checkpoints, and a resumed
//! run that continues exactly like an uninterrupted one.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use verl_e2e::*;
use verl_test_support::Lcg;

const CORPUS: &[&str] = &[
    "Natalia sold 48 clips in April and half as many in May. How many clips did she sell?",
    "Let's think step by step and output the final answer after \"####\". #### 72 #### 10",
    "the answer is 12 plus 30 equals 42 so #### 42",
    "system user assistant 0 1 2 3 4 5 6 7 8 9",
];
const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
const CHATML: &str = "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/// A tiny Qwen2-shaped HF folder: trained BPE tokenizer, ChatML template, random safetensors.
fn write_model(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let tok = verl_chat::train_bpe(CORPUS, 320, &SPECIALS).unwrap();
    tok.save(dir.join("tokenizer.json"), false).unwrap();
    let vocab = tok.get_vocab_size(true);
    std::fs::write(
        dir.join("tokenizer_config.json"),
        json!({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": null,
               "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML})
        .to_string(),
    )
    .unwrap();
    let (h, inter, layers, heads, kv, hd) = (32usize, 64usize, 2usize, 4usize, 4usize, 8usize);
    std::fs::write(
        dir.join("config.json"),
        json!({
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": vocab,
            "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "max_position_embeddings": 512,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": true,
            "hidden_act": "silu", "torch_dtype": "float32",
            "eos_token_id": 2, "pad_token_id": 0
        })
        .to_string(),
    )
    .unwrap();
    let mut rng = Lcg(42);
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut add = |name: String, shape: Vec<usize>, ones: bool| {
        let n: usize = shape.iter().product();
        let vals: Vec<f32> = (0..n)
            .map(|_| {
                if ones {
                    1.0
                } else {
                    (rng.unit24() - 0.5) * 0.2
                }
            })
            .collect();
        let bytes = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        tensors.push((name, shape, bytes));
    };
    add("model.embed_tokens.weight".into(), vec![vocab, h], false);
    add("model.norm.weight".into(), vec![h], true);
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        add(format!("{p}.input_layernorm.weight"), vec![h], true);
        add(
            format!("{p}.post_attention_layernorm.weight"),
            vec![h],
            true,
        );
        add(
            format!("{p}.self_attn.q_proj.weight"),
            vec![heads * hd, h],
            false,
        );
        add(
            format!("{p}.self_attn.q_proj.bias"),
            vec![heads * hd],
            false,
        );
        add(
            format!("{p}.self_attn.k_proj.weight"),
            vec![kv * hd, h],
            false,
        );
        add(format!("{p}.self_attn.k_proj.bias"), vec![kv * hd], false);
        add(
            format!("{p}.self_attn.v_proj.weight"),
            vec![kv * hd, h],
            false,
        );
        add(format!("{p}.self_attn.v_proj.bias"), vec![kv * hd], false);
        add(
            format!("{p}.self_attn.o_proj.weight"),
            vec![h, heads * hd],
            false,
        );
        add(format!("{p}.mlp.gate_proj.weight"), vec![inter, h], false);
        add(format!("{p}.mlp.up_proj.weight"), vec![inter, h], false);
        add(format!("{p}.mlp.down_proj.weight"), vec![h, inter], false);
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                    .unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, &None, &dir.join("model.safetensors")).unwrap();
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

/// Back to the defaults of the job's FSDP precision keys (fp32 compute), for the runs on the
/// Megatron backend, which refuses another backend's keys.
const FSDP_DTYPE_OFF: [&str; 2] = [
    "~actor_rollout_ref.actor.fsdp_config.model_dtype",
    "~actor_rollout_ref.actor.fsdp_config.dtype",
];

fn job_yaml(root: &Path, run: &str) -> String {
    let r = root.display();
    format!(
        r#"
data:
  train_files: {r}/train.jsonl
  val_files: {r}/val.jsonl
  train_batch_size: 4
  val_batch_size: 4
  max_prompt_length: 96
  max_response_length: 6
  seed: 3
actor_rollout_ref:
  model: {{path: {r}/model}}
  actor:
    strategy: fsdp
    ppo_mini_batch_size: 2
    ppo_micro_batch_size_per_gpu: 2
    use_kl_loss: true
    kl_loss_coef: 0.01
    optim: {{lr: 1.0e-3}}
    fsdp_config: {{model_dtype: fp32, dtype: fp32}}
  rollout:
    n: 2
    log_prob_micro_batch_size_per_gpu: 4
  ref:
    log_prob_micro_batch_size_per_gpu: 4
algorithm:
  adv_estimator: grpo
trainer:
  device: cpu
  total_epochs: 4
  total_training_steps: 3
  logger: [file]
  save_freq: 2
  test_freq: 2
  val_before_train: false
  n_gpus_per_node: 1
  project_name: e2e
  experiment_name: {run}
  default_local_dir: {r}/{run}/ckpt
"#
    )
}

fn metrics_by_step(path: &Path) -> BTreeMap<u64, serde_json::Map<String, Value>> {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("metrics file {}: {e}", path.display()));
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let v: Value = serde_json::from_str(line).unwrap();
        let step = v["step"].as_u64().unwrap();
        let data = v["data"].as_object().cloned().unwrap_or_default();
        out.entry(step)
            .or_insert_with(serde_json::Map::new)
            .extend(data);
    }
    out
}

fn verl_run(inst: &Path, cwd: &Path, job: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec!["run", job.to_str().unwrap()];
    args.extend_from_slice(extra);
    std::process::Command::new(inst.join("verl"))
        .args(&args)
        .current_dir(cwd)
        .env_remove("VERL_PLUGIN_PATH")
        .env("VERL_FILE_LOGGER_ROOT", cwd.join("logs"))
        .output()
        .unwrap()
}

fn jsonl_of(cwd: &Path) -> PathBuf {
    let mut found = Vec::new();
    let mut stack = vec![cwd.join("logs")];
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
    assert_eq!(found.len(), 1, "expected one metrics file, found {found:?}");
    found.remove(0)
}

/// The metrics a run's numerics decide: not timings, device memory, or the rollout engine's
/// per-rank pool statistics (`rollout/*`, which depend on how rows are spread over ranks).
fn comparable(m: &serde_json::Map<String, Value>) -> BTreeMap<String, f64> {
    m.iter()
        .filter(|(k, _)| {
            // global_seqlen/* describe how the step's tokens split over data-parallel ranks.
            !k.starts_with("timing")
                && !k.starts_with("perf/")
                && !k.starts_with("rollout/")
                && !k.starts_with("global_seqlen/")
        })
        .filter_map(|(k, v)| v.as_f64().map(|f| (k.clone(), f)))
        .collect()
}

/// One test's world: the installed binary and plugins, the tiny model, 8 training and 4
/// validation rows, all in temporary directories; each job runs in its own directory under it.
struct Fixture {
    inst: tempfile::TempDir,
    tmp: tempfile::TempDir,
}

impl Fixture {
    fn new(plugins: &[&str]) -> Fixture {
        let inst = install(plugins);
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        write_model(&root.join("model"));
        write_data(&root.join("train.jsonl"), 8, "train");
        write_data(&root.join("val.jsonl"), 4, "test");
        Fixture { inst, tmp }
    }

    fn root(&self) -> &Path {
        self.tmp.path()
    }

    /// `verl run` of job `name` (the standard job with `args`); its output and directory.
    fn output(&self, name: &str, args: &[&str]) -> (std::process::Output, PathBuf) {
        let dir = self.root().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let job = write(&dir, "job.yaml", &job_yaml(self.root(), name));
        (verl_run(self.inst.path(), &dir, &job, args), dir)
    }

    /// As [`Fixture::output`], which must succeed; the job's directory.
    fn run(&self, name: &str, args: &[&str]) -> PathBuf {
        let (o, dir) = self.output(name, args);
        assert!(
            o.status.success(),
            "{name}: stdout:\n{}\nstderr:\n{}",
            stdout(&o),
            stderr(&o)
        );
        dir
    }

    /// The metrics of a successful job, by step.
    fn metrics(&self, name: &str, args: &[&str]) -> BTreeMap<u64, serde_json::Map<String, Value>> {
        metrics_by_step(&jsonl_of(&self.run(name, args)))
    }
}

#[test]
fn grpo_trains_checkpoints_and_resumes_identically_through_the_fsdp_plugin() {
    let fx = Fixture::new(&["libverl_fsdp.so", "libverl_rewards.so"]);
    let (inst, root) = (&fx.inst, fx.root());

    // Uninterrupted: 3 steps.
    let straight = root.join("straight");
    std::fs::create_dir_all(&straight).unwrap();
    let job_a = write(&straight, "job.yaml", &job_yaml(root, "straight"));
    let o = verl_run(inst.path(), &straight, &job_a, &[]);
    assert!(
        o.status.success(),
        "stdout:\n{}\nstderr:\n{}",
        stdout(&o),
        stderr(&o)
    );
    let a = metrics_by_step(&jsonl_of(&straight));
    for step in 1..=3 {
        let m = a
            .get(&step)
            .unwrap_or_else(|| panic!("no metrics for step {step}: {a:?}"));
        for key in [
            "actor/pg_loss",
            "actor/kl_loss",
            "actor/grad_norm",
            "actor/lr",
            "critic/score/mean",
            "response_length/mean",
            "timing_s/gen",
            "timing_s/update_actor",
            "perf/throughput",
        ] {
            assert!(
                m.contains_key(key),
                "step {step} lacks {key}: {:?}",
                m.keys()
            );
        }
    }
    assert!(
        a[&2]
            .keys()
            .any(|k| k.starts_with("val-core/openai/gsm8k/")),
        "no validation at step 2"
    );
    let ckpt = root.join("straight/ckpt");
    assert_eq!(
        std::fs::read_to_string(ckpt.join("latest_checkpointed_iteration.txt"))
            .unwrap()
            .trim(),
        "3"
    );
    assert!(ckpt.join("global_step_2/actor").is_dir());
    assert!(
        ckpt.join("global_step_3/actor/model.safetensors").is_file()
            || ckpt.join("global_step_3/actor").is_dir()
    );

    // Interrupted: 2 steps, then resume to 3.
    let resumed = root.join("resumed");
    std::fs::create_dir_all(&resumed).unwrap();
    let job_b = write(&resumed, "job.yaml", &job_yaml(root, "resumed"));
    let o = verl_run(
        inst.path(),
        &resumed,
        &job_b,
        &["trainer.total_training_steps=2"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let o = verl_run(inst.path(), &resumed, &job_b, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("resumed from step 2"), "{}", stdout(&o));
    let b = metrics_by_step(&jsonl_of(&resumed));
    let (sa, sb) = (comparable(&a[&3]), comparable(&b[&3]));
    assert_eq!(sa.keys().collect::<Vec<_>>(), sb.keys().collect::<Vec<_>>());
    for (k, va) in &sa {
        let vb = sb[k];
        assert!(
            (va - vb).abs() <= 1e-6 * va.abs().max(1.0),
            "step 3 `{k}` differs after resume: {va} vs {vb}"
        );
    }
}

#[test]
fn generate_runs_through_the_fsdp_plugin_and_is_batch_invariant_when_greedy() {
    let inst = install(&["libverl_fsdp.so"]);
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    write_model(&model);
    let gen = |prompts: &[&str]| {
        let mut args = vec![
            "generate".to_string(),
            "--model".into(),
            model.display().to_string(),
            "--chat".into(),
            "--greedy".into(),
            "--max-new-tokens".into(),
            "8".into(),
            "--json".into(),
        ];
        for p in prompts {
            args.push("--prompt".into());
            args.push(p.to_string());
        }
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = run(&inst.path().join("verl"), &refs);
        assert!(o.status.success(), "{}", stderr(&o));
        stdout(&o)
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .collect::<Vec<_>>()
    };
    let both = gen(&[
        "How many clips?",
        "Natalia sold 48 clips in April. How many in May?",
    ]);
    assert_eq!(both.len(), 2);
    for r in &both {
        let ids = r["token_ids"].as_array().unwrap();
        let lps = r["log_probs"].as_array().unwrap();
        assert!(!ids.is_empty() && ids.len() <= 8);
        assert_eq!(ids.len(), lps.len());
        assert!(lps.iter().all(|l| l.as_f64().unwrap() <= 0.0));
        assert!(["stop", "length"].contains(&r["finish_reason"].as_str().unwrap()));
    }
    // Left-padding the shorter prompt in a batch must not change its greedy continuation.
    let alone = gen(&["How many clips?"]);
    assert_eq!(alone[0]["token_ids"], both[0]["token_ids"]);
}

/// `trainer.n_gpus_per_node=N` on CPU ranks: the launcher spawns N `verl` processes, each trains
/// on its contiguous quarter/half of the step's prompts with ZeRO-3 sharded weights, generates at
/// rollout TP 2 / 4 (weights resharded from the ZeRO-3 blocks, prompts shared out), and the
/// metrics must be those of one rank on the whole batch. One mini-batch per step (verl's ranks
/// each chunk their own rows, so several mini-batches would differ from one rank by design).
#[test]
fn grpo_on_two_and_four_cpu_ranks_equals_one_rank_and_resumes_across_world_sizes() {
    let fx = Fixture::new(&["libverl_fsdp.so", "libverl_rewards.so"]);
    let run = |name: &str, extra: &[&str]| {
        let mut args = vec![
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
            // Balancing orders rows by length, differently per world size (and so the order of
            // the floating-point sums); the split itself must not change a number.
            "trainer.balance_batch=false",
        ];
        args.extend_from_slice(extra);
        let (o, dir) = fx.output(name, &args);
        assert!(
            o.status.success(),
            "{name}: stdout:\n{}\nstderr:\n{}",
            stdout(&o),
            stderr(&o)
        );
        (dir, o)
    };
    let close = |what: &str, a: &BTreeMap<String, f64>, b: &BTreeMap<String, f64>| {
        assert_eq!(
            a.keys().collect::<Vec<_>>(),
            b.keys().collect::<Vec<_>>(),
            "{what}: metric names differ"
        );
        for (k, va) in a {
            let vb = b[k];
            assert!(
                (va - vb).abs() <= 1e-5 * va.abs().max(1.0),
                "{what}: `{k}` is {vb}, one rank gave {va}"
            );
        }
    };
    let (one, _) = run("one", &[]);
    let base = metrics_by_step(&jsonl_of(&one));
    assert!(base[&3].contains_key("actor/pg_loss"), "{:?}", base[&3]);
    // verl's default rollout TP 2 at 2 ranks; rollout TP 4 at 4 (one rollout group, each rank a
    // quarter of every split weight): the samples are one rank's.
    for (world, rollout_tp) in [("2", "2"), ("4", "4")] {
        let name = format!("world{world}");
        let (dir, _) = run(
            &name,
            &[
                &format!("trainer.n_gpus_per_node={world}"),
                &format!("actor_rollout_ref.rollout.tensor_model_parallel_size={rollout_tp}"),
            ],
        );
        let m = metrics_by_step(&jsonl_of(&dir));
        assert_eq!(
            m[&1].get("rollout/tp").and_then(Value::as_f64),
            rollout_tp.parse::<f64>().ok(),
            "{world} ranks: generation's tensor-parallel size"
        );
        for step in 1..=3 {
            close(
                &format!("{world} ranks, step {step}"),
                &comparable(&base[&step]),
                &comparable(&m[&step]),
            );
        }
        // Every rank wrote its shard of the actor's optimizer state.
        let actor = dir.join("ckpt/global_step_2/actor");
        let shards = std::fs::read_dir(&actor)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("optim.rank"))
            .count();
        assert_eq!(shards.to_string(), world, "{}", actor.display());
    }

    // Two ranks train steps 1-2 and checkpoint; four ranks resume for step 3 (resharding).
    let (dir, _) = run(
        "resharded",
        &[
            "trainer.n_gpus_per_node=2",
            "trainer.total_training_steps=2",
        ],
    );
    let (_, o) = run("resharded", &["trainer.n_gpus_per_node=4"]);
    assert!(stdout(&o).contains("resumed from step 2"), "{}", stdout(&o));
    let m = metrics_by_step(&jsonl_of(&dir));
    close(
        "2 ranks → checkpoint → 4 ranks, step 3",
        &comparable(&base[&3]),
        &comparable(&m[&3]),
    );
}

/// The Megatron backend through `verl run` on CPU ranks: TP=2, TP=2 × DP=2, PP=2, TP=2 × PP=2 and
/// TP=2 × PP=2 × DP=2 with generation at TP=4 must train exactly like the FSDP backend on one rank — actor, reference and critic. The host gives the ranks of one tensor-parallel group the same prompts and counts
/// their copies once in every batch-wide statistic (data metrics, whitening, validation). PPO
/// with GAE, because the tiny random policy never earns a reward: GRPO's advantages would all be
/// zero and the update pure rounding noise, while the critic's values make GAE's advantages real.
#[test]
fn megatron_tensor_and_pipeline_parallel_ranks_train_like_one_fsdp_rank() {
    let fx = Fixture::new(&[
        "libverl_fsdp.so",
        "libverl_megatron.so",
        "libverl_rewards.so",
    ]);
    let root = fx.root();
    let run = |name: &str, extra: &[&str]| {
        let critic_model = format!("critic.model.path={}", root.join("model").display());
        let mut args = vec![
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
            "algorithm.adv_estimator=gae",
            &critic_model,
            "critic.ppo_mini_batch_size=4",
            "critic.ppo_micro_batch_size_per_gpu=1",
            "critic.forward_micro_batch_size_per_gpu=1",
            "critic.optim.lr=1e-3",
        ];
        args.extend_from_slice(extra);
        fx.run(name, &args)
    };
    // The reference computes in bf16 by default (verl's), which no two backends round alike.
    let base = metrics_by_step(&jsonl_of(&run(
        "fsdp",
        &[
            "critic.model.fsdp_config.model_dtype=fp32",
            "critic.model.fsdp_config.dtype=fp32",
            "actor_rollout_ref.ref.fsdp_config.dtype=fp32",
        ],
    )));
    assert!(
        base[&1]["critic/advantages/max"].as_f64().unwrap() > 1e-3,
        "GAE advantages should be non-trivial: {:?}",
        base[&1]
    );
    let megatron = [
        "actor_rollout_ref.actor.strategy=megatron",
        FSDP_DTYPE_OFF[0],
        FSDP_DTYPE_OFF[1],
        "actor_rollout_ref.actor.megatron.dtype=float32",
        "actor_rollout_ref.ref.megatron.dtype=float32",
        "critic.strategy=megatron",
        "critic.megatron.dtype=float32",
    ];
    // (name, ranks, TP, PP, rollout TP): verl's default rollout TP 2 where it fits; the last is
    // the layout of verl's run_qwen2_5-7b_math_megatron_diff_tp.sh (train TP 2 × PP 2 × DP 2,
    // generation at TP 4 in two rollout groups), scaled down.
    let layouts: [(&str, &str, u32, u32, u32); 5] = [
        ("tp2", "2", 2, 1, 2),
        ("tp2_dp2", "4", 2, 1, 2),
        ("pp2", "2", 1, 2, 2),
        ("tp2_pp2", "4", 2, 2, 2),
        ("tp2_pp2_dp2_rollout_tp4", "8", 2, 2, 4),
    ];
    for (name, world, tp, pp, rollout_tp) in layouts {
        let sizes = [
            format!("trainer.n_gpus_per_node={world}"),
            format!("actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}"),
            format!("actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={pp}"),
            format!("critic.megatron.tensor_model_parallel_size={tp}"),
            format!("critic.megatron.pipeline_model_parallel_size={pp}"),
            format!("actor_rollout_ref.rollout.tensor_model_parallel_size={rollout_tp}"),
        ];
        let mut extra = megatron.to_vec();
        extra.extend(sizes.iter().map(String::as_str));
        let m = metrics_by_step(&jsonl_of(&run(name, &extra)));
        assert_eq!(
            m[&1].get("rollout/tp").and_then(Value::as_f64),
            Some(rollout_tp as f64),
            "{name}: generation's tensor-parallel size"
        );
        let mut bad = Vec::new();
        for step in 1..=3 {
            let (a, b) = (comparable(&base[&step]), comparable(&m[&step]));
            for (k, va) in &a {
                match b.get(k) {
                    None => bad.push(format!("step {step}: `{k}` missing")),
                    // pg_loss is a mean of whitened advantages (≈ 0 ± 1e-8 of rounding): 1e-7 floor.
                    Some(vb) if (va - vb).abs() > 1e-5 * va.abs().max(1e-2) => bad.push(format!(
                        "step {step}: `{k}` is {vb}, one FSDP rank gave {va}"
                    )),
                    Some(_) => {}
                }
            }
        }
        assert!(bad.is_empty(), "{name}:\n{}", bad.join("\n"));
    }
}

/// verl's GMPO (`geo_mean`) and DPPO (`dppo_tv`, `dppo_kl`) policy losses through the binary and
/// both backends, two micro-batches per mini-batch: each trains, reports verl's clip metrics and a
/// loss other than vanilla PPO's on the same first rollouts, and Megatron at TP 2 trains as one
/// FSDP rank. (Their numbers against verl's own code: `crates/losses/tests/golden.rs`.)
#[test]
fn gmpo_and_dppo_losses_train_alike_through_both_backends() {
    let fx = Fixture::new(&[
        "libverl_fsdp.so",
        "libverl_megatron.so",
        "libverl_rewards.so",
    ]);
    // GAE with a critic: the tiny model's rule rewards are all zero, GRPO's advantages would be too.
    let critic_model = format!("critic.model.path={}", fx.root().join("model").display());
    let run = |name: &str, extra: &[&str]| {
        let mut args = vec![
            "trainer.test_freq=-1",
            "trainer.save_freq=-1",
            "trainer.total_training_steps=2",
            "actor_rollout_ref.actor.use_kl_loss=false",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "algorithm.adv_estimator=gae",
            &critic_model,
            "critic.ppo_mini_batch_size=2",
            "critic.ppo_micro_batch_size_per_gpu=1",
            "critic.forward_micro_batch_size_per_gpu=1",
            "critic.optim.lr=1e-3",
        ];
        args.extend_from_slice(extra);
        fx.metrics(name, &args)
    };
    let fsdp_fp32 = [
        "critic.model.fsdp_config.model_dtype=fp32",
        "critic.model.fsdp_config.dtype=fp32",
    ];
    let megatron = [
        "actor_rollout_ref.actor.strategy=megatron",
        FSDP_DTYPE_OFF[0],
        FSDP_DTYPE_OFF[1],
        "actor_rollout_ref.actor.megatron.dtype=float32",
        "critic.strategy=megatron",
        "critic.megatron.dtype=float32",
        "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "critic.megatron.tensor_model_parallel_size=2",
    ];
    let vanilla = run("vanilla", &fsdp_fp32);
    let pg_loss = |m: &BTreeMap<u64, serde_json::Map<String, Value>>| {
        m[&1]["actor/pg_loss"].as_f64().expect("actor/pg_loss")
    };
    for loss in ["geo_mean", "dppo_tv", "dppo_kl"] {
        let mode = format!("actor_rollout_ref.actor.policy_loss.loss_mode={loss}");
        let fsdp = run(
            &format!("{loss}_fsdp"),
            &[fsdp_fp32[0], fsdp_fp32[1], &mode],
        );
        for key in [
            "actor/pg_clipfrac",
            "actor/pg_clipfrac_lower",
            "actor/ppo_kl",
        ] {
            assert!(
                fsdp[&1]
                    .get(key)
                    .and_then(Value::as_f64)
                    .is_some_and(f64::is_finite),
                "{loss}: `{key}` missing or not finite: {:?}",
                fsdp[&1]
            );
        }
        assert!(
            fsdp[&1]["critic/advantages/max"].as_f64().unwrap() > 1e-3,
            "{loss}: GAE advantages should be non-trivial: {:?}",
            fsdp[&1]
        );
        // Same seed, same first rollouts: only the loss differs.
        assert_eq!(
            fsdp[&1]["critic/score/mean"], vanilla[&1]["critic/score/mean"],
            "{loss}: the first rollouts should be vanilla's"
        );
        let (ours, base) = (pg_loss(&fsdp), pg_loss(&vanilla));
        assert!(
            (ours - base).abs() > 1e-6,
            "{loss}: pg_loss {ours} equals vanilla's {base}: the loss mode did not act"
        );
        let mut extra = megatron.to_vec();
        extra.push(&mode);
        let meg = run(&format!("{loss}_megatron"), &extra);
        let mut bad = Vec::new();
        for step in 1..=2 {
            let (a, b) = (comparable(&fsdp[&step]), comparable(&meg[&step]));
            for (k, va) in &a {
                match b.get(k) {
                    None => bad.push(format!("step {step}: `{k}` missing")),
                    Some(vb) if (va - vb).abs() > 1e-5 * va.abs().max(1e-2) => bad.push(format!(
                        "step {step}: `{k}` is {vb} on Megatron, {va} on FSDP"
                    )),
                    Some(_) => {}
                }
            }
        }
        assert!(bad.is_empty(), "{loss}:\n{}", bad.join("\n"));
    }
}

/// On-policy steps (one mini-batch, one epoch, no KL in the reward) skip the old-log-prob pass:
/// the update takes the PPO ratio against its own detached log-probs either way and reports
/// `actor/entropy` from its forward instead. Every metric must equal the run that keeps the pass
/// (`trainer.skip_on_policy_old_log_prob=false`), through both backends, except the
/// rollout-vs-training log-prob comparison, which needs the pass; an off-policy job (two
/// mini-batches) and `rollout.calculate_log_probs` still run it.
#[test]
fn on_policy_steps_skip_the_old_log_prob_pass_without_changing_any_metric() {
    let fx = Fixture::new(&[
        "libverl_fsdp.so",
        "libverl_megatron.so",
        "libverl_rewards.so",
    ]);
    let run = |name: &str, extra: &[&str]| {
        let mut args = vec!["trainer.test_freq=-1", "trainer.save_freq=-1"];
        args.extend_from_slice(extra);
        fx.metrics(name, &args)
    };
    let on_policy = "actor_rollout_ref.actor.ppo_mini_batch_size=4";
    let keep = "trainer.skip_on_policy_old_log_prob=false";
    let megatron = [
        "actor_rollout_ref.actor.strategy=megatron",
        FSDP_DTYPE_OFF[0],
        FSDP_DTYPE_OFF[1],
        "actor_rollout_ref.actor.megatron.dtype=float32",
        "actor_rollout_ref.ref.megatron.dtype=float32",
    ];
    for backend in ["fsdp", "megatron"] {
        let mut base: Vec<&str> = vec![on_policy];
        if backend == "megatron" {
            base.extend_from_slice(&megatron);
        }
        let skipped = run(&format!("{backend}_skip"), &base);
        let mut with_keep = base.clone();
        with_keep.push(keep);
        let kept = run(&format!("{backend}_keep"), &with_keep);
        let mut bad = Vec::new();
        for step in 1..=3 {
            assert!(
                !skipped[&step].contains_key("timing_s/old_log_prob"),
                "{backend} step {step}: the old-log-prob pass ran on an on-policy step"
            );
            assert!(kept[&step].contains_key("timing_s/old_log_prob"));
            let (a, b) = (comparable(&kept[&step]), comparable(&skipped[&step]));
            assert!(a.contains_key("actor/entropy") && b.contains_key("actor/entropy"));
            for (k, va) in &a {
                // Rollout-vs-training log-probs need the pass (verl reports them with
                // `rollout.calculate_log_probs`, which keeps it).
                if k.starts_with("training/rollout_probs_diff") {
                    assert!(!b.contains_key(k));
                    continue;
                }
                match b.get(k) {
                    None => bad.push(format!("step {step}: `{k}` missing when skipped")),
                    Some(vb) if (va - vb).abs() > 1e-5 * va.abs().max(1e-2) => {
                        bad.push(format!("step {step}: `{k}` is {vb} skipped, {va} kept"))
                    }
                    Some(_) => {}
                }
            }
        }
        assert!(bad.is_empty(), "{backend}:\n{}", bad.join("\n"));
    }
    // Two mini-batches per step: the second is off-policy, so the pass runs; and asking for the
    // rollout log-prob comparison keeps it on on-policy steps.
    let off = run("fsdp_off_policy", &[]);
    assert!(off[&1].contains_key("timing_s/old_log_prob"));
    let diff = run(
        "fsdp_rollout_diff",
        &[
            on_policy,
            "actor_rollout_ref.rollout.calculate_log_probs=true",
        ],
    );
    assert!(diff[&1].contains_key("timing_s/old_log_prob"));
    assert!(diff[&1].contains_key("training/rollout_probs_diff_mean"));
}

/// verl's `algorithm.rollout_correction` through the real binary and plugins.
/// * Bypass mode takes the rollout's log-probs as the old log-probs: an off-policy job (two
///   mini-batches) then never runs the old-log-prob pass, through both backends, and trains as
///   the job that recomputes them (on the CPU in fp32 the two agree to rounding).
/// * Decoupled importance weights and rejection: the `rollout_corr/*` metrics, weights ≈ 1 for an
///   unchanged policy, and a rejection rule that removes every token reaches the update, which
///   then has nothing to train on.
/// * A setting it cannot honour fails before anything runs, naming the key.
#[test]
fn rollout_correction_bypasses_the_old_pass_and_corrects_through_the_plugins() {
    let fx = Fixture::new(&[
        "libverl_fsdp.so",
        "libverl_megatron.so",
        "libverl_rewards.so",
    ]);
    fn with_args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
        let mut args = vec![
            "trainer.test_freq=-1",
            "trainer.save_freq=-1",
            "actor_rollout_ref.rollout.calculate_log_probs=true",
        ];
        args.extend_from_slice(extra);
        args
    }
    let go = |name: &str, extra: &[&str]| fx.output(name, &with_args(extra));
    let run = |name: &str, extra: &[&str]| fx.metrics(name, &with_args(extra));
    let bypass = "algorithm.rollout_correction.bypass_mode=true";

    // Off-policy (ppo_mini_batch_size 2 of 4 prompts): the recomputing run against bypass.
    let recomputed = run("fsdp_recompute", &[]);
    let bypassed = run("fsdp_bypass", &[bypass]);
    let mut bad = Vec::new();
    for step in 1..=3 {
        assert!(recomputed[&step].contains_key("timing_s/old_log_prob"));
        assert!(
            !bypassed[&step].contains_key("timing_s/old_log_prob"),
            "step {step}: bypass mode ran the old-log-prob pass"
        );
        let (a, b) = (comparable(&recomputed[&step]), comparable(&bypassed[&step]));
        for k in [
            "actor/pg_loss",
            "actor/grad_norm",
            "actor/kl_loss",
            "critic/score/mean",
        ] {
            let (Some(va), Some(vb)) = (a.get(k), b.get(k)) else {
                bad.push(format!("step {step}: `{k}` missing"));
                continue;
            };
            if (va - vb).abs() > 1e-3 * va.abs().max(1e-1) {
                bad.push(format!(
                    "step {step}: `{k}` is {vb} bypassed, {va} recomputed"
                ));
            }
        }
        // The anchor differs from the recomputed one by rounding only (the second mini-batch's
        // KL against it is the optimizer step's, in both runs).
        let kl = |m: &BTreeMap<String, f64>| m.get("actor/ppo_kl").copied().unwrap_or(f64::NAN);
        assert!(
            (kl(&a) - kl(&b)).abs() < 1e-5,
            "step {step}: actor/ppo_kl {} bypassed, {} recomputed",
            kl(&b),
            kl(&a)
        );
    }
    assert!(bad.is_empty(), "bypass vs recomputed:\n{}", bad.join("\n"));
    // Another policy loss is anchored at the rollout log-probs the same way (verl's DPPO example).
    let dppo = "actor_rollout_ref.actor.policy_loss.loss_mode=dppo_tv";
    let recomputed = run("fsdp_recompute_dppo", &[dppo]);
    let bypassed = run("fsdp_bypass_dppo", &[bypass, dppo]);
    for step in 1..=3 {
        assert!(!bypassed[&step].contains_key("timing_s/old_log_prob"));
        for k in ["actor/pg_loss", "actor/grad_norm", "actor/ppo_kl"] {
            let (va, vb) = (recomputed[&step][k].as_f64(), bypassed[&step][k].as_f64());
            let (Some(va), Some(vb)) = (va, vb) else {
                panic!("dppo_tv step {step}: `{k}` missing");
            };
            assert!(
                (va - vb).abs() <= 1e-3 * va.abs().max(1e-1),
                "dppo_tv step {step}: `{k}` is {vb} bypassed, {va} recomputed"
            );
        }
    }
    let mega = run(
        "megatron_bypass",
        &[
            bypass,
            "actor_rollout_ref.actor.strategy=megatron",
            FSDP_DTYPE_OFF[0],
            FSDP_DTYPE_OFF[1],
            "actor_rollout_ref.actor.megatron.dtype=float32",
            "actor_rollout_ref.ref.megatron.dtype=float32",
        ],
    );
    assert!(!mega[&1].contains_key("timing_s/old_log_prob"));
    assert!(mega[&3].contains_key("actor/pg_loss"));

    // Decoupled: token weights truncated at 2 plus a geometric-mean rejection rule.
    let corrected = run(
        "fsdp_is_rs",
        &[
            "algorithm.rollout_correction.rollout_is=token",
            "algorithm.rollout_correction.rollout_rs=seq_mean_k1",
            "algorithm.rollout_correction.rollout_rs_threshold=1.5",
        ],
    );
    for step in 1..=3 {
        let m = comparable(&corrected[&step]);
        let get = |k: &str| {
            *m.get(&format!("rollout_corr/{k}"))
                .unwrap_or_else(|| panic!("step {step}: no rollout_corr/{k}"))
        };
        assert!(
            (get("rollout_is_mean") - 1.0).abs() < 1e-3,
            "{}",
            get("rollout_is_mean")
        );
        assert!(get("kl").abs() < 1e-4 && get("chi2_token").abs() < 1e-3);
        assert_eq!(
            get("rollout_rs_masked_fraction"),
            0.0,
            "a ratio ≈ 1 is kept"
        );
        assert!(get("training_ppl") > 1.0 && get("rollout_is_eff_sample_size") > 0.99);
        assert!(m.contains_key("actor/pg_loss"));
    }
    // A band that excludes ratio 1 rejects every token: the updates have nothing to count.
    let rejected = run(
        "fsdp_reject_all",
        &[
            "algorithm.rollout_correction.rollout_rs=token_k1",
            "algorithm.rollout_correction.rollout_rs_threshold=2.0_3.0",
        ],
    );
    for step in 1..=3 {
        let m = comparable(&rejected[&step]);
        assert!(m["rollout_corr/rollout_rs_masked_fraction"] > 1.0 - 1e-6);
        assert_eq!(m["rollout_corr/rollout_rs_seq_masked_fraction"], 1.0);
        assert!(
            !m.contains_key("actor/pg_loss"),
            "step {step}: the update trained on rejected tokens: {:?}",
            m.get("actor/pg_loss")
        );
    }

    // Up-front refusals, before any model is loaded.
    for (extra, key) in [
        (
            &[
                "actor_rollout_ref.rollout.calculate_log_probs=false",
                bypass,
            ][..],
            "actor_rollout_ref.rollout.calculate_log_probs",
        ),
        (
            &[bypass, "algorithm.rollout_correction.loss_type=reinforce"],
            "algorithm.rollout_correction.loss_type",
        ),
        (
            &["algorithm.rollout_correction.rollout_rs=geometric"],
            "seq_mean_k1",
        ),
    ] {
        let mut args = vec!["--dry-run"];
        args.extend_from_slice(extra);
        let (o, _) = go("refused", &args);
        assert!(!o.status.success(), "{extra:?} was accepted");
        assert!(stderr(&o).contains(key), "{extra:?}: {}", stderr(&o));
    }
}

/// verl 0.10 renamed settings (`reward.*`, `model_engine`, `critic.fsdp`, `optim.clip_grad`);
/// a job in either layout is the same job: the same metrics, value for value.
#[test]
fn a_grpo_job_in_verl_0_7_and_0_10_layouts_trains_identically() {
    let fx = Fixture::new(&["libverl_fsdp.so", "libverl_rewards.so"]);
    let v07 = [
        "actor_rollout_ref.actor.strategy=fsdp",
        "reward_model.reward_manager=naive",
        "reward_model.enable=false",
        "custom_reward_function.reward_kwargs={method: flexible}",
        "actor_rollout_ref.actor.grad_clip=0.5",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1",
        "trainer.use_legacy_worker_impl=disable",
    ];
    let v010 = [
        "model_engine=dp",
        "reward.reward_manager.name=naive",
        "reward.reward_model.enable=false",
        "reward.custom_reward_function.reward_kwargs={method: flexible}",
        "actor_rollout_ref.actor.optim.clip_grad=0.5",
        "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=1",
        "trainer.use_v1=true",
    ];
    let a = fx.metrics("v07", &v07);
    let b = fx.metrics("v010", &v010);
    assert_eq!(a.keys().collect::<Vec<_>>(), vec![&1, &2, &3]);
    for step in 1..=3 {
        let (ma, mb) = (comparable(&a[&step]), comparable(&b[&step]));
        assert!(ma.len() > 30, "{ma:?}");
        assert_eq!(ma, mb, "step {step}");
    }
}
