//! The decoder-only transformer with a choice of head, its KV cache, and activation checkpointing.

use tch::{nn, Device, Kind, Tensor};

pub use crate::attention_backend::{AttentionBackend, AttentionCall};
use crate::config::ModelConfig;
use crate::error::{NnError, Result};
use crate::layers::{
    AccumulateIntoGrad, AttentionRows, DecoderLayer, InitMode, KvSlot, LayerCtx, Linear,
    ParamFactory, Residual, RmsNorm, Rope,
};
use crate::tp::{TpComm, TpShard};

mod backward;

mod decode;

mod forward;

/// Which output head sits on the final hidden states.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadKind {
    /// Policy / reference: vocabulary logits `[B, T, vocab]` (`lm_head.weight`, or the embedding
    /// matrix when `tie_word_embeddings`). HF class `*ForCausalLM`.
    CausalLm,
    /// Critic: one scalar per token, `[B, T]` (`score.weight` `[1, H]` + `score.bias` `[1]`,
    /// the layout of HF `*ForTokenClassification` with `num_labels = 1`).
    Value,
    /// Reward model: `[B, num_labels]` read at each row's last non-pad token (`score.weight`
    /// `[num_labels, H]`, no bias; HF `*ForSequenceClassification`).
    SequenceClassification,
    /// Reward model with a two-layer head: `[B, 1]` read at each row's last non-pad token
    /// (`score.0` `[H, H]` + bias, ReLU, `score.2` `[1, H]` + bias; the `Qwen2ForRewardModel`
    /// class Qwen2.5-Math-RM ships as remote code).
    RewardModel,
}

impl HeadKind {
    pub(crate) fn class_suffix(self) -> &'static str {
        match self {
            HeadKind::CausalLm => "ForCausalLM",
            HeadKind::Value => "ForTokenClassification",
            HeadKind::SequenceClassification => "ForSequenceClassification",
            HeadKind::RewardModel => "ForRewardModel",
        }
    }

    /// The head a reward model's `architectures` entry names: `*ForSequenceClassification` or
    /// `*ForRewardModel`; `None` for any other class (a causal LM has no reward head).
    pub fn of_reward_model(config: &ModelConfig) -> Option<HeadKind> {
        let class = config
            .raw
            .get("architectures")?
            .as_array()?
            .first()?
            .as_str()?;
        if class.ends_with("ForSequenceClassification") {
            Some(HeadKind::SequenceClassification)
        } else if class.ends_with("ForRewardModel") {
            Some(HeadKind::RewardModel)
        } else {
            None
        }
    }
}

/// Where and how to build a model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelOptions {
    pub device: Device,
    /// Parameter dtype: `Kind::Float`, `Kind::BFloat16` or `Kind::Half`.
    pub dtype: Kind,
    pub head: HeadKind,
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions {
            device: Device::Cpu,
            dtype: Kind::Float,
            head: HeadKind::CausalLm,
        }
    }
}

/// Per-layer key/value cache for incremental decoding.
///
/// Keys/values are stored after RoPE, before GQA expansion: `[B, num_kv_heads, L, head_dim]`.
/// The cache also remembers which of its `L` positions are real tokens (`key_mask`, bool `[B, L]`),
/// so a caller passes the attention mask of the *new* tokens only.
///
/// Two storage modes: [`KvCache::new`] grows by concatenation (simple, O(L) copy per step);
/// [`KvCache::with_capacity`] allocates `[B, n_kv, capacity, D]` buffers on first use and writes
/// new entries in place (what a generation engine wants; exceeding the capacity is an error).
#[derive(Debug)]
pub struct KvCache {
    pub(crate) layers: Vec<Option<(Tensor, Tensor)>>,
    pub(crate) key_mask: Option<Tensor>,
    capacity: Option<i64>,
}

impl KvCache {
    pub fn new(num_layers: usize) -> Self {
        KvCache {
            layers: (0..num_layers).map(|_| None).collect(),
            key_mask: None,
            capacity: None,
        }
    }

    /// A cache that holds at most `capacity` positions (prompt + generated) per row.
    pub fn with_capacity(num_layers: usize, capacity: i64) -> Self {
        KvCache {
            capacity: Some(capacity),
            ..KvCache::new(num_layers)
        }
    }

    /// Preallocated length, `None` for a growing cache.
    pub fn capacity(&self) -> Option<i64> {
        self.capacity
    }

    /// Cached sequence length `L` (0 when empty).
    pub fn len(&self) -> i64 {
        self.key_mask.as_ref().map(|m| m.size()[1]).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn batch_size(&self) -> Option<i64> {
        self.key_mask.as_ref().map(|m| m.size()[0])
    }

    /// Bool `[B, L]`: true where the cached position holds a real (non-pad) token.
    pub fn key_mask(&self) -> Option<&Tensor> {
        self.key_mask.as_ref()
    }

    /// `(keys, values)` of layer `i`, each `[B, num_kv_heads, L, head_dim]` (views of the
    /// buffers for a preallocated cache).
    pub fn layer(&self, i: usize) -> Option<(Tensor, Tensor)> {
        let (k, v) = self.layers.get(i)?.as_ref()?;
        let len = self.len();
        Some((k.f_narrow(2, 0, len).ok()?, v.f_narrow(2, 0, len).ok()?))
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Keeps only the batch rows in `rows` (int64 indices, in that order): drop finished
    /// sequences or reorder beams.
    pub fn select_rows(&mut self, rows: &Tensor) -> Result<()> {
        for (k, v) in self.layers.iter_mut().flatten() {
            let idx = rows.f_to_device(k.device())?;
            *k = k.f_index_select(0, &idx)?;
            *v = v.f_index_select(0, &idx)?;
        }
        if let Some(m) = &mut self.key_mask {
            *m = m.f_index_select(0, &rows.f_to_device(m.device())?)?;
        }
        Ok(())
    }

    pub fn clear(&mut self) {
        self.layers.iter_mut().for_each(|l| *l = None);
        self.key_mask = None;
    }
}

/// A group of parameters used together by the forward pass: the unit a sharding backend gathers
/// right before its use and frees right after (FSDP's "wrapped module").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Unit {
    /// `model.embed_tokens`.
    Embedding,
    /// Decoder layer `i`.
    Layer(usize),
    /// The final norm and the head (with a tied LM head, that includes the embedding matrix).
    Head,
}

impl std::fmt::Display for Unit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unit::Embedding => write!(f, "embedding"),
            Unit::Layer(i) => write!(f, "layer {i}"),
            Unit::Head => write!(f, "final norm + head"),
        }
    }
}

/// The hook [`Transformer::forward_backward_gated`] calls around each [`Unit`]: a sharded backend
/// makes the unit's parameters hold full values on `acquire` (e.g. all-gather into them with
/// `Tensor::set_data`), frees them on `release`, and receives the unit's parameter gradients from
/// each backward through it (e.g. to reduce-scatter them) instead of having them accumulate in
/// `.grad`. An error should be kept by the gate for its owner and reported as [`NnError::Gate`].
pub trait ParamGate {
    fn acquire(&mut self, unit: Unit) -> Result<()>;
    fn release(&mut self, unit: Unit) -> Result<()>;
    /// `grads[i]` belongs to parameter `Transformer::unit_parameters(unit)[i]`; `None` where the
    /// parameter got no gradient (an expert no token was routed to).
    fn gradients(&mut self, unit: Unit, grads: Vec<Option<Tensor>>) -> Result<()>;
}

#[derive(Debug)]
enum Head {
    Lm(Tensor),
    Value(Linear),
    Score(Linear),
    RewardMlp(Linear, Linear),
}

/// A decoder-only transformer (Llama / Mistral / Qwen2 / Qwen3 / Mixtral / Qwen2-MoE / Qwen3-MoE)
/// with one head. Parameters live in a `tch::nn::VarStore` whose keys are the HF tensor names
/// (`model.layers.0.self_attn.q_proj.weight`, ...).
pub struct Transformer {
    config: ModelConfig,
    head_kind: HeadKind,
    dtype: Kind,
    vs: nn::VarStore,
    pub(crate) params: Vec<(String, Tensor)>,
    head_param_names: Vec<String>,
    embed_tokens: Tensor,
    pub(crate) layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    rope: Rope,
    head: Head,
    padding_idx: i64,
    checkpointing: bool,
    /// See [`Transformer::set_grad_accumulation_fusion`].
    grad_accumulation_fusion: bool,
    /// See [`Transformer::set_consistent_attention`].
    consistent_attention: bool,
    /// Indices into `params` of each decoder layer's parameters.
    layer_params: Vec<std::ops::Range<usize>>,
    /// Indices of the final norm and the head's own parameters.
    head_params: std::ops::Range<usize>,
    tied_head: bool,
    /// Set for one tensor-parallel shard ([`Transformer::tp_shard`]); `None`: the whole model.
    pub(crate) tp: Option<TpShard>,
    /// LoRA adapters ([`crate::lora`]); their parameters follow the base ones in `params`.
    pub(crate) lora: Option<crate::lora::LoraState>,
    /// Per decoder layer, indices into `params` of its adapters.
    pub(crate) layer_adapters: Vec<Vec<usize>>,
}

impl std::fmt::Debug for Transformer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transformer")
            .field("arch", &self.config.arch)
            .field("head", &self.head_kind)
            .field("dtype", &self.dtype)
            .field("device", &self.vs.device())
            .field("layers", &self.layers.len())
            .field("params", &self.params.len())
            .finish()
    }
}

/// What [`Transformer::tune_decode_gemms`] did over a decode step's distinct GEMM shapes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GemmTuning {
    /// Distinct shapes of the step.
    pub shapes: usize,
    /// Shapes that run a cuBLASLt configuration (faster than libtorch's, same bits).
    pub chosen: usize,
    /// Shapes timed by this call.
    pub timed: usize,
    /// Shapes settled by this call from the tuning cache file (checked again, not timed).
    pub from_file: usize,
}

impl Transformer {
    /// A freshly initialised model (HF `_init_weights`: normal(0, initializer_range)).
    pub fn new(config: ModelConfig, opts: &ModelOptions) -> Result<Transformer> {
        let std = config.initializer_range;
        Transformer::build(config, opts, InitMode::Random { std })
    }

    /// A frozen model whose weights the caller sets next (zeros, norms ones, until then):
    /// [`Transformer::share_parameters`] without the cost of a random init.
    pub fn for_weights(config: ModelConfig, opts: &ModelOptions) -> Result<Transformer> {
        let mut m = Transformer::build(config, opts, InitMode::Zeros)?;
        m.set_requires_grad(false)?;
        Ok(m)
    }

    pub(crate) fn build(
        config: ModelConfig,
        opts: &ModelOptions,
        init: InitMode,
    ) -> Result<Transformer> {
        if !matches!(
            opts.dtype,
            Kind::Float | Kind::BFloat16 | Kind::Half | Kind::Double
        ) {
            return Err(NnError::input(
                "ModelOptions.dtype",
                "Float, BFloat16, Half or Double",
                format!("{:?}", opts.dtype),
            ));
        }
        let mut vs = nn::VarStore::new(opts.device);
        vs.set_kind(opts.dtype);
        let cfg = &config;
        let mut f = ParamFactory::new(vs.root(), init);
        let embed_tokens = f.matrix(
            "model.embed_tokens.weight",
            &[cfg.vocab_size, cfg.hidden_size],
        )?;
        let mut layer_params = Vec::new();
        let layers = (0..cfg.num_hidden_layers as usize)
            .map(|i| {
                let start = f.params.len();
                let layer = DecoderLayer::new(&mut f, cfg, i)?;
                layer_params.push(start..f.params.len());
                Ok(layer)
            })
            .collect::<Result<Vec<_>>>()?;
        let norm_start = f.params.len();
        let norm = f.rms_norm("model.norm", cfg.hidden_size, cfg.rms_norm_eps)?;
        let n_before_head = f.params.len();
        let head = match opts.head {
            HeadKind::CausalLm if cfg.tie_word_embeddings => Head::Lm(embed_tokens.shallow_clone()),
            HeadKind::CausalLm => {
                Head::Lm(f.matrix("lm_head.weight", &[cfg.vocab_size, cfg.hidden_size])?)
            }
            HeadKind::Value => Head::Value(f.linear("score", cfg.hidden_size, 1, true)?),
            HeadKind::SequenceClassification => {
                Head::Score(f.linear("score", cfg.hidden_size, cfg.num_labels, false)?)
            }
            HeadKind::RewardModel => Head::RewardMlp(
                f.linear("score.0", cfg.hidden_size, cfg.hidden_size, true)?,
                f.linear("score.2", cfg.hidden_size, 1, true)?,
            ),
        };
        let tied_head = opts.head == HeadKind::CausalLm && cfg.tie_word_embeddings;
        let params = std::mem::take(&mut f.params);
        let head_params = norm_start..params.len();
        let head_param_names = params[n_before_head..]
            .iter()
            .map(|(n, _)| n.clone())
            .collect();
        drop(f);
        let rope = Rope::new(cfg, opts.device)?;
        let padding_idx = cfg
            .pad_token_id
            .filter(|&p| p >= 0 && p < cfg.vocab_size)
            .unwrap_or(-1);
        Ok(Transformer {
            head_kind: opts.head,
            dtype: opts.dtype,
            vs,
            params,
            head_param_names,
            embed_tokens,
            layers,
            norm,
            rope,
            head,
            padding_idx,
            checkpointing: false,
            grad_accumulation_fusion: false,
            consistent_attention: false,
            layer_params,
            head_params,
            tied_head,
            config,
            tp: None,
            lora: None,
            layer_adapters: Vec::new(),
        })
    }

    /// One tensor-parallel rank's shard of the model `config` describes, for inference: Megatron's
    /// column / row / vocab-parallel layout (see [`crate::tp`]), combined over `comm`. Parameters
    /// are zero-filled (norms ones) with this rank's local shapes under their HF names; the caller
    /// copies its shards into [`Transformer::named_parameters`]. [`Transformer::config`] stays the
    /// full model's; [`Transformer::shard_config`] is the per-rank one (heads, key/value heads, MLP
    /// columns and vocabulary divided by `comm.size()`).
    ///
    /// Every forward makes collectives, so all ranks must run the same forwards in the same order;
    /// the head's logits are all-gathered, so every rank gets the full `[.., vocab]` logits.
    /// Dense models with an LM head only; no backward (the collectives are not differentiable
    /// here), no `save_pretrained`.
    pub fn tp_shard(
        config: ModelConfig,
        opts: &ModelOptions,
        comm: std::sync::Arc<dyn TpComm>,
    ) -> Result<Transformer> {
        if opts.head != HeadKind::CausalLm {
            return Err(NnError::input(
                "tensor-parallel model head",
                "CausalLm",
                format!("{:?}", opts.head),
            ));
        }
        let (size, rank) = (comm.size(), comm.rank());
        let local = crate::tp::local_config(&config, size, rank)?;
        let mut model = Transformer::build(local.clone(), opts, InitMode::Zeros)?;
        model.set_requires_grad(false)?;
        let shard = TpShard {
            comm,
            vocab_start: rank as i64 * local.vocab_size,
            vocab_local: local.vocab_size,
            local,
        };
        for layer in &mut model.layers {
            layer.set_tp(shard.clone())?;
        }
        model.tp = Some(shard);
        model.config = config;
        Ok(model)
    }

    /// The tensor-parallel size of this model: 1 for a whole model, the group size for a shard
    /// built by [`Transformer::tp_shard`].
    pub fn tp_size(&self) -> usize {
        self.tp.as_ref().map_or(1, |t| t.comm.size())
    }

    /// This rank's index in its tensor-parallel group (0 for a whole model).
    pub fn tp_rank(&self) -> usize {
        self.tp.as_ref().map_or(0, |t| t.comm.rank())
    }

    /// The config of the weights this rank holds: [`Transformer::config`] for a whole model; for a
    /// tensor-parallel shard the heads, key/value heads, MLP columns and vocabulary divided by the
    /// tensor-parallel size (what a KV cache of this rank is sized by).
    pub fn shard_config(&self) -> &ModelConfig {
        self.tp.as_ref().map_or(&self.config, |t| &t.local)
    }

    /// LM-head logits computed from [`Transformer::lm_head_weight`] (`[.., vocab / tp]` on a
    /// tensor-parallel shard) -> the full `[.., vocab]` logits, all-gathered over the group. The
    /// identity (no operation) for a whole model.
    pub fn gather_vocab(&self, logits: Tensor) -> Result<Tensor> {
        match &self.tp {
            None => Ok(logits),
            Some(tp) => tp.gather_vocab(&logits),
        }
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn head_kind(&self) -> HeadKind {
        self.head_kind
    }

    pub fn device(&self) -> Device {
        self.vs.device()
    }

    pub fn dtype(&self) -> Kind {
        self.dtype
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// The var store holding every parameter (keys are HF names). Use it for optimizers.
    pub fn var_store(&self) -> &nn::VarStore {
        &self.vs
    }

    /// Points every parameter at the tensor `weights` holds under its name, without copying: the
    /// model then shares their memory (a non-contiguous tensor is made contiguous first). Shapes,
    /// dtypes and devices must match; a missing or mismatched tensor is an error naming it.
    pub fn share_parameters(
        &self,
        weights: &std::collections::HashMap<String, Tensor>,
    ) -> Result<()> {
        tch::no_grad(|| -> Result<()> {
            for (name, dst) in &self.params {
                let src = weights.get(name).ok_or_else(|| {
                    NnError::input(format!("parameter `{name}`"), "a tensor to share", "none")
                })?;
                if src.size() != dst.size()
                    || src.kind() != dst.kind()
                    || src.device() != dst.device()
                {
                    return Err(NnError::input(
                        format!("parameter `{name}`"),
                        format!("{:?} {:?} on {:?}", dst.size(), dst.kind(), dst.device()),
                        format!("{:?} {:?} on {:?}", src.size(), src.kind(), src.device()),
                    ));
                }
                let src = src.f_detach()?.f_contiguous()?;
                dst.shallow_clone().f_set_data(&src)?;
            }
            Ok(())
        })
    }

    /// Parameters in a fixed order (embedding, layers, final norm, head) with their HF names.
    /// A tied LM head has no entry of its own. Tensors share storage with the model.
    pub fn named_parameters(&self) -> &[(String, Tensor)] {
        &self.params
    }

    /// Names of the head's own parameters (empty for a tied LM head).
    pub fn head_parameter_names(&self) -> &[String] {
        &self.head_param_names
    }

    /// The units in forward order: embedding, layers, final norm + head.
    pub fn units(&self) -> Vec<Unit> {
        std::iter::once(Unit::Embedding)
            .chain((0..self.layers.len()).map(Unit::Layer))
            .chain(std::iter::once(Unit::Head))
            .collect()
    }

    /// Indices into [`Transformer::named_parameters`] of the parameters `unit` reads, in the
    /// order [`ParamGate::gradients`] reports them. A tied LM head lists the embedding matrix
    /// (index 0) after the final norm, so it belongs to two units.
    pub fn unit_parameters(&self, unit: Unit) -> Vec<usize> {
        match unit {
            Unit::Embedding => vec![0],
            Unit::Layer(i) => self
                .layer_params
                .get(i)
                .cloned()
                .unwrap_or(0..0)
                .chain(self.layer_adapters.get(i).into_iter().flatten().copied())
                .collect(),
            Unit::Head => {
                let mut v: Vec<usize> = self.head_params.clone().collect();
                if self.tied_head {
                    v.push(0);
                }
                v
            }
        }
    }

    /// Mutable access to the var store (e.g. `VarStore::set_device`).
    pub fn var_store_mut(&mut self) -> &mut nn::VarStore {
        &mut self.vs
    }

    /// Layer `layer`'s feed-forward block (dense MLP, or the sparse MoE block of an MoE family)
    /// applied to already-normed hidden states `x` (`[.., H]`); differentiable. The one-rank
    /// reference for parallel implementations of the block (expert parallelism).
    pub fn feed_forward(&self, layer: usize, x: &Tensor) -> Result<Tensor> {
        let l = self.layers.get(layer).ok_or_else(|| {
            NnError::input(
                "decoder layer index",
                format!("below the layer count {}", self.layers.len()),
                layer.to_string(),
            )
        })?;
        l.feed_forward(x)
    }

    /// Enables or disables gradient tracking for every parameter (a frozen reference policy).
    pub fn set_requires_grad(&mut self, on: bool) -> Result<()> {
        for (_, p) in &self.params {
            let _ = p.f_set_requires_grad(on)?;
        }
        Ok(())
    }

    /// With `on`, [`Transformer::forward_backward`] and its variants (not the gated, sharded ones)
    /// add the gradients of the linear projections' weights (and biases) into their `.grad`
    /// inside the weight-gradient GEMMs (beta = 1) instead of through autograd's separate
    /// accumulation kernels: for a trainer that accumulates micro-batch gradients in `.grad` and
    /// reads them from there. The sum is the same up to rounding (one rounding per micro-batch
    /// instead of two; see [`verl_torch_ext::linear_accumulating`]).
    pub fn set_grad_accumulation_fusion(&mut self, on: bool) {
        self.grad_accumulation_fusion = on;
    }

    /// Turns per-layer activation checkpointing on or off; it affects [`Transformer::forward_backward`].
    pub fn set_activation_checkpointing(&mut self, on: bool) {
        self.checkpointing = on;
    }

    pub fn activation_checkpointing(&self) -> bool {
        self.checkpointing
    }

    /// With `on`, causal forwards on CUDA whose attention needs no gradient (log-prob and
    /// reference passes) compute attention with the generation engine's paged decode kernel, one
    /// query per position and one context split, the way the engine does under the same switch
    /// (`rollout.consistent_attention`). Each position's attention output is then bit-identical
    /// to the one its decode step produced, so rollout log-probs and recomputed log-probs differ
    /// only by the GEMMs' accumulation order. Off: flash attention (faster).
    pub fn set_consistent_attention(&mut self, on: bool) {
        self.consistent_attention = on;
    }

    pub fn consistent_attention(&self) -> bool {
        self.consistent_attention
    }

    /// A fresh growing cache for this model.
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(self.layers.len())
    }

    /// A fresh preallocated cache for this model holding up to `capacity` positions.
    pub fn new_cache_with_capacity(&self, capacity: i64) -> KvCache {
        KvCache::with_capacity(self.layers.len(), capacity)
    }

    fn embed(&self, input_ids: &Tensor) -> Result<Tensor> {
        if let Some(tp) = &self.tp {
            return tp.embed(&self.embed_tokens, input_ids, self.padding_idx);
        }
        if self.embed_tokens.requires_grad() && crate::layers::accumulating_into_grad() {
            // Gradient-accumulation fusion: the rows present go straight into .grad.
            let pad = (self.padding_idx >= 0).then_some(self.padding_idx);
            return Ok(verl_torch_ext::embedding_accumulating(
                &self.embed_tokens,
                input_ids,
                pad,
            )?);
        }
        Ok(Tensor::f_embedding(
            &self.embed_tokens,
            input_ids,
            self.padding_idx,
            false,
            false,
        )?)
    }

    /// Masks, RoPE tables and positions for one forward.
    fn prepare(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        position_ids: Option<&Tensor>,
        cache: Option<&KvCache>,
        rows: Option<&AttentionRows>,
    ) -> Result<Prepared> {
        let (b, t) = ids_shape(input_ids)?;
        if let Some(r) = rows {
            self.check_rows(r, b, t, attention_mask.is_some() || cache.is_some())?;
        }
        let device = input_ids.device();
        if device != self.device() {
            return Err(NnError::input(
                "input_ids device",
                format!("{:?} (the model's)", self.device()),
                format!("{device:?}"),
            ));
        }
        let new_mask = match attention_mask {
            Some(m) => {
                check_shape("attention_mask", m, &[b, t])?;
                m.f_to_device(device)?.f_ne(0)?
            }
            None => Tensor::f_ones([b, t], (Kind::Bool, device))?,
        };
        let past = cache.map(|c| c.len()).unwrap_or(0);
        let full_mask = match cache.and_then(|c| c.key_mask.as_ref()) {
            Some(prev) => {
                if prev.size()[0] != b {
                    return Err(NnError::input(
                        "input_ids batch size",
                        format!("{} (the KV cache's)", prev.size()[0]),
                        b.to_string(),
                    ));
                }
                Tensor::f_cat(&[prev, &new_mask], 1)?
            }
            None => new_mask.shallow_clone(),
        };
        let total = past + t;
        let positions = match position_ids {
            Some(p) => {
                check_shape("position_ids", p, &[b, t])?;
                p.f_to_device(device)?
            }
            None => full_mask
                .f_to_kind(Kind::Int64)?
                .f_cumsum(-1, Kind::Int64)?
                .f_sub_scalar(1)?
                .f_clamp_min(0)?
                .f_narrow(1, past, t)?,
        };
        let (cos, sin) = self.rope.cos_sin(&positions, self.dtype)?;

        // Query i sits at cache index past + i; key j may be seen when j <= past + i, the key is a
        // real token, and (sliding window) j > past + i - window. A padding query would then see
        // nothing, and SDPA turns an all-false row into NaN that leaks into gradients, so padding
        // queries attend to themselves instead (their outputs are ignored anyway).
        let causal = attention_mask.is_none()
            && cache.is_none()
            && self.layers.iter().all(|l| l.window().is_none());
        let masks = if causal {
            Vec::new()
        } else {
            self.attention_masks(&new_mask, &full_mask, past, total)?
        };
        let consistent = if causal
            && self.consistent_attention
            && verl_torch_ext::paged_attention_available(device)
        {
            Some(match rows {
                Some(r) => crate::layers::ConsistentAttention::for_rows(r)?,
                None => crate::layers::ConsistentAttention::new(b, t, device)?,
            })
        } else {
            None
        };
        Ok(Prepared {
            layer: LayerCtx {
                cos: cos.f_unsqueeze(1)?,
                sin: sin.f_unsqueeze(1)?,
                masks,
                causal,
                consistent,
                rows: rows.map(AttentionRows::shallow_clone),
            },
            full_mask,
        })
    }

    /// A packed forward: `[1, N]` tokens, no mask or cache, full causal attention in every layer.
    fn check_rows(&self, rows: &AttentionRows, b: i64, t: i64, masked: bool) -> Result<()> {
        if b != 1 || t != rows.tokens() {
            return Err(NnError::input(
                "packed input_ids",
                format!("[1, {}] (the attention rows' stream)", rows.tokens()),
                format!("[{b}, {t}]"),
            ));
        }
        if masked {
            return Err(NnError::input(
                "packed forward",
                "no attention mask and no KV cache (the rows say what each token sees)",
                "a mask or a cache",
            ));
        }
        if let Some(i) = self.layers.iter().position(|l| l.window().is_some()) {
            return Err(NnError::input(
                "packed forward",
                "full causal attention in every layer",
                format!("a sliding window in layer {i}"),
            ));
        }
        Ok(())
    }

    /// The boolean masks `[B, 1, T, total]` of one forward, one per distinct sliding window.
    fn attention_masks(
        &self,
        new_mask: &Tensor,
        full_mask: &Tensor,
        past: i64,
        total: i64,
    ) -> Result<Vec<(Option<i64>, Tensor)>> {
        let device = new_mask.device();
        let q_idx = Tensor::f_arange_start(past, total, (Kind::Int64, device))?.f_unsqueeze(1)?;
        let k_idx = Tensor::f_arange(total, (Kind::Int64, device))?.f_unsqueeze(0)?;
        let causal = k_idx.f_le_tensor(&q_idx)?;
        let key_ok = full_mask.f_unsqueeze(1)?;
        let pad_query_self = k_idx
            .f_eq_tensor(&q_idx)?
            .f_unsqueeze(0)?
            .f_logical_and(&new_mask.f_logical_not()?.f_unsqueeze(2)?)?;
        let mut windows: Vec<Option<i64>> = self.layers.iter().map(|l| l.window()).collect();
        windows.sort();
        windows.dedup();
        let mut masks = Vec::with_capacity(windows.len());
        for w in windows {
            let mut allowed = causal.shallow_clone();
            if let Some(w) = w {
                allowed = allowed.f_logical_and(&k_idx.f_gt_tensor(&q_idx.f_sub_scalar(w)?)?)?;
            }
            let m = allowed
                .f_unsqueeze(0)?
                .f_logical_and(&key_ok)?
                .f_logical_or(&pad_query_self)?
                .f_unsqueeze(1)?;
            masks.push((w, m));
        }
        Ok(masks)
    }

    /// A tensor-parallel shard has no backward (its collectives are not differentiable here).
    fn check_trainable(&self) -> Result<()> {
        match &self.tp {
            None => Ok(()),
            Some(tp) => Err(NnError::input(
                "forward-backward model",
                "a whole model",
                format!(
                    "tensor-parallel shard {} of {} (inference only)",
                    tp.comm.rank(),
                    tp.comm.size()
                ),
            )),
        }
    }

    /// Copies every parameter (no grad) from another model of the same config and head.
    pub fn copy_weights_from(&mut self, other: &Transformer) -> Result<()> {
        if other.params.len() != self.params.len() {
            return Err(NnError::input(
                "copy_weights_from source",
                format!("{} parameters", self.params.len()),
                format!("{} parameters", other.params.len()),
            ));
        }
        tch::no_grad(|| -> Result<()> {
            for ((name, dst), (src_name, src)) in self.params.iter_mut().zip(other.params.iter()) {
                if name != src_name || dst.size() != src.size() {
                    return Err(NnError::input(
                        format!("copy_weights_from `{name}`"),
                        format!("{name} {:?}", dst.size()),
                        format!("{src_name} {:?}", src.size()),
                    ));
                }
                dst.f_copy_(src)?;
            }
            Ok(())
        })
    }
}

struct Prepared {
    layer: LayerCtx,
    full_mask: Tensor,
}

/// What a forward-backward hands its loss function.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Output {
    /// The head output.
    Head,
    /// The final hidden states (after the final norm).
    Hidden,
}

fn input_grad(g: Option<Tensor>) -> Result<Tensor> {
    g.ok_or_else(|| NnError::input("unit backward", "a gradient for the unit input", "none"))
}

/// Runs `f` with `unit` acquired, releasing it afterwards even when `f` fails.
fn gated<T>(
    gate: &mut dyn ParamGate,
    unit: Unit,
    f: impl FnOnce(&mut dyn ParamGate) -> Result<T>,
) -> Result<T> {
    gate.acquire(unit)?;
    let r = f(&mut *gate);
    let released = gate.release(unit);
    let v = r?;
    released?;
    Ok(v)
}

fn backward_with_grad(y: &Tensor, grad: &Tensor) -> Result<()> {
    let surrogate = y.f_mul(grad)?.f_sum(None::<Kind>)?;
    Ok(surrogate.f_backward()?)
}

fn check_scalar(loss: &Tensor) -> Result<()> {
    if loss.numel() != 1 {
        return Err(NnError::input(
            "loss_fn result",
            "a scalar tensor",
            format!("shape {:?}", loss.size()),
        ));
    }
    Ok(())
}

fn ids_shape(input_ids: &Tensor) -> Result<(i64, i64)> {
    let s = input_ids.size();
    if s.len() != 2 || input_ids.kind() != Kind::Int64 {
        return Err(NnError::input(
            "input_ids",
            "int64 [B, T]",
            format!("{:?} {:?}", input_ids.kind(), s),
        ));
    }
    Ok((s[0], s[1]))
}

fn check_shape(what: &str, t: &Tensor, expected: &[i64]) -> Result<()> {
    if t.size() != expected {
        return Err(NnError::input(
            what,
            format!("shape {expected:?}"),
            format!("shape {:?}", t.size()),
        ));
    }
    Ok(())
}

/// `x · wᵀ` with fp32 output (`x` `[N, H]`, `w` `[V, H]`): LM-head logits. For bf16/f16 inputs
/// on CUDA the GEMM accumulates in fp32 and writes fp32, so logits are not rounded to 8 bits of
/// mantissa (the rollout engine and the training forward then agree to ~1e-3 in log-prob instead
/// of ~1e-2); elsewhere, and under autograd (the fp32-output GEMM has no derivative), `linear` in
/// the input dtype, then a cast.
pub fn linear_fp32(x: &Tensor, w: &Tensor) -> std::result::Result<Tensor, tch::TchError> {
    let half = matches!(x.kind(), Kind::BFloat16 | Kind::Half);
    if half && x.device().is_cuda() && x.dim() == 2 {
        // No derivative for this GEMM: under autograd with an input that needs one, `linear`.
        if let Ok(out) = x.f_mm_dtype(&w.f_tr()?, Kind::Float) {
            if !out.requires_grad() {
                return Ok(out);
            }
        }
    }
    x.f_linear(w, None::<&Tensor>)?.f_to_kind(Kind::Float)
}

/// The guard of [`Transformer::fuse_decode_weights`]: the fused projections live until it drops.
pub struct FusedDecodeWeights<'a> {
    model: &'a Transformer,
    /// Device bytes the fused copies hold.
    pub bytes: usize,
}

impl Drop for FusedDecodeWeights<'_> {
    fn drop(&mut self) {
        for layer in &self.model.layers {
            let _ = layer.fuse(false);
        }
    }
}
