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
use verl_nn::{Checkpoint, HeadKind, ModelConfig, RopeScaling};

use crate::error::{MegatronError, Result, TorchContext};
use crate::moe::{EpMoe, ExpertGroup, MoeLoadMetrics, MoeSpec, Tokens};
use crate::parallel::Group;

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
    fn dim(self) -> Option<i64> {
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

/// Where full (unsplit) parameter values come from when a model is built or reloaded.
pub trait FullSource {
    /// The full tensor `name`, or `None` when the source lacks it.
    fn full(&mut self, name: &str) -> Result<Option<Tensor>>;
}

impl FullSource for Checkpoint {
    fn full(&mut self, name: &str) -> Result<Option<Tensor>> {
        if !self.contains(name) {
            return Ok(None);
        }
        Ok(Some(self.tensor(name)?))
    }
}

impl FullSource for std::collections::HashMap<String, Tensor> {
    fn full(&mut self, name: &str) -> Result<Option<Tensor>> {
        Ok(self.get(name).map(|t| t.shallow_clone()))
    }
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
    inv_freq: Tensor,
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

/// The parameters of a model, in a fixed order, with their full shapes and splits.
fn param_specs(cfg: &ModelConfig, head: HeadKind) -> Result<Vec<(String, Vec<i64>, Split)>> {
    if head == HeadKind::SequenceClassification {
        return Err(MegatronError::Unsupported {
            key: "reward_model".into(),
            what: "a sequence-classification head".into(),
        });
    }
    let (h, nh, nkv, hd, inter, v) = (
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.intermediate_size,
        cfg.vocab_size,
    );
    let mut out = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![v, h],
        Split::Rows,
    )];
    for i in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{i}");
        let mut push = |n: String, s: Vec<i64>, sp: Split| out.push((n, s, sp));
        push(
            format!("{p}.input_layernorm.weight"),
            vec![h],
            Split::Replicated,
        );
        for (n, rows) in [
            ("q_proj", nh * hd),
            ("k_proj", nkv * hd),
            ("v_proj", nkv * hd),
        ] {
            push(
                format!("{p}.self_attn.{n}.weight"),
                vec![rows, h],
                Split::Rows,
            );
            if cfg.qkv_bias {
                push(format!("{p}.self_attn.{n}.bias"), vec![rows], Split::Rows);
            }
        }
        push(
            format!("{p}.self_attn.o_proj.weight"),
            vec![h, nh * hd],
            Split::Cols,
        );
        if cfg.o_bias {
            push(
                format!("{p}.self_attn.o_proj.bias"),
                vec![h],
                Split::Replicated,
            );
        }
        if cfg.qk_norm {
            push(
                format!("{p}.self_attn.q_norm.weight"),
                vec![hd],
                Split::Replicated,
            );
            push(
                format!("{p}.self_attn.k_norm.weight"),
                vec![hd],
                Split::Replicated,
            );
        }
        push(
            format!("{p}.post_attention_layernorm.weight"),
            vec![h],
            Split::Replicated,
        );
        if is_sparse(cfg, i as usize) {
            out.extend(moe_specs(cfg, i as usize)?);
            continue;
        }
        for n in ["gate_proj", "up_proj"] {
            push(format!("{p}.mlp.{n}.weight"), vec![inter, h], Split::Rows);
            if cfg.mlp_bias {
                push(format!("{p}.mlp.{n}.bias"), vec![inter], Split::Rows);
            }
        }
        push(
            format!("{p}.mlp.down_proj.weight"),
            vec![h, inter],
            Split::Cols,
        );
        if cfg.mlp_bias {
            push(
                format!("{p}.mlp.down_proj.bias"),
                vec![h],
                Split::Replicated,
            );
        }
    }
    out.push(("model.norm.weight".into(), vec![h], Split::Replicated));
    match head {
        HeadKind::CausalLm if cfg.tie_word_embeddings => {}
        HeadKind::CausalLm => out.push(("lm_head.weight".into(), vec![v, h], Split::Rows)),
        _ => {
            out.push(("score.weight".into(), vec![1, h], Split::Replicated));
            out.push(("score.bias".into(), vec![1], Split::Replicated));
        }
    }
    Ok(out)
}

/// Whether decoder layer `layer` of `cfg` is a sparse MoE layer.
fn is_sparse(cfg: &ModelConfig, layer: usize) -> bool {
    cfg.moe
        .as_ref()
        .and_then(|m| m.sparse_layers.get(layer).copied())
        .unwrap_or(false)
}

/// The parameters of sparse layer `layer`'s MoE block (every expert), as [`EpMoe`] holds them:
/// the router and a shared expert replicated, each routed expert's gate/up split by rows and
/// down by columns over the (expert-)tensor-parallel group.
fn moe_specs(cfg: &ModelConfig, layer: usize) -> Result<Vec<(String, Vec<i64>, Split)>> {
    let s = MoeSpec::new(cfg, layer, 0.0)?;
    let (p, e, h, inter) = (&s.prefix, s.num_experts, s.hidden, s.expert_intermediate);
    let [g, u, d] = s.names;
    let mut out = vec![(format!("{p}.gate.weight"), vec![e, h], Split::Replicated)];
    for x in 0..e {
        out.push((
            format!("{p}.experts.{x}.{g}.weight"),
            vec![inter, h],
            Split::Rows,
        ));
        out.push((
            format!("{p}.experts.{x}.{u}.weight"),
            vec![inter, h],
            Split::Rows,
        ));
        out.push((
            format!("{p}.experts.{x}.{d}.weight"),
            vec![h, inter],
            Split::Cols,
        ));
    }
    if let Some(si) = s.shared_intermediate {
        for (n, shape) in [
            ("gate_proj", vec![si, h]),
            ("up_proj", vec![si, h]),
            ("down_proj", vec![h, si]),
        ] {
            out.push((
                format!("{p}.shared_expert.{n}.weight"),
                shape,
                Split::Replicated,
            ));
        }
        out.push((
            format!("{p}.shared_expert_gate.weight"),
            vec![1, h],
            Split::Replicated,
        ));
    }
    Ok(out)
}

/// The MoE block prefix (`model.layers.<i>.block_sparse_moe` / `.mlp`) of a sparse layer's
/// parameter `name`, with the layer index.
fn moe_layer_of(cfg: &ModelConfig, name: &str) -> Option<usize> {
    let i = layer_of(name)?;
    if !is_sparse(cfg, i) {
        return None;
    }
    let p = format!("model.layers.{i}.");
    let rest = name.strip_prefix(&p)?;
    (rest.starts_with("block_sparse_moe.") || rest.starts_with("mlp.")).then_some(i)
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

/// The global layer index of a parameter name (`model.layers.<i>.…`).
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("model.layers.")?
        .split('.')
        .next()?
        .parse()
        .ok()
}

/// The parameters stage `stage` holds, in [`param_specs`] order. With tied embeddings the last
/// stage holds its own copy of the embedding as the LM head (Megatron's shared embedding): its
/// gradient is summed with the first stage's before every optimizer step, so both copies stay
/// equal.
pub fn stage_specs(
    cfg: &ModelConfig,
    head: HeadKind,
    stage: Stage,
) -> Result<Vec<(String, Vec<i64>, Split)>> {
    let layers = stage.layers(cfg.num_hidden_layers as usize);
    let tied_head = head == HeadKind::CausalLm && cfg.tie_word_embeddings;
    Ok(param_specs(cfg, head)?
        .into_iter()
        .filter(|(name, _, _)| match layer_of(name) {
            Some(i) => layers.contains(&i),
            None if name == EMBED => stage.is_first() || (stage.is_last() && tied_head),
            None => stage.is_last(),
        })
        .collect())
}

pub const EMBED: &str = "model.embed_tokens.weight";

/// Rank `rank`'s block of `full` (of `size` blocks) under `split`.
pub fn shard_of(full: &Tensor, split: Split, rank: usize, size: usize) -> Result<Tensor> {
    match split.dim() {
        None => Ok(full.shallow_clone()),
        Some(d) => {
            let n = full.size()[d as usize] / size as i64;
            full.f_narrow(d, rank as i64 * n, n)
                .ctx("tensor-parallel shard")
        }
    }
}

impl TpModel {
    /// Builds this rank's slices of the model described by `cfg`, reading full tensors from
    /// `source`. A value head the source lacks (a critic started from a policy checkpoint) is
    /// initialised like HF's `_init_weights`, from the global generator: seed it identically on
    /// every rank first.
    pub fn new(
        cfg: ModelConfig,
        head_kind: HeadKind,
        dtype: Kind,
        device: Device,
        tp: Arc<Group>,
        source: &mut dyn FullSource,
    ) -> Result<TpModel> {
        Self::new_stage(
            cfg,
            head_kind,
            dtype,
            device,
            tp,
            Stage::single(),
            ExpertSetup::single(),
            source,
        )
    }

    /// [`TpModel::new`] for pipeline stage `stage`: only that stage's parameters are read and held.
    /// The sparse MoE layers of a mixture-of-experts model hold this expert-parallel rank's
    /// experts (of `experts.ep`), each split over the expert-tensor-parallel group.
    #[allow(clippy::too_many_arguments)]
    pub fn new_stage(
        cfg: ModelConfig,
        head_kind: HeadKind,
        dtype: Kind,
        device: Device,
        tp: Arc<Group>,
        stage: Stage,
        experts: ExpertSetup,
        source: &mut dyn FullSource,
    ) -> Result<TpModel> {
        if cfg.moe.is_some() && tp.size > 1 && experts.seq.size != tp.size {
            return Err(MegatronError::Api(verl_plugin_api::Error::failed(format!(
                "internal: the MoE token group has {} ranks, the tensor-parallel group {}",
                experts.seq.size, tp.size
            ))));
        }
        let specs = stage_specs(&cfg, head_kind, stage)?;
        let (rank, size) = (tp.rank, tp.size);
        let mut params = Vec::with_capacity(specs.len());
        let mut moe_splits = std::collections::HashMap::new();
        for (name, shape, split) in specs {
            if moe_layer_of(&cfg, &name).is_some() {
                moe_splits.insert(name, split);
                continue;
            }
            let full = match source.full(&name)? {
                Some(t) => t,
                None if name.starts_with("score.") => {
                    let t = Tensor::f_zeros(shape.as_slice(), (dtype, device)).ctx("value head")?;
                    if name.ends_with(".weight") {
                        let mut t2 = t.shallow_clone();
                        let _ = tch::no_grad(|| t2.f_normal_(0.0, cfg.initializer_range))
                            .ctx("initialise value head")?;
                    }
                    tracing::warn!("{name} is not in the checkpoint: freshly initialised");
                    t
                }
                None => {
                    return Err(MegatronError::Model(verl_nn::NnError::MissingTensor {
                        dir: std::path::PathBuf::from("<model source>"),
                        name,
                        arch: cfg.arch.to_string(),
                    }))
                }
            };
            if full.size() != shape {
                return Err(MegatronError::Model(verl_nn::NnError::ShapeMismatch {
                    path: std::path::PathBuf::from("<model source>"),
                    name,
                    expected: shape,
                    found: full.size(),
                }));
            }
            let local = shard_of(&full, split, rank, size)?
                .f_to_kind(dtype)
                .and_then(|t| t.f_to_device(device))
                .and_then(|t| t.f_contiguous())
                .and_then(|t| t.f_detach_copy())
                .ctx(&format!("load `{name}`"))?;
            params.push(TpParam {
                name,
                full_shape: shape,
                split,
                local,
                expert: None,
            });
        }
        // The MoE blocks read their own parameters (this rank's experts); the model shares their
        // tensors, so the optimizer's writes reach the blocks.
        let mut blocks = std::collections::HashMap::new();
        for i in stage.layers(cfg.num_hidden_layers as usize) {
            if !is_sparse(&cfg, i) {
                continue;
            }
            let spec = MoeSpec::new(&cfg, i, experts.aux_loss_coeff)?;
            let mut block = EpMoe::new(
                spec,
                experts.ep.clone(),
                experts.etp.clone(),
                dtype,
                device,
                source,
            )?;
            block.set_tokens(
                experts.seq.clone(),
                moe_tokens(false, tp.size, experts.etp.size),
            );
            let per_rank = block.local_expert_range().end - block.local_expert_range().start;
            let mut index = Vec::with_capacity(block.params.len());
            for mp in &block.params {
                let split = moe_splits.get(&mp.name).copied().ok_or_else(|| {
                    MegatronError::Api(verl_plugin_api::Error::failed(format!(
                        "internal: MoE parameter `{}` has no spec",
                        mp.name
                    )))
                })?;
                index.push(params.len());
                params.push(TpParam {
                    name: mp.name.clone(),
                    full_shape: mp.full_shape.clone(),
                    split,
                    local: mp.local.shallow_clone(),
                    expert: match mp.placement {
                        crate::moe::Placement::Expert { expert, .. } => Some((expert, per_rank)),
                        crate::moe::Placement::Replicated => None,
                    },
                });
            }
            blocks.insert(i, (block, index));
        }
        let index = |n: &str| -> Option<usize> { params.iter().position(|p| p.name == n) };
        let need = |n: String| -> Result<usize> {
            index(&n).ok_or_else(|| {
                MegatronError::Api(verl_plugin_api::Error::failed(format!(
                    "internal: parameter `{n}` was not built"
                )))
            })
        };
        let lin = |p: String| -> Result<Lin> {
            Ok(Lin {
                w: need(format!("{p}.weight"))?,
                b: index(&format!("{p}.bias")),
            })
        };
        let mut layers = Vec::new();
        for i in stage.layers(cfg.num_hidden_layers as usize) {
            let p = format!("model.layers.{i}");
            layers.push(Layer {
                in_norm: need(format!("{p}.input_layernorm.weight"))?,
                q: lin(format!("{p}.self_attn.q_proj"))?,
                k: lin(format!("{p}.self_attn.k_proj"))?,
                v: lin(format!("{p}.self_attn.v_proj"))?,
                o: lin(format!("{p}.self_attn.o_proj"))?,
                q_norm: index(&format!("{p}.self_attn.q_norm.weight")),
                k_norm: index(&format!("{p}.self_attn.k_norm.weight")),
                post_norm: need(format!("{p}.post_attention_layernorm.weight"))?,
                ffn: match blocks.remove(&i) {
                    Some((block, index)) => Ffn::Moe {
                        block: Box::new(block),
                        index,
                        layer: i,
                    },
                    None => Ffn::Dense {
                        gate: lin(format!("{p}.mlp.gate_proj"))?,
                        up: lin(format!("{p}.mlp.up_proj"))?,
                        down: lin(format!("{p}.mlp.down_proj"))?,
                    },
                },
                window: cfg.layer_windows.get(i).copied().flatten(),
            });
        }
        let embed = match stage.is_first() {
            true => Some(need(EMBED.into())?),
            false => None,
        };
        let (norm, head) = match (stage.is_last(), head_kind) {
            (false, _) => (None, None),
            (true, HeadKind::CausalLm) => (
                Some(need("model.norm.weight".into())?),
                Some(Head::Lm(match index("lm_head.weight") {
                    Some(i) => i,
                    None => need(EMBED.into())?,
                })),
            ),
            (true, _) => (
                Some(need("model.norm.weight".into())?),
                Some(Head::Value {
                    w: need("score.weight".into())?,
                    b: need("score.bias".into())?,
                }),
            ),
        };
        let tp_size = size as i64;
        let vocab_local = cfg.vocab_size / tp_size;
        let vocab_start = rank as i64 * vocab_local;
        let padding_local = cfg
            .pad_token_id
            .filter(|&p| p >= vocab_start && p < vocab_start + vocab_local)
            .map(|p| p - vocab_start)
            .unwrap_or(-1);
        let inv_freq = inv_freq(&cfg, device)?;
        let moe_load = std::sync::Mutex::new(fresh_load(&cfg));
        let mut seq_sharded = vec![false; params.len()];
        for l in &layers {
            seq_sharded[l.in_norm] = true;
            seq_sharded[l.post_norm] = true;
            for b in [l.o.b, l.ffn_down_bias()].into_iter().flatten() {
                seq_sharded[b] = true;
            }
        }
        if let Some(n) = norm {
            seq_sharded[n] = true;
        }
        Ok(TpModel {
            sp: false,
            recompute: Recompute::All,
            grad_into: Vec::new(),
            seq_sharded,
            experts,
            moe_load,
            heads_local: cfg.num_attention_heads / tp_size,
            kv_local: cfg.num_key_value_heads / tp_size,
            vocab_start,
            vocab_local,
            padding_local,
            norm,
            embed,
            layers,
            head,
            stage,
            head_kind,
            dtype,
            device,
            tp,
            inv_freq,
            params,
            cfg,
        })
    }

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
    /// Whether this stage holds the last stage's copy of a tied embedding (its LM head).
    pub fn holds_tied_head_copy(&self) -> bool {
        !self.stage.is_first()
            && matches!(self.head, Some(Head::Lm(w)) if self.params[w].name == EMBED)
    }
    /// The index of parameter `name` on this stage.
    pub fn param_index(&self, name: &str) -> Option<usize> {
        self.params.iter().position(|p| p.name == name)
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

    /// The sequence length a micro-batch of `t` positions runs at: with SP, `t` padded up to a
    /// multiple of the tensor-parallel size (the padding is masked).
    pub fn padded_len(&self, t: i64) -> i64 {
        let n = self.tp.size as i64;
        match self.sp {
            true => (t + n - 1) / n * n,
            false => t,
        }
    }
    /// The positions of the residual stream this rank holds for a micro-batch of `t` positions.
    pub fn local_len(&self, t: i64) -> i64 {
        match self.sp {
            true => self.padded_len(t) / self.tp.size as i64,
            false => t,
        }
    }
    /// The shape of a stage's output (and of its gradient) for input ids `[B, T]`: what pipeline
    /// stages exchange, `[B, T / tp (padded), H]` with SP.
    pub fn activation_shape(&self, ids: &Tensor) -> [i64; 3] {
        let s = ids.size();
        [s[0], self.local_len(s[1]), self.cfg.hidden_size]
    }

    /// All-gathers sequence shards `[B, T / tp, ..]` into `[B, T, ..]` (no autograd).
    fn gather_seq(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.f_detach().ctx("sequence gather input")?;
        let parts = self
            .tp
            .all_gather(&x, "all_gather (sequence-parallel activations)")?;
        Tensor::f_cat(&parts, 1).ctx("join sequence shards")
    }

    /// Reduce-scatters partial sums `[B, T, ..]` along the sequence: this rank's `[B, T / tp, ..]`
    /// block of the sum over the tensor-parallel group (no autograd).
    fn scatter_seq(&self, x: &Tensor) -> Result<Tensor> {
        let s = x.size();
        let n = self.tp.size as i64;
        let tl = s[1] / n;
        let mut blocked = vec![s[0], n, tl];
        blocked.extend_from_slice(&s[2..]);
        let mut out_shape = vec![s[0], tl];
        out_shape.extend_from_slice(&s[2..]);
        let input = x
            .f_detach()
            .and_then(|x| x.f_reshape(blocked.as_slice()))
            .and_then(|x| x.f_transpose(0, 1))
            .and_then(|x| x.f_contiguous())
            .and_then(|x| x.f_reshape([-1]))
            .ctx("sequence scatter input")?;
        let numel: i64 = out_shape.iter().product();
        let mut out = Tensor::f_zeros([numel], (x.kind(), x.device())).ctx("scatter buffer")?;
        self.tp.reduce_scatter_sum(
            &mut out,
            &input,
            "reduce_scatter (sequence-parallel partial sums)",
        )?;
        out.f_reshape(out_shape.as_slice()).ctx("sequence shard")
    }

    /// This rank's sequence block `[B, T / tp, ..]` of a replicated `[B, T, ..]` tensor.
    fn shard_seq(&self, x: &Tensor) -> Result<Tensor> {
        let tl = x.size()[1] / self.tp.size as i64;
        x.f_narrow(1, self.tp.rank as i64 * tl, tl)
            .ctx("sequence shard")
    }

    pub fn set_requires_grad(&mut self, on: bool) -> Result<()> {
        for p in &self.params {
            let _ = p.local.f_set_requires_grad(on).ctx("requires_grad")?;
        }
        Ok(())
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
        let q = rope(&q, &ctx.cos, &ctx.sin)?;
        let k = rope(&k, &ctx.cos, &ctx.sin)?;
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
    /// instead of three and their sum backward, as the FSDP model does. `None` off CUDA, with mixed
    /// biases, or with `VERL_FUSED_QKV=0`.
    fn qkv_concatenated(&self, l: &Layer, x: &Tensor) -> Result<Option<Tensor>> {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        if !matches!(x.device(), Device::Cuda(_))
            || !*ON.get_or_init(|| std::env::var("VERL_FUSED_QKV").as_deref() != Ok("0"))
        {
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

    /// The attention half of a decoder layer with SP: `h` is this rank's sequence shard. The input
    /// norm `x1` (shard) is all-gathered (`x1c`, a leaf with `cut`) before the column-parallel
    /// QKV, the row-parallel o_proj's partial sums `a_part` are reduce-scattered (`a_c`, a leaf
    /// with `cut`) into the residual stream `h2` (shard) and its norm `x2` (shard).
    fn sp_attention_block(&self, l: &Layer, h: &Tensor, ctx: &Ctx, cut: bool) -> Result<SpAttn> {
        let x1 = self.rms(h, l.in_norm)?;
        let x1c = leaf_if(&self.gather_seq(&x1)?, cut)?;
        let a_part = self.attention(l, &x1c, ctx)?;
        let a_c = leaf_if(&self.scatter_seq(&a_part)?, cut)?;
        let a = self.add_bias(a_c.shallow_clone(), l.o.b)?;
        let h2 = h.f_add(&a).ctx("residual")?;
        let x2 = self.rms(&h2, l.post_norm)?;
        Ok(SpAttn {
            x1,
            x1c,
            a_part,
            a_c,
            h2,
            x2,
        })
    }

    /// One decoder layer with a dense MLP and SP: [`TpModel::sp_attention_block`], then `x2`
    /// all-gathered (`x2c`) before gate/up and down's partial sums reduce-scattered (`m_c`).
    fn sp_layer(&self, l: &Layer, h: &Tensor, ctx: &Ctx, cut: bool) -> Result<SpTrace> {
        let Ffn::Dense { gate, up, down } = l.ffn else {
            return Err(MegatronError::Api(verl_plugin_api::Error::failed(
                "internal: a MoE layer traced as a dense one",
            )));
        };
        let attn = self.sp_attention_block(l, h, ctx, cut)?;
        let x2c = leaf_if(&self.gather_seq(&attn.x2)?, cut)?;
        let m_part = self.mlp(gate, up, down, &x2c)?;
        let m_c = leaf_if(&self.scatter_seq(&m_part)?, cut)?;
        let m = self.add_bias(m_c.shallow_clone(), down.b)?;
        let out = attn.h2.f_add(&m).ctx("residual")?;
        Ok(SpTrace {
            attn,
            x2c,
            m_part,
            m_c,
            out,
        })
    }

    /// The backward of [`TpModel::sp_attention_block`] from the gradient `g_x2` of the
    /// post-attention norm's output (shard) and `grad_res` of the residual stream `h2` (shard):
    /// the norm and residual segment, o_proj's output gradient all-gathered (the backward of the
    /// reduce-scatter), the attention segment, its input gradient reduce-scattered (the backward
    /// of the all-gather), and the input norm. Returns the gradient of the layer input `h`.
    fn sp_attention_backward(
        &self,
        l: &Layer,
        h: &Tensor,
        a: &SpAttn,
        g_x2: &Tensor,
        grad_res: &Tensor,
        sink: &mut dyn FnMut(usize, &Tensor) -> Result<()>,
    ) -> Result<Tensor> {
        let roots = [(&a.x2, g_x2), (&a.h2, grad_res)];
        let mut params = vec![l.post_norm];
        params.extend(l.o.b);
        let g = self.backward(&roots, &[&a.a_c, h], &params, true, sink)?;
        let g_a = self.gather_seq(&g[0])?;
        let through_residual = g[1].shallow_clone();
        let roots = [(&a.a_part, &g_a)];
        let g = self.backward(&roots, &[&a.x1c], &l.attention_inner_params(), false, sink)?;
        let g_x1 = self.scatter_seq(&g[0])?;
        let roots = [(&a.x1, &g_x1)];
        let g = self.backward(&roots, &[h], &[l.in_norm], false, sink)?;
        through_residual.f_add(&g[0]).ctx("input gradient")
    }

    /// [`TpModel::layer_backward`] with SP.
    fn sp_layer_backward(
        &self,
        l: &Layer,
        saved: &Tensor,
        grad_out: &Tensor,
        ctx: &Ctx,
        sink: &mut dyn FnMut(usize, &Tensor) -> Result<()>,
    ) -> Result<Tensor> {
        let Ffn::Dense { gate, up, down } = l.ffn else {
            return Err(MegatronError::Api(verl_plugin_api::Error::failed(
                "internal: a MoE layer chained as a dense one",
            )));
        };
        let h = leaf_if(saved, true)?;
        let tr = self.sp_layer(l, &h, ctx, true)?;
        // Residual add: the reduce-scattered MLP output and down's bias get `grad_out`.
        let roots = [(&tr.out, grad_out)];
        let bias: Vec<usize> = down.b.into_iter().collect();
        let g = self.backward(&roots, &[&tr.m_c], &bias, true, sink)?;
        let g_m = self.gather_seq(&g[0])?;
        let mut params = vec![];
        for lin in [gate, up] {
            params.push(lin.w);
            params.extend(lin.b);
        }
        params.push(down.w);
        let roots = [(&tr.m_part, &g_m)];
        let g = self.backward(&roots, &[&tr.x2c], &params, false, sink)?;
        let g_x2 = self.scatter_seq(&g[0])?;
        self.sp_attention_backward(l, &h, &tr.attn, &g_x2, grad_out, sink)
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
        let (cos, sin) = cos_sin(&self.inv_freq, &positions, self.dtype)?;
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

    /// Final hidden states `[B, T, H]` (after the final norm), replicated on every tensor-parallel
    /// rank, of a model that is the whole pipeline (one stage). No autograd.
    pub fn forward_hidden(
        &self,
        ids: &Tensor,
        mask: &Tensor,
        positions: &Tensor,
    ) -> Result<Tensor> {
        let acts = self.stage_forward(ids, mask, positions, None)?;
        self.final_hidden(&acts)
    }

    /// The final norm of the last stage's output `[B, T, H]`, replicated on every
    /// tensor-parallel rank (with SP, all-gathered from the sequence shards and unpadded). No
    /// autograd.
    pub fn final_hidden(&self, acts: &StageActs) -> Result<Tensor> {
        let _guard = tch::no_grad_guard();
        let h = self.rms(&acts.out, self.need_norm()?)?;
        if !self.sp {
            return Ok(h);
        }
        self.gather_seq(&h)?
            .f_narrow(1, 0, acts.ctx.t)
            .ctx("unpad sequence")
    }

    /// This stage's forward of one micro-batch without autograd: the first stage embeds `ids`,
    /// every other stage starts from `input` (the previous stage's output). Keeps each layer's
    /// input for the recomputing backward ([`TpModel::stage_backward`]); `out` is what goes to the
    /// next stage (the last stage's is before the final norm). A stage of several model chunks
    /// runs its chunk 0 ([`TpModel::chunk_forward`] runs the others).
    pub fn stage_forward(
        &self,
        ids: &Tensor,
        mask: &Tensor,
        positions: &Tensor,
        input: Option<&Tensor>,
    ) -> Result<StageActs> {
        self.chunk_forward_impl(0, ids, mask, positions, input, false)
    }

    /// [`TpModel::stage_forward`] of a micro-batch whose backward follows
    /// ([`TpModel::stage_backward`]): it keeps the activations of the dense layers the backward
    /// does not recompute ([`TpModel::set_recompute`]).
    pub fn stage_forward_train(
        &self,
        ids: &Tensor,
        mask: &Tensor,
        positions: &Tensor,
        input: Option<&Tensor>,
    ) -> Result<StageActs> {
        self.chunk_forward_impl(0, ids, mask, positions, input, true)
    }

    /// [`TpModel::chunk_forward`] of a micro-batch whose backward follows (see
    /// [`TpModel::stage_forward_train`]).
    pub fn chunk_forward_train(
        &self,
        chunk: usize,
        ids: &Tensor,
        mask: &Tensor,
        positions: &Tensor,
        input: Option<&Tensor>,
    ) -> Result<StageActs> {
        self.chunk_forward_impl(chunk, ids, mask, positions, input, true)
    }

    /// The forward of this stage's model chunk `chunk` (virtual pipeline stage
    /// `chunk · stages + stage`): chunk 0 of the first stage embeds `ids`, every other chunk starts
    /// from `input` (the previous virtual stage's output).
    pub fn chunk_forward(
        &self,
        chunk: usize,
        ids: &Tensor,
        mask: &Tensor,
        positions: &Tensor,
        input: Option<&Tensor>,
    ) -> Result<StageActs> {
        self.chunk_forward_impl(chunk, ids, mask, positions, input, false)
    }

    /// The forwards above; `train`: keep the autograd graphs of the dense layers the backward does
    /// not recompute (none with SP).
    fn chunk_forward_impl(
        &self,
        chunk: usize,
        ids: &Tensor,
        mask: &Tensor,
        positions: &Tensor,
        input: Option<&Tensor>,
        train: bool,
    ) -> Result<StageActs> {
        let _guard = tch::no_grad_guard();
        let layers = self.chunk_layer_slice(chunk)?;
        let ctx = self.prepare(ids, mask, positions)?;
        let embeds = self.stage.is_first() && chunk == 0;
        let mut h = match (embeds, input) {
            (true, _) => self.embed_input(&ctx.ids)?,
            (false, Some(x)) => x.shallow_clone(),
            (false, None) => {
                return Err(MegatronError::Api(verl_plugin_api::Error::failed(format!(
                    "internal: pipeline stage {} (model chunk {chunk}) got no activation from the previous stage",
                    self.stage.index
                ))))
            }
        };
        let want = self.local_len(ctx.t);
        if h.size().get(1) != Some(&want) {
            return Err(MegatronError::Api(verl_plugin_api::Error::failed(format!(
                "internal: pipeline stage {} got an activation of shape {:?}, expected {want} positions",
                self.stage.index,
                h.size()
            ))));
        }
        LAST_RESIDUAL.with(|c| c.set(Some((want, ctx.t))));
        let mut inputs = Vec::with_capacity(layers.len());
        let keep = |i: usize| train && self.keeps_layer(i);
        let any_kept = (0..layers.len()).any(keep);
        let mut kept = Vec::new();
        for (i, l) in layers.iter().enumerate() {
            if keep(i) && !self.sp && matches!(l.ffn, Ffn::Dense { .. }) {
                let hl = leaf_if(&h, true)?;
                let tr = tch::with_grad(|| self.layer(l, &hl, &ctx, true))?;
                let next = tr.out.f_detach().ctx("layer output")?;
                inputs.push(std::mem::replace(&mut h, next));
                kept.push(Some(Kept { h: hl, tr }));
                continue;
            }
            let next = self.layer_out(l, &h, &ctx)?;
            inputs.push(std::mem::replace(&mut h, next));
            if any_kept {
                kept.push(None);
            }
        }
        Ok(StageActs {
            chunk,
            ctx,
            inputs,
            kept,
            out: h,
        })
    }

    /// The decoder layers of model chunk `chunk` of this stage.
    fn chunk_layer_slice(&self, chunk: usize) -> Result<&[Layer]> {
        let chunks = self.stage.chunks.max(1);
        if chunk >= chunks {
            return Err(MegatronError::Api(verl_plugin_api::Error::failed(format!(
                "internal: model chunk {chunk} of a stage with {chunks}"
            ))));
        }
        let per = self.layers.len() / chunks;
        Ok(&self.layers[chunk * per..(chunk + 1) * per])
    }

    /// The LM head matrix `[V, H]` when this rank holds all of it (tensor-parallel size 1, last
    /// stage): log-probs then go through [`verl_losses::ChunkedLmHead`], as in the FSDP backend (on
    /// CUDA fused kernels over fp32 logit chunks; no `[tokens, V]` logits kept for the backward).
    pub fn whole_lm_head(&self) -> Option<&Tensor> {
        match (self.tp.size, self.head) {
            (1, Some(Head::Lm(w))) => Some(self.p(w)),
            _ => None,
        }
    }

    /// Log-probabilities of `targets` (`[..]`) and optionally the entropy, from hidden states
    /// `[.., H]`: vocab-parallel, fp32, logits divided by `temperature`. Differentiable.
    pub fn token_stats(
        &self,
        hidden: &Tensor,
        targets: &Tensor,
        temperature: f64,
        with_entropy: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let Head::Lm(w) = self.need_head()? else {
            return Err(MegatronError::Api(verl_plugin_api::Error::failed(
                "log-probabilities need an LM head; this model has a value head",
            )));
        };
        let logits = hidden
            .f_linear(self.p(w), None::<&Tensor>)
            .and_then(|l| l.f_to_kind(Kind::Float))
            .and_then(|l| l.f_div_scalar(temperature))
            .ctx("local logits")?;
        if self.tp.size == 1 {
            let lp = verl_losses::logprobs_from_logits(&logits, targets)?;
            let ent = match with_entropy {
                true => Some(verl_losses::entropy_from_logits(&logits)?),
                false => None,
            };
            return Ok((lp, ent));
        }
        // The maximum only stabilises the exponentials (log Z does not depend on it): no gradient.
        let mut m = logits
            .f_detach()
            .and_then(|l| l.f_amax([-1i64].as_slice(), true))
            .ctx("local max")?;
        self.tp
            .all_reduce(&mut m, ReduceOp::Max, "all_reduce (logit max)")?;
        let shifted = logits.f_sub(&m).ctx("shift logits")?;
        let sum_exp = shifted
            .f_exp()
            .and_then(|e| e.f_sum_dim_intlist([-1i64].as_slice(), false, None::<Kind>))
            .ctx("sum of exponentials")?;
        // log Z - m; the maximum cancels in every quantity below.
        let sum_total = self.reduce(sum_exp)?;
        let log_z = sum_total.f_log().ctx("log partition")?;
        let in_range = targets
            .f_ge(self.vocab_start)
            .and_then(|a| a.f_logical_and(&targets.f_lt(self.vocab_start + self.vocab_local)?))
            .ctx("target range")?;
        let local_t = targets
            .f_sub_scalar(self.vocab_start)
            .and_then(|x| x.f_mul(&in_range.f_to_kind(Kind::Int64)?))
            .and_then(|x| x.f_unsqueeze(-1))
            .ctx("local targets")?;
        let picked = shifted
            .f_gather(-1, &local_t, false)
            .and_then(|p| p.f_squeeze_dim(-1))
            .and_then(|p| p.f_mul(&in_range.f_to_kind(Kind::Float)?))
            .ctx("target logit")?;
        let lp = self.reduce(picked)?.f_sub(&log_z).ctx("log-prob")?;
        let ent = if with_entropy {
            // H = log S - W / S with W = Σ exp(l - m)·(l - m). Every all-reduced sum must be of
            // terms that depend on this rank's logits only: the identity backward of the reduction
            // drops the other ranks' dependence on ours (Σ p·(l - m) would depend on every rank's
            // logits through p's normaliser, and its gradient would come out wrong).
            let w = shifted
                .f_exp()
                .and_then(|e| e.f_mul(&shifted))
                .and_then(|x| x.f_sum_dim_intlist([-1i64].as_slice(), false, None::<Kind>))
                .ctx("expected logit")?;
            let w = self.reduce(w)?;
            let mean = w.f_div(&sum_total).ctx("entropy")?;
            Some(log_z.f_sub(&mean).ctx("entropy")?)
        } else {
            None
        };
        Ok((lp, ent))
    }

    /// Values `[..]` from hidden states `[.., H]` (value head; replicated). Differentiable.
    pub fn values(&self, hidden: &Tensor) -> Result<Tensor> {
        let Head::Value { w, b } = self.need_head()? else {
            return Err(MegatronError::Api(verl_plugin_api::Error::failed(
                "values need a value head; this model has an LM head",
            )));
        };
        hidden
            .f_linear(self.p(w), Some(self.p(b)))
            .and_then(|v| v.f_squeeze_dim(-1))
            .ctx("value head")
    }

    fn head_params(&self) -> Vec<usize> {
        match self.head {
            Some(Head::Lm(w)) => vec![w],
            Some(Head::Value { w, b }) => vec![w, b],
            None => vec![],
        }
    }

    /// Differentiates the outputs `roots` (each with its gradient, `(y, dL/dy)`) w.r.t. `inputs`
    /// (leaves or graph tensors) and the parameters `params`, through `autograd::grad` (no
    /// surrogate `(y · g).sum()` to run and differentiate); hands each parameter gradient to
    /// `sink` and returns the inputs' gradients (zeros when unreachable).
    fn backward(
        &self,
        roots: &[(&Tensor, &Tensor)],
        inputs: &[&Tensor],
        params: &[usize],
        keep_graph: bool,
        sink: &mut dyn FnMut(usize, &Tensor) -> Result<()>,
    ) -> Result<Vec<Tensor>> {
        let mut wrt: Vec<&Tensor> = inputs.to_vec();
        wrt.extend(params.iter().map(|&i| self.p(i)));
        let grads = output_grads(roots, &wrt, keep_graph)?;
        let mut out = Vec::with_capacity(inputs.len());
        for (k, g) in grads.iter().enumerate() {
            if k < inputs.len() {
                out.push(match g {
                    Some(g) => g.shallow_clone(),
                    None => inputs[k].f_zeros_like().ctx("zero gradient")?,
                });
            } else if let Some(g) = g {
                let i = params[k - inputs.len()];
                if self.sp && self.seq_sharded[i] {
                    // A replicated parameter applied to this rank's sequence shard: its gradient
                    // is a partial sum over the tensor-parallel group.
                    let mut g = g
                        .f_contiguous()
                        .and_then(|g| g.f_detach_copy())
                        .ctx("gradient")?;
                    self.tp.all_reduce(
                        &mut g,
                        ReduceOp::Sum,
                        "all_reduce (sequence-parallel parameter gradient)",
                    )?;
                    sink(i, &g)?;
                } else {
                    sink(i, g)?;
                }
            }
        }
        Ok(out)
    }

    /// Forward, `loss_fn` on the final hidden states (a leaf: call [`TpModel::token_stats`] or
    /// [`TpModel::values`] on it), and the hand-chained backward, of a model that is the whole
    /// pipeline. Parameter gradients (this rank's slices, in the parameter dtype) go to
    /// `sink(param_index, grad)`; nothing accumulates in `.grad`. Returns the detached loss and the
    /// loss function's side values.
    pub fn forward_backward<T>(
        &self,
        ids: &Tensor,
        mask: &Tensor,
        positions: &Tensor,
        moe: MoeMicro,
        sink: &mut dyn FnMut(usize, &Tensor) -> Result<()>,
        loss_fn: impl FnOnce(&Tensor) -> Result<(Tensor, T)>,
    ) -> Result<(Tensor, T)> {
        let acts = self.stage_forward_train(ids, mask, positions, None)?;
        let (grad, loss, side) = self.head_backward(&acts, sink, loss_fn)?;
        self.stage_backward(ids, acts, &grad, moe, sink)?;
        Ok((loss, side))
    }

    /// The last stage's head: the final norm of `out` (this stage's output), `loss_fn` on the
    /// normed hidden states (a leaf), and the backward to `out`. Returns the gradient of `out`, the
    /// detached loss and the loss function's side values.
    pub fn head_backward<T>(
        &self,
        acts: &StageActs,
        sink: &mut dyn FnMut(usize, &Tensor) -> Result<()>,
        loss_fn: impl FnOnce(&Tensor) -> Result<(Tensor, T)>,
    ) -> Result<(Tensor, Tensor, T)> {
        let (norm, head) = (self.need_norm()?, self.need_head()?);
        if acts.chunk + 1 != self.stage.chunks.max(1) {
            return Err(self.wrong_stage("the head", "the last chunk of the last"));
        }
        let leaf = |x: &Tensor| {
            x.f_detach()
                .and_then(|d| d.f_set_requires_grad(true))
                .ctx("leaf")
        };
        // The final norm's output is cut because a vocab-parallel head consumes it. With SP the
        // norm runs on this rank's sequence shard and its output is all-gathered (and unpadded)
        // before the head.
        let hl = leaf(&acts.out)?;
        let hf = self.rms(&hl, norm)?;
        let hc = match self.sp {
            true => leaf(
                &self
                    .gather_seq(&hf)?
                    .f_narrow(1, 0, acts.ctx.t)
                    .ctx("unpad sequence")?,
            )?,
            false => leaf(&hf)?,
        };
        let (loss, side) = loss_fn(&hc)?;
        if loss.numel() != 1 {
            return Err(MegatronError::config(
                "loss",
                "a scalar tensor",
                format!("shape {:?}", loss.size()),
            ));
        }
        let one = loss.f_ones_like().ctx("loss gradient")?;
        let g = self.backward(&[(&loss, &one)], &[&hc], &self.head_params(), false, sink)?;
        let ghc = match (head, self.sp) {
            (Head::Lm(_), false) => self.reduce_grad(g[0].shallow_clone())?,
            (Head::Value { .. }, false) => g[0].shallow_clone(),
            (head, true) => {
                let padded = g[0]
                    .f_constant_pad_nd([0, 0, 0, acts.ctx.t_pad - acts.ctx.t])
                    .ctx("pad gradient")?;
                match head {
                    // The vocab-parallel head's input gradients are partial sums: the backward
                    // of the all-gather is a reduce-scatter.
                    Head::Lm(_) => self.scatter_seq(&padded)?,
                    // A replicated head's are complete on every rank: take this rank's block.
                    Head::Value { .. } => self.shard_seq(&padded)?,
                }
            }
        };
        let roots = [(&hf, &ghc)];
        let grad = self.backward(&roots, &[&hl], &[norm], false, sink)?[0].shallow_clone();
        Ok((grad, loss.f_detach().ctx("loss")?, side))
    }

    /// This stage's backward of one micro-batch from the gradient of its output: the layers are
    /// recomputed from their saved inputs and chained in reverse. Returns the gradient of the
    /// stage input (for the previous stage), or `None` on the first stage, where it flows into
    /// the embedding. `moe` says how the MoE blocks treat this micro-batch (router loss scale,
    /// load metrics).
    pub fn stage_backward(
        &self,
        ids: &Tensor,
        acts: StageActs,
        grad_out: &Tensor,
        moe: MoeMicro,
        sink: &mut dyn FnMut(usize, &Tensor) -> Result<()>,
    ) -> Result<Option<Tensor>> {
        let StageActs {
            chunk,
            ctx,
            inputs,
            mut kept,
            out,
        } = acts;
        drop(out);
        let layers = self.chunk_layer_slice(chunk)?;
        kept.resize_with(layers.len(), || None);
        let mut grad = grad_out.shallow_clone();
        for ((l, saved), kept) in layers.iter().zip(inputs).zip(kept).rev() {
            grad = match &l.ffn {
                Ffn::Dense { .. } if kept.is_some() => {
                    let k = kept.expect("checked");
                    self.layer_chain(l, &k.h, &k.tr, &grad, sink)?
                }
                Ffn::Dense { .. } if self.sp => {
                    self.sp_layer_backward(l, &saved, &grad, &ctx, sink)?
                }
                Ffn::Dense { .. } => self.layer_backward(l, &saved, &grad, &ctx, sink)?,
                Ffn::Moe { .. } => self.moe_layer_backward(l, &saved, &grad, &ctx, moe, sink)?,
            };
        }
        if !(self.stage.is_first() && chunk == 0) {
            return Ok(Some(grad));
        }
        // The ids as the forward embedded them (padded with SP) are kept in `ctx`.
        let _ = ids;
        let (e, grad) = match self.sp {
            // The backward of the embedding's reduce-scatter is an all-gather.
            true => (self.embed_partial(&ctx.ids)?, self.gather_seq(&grad)?),
            false => (self.embed(&ctx.ids)?, grad),
        };
        if e.requires_grad() {
            let roots = [(&e, &grad)];
            self.backward(&roots, &[], &[self.need_embed()?], false, sink)?;
        }
        Ok(None)
    }

    /// Recomputes layer `l` from its saved input and chains its backward in three segments: the
    /// MLP block (its input gradient all-reduced), the attention block plus the residual path, and
    /// the input norm (its output gradient all-reduced). Returns the gradient of the layer input.
    fn layer_backward(
        &self,
        l: &Layer,
        saved: &Tensor,
        grad_out: &Tensor,
        ctx: &Ctx,
        sink: &mut dyn FnMut(usize, &Tensor) -> Result<()>,
    ) -> Result<Tensor> {
        let h = saved
            .f_detach()
            .and_then(|d| d.f_set_requires_grad(true))
            .ctx("layer input")?;
        let tr = self.layer(l, &h, ctx, true)?;
        self.layer_chain(l, &h, &tr, grad_out, sink)
    }

    /// The backward of dense layer `l` from its traced forward (`h`: its input leaf), in the three
    /// segments of [`TpModel::layer_backward`]. Returns the gradient of the layer input.
    fn layer_chain(
        &self,
        l: &Layer,
        h: &Tensor,
        tr: &Trace,
        grad_out: &Tensor,
        sink: &mut dyn FnMut(usize, &Tensor) -> Result<()>,
    ) -> Result<Tensor> {
        let roots = [(&tr.out, grad_out)];
        let g = self.backward(&roots, &[&tr.x2c], &l.mlp_params(), true, sink)?;
        let gx2 = self.reduce_grad(g[0].shallow_clone())?;
        let roots = [(&tr.x2, &gx2), (&tr.h2, grad_out)];
        let mut params = vec![l.post_norm];
        params.extend(l.attention_params());
        let g = self.backward(&roots, &[&tr.x1c, h], &params, true, sink)?;
        let gx1 = self.reduce_grad(g[0].shallow_clone())?;
        let through_residual = g[1].shallow_clone();
        let roots = [(&tr.x1, &gx1)];
        let g = self.backward(&roots, &[h], &[l.in_norm], false, sink)?;
        through_residual.f_add(&g[0]).ctx("input gradient")
    }

    /// Recomputes MoE layer `l` from its saved input and chains its backward: the MoE block
    /// (forward and backward through the expert-parallel all-to-alls and the
    /// expert-tensor-parallel collectives; its input gradient is complete for the tokens it was
    /// given: the whole replicated sequence without SP, this rank's shard with SP), then the
    /// attention block plus the residual path and the input norm as in
    /// [`TpModel::layer_backward`] (or [`TpModel::sp_attention_backward`]).
    fn moe_layer_backward(
        &self,
        l: &Layer,
        saved: &Tensor,
        grad_out: &Tensor,
        ctx: &Ctx,
        moe: MoeMicro,
        sink: &mut dyn FnMut(usize, &Tensor) -> Result<()>,
    ) -> Result<Tensor> {
        let Ffn::Moe {
            block,
            index,
            layer,
        } = &l.ffn
        else {
            return Err(MegatronError::Api(verl_plugin_api::Error::failed(
                "internal: a dense layer chained as a MoE one",
            )));
        };
        let h = leaf_if(saved, true)?;
        // With SP the MoE block routes this rank's sequence shard (Megatron-core's dispatch: no
        // all-gather before the block, no reduce-scatter after it): the shard's output gradient
        // goes in, the shard's input gradient comes out; the block reduces its statistics, its
        // router loss and its replicated parameters' gradients over the tensor-parallel group.
        let (attn, x2d, gy, valid) = match self.sp {
            true => {
                let a = self.sp_attention_block(l, &h, ctx, true)?;
                let x2d = a.x2.f_detach().ctx("moe input")?;
                let valid = self.shard_seq(&ctx.valid)?;
                (Err(a), x2d, grad_out.shallow_clone(), valid)
            }
            false => {
                let t = self.attention_block(l, &h, ctx, true)?;
                let x2d = t.3.f_detach().ctx("moe input")?;
                (
                    Ok(t),
                    x2d,
                    grad_out.shallow_clone(),
                    ctx.valid.shallow_clone(),
                )
            }
        };
        let mut block_sink = |k: usize, g: &Tensor| -> Result<()> {
            let i = *index.get(k).ok_or_else(|| {
                MegatronError::Api(verl_plugin_api::Error::failed(format!(
                    "internal: MoE parameter {k} of layer {layer} has no model index"
                )))
            })?;
            sink(i, g)
        };
        let r = block.forward_backward(&x2d, Some(&valid), &gy, moe.aux_scale, &mut block_sink)?;
        if moe.record {
            self.moe_load
                .lock()
                .map_err(|_| {
                    MegatronError::Api(verl_plugin_api::Error::failed(
                        "internal: MoE load metrics lock poisoned",
                    ))
                })?
                .add(*layer, &r.stats)?;
        }
        let (x1, x1c, h2, x2) = match attn {
            Ok(t) => t,
            Err(a) => {
                return self.sp_attention_backward(l, &h, &a, &r.grad_x, grad_out, sink);
            }
        };
        let roots = [(&x2, &r.grad_x), (&h2, grad_out)];
        let mut params = vec![l.post_norm];
        params.extend(l.attention_params());
        let g = self.backward(&roots, &[&x1c, &h], &params, true, sink)?;
        let gx1 = self.reduce_grad(g[0].shallow_clone())?;
        let through_residual = g[1].shallow_clone();
        let roots = [(&x1, &gx1)];
        let g = self.backward(&roots, &[&h], &[l.in_norm], false, sink)?;
        through_residual.f_add(&g[0]).ctx("input gradient")
    }

    /// The global indices of the model's sparse (MoE) layers (every stage's).
    pub fn sparse_layers(&self) -> Vec<usize> {
        (0..self.cfg.num_hidden_layers as usize)
            .filter(|&i| is_sparse(&self.cfg, i))
            .collect()
    }

    /// The routing counts and load-balancing losses recorded by the training backwards since the
    /// last call (every sparse layer of the model listed, so stages reduce together), and a fresh
    /// accumulator in their place.
    pub fn take_moe_load(&self) -> Result<MoeLoadMetrics> {
        let mut guard = self.moe_load.lock().map_err(|_| {
            MegatronError::Api(verl_plugin_api::Error::failed(
                "internal: MoE load metrics lock poisoned",
            ))
        })?;
        Ok(std::mem::replace(&mut *guard, fresh_load(&self.cfg)))
    }

    /// Whole tensors of parameter `i`, by HF name, from this rank's slice `local` (the parameter
    /// itself or e.g. an optimizer moment): one for an ordinary parameter; for a routed expert's,
    /// one per expert-parallel rank (the same projection of the expert at the same local position
    /// on each). Every rank of the tensor- and expert-parallel groups must call this together, in
    /// the same parameter order.
    pub fn gather_named(&self, i: usize, local: &Tensor) -> Result<Vec<(String, Tensor)>> {
        let full = self.gather_full(i, local)?;
        let p = &self.params[i];
        let Some((expert, per_rank)) = p.expert else {
            return Ok(vec![(p.name.clone(), full)]);
        };
        let ep = &self.experts.ep;
        let parts = ep.all_gather(&full, "all_gather (expert weights)")?;
        let me = ep.rank as i64;
        let own = format!(".experts.{expert}.");
        Ok(parts
            .into_iter()
            .enumerate()
            .map(|(r, t)| {
                let other = expert + (r as i64 - me) * per_rank;
                (p.name.replacen(&own, &format!(".experts.{other}."), 1), t)
            })
            .collect())
    }

    /// Whether parameter `i` is a routed expert's (held by one expert-parallel rank; its gradient
    /// covers every token of the expert-parallel group).
    pub fn is_expert(&self, i: usize) -> bool {
        self.params[i].expert.is_some()
    }

    /// The full tensor of parameter `i` from this rank's slice `local` (which may be the slice of
    /// another tensor of the same layout, e.g. an optimizer moment). Every rank of the
    /// tensor-parallel group (of the expert-tensor-parallel group, for a routed expert's
    /// parameter) must call this together.
    pub fn gather_full(&self, i: usize, local: &Tensor) -> Result<Tensor> {
        let p = &self.params[i];
        let Some(d) = p.split.dim() else {
            return Ok(local.shallow_clone());
        };
        let parts = match p.expert {
            // A routed expert is split over the expert-tensor-parallel group.
            Some(_) => self
                .experts
                .etp
                .all_gather(local, "all_gather (expert-tensor-parallel slices)")?,
            None => self.tp.all_gather(local, "all_gather (full parameter)")?,
        };
        Tensor::f_cat(&parts, d).ctx("join tensor-parallel shards")
    }

    /// This rank's slice of a full tensor shaped like parameter `i`.
    pub fn local_of(&self, i: usize, full: &Tensor) -> Result<Tensor> {
        let p = &self.params[i];
        if full.size() != p.full_shape {
            return Err(MegatronError::Model(verl_nn::NnError::ShapeMismatch {
                path: std::path::PathBuf::from("<full tensor>"),
                name: p.name.clone(),
                expected: p.full_shape.clone(),
                found: full.size(),
            }));
        }
        match p.expert {
            Some(_) => shard_of(full, p.split, self.experts.etp.rank, self.experts.etp.size),
            None => shard_of(full, p.split, self.tp.rank, self.tp.size),
        }
    }

    /// Whether parameter `i` is divided over the tensor-parallel ranks (its gradient norm is then
    /// summed over them; a replicated one counts once).
    pub fn is_split(&self, i: usize) -> bool {
        self.params[i].split != Split::Replicated
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

/// `x · cos + rotate_half(x) · sin`, through the model crate's rotary embedding (one CUDA kernel
/// forward and backward where it applies, the torch ops elsewhere).
fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    Ok(verl_nn::apply_rope(x, cos, sin)?)
}

/// `silu(g) · u`, through the model crate's (one CUDA kernel forward and backward where it applies).
fn silu_mul(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    Ok(verl_nn::silu_mul(g, u)?)
}

/// `[B, n_kv, L, D]` → `[B, n_kv · groups, L, D]`.
fn repeat_kv(x: &Tensor, groups: i64) -> Result<Tensor> {
    if groups == 1 {
        return Ok(x.shallow_clone());
    }
    let s = x.size();
    x.f_unsqueeze(2)
        .and_then(|y| y.f_expand([s[0], s[1], groups, s[2], s[3]], false))
        .and_then(|y| y.f_reshape([s[0], s[1] * groups, s[2], s[3]]))
        .ctx("repeat kv heads")
}

/// RoPE inverse frequencies (fp32), as verl-nn computes them (same operation order, so the tables
/// are bit-identical and one-rank parity holds).
fn inv_freq(cfg: &ModelConfig, device: Device) -> Result<Tensor> {
    let f = || -> std::result::Result<Tensor, tch::TchError> {
        let dim = cfg.head_dim;
        let exponent = Tensor::f_arange_start_step(0, dim, 2, (Kind::Int64, Device::Cpu))?
            .f_to_kind(Kind::Float)?
            .f_div_scalar(dim as f64)?;
        let mut inv = Tensor::f_pow_scalar(cfg.rope_theta, &exponent)?.f_reciprocal()?;
        match cfg.rope_scaling {
            None => {}
            Some(RopeScaling::Linear { factor }) => inv = inv.f_div_scalar(factor)?,
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old_ctx,
            }) => {
                let low_wavelen = old_ctx / low_freq_factor;
                let high_wavelen = old_ctx / high_freq_factor;
                let wavelen = inv
                    .f_reciprocal()?
                    .f_mul_scalar(2.0 * std::f64::consts::PI)?;
                let is_low = wavelen.f_gt(low_wavelen)?;
                let scaled = inv.f_div_scalar(factor)?.f_where_self(&is_low, &inv)?;
                let smooth = wavelen
                    .f_reciprocal()?
                    .f_mul_scalar(old_ctx)?
                    .f_sub_scalar(low_freq_factor)?
                    .f_div_scalar(high_freq_factor - low_freq_factor)?;
                let smoothed = smooth
                    .f_neg()?
                    .f_add_scalar(1.0)?
                    .f_mul(&scaled)?
                    .f_div_scalar(factor)?
                    .f_add(&smooth.f_mul(&scaled)?)?;
                let is_medium = wavelen
                    .f_lt(high_wavelen)?
                    .f_logical_not()?
                    .f_logical_and(&is_low.f_logical_not()?)?;
                inv = smoothed.f_where_self(&is_medium, &scaled)?;
            }
        }
        inv.f_to_device(device)
    };
    f().ctx("rope frequencies")
}

fn cos_sin(inv: &Tensor, positions: &Tensor, kind: Kind) -> Result<(Tensor, Tensor)> {
    let f = || -> std::result::Result<(Tensor, Tensor), tch::TchError> {
        let freqs = positions
            .f_to_kind(Kind::Float)?
            .f_unsqueeze(-1)?
            .f_mul(&inv.f_to_device(positions.device())?)?;
        let emb = Tensor::f_cat(&[&freqs, &freqs], -1)?;
        Ok((emb.f_cos()?.f_to_kind(kind)?, emb.f_sin()?.f_to_kind(kind)?))
    };
    f().ctx("rope tables")
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
mod tests {
    use super::*;

    /// The layout test behind the causal (flash) attention path: rows whose real tokens come
    /// first pass (with or without trailing padding, all padding too); a row with padding in
    /// front or a hole does not.
    #[test]
    fn real_tokens_first_spots_front_padding_and_holes() {
        let rows = |v: &[&[i64]]| -> Tensor {
            let flat: Vec<i64> = v.iter().flat_map(|r| r.iter().copied()).collect();
            Tensor::from_slice(&flat)
                .view([v.len() as i64, v[0].len() as i64])
                .ne(0)
        };
        assert!(real_tokens_first(&rows(&[&[1, 1, 1, 1], &[1, 1, 0, 0], &[0, 0, 0, 0]])).unwrap());
        assert!(!real_tokens_first(&rows(&[&[1, 1, 1, 1], &[0, 1, 1, 1]])).unwrap());
        assert!(!real_tokens_first(&rows(&[&[1, 0, 1, 0]])).unwrap());
        assert!(real_tokens_first(&rows(&[&[1], &[0]])).unwrap());
    }
}

#[cfg(test)]
mod keep_tests {
    use super::*;
    use verl_nn::{ModelOptions, Transformer};

    /// A 3-layer fp32 Qwen2 model on the CPU (TP 1) and a `[2, 7]` batch.
    fn tiny() -> (TpModel, Tensor, Tensor, Tensor) {
        let cfg = ModelConfig::from_value(
            serde_json::json!({
                "model_type": "qwen2", "vocab_size": 61, "hidden_size": 32,
                "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
                "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "tie_word_embeddings": false,
            }),
            "inline/config.json",
        )
        .unwrap();
        tch::manual_seed(3);
        let full = Transformer::new(
            cfg.clone(),
            &ModelOptions {
                device: Device::Cpu,
                dtype: Kind::Float,
                head: HeadKind::CausalLm,
            },
        )
        .unwrap();
        let mut named: std::collections::HashMap<String, Tensor> = full
            .named_parameters()
            .iter()
            .map(|(n, t)| (n.clone(), t.detach().copy()))
            .collect();
        let mut model = TpModel::new(
            cfg,
            HeadKind::CausalLm,
            Kind::Float,
            Device::Cpu,
            Arc::new(Group::single("tensor-parallel")),
            &mut named,
        )
        .unwrap();
        model.set_requires_grad(true).unwrap();
        let ids = Tensor::randint(61, [2, 7], (Kind::Int64, Device::Cpu));
        let mask = Tensor::ones([2, 7], (Kind::Int64, Device::Cpu));
        let positions = Tensor::arange(7, (Kind::Int64, Device::Cpu))
            .unsqueeze(0)
            .repeat([2, 1]);
        (model, ids, mask, positions)
    }

    /// One forward and backward (a log-softmax loss through the LM head): the loss and the
    /// gradient the sink got per parameter.
    fn run(
        model: &TpModel,
        ids: &Tensor,
        mask: &Tensor,
        positions: &Tensor,
    ) -> (Tensor, Vec<Option<Tensor>>) {
        let mut grads: Vec<Option<Tensor>> = (0..model.params.len()).map(|_| None).collect();
        let (loss, ()) = model
            .forward_backward(
                ids,
                mask,
                positions,
                MoeMicro::NONE,
                &mut |i, g| {
                    grads[i] = Some(g.detach().copy());
                    Ok(())
                },
                |h| {
                    let w = model.whole_lm_head().expect("TP 1 holds the LM head");
                    let logits = h.matmul(&w.tr());
                    Ok((logits.log_softmax(-1, Kind::Float).mean(Kind::Float), ()))
                },
            )
            .unwrap();
        (loss, grads)
    }

    /// `set_recompute`: a training forward keeps the graphs of the dense layers not recomputed (an
    /// inference forward keeps none), and the backward that chains them gives the recomputing
    /// backward's parameter gradients and loss bit for bit.
    #[test]
    fn kept_activations_give_the_recomputed_gradients() {
        let (mut model, ids, mask, positions) = tiny();
        let (loss_re, grads_re) = run(&model, &ids, &mask, &positions);
        assert!(model
            .stage_forward_train(&ids, &mask, &positions, None)
            .unwrap()
            .kept
            .is_empty());
        model.set_recompute(Recompute::FirstOf(1));
        let acts = model
            .stage_forward_train(&ids, &mask, &positions, None)
            .unwrap();
        let kept: Vec<bool> = acts.kept.iter().map(Option::is_some).collect();
        assert_eq!(kept, [false, true, true]);
        let (loss_block, grads_block) = run(&model, &ids, &mask, &positions);
        model.set_recompute(Recompute::None);
        let acts = model
            .stage_forward_train(&ids, &mask, &positions, None)
            .unwrap();
        assert_eq!(acts.kept.len(), 3);
        assert!(acts.kept.iter().all(Option::is_some));
        assert!(model
            .stage_forward(&ids, &mask, &positions, None)
            .unwrap()
            .kept
            .is_empty());
        let (loss_kept, grads_kept) = run(&model, &ids, &mask, &positions);
        for (what, loss, grads) in [
            ("kept", &loss_kept, &grads_kept),
            ("first layer recomputed", &loss_block, &grads_block),
        ] {
            assert!(loss_re.equal(loss), "{what}: loss differs");
            let mut compared = 0;
            for (i, (a, b)) in grads_re.iter().zip(grads).enumerate() {
                let name = &model.params[i].name;
                match (a, b) {
                    (Some(a), Some(b)) => {
                        assert!(a.equal(b), "{what}: {name}: gradients differ");
                        compared += 1;
                    }
                    (None, None) => {}
                    _ => panic!("{what}: {name}: a gradient on one path only"),
                }
            }
            assert_eq!(compared, model.params.len(), "{what}");
        }
    }

    /// `set_grad_targets`: with every matrix given an accumulator, the decoder layers' projection
    /// weights (q, k, v, o, gate, up, down of 3 layers) add their gradients there and reach the
    /// sink with none; every other parameter (the embedding and LM head too) still goes to the
    /// sink, with its gradient unchanged; recomputed or kept layers alike.
    #[test]
    fn gradient_targets_take_the_projection_weights_gradients() {
        let (mut model, ids, mask, positions) = tiny();
        let (loss_ref, grads_ref) = run(&model, &ids, &mask, &positions);
        for recompute in [Recompute::All, Recompute::None] {
            model.set_recompute(recompute);
            let targets: Vec<Option<Tensor>> = model
                .params
                .iter()
                .map(|p| (p.local.dim() == 2).then(|| p.local.detach().zeros_like()))
                .collect();
            model.set_grad_targets(Some(
                targets
                    .iter()
                    .map(|t| t.as_ref().map(Tensor::shallow_clone))
                    .collect(),
            ));
            let (loss, grads) = run(&model, &ids, &mask, &positions);
            model.set_grad_targets(None);
            assert!(loss.equal(&loss_ref), "{recompute:?}: loss differs");
            let mut into = 0;
            for (i, p) in model.params.iter().enumerate() {
                let what = format!("{recompute:?}: {}", p.name);
                match (&grads_ref[i], &grads[i], &targets[i]) {
                    (Some(want), None, Some(acc)) => {
                        let d = (acc - want).abs().max().double_value(&[]);
                        assert!(d < 1e-6, "{what}: accumulated gradient off by {d}");
                        into += 1;
                    }
                    (Some(want), Some(got), acc) => {
                        assert!(want.equal(got), "{what}: sink gradient differs");
                        if let Some(acc) = acc {
                            assert_eq!(acc.abs().sum(Kind::Float).double_value(&[]), 0.0, "{what}");
                        }
                    }
                    (None, None, _) => {}
                    _ => panic!("{what}: gradient neither in the sink nor in its target"),
                }
            }
            assert_eq!(
                into,
                3 * 7,
                "{recompute:?}: projection weights accumulated in place"
            );
        }
    }
}
