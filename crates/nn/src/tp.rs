//! Tensor-parallel inference: a [`Transformer`](crate::Transformer) that holds one rank's shard of
//! the weights (Megatron's layout) and combines partial results through a [`TpComm`].
//!
//! The layout is Megatron's, the one a tensor-parallel training backend already holds:
//!
//! * q/k/v and gate/up are column-parallel: rank `r` holds rows `r·n/tp..(r+1)·n/tp` of each
//!   matrix (whole attention heads, whole key/value heads, a block of MLP columns), so attention
//!   and SwiGLU run on local heads / columns only;
//! * o_proj and down_proj are row-parallel: rank `r` holds the matching block of input columns,
//!   its product is a partial sum that is all-reduced; their bias is replicated and added once,
//!   after the reduction;
//! * the embedding and the LM head are vocab-parallel: rank `r` holds vocabulary rows
//!   `r·V/tp..(r+1)·V/tp`; out-of-shard token ids embed to zero and the partial embeddings are
//!   all-reduced; the local logits `[.., V/tp]` are all-gathered along the vocabulary so every rank
//!   holds the full logits (and samples the same tokens);
//! * norms (and q/k norms) are replicated.
//!
//! A sharded model is for inference only (no autograd through the collectives) and for dense
//! models (a MoE block is not split here). Every rank must run the same forwards in the same
//! order: each forward makes `2 × layers + 1` all-reduces and, for the LM head, one all-gather.

use std::sync::Arc;

use tch::Tensor;

use crate::config::ModelConfig;
use crate::error::{NnError, Result};

/// The collectives of a tensor-parallel group, as a sharded model needs them. Implemented by a
/// training backend over its communicator; every member calls each method in the same order.
pub trait TpComm: Send + Sync {
    /// This rank's index in the tensor-parallel group, `0..size()`.
    fn rank(&self) -> usize;
    /// The tensor-parallel size.
    fn size(&self) -> usize;
    /// The elementwise sum of every member's `t` (same shape and dtype everywhere), returned on
    /// every member. The result must be bitwise identical on all members (a reduce-scatter +
    /// all-gather or a fixed-order sum both are), so that ranks stay in lock-step.
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor>;
    /// Every member's `t` concatenated along the last dimension, in rank order.
    fn all_gather_last(&self, t: &Tensor) -> Result<Tensor>;
}

/// The dimension a parameter (by HF name) is split along in the tensor-parallel layout above:
/// 0 for column-parallel and vocabulary-parallel tensors (q/k/v, gate/up, embedding, LM head), 1
/// for the row-parallel matrices (o_proj, down_proj), `None` for replicated ones (norms,
/// row-parallel biases). Block `r` of `size` along that dimension is rank `r`'s shard, so `k`
/// consecutive shards of a size-`tp` layout concatenate into one shard of the size-`tp / k`
/// layout, and a shard splits into `m` consecutive shards of the size-`tp × m` layout.
pub fn split_dim(name: &str) -> Option<i64> {
    if name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight") {
        Some(1)
    } else if name.contains("q_proj")
        || name.contains("k_proj")
        || name.contains("v_proj")
        || name.contains("gate_proj")
        || name.contains("up_proj")
        || name.contains("embed_tokens")
        || name.starts_with("lm_head")
    {
        Some(0)
    } else {
        None
    }
}

/// Rank `rank`'s shard (of `size`) of `t`, a whole tensor or a coarser shard of parameter
/// `name`: block `rank` along [`split_dim`] (a view, no copy), or `t` itself when replicated.
pub fn shard_of(t: &Tensor, name: &str, rank: usize, size: usize) -> Result<Tensor> {
    let Some(d) = split_dim(name) else {
        return Ok(t.shallow_clone());
    };
    let n = t.size()[d as usize];
    if size == 0 || n % size as i64 != 0 {
        return Err(NnError::input(
            format!("tensor-parallel split of `{name}`"),
            format!("a dimension {d} divisible by {size}"),
            format!("shape {:?}", t.size()),
        ));
    }
    let n = n / size as i64;
    Ok(t.f_narrow(d, rank as i64 * n, n)?)
}

/// One rank's view of a sharded model: the communicator and the vocabulary rows it holds.
#[derive(Clone)]
pub(crate) struct TpShard {
    pub comm: Arc<dyn TpComm>,
    pub vocab_start: i64,
    pub vocab_local: i64,
    /// The config the layers were built with (heads, key/value heads, MLP columns and vocabulary
    /// divided by the tensor-parallel size).
    pub local: ModelConfig,
}

impl std::fmt::Debug for TpShard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TpShard")
            .field("rank", &self.comm.rank())
            .field("size", &self.comm.size())
            .field("vocab_start", &self.vocab_start)
            .field("vocab_local", &self.vocab_local)
            .finish()
    }
}

/// The per-rank config of `cfg` split `tp` ways, with a clear error for what cannot be split.
pub(crate) fn local_config(cfg: &ModelConfig, tp: usize, rank: usize) -> Result<ModelConfig> {
    if tp == 0 || rank >= tp {
        return Err(NnError::input(
            "tensor-parallel communicator",
            "rank < size, size >= 1",
            format!("rank {rank} of {tp}"),
        ));
    }
    if cfg.moe.is_some() {
        return Err(NnError::input(
            "tensor-parallel model",
            "a dense model (MoE blocks are not split by Transformer::tp_shard)",
            cfg.arch.model_type().to_string(),
        ));
    }
    let t = tp as i64;
    for (what, n) in [
        ("num_attention_heads", cfg.num_attention_heads),
        ("num_key_value_heads", cfg.num_key_value_heads),
        ("intermediate_size", cfg.intermediate_size),
        ("vocab_size", cfg.vocab_size),
    ] {
        if n % t != 0 {
            return Err(NnError::input(
                format!("tensor-parallel size for `{what}`"),
                format!("a divisor of {what}={n}"),
                tp.to_string(),
            ));
        }
    }
    let mut local = cfg.clone();
    local.num_attention_heads /= t;
    local.num_key_value_heads /= t;
    local.intermediate_size /= t;
    local.vocab_size /= t;
    // The padding row (only the embedding's backward reads it) is a local row, or none.
    let start = rank as i64 * local.vocab_size;
    local.pad_token_id = cfg
        .pad_token_id
        .filter(|&p| p >= start && p < start + local.vocab_size)
        .map(|p| p - start);
    Ok(local)
}

impl TpShard {
    /// The vocab-parallel embedding: local rows, out-of-shard ids masked to zero, summed over the
    /// group.
    pub fn embed(&self, weight: &Tensor, ids: &Tensor, padding_idx: i64) -> Result<Tensor> {
        let end = self.vocab_start + self.vocab_local;
        let in_range = ids.f_ge(self.vocab_start)?.f_logical_and(&ids.f_lt(end)?)?;
        let local = ids
            .f_sub_scalar(self.vocab_start)?
            .f_mul(&in_range.f_to_kind(tch::Kind::Int64)?)?;
        let e = Tensor::f_embedding(weight, &local, padding_idx, false, false)?;
        let e = e.f_mul(&in_range.f_unsqueeze(-1)?.f_to_kind(e.kind())?)?;
        self.comm.all_reduce_sum(&e)
    }

    /// A row-parallel output: the partial sums reduced, then the replicated bias added once.
    pub fn reduce_with_bias(&self, partial: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        let s = self.comm.all_reduce_sum(partial)?;
        match bias {
            Some(b) => Ok(s.f_add(b)?),
            None => Ok(s),
        }
    }

    /// Local `[.., V/tp]` logits -> full `[.., V]` on every rank.
    pub fn gather_vocab(&self, logits: &Tensor) -> Result<Tensor> {
        self.comm.all_gather_last(logits)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    //! A sharded model run by two threads over an in-process communicator against the full one.

    use super::*;
    use crate::{ModelOptions, Transformer};
    use std::sync::{Barrier, Mutex};
    use tch::Kind;

    /// Ranks as threads: every collective deposits its input, waits for the others, then each
    /// member combines the deposits in rank order (so the result is identical everywhere).
    pub(crate) struct ThreadComm {
        rank: usize,
        shared: Arc<Shared>,
    }

    pub(crate) struct Shared {
        size: usize,
        slots: Mutex<Vec<Option<Tensor>>>,
        barrier: Barrier,
    }

    impl ThreadComm {
        pub fn group(size: usize) -> Vec<ThreadComm> {
            let shared = Arc::new(Shared {
                size,
                slots: Mutex::new((0..size).map(|_| None).collect()),
                barrier: Barrier::new(size),
            });
            (0..size)
                .map(|rank| ThreadComm {
                    rank,
                    shared: shared.clone(),
                })
                .collect()
        }

        fn exchange(&self, t: &Tensor) -> Vec<Tensor> {
            self.shared.slots.lock().unwrap()[self.rank] = Some(t.copy());
            self.shared.barrier.wait();
            let all: Vec<Tensor> = self
                .shared
                .slots
                .lock()
                .unwrap()
                .iter()
                .map(|s| s.as_ref().unwrap().copy())
                .collect();
            self.shared.barrier.wait();
            all
        }
    }

    impl TpComm for ThreadComm {
        fn rank(&self) -> usize {
            self.rank
        }
        fn size(&self) -> usize {
            self.shared.size
        }
        fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
            let all = self.exchange(t);
            let mut s = all[0].copy();
            for x in &all[1..] {
                s = s.f_add(x)?;
            }
            Ok(s)
        }
        fn all_gather_last(&self, t: &Tensor) -> Result<Tensor> {
            let all = self.exchange(t);
            Ok(Tensor::f_cat(&all, -1)?)
        }
    }

    fn config(bias: bool, tied: bool) -> ModelConfig {
        ModelConfig::from_value(
            serde_json::json!({
                "model_type": "llama", "vocab_size": 40, "hidden_size": 16,
                "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "initializer_range": 0.2, "pad_token_id": 0,
                "attention_bias": bias, "mlp_bias": bias, "tie_word_embeddings": tied,
                "max_position_embeddings": 64,
            }),
            "inline/config.json",
        )
        .unwrap()
    }

    fn random_biases(m: &Transformer) {
        tch::no_grad(|| {
            for (name, p) in m.named_parameters() {
                if name.ends_with(".bias") {
                    let _ = p.shallow_clone().f_normal_(0.0, 0.3).unwrap();
                }
            }
        });
    }

    fn check(bias: bool, tied: bool) {
        tch::manual_seed(11);
        let cfg = config(bias, tied);
        let full = Transformer::new(cfg.clone(), &ModelOptions::default()).unwrap();
        random_biases(&full);
        let ids = Tensor::from_slice(&[3i64, 17, 39, 0, 22, 8, 20, 21, 1, 5, 19, 30]).view([2, 6]);
        let mask = Tensor::from_slice(&[0i64, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]).view([2, 6]);
        let want = tch::no_grad(|| full.forward(&ids, Some(&mask), None, None)).unwrap();
        let want_greedy = full.generate_greedy(&ids, Some(&mask), 5, true).unwrap();
        let handles: Vec<_> = ThreadComm::group(2)
            .into_iter()
            .map(|comm| {
                let weights: Vec<(String, Tensor)> = full
                    .named_parameters()
                    .iter()
                    .map(|(n, t)| (n.clone(), t.detach().copy()))
                    .collect();
                let cfg = cfg.clone();
                let (ids, mask) = (ids.copy(), mask.copy());
                std::thread::spawn(move || {
                    let rank = comm.rank;
                    let m = Transformer::tp_shard(cfg, &ModelOptions::default(), Arc::new(comm))
                        .unwrap();
                    assert_eq!((m.tp_size(), m.tp_rank()), (2, rank));
                    for (name, dst) in m.named_parameters() {
                        let full = &weights.iter().find(|(n, _)| n == name).unwrap().1;
                        let local = shard_like(full, name, rank, 2);
                        assert_eq!(dst.size(), local.size(), "{name}");
                        tch::no_grad(|| dst.shallow_clone().copy_(&local));
                    }
                    let logits = tch::no_grad(|| m.forward(&ids, Some(&mask), None, None)).unwrap();
                    let greedy = m.generate_greedy(&ids, Some(&mask), 5, true).unwrap();
                    (logits, greedy, m.shard_config().num_key_value_heads)
                })
            })
            .collect();
        for h in handles {
            let (logits, greedy, kv) = h.join().unwrap();
            assert_eq!(kv, 1);
            let valid = mask.unsqueeze(-1).to_kind(Kind::Float);
            let d = ((&logits - &want) * &valid).abs().max().double_value(&[]);
            eprintln!("bias {bias} tied {tied}: sharded vs full logits max diff {d:e}");
            assert!(d < 1e-5, "bias {bias} tied {tied}: logits differ by {d}");
            assert_eq!(greedy, want_greedy);
        }
    }

    /// Megatron's split of a full HF tensor for rank `rank` of `size`.
    pub(crate) fn shard_like(full: &Tensor, name: &str, rank: usize, size: usize) -> Tensor {
        super::shard_of(full, name, rank, size).unwrap().copy()
    }

    #[test]
    fn sharded_forward_equals_full_forward() {
        check(false, false);
    }

    #[test]
    fn sharded_forward_with_biases_and_tied_head_equals_full_forward() {
        check(true, true);
    }

    #[test]
    fn sharding_refuses_a_size_that_does_not_divide() {
        let cfg = config(false, false);
        let comm = ThreadComm::group(3).pop().unwrap();
        let e = Transformer::tp_shard(cfg, &ModelOptions::default(), Arc::new(comm)).unwrap_err();
        assert!(e.to_string().contains("num_attention_heads=4"), "{e}");
    }

    #[test]
    fn a_shard_has_no_backward() {
        let comm = ThreadComm::group(1).pop().unwrap();
        let m = Transformer::tp_shard(
            config(false, false),
            &ModelOptions::default(),
            Arc::new(comm),
        )
        .unwrap();
        let ids = Tensor::from_slice(&[3i64, 4]).view([1, 2]);
        let e = m
            .forward_backward(&ids, None, None, |x| Ok(x.sum(Kind::Float)))
            .unwrap_err();
        assert!(e.to_string().contains("inference only"), "{e}");
    }
}
