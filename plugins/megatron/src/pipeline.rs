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
//! inputs are what a stage keeps: the layers are recomputed in the backward). Where a stage sends
//! to a neighbour and then waits for that neighbour, the two transfers are one exchange
//! ([`Op::SendForwardRecvBackward`], [`Op::SendBackwardRecvForward`]), which is what keeps a
//! blocking send (NCCL's) from deadlocking. With one stage the schedule is F0 B0 F1 B1 …: the
//! same code path trains PP = 1.

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
                let acts = model.stage_forward(m.ids, m.mask, m.positions, input.as_ref())?;
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

/// Whole tensors of every stage, by HF name, on every member of the pipeline group: each stage
/// contributes `mine` (its own parameters' whole tensors, in `kind`) and receives the others'. A
/// name held by several stages (a tied embedding's copy on the last stage) is taken from the
/// first that holds it.
pub fn gather_stages(
    cfg: &ModelConfig,
    head: HeadKind,
    pp: &Group,
    mine: HashMap<String, Tensor>,
    kind: Kind,
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
            },
        )?
        .into_iter()
        .filter(|(n, _, _)| !out.contains_key(n))
        .map(|(n, shape, _)| (n, shape))
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
        let mut off = 0;
        for (n, shape) in specs {
            let len: i64 = shape.iter().product();
            let t = flat
                .f_narrow(0, off, len)
                .and_then(|t| t.f_view(shape.as_slice()))
                .ctx("split stage weights")?;
            off += len;
            out.insert(n, t);
        }
    }
    Ok(out)
}

/// Copies the last stage's per-row outputs (`[rows, R]` fp32 tensors) to every stage.
pub fn broadcast_from_last(pp: &Group, outputs: &mut [Tensor]) -> Result<()> {
    for t in outputs {
        pp.broadcast(t, pp.size - 1, "broadcast (last stage outputs)")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use Op::*;

    #[test]
    fn one_stage_alternates_forward_and_backward() {
        assert_eq!(
            one_f_one_b(0, 1, 3),
            vec![
                Forward(0),
                Backward(0),
                Forward(1),
                Backward(1),
                Forward(2),
                Backward(2)
            ]
        );
    }

    #[test]
    fn two_stages_three_micro_batches() {
        assert_eq!(
            one_f_one_b(0, 2, 3),
            vec![
                Forward(0),
                SendForward(0),
                Forward(1),
                SendForwardRecvBackward { send: 1, recv: 0 },
                Backward(0),
                Forward(2),
                SendForwardRecvBackward { send: 2, recv: 1 },
                Backward(1),
                RecvBackward(2),
                Backward(2),
            ]
        );
        assert_eq!(
            one_f_one_b(1, 2, 3),
            vec![
                RecvForward(0),
                Forward(0),
                Backward(0),
                SendBackwardRecvForward { send: 0, recv: 1 },
                Forward(1),
                Backward(1),
                SendBackwardRecvForward { send: 1, recv: 2 },
                Forward(2),
                Backward(2),
                SendBackward(2),
            ]
        );
    }

    #[test]
    fn fewer_micro_batches_than_stages_is_all_warm_up_and_cool_down() {
        // Stage 0 of 4 with 2 micro-batches: both forwards are warm-up, both backwards cool-down.
        assert_eq!(
            one_f_one_b(0, 4, 2),
            vec![
                Forward(0),
                SendForward(0),
                Forward(1),
                SendForward(1),
                RecvBackward(0),
                Backward(0),
                RecvBackward(1),
                Backward(1),
            ]
        );
        // Stage 2 of 4: one warm-up forward, one steady pair, one cool-down backward.
        assert_eq!(
            one_f_one_b(2, 4, 2),
            vec![
                RecvForward(0),
                Forward(0),
                SendForward(0),
                RecvForward(1),
                Forward(1),
                SendForwardRecvBackward { send: 1, recv: 0 },
                Backward(0),
                SendBackward(0),
                RecvBackward(1),
                Backward(1),
                SendBackward(1),
            ]
        );
    }

    /// What one stage posts to a neighbour: (to stage, micro-batch, is gradient).
    type Msg = (usize, usize, bool);

    /// Executes every stage's schedule with blocking point-to-point semantics (a send completes
    /// only when its peer receives, an exchange only when the peer exchanges or posts the matching
    /// halves), checking the data dependencies and the memory bound of 1F1B, and fails on a
    /// deadlock.
    fn simulate(stages: usize, micro: usize) {
        let scheds: Vec<Vec<Op>> = (0..stages).map(|s| one_f_one_b(s, stages, micro)).collect();
        for (s, ops) in scheds.iter().enumerate() {
            let count = |f: &dyn Fn(&Op) -> bool| ops.iter().filter(|o| f(o)).count();
            assert_eq!(count(&|o| matches!(o, Forward(_))), micro, "stage {s}");
            assert_eq!(count(&|o| matches!(o, Backward(_))), micro, "stage {s}");
        }
        let mut pc = vec![0usize; stages];
        // Per stage: micro-batches whose activation / output gradient arrived, forwards done,
        // backwards done.
        let mut have_act = vec![vec![false; micro]; stages];
        let mut have_grad = vec![vec![false; micro]; stages];
        let mut fwd = vec![vec![false; micro]; stages];
        let mut bwd = vec![vec![false; micro]; stages];
        // What stage s sends at its current op (to, micro, is_grad) and what it receives.
        let sends = |op: &Op, s: usize| -> Vec<Msg> {
            match *op {
                SendForward(i) => vec![(s + 1, i, false)],
                SendBackward(i) => vec![(s - 1, i, true)],
                SendForwardRecvBackward { send, .. } => vec![(s + 1, send, false)],
                SendBackwardRecvForward { send, .. } => vec![(s - 1, send, true)],
                _ => vec![],
            }
        };
        let recvs = |op: &Op, s: usize| -> Vec<Msg> {
            match *op {
                RecvForward(i) => vec![(s - 1, i, false)],
                RecvBackward(i) => vec![(s + 1, i, true)],
                SendForwardRecvBackward { recv, .. } => vec![(s + 1, recv, true)],
                SendBackwardRecvForward { recv, .. } => vec![(s - 1, recv, false)],
                _ => vec![],
            }
        };
        loop {
            if (0..stages).all(|s| pc[s] == scheds[s].len()) {
                break;
            }
            let mut progressed = false;
            for s in 0..stages {
                let Some(op) = scheds[s].get(pc[s]).copied() else {
                    continue;
                };
                match op {
                    Forward(i) => {
                        assert!(s == 0 || have_act[s][i], "stage {s} F{i} before its input");
                        fwd[s][i] = true;
                        let in_flight = (0..micro).filter(|&j| fwd[s][j] && !bwd[s][j]).count();
                        assert!(
                            in_flight <= stages - s,
                            "stage {s}: {in_flight} micro-batches in flight"
                        );
                    }
                    Backward(i) => {
                        assert!(fwd[s][i], "stage {s} B{i} before F{i}");
                        assert!(
                            s + 1 == stages || have_grad[s][i],
                            "stage {s} B{i} before its output gradient"
                        );
                        bwd[s][i] = true;
                    }
                    _ => {
                        // A communication op completes when the peer's current op posts the
                        // mirror image of each of its halves.
                        let mine_s = sends(&op, s);
                        let mine_r = recvs(&op, s);
                        let peer = mine_s.first().or(mine_r.first()).map(|m| m.0).unwrap();
                        let Some(pop) = scheds[peer].get(pc[peer]).copied() else {
                            continue;
                        };
                        let theirs_s = sends(&pop, peer);
                        let theirs_r = recvs(&pop, peer);
                        let matched = mine_s
                            .iter()
                            .all(|&(_, i, g)| theirs_r.contains(&(s, i, g)))
                            && mine_r
                                .iter()
                                .all(|&(_, i, g)| theirs_s.contains(&(s, i, g)))
                            && theirs_s
                                .iter()
                                .all(|&(_, i, g)| mine_r.contains(&(peer, i, g)))
                            && theirs_r
                                .iter()
                                .all(|&(_, i, g)| mine_s.contains(&(peer, i, g)));
                        if !matched {
                            continue;
                        }
                        for &(_, i, g) in &mine_s {
                            if g {
                                assert!(bwd[s][i]);
                                have_grad[peer][i] = true;
                            } else {
                                assert!(fwd[s][i]);
                                have_act[peer][i] = true;
                            }
                        }
                        for &(_, i, g) in &theirs_s {
                            if g {
                                have_grad[s][i] = true;
                            } else {
                                have_act[s][i] = true;
                            }
                        }
                        pc[peer] += 1;
                    }
                }
                pc[s] += 1;
                progressed = true;
            }
            assert!(
                progressed,
                "deadlock with {stages} stages × {micro} micro-batches at {pc:?}"
            );
        }
        for (s, done) in bwd.iter().enumerate() {
            assert!(done.iter().all(|&b| b), "stage {s} missed a backward");
        }
    }

    #[test]
    fn every_layout_runs_to_completion_without_deadlock() {
        for stages in 1..=5 {
            for micro in 1..=9 {
                simulate(stages, micro);
            }
        }
    }

    #[test]
    fn warm_up_depth_shrinks_towards_the_last_stage() {
        for s in 0..4 {
            let ops = one_f_one_b(s, 4, 8);
            let warm = ops
                .iter()
                .take_while(|o| !matches!(o, Backward(_)))
                .filter(|o| matches!(o, Forward(_)))
                .count();
            // The warm-up forwards plus the first steady forward.
            assert_eq!(warm, 4 - s, "stage {s}");
        }
    }
}
