//! Expert parallelism in the Megatron actor, ranks as threads of this process with the CPU
//! communicator: a tiny Mixtral (4 experts, top-2, 2 sparse layers, fp32) at EP = 2 (world 2), EP
//! = 2 × TP = 2 (world 4, expert TP = TP, sequence-parallel dispatch), EP = 2 × expert-DP = 2 (world 4, the distributed
//! optimizer sharding the experts over the expert-data-parallel group) and EP = 2 × PP = 2 (world
//! 4, one sparse layer per stage) against the one-rank
//! Megatron actor: metrics (the per-expert load, imbalance and router loss included), updated
//! weights and log-probs over three steps within 1e-5; the one-rank MoE model itself against the
//! FSDP backend (verl-nn's MoE block) without the router loss; checkpoints moving between EP = 2
//! and EP = 1; layout errors.

mod support;

use std::path::Path;
use std::sync::Arc;

use serde_json::{json, Value};
use verl_fsdp_engine::FsdpPlugin;
use verl_megatron::MegatronPlugin;
use verl_plugin_api::client::{ActorClient, CriticClient};
use verl_plugin_api::{col, testing, InitArgs, LogProbOptions, Role, UpdateOptions, ValueOptions};

use support::*;

/// A layout under test: (tensor, pipeline, expert, world); data parallelism takes the rest.
type Shape = (u64, u64, u64, usize);

fn dp_of((tp, pp, _, world): Shape) -> usize {
    world / (tp * pp) as usize
}

fn job_config(model: &Path, (tp, pp, ep, _): Shape, distributed: bool, patch: Value) -> Value {
    let mut c = config_pp(
        model,
        tp,
        pp,
        distributed,
        json!({"actor_rollout_ref": {"actor": {"megatron": {"expert_model_parallel_size": ep}}}}),
    );
    merge(&mut c, &patch);
    c
}

/// `(per-step metrics, weights after the last step (rank 0), log-probs before the first update,
/// log-probs after the last one, data-parallel rank)` of one rank.
type ActorRun = (Vec<Metrics>, Option<Weights>, Vec<f32>, Vec<f32>, usize);

/// Three updates; `fsdp` runs the one-rank FSDP backend instead of Megatron.
fn actor_steps(
    shape: Shape,
    model: &Path,
    distributed: bool,
    patch: Value,
    fsdp: bool,
) -> Vec<ActorRun> {
    let (world, dp) = (shape.3, dp_of(shape));
    let job = Arc::new(Job::new(world));
    let cfg = job_config(model, shape, distributed, patch);
    let j = job.clone();
    job.run(move |rank| {
        let init = j.init(Role::Actor, rank, &cfg);
        let mut a = match fsdp {
            true => testing::actor::<FsdpPlugin>(&init).unwrap(),
            false => testing::actor::<MegatronPlugin>(&init).unwrap(),
        };
        let dp_rank = a.data_parallel().rank as usize;
        assert_eq!(a.data_parallel().size as usize, dp);
        let (metrics, lp0, lp) = three_updates(&mut a, dp_rank, dp);
        (metrics, export(&mut a, rank), lp0, lp, dp_rank)
    })
}

/// The response mask of `global_batch(seed)`, row-major.
fn response_mask(seed: u64) -> Vec<bool> {
    global_batch(seed)
        .tensor::<i64>(col::RESPONSE_MASK)
        .unwrap()
        .data
        .iter()
        .map(|&m| m != 0)
        .collect()
}

/// The largest difference between the one-rank per-token outputs (log-probs, values) and every
/// rank's (its data-parallel slice), at real response positions.
fn slice_diff(one: &[f32], mask: &[bool], dp: usize, runs: &[(usize, &Vec<f32>)]) -> f32 {
    let per = one.len() / dp;
    let mut worst = 0.0f32;
    for (dp_rank, got) in runs {
        let range = dp_rank * per..(dp_rank + 1) * per;
        for ((a, b), keep) in one[range.clone()].iter().zip(got.iter()).zip(&mask[range]) {
            if *keep {
                worst = worst.max((a - b).abs());
            }
        }
    }
    worst
}

/// Real tokens (prompt and response) of `global_batch(seed)`.
fn real_tokens(seed: u64) -> f64 {
    let b = global_batch(seed);
    let count = |c: &str| b.tensor::<i64>(c).unwrap().data.iter().sum::<i64>();
    (count(col::PROMPT_MASK) + count(col::RESPONSE_MASK)) as f64
}

#[test]
fn ep2_alone_with_tp2_with_expert_dp2_and_with_pp2_actor_updates_equal_one_rank() {
    let dir = tiny_mixtral();
    // AdamW's default eps (1e-8) turns fp32 reassociation noise in near-zero gradients (expert
    // weights that few tokens reach; at EP > 1 an expert sums its gradient over the rows of every
    // rank at once) into weight differences of about lr · noise / eps: ~2e-5 after three steps
    // here, whatever the learning rate. eps = 1e-3 keeps small gradients' updates proportional
    // to them, so the comparison checks the gradients (every layout then agrees within 1e-6);
    // the checkpoint test below runs with the default eps.
    let patch = json!({"actor_rollout_ref": {"actor": {"optim": {"eps": 1e-3}}}});
    let one = actor_steps((1, 1, 1, 1), dir.path(), true, patch.clone(), false).remove(0);
    // The one-rank metrics are real: every routed (token, slot) pair of both epochs is counted
    // (Σ_e load = top-k 2 × real tokens × 2 epochs, per layer), and the router loss is on.
    for (step, m) in one.0.iter().enumerate() {
        let loads: Vec<f64> = (0..4).map(|e| m[&format!("moe/expert_load/{e}")]).collect();
        let want = 2.0 * real_tokens(100 + step as u64) * 2.0;
        assert_eq!(loads.iter().sum::<f64>(), want, "step {step}: {loads:?}");
        let mean = want / 4.0;
        let worst = loads.iter().cloned().fold(0.0, f64::max) / mean;
        assert!(m["moe/load_imbalance_max"] >= m["moe/load_imbalance"] - 1e-12);
        assert!(
            m["moe/load_imbalance"] >= 1.0 && m["moe/load_imbalance_max"] >= worst - 1e-9,
            "{m:?}"
        );
        assert!(m["moe/aux_loss"] > 0.0, "{m:?}");
    }
    let mut report = Vec::new();
    for shape in [(1, 1, 2, 2), (2, 1, 2, 4), (1, 1, 2, 4), (1, 2, 2, 4)] {
        let runs = actor_steps(shape, dir.path(), true, patch.clone(), false);
        let what = format!("tp × pp × ep × world {shape:?}");
        for (rank, run) in runs.iter().enumerate() {
            for (step, (m1, m)) in one.0.iter().zip(&run.0).enumerate() {
                assert_metrics_close(m1, m, &format!("{what} rank {rank} step {step}"));
            }
        }
        let (a, b) = (one.1.as_ref().unwrap(), runs[0].1.as_ref().unwrap());
        let d = max_weight_diff(a, b);
        let worst = a
            .iter()
            .map(|(k, t)| {
                let d = (t.to_kind(tch::Kind::Double) - b[k].to_kind(tch::Kind::Double))
                    .abs()
                    .max()
                    .double_value(&[]);
                (d, k.clone())
            })
            .fold((0.0, String::new()), |x, y| if y.0 > x.0 { y } else { x });
        assert!(
            d < TOL,
            "{what}: weights differ from one rank by {d} ({worst:?})"
        );
        let dp = dp_of(shape);
        let before: Vec<(usize, &Vec<f32>)> = runs.iter().map(|r| (r.4, &r.2)).collect();
        let d0 = slice_diff(&one.2, &response_mask(100), dp, &before);
        assert!(d0 < TOL as f32, "{what}: log-probs before differ by {d0}");
        let after: Vec<(usize, &Vec<f32>)> = runs.iter().map(|r| (r.4, &r.3)).collect();
        let d1 = slice_diff(&one.3, &response_mask(102), dp, &after);
        assert!(d1 < TOL as f32, "{what}: log-probs after differ by {d1}");
        report.push(format!("{what}: weights {d:e}, log-probs {d0:e} / {d1:e}"));
    }
    eprintln!("max |diff| against one rank: {report:#?}");
}

#[test]
fn one_rank_moe_model_equals_the_fsdp_backend_without_router_loss() {
    let dir = tiny_mixtral();
    let no_aux = json!({"actor_rollout_ref": {"actor": {"megatron": {
        "override_transformer_config": {"moe_aux_loss_coeff": 0.0}}}}});
    let fsdp = actor_steps((1, 1, 1, 1), dir.path(), true, no_aux.clone(), true).remove(0);
    let mega = actor_steps((1, 1, 1, 1), dir.path(), true, no_aux, false).remove(0);
    let d = max_abs_diff(&fsdp.2, &mega.2);
    assert!(d < TOL as f32, "log-probs before the updates differ by {d}");
    let d = max_weight_diff(fsdp.1.as_ref().unwrap(), mega.1.as_ref().unwrap());
    assert!(d < TOL, "weights after three updates differ by {d}");
    for (step, (f, m)) in fsdp.0.iter().zip(&mega.0).enumerate() {
        for k in ["actor/pg_loss", "actor/grad_norm", "actor/entropy"] {
            assert!(
                (f[k] - m[k]).abs() < TOL * (1.0 + f[k].abs()),
                "step {step} {k}: fsdp {} megatron {}",
                f[k],
                m[k]
            );
        }
        assert!(
            !m.contains_key("moe/aux_loss"),
            "coefficient 0: no router loss"
        );
        assert!(m.contains_key("moe/expert_load/0"));
    }
}

/// `(per-step metrics, values after the updates, data-parallel rank)` of one critic rank.
type CriticRun = (Vec<Metrics>, Vec<f32>, usize);

fn critic_steps(shape: Shape, model: &Path) -> Vec<CriticRun> {
    let (world, dp) = (shape.3, dp_of(shape));
    let job = Arc::new(Job::new(world));
    let mut cfg = job_config(
        model,
        shape,
        true,
        json!({"critic": {"optim": {"eps": 1e-3}}}),
    );
    let ep = json!({"critic": {"megatron": {"expert_model_parallel_size": shape.2}}});
    merge(&mut cfg, &ep);
    let j = job.clone();
    job.run(move |rank| {
        let mut c: CriticClient =
            testing::critic::<MegatronPlugin>(&j.init(Role::Critic, rank, &cfg)).unwrap();
        let dp_rank = c.data_parallel().rank as usize;
        let mut metrics = Vec::new();
        for step in 0..3 {
            let b = shard_rows(&global_batch(200 + step), dp_rank, dp);
            let m = c.update(&b, &UpdateOptions::default()).unwrap();
            metrics.push(m.into_iter().collect());
        }
        let b = shard_rows(&global_batch(300), dp_rank, dp);
        let v = c.compute_values(&b, &ValueOptions::default()).unwrap();
        (metrics, f32s(&v, col::VALUES), dp_rank)
    })
}

#[test]
fn ep2_critic_updates_equal_one_rank() {
    let dir = tiny_mixtral();
    let one = critic_steps((1, 1, 1, 1), dir.path()).remove(0);
    assert!(
        one.0[0].contains_key("critic/moe/expert_load/3"),
        "{:?}",
        one.0[0]
    );
    assert!(one.0[0]["critic/moe/aux_loss"] > 0.0);
    for shape in [(1, 1, 2, 2), (2, 1, 2, 4)] {
        let runs = critic_steps(shape, dir.path());
        let what = format!("critic tp × pp × ep × world {shape:?}");
        for (rank, run) in runs.iter().enumerate() {
            for (step, (m1, m)) in one.0.iter().zip(&run.0).enumerate() {
                assert_metrics_close(m1, m, &format!("{what} rank {rank} step {step}"));
            }
        }
        let got: Vec<(usize, &Vec<f32>)> = runs.iter().map(|r| (r.2, &r.1)).collect();
        let d = slice_diff(&one.1, &response_mask(300), dp_of(shape), &got);
        assert!(d < TOL as f32, "{what}: values differ by {d}");
    }
}

fn actor_at(job: &Job, rank: usize, cfg: &Value) -> ActorClient {
    testing::actor::<MegatronPlugin>(&job.init(Role::Actor, rank, cfg)).unwrap()
}

fn upd(step: u64) -> UpdateOptions {
    UpdateOptions {
        global_step: step,
        ..UpdateOptions::default()
    }
}

#[test]
fn checkpoints_move_between_ep2_and_ep1() {
    let dir = tiny_mixtral();
    let m = dir.path().to_path_buf();
    let batch = global_batch(9);
    let ckpt2 = tempfile::tempdir().unwrap();
    // EP = 2: one update, save, score, then a second update (the uninterrupted run).
    let job = Arc::new(Job::new(2));
    let (j, cfg) = (job.clone(), job_config(&m, (1, 1, 2, 2), true, json!({})));
    let (b, c) = (batch.clone(), ckpt2.path().to_path_buf());
    let at_ep2 = job.run(move |rank| {
        let mut a = actor_at(&j, rank, &cfg);
        a.update(&shard_rows(&global_batch(100), rank, 2), &upd(1))
            .unwrap();
        a.save(&c).unwrap();
        let lp = f32s(
            &a.compute_log_prob(&b, &LogProbOptions::default()).unwrap(),
            col::LOG_PROBS,
        );
        a.update(&shard_rows(&global_batch(101), rank, 2), &upd(2))
            .unwrap();
        (lp, export(&mut a, rank))
    });
    let state: Value =
        serde_json::from_str(&std::fs::read_to_string(ckpt2.path().join("state.json")).unwrap())
            .unwrap();
    assert_eq!(state["layout"]["expert_model_parallel_size"], 2);
    // Every expert is in the checkpoint under its HF name, whichever rank held it.
    let masters: Weights = tch::Tensor::read_safetensors(ckpt2.path().join("master.safetensors"))
        .unwrap()
        .into_iter()
        .collect();
    for l in 0..2 {
        for e in 0..4 {
            let n = format!("model.layers.{l}.block_sparse_moe.experts.{e}.w2.weight");
            assert_eq!(masters[&n].size(), vec![16, 40], "{n}");
        }
    }
    // EP = 1 loads it: the same log-probs, and the next update (AdamW moments of every expert
    // restored) lands on the uninterrupted EP = 2 run's weights.
    let cfg1 = job_config(&m, (1, 1, 1, 1), true, json!({}));
    let mut a = actor_at(&Job::new(1), 0, &cfg1);
    a.load(ckpt2.path()).unwrap();
    let lp1 = f32s(
        &a.compute_log_prob(&batch, &LogProbOptions::default())
            .unwrap(),
        col::LOG_PROBS,
    );
    for (lp, _) in &at_ep2 {
        let d = max_abs_diff(lp, &lp1);
        assert!(d < TOL as f32, "EP=2 → EP=1: log-probs differ by {d}");
    }
    let ckpt1 = tempfile::tempdir().unwrap();
    a.save(ckpt1.path()).unwrap();
    a.update(&global_batch(101), &upd(2)).unwrap();
    let w1 = export(&mut a, 0).unwrap();
    let d = max_weight_diff(at_ep2[0].1.as_ref().unwrap(), &w1);
    assert!(d < TOL, "EP=2 → EP=1: resumed weights differ by {d}");
    // EP = 1 → EP = 2: the same log-probs on both expert-parallel ranks.
    let job = Arc::new(Job::new(2));
    let (j, cfg) = (job.clone(), job_config(&m, (1, 1, 2, 2), false, json!({})));
    let (b, c) = (batch.clone(), ckpt1.path().to_path_buf());
    let back = job.run(move |rank| {
        let mut a = actor_at(&j, rank, &cfg);
        a.load(&c).unwrap();
        f32s(
            &a.compute_log_prob(&b, &LogProbOptions::default()).unwrap(),
            col::LOG_PROBS,
        )
    });
    for lp in back {
        let d = max_abs_diff(&lp1, &lp);
        assert!(d < TOL as f32, "EP=1 → EP=2: log-probs differ by {d}");
    }
}

#[test]
fn bad_expert_layouts_name_the_key_and_the_valid_sizes() {
    let dir = tiny_mixtral();
    let create = |shape: Shape, patch: Value| {
        let mut init = InitArgs::new(Role::Actor, job_config(dir.path(), shape, true, patch));
        init.world_size = shape.3 as u32;
        testing::actor::<MegatronPlugin>(&init)
            .err()
            .unwrap()
            .to_string()
    };
    let e = create((1, 1, 3, 3), json!({}));
    assert!(
        e.contains("actor_rollout_ref.actor.megatron.expert_model_parallel_size")
            && e.contains("expert_model_parallel_size=3 does not divide num_experts=4 (4 experts / 3 ranks = 1.33 experts per rank); valid with data-parallel size 3: 1"),
        "{e}"
    );
    let e = create(
        (2, 1, 2, 4),
        json!({"actor_rollout_ref": {"actor": {"megatron": {"expert_tensor_parallel_size": 3}}}}),
    );
    assert!(
        e.contains("actor_rollout_ref.actor.megatron.expert_tensor_parallel_size")
            && e.contains("expert_tensor_parallel_size=3 does not divide the expert intermediate size")
            && e.contains("valid with expert_model_parallel_size=2 and 4 tensor × data-parallel ranks per stage: 1, 2"),
        "{e}"
    );
    let e = create(
        (1, 1, 2, 2),
        json!({"actor_rollout_ref": {"actor": {"megatron": {
            "override_transformer_config": {"moe_aux_loss_coeff": -1.0}}}}}),
    );
    assert!(
        e.contains("override_transformer_config.moe_aux_loss_coeff") && e.contains("non-negative"),
        "{e}"
    );
}
