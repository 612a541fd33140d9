//! ZeRO-3 sharding over several data-parallel ranks, run as threads of this process with a store
//! on 127.0.0.1 and the CPU communicator: parity with one rank (losses, metrics, weights), sharded
//! checkpoints resharded across world sizes, failure of a peer, memory per rank.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use serde_json::{json, Value};
use tch::{Kind, Tensor};
use verl_fsdp::{FsdpActor, FsdpPlugin};
use verl_nn::HeadKind;
use verl_plugin_api::client::{ActorClient, CriticClient};
use verl_plugin_api::{
    col, testing, Actor, Batch, InitArgs, LogProbOptions, Role, UpdateOptions, ValueOptions,
};
use verl_test_support::model::{model_dir, qwen2_config};
use verl_test_support::{merge, Lcg};

const VOCAB: i64 = 40;
const PL: usize = 4;
const RL: usize = 5;
const ROWS: usize = 8;
/// Parity tolerance (fp32; only the order of floating-point sums differs between world sizes).
const TOL: f64 = 1e-5;

/// A random qwen2-shaped checkpoint with `head` (a value head for the critic, so that no rank has
/// to initialise one at random).
fn tiny_model(tied: bool, head: HeadKind) -> tempfile::TempDir {
    model_dir(qwen2_config(VOCAB, 16, 40, 2, 64, tied), Some(5), head)
}

/// One mini-batch of the whole global batch, one row per micro-batch: the same micro-batches at
/// every world size, so that list metrics (clip fractions) are comparable too.
fn config(model: &Path, patch: Value) -> Value {
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
        },
    });
    merge(&mut c, &patch);
    c
}

use verl_test_support::ranks::Job;

/// The global batch of one step: sequences with uneven prompt / response lengths and every
/// column the actor and critic updates read.
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
            // Old log-probs near the model's (ln(1/40) ≈ -3.7) so ratios get clipped sometimes.
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

/// Rank `rank`'s contiguous 1/world of the rows.
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
    // Every rank takes part in the gather; rank 0 writes.
    actor.export_hf(dir.path()).unwrap();
    (rank == 0).then(|| read_weights(dir.path()))
}

fn max_weight_diff(a: &Weights, b: &Weights) -> f64 {
    assert_eq!(a.len(), b.len());
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
    assert_eq!(
        want.keys().collect::<Vec<_>>(),
        got.keys().collect::<Vec<_>>(),
        "{what}: metric names"
    );
    for (k, x) in want {
        let y = got[k];
        assert!(
            (x - y).abs() <= TOL * (1.0 + x.abs()),
            "{what}: {k}: one rank {x}, sharded {y}"
        );
    }
}

fn actor_on(job: &Job, rank: usize, cfg: &Value) -> ActorClient {
    testing::actor::<FsdpPlugin>(&job.init(Role::Actor, rank, cfg)).unwrap()
}

/// Per rank: the metrics of each step, the weights after the last one (rank 0) and the log-probs
/// of this rank's rows after it.
type ActorRun = (Vec<Metrics>, Option<Weights>, Vec<f32>);

fn actor_steps(world: usize, model: &Path, patch: Value, steps: u64) -> Vec<ActorRun> {
    actor_steps_on(world, model, patch, steps, global_batch)
}

fn actor_steps_on(
    world: usize,
    model: &Path,
    patch: Value,
    steps: u64,
    batch: fn(u64) -> Batch,
) -> Vec<ActorRun> {
    let job = Job::new(world);
    let cfg = config(model, patch);
    let job = std::sync::Arc::new(job);
    let j = job.clone();
    job.run(move |rank| {
        let mut a = actor_on(&j, rank, &cfg);
        let mut metrics = Vec::new();
        let mut last = None;
        for step in 0..steps {
            let b = shard_rows(&batch(100 + step), rank, world);
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
            last = Some(b);
        }
        let lp = a
            .compute_log_prob(&last.unwrap(), &LogProbOptions::default())
            .unwrap();
        (metrics, export(&mut a, rank), f32s(&lp, col::LOG_PROBS))
    })
}

fn check_actor_parity(tied: bool, patch: Value) {
    let dir = tiny_model(tied, HeadKind::CausalLm);
    let one = actor_steps(1, dir.path(), patch.clone(), 3).remove(0);
    for world in [2, 4] {
        let runs = actor_steps(world, dir.path(), patch.clone(), 3);
        for (rank, (metrics, _, _)) in runs.iter().enumerate() {
            for (step, (m1, m)) in one.0.iter().zip(metrics).enumerate() {
                assert_metrics_close(m1, m, &format!("world {world} rank {rank} step {step}"));
            }
        }
        let w = runs[0].1.as_ref().unwrap();
        let d = max_weight_diff(one.1.as_ref().unwrap(), w);
        assert!(
            d < TOL,
            "world {world}: weights differ from one rank by {d}"
        );
        let lp: Vec<f32> = runs.iter().flat_map(|r| r.2.clone()).collect();
        let d = one
            .2
            .iter()
            .zip(&lp)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(d < 1e-4, "world {world}: log-probs differ by {d}");
    }
}

#[test]
fn actor_updates_at_world_2_and_4_equal_one_rank() {
    check_actor_parity(false, json!({}));
}

/// `mixed_precision.reduce_dtype: bf16` reduce-scatters the gradients in bf16: the first
/// update's gradient norm is within bf16 rounding of the fp32 reduction's but not equal to it
/// (the key takes effect), and so are the weights after it.
#[test]
fn bf16_gradient_reduction_follows_reduce_dtype() {
    let dir = tiny_model(false, HeadKind::CausalLm);
    let patch = |reduce: &str| {
        json!({"actor_rollout_ref": {"actor": {"ppo_epochs": 1, "fsdp_config": {
            "dtype": "fp32", "mixed_precision": {"reduce_dtype": reduce},
        }}}})
    };
    let one = actor_steps(1, dir.path(), patch("fp32"), 1).remove(0);
    let fp32 = actor_steps(2, dir.path(), patch("fp32"), 1).remove(0);
    let bf16 = actor_steps(2, dir.path(), patch("bf16"), 1).remove(0);
    let norm = |r: &ActorRun| r.0[0]["actor/grad_norm"];
    let (g1, g32, g16) = (norm(&one), norm(&fp32), norm(&bf16));
    assert!(
        (g1 - g32).abs() <= TOL * g1,
        "fp32 reduction: {g32} vs one rank {g1}"
    );
    assert!(
        g16 != g32 && (g16 - g32).abs() <= 1e-2 * g32,
        "bf16 reduction: {g16} vs fp32 {g32}"
    );
    let w1 = one.1.as_ref().unwrap();
    let d32 = max_weight_diff(w1, fp32.1.as_ref().unwrap());
    let d16 = max_weight_diff(w1, bf16.1.as_ref().unwrap());
    assert!(d32 < TOL && d16 > d32, "weights: fp32 {d32}, bf16 {d16}");
}

#[test]
fn tied_embeddings_and_kept_forward_params_equal_one_rank() {
    check_actor_parity(
        true,
        json!({"actor_rollout_ref": {"actor": {"fsdp_config": {
            "reshard_after_forward": false, "param_offload": true, "optimizer_offload": true,
        }}}}),
    );
}

#[test]
fn dynamic_batch_sizes_with_unequal_micro_batch_counts_still_match() {
    // A token budget packs each rank's rows into a different number of micro-batches; ranks
    // split or pad to the same count, and the gradient (hence weights and summed losses) is the
    // one-rank gradient whatever the packing.
    let dir = tiny_model(false, HeadKind::CausalLm);
    let patch = json!({"actor_rollout_ref": {"actor": {
        "use_dynamic_bsz": true, "ppo_max_token_len_per_gpu": 10,
    }}});
    let one = actor_steps(1, dir.path(), patch.clone(), 2).remove(0);
    let runs = actor_steps(4, dir.path(), patch, 2);
    let d = max_weight_diff(one.1.as_ref().unwrap(), runs[0].1.as_ref().unwrap());
    assert!(d < TOL, "weights differ from one rank by {d}");
    for name in [
        "actor/pg_loss",
        "actor/kl_loss",
        "actor/grad_norm",
        "actor/entropy",
    ] {
        for (m1, m) in one.0.iter().zip(&runs[0].0) {
            let (x, y) = (m1[name], m[name]);
            assert!((x - y).abs() <= TOL * (1.0 + x.abs()), "{name}: {x} vs {y}");
        }
    }
}

/// [`global_batch`] with GRPO groups: rows 0-3 and 4-7 each share the prompt of their first row.
fn grouped_batch(seed: u64) -> Batch {
    let mut b = global_batch(seed);
    for name in [col::PROMPTS, col::PROMPT_MASK] {
        let t = b.tensor::<i64>(name).unwrap();
        let data: Vec<i64> = (0..ROWS).flat_map(|i| t.row(i - i % 4).to_vec()).collect();
        b.insert_tensor(name, &[ROWS, PL], &data);
    }
    b
}

#[test]
fn prefix_grouper_at_world_2_equals_unshared_ranks() {
    // Each rank's micro-batches of 3 rows hold parts of a group; the shared-prompt forward and
    // its gathered-parameter backward give the unshared update (weights: also one rank's).
    let dir = tiny_model(false, HeadKind::CausalLm);
    let micro = json!({"actor_rollout_ref": {"actor": {"ppo_micro_batch_size_per_gpu": 3}}});
    let mut shared = micro.clone();
    shared["actor_rollout_ref"]["actor"]["use_prefix_grouper"] = json!(true);
    let one = actor_steps_on(1, dir.path(), micro.clone(), 2, grouped_batch).remove(0);
    let plain = actor_steps_on(2, dir.path(), micro, 2, grouped_batch);
    let runs = actor_steps_on(2, dir.path(), shared, 2, grouped_batch);
    let w = runs[0].1.as_ref().unwrap();
    for (what, want) in [("one rank", &one.1), ("two unshared ranks", &plain[0].1)] {
        let d = max_weight_diff(want.as_ref().unwrap(), w);
        assert!(d < TOL, "weights differ from {what} by {d}");
    }
    for (rank, (run, want)) in runs.iter().zip(&plain).enumerate() {
        for (step, (m1, m)) in want.0.iter().zip(&run.0).enumerate() {
            assert_metrics_close(m1, m, &format!("rank {rank} step {step}"));
        }
        let d = want
            .2
            .iter()
            .zip(&run.2)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(d < 1e-4, "rank {rank}: log-probs differ by {d}");
    }
}

type CriticRun = (Vec<Metrics>, Vec<f32>);

fn critic_steps(world: usize, model: &Path, steps: u64) -> Vec<CriticRun> {
    let job = std::sync::Arc::new(Job::new(world));
    let cfg = config(model, json!({}));
    let j = job.clone();
    job.run(move |rank| {
        let mut c: CriticClient =
            testing::critic::<FsdpPlugin>(&j.init(Role::Critic, rank, &cfg)).unwrap();
        let mut metrics = Vec::new();
        for step in 0..steps {
            let b = shard_rows(&global_batch(200 + step), rank, world);
            let m = c.update(&b, &UpdateOptions::default()).unwrap();
            metrics.push(m.into_iter().collect());
        }
        let b = shard_rows(&global_batch(300), rank, world);
        let v = c.compute_values(&b, &ValueOptions::default()).unwrap();
        (metrics, f32s(&v, col::VALUES))
    })
}

#[test]
fn critic_updates_at_world_2_and_4_equal_one_rank() {
    let dir = tiny_model(false, HeadKind::Value);
    let one = critic_steps(1, dir.path(), 3).remove(0);
    for world in [2, 4] {
        let runs = critic_steps(world, dir.path(), 3);
        for (rank, (metrics, _)) in runs.iter().enumerate() {
            for (step, (m1, m)) in one.0.iter().zip(metrics).enumerate() {
                assert_metrics_close(
                    m1,
                    m,
                    &format!("critic world {world} rank {rank} step {step}"),
                );
            }
        }
        let values: Vec<f32> = runs.iter().flat_map(|r| r.1.clone()).collect();
        let d = one
            .1
            .iter()
            .zip(&values)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(
            d < 1e-4,
            "world {world}: values after training differ by {d}"
        );
    }
}

/// Loads `from` (if any) at `world` ranks, runs update `step`, saves to `to` (if any); returns the
/// step's metrics (rank 0) and the weights after it.
fn resume_step(
    world: usize,
    model: &Path,
    from: Option<&Path>,
    step: u64,
    to: Option<&Path>,
) -> (Metrics, Weights) {
    resume_step_with(world, model, json!({}), from, step, to)
}

fn resume_step_with(
    world: usize,
    model: &Path,
    patch: Value,
    from: Option<&Path>,
    step: u64,
    to: Option<&Path>,
) -> (Metrics, Weights) {
    let job = std::sync::Arc::new(Job::new(world));
    let cfg = config(model, patch);
    let (from, to) = (from.map(Path::to_path_buf), to.map(Path::to_path_buf));
    let j = job.clone();
    let mut out = job.run(move |rank| {
        let mut a = actor_on(&j, rank, &cfg);
        if let Some(d) = &from {
            a.load(d).unwrap();
        }
        let b = shard_rows(&global_batch(100 + step), rank, world);
        let m = a.update(&b, &UpdateOptions::default()).unwrap();
        if let Some(d) = &to {
            a.save(d).unwrap();
        }
        (m.into_iter().collect::<Metrics>(), export(&mut a, rank))
    });
    let (m, w) = out.remove(0);
    (m, w.unwrap())
}

#[test]
fn sharded_checkpoints_reshard_between_world_sizes() {
    let dir = tiny_model(true, HeadKind::CausalLm);
    let model = dir.path();
    // The uninterrupted one-rank run, keeping a one-rank checkpoint after step 2.
    let c1 = tempfile::tempdir().unwrap();
    let reference = {
        let job = std::sync::Arc::new(Job::new(1));
        let cfg = config(model, json!({}));
        let c1 = c1.path().to_path_buf();
        let j = job.clone();
        job.run(move |rank| {
            let mut a = actor_on(&j, rank, &cfg);
            let mut out = Vec::new();
            for step in 0..4 {
                let b = global_batch(100 + step);
                let m: Metrics = a
                    .update(&b, &UpdateOptions::default())
                    .unwrap()
                    .into_iter()
                    .collect();
                if step == 2 {
                    a.save(&c1).unwrap();
                }
                out.push((m, export(&mut a, rank).unwrap()));
            }
            out
        })
        .remove(0)
    };
    let check = |what: &str, step: usize, got: &(Metrics, Weights)| {
        assert_metrics_close(&reference[step].0, &got.0, what);
        let d = max_weight_diff(&reference[step].1, &got.1);
        assert!(
            d < TOL,
            "{what}: weights differ from the uninterrupted run by {d}"
        );
    };
    let (c2, c4, c2b) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let s0 = resume_step(2, model, None, 0, Some(c2.path()));
    check("world 2, step 0", 0, &s0);
    let state: Value =
        serde_json::from_str(&std::fs::read_to_string(c2.path().join("state.json")).unwrap())
            .unwrap();
    assert_eq!(state["world_size"], 2);
    assert!(state["layout"].as_array().unwrap().len() >= 3, "{state}");
    for f in [
        "master.rank0-of-2.safetensors",
        "master.rank1-of-2.safetensors",
        "optim.rank1-of-2.safetensors",
        "model/config.json",
    ] {
        assert!(c2.path().join(f).exists(), "{f} missing");
    }
    let s1 = resume_step(4, model, Some(c2.path()), 1, Some(c4.path()));
    check("2 → 4, step 1", 1, &s1);
    let s2 = resume_step(2, model, Some(c4.path()), 2, Some(c2b.path()));
    check("4 → 2, step 2", 2, &s2);
    let s3 = resume_step(1, model, Some(c2b.path()), 3, None);
    check("2 → 1, step 3", 3, &s3);
    let s3b = resume_step(2, model, Some(c1.path()), 3, None);
    check("1 → 2, step 3", 3, &s3b);
}

#[test]
fn bf16_compute_with_fp32_masters_matches_one_rank_and_reshards() {
    // bf16 forward/backward with fp32 masters: the same per-micro-batch bf16 gradients are summed
    // in another order, which can move a master across a bf16 rounding boundary, hence the
    // bf16-sized tolerance (1 ulp at these magnitudes is ~1e-3).
    let dir = tiny_model(false, HeadKind::CausalLm);
    let model = dir.path();
    let patch = json!({"actor_rollout_ref": {"actor": {"fsdp_config": {"dtype": "bf16"}}}});
    let close = |what: &str, a: &(Metrics, Weights), b: &(Metrics, Weights)| {
        for (k, x) in &a.0 {
            let y = b.0[k];
            assert!(
                (x - y).abs() <= 2e-2 * (1.0 + x.abs()),
                "{what}: {k}: {x} vs {y}"
            );
        }
        let d = max_weight_diff(&a.1, &b.1);
        assert!(d < 1e-2, "{what}: bf16 weights differ by {d}");
        assert!(a.1.values().all(|t| t.kind() == Kind::BFloat16));
    };
    let (c1, c2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let one0 = resume_step_with(1, model, patch.clone(), None, 0, Some(c1.path()));
    let one1 = resume_step_with(1, model, patch.clone(), Some(c1.path()), 1, None);
    let two0 = resume_step_with(2, model, patch.clone(), None, 0, Some(c2.path()));
    close("world 2, step 0", &one0, &two0);
    assert!(c2.path().join("master.rank1-of-2.safetensors").exists());
    // 2 → 1 and 1 → 2 with fp32 masters in the checkpoint.
    let from2 = resume_step_with(1, model, patch.clone(), Some(c2.path()), 1, None);
    close("2 → 1, step 1", &one1, &from2);
    let from1 = resume_step_with(2, model, patch, Some(c1.path()), 1, None);
    close("1 → 2, step 1", &one1, &from1);
}

#[test]
fn a_failing_peer_ends_the_update_of_the_others_naming_it() {
    let dir = tiny_model(false, HeadKind::CausalLm);
    let job = std::sync::Arc::new(Job::new(3));
    let cfg = config(
        dir.path(),
        json!({"actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 6}}}),
    );
    let j = job.clone();
    let errors = job.run(move |rank| {
        let mut a = actor_on(&j, rank, &cfg);
        let mut b = shard_rows(&global_batch(1), rank, 4);
        if rank == 1 {
            // Fails inside the plugin after its first micro-batch's collectives, while the
            // others are already waiting in the next ones.
            let adv = vec![f32::NAN; 2 * RL];
            b.insert_tensor(col::ADVANTAGES, &[2, RL], &adv);
        }
        a.update(&b, &UpdateOptions::default())
            .err()
            .map(|e| e.to_string())
    });
    let own = errors[1].as_ref().expect("rank 1 fails");
    assert!(own.contains("not finite"), "{own}");
    for r in [0, 2] {
        let e = errors[r].as_ref().expect("the others fail too");
        assert!(e.contains("rank 1 failed"), "rank {r}: {e}");
        assert!(
            e.contains("not finite"),
            "rank {r} should carry rank 1's cause: {e}"
        );
    }
}

#[test]
fn reference_and_generation_give_each_rank_its_own_rows() {
    let dir = tiny_model(true, HeadKind::CausalLm);
    let cfg = config(dir.path(), json!({}));
    let run = |world: usize| {
        let job = std::sync::Arc::new(Job::new(world));
        let (j, cfg) = (job.clone(), cfg.clone());
        job.run(move |rank| {
            let b = shard_rows(&global_batch(9), rank, world);
            let mut r = testing::actor::<FsdpPlugin>(&j.init(Role::Reference, rank, &cfg)).unwrap();
            let ref_lp = f32s(
                &r.compute_log_prob(&b, &LogProbOptions::default()).unwrap(),
                col::LOG_PROBS,
            );
            let mut a = actor_on(&j, rank, &cfg);
            assert_eq!(a.data_parallel().size as usize, world);
            let rows: Vec<Vec<i64>> = (0..4).map(|i| vec![2 + i, 3 + i, 4]).collect();
            let all: Vec<&[i64]> = rows.iter().map(Vec::as_slice).collect();
            let n = 4 / world;
            let mine = &all[rank * n..(rank + 1) * n];
            let gen = a
                .generate(
                    &testing::prompts(mine, 0),
                    &verl_plugin_api::GenerateOptions {
                        n: 1,
                        max_new_tokens: 4,
                        seed: Some(11),
                        row_offset: (rank * n) as u64,
                        ..Default::default()
                    },
                )
                .unwrap();
            (ref_lp, gen.tensor::<i64>(col::RESPONSES).unwrap().data)
        })
        .into_iter()
        .fold((vec![], vec![]), |(mut a, mut b), (x, y)| {
            a.extend(x);
            b.extend(y);
            (a, b)
        })
    };
    let one = run(1);
    let two = run(2);
    let d = one
        .0
        .iter()
        .zip(&two.0)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert_eq!(one.0.len(), two.0.len());
    assert!(d < 1e-5, "reference log-probs differ by {d}");
    assert_eq!(
        one.1, two.1,
        "generation on gathered weights, by global row index"
    );
}

#[test]
fn missing_rendezvous_is_a_config_error() {
    let dir = tiny_model(false, HeadKind::CausalLm);
    let mut init = InitArgs::new(Role::Actor, config(dir.path(), json!({})));
    init.world_size = 2;
    let e = testing::actor::<FsdpPlugin>(&init).err().unwrap();
    assert!(e.to_string().contains("rendezvous"), "{e}");
}

#[test]
fn memory_per_rank_falls_with_the_world_size() {
    let dir = tiny_model(false, HeadKind::CausalLm);
    let cfg = config(dir.path(), json!({}));
    let mut totals = Vec::new();
    for world in [1usize, 2, 4] {
        let job = std::sync::Arc::new(Job::new(world));
        let (j, cfg) = (job.clone(), cfg.clone());
        let stats = job.run(move |rank| {
            let mut a = FsdpActor::create(&j.init(Role::Actor, rank, &cfg), false).unwrap();
            let b = shard_rows(&global_batch(7), rank, world);
            a.update(&b, &UpdateOptions::default()).unwrap();
            a.memory()
        });
        let total = stats[0].total();
        for s in &stats {
            assert_eq!(s.total(), total, "world {world}: ranks hold the same");
        }
        totals.push((world, total, stats[0]));
    }
    for (world, total, stats) in &totals {
        println!("world {world}: {total} bytes per rank ({stats:?})");
    }
    // One rank drops its gradients after the update (`zero_grad` sets `.grad` to None); ranks of a
    // sharded world keep their gradient shard, a flat buffer the reduce-scatter writes into.
    assert_eq!(
        totals[0].2.grads, 0,
        "world 1 keeps gradients: {:?}",
        totals[0].2
    );
    let one = (totals[0].2.params + totals[0].2.optimizer) as f64;
    let full_params = totals[0].2.peak_gathered as f64;
    for (world, _, stats) in &totals[1..] {
        assert_eq!(
            stats.grads, stats.params,
            "world {world}: a gradient per parameter: {stats:?}"
        );
        let total = stats.params + stats.optimizer;
        let ratio = total as f64 / one;
        let ideal = 1.0 / *world as f64;
        // Padding to a multiple of the world size adds at most a few elements per group.
        assert!(
            ratio <= ideal * 1.02 && ratio >= ideal * 0.98,
            "world {world}: {total} bytes per rank vs {one} on one rank ({ratio:.4}, ideal {ideal}): {stats:?}"
        );
        // During the update at most one unit (a decoder layer here, ~40% of the model) was
        // gathered at a time.
        let peak = stats.peak_gathered as f64 / full_params;
        assert!(
            peak > 0.0 && peak < 0.6,
            "world {world}: peak gathered {peak:.3} of the model"
        );
    }
}

/// LoRA on several ranks: the adapters are sharded (the frozen base stays whole on every rank),
/// and two and four ranks train them as one does.
#[test]
fn lora_updates_at_world_2_and_4_equal_one_rank() {
    let lora = json!({"actor_rollout_ref": {"model": {"lora_rank": 4, "lora_alpha": 8}}});
    check_actor_parity(false, lora.clone());
    // The parity is of a model that moved: the merged export differs from the base.
    let dir = tiny_model(false, HeadKind::CausalLm);
    let two = actor_steps(2, dir.path(), lora, 3);
    let base = read_weights(dir.path());
    let moved = max_weight_diff(&base, two[0].1.as_ref().unwrap());
    assert!(moved > 1e-4, "the adapters did not train ({moved})");
}
