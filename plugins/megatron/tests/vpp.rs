//! Virtual pipeline parallelism (Megatron's interleaved 1F1B schedule) run as threads of this
//! process with the CPU communicator, against the one-rank FSDP backend in fp32: PP=2 × VPP=2
//! (alone, with TP=2, with TP=2 and sequence parallelism, and with DP=2) and PP=4 × VPP=2 actor
//! updates (metrics, exported weights, log-probs before and after three updates within 1e-5),
//! micro-batch counts that are not a multiple of the stage count, the critic, and checkpoints
//! moving between PP=2 × VPP=2 and PP=1.

mod support;

use std::path::Path;
use std::sync::Arc;

use serde_json::json;
use verl_fsdp_engine::FsdpPlugin;
use verl_megatron::MegatronPlugin;
use verl_nn::HeadKind;
use verl_plugin_api::client::{ActorClient, CriticClient};
use verl_plugin_api::{col, testing, LogProbOptions, Role, UpdateOptions, ValueOptions};

use support::*;

/// (tensor, pipeline, virtual pipeline, world); data parallelism takes the rest.
type Shape = (u64, u64, u64, usize);

fn dp_of((tp, pp, _, world): Shape) -> usize {
    world / (tp * pp) as usize
}

/// The tiny model's config with pp.rs's learning rate 5e-3 and sp.rs's AdamW eps 1e-3 (with the
/// default 1e-8 a parameter whose gradient is near zero moves by about the learning rate in the
/// direction of its rounding noise, so a different summation order shows as ~1e-4), `vpp` model
/// chunks per stage, `micro` rows per micro-batch and sequence parallelism on or off.
fn job_config(model: &Path, (tp, pp, vpp, _): Shape, micro: usize, sp: bool) -> serde_json::Value {
    let vpp = if vpp > 1 { json!(vpp) } else { json!(null) };
    let part = json!({
        "optim": {"lr": 5e-3, "eps": 1e-3},
        "ppo_micro_batch_size_per_gpu": micro,
        "megatron": {"virtual_pipeline_model_parallel_size": vpp, "sequence_parallel": sp},
    });
    let mut critic = part.clone();
    critic["optim"]["weight_decay"] = json!(0.0);
    config_pp(
        model,
        tp,
        pp,
        true,
        json!({"actor_rollout_ref": {"actor": part}, "critic": critic}),
    )
}

/// `(per-step metrics, weights after the last step (rank 0), log-probs before the first update,
/// log-probs after the last one, data-parallel rank)` of one rank.
type ActorRun = (Vec<Metrics>, Option<Weights>, Vec<f32>, Vec<f32>, usize);

fn actor_steps(megatron: Option<Shape>, model: &Path, micro: usize, sp: bool) -> Vec<ActorRun> {
    let shape = megatron.unwrap_or((1, 1, 1, 1));
    let dp = dp_of(shape);
    let job = Arc::new(Job::new(shape.3));
    let cfg = job_config(model, shape, micro, sp);
    let j = job.clone();
    job.run(move |rank| {
        let init = j.init(Role::Actor, rank, &cfg);
        let mut a = match megatron {
            None => testing::actor::<FsdpPlugin>(&init).unwrap(),
            Some(_) => testing::actor::<MegatronPlugin>(&init).unwrap(),
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

/// The largest difference of `got` (a rank's outputs for its data-parallel slice) from the
/// one-rank outputs, at the positions `mask` keeps.
fn slice_diff(one: &[f32], mask: &[bool], dp: usize, dp_rank: usize, got: &[f32]) -> f32 {
    let per = one.len() / dp;
    let range = dp_rank * per..(dp_rank + 1) * per;
    let m = &mask[range.clone()];
    let keep = |v: &[f32]| -> Vec<f32> {
        v.iter()
            .zip(m)
            .filter(|(_, &k)| k)
            .map(|(x, _)| *x)
            .collect()
    };
    // Relative to the log-prob's size, as `assert_metrics_close` compares metrics: three updates
    // amplify fp32 reduction-order noise to ~1e-5 absolute on log-probs of magnitude ~4.
    let (a, b) = (keep(&one[range]), keep(got));
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs() / (1.0 + x.abs()))
        .fold(0.0, f32::max)
}

/// Every shape against one rank: metrics of every rank and step, rank 0's exported weights, every
/// rank's log-probs before and after. Prints the largest differences.
fn check_actor_parity(tied: bool, layers: i64, micro: usize, sp: bool, shapes: &[Shape]) {
    let dir = tiny_model_with_layers(tied, HeadKind::CausalLm, layers);
    let one = actor_steps(None, dir.path(), micro, false).remove(0);
    for &shape in shapes {
        let runs = actor_steps(Some(shape), dir.path(), micro, sp);
        let what = format!("tied {tied}, micro {micro}, sp {sp}, tp × pp × vpp × world {shape:?}");
        for (rank, run) in runs.iter().enumerate() {
            for (step, (m1, m)) in one.0.iter().zip(&run.0).enumerate() {
                assert_metrics_close(m1, m, &format!("{what} rank {rank} step {step}"));
            }
        }
        let dw = max_weight_diff(one.1.as_ref().unwrap(), runs[0].1.as_ref().unwrap());
        assert!(dw < TOL, "{what}: weights differ from one rank by {dw}");
        let (m0, m2) = (response_mask(100), response_mask(102));
        let mut dl = 0.0f32;
        for (rank, run) in runs.iter().enumerate() {
            for (want, mask, got) in [(&one.2, &m0, &run.2), (&one.3, &m2, &run.3)] {
                let d = slice_diff(want, mask, dp_of(shape), run.4, got);
                assert!(
                    d < TOL as f32,
                    "{what}: rank {rank} log-probs differ by {d} (relative to 1 + |log-prob|)"
                );
                dl = dl.max(d);
            }
        }
        eprintln!("{what}: max weight diff {dw:e}, max log-prob diff {dl:e}");
    }
}

#[test]
fn pp2_vpp2_tp2_pp2_vpp2_and_pp2_vpp2_dp2_actor_updates_equal_one_rank() {
    // Four layers: one per model chunk at PP=2 × VPP=2; eight micro-batches per mini-batch (four
    // with DP=2).
    check_actor_parity(
        false,
        4,
        1,
        false,
        &[(1, 2, 2, 2), (2, 2, 2, 4), (1, 2, 2, 4)],
    );
}

#[test]
fn tp2_pp2_vpp2_with_sequence_parallelism_equals_one_rank() {
    // The chunks exchange the sequence shards (odd sequences of 9 positions, padded to 10).
    check_actor_parity(false, 4, 1, true, &[(2, 2, 2, 4)]);
}

#[test]
fn tied_embeddings_at_pp2_vpp2_and_pp4_vpp2_equal_one_rank() {
    // Eight layers: two per chunk at PP=2 × VPP=2, one at PP=4 × VPP=2 (eight virtual stages);
    // the embedding lives in rank 0's chunk 0, its tied head copy in the last rank's last chunk.
    check_actor_parity(true, 8, 1, false, &[(1, 2, 2, 2), (1, 4, 2, 4)]);
}

#[test]
fn micro_batch_counts_that_are_not_a_multiple_of_the_stages_equal_one_rank() {
    // Three rows per micro-batch: 3 micro-batches (of 3, 3 and 2 rows) per mini-batch of 8 at
    // PP=2 (the last group of the schedule table has one micro-batch), and at PP=4 fewer
    // micro-batches than stages. Log-probs run 3 micro-batches of 3 rows.
    check_actor_parity(false, 8, 3, false, &[(1, 2, 2, 2), (1, 4, 2, 4)]);
}

type CriticRun = (Vec<Metrics>, Vec<f32>, usize);

fn critic_steps(megatron: Option<Shape>, model: &Path) -> Vec<CriticRun> {
    let shape = megatron.unwrap_or((1, 1, 1, 1));
    let dp = dp_of(shape);
    let job = Arc::new(Job::new(shape.3));
    let cfg = job_config(model, shape, 1, false);
    let j = job.clone();
    job.run(move |rank| {
        let init = j.init(Role::Critic, rank, &cfg);
        let mut c: CriticClient = match megatron {
            None => testing::critic::<FsdpPlugin>(&init).unwrap(),
            Some(_) => testing::critic::<MegatronPlugin>(&init).unwrap(),
        };
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
fn pp2_vpp2_critic_updates_equal_one_rank() {
    // The value head lives in the last chunk of the last stage.
    let dir = tiny_model_with_layers(false, HeadKind::Value, 4);
    let one = critic_steps(None, dir.path()).remove(0);
    for shape in [(1, 2, 2, 2), (2, 2, 2, 4)] {
        let runs = critic_steps(Some(shape), dir.path());
        let what = format!("critic, tp × pp × vpp × world {shape:?}");
        let mut dv = 0.0f32;
        for (rank, (metrics, values, dp_rank)) in runs.iter().enumerate() {
            for (step, (m1, m)) in one.0.iter().zip(metrics).enumerate() {
                assert_metrics_close(m1, m, &format!("{what} rank {rank} step {step}"));
            }
            let all = vec![true; one.1.len()];
            let d = slice_diff(&one.1, &all, dp_of(shape), *dp_rank, values);
            assert!(d < TOL as f32, "{what}: rank {rank} values differ by {d}");
            dv = dv.max(d);
        }
        eprintln!("{what}: max value diff {dv:e}");
    }
}

fn actor_at(job: &Job, rank: usize, cfg: &serde_json::Value) -> ActorClient {
    testing::actor::<MegatronPlugin>(&job.init(Role::Actor, rank, cfg)).unwrap()
}

#[test]
fn checkpoints_move_between_pp2_vpp2_and_pp1() {
    let dir = tiny_model_with_layers(true, HeadKind::CausalLm, 4);
    let m = dir.path().to_path_buf();
    let ckpt = tempfile::tempdir().unwrap();
    let c2 = ckpt.path().to_path_buf();
    let opts = LogProbOptions::default;
    let batch = global_batch(100);
    let upd = |step: u64| UpdateOptions {
        global_step: step,
        ..UpdateOptions::default()
    };
    // PP=2 × VPP=2: one update, save, log-probs, a second update (the uninterrupted run).
    let job = Arc::new(Job::new(2));
    let (j, cfg) = (job.clone(), job_config(&m, (1, 2, 2, 2), 1, false));
    let (b, c) = (batch.clone(), c2.clone());
    let at_vpp = job.run(move |rank| {
        let mut a = actor_at(&j, rank, &cfg);
        a.update(&b, &upd(1)).unwrap();
        a.save(&c).unwrap();
        let lp = f32s(&a.compute_log_prob(&b, &opts()).unwrap(), col::LOG_PROBS);
        a.update(&global_batch(101), &upd(2)).unwrap();
        (lp, export(&mut a, rank))
    });
    assert_eq!(at_vpp[0].0, at_vpp[1].0, "both stages return the log-probs");
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(c2.join("state.json")).unwrap()).unwrap();
    assert_eq!(state["layout"]["pipeline_model_parallel_size"], 2);
    assert_eq!(state["layout"]["virtual_pipeline_model_parallel_size"], 2);

    // PP=1 loads it: the same log-probs, and the resumed update lands on the uninterrupted run's
    // weights (every chunk's master weights and AdamW moments came back).
    let mut a = actor_at(&Job::new(1), 0, &job_config(&m, (1, 1, 1, 1), 1, false));
    a.load(&c2).unwrap();
    let lp1 = f32s(
        &a.compute_log_prob(&batch, &opts()).unwrap(),
        col::LOG_PROBS,
    );
    let d = max_abs_diff(&at_vpp[0].0, &lp1);
    assert!(
        d < TOL as f32,
        "PP=2 × VPP=2 → PP=1: log-probs differ by {d}"
    );
    let ckpt1 = tempfile::tempdir().unwrap();
    a.save(ckpt1.path()).unwrap();
    a.update(&global_batch(101), &upd(2)).unwrap();
    let w1 = export(&mut a, 0).unwrap();
    let dw = max_weight_diff(at_vpp[0].1.as_ref().unwrap(), &w1);
    assert!(
        dw < TOL,
        "PP=2 × VPP=2 → PP=1: resumed weights differ by {dw}"
    );
    eprintln!("PP=2 × VPP=2 → PP=1: log-prob diff {d:e}, resumed weight diff {dw:e}");

    // PP=1 → PP=2 × VPP=2: the same log-probs on both ranks.
    let job = Arc::new(Job::new(2));
    let (j, cfg) = (job.clone(), job_config(&m, (1, 2, 2, 2), 1, false));
    let (b, c) = (batch.clone(), ckpt1.path().to_path_buf());
    let back = job.run(move |rank| {
        let mut a = actor_at(&j, rank, &cfg);
        a.load(&c).unwrap();
        f32s(&a.compute_log_prob(&b, &opts()).unwrap(), col::LOG_PROBS)
    });
    for (rank, lp) in back.iter().enumerate() {
        let d = max_abs_diff(&lp1, lp);
        assert!(
            d < TOL as f32,
            "PP=1 → PP=2 × VPP=2: rank {rank} differs by {d}"
        );
    }
}
