//! Generation at its own parallel layout (the prompt side of HybridFlow's 3D-HybridEngine).
//!
//! Training splits the job's ranks into data replicas (every rank of a replica gets the same
//! prompts from its host: the tensor × pipeline ranks of one Megatron replica, or each FSDP rank
//! alone); generation splits the same ranks into rollout groups of `rollout TP` ranks that run
//! the engine together on one tensor-parallel shard each. [`share`] hands every rollout group an
//! even, contiguous share of the whole batch (all replicas' prompts, in replica order), with the
//! request seeds those prompts have in one call over the whole batch, so no prompt is generated
//! twice and the tokens do not depend on the layout. [`Shared::gather_back`] then returns to each
//! rank the rows of its own replica's prompts, in the order one call over them gives.

use std::sync::Arc;

use tch::{Device, Kind, Tensor};
use verl_comm::ReduceOp;
use verl_nn::{NnError, TpComm};
use verl_rollout::{FinishReason, Generation, GenerationStats};

use crate::dp::Dp;
use crate::error::{BackendError, Result, TorchContext};
use crate::generation::{i64_vec, GenerateCall};

/// Where a rank stands in the two layouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// The training data replica whose prompts this rank's host passes (same on its peers).
    pub replica: usize,
    /// The rollout group this rank generates with, of `groups`.
    pub group: usize,
    pub groups: usize,
    /// This rank's index in its rollout group (its tensor-parallel shard); the outputs of index 0
    /// are the group's.
    pub tp_rank: usize,
}

/// A [`TpComm`] over a rollout tensor-parallel group.
pub struct DpTpComm(pub Arc<Dp>);

fn comm_err(what: &str, e: BackendError) -> NnError {
    NnError::InvalidInput {
        what: format!("rollout tensor-parallel {what}"),
        expected: "a completed collective".into(),
        found: e.to_string(),
    }
}

impl TpComm for DpTpComm {
    fn rank(&self) -> usize {
        self.0.rank
    }
    fn size(&self) -> usize {
        self.0.size
    }
    fn all_reduce_sum(&self, t: &Tensor) -> verl_nn::Result<Tensor> {
        let mut s = t.f_contiguous()?.f_detach_copy()?;
        self.0
            .all_reduce_tensor(&mut s, ReduceOp::Sum, "all_reduce (generation)")
            .map_err(|e| comm_err("all-reduce", e))?;
        Ok(s)
    }
    fn all_gather_last(&self, t: &Tensor) -> verl_nn::Result<Tensor> {
        let parts = self
            .0
            .all_gather(t, "all_gather (generation logits)")
            .map_err(|e| comm_err("all-gather", e))?;
        Ok(Tensor::f_cat(&parts, -1)?)
    }
}

/// The config key choosing the rollout tensor-parallel size.
pub const ROLLOUT_TP_KEY: &str = "actor_rollout_ref.rollout.tensor_model_parallel_size";

/// The rollout tensor-parallel sizes `model` splits into: those dividing its heads, key/value
/// heads, MLP width and vocabulary.
pub fn model_allows(model: &verl_nn::ModelConfig, tp: usize) -> bool {
    let t = tp as i64;
    [
        model.num_attention_heads,
        model.num_key_value_heads,
        model.intermediate_size,
        model.vocab_size,
    ]
    .iter()
    .all(|n| n % t == 0)
}

/// `actor_rollout_ref.rollout.tensor_model_parallel_size` for a data-parallel backend of `world`
/// ranks: rollout groups of that many consecutive ranks. Any divisor of the world that the model
/// splits into; absent, null or 1: each rank generates its own prompts on the whole model.
/// `tp1_because` names what makes this job generate at TP 1 whatever was asked (a warning when
/// more was). verl's default 2 on an odd number of ranks is taken as 1 (a warning on several
/// ranks); a size the ranks split into but the model's heads do not becomes the largest divisor
/// of it that fits both (a warning); any other size is refused.
pub fn data_parallel_rollout_tp(
    cfg: &serde_json::Value,
    world: usize,
    model: &verl_nn::ModelConfig,
    tp1_because: Option<&str>,
) -> Result<usize> {
    let asked = match cfg.pointer("/actor_rollout_ref/rollout/tensor_model_parallel_size") {
        None | Some(serde_json::Value::Null) => 1,
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 => n as usize,
            _ => {
                return Err(BackendError::config(
                    ROLLOUT_TP_KEY,
                    "a positive integer (or null: 1)",
                    v,
                ))
            }
        },
    };
    if asked == 1 {
        return Ok(1);
    }
    if let Some(why) = tp1_because {
        tracing::warn!(
            "{ROLLOUT_TP_KEY}={asked}: {why} generates at rollout TP 1 (each rank its own \
             prompts on the whole model: the same tokens, only the speed differs); set it to 1 \
             to silence this"
        );
        return Ok(1);
    }
    let valid: Vec<usize> = (1..=world)
        .filter(|&r| world.is_multiple_of(r) && model_allows(model, r))
        .collect();
    if valid.contains(&asked) {
        return Ok(asked);
    }
    if asked == 2 && !world.is_multiple_of(2) {
        // verl's default, filled in for every job that leaves the key alone.
        if world > 1 {
            tracing::warn!(
                "{ROLLOUT_TP_KEY}=2 (verl's default) does not divide {world} ranks: taken as \
                 unset, each rank generates its own prompts at TP 1; set it to one of {valid:?} \
                 to silence this"
            );
        }
        return Ok(1);
    }
    if world.is_multiple_of(asked) {
        return Ok(fit_model(asked, &valid, model));
    }
    Err(BackendError::config(
        ROLLOUT_TP_KEY,
        format!(
            "one of {valid:?}: a divisor of the {world} data-parallel ranks that divides the \
             model's heads, key/value heads, MLP width and vocabulary"
        ),
        asked,
    ))
}

/// A rollout TP `asked` that the ranks take but `model`'s heads do not (vLLM would replicate
/// key/value heads; verl-rs does not): the largest of the `valid` sizes dividing it, with one
/// warning, as the same tokens come out at any size.
pub fn fit_model(asked: usize, valid: &[usize], model: &verl_nn::ModelConfig) -> usize {
    let fit = valid
        .iter()
        .copied()
        .filter(|r| asked.is_multiple_of(*r))
        .max()
        .unwrap_or(1);
    tracing::warn!(
        "{ROLLOUT_TP_KEY}={asked}: the model's heads ({} attention, {} key/value), MLP width {} or \
         vocabulary {} do not split {asked} ways (verl-rs does not replicate key/value heads); \
         generation runs at tensor-parallel size {fit} (the same tokens, only the speed \
         differs); set it to one of {valid:?} to silence this",
        model.num_attention_heads,
        model.num_key_value_heads,
        model.intermediate_size,
        model.vocab_size
    );
    fit
}

/// Rollout groups of `tp` consecutive ranks of `world`, each rank its own data replica.
pub fn data_parallel_placement(rank: usize, world: usize, tp: usize) -> Placement {
    Placement {
        replica: rank,
        group: rank / tp,
        groups: world / tp,
        tp_rank: rank % tp,
    }
}

/// The rollout groups of [`data_parallel_placement`], as rank lists.
pub fn data_parallel_groups(world: usize, tp: usize) -> Vec<Vec<usize>> {
    (0..world / tp)
        .map(|g| (g * tp..(g + 1) * tp).collect())
        .collect()
}

/// One replica's prompts in the whole batch.
#[derive(Debug, Clone, Copy)]
struct Replica {
    id: usize,
    /// First row in the whole batch (replicas concatenated in id order).
    start: usize,
    rows: usize,
}

/// This rank's share of a generate call (see the module docs).
pub struct Shared {
    /// What this rank's rollout group generates: its share of the whole batch, with request seeds.
    pub call: GenerateCall,
    /// First row of that share in the whole batch.
    start: usize,
    /// The replicas in batch order, and which one is this rank's.
    replicas: Vec<Replica>,
    mine: usize,
    /// Per rank: whether its outputs are read (index 0 of its rollout group).
    readers: Vec<bool>,
    max_new_tokens: usize,
}

const META: usize = 8;

/// Splits `call` (this rank's replica's prompts, `row_offset` their first global index) over the
/// rollout groups of `world` (every rank of the job) as `place` says; every rank calls it
/// together. The whole batch's prompts are exchanged with one all-gather (token ids, small next to
/// the weights).
pub fn share(call: &GenerateCall, world: &Dp, place: Placement) -> Result<Shared> {
    const WHAT: &str = "all_gather (rollout prompts)";
    let seed = call.params.seed.ok_or_else(|| {
        BackendError::Api(verl_plugin_api::Error::failed(
            "internal: a shared generate call needs a seed",
        ))
    })?;
    let (rows, width) = (call.ids.size()[0], call.ids.size()[1]);
    let meta = [
        place.replica as i64,
        rows,
        width,
        call.params.row_offset as i64,
        place.group as i64,
        place.groups as i64,
        place.tp_rank as i64,
        seed as i64,
    ];
    let metas = world.all_gather_rows(
        &Tensor::f_from_slice(&meta)
            .and_then(|t| t.f_view([1, META as i64]))
            .ctx(WHAT)?,
        WHAT,
    )?;
    let metas: Vec<Vec<i64>> = metas.iter().map(i64_vec).collect::<Result<_>>()?;
    let bad = |what: String| BackendError::Api(verl_plugin_api::Error::failed(what));
    // The replicas, each from its first rank, in id order.
    let mut ids: Vec<usize> = metas.iter().map(|m| m[0] as usize).collect();
    ids.sort_unstable();
    ids.dedup();
    let mut replicas = Vec::new();
    let mut start = 0;
    let mut offsets = Vec::new();
    for &id in &ids {
        let first = metas.iter().find(|m| m[0] as usize == id).expect("listed");
        for (r, m) in metas.iter().enumerate() {
            if m[0] as usize == id && (m[1] != first[1] || m[3] != first[3]) {
                return Err(bad(format!(
                    "rank {r} of data replica {id} was given {} prompts from index {}, its peers \
                     {} from index {}: every rank of a replica must get the same prompts",
                    m[1], m[3], first[1], first[3]
                )));
            }
        }
        replicas.push(Replica {
            id,
            start,
            rows: first[1] as usize,
        });
        offsets.push(first[3] as u64);
        start += first[1] as usize;
    }
    for (r, m) in metas.iter().enumerate() {
        if m[5] != place.groups as i64 || m[7] != seed as i64 {
            return Err(bad(format!(
                "rank {r} generates in {} rollout groups with seed {}, this rank in {} with seed \
                 {seed}",
                m[5], m[7] as u64, place.groups
            )));
        }
    }
    let total = start;
    let mine = replicas
        .iter()
        .position(|r| r.id == place.replica)
        .expect("own replica listed");
    // Every rank's prompts as `[rows, 2 * P]` (ids, then mask), left-padded to the widest.
    let p = metas.iter().map(|m| m[2]).max().unwrap_or(width);
    let left = |t: &Tensor| -> Result<Tensor> {
        let t = t.f_to_kind(Kind::Int64).ctx(WHAT)?;
        match width < p {
            true => t.f_constant_pad_nd([p - width, 0]).ctx(WHAT),
            false => Ok(t),
        }
    };
    let both = Tensor::f_cat(&[left(&call.ids)?, left(&call.mask)?], 1).ctx(WHAT)?;
    let all = world.all_gather_rows(&both, WHAT)?;
    let first_rank = |id: usize| {
        metas
            .iter()
            .position(|m| m[0] as usize == id)
            .expect("listed")
    };
    let whole = Tensor::f_cat(
        &replicas
            .iter()
            .map(|r| all[first_rank(r.id)].shallow_clone())
            .collect::<Vec<_>>(),
        0,
    )
    .ctx(WHAT)?;
    let (g, groups) = (place.group, place.groups.max(1));
    let (lo, hi) = (g * total / groups, (g + 1) * total / groups);
    let device = call.ids.device();
    let chunk = whole
        .f_narrow(0, lo as i64, (hi - lo) as i64)
        .and_then(|c| c.f_to_device(device))
        .ctx(WHAT)?;
    let global_index = |row: usize| -> u64 {
        let k = replicas
            .iter()
            .rposition(|r| r.start <= row)
            .expect("row in the batch");
        offsets[k] + (row - replicas[k].start) as u64
    };
    let seeds = (lo..hi)
        .map(|row| verl_rollout::prompt_seed(seed, global_index(row)))
        .collect();
    let readers = metas.iter().map(|m| m[6] == 0).collect();
    Ok(Shared {
        call: GenerateCall {
            ids: chunk.f_narrow(1, 0, p).ctx(WHAT)?,
            mask: chunk.f_narrow(1, p, p).ctx(WHAT)?,
            params: call.params.clone(),
            request_seeds: Some(seeds),
        },
        start: lo,
        replicas,
        mine,
        readers,
        max_new_tokens: call.params.max_new_tokens,
    })
}

impl Shared {
    /// Prompts this rank's rollout group generates (0 when the batch has fewer prompts than
    /// there are groups).
    pub fn prompts(&self) -> usize {
        self.call.ids.size()[0] as usize
    }

    /// Runs `f` on the share's call, or returns an empty generation for an empty share (every
    /// member of the group then skips together).
    pub fn run(
        &self,
        f: impl FnOnce(&GenerateCall) -> Result<(Generation, GenerationStats)>,
    ) -> Result<(Generation, GenerationStats)> {
        if self.prompts() > 0 {
            return f(&self.call);
        }
        let l = self.max_new_tokens as i64;
        let device = self.call.ids.device();
        let zeros = |k| Tensor::f_zeros([0, l], (k, device)).ctx("empty generation");
        Ok((
            Generation {
                responses: zeros(Kind::Int64)?,
                response_mask: zeros(Kind::Int64)?,
                log_probs: match self.call.params.return_log_probs {
                    true => Some(zeros(Kind::Float)?),
                    false => None,
                },
                finish_reasons: Vec::new(),
                prompt_index: Vec::new(),
                sampled_mask: None,
            },
            GenerationStats::default(),
        ))
    }

    /// Every rollout group's output exchanged (one all-gather of token ids and masks, one of
    /// log-probs), and the rows of this rank's replica kept: prompt by prompt, each prompt's
    /// samples in the order its group produced them, `prompt_index` local to the replica.
    pub fn gather_back(&self, gen: &Generation, world: &Dp) -> Result<Generation> {
        const WHAT: &str = "all_gather (rollout outputs)";
        let l = self.max_new_tokens as i64;
        let rows = gen.prompt_index.len() as i64;
        let device = gen.responses.device();
        let on = |t: &Tensor| t.f_to_device(device).and_then(|t| t.f_to_kind(Kind::Int64));
        let reasons: Vec<i64> = gen
            .finish_reasons
            .iter()
            .map(|r| (*r == FinishReason::Stop) as i64)
            .collect();
        let index: Vec<i64> = gen
            .prompt_index
            .iter()
            .map(|&i| i + self.start as i64)
            .collect();
        let col = |v: &[i64]| {
            Tensor::f_from_slice(v)
                .and_then(|t| t.f_to_device(device))
                .and_then(|t| t.f_view([rows, 1]))
        };
        let sampled = match &gen.sampled_mask {
            Some(s) => on(s),
            None => Tensor::f_zeros([rows, l], (Kind::Int64, device)),
        };
        let packed = Tensor::f_cat(
            &[
                on(&gen.responses).ctx(WHAT)?,
                on(&gen.response_mask).ctx(WHAT)?,
                sampled.ctx(WHAT)?,
                col(&reasons).ctx(WHAT)?,
                col(&index).ctx(WHAT)?,
            ],
            1,
        )
        .ctx(WHAT)?;
        let packs = world.all_gather_rows(&packed, WHAT)?;
        let lps = match &gen.log_probs {
            Some(lp) => Some(world.all_gather_rows(&lp.f_to_kind(Kind::Float).ctx(WHAT)?, WHAT)?),
            None => None,
        };
        let r = self.replicas[self.mine];
        let (lo, hi) = (r.start as i64, (r.start + r.rows) as i64);
        // (global prompt, source rank, row) of every kept row, sorted by prompt: a stable sort
        // keeps each prompt's samples in their group's order.
        let mut picked: Vec<(i64, usize, i64)> = Vec::new();
        let mut host_packs = Vec::with_capacity(packs.len());
        for (rank, pack) in packs.iter().enumerate() {
            let pack = pack.f_to_device(Device::Cpu).ctx(WHAT)?;
            if self.readers[rank] {
                let idx = i64_vec(&pack.f_select(1, 3 * l + 1).ctx(WHAT)?)?;
                for (row, &g) in idx.iter().enumerate() {
                    if (lo..hi).contains(&g) {
                        picked.push((g, rank, row as i64));
                    }
                }
            }
            host_packs.push(pack);
        }
        picked.sort_by_key(|&(g, _, _)| g);
        let take = |parts: &[Tensor]| -> Result<Tensor> {
            let rows: Vec<Tensor> = picked
                .iter()
                .map(|&(_, rank, row)| parts[rank].f_select(0, row))
                .collect::<std::result::Result<_, _>>()
                .ctx(WHAT)?;
            match rows.is_empty() {
                true => Tensor::f_zeros([0, parts[0].size()[1]], (parts[0].kind(), Device::Cpu))
                    .ctx(WHAT),
                false => Tensor::f_stack(&rows, 0)
                    .and_then(|t| t.f_to_device(device))
                    .ctx(WHAT),
            }
        };
        let mine = take(&host_packs)?;
        let part = |k: i64| mine.f_narrow(1, k * l, l).ctx(WHAT);
        let log_probs = match lps {
            Some(parts) => {
                let host: Vec<Tensor> = parts
                    .iter()
                    .map(|t| t.f_to_device(Device::Cpu))
                    .collect::<std::result::Result<_, _>>()
                    .ctx(WHAT)?;
                Some(take(&host)?)
            }
            None => None,
        };
        let tail =
            |k: i64| -> Result<Vec<i64>> { i64_vec(&mine.f_select(1, 3 * l + k).ctx(WHAT)?) };
        Ok(Generation {
            responses: part(0)?,
            response_mask: part(1)?,
            sampled_mask: match gen.sampled_mask {
                Some(_) => Some(part(2)?),
                None => None,
            },
            log_probs,
            finish_reasons: tail(0)?
                .into_iter()
                .map(|s| match s {
                    1 => FinishReason::Stop,
                    _ => FinishReason::Length,
                })
                .collect(),
            prompt_index: tail(1)?.into_iter().map(|g| g - lo).collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn model(kv: i64) -> verl_nn::ModelConfig {
        verl_nn::ModelConfig::from_value(
            json!({
                "model_type": "qwen2", "vocab_size": 40, "hidden_size": 16,
                "intermediate_size": 40, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": kv,
            }),
            "inline/config.json",
        )
        .unwrap()
    }

    fn tp(v: serde_json::Value, world: usize, kv: i64, why: Option<&str>) -> Result<usize> {
        let cfg = json!({"actor_rollout_ref": {"rollout": {"tensor_model_parallel_size": v}}});
        data_parallel_rollout_tp(&cfg, world, &model(kv), why)
    }

    #[test]
    fn data_parallel_rollout_sizes() {
        assert_eq!(tp(serde_json::Value::Null, 4, 4, None).unwrap(), 1);
        assert_eq!(tp(json!(2), 4, 4, None).unwrap(), 2);
        assert_eq!(tp(json!(4), 4, 4, None).unwrap(), 4);
        // verl's default on one rank or an odd number of ranks: unset.
        assert_eq!(tp(json!(2), 1, 4, None).unwrap(), 1);
        assert_eq!(tp(json!(2), 3, 4, None).unwrap(), 1);
        // The ranks split 4 ways, 2 key/value heads do not: the largest size that fits.
        assert_eq!(tp(json!(4), 4, 2, None).unwrap(), 2);
        // LoRA, MoE, multi-turn: TP 1.
        assert_eq!(tp(json!(4), 4, 4, Some("a LoRA actor")).unwrap(), 1);
        let e = tp(json!(3), 4, 4, None).unwrap_err().to_string();
        assert!(
            e.contains(ROLLOUT_TP_KEY) && e.contains("one of [1, 2, 4]"),
            "{e}"
        );
        let e = tp(json!(8), 4, 4, None).unwrap_err().to_string();
        assert!(e.contains("found 8"), "{e}");
        let e = tp(json!("x"), 4, 4, None).unwrap_err().to_string();
        assert!(e.contains("positive integer"), "{e}");
    }

    #[test]
    fn data_parallel_groups_are_consecutive_ranks() {
        assert_eq!(data_parallel_groups(4, 2), vec![vec![0, 1], vec![2, 3]]);
        let p = data_parallel_placement(3, 4, 2);
        assert_eq!((p.replica, p.group, p.groups, p.tp_rank), (3, 1, 2, 1));
    }
}
