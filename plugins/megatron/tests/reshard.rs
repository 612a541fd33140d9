//! Generation at its own tensor-parallel size (3D-HybridEngine) on 4 CPU ranks (threads): for the
//! training layouts TP 2 × DP 2, TP 2 × PP 2 and TP 4, generation at rollout TP 1, 2 and 4 returns
//! every rank exactly the tokens, masks and finish reasons one TP=1 rank gives for its replica's
//! prompts (greedy and seeded sampling, fp32), rollout log-probs within 1e-5; every rollout group
//! generates a different share of the prompts; resharding moves only what a rank lacks.

mod support;

use std::sync::Arc;

use serde_json::json;
use verl_megatron::MegatronActor;
use verl_nn::HeadKind;
use verl_plugin_api::{col, testing, Actor, Batch, GenerateOptions, Role};
use verl_test_support::model::{model_dir, qwen2_config};

use support::*;

const PROMPTS: usize = 8;

/// 4 heads and 4 key/value heads, 40 MLP columns, 40 tokens: splits 1, 2 and 4 ways.
fn model() -> tempfile::TempDir {
    model_tied(false)
}

fn model_tied(tied: bool) -> tempfile::TempDir {
    let mut c = qwen2_config(VOCAB, 16, 40, 2, 64, tied);
    c["num_key_value_heads"] = json!(4);
    model_dir(c, Some(11), HeadKind::CausalLm)
}

fn options() -> Vec<GenerateOptions> {
    let base = GenerateOptions {
        max_new_tokens: 6,
        seed: Some(5),
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
            top_p: 0.95,
            ..base
        },
    ]
}

fn prompt_rows() -> Vec<Vec<i64>> {
    let mut rng = Lcg(3);
    (0..PROMPTS)
        .map(|_| {
            let len = 1 + (rng.next() % 5) as usize;
            (0..len)
                .map(|_| 2 + (rng.next() % (VOCAB as u64 - 2)) as i64)
                .collect()
        })
        .collect()
}

/// Prompts `range` of the batch as a generate call's batch.
fn prompts(range: std::ops::Range<usize>) -> Batch {
    let rows = prompt_rows();
    let refs: Vec<&[i64]> = rows[range].iter().map(|r| r.as_slice()).collect();
    testing::prompts(&refs, 0)
}

struct Ran {
    outs: Vec<Batch>,
    shares_training_memory: bool,
    reshard_bytes: f64,
    rollout_numel: usize,
    group_prompts: i64,
}

/// Every rank's generations: `tp` × `pp` training layout over `world` ranks, rollout TP `rtp`;
/// each data-parallel replica gets its contiguous slice of the batch with its row offset.
fn run(dir: &std::path::Path, world: usize, tp: u64, pp: u64, rtp: Option<u64>) -> Vec<Ran> {
    let job = Arc::new(Job::new(world));
    let patch = match rtp {
        Some(r) => json!({"actor_rollout_ref": {"rollout": {"tensor_model_parallel_size": r}}}),
        None => json!({}),
    };
    let cfg = config_pp(dir, tp, pp, true, patch);
    let j = job.clone();
    job.run(move |rank| {
        let mut a = MegatronActor::create(&j.init(Role::Actor, rank, &cfg), false).unwrap();
        let (dp, dp_rank) = {
            let p = a.parallel();
            (p.dp.size, p.dp.rank)
        };
        let (lo, hi) = (dp_rank * PROMPTS / dp, (dp_rank + 1) * PROMPTS / dp);
        let batch = prompts(lo..hi);
        let outs: Vec<Batch> = options()
            .into_iter()
            .map(|o| {
                let o = GenerateOptions {
                    row_offset: lo as u64,
                    ..o
                };
                a.generate(&batch, &o).unwrap()
            })
            .collect();
        let meta = outs[0].meta();
        let group_prompts = meta
            .get("rollout/group_prompts")
            .and_then(|v| v.as_i64())
            .unwrap_or(-1);
        let rollout: Vec<(String, usize, usize)> = a
            .rollout_model()
            .unwrap()
            .named_parameters()
            .iter()
            .map(|(n, t)| (n.clone(), t.numel(), t.data_ptr() as usize))
            .collect();
        let rollout_numel = rollout.iter().map(|r| r.1).sum();
        // Whether every rollout weight is the training weight itself (same memory).
        let m = a.model();
        let shares_training_memory = rollout.iter().all(|(n, _, ptr)| {
            m.param_index(n)
                .is_some_and(|i| m.params[i].local.data_ptr() as usize == *ptr)
        });
        let mut outs = outs;
        // Each prompt slice is checked against the reference rows of the same prompts.
        for b in &mut outs {
            b.set_meta(&json!({"lo": lo, "hi": hi}).as_object().unwrap().clone());
        }
        Ran {
            outs,
            shares_training_memory,
            reshard_bytes: a.last_reshard().bytes_in,
            rollout_numel,
            group_prompts,
        }
    })
}

fn i64s(b: &Batch, name: &str) -> Vec<i64> {
    b.tensor::<i64>(name).unwrap().data
}

/// Rows of `want` (the whole batch) answering prompts `lo..hi`, against `got`.
fn check_rows(want: &Batch, got: &Batch, what: &str) -> f32 {
    let lo = got.meta()["lo"].as_i64().unwrap();
    let hi = got.meta()["hi"].as_i64().unwrap();
    let index = i64s(want, col::PROMPT_INDEX);
    let keep: Vec<usize> = (0..index.len())
        .filter(|&r| (lo..hi).contains(&index[r]))
        .collect();
    let l = want.tensor::<i64>(col::RESPONSES).unwrap().shape[1];
    let rows = |b: &Batch, name: &str, pick: &[usize]| -> Vec<i64> {
        let v = i64s(b, name);
        pick.iter()
            .flat_map(|&r| v[r * l..(r + 1) * l].to_vec())
            .collect()
    };
    let all: Vec<usize> = (0..i64s(got, col::PROMPT_INDEX).len()).collect();
    for c in [col::RESPONSES, col::RESPONSE_MASK] {
        assert_eq!(
            rows(want, c, &keep),
            rows(got, c, &all),
            "{what}: `{c}` differs"
        );
    }
    let wi: Vec<i64> = keep.iter().map(|&r| index[r] - lo).collect();
    assert_eq!(wi, i64s(got, col::PROMPT_INDEX), "{what}: prompt index");
    let wr = want.strings(col::FINISH_REASON).unwrap();
    let wr: Vec<String> = keep.iter().map(|&r| wr[r].clone()).collect();
    assert_eq!(
        wr,
        got.strings(col::FINISH_REASON).unwrap(),
        "{what}: finish"
    );
    let wl = f32s(want, col::ROLLOUT_LOG_PROBS);
    let wl: Vec<f32> = keep
        .iter()
        .flat_map(|&r| wl[r * l..(r + 1) * l].to_vec())
        .collect();
    let d = max_abs_diff(&wl, &f32s(got, col::ROLLOUT_LOG_PROBS));
    assert!(d < 1e-5, "{what}: rollout log-probs differ by {d}");
    d
}

#[test]
fn every_rollout_tp_over_every_training_layout_generates_what_one_rank_does() {
    let dir = model();
    let want = run(dir.path(), 1, 1, 1, None).remove(0).outs;
    // The generations are not trivial: some rows stop early, some run to the length limit.
    let reasons = want[1].strings(col::FINISH_REASON).unwrap();
    assert!(reasons.iter().any(|r| r == "stop"), "{reasons:?}");
    assert!(reasons.iter().any(|r| r == "length"), "{reasons:?}");
    let full: usize = {
        let v = VOCAB as usize;
        // embedding + LM head, per layer q/k/v (+ biases) o, MLP, norms; final norm.
        2 * v * 16 + 2 * (3 * (16 * 16 + 16) + 16 * 16 + 3 * 40 * 16 + 2 * 16) + 16
    };
    for (tp, pp) in [(2u64, 1u64), (2, 2), (4, 1)] {
        for rtp in [1u64, 2, 4] {
            let what = format!("train TP {tp} × PP {pp}, rollout TP {rtp}");
            let ranks = run(dir.path(), 4, tp, pp, Some(rtp));
            let mut shares = Vec::new();
            for (rank, r) in ranks.iter().enumerate() {
                for (k, name) in ["greedy", "sampled"].iter().enumerate() {
                    let d = check_rows(
                        &want[k],
                        &r.outs[k],
                        &format!("{what}, rank {rank}, {name}"),
                    );
                    eprintln!("{what} rank {rank} {name}: log-prob diff {d:e}");
                }
                // The generation model is this rank's 1/rtp of every split tensor.
                assert!(
                    r.rollout_numel <= full / rtp as usize + 200,
                    "{what}: rank {rank} holds {} of {full} elements",
                    r.rollout_numel
                );
                if rtp as usize == 1 {
                    assert_eq!(r.rollout_numel, full, "{what}");
                }
                // At the actor's TP (one stage) generation runs on the training weights
                // themselves: no second copy.
                assert_eq!(
                    r.shares_training_memory,
                    rtp == tp && pp == 1,
                    "{what}: rank {rank}"
                );
                // Nothing moves where the rollout shard is (part of) the training shard.
                if pp == 1 && rtp >= tp {
                    assert_eq!(r.reshard_bytes, 0.0, "{what}: rank {rank}");
                } else {
                    assert!(r.reshard_bytes > 0.0, "{what}: rank {rank}");
                    // Never more than the rollout shard it builds (fp32), also where the rollout
                    // group spans the pipeline stages (rollout TP 4 over TP 2 × PP 2).
                    assert!(
                        r.reshard_bytes <= (4 * full / rtp as usize) as f64,
                        "{what}: rank {rank} received {} bytes",
                        r.reshard_bytes
                    );
                }
                shares.push(r.group_prompts);
            }
            // The rollout groups split the prompts: no prompt generated twice.
            let groups = 4 / rtp as usize;
            let own = rtp == tp && pp == 1;
            if !own {
                let total: i64 = shares.iter().sum::<i64>() / rtp as i64;
                assert_eq!(
                    total, PROMPTS as i64,
                    "{what}: shares {shares:?} over {groups} groups"
                );
            }
        }
    }
}

/// Tied embeddings live on the first and the last stage: where the stages exchange their pieces
/// (a rollout group across them) and where they broadcast them, each rank gets the embedding once.
#[test]
fn tied_embeddings_across_stages_reshard_to_what_one_rank_generates() {
    let dir = model_tied(true);
    let want = run(dir.path(), 1, 1, 1, None).remove(0).outs;
    for rtp in [1u64, 2, 4] {
        for (rank, r) in run(dir.path(), 4, 2, 2, Some(rtp)).iter().enumerate() {
            for (k, name) in ["greedy", "sampled"].iter().enumerate() {
                check_rows(
                    &want[k],
                    &r.outs[k],
                    &format!("tied, TP 2 × PP 2, rollout TP {rtp}, rank {rank}, {name}"),
                );
            }
        }
    }
}
