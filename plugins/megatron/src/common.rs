//! What the roles share: config sections, joining the parallel groups, building the model, the
//! micro-batch loop of forward passes, the full (TP=1) model for generation and HF export.

use std::collections::HashMap;
use std::path::Path;

use tch::{Device, Kind, Tensor};
use verl_backend_kit::config::{parse_dtype, section, MicroBatching};
use verl_backend_kit::data::{index_tensor, micro_batches, MicroBatch, Sequences};
use verl_backend_kit::dp::Dp;
use verl_backend_kit::update::NonFiniteAt;
use verl_comm::ReduceOp;
use verl_nn::{Checkpoint, HeadKind, ModelConfig, ModelOptions, Transformer};
use verl_plugin_api::InitArgs;

use crate::error::{MegatronError, Result, TorchContext};
use crate::layout::{Layout, MegatronSection};
use crate::parallel::Parallel;
use crate::pipeline::{broadcast_from_last, forward_only, gather_stages, MicroInput};
use crate::tp::{ExpertSetup, MoeMicro, Recompute, TpModel};

/// Reads `<prefix>` as a [`MegatronSection`]; `fallback` (another role's section) when absent.
pub fn megatron_section(
    cfg: &serde_json::Value,
    prefix: &str,
    fallback: Option<&str>,
) -> Result<MegatronSection> {
    let present = prefix
        .split('.')
        .try_fold(cfg, |v, k| v.get(k))
        .map(|v| !v.is_null())
        .unwrap_or(false);
    match (present, fallback) {
        (false, Some(f)) => Ok(section(cfg, f)?),
        _ => Ok(section(cfg, prefix)?),
    }
}

/// The layout of a role, validated, with the parts this backend does not implement yet refused.
pub fn role_layout(
    sec: &MegatronSection,
    prefix: &str,
    init: &InitArgs,
    model: &ModelConfig,
) -> Result<Layout> {
    let layout = Layout::validate(sec, prefix, init.world_size.max(1) as usize, model)?;
    let unsupported = |k: &str, what: &str| MegatronError::Unsupported {
        key: format!("{prefix}.{k}"),
        what: what.into(),
    };
    if layout.cp > 1 {
        return Err(unsupported(
            "context_parallel_size",
            "context parallelism (> 1)",
        ));
    }
    Ok(layout)
}

/// Megatron's `moe_aux_loss_coeff` of a mixture-of-experts model:
/// `<prefix>.override_transformer_config.moe_aux_loss_coeff`, else config.json's
/// `router_aux_loss_coef` (the HF field for the same load-balancing loss), else HF's default for
/// Mixtral / Qwen2-MoE / Qwen3-MoE, 0.001. 0 for a dense model.
pub fn aux_loss_coeff(sec: &MegatronSection, prefix: &str, model: &ModelConfig) -> Result<f64> {
    if model.moe.is_none() {
        return Ok(0.0);
    }
    let (key, value) = match sec.override_transformer_config.get("moe_aux_loss_coeff") {
        Some(v) => (
            format!("{prefix}.override_transformer_config.moe_aux_loss_coeff"),
            v.clone(),
        ),
        None => match model.raw.get("router_aux_loss_coef") {
            Some(v) => (
                "model config.json `router_aux_loss_coef`".to_string(),
                v.clone(),
            ),
            None => return Ok(0.001),
        },
    };
    match value.as_f64() {
        Some(c) if c.is_finite() && c >= 0.0 => Ok(c),
        _ => Err(MegatronError::config(
            key,
            "a finite non-negative number",
            value,
        )),
    }
}

/// `*.megatron.dtype` → the compute dtype.
pub fn compute_dtype(sec: &MegatronSection, prefix: &str) -> Result<Kind> {
    Ok(parse_dtype(&format!("{prefix}.dtype"), &sec.dtype)?)
}

/// Joins the role's groups.
pub fn join(init: &InitArgs, role: &str, layout: Layout, device: Device) -> Result<Parallel> {
    Parallel::join(init, role, layout, device)
}

/// This rank's slices of the model in `dir` (or, with `random_init`, of a freshly initialised one).
/// The global generator is seeded with `seed` first, so a value head missing from the checkpoint is
/// initialised identically on every rank (and as the FSDP backend does).
#[allow(clippy::too_many_arguments)]
pub fn build_model(
    dir: &Path,
    cfg: ModelConfig,
    head: HeadKind,
    dtype: Kind,
    par: &Parallel,
    seed: u64,
    random_init: Option<u64>,
    aux_loss_coeff: f64,
) -> Result<TpModel> {
    // Ranks run as threads of one process (the tests) share libtorch's global generator: one
    // rank's seeding and draws (a fresh value head, a random init) must not interleave with
    // another's, or the replicated value head differs between ranks.
    static SEEDED_BUILD: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _seeded = SEEDED_BUILD.lock().unwrap_or_else(|e| e.into_inner());
    tch::manual_seed(seed as i64);
    let stage = par.stage();
    let experts = ExpertSetup {
        ep: par.ep.clone(),
        etp: par.etp.clone(),
        seq: par.moe_tp.clone(),
        aux_loss_coeff,
    };
    let mut model = match random_init {
        None => {
            let mut ckpt = Checkpoint::open(dir)?;
            TpModel::new_stage(
                cfg,
                head,
                dtype,
                par.device,
                par.tp.clone(),
                stage,
                experts,
                &mut ckpt,
            )
        }
        Some(s) => {
            // Drawn on this rank's device, as the FSDP backend draws it (the same weights for one
            // seed, and seconds instead of minutes for a billion parameters on the CPU's serial
            // generator); every rank draws the whole model with the same seed, then keeps its
            // slices.
            tch::manual_seed(s as i64);
            let full = Transformer::new(
                cfg.clone(),
                &ModelOptions {
                    device: par.device,
                    dtype,
                    head,
                },
            )?;
            let mut named: HashMap<String, Tensor> = full
                .named_parameters()
                .iter()
                .map(|(n, t)| (n.clone(), t.shallow_clone()))
                .collect();
            TpModel::new_stage(
                cfg,
                head,
                dtype,
                par.device,
                par.tp.clone(),
                stage,
                experts,
                &mut named,
            )
        }
    }?;
    // Megatron-core sequence parallelism (TP > 1 only): the residual stream, norms and dropout
    // region sharded along the sequence over the tensor-parallel group.
    model.set_sequence_parallel(par.layout.sequence_parallel);
    Ok(model)
}

/// A plain (TP=1) `verl_nn::Transformer` on `device` holding `weights` (full tensors by HF name):
/// what generation runs on, and what HF export writes.
pub fn assemble(
    cfg: &ModelConfig,
    head: HeadKind,
    dtype: Kind,
    device: Device,
    weights: &HashMap<String, Tensor>,
) -> Result<Transformer> {
    let mut model = Transformer::new(
        cfg.clone(),
        &ModelOptions {
            device,
            dtype,
            head,
        },
    )?;
    model.set_requires_grad(false)?;
    tch::no_grad(|| -> Result<()> {
        for (name, dst) in model.named_parameters() {
            let src = weights.get(name).ok_or_else(|| {
                MegatronError::Api(verl_plugin_api::Error::failed(format!(
                    "internal: no gathered tensor for `{name}`"
                )))
            })?;
            dst.shallow_clone()
                .f_copy_(src)
                .ctx("assemble full model")?;
        }
        Ok(())
    })?;
    Ok(model)
}

/// The full live (compute-dtype) weights of this stage's parameters, gathered over its
/// tensor-parallel group (and every expert, over the expert-parallel group).
pub fn gather_live(model: &TpModel) -> Result<HashMap<String, Tensor>> {
    let mut out = HashMap::new();
    for (i, p) in model.params.iter().enumerate() {
        let local = p.local.f_detach().ctx("live weight")?;
        out.extend(model.gather_named(i, &local)?);
    }
    Ok(out)
}

/// The full live (compute-dtype) weights of the whole model, gathered over the tensor-parallel
/// group and the pipeline stages: complete on every rank (generation and export need them all).
pub fn gather_live_model(model: &TpModel, par: &Parallel) -> Result<HashMap<String, Tensor>> {
    let out = gather_live(model)?;
    gather_stages(
        model.config(),
        model.head_kind(),
        &par.pp,
        model.stage().chunks,
        out,
        model.dtype(),
        1,
    )
}

/// Runs the model over every micro-batch of `seqs` (through the pipeline stages) and `f(sub,
/// hidden)` on the normed final hidden states on the last stage, and scatters its `[rows, R]`
/// outputs back into batch order; the last stage's outputs then reach every stage, so each rank
/// returns the full result for its data-parallel slice. `outputs` is how many tensors `f`
/// returns.
#[allow(clippy::too_many_arguments)]
pub fn forward_micro_batches(
    model: &TpModel,
    par: &Parallel,
    seqs: &Sequences,
    batching: MicroBatching,
    budget_key: &str,
    outputs: usize,
    mut f: impl FnMut(&Sequences, &Tensor) -> Result<Vec<Tensor>>,
) -> Result<Vec<Tensor>> {
    let rows: Vec<usize> = (0..seqs.rows()).collect();
    let lengths = seqs.row_lengths()?;
    let parts = micro_batches(&rows, &lengths, batching, budget_key)?;
    // The MoE blocks of an expert-parallel model may exchange tokens between data-parallel ranks
    // (an expert group beyond one tensor-parallel group): every rank then runs the same number of
    // forwards (dummies are run and discarded).
    let parts: Vec<MicroBatch> = if par.layout.experts_span_data_parallel() {
        same_micro_batch_count(&par.dp_meta, parts)?
    } else {
        parts
            .into_iter()
            .map(|rows| MicroBatch { rows, dummy: false })
            .collect()
    };
    let device = seqs.input_ids.device();
    let subs: Vec<(Tensor, Sequences, bool)> = parts
        .iter()
        .map(|part| {
            let idx = index_tensor(&part.rows, device)?;
            let sub = seqs.select(&idx)?;
            Ok((idx, sub, part.dummy))
        })
        .collect::<Result<_>>()?;
    let micro: Vec<MicroInput> = subs
        .iter()
        .map(|(_, s, _)| MicroInput {
            ids: &s.input_ids,
            mask: &s.attention_mask,
            positions: &s.position_ids,
            moe: MoeMicro::NONE,
        })
        .collect();
    let mut out = seqs.output_buffers(outputs)?;
    forward_only(model, &par.pp, &micro, &mut |i, hidden| {
        let (idx, sub, dummy) = &subs[i];
        if *dummy {
            return Ok(());
        }
        let res = f(sub, hidden)?;
        for (dst, src) in out.iter_mut().zip(res) {
            let _ = dst
                .f_index_copy_(0, idx, &src.f_to_kind(Kind::Float).ctx("output")?)
                .ctx("scatter micro-batch output")?;
        }
        Ok(())
    })?;
    broadcast_from_last(&par.pp, &mut out)?;
    Ok(out)
}

// Shared with the FSDP backend: row-count and micro-batch agreement across data-parallel ranks,
// and the tokenizer files an exported HF folder needs.
pub use verl_backend_kit::budget::{same_micro_batch_count, same_rows_on_every_rank};
pub use verl_backend_kit::model_files::{copy_tokenizer_files, random_init_seed};
pub use verl_backend_kit::policy::check_temperature;

/// A mini-batch's micro-batches as an update's pipeline schedule takes them: each one's rows
/// (`Sequences`), the role's per-row inputs, whether it only pads, and what its MoE blocks do.
pub struct UpdateMicros<T> {
    pub micros: Vec<(Sequences, T, bool)>,
    moe: Vec<MoeMicro>,
}

impl<T> UpdateMicros<T> {
    /// `rows` of `seqs` split by `micro` (the same count on every data-parallel rank); `pick`
    /// takes a micro-batch's rows of the role's per-row inputs.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        model: &TpModel,
        dp: &Dp,
        seqs: &Sequences,
        rows: &[usize],
        lengths: &[i64],
        micro: MicroBatching,
        budget_key: &str,
        pick: impl Fn(&Tensor) -> Result<T>,
    ) -> Result<UpdateMicros<T>> {
        let device = seqs.response_mask.device();
        let parts = same_micro_batch_count(dp, micro_batches(rows, lengths, micro, budget_key)?)?;
        let moe = moe_micro(model, dp, &parts)?;
        let micros = parts
            .iter()
            .map(|MicroBatch { rows: part, dummy }| {
                let idx = index_tensor(part, device)?;
                Ok((seqs.select(&idx)?, pick(&idx)?, *dummy))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(UpdateMicros { micros, moe })
    }

    /// The model inputs of each micro-batch.
    pub fn inputs(&self) -> Vec<MicroInput<'_>> {
        self.micros
            .iter()
            .zip(&self.moe)
            .map(|((sub, _, _), &moe)| MicroInput {
                ids: &sub.input_ids,
                mask: &sub.attention_mask,
                positions: &sub.position_ids,
                moe,
            })
            .collect()
    }

    /// Whether micro-batch `i` only pads.
    pub fn is_dummy(&self, i: usize) -> bool {
        self.micros[i].2
    }
}

/// What the MoE blocks do in each micro-batch of a mini-batch (`parts`, already equalised over the
/// data-parallel ranks). Megatron scales the router load-balancing loss like the main loss, by
/// one over the micro-batches that share the gradient: with gradients summed over the
/// data-parallel ranks that is every rank's real micro-batches, so each (token set, loss) pair
/// gets the weight a one-rank run of the same micro-batches gives it. Dummy micro-batches get no
/// loss and record nothing. Without sparse layers: [`MoeMicro::NONE`] (no collective).
pub fn moe_micro(model: &TpModel, dp: &Dp, parts: &[MicroBatch]) -> Result<Vec<MoeMicro>> {
    if model.sparse_layers().is_empty() {
        return Ok(vec![MoeMicro::NONE; parts.len()]);
    }
    let mut real = [parts.iter().filter(|p| !p.dummy).count() as f64];
    dp.all_reduce_sum(&mut real)?;
    let scale = if real[0] > 0.0 { 1.0 / real[0] } else { 0.0 };
    Ok(parts
        .iter()
        .map(|p| MoeMicro {
            aux_scale: if p.dummy { 0.0 } else { scale },
            record: !p.dummy,
        })
        .collect())
}

/// The MoE step metrics of the training backwards since the last call (`moe/expert_load/<e>`,
/// `moe/load_imbalance`, `moe/load_imbalance_max`, `moe/aux_loss`): routed pairs summed over the
/// data-parallel ranks (tensor-parallel peers either route the same tokens or, partitioning
/// them, report the sums over their group: counted once) and the pipeline stages (each holds
/// other layers), identical on every rank. Empty for a dense model.
pub fn moe_load_metrics(model: &TpModel, par: &Parallel) -> Result<Vec<(String, f64)>> {
    let mut load = model.take_moe_load()?;
    if model.sparse_layers().is_empty() {
        return Ok(vec![]);
    }
    load.reduce_with(|v| {
        par.dp
            .all_reduce_f64(v, ReduceOp::Sum, "all_reduce (moe load metrics)")?;
        par.pp
            .all_reduce_f64(v, ReduceOp::Sum, "all_reduce (moe load metrics)")
    })?;
    Ok(load.metrics())
}

/// The last pipeline stage's `value` on every stage (what only it computed: losses, metrics).
pub fn from_last_stage<T: serde::Serialize + serde::de::DeserializeOwned>(
    par: &Parallel,
    value: &T,
    what: &'static str,
) -> Result<T> {
    if par.pp.size == 1 {
        return serde_json::to_value(value)
            .and_then(serde_json::from_value)
            .map_err(|e| internal_json(what, e));
    }
    let v = serde_json::to_value(value).map_err(|e| internal_json(what, e))?;
    let got = par.pp.broadcast_json(&v, par.pp.size - 1, what)?;
    serde_json::from_value(got).map_err(|e| internal_json(what, e))
}

/// The last pipeline stage's report of a mini-batch's first non-finite value, on every stage
/// (the other stages compute no loss).
pub fn non_finite_from_last_stage(
    par: &Parallel,
    bad: Option<NonFiniteAt>,
) -> Result<Option<NonFiniteAt>> {
    // The value travels as text: JSON has no NaN or infinity.
    let wire = bad.map(|b| (b.micro, b.metric, b.value.to_string()));
    let got = from_last_stage(par, &wire, "broadcast (non-finite loss report)")?;
    Ok(got.map(|(micro, metric, value)| NonFiniteAt {
        micro,
        metric,
        value: value.parse().unwrap_or(f64::NAN),
    }))
}

fn internal_json(what: &str, e: serde_json::Error) -> MegatronError {
    MegatronError::Api(verl_plugin_api::Error::failed(format!(
        "internal: {what}: {e}"
    )))
}

/// The metrics of an update on every pipeline stage: the losses and everything derived from them
/// exist on the last stage only, so its metrics are what every rank reports; the memory metrics
/// ([`verl_backend_kit::metrics::MEMORY_METRICS`]) are the maximum over the stages.
pub fn metrics_from_last_stage(
    par: &Parallel,
    mine: Vec<(String, f64)>,
) -> Result<Vec<(String, f64)>> {
    if par.pp.size == 1 {
        return Ok(mine);
    }
    let keys = verl_backend_kit::metrics::MEMORY_METRICS;
    let mut memory = keys.map(|key| {
        mine.iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| *v)
            .unwrap_or(-1.0)
    });
    par.pp
        .all_reduce_f64(&mut memory, ReduceOp::Max, "all_reduce (memory metrics)")?;
    // JSON has no NaN: values travel as optional numbers.
    let encoded: Vec<(String, Option<f64>)> = mine
        .into_iter()
        .map(|(k, v)| (k, v.is_finite().then_some(v)))
        .collect();
    let got = from_last_stage(par, &encoded, "broadcast (update metrics)")?;
    let mut out: Vec<(String, f64)> = got
        .into_iter()
        .map(|(k, v)| (k, v.unwrap_or(f64::NAN)))
        .collect();
    for (key, value) in keys.into_iter().zip(memory) {
        if value < 0.0 {
            continue;
        }
        match out.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = value,
            None => out.push((key.to_string(), value)),
        }
    }
    Ok(out)
}

/// Which layers the training backward recomputes, from verl's
/// `<prefix>.override_transformer_config`, as Megatron-core reads it: `recompute_granularity`
/// `null` (verl's default) keeps every layer's activations; `full` recomputes every layer
/// (`recompute_method` `uniform`, or unset) or the first `recompute_num_layers` of each model
/// chunk (`block`); `selective` (Megatron-core's recomputation of parts of a layer, by default the
/// attention scores, which flash attention never stores) keeps every layer here.
/// `*.model.enable_gradient_checkpointing` is the FSDP backend's key and, as in verl, is not read.
pub fn recompute(sec: &MegatronSection, prefix: &str) -> Result<Recompute> {
    let otc = &sec.override_transformer_config;
    let key = |k: &str| format!("{prefix}.override_transformer_config.{k}");
    let granularity = match otc.get("recompute_granularity") {
        None | Some(serde_json::Value::Null) => return Ok(Recompute::None),
        Some(v) => v,
    };
    match granularity.as_str() {
        Some("selective") => {
            tracing::info!(
                "{}=selective: this backend keeps whole layers or recomputes whole layers; \
                 selective recomputation (of attention scores, which flash attention never \
                 stores) keeps every layer's activations",
                key("recompute_granularity")
            );
            return Ok(Recompute::None);
        }
        Some("full") => {}
        _ => {
            return Err(MegatronError::config(
                key("recompute_granularity"),
                "null, \"full\" or \"selective\"",
                granularity,
            ))
        }
    }
    let method = otc.get("recompute_method").filter(|v| !v.is_null());
    match method.map(|v| v.as_str()) {
        None | Some(Some("uniform")) => Ok(Recompute::All),
        Some(Some("block")) => {
            let n = otc.get("recompute_num_layers").cloned().unwrap_or_default();
            match n.as_u64() {
                Some(n) => Ok(Recompute::FirstOf(n as usize)),
                None => Err(MegatronError::config(
                    key("recompute_num_layers"),
                    "a non-negative integer (layers of each model chunk to recompute, with \
                     recompute_method=block)",
                    n,
                )),
            }
        }
        _ => Err(MegatronError::config(
            key("recompute_method"),
            "null, \"uniform\" or \"block\"",
            method.cloned().unwrap_or_default(),
        )),
    }
}

/// Sets `model`'s recomputation from `<prefix>.override_transformer_config` ([`recompute`]) and
/// says when layers will be recomputed anyway (sequence parallelism, MoE blocks).
pub fn apply_recompute(model: &mut TpModel, sec: &MegatronSection, prefix: &str) -> Result<()> {
    let r = recompute(sec, prefix)?;
    model.set_recompute(r);
    if r == Recompute::All {
        return Ok(());
    }
    if model.sequence_parallel() {
        tracing::info!(
            "{prefix}: with sequence parallelism every decoder layer is recomputed in the \
             backward (only its input is kept)"
        );
    } else if !model.sparse_layers().is_empty() {
        tracing::info!(
            "{prefix}: MoE layers are recomputed in the backward (only their input is kept)"
        );
    }
    Ok(())
}
