//! Pipeline parallelism (× tensor × data parallelism) run as threads of this process with the CPU
//! communicator, against the one-rank FSDP backend: metrics, updated weights and log-probs over
//! three steps within 1e-5 for the actor (separate and tied embeddings) and the critic, every rank
//! returning the full outputs of its data-parallel slice; checkpoints moving between PP=2 and
//! PP=1; generation on the weights gathered from the stages (the interleaved schedule: vpp.rs).

mod support;

use std::path::Path;
use std::sync::Arc;

use serde_json::json;
use verl_fsdp_engine::FsdpPlugin;
use verl_megatron::MegatronPlugin;
use verl_nn::HeadKind;
use verl_plugin_api::client::{ActorClient, CriticClient};
use verl_plugin_api::{
    col, testing, GenerateOptions, InitArgs, LogProbOptions, Role, UpdateOptions, ValueOptions,
};

use support::*;

/// Four decoder layers: two per stage at PP=2, one per stage at PP=4.
const LAYERS: i64 = 4;

/// The tiny model's config with a learning rate of 5e-3: at tp.rs's 2e-2 a four-layer model
/// turns fp32 reassociation noise (the order of a few sums differs from one rank) into ~1e-4
/// after three updates, whatever the layout (TP=2 as much as PP=2), because AdamW moves every
/// weight whose gradient is near zero by about the learning rate in the direction of that
/// gradient's sign. At 5e-3 every layout stays within 1e-6 of one rank.
fn job_config(model: &Path, (tp, pp, _): Shape, distributed: bool) -> serde_json::Value {
    let optim = json!({"optim": {"lr": 5e-3}});
    config_pp(
        model,
        tp,
        pp,
        distributed,
        json!({"actor_rollout_ref": {"actor": optim.clone()}, "critic": optim}),
    )
}

/// The response mask of `global_batch(seed)`, row-major: log-probs are compared where it is 1
/// (what a padding position holds is not part of the contract).
fn response_mask(seed: u64) -> Vec<bool> {
    global_batch(seed)
        .tensor::<i64>(col::RESPONSE_MASK)
        .unwrap()
        .data
        .iter()
        .map(|&m| m != 0)
        .collect()
}

/// A parallel layout under test: (tensor, pipeline, world); data parallelism takes the rest.
type Shape = (u64, u64, usize);

fn dp_of((tp, pp, world): Shape) -> usize {
    world / (tp * pp) as usize
}

/// `(per-step metrics, weights after the last step (rank 0), log-probs before the first update,
/// log-probs after the last one, data-parallel rank)` of one rank.
type ActorRun = (Vec<Metrics>, Option<Weights>, Vec<f32>, Vec<f32>, usize);

/// Three updates of an actor; `megatron = None` is the one-rank FSDP reference.
fn actor_steps(megatron: Option<Shape>, model: &Path, distributed: bool) -> Vec<ActorRun> {
    let shape = megatron.unwrap_or((1, 1, 1));
    let world = shape.2;
    let dp = dp_of(shape);
    let job = Arc::new(Job::new(world));
    let cfg = job_config(model, shape, distributed);
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

/// Every rank's output equals the one-rank output's rows of that rank's data-parallel slice, at
/// the positions `mask` keeps.
fn assert_slices_match(
    one: &[f32],
    mask: &[bool],
    dp: usize,
    got: &[(usize, &Vec<f32>)],
    what: &str,
) {
    let per = one.len() / dp;
    let keep = |v: &[f32], m: &[bool]| -> Vec<f32> {
        v.iter()
            .zip(m)
            .filter(|(_, &k)| k)
            .map(|(x, _)| *x)
            .collect()
    };
    for (rank, (dp_rank, v)) in got.iter().enumerate() {
        let range = dp_rank * per..(dp_rank + 1) * per;
        let m = &mask[range.clone()];
        let d = max_abs_diff(&keep(&one[range], m), &keep(v, m));
        assert!(d < TOL as f32, "{what}: rank {rank} differs by {d}");
    }
}

fn check_actor_parity(tied: bool, distributed: bool, shapes: &[Shape]) {
    let dir = tiny_model_with_layers(tied, HeadKind::CausalLm, LAYERS);
    let one = actor_steps(None, dir.path(), distributed).remove(0);
    for &shape in shapes {
        let runs = actor_steps(Some(shape), dir.path(), distributed);
        let what = format!("tied {tied}, tp × pp × world {shape:?}");
        for (rank, run) in runs.iter().enumerate() {
            for (step, (m1, m)) in one.0.iter().zip(&run.0).enumerate() {
                assert_metrics_close(m1, m, &format!("{what} rank {rank} step {step}"));
            }
        }
        let d = max_weight_diff(one.1.as_ref().unwrap(), runs[0].1.as_ref().unwrap());
        assert!(d < TOL, "{what}: weights differ from one rank by {d}");
        let dp = dp_of(shape);
        let before: Vec<(usize, &Vec<f32>)> = runs.iter().map(|r| (r.4, &r.2)).collect();
        let (m0, m2) = (response_mask(100), response_mask(102));
        assert_slices_match(
            &one.2,
            &m0,
            dp,
            &before,
            &format!("{what}: log-probs before"),
        );
        let after: Vec<(usize, &Vec<f32>)> = runs.iter().map(|r| (r.4, &r.3)).collect();
        assert_slices_match(&one.3, &m2, dp, &after, &format!("{what}: log-probs after"));
    }
}

#[test]
fn pp2_tp2_pp2_and_pp2_dp2_actor_updates_equal_one_rank() {
    check_actor_parity(false, true, &[(1, 2, 2), (2, 2, 4), (1, 2, 4)]);
}

#[test]
fn tied_embeddings_over_two_and_four_stages_equal_one_rank() {
    // The first and the last stage each hold the embedding; their gradients are summed. PP=4
    // also has stages with neither the embedding nor the head.
    check_actor_parity(true, false, &[(1, 2, 2), (2, 2, 4), (1, 4, 4)]);
}

type CriticRun = (Vec<Metrics>, Vec<f32>, usize);

fn critic_steps(megatron: Option<Shape>, model: &Path) -> Vec<CriticRun> {
    let shape = megatron.unwrap_or((1, 1, 1));
    let world = shape.2;
    let dp = dp_of(shape);
    let job = Arc::new(Job::new(world));
    let cfg = job_config(model, shape, true);
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
fn pp2_and_tp2_pp2_critic_updates_equal_one_rank() {
    // A checkpoint with a value head, and one without: the last stage alone initialises the head,
    // from the seed, exactly as the one-rank backend does.
    for (head, shapes) in [
        (HeadKind::Value, &[(1, 2, 2), (2, 2, 4)][..]),
        (HeadKind::CausalLm, &[(1, 2, 2)][..]),
    ] {
        let dir = tiny_model_with_layers(false, head, LAYERS);
        let one = critic_steps(None, dir.path()).remove(0);
        for &shape in shapes {
            let runs = critic_steps(Some(shape), dir.path());
            let what = format!("critic from a {head:?} checkpoint, tp × pp × world {shape:?}");
            for (rank, (metrics, _, _)) in runs.iter().enumerate() {
                for (step, (m1, m)) in one.0.iter().zip(metrics).enumerate() {
                    assert_metrics_close(m1, m, &format!("{what} rank {rank} step {step}"));
                }
            }
            let got: Vec<(usize, &Vec<f32>)> = runs.iter().map(|r| (r.2, &r.1)).collect();
            let all = vec![true; one.1.len()];
            assert_slices_match(&one.1, &all, dp_of(shape), &got, &format!("{what}: values"));
        }
    }
}

fn actor_at(job: &Job, rank: usize, cfg: &serde_json::Value) -> ActorClient {
    testing::actor::<MegatronPlugin>(&job.init(Role::Actor, rank, cfg)).unwrap()
}

#[test]
fn checkpoints_move_between_pp2_and_pp1() {
    let dir = tiny_model_with_layers(true, HeadKind::CausalLm, LAYERS);
    let ckpt2 = tempfile::tempdir().unwrap();
    let (m, c2) = (dir.path().to_path_buf(), ckpt2.path().to_path_buf());
    let opts = LogProbOptions::default;
    let batch = global_batch(100);
    let upd = |step: u64| UpdateOptions {
        global_step: step,
        ..UpdateOptions::default()
    };
    // PP=2 (tied embeddings: the state holds one embedding): one update, save; then a second
    // update (the uninterrupted run's weights).
    let job = Arc::new(Job::new(2));
    let (j, cfg) = (job.clone(), config_pp(&m, 1, 2, true, json!({})));
    let (b, c) = (batch.clone(), c2.clone());
    let at_pp2 = job.run(move |rank| {
        let mut a = actor_at(&j, rank, &cfg);
        a.update(&b, &upd(1)).unwrap();
        a.save(&c).unwrap();
        let lp = f32s(&a.compute_log_prob(&b, &opts()).unwrap(), col::LOG_PROBS);
        a.update(&global_batch(101), &upd(2)).unwrap();
        (lp, export(&mut a, rank))
    });
    assert_eq!(at_pp2[0].0, at_pp2[1].0, "both stages return the log-probs");
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(c2.join("state.json")).unwrap()).unwrap();
    assert_eq!(state["layout"]["pipeline_model_parallel_size"], 2);

    // PP=1 loads it: the same log-probs, and the next update (AdamW moments of every stage)
    // lands on the uninterrupted run's weights.
    let ckpt1 = tempfile::tempdir().unwrap();
    let mut a = actor_at(&Job::new(1), 0, &config_pp(&m, 1, 1, true, json!({})));
    a.load(&c2).unwrap();
    let lp1 = f32s(
        &a.compute_log_prob(&batch, &opts()).unwrap(),
        col::LOG_PROBS,
    );
    let d = max_abs_diff(&at_pp2[0].0, &lp1);
    assert!(d < TOL as f32, "PP=2 → PP=1: log-probs differ by {d}");
    a.save(ckpt1.path()).unwrap();
    a.update(&global_batch(101), &upd(2)).unwrap();
    let w1 = export(&mut a, 0).unwrap();
    let d = max_weight_diff(at_pp2[0].1.as_ref().unwrap(), &w1);
    assert!(d < TOL, "PP=2 → PP=1: resumed weights differ by {d}");

    // PP=1 → TP=2 × PP=2: the same log-probs on every rank.
    let job = Arc::new(Job::new(4));
    let (j, cfg) = (job.clone(), config_pp(&m, 2, 2, false, json!({})));
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
            "PP=1 → TP=2 × PP=2: rank {rank} differs by {d}"
        );
    }
}

#[test]
fn generation_on_the_gathered_stages_equals_one_rank_and_reference_matches_actor() {
    let dir = tiny_model_with_layers(true, HeadKind::CausalLm, LAYERS);
    let prompts = testing::prompts(&[&[5, 6, 7, 8], &[9, 10], &[11, 12, 13]], 0);
    let opts = GenerateOptions {
        n: 2,
        max_new_tokens: 6,
        temperature: 0.8,
        seed: Some(3),
        eos_token_ids: vec![1],
        ..GenerateOptions::default()
    };
    let cfg = config_pp(dir.path(), 1, 1, true, json!({}));
    let mut one = testing::actor::<FsdpPlugin>(&InitArgs::new(Role::Actor, cfg)).unwrap();
    let want = one.generate(&prompts, &opts).unwrap();
    let at = LogProbOptions {
        temperature: 0.8,
        ..LogProbOptions::default()
    };
    let want_lp = f32s(&one.compute_log_prob(&want, &at).unwrap(), col::LOG_PROBS);
    let job = Arc::new(Job::new(2));
    let (j, cfg) = (job.clone(), config_pp(dir.path(), 1, 2, true, json!({})));
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
        let mask: Vec<bool> = g
            .tensor::<i64>(col::RESPONSE_MASK)
            .unwrap()
            .data
            .iter()
            .map(|&m| m != 0)
            .collect();
        assert_slices_match(&want_lp, &mask, 1, &[(0, lp)], "generated rows: log-probs");
        // Same weights, same forward: equal up to the CPU kernels' run-to-run rounding (one ulp
        // was seen with ranks as threads on a 2-core AVX-512 box).
        let d = max_abs_diff(lp, ref_lp);
        assert!(
            d < 1e-5,
            "the reference starts from the actor's weights: log-probs differ by {d}"
        );
    }
}

#[test]
fn a_non_finite_loss_fails_every_stage_naming_it() {
    // Only the last stage computes the loss; it tells the first, which fails with the same cause
    // (its own report, or the last stage's failure notice when that arrives first: both name the
    // metric and the micro-batch) instead of waiting in the next collective.
    let dir = tiny_model_with_layers(false, HeadKind::CausalLm, LAYERS);
    let job = Arc::new(Job::new(2));
    let (j, cfg) = (job.clone(), job_config(dir.path(), (1, 2, 2), true));
    let errors = job.run(move |rank| {
        let mut a = actor_at(&j, rank, &cfg);
        let mut b = global_batch(100);
        let mut adv = b.tensor::<f32>(col::ADVANTAGES).unwrap().data;
        adv[3 * RL] = f32::NAN;
        b.insert_tensor(col::ADVANTAGES, &[ROWS, RL], &adv);
        a.update(&b, &UpdateOptions::default())
            .err()
            .map(|e| e.to_string())
            .expect("the update fails")
    });
    for (rank, e) in errors.iter().enumerate() {
        assert!(
            e.contains("micro-batch 3: `actor/pg_loss` is not finite (NaN)"),
            "rank {rank}: {e}"
        );
        assert!(e.contains("optimizer step was skipped"), "rank {rank}: {e}");
    }
}
