//! Forward passes over micro-batches: per-token log-probs / entropy of the response tokens (policy)
//! and per-token values (critic), scattered back into batch order.

use tch::{Kind, Tensor};
use verl_losses::ChunkedLmHead;
use verl_nn::Transformer;

use crate::packing::{Padding, RowLayout};
use verl_backend_kit::budget::head_chunk_tokens;
use verl_backend_kit::config::MicroBatching;
use verl_backend_kit::data::{index_tensor, micro_batches, Sequences};
use verl_backend_kit::error::{BackendError, Result, TorchContext};

/// Logits of the positions that predict response tokens, fp32, divided by `temperature`.
pub fn response_logits(seqs: &Sequences, head_out: &Tensor, temperature: f64) -> Result<Tensor> {
    check_temperature(temperature)?;
    seqs.response_slice(head_out)?
        .f_to_kind(Kind::Float)
        .and_then(|l| l.f_div_scalar(temperature))
        .ctx("logits / temperature")
}

/// Log-probs (and entropy) of `seqs.responses`, without autograd: every response position, through
/// the LM head in chunks of [`head_chunk_tokens`] (the prompt positions never reach the head, and no
/// `[rows, R, vocab]` fp32 logits are built).
pub fn token_stats(
    model: &Transformer,
    seqs: &Sequences,
    temperature: f64,
    with_entropy: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let all: Vec<usize> = (0..seqs.rows()).collect();
    let layout = RowLayout::new(seqs, &all, Padding::Keep)?;
    let chunk = head_chunk_tokens(model.config().vocab_size);
    layout_token_stats(model, &layout, temperature, with_entropy, chunk)
}

/// The LM head matrix of a causal-LM model.
pub fn lm_head(model: &Transformer) -> Result<Tensor> {
    model
        .lm_head_weight()
        .map(Tensor::shallow_clone)
        .ok_or_else(|| {
            BackendError::Api(verl_plugin_api::Error::failed(format!(
                "log-probs need a causal-LM head, found a {:?} head",
                model.head_kind()
            )))
        })
}

/// Log-probs (and entropy) `[rows, R]` of the tokens `layout` selects (0 at the others), without
/// autograd, with the LM head applied `chunk_tokens` selected tokens at a time.
pub fn layout_token_stats(
    model: &Transformer,
    layout: &RowLayout,
    temperature: f64,
    with_entropy: bool,
    chunk_tokens: i64,
) -> Result<(Tensor, Option<Tensor>)> {
    check_temperature(temperature)?;
    let _guard = tch::no_grad_guard();
    let hidden = layout.forward_hidden(model)?;
    let picked = layout.gather(&hidden)?;
    drop(hidden);
    let stats = ChunkedLmHead::new(chunk_tokens, temperature, with_entropy).forward(
        &picked,
        &lm_head(model)?,
        &layout.targets,
    )?;
    let lp = layout.scatter(&stats.log_probs).ctx("scatter log-probs")?;
    let ent = match &stats.entropy {
        Some(e) => Some(layout.scatter(e).ctx("scatter entropy")?),
        None => None,
    };
    Ok((lp, ent))
}

/// Critic values `[rows, R]` fp32 at the tokens `layout` selects (0 at the others), without
/// autograd.
pub fn layout_values(model: &Transformer, layout: &RowLayout) -> Result<Tensor> {
    let _guard = tch::no_grad_guard();
    let out = model.apply_head(&layout.forward_hidden(model)?, layout.model_mask())?;
    layout.scatter(&layout.gather(&out)?).ctx("scatter values")
}

/// Runs `f` on the micro-batches of a forward-only pass — rows grouped by length
/// ([`length_sorted_micro_batches`]), or in batch order when prompts are shared
/// ([`Padding::forward_micro_batches`]), laid out for `padding` — and scatters its `[rows, R]`
/// outputs back into batch order. `outputs` is how many tensors `f` returns.
pub fn per_micro_batch_layout<F>(
    seqs: &Sequences,
    batching: MicroBatching,
    padding: Padding,
    budget_key: &str,
    outputs: usize,
    mut f: F,
) -> Result<Vec<Tensor>>
where
    F: FnMut(&RowLayout) -> Result<Vec<Tensor>>,
{
    let parts = padding.forward_micro_batches(seqs, batching, budget_key)?;
    let device = seqs.input_ids.device();
    let mut out = seqs.output_buffers(outputs)?;
    for part in parts {
        let layout = RowLayout::new(seqs, &part, padding)?;
        let res = f(&layout)?;
        let idx = index_tensor(&part, device)?;
        for (dst, src) in out.iter_mut().zip(res) {
            let _ = dst
                .f_index_copy_(0, &idx, &src.f_to_kind(Kind::Float).ctx("output")?)
                .ctx("scatter micro-batch output")?;
        }
    }
    Ok(out)
}

/// Critic values at the response positions (verl's `values[:, -R-1:-1]`), fp32, without autograd.
pub fn values(model: &Transformer, seqs: &Sequences) -> Result<Tensor> {
    let _guard = tch::no_grad_guard();
    let out = model.forward(
        &seqs.input_ids,
        Some(&seqs.attention_mask),
        Some(&seqs.position_ids),
        None,
    )?;
    seqs.response_slice(&out)?
        .f_to_kind(Kind::Float)
        .ctx("values to fp32")
}

/// Runs `f` on every micro-batch of `seqs` and scatters its `[rows, R]` outputs back into batch order.
/// `outputs` is how many tensors `f` returns.
pub fn per_micro_batch<F>(
    seqs: &Sequences,
    batching: MicroBatching,
    budget_key: &str,
    outputs: usize,
    mut f: F,
) -> Result<Vec<Tensor>>
where
    F: FnMut(&Sequences) -> Result<Vec<Tensor>>,
{
    let rows: Vec<usize> = (0..seqs.rows()).collect();
    let lengths = seqs.row_lengths()?;
    let parts = micro_batches(&rows, &lengths, batching, budget_key)?;
    let device = seqs.input_ids.device();
    let mut out = seqs.output_buffers(outputs)?;
    for part in parts {
        let idx = index_tensor(&part, device)?;
        let sub = seqs.select(&idx)?;
        let res = f(&sub)?;
        for (dst, src) in out.iter_mut().zip(res) {
            let _ = dst
                .f_index_copy_(0, &idx, &src.f_to_kind(Kind::Float).ctx("output")?)
                .ctx("scatter micro-batch output")?;
        }
    }
    Ok(out)
}

fn check_temperature(temperature: f64) -> Result<()> {
    if temperature.is_finite() && temperature > 0.0 {
        return Ok(());
    }
    Err(BackendError::config(
        "actor_rollout_ref.rollout.temperature",
        "a finite temperature > 0",
        temperature,
    ))
}
