//! Tensor-parallel generation at TP=2: each rank runs the rollout engine on its own shard of the
//! weights, ranks as threads over the CPU communicator; the tokens, masks and rollout log-probs
//! equal those of the TP=1 actor (greedy and sampled, same seed), the shards are half-size, and a
//! rollout TP the layout cannot take is refused. Other layouts: `reshard.rs`.

mod support;

use serde_json::{json, Value};
use verl_megatron::rollout::ROLLOUT_TP_KEY;
use verl_megatron::MegatronActor;
use verl_nn::HeadKind;
use verl_plugin_api::{col, testing, Actor, Batch, GenerateOptions, Role};

use support::*;

fn sampled() -> GenerateOptions {
    GenerateOptions {
        n: 2,
        max_new_tokens: 8,
        temperature: 0.8,
        top_p: 0.9,
        seed: Some(3),
        eos_token_ids: vec![1],
        return_log_probs: true,
        ..GenerateOptions::default()
    }
}

fn greedy() -> GenerateOptions {
    GenerateOptions {
        n: 2,
        max_new_tokens: 8,
        do_sample: false,
        seed: Some(3),
        eos_token_ids: vec![1],
        return_log_probs: true,
        ..GenerateOptions::default()
    }
}

fn prompts() -> Batch {
    testing::prompts(
        &[&[5, 6, 7, 8], &[9, 10], &[11, 12, 13], &[30, 2, 17, 39, 21]],
        0,
    )
}

/// Every rank's `(rollout mode, generation per option set)` of a `tp`-rank actor.
fn generate(
    model: &std::path::Path,
    tp: u64,
    patch: Value,
    opts: &[GenerateOptions],
) -> Vec<(usize, Vec<Batch>)> {
    let job = std::sync::Arc::new(Job::new(tp as usize));
    let cfg = config(model, tp, true, patch);
    let (j, opts) = (job.clone(), opts.to_vec());
    job.run(move |rank| {
        let mut a = MegatronActor::create(&j.init(Role::Actor, rank, &cfg), false).unwrap();
        let p = prompts();
        let out = opts.iter().map(|o| a.generate(&p, o).unwrap()).collect();
        (a.rollout_layout().grid.tp, out)
    })
}

fn i64s(b: &Batch, name: &str) -> Vec<i64> {
    b.tensor::<i64>(name).unwrap().data
}

fn assert_same_generation(want: &Batch, got: &Batch, what: &str) -> f32 {
    for c in [col::RESPONSES, col::RESPONSE_MASK, col::PROMPT_INDEX] {
        assert_eq!(i64s(want, c), i64s(got, c), "{what}: `{c}` differs");
    }
    assert_eq!(
        want.strings(col::FINISH_REASON).unwrap(),
        got.strings(col::FINISH_REASON).unwrap(),
        "{what}: finish reasons differ"
    );
    let d = max_abs_diff(
        &f32s(want, col::ROLLOUT_LOG_PROBS),
        &f32s(got, col::ROLLOUT_LOG_PROBS),
    );
    assert!(d < 1e-4, "{what}: rollout log-probs differ by {d}");
    d
}

fn check_tp2_equals_tp1(tied: bool) {
    let dir = tiny_model(tied, HeadKind::CausalLm);
    let opts = [greedy(), sampled()];
    let (mode, want) = generate(dir.path(), 1, json!({}), &opts).remove(0);
    assert_eq!(mode, 1);
    // The generations are not trivial: some rows stop early, some run to the length limit.
    let lengths: Vec<i64> = i64s(&want[1], col::RESPONSE_MASK)
        .chunks(8)
        .map(|r| r.iter().sum())
        .collect();
    assert!(lengths.iter().any(|&l| l > 1), "{lengths:?}");
    for (patch, expect) in [
        // The key absent (the config helper sets none): the actor's TP.
        (json!({}), 2),
        (
            json!({"actor_rollout_ref": {"rollout": {"tensor_model_parallel_size": 2}}}),
            2,
        ),
        (
            json!({"actor_rollout_ref": {"rollout": {"tensor_model_parallel_size": 1}}}),
            1,
        ),
    ] {
        let runs = generate(dir.path(), 2, patch.clone(), &opts);
        for (rank, (mode, got)) in runs.iter().enumerate() {
            assert_eq!(*mode, expect, "{patch}");
            for (k, name) in ["greedy", "sampled"].iter().enumerate() {
                let d = assert_same_generation(
                    &want[k],
                    &got[k],
                    &format!("tied {tied}, {patch}, rank {rank}, {name}"),
                );
                eprintln!("tied {tied} {patch} rank {rank} {name}: rollout log-prob diff {d:e}");
            }
        }
        // Both ranks return exactly the same thing (one replica's prompts).
        assert_eq!(
            f32s(&runs[0].1[1], col::ROLLOUT_LOG_PROBS),
            f32s(&runs[1].1[1], col::ROLLOUT_LOG_PROBS)
        );
    }
}

#[test]
fn tp2_sharded_generation_equals_tp1() {
    check_tp2_equals_tp1(false);
}

#[test]
fn tp2_sharded_generation_with_tied_embeddings_equals_tp1() {
    check_tp2_equals_tp1(true);
}

#[test]
fn each_rank_holds_half_of_the_weights_and_kv_heads() {
    let dir = tiny_model(false, HeadKind::CausalLm);
    let job = std::sync::Arc::new(Job::new(2));
    let (j, cfg) = (job.clone(), config(dir.path(), 2, true, json!({})));
    let shapes = job.run(move |rank| {
        let mut a = MegatronActor::create(&j.init(Role::Actor, rank, &cfg), false).unwrap();
        let m = a.rollout_model().unwrap();
        let shape = |name: &str| -> Vec<i64> {
            m.named_parameters()
                .iter()
                .find(|(n, _)| n == name)
                .unwrap()
                .1
                .size()
        };
        let c = m.shard_config();
        (
            (m.tp_size(), m.tp_rank()),
            (c.num_attention_heads, c.num_key_value_heads, c.vocab_size),
            m.config().num_key_value_heads,
            [
                shape("model.embed_tokens.weight"),
                shape("model.layers.0.self_attn.q_proj.weight"),
                shape("model.layers.0.self_attn.k_proj.weight"),
                shape("model.layers.0.self_attn.o_proj.weight"),
                shape("model.layers.0.mlp.gate_proj.weight"),
                shape("model.layers.0.mlp.down_proj.weight"),
                shape("lm_head.weight"),
            ],
            m.named_parameters()
                .iter()
                .map(|(_, t)| t.numel())
                .sum::<usize>(),
        )
    });
    for (rank, (tp, heads, full_kv, shapes, numel)) in shapes.into_iter().enumerate() {
        assert_eq!(tp, (2, rank));
        // 4 heads / 2 KV heads / 40 tokens split in two: the rank's KV pool holds 1 KV head.
        assert_eq!(heads, (2, 1, 20));
        assert_eq!(full_kv, 2);
        // hidden 16, head_dim 4, intermediate 40, vocab 40.
        assert_eq!(
            shapes,
            [
                vec![20, 16],
                vec![8, 16],
                vec![4, 16],
                vec![16, 8],
                vec![20, 16],
                vec![16, 20],
                vec![20, 16],
            ]
        );
        // Everything but the norms halves: embedding + LM head 2 × 640, per layer q/k/v (with
        // qwen2's biases) 272 + 136 + 136, o_proj 256, MLP 3 × 640; norms 16 + 2 × 32.
        let split = 2 * 640 + 2 * (272 + 136 + 136 + 256 + 3 * 640);
        let norms = 16 + 2 * 32;
        assert_eq!(numel, split / 2 + norms);
    }
}

#[test]
fn a_rollout_tp_the_layout_cannot_take_is_refused() {
    let dir = tiny_model(false, HeadKind::CausalLm);
    let cfg = config(
        dir.path(),
        2,
        true,
        json!({"actor_rollout_ref": {"rollout": {"tensor_model_parallel_size": 4}}}),
    );
    // The key is checked before the ranks join, so one rank alone reports it.
    let job = Job::new(2);
    let e = MegatronActor::create(&job.init(Role::Actor, 0, &cfg), false)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains(ROLLOUT_TP_KEY), "{e}");
    assert!(e.contains("found 4"), "{e}");
    assert!(e.contains("one of [1, 2]"), "{e}");
    assert!(
        e.contains("a divisor of the actor's tensor_model_parallel_size=2"),
        "{e}"
    );
}
