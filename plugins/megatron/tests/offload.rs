//! verl's offload keys (`*.megatron.param_offload`, `grad_offload`, `optimizer_offload`): the actor
//! (TP=2 × DP=2 with the distributed optimizer, and TP=2 × PP=2), the critic and the reference run
//! with offloading exactly as without it (bit-identical log-probs, metrics, generations, exported
//! weights), and between calls every offloaded tensor sits on the host — exactly the parameters,
//! gradient buffers and optimizer state (masters, moments) of the rank. Ranks run as threads; on
//! the CPU the host is the device, but with `offload::use_host_homes_on_cpu` (called by every test
//! here) the moves go through the host homes and copy, as on a GPU.

mod support;

use std::collections::BTreeSet;
use std::path::Path;

use serde_json::{json, Value};
use tch::Device;
use verl_megatron::offload::{Need, Offload, Place, HOST};
use verl_megatron::{MegatronActor, MegatronCritic};
use verl_nn::HeadKind;
use verl_plugin_api::{
    col, testing, Actor, Batch, Critic, GenerateOptions, LogProbOptions, Role, UpdateOptions,
    ValueOptions,
};

use support::*;

/// Moves through the host homes on the CPU too (a move to the "device" copies).
fn homes_on_cpu() {
    verl_megatron::offload::use_host_homes_on_cpu();
}

fn all_offload(on: bool) -> Value {
    json!({"param_offload": on, "grad_offload": on, "optimizer_offload": on})
}

fn offload_patch(on: bool) -> Value {
    offload_patch_with(on, json!({}))
}

/// [`offload_patch`] with more `megatron` keys for both roles.
fn offload_patch_with(on: bool, megatron: Value) -> Value {
    let mut mg = all_offload(on);
    merge(&mut mg, &megatron);
    json!({
        "actor_rollout_ref": {"actor": {"megatron": mg.clone()}},
        "critic": {"megatron": mg},
    })
}

/// Everything but the device-memory / timing metrics.
fn comparable(m: Vec<(String, f64)>) -> Metrics {
    m.into_iter()
        .filter(|(k, _)| !k.starts_with("perf/"))
        .collect()
}

/// `(metrics per step, log-probs before, log-probs after, after save + load, generation, export)`.
type ActorRun = (
    Vec<Metrics>,
    Vec<f32>,
    Vec<f32>,
    Vec<f32>,
    Batch,
    Option<Weights>,
);

fn assert_host_between_calls(a: &MegatronActor) {
    let (p, g, o) = a.state_devices();
    let on = a.offload();
    for (tensors, offloaded) in [(p, on.params), (g, on.grads), (o, on.optimizer)] {
        if offloaded {
            assert!(tensors.iter().all(|d| *d == HOST), "{tensors:?}");
        }
    }
    if on.params {
        assert!(
            !a.holds_rollout_model(),
            "generation copy kept on the device"
        );
    }
}

fn actor_run(
    model: &Path,
    (tp, pp, world): (u64, u64, usize),
    megatron: &Value,
    offload: bool,
) -> Vec<ActorRun> {
    let dp = world / (tp * pp) as usize;
    let job = std::sync::Arc::new(Job::new(world));
    let cfg = config_pp(
        model,
        tp,
        pp,
        true,
        offload_patch_with(offload, megatron.clone()),
    );
    let j = job.clone();
    let ckpt = std::sync::Arc::new(tempfile::tempdir().unwrap());
    job.run(move |rank| {
        let mut a = MegatronActor::create(&j.init(Role::Actor, rank, &cfg), false).unwrap();
        assert_eq!(a.offload().any(), offload);
        assert_host_between_calls(&a);
        let dp_rank = a.data_parallel().rank as usize;
        let opts = LogProbOptions {
            with_entropy: true,
            ..LogProbOptions::default()
        };
        let first = shard_rows(&global_batch(100), dp_rank, dp);
        let lp0 = f32s(&a.compute_log_prob(&first, &opts).unwrap(), col::LOG_PROBS);
        assert_host_between_calls(&a);
        let mut metrics = Vec::new();
        let mut last = first;
        for step in 0..3 {
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
            assert_host_between_calls(&a);
            metrics.push(comparable(m));
            last = b;
        }
        let lp = f32s(&a.compute_log_prob(&last, &opts).unwrap(), col::LOG_PROBS);
        let gen = a
            .generate(
                &testing::prompts(&[&[5, 6, 7, 8], &[9, 10]], 0),
                &GenerateOptions {
                    n: 2,
                    max_new_tokens: 4,
                    temperature: 0.8,
                    seed: Some(3),
                    eos_token_ids: vec![1],
                    ..GenerateOptions::default()
                },
            )
            .unwrap();
        assert_host_between_calls(&a);
        a.save(ckpt.path()).unwrap();
        assert_host_between_calls(&a);
        a.load(ckpt.path()).unwrap();
        assert_host_between_calls(&a);
        let lp_loaded = f32s(&a.compute_log_prob(&last, &opts).unwrap(), col::LOG_PROBS);
        let dir = tempfile::tempdir().unwrap();
        a.export_hf(dir.path()).unwrap();
        assert_host_between_calls(&a);
        let weights = (rank == 0).then(|| read_weights(dir.path()));
        (metrics, lp0, lp, lp_loaded, gen, weights)
    })
}

fn check_actor(tp: u64, pp: u64, world: usize) {
    let dir = tiny_model(false, HeadKind::CausalLm);
    check_actor_on(dir.path(), (tp, pp, world), json!({}));
}

fn check_actor_on(model: &Path, (tp, pp, world): (u64, u64, usize), megatron: Value) {
    let plain = actor_run(model, (tp, pp, world), &megatron, false);
    let off = actor_run(model, (tp, pp, world), &megatron, true);
    for (rank, (want, got)) in plain.iter().zip(&off).enumerate() {
        let what = format!("tp {tp} pp {pp} rank {rank}");
        assert!(want.0.iter().all(|m| m.contains_key("actor/grad_norm")));
        assert_eq!(want.0, got.0, "{what}: metrics");
        assert_eq!(want.1, got.1, "{what}: log-probs before the updates");
        assert_eq!(want.2, got.2, "{what}: log-probs after the updates");
        assert_eq!(got.2, got.3, "{what}: log-probs after save + load");
        for c in [col::RESPONSES, col::RESPONSE_MASK] {
            assert_eq!(
                want.4.tensor::<i64>(c).unwrap(),
                got.4.tensor::<i64>(c).unwrap(),
                "{what}: generation `{c}`"
            );
        }
    }
    let d = max_weight_diff(plain[0].5.as_ref().unwrap(), off[0].5.as_ref().unwrap());
    assert_eq!(d, 0.0, "exported weights differ by {d}");
}

#[test]
fn actor_tp2_dp2_distributed_optimizer_with_offload_is_bit_identical() {
    homes_on_cpu();
    check_actor(2, 1, 4);
}

#[test]
fn actor_tp2_pp2_with_offload_is_bit_identical() {
    homes_on_cpu();
    check_actor(2, 2, 4);
}

#[test]
fn moe_actor_tp2_ep2_with_offload_is_bit_identical() {
    homes_on_cpu();
    // The MoE blocks share their parameters with the model: in-place moves keep them in step.
    let dir = tiny_mixtral();
    check_actor_on(
        dir.path(),
        (2, 1, 4),
        json!({"expert_model_parallel_size": 2}),
    );
}

#[test]
fn offload_moves_exactly_the_parameters_gradients_and_optimizer_state() {
    homes_on_cpu();
    let dir = tiny_model(false, HeadKind::CausalLm);
    let job = std::sync::Arc::new(Job::new(2));
    let cfg = config(dir.path(), 2, true, offload_patch(true));
    let j = job.clone();
    job.run(move |rank| {
        let mut a = MegatronActor::create(&j.init(Role::Actor, rank, &cfg), false).unwrap();
        let names: BTreeSet<String> = a.model().params.iter().map(|p| p.name.clone()).collect();
        let params = a.move_offloaded(Need::Params, Place::Host).unwrap();
        assert_eq!(params.iter().cloned().collect::<BTreeSet<_>>(), names);
        assert_eq!(params.len(), names.len());
        let all: BTreeSet<String> = a
            .move_offloaded(Need::Train, Place::Device)
            .unwrap()
            .into_iter()
            .collect();
        let (_, grads, optim) = a.state_devices();
        let flats = grads.len();
        assert!(flats >= 2, "split and replicated flats");
        assert_eq!(optim.len(), 3 * flats);
        let mut want = names.clone();
        for f in 0..flats {
            for what in ["grad", "master", "exp_avg", "exp_avg_sq"] {
                want.insert(format!("{what}/{f}"));
            }
        }
        assert_eq!(all, want);
        // A checkpoint needs the optimizer state but not the gradient buffers.
        let state: BTreeSet<String> = a
            .move_offloaded(Need::State, Place::Host)
            .unwrap()
            .into_iter()
            .collect();
        assert!(state.iter().all(|l| !l.starts_with("grad/")));
        assert_eq!(state.len(), names.len() + 3 * flats);
        let (p, g, o) = a.state_devices();
        assert!(p.iter().chain(&g).chain(&o).all(|d| *d == Device::Cpu));
        // Offloading nothing moves nothing.
        let plain = config(dir_of(&cfg), 2, true, json!({}));
        drop(a);
        let mut b = MegatronActor::create(&j.init(Role::Actor, rank, &plain), false).unwrap();
        assert_eq!(b.offload(), Offload::default());
        assert!(b
            .move_offloaded(Need::Train, Place::Host)
            .unwrap()
            .is_empty());
    });
}

fn dir_of(cfg: &Value) -> &Path {
    Path::new(cfg["actor_rollout_ref"]["model"]["path"].as_str().unwrap())
}

fn critic_run(model: &Path, offload: bool) -> Vec<(Vec<Metrics>, Vec<f32>)> {
    let job = std::sync::Arc::new(Job::new(2));
    let cfg = config(model, 2, true, offload_patch(offload));
    let j = job.clone();
    job.run(move |rank| {
        let mut c = MegatronCritic::create(&j.init(Role::Critic, rank, &cfg)).unwrap();
        let host = |c: &MegatronCritic| {
            let (p, g, o) = c.state_devices();
            assert!(!offload || p.iter().chain(&g).chain(&o).all(|d| *d == HOST));
        };
        host(&c);
        let mut metrics = Vec::new();
        let mut last = global_batch(200);
        for step in 0..2 {
            let b = global_batch(200 + step);
            let m = c
                .update(
                    &b,
                    &UpdateOptions {
                        global_step: step + 1,
                        ..UpdateOptions::default()
                    },
                )
                .unwrap();
            host(&c);
            metrics.push(comparable(m));
            last = b;
        }
        let v = f32s(
            &c.compute_values(&last, &ValueOptions::default()).unwrap(),
            col::VALUES,
        );
        host(&c);
        (metrics, v)
    })
}

#[test]
fn critic_tp2_with_offload_is_bit_identical() {
    homes_on_cpu();
    let dir = tiny_model(false, HeadKind::Value);
    let plain = critic_run(dir.path(), false);
    let off = critic_run(dir.path(), true);
    assert_eq!(plain, off);
}

fn reference_log_probs(model: &Path, offload: bool) -> Vec<Vec<f32>> {
    let job = std::sync::Arc::new(Job::new(2));
    let patch = json!({"actor_rollout_ref": {"ref": {"megatron": {
        "tensor_model_parallel_size": 2, "dtype": "fp32", "param_offload": offload}}}});
    let cfg = config(model, 2, true, patch);
    let j = job.clone();
    job.run(move |rank| {
        let mut r = MegatronActor::create(&j.init(Role::Reference, rank, &cfg), true).unwrap();
        assert_eq!(r.offload().params, offload);
        let mut out = Vec::new();
        for seed in [300, 301] {
            let lp = r
                .compute_log_prob(&global_batch(seed), &LogProbOptions::default())
                .unwrap();
            assert_host_between_calls(&r);
            out.extend(f32s(&lp, col::LOG_PROBS));
        }
        out
    })
}

#[test]
fn reference_with_param_offload_is_bit_identical() {
    homes_on_cpu();
    let dir = tiny_model(false, HeadKind::CausalLm);
    assert_eq!(
        reference_log_probs(dir.path(), false),
        reference_log_probs(dir.path(), true)
    );
}
