//! Expert parallelism with ranks as threads (CPU communicator over a loopback store) against
//! verl-nn's one-rank MoE block as the reference, fp32: outputs, input gradients and parameter
//! gradients within 1e-5 for EP = 2 and 4 (and EP = 2 × ETP = 2, with ETP peers sharing their
//! tokens or, as under sequence parallelism, each routing its own), uneven routing with experts and
//! whole ranks that receive no tokens, the Switch load-balancing loss and its gradient, the load
//! statistics and the step metrics.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use serde_json::{json, Value};
use tch::{Device, Kind, Tensor};
use verl_comm::{Communicator, CpuCommunicator, CpuOptions, StoreClient, StoreServer};
use verl_megatron::moe::{
    EpMoe, ExpertGroup, LoadStats, MoeLoadMetrics, MoeSpec, Placement, Tokens,
};
use verl_megatron::MegatronError;
use verl_nn::{ModelConfig, ModelOptions, Transformer};

const TOL: f64 = 1e-5;
const H: i64 = 16;
const B: i64 = 2;
const T: i64 = 5;
const TIMEOUT: Duration = Duration::from_secs(30);

/// Plain data that crosses threads: shape and values.
#[derive(Clone, Debug)]
struct Plain(Vec<i64>, Vec<f32>);

impl Plain {
    fn of(t: &Tensor) -> Plain {
        let t = t.detach().to_kind(Kind::Float).contiguous();
        Plain(t.size(), Vec::<f32>::try_from(&t.reshape([-1])).unwrap())
    }
    fn tensor(&self) -> Tensor {
        Tensor::from_slice(&self.1).reshape(self.0.as_slice())
    }
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size(), "shapes differ");
    if a.numel() == 0 {
        return 0.0;
    }
    (a - b).abs().max().double_value(&[])
}

fn assert_close(what: &str, a: &Tensor, b: &Tensor) {
    let d = max_diff(a, b);
    assert!(d <= TOL, "{what}: max |diff| = {d:e} > {TOL:e}");
}

fn mixtral(experts: i64, top_k: i64) -> Value {
    json!({
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
        "vocab_size": 32, "hidden_size": H, "intermediate_size": 24,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_local_experts": experts, "num_experts_per_tok": top_k,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 32, "initializer_range": 0.3,
    })
}

fn qwen2_moe() -> Value {
    json!({
        "model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"],
        "vocab_size": 32, "hidden_size": H, "intermediate_size": 24,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
        "shared_expert_intermediate_size": 12, "norm_topk_prob": false,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 32, "initializer_range": 0.3,
    })
}

/// A seeded random one-layer model; `tweak` may rewrite its parameters (no grad).
fn model(cfg: Value, tweak: impl Fn(&str, &mut Tensor)) -> Transformer {
    let cfg = ModelConfig::from_value(cfg, "inline/config.json").unwrap();
    tch::manual_seed(11);
    let m = Transformer::new(cfg, &ModelOptions::default()).unwrap();
    tch::no_grad(|| {
        for (n, t) in m.named_parameters() {
            let mut t = t.shallow_clone();
            tweak(n, &mut t);
        }
    });
    m
}

/// Every parameter of the model's first MoE block, as plain data.
fn block_params(m: &Transformer) -> HashMap<String, Plain> {
    m.named_parameters()
        .iter()
        .filter(|(n, _)| n.contains("block_sparse_moe") || n.contains(".mlp."))
        .map(|(n, t)| (n.clone(), Plain::of(t)))
        .collect()
}

/// Megatron-core's Switch load-balancing loss on `x` (`[N, H]`), written directly.
fn switch_aux(x: &Tensor, router: &Tensor, k: i64, coeff: f64) -> Tensor {
    let probs = x.linear(router, None::<&Tensor>).softmax(1, Kind::Float);
    let e = probs.size()[1];
    let (_, sel) = probs.topk(k, -1, true, true);
    let counts = sel.one_hot(e).to_kind(Kind::Float).sum_dim_intlist(
        [0i64, 1].as_slice(),
        false,
        None::<Kind>,
    );
    let n = x.size()[0] as f64;
    (probs.sum_dim_intlist([0i64].as_slice(), false, None::<Kind>) * counts).sum(Kind::Float)
        * (coeff * e as f64 / (k as f64 * n * n))
}

/// The one-rank reference: outputs and input gradients per token set, parameter gradients by
/// name, for the loss `Σ y·g + aux_scale · Σ_r aux(x_r)`.
struct Reference {
    y: Vec<Tensor>,
    gx: Vec<Tensor>,
    grads: HashMap<String, Tensor>,
}

fn reference(
    m: &Transformer,
    xs: &[Tensor],
    gs: &[Tensor],
    aux: Option<(f64, f64)>,
    group: usize,
) -> Reference {
    let x = Tensor::cat(xs, 0).detach().set_requires_grad(true);
    let g = Tensor::cat(gs, 0);
    let y = m.feed_forward(0, &x).unwrap();
    let mut loss = (&y * &g).sum(Kind::Float);
    if let Some((coeff, scale)) = aux {
        let k = m.config().moe.as_ref().unwrap().top_k;
        let router = m
            .named_parameters()
            .iter()
            .find(|(n, _)| n.ends_with(".gate.weight") && !n.contains("experts"))
            .map(|(_, t)| t.shallow_clone())
            .unwrap();
        let g = group as i64;
        for r in 0..xs.len() as i64 / g {
            let xr = x.narrow(0, r * B * g, B * g).reshape([-1, H]);
            loss = loss
                .f_add(&(switch_aux(&xr, &router, k, coeff) * scale))
                .unwrap();
        }
    }
    let params: Vec<(String, Tensor)> = m
        .named_parameters()
        .iter()
        .filter(|(n, _)| n.contains("block_sparse_moe") || n.contains(".mlp."))
        .map(|(n, t)| (n.clone(), t.shallow_clone()))
        .collect();
    let mut wrt = vec![x.shallow_clone()];
    wrt.extend(params.iter().map(|(_, t)| t.shallow_clone()));
    let grads = Tensor::run_backward(&[loss], &wrt, false, false);
    let gx = grads[0].shallow_clone();
    let mut by_name = HashMap::new();
    for ((n, t), g) in params.iter().zip(&grads[1..]) {
        let g = if g.defined() {
            g.shallow_clone()
        } else {
            t.zeros_like()
        };
        by_name.insert(n.clone(), g);
    }
    let y = y.detach();
    Reference {
        y: (0..xs.len() as i64)
            .map(|r| y.narrow(0, r * B, B))
            .collect(),
        gx: (0..xs.len() as i64)
            .map(|r| gx.narrow(0, r * B, B))
            .collect(),
        grads: by_name,
    }
}

/// What one rank reports back.
struct RankOut {
    ep_rank: usize,
    etp_rank: usize,
    y_fwd: Plain,
    y: Plain,
    gx: Plain,
    grads: HashMap<String, (Plain, Placement)>,
    stats: LoadStats,
    stats_fwd: LoadStats,
    local_experts: std::ops::Range<i64>,
    /// The whole block gathered from every rank's slices.
    full: Vec<(String, Plain)>,
}

struct Setup {
    cfg: Value,
    ep: usize,
    etp: usize,
    aux: Option<(f64, f64)>,
    /// Per token set (EP rank): valid-token mask `[B, T]`.
    valid: Option<Vec<Plain>>,
    /// [`Tokens::Local`]: every rank routes its own token set (`ep × etp` of them), its ETP group
    /// standing for its tensor-parallel group under sequence parallelism (the load statistics
    /// and the router loss are those of the group's token sets together).
    local: bool,
}

impl Setup {
    fn sets(&self) -> usize {
        if self.local {
            self.ep * self.etp
        } else {
            self.ep
        }
    }
}

fn join(addr: SocketAddr, rank: usize, world: usize) -> CpuCommunicator {
    let store = Arc::new(StoreClient::connect_as(addr, rank, TIMEOUT).unwrap());
    let opts = CpuOptions {
        timeout: TIMEOUT,
        op_timeout: Some(TIMEOUT),
    };
    CpuCommunicator::new(store, rank, world, opts).unwrap()
}

/// Runs `f(rank, world communicator)` on `world` threads.
fn ranks<R: Send>(world: usize, f: impl Fn(usize, &dyn Communicator) -> R + Sync) -> Vec<R> {
    let server = StoreServer::bind("127.0.0.1:0").unwrap();
    let addr = server.connect_addr();
    let f = &f;
    thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                thread::Builder::new()
                    .name(format!("rank{rank}"))
                    .spawn_scoped(s, move || f(rank, &join(addr, rank, world)))
                    .unwrap()
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Rank `r` of `ep × etp` ranks (ETP fastest, as Megatron orders expert ranks): EP groups are
/// the ranks of equal ETP index, ETP groups the ranks of equal EP index.
fn groups(world: &dyn Communicator, ep: usize, etp: usize) -> (ExpertGroup, ExpertGroup) {
    let mut ep_group = None;
    for t in 0..etp {
        let ranks: Vec<usize> = (0..ep).map(|e| e * etp + t).collect();
        if let Some(c) = world.new_group(&ranks).unwrap() {
            ep_group = Some(ExpertGroup::new("expert-parallel", c));
        }
    }
    let mut etp_group = None;
    for e in 0..ep {
        let ranks: Vec<usize> = (0..etp).map(|t| e * etp + t).collect();
        if let Some(c) = world.new_group(&ranks).unwrap() {
            etp_group = Some(ExpertGroup::new("expert-tensor-parallel", c));
        }
    }
    (ep_group.unwrap(), etp_group.unwrap())
}

/// Inputs and output gradients of each token set (EP rank).
fn data(ep: usize, positive: bool) -> (Vec<Tensor>, Vec<Tensor>) {
    tch::manual_seed(23);
    let xs = (0..ep)
        .map(|_| {
            let x = Tensor::randn([B, T, H], (Kind::Float, Device::Cpu));
            if positive {
                x.abs() + 0.1
            } else {
                x
            }
        })
        .collect();
    let gs = (0..ep)
        .map(|_| Tensor::randn([B, T, H], (Kind::Float, Device::Cpu)))
        .collect();
    (xs, gs)
}

fn run(setup: &Setup, params: &HashMap<String, Plain>, xs: &[Plain], gs: &[Plain]) -> Vec<RankOut> {
    let (ep, etp, local) = (setup.ep, setup.etp, setup.local);
    let cfg = ModelConfig::from_value(setup.cfg.clone(), "inline/config.json").unwrap();
    let coeff = setup.aux.map(|a| a.0).unwrap_or(0.0);
    let scale = setup.aux.map(|a| a.1).unwrap_or(0.0);
    let mut outs = ranks(ep * etp, |rank, world| {
        let (epg, etpg) = groups(world, ep, etp);
        let (ep_rank, etp_rank) = (epg.rank, etpg.rank);
        // The ETP ranks again, as the tensor-parallel group the tokens are partitioned over.
        let mut seq = None;
        if local {
            for e in 0..ep {
                let ranks: Vec<usize> = (0..etp).map(|t| e * etp + t).collect();
                if let Some(c) = world.new_group(&ranks).unwrap() {
                    seq = Some(ExpertGroup::new("tensor-parallel (moe tokens)", c));
                }
            }
        }
        assert_eq!(rank, ep_rank * etp + etp_rank);
        let mut source: HashMap<String, Tensor> = params
            .iter()
            .map(|(n, p)| (n.clone(), p.tensor()))
            .collect();
        let spec = MoeSpec::new(&cfg, 0, coeff).unwrap();
        let mut block = EpMoe::new(
            spec,
            Arc::new(epg),
            Arc::new(etpg),
            Kind::Float,
            Device::Cpu,
            &mut source,
        )
        .unwrap();
        let set = match seq {
            Some(seq) => {
                block.set_tokens(Arc::new(seq), Tokens::Local);
                rank
            }
            None => ep_rank,
        };
        let x = xs[set].tensor();
        let g = gs[set].tensor();
        let valid = setup.valid.as_ref().map(|v| v[set].tensor());
        let fwd = block.forward(&x, valid.as_ref()).unwrap();
        let mut grads = HashMap::new();
        let out = block
            .forward_backward(&x, valid.as_ref(), &g, scale, &mut |i, g| {
                let p = &block.params[i];
                let prev = grads.insert(p.name.clone(), (Plain::of(g), p.placement));
                assert!(prev.is_none(), "{} sunk twice", p.name);
                Ok(())
            })
            .unwrap();
        let locals: Vec<Tensor> = block
            .params
            .iter()
            .map(|p| p.local.shallow_clone())
            .collect();
        let full = block
            .gather_full(&locals)
            .unwrap()
            .into_iter()
            .map(|(n, t)| (n, Plain::of(&t)))
            .collect();
        RankOut {
            full,
            ep_rank,
            etp_rank,
            y_fwd: Plain::of(&fwd.y),
            y: Plain::of(&out.y),
            gx: Plain::of(&out.grad_x),
            grads,
            stats: out.stats,
            stats_fwd: fwd.stats,
            local_experts: block.local_expert_range(),
        }
    });
    outs.sort_by_key(|o| o.ep_rank * etp + o.etp_rank);
    outs
}

/// Checks every rank against the reference; returns the outputs for further checks.
fn check_against_reference(
    setup: &Setup,
    m: &Transformer,
    positive: bool,
) -> (Vec<RankOut>, Reference) {
    let (xs, gs) = data(setup.sets(), positive);
    let group = if setup.local { setup.etp } else { 1 };
    let r = reference(m, &xs, &gs, setup.aux, group);
    let params = block_params(m);
    let xs_p: Vec<Plain> = xs.iter().map(Plain::of).collect();
    let gs_p: Vec<Plain> = gs.iter().map(Plain::of).collect();
    let outs = run(setup, &params, &xs_p, &gs_p);
    let mut replicated_sum: HashMap<String, Tensor> = HashMap::new();
    let mut expert_seen: HashMap<String, usize> = HashMap::new();
    for o in &outs {
        let e = match setup.local {
            true => o.ep_rank * setup.etp + o.etp_rank,
            false => o.ep_rank,
        };
        let who = format!("ep rank {}, etp rank {}", o.ep_rank, o.etp_rank);
        assert_close(&format!("{who}: forward"), &o.y_fwd.tensor(), &r.y[e]);
        assert_close(
            &format!("{who}: forward_backward output"),
            &o.y.tensor(),
            &r.y[e],
        );
        assert_close(&format!("{who}: input gradient"), &o.gx.tensor(), &r.gx[e]);
        assert_eq!(
            o.stats, o.stats_fwd,
            "{who}: stats of forward and forward_backward"
        );
        assert_eq!(
            o.full.len(),
            params.len(),
            "{who}: gathered parameter count"
        );
        for (name, t) in &o.full {
            let want = &params[name];
            assert_eq!(t.0, want.0, "{who}: gathered shape of {name}");
            assert_eq!(t.1, want.1, "{who}: gathered values of {name}");
        }
        for (name, (g, placement)) in &o.grads {
            let full = &r.grads[name];
            match placement {
                Placement::Replicated => {
                    // Only one ETP rank per EP rank contributes (ETP peers hold the same tokens,
                    // or, with local tokens, all-reduced their gradients over their group).
                    if o.etp_rank == 0 {
                        let acc = replicated_sum
                            .entry(name.clone())
                            .or_insert_with(|| full.zeros_like());
                        *acc += g.tensor();
                    }
                }
                Placement::Expert { expert, split_dim } => {
                    assert!(o.local_experts.contains(expert), "{who}: {name}");
                    let want = match split_dim {
                        None => full.shallow_clone(),
                        Some(d) => {
                            let n = full.size()[*d as usize] / setup.etp as i64;
                            full.narrow(*d, o.etp_rank as i64 * n, n)
                        }
                    };
                    assert_close(&format!("{who}: gradient of {name}"), &g.tensor(), &want);
                    *expert_seen.entry(name.clone()).or_default() += 1;
                }
            }
        }
    }
    for (name, full) in &r.grads {
        if name.contains(".experts.") {
            let expert: i64 = name
                .split(".experts.")
                .nth(1)
                .unwrap()
                .split('.')
                .next()
                .unwrap()
                .parse()
                .unwrap();
            let nonzero = full.abs().sum(Kind::Float).double_value(&[]) > 0.0;
            let seen = expert_seen.get(name).copied().unwrap_or(0);
            // Every ETP rank of the owner reports a used expert; an unused one gets no gradient.
            if nonzero {
                assert_eq!(
                    seen, setup.etp,
                    "{name} (expert {expert}) gradient reported by {seen} ranks"
                );
            } else {
                assert_eq!(seen, 0, "{name} has no tokens but got a gradient");
            }
        } else {
            let got = replicated_sum
                .get(name)
                .unwrap_or_else(|| panic!("{name}: no rank reported a gradient"));
            assert_close(
                &format!("sum over ranks of the gradient of {name}"),
                got,
                full,
            );
        }
    }
    (outs, r)
}

#[test]
fn ep2_matches_one_rank_block() {
    let m = model(mixtral(4, 2), |_, _| {});
    let setup = Setup {
        cfg: mixtral(4, 2),
        ep: 2,
        etp: 1,
        aux: None,
        valid: None,
        local: false,
    };
    let (outs, _) = check_against_reference(&setup, &m, false);
    assert_eq!(outs[0].local_experts, 0..2);
    assert_eq!(outs[1].local_experts, 2..4);
    for o in &outs {
        assert_eq!(o.stats.tokens, B * T);
        assert_eq!(o.stats.tokens_per_expert.iter().sum::<i64>(), 2 * B * T);
        assert_eq!(o.stats.aux_loss, None);
    }
}

#[test]
fn ep4_with_aux_loss_matches_one_rank_block() {
    let cfg = mixtral(8, 2);
    let m = model(cfg.clone(), |_, _| {});
    let setup = Setup {
        cfg,
        ep: 4,
        etp: 1,
        aux: Some((0.01, 3.0)),
        valid: None,
        local: false,
    };
    let (xs, _) = data(4, false);
    let (outs, _) = check_against_reference(&setup, &m, false);
    let router = m
        .named_parameters()
        .iter()
        .find(|(n, _)| n.ends_with("block_sparse_moe.gate.weight"))
        .unwrap()
        .1
        .shallow_clone();
    for o in &outs {
        assert_eq!(o.local_experts.end - o.local_experts.start, 2);
        let want = tch::no_grad(|| switch_aux(&xs[o.ep_rank].reshape([-1, H]), &router, 2, 0.01))
            .double_value(&[]);
        let got = o.stats.aux_loss.unwrap();
        assert!(
            (got - want).abs() <= 1e-7,
            "rank {}: aux loss {got} vs {want}",
            o.ep_rank
        );
    }
}

#[test]
fn ep2_times_etp2_matches_one_rank_block() {
    let m = model(mixtral(4, 2), |_, _| {});
    let setup = Setup {
        cfg: mixtral(4, 2),
        ep: 2,
        etp: 2,
        aux: Some((0.05, 1.0)),
        valid: None,
        local: false,
    };
    let (outs, _) = check_against_reference(&setup, &m, false);
    let w1 = outs[0]
        .grads
        .iter()
        .find(|(n, _)| n.ends_with("experts.0.w1.weight"))
        .unwrap();
    assert_eq!(w1.1 .0 .0, vec![12, H], "ETP halves the expert columns");
}

#[test]
fn local_tokens_gathered_over_etp_match_one_rank_block() {
    // Megatron-core's sequence-parallel dispatch: every rank routes its own tokens, the rows an
    // expert owner receives are all-gathered over its ETP group and the partial outputs
    // reduce-scattered back; the statistics and the router loss are those of the ETP group's
    // tokens together (the loss summed over the group is the loss of all its tokens).
    let cfg = mixtral(4, 2);
    let m = model(cfg.clone(), |_, _| {});
    let setup = Setup {
        cfg,
        ep: 2,
        etp: 2,
        aux: Some((0.05, 1.0)),
        valid: None,
        local: true,
    };
    let (xs, _) = data(4, false);
    let (outs, _) = check_against_reference(&setup, &m, false);
    let router = m
        .named_parameters()
        .iter()
        .find(|(n, _)| n.ends_with("block_sparse_moe.gate.weight"))
        .unwrap()
        .1
        .shallow_clone();
    for o in &outs {
        assert_eq!(
            o.stats.tokens,
            2 * B * T,
            "statistics of the ETP pair's tokens"
        );
        assert_eq!(o.stats.tokens_per_expert.iter().sum::<i64>(), 2 * 2 * B * T);
        let pair = Tensor::cat(&[&xs[2 * o.ep_rank], &xs[2 * o.ep_rank + 1]], 0);
        let want =
            tch::no_grad(|| switch_aux(&pair.reshape([-1, H]), &router, 2, 0.05)).double_value(&[]);
        let got = o.stats.aux_loss.unwrap();
        assert!((got - want).abs() <= 1e-7, "aux loss {got} vs {want}");
    }
}

#[test]
fn qwen2_moe_shared_expert_matches_one_rank_block() {
    let m = model(qwen2_moe(), |_, _| {});
    let setup = Setup {
        cfg: qwen2_moe(),
        ep: 2,
        etp: 1,
        aux: Some((0.02, 0.5)),
        valid: None,
        local: false,
    };
    let (outs, _) = check_against_reference(&setup, &m, false);
    assert!(outs[0]
        .grads
        .keys()
        .any(|n| n.contains("shared_expert_gate")));
}

/// Positive inputs and a router whose rows 1 and 3 point away from them: experts 1 and 3 never
/// get a token, so with EP = 4 ranks 1 and 3 receive nothing at all.
fn skewed(name: &str, t: &mut Tensor) {
    if name.ends_with("block_sparse_moe.gate.weight") {
        for e in [1i64, 3] {
            let _ = t.get(e).fill_(-1.0);
        }
        for e in [0i64, 2] {
            let mut row = t.get(e);
            let a = row.abs() * 0.1;
            row.copy_(&a);
        }
    }
}

#[test]
fn uneven_routing_with_idle_experts_and_idle_ranks() {
    let m = model(mixtral(4, 2), skewed);
    for ep in [2usize, 4] {
        let setup = Setup {
            cfg: mixtral(4, 2),
            ep,
            etp: 1,
            aux: Some((0.01, 1.0)),
            valid: None,
            local: false,
        };
        let (outs, r) = check_against_reference(&setup, &m, true);
        for o in &outs {
            assert_eq!(
                o.stats.tokens_per_expert,
                vec![B * T, 0, B * T, 0],
                "ep {ep}"
            );
            assert!((o.stats.imbalance() - 2.0).abs() < 1e-12);
            assert!(!o
                .grads
                .keys()
                .any(|n| n.contains("experts.1.") || n.contains("experts.3.")));
        }
        // The reference has every expert; the idle ones have zero gradients there.
        assert!(r.grads.keys().any(|n| n.contains("experts.1.")));
    }
    // Local tokens gathered over ETP, every token routed to experts 0 and 1: EP rank 1 (both of
    // its ETP members) gets no rows at all.
    let m = model(mixtral(4, 2), |name, t| {
        if name.ends_with("block_sparse_moe.gate.weight") {
            for e in [2i64, 3] {
                let _ = t.get(e).fill_(-1.0);
            }
            for e in [0i64, 1] {
                let mut row = t.get(e);
                let a = row.abs() * 0.1;
                row.copy_(&a);
            }
        }
    });
    let setup = Setup {
        cfg: mixtral(4, 2),
        ep: 2,
        etp: 2,
        aux: Some((0.01, 1.0)),
        valid: None,
        local: true,
    };
    let (outs, _) = check_against_reference(&setup, &m, true);
    for o in &outs {
        assert_eq!(o.stats.tokens_per_expert, vec![2 * B * T, 2 * B * T, 0, 0]);
        if o.ep_rank == 1 {
            assert!(o.grads.keys().all(|n| !n.contains(".experts.")));
        }
    }
}

#[test]
fn load_statistics_and_metrics_match_direct_counts() {
    let cfg = mixtral(4, 2);
    let m = model(cfg.clone(), |_, _| {});
    // Rank 0: the last two positions of row 0 are padding; rank 1: row 1 is all padding.
    let masks: Vec<Tensor> = vec![
        Tensor::from_slice(&[1i64, 1, 1, 0, 0, 1, 1, 1, 1, 1]).reshape([B, T]),
        Tensor::from_slice(&[1i64, 1, 1, 1, 1, 0, 0, 0, 0, 0]).reshape([B, T]),
    ];
    let (xs, gs) = data(2, false);
    let setup = Setup {
        cfg,
        ep: 2,
        etp: 1,
        aux: Some((0.1, 1.0)),
        valid: Some(masks.iter().map(Plain::of).collect()),
        local: false,
    };
    let params = block_params(&m);
    let outs = run(
        &setup,
        &params,
        &xs.iter().map(Plain::of).collect::<Vec<_>>(),
        &gs.iter().map(Plain::of).collect::<Vec<_>>(),
    );
    let router = m
        .named_parameters()
        .iter()
        .find(|(n, _)| n.ends_with("block_sparse_moe.gate.weight"))
        .unwrap()
        .1
        .shallow_clone();
    let mut totals = [0f64; 4];
    for o in &outs {
        let x = xs[o.ep_rank].reshape([-1, H]);
        let mask = Vec::<i64>::try_from(&masks[o.ep_rank].reshape([-1])).unwrap();
        let probs = tch::no_grad(|| x.linear(&router, None::<&Tensor>).softmax(1, Kind::Float));
        let (_, sel) = probs.topk(2, -1, true, true);
        let sel = Vec::<i64>::try_from(&sel.reshape([-1])).unwrap();
        let mut want = vec![0i64; 4];
        for (i, e) in sel.iter().enumerate() {
            if mask[i / 2] != 0 {
                want[*e as usize] += 1;
            }
        }
        assert_eq!(o.stats.tokens_per_expert, want, "rank {}", o.ep_rank);
        assert_eq!(o.stats.tokens, mask.iter().sum::<i64>());
        for (t, w) in totals.iter_mut().zip(&want) {
            *t += *w as f64;
        }
        // The aux loss over the valid tokens only.
        let keep: Vec<i64> = (0..mask.len() as i64)
            .filter(|&i| mask[i as usize] != 0)
            .collect();
        let xv = x.index_select(0, &Tensor::from_slice(&keep));
        let aux = tch::no_grad(|| switch_aux(&xv, &router, 2, 0.1)).double_value(&[]);
        let got = o.stats.aux_loss.unwrap();
        assert!((got - aux).abs() <= 1e-7, "aux {got} vs {aux}");
    }

    // Step metrics: two ranks' stats for layer 0 (twice, like two micro-batches), summed over
    // ranks as a data-parallel reduction would.
    let per_rank: Vec<MoeLoadMetrics> = outs
        .iter()
        .map(|o| {
            let mut mm = MoeLoadMetrics::new(4);
            mm.add(0, &o.stats).unwrap();
            mm.add(0, &o.stats).unwrap();
            mm
        })
        .collect();
    let mut flats: Vec<Vec<f64>> = vec![];
    for p in &per_rank {
        let mut p = p.clone();
        p.reduce_with(|v| {
            flats.push(v.to_vec());
            Ok(())
        })
        .unwrap();
    }
    let summed: Vec<f64> = (0..flats[0].len())
        .map(|i| flats.iter().map(|f| f[i]).sum())
        .collect();
    let mut metrics = per_rank[0].clone();
    metrics
        .reduce_with(|v| {
            v.copy_from_slice(&summed);
            Ok(())
        })
        .unwrap();
    let got: HashMap<String, f64> = metrics.metrics().into_iter().collect();
    for (e, t) in totals.iter().enumerate() {
        assert_eq!(got[&format!("moe/expert_load/{e}")], 2.0 * t);
    }
    let mean = totals.iter().sum::<f64>() / 4.0;
    let imb = totals.iter().cloned().fold(0.0, f64::max) / mean;
    assert!((got["moe/load_imbalance"] - imb).abs() < 1e-12);
    assert!((got["moe/load_imbalance_max"] - imb).abs() < 1e-12);
    let aux_mean = outs.iter().map(|o| o.stats.aux_loss.unwrap()).sum::<f64>() / 2.0;
    assert!((got["moe/aux_loss"] - aux_mean).abs() < 1e-12);
    assert_eq!(got.len(), 4 + 3);

    // A second layer with a perfectly balanced load: the mean imbalance halves the excess.
    let mut two = metrics.clone();
    two.add(
        1,
        &LoadStats {
            tokens_per_expert: vec![5, 5, 5, 5],
            tokens: 10,
            aux_loss: None,
        },
    )
    .unwrap();
    let got: HashMap<String, f64> = two.metrics().into_iter().collect();
    assert!((got["moe/load_imbalance"] - (imb + 1.0) / 2.0).abs() < 1e-12);
    assert!((got["moe/load_imbalance_max"] - imb).abs() < 1e-12);
    assert!(MoeLoadMetrics::new(4).metrics().is_empty());

    // Pipeline stages: stage 0 runs layer 0, stage 1 layer 2; both list every sparse layer, so
    // their flats line up, and the sum over stages equals one accumulator that saw both layers.
    let balanced = LoadStats {
        tokens_per_expert: vec![5, 5, 5, 5],
        tokens: 10,
        aux_loss: Some(0.5),
    };
    let mut stages = [
        MoeLoadMetrics::with_layers(4, [0, 2]),
        MoeLoadMetrics::with_layers(4, [0, 2]),
    ];
    stages[0].add(0, &outs[0].stats).unwrap();
    stages[1].add(2, &balanced).unwrap();
    let mut flats: Vec<Vec<f64>> = vec![];
    for s in stages.clone().iter_mut() {
        s.reduce_with(|v| {
            flats.push(v.to_vec());
            Ok(())
        })
        .unwrap();
    }
    assert_eq!(flats[0].len(), flats[1].len());
    let summed: Vec<f64> = (0..flats[0].len())
        .map(|i| flats[0][i] + flats[1][i])
        .collect();
    stages[0]
        .reduce_with(|v| {
            v.copy_from_slice(&summed);
            Ok(())
        })
        .unwrap();
    let mut both = MoeLoadMetrics::new(4);
    both.add(0, &outs[0].stats).unwrap();
    both.add(2, &balanced).unwrap();
    assert_eq!(stages[0].metrics(), both.metrics());
    // A listed layer nothing ran through does not dilute the means.
    let mut one = MoeLoadMetrics::with_layers(4, [0, 1]);
    one.add(0, &balanced).unwrap();
    let got: HashMap<String, f64> = one.metrics().into_iter().collect();
    assert_eq!(got["moe/expert_load/0"], 5.0);
    assert_eq!(got["moe/load_imbalance"], 1.0);
    assert_eq!(got["moe/aux_loss"], 0.5);
}

#[test]
fn bad_layouts_and_inputs_are_named() {
    let cfg = ModelConfig::from_value(mixtral(4, 2), "inline/config.json").unwrap();
    let m = model(mixtral(4, 2), |_, _| {});
    let params = block_params(&m);
    let errs = ranks(3, |_, world| {
        let ep = ExpertGroup::new(
            "expert-parallel",
            world.new_group(&[0, 1, 2]).unwrap().unwrap(),
        );
        let mut source: HashMap<String, Tensor> = params
            .iter()
            .map(|(n, p)| (n.clone(), p.tensor()))
            .collect();
        EpMoe::new(
            MoeSpec::new(&cfg, 0, 0.0).unwrap(),
            Arc::new(ep),
            Arc::new(ExpertGroup::single("expert-tensor-parallel")),
            Kind::Float,
            Device::Cpu,
            &mut source,
        )
        .unwrap_err()
        .to_string()
    });
    for e in errs {
        assert!(
            e.contains(
                "expert_model_parallel_size=3 does not divide num_experts=4; valid: 1, 2, 4"
            ),
            "{e}"
        );
    }

    let dense = ModelConfig::from_value(
        json!({"model_type": "qwen2", "vocab_size": 32, "hidden_size": 16,
               "intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 4,
               "num_key_value_heads": 2}),
        "inline/config.json",
    )
    .unwrap();
    let e = MoeSpec::new(&dense, 0, 0.0).unwrap_err();
    assert!(
        matches!(&e, MegatronError::Shared(s) if matches!(**s, verl_backend_kit::BackendError::Config { .. })),
        "{e}"
    );
    assert!(e.to_string().contains("mixture-of-experts"), "{e}");
    let e = MoeSpec::new(&cfg, 0, -1.0).unwrap_err();
    assert!(e.to_string().contains("moe_aux_loss_coeff"), "{e}");

    // One rank: a missing tensor and a wrong hidden size are named.
    let mut partial: HashMap<String, Tensor> = params
        .iter()
        .filter(|(n, _)| !n.contains("experts.2.w2"))
        .map(|(n, p)| (n.clone(), p.tensor()))
        .collect();
    let single = || Arc::new(ExpertGroup::single("expert-parallel"));
    let e = EpMoe::new(
        MoeSpec::new(&cfg, 0, 0.0).unwrap(),
        single(),
        single(),
        Kind::Float,
        Device::Cpu,
        &mut partial,
    )
    .unwrap_err();
    assert!(e.to_string().contains("experts.2.w2.weight"), "{e}");
    let mut full: HashMap<String, Tensor> = params
        .iter()
        .map(|(n, p)| (n.clone(), p.tensor()))
        .collect();
    let block = EpMoe::new(
        MoeSpec::new(&cfg, 0, 0.0).unwrap(),
        single(),
        single(),
        Kind::Float,
        Device::Cpu,
        &mut full,
    )
    .unwrap();
    let e = block
        .forward(&Tensor::zeros([2, 3, 8], (Kind::Float, Device::Cpu)), None)
        .unwrap_err();
    assert!(
        e.to_string().contains("hidden_size") && e.to_string().contains("[2, 3, 8]"),
        "{e}"
    );
    let x = Tensor::zeros([2, 3, H], (Kind::Float, Device::Cpu));
    let e = block
        .forward_backward(&x, None, &x.narrow(1, 0, 2), 0.0, &mut |_, _| Ok(()))
        .unwrap_err();
    assert!(e.to_string().contains("output gradient"), "{e}");
    let e = block
        .forward(&x, Some(&Tensor::ones([2, 2], (Kind::Int64, Device::Cpu))))
        .unwrap_err();
    assert!(e.to_string().contains("valid token mask"), "{e}");
}
