//! Generation at its own tensor-parallel size (HybridFlow's 3D-HybridEngine): training runs at
//! TP_t × PP × DP, generation at `actor_rollout_ref.rollout.tensor_model_parallel_size` = TP_r over
//! the same ranks, in `world / TP_r` rollout groups that each generate their own share of the
//! prompts ([`verl_backend_kit::hybrid`]).
//!
//! Each rank builds its rollout shard from its training shard, moving only what it lacks
//! ([`RolloutGrid`]):
//!
//! * TP_r divides TP_t (k = TP_t / TP_r): the rollout group is strided — ranks `a, a + k, ...` of
//!   a tensor-parallel group — so that rollout shard `j` is training shards `j·k .. j·k + k`,
//!   held by the `k` consecutive ranks around this one: one all-gather in that block of `k`;
//! * TP_r = TP_t: the training shard as it is;
//! * TP_r a multiple of TP_t (m = TP_r / TP_t): a rollout group spans `m` consecutive training
//!   replicas (or stages) and rollout shard `t·m + s` is block `s` of training shard `t`: a slice,
//!   no communication;
//! * with pipeline parallelism each rank then receives the other stages' part of its own rollout
//!   shard: broadcast over the pipeline group, or — where a rollout group spans the stages, so
//!   that pipeline peers hold different shards — sent to each peer on its own.
//!
//! MoE models generate at rollout TP 1 (a MoE block is not split for generation); TP_r = 1 is the
//! whole model on every rank, each rank generating its own share.

use std::collections::HashMap;
use std::sync::Arc;

use serde_json::Value;
use tch::{Device, Tensor};
use verl_backend_kit::dp::Dp;
use verl_backend_kit::hybrid::{DpTpComm, Placement};
use verl_nn::{HeadKind, ModelConfig, ModelOptions, TpComm, Transformer};

use crate::error::{MegatronError, Result, TorchContext};
use crate::layout::Layout;
use crate::parallel::Parallel;
use crate::tp::TpModel;

/// The config key choosing the rollout tensor-parallel size.
pub const ROLLOUT_TP_KEY: &str = "actor_rollout_ref.rollout.tensor_model_parallel_size";

/// verl's default `rollout.tensor_model_parallel_size` (its `ppo_trainer.yaml`), which the host's
/// defaults fill in when a job does not set the key.
const VERL_DEFAULT_ROLLOUT_TP: usize = 2;

/// The two layouts over the job's ranks: rank = t + TP_t · q, `t` its training tensor-parallel
/// index and `q` the rest of its coordinates (context, data, pipeline) in Megatron's order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RolloutGrid {
    /// Training tensor-parallel size, context × data-parallel size and world.
    pub train_tp: usize,
    pub cp_dp: usize,
    pub world: usize,
    /// Rollout tensor-parallel size.
    pub tp: usize,
}

impl RolloutGrid {
    fn split(&self, rank: usize) -> (usize, usize) {
        (rank % self.train_tp, rank / self.train_tp)
    }

    /// Rollout groups (`world / TP_r`).
    pub fn groups(&self) -> usize {
        self.world / self.tp
    }

    /// `(rollout group, rollout shard index)` of `rank`.
    pub fn place(&self, rank: usize) -> (usize, usize) {
        let (t, q) = self.split(rank);
        if self.tp <= self.train_tp {
            let k = self.train_tp / self.tp;
            (q * k + t % k, t / k)
        } else {
            let m = self.tp / self.train_tp;
            (q / m, t * m + q % m)
        }
    }

    /// The rank holding rollout shard `j` of group `g`.
    fn rank_at(&self, g: usize, j: usize) -> usize {
        if self.tp <= self.train_tp {
            let k = self.train_tp / self.tp;
            (g / k) * self.train_tp + j * k + g % k
        } else {
            let m = self.tp / self.train_tp;
            j / m + self.train_tp * (g * m + j % m)
        }
    }

    /// Every rollout group's ranks, in shard order, groups in order.
    pub fn rollout_groups(&self) -> Vec<Vec<usize>> {
        (0..self.groups())
            .map(|g| (0..self.tp).map(|j| self.rank_at(g, j)).collect())
            .collect()
    }

    /// TP_r < TP_t: the blocks of `TP_t / TP_r` consecutive training shards that make one rollout
    /// shard (empty otherwise).
    pub fn gather_blocks(&self) -> Vec<Vec<usize>> {
        if self.tp >= self.train_tp {
            return Vec::new();
        }
        let k = self.train_tp / self.tp;
        (0..self.world / k)
            .map(|b| (b * k..(b + 1) * k).collect())
            .collect()
    }

    /// Whether a rank's pipeline peers (same t, context and data index) hold the same rollout
    /// shard, so stages can be gathered at the rollout shard's size; otherwise they are gathered
    /// at the training shard's size and sliced afterwards.
    pub fn stages_share_shard(&self) -> bool {
        self.tp <= self.train_tp || self.cp_dp.is_multiple_of(self.tp / self.train_tp)
    }
}

/// What generation runs at: the grid, or why it runs at TP 1 whatever was asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RolloutLayout {
    pub grid: RolloutGrid,
}

/// The rollout tensor-parallel sizes valid for this layout and model.
/// Whether rollout TP `r` fits the layout: a divisor of the actor's TP, or a multiple of it that
/// the ranks split into.
fn layout_fits(layout: &Layout, r: usize) -> bool {
    let world = layout.world();
    if r <= layout.tp {
        layout.tp.is_multiple_of(r)
    } else {
        r.is_multiple_of(layout.tp)
            && world.is_multiple_of(r)
            && (world / layout.tp).is_multiple_of(r / layout.tp)
    }
}

/// The rollout tensor-parallel sizes valid for this layout and model.
fn valid_sizes(layout: &Layout, model: &ModelConfig) -> Vec<usize> {
    (1..=layout.world())
        .filter(|&r| layout_fits(layout, r) && verl_backend_kit::hybrid::model_allows(model, r))
        .collect()
}

/// Resolves `actor_rollout_ref.rollout.tensor_model_parallel_size` against the actor's layout:
/// any size that divides the actor's TP, or is a multiple of it that the ranks split into, and
/// that divides the model's heads, key/value heads, MLP width and vocabulary. Absent or null:
/// the actor's TP. A size the layout takes but the model's heads do not becomes the largest
/// divisor of it that fits both, and verl's default 2 where the layout does not take it is taken
/// as unset (each with a warning). A MoE model generates at TP 1 (a warning when more was asked).
/// Any other size is refused.
pub fn resolve(cfg: &Value, layout: &Layout, model: &ModelConfig) -> Result<RolloutLayout> {
    let tp = layout.tp;
    let v = cfg.pointer("/actor_rollout_ref/rollout/tensor_model_parallel_size");
    let asked = match v {
        None | Some(Value::Null) => tp,
        Some(v) => match v.as_u64() {
            Some(n) if n >= 1 => n as usize,
            _ => {
                return Err(MegatronError::config(
                    ROLLOUT_TP_KEY,
                    "a positive integer (or null: the actor's tensor_model_parallel_size)",
                    v,
                ))
            }
        },
    };
    let grid = |r: usize| RolloutGrid {
        train_tp: tp,
        cp_dp: layout.cp * layout.dp,
        world: layout.world(),
        tp: r,
    };
    if model.moe.is_some() {
        if asked != 1 {
            tracing::warn!(
                "{ROLLOUT_TP_KEY}={asked}: a mixture-of-experts model generates at rollout TP 1 \
                 (the whole model on every rank, each rank generating its own share of the \
                 prompts: the same tokens, only the speed differs); set it to 1 to silence this"
            );
        }
        return Ok(RolloutLayout { grid: grid(1) });
    }
    let valid = valid_sizes(layout, model);
    if valid.contains(&asked) {
        return Ok(RolloutLayout { grid: grid(asked) });
    }
    if layout_fits(layout, asked) {
        let fit = verl_backend_kit::hybrid::fit_model(asked, &valid, model);
        return Ok(RolloutLayout { grid: grid(fit) });
    }
    if asked == VERL_DEFAULT_ROLLOUT_TP && valid.contains(&tp) {
        tracing::warn!(
            "{ROLLOUT_TP_KEY}={asked} (verl's default) does not fit this layout (actor \
             tensor_model_parallel_size={tp}, {} ranks): taken as unset, generation runs at \
             TP={tp}; set it to one of {valid:?} to silence this",
            layout.world()
        );
        return Ok(RolloutLayout { grid: grid(tp) });
    }
    Err(MegatronError::config(
        ROLLOUT_TP_KEY,
        format!(
            "one of {valid:?}: a divisor of the actor's tensor_model_parallel_size={tp} or a \
             multiple of it that the {} ranks split into ({} data-parallel × {} pipeline), \
             dividing the model's heads, key/value heads, MLP width and vocabulary",
            layout.world(),
            layout.dp,
            layout.pp
        ),
        asked,
    ))
}

impl RolloutLayout {
    /// The layout of a role that never generates (the reference): rollout TP = its TP.
    pub fn unused(layout: &Layout) -> RolloutLayout {
        RolloutLayout {
            grid: RolloutGrid {
                train_tp: layout.tp,
                cp_dp: layout.cp * layout.dp,
                world: layout.world(),
                tp: layout.tp,
            },
        }
    }

    /// This rank's place for [`verl_backend_kit::hybrid::share`]: its training data replica
    /// (every tensor × pipeline rank of a replica gets the same prompts) and rollout group.
    pub fn placement(&self, layout: &Layout, rank: usize) -> Placement {
        let (group, tp_rank) = self.grid.place(rank);
        Placement {
            replica: layout.coords(rank).dp,
            group,
            groups: self.grid.groups(),
            tp_rank,
        }
    }
}

/// The communicators generation uses, made once by every rank together.
pub struct RolloutComms {
    /// Every rank (the prompts and outputs exchanged between rollout groups).
    pub world: Dp,
    /// This rank's rollout group.
    pub group: Arc<Dp>,
    /// TP_r < TP_t: this rank's block of training shards.
    pub block: Dp,
}

impl RolloutComms {
    pub fn new(world: Dp, grid: &RolloutGrid) -> Result<RolloutComms> {
        let group = Arc::new(world.subgroup(&grid.rollout_groups())?);
        let block = world.subgroup(&grid.gather_blocks())?;
        Ok(RolloutComms {
            world,
            group,
            block,
        })
    }
}

/// What a reshard moved: bytes this rank received and seconds it took.
#[derive(Debug, Clone, Copy, Default)]
pub struct Reshard {
    pub bytes_in: f64,
    pub secs: f64,
}

fn bytes(t: &Tensor) -> f64 {
    (t.numel() * t.kind().elt_size_in_bytes()) as f64
}

/// This rank's rollout shard of `model` (its live compute-dtype weights), built as the module docs
/// say; a plain TP=1 model when TP_r = 1. Every rank of the job calls it together.
pub fn reshard(
    model: &TpModel,
    grid: &RolloutGrid,
    comms: &RolloutComms,
    par: &Parallel,
    device: Device,
) -> Result<(Transformer, Reshard)> {
    let start = std::time::Instant::now();
    let (rank, pp) = (par.rank, &par.pp);
    if grid.tp == 1 {
        // The whole model on every rank: every shard of every stage (and every expert) is needed.
        let own: f64 = model.params.iter().map(|p| bytes(&p.local)).sum();
        let weights = crate::common::gather_live_model(model, par)?;
        let full: f64 = weights.values().map(bytes).sum();
        let out = Transformer::for_weights(
            model.config().clone(),
            &ModelOptions {
                device,
                dtype: model.dtype(),
                head: HeadKind::CausalLm,
            },
        )?;
        // The gathered tensors become the model's weights: no second copy.
        out.share_parameters(&weights)?;
        return Ok((
            out,
            Reshard {
                bytes_in: full - own,
                secs: start.elapsed().as_secs_f64(),
            },
        ));
    }
    let mut moved = 0.0;
    let (_, j) = grid.place(rank);
    let share = grid.stages_share_shard();
    // Step 1, along the tensor-parallel axis, this stage's parameters.
    let mut mine: HashMap<String, Tensor> = HashMap::new();
    for p in &model.params {
        if p.expert.is_some() {
            return Err(MegatronError::Api(verl_plugin_api::Error::failed(
                "internal: a routed expert reached the tensor-parallel rollout reshard",
            )));
        }
        let local = p.local.f_detach().ctx("live weight")?;
        let t = match verl_nn::tp::split_dim(&p.name) {
            None => local,
            Some(_) if grid.tp == grid.train_tp => local,
            Some(d) if grid.tp < grid.train_tp => {
                let parts = comms
                    .block
                    .all_gather(&local, "all_gather (rollout reshard)")?;
                moved += bytes(&local) * (parts.len() - 1) as f64;
                Tensor::f_cat(&parts, d).ctx("rollout shard")?
            }
            Some(_) => {
                let m = grid.tp / grid.train_tp;
                match share {
                    true => verl_nn::tp::shard_of(&local, &p.name, j % m, m)?,
                    false => local,
                }
            }
        };
        mine.insert(p.name.clone(), t);
    }
    // Step 2, the other stages' parts of this shard.
    if pp.size > 1 && share {
        let own: f64 = mine.values().map(bytes).sum();
        mine = crate::pipeline::gather_stages(
            model.config(),
            model.head_kind(),
            pp,
            model.stage().chunks,
            mine,
            model.dtype(),
            grid.tp,
        )?;
        moved += mine.values().map(bytes).sum::<f64>() - own;
    } else if pp.size > 1 {
        // The stages hold different rollout shards (a rollout group spans them): each sends
        // every other exactly the piece of its training shard that the other's shard needs.
        let (got, received) = exchange_stage_pieces(model, grid, par, &mine)?;
        moved += received;
        let m = grid.tp / grid.train_tp;
        for (name, t) in mine.iter_mut() {
            *t = verl_nn::tp::shard_of(t, name, j % m, m)?;
        }
        mine.extend(got);
    } else if !share {
        return Err(MegatronError::Api(verl_plugin_api::Error::failed(
            "internal: rollout shards differ across pipeline peers of a one-stage layout",
        )));
    }
    let opts = ModelOptions {
        device,
        dtype: model.dtype(),
        head: HeadKind::CausalLm,
    };
    let comm: Arc<dyn TpComm> = Arc::new(DpTpComm(comms.group.clone()));
    let out = Transformer::tp_shard(model.config().clone(), &opts, comm)?;
    // The rollout shard's tensors become the engine's weights without a copy: at rollout TP =
    // the actor's TP they are the training weights themselves.
    out.share_parameters(&mine)?;
    Ok((
        out,
        Reshard {
            bytes_in: moved,
            secs: start.elapsed().as_secs_f64(),
        },
    ))
}

/// TP_r > TP_t with a rollout group spanning the pipeline stages: every stage sends each other
/// stage's rank (same tensor, context and data index) the sub-piece of its training shard that
/// the receiver's rollout shard needs, over a ring of send/receive pairs; `mine` is this stage's
/// training shard. Returns the other stages' pieces (a name held by several stages, the tied
/// embedding, comes from the first one) and the bytes received.
fn exchange_stage_pieces(
    model: &TpModel,
    grid: &RolloutGrid,
    par: &Parallel,
    mine: &HashMap<String, Tensor>,
) -> Result<(HashMap<String, Tensor>, f64)> {
    use crate::tp::{stage_specs, Stage};
    let pp = &par.pp;
    let m = grid.tp / grid.train_tp;
    let (cfg, head, chunks) = (model.config(), model.head_kind(), model.stage().chunks);
    let specs = |s: usize| -> Result<Vec<(String, Vec<i64>, crate::tp::Split)>> {
        stage_specs(
            cfg,
            head,
            Stage {
                index: s,
                count: pp.size,
                chunks,
            },
        )
    };
    let all: Vec<_> = (0..pp.size).map(specs).collect::<Result<_>>()?;
    // What stage `from` sends stage `to`: its parameters no earlier stage holds and `to` lacks.
    let sent = |from: usize, to: usize| -> Vec<(String, Vec<i64>, crate::tp::Split)> {
        all[from]
            .iter()
            .filter(|(n, _, _)| {
                !all[..from]
                    .iter()
                    .any(|st| st.iter().any(|(x, _, _)| x == n))
                    && !all[to].iter().any(|(x, _, _)| x == n)
            })
            .cloned()
            .collect()
    };
    // The sub-piece (of m) of a training shard the rank at stage `s` of this pipeline group needs.
    let sub_at = |s: usize| {
        let r = par.layout.rank_of(crate::layout::Coords {
            pp: s,
            ..par.coords
        });
        grid.place(r).1 % m
    };
    let me = pp.rank;
    let (kind, device) = (model.dtype(), model.device());
    let mut got = HashMap::new();
    let mut received = 0.0;
    for d in 1..pp.size {
        let (dst, src) = ((me + d) % pp.size, (me + pp.size - d) % pp.size);
        let out_parts = sent(me, dst)
            .iter()
            .map(|(n, _, _)| -> Result<Tensor> {
                let t = mine.get(n).ok_or_else(|| {
                    MegatronError::Api(verl_plugin_api::Error::failed(format!(
                        "internal: stage {me} lacks its parameter `{n}`"
                    )))
                })?;
                verl_nn::tp::shard_of(t, n, sub_at(dst), m)?
                    .f_reshape([-1])
                    .ctx("stage piece")
            })
            .collect::<Result<Vec<_>>>()?;
        let out = match out_parts.is_empty() {
            true => Tensor::f_zeros([0], (kind, device)).ctx("stage piece")?,
            false => Tensor::f_cat(&out_parts, 0).ctx("stage pieces")?,
        };
        let incoming: Vec<(String, Vec<i64>)> = sent(src, me)
            .into_iter()
            .map(|(n, mut shape, split)| {
                if let Some(dim) = split.dim() {
                    shape[dim as usize] /= grid.tp as i64;
                }
                (n, shape)
            })
            .collect();
        let numel: i64 = incoming
            .iter()
            .map(|(_, sh)| sh.iter().product::<i64>())
            .sum();
        let mut into = Tensor::f_zeros([numel], (kind, device)).ctx("stage piece buffer")?;
        pp.send_recv(&out, dst, &mut into, src, "send_recv (rollout reshard)")?;
        received += bytes(&into);
        got.extend(crate::pipeline::unflatten(&into, incoming)?);
    }
    Ok((got, received))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn model(moe: bool) -> ModelConfig {
        let mut v = json!({
            "model_type": "qwen2", "vocab_size": 40, "hidden_size": 16, "intermediate_size": 40,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        });
        if moe {
            v = json!({
                "model_type": "mixtral", "vocab_size": 40, "hidden_size": 16,
                "intermediate_size": 40, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
            });
        }
        ModelConfig::from_value(v, "inline/config.json").unwrap()
    }

    fn layout(tp: usize, dp: usize, pp: usize) -> Layout {
        Layout {
            tp,
            dp,
            pp,
            ..Layout::single()
        }
    }

    fn cfg(v: Value) -> Value {
        json!({"actor_rollout_ref": {"rollout": {"tensor_model_parallel_size": v}}})
    }

    fn tp_of(v: Value, tp: usize, dp: usize, pp: usize) -> usize {
        resolve(&cfg(v), &layout(tp, dp, pp), &model(false))
            .unwrap()
            .grid
            .tp
    }

    #[test]
    fn rollout_tp_resolution() {
        assert_eq!(tp_of(json!(2), 2, 1, 1), 2);
        assert_eq!(tp_of(Value::Null, 4, 1, 1), 4);
        assert_eq!(tp_of(json!(1), 2, 1, 1), 1);
        assert_eq!(tp_of(json!(2), 4, 1, 1), 2);
        // A multiple of the actor's TP over data-parallel replicas or stages.
        assert_eq!(tp_of(json!(4), 2, 2, 1), 4);
        assert_eq!(tp_of(json!(4), 2, 1, 2), 4);
        assert_eq!(tp_of(json!(4), 2, 2, 2), 4);
        // verl's default 2 where it does not fit: the actor's TP.
        assert_eq!(tp_of(json!(2), 1, 1, 1), 1);
        // MoE: TP 1.
        let r = resolve(&cfg(json!(2)), &layout(2, 1, 1), &model(true)).unwrap();
        assert_eq!(r.grid.tp, 1);
        let e = resolve(&cfg(json!(4)), &layout(2, 1, 1), &model(false))
            .unwrap_err()
            .to_string();
        assert!(e.contains(ROLLOUT_TP_KEY), "{e}");
        assert!(e.contains("found 4"), "{e}");
        assert!(e.contains("one of [1, 2]"), "{e}");
        // The layout takes 3, the model's 4 heads do not: the largest size that fits both.
        assert_eq!(tp_of(json!(3), 1, 3, 1), 1);
        assert_eq!(tp_of(json!(4), 2, 2, 1), 4);
        let e = resolve(&cfg(json!(0)), &layout(2, 1, 1), &model(false))
            .unwrap_err()
            .to_string();
        assert!(e.contains("positive integer"), "{e}");
    }

    /// Every rank is in exactly one rollout group at the shard index `place` gives; a rollout
    /// shard is made of training shards the rank's block (or its own shard) holds.
    #[test]
    fn grids_cover_every_rank_once() {
        for (train_tp, cp_dp, pp, tp) in [
            (2, 1, 1, 1),
            (4, 1, 1, 2),
            (4, 2, 1, 1),
            (2, 2, 1, 4),
            (2, 1, 2, 4),
            (2, 2, 2, 4),
            (1, 4, 1, 4),
            (2, 2, 2, 8),
        ] {
            let world = train_tp * cp_dp * pp;
            let g = RolloutGrid {
                train_tp,
                cp_dp,
                world,
                tp,
            };
            let groups = g.rollout_groups();
            assert_eq!(groups.len(), world / tp);
            let mut seen = vec![false; world];
            for (gi, members) in groups.iter().enumerate() {
                for (j, &r) in members.iter().enumerate() {
                    assert!(!seen[r], "{g:?}: rank {r} twice");
                    seen[r] = true;
                    assert_eq!(g.place(r), (gi, j), "{g:?} rank {r}");
                    let t = r % train_tp;
                    if tp <= train_tp {
                        // Rollout shard j = training shards j·k..j·k+k: its block.
                        let k = train_tp / tp;
                        assert_eq!(t / k, j);
                        let block = g
                            .gather_blocks()
                            .into_iter()
                            .find(|b| b.contains(&r))
                            .unwrap_or_else(|| vec![r]);
                        let ts: Vec<usize> = block.iter().map(|x| x % train_tp).collect();
                        assert_eq!(ts, (j * k..j * k + k).collect::<Vec<_>>());
                    } else {
                        // Rollout shard j lies inside training shard t.
                        assert_eq!(j / (tp / train_tp), t);
                    }
                }
            }
            assert!(seen.iter().all(|&s| s), "{g:?}");
        }
    }
}
