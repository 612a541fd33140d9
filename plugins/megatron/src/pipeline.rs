//! Pipeline parallelism: the 1F1B schedule, its executor for training, the streaming forward of the
//! scoring paths, and gathering the stages' weights into whole models.
//!
//! A pipeline group holds one rank per stage with the same tensor- and data-parallel coordinates,
//! so every rank talks only to its own stage neighbours, and each tensor-parallel rank passes the
//! whole (replicated) activation of its micro-batch. Every stage splits a mini-batch into the same
//! micro-batches (the same rows reach every stage of a replica), so the shape of each activation
//! and gradient is known to both ends without exchanging it.
//!
//! Training follows Megatron's non-interleaved 1F1B schedule: stage `s` of `p` runs
//! `min(p - s - 1, m)` warm-up forwards, then alternates one forward and one backward, then drains
//! the remaining backwards. At most `p - s` micro-batches are in flight on stage `s` (their layer
//! inputs are what a stage keeps when the layers are recomputed in the backward; their dense
//! layers' graphs too without activation checkpointing). Where a stage sends
//! to a neighbour and then waits for that neighbour, the two transfers are one exchange
//! ([`Op::SendForwardRecvBackward`], [`Op::SendBackwardRecvForward`]), which is what keeps a
//! blocking send (NCCL's) from deadlocking. With one stage the schedule is F0 B0 F1 B1 …: the
//! same code path trains PP = 1.
//!
//! With virtual pipeline parallelism (`virtual_pipeline_model_parallel_size` = `v` model chunks
//! per stage) chunk `c` of stage `s` is virtual stage `c·p + s`: activations go from chunk `c` of
//! stage `s` to chunk `c` of stage `s + 1`, and from the last stage's chunk `c` to the first
//! stage's chunk `c + 1` (a ring). Training follows Megatron-core's interleaved 1F1B
//! ([`interleaved`]): units (micro-batch, chunk) in the schedule table's order (micro-batches in
//! groups of `p`, each group through every chunk), `min((p - s - 1)·2 + (v - 1)·p, m·v)` warm-up
//! forwards on stage `s`, then one forward and one backward, then the remaining backwards (with
//! `m` not a multiple of `p` the remainder joins the last group and the warm-up counts that
//! group's size instead of `p`: [`interleaved_warmup`]). The transfers are laid out in lock-step rounds where every send meets its receive in the same
//! round and the same half (activations, then gradients), which is deadlock-free with blocking
//! sends for any number of micro-batches.

use std::collections::HashMap;

use tch::{Kind, Tensor};
use verl_nn::{HeadKind, ModelConfig};

use crate::error::{MegatronError, Result, TorchContext};
use crate::parallel::Group;
use crate::tp::{stage_specs, MoeMicro, Stage, StageActs, TpModel};

/// One step of a stage's schedule; the numbers are micro-batch indices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Receive micro-batch `i`'s activation from the previous stage.
    RecvForward(usize),
    Forward(usize),
    /// Send micro-batch `i`'s output to the next stage.
    SendForward(usize),
    /// Receive the gradient of micro-batch `i`'s output from the next stage.
    RecvBackward(usize),
    Backward(usize),
    /// Send the gradient of micro-batch `i`'s input to the previous stage.
    SendBackward(usize),
    /// With the next stage: send the output of `send`, receive the output gradient of `recv`.
    SendForwardRecvBackward {
        send: usize,
        recv: usize,
    },
    /// With the previous stage: send the input gradient of `send`, receive the activation of
    /// `recv`.
    SendBackwardRecvForward {
        send: usize,
        recv: usize,
    },
}

/// The 1F1B schedule of `stage` (of `stages`) over `micro` micro-batches. The first stage never
/// receives activations nor sends gradients, the last never sends activations nor receives
/// gradients: an exchange with a missing neighbour becomes its remaining half, or nothing.
pub fn one_f_one_b(stage: usize, stages: usize, micro: usize) -> Vec<Op> {
    let first = stage == 0;
    let last = stage + 1 >= stages;
    let warmup = (stages - stage - 1).min(micro);
    let steady = micro - warmup;
    let mut ops = Vec::with_capacity(4 * micro);
    for i in 0..warmup {
        if !first {
            ops.push(Op::RecvForward(i));
        }
        ops.push(Op::Forward(i));
        if !last {
            ops.push(Op::SendForward(i));
        }
    }
    if steady > 0 && !first {
        ops.push(Op::RecvForward(warmup));
    }
    for i in 0..steady {
        let (fwd, bwd) = (warmup + i, i);
        ops.push(Op::Forward(fwd));
        if !last {
            ops.push(Op::SendForwardRecvBackward {
                send: fwd,
                recv: bwd,
            });
        }
        ops.push(Op::Backward(bwd));
        if !first {
            if i + 1 == steady {
                ops.push(Op::SendBackward(bwd));
            } else {
                ops.push(Op::SendBackwardRecvForward {
                    send: bwd,
                    recv: fwd + 1,
                });
            }
        }
    }
    for i in steady..micro {
        if !last {
            ops.push(Op::RecvBackward(i));
        }
        ops.push(Op::Backward(i));
        if !first {
            ops.push(Op::SendBackward(i));
        }
    }
    ops
}

/// Every stage's schedule (indexed by stage), or why the schedule cannot run.
pub type Plans = std::result::Result<Vec<Vec<Step>>, String>;

/// One micro-batch through one model chunk: the unit of work of the interleaved schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Unit {
    pub chunk: usize,
    pub micro: usize,
}

/// One step of a stage's interleaved (virtual pipeline) schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    Forward(Unit),
    Backward(Unit),
    /// One lock-step transfer with both ring neighbours, in two halves that every stage runs in
    /// the same order: first the activations (send `send_act`'s output to the next stage while
    /// receiving `recv_act`'s input from the previous one), then the gradients (send
    /// `send_grad`'s input gradient to the previous stage while receiving `recv_grad`'s output
    /// gradient from the next one). The last stage's next is the first (chunk `c` feeds chunk
    /// `c + 1`) and the first's previous is the last.
    Comm {
        send_act: Option<Unit>,
        recv_act: Option<Unit>,
        send_grad: Option<Unit>,
        recv_grad: Option<Unit>,
    },
}

/// The order of the units of `micro` micro-batches through `chunks` model chunks of `stages`
/// stages (Megatron-core's schedule table): micro-batches in groups of `stages`, each group
/// through chunk 0, then chunk 1, …; backwards take the chunks of a group in reverse. With `micro`
/// a multiple of `stages`, forward unit `k` is chunk `(k / stages) % chunks` of micro-batch
/// `(k / (stages · chunks)) · stages + k % stages`. Otherwise the remainder joins the last group
/// (Megatron's `microbatch_group_size_per_vp_stage` larger than the stage count for that group):
/// a group shorter than the stage count would make the ring of stages wait on itself.
pub fn virtual_order(stages: usize, chunks: usize, micro: usize, backward: bool) -> Vec<Unit> {
    let mut out = Vec::with_capacity(micro * chunks);
    let group = stages.max(1);
    let mut start = 0;
    while start < micro {
        // A remainder joins the last full group (a group shorter than the stage count makes the
        // ring wait on itself).
        let end = if micro - start < 2 * group {
            micro
        } else {
            start + group
        };
        for c in 0..chunks {
            let chunk = if backward { chunks - 1 - c } else { c };
            out.extend((start..end).map(|micro| Unit { chunk, micro }));
        }
        start = end;
    }
    out
}

/// Megatron's warm-up depth of the interleaved schedule on `stage`: `(stages - stage - 1) · 2 +
/// (chunks - 1) · group` forwards before the first backward, at most every unit, where `group` is
/// the schedule table's group size, `stages` (Megatron's `microbatch_group_size_per_vp_stage`).
/// When `micro` is not a multiple of `stages` the last group holds `stages + micro % stages`
/// micro-batches ([`virtual_order`]) and the warm-up grows to match it: the last stage must have
/// run a unit's forward through every chunk before the backward comes back to it.
pub fn interleaved_warmup(stage: usize, stages: usize, chunks: usize, micro: usize) -> usize {
    let group = if micro > stages {
        stages + micro % stages
    } else {
        stages
    };
    ((stages - stage - 1) * 2 + (chunks - 1) * group).min(micro * chunks)
}

/// Where unit `u`'s output goes from `stage`: the same chunk of the next stage, or from the last
/// stage the next chunk of the first; `None` after the last virtual stage (the head's input).
fn act_dest(stage: usize, stages: usize, chunks: usize, u: Unit) -> Option<(usize, Unit)> {
    if stage + 1 < stages {
        Some((stage + 1, u))
    } else if u.chunk + 1 < chunks {
        Some((
            0,
            Unit {
                chunk: u.chunk + 1,
                micro: u.micro,
            },
        ))
    } else {
        None
    }
}

/// Where unit `u`'s input gradient goes from `stage`: the mirror image of [`act_dest`]; `None`
/// before the first virtual stage (the embedding's output).
fn grad_dest(stage: usize, stages: usize, u: Unit) -> Option<(usize, Unit)> {
    if stage > 0 {
        Some((stage - 1, u))
    } else if u.chunk > 0 {
        Some((
            stages - 1,
            Unit {
                chunk: u.chunk - 1,
                micro: u.micro,
            },
        ))
    } else {
        None
    }
}

/// Lays the stages' compute orders (`orders[s]`: `(is_backward, unit)`) out in lock-step time
/// and adds the transfers: at each step every stage runs its next unit if that unit's input (or
/// output gradient) has arrived, then every stage that produced something for a neighbour posts
/// one [`Step::Comm`] together with that neighbour (which gets the data for a later step). Each
/// transfer has both ends in the same step and the same half, so with blocking sends (NCCL's, or
/// a rendezvous) no stage can wait on a neighbour that waits on something later: the schedule
/// cannot deadlock. Fails if the orders cannot run (a unit waits for data that never comes).
fn lay_out(stages: usize, chunks: usize, micro: usize, orders: &[Vec<(bool, Unit)>]) -> Plans {
    let n = micro * chunks;
    let idx = |u: Unit| u.chunk * micro + u.micro;
    let mut have_act = vec![vec![false; n]; stages];
    let mut have_grad = vec![vec![false; n]; stages];
    let mut done_fwd = vec![vec![false; n]; stages];
    let mut pc = vec![0usize; stages];
    let mut steps: Vec<Vec<Step>> = vec![Vec::new(); stages];
    while (0..stages).any(|s| pc[s] < orders[s].len()) {
        let mut produced: Vec<Option<(bool, Unit)>> = vec![None; stages];
        for s in 0..stages {
            let Some(&(bwd, u)) = orders[s].get(pc[s]) else {
                continue;
            };
            if bwd && !done_fwd[s][idx(u)] {
                return Err(format!(
                    "stage {s} of {stages} × {chunks} chunks × {micro} micro-batches would run the backward of {u:?} before its forward"
                ));
            }
            let ready = if bwd {
                (s + 1 == stages && u.chunk + 1 == chunks) || have_grad[s][idx(u)]
            } else {
                (s == 0 && u.chunk == 0) || have_act[s][idx(u)]
            };
            if ready {
                steps[s].push(if bwd {
                    Step::Backward(u)
                } else {
                    Step::Forward(u)
                });
                pc[s] += 1;
                done_fwd[s][idx(u)] |= !bwd;
                produced[s] = Some((bwd, u));
            }
        }
        if produced.iter().all(|p| p.is_none()) {
            return Err(format!(
                "the interleaved schedule of {stages} stages × {chunks} chunks × {micro} micro-batches is stuck at {pc:?}"
            ));
        }
        let mut comm = vec![(None, None, None, None); stages];
        for (s, p) in produced.iter().enumerate() {
            match *p {
                Some((false, u)) => {
                    if let Some((d, du)) = act_dest(s, stages, chunks, u) {
                        comm[s].0 = Some(u);
                        comm[d].1 = Some(du);
                        have_act[d][idx(du)] = true;
                    }
                }
                Some((true, u)) => {
                    if let Some((d, du)) = grad_dest(s, stages, u) {
                        comm[s].2 = Some(u);
                        comm[d].3 = Some(du);
                        have_grad[d][idx(du)] = true;
                    }
                }
                None => {}
            }
        }
        for (s, c) in comm.into_iter().enumerate() {
            if c != (None, None, None, None) {
                steps[s].push(Step::Comm {
                    send_act: c.0,
                    recv_act: c.1,
                    send_grad: c.2,
                    recv_grad: c.3,
                });
            }
        }
    }
    Ok(steps)
}

/// Megatron-core's interleaved 1F1B schedule (`forward_backward_pipelining_with_interleaving`)
/// of every stage, for `stages` stages of `chunks` model chunks each over `micro` micro-batches:
/// stage `s` runs [`interleaved_warmup`] forwards in [`virtual_order`], then alternates one
/// forward and one backward (backwards in the reversed-chunk order), then drains the remaining
/// backwards; the transfers are laid out by [`lay_out`]. Every stage computes the same plan.
pub fn interleaved(stages: usize, chunks: usize, micro: usize) -> Plans {
    interleaved_with_extra_warmup(stages, chunks, micro).map(|(plan, _)| plan)
}

/// [`interleaved`] and the extra warm-up forwards it needed. None has been seen to need any (the
/// tests check every layout up to 6 stages × 4 chunks × 24 micro-batches); should a layout need
/// them, every stage warms up by the fewest extra forwards that make the plan run (at most all of
/// them, which always runs) instead of failing.
pub fn interleaved_with_extra_warmup(
    stages: usize,
    chunks: usize,
    micro: usize,
) -> std::result::Result<(Vec<Vec<Step>>, usize), String> {
    let fwd = virtual_order(stages, chunks, micro, false);
    let bwd = virtual_order(stages, chunks, micro, true);
    let n = fwd.len();
    let mut first_error = None;
    for extra in 0..=n {
        let orders: Vec<Vec<(bool, Unit)>> = (0..stages)
            .map(|s| {
                let w = (interleaved_warmup(s, stages, chunks, micro) + extra).min(n);
                let mut o: Vec<(bool, Unit)> = fwd[..w].iter().map(|&u| (false, u)).collect();
                for k in 0..n - w {
                    o.push((false, fwd[w + k]));
                    o.push((true, bwd[k]));
                }
                o.extend(bwd[n - w..].iter().map(|&u| (true, u)));
                o
            })
            .collect();
        match lay_out(stages, chunks, micro, &orders) {
            Ok(plan) => return Ok((plan, extra)),
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
        if (0..stages).all(|s| interleaved_warmup(s, stages, chunks, micro) + extra >= n) {
            break;
        }
    }
    Err(first_error.unwrap_or_default())
}

/// The forward-only schedule of the interleaved pipeline (scoring): every unit in
/// [`virtual_order`], with the transfers laid out as for training.
pub fn interleaved_forward(stages: usize, chunks: usize, micro: usize) -> Plans {
    let fwd = virtual_order(stages, chunks, micro, false);
    let orders: Vec<Vec<(bool, Unit)>> = (0..stages)
        .map(|_| fwd.iter().map(|&u| (false, u)).collect())
        .collect();
    lay_out(stages, chunks, micro, &orders)
}

/// The model inputs of one micro-batch (what fixes its activation shape `[rows, T, H]`).
pub struct MicroInput<'a> {
    pub ids: &'a Tensor,
    pub mask: &'a Tensor,
    pub positions: &'a Tensor,
    /// What the MoE blocks do in this micro-batch's backward ([`MoeMicro::NONE`] for a dense
    /// model or a forward-only pass).
    pub moe: MoeMicro,
}

fn internal(message: String) -> MegatronError {
    MegatronError::Api(verl_plugin_api::Error::failed(message))
}

/// `[rows, T, H]` zeros in the model's dtype: a buffer for a neighbour's activation or gradient.
/// With sequence parallelism stages exchange their sequence shards, `[rows, T / tp, H]` (`T`
/// padded up to a multiple of TP): each tensor-parallel rank sends its own shard to its peer of
/// the next stage, so a point-to-point message is `1 / tp` of the full activation.
fn buffer(model: &TpModel, input: &MicroInput) -> Result<Tensor> {
    Tensor::f_zeros(
        model.activation_shape(input.ids),
        (model.dtype(), model.device()),
    )
    .ctx("pipeline receive buffer")
}

/// The last stage's loss on micro-batch `i`'s normed final hidden states: the scalar loss (with its
/// graph) and side values.
pub type LossFn<'a, T> = dyn FnMut(usize, &Tensor) -> Result<(Tensor, T)> + 'a;

/// Per micro-batch state of the executor on one stage.
#[derive(Default)]
struct Slot {
    /// The activation received from the previous stage.
    input: Option<Tensor>,
    acts: Option<StageActs>,
    /// The gradient of this stage's output, received from the next stage.
    grad_out: Option<Tensor>,
    /// The gradient of this stage's input, to send to the previous stage.
    grad_in: Option<Tensor>,
}

/// Runs the 1F1B schedule of this rank's stage over `micro` (one forward and one backward per
/// micro-batch); parameter gradients go to `sink`. On the last stage `loss_fn(i, hidden)` is
/// called in micro-batch order on the normed final hidden states of micro-batch `i` and its results
/// are returned; the other stages return `None` for every micro-batch.
pub fn train_1f1b<T>(
    model: &TpModel,
    pp: &Group,
    micro: &[MicroInput],
    sink: &mut dyn FnMut(usize, &Tensor) -> Result<()>,
    loss_fn: &mut LossFn<T>,
) -> Result<Vec<Option<(Tensor, T)>>> {
    let stage = model.stage();
    if pp.size != stage.count || pp.rank != stage.index {
        return Err(internal(format!(
            "pipeline group rank {} of {} does not match model stage {} of {}",
            pp.rank, pp.size, stage.index, stage.count
        )));
    }
    if stage.chunks > 1 {
        return train_interleaved(model, pp, micro, sink, loss_fn);
    }
    let mut slots: Vec<Slot> = (0..micro.len()).map(|_| Slot::default()).collect();
    let mut results: Vec<Option<(Tensor, T)>> = (0..micro.len()).map(|_| None).collect();
    let (prev, next) = (stage.index.wrapping_sub(1), stage.index + 1);
    let take = |t: &mut Option<Tensor>, what: &str, i: usize| {
        t.take()
            .ok_or_else(|| internal(format!("1F1B: no {what} for micro-batch {i}")))
    };
    for op in one_f_one_b(stage.index, stage.count, micro.len()) {
        match op {
            Op::RecvForward(i) => {
                let mut x = buffer(model, &micro[i])?;
                pp.recv(&mut x, prev, "recv (activation)")?;
                slots[i].input = Some(x);
            }
            Op::Forward(i) => {
                let m = &micro[i];
                let input = slots[i].input.take();
                let acts = model.stage_forward_train(m.ids, m.mask, m.positions, input.as_ref())?;
                slots[i].acts = Some(acts);
            }
            Op::SendForward(i) => {
                let out = output(&slots[i], i)?;
                pp.send(&out, next, "send (activation)")?;
            }
            Op::RecvBackward(i) => {
                let mut g = buffer(model, &micro[i])?;
                pp.recv(&mut g, next, "recv (output gradient)")?;
                slots[i].grad_out = Some(g);
            }
            Op::Backward(i) => {
                let acts = slots[i]
                    .acts
                    .take()
                    .ok_or_else(|| internal(format!("1F1B: micro-batch {i} has no forward")))?;
                let grad_out = if stage.is_last() {
                    let (g, loss, side) = model.head_backward(&acts, sink, |h| loss_fn(i, h))?;
                    results[i] = Some((loss, side));
                    g
                } else {
                    take(&mut slots[i].grad_out, "output gradient", i)?
                };
                slots[i].grad_in =
                    model.stage_backward(micro[i].ids, acts, &grad_out, micro[i].moe, sink)?;
            }
            Op::SendBackward(i) => {
                let g = take(&mut slots[i].grad_in, "input gradient", i)?;
                pp.send(&g, prev, "send (input gradient)")?;
            }
            Op::SendForwardRecvBackward { send, recv } => {
                let out = output(&slots[send], send)?;
                let mut g = buffer(model, &micro[recv])?;
                pp.exchange(&out, &mut g, next, "send_recv (activation / gradient)")?;
                slots[recv].grad_out = Some(g);
            }
            Op::SendBackwardRecvForward { send, recv } => {
                let g = take(&mut slots[send].grad_in, "input gradient", send)?;
                let mut x = buffer(model, &micro[recv])?;
                pp.exchange(&g, &mut x, prev, "send_recv (gradient / activation)")?;
                slots[recv].input = Some(x);
            }
        }
    }
    Ok(results)
}

fn output(slot: &Slot, i: usize) -> Result<Tensor> {
    slot.acts
        .as_ref()
        .ok_or_else(|| internal(format!("1F1B: micro-batch {i} has no forward to send")))?
        .out
        .f_contiguous()
        .ctx("stage output")
}

/// The forward of every micro-batch through the pipeline, without autograd: each stage receives a
/// micro-batch's activation, runs its layers and passes the result on while the next stage works
/// on the previous micro-batch. On the last stage `head(i, hidden)` gets the normed final hidden
/// states of micro-batch `i`; the other stages never call it.
pub fn forward_only(
    model: &TpModel,
    pp: &Group,
    micro: &[MicroInput],
    head: &mut dyn FnMut(usize, &Tensor) -> Result<()>,
) -> Result<()> {
    let _guard = tch::no_grad_guard();
    let stage = model.stage();
    if stage.chunks > 1 {
        return forward_interleaved(model, pp, micro, head);
    }
    for (i, m) in micro.iter().enumerate() {
        let input = if stage.is_first() {
            None
        } else {
            let mut x = buffer(model, m)?;
            pp.recv(&mut x, stage.index - 1, "recv (activation)")?;
            Some(x)
        };
        let acts = model.stage_forward(m.ids, m.mask, m.positions, input.as_ref())?;
        if stage.is_last() {
            head(i, &model.final_hidden(&acts)?)?;
        } else {
            let out = acts.out.f_contiguous().ctx("stage output")?;
            pp.send(&out, stage.index + 1, "send (activation)")?;
        }
    }
    Ok(())
}

/// The plan of this rank's stage, or the error that says why there is none.
fn plan(stage: Stage, micro: usize, make: fn(usize, usize, usize) -> Plans) -> Result<Vec<Step>> {
    make(stage.count, stage.chunks, micro)
        .map(|mut all| all.swap_remove(stage.index))
        .map_err(|e| internal(format!("internal: {e}")))
}

/// Runs one [`Step::Comm`] half: `out` to `next` and/or `into` from `prev` at once.
fn ring_transfer(
    pp: &Group,
    out: Option<Tensor>,
    into: Option<&mut Tensor>,
    (next, prev): (usize, usize),
    what: &'static str,
) -> Result<()> {
    match (out, into) {
        (Some(o), Some(i)) => pp.send_recv(&o, next, i, prev, what),
        (Some(o), None) => pp.send(&o, next, what),
        (None, Some(i)) => pp.recv(i, prev, what),
        (None, None) => Ok(()),
    }
}

/// [`train_1f1b`] for a stage of several model chunks: Megatron's interleaved schedule
/// ([`interleaved`]). Parameter gradients go to `sink`; `loss_fn(i, hidden)` runs on the last
/// stage, in micro-batch order, as the backward of the last chunk reaches micro-batch `i`.
fn train_interleaved<T>(
    model: &TpModel,
    pp: &Group,
    micro: &[MicroInput],
    sink: &mut dyn FnMut(usize, &Tensor) -> Result<()>,
    loss_fn: &mut LossFn<T>,
) -> Result<Vec<Option<(Tensor, T)>>> {
    let stage = model.stage();
    let (m, chunks) = (micro.len(), stage.chunks);
    let steps = plan(stage, m, interleaved)?;
    let mut slots: Vec<Slot> = (0..m * chunks).map(|_| Slot::default()).collect();
    let mut results: Vec<Option<(Tensor, T)>> = (0..m).map(|_| None).collect();
    let at = |u: Unit| u.chunk * m + u.micro;
    let ring = (
        (stage.index + 1) % stage.count,
        (stage.index + stage.count - 1) % stage.count,
    );
    let (ring_fwd, ring_bwd) = (ring, (ring.1, ring.0));
    let take = |t: &mut Option<Tensor>, what: &str, u: Unit| {
        t.take()
            .ok_or_else(|| internal(format!("interleaved 1F1B: no {what} for {u:?}")))
    };
    for step in steps {
        match step {
            Step::Forward(u) => {
                let mi = &micro[u.micro];
                let input = slots[at(u)].input.take();
                let acts = model.chunk_forward_train(
                    u.chunk,
                    mi.ids,
                    mi.mask,
                    mi.positions,
                    input.as_ref(),
                )?;
                slots[at(u)].acts = Some(acts);
            }
            Step::Backward(u) => {
                let acts = slots[at(u)]
                    .acts
                    .take()
                    .ok_or_else(|| internal(format!("interleaved 1F1B: {u:?} has no forward")))?;
                let grad_out = if stage.is_last() && u.chunk + 1 == chunks {
                    let (g, loss, side) =
                        model.head_backward(&acts, sink, |h| loss_fn(u.micro, h))?;
                    results[u.micro] = Some((loss, side));
                    g
                } else {
                    take(&mut slots[at(u)].grad_out, "output gradient", u)?
                };
                let mi = &micro[u.micro];
                slots[at(u)].grad_in =
                    model.stage_backward(mi.ids, acts, &grad_out, mi.moe, sink)?;
            }
            Step::Comm {
                send_act,
                recv_act,
                send_grad,
                recv_grad,
            } => {
                let out = send_act
                    .map(|u| output(&slots[at(u)], u.micro))
                    .transpose()?;
                let mut x = recv_act
                    .map(|u| buffer(model, &micro[u.micro]))
                    .transpose()?;
                ring_transfer(pp, out, x.as_mut(), ring_fwd, "send_recv (activations)")?;
                if let (Some(u), Some(x)) = (recv_act, x) {
                    slots[at(u)].input = Some(x);
                }
                let g = send_grad
                    .map(|u| take(&mut slots[at(u)].grad_in, "input gradient", u))
                    .transpose()?;
                let mut gin = recv_grad
                    .map(|u| buffer(model, &micro[u.micro]))
                    .transpose()?;
                ring_transfer(pp, g, gin.as_mut(), ring_bwd, "send_recv (gradients)")?;
                if let (Some(u), Some(g)) = (recv_grad, gin) {
                    slots[at(u)].grad_out = Some(g);
                }
            }
        }
    }
    Ok(results)
}

/// [`forward_only`] for a stage of several model chunks ([`interleaved_forward`]): every
/// micro-batch through every chunk, the last chunk of the last stage calling `head`.
fn forward_interleaved(
    model: &TpModel,
    pp: &Group,
    micro: &[MicroInput],
    head: &mut dyn FnMut(usize, &Tensor) -> Result<()>,
) -> Result<()> {
    let stage = model.stage();
    let (m, chunks) = (micro.len(), stage.chunks);
    let steps = plan(stage, m, interleaved_forward)?;
    let at = |u: Unit| u.chunk * m + u.micro;
    let mut inputs: Vec<Option<Tensor>> = (0..m * chunks).map(|_| None).collect();
    let mut outputs: Vec<Option<Tensor>> = (0..m * chunks).map(|_| None).collect();
    let ring = (
        (stage.index + 1) % stage.count,
        (stage.index + stage.count - 1) % stage.count,
    );
    for step in steps {
        match step {
            Step::Forward(u) => {
                let mi = &micro[u.micro];
                let input = inputs[at(u)].take();
                let acts =
                    model.chunk_forward(u.chunk, mi.ids, mi.mask, mi.positions, input.as_ref())?;
                if stage.is_last() && u.chunk + 1 == chunks {
                    head(u.micro, &model.final_hidden(&acts)?)?;
                } else {
                    outputs[at(u)] = Some(acts.out.f_contiguous().ctx("stage output")?);
                }
            }
            Step::Comm {
                send_act, recv_act, ..
            } => {
                let out = send_act
                    .map(|u| {
                        outputs[at(u)].take().ok_or_else(|| {
                            internal(format!("interleaved forward: {u:?} has no output"))
                        })
                    })
                    .transpose()?;
                let mut x = recv_act
                    .map(|u| buffer(model, &micro[u.micro]))
                    .transpose()?;
                ring_transfer(pp, out, x.as_mut(), ring, "send_recv (activations)")?;
                if let (Some(u), Some(x)) = (recv_act, x) {
                    inputs[at(u)] = Some(x);
                }
            }
            Step::Backward(u) => {
                return Err(internal(format!(
                    "internal: a backward of {u:?} in a forward-only schedule"
                )))
            }
        }
    }
    Ok(())
}

/// Whole tensors of every stage, by HF name, on every member of the pipeline group: each stage
/// contributes `mine` (its own parameters' whole tensors, in `kind`) and receives the others'. A
/// name held by several stages (a tied embedding's copy on the last stage) is taken from the
/// first that holds it.
pub fn gather_stages(
    cfg: &ModelConfig,
    head: HeadKind,
    pp: &Group,
    chunks: usize,
    mine: HashMap<String, Tensor>,
    kind: Kind,
    shards: usize,
) -> Result<HashMap<String, Tensor>> {
    if pp.size == 1 {
        return Ok(mine);
    }
    let device = mine
        .values()
        .next()
        .map(|t| t.device())
        .unwrap_or(tch::Device::Cpu);
    let mut out = HashMap::new();
    for s in 0..pp.size {
        let specs: Vec<(String, Vec<i64>)> = stage_specs(
            cfg,
            head,
            Stage {
                index: s,
                count: pp.size,
                chunks,
            },
        )?
        .into_iter()
        .filter(|(n, _, _)| !out.contains_key(n))
        .map(|(n, mut shape, split)| {
            // A tensor-parallel shard's size (every split tensor divided `shards` ways).
            if let (Some(d), true) = (split.dim(), shards > 1) {
                shape[d as usize] /= shards as i64;
            }
            (n, shape)
        })
        .collect();
        let numel: i64 = specs.iter().map(|(_, sh)| sh.iter().product::<i64>()).sum();
        let mut flat = if s == pp.rank {
            let parts = specs
                .iter()
                .map(|(n, _)| {
                    mine.get(n)
                        .ok_or_else(|| {
                            internal(format!("pipeline stage {s} lacks its parameter `{n}`"))
                        })?
                        .f_to_kind(kind)
                        .and_then(|t| t.f_reshape([-1]))
                        .ctx("flatten stage weights")
                })
                .collect::<Result<Vec<_>>>()?;
            Tensor::f_cat(&parts, 0).ctx("flatten stage weights")?
        } else {
            Tensor::f_zeros([numel], (kind, device)).ctx("stage weights buffer")?
        };
        pp.broadcast(&mut flat, s, "broadcast (stage weights)")?;
        out.extend(unflatten(&flat, specs)?);
    }
    Ok(out)
}

/// `flat` cut into the named tensors of `specs` (shapes), in order: views, no copy.
pub fn unflatten(flat: &Tensor, specs: Vec<(String, Vec<i64>)>) -> Result<Vec<(String, Tensor)>> {
    let mut off = 0;
    specs
        .into_iter()
        .map(|(n, shape)| {
            let len: i64 = shape.iter().product();
            let t = flat
                .f_narrow(0, off, len)
                .and_then(|t| t.f_view(shape.as_slice()))
                .ctx("split stage weights")?;
            off += len;
            Ok((n, t))
        })
        .collect()
}

/// Copies the last stage's per-row outputs (`[rows, R]` fp32 tensors) to every stage.
pub fn broadcast_from_last(pp: &Group, outputs: &mut [Tensor]) -> Result<()> {
    for t in outputs {
        pp.broadcast(t, pp.size - 1, "broadcast (last stage outputs)")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
