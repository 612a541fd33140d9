//! Tensor parallelism (× data parallelism) run as threads of this process with a store on
//! 127.0.0.1 and the CPU communicator, against the one-rank FSDP backend as the reference: log-probs,
//! losses, metrics and updated weights over three steps within 1e-5 (fp32), the critic likewise,
//! checkpoints resharded between TP=2 and TP=1, generation on the gathered TP=1 copy, HF export,
//! layout errors.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use serde_json::{json, Value};
use tch::{Kind, Tensor};
use verl_comm::StoreServer;
use verl_fsdp_core::FsdpPlugin;
use verl_megatron::MegatronPlugin;
use verl_nn::{HeadKind, ModelConfig, ModelOptions, SaveOptions, Transformer};
use verl_plugin_api::client::{ActorClient, CriticClient};
use verl_plugin_api::{
    col, testing, Batch, GenerateOptions, InitArgs, LogProbOptions, Rendezvous, Role,
    UpdateOptions, ValueOptions,
};

const VOCAB: i64 = 40;
const PL: usize = 4;
const RL: usize = 5;
const ROWS: usize = 8;
const TOL: f64 = 1e-5;

/// A random qwen2-shaped checkpoint: 4 heads / 2 KV heads / 40 MLP columns / 40 tokens, all
/// divisible by TP = 2.
fn tiny_model(tied: bool, head: HeadKind) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let cfg = ModelConfig::from_value(
        json!({
            "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"],
            "vocab_size": VOCAB, "hidden_size": 16, "intermediate_size": 40,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 64,
            "tie_word_embeddings": tied, "initializer_range": 0.2,
            "pad_token_id": 0, "eos_token_id": 1,
        }),
        "inline/config.json",
    )
    .unwrap();
    tch::manual_seed(5);
    let model = Transformer::new(
        cfg,
        &ModelOptions {
            head,
            ..ModelOptions::default()
        },
    )
    .unwrap();
    model
        .save_pretrained(dir.path(), &SaveOptions::default())
        .unwrap();
    std::fs::write(dir.path().join("tokenizer_config.json"), "{}\n").unwrap();
    dir
}

fn merge(base: &mut Value, patch: &Value) {
    match (base, patch) {
        (Value::Object(b), Value::Object(p)) => {
            for (k, v) in p {
                merge(b.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
        (b, p) => *b = p.clone(),
    }
}

/// One mini-batch of the whole global batch, one row per micro-batch, fp32 everywhere; the
/// Megatron sections say `tp` and whether the optimizer is distributed.
fn config(model: &Path, tp: u64, distributed: bool, patch: Value) -> Value {
    let mg = json!({"tensor_model_parallel_size": tp, "dtype": "fp32",
                    "use_distributed_optimizer": distributed});
    let mut c = json!({
        "trainer": {"device": "cpu"},
        "actor_rollout_ref": {
            "model": {"path": model.to_str().unwrap()},
            "actor": {
                "ppo_mini_batch_size": ROWS, "ppo_micro_batch_size_per_gpu": 1, "ppo_epochs": 2,
                "grad_clip": 0.5, "calculate_entropy": true, "entropy_coeff": 0.01,
                "use_kl_loss": true, "kl_loss_coef": 0.1, "kl_loss_type": "low_var_kl",
                "optim": {"lr": 2e-2, "weight_decay": 0.01},
                "fsdp_config": {"model_dtype": "fp32", "dtype": "fp32"},
                "megatron": mg.clone(),
            },
            "rollout": {"n": 1, "temperature": 1.0, "log_prob_micro_batch_size_per_gpu": 3},
            "ref": {"fsdp_config": {"dtype": "fp32"}},
        },
        "critic": {
            "ppo_mini_batch_size": ROWS, "ppo_micro_batch_size_per_gpu": 1, "ppo_epochs": 2,
            "grad_clip": 0.5,
            "optim": {"lr": 2e-2, "weight_decay": 0.0},
            "model": {"path": model.to_str().unwrap(),
                      "fsdp_config": {"model_dtype": "fp32", "dtype": "fp32"}},
            "megatron": mg,
        },
    });
    merge(&mut c, &patch);
    c
}

struct Job {
    _server: Option<StoreServer>,
    port: u16,
    world: usize,
}

impl Job {
    fn new(world: usize) -> Job {
        if world == 1 {
            return Job {
                _server: None,
                port: 0,
                world,
            };
        }
        let server = StoreServer::bind("127.0.0.1:0").unwrap();
        let port = server.local_addr().port();
        Job {
            _server: Some(server),
            port,
            world,
        }
    }

    fn init(&self, role: Role, rank: usize, config: &Value) -> InitArgs {
        let mut init = InitArgs::new(role, config.clone());
        init.rank = rank as u32;
        init.local_rank = rank as u32;
        init.world_size = self.world as u32;
        if self.world > 1 {
            init.rendezvous = Some(Rendezvous {
                master_addr: "127.0.0.1".into(),
                master_port: self.port,
                timeout_s: 60,
            });
        }
        init
    }

    /// Runs `f(rank)` on every rank, each on its own thread; a rank slower than two minutes fails
    /// the test (a hang).
    fn run<T: Send + 'static>(&self, f: impl Fn(usize) -> T + Send + Sync + 'static) -> Vec<T> {
        let f = std::sync::Arc::new(f);
        let (tx, rx) = mpsc::channel();
        for rank in 0..self.world {
            let (f, tx) = (f.clone(), tx.clone());
            std::thread::Builder::new()
                .name(format!("rank{rank}"))
                .spawn(move || {
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(rank)));
                    let _ = tx.send((rank, r));
                })
                .unwrap();
        }
        let mut out: Vec<Option<T>> = (0..self.world).map(|_| None).collect();
        for _ in 0..self.world {
            let (rank, r) = rx
                .recv_timeout(Duration::from_secs(120))
                .expect("a rank hung for 120 s");
            match r {
                Ok(v) => out[rank] = Some(v),
                Err(p) => std::panic::resume_unwind(p),
            }
        }
        out.into_iter().map(|v| v.unwrap()).collect()
    }
}

struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn unit(&mut self) -> f32 {
        (self.next() % 10_000) as f32 / 10_000.0
    }
}

/// The global batch of one step: uneven prompt / response lengths, every update column.
fn global_batch(seed: u64) -> Batch {
    let mut rng = Lcg(seed);
    let (mut p, mut pm, mut r, mut rm) = (vec![], vec![], vec![], vec![]);
    let (mut old, mut refl, mut adv, mut val, mut ret) = (vec![], vec![], vec![], vec![], vec![]);
    for _ in 0..ROWS {
        let plen = 1 + (rng.next() % PL as u64) as usize;
        let rlen = 1 + (rng.next() % RL as u64) as usize;
        for j in 0..PL {
            let real = j >= PL - plen;
            p.push(if real {
                2 + (rng.next() % (VOCAB as u64 - 2)) as i64
            } else {
                0
            });
            pm.push(real as i64);
        }
        let a = rng.unit() * 2.0 - 1.0;
        for j in 0..RL {
            let real = j < rlen;
            r.push(if real {
                2 + (rng.next() % (VOCAB as u64 - 2)) as i64
            } else {
                0
            });
            rm.push(real as i64);
            old.push(-3.7 + (rng.unit() - 0.5) * 0.6);
            refl.push(-3.7 + (rng.unit() - 0.5) * 0.4);
            adv.push(a);
            val.push(rng.unit() - 0.5);
            ret.push(rng.unit() * 2.0 - 1.0);
        }
    }
    let mut b = Batch::new();
    b.insert_tensor(col::PROMPTS, &[ROWS, PL], &p);
    b.insert_tensor(col::PROMPT_MASK, &[ROWS, PL], &pm);
    b.insert_tensor(col::RESPONSES, &[ROWS, RL], &r);
    b.insert_tensor(col::RESPONSE_MASK, &[ROWS, RL], &rm);
    b.insert_tensor(col::OLD_LOG_PROBS, &[ROWS, RL], &old);
    b.insert_tensor(col::REF_LOG_PROBS, &[ROWS, RL], &refl);
    b.insert_tensor(col::ADVANTAGES, &[ROWS, RL], &adv);
    b.insert_tensor(col::VALUES, &[ROWS, RL], &val);
    b.insert_tensor(col::RETURNS, &[ROWS, RL], &ret);
    b
}

/// Data-parallel shard `rank` of `world` (contiguous rows); tensor-parallel peers get the same.
fn shard_rows(b: &Batch, rank: usize, world: usize) -> Batch {
    let n = b.rows() / world;
    let (start, end) = (rank * n, (rank + 1) * n);
    let mut out = Batch::new();
    for name in b.column_names() {
        if let Ok(t) = b.tensor::<i64>(name) {
            let w = t.cols();
            let data: Vec<i64> = (start..end).flat_map(|i| t.row(i).to_vec()).collect();
            out.insert_tensor(name, &[end - start, w], &data);
        } else {
            let t = b.tensor::<f32>(name).unwrap();
            let w = t.cols();
            let data: Vec<f32> = (start..end).flat_map(|i| t.row(i).to_vec()).collect();
            out.insert_tensor(name, &[end - start, w], &data);
        }
    }
    out
}

fn f32s(b: &Batch, name: &str) -> Vec<f32> {
    b.tensor::<f32>(name).unwrap().data
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max)
}

type Metrics = BTreeMap<String, f64>;
type Weights = HashMap<String, Tensor>;

fn read_weights(dir: &Path) -> Weights {
    Tensor::read_safetensors(dir.join("model.safetensors"))
        .unwrap()
        .into_iter()
        .collect()
}

fn export(actor: &mut ActorClient, rank: usize) -> Option<Weights> {
    let dir = tempfile::tempdir().unwrap();
    actor.export_hf(dir.path()).unwrap();
    (rank == 0).then(|| read_weights(dir.path()))
}

fn max_weight_diff(a: &Weights, b: &Weights) -> f64 {
    assert_eq!(
        a.keys().collect::<std::collections::BTreeSet<_>>(),
        b.keys().collect::<std::collections::BTreeSet<_>>()
    );
    a.iter()
        .map(|(k, t)| {
            (t.to_kind(Kind::Double) - b[k].to_kind(Kind::Double))
                .abs()
                .max()
                .double_value(&[])
        })
        .fold(0.0, f64::max)
}

fn assert_metrics_close(want: &Metrics, got: &Metrics, what: &str) {
    let skip = |k: &String| k.starts_with("perf/");
    assert_eq!(
        want.keys().filter(|k| !skip(k)).collect::<Vec<_>>(),
        got.keys().filter(|k| !skip(k)).collect::<Vec<_>>(),
        "{what}: metric names"
    );
    let off: Vec<String> = want
        .iter()
        .filter(|(k, _)| !skip(k))
        .filter(|(k, x)| (*x - got[*k]).abs() > TOL * (1.0 + x.abs()))
        .map(|(k, x)| format!("{k}: one rank {x}, megatron {}", got[k]))
        .collect();
    assert!(off.is_empty(), "{what}: {off:#?}");
}

/// `(per-step metrics, weights after the last step (rank 0), log-probs before the first update,
/// log-probs after the last one)` of one rank.
type ActorRun = (Vec<Metrics>, Option<Weights>, Vec<f32>, Vec<f32>);

/// `steps` updates of an actor; `megatron = None` is the one-rank FSDP reference, `Some((tp,
/// world))` the Megatron backend with data parallelism over `world / tp`.
fn actor_steps(
    megatron: Option<(u64, usize)>,
    model: &Path,
    distributed: bool,
    steps: u64,
) -> Vec<ActorRun> {
    let (tp, world) = megatron.unwrap_or((1, 1));
    let dp = world / tp as usize;
    let job = std::sync::Arc::new(Job::new(world));
    let cfg = config(model, tp, distributed, json!({}));
    let j = job.clone();
    job.run(move |rank| {
        let init = j.init(Role::Actor, rank, &cfg);
        let mut a = match megatron {
            None => testing::actor::<FsdpPlugin>(&init).unwrap(),
            Some(_) => testing::actor::<MegatronPlugin>(&init).unwrap(),
        };
        let dp_rank = a.data_parallel().rank as usize;
        assert_eq!(a.data_parallel().size as usize, dp);
        let opts = LogProbOptions {
            with_entropy: true,
            ..LogProbOptions::default()
        };
        let first = shard_rows(&global_batch(100), dp_rank, dp);
        let lp0 = f32s(&a.compute_log_prob(&first, &opts).unwrap(), col::LOG_PROBS);
        let mut metrics = Vec::new();
        let mut last = first;
        for step in 0..steps {
            let b = shard_rows(&global_batch(100 + step), dp_rank, dp);
            let m = a
                .update(
                    &b,
                    &UpdateOptions {
                        global_step: step + 1,
                        ..UpdateOptions::default()
                    },
                )
                .unwrap();
            metrics.push(m.into_iter().collect());
            last = b;
        }
        let lp = f32s(&a.compute_log_prob(&last, &opts).unwrap(), col::LOG_PROBS);
        (metrics, export(&mut a, rank), lp0, lp)
    })
}

fn check_actor_parity(tied: bool, distributed: bool) {
    let dir = tiny_model(tied, HeadKind::CausalLm);
    let one = actor_steps(None, dir.path(), distributed, 3).remove(0);
    for (tp, world) in [(2, 2), (2, 4)] {
        let dp = world / tp as usize;
        let runs = actor_steps(Some((tp, world)), dir.path(), distributed, 3);
        let what = format!("tp {tp} world {world}");
        for (rank, (metrics, _, _, _)) in runs.iter().enumerate() {
            for (step, (m1, m)) in one.0.iter().zip(metrics).enumerate() {
                assert_metrics_close(m1, m, &format!("{what} rank {rank} step {step}"));
            }
        }
        let d = max_weight_diff(one.1.as_ref().unwrap(), runs[0].1.as_ref().unwrap());
        assert!(d < TOL, "{what}: weights differ from one rank by {d}");
        // Data-parallel rank d's rows sit at tensor-parallel rank 0 of replica d; every
        // tensor-parallel peer returns the same full log-probs.
        for (lp_one, pick) in [(&one.2, 2usize), (&one.3, 3usize)] {
            let mut joined = Vec::new();
            for d in 0..dp {
                let base = d * tp as usize;
                let lp = |r: usize| if pick == 2 { &runs[r].2 } else { &runs[r].3 };
                for t in 1..tp as usize {
                    assert_eq!(
                        lp(base),
                        lp(base + t),
                        "{what}: tensor-parallel peers disagree"
                    );
                }
                joined.extend(lp(base).iter().copied());
            }
            let d = max_abs_diff(lp_one, &joined);
            assert!(d < TOL as f32, "{what}: log-probs differ by {d}");
        }
    }
}

#[test]
fn tp2_and_tp2_dp2_actor_updates_equal_one_rank() {
    check_actor_parity(false, true);
}

#[test]
fn tied_embeddings_without_distributed_optimizer_equal_one_rank() {
    check_actor_parity(true, false);
}

type CriticRun = (Vec<Metrics>, Vec<f32>);

fn critic_steps(megatron: Option<(u64, usize)>, model: &Path, steps: u64) -> Vec<CriticRun> {
    let (tp, world) = megatron.unwrap_or((1, 1));
    let dp = world / tp as usize;
    let job = std::sync::Arc::new(Job::new(world));
    let cfg = config(model, tp, true, json!({}));
    let j = job.clone();
    job.run(move |rank| {
        let init = j.init(Role::Critic, rank, &cfg);
        let mut c: CriticClient = match megatron {
            None => testing::critic::<FsdpPlugin>(&init).unwrap(),
            Some(_) => testing::critic::<MegatronPlugin>(&init).unwrap(),
        };
        let dp_rank = c.data_parallel().rank as usize;
        let mut metrics = Vec::new();
        for step in 0..steps {
            let b = shard_rows(&global_batch(200 + step), dp_rank, dp);
            let m = c.update(&b, &UpdateOptions::default()).unwrap();
            metrics.push(m.into_iter().collect());
        }
        let b = shard_rows(&global_batch(300), dp_rank, dp);
        let v = c.compute_values(&b, &ValueOptions::default()).unwrap();
        (metrics, f32s(&v, col::VALUES))
    })
}

#[test]
fn tp2_and_tp2_dp2_critic_updates_equal_one_rank() {
    // A checkpoint with a value head; another without (the head is initialised from the seed
    // exactly as the FSDP backend does).
    for head in [HeadKind::Value, HeadKind::CausalLm] {
        let dir = tiny_model(false, head);
        let one = critic_steps(None, dir.path(), 3).remove(0);
        for (tp, world) in [(2, 2), (2, 4)] {
            let dp = world / tp as usize;
            let runs = critic_steps(Some((tp, world)), dir.path(), 3);
            let what = format!("{head:?} checkpoint, tp {tp} world {world}");
            for (rank, (metrics, _)) in runs.iter().enumerate() {
                for (step, (m1, m)) in one.0.iter().zip(metrics).enumerate() {
                    assert_metrics_close(m1, m, &format!("{what} rank {rank} step {step}"));
                }
            }
            let joined: Vec<f32> = (0..dp)
                .flat_map(|d| runs[d * tp as usize].1.clone())
                .collect();
            // A freshly initialised head starts with values up to ~2 and gradients 3× larger:
            // after six AdamW steps at lr 2e-2 the reassociation noise of the split matmuls
            // (1e-6 before the first step) has grown to ~2e-5 in the values, while every metric
            // still agrees within 1e-5. The checkpoint with a value head stays within 1e-5.
            let tol = if head == HeadKind::Value { TOL } else { 5e-5 } as f32;
            let d = max_abs_diff(&one.1, &joined);
            assert!(d < tol, "{what}: values differ by {d}");
        }
    }
}

fn actor_at(job: &Job, rank: usize, cfg: &Value) -> ActorClient {
    testing::actor::<MegatronPlugin>(&job.init(Role::Actor, rank, cfg)).unwrap()
}

#[test]
fn checkpoints_reshard_between_tp2_and_tp1() {
    let dir = tiny_model(false, HeadKind::CausalLm);
    let ckpt2 = tempfile::tempdir().unwrap();
    let (m, c2) = (dir.path().to_path_buf(), ckpt2.path().to_path_buf());
    let opts = LogProbOptions::default;
    let batch = global_batch(100);
    let upd = |step: u64| UpdateOptions {
        global_step: step,
        ..UpdateOptions::default()
    };
    // TP=2: one update, save; then a second update (the uninterrupted run's weights).
    let job = std::sync::Arc::new(Job::new(2));
    let (j, cfg) = (job.clone(), config(&m, 2, true, json!({})));
    let (b, c) = (batch.clone(), c2.clone());
    let at_tp2 = job.run(move |rank| {
        let mut a = actor_at(&j, rank, &cfg);
        a.update(&b, &upd(1)).unwrap();
        a.save(&c).unwrap();
        let lp = f32s(&a.compute_log_prob(&b, &opts()).unwrap(), col::LOG_PROBS);
        a.update(&global_batch(101), &upd(2)).unwrap();
        (lp, export(&mut a, rank))
    });
    let state: Value =
        serde_json::from_str(&std::fs::read_to_string(c2.join("state.json")).unwrap()).unwrap();
    assert_eq!(state["layout"]["tensor_model_parallel_size"], 2);
    assert_eq!(state["format"], "verl-megatron/1");

    // TP=1 loads the TP=2 checkpoint: same log-probs, and the next update (AdamW moments
    // resharded) lands on the uninterrupted run's weights.
    let ckpt1 = tempfile::tempdir().unwrap();
    let mut a = actor_at(&Job::new(1), 0, &config(&m, 1, true, json!({})));
    a.load(&c2).unwrap();
    let lp1 = f32s(
        &a.compute_log_prob(&batch, &opts()).unwrap(),
        col::LOG_PROBS,
    );
    let d = max_abs_diff(&at_tp2[0].0, &lp1);
    assert!(d < TOL as f32, "TP=2 → TP=1: log-probs differ by {d}");
    a.save(ckpt1.path()).unwrap();
    a.update(&global_batch(101), &upd(2)).unwrap();
    let w1 = export(&mut a, 0).unwrap();
    let d = max_weight_diff(at_tp2[0].1.as_ref().unwrap(), &w1);
    assert!(d < TOL, "TP=2 → TP=1: resumed weights differ by {d}");

    // TP=1 → TP=2: the same log-probs on both tensor-parallel ranks.
    let job = std::sync::Arc::new(Job::new(2));
    let (j, cfg) = (job.clone(), config(&m, 2, false, json!({})));
    let (b, c) = (batch.clone(), ckpt1.path().to_path_buf());
    let back = job.run(move |rank| {
        let mut a = actor_at(&j, rank, &cfg);
        a.load(&c).unwrap();
        f32s(&a.compute_log_prob(&b, &opts()).unwrap(), col::LOG_PROBS)
    });
    for lp in back {
        let d = max_abs_diff(&lp1, &lp);
        assert!(d < TOL as f32, "TP=1 → TP=2: log-probs differ by {d}");
    }
}

#[test]
fn generation_on_the_gathered_model_equals_one_rank_and_reference_matches_actor() {
    let dir = tiny_model(true, HeadKind::CausalLm);
    let prompts = testing::prompts(&[&[5, 6, 7, 8], &[9, 10], &[11, 12, 13]], 0);
    let opts = GenerateOptions {
        n: 2,
        max_new_tokens: 6,
        temperature: 0.8,
        seed: Some(3),
        eos_token_ids: vec![1],
        ..GenerateOptions::default()
    };
    let cfg = config(dir.path(), 1, true, json!({}));
    let mut one = testing::actor::<FsdpPlugin>(&InitArgs::new(Role::Actor, cfg)).unwrap();
    let want = one.generate(&prompts, &opts).unwrap();
    let at = LogProbOptions {
        temperature: 0.8,
        ..LogProbOptions::default()
    };
    let want_lp = one.compute_log_prob(&want, &at).unwrap();
    let job = std::sync::Arc::new(Job::new(2));
    let (j, cfg) = (job.clone(), config(dir.path(), 2, true, json!({})));
    let (p, o, at) = (prompts.clone(), opts.clone(), at.clone());
    let got = job.run(move |rank| {
        let mut a = actor_at(&j, rank, &cfg);
        let mut r =
            testing::reference::<MegatronPlugin>(&j.init(Role::Reference, rank, &cfg)).unwrap();
        let g = a.generate(&p, &o).unwrap();
        let lp = a.compute_log_prob(&g, &at).unwrap();
        let ref_lp = r.compute_log_prob(&g, &at).unwrap();
        (g, f32s(&lp, col::LOG_PROBS), f32s(&ref_lp, col::LOG_PROBS))
    });
    for (g, lp, ref_lp) in &got {
        assert_eq!(
            g.tensor::<i64>(col::RESPONSES).unwrap().data,
            want.tensor::<i64>(col::RESPONSES).unwrap().data
        );
        let d = max_abs_diff(&f32s(&want_lp, col::LOG_PROBS), lp);
        assert!(
            d < TOL as f32,
            "log-probs of the generated rows differ by {d}"
        );
        assert_eq!(lp, ref_lp, "the reference starts from the actor's weights");
        // The rollout log-probs come from the gathered TP=1 model.
        let d = max_abs_diff(&f32s(g, col::ROLLOUT_LOG_PROBS), lp);
        assert!(
            d < 1e-4,
            "rollout log-probs differ from the TP log-probs by {d}"
        );
    }
}

#[test]
fn hf_export_at_tp2_loads_in_transformers() {
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python");
    let has_transformers = std::process::Command::new(&python)
        .args(["-c", "import transformers"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    let dir = tiny_model(false, HeadKind::CausalLm);
    let out = tempfile::tempdir().unwrap();
    let job = std::sync::Arc::new(Job::new(2));
    let (j, cfg) = (job.clone(), config(dir.path(), 2, true, json!({})));
    let o = out.path().to_path_buf();
    let lps = job.run(move |rank| {
        let mut a = actor_at(&j, rank, &cfg);
        a.update(&global_batch(7), &UpdateOptions::default())
            .unwrap();
        a.export_hf(&o).unwrap();
        f32s(
            &a.compute_log_prob(&global_batch(8), &LogProbOptions::default())
                .unwrap(),
            col::LOG_PROBS,
        )
    });
    assert!(out.path().join("tokenizer_config.json").is_file());
    // verl-nn reads the export back and scores like the TP=2 actor.
    let cfg1 = config(out.path(), 1, true, json!({}));
    let mut one = testing::actor::<FsdpPlugin>(&InitArgs::new(Role::Actor, cfg1)).unwrap();
    let lp = f32s(
        &one.compute_log_prob(&global_batch(8), &LogProbOptions::default())
            .unwrap(),
        col::LOG_PROBS,
    );
    let d = max_abs_diff(&lps[0], &lp);
    assert!(d < TOL as f32, "exported model scores differently by {d}");
    if !has_transformers {
        eprintln!(
            "skipping the transformers check: {} has no transformers",
            python.display()
        );
        return;
    }
    let script = format!(
        "import transformers, torch\nm = transformers.AutoModelForCausalLM.from_pretrained({:?})\nprint(m(torch.tensor([[3, 4, 5]])).logits.shape)",
        out.path().to_str().unwrap()
    );
    let o = std::process::Command::new(&python)
        .args(["-c", &script])
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "transformers could not load the export: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("torch.Size([1, 3, 40])"),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
}

#[test]
fn layout_errors_name_the_key_and_the_valid_sizes() {
    let dir = tiny_model(false, HeadKind::CausalLm);
    let mut init = InitArgs::new(Role::Actor, config(dir.path(), 3, true, json!({})));
    init.world_size = 3;
    let e = testing::actor::<MegatronPlugin>(&init)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("actor_rollout_ref.actor.megatron.tensor_model_parallel_size")
            && e.contains("tensor_model_parallel_size=3 does not divide num_attention_heads=4; valid: 1, 2, 4"),
        "{e}"
    );
    let mut init = InitArgs::new(
        Role::Critic,
        config(
            dir.path(),
            1,
            true,
            json!({"critic": {"megatron": {"pipeline_model_parallel_size": 2}}}),
        ),
    );
    init.world_size = 2;
    let e = testing::critic::<MegatronPlugin>(&init).err().unwrap();
    assert_eq!(e.kind(), verl_plugin_api::ErrorKind::NotImplemented, "{e}");
    assert!(
        e.to_string()
            .contains("critic.megatron.pipeline_model_parallel_size"),
        "{e}"
    );
}
