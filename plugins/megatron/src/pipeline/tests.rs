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

/// One half of a [`Step::Comm`] as a rank posts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Half {
    ActSend(Unit),
    ActRecv(Unit),
    GradSend(Unit),
    GradRecv(Unit),
}

enum Item {
    Compute(Step),
    /// The halves of one transfer call, with which are complete.
    Transfer(Vec<(Half, bool)>),
}

fn items(steps: &[Step]) -> Vec<Item> {
    let mut out = Vec::new();
    for &st in steps {
        match st {
            Step::Comm {
                send_act,
                recv_act,
                send_grad,
                recv_grad,
            } => {
                let a: Vec<(Half, bool)> = send_act
                    .map(Half::ActSend)
                    .into_iter()
                    .chain(recv_act.map(Half::ActRecv))
                    .map(|h| (h, false))
                    .collect();
                let g: Vec<(Half, bool)> = send_grad
                    .map(Half::GradSend)
                    .into_iter()
                    .chain(recv_grad.map(Half::GradRecv))
                    .map(|h| (h, false))
                    .collect();
                assert!(!a.is_empty() || !g.is_empty(), "an empty transfer");
                for t in [a, g] {
                    if !t.is_empty() {
                        out.push(Item::Transfer(t));
                    }
                }
            }
            st => out.push(Item::Compute(st)),
        }
    }
    out
}

/// Runs every stage's interleaved schedule with rendezvous semantics (a send completes only
/// when the peer's current call posts the matching receive; the two halves of one call are
/// posted together), with first-in-first-out channels between neighbours: a receive posted
/// for another unit than the one in flight on its channel fails the test, and so does a
/// deadlock. Checks the data dependencies, that every unit of every chunk gets exactly one
/// forward and one backward (after it), and the in-flight bound `warm-up + 1`.
fn simulate_interleaved(stages: usize, chunks: usize, micro: usize, train: bool) {
    let plans = if train {
        interleaved(stages, chunks, micro).unwrap()
    } else {
        interleaved_forward(stages, chunks, micro).unwrap()
    };
    let what = format!("{stages} stages × {chunks} chunks × {micro} micro-batches");
    let n = micro * chunks;
    let at = |u: Unit| u.chunk * micro + u.micro;
    let mut items: Vec<Vec<Item>> = plans.iter().map(|p| items(p)).collect();
    let mut pc = vec![0usize; stages];
    let mut have_act = vec![vec![false; n]; stages];
    let mut have_grad = vec![vec![false; n]; stages];
    let mut fwd = vec![vec![0usize; n]; stages];
    let mut bwd = vec![vec![0usize; n]; stages];
    let mut max_in_flight = vec![0usize; stages];
    let next = |s: usize| (s + 1) % stages;
    let prev = |s: usize| (s + stages - 1) % stages;
    loop {
        if (0..stages).all(|s| pc[s] == items[s].len()) {
            break;
        }
        let mut progressed = false;
        // Match posted sends with the peers' posted receives.
        for s in 0..stages {
            let Some(Item::Transfer(halves)) = items[s].get(pc[s]) else {
                continue;
            };
            let sends: Vec<(usize, Half)> = halves
                .iter()
                .enumerate()
                .filter(|(_, (h, done))| !done && matches!(h, Half::ActSend(_) | Half::GradSend(_)))
                .map(|(j, (h, _))| (j, *h))
                .collect();
            for (j, h) in sends {
                let (peer, want) = match h {
                    Half::ActSend(u) => {
                        assert!(fwd[s][at(u)] == 1, "{what}: stage {s} sends {u:?} unrun");
                        let (d, du) = act_dest(s, stages, chunks, u).expect("a destination");
                        assert_eq!(d, next(s));
                        (d, Half::ActRecv(du))
                    }
                    Half::GradSend(u) => {
                        assert!(bwd[s][at(u)] == 1, "{what}: stage {s} sends {u:?} unrun");
                        let (d, du) = grad_dest(s, stages, u).expect("a destination");
                        assert_eq!(d, prev(s));
                        (d, Half::GradRecv(du))
                    }
                    _ => unreachable!(),
                };
                let Some(Item::Transfer(theirs)) = items[peer].get_mut(pc[peer]) else {
                    continue;
                };
                // The first pending receive of the peer on this channel must be this one.
                let pending = theirs.iter_mut().find(|(hh, done)| {
                    !done
                        && match hh {
                            Half::ActRecv(_) => prev(peer) == s,
                            Half::GradRecv(_) => next(peer) == s,
                            _ => false,
                        }
                });
                let Some((got, done)) = pending else {
                    continue;
                };
                // With two stages activations and gradients share the channel: a pending
                // receive of the other kind would take this message.
                assert_eq!(*got, want, "{what}: stage {peer} receives out of order");
                *done = true;
                match want {
                    Half::ActRecv(du) => have_act[peer][at(du)] = true,
                    Half::GradRecv(du) => have_grad[peer][at(du)] = true,
                    _ => unreachable!(),
                }
                if let Some(Item::Transfer(mine)) = items[s].get_mut(pc[s]) {
                    mine[j].1 = true;
                }
                progressed = true;
            }
        }
        for s in 0..stages {
            let w = interleaved_warmup(s, stages, chunks, micro);
            match items[s].get(pc[s]) {
                None => continue,
                Some(Item::Transfer(halves)) => {
                    if halves.iter().all(|(_, d)| *d) {
                        pc[s] += 1;
                        progressed = true;
                    }
                }
                Some(Item::Compute(Step::Forward(u))) => {
                    let u = *u;
                    assert!(
                        (s == 0 && u.chunk == 0) || have_act[s][at(u)],
                        "{what}: stage {s} runs {u:?} before its input"
                    );
                    fwd[s][at(u)] += 1;
                    let in_flight = (0..n).filter(|&k| fwd[s][k] > bwd[s][k]).count();
                    max_in_flight[s] = max_in_flight[s].max(in_flight);
                    if train {
                        assert!(
                            in_flight <= w + 1,
                            "{what}: stage {s} holds {in_flight} units (warm-up {w})"
                        );
                    }
                    pc[s] += 1;
                    progressed = true;
                }
                Some(Item::Compute(Step::Backward(u))) => {
                    let u = *u;
                    assert!(fwd[s][at(u)] == 1, "{what}: stage {s} B{u:?} before F");
                    assert!(
                        (s + 1 == stages && u.chunk + 1 == chunks) || have_grad[s][at(u)],
                        "{what}: stage {s} B{u:?} before its output gradient"
                    );
                    bwd[s][at(u)] += 1;
                    pc[s] += 1;
                    progressed = true;
                }
                Some(Item::Compute(Step::Comm { .. })) => unreachable!(),
            }
        }
        assert!(progressed, "{what}: deadlock at {pc:?}");
    }
    for s in 0..stages {
        assert!(fwd[s].iter().all(|&c| c == 1), "{what}: stage {s} forwards");
        let want = if train { 1 } else { 0 };
        assert!(
            bwd[s].iter().all(|&c| c == want),
            "{what}: stage {s} backwards"
        );
        if train {
            // Warm-up + the first steady forward (when the warm-up is not everything).
            let w = interleaved_warmup(s, stages, chunks, micro);
            assert_eq!(max_in_flight[s], (w + 1).min(n), "{what}: stage {s}");
        }
    }
}

#[test]
fn interleaved_schedules_run_to_completion_without_deadlock() {
    for stages in 2..=4 {
        for chunks in 2..=3 {
            for micro in 1..=(3 * stages + 1) {
                simulate_interleaved(stages, chunks, micro, true);
                simulate_interleaved(stages, chunks, micro, false);
            }
        }
    }
}

#[test]
fn any_micro_batch_count_runs_with_megatron_s_warm_up() {
    for stages in 2..=6 {
        for chunks in 2..=4 {
            for micro in 1..=4 * stages {
                let (_, extra) = interleaved_with_extra_warmup(stages, chunks, micro).unwrap();
                assert_eq!(extra, 0, "{stages} × {chunks} × {micro}");
            }
        }
    }
}

#[test]
fn virtual_order_follows_megatron() {
    // 2 stages × 2 chunks × 4 micro-batches: k → chunk (k / 2) % 2, micro (k / 4) · 2 + k % 2.
    let f = virtual_order(2, 2, 4, false);
    let want: Vec<(usize, usize)> = (0..8).map(|k| ((k / 2) % 2, (k / 4) * 2 + k % 2)).collect();
    assert_eq!(
        f.iter().map(|u| (u.chunk, u.micro)).collect::<Vec<_>>(),
        want
    );
    let b = virtual_order(2, 2, 4, true);
    assert_eq!(
        b.iter().map(|u| (u.chunk, u.micro)).collect::<Vec<_>>(),
        want.iter().map(|&(c, i)| (1 - c, i)).collect::<Vec<_>>()
    );
    // A remainder joins the last group: 5 micro-batches over 2 stages are groups of 2 and 3.
    let f = virtual_order(2, 2, 5, false);
    assert_eq!(
        f.iter().map(|u| (u.chunk, u.micro)).collect::<Vec<_>>(),
        vec![
            (0, 0),
            (0, 1),
            (1, 0),
            (1, 1),
            (0, 2),
            (0, 3),
            (0, 4),
            (1, 2),
            (1, 3),
            (1, 4)
        ]
    );
}

#[test]
fn interleaved_compute_order_is_warm_up_then_one_forward_one_backward() {
    let (stages, chunks, micro) = (4, 2, 8);
    let plans = interleaved(stages, chunks, micro).unwrap();
    let fwd = virtual_order(stages, chunks, micro, false);
    let bwd = virtual_order(stages, chunks, micro, true);
    for (s, steps) in plans.iter().enumerate() {
        let compute: Vec<Step> = steps
            .iter()
            .copied()
            .filter(|st| !matches!(st, Step::Comm { .. }))
            .collect();
        let w = interleaved_warmup(s, stages, chunks, micro);
        assert_eq!(w, (stages - s - 1) * 2 + (chunks - 1) * stages);
        let mut want: Vec<Step> = fwd[..w].iter().map(|&u| Step::Forward(u)).collect();
        for k in 0..fwd.len() - w {
            want.push(Step::Forward(fwd[w + k]));
            want.push(Step::Backward(bwd[k]));
        }
        want.extend(bwd[fwd.len() - w..].iter().map(|&u| Step::Backward(u)));
        assert_eq!(compute, want, "stage {s}");
    }
}
