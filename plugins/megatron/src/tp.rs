//! The tensor-parallel decoder (Llama / Mistral / Qwen2 / Qwen3 families with a dense MLP, Mixtral /
//! Qwen2-MoE / Qwen3-MoE with expert-parallel MoE blocks), built from the
//! same HF checkpoint folder as `verl_nn::Transformer`: every rank of a tensor-parallel group holds a
//! slice of each matrix and the ranks combine partial results with collectives.
//!
//! * q/k/v and gate/up are column-parallel (`ColumnParallelLinear`): each rank owns whole attention
//!   heads, whole key/value heads and a block of MLP columns, so attention and SwiGLU run locally.
//! * o_proj and down_proj are row-parallel (`RowParallelLinear`): each rank's product is a partial
//!   sum, all-reduced; their bias (if any) is added once, after the reduction.
//! * The embedding and the LM head are vocab-parallel: out-of-shard token ids are masked and the
//!   partial embeddings all-reduced; log-probabilities and entropy are computed from the local
//!   `[.., vocab / tp]` logits with all-reduces of the maximum, the sum of exponentials and the target
//!   logit, so no rank ever holds the full-vocabulary logits.
//! * Norms, biases of row-parallel layers and a value head are replicated.
//! * The sparse layers of a mixture-of-experts model (Mixtral, Qwen2-MoE, Qwen3-MoE) run an
//!   [`EpMoe`] block instead of the MLP: the router (and a shared expert) replicated, the routed
//!   experts shared out over the expert-parallel group (tokens travel by all-to-all) and each
//!   expert split over the expert-tensor-parallel group (Megatron-core's expert grid, any
//!   `expert_tensor_parallel_size`). Its parameters are model parameters (`TpParam::expert`
//!   marks the routed experts' ones). Without sequence parallelism and with ETP = TP the block
//!   routes the tokens the tensor-parallel group shares ([`Tokens::Replicated`]); with ETP ≠ TP
//!   each tensor-parallel rank routes its `1/TP` slice of them and the outputs are all-gathered
//!   ([`Tokens::Slice`]).
//!
//! * Sequence parallelism (Megatron-core's `sequence_parallel`, [`TpModel::set_sequence_parallel`],
//!   TP > 1): the residual stream, the norms and the dropout region hold this rank's block of
//!   `T / tp` positions (the micro-batch padded up to a multiple of TP, padding masked). The
//!   input of QKV and gate/up is all-gathered along the sequence, the partial sums of o_proj,
//!   down and the vocab-parallel embedding are reduce-scattered (instead of all-reduced), the
//!   final norm's output is all-gathered (and unpadded) before the head; in the backward each
//!   all-gather becomes a reduce-scatter and vice versa (a replicated value head's complete
//!   gradient is narrowed instead). The replicated parameters applied to sequence shards (norms,
//!   row-parallel biases) get their gradients all-reduced over TP. A MoE block routes only this
//!   rank's sequence shard (Megatron-core: no all-gather before the block, no reduce-scatter
//!   after it; [`Tokens::Local`]); its load statistics and router loss are reduced over the
//!   tensor-parallel group, so they are those of the whole sequence. Pipeline stages exchange
//!   sequence shards.
//!
//! Autograd through collectives: tch has no custom autograd functions. Megatron's `g` (all-reduce
//! forward, identity backward) is written inside the graph as `s + (x - x.detach())` with `s` the
//! reduced value. Megatron's `f` (identity forward, all-reduce backward) is where the graph is cut:
//! the input of every column-parallel block is a fresh leaf, the backward is chained by hand one
//! segment at a time (like `verl_nn::Transformer::forward_backward_gated`) and the leaf's gradient
//! is all-reduced before it flows on. A layer recomputed in the backward (activation
//! checkpointing, Megatron-core's `recompute_granularity: full`) keeps only its input between
//! forward and backward; the others keep their cut graphs ([`TpModel::set_recompute`]).
//!
//! A model may be one pipeline stage ([`Stage`]): it then holds only its decoder layers (and the
//! embedding on the first stage, the final norm and head on the last), and its forward and backward
//! come in per-stage pieces ([`TpModel::stage_forward`], [`TpModel::head_backward`],
//! [`TpModel::stage_backward`]) that the pipeline schedule strings together across ranks. With
//! virtual pipeline parallelism a stage holds several model chunks (virtual stages) and runs one
//! chunk at a time ([`TpModel::chunk_forward`]; the backward follows the chunk its forward ran).

use std::sync::Arc;

use tch::{Device, Kind, Tensor};
use verl_comm::ReduceOp;
use verl_nn::{apply_rope, repeat_kv, silu_mul, HeadKind, ModelConfig, Rope};

use crate::error::{MegatronError, Result, TorchContext};
use crate::moe::{EpMoe, MoeLoadMetrics, MoeSpec, Tokens};
use crate::parallel::ExpertGroup;
use crate::parallel::Group;

mod build;

mod backward;

mod params;

mod sequence;

mod specs;
pub use crate::layout::Stage;
pub use crate::source::FullSource;
use specs::{is_sparse, moe_layer_of};
pub use specs::{shard_of, stage_specs, EMBED};

mod stage;

/// How a parameter is divided over the tensor-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Every rank holds the whole tensor (norms, row-parallel biases, a value head).
    Replicated,
    /// Rank `r` holds block `r` of dim 0 (column-parallel outputs, vocabulary rows).
    Rows,
    /// Rank `r` holds block `r` of dim 1 (row-parallel inputs).
    Cols,
}

impl Split {
    pub fn dim(self) -> Option<i64> {
        match self {
            Split::Replicated => None,
            Split::Rows => Some(0),
            Split::Cols => Some(1),
        }
    }
}

/// One parameter: its HF name, the full shape, and this rank's slice (an autograd leaf).
#[derive(Debug)]
pub struct TpParam {
    pub name: String,
    pub full_shape: Vec<i64>,
    pub split: Split,
    pub local: Tensor,
    /// A routed expert's parameter: `(its expert index, experts per expert-parallel rank)`. Only
    /// the expert-parallel rank owning the expert holds it; `split` is then its division over the
    /// expert-tensor-parallel group.
    pub expert: Option<(i64, i64)>,
}

/// The expert groups and the router loss coefficient a mixture-of-experts model is built with.
#[derive(Debug, Clone)]
pub struct ExpertSetup {
    pub ep: Arc<ExpertGroup>,
    /// The expert-tensor-parallel group; when it has as many ranks as the tensor-parallel group
    /// it must be those ranks (in the same order).
    pub etp: Arc<ExpertGroup>,
    /// The tensor-parallel ranks (in the same order) as an expert group: the MoE blocks
    /// partition their tokens over it (sequence parallelism, or ETP ≠ TP).
    pub seq: Arc<ExpertGroup>,
    /// Megatron's `moe_aux_loss_coeff` (0 disables the load-balancing loss).
    pub aux_loss_coeff: f64,
}

impl ExpertSetup {
    /// One rank: no expert parallelism, no load-balancing loss.
    pub fn single() -> ExpertSetup {
        ExpertSetup {
            ep: Arc::new(ExpertGroup::single("expert-parallel")),
            etp: Arc::new(ExpertGroup::single("expert-tensor-parallel")),
            seq: Arc::new(ExpertGroup::single("tensor-parallel (moe tokens)")),
            aux_loss_coeff: 0.0,
        }
    }
}

/// What the MoE blocks do on one micro-batch's backward: the scale of the router load-balancing
/// loss's gradient (Megatron scales it like the main loss of the micro-batch) and whether its
/// routing counts enter the step's load metrics (not for a dummy micro-batch).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeMicro {
    pub aux_scale: f64,
    pub record: bool,
}

impl MoeMicro {
    /// No load-balancing gradient, nothing recorded.
    pub const NONE: MoeMicro = MoeMicro {
        aux_scale: 0.0,
        record: false,
    };
}

#[derive(Debug, Clone, Copy)]
struct Lin {
    w: usize,
    b: Option<usize>,
}

#[derive(Debug)]
struct Layer {
    in_norm: usize,
    q: Lin,
    k: Lin,
    v: Lin,
    o: Lin,
    q_norm: Option<usize>,
    k_norm: Option<usize>,
    post_norm: usize,
    ffn: Ffn,
    window: Option<i64>,
}

/// A decoder layer's feed-forward block.
#[derive(Debug)]
enum Ffn {
    /// The tensor-parallel SwiGLU MLP.
    Dense { gate: Lin, up: Lin, down: Lin },
    /// A sparse MoE block with expert parallelism; `index[k]` is the model parameter of the
    /// block's parameter `k`; `layer` the global layer index (for the load metrics).
    Moe {
        block: Box<EpMoe>,
        index: Vec<usize>,
        layer: usize,
    },
}

impl Layer {
    fn attention_params(&self) -> Vec<usize> {
        let mut v = vec![];
        for l in [self.q, self.k, self.v, self.o] {
            v.push(l.w);
            v.extend(l.b);
        }
        v.extend(self.q_norm);
        v.extend(self.k_norm);
        v
    }
    fn ffn_down_bias(&self) -> Option<usize> {
        match self.ffn {
            Ffn::Dense { down, .. } => down.b,
            Ffn::Moe { .. } => None,
        }
    }
    /// The attention block's parameters that act on the gathered (full-sequence) input.
    fn attention_inner_params(&self) -> Vec<usize> {
        let mut v = vec![];
        for l in [self.q, self.k, self.v] {
            v.push(l.w);
            v.extend(l.b);
        }
        v.push(self.o.w);
        v.extend(self.q_norm);
        v.extend(self.k_norm);
        v
    }
    fn mlp_params(&self) -> Vec<usize> {
        let mut v = vec![];
        if let Ffn::Dense { gate, up, down } = self.ffn {
            for l in [gate, up, down] {
                v.push(l.w);
                v.extend(l.b);
            }
        }
        v
    }
}

#[derive(Debug, Clone, Copy)]
enum Head {
    /// Vocab-parallel LM head (the embedding shard when tied).
    Lm(usize),
    /// Replicated value head `score` (`[1, H]` + bias).
    Value { w: usize, b: usize },
}

/// Per-forward inputs shared by all layers: RoPE tables and attention masks.
struct Ctx {
    /// The input ids, padded (with SP) to a multiple of the tensor-parallel size.
    ids: Tensor,
    /// The micro-batch's sequence length before that padding, and after it.
    t: i64,
    t_pad: i64,
    cos: Tensor,
    sin: Tensor,
    /// Real (non-padding) tokens `[B, T]`: what the MoE load statistics and router loss count.
    valid: Tensor,
    masks: Vec<(Option<i64>, Tensor)>,
    /// On CUDA, every row's real tokens come first (padding, if any, only after them) and no
    /// layer has a window: attention is plain causal attention (`is_causal`, GQA in the kernel, no
    /// mask: flash attention), as in the FSDP backend. Real queries see exactly the keys the mask
    /// allows; padding queries (whose outputs nothing reads) see earlier padding too.
    causal: bool,
}

impl Ctx {
    fn mask(&self, window: Option<i64>) -> Result<&Tensor> {
        self.masks
            .iter()
            .find(|(w, _)| *w == window)
            .map(|(_, m)| m)
            .ok_or_else(|| {
                MegatronError::Api(verl_plugin_api::Error::failed(format!(
                    "no attention mask built for window {window:?}"
                )))
            })
    }
}

/// What a pipeline stage keeps of one micro-batch between its forward and its backward: the masks
/// and RoPE tables, each layer's input (the layers are recomputed in the backward, unless their
/// graphs were kept) and the stage's output.
pub struct StageActs {
    /// The model chunk that ran (0 without a virtual pipeline).
    chunk: usize,
    ctx: Ctx,
    inputs: Vec<Tensor>,
    /// Per layer, its autograd graph when the forward kept it ([`TpModel::set_recompute`]):
    /// the backward then chains it without recomputing the layer. Empty otherwise.
    kept: Vec<Option<Kept>>,
    pub out: Tensor,
}

/// A dense layer's forward with autograd, kept for the backward: its input as a leaf and the
/// graph's cut points.
struct Kept {
    h: Tensor,
    tr: Trace,
}

/// Which decoder layers a training backward recomputes from their saved inputs instead of keeping
/// their activations from the forward: Megatron-core's `recompute_granularity` /
/// `recompute_method` / `recompute_num_layers` (see `common::recompute`). Layers with sequence
/// parallelism or a MoE block are recomputed whatever this says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recompute {
    /// Keep every dense layer's activations (verl's default, `recompute_granularity: null`).
    None,
    /// Recompute every layer (`full` with the `uniform` method).
    All,
    /// Recompute the first `n` layers of each model chunk and keep the rest (`full` with the
    /// `block` method and `recompute_num_layers: n`).
    FirstOf(usize),
}

/// What one layer's recomputation keeps for the hand-chained backward.
struct Trace {
    x1: Tensor,
    x1c: Tensor,
    h2: Tensor,
    x2: Tensor,
    x2c: Tensor,
    out: Tensor,
}

/// What the attention half of a layer keeps with SP (see [`TpModel::sp_attention_block`]).
struct SpAttn {
    x1: Tensor,
    x1c: Tensor,
    a_part: Tensor,
    a_c: Tensor,
    h2: Tensor,
    x2: Tensor,
}

/// What one dense layer's recomputation keeps with SP.
struct SpTrace {
    attn: SpAttn,
    x2c: Tensor,
    m_part: Tensor,
    m_c: Tensor,
    out: Tensor,
}

thread_local! {
    /// Introspection: `(positions of the residual stream held, the micro-batch's sequence
    /// length)` of the last stage forward run on this thread.
    static LAST_RESIDUAL: std::cell::Cell<Option<(i64, i64)>> = const { std::cell::Cell::new(None) };
}

/// Debug / introspection hook: `(positions of the residual stream this rank held, the sequence
/// length of the micro-batch)` in the last stage forward run on the calling thread. With sequence
/// parallelism the first is the sequence (padded to a multiple of TP) divided by TP.
pub fn last_residual_positions() -> Option<(i64, i64)> {
    LAST_RESIDUAL.with(|c| c.get())
}

/// The tensor-parallel model of one rank.
pub struct TpModel {
    cfg: ModelConfig,
    head_kind: HeadKind,
    dtype: Kind,
    device: Device,
    pub params: Vec<TpParam>,
    /// The input embedding (first stage only).
    embed: Option<usize>,
    /// This stage's decoder layers.
    layers: Vec<Layer>,
    /// Final norm and head (last stage only).
    norm: Option<usize>,
    head: Option<Head>,
    stage: Stage,
    tp: Arc<Group>,
    experts: ExpertSetup,
    /// Routing counts and load-balancing losses of the training backwards since the last
    /// [`TpModel::take_moe_load`].
    moe_load: std::sync::Mutex<MoeLoadMetrics>,
    heads_local: i64,
    kv_local: i64,
    vocab_start: i64,
    vocab_local: i64,
    /// `pad_token_id` as a row of this rank's embedding shard, or -1.
    padding_local: i64,
    rope: Rope,
    /// Sequence parallelism (Megatron-core's `sequence_parallel`, only with TP > 1): the residual
    /// stream and the norms hold `T / tp` positions per rank.
    sp: bool,
    /// The replicated parameters applied to sequence-sharded activations (the layer norms, the
    /// final norm, the row-parallel biases): with SP their gradients are all-reduced over TP.
    seq_sharded: Vec<bool>,
    /// Which layers training backwards recompute ([`TpModel::set_recompute`]).
    recompute: Recompute,
    /// Per parameter, where a training backward adds its gradient itself instead of handing it
    /// to the sink ([`TpModel::set_grad_targets`]); empty when none.
    grad_into: Vec<Option<Tensor>>,
}

impl std::fmt::Debug for TpModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TpModel")
            .field("arch", &self.cfg.arch)
            .field("head", &self.head_kind)
            .field("tp", &(self.tp.rank, self.tp.size))
            .field("dtype", &self.dtype)
            .finish()
    }
}

impl TpModel {
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }
    pub fn head_kind(&self) -> HeadKind {
        self.head_kind
    }
    pub fn dtype(&self) -> Kind {
        self.dtype
    }
    pub fn device(&self) -> Device {
        self.device
    }
    pub fn tp(&self) -> &Group {
        &self.tp
    }
    pub fn stage(&self) -> Stage {
        self.stage
    }
    /// Turns Megatron-core sequence parallelism on or off; it only takes effect with TP > 1.
    pub fn set_sequence_parallel(&mut self, on: bool) {
        self.sp = on && self.tp.size > 1;
        let tokens = moe_tokens(self.sp, self.tp.size, self.experts.etp.size);
        for l in &mut self.layers {
            if let Ffn::Moe { block, .. } = &mut l.ffn {
                block.set_tokens(self.experts.seq.clone(), tokens);
            }
        }
    }
    pub fn sequence_parallel(&self) -> bool {
        self.sp
    }

    /// Which layers training backwards recompute (a new model: [`Recompute::All`]). The training
    /// forwards ([`TpModel::stage_forward_train`], [`TpModel::chunk_forward_train`]) keep every
    /// other dense layer's activations (its autograd graph, cut where the tensor-parallel backward
    /// all-reduces) and the backward chains them: one forward less per kept layer and
    /// micro-batch, for their activation memory while the micro-batch is in flight. Layers with
    /// sequence parallelism or a MoE block are recomputed whatever this says. Gradients are the
    /// same either way (the same forward, run once instead of twice).
    pub fn set_recompute(&mut self, r: Recompute) {
        self.recompute = r;
    }
    pub fn recompute(&self) -> Recompute {
        self.recompute
    }
    /// Gradient-accumulation fusion (Megatron-core's `gradient_accumulation_fusion`): per
    /// parameter, a contiguous tensor of its local shape (the trainer's fp32 accumulator slice)
    /// into which the backward adds the gradient of each decoder-layer projection weight
    /// directly, with the weight-gradient GEMM itself ([`verl_torch_ext::linear_into`]); those
    /// weights then reach the sink with no gradient. `None` (or an empty list) turns it off.
    pub fn set_grad_targets(&mut self, targets: Option<Vec<Option<Tensor>>>) {
        self.grad_into = targets.unwrap_or_default();
    }

    /// Parameter `i`'s gradient target, while autograd records.
    fn grad_target(&self, i: usize) -> Option<&Tensor> {
        let t = self.grad_into.get(i)?.as_ref()?;
        verl_torch_ext::grad_enabled().then_some(t)
    }

    /// Whether a training forward keeps dense layer `i` (of its model chunk).
    fn keeps_layer(&self, i: usize) -> bool {
        match self.recompute {
            Recompute::None => true,
            Recompute::All => false,
            Recompute::FirstOf(n) => i >= n,
        }
    }

    fn p(&self, i: usize) -> &Tensor {
        &self.params[i].local
    }

    /// Megatron's `g`: all-reduce (sum) over the tensor-parallel group in the forward, identity in
    /// the backward. The reduced value enters the graph as `s + (x - x.detach())`, exactly `s`.
    fn reduce(&self, x: Tensor) -> Result<Tensor> {
        if self.tp.size == 1 {
            return Ok(x);
        }
        let mut s = tch::no_grad(|| x.f_detach_copy()).ctx("reduce buffer")?;
        self.tp
            .all_reduce(&mut s, ReduceOp::Sum, "all_reduce (row-parallel output)")?;
        if !x.requires_grad() {
            return Ok(s);
        }
        let zero = x
            .f_sub(&x.f_detach().ctx("detach")?)
            .ctx("identity backward")?;
        s.f_add(&zero).ctx("identity backward")
    }

    /// All-reduces a gradient that arrived at the input of a column-parallel block (Megatron's
    /// `f` in the backward).
    fn reduce_grad(&self, g: Tensor) -> Result<Tensor> {
        if self.tp.size == 1 {
            return Ok(g);
        }
        let mut g = g.f_contiguous().ctx("gradient")?;
        self.tp
            .all_reduce(&mut g, ReduceOp::Sum, "all_reduce (input gradient)")?;
        Ok(g)
    }

    /// The decoder's RMSNorm, as the FSDP backend's model computes it (libtorch's fused kernel on
    /// CUDA).
    fn rms(&self, x: &Tensor, w: usize) -> Result<Tensor> {
        Ok(verl_nn::rms_norm(x, self.p(w), self.cfg.rms_norm_eps)?)
    }

    fn linear(&self, x: &Tensor, l: Lin, with_bias: bool) -> Result<Tensor> {
        let b = if with_bias {
            l.b.map(|b| self.p(b))
        } else {
            None
        };
        if let Some(acc) = self.grad_target(l.w) {
            let y = verl_torch_ext::linear_into(x, self.p(l.w), &[acc])?;
            return match b {
                Some(b) => y.f_add(b).ctx("bias"),
                None => Ok(y),
            };
        }
        x.f_linear(self.p(l.w), b).ctx("linear")
    }

    /// The vocab-parallel embedding: this rank's rows, out-of-shard ids masked, partial sums reduced.
    fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        if self.tp.size == 1 {
            let w = self.p(self.need_embed()?);
            return Tensor::f_embedding(w, ids, self.padding_local, false, false).ctx("embedding");
        }
        self.reduce(self.embed_partial(ids)?)
    }

    /// The stage input of the first stage: the embedding, reduce-scattered to this rank's sequence
    /// shard with SP (no autograd).
    fn embed_input(&self, ids: &Tensor) -> Result<Tensor> {
        match self.sp {
            true => self.scatter_seq(&self.embed_partial(ids)?),
            false => self.embed(ids),
        }
    }

    /// This rank's partial vocab-parallel embedding (zero rows for out-of-shard ids).
    fn embed_partial(&self, ids: &Tensor) -> Result<Tensor> {
        let w = self.p(self.need_embed()?);
        let in_range = ids
            .f_ge(self.vocab_start)
            .and_then(|a| a.f_logical_and(&ids.f_lt(self.vocab_start + self.vocab_local)?))
            .ctx("embedding range")?;
        let local = ids
            .f_sub_scalar(self.vocab_start)
            .and_then(|x| x.f_mul(&in_range.f_to_kind(Kind::Int64)?))
            .ctx("embedding ids")?;
        Tensor::f_embedding(w, &local, self.padding_local, false, false)
            .and_then(|e| e.f_mul(&in_range.f_unsqueeze(-1)?.f_to_kind(e.kind())?))
            .ctx("embedding")
    }

    fn attention(&self, l: &Layer, x: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        let (b, t) = (x.size()[0], x.size()[1]);
        let hd = self.cfg.head_dim;
        let heads = |lin: Lin, n: i64, norm: Option<usize>| -> Result<Tensor> {
            let y = self
                .linear(x, lin, true)?
                .f_view([b, t, n, hd])
                .ctx("split heads")?;
            let y = match norm {
                Some(w) => self.rms(&y, w)?,
                None => y,
            };
            y.f_transpose(1, 2).ctx("heads first")
        };
        let (q, k, v) = match self.qkv_concatenated(l, x)? {
            Some(y) => {
                let split = |y: Tensor, n: i64, norm: Option<usize>| -> Result<Tensor> {
                    let y = y.f_view([b, t, n, hd]).ctx("split heads")?;
                    let y = match norm {
                        Some(w) => self.rms(&y, w)?,
                        None => y,
                    };
                    y.f_transpose(1, 2).ctx("heads first")
                };
                let (nq, nkv) = (self.heads_local * hd, self.kv_local * hd);
                let mut parts = y
                    .f_split_with_sizes([nq, nkv, nkv], -1)
                    .ctx("split q/k/v")?
                    .into_iter();
                let (Some(qy), Some(ky), Some(vy)) = (parts.next(), parts.next(), parts.next())
                else {
                    return Err(MegatronError::Api(verl_plugin_api::Error::failed(
                        "internal: q/k/v split into fewer than three parts",
                    )));
                };
                (
                    split(qy, self.heads_local, l.q_norm)?,
                    split(ky, self.kv_local, l.k_norm)?,
                    split(vy, self.kv_local, None)?,
                )
            }
            None => (
                heads(l.q, self.heads_local, l.q_norm)?,
                heads(l.k, self.kv_local, l.k_norm)?,
                heads(l.v, self.kv_local, None)?,
            ),
        };
        let q = apply_rope(&q, &ctx.cos, &ctx.sin)?;
        let k = apply_rope(&k, &ctx.cos, &ctx.sin)?;
        let groups = self.heads_local / self.kv_local;
        let out = if ctx.causal {
            verl_nn::causal_attention(&q, &k, &v)?
        } else {
            let (k, v) = (repeat_kv(&k, groups)?, repeat_kv(&v, groups)?);
            Tensor::f_scaled_dot_product_attention(
                &q,
                &k,
                &v,
                Some(ctx.mask(l.window)?),
                0.0,
                false,
                None::<f64>,
                false,
            )
            .ctx("attention")?
        };
        let out = out
            .f_transpose(1, 2)
            .and_then(|o| o.f_contiguous())
            .and_then(|o| o.f_view([b, t, self.heads_local * hd]))
            .ctx("attention")?;
        self.linear(&out, l.o, false)
    }

    /// On CUDA, this rank's q/k/v heads as one GEMM over the concatenated weight shards (and
    /// biases), recorded by autograd: one launch instead of three forward, one input-gradient GEMM
    /// instead of three and their sum backward, as the FSDP model does. `None` off CUDA or with
    /// mixed biases.
    fn qkv_concatenated(&self, l: &Layer, x: &Tensor) -> Result<Option<Tensor>> {
        if !matches!(x.device(), Device::Cuda(_)) {
            return Ok(None);
        }
        let bias = match (l.q.b, l.k.b, l.v.b) {
            (Some(a), Some(b), Some(c)) => {
                Some(Tensor::f_cat(&[self.p(a), self.p(b), self.p(c)], 0).ctx("q/k/v bias")?)
            }
            (None, None, None) => None,
            _ => return Ok(None),
        };
        let w =
            Tensor::f_cat(&[self.p(l.q.w), self.p(l.k.w), self.p(l.v.w)], 0).ctx("q/k/v weight")?;
        if let (Some(aq), Some(ak), Some(av)) = (
            self.grad_target(l.q.w),
            self.grad_target(l.k.w),
            self.grad_target(l.v.w),
        ) {
            let y = verl_torch_ext::linear_into(x, &w, &[aq, ak, av])?;
            return Ok(Some(match bias {
                Some(b) => y.f_add(&b).ctx("q/k/v bias")?,
                None => y,
            }));
        }
        Ok(Some(x.f_linear(&w, bias.as_ref()).ctx("q/k/v")?))
    }

    fn mlp(&self, gate: Lin, up: Lin, down: Lin, x: &Tensor) -> Result<Tensor> {
        let g = self.linear(x, gate, true)?;
        let u = self.linear(x, up, true)?;
        self.linear(&silu_mul(&g, &u)?, down, false)
    }

    fn add_bias(&self, x: Tensor, b: Option<usize>) -> Result<Tensor> {
        match b {
            Some(b) => x.f_add(self.p(b)).ctx("bias"),
            None => Ok(x),
        }
    }

    /// The attention half of a decoder layer: the input norm `x1` (and its leaf `x1c` with
    /// `cut`), the residual stream after attention `h2` and the post-attention norm `x2`.
    fn attention_block(
        &self,
        l: &Layer,
        h: &Tensor,
        ctx: &Ctx,
        cut: bool,
    ) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
        let x1 = self.rms(h, l.in_norm)?;
        let x1c = leaf_if(&x1, cut)?;
        let a = self.reduce(self.attention(l, &x1c, ctx)?)?;
        let a = self.add_bias(a, l.o.b)?;
        let h2 = h.f_add(&a).ctx("residual")?;
        let x2 = self.rms(&h2, l.post_norm)?;
        Ok((x1, x1c, h2, x2))
    }

    /// One decoder layer with a dense MLP. With `cut`, the inputs of the two column-parallel
    /// blocks become fresh leaves (the points where the backward all-reduces).
    fn layer(&self, l: &Layer, h: &Tensor, ctx: &Ctx, cut: bool) -> Result<Trace> {
        let Ffn::Dense { gate, up, down } = l.ffn else {
            return Err(MegatronError::Api(verl_plugin_api::Error::failed(
                "internal: a MoE layer traced as a dense one",
            )));
        };
        let (x1, x1c, h2, x2) = self.attention_block(l, h, ctx, cut)?;
        let x2c = leaf_if(&x2, cut)?;
        let m = self.reduce(self.mlp(gate, up, down, &x2c)?)?;
        let m = self.add_bias(m, down.b)?;
        let out = h2.f_add(&m).ctx("residual")?;
        Ok(Trace {
            x1,
            x1c,
            h2,
            x2,
            x2c,
            out,
        })
    }

    /// One decoder layer's output, without autograd (dense or MoE).
    fn layer_out(&self, l: &Layer, h: &Tensor, ctx: &Ctx) -> Result<Tensor> {
        if self.sp {
            return match &l.ffn {
                Ffn::Dense { .. } => Ok(self.sp_layer(l, h, ctx, false)?.out),
                Ffn::Moe { block, .. } => {
                    // Megatron-core: the block routes this rank's sequence shard.
                    let a = self.sp_attention_block(l, h, ctx, false)?;
                    let valid = self.shard_seq(&ctx.valid)?;
                    let y = block.forward(&a.x2, Some(&valid))?.y;
                    a.h2.f_add(&y).ctx("residual")
                }
            };
        }
        match &l.ffn {
            Ffn::Dense { .. } => Ok(self.layer(l, h, ctx, false)?.out),
            Ffn::Moe { block, .. } => {
                let (_, _, h2, x2) = self.attention_block(l, h, ctx, false)?;
                let y = block.forward(&x2, Some(&ctx.valid))?.y;
                h2.f_add(&y).ctx("residual")
            }
        }
    }

    /// Masks and RoPE tables for one forward (no KV cache: training and scoring only).
    fn prepare(&self, ids: &Tensor, mask: &Tensor, positions: &Tensor) -> Result<Ctx> {
        let s = ids.size();
        if s.len() != 2 || ids.kind() != Kind::Int64 {
            return Err(MegatronError::config(
                "input_ids",
                "int64 [B, T]",
                format!("{:?} {:?}", ids.kind(), s),
            ));
        }
        let (t0, device) = (s[1], ids.device());
        // With SP the sequence is padded up to a multiple of the tensor-parallel size: masked
        // positions at the end that no real query attends to.
        let t = self.padded_len(t0);
        let pad = |x: &Tensor| -> Result<Tensor> {
            match t > t0 {
                true => x.f_constant_pad_nd([0, t - t0]).ctx("sequence padding"),
                false => Ok(x.shallow_clone()),
            }
        };
        let (ids, mask, positions) = (pad(ids)?, pad(mask)?, pad(positions)?);
        let new_mask = mask.f_ne(0).ctx("mask")?;
        let (cos, sin) = self.rope.cos_sin(&positions, self.dtype)?;
        // Same rule as verl-nn: causal, real keys only, sliding windows; a padding query attends to
        // itself so that SDPA never sees an all-false row (NaN in the gradients).
        let build = || -> std::result::Result<Vec<(Option<i64>, Tensor)>, tch::TchError> {
            let q_idx = Tensor::f_arange(t, (Kind::Int64, device))?.f_unsqueeze(1)?;
            let k_idx = Tensor::f_arange(t, (Kind::Int64, device))?.f_unsqueeze(0)?;
            let causal = k_idx.f_le_tensor(&q_idx)?;
            let key_ok = new_mask.f_unsqueeze(1)?;
            let pad_self = k_idx
                .f_eq_tensor(&q_idx)?
                .f_unsqueeze(0)?
                .f_logical_and(&new_mask.f_logical_not()?.f_unsqueeze(2)?)?;
            let mut windows: Vec<Option<i64>> = self.layers.iter().map(|l| l.window).collect();
            windows.sort();
            windows.dedup();
            let mut masks = Vec::new();
            for w in windows {
                let mut allowed = causal.shallow_clone();
                if let Some(w) = w {
                    allowed =
                        allowed.f_logical_and(&k_idx.f_gt_tensor(&q_idx.f_sub_scalar(w)?)?)?;
                }
                let m = allowed
                    .f_unsqueeze(0)?
                    .f_logical_and(&key_ok)?
                    .f_logical_or(&pad_self)?
                    .f_unsqueeze(1)?;
                masks.push((w, m));
            }
            Ok(masks)
        };
        // One host sync per forward: does any row have a real token after a padding one?
        // CUDA only: on the CPU libtorch's causal kernel blocks its work by the head count, so a
        // tensor-parallel shard would no longer compute exactly what one rank computes.
        let causal = device.is_cuda()
            && self.layers.iter().all(|l| l.window.is_none())
            && real_tokens_first(&new_mask).ctx("padding layout")?;
        Ok(Ctx {
            ids,
            t: t0,
            t_pad: t,
            valid: new_mask.shallow_clone(),
            cos: cos.f_unsqueeze(1).ctx("rope")?,
            sin: sin.f_unsqueeze(1).ctx("rope")?,
            masks: if causal {
                Vec::new()
            } else {
                build().ctx("attention masks")?
            },
            causal,
        })
    }

    fn need_embed(&self) -> Result<usize> {
        self.embed
            .ok_or_else(|| self.wrong_stage("the input embedding", "the first"))
    }
    fn need_norm(&self) -> Result<usize> {
        self.norm
            .ok_or_else(|| self.wrong_stage("the final norm", "the last"))
    }
    fn need_head(&self) -> Result<Head> {
        self.head
            .ok_or_else(|| self.wrong_stage("the head", "the last"))
    }
    fn wrong_stage(&self, what: &str, which: &str) -> MegatronError {
        MegatronError::Api(verl_plugin_api::Error::failed(format!(
            "internal: {what} lives on {which} pipeline stage, this is stage {} of {}",
            self.stage.index, self.stage.count
        )))
    }
}

/// Which tokens the MoE blocks route (see [`Tokens`]): this rank's own under sequence
/// parallelism (or at TP = 1, where an expert-tensor-parallel group spans data-parallel ranks);
/// without it the tokens the tensor-parallel group shares when it is the expert-tensor-parallel
/// group (ETP = TP), else this rank's `1/TP` slice of them.
fn moe_tokens(sp: bool, tp: usize, etp: usize) -> Tokens {
    if tp == 1 || sp {
        Tokens::Local
    } else if etp == tp {
        Tokens::Replicated
    } else {
        Tokens::Slice
    }
}

/// A fresh MoE load accumulator listing every sparse layer of `cfg`.
fn fresh_load(cfg: &ModelConfig) -> MoeLoadMetrics {
    let experts = cfg.moe.as_ref().map(|m| m.num_experts).unwrap_or(0).max(0) as usize;
    MoeLoadMetrics::with_layers(
        experts,
        (0..cfg.num_hidden_layers as usize).filter(|&i| is_sparse(cfg, i)),
    )
}

/// `x` as a fresh leaf that requires grad (with `cut`), or `x` itself.
fn leaf_if(x: &Tensor, cut: bool) -> Result<Tensor> {
    if cut {
        x.f_detach()
            .and_then(|d| d.f_set_requires_grad(true))
            .ctx("cut")
    } else {
        Ok(x.shallow_clone())
    }
}

/// Whether every row of the boolean mask `[B, T]` (true = real token) has its real tokens first:
/// no real token after a padding one. One host synchronisation.
fn real_tokens_first(mask: &Tensor) -> std::result::Result<bool, tch::TchError> {
    let t = mask.size()[1];
    if t < 2 {
        return Ok(true);
    }
    let later = mask.f_narrow(1, 1, t - 1)?;
    let earlier_pad = mask.f_narrow(1, 0, t - 1)?.f_logical_not()?;
    Ok(!bool::try_from(
        later.f_logical_and(&earlier_pad)?.f_any()?,
    )?)
}

/// `autograd::grad` of the outputs `roots` (each `(y, dL/dy)`) w.r.t. `wrt`: `dL/dy` is handed
/// over in `y`'s dtype and shape (what autograd hands the `y` of a surrogate `(y · dL/dy).sum()`,
/// without running that product and sum and their backward); an output outside the graph
/// (nothing it depends on needs a gradient) contributes nothing, and `None` marks an unreachable
/// or frozen tensor of `wrt`.
pub(crate) fn output_grads(
    roots: &[(&Tensor, &Tensor)],
    wrt: &[&Tensor],
    keep_graph: bool,
) -> Result<Vec<Option<Tensor>>> {
    let gs = roots
        .iter()
        .map(|(y, g)| {
            let g = match g.kind() == y.kind() {
                true => g.shallow_clone(),
                false => g.f_to_kind(y.kind())?,
            };
            match g.size() == y.size() {
                true => Ok(g),
                false => g.f_expand_as(y),
            }
        })
        .collect::<std::result::Result<Vec<Tensor>, _>>()
        .ctx("output gradient")?;
    let pairs: Vec<(&Tensor, &Tensor)> = roots
        .iter()
        .zip(&gs)
        .filter(|((y, _), _)| y.requires_grad())
        .map(|((y, _), g)| (*y, g))
        .collect();
    Ok(match pairs.is_empty() {
        true => wrt.iter().map(|_| None).collect(),
        false => verl_torch_ext::grad(&pairs, wrt, keep_graph)?,
    })
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod keep_tests;
