//! Forward passes over micro-batches: per-token log-probs / entropy of the response tokens (policy)
//! and per-token values (critic), scattered back into batch order.

use tch::{Kind, Tensor};
use verl_losses::{entropy_from_logits, logprobs_from_logits};
use verl_nn::Transformer;

use crate::config::MicroBatching;
use crate::data::{index_tensor, micro_batches, Sequences};
use crate::error::{FsdpError, Result, TorchContext};

/// Logits of the positions that predict response tokens, fp32, divided by `temperature`.
pub fn response_logits(seqs: &Sequences, head_out: &Tensor, temperature: f64) -> Result<Tensor> {
    check_temperature(temperature)?;
    seqs.response_slice(head_out)?
        .f_to_kind(Kind::Float)
        .and_then(|l| l.f_div_scalar(temperature))
        .ctx("logits / temperature")
}

/// Log-probs (and entropy) of `seqs.responses`, without autograd. The LM head is applied to the
/// response positions only, so the `[rows, T, vocab]` logits of the prompt are never built.
pub fn token_stats(
    model: &Transformer,
    seqs: &Sequences,
    temperature: f64,
    with_entropy: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    check_temperature(temperature)?;
    let _guard = tch::no_grad_guard();
    let hidden = model.forward_hidden(
        &seqs.input_ids,
        Some(&seqs.attention_mask),
        Some(&seqs.position_ids),
        None,
    )?;
    let hidden = seqs.response_slice(&hidden)?;
    let logits = model.apply_head(&hidden, None)?;
    let logits = logits
        .f_to_kind(Kind::Float)
        .and_then(|l| l.f_div_scalar(temperature))
        .ctx("logits / temperature")?;
    let lp = logprobs_from_logits(&logits, &seqs.responses)?;
    let ent = if with_entropy {
        Some(entropy_from_logits(&logits)?)
    } else {
        None
    };
    Ok((lp, ent))
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
    let mut out: Vec<Tensor> = (0..outputs)
        .map(|_| {
            Tensor::f_zeros(
                [seqs.rows() as i64, seqs.response_len],
                (Kind::Float, device),
            )
            .ctx("output buffer")
        })
        .collect::<Result<_>>()?;
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
    Err(FsdpError::config(
        "actor_rollout_ref.rollout.temperature",
        "a finite temperature > 0",
        temperature,
    ))
}
