//! Expert parallelism for the sparse MoE blocks of Mixtral / Qwen2-MoE / Qwen3-MoE, with
//! Megatron-core's all-to-all token dispatch.
//!
//! * The router (and a Qwen2-MoE shared expert) is replicated; the routed experts are sharded over
//!   the expert-parallel group: EP rank `e` owns experts `[e·E/EP, (e+1)·E/EP)`. With expert tensor
//!   parallelism (ETP > 1) each expert is further split like a dense TP MLP (gate/up by rows,
//!   down by columns) over the expert-tensor-parallel group.
//! * Which tokens a rank routes ([`Tokens`]): its own ([`Tokens::Local`]: Megatron-core's
//!   sequence-parallel dispatch, each tensor-parallel rank routing only its sequence shard, or
//!   TP = 1), a copy shared by its ETP group ([`Tokens::Replicated`]: the tensor-parallel group
//!   without sequence parallelism when ETP = TP), or its `1/TP` slice of a copy shared by its
//!   tensor-parallel group ([`Tokens::Slice`]: no sequence parallelism, ETP ≠ TP; the outputs are
//!   all-gathered over the tensor-parallel group, so the block is sequence-parallel inside).
//! * Dispatch: route (fp32 softmax, top-k, optional renormalisation: exactly `verl_nn`'s maths),
//!   permute the (token, slot) pairs expert-major (so they are grouped by destination rank),
//!   all-gather the per-expert counts, `all_to_all_v` the token rows to the expert owners; when
//!   the ETP members hold different tokens, all-gather the received rows over the ETP group
//!   (unequal sizes); sort the rows by local expert, run the experts, undo the sort, then
//!   reduce-scatter the partial outputs back over ETP (or, with [`Tokens::Replicated`], all-reduce
//!   them), `all_to_all_v` back, and combine: `y[t] = Σ_k w[t,k] · expert_k(x[t])` (+ the shared
//!   expert). No capacity limit, no token dropping.
//! * Backward through the collectives is chained by hand (tch has no custom autograd functions):
//!   the graph is cut at both all-to-alls; the gradient of an all-to-all is the reverse
//!   all-to-all, of the ETP all-gather a reduce-scatter and vice versa; with
//!   [`Tokens::Replicated`] the expert input gradient is all-reduced over ETP (Megatron's `f`),
//!   the expert output gradient is not (Megatron's `g`). When the tokens are partitioned over the
//!   tensor-parallel ranks ([`Tokens::Local`], [`Tokens::Slice`]) the replicated parameters'
//!   gradients (router, shared expert) are all-reduced over them inside the block.
//! * The router load-balancing loss is Megatron-core's Switch loss
//!   `coeff · E / (k · T²) · Σ_e (Σ_t p[t,e]) · n_e` (`p` the full softmax, `n_e` the (token, slot)
//!   pairs routed to `e`, `T` the tokens; HF Mixtral's loss divided by `k`), over the valid
//!   tokens. With partitioned tokens it is Megatron-core's sequence-parallel form
//!   (`sequence_partition_group` = the tensor-parallel group): `n_e` and `T` are summed over the
//!   tensor-parallel ranks, `Σ_t p[t,e]` runs over this rank's tokens, so the ranks' losses add up
//!   to the loss of the whole sequence. Its gradient is added in [`EpMoe::forward_backward`] with
//!   a caller-given scale.
//! * Load metrics ([`LoadStats`], [`MoeLoadMetrics`]): routed pairs per expert and the imbalance
//!   `max / mean`, as step metrics `moe/expert_load/<e>`, `moe/load_imbalance`,
//!   `moe/load_imbalance_max` and `moe/aux_loss`. With partitioned tokens the statistics (and the
//!   reported loss) are those of the tensor-parallel group's whole sequence, identical on its
//!   ranks, so every token counts once.

use std::collections::BTreeMap;
use std::sync::Arc;

use tch::{Device, Kind, Tensor};
use verl_nn::{Arch, ModelConfig};

use crate::error::{MegatronError, Result, TorchContext};
pub use crate::parallel::ExpertGroup;
use crate::source::FullSource;

mod dispatch;

mod backward;

/// The shape of one MoE block, from the model config.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeSpec {
    pub hidden: i64,
    pub num_experts: i64,
    pub top_k: i64,
    pub expert_intermediate: i64,
    pub norm_topk_prob: bool,
    /// Qwen2-MoE: the always-on shared expert's width (gated by a sigmoid).
    pub shared_intermediate: Option<i64>,
    /// `moe_aux_loss_coeff`; 0 disables the load-balancing loss.
    pub aux_loss_coeff: f64,
    /// HF module prefix of the block, e.g. `model.layers.3.block_sparse_moe`.
    pub prefix: String,
    /// HF names of the expert projections: gate, up, down.
    pub names: [&'static str; 3],
}

impl MoeSpec {
    /// The MoE block of decoder layer `layer` of `cfg`.
    pub fn new(cfg: &ModelConfig, layer: usize, aux_loss_coeff: f64) -> Result<MoeSpec> {
        let moe = cfg.moe.as_ref().ok_or_else(|| {
            MegatronError::config(
                "model config.json",
                "a mixture-of-experts family (mixtral, qwen2_moe, qwen3_moe) for an expert-parallel block",
                cfg.arch.model_type(),
            )
        })?;
        if !moe.sparse_layers.get(layer).copied().unwrap_or(false) {
            return Err(MegatronError::config(
                "model config.json",
                format!(
                    "decoder layer {layer} to be a sparse MoE layer (sparse layers: {:?})",
                    moe.sparse_layers
                        .iter()
                        .enumerate()
                        .filter(|(_, s)| **s)
                        .map(|(i, _)| i)
                        .collect::<Vec<_>>()
                ),
                "a dense layer or no such layer",
            ));
        }
        if !aux_loss_coeff.is_finite() || aux_loss_coeff < 0.0 {
            return Err(MegatronError::config(
                "moe_aux_loss_coeff",
                "a finite non-negative number",
                aux_loss_coeff,
            ));
        }
        let mixtral = cfg.arch == Arch::Mixtral;
        Ok(MoeSpec {
            hidden: cfg.hidden_size,
            num_experts: moe.num_experts,
            top_k: moe.top_k,
            expert_intermediate: moe.expert_intermediate_size,
            norm_topk_prob: moe.norm_topk_prob,
            shared_intermediate: moe.shared_expert_intermediate_size,
            aux_loss_coeff,
            prefix: format!(
                "model.layers.{layer}.{}",
                if mixtral { "block_sparse_moe" } else { "mlp" }
            ),
            names: if mixtral {
                ["w1", "w3", "w2"]
            } else {
                ["gate_proj", "up_proj", "down_proj"]
            },
        })
    }
}

/// Where a parameter of an [`EpMoe`] lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Every rank holds the whole tensor (router, shared expert); its gradient covers this rank's
    /// tokens only (reduce it over the data-parallel ranks like any replicated parameter).
    Replicated,
    /// Routed expert `expert`, held by one expert-parallel rank; `split_dim` is the dim divided
    /// over the expert-tensor-parallel group (`None` with ETP = 1). Its gradient already covers
    /// every token of the expert-parallel group.
    Expert { expert: i64, split_dim: Option<i64> },
}

/// One parameter: its HF name, full shape, placement and this rank's slice (an autograd leaf).
#[derive(Debug)]
pub struct MoeParam {
    pub name: String,
    pub full_shape: Vec<i64>,
    pub placement: Placement,
    pub local: Tensor,
}

/// Per-call routing counts of one block.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadStats {
    /// (token, slot) pairs of this rank's valid tokens routed to each expert (`Σ = k · tokens`).
    pub tokens_per_expert: Vec<i64>,
    /// Valid tokens of this call.
    pub tokens: i64,
    /// The coefficient-scaled load-balancing loss of this call (`None` when the coefficient is 0).
    pub aux_loss: Option<f64>,
}

impl LoadStats {
    /// `max / mean` of the per-expert loads (1 = perfectly balanced; 0 when nothing was routed).
    pub fn imbalance(&self) -> f64 {
        imbalance(
            &self
                .tokens_per_expert
                .iter()
                .map(|&c| c as f64)
                .collect::<Vec<_>>(),
        )
    }
}

fn imbalance(loads: &[f64]) -> f64 {
    let total: f64 = loads.iter().sum();
    if loads.is_empty() || total <= 0.0 {
        return 0.0;
    }
    let mean = total / loads.len() as f64;
    loads.iter().cloned().fold(f64::MIN, f64::max) / mean
}

/// The no-grad result of [`EpMoe::forward`].
#[derive(Debug)]
pub struct MoeOutput {
    /// The block output, shaped like the input.
    pub y: Tensor,
    pub stats: LoadStats,
}

/// The result of [`EpMoe::forward_backward`].
#[derive(Debug)]
pub struct MoeGrad {
    /// The block output (detached), shaped like the input.
    pub y: Tensor,
    /// The gradient of the input (output gradient plus the scaled load-balancing loss).
    pub grad_x: Tensor,
    pub stats: LoadStats,
}

/// Which tokens each rank's block routes, relative to its tensor-parallel group (`seq`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tokens {
    /// The members of the expert-tensor-parallel group hold the same tokens (the tensor-parallel
    /// group without sequence parallelism, with ETP = TP): no gather over ETP, the experts'
    /// partial outputs and input gradients are all-reduced over it.
    Replicated,
    /// Every rank routes its own tokens (its sequence shard under sequence parallelism, or
    /// TP = 1): the rows an expert owner receives are all-gathered over ETP; the statistics, the
    /// load-balancing loss and the replicated parameters' gradients are reduced over `seq`.
    Local,
    /// The input is replicated over `seq` (no sequence parallelism, ETP ≠ TP): each member routes
    /// its `1/size` slice of the tokens as [`Tokens::Local`] and the outputs (and input
    /// gradients) are all-gathered over `seq`.
    Slice,
}

thread_local! {
    /// Introspection: `(mode, token rows routed, token rows of the input)` of the last block call
    /// on this thread.
    static LAST_ROUTED: std::cell::Cell<Option<(Tokens, i64, i64)>> = const { std::cell::Cell::new(None) };
}

/// Debug / introspection hook: `(the block's token mode, the token rows this rank routed, the
/// token rows of its input)` in the last MoE block call run on the calling thread. Under
/// sequence parallelism the input is this rank's sequence shard and every row of it is routed;
/// with [`Tokens::Slice`] a rank routes `1/TP` of its input's rows (rounded up).
pub fn last_routed() -> Option<(Tokens, i64, i64)> {
    LAST_ROUTED.with(|c| c.get())
}

/// Host-side routing plan of one call: which rows go where.
struct Plan {
    /// Flat (token · k + slot) indices, expert-major, ascending within an expert.
    flat: Tensor,
    /// The token of each entry of `flat`.
    tokens: Tensor,
    send_splits: Vec<usize>,
    recv_splits: Vec<usize>,
    /// Rows each member of the ETP group received by all-to-all (gathered over ETP when the
    /// members hold different tokens; just this rank's count otherwise).
    etp_rows: Vec<usize>,
    /// Received (gathered) rows in local-expert-major order (indices into them) and back.
    order: Tensor,
    inverse: Tensor,
    /// Received rows per local expert.
    expert_rows: Vec<i64>,
    stats: LoadStats,
}

/// What the forward keeps for the backward.
struct Fwd {
    /// The input as a leaf `[N, H]`.
    xl: Tensor,
    /// Expert inputs (sorted by local expert) as a leaf, and the experts' (partial) outputs.
    xsl: Tensor,
    ys: Option<Tensor>,
    /// The combined expert outputs back at the source rank, as a leaf `[S, H]`.
    ybl: Tensor,
    /// Output `[N, H]` and the coefficient-scaled aux loss (graph tensors when differentiating).
    y: Tensor,
    aux: Option<Tensor>,
    plan: Plan,
}

/// A sparse MoE block with expert parallelism (one rank's part).
pub struct EpMoe {
    spec: MoeSpec,
    ep: Arc<ExpertGroup>,
    etp: Arc<ExpertGroup>,
    /// The tensor-parallel ranks, over which the tokens are partitioned ([`Tokens::Local`],
    /// [`Tokens::Slice`]).
    seq: Arc<ExpertGroup>,
    tokens: Tokens,
    dtype: Kind,
    device: Device,
    pub params: Vec<MoeParam>,
    router: usize,
    /// Per local expert: gate, up, down.
    experts: Vec<[usize; 3]>,
    /// Shared expert gate/up/down and its sigmoid gate.
    shared: Option<([usize; 3], usize)>,
    first_expert: i64,
    local_experts: i64,
}

impl std::fmt::Debug for EpMoe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EpMoe")
            .field("prefix", &self.spec.prefix)
            .field("ep", &(self.ep.rank, self.ep.size))
            .field("etp", &(self.etp.rank, self.etp.size))
            .field("tokens", &(self.tokens, self.seq.size))
            .field("experts", &(self.first_expert, self.local_experts))
            .finish()
    }
}

fn cut(x: &Tensor, what: &str) -> Result<Tensor> {
    x.f_detach()
        .and_then(|d| d.f_set_requires_grad(true))
        .ctx(what)
}

fn index(v: &[i64], device: Device, what: &str) -> Result<Tensor> {
    Tensor::f_from_slice(v)
        .and_then(|t| t.f_to_device(device))
        .ctx(what)
}

impl EpMoe {
    /// Builds this rank's part of the block `spec`: the replicated router (and shared expert) and
    /// its experts, read as full tensors from `source`. It starts as [`Tokens::Replicated`] (`etp`
    /// a group whose members get identical inputs, e.g. the tensor-parallel group without
    /// sequence parallelism); see [`EpMoe::set_tokens`].
    pub fn new(
        spec: MoeSpec,
        ep: Arc<ExpertGroup>,
        etp: Arc<ExpertGroup>,
        dtype: Kind,
        device: Device,
        source: &mut dyn FullSource,
    ) -> Result<EpMoe> {
        let (e, h, inter) = (spec.num_experts, spec.hidden, spec.expert_intermediate);
        if ep.size == 0 || e % ep.size as i64 != 0 {
            return Err(MegatronError::Layout {
                key: "expert_model_parallel_size".into(),
                message: format!(
                    "expert_model_parallel_size={} does not divide num_experts={e}; valid: {}",
                    ep.size,
                    divisor_list(e)
                ),
            });
        }
        if etp.size == 0 || inter % etp.size as i64 != 0 {
            return Err(MegatronError::Layout {
                key: "expert_tensor_parallel_size".into(),
                message: format!(
                    "expert_tensor_parallel_size={} does not divide the expert intermediate size {inter}; valid: {}",
                    etp.size,
                    divisor_list(inter)
                ),
            });
        }
        if spec.top_k < 1 || spec.top_k > e {
            return Err(MegatronError::config(
                "num_experts_per_tok",
                format!("between 1 and num_experts={e}"),
                spec.top_k,
            ));
        }
        let local_experts = e / ep.size as i64;
        let first_expert = ep.rank as i64 * local_experts;
        let p = spec.prefix.clone();
        let mut specs: Vec<(String, Vec<i64>, Placement)> = vec![(
            format!("{p}.gate.weight"),
            vec![e, h],
            Placement::Replicated,
        )];
        let split = |d: i64| (etp.size > 1).then_some(d);
        for x in first_expert..first_expert + local_experts {
            let [g, u, d] = spec.names;
            let ex = |dim| Placement::Expert {
                expert: x,
                split_dim: split(dim),
            };
            specs.push((format!("{p}.experts.{x}.{g}.weight"), vec![inter, h], ex(0)));
            specs.push((format!("{p}.experts.{x}.{u}.weight"), vec![inter, h], ex(0)));
            specs.push((format!("{p}.experts.{x}.{d}.weight"), vec![h, inter], ex(1)));
        }
        if let Some(si) = spec.shared_intermediate {
            for (n, shape) in [
                ("gate_proj", vec![si, h]),
                ("up_proj", vec![si, h]),
                ("down_proj", vec![h, si]),
            ] {
                specs.push((
                    format!("{p}.shared_expert.{n}.weight"),
                    shape,
                    Placement::Replicated,
                ));
            }
            specs.push((
                format!("{p}.shared_expert_gate.weight"),
                vec![1, h],
                Placement::Replicated,
            ));
        }
        let mut params = Vec::with_capacity(specs.len());
        for (name, shape, placement) in specs {
            let full = source.full(&name)?.ok_or_else(|| {
                MegatronError::Model(verl_nn::NnError::MissingTensor {
                    dir: std::path::PathBuf::from("<model source>"),
                    name: name.clone(),
                    arch: spec.prefix.clone(),
                })
            })?;
            if full.size() != shape {
                return Err(MegatronError::Model(verl_nn::NnError::ShapeMismatch {
                    path: std::path::PathBuf::from("<model source>"),
                    name,
                    expected: shape,
                    found: full.size(),
                }));
            }
            let local = shard(&full, placement, etp.rank, etp.size)?
                .f_to_kind(dtype)
                .and_then(|t| t.f_to_device(device))
                .and_then(|t| t.f_contiguous())
                .and_then(|t| t.f_detach_copy())
                .and_then(|t| t.f_set_requires_grad(true))
                .ctx(&format!("load `{name}`"))?;
            params.push(MoeParam {
                name,
                full_shape: shape,
                placement,
                local,
            });
        }
        let experts = (0..local_experts as usize)
            .map(|j| [1 + 3 * j, 2 + 3 * j, 3 + 3 * j])
            .collect();
        let base = 1 + 3 * local_experts as usize;
        let shared = spec
            .shared_intermediate
            .map(|_| ([base, base + 1, base + 2], base + 3));
        Ok(EpMoe {
            spec,
            ep,
            etp,
            seq: Arc::new(ExpertGroup::single("tensor-parallel (moe tokens)")),
            tokens: Tokens::Replicated,
            dtype,
            device,
            params,
            router: 0,
            experts,
            shared,
            first_expert,
            local_experts,
        })
    }

    pub fn spec(&self) -> &MoeSpec {
        &self.spec
    }
    /// Which tokens the block routes (see [`Tokens`]); `seq` is this rank's tensor-parallel group
    /// (as an expert group), over which the tokens are partitioned with [`Tokens::Local`] and
    /// [`Tokens::Slice`]. Every member of `seq` must use the same mode.
    pub fn set_tokens(&mut self, seq: Arc<ExpertGroup>, tokens: Tokens) {
        self.seq = seq;
        self.tokens = tokens;
    }
    pub fn tokens(&self) -> Tokens {
        self.tokens
    }
    /// Whether the ETP members hold different rows (gathered before the experts).
    fn etp_gather(&self) -> bool {
        self.tokens != Tokens::Replicated && self.etp.size > 1
    }
    /// Whether the tokens are partitioned over more than one tensor-parallel rank.
    fn partitioned(&self) -> bool {
        self.tokens != Tokens::Replicated && self.seq.size > 1
    }
    pub fn ep(&self) -> &ExpertGroup {
        &self.ep
    }
    pub fn etp(&self) -> &ExpertGroup {
        &self.etp
    }
    pub fn dtype(&self) -> Kind {
        self.dtype
    }
    pub fn device(&self) -> Device {
        self.device
    }

    /// The experts this rank owns: `first..first + count`.
    pub fn local_expert_range(&self) -> std::ops::Range<i64> {
        self.first_expert..self.first_expert + self.local_experts
    }

    /// Index into [`EpMoe::params`] of the parameter named `name` (HF name).
    pub fn param_index(&self, name: &str) -> Option<usize> {
        self.params.iter().position(|p| p.name == name)
    }

    pub fn set_requires_grad(&mut self, on: bool) -> Result<()> {
        for p in &self.params {
            let _ = p.local.f_set_requires_grad(on).ctx("requires_grad")?;
        }
        Ok(())
    }

    /// This rank's slice of a full tensor shaped like parameter `i` (checkpoint reload).
    pub fn local_of(&self, i: usize, full: &Tensor) -> Result<Tensor> {
        let p = self.params.get(i).ok_or_else(|| {
            MegatronError::config(
                "moe parameter index",
                format!("below {}", self.params.len()),
                i,
            )
        })?;
        if full.size() != p.full_shape {
            return Err(MegatronError::Model(verl_nn::NnError::ShapeMismatch {
                path: std::path::PathBuf::from("<full tensor>"),
                name: p.name.clone(),
                expected: p.full_shape.clone(),
                found: full.size(),
            }));
        }
        shard(full, p.placement, self.etp.rank, self.etp.size)
    }

    fn p(&self, i: usize) -> &Tensor {
        &self.params[i].local
    }

    /// Every parameter of the whole block as a full tensor, by HF name (the router, every
    /// expert of every expert-parallel rank, the shared expert), from this rank's slices `local`
    /// (indexed like [`EpMoe::params`]: the parameters themselves, or e.g. optimizer moments of
    /// the same layout). Every member of the EP and ETP groups must call this together.
    pub fn gather_full(&self, local: &[Tensor]) -> Result<Vec<(String, Tensor)>> {
        if local.len() != self.params.len() {
            return Err(MegatronError::config(
                "moe parameter slices",
                format!(
                    "{} tensors (one per parameter of {})",
                    self.params.len(),
                    self.spec.prefix
                ),
                local.len(),
            ));
        }
        let mut out = Vec::with_capacity(self.params.len() * self.ep.size);
        let mut experts: Vec<(usize, Tensor)> = Vec::new();
        for (i, (p, t)) in self.params.iter().zip(local).enumerate() {
            match p.placement {
                Placement::Replicated => out.push((p.name.clone(), t.shallow_clone())),
                Placement::Expert { split_dim, .. } => {
                    let full = match split_dim {
                        Some(d) => {
                            let parts = self
                                .etp
                                .all_gather(t, "all_gather (expert-tensor-parallel slices)")?;
                            Tensor::f_cat(&parts, d).ctx("join expert-tensor-parallel slices")?
                        }
                        None => t.shallow_clone(),
                    };
                    experts.push((i, full));
                }
            }
        }
        // The j-th local tensor of EP rank r belongs to expert r·(E/EP) + j/3 with the same
        // projection: one all-gather per local tensor, in the same order on every rank.
        let [g, u, d] = self.spec.names;
        for (i, full) in &experts {
            let parts = self.ep.all_gather(full, "all_gather (expert weights)")?;
            let proj = [g, u, d][(*i - 1) % 3];
            let j = (*i - 1) / 3;
            for (r, part) in parts.into_iter().enumerate() {
                let expert = r as i64 * self.local_experts + j as i64;
                out.push((
                    format!("{}.experts.{expert}.{proj}.weight", self.spec.prefix),
                    part,
                ));
            }
        }
        Ok(out)
    }

    fn mlp(&self, x: &Tensor, [g, u, d]: [usize; 3]) -> Result<Tensor> {
        let f = || -> std::result::Result<Tensor, tch::TchError> {
            let gate = x.f_linear(self.p(g), None::<&Tensor>)?.f_silu()?;
            let up = x.f_linear(self.p(u), None::<&Tensor>)?;
            gate.f_mul(&up)?.f_linear(self.p(d), None::<&Tensor>)
        };
        f().ctx("expert mlp")
    }

    /// `x` as `[N, H]` after checking its trailing dim, and the valid-token flags.
    fn check(&self, x: &Tensor, valid: Option<&Tensor>) -> Result<(Tensor, Vec<bool>)> {
        let size = x.size();
        if size.last().copied() != Some(self.spec.hidden) {
            return Err(MegatronError::from(verl_backend_kit::BackendError::Input {
                call: "expert-parallel moe",
                column: "hidden_states".into(),
                expected: format!("[.., {}] (hidden_size)", self.spec.hidden),
                found: format!("{size:?}"),
            }));
        }
        let xs = x.f_reshape([-1, self.spec.hidden]).ctx("flatten tokens")?;
        let n = xs.size()[0];
        let flags = match valid {
            None => vec![true; n as usize],
            Some(v) => {
                if v.size()[..] != size[..size.len() - 1] {
                    return Err(MegatronError::from(verl_backend_kit::BackendError::Input {
                        call: "expert-parallel moe",
                        column: "valid token mask".into(),
                        expected: format!("shape {:?}", &size[..size.len() - 1]),
                        found: format!("{:?}", v.size()),
                    }));
                }
                let v = v
                    .f_reshape([-1])
                    .and_then(|v| v.f_ne(0))
                    .and_then(|v| v.f_to_kind(Kind::Int64))
                    .and_then(|v| v.f_to_device(Device::Cpu))
                    .ctx("valid token mask")?;
                Vec::<i64>::try_from(&v)
                    .ctx("valid token mask")?
                    .into_iter()
                    .map(|b| b != 0)
                    .collect()
            }
        };
        Ok((xs, flags))
    }
}

/// Rank `rank`'s slice of `full` (of `size` ETP slices) under `placement`.
fn shard(full: &Tensor, placement: Placement, rank: usize, size: usize) -> Result<Tensor> {
    match placement {
        Placement::Expert {
            split_dim: Some(d), ..
        } => {
            let n = full.size()[d as usize] / size as i64;
            full.f_narrow(d, rank as i64 * n, n)
                .ctx("expert-tensor-parallel shard")
        }
        _ => Ok(full.shallow_clone()),
    }
}

fn divisor_list(n: i64) -> String {
    crate::layout::divisors(n.max(0) as u64)
        .iter()
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Step-level MoE metrics accumulated over micro-batches and layers.
///
/// Names: `moe/expert_load/<e>` (routed (token, slot) pairs of valid tokens per expert over the
/// step, summed over the ranks reduced with [`MoeLoadMetrics::reduce_with`], mean over MoE
/// layers), `moe/load_imbalance` (mean over MoE layers of `max / mean` of the
/// per-expert loads), `moe/load_imbalance_max` (the worst layer's) and `moe/aux_loss` (mean of the
/// coefficient-scaled load-balancing loss over layers and calls; only when it was computed).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MoeLoadMetrics {
    num_experts: usize,
    /// Per layer: per-expert loads, aux loss sum, aux loss count.
    layers: BTreeMap<usize, (Vec<f64>, f64, f64)>,
}

impl MoeLoadMetrics {
    pub fn new(num_experts: usize) -> MoeLoadMetrics {
        MoeLoadMetrics {
            num_experts,
            layers: BTreeMap::new(),
        }
    }

    /// An accumulator that already lists `layers` (every sparse layer of the model), so ranks
    /// that run different layers (pipeline stages) can still be reduced together with
    /// [`MoeLoadMetrics::reduce_with`]; a layer nothing was routed through is left out of the
    /// metrics.
    pub fn with_layers(num_experts: usize, layers: impl IntoIterator<Item = usize>) -> Self {
        MoeLoadMetrics {
            num_experts,
            layers: layers
                .into_iter()
                .map(|l| (l, (vec![0.0; num_experts], 0.0, 0.0)))
                .collect(),
        }
    }

    /// Adds one call of layer `layer`'s block.
    pub fn add(&mut self, layer: usize, stats: &LoadStats) -> Result<()> {
        if stats.tokens_per_expert.len() != self.num_experts {
            return Err(MegatronError::config(
                "moe load statistics",
                format!("{} per-expert counts", self.num_experts),
                stats.tokens_per_expert.len(),
            ));
        }
        let e = self.num_experts;
        let entry = self
            .layers
            .entry(layer)
            .or_insert_with(|| (vec![0.0; e], 0.0, 0.0));
        for (acc, &c) in entry.0.iter_mut().zip(&stats.tokens_per_expert) {
            *acc += c as f64;
        }
        if let Some(a) = stats.aux_loss {
            entry.1 += a;
            entry.2 += 1.0;
        }
        Ok(())
    }

    /// Sums the accumulated values over ranks with `reduce` (e.g. a data-parallel all-reduce of
    /// plain numbers). Every rank must have seen the same layers.
    pub fn reduce_with(&mut self, reduce: impl FnOnce(&mut [f64]) -> Result<()>) -> Result<()> {
        let mut flat: Vec<f64> = Vec::new();
        for (loads, s, n) in self.layers.values() {
            flat.extend(loads);
            flat.push(*s);
            flat.push(*n);
        }
        reduce(&mut flat)?;
        let mut it = flat.into_iter();
        for (loads, s, n) in self.layers.values_mut() {
            for l in loads.iter_mut() {
                *l = it.next().unwrap_or(0.0);
            }
            *s = it.next().unwrap_or(0.0);
            *n = it.next().unwrap_or(0.0);
        }
        Ok(())
    }

    /// The step metrics (empty when no MoE layer ran).
    pub fn metrics(&self) -> Vec<(String, f64)> {
        let used: Vec<&(Vec<f64>, f64, f64)> = self
            .layers
            .values()
            .filter(|(l, _, k)| l.iter().sum::<f64>() > 0.0 || *k > 0.0)
            .collect();
        let n = used.len();
        if n == 0 {
            return vec![];
        }
        let mut out = Vec::with_capacity(self.num_experts + 3);
        for e in 0..self.num_experts {
            let mean = used.iter().map(|(l, _, _)| l[e]).sum::<f64>() / n as f64;
            out.push((format!("moe/expert_load/{e}"), mean));
        }
        let per_layer: Vec<f64> = used.iter().map(|(l, _, _)| imbalance(l)).collect();
        out.push((
            "moe/load_imbalance".into(),
            per_layer.iter().sum::<f64>() / n as f64,
        ));
        out.push((
            "moe/load_imbalance_max".into(),
            per_layer.iter().cloned().fold(0.0, f64::max),
        ));
        let (s, c) = used
            .iter()
            .fold((0.0, 0.0), |(s, c), (_, a, k)| (s + a, c + k));
        if c > 0.0 {
            out.push(("moe/aux_loss".into(), s / c));
        }
        out
    }
}
