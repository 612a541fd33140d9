//! The paged engine on a tensor-parallel model: two shards (`Transformer::tp_shard`) run as
//! threads over an in-process communicator, in lock-step, produce the whole model's tokens and
//! log-probs, including under a KV budget small enough to force preemptions and with the samples
//! of a prompt sharing its blocks.

use std::sync::{Arc, Barrier, Mutex};

use tch::{Kind, Tensor};
use verl_nn::{ModelConfig, ModelOptions, TpComm, Transformer};
use verl_rollout::{generate_with_config, EngineConfig, SamplingParams};

/// Ranks as threads: each collective deposits its input, waits, and every member combines the
/// deposits in rank order (the same result everywhere).
struct ThreadComm {
    rank: usize,
    size: usize,
    slots: Arc<Mutex<Vec<Option<Tensor>>>>,
    barrier: Arc<Barrier>,
}

impl ThreadComm {
    fn group(size: usize) -> Vec<ThreadComm> {
        let slots = Arc::new(Mutex::new((0..size).map(|_| None).collect()));
        let barrier = Arc::new(Barrier::new(size));
        (0..size)
            .map(|rank| ThreadComm {
                rank,
                size,
                slots: slots.clone(),
                barrier: barrier.clone(),
            })
            .collect()
    }

    fn exchange(&self, t: &Tensor) -> Vec<Tensor> {
        self.slots.lock().unwrap()[self.rank] = Some(t.copy());
        self.barrier.wait();
        let all = self
            .slots
            .lock()
            .unwrap()
            .iter()
            .map(|s| s.as_ref().unwrap().copy())
            .collect();
        self.barrier.wait();
        all
    }
}

impl TpComm for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn all_reduce_sum(&self, t: &Tensor) -> verl_nn::Result<Tensor> {
        let all = self.exchange(t);
        let mut s = all[0].copy();
        for x in &all[1..] {
            s = s.f_add(x)?;
        }
        Ok(s)
    }
    fn all_gather_last(&self, t: &Tensor) -> verl_nn::Result<Tensor> {
        Ok(Tensor::f_cat(&self.exchange(t), -1)?)
    }
}

fn config() -> ModelConfig {
    ModelConfig::from_value(
        serde_json::json!({
            "model_type": "qwen2", "vocab_size": 96, "hidden_size": 32,
            "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "initializer_range": 0.2, "tie_word_embeddings": false,
            "max_position_embeddings": 128,
        }),
        "inline/config.json",
    )
    .unwrap()
}

/// Megatron's split of a full HF tensor for rank `rank` of `size`.
fn shard_of(full: &Tensor, name: &str, rank: usize, size: usize) -> Tensor {
    let dim = if name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight") {
        Some(1)
    } else if [
        "q_proj",
        "k_proj",
        "v_proj",
        "gate_proj",
        "up_proj",
        "embed_tokens",
        "lm_head",
    ]
    .iter()
    .any(|k| name.contains(k))
    {
        Some(0)
    } else {
        None
    };
    match dim {
        None => full.copy(),
        Some(d) => {
            let n = full.size()[d as usize] / size as i64;
            full.narrow(d, rank as i64 * n, n).copy()
        }
    }
}

type Out = (Vec<i64>, Vec<i64>, Vec<f32>, usize);

fn run(m: &Transformer, params: &SamplingParams, cfg: &EngineConfig) -> Out {
    let prompts = Tensor::from_slice(&[
        0i64, 0, 0, 5, 6, 7, //
        11, 12, 13, 14, 15, 16, //
        0, 0, 0, 0, 40, 41, //
        0, 70, 71, 72, 73, 74,
    ])
    .view([4, 6]);
    let mask = prompts.ne(0).to_kind(Kind::Int64);
    let (g, stats) = generate_with_config(m, &prompts, &mask, params, None, cfg).unwrap();
    (
        Vec::<i64>::try_from(g.responses.flatten(0, -1)).unwrap(),
        Vec::<i64>::try_from(g.response_mask.flatten(0, -1)).unwrap(),
        Vec::<f32>::try_from(g.log_probs.unwrap().flatten(0, -1)).unwrap(),
        stats.preemptions,
    )
}

#[test]
fn sharded_engine_equals_the_whole_model_under_preemption() {
    tch::manual_seed(3);
    let full = Transformer::new(config(), &ModelOptions::default()).unwrap();
    let sampled = SamplingParams {
        n: 3,
        max_new_tokens: 12,
        temperature: 0.9,
        seed: Some(7),
        eos_token_ids: vec![2],
        return_log_probs: true,
        ..SamplingParams::default()
    };
    let greedy = SamplingParams {
        do_sample: false,
        ..sampled.clone()
    };
    let engines = [
        EngineConfig::default(),
        // Room for about three sequences at once: preemptions and recomputation.
        EngineConfig {
            block_size: 4,
            kv_cache_tokens: Some(60),
            max_prefill_tokens: 16,
            ..EngineConfig::default()
        },
    ];
    let cases: Vec<(SamplingParams, EngineConfig)> = [&sampled, &greedy]
        .iter()
        .flat_map(|p| engines.iter().map(move |e| ((*p).clone(), e.clone())))
        .collect();
    let want: Vec<Out> = cases.iter().map(|(p, e)| run(&full, p, e)).collect();
    assert!(want[1].3 > 0, "the small KV budget preempts");
    let handles: Vec<_> = ThreadComm::group(2)
        .into_iter()
        .map(|comm| {
            let weights: Vec<(String, Tensor)> = full
                .named_parameters()
                .iter()
                .map(|(n, t)| (n.clone(), t.detach().copy()))
                .collect();
            let cases = cases.clone();
            std::thread::spawn(move || {
                let rank = comm.rank;
                let m = Transformer::tp_shard(config(), &ModelOptions::default(), Arc::new(comm))
                    .unwrap();
                for (name, dst) in m.named_parameters() {
                    let w = &weights.iter().find(|(n, _)| n == name).unwrap().1;
                    tch::no_grad(|| dst.shallow_clone().copy_(&shard_of(w, name, rank, 2)));
                }
                assert_eq!(m.shard_config().num_key_value_heads, 1);
                cases
                    .iter()
                    .map(|(p, e)| run(&m, p, e))
                    .collect::<Vec<Out>>()
            })
        })
        .collect();
    for (rank, h) in handles.into_iter().enumerate() {
        let got = h.join().unwrap();
        for (k, (w, g)) in want.iter().zip(&got).enumerate() {
            assert_eq!(w.0, g.0, "rank {rank} case {k}: tokens");
            assert_eq!(w.1, g.1, "rank {rank} case {k}: masks");
            assert_eq!(w.3, g.3, "rank {rank} case {k}: preemptions");
            let d =
                w.2.iter()
                    .zip(&g.2)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
            eprintln!(
                "rank {rank} case {k}: log-prob diff {d:e}, preemptions {}",
                g.3
            );
            assert!(d < 1e-4, "rank {rank} case {k}: log-probs differ by {d}");
        }
    }
}

#[test]
fn a_sharded_model_needs_a_seed() {
    let comm = ThreadComm::group(2).remove(0);
    // Size 2, but never run a collective: the seed check comes first.
    let m = Transformer::tp_shard(config(), &ModelOptions::default(), Arc::new(comm)).unwrap();
    let prompts = Tensor::from_slice(&[5i64, 6]).view([1, 2]);
    let mask = prompts.ones_like();
    let params = SamplingParams {
        seed: None,
        ..SamplingParams::default()
    };
    let e = verl_rollout::generate(&m, &prompts, &mask, &params)
        .unwrap_err()
        .to_string();
    assert!(e.contains("SamplingParams.seed"), "{e}");
}
