//! Megatron-core's general expert grid (expert_tensor_parallel_size ≠ tensor_model_parallel_size)
//! and the sequence-parallel MoE dispatch (each tensor-parallel rank routing only its own
//! sequence shard), ranks as threads of this process with the CPU communicator: the tiny Mixtral
//! (4 experts, top-2, 2 sparse layers, fp32) against the one-rank Megatron actor over three
//! updates (every metric, the per-expert load, imbalance and router loss included, the updated
//! weights and the log-probs within 1e-5), at TP = 2 × EP = 2 with ETP = 1 on 2 ranks (with SP,
//! and without it: each tensor-parallel rank routes its half of the tokens), the same with DP = 2
//! (world 4, distributed optimizer sharding the experts over the expert-data-parallel group) and
//! with PP = 2, ETP = TP = 2 × EP = 2 with SP (world 4), TP = 1 with ETP = 2 (the
//! expert-tensor-parallel group made of data-parallel ranks); a checkpoint written at TP = 2 /
//! ETP = 1 / EP = 2 loading on one rank (and on ETP = TP = 2 × EP = 2) with the same log-probs;
//! and the layout checks.

mod support;

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use serde_json::{json, Value};
use verl_megatron::moe::Tokens;
use verl_megatron::MegatronPlugin;
use verl_plugin_api::client::ActorClient;
use verl_plugin_api::{col, testing, InitArgs, LogProbOptions, Role, UpdateOptions};

use support::*;

/// A layout under test: tensor, expert, expert-tensor (None: = TP), world, sequence_parallel,
/// distributed optimizer. Data parallelism takes the rest.
#[derive(Debug, Clone, Copy)]
struct Shape {
    tp: u64,
    pp: u64,
    ep: u64,
    etp: Option<u64>,
    world: usize,
    sp: bool,
    distributed: bool,
}

const ONE: Shape = Shape {
    tp: 1,
    pp: 1,
    ep: 1,
    etp: None,
    world: 1,
    sp: false,
    distributed: true,
};

fn shape(tp: u64, ep: u64, etp: Option<u64>, world: usize, sp: bool) -> Shape {
    Shape {
        tp,
        pp: 1,
        ep,
        etp,
        world,
        sp,
        distributed: true,
    }
}

impl Shape {
    fn dp(&self) -> usize {
        self.world / (self.tp * self.pp) as usize
    }
}

/// The job config: AdamW eps 1e-3 as in moe.rs (near-zero expert gradients otherwise turn fp32
/// reassociation noise into visible weight differences).
fn job_config(model: &Path, s: Shape) -> Value {
    let mut mg = json!({"expert_model_parallel_size": s.ep, "sequence_parallel": s.sp});
    if let Some(etp) = s.etp {
        mg["expert_tensor_parallel_size"] = json!(etp);
    }
    config_pp(
        model,
        s.tp,
        s.pp,
        s.distributed,
        json!({"actor_rollout_ref": {"actor": {"optim": {"eps": 1e-3}, "megatron": mg}}}),
    )
}

/// `(per-step metrics, weights after the last step (rank 0), log-probs before the first update,
/// log-probs after the last one, data-parallel rank, the last MoE call's (token mode, rows
/// routed, input rows) and the residual positions held in the last forward)` of one rank.
type ActorRun = (
    Vec<Metrics>,
    Option<Weights>,
    Vec<f32>,
    Vec<f32>,
    usize,
    Option<(Tokens, i64, i64)>,
    Option<(i64, i64)>,
);

fn actor_steps(s: Shape, model: &Path) -> Vec<ActorRun> {
    let (world, dp) = (s.world, s.dp());
    let job = Arc::new(Job::new(world));
    let cfg = job_config(model, s);
    let j = job.clone();
    job.run(move |rank| {
        let init = j.init(Role::Actor, rank, &cfg);
        let mut a = testing::actor::<MegatronPlugin>(&init).unwrap();
        let dp_rank = a.data_parallel().rank as usize;
        assert_eq!(a.data_parallel().size as usize, dp);
        let (metrics, lp0, lp) = three_updates(&mut a, dp_rank, dp);
        let routed = verl_megatron::moe::last_routed();
        let held = verl_megatron::tp::last_residual_positions();
        (
            metrics,
            export(&mut a, rank),
            lp0,
            lp,
            dp_rank,
            routed,
            held,
        )
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

/// The largest difference between the one-rank log-probs and every rank's (its data-parallel
/// slice), at real response positions.
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

/// Runs every layout of `shapes` and compares it with the one-rank run: every metric of every
/// rank (the MoE load counts each token once: Σ_e load = top-k × real tokens × epochs), rank 0's
/// updated weights and every rank's log-probs.
fn against_one_rank(shapes: &[Shape]) {
    let dir = tiny_mixtral();
    let t = Instant::now();
    let one = actor_steps(ONE, dir.path()).remove(0);
    for (step, m) in one.0.iter().enumerate() {
        let load: f64 = (0..4).map(|e| m[&format!("moe/expert_load/{e}")]).sum();
        assert_eq!(
            load,
            2.0 * real_tokens(100 + step as u64) * 2.0,
            "step {step}"
        );
        assert!(m["moe/aux_loss"] > 0.0, "{m:?}");
    }
    let mut report = vec![format!("one rank: {:.1} s", t.elapsed().as_secs_f64())];
    for &s in shapes {
        let t = Instant::now();
        let runs = actor_steps(s, dir.path());
        let what = format!("{s:?}");
        for (rank, run) in runs.iter().enumerate() {
            // Which tokens the last MoE call routed: with SP this rank's sequence shard, whole
            // (no all-gather before the block); without SP and ETP ≠ TP half the replicated rows.
            let (mode, routed, input) = run.5.unwrap();
            let (held, len) = run.6.unwrap();
            match (s.tp > 1, s.sp) {
                (true, true) => {
                    assert_eq!(mode, Tokens::Local, "{what}");
                    assert_eq!(routed, input, "{what}");
                    assert!(held < len && input % held == 0, "{what}: {held} of {len}");
                }
                (true, false) => {
                    assert_eq!(mode, Tokens::Slice, "{what}");
                    assert_eq!(routed, (input + 1) / 2, "{what}");
                    assert_eq!(input % len, 0, "{what}: whole sequences");
                }
                (false, _) => assert_eq!((mode, routed), (Tokens::Local, input), "{what}"),
            }
            for (step, (m1, m)) in one.0.iter().zip(&run.0).enumerate() {
                assert_metrics_close(m1, m, &format!("{what} rank {rank} step {step}"));
            }
        }
        let d = max_weight_diff(one.1.as_ref().unwrap(), runs[0].1.as_ref().unwrap());
        assert!(d < TOL, "{what}: weights differ from one rank by {d}");
        let before: Vec<(usize, &Vec<f32>)> = runs.iter().map(|r| (r.4, &r.2)).collect();
        let d0 = slice_diff(&one.2, &response_mask(100), s.dp(), &before);
        assert!(d0 < TOL as f32, "{what}: log-probs before differ by {d0}");
        let after: Vec<(usize, &Vec<f32>)> = runs.iter().map(|r| (r.4, &r.3)).collect();
        let d1 = slice_diff(&one.3, &response_mask(102), s.dp(), &after);
        assert!(d1 < TOL as f32, "{what}: log-probs after differ by {d1}");
        report.push(format!(
            "{what}: weights {d:e}, log-probs {d0:e} / {d1:e}, {:.1} s",
            t.elapsed().as_secs_f64()
        ));
    }
    eprintln!("max |diff| against one rank: {report:#?}");
}

#[test]
fn tp2_etp1_ep2_with_sp_on_two_ranks_equals_one_rank() {
    against_one_rank(&[shape(2, 2, Some(1), 2, true)]);
}

#[test]
fn tp2_etp1_ep2_dp2_with_sp_and_distributed_optimizer_equals_one_rank() {
    against_one_rank(&[shape(2, 2, Some(1), 4, true)]);
}

#[test]
fn etp_equal_tp2_ep2_with_sp_local_routing_equals_one_rank() {
    against_one_rank(&[shape(2, 2, Some(2), 4, true)]);
}

#[test]
fn tp2_etp1_ep2_with_sp_over_two_pipeline_stages_equals_one_rank() {
    // One sparse layer per stage; the stages exchange sequence shards that the MoE blocks route.
    let mut s = shape(2, 2, Some(1), 4, true);
    s.pp = 2;
    against_one_rank(&[s]);
}

#[test]
fn tp2_etp1_without_sp_routes_token_slices_and_equals_one_rank() {
    // No sequence parallelism: each tensor-parallel rank routes its half of the (replicated)
    // tokens and the outputs are all-gathered; also without expert parallelism (every rank holds
    // every expert, their gradients reduced over the tensor-parallel pair) and with the
    // expert-tensor-parallel group made of data-parallel ranks (TP = 1, ETP = 2).
    against_one_rank(&[
        shape(2, 2, Some(1), 2, false),
        shape(2, 1, Some(1), 2, true),
        shape(1, 1, Some(2), 2, false),
    ]);
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
fn checkpoints_move_between_tp2_etp1_ep2_and_one_rank() {
    let dir = tiny_mixtral();
    let m = dir.path().to_path_buf();
    let batch = global_batch(9);
    let ckpt = tempfile::tempdir().unwrap();
    // TP = 2 × EP = 2 with ETP = 1 and SP on 2 ranks: one update, save, score, a second update.
    let s = shape(2, 2, Some(1), 2, true);
    let job = Arc::new(Job::new(2));
    let (j, cfg) = (job.clone(), job_config(&m, s));
    let (b, c) = (batch.clone(), ckpt.path().to_path_buf());
    let at_grid = job.run(move |rank| {
        let mut a = actor_at(&j, rank, &cfg);
        a.update(&global_batch(100), &upd(1)).unwrap();
        a.save(&c).unwrap();
        let lp = f32s(
            &a.compute_log_prob(&b, &LogProbOptions::default()).unwrap(),
            col::LOG_PROBS,
        );
        a.update(&global_batch(101), &upd(2)).unwrap();
        (lp, export(&mut a, rank))
    });
    let state: Value =
        serde_json::from_str(&std::fs::read_to_string(ckpt.path().join("state.json")).unwrap())
            .unwrap();
    assert_eq!(state["layout"]["expert_tensor_parallel_size"], 1);
    assert_eq!(state["layout"]["expert_model_parallel_size"], 2);
    let masters: Weights = tch::Tensor::read_safetensors(ckpt.path().join("master.safetensors"))
        .unwrap()
        .into_iter()
        .collect();
    for l in 0..2 {
        for e in 0..4 {
            let n = format!("model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight");
            assert_eq!(masters[&n].size(), vec![40, 16], "{n}");
        }
    }
    // One rank loads it: the same log-probs, and the next update (every expert's AdamW moments
    // restored) lands on the uninterrupted run's weights.
    let one = job_config(&m, ONE);
    let mut a = actor_at(&Job::new(1), 0, &one);
    a.load(ckpt.path()).unwrap();
    let lp1 = f32s(
        &a.compute_log_prob(&batch, &LogProbOptions::default())
            .unwrap(),
        col::LOG_PROBS,
    );
    for (lp, _) in &at_grid {
        let d = max_abs_diff(lp, &lp1);
        assert!(
            d < TOL as f32,
            "TP2/ETP1/EP2 → 1 rank: log-probs differ by {d}"
        );
    }
    let ckpt1 = tempfile::tempdir().unwrap();
    a.save(ckpt1.path()).unwrap();
    a.update(&global_batch(101), &upd(2)).unwrap();
    let w1 = export(&mut a, 0).unwrap();
    let d = max_weight_diff(at_grid[0].1.as_ref().unwrap(), &w1);
    assert!(
        d < TOL,
        "TP2/ETP1/EP2 → 1 rank: resumed weights differ by {d}"
    );
    // 1 rank → ETP = TP = 2 × EP = 2 on 4 ranks (another expert layout): the same log-probs.
    let s = shape(2, 2, Some(2), 4, true);
    let job = Arc::new(Job::new(4));
    let (j, cfg) = (job.clone(), job_config(&m, s));
    let (b, c) = (batch.clone(), ckpt1.path().to_path_buf());
    let back = job.run(move |rank| {
        let mut a = actor_at(&j, rank, &cfg);
        a.load(&c).unwrap();
        // Data-parallel rank r scores rows of its half of the batch; the 1-rank reference is
        // sliced the same way below.
        let dp_rank = a.data_parallel().rank as usize;
        let lp = f32s(
            &a.compute_log_prob(&shard_rows(&b, dp_rank, 2), &LogProbOptions::default())
                .unwrap(),
            col::LOG_PROBS,
        );
        (dp_rank, lp)
    });
    let half = lp1.len() / 2;
    for (dp_rank, lp) in back {
        let d = max_abs_diff(&lp1[dp_rank * half..(dp_rank + 1) * half], &lp);
        assert!(
            d < TOL as f32,
            "1 rank → TP2/ETP2/EP2: log-probs differ by {d}"
        );
    }
}

#[test]
fn expert_layout_errors_name_the_key_and_the_valid_sizes() {
    let dir = tiny_mixtral();
    let create = |s: Shape| {
        let mut init = InitArgs::new(Role::Actor, job_config(dir.path(), s));
        init.world_size = s.world as u32;
        testing::actor::<MegatronPlugin>(&init)
            .err()
            .unwrap()
            .to_string()
    };
    // ETP × EP = 4 does not divide the 2 tensor × data-parallel ranks.
    let e = create(shape(2, 2, Some(2), 2, true));
    assert!(
        e.contains("actor_rollout_ref.actor.megatron.expert_model_parallel_size")
            && e.contains("world size 2 is not a multiple of expert_tensor_parallel_size=2 × expert_model_parallel_size=2")
            && e.contains("valid: 1 "),
        "{e}"
    );
    // 40 expert columns do not split over 3 ranks.
    let e = create(shape(1, 1, Some(3), 3, false));
    assert!(
        e.contains("actor_rollout_ref.actor.megatron.expert_tensor_parallel_size")
            && e.contains(
                "expert_tensor_parallel_size=3 does not divide the expert intermediate size"
            )
            && e.contains("40"),
        "{e}"
    );
}
