//! Generation at its own tensor-parallel size over 4 ZeRO-3 data-parallel CPU ranks (threads):
//! at rollout TP 1, 2 and 4 every rank gets exactly the tokens, masks and finish reasons one rank
//! generates for its prompts (greedy and seeded sampling, fp32), rollout log-probs within 1e-5;
//! each rollout group generates its members' prompts together on one shard per rank; a size that
//! does not divide the ranks is refused by key.

use std::sync::Arc;

use serde_json::json;
use verl_fsdp::FsdpActor;
use verl_nn::HeadKind;
use verl_plugin_api::{col, testing, Actor, Batch, GenerateOptions, Role};
use verl_test_support::model::{model_dir, qwen2_config};
use verl_test_support::ranks::Job;
use verl_test_support::{merge, Lcg};

const VOCAB: i64 = 40;
const PROMPTS: usize = 8;
const WORLD: usize = 4;
/// Elements of [`model`]: embedding and LM head 2 × 640; per layer q/k/v with biases 3 × 272,
/// o_proj 256, MLP 3 × 640, norms 32; the final norm 16. `NORMS`: the replicated ones.
const FULL: f64 = 1280.0 + 2.0 * (3.0 * 272.0 + 256.0 + 1920.0 + 32.0) + 16.0;
const NORMS: f64 = 2.0 * 32.0 + 16.0;

/// 4 heads and 4 key/value heads, 40 MLP columns, 40 tokens: splits 1, 2 and 4 ways.
fn model() -> tempfile::TempDir {
    let mut c = qwen2_config(VOCAB, 16, 40, 2, 64, false);
    c["num_key_value_heads"] = json!(4);
    model_dir(c, Some(11), HeadKind::CausalLm)
}

fn config(model: &std::path::Path, rollout_tp: u64) -> serde_json::Value {
    let mut c = json!({
        "trainer": {"device": "cpu"},
        "actor_rollout_ref": {
            "model": {"path": model.to_str().unwrap()},
            "actor": {
                "ppo_mini_batch_size": PROMPTS, "ppo_micro_batch_size_per_gpu": 1,
                "fsdp_config": {"model_dtype": "fp32", "dtype": "fp32"},
            },
            "rollout": {"n": 1, "log_prob_micro_batch_size_per_gpu": 2},
        },
    });
    merge(
        &mut c,
        &json!({"actor_rollout_ref": {"rollout": {"tensor_model_parallel_size": rollout_tp}}}),
    );
    c
}

fn options() -> Vec<GenerateOptions> {
    let base = GenerateOptions {
        max_new_tokens: 6,
        seed: Some(9),
        eos_token_ids: vec![1],
        return_log_probs: true,
        ..GenerateOptions::default()
    };
    vec![
        GenerateOptions {
            do_sample: false,
            ..base.clone()
        },
        GenerateOptions {
            n: 2,
            temperature: 0.9,
            top_k: 20,
            ..base
        },
    ]
}

fn prompts(range: std::ops::Range<usize>) -> Batch {
    let mut rng = Lcg(4);
    let rows: Vec<Vec<i64>> = (0..PROMPTS)
        .map(|_| {
            let len = 1 + (rng.next() % 5) as usize;
            (0..len)
                .map(|_| 2 + (rng.next() % (VOCAB as u64 - 2)) as i64)
                .collect()
        })
        .collect();
    let refs: Vec<&[i64]> = rows[range].iter().map(|r| r.as_slice()).collect();
    testing::prompts(&refs, 0)
}

/// Per rank: (its prompt range, its generations, its `rollout/tp` and `rollout/reshard_mb`).
type Ran = (std::ops::Range<usize>, Vec<Batch>, i64, f64);

/// Every rank's generations; rank `r` holds prompts `bounds[r]..bounds[r + 1]` (even slices
/// when `bounds` is empty).
fn run(dir: &std::path::Path, world: usize, rollout_tp: u64, bounds: &[usize]) -> Vec<Ran> {
    let job = Arc::new(Job::new(world));
    let bounds: Vec<usize> = match bounds.is_empty() {
        true => (0..=world).map(|r| r * PROMPTS / world).collect(),
        false => bounds.to_vec(),
    };
    let cfg = config(dir, rollout_tp);
    let j = job.clone();
    job.run(move |rank| {
        let mut a = FsdpActor::create(&j.init(Role::Actor, rank, &cfg), false).unwrap();
        let range = bounds[rank]..bounds[rank + 1];
        let batch = prompts(range.clone());
        let outs: Vec<Batch> = options()
            .into_iter()
            .map(|o| {
                let o = GenerateOptions {
                    row_offset: range.start as u64,
                    ..o
                };
                a.generate(&batch, &o).unwrap()
            })
            .collect();
        let meta = outs[0].meta();
        (
            range,
            outs,
            meta["rollout/tp"].as_i64().unwrap(),
            meta.get("rollout/reshard_mb")
                .and_then(|v| v.as_f64())
                .unwrap_or(0.0),
        )
    })
}

fn i64s(b: &Batch, name: &str) -> Vec<i64> {
    b.tensor::<i64>(name).unwrap().data
}

fn f32s(b: &Batch, name: &str) -> Vec<f32> {
    b.tensor::<f32>(name).unwrap().data
}

/// `want`'s rows (the whole batch) for prompts `range` against `got`; returns the largest
/// rollout log-prob difference.
fn check(want: &Batch, got: &Batch, range: &std::ops::Range<usize>, what: &str) -> f32 {
    let index = i64s(want, col::PROMPT_INDEX);
    let keep: Vec<usize> = (0..index.len())
        .filter(|&r| range.contains(&(index[r] as usize)))
        .collect();
    let l = want.tensor::<i64>(col::RESPONSES).unwrap().shape[1];
    let pick = |v: Vec<i64>| -> Vec<i64> {
        keep.iter()
            .flat_map(|&r| v[r * l..(r + 1) * l].to_vec())
            .collect()
    };
    for c in [col::RESPONSES, col::RESPONSE_MASK] {
        assert_eq!(pick(i64s(want, c)), i64s(got, c), "{what}: `{c}` differs");
    }
    let wi: Vec<i64> = keep
        .iter()
        .map(|&r| index[r] - range.start as i64)
        .collect();
    assert_eq!(wi, i64s(got, col::PROMPT_INDEX), "{what}: prompt index");
    let wr = want.strings(col::FINISH_REASON).unwrap();
    let wr: Vec<String> = keep.iter().map(|&r| wr[r].clone()).collect();
    assert_eq!(wr, got.strings(col::FINISH_REASON).unwrap(), "{what}");
    let wl = f32s(want, col::ROLLOUT_LOG_PROBS);
    let gl = f32s(got, col::ROLLOUT_LOG_PROBS);
    let d = keep
        .iter()
        .flat_map(|&r| wl[r * l..(r + 1) * l].to_vec())
        .zip(gl)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(d < 1e-5, "{what}: rollout log-probs differ by {d}");
    d
}

#[test]
fn every_rollout_tp_over_four_fsdp_ranks_generates_what_one_rank_does() {
    let dir = model();
    let want = run(dir.path(), 1, 1, &[]).remove(0).1;
    let reasons = want[1].strings(col::FINISH_REASON).unwrap();
    assert!(reasons.iter().any(|r| r == "stop"), "{reasons:?}");
    assert!(reasons.iter().any(|r| r == "length"), "{reasons:?}");
    // Even slices, and uneven ones (validation splits need not be even).
    for (rtp, bounds) in [
        (1u64, vec![]),
        (2, vec![]),
        (4, vec![]),
        (2, vec![0, 3, 4, 7, 8]),
        (4, vec![0, 1, 1, 6, 8]),
    ] {
        for (rank, (range, outs, tp, mb)) in run(dir.path(), WORLD, rtp, &bounds).iter().enumerate()
        {
            assert_eq!(*tp, rtp as i64, "rank {rank}");
            for (k, name) in ["greedy", "sampled"].iter().enumerate() {
                let what = format!("rollout TP {rtp}, prompts {range:?}, rank {rank}, {name}");
                let d = check(&want[k], &outs[k], range, &what);
                eprintln!("{what}: log-prob diff {d:e}");
            }
            // A rank receives only what its shard lacks: at most its 1/rtp of the split tensors
            // plus the replicated norms (fp32), never the 3/4 of the model an all-gather brings.
            if rtp > 1 {
                let bytes = mb * 1e6;
                let most = 4.0 * (FULL / rtp as f64 + NORMS);
                assert!(
                    bytes > 0.0 && bytes <= most,
                    "rollout TP {rtp}, rank {rank}: received {bytes} bytes, its shard is {most}"
                );
            }
        }
    }
}

#[test]
fn a_rollout_tp_that_does_not_divide_the_ranks_is_refused_by_key() {
    let dir = model();
    let job = Arc::new(Job::new(WORLD));
    let (j, cfg) = (job.clone(), config(dir.path(), 3));
    let errors = job.run(move |rank| {
        FsdpActor::create(&j.init(Role::Actor, rank, &cfg), false)
            .err()
            .expect("refused")
            .to_string()
    });
    let e = &errors[0];
    assert!(
        e.contains("actor_rollout_ref.rollout.tensor_model_parallel_size"),
        "{e}"
    );
    assert!(e.contains("one of [1, 2, 4]"), "{e}");
    assert!(e.contains("found 3"), "{e}");
}
