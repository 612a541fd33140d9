use super::*;
use crate::shard::bytes;
use tch::Kind;

fn tiny(dtype: Kind, seed: i64) -> Transformer {
    verl_test_support::tiny::tiny_transformer(dtype, seed)
}

fn optim_cfg() -> OptimSection {
    serde_json::from_value(serde_json::json!({"lr": 1e-2, "weight_decay": 0.01})).unwrap()
}

/// Everything a step leaves behind, as host fp32 copies: live parameters, masters, moments.
type State = (Vec<Tensor>, Vec<Tensor>, Vec<Tensor>, Vec<Tensor>);

fn snapshot(t: &TrainableModel) -> State {
    let host = |ts: &[Tensor]| -> Vec<Tensor> {
        ts.iter()
            .map(|x| x.to_device(Device::Cpu).to_kind(Kind::Float).copy())
            .collect()
    };
    let live: Vec<Tensor> = t
        .model
        .named_parameters()
        .iter()
        .map(|(_, p)| p.detach())
        .collect();
    (
        host(&live),
        host(&t.masters),
        host(&t.optim.exp_avg),
        host(&t.optim.exp_avg_sq),
    )
}

/// Three mini-batches of one micro-batch each (two with two micro-batches) on `master` /
/// `compute` dtypes with `offload`, on the CPU.
fn train(master: Kind, compute: Kind, offload: Offload, chunk: usize) -> (State, TrainableModel) {
    let model = tiny(compute, 7);
    let mut t = TrainableModel::new_on(
        model,
        Precision { master, compute },
        optim_cfg(),
        "actor_rollout_ref.actor.optim",
        1.0,
        &Dp::single(),
        Sharding {
            offload,
            ..Sharding::default()
        },
    )
    .unwrap();
    t.offload_chunk_bytes = chunk;
    let dp = Dp::single();
    for step in 0..3u64 {
        t.zero_grad().unwrap();
        for k in 0..(1 + step % 2) {
            // Token ids without the global generator (other tests draw from it in parallel).
            let (a, b) = ((7 * step + 3 * k + 5) as i64, (2 * k) as i64);
            let ids = (Tensor::arange(12, (Kind::Int64, Device::Cpu)) * a + b)
                .remainder(verl_test_support::tiny::VOCAB)
                .reshape([2, 6]);
            let _ = t
                .forward_backward(&dp, &ids, None, None, |logits| {
                    Ok(logits.to_kind(Kind::Float).square().mean(Kind::Float))
                })
                .unwrap();
            t.after_backward().unwrap();
        }
        t.finish_mini_batch(&dp, 1e-2, at("actor", step)).unwrap();
    }
    (snapshot(&t), t)
}

fn assert_same(a: &State, b: &State, what: &str) {
    for (name, x, y) in [
        ("live parameters", &a.0, &b.0),
        ("masters", &a.1, &b.1),
        ("exp_avg", &a.2, &b.2),
        ("exp_avg_sq", &a.3, &b.3),
    ] {
        assert_eq!(x.len(), y.len(), "{what}: {name} count");
        for (i, (p, q)) in x.iter().zip(y).enumerate() {
            assert!(p.equal(q), "{what}: {name}[{i}] differs");
        }
    }
}

#[test]
fn offloaded_steps_equal_device_steps_bit_for_bit() {
    let all = Offload {
        params: true,
        optimizer: true,
    };
    let optimizer_only = Offload {
        params: false,
        optimizer: true,
    };
    // Mixed precision (bf16 model, fp32 masters): masters and moments offloaded, in one chunk
    // and in chunks of a few parameters.
    let (want, plain) = train(
        Kind::Float,
        Kind::BFloat16,
        Offload::default(),
        OFFLOAD_CHUNK_BYTES,
    );
    assert_eq!(plain.host_offload(), Offload::default());
    for (offload, chunk) in [(all, OFFLOAD_CHUNK_BYTES), (all, 4096), (optimizer_only, 1)] {
        let (got, t) = train(Kind::Float, Kind::BFloat16, offload, chunk);
        assert_eq!(t.host_offload(), offload);
        assert_same(&want, &got, &format!("mixed, {offload:?}, chunk {chunk}"));
        // The training really moved: the weights are not the initial ones.
        let init = tiny(Kind::BFloat16, 7);
        let moved = init
            .named_parameters()
            .iter()
            .zip(&got.0)
            .any(|((_, p), q)| !p.to_kind(Kind::Float).equal(q));
        assert!(moved, "the steps changed no weight");
    }
    // fp32 throughout: the masters are the live parameters; only the moments can leave.
    let (want, _) = train(
        Kind::Float,
        Kind::Float,
        Offload::default(),
        OFFLOAD_CHUNK_BYTES,
    );
    let (got, t) = train(Kind::Float, Kind::Float, all, 2048);
    assert_eq!(
        t.host_offload(),
        optimizer_only,
        "param_offload without mixed precision"
    );
    assert_same(&want, &got, "fp32, moments offloaded");
}

#[test]
fn offloaded_state_stays_separate_from_the_device_copies() {
    // On the CPU the "device" copies are still copies: stepping them must write the results
    // back into the host tensors (a missing copy-back would leave the moments at zero).
    let all = Offload {
        params: true,
        optimizer: true,
    };
    let (_, t) = train(Kind::Float, Kind::BFloat16, all, 4096);
    for m in &t.optim.exp_avg_sq {
        assert!(m.abs().sum(Kind::Float).double_value(&[]) > 0.0);
    }
    // The live bf16 model holds the masters rounded.
    for ((_, p), m) in t.model.named_parameters().iter().zip(&t.masters) {
        assert!(p.equal(&m.to_kind(Kind::BFloat16)));
    }
}

#[test]
fn gradient_accumulators_are_held_only_between_backward_and_step() {
    let (_, mut t) = train(
        Kind::Float,
        Kind::BFloat16,
        Offload::default(),
        OFFLOAD_CHUNK_BYTES,
    );
    assert_eq!(t.memory().grads, 0, "after the step");
    let ids = Tensor::randint(
        verl_test_support::tiny::VOCAB,
        [2, 6],
        (Kind::Int64, Device::Cpu),
    );
    t.zero_grad().unwrap();
    let _ = t
        .forward_backward(&Dp::single(), &ids, None, None, |logits| {
            Ok(logits.to_kind(Kind::Float).mean(Kind::Float))
        })
        .unwrap();
    t.after_backward().unwrap();
    let fp32_bytes: usize = t.masters.iter().map(bytes).sum();
    assert_eq!(t.memory().grads, fp32_bytes, "after a backward");
    t.zero_grad().unwrap();
    assert_eq!(t.memory().grads, 0, "after zero_grad");
    // A step with no backward since zero_grad takes zero gradients (weight decay only).
    let before = snapshot(&t);
    t.finish_mini_batch(&Dp::single(), 1e-2, at("actor", 9))
        .unwrap();
    let after = snapshot(&t);
    for (m0, m1) in before.2.iter().zip(&after.2) {
        // exp_avg decays by beta1 with a zero gradient.
        assert!(m1.allclose(&(m0 * 0.9), 1e-6, 0.0, false));
    }
}

#[test]
fn one_rank_offload_keeps_what_can_leave_the_device() {
    let all = Offload {
        params: true,
        optimizer: true,
    };
    let mixed = Precision {
        master: Kind::Float,
        compute: Kind::BFloat16,
    };
    let pure = Precision {
        master: Kind::BFloat16,
        compute: Kind::BFloat16,
    };
    let sec = "actor_rollout_ref.actor.fsdp_config";
    assert_eq!(one_rank_offload(all, mixed, Device::Cuda(0), sec), all);
    assert_eq!(
        one_rank_offload(all, pure, Device::Cuda(0), sec),
        Offload {
            params: false,
            optimizer: true
        }
    );
    assert_eq!(
        one_rank_offload(all, mixed, Device::Cpu, sec),
        Offload::default()
    );
    assert_eq!(
        one_rank_offload(Offload::default(), mixed, Device::Cuda(0), sec),
        Offload::default()
    );
}

fn at(role: &'static str, step: u64) -> verl_backend_kit::update::StepAt {
    verl_backend_kit::update::StepAt {
        role,
        step,
        epoch: 0,
        mini_batch: 0,
    }
}
