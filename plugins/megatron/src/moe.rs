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
use verl_comm::{CommError, Communicator, ReduceOp};
use verl_nn::{Arch, ModelConfig};

use crate::error::{MegatronError, Result, TorchContext};
use crate::tp::FullSource;

/// The expert-parallel or expert-tensor-parallel group of one rank (or none, for one rank).
pub struct ExpertGroup {
    pub name: &'static str,
    pub rank: usize,
    pub size: usize,
    comm: Option<Box<dyn Communicator>>,
}

impl std::fmt::Debug for ExpertGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertGroup")
            .field("name", &self.name)
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish()
    }
}

impl ExpertGroup {
    /// A group of one rank: every collective is the identity.
    pub fn single(name: &'static str) -> ExpertGroup {
        ExpertGroup {
            name,
            rank: 0,
            size: 1,
            comm: None,
        }
    }

    /// The group of `comm`'s members (`comm.rank()` is this rank's index in it).
    pub fn new(name: &'static str, comm: Box<dyn Communicator>) -> ExpertGroup {
        ExpertGroup {
            name,
            rank: comm.rank(),
            size: comm.world_size(),
            comm: (comm.world_size() > 1).then_some(comm),
        }
    }

    fn err(&self, op: &'static str) -> impl Fn(CommError) -> MegatronError + '_ {
        move |source| MegatronError::Comm {
            group: self.name,
            op,
            source: Box::new(source),
        }
    }

    /// All-to-all of the rows of `input` (`input_splits[j]` rows to member `j`); returns the
    /// `Σ output_splits` received rows, in member order.
    pub fn all_to_all_v(
        &self,
        input: &Tensor,
        input_splits: &[usize],
        output_splits: &[usize],
        what: &'static str,
    ) -> Result<Tensor> {
        let Some(c) = &self.comm else {
            return input.f_detach_copy().ctx(what);
        };
        let mut shape = input.size();
        shape[0] = output_splits.iter().sum::<usize>() as i64;
        let input = input.f_contiguous().ctx(what)?;
        let mut out =
            Tensor::f_empty(shape.as_slice(), (input.kind(), input.device())).ctx(what)?;
        c.all_to_all_v(&mut out, &input, output_splits, input_splits)
            .map_err(self.err(what))?;
        Ok(out)
    }

    /// Variable-size all-gather of rows: member `j` contributes `rows[j]` rows (`t` holds this
    /// member's); returns the `Σ rows` rows, member-major.
    pub fn all_gather_rows(
        &self,
        t: &Tensor,
        rows: &[usize],
        what: &'static str,
    ) -> Result<Tensor> {
        if self.comm.is_none() {
            return t.f_detach_copy().ctx(what);
        }
        let n = t.size().first().copied().unwrap_or(0) as usize;
        let mut reps = vec![1i64; t.dim().max(1)];
        reps[0] = self.size as i64;
        let input = t.f_repeat(reps.as_slice()).ctx(what)?;
        self.all_to_all_v(&input, &vec![n; self.size], rows, what)
    }

    /// Variable-size reduce-scatter of rows: `t` holds `Σ rows` rows, member-major (`rows[j]` for
    /// member `j`); returns this member's `rows[rank]` rows summed over the group (in member
    /// order).
    pub fn reduce_scatter_rows(
        &self,
        t: &Tensor,
        rows: &[usize],
        what: &'static str,
    ) -> Result<Tensor> {
        if self.comm.is_none() {
            return t.f_detach_copy().ctx(what);
        }
        let mine = rows[self.rank];
        let parts = self.all_to_all_v(t, rows, &vec![mine; self.size], what)?;
        let mut shape = t.size();
        shape[0] = mine as i64;
        shape.insert(0, self.size as i64);
        parts
            .f_reshape(shape.as_slice())
            .and_then(|p| p.f_sum_dim_intlist([0i64].as_slice(), false, None::<Kind>))
            .ctx(what)
    }

    /// Sums `t` in place over the group.
    pub fn all_reduce_sum(&self, t: &mut Tensor, what: &'static str) -> Result<()> {
        match &self.comm {
            Some(c) => c.all_reduce(t, ReduceOp::Sum).map_err(self.err(what)),
            None => Ok(()),
        }
    }

    /// Every member's `t` (same shape everywhere), in member order.
    pub fn all_gather(&self, t: &Tensor, what: &'static str) -> Result<Vec<Tensor>> {
        match &self.comm {
            Some(c) => {
                let t = t.f_contiguous().ctx(what)?;
                c.all_gather(&t).map_err(self.err(what))
            }
            None => Ok(vec![t.shallow_clone()]),
        }
    }

    /// Every member's `values` (same length everywhere), in member order.
    pub fn all_gather_i64(
        &self,
        values: &[i64],
        device: Device,
        what: &'static str,
    ) -> Result<Vec<Vec<i64>>> {
        let Some(c) = &self.comm else {
            return Ok(vec![values.to_vec()]);
        };
        let t = Tensor::f_from_slice(values)
            .and_then(|t| t.f_to_device(device))
            .ctx(what)?;
        let parts = c.all_gather(&t).map_err(self.err(what))?;
        parts
            .iter()
            .map(|p| Vec::<i64>::try_from(&p.f_to_device(Device::Cpu).ctx(what)?).ctx(what))
            .collect()
    }
}

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
            return Err(MegatronError::Input {
                call: "expert-parallel moe",
                column: "hidden_states".into(),
                expected: format!("[.., {}] (hidden_size)", self.spec.hidden),
                found: format!("{size:?}"),
            });
        }
        let xs = x.f_reshape([-1, self.spec.hidden]).ctx("flatten tokens")?;
        let n = xs.size()[0];
        let flags = match valid {
            None => vec![true; n as usize],
            Some(v) => {
                if v.size()[..] != size[..size.len() - 1] {
                    return Err(MegatronError::Input {
                        call: "expert-parallel moe",
                        column: "valid token mask".into(),
                        expected: format!("shape {:?}", &size[..size.len() - 1]),
                        found: format!("{:?}", v.size()),
                    });
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

    /// Router: fp32 softmax probabilities `[N, E]`, top-k weights `[N, k]` (in the input dtype)
    /// and the selected experts (host).
    fn route(&self, xs: &Tensor) -> Result<(Tensor, Tensor, Vec<i64>)> {
        let probs = xs
            .f_linear(self.p(self.router), None::<&Tensor>)
            .and_then(|l| l.f_softmax(1, Kind::Float))
            .ctx("router")?;
        let (mut w, sel) = probs
            .f_topk(self.spec.top_k, -1, true, true)
            .ctx("top-k routing")?;
        if self.spec.norm_topk_prob {
            w = w
                .f_sum_dim_intlist([-1i64].as_slice(), true, None::<Kind>)
                .and_then(|s| w.f_div(&s))
                .ctx("renormalise top-k")?;
        }
        let w = w.f_to_kind(xs.kind()).ctx("routing weights")?;
        let sel = sel
            .f_reshape([-1])
            .and_then(|s| s.f_to_device(Device::Cpu))
            .ctx("selected experts")?;
        let sel = Vec::<i64>::try_from(&sel).ctx("selected experts")?;
        Ok((probs, w, sel))
    }

    /// Groups the (token, slot) pairs by expert, exchanges the counts and derives the splits.
    fn plan(&self, sel: &[i64], valid: &[bool], device: Device) -> Result<Plan> {
        let e = self.spec.num_experts as usize;
        let k = self.spec.top_k as usize;
        let mut per_expert: Vec<Vec<i64>> = vec![Vec::new(); e];
        let mut counts = vec![0i64; 2 * e];
        for (flat, &x) in sel.iter().enumerate() {
            let slot = per_expert
                .get_mut(x as usize)
                .ok_or_else(|| MegatronError::Input {
                    call: "expert-parallel moe",
                    column: "router output".into(),
                    expected: format!("expert ids below {e}"),
                    found: x.to_string(),
                })?;
            slot.push(flat as i64);
            counts[x as usize] += 1;
            if valid[flat / k] {
                counts[e + x as usize] += 1;
            }
        }
        // One collective: every rank's routed pairs per expert (dispatch) and its valid pairs
        // per expert (metrics).
        let all = self
            .ep
            .all_gather_i64(&counts, device, "all_gather (tokens per expert)")?;
        let per_rank = self.local_experts as usize;
        let send_splits: Vec<usize> = (0..self.ep.size)
            .map(|r| counts[r * per_rank..(r + 1) * per_rank].iter().sum::<i64>() as usize)
            .collect();
        let first = self.first_expert as usize;
        let recv_splits: Vec<usize> = all
            .iter()
            .map(|c| c[first..first + per_rank].iter().sum::<i64>() as usize)
            .collect();
        // Received rows are [source][local expert]; gathered over ETP (members holding different
        // tokens) they are [member][source][local expert]; the experts want [local expert][member,
        // source].
        let mine: Vec<i64> = all
            .iter()
            .flat_map(|c| c[first..first + per_rank].iter().copied())
            .collect();
        let members = if self.etp_gather() {
            self.etp.all_gather_i64(
                &mine,
                device,
                "all_gather (expert-tensor-parallel row counts)",
            )?
        } else {
            vec![mine]
        };
        let etp_rows: Vec<usize> = members
            .iter()
            .map(|m| m.iter().sum::<i64>() as usize)
            .collect();
        // Start of each (member, source, local expert) block of rows.
        let mut starts = Vec::with_capacity(members.len());
        let mut start = 0i64;
        for m in &members {
            let mut row = Vec::with_capacity(m.len());
            for &n in m {
                row.push(start);
                start += n;
            }
            starts.push(row);
        }
        let sources = all.len();
        let mut order = Vec::with_capacity(start as usize);
        let mut expert_rows = vec![0i64; per_rank];
        for (j, rows) in expert_rows.iter_mut().enumerate() {
            for (m, counts) in members.iter().enumerate() {
                for s in 0..sources {
                    let b = s * per_rank + j;
                    order.extend(starts[m][b]..starts[m][b] + counts[b]);
                    *rows += counts[b];
                }
            }
        }
        let mut inverse = vec![0i64; order.len()];
        for (i, &o) in order.iter().enumerate() {
            inverse[o as usize] = i as i64;
        }
        let flat: Vec<i64> = per_expert.concat();
        let tokens: Vec<i64> = flat.iter().map(|f| f / k as i64).collect();
        let stats = LoadStats {
            tokens_per_expert: counts[e..].to_vec(),
            tokens: valid.iter().filter(|v| **v).count() as i64,
            aux_loss: None,
        };
        Ok(Plan {
            flat: index(&flat, device, "routing indices")?,
            tokens: index(&tokens, device, "routing indices")?,
            send_splits,
            recv_splits,
            etp_rows,
            order: index(&order, device, "expert order")?,
            inverse: index(&inverse, device, "expert order")?,
            expert_rows,
            stats,
        })
    }

    /// Whether this member routes its slice of a copy shared by the tensor-parallel ranks.
    fn sliced(&self) -> bool {
        self.tokens == Tokens::Slice && self.seq.size > 1
    }

    /// With [`Tokens::Slice`]: this member's block of the rows of `xs` (`[N, ..]`), padded with
    /// zero rows to a multiple of the tensor-parallel size first. The flags of the rows come
    /// from [`EpMoe::slice_flags`].
    fn slice_of(&self, xs: &Tensor) -> Result<Tensor> {
        let (n, size) = (xs.size()[0] as usize, self.seq.size);
        let per = n.div_ceil(size);
        let pad = per * size - n;
        let padded = match pad {
            0 => xs.shallow_clone(),
            _ => {
                let mut spec = vec![0i64; 2 * (xs.dim() - 1)];
                spec.extend([0, pad as i64]);
                xs.f_constant_pad_nd(spec.as_slice())
                    .ctx("pad token rows")?
            }
        };
        padded
            .f_narrow(0, (self.seq.rank * per) as i64, per as i64)
            .ctx("token slice")
    }

    /// The valid flags of this member's block of rows ([`EpMoe::slice_of`]); padding is invalid.
    fn slice_flags(&self, flags: &[bool]) -> Vec<bool> {
        let per = flags.len().div_ceil(self.seq.size);
        let start = self.seq.rank * per;
        (start..start + per)
            .map(|i| flags.get(i).copied().unwrap_or(false))
            .collect()
    }

    /// This rank's rows `local` of a block input shaped like `x` back as the whole `x`'s: with
    /// [`Tokens::Slice`] every member's block all-gathered, joined and unpadded.
    fn full_rows(&self, local: &Tensor, x: &Tensor, what: &'static str) -> Result<Tensor> {
        let full = if self.sliced() {
            let size = x.size();
            let n: i64 = size[..size.len() - 1].iter().product();
            let local = local.f_contiguous().ctx(what)?;
            let parts = self.seq.all_gather(&local, what)?;
            Tensor::f_cat(&parts, 0)
                .and_then(|t| t.f_narrow(0, 0, n))
                .ctx(what)?
        } else {
            local.shallow_clone()
        };
        full.f_reshape(x.size().as_slice()).ctx(what)
    }

    /// `Σ_t p[t, e]` over the valid tokens (`[E]`, fp32, in the graph of `probs`) when the
    /// load-balancing loss is on.
    fn prob_sums(&self, probs: &Tensor, valid: &[bool]) -> Result<Option<Tensor>> {
        if self.spec.aux_loss_coeff == 0.0 {
            return Ok(None);
        }
        let mask: Vec<f32> = valid.iter().map(|&v| if v { 1.0 } else { 0.0 }).collect();
        let f = || -> std::result::Result<Tensor, tch::TchError> {
            let mask = Tensor::f_from_slice(&mask)?
                .f_to_device(probs.device())?
                .f_unsqueeze(-1)?;
            probs
                .f_mul(&mask)?
                .f_sum_dim_intlist([0i64].as_slice(), false, None::<Kind>)
        };
        f().map(Some).ctx("router probability sums")
    }

    /// With tokens partitioned over the tensor-parallel ranks: sums the valid (token, slot) pairs
    /// per expert, the valid tokens and (with the load-balancing loss) the router probability
    /// sums over them (Megatron-core's `sequence_partition_group`), so `stats` describe the
    /// whole sequence. Returns the summed probability sums.
    fn reduce_stats(
        &self,
        stats: &mut LoadStats,
        p_sum: Option<&Tensor>,
        device: Device,
    ) -> Result<Option<Vec<f64>>> {
        if !self.partitioned() {
            return Ok(None);
        }
        let what = "all_reduce (moe load statistics over the tensor-parallel ranks)";
        let e = self.spec.num_experts as usize;
        let mut host: Vec<f64> = stats.tokens_per_expert.iter().map(|&c| c as f64).collect();
        host.push(stats.tokens as f64);
        let head = Tensor::f_from_slice(&host)
            .and_then(|t| t.f_to_device(device))
            .ctx(what)?;
        let mut buf = match p_sum {
            Some(p) => p
                .f_detach()
                .and_then(|p| p.f_to_kind(Kind::Double))
                .and_then(|p| Tensor::f_cat(&[&head, &p], 0))
                .ctx(what)?,
            None => head,
        };
        self.seq.all_reduce_sum(&mut buf, what)?;
        let v = Vec::<f64>::try_from(&buf.f_to_device(Device::Cpu).ctx(what)?).ctx(what)?;
        stats.tokens_per_expert = v[..e].iter().map(|&c| c.round() as i64).collect();
        stats.tokens = v[e].round() as i64;
        Ok(p_sum.map(|_| v[e + 1..].to_vec()))
    }

    /// The forward; with `grad` the differentiable pieces are built as graphs between the cuts.
    fn run(&self, x: &Tensor, valid: Option<&Tensor>, grad: bool) -> Result<Fwd> {
        let (xs, flags) = self.check(x, valid)?;
        let input_rows = flags.len() as i64;
        let (xs, flags) = match self.sliced() {
            true => (self.slice_of(&xs)?, self.slice_flags(&flags)),
            false => (xs, flags),
        };
        LAST_ROUTED.with(|c| c.set(Some((self.tokens, flags.len() as i64, input_rows))));
        let device = xs.device();
        let xl = if grad {
            cut(&xs, "moe input")?
        } else {
            xs.shallow_clone()
        };
        let (probs, weights, sel) = self.route(&xl)?;
        let mut plan = self.plan(&sel, &flags, device)?;
        let p_sum = self.prob_sums(&probs, &flags)?;
        let p_total = self.reduce_stats(&mut plan.stats, p_sum.as_ref(), device)?;
        // Dispatch: rows of the (token, slot) pairs, expert-major, to the expert owners.
        let xp = xl
            .f_detach()
            .and_then(|x| x.f_index_select(0, &plan.tokens))
            .ctx("permute tokens")?;
        let recv = self.ep.all_to_all_v(
            &xp,
            &plan.send_splits,
            &plan.recv_splits,
            "all_to_all (dispatch tokens)",
        )?;
        drop(xp);
        let gathered = match self.etp_gather() {
            true => self.etp.all_gather_rows(
                &recv,
                &plan.etp_rows,
                "all_gather (expert-tensor-parallel token rows)",
            )?,
            false => recv,
        };
        let sorted = gathered
            .f_index_select(0, &plan.order)
            .ctx("sort by local expert")?;
        drop(gathered);
        let xsl = if grad {
            cut(&sorted, "expert input")?
        } else {
            sorted
        };
        let mut outs = Vec::with_capacity(self.experts.len());
        let mut start = 0;
        for (j, &rows) in plan.expert_rows.iter().enumerate() {
            if rows > 0 {
                let chunk = xsl.f_narrow(0, start, rows).ctx("expert rows")?;
                outs.push(self.mlp(&chunk, self.experts[j])?);
            }
            start += rows;
        }
        let ys = if outs.is_empty() {
            None
        } else {
            Some(Tensor::f_cat(&outs, 0).ctx("expert outputs")?)
        };
        drop(outs);
        let mut y_sorted = match &ys {
            Some(ys) => ys.f_detach_copy().ctx("expert outputs")?,
            None => xsl
                .f_detach()
                .and_then(|x| x.f_zeros_like())
                .ctx("expert outputs")?,
        };
        let y_recv = if self.etp_gather() {
            // Partial sums of every member's rows: each member keeps the sum of its own.
            let y_g = y_sorted
                .f_index_select(0, &plan.inverse)
                .ctx("unsort expert outputs")?;
            self.etp.reduce_scatter_rows(
                &y_g,
                &plan.etp_rows,
                "reduce_scatter (expert output partial sums)",
            )?
        } else {
            if self.etp.size > 1 && y_sorted.numel() > 0 {
                self.etp
                    .all_reduce_sum(&mut y_sorted, "all_reduce (expert output partial sums)")?;
            }
            y_sorted
                .f_index_select(0, &plan.inverse)
                .ctx("unsort expert outputs")?
        };
        let back = self.ep.all_to_all_v(
            &y_recv,
            &plan.recv_splits,
            &plan.send_splits,
            "all_to_all (combine expert outputs)",
        )?;
        let ybl = if grad {
            cut(&back, "expert outputs")?
        } else {
            back
        };
        // Combine: y[t] = Σ_k w[t, k] · expert_k(x[t]), in expert order per token as verl-nn.
        let w = weights
            .f_reshape([-1])
            .and_then(|w| w.f_index_select(0, &plan.flat))
            .and_then(|w| w.f_unsqueeze(-1))
            .ctx("routing weights")?;
        let mut y = xl
            .f_detach()
            .and_then(|x| x.f_zeros_like())
            .and_then(|z| z.f_index_add(0, &plan.tokens, &ybl.f_mul(&w)?))
            .ctx("combine expert outputs")?;
        if let Some((mlp, gate)) = self.shared {
            let s = self
                .mlp(&xl, mlp)?
                .f_mul(
                    &xl.f_linear(self.p(gate), None::<&Tensor>)
                        .and_then(|g| g.f_sigmoid())
                        .ctx("shared expert gate")?,
                )
                .ctx("shared expert")?;
            y = y.f_add(&s).ctx("shared expert")?;
        }
        let aux = self.aux_loss(p_sum.as_ref(), &plan.stats)?;
        plan.stats.aux_loss = match (&aux, &p_total) {
            (None, _) => None,
            // The loss of the whole sequence: Σ over the tensor-parallel ranks of their terms.
            (Some(_), Some(p)) => Some(self.aux_value(p, &plan.stats)),
            (Some(a), None) => Some(a.f_double_value(&[]).ctx("aux loss value")?),
        };
        Ok(Fwd {
            xl,
            xsl,
            ys,
            ybl,
            y,
            aux,
            plan,
        })
    }

    /// `coeff · E / (k · T²)`, the Switch loss's scale for `tokens` valid tokens.
    fn aux_scale(&self, tokens: i64) -> f64 {
        let t = tokens as f64;
        let e = self.spec.num_experts as f64;
        let k = self.spec.top_k as f64;
        self.spec.aux_loss_coeff * e / (k * t * t)
    }

    /// Megatron-core's Switch load-balancing loss term of this rank, coefficient included:
    /// `p_sum` this rank's router probability sums, `stats` the counts (of the whole sequence
    /// when the tokens are partitioned over the tensor-parallel ranks).
    fn aux_loss(&self, p_sum: Option<&Tensor>, stats: &LoadStats) -> Result<Option<Tensor>> {
        let Some(p_sum) = p_sum else {
            return Ok(None);
        };
        if stats.tokens == 0 {
            return Tensor::f_zeros([], (Kind::Float, p_sum.device()))
                .map(Some)
                .ctx("aux loss");
        }
        let counts: Vec<f32> = stats.tokens_per_expert.iter().map(|&c| c as f32).collect();
        let scale = self.aux_scale(stats.tokens);
        let f = || -> std::result::Result<Tensor, tch::TchError> {
            let counts = Tensor::f_from_slice(&counts)?.f_to_device(p_sum.device())?;
            p_sum
                .f_mul(&counts)?
                .f_sum(Kind::Float)?
                .f_mul_scalar(scale)
        };
        f().map(Some).ctx("aux loss")
    }

    /// The whole sequence's load-balancing loss from the probability sums `p_total` and the
    /// counts of `stats`, both summed over the tensor-parallel ranks.
    fn aux_value(&self, p_total: &[f64], stats: &LoadStats) -> f64 {
        if stats.tokens == 0 {
            return 0.0;
        }
        let dot: f64 = p_total
            .iter()
            .zip(&stats.tokens_per_expert)
            .map(|(p, &n)| p * n as f64)
            .sum();
        dot * self.aux_scale(stats.tokens)
    }

    /// The block on `x` (`[.., H]`, this rank's tokens), without autograd. `valid` (`[..]`,
    /// nonzero = real token) restricts the load statistics and the aux loss; every token is
    /// still routed. Every member of the EP and ETP groups (and, with partitioned tokens, of the
    /// tensor-parallel group) must call this together.
    pub fn forward(&self, x: &Tensor, valid: Option<&Tensor>) -> Result<MoeOutput> {
        let _guard = tch::no_grad_guard();
        let f = self.run(x, valid, false)?;
        Ok(MoeOutput {
            y: self.full_rows(&f.y, x, "all_gather (moe output slices)")?,
            stats: f.plan.stats,
        })
    }

    /// Forward and backward of the block for the output gradient `grad_y` (shaped like `x`),
    /// plus `aux_scale ×` the gradient of the load-balancing loss (Megatron scales it like the
    /// main loss: pass the same factor the micro-batch's loss is scaled by). Parameter gradients
    /// (this rank's slices, in the parameter dtype) go to `sink(param_index, grad)` (not called
    /// for a parameter that got none, e.g. an expert without tokens); nothing accumulates in
    /// `.grad`. With tokens partitioned over the tensor-parallel ranks the replicated parameters'
    /// gradients are summed over them first (complete on every rank). Returns the output, the
    /// input gradient and the load statistics. Every member of the EP and ETP groups (and, with
    /// partitioned tokens, of the tensor-parallel group) must call this together.
    pub fn forward_backward(
        &self,
        x: &Tensor,
        valid: Option<&Tensor>,
        grad_y: &Tensor,
        aux_scale: f64,
        sink: &mut dyn FnMut(usize, &Tensor) -> Result<()>,
    ) -> Result<MoeGrad> {
        if grad_y.size() != x.size() {
            return Err(MegatronError::Input {
                call: "expert-parallel moe backward",
                column: "output gradient".into(),
                expected: format!("the input's shape {:?}", x.size()),
                found: format!("{:?}", grad_y.size()),
            });
        }
        let f = self.run(x, valid, true)?;
        let gy = grad_y
            .f_reshape([-1, self.spec.hidden])
            .ctx("output gradient")?;
        let gy = match self.sliced() {
            true => self.slice_of(&gy)?,
            false => gy,
        };
        // Segment 1: combine, router, shared expert and aux loss, up to the combine cut.
        let aux_grad = match &f.aux {
            Some(a) => Some(
                Tensor::f_full(a.size(), aux_scale, (a.kind(), a.device()))
                    .ctx("aux loss gradient")?,
            ),
            None => None,
        };
        let mut roots: Vec<(&Tensor, &Tensor)> = vec![(&f.y, &gy)];
        if let (Some(a), Some(g)) = (&f.aux, &aux_grad) {
            roots.push((a, g));
        }
        let mut replicated = vec![self.router];
        if let Some((mlp, gate)) = self.shared {
            replicated.extend(mlp);
            replicated.push(gate);
        }
        let g = if self.partitioned() {
            // Partial over the tensor-parallel ranks' tokens: summed over them, in a fixed
            // order, whether or not this rank got a gradient.
            let mut got: Vec<Option<Tensor>> = (0..replicated.len()).map(|_| None).collect();
            let mut keep = |i: usize, g: &Tensor| -> Result<()> {
                if let Some(k) = replicated.iter().position(|&r| r == i) {
                    got[k] = Some(g.shallow_clone());
                }
                Ok(())
            };
            let g = self.backward(&roots, &[&f.xl, &f.ybl], &replicated, &mut keep)?;
            for (k, &i) in replicated.iter().enumerate() {
                if !self.p(i).requires_grad() {
                    continue;
                }
                let mut t = match got[k].take() {
                    Some(t) => t.f_contiguous().and_then(|t| t.f_detach_copy()),
                    None => self.p(i).f_detach().and_then(|p| p.f_zeros_like()),
                }
                .ctx("replicated moe gradient")?;
                self.seq.all_reduce_sum(
                    &mut t,
                    "all_reduce (router / shared expert gradient over the tensor-parallel ranks)",
                )?;
                sink(i, &t)?;
            }
            g
        } else {
            self.backward(&roots, &[&f.xl, &f.ybl], &replicated, sink)?
        };
        let (gx_direct, g_back) = (g[0].shallow_clone(), g[1].shallow_clone());
        drop(roots);
        // Reverse of the combine all-to-all: output gradients to the expert owners.
        let g_recv = self.ep.all_to_all_v(
            &g_back,
            &f.plan.send_splits,
            &f.plan.recv_splits,
            "all_to_all (expert output gradient)",
        )?;
        // The backward of the ETP reduce-scatter is an all-gather (of the all-reduce, the
        // identity).
        let g_gathered = match self.etp_gather() {
            true => self.etp.all_gather_rows(
                &g_recv,
                &f.plan.etp_rows,
                "all_gather (expert output gradient)",
            )?,
            false => g_recv,
        };
        let g_sorted = g_gathered
            .f_index_select(0, &f.plan.order)
            .ctx("sort gradient by local expert")?;
        // Segment 2: the local experts.
        let mut g_xs = match &f.ys {
            Some(ys) => {
                let params: Vec<usize> = self.experts.iter().flatten().copied().collect();
                self.backward(&[(ys, &g_sorted)], &[&f.xsl], &params, sink)?[0].shallow_clone()
            }
            None => f.xsl.f_zeros_like().ctx("expert input gradient")?,
        };
        // The experts' input gradients are partial sums over ETP: the backward of the all-gather
        // is a reduce-scatter (of identical inputs, an all-reduce).
        let g_recv_x = if self.etp_gather() {
            let g_g = g_xs
                .f_index_select(0, &f.plan.inverse)
                .ctx("unsort expert input gradient")?;
            self.etp.reduce_scatter_rows(
                &g_g,
                &f.plan.etp_rows,
                "reduce_scatter (expert input gradient)",
            )?
        } else {
            if self.etp.size > 1 && g_xs.numel() > 0 {
                g_xs = g_xs.f_contiguous().ctx("expert input gradient")?;
                self.etp
                    .all_reduce_sum(&mut g_xs, "all_reduce (expert input gradient)")?;
            }
            g_xs.f_index_select(0, &f.plan.inverse)
                .ctx("unsort expert input gradient")?
        };
        // Reverse of the dispatch all-to-all: input gradients back to the token owners.
        let g_xp = self.ep.all_to_all_v(
            &g_recv_x,
            &f.plan.recv_splits,
            &f.plan.send_splits,
            "all_to_all (token gradient)",
        )?;
        let grad_x = gx_direct
            .f_index_add(0, &f.plan.tokens, &g_xp)
            .ctx("input gradient")?;
        Ok(MoeGrad {
            y: self.full_rows(
                &f.y.f_detach().ctx("moe output")?,
                x,
                "all_gather (moe output slices)",
            )?,
            grad_x: self.full_rows(&grad_x, x, "all_gather (moe input gradient slices)")?,
            stats: f.plan.stats,
        })
    }

    /// Differentiates the outputs `roots` (each `(y, dL/dy)`, see [`crate::tp::output_grads`])
    /// w.r.t. `inputs` and the parameters `params`; hands each parameter gradient to `sink`,
    /// returns the inputs' gradients (zeros when unreachable).
    fn backward(
        &self,
        roots: &[(&Tensor, &Tensor)],
        inputs: &[&Tensor],
        params: &[usize],
        sink: &mut dyn FnMut(usize, &Tensor) -> Result<()>,
    ) -> Result<Vec<Tensor>> {
        let mut wrt: Vec<&Tensor> = inputs.to_vec();
        let params: Vec<usize> = params
            .iter()
            .copied()
            .filter(|&i| self.p(i).requires_grad())
            .collect();
        wrt.extend(params.iter().map(|&i| self.p(i)));
        let grads = crate::tp::output_grads(roots, &wrt, false)?;
        let mut out = Vec::with_capacity(inputs.len());
        for (k, g) in grads.iter().enumerate() {
            if k < inputs.len() {
                out.push(match g {
                    Some(g) => g.shallow_clone(),
                    None => inputs[k].f_zeros_like().ctx("zero gradient")?,
                });
            } else if let Some(g) = g {
                sink(params[k - inputs.len()], g)?;
            }
        }
        Ok(out)
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
