//! Expert parallelism for the sparse MoE blocks of Mixtral / Qwen2-MoE / Qwen3-MoE, with
//! Megatron-core's all-to-all token dispatch.
//!
//! * The router (and a Qwen2-MoE shared expert) is replicated; the routed experts are sharded over
//!   the expert-parallel group: EP rank `e` owns experts `[e·E/EP, (e+1)·E/EP)`. With expert tensor
//!   parallelism (ETP > 1) each expert is further split like a dense TP MLP (gate/up by rows,
//!   down by columns) over an ETP group whose members hold the same tokens.
//! * Dispatch: route (fp32 softmax, top-k, optional renormalisation: exactly `verl_nn`'s maths),
//!   permute the (token, slot) pairs expert-major (so they are grouped by destination rank),
//!   all-gather the per-expert counts, `all_to_all_v` the token rows to the expert owners, sort the
//!   received rows by local expert, run the experts (partial sums all-reduced over ETP), undo the
//!   sort, `all_to_all_v` back, and combine: `y[t] = Σ_k w[t,k] · expert_k(x[t])` (+ the shared
//!   expert). No capacity limit, no token dropping.
//! * Backward through the collectives is chained by hand (tch has no custom autograd functions):
//!   the graph is cut at both all-to-alls; the gradient of an all-to-all is the reverse
//!   all-to-all; the expert input gradient is all-reduced over ETP (Megatron's `f`), the expert
//!   output gradient is not (Megatron's `g`).
//! * The router load-balancing loss is Megatron-core's Switch loss
//!   `coeff · E / (k · T²) · Σ_e (Σ_t p[t,e]) · n_e` (`p` the full softmax, `n_e` the (token, slot)
//!   pairs routed to `e`, `T` the tokens; HF Mixtral's loss divided by `k`), over this rank's valid
//!   tokens. Its gradient is added in [`EpMoe::forward_backward`] with a caller-given scale.
//! * Load metrics ([`LoadStats`], [`MoeLoadMetrics`]): routed pairs per expert and the imbalance
//!   `max / mean`, as step metrics `moe/expert_load/<e>`, `moe/load_imbalance`,
//!   `moe/load_imbalance_max` and `moe/aux_loss`.

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

/// Host-side routing plan of one call: which rows go where.
struct Plan {
    /// Flat (token · k + slot) indices, expert-major, ascending within an expert.
    flat: Tensor,
    /// The token of each entry of `flat`.
    tokens: Tensor,
    send_splits: Vec<usize>,
    recv_splits: Vec<usize>,
    /// Received rows in local-expert-major order (indices into the received rows) and back.
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
            .field("experts", &(self.first_expert, self.local_experts))
            .finish()
    }
}

fn cut(x: &Tensor, what: &str) -> Result<Tensor> {
    x.f_detach()
        .and_then(|d| d.f_set_requires_grad(true))
        .ctx(what)
}

/// `(y · g).sum()`: its gradient w.r.t. `y` is exactly `g`.
fn surrogate(y: &Tensor, g: &Tensor) -> Result<Tensor> {
    y.f_mul(g)
        .and_then(|x| x.f_sum(Kind::Float))
        .ctx("surrogate loss")
}

fn index(v: &[i64], device: Device, what: &str) -> Result<Tensor> {
    Tensor::f_from_slice(v)
        .and_then(|t| t.f_to_device(device))
        .ctx(what)
}

impl EpMoe {
    /// Builds this rank's part of the block `spec`: the replicated router (and shared expert) and
    /// its experts, read as full tensors from `source`. `etp` must be a group whose members get
    /// identical inputs (e.g. the tensor-parallel group without sequence parallelism).
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
        // Received rows are [source][local expert]; the experts want [local expert][source].
        let mut offsets = Vec::with_capacity(all.len());
        let mut start = 0i64;
        for c in &all {
            offsets.push(start);
            start += c[first..first + per_rank].iter().sum::<i64>();
        }
        let mut order = Vec::with_capacity(start as usize);
        let mut expert_rows = vec![0i64; per_rank];
        for (j, rows) in expert_rows.iter_mut().enumerate() {
            for (s, c) in all.iter().enumerate() {
                let before: i64 = c[first..first + j].iter().sum();
                let n = c[first + j];
                order.extend(offsets[s] + before..offsets[s] + before + n);
                *rows += n;
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
            order: index(&order, device, "expert order")?,
            inverse: index(&inverse, device, "expert order")?,
            expert_rows,
            stats,
        })
    }

    /// The forward; with `grad` the differentiable pieces are built as graphs between the cuts.
    fn run(&self, x: &Tensor, valid: Option<&Tensor>, grad: bool) -> Result<Fwd> {
        let (xs, flags) = self.check(x, valid)?;
        let device = xs.device();
        let xl = if grad {
            cut(&xs, "moe input")?
        } else {
            xs.shallow_clone()
        };
        let (probs, weights, sel) = self.route(&xl)?;
        let mut plan = self.plan(&sel, &flags, device)?;
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
        let sorted = recv
            .f_index_select(0, &plan.order)
            .ctx("sort by local expert")?;
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
        if self.etp.size > 1 && y_sorted.numel() > 0 {
            self.etp
                .all_reduce_sum(&mut y_sorted, "all_reduce (expert output partial sums)")?;
        }
        let y_recv = y_sorted
            .f_index_select(0, &plan.inverse)
            .ctx("unsort expert outputs")?;
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
        let aux = self.aux_loss(&probs, &flags, &plan.stats)?;
        if let Some(a) = &aux {
            plan.stats.aux_loss = Some(a.f_double_value(&[]).ctx("aux loss value")?);
        }
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

    /// Megatron-core's Switch load-balancing loss over the valid tokens, coefficient included.
    fn aux_loss(
        &self,
        probs: &Tensor,
        valid: &[bool],
        stats: &LoadStats,
    ) -> Result<Option<Tensor>> {
        let coeff = self.spec.aux_loss_coeff;
        if coeff == 0.0 {
            return Ok(None);
        }
        let t = stats.tokens as f64;
        if t == 0.0 {
            return Tensor::f_zeros([], (Kind::Float, probs.device()))
                .map(Some)
                .ctx("aux loss");
        }
        let e = self.spec.num_experts as f64;
        let k = self.spec.top_k as f64;
        let mask: Vec<f32> = valid.iter().map(|&v| if v { 1.0 } else { 0.0 }).collect();
        let counts: Vec<f32> = stats.tokens_per_expert.iter().map(|&c| c as f32).collect();
        let f = || -> std::result::Result<Tensor, tch::TchError> {
            let mask = Tensor::f_from_slice(&mask)?
                .f_to_device(probs.device())?
                .f_unsqueeze(-1)?;
            let counts = Tensor::f_from_slice(&counts)?.f_to_device(probs.device())?;
            let p_sum =
                probs
                    .f_mul(&mask)?
                    .f_sum_dim_intlist([0i64].as_slice(), false, None::<Kind>)?;
            p_sum
                .f_mul(&counts)?
                .f_sum(Kind::Float)?
                .f_mul_scalar(coeff * e / (k * t * t))
        };
        f().map(Some).ctx("aux loss")
    }

    /// The block on `x` (`[.., H]`, this rank's tokens), without autograd. `valid` (`[..]`,
    /// nonzero = real token) restricts the load statistics and the aux loss; every token is
    /// still routed. Every member of the EP (and ETP) group must call this together.
    pub fn forward(&self, x: &Tensor, valid: Option<&Tensor>) -> Result<MoeOutput> {
        let _guard = tch::no_grad_guard();
        let f = self.run(x, valid, false)?;
        Ok(MoeOutput {
            y: f.y.f_reshape(x.size().as_slice()).ctx("moe output")?,
            stats: f.plan.stats,
        })
    }

    /// Forward and backward of the block for the output gradient `grad_y` (shaped like `x`),
    /// plus `aux_scale ×` the gradient of the load-balancing loss (Megatron scales it like the
    /// main loss: pass the same factor the micro-batch's loss is scaled by). Parameter gradients
    /// (this rank's slices, in the parameter dtype) go to `sink(param_index, grad)` (not called
    /// for a parameter that got none, e.g. an expert without tokens); nothing accumulates in
    /// `.grad`. Returns the output, the input gradient and the load statistics. Every member of
    /// the EP (and ETP) group must call this together.
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
            .f_reshape(f.y.size().as_slice())
            .ctx("output gradient")?;
        // Segment 1: combine, router, shared expert and aux loss, up to the combine cut.
        let mut root = surrogate(&f.y, &gy)?;
        if let Some(a) = &f.aux {
            root = root
                .f_add(&a.f_mul_scalar(aux_scale).ctx("aux loss")?)
                .ctx("aux loss")?;
        }
        let mut replicated = vec![self.router];
        if let Some((mlp, gate)) = self.shared {
            replicated.extend(mlp);
            replicated.push(gate);
        }
        let g = self.backward(&root, &[&f.xl, &f.ybl], &replicated, sink)?;
        let (gx_direct, g_back) = (g[0].shallow_clone(), g[1].shallow_clone());
        drop(root);
        // Reverse of the combine all-to-all: output gradients to the expert owners.
        let g_recv = self.ep.all_to_all_v(
            &g_back,
            &f.plan.send_splits,
            &f.plan.recv_splits,
            "all_to_all (expert output gradient)",
        )?;
        let g_sorted = g_recv
            .f_index_select(0, &f.plan.order)
            .ctx("sort gradient by local expert")?;
        // Segment 2: the local experts (the ETP all-reduce of the output is the identity here).
        let mut g_xs = match &f.ys {
            Some(ys) => {
                let root = surrogate(ys, &g_sorted)?;
                let params: Vec<usize> = self.experts.iter().flatten().copied().collect();
                self.backward(&root, &[&f.xsl], &params, sink)?[0].shallow_clone()
            }
            None => f.xsl.f_zeros_like().ctx("expert input gradient")?,
        };
        if self.etp.size > 1 && g_xs.numel() > 0 {
            g_xs = g_xs.f_contiguous().ctx("expert input gradient")?;
            self.etp
                .all_reduce_sum(&mut g_xs, "all_reduce (expert input gradient)")?;
        }
        let g_recv_x = g_xs
            .f_index_select(0, &f.plan.inverse)
            .ctx("unsort expert input gradient")?;
        // Reverse of the dispatch all-to-all: input gradients back to the token owners.
        let g_xp = self.ep.all_to_all_v(
            &g_recv_x,
            &f.plan.recv_splits,
            &f.plan.send_splits,
            "all_to_all (token gradient)",
        )?;
        let grad_x = gx_direct
            .f_index_add(0, &f.plan.tokens, &g_xp)
            .and_then(|g| g.f_reshape(x.size().as_slice()))
            .ctx("input gradient")?;
        Ok(MoeGrad {
            y: f.y
                .f_detach()
                .and_then(|y| y.f_reshape(x.size().as_slice()))
                .ctx("moe output")?,
            grad_x,
            stats: f.plan.stats,
        })
    }

    /// Differentiates `root` w.r.t. `inputs` and the parameters `params`; hands each defined
    /// parameter gradient to `sink`, returns the inputs' gradients (zeros when unreachable).
    fn backward(
        &self,
        root: &Tensor,
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
        let grads = if root.requires_grad() {
            Tensor::f_run_backward(&[root], &wrt, false, false).ctx("moe backward")?
        } else {
            (0..wrt.len()).map(|_| Tensor::new()).collect()
        };
        let mut out = Vec::with_capacity(inputs.len());
        for (k, g) in grads.iter().enumerate() {
            if k < inputs.len() {
                out.push(if g.defined() {
                    g.shallow_clone()
                } else {
                    inputs[k].f_zeros_like().ctx("zero gradient")?
                });
            } else if g.defined() {
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
