//! The parallel layout of a role: verl's `*.megatron.*` keys, checked against the world size and the
//! model, and each rank's coordinates in it.
//!
//! Ranks are ordered like Megatron-core's default `tp-cp-ep-dp-pp`: the tensor-parallel index varies
//! fastest, then context-parallel, then data-parallel, and the pipeline stage slowest, so the ranks of
//! one tensor-parallel group are neighbours (one node, the fastest links).
//!
//! A mixture-of-experts model's routed experts use Megatron-core's expert grid on top: within one
//! pipeline stage the tensor × data-parallel ranks are re-partitioned as expert-tensor-parallel
//! × expert-parallel × expert-data-parallel (`tp-ep-dp-pp` order: the expert-tensor-parallel
//! index varies fastest, then the expert-parallel index, then the expert-data-parallel one).

use serde::Deserialize;
use verl_nn::ModelConfig;

use crate::error::{MegatronError, Result};

/// `actor_rollout_ref.actor.megatron` / `actor_rollout_ref.ref.megatron` / `critic.megatron`, with
/// verl's defaults (`ppo_megatron_trainer.yaml`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(default)]
pub struct MegatronSection {
    pub tensor_model_parallel_size: u64,
    pub pipeline_model_parallel_size: u64,
    pub virtual_pipeline_model_parallel_size: Option<u64>,
    pub expert_model_parallel_size: u64,
    pub expert_tensor_parallel_size: Option<u64>,
    pub context_parallel_size: u64,
    pub sequence_parallel: bool,
    pub use_distributed_optimizer: bool,
    /// Parameters in host memory between calls ([`crate::offload`]).
    pub param_offload: bool,
    /// fp32 gradient buffers in host memory between updates.
    pub grad_offload: bool,
    /// fp32 masters and AdamW moments in host memory between updates.
    pub optimizer_offload: bool,
    pub seed: u64,
    /// Compute dtype of forward/backward (the optimizer always keeps fp32 master weights, as
    /// Megatron's mixed-precision optimizer does).
    pub dtype: String,
    /// verl's `override_transformer_config` (this backend reads `moe_aux_loss_coeff` and the
    /// `recompute_*` keys).
    pub override_transformer_config: serde_json::Map<String, serde_json::Value>,
}

impl Default for MegatronSection {
    fn default() -> Self {
        MegatronSection {
            tensor_model_parallel_size: 1,
            pipeline_model_parallel_size: 1,
            virtual_pipeline_model_parallel_size: None,
            expert_model_parallel_size: 1,
            expert_tensor_parallel_size: None,
            context_parallel_size: 1,
            sequence_parallel: true,
            use_distributed_optimizer: true,
            param_offload: false,
            grad_offload: false,
            optimizer_offload: false,
            seed: 42,
            dtype: "bfloat16".into(),
            override_transformer_config: serde_json::Map::new(),
        }
    }
}

/// A validated layout: the sizes of every parallel dimension (their product is the world size).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub tp: usize,
    pub cp: usize,
    pub dp: usize,
    pub pp: usize,
    /// Model chunks per pipeline stage (1 without virtual pipelining).
    pub vpp: usize,
    pub ep: usize,
    pub etp: usize,
    /// The model has routed experts (the expert groups exist).
    pub moe: bool,
    /// Megatron's sequence parallelism (only meaningful with `tp > 1`).
    pub sequence_parallel: bool,
    pub distributed_optimizer: bool,
}

/// Where one rank sits in a [`Layout`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Coords {
    pub tp: usize,
    pub cp: usize,
    pub dp: usize,
    pub pp: usize,
}

/// The divisors of `n`, ascending (for "valid values" hints).
pub fn divisors(n: u64) -> Vec<u64> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

fn list(v: &[u64]) -> String {
    v.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

impl Layout {
    /// Checks `section` (found at `prefix`, e.g. `actor_rollout_ref.actor.megatron`) against a
    /// job of `world` ranks and the model `model`. Every error names the key, shows the arithmetic
    /// and lists values that would work.
    pub fn validate(
        section: &MegatronSection,
        prefix: &str,
        world: usize,
        model: &ModelConfig,
    ) -> Result<Layout> {
        let key = |k: &str| format!("{prefix}.{k}");
        let positive = |k: &str, v: u64| -> Result<usize> {
            if v == 0 {
                return Err(MegatronError::config(key(k), "a positive integer", 0));
            }
            Ok(v as usize)
        };
        let tp = positive(
            "tensor_model_parallel_size",
            section.tensor_model_parallel_size,
        )?;
        let pp = positive(
            "pipeline_model_parallel_size",
            section.pipeline_model_parallel_size,
        )?;
        let cp = positive("context_parallel_size", section.context_parallel_size)?;
        let ep = positive(
            "expert_model_parallel_size",
            section.expert_model_parallel_size,
        )?;
        let vpp = match section.virtual_pipeline_model_parallel_size {
            None => 1,
            Some(v) => positive("virtual_pipeline_model_parallel_size", v)?,
        };
        let etp = match section.expert_tensor_parallel_size {
            None => tp,
            Some(v) => positive("expert_tensor_parallel_size", v)?,
        };
        let world64 = world as u64;
        let mp = tp * pp * cp;
        if !world.is_multiple_of(mp) {
            let rest = (pp * cp) as u64;
            let valid: Vec<u64> = if world64.is_multiple_of(rest) {
                divisors(world64 / rest)
            } else {
                vec![]
            };
            return Err(MegatronError::Layout {
                key: key("tensor_model_parallel_size"),
                message: format!(
                    "world size {world} is not a multiple of tensor_model_parallel_size={tp} × pipeline_model_parallel_size={pp} × context_parallel_size={cp} = {mp}; {}",
                    if valid.is_empty() {
                        format!("pipeline_model_parallel_size × context_parallel_size = {rest} does not divide {world} either")
                    } else {
                        format!("valid tensor_model_parallel_size with these pipeline/context sizes: {}", list(&valid))
                    }
                ),
            });
        }
        let dp = world / mp;
        let divides = |k: &str, size: usize, what: &str, n: i64, extra: &str| -> Result<()> {
            if n % size as i64 == 0 {
                return Ok(());
            }
            Err(MegatronError::Layout {
                key: key(k),
                message: format!(
                    "{k}={size} does not divide {what}={n}{extra}; valid: {}",
                    list(&divisors(n as u64))
                ),
            })
        };
        let tp_key = "tensor_model_parallel_size";
        divides(
            tp_key,
            tp,
            "num_attention_heads",
            model.num_attention_heads,
            "",
        )?;
        divides(
            tp_key,
            tp,
            "num_key_value_heads",
            model.num_key_value_heads,
            " (each rank holds whole key/value heads)",
        )?;
        divides(
            tp_key,
            tp,
            "intermediate_size",
            model.intermediate_size,
            " (gate/up are split by columns)",
        )?;
        divides(
            tp_key,
            tp,
            "vocab_size",
            model.vocab_size,
            " (the embedding and LM head are split by vocabulary rows; this backend does not pad the vocabulary)",
        )?;
        let layers = model.num_hidden_layers;
        let chunks = (pp * vpp) as i64;
        if layers % chunks != 0 {
            let valid: Vec<u64> = divisors(layers as u64)
                .into_iter()
                .filter(|d| {
                    (d * vpp as u64) as i64 <= layers && layers % (d * vpp as u64) as i64 == 0
                })
                .collect();
            return Err(MegatronError::Layout {
                key: key("pipeline_model_parallel_size"),
                message: format!(
                    "num_hidden_layers={layers} cannot be split into pipeline_model_parallel_size={pp} × virtual_pipeline_model_parallel_size={vpp} = {chunks} equal chunks; valid pipeline_model_parallel_size with this virtual size: {}",
                    list(&valid)
                ),
            });
        }
        if vpp > 1 && pp == 1 {
            return Err(MegatronError::config(
                key("virtual_pipeline_model_parallel_size"),
                "null unless pipeline_model_parallel_size > 1 (virtual stages interleave real ones)",
                vpp,
            ));
        }
        let etp = match &model.moe {
            Some(moe) => {
                Self::check_experts(
                    prefix,
                    moe.num_experts,
                    moe.expert_intermediate_size,
                    ep,
                    etp,
                    tp,
                    dp,
                    world,
                )?;
                etp
            }
            None if ep > 1 => {
                return Err(MegatronError::config(
                    key("expert_model_parallel_size"),
                    format!(
                        "1 for a dense model ({} has no experts)",
                        model.arch.model_type()
                    ),
                    ep,
                ))
            }
            // Expert tensor parallelism means nothing without experts.
            None => 1,
        };
        Ok(Layout {
            tp,
            cp,
            dp,
            pp,
            vpp,
            ep,
            etp,
            moe: model.moe.is_some(),
            sequence_parallel: section.sequence_parallel && tp > 1,
            distributed_optimizer: section.use_distributed_optimizer,
        })
    }

    /// Megatron-core's expert layout: the experts divide evenly over the expert-parallel ranks,
    /// the expert intermediate size over the expert-tensor-parallel ranks, and the expert grid
    /// `expert_tensor_parallel_size × expert_model_parallel_size × expert-data-parallel ×
    /// pipeline_model_parallel_size × context_parallel_size` covers the world, i.e. the
    /// tensor × data-parallel ranks of a stage split into whole `ETP × EP` groups.
    #[allow(clippy::too_many_arguments)]
    fn check_experts(
        prefix: &str,
        experts: i64,
        inter: i64,
        ep: usize,
        etp: usize,
        tp: usize,
        dp: usize,
        world: usize,
    ) -> Result<()> {
        let key = |k: &str| format!("{prefix}.{k}");
        let stage = (tp * dp) as u64;
        let valid_ep = |etp: usize| -> Vec<u64> {
            divisors(experts.max(1) as u64)
                .into_iter()
                .filter(|d| stage.is_multiple_of(d * etp as u64))
                .collect()
        };
        let ranks = |etp: usize| {
            if etp == tp {
                format!("data-parallel size {dp}")
            } else {
                format!(
                    "tensor_model_parallel_size={tp} × data-parallel size {dp} = {stage} ranks per stage and expert_tensor_parallel_size={etp}"
                )
            }
        };
        if experts % ep as i64 != 0 {
            return Err(MegatronError::Layout {
                key: key("expert_model_parallel_size"),
                message: format!(
                    "expert_model_parallel_size={ep} does not divide num_experts={experts} ({experts} experts / {ep} ranks = {:.2} experts per rank); valid with {}: {}",
                    experts as f64 / ep as f64,
                    ranks(etp),
                    list(&valid_ep(etp))
                ),
            });
        }
        if inter % etp as i64 != 0 {
            let valid: Vec<u64> = divisors(inter.max(1) as u64)
                .into_iter()
                .filter(|d| stage.is_multiple_of(d * ep as u64))
                .collect();
            return Err(MegatronError::Layout {
                key: key("expert_tensor_parallel_size"),
                message: format!(
                    "expert_tensor_parallel_size={etp} does not divide the expert intermediate size (moe_intermediate_size / intermediate_size of each expert) {inter} (gate/up are split by rows, down by columns); valid with expert_model_parallel_size={ep} and {stage} tensor × data-parallel ranks per stage: {}",
                    list(&valid)
                ),
            });
        }
        let pp_cp = world / (tp * dp);
        let expert_world = etp * ep * pp_cp;
        if !(tp * dp).is_multiple_of(etp * ep) {
            let valid_etp: Vec<u64> = divisors(inter.max(1) as u64)
                .into_iter()
                .filter(|d| stage.is_multiple_of(d * ep as u64))
                .collect();
            return Err(MegatronError::Layout {
                key: key("expert_model_parallel_size"),
                message: format!(
                    "world size {world} is not a multiple of expert_tensor_parallel_size={etp} × expert_model_parallel_size={ep} × pipeline_model_parallel_size × context_parallel_size={pp_cp} = {expert_world} (the expert grid re-partitions the tensor_model_parallel_size={tp} × data-parallel {dp} = {stage} ranks of each stage into expert-tensor × expert × expert-data-parallel groups: {stage} / ({etp} × {ep}) is not whole); valid: {} (expert_model_parallel_size with {}), or expert_tensor_parallel_size in {} with expert_model_parallel_size={ep}",
                    list(&valid_ep(etp)),
                    ranks(etp),
                    list(&valid_etp)
                ),
            });
        }
        Ok(())
    }

    /// This rank's local index within its stage (tensor-parallel fastest) and the stage's
    /// first global rank.
    fn stage_index(&self, c: Coords) -> (usize, usize) {
        let n = self.tp * self.cp * self.dp;
        (c.tp + self.tp * (c.cp + self.cp * c.dp), c.pp * n)
    }

    /// This rank's (expert-tensor-parallel, expert-parallel, expert-data-parallel) indices.
    pub fn expert_grid(&self, c: Coords) -> (usize, usize, usize) {
        let (etp, ep) = (self.etp.max(1), self.ep.max(1));
        let (l, _) = self.stage_index(c);
        (l % etp, (l / etp) % ep, l / (etp * ep))
    }

    /// The expert-data-parallel size: `tp · cp · dp / (etp · ep)`.
    pub fn expert_dp_size(&self) -> usize {
        (self.tp * self.cp * self.dp) / (self.etp.max(1) * self.ep.max(1))
    }

    /// The groups of the expert grid that vary index `axis` (0 = expert-tensor-parallel, 1 =
    /// expert-parallel, 2 = expert-data-parallel), every stage's, in a fixed order.
    fn expert_groups(&self, axis: usize) -> Vec<Vec<usize>> {
        let sizes = [
            self.etp.max(1),
            self.ep.max(1),
            self.expert_dp_size().max(1),
        ];
        let n = self.tp * self.cp * self.dp;
        let mut out = Vec::new();
        for pp in 0..self.pp {
            let (a, b) = match axis {
                0 => (1, 2),
                1 => (0, 2),
                _ => (0, 1),
            };
            for hi in 0..sizes[b] {
                for lo in 0..sizes[a] {
                    let group = (0..sizes[axis])
                        .map(|i| {
                            let mut idx = [0usize; 3];
                            idx[axis] = i;
                            idx[a] = lo;
                            idx[b] = hi;
                            pp * n + idx[0] + sizes[0] * (idx[1] + sizes[1] * idx[2])
                        })
                        .collect();
                    out.push(group);
                }
            }
        }
        out
    }

    /// Every expert-tensor-parallel group (`etp` consecutive ranks of one stage): each routed
    /// expert is split over it.
    pub fn etp_groups(&self) -> Vec<Vec<usize>> {
        self.expert_groups(0)
    }

    /// Every expert-parallel group: member `e` holds experts `[e·E/ep, (e+1)·E/ep)`. With
    /// `etp = tp` these are data-parallel ranks of one tensor-parallel index; with `etp = 1`
    /// and `ep = tp`, the tensor-parallel groups.
    pub fn ep_groups(&self) -> Vec<Vec<usize>> {
        self.expert_groups(1)
    }

    /// Every expert-data-parallel group: the ranks that hold the same expert shards; expert
    /// gradients are reduced and their optimizer state sharded over it.
    pub fn expert_dp_groups(&self) -> Vec<Vec<usize>> {
        self.expert_groups(2)
    }

    /// This rank's (expert-parallel, expert-data-parallel) indices.
    pub fn expert_coords(&self, c: Coords) -> (usize, usize) {
        let (_, ep, edp) = self.expert_grid(c);
        (ep, edp)
    }

    /// Whether an expert group (expert-tensor- or expert-parallel) reaches beyond one
    /// tensor-parallel group, i.e. joins ranks of different data-parallel indices: they must
    /// then run the same number of MoE forwards.
    pub fn experts_span_data_parallel(&self) -> bool {
        self.moe && !self.tp.is_multiple_of(self.etp.max(1) * self.ep.max(1))
    }

    /// Whether the expert-data-parallel group differs from the data-parallel group.
    pub fn separate_expert_dp(&self) -> bool {
        self.moe && !(self.ep <= 1 && self.etp == self.tp)
    }

    /// A one-rank layout.
    pub fn single() -> Layout {
        Layout {
            tp: 1,
            cp: 1,
            dp: 1,
            pp: 1,
            vpp: 1,
            ep: 1,
            etp: 1,
            moe: false,
            sequence_parallel: false,
            distributed_optimizer: false,
        }
    }

    pub fn world(&self) -> usize {
        self.tp * self.cp * self.dp * self.pp
    }

    /// The coordinates of global rank `rank` (tensor-parallel fastest, pipeline slowest).
    pub fn coords(&self, rank: usize) -> Coords {
        Coords {
            tp: rank % self.tp,
            cp: (rank / self.tp) % self.cp,
            dp: (rank / (self.tp * self.cp)) % self.dp,
            pp: rank / (self.tp * self.cp * self.dp),
        }
    }

    /// The global rank at `c`.
    pub fn rank_of(&self, c: Coords) -> usize {
        c.tp + self.tp * (c.cp + self.cp * (c.dp + self.dp * c.pp))
    }

    /// Every tensor-parallel group (ranks in group-rank order), in a fixed order.
    pub fn tp_groups(&self) -> Vec<Vec<usize>> {
        self.groups(|c, i| Coords { tp: i, ..c }, self.tp, |c| c.tp == 0)
    }

    /// Every data-parallel group: the ranks that hold the same model shard.
    pub fn dp_groups(&self) -> Vec<Vec<usize>> {
        self.groups(|c, i| Coords { dp: i, ..c }, self.dp, |c| c.dp == 0)
    }

    /// Every pipeline group: the stages of one model replica shard.
    pub fn pp_groups(&self) -> Vec<Vec<usize>> {
        self.groups(|c, i| Coords { pp: i, ..c }, self.pp, |c| c.pp == 0)
    }

    fn groups(
        &self,
        member: impl Fn(Coords, usize) -> Coords,
        size: usize,
        first: impl Fn(Coords) -> bool,
    ) -> Vec<Vec<usize>> {
        (0..self.world())
            .map(|r| self.coords(r))
            .filter(|c| first(*c))
            .map(|c| (0..size).map(|i| self.rank_of(member(c, i))).collect())
            .collect()
    }

    /// A short description for logs and `state.json`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "tensor_model_parallel_size": self.tp,
            "pipeline_model_parallel_size": self.pp,
            "virtual_pipeline_model_parallel_size": self.vpp,
            "context_parallel_size": self.cp,
            "expert_model_parallel_size": self.ep,
            "expert_tensor_parallel_size": self.etp,
            "data_parallel_size": self.dp,
            "sequence_parallel": self.sequence_parallel,
            "use_distributed_optimizer": self.distributed_optimizer,
        })
    }
}

/// Which pipeline stage a model is: its index among `count` stages, holding `chunks` model chunks
/// (Megatron's virtual pipeline: 1 without it). Chunk `c` of stage `i` is virtual stage
/// `c·count + i` and holds decoder layers `v·L/(count·chunks) .. (v+1)·L/(count·chunks)` of that
/// virtual stage `v` (the layout checked that `count·chunks` divides `L`). The first stage holds
/// the embedding (in its chunk 0), the last the final norm and the head (in its last chunk).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stage {
    pub index: usize,
    pub count: usize,
    pub chunks: usize,
}

impl Stage {
    pub fn single() -> Stage {
        Stage {
            index: 0,
            count: 1,
            chunks: 1,
        }
    }
    pub fn is_first(&self) -> bool {
        self.index == 0
    }
    pub fn is_last(&self) -> bool {
        self.index + 1 == self.count
    }
    /// The global indices of the decoder layers of this stage's model chunk `chunk`.
    pub fn chunk_layers(&self, total: usize, chunk: usize) -> std::ops::Range<usize> {
        let per = total / (self.count * self.chunks).max(1);
        let v = chunk * self.count + self.index;
        v * per..(v + 1) * per
    }
    /// The global indices of this stage's decoder layers, chunk after chunk (ascending).
    pub fn layers(&self, total: usize) -> Vec<usize> {
        (0..self.chunks.max(1))
            .flat_map(|c| self.chunk_layers(total, c))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(heads: i64, kv: i64, layers: i64) -> ModelConfig {
        ModelConfig::from_value(
            serde_json::json!({
                "model_type": "qwen2", "vocab_size": 64, "hidden_size": heads * 8,
                "intermediate_size": 56, "num_hidden_layers": layers,
                "num_attention_heads": heads, "num_key_value_heads": kv,
            }),
            "test/config.json",
        )
        .unwrap()
    }

    fn section(tp: u64, pp: u64) -> MegatronSection {
        MegatronSection {
            tensor_model_parallel_size: tp,
            pipeline_model_parallel_size: pp,
            ..MegatronSection::default()
        }
    }

    /// A role's `megatron` block with every key this backend reads set away from its default
    /// arrives as written; the reference falls back to the actor's block when it has none.
    #[test]
    fn megatron_section_reads_the_verl_keys_it_names() {
        let block = serde_json::json!({
            "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 4,
            "virtual_pipeline_model_parallel_size": 2, "expert_model_parallel_size": 8,
            "expert_tensor_parallel_size": 1, "context_parallel_size": 1,
            "sequence_parallel": false, "use_distributed_optimizer": false,
            "param_offload": true, "grad_offload": true, "optimizer_offload": true,
            "seed": 7, "dtype": "float16",
            "override_transformer_config": {"recompute_granularity": "full", "moe_aux_loss_coeff": 0.01}
        });
        let cfg = serde_json::json!({"actor_rollout_ref": {"actor": {"megatron": block}}});
        for (prefix, fallback) in [
            ("actor_rollout_ref.actor.megatron", None),
            (
                "actor_rollout_ref.ref.megatron",
                Some("actor_rollout_ref.actor.megatron"),
            ),
        ] {
            let m = crate::common::megatron_section(&cfg, prefix, fallback).unwrap();
            assert_eq!(
                (
                    m.tensor_model_parallel_size,
                    m.pipeline_model_parallel_size,
                    m.virtual_pipeline_model_parallel_size,
                    m.expert_model_parallel_size,
                    m.expert_tensor_parallel_size,
                ),
                (2, 4, Some(2), 8, Some(1)),
                "{prefix}"
            );
            assert!(!m.sequence_parallel && !m.use_distributed_optimizer);
            assert!(m.param_offload && m.grad_offload && m.optimizer_offload);
            assert_eq!((m.seed, m.dtype.as_str()), (7, "float16"));
            assert_eq!(
                m.override_transformer_config["recompute_granularity"],
                "full"
            );
            assert_eq!(m.override_transformer_config["moe_aux_loss_coeff"], 0.01);
        }
    }

    const P: &str = "actor_rollout_ref.actor.megatron";

    #[test]
    fn heads_not_divisible_lists_valid_sizes() {
        let e = Layout::validate(&section(3, 1), P, 6, &model(14, 2, 4)).unwrap_err();
        let s = e.to_string();
        assert!(
            s.contains("actor_rollout_ref.actor.megatron.tensor_model_parallel_size"),
            "{s}"
        );
        assert!(
            s.contains("tensor_model_parallel_size=3 does not divide num_attention_heads=14; valid: 1, 2, 7, 14"),
            "{s}"
        );
    }

    #[test]
    fn kv_heads_and_world_size_are_checked() {
        let e = Layout::validate(&section(4, 1), P, 4, &model(8, 2, 4)).unwrap_err();
        assert!(
            e.to_string()
                .contains("does not divide num_key_value_heads=2"),
            "{e}"
        );
        let e = Layout::validate(&section(4, 1), P, 6, &model(8, 4, 4)).unwrap_err();
        let s = e.to_string();
        assert!(s.contains("world size 6 is not a multiple of tensor_model_parallel_size=4 × pipeline_model_parallel_size=1 × context_parallel_size=1 = 4"), "{s}");
        assert!(s.contains("valid tensor_model_parallel_size"), "{s}");
        assert!(s.contains("1, 2, 3, 6"), "{s}");
    }

    #[test]
    fn layers_must_split_into_pipeline_chunks() {
        let mut s = section(1, 2);
        s.virtual_pipeline_model_parallel_size = Some(2);
        let e = Layout::validate(&s, P, 2, &model(4, 2, 6)).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("num_hidden_layers=6 cannot be split into pipeline_model_parallel_size=2 × virtual_pipeline_model_parallel_size=2 = 4"), "{msg}");
        assert!(
            msg.contains("valid pipeline_model_parallel_size with this virtual size: 1, 3"),
            "{msg}"
        );
        assert!(Layout::validate(&section(1, 3), P, 3, &model(4, 2, 6)).is_ok());
    }

    #[test]
    fn zero_and_expert_sizes_are_rejected_for_dense_models() {
        let e = Layout::validate(&section(0, 1), P, 1, &model(4, 2, 2)).unwrap_err();
        assert!(
            e.to_string()
                .contains("tensor_model_parallel_size`: expected a positive integer, found 0"),
            "{e}"
        );
        let mut s = section(1, 1);
        s.expert_model_parallel_size = 2;
        let e = Layout::validate(&s, P, 2, &model(4, 2, 2)).unwrap_err();
        assert!(e.to_string().contains("expert_model_parallel_size"), "{e}");
        assert!(e.to_string().contains("has no experts"), "{e}");
    }

    #[test]
    fn data_parallel_size_is_what_remains() {
        let l = Layout::validate(&section(2, 2), P, 8, &model(4, 2, 4)).unwrap();
        assert_eq!((l.tp, l.pp, l.cp, l.dp), (2, 2, 1, 2));
        assert!(
            l.sequence_parallel,
            "verl's default sequence_parallel=true holds with tp > 1"
        );
        let l = Layout::validate(&section(1, 1), P, 3, &model(4, 2, 4)).unwrap();
        assert!(
            !l.sequence_parallel,
            "sequence parallelism means nothing at tp = 1"
        );
        assert_eq!(l.dp, 3);
    }

    #[test]
    fn ranks_are_ordered_tensor_parallel_fastest() {
        let l = Layout::validate(&section(2, 2), P, 8, &model(4, 2, 4)).unwrap();
        assert_eq!(
            l.coords(0),
            Coords {
                tp: 0,
                cp: 0,
                dp: 0,
                pp: 0
            }
        );
        assert_eq!(
            l.coords(1),
            Coords {
                tp: 1,
                cp: 0,
                dp: 0,
                pp: 0
            }
        );
        assert_eq!(
            l.coords(2),
            Coords {
                tp: 0,
                cp: 0,
                dp: 1,
                pp: 0
            }
        );
        assert_eq!(
            l.coords(5),
            Coords {
                tp: 1,
                cp: 0,
                dp: 0,
                pp: 1
            }
        );
        for r in 0..8 {
            assert_eq!(l.rank_of(l.coords(r)), r);
        }
        assert_eq!(
            l.tp_groups(),
            vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]
        );
        assert_eq!(
            l.dp_groups(),
            vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
        );
        assert_eq!(
            l.pp_groups(),
            vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
        );
    }

    fn mixtral(experts: i64) -> ModelConfig {
        ModelConfig::from_value(
            serde_json::json!({
                "model_type": "mixtral", "vocab_size": 64, "hidden_size": 32,
                "intermediate_size": 56, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2,
                "num_local_experts": experts, "num_experts_per_tok": 2,
            }),
            "test/config.json",
        )
        .unwrap()
    }

    fn moe_section(tp: u64, ep: u64, etp: Option<u64>) -> MegatronSection {
        MegatronSection {
            expert_model_parallel_size: ep,
            expert_tensor_parallel_size: etp,
            ..section(tp, 1)
        }
    }

    #[test]
    fn expert_groups_are_data_parallel_ranks_of_one_tensor_parallel_index() {
        let l = Layout::validate(&moe_section(2, 2, None), P, 8, &mixtral(4)).unwrap();
        assert_eq!((l.tp, l.dp, l.ep, l.etp), (2, 4, 2, 2));
        assert_eq!(
            l.ep_groups(),
            vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
        );
        assert_eq!(
            l.expert_dp_groups(),
            vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
        );
        assert_eq!(l.expert_coords(l.coords(6)), (1, 1));
        assert_eq!(l.to_json()["expert_tensor_parallel_size"], 2);
        // Two stages: the groups never leave a stage.
        let mut s = moe_section(1, 2, None);
        s.pipeline_model_parallel_size = 2;
        let l = Layout::validate(&s, P, 4, &mixtral(4)).unwrap();
        assert_eq!(l.ep_groups(), vec![vec![0, 1], vec![2, 3]]);
        assert_eq!(
            l.expert_dp_groups(),
            vec![vec![0], vec![1], vec![2], vec![3]]
        );
        // A dense model keeps expert sizes at 1 whatever expert_tensor_parallel_size says.
        let l = Layout::validate(&moe_section(2, 1, Some(2)), P, 2, &model(4, 2, 2)).unwrap();
        assert_eq!((l.ep, l.etp), (1, 1));
    }

    #[test]
    fn expert_layout_errors_show_the_arithmetic_and_valid_sizes() {
        let e = Layout::validate(&moe_section(1, 3, None), P, 6, &mixtral(4)).unwrap_err();
        let s = e.to_string();
        assert!(
            s.contains("actor_rollout_ref.actor.megatron.expert_model_parallel_size"),
            "{s}"
        );
        assert!(
            s.contains("expert_model_parallel_size=3 does not divide num_experts=4 (4 experts / 3 ranks = 1.33 experts per rank); valid with data-parallel size 6: 1, 2"),
            "{s}"
        );
        // Experts divide, but the data-parallel ranks do not split into expert groups.
        let e = Layout::validate(&moe_section(2, 4, None), P, 4, &mixtral(8)).unwrap_err();
        let s = e.to_string();
        assert!(s.contains("world size 4 is not a multiple of expert_tensor_parallel_size=2 × expert_model_parallel_size=4 × pipeline_model_parallel_size × context_parallel_size=1 = 8"), "{s}");
        assert!(s.contains("valid: 1, 2"), "{s}");
        // The expert intermediate size (56) must split over the expert-tensor-parallel ranks.
        let e = Layout::validate(&moe_section(1, 1, Some(3)), P, 3, &mixtral(4)).unwrap_err();
        let s = e.to_string();
        assert!(
            s.contains("actor_rollout_ref.actor.megatron.expert_tensor_parallel_size"),
            "{s}"
        );
        assert!(
            s.contains(
                "expert_tensor_parallel_size=3 does not divide the expert intermediate size"
            ),
            "{s}"
        );
        assert!(s.contains("56") && s.contains("valid with expert_model_parallel_size=1 and 3 tensor × data-parallel ranks per stage: 1"), "{s}");
        // ETP × EP must divide the stage's tensor × data-parallel ranks.
        let e = Layout::validate(&moe_section(2, 2, Some(4)), P, 4, &mixtral(4)).unwrap_err();
        let s = e.to_string();
        assert!(s.contains("world size 4 is not a multiple of expert_tensor_parallel_size=4 × expert_model_parallel_size=2"), "{s}");
        assert!(s.contains("4 / (4 × 2) is not whole"), "{s}");
        assert!(s.contains("valid: 1 (expert_model_parallel_size with tensor_model_parallel_size=2 × data-parallel size 2 = 4 ranks per stage and expert_tensor_parallel_size=4)"), "{s}");
        assert!(
            s.contains("or expert_tensor_parallel_size in 1, 2 with expert_model_parallel_size=2"),
            "{s}"
        );
        assert!(Layout::validate(&moe_section(2, 2, Some(1)), P, 4, &mixtral(4)).is_ok());
        assert!(Layout::validate(&moe_section(2, 2, Some(2)), P, 4, &mixtral(4)).is_ok());
    }

    #[test]
    fn expert_grid_repartitions_tensor_and_data_parallel_ranks() {
        // TP = 2, ETP = 1, EP = 2 on 2 ranks: the tensor-parallel pair is the expert-parallel group.
        let l = Layout::validate(&moe_section(2, 2, Some(1)), P, 2, &mixtral(4)).unwrap();
        assert_eq!(
            (l.tp, l.dp, l.ep, l.etp, l.expert_dp_size()),
            (2, 1, 2, 1, 1)
        );
        assert_eq!(l.ep_groups(), vec![vec![0, 1]]);
        assert_eq!(l.etp_groups(), vec![vec![0], vec![1]]);
        assert!(l.separate_expert_dp() && !l.experts_span_data_parallel());
        // ... with DP = 2: the expert-data-parallel groups join the data-parallel replicas.
        let l = Layout::validate(&moe_section(2, 2, Some(1)), P, 4, &mixtral(4)).unwrap();
        assert_eq!(l.ep_groups(), vec![vec![0, 1], vec![2, 3]]);
        assert_eq!(l.expert_dp_groups(), vec![vec![0, 2], vec![1, 3]]);
        assert_eq!(l.expert_grid(l.coords(3)), (0, 1, 1));
        // TP = 2, ETP = 1, EP = 4: one expert-parallel group over both replicas.
        let l = Layout::validate(&moe_section(2, 4, Some(1)), P, 4, &mixtral(4)).unwrap();
        assert_eq!(l.ep_groups(), vec![vec![0, 1, 2, 3]]);
        assert_eq!(
            l.expert_dp_groups(),
            vec![vec![0], vec![1], vec![2], vec![3]]
        );
        assert!(l.experts_span_data_parallel());
        // TP = 1, ETP = 2: the expert-tensor-parallel group is made of data-parallel ranks.
        let l = Layout::validate(&moe_section(1, 1, Some(2)), P, 4, &mixtral(4)).unwrap();
        assert_eq!(l.etp_groups(), vec![vec![0, 1], vec![2, 3]]);
        assert_eq!(l.expert_dp_groups(), vec![vec![0, 2], vec![1, 3]]);
        assert!(l.experts_span_data_parallel());
        // ETP = TP: the old layout (and no separate expert-data-parallel group without EP).
        let l = Layout::validate(&moe_section(2, 1, None), P, 4, &mixtral(4)).unwrap();
        assert_eq!(l.etp_groups(), l.tp_groups());
        assert_eq!(l.expert_dp_groups(), l.dp_groups());
        assert!(!l.separate_expert_dp());
        // Two stages: no group leaves its stage.
        let mut s = moe_section(2, 2, Some(1));
        s.pipeline_model_parallel_size = 2;
        let l = Layout::validate(&s, P, 4, &mixtral(4)).unwrap();
        assert_eq!(l.ep_groups(), vec![vec![0, 1], vec![2, 3]]);
    }
}
