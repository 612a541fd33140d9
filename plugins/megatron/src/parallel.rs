//! The communicators of a role: the world group it joins through `InitArgs.rendezvous`, and the
//! tensor-parallel, data-parallel and pipeline groups cut out of it along the [`Layout`] (and, for a
//! mixture-of-experts model, the expert-parallel, expert-tensor-parallel and expert-data-parallel
//! groups).
//!
//! Every role instance joins on its own (own store connection, own rendezvous prefix
//! `verl-megatron/<role>/<n>`), so ranks may be threads of one process (the tests) or processes.
//! With one rank no communicator exists and every collective is the identity.

use std::sync::Arc;
use std::time::Duration;

use tch::{Device, Kind, Tensor};
use verl_backend_kit::dp::Dp;
use verl_comm::{
    CommError, Communicator, CpuCommunicator, CpuOptions, NcclCommunicator, NcclOptions, ReduceOp,
    StoreClient,
};
use verl_plugin_api::InitArgs;

use crate::error::{MegatronError, Result, TorchContext};
use crate::layout::{Coords, Layout};

/// One process group (or none, for a group of one rank).
pub struct Group {
    pub name: &'static str,
    pub rank: usize,
    pub size: usize,
    comm: Option<Box<dyn Communicator>>,
    /// Where scalar reduction buffers live (NCCL reduces on its GPU only).
    device: Device,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("name", &self.name)
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish()
    }
}

impl Group {
    pub fn single(name: &'static str) -> Group {
        Group {
            name,
            rank: 0,
            size: 1,
            comm: None,
            device: Device::Cpu,
        }
    }

    fn new(name: &'static str, comm: Box<dyn Communicator>, device: Device) -> Group {
        Group {
            name,
            rank: comm.rank(),
            size: comm.world_size(),
            comm: if comm.world_size() > 1 {
                Some(comm)
            } else {
                None
            },
            device,
        }
    }

    fn err(&self, op: &'static str) -> impl Fn(CommError) -> MegatronError + '_ {
        move |source| MegatronError::Comm {
            group: self.name,
            op,
            source: Box::new(source),
        }
    }

    /// Reduces `t` in place over the group.
    pub fn all_reduce(&self, t: &mut Tensor, op: ReduceOp, what: &'static str) -> Result<()> {
        match &self.comm {
            Some(c) => c.all_reduce(t, op).map_err(self.err(what)),
            None => Ok(()),
        }
    }

    /// Every member's `t` (same shape everywhere), in group-rank order.
    pub fn all_gather(&self, t: &Tensor, what: &'static str) -> Result<Vec<Tensor>> {
        match &self.comm {
            Some(c) => {
                let t = t.f_contiguous().ctx("gather input")?;
                c.all_gather(&t).map_err(self.err(what))
            }
            None => Ok(vec![t.shallow_clone()]),
        }
    }

    /// Flat all-gather: `out` holds `size × input.numel()` elements, rank-major.
    pub fn all_gather_into(
        &self,
        out: &mut Tensor,
        input: &Tensor,
        what: &'static str,
    ) -> Result<()> {
        match &self.comm {
            Some(c) => c.all_gather_into(out, input).map_err(self.err(what)),
            None => out.f_copy_(input).ctx(what),
        }
    }

    /// Sums `input` (`size × out.numel()` elements) over the group and leaves this rank's block in
    /// `out`.
    pub fn reduce_scatter_sum(
        &self,
        out: &mut Tensor,
        input: &Tensor,
        what: &'static str,
    ) -> Result<()> {
        match &self.comm {
            Some(c) => c
                .reduce_scatter(out, input, ReduceOp::Sum)
                .map_err(self.err(what)),
            None => out.f_copy_(input).ctx(what),
        }
    }

    /// Reduces plain numbers over the group.
    pub fn all_reduce_f64(&self, v: &mut [f64], op: ReduceOp, what: &'static str) -> Result<()> {
        let Some(c) = &self.comm else {
            return Ok(());
        };
        if v.is_empty() {
            return Ok(());
        }
        let mut t = Tensor::f_from_slice(v)
            .and_then(|t| t.f_to_device(self.device))
            .ctx("reduction buffer")?;
        c.all_reduce(&mut t, op).map_err(self.err(what))?;
        let host = Vec::<f64>::try_from(&t.f_to_device(Device::Cpu).ctx("reduction result")?)
            .ctx("reduction result")?;
        v.copy_from_slice(&host);
        Ok(())
    }

    pub fn barrier(&self, what: &'static str) -> Result<()> {
        match &self.comm {
            Some(c) => c.barrier().map_err(self.err(what)),
            None => Ok(()),
        }
    }

    /// Copies member `root`'s `t` into `t` on every member.
    pub fn broadcast(&self, t: &mut Tensor, root: usize, what: &'static str) -> Result<()> {
        match &self.comm {
            Some(c) => c.broadcast(t, root).map_err(self.err(what)),
            None => Ok(()),
        }
    }

    /// Sends `t` to member `dst` (which calls [`Group::recv`] with a tensor of the same shape and
    /// dtype).
    pub fn send(&self, t: &Tensor, dst: usize, what: &'static str) -> Result<()> {
        self.comm_or_alone(what)?
            .send(t, dst)
            .map_err(self.err(what))
    }

    pub fn recv(&self, t: &mut Tensor, src: usize, what: &'static str) -> Result<()> {
        self.comm_or_alone(what)?
            .recv(t, src)
            .map_err(self.err(what))
    }

    /// Sends `out` to member `peer` and receives `into` from it at once (both neighbours exchange
    /// without either blocking the other).
    pub fn exchange(
        &self,
        out: &Tensor,
        into: &mut Tensor,
        peer: usize,
        what: &'static str,
    ) -> Result<()> {
        self.comm_or_alone(what)?
            .send_recv(out, peer, into, peer)
            .map_err(self.err(what))
    }

    /// Sends `out` to member `dst` while receiving `into` from member `src` (the two may differ: a
    /// ring shift of the interleaved pipeline schedule), without either half blocking the other.
    pub fn send_recv(
        &self,
        out: &Tensor,
        dst: usize,
        into: &mut Tensor,
        src: usize,
        what: &'static str,
    ) -> Result<()> {
        self.comm_or_alone(what)?
            .send_recv(out, dst, into, src)
            .map_err(self.err(what))
    }

    fn comm_or_alone(&self, what: &'static str) -> Result<&dyn Communicator> {
        self.comm.as_deref().ok_or_else(|| {
            MegatronError::Api(verl_plugin_api::Error::failed(format!(
                "internal: {what} on the one-rank {} group (there is no peer)",
                self.name
            )))
        })
    }

    /// Member `root`'s JSON value on every member (metrics, error reports: small and rare).
    pub fn broadcast_json(
        &self,
        value: &serde_json::Value,
        root: usize,
        what: &'static str,
    ) -> Result<serde_json::Value> {
        if self.comm.is_none() {
            return Ok(value.clone());
        }
        let bytes = if self.rank == root {
            serde_json::to_vec(value).unwrap_or_default()
        } else {
            vec![]
        };
        let mut len = Tensor::f_from_slice(&[bytes.len() as i64])
            .and_then(|t| t.f_to_device(self.device))
            .ctx("broadcast length")?;
        self.broadcast(&mut len, root, what)?;
        let n = len.f_int64_value(&[0]).ctx("broadcast length")?;
        let mut buf = if self.rank == root {
            Tensor::f_from_slice(&bytes)
        } else {
            Tensor::f_zeros([n], (Kind::Uint8, Device::Cpu))
        }
        .and_then(|t| t.f_to_device(self.device))
        .ctx("broadcast buffer")?;
        self.broadcast(&mut buf, root, what)?;
        let host = Vec::<u8>::try_from(&buf.f_to_device(Device::Cpu).ctx("broadcast buffer")?)
            .ctx("broadcast buffer")?;
        serde_json::from_slice(&host).map_err(|e| {
            MegatronError::Api(verl_plugin_api::Error::failed(format!(
                "{} {what}: member {root} sent invalid JSON: {e}",
                self.name
            )))
        })
    }
}

/// All groups of one role instance on this rank.
pub struct Parallel {
    pub layout: Layout,
    pub coords: Coords,
    pub rank: usize,
    pub device: Device,
    pub tp: Arc<Group>,
    /// Data-parallel group for tensors (gradients, optimizer shards).
    pub dp: Group,
    /// The same data-parallel ranks as the FSDP helpers see them (counts, metrics, batching).
    pub dp_meta: Dp,
    /// The pipeline group: member `s` is stage `s` of this rank's model replica shard (same
    /// tensor- and data-parallel coordinates).
    pub pp: Group,
    /// The expert-parallel group (Megatron-core's expert grid: the ranks of one stage that share
    /// out the routed experts).
    pub ep: Arc<ExpertGroup>,
    /// The expert-tensor-parallel group (the ranks each routed expert is split over).
    pub etp: Arc<ExpertGroup>,
    /// The expert-data-parallel group (the ranks holding the same expert shards), when it
    /// differs from `dp` (expert parallelism > 1 or ETP ≠ TP).
    pub edp: Option<Group>,
    /// The tensor-parallel ranks as a group the MoE blocks drive (their tokens are partitioned
    /// over it under sequence parallelism, or sliced when ETP ≠ TP); one rank for a dense model.
    pub moe_tp: Arc<ExpertGroup>,
    world: Option<Box<dyn Communicator>>,
}

impl std::fmt::Debug for Parallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Parallel")
            .field("layout", &self.layout)
            .field("coords", &self.coords)
            .finish()
    }
}

impl Parallel {
    /// One rank, no communicators.
    pub fn single(device: Device) -> Parallel {
        Parallel {
            layout: Layout::single(),
            coords: Coords {
                tp: 0,
                cp: 0,
                dp: 0,
                pp: 0,
            },
            rank: 0,
            device,
            tp: Arc::new(Group::single("tensor-parallel")),
            dp: Group::single("data-parallel"),
            dp_meta: Dp::single(),
            pp: Group::single("pipeline"),
            ep: Arc::new(ExpertGroup::single("expert-parallel")),
            etp: Arc::new(ExpertGroup::single("expert-tensor-parallel")),
            edp: None,
            moe_tp: Arc::new(ExpertGroup::single("tensor-parallel (moe tokens)")),
            world: None,
        }
    }

    /// Joins the job of `init` as `role` and builds this rank's groups along `layout`.
    pub fn join(init: &InitArgs, role: &str, layout: Layout, device: Device) -> Result<Parallel> {
        if init.world_size <= 1 {
            return Ok(Parallel {
                layout,
                ..Parallel::single(device)
            });
        }
        let (rank, world) = (init.rank as usize, init.world_size as usize);
        if rank >= world {
            return Err(MegatronError::config(
                "InitArgs.rank",
                format!("a rank below the world size {world}"),
                rank,
            ));
        }
        let rdv = init.rendezvous.as_ref().ok_or_else(|| {
            MegatronError::config(
                "InitArgs.rendezvous",
                format!("the job's store (master_addr, master_port) for a world of {world} ranks"),
                "none",
            )
        })?;
        let timeout = Duration::from_secs(rdv.timeout_s.max(1));
        let addr = format!("{}:{}", rdv.master_addr, rdv.master_port);
        let comm_err = |op: &'static str| {
            move |source: CommError| MegatronError::Comm {
                group: "world",
                op,
                source: Box::new(source),
            }
        };
        let store = StoreClient::connect_as(addr.as_str(), rank, timeout)
            .map_err(|e| comm_err("connect to the rendezvous store")(e.into()))?;
        let instance = store
            .add(&format!("verl-megatron/{role}/instances/rank{rank}"), 1)
            .map_err(|e| comm_err("rendezvous")(e.into()))?;
        let prefix = format!("verl-megatron/{role}/{instance}");
        let store = Arc::new(store);
        let world_comm: Box<dyn Communicator> = match device {
            Device::Cpu => Box::new(
                CpuCommunicator::with_prefix(
                    store,
                    &prefix,
                    rank,
                    world,
                    CpuOptions {
                        timeout,
                        ..CpuOptions::default()
                    },
                )
                .map_err(comm_err("rendezvous (cpu communicator)"))?,
            ),
            Device::Cuda(gpu) => Box::new(
                NcclCommunicator::with_prefix(
                    store,
                    &prefix,
                    rank,
                    world,
                    NcclOptions {
                        device: gpu,
                        timeout,
                        ..NcclOptions::default()
                    },
                )
                .map_err(comm_err("rendezvous (nccl communicator)"))?,
            ),
            other => {
                return Err(MegatronError::config(
                    "trainer.device",
                    "cpu or cuda for a multi-rank job",
                    format!("{other:?}"),
                ))
            }
        };
        let coords = layout.coords(rank);
        // Every member creates its groups in the same global order, so the rendezvous of each
        // group pairs the right ranks.
        let mine = |groups: Vec<Vec<usize>>, name: &'static str| -> Result<Box<dyn Communicator>> {
            let mut found = None;
            for g in groups {
                if let Some(c) = world_comm
                    .new_group(&g)
                    .map_err(comm_err("create a sub-group"))?
                {
                    found = Some(c);
                }
            }
            found.ok_or_else(|| MegatronError::Layout {
                key: "InitArgs.rank".into(),
                message: format!("rank {rank} belongs to no {name} group of the layout"),
            })
        };
        let tp = Group::new(
            "tensor-parallel",
            mine(layout.tp_groups(), "tensor-parallel")?,
            device,
        );
        let dp = Group::new(
            "data-parallel",
            mine(layout.dp_groups(), "data-parallel")?,
            device,
        );
        let dp_meta = Dp::with_communicator(mine(layout.dp_groups(), "data-parallel")?, device);
        let pp = Group::new("pipeline", mine(layout.pp_groups(), "pipeline")?, device);
        // Expert groups only where a MoE model needs them (the layout keeps ep = etp = 1 for a
        // dense model), so dense jobs create no extra communicators. Megatron-core's expert grid:
        // the stage's tensor × data-parallel ranks as ETP × EP × expert-DP, ETP fastest.
        let etp = match layout.etp > 1 {
            true => ExpertGroup::new(
                "expert-tensor-parallel",
                mine(layout.etp_groups(), "expert-tensor-parallel")?,
            ),
            false => ExpertGroup::single("expert-tensor-parallel"),
        };
        let ep = match layout.ep > 1 {
            true => ExpertGroup::new(
                "expert-parallel",
                mine(layout.ep_groups(), "expert-parallel")?,
            ),
            false => ExpertGroup::single("expert-parallel"),
        };
        let edp = match layout.separate_expert_dp() {
            true => Some(Group::new(
                "expert-data-parallel",
                mine(layout.expert_dp_groups(), "expert-data-parallel")?,
                device,
            )),
            false => None,
        };
        let moe_tp = match layout.moe && layout.tp > 1 {
            true => ExpertGroup::new(
                "tensor-parallel (moe tokens)",
                mine(layout.tp_groups(), "tensor-parallel")?,
            ),
            false => ExpertGroup::single("tensor-parallel (moe tokens)"),
        };
        Ok(Parallel {
            layout,
            coords,
            rank,
            device,
            tp: Arc::new(tp),
            dp,
            dp_meta,
            pp,
            ep: Arc::new(ep),
            etp: Arc::new(etp),
            edp,
            moe_tp: Arc::new(moe_tp),
            world: Some(world_comm),
        })
    }

    /// Every rank of the job as a group of its own (a fresh communicator, so its collectives
    /// never interleave with the layout's groups): generation's exchanges between rollout groups.
    /// Every rank calls it together.
    pub fn world_group(&self) -> Result<Dp> {
        let Some(w) = &self.world else {
            return Ok(Dp::single());
        };
        let all: Vec<usize> = (0..w.world_size()).collect();
        let comm = w.new_group(&all).map_err(|source| MegatronError::Comm {
            group: "world",
            op: "create a sub-group",
            source: Box::new(source),
        })?;
        Ok(match comm {
            Some(c) => Dp::with_communicator(c, self.device),
            None => Dp::single(),
        })
    }

    /// Declares this rank failed so every peer's collectives stop naming it; returns `error`.
    pub fn fail(&self, error: MegatronError) -> MegatronError {
        if let Some(w) = &self.world {
            if !error.is_peer_failure() {
                w.abort(&error.to_string());
            }
        }
        error
    }

    pub fn barrier(&self, what: &'static str) -> Result<()> {
        match &self.world {
            Some(w) => w.barrier().map_err(|source| MegatronError::Comm {
                group: "world",
                op: what,
                source: Box::new(source),
            }),
            None => Ok(()),
        }
    }

    /// The group expert gradients are reduced over (and their optimizer state sharded over).
    pub fn expert_dp(&self) -> &Group {
        self.edp.as_ref().unwrap_or(&self.dp)
    }

    /// Sums plain numbers over the expert-parallel group.
    pub fn ep_all_reduce_f64(&self, v: &mut [f64], what: &'static str) -> Result<()> {
        self.expert_all_reduce_f64(&self.ep, v, what)
    }

    /// Sums plain numbers over the expert-tensor-parallel group.
    pub fn etp_all_reduce_f64(&self, v: &mut [f64], what: &'static str) -> Result<()> {
        self.expert_all_reduce_f64(&self.etp, v, what)
    }

    fn expert_all_reduce_f64(
        &self,
        group: &ExpertGroup,
        v: &mut [f64],
        what: &'static str,
    ) -> Result<()> {
        if group.size <= 1 || v.is_empty() {
            return Ok(());
        }
        let mut t = Tensor::f_from_slice(v)
            .and_then(|t| t.f_to_device(self.device))
            .ctx("reduction buffer")?;
        group.all_reduce_sum(&mut t, what)?;
        let host = Vec::<f64>::try_from(&t.f_to_device(Device::Cpu).ctx("reduction result")?)
            .ctx("reduction result")?;
        v.copy_from_slice(&host);
        Ok(())
    }

    /// This rank's pipeline stage.
    pub fn stage(&self) -> crate::layout::Stage {
        crate::layout::Stage {
            index: self.coords.pp,
            count: self.layout.pp,
            chunks: self.layout.vpp.max(1),
        }
    }

    /// Rank 0 of the whole job (it writes checkpoints and exports).
    pub fn is_first(&self) -> bool {
        self.rank == 0
    }
}
/// The expert-parallel or expert-tensor-parallel group of one rank (or none, for one rank).
pub struct ExpertGroup {
    pub name: &'static str,
    pub rank: usize,
    pub size: usize,
    comm: Option<Box<dyn Communicator>>,
}

impl std::fmt::Debug for ExpertGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertGroup")
            .field("name", &self.name)
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish()
    }
}

impl ExpertGroup {
    /// A group of one rank: every collective is the identity.
    pub fn single(name: &'static str) -> ExpertGroup {
        ExpertGroup {
            name,
            rank: 0,
            size: 1,
            comm: None,
        }
    }

    /// The group of `comm`'s members (`comm.rank()` is this rank's index in it).
    pub fn new(name: &'static str, comm: Box<dyn Communicator>) -> ExpertGroup {
        ExpertGroup {
            name,
            rank: comm.rank(),
            size: comm.world_size(),
            comm: (comm.world_size() > 1).then_some(comm),
        }
    }

    fn err(&self, op: &'static str) -> impl Fn(CommError) -> MegatronError + '_ {
        move |source| MegatronError::Comm {
            group: self.name,
            op,
            source: Box::new(source),
        }
    }

    /// All-to-all of the rows of `input` (`input_splits[j]` rows to member `j`); returns the
    /// `Σ output_splits` received rows, in member order.
    pub fn all_to_all_v(
        &self,
        input: &Tensor,
        input_splits: &[usize],
        output_splits: &[usize],
        what: &'static str,
    ) -> Result<Tensor> {
        let Some(c) = &self.comm else {
            return input.f_detach_copy().ctx(what);
        };
        let mut shape = input.size();
        shape[0] = output_splits.iter().sum::<usize>() as i64;
        let input = input.f_contiguous().ctx(what)?;
        let mut out =
            Tensor::f_empty(shape.as_slice(), (input.kind(), input.device())).ctx(what)?;
        c.all_to_all_v(&mut out, &input, output_splits, input_splits)
            .map_err(self.err(what))?;
        Ok(out)
    }

    /// Variable-size all-gather of rows: member `j` contributes `rows[j]` rows (`t` holds this
    /// member's); returns the `Σ rows` rows, member-major.
    pub fn all_gather_rows(
        &self,
        t: &Tensor,
        rows: &[usize],
        what: &'static str,
    ) -> Result<Tensor> {
        if self.comm.is_none() {
            return t.f_detach_copy().ctx(what);
        }
        let n = t.size().first().copied().unwrap_or(0) as usize;
        let mut reps = vec![1i64; t.dim().max(1)];
        reps[0] = self.size as i64;
        let input = t.f_repeat(reps.as_slice()).ctx(what)?;
        self.all_to_all_v(&input, &vec![n; self.size], rows, what)
    }

    /// Variable-size reduce-scatter of rows: `t` holds `Σ rows` rows, member-major (`rows[j]` for
    /// member `j`); returns this member's `rows[rank]` rows summed over the group (in member
    /// order).
    pub fn reduce_scatter_rows(
        &self,
        t: &Tensor,
        rows: &[usize],
        what: &'static str,
    ) -> Result<Tensor> {
        if self.comm.is_none() {
            return t.f_detach_copy().ctx(what);
        }
        let mine = rows[self.rank];
        let parts = self.all_to_all_v(t, rows, &vec![mine; self.size], what)?;
        let mut shape = t.size();
        shape[0] = mine as i64;
        shape.insert(0, self.size as i64);
        parts
            .f_reshape(shape.as_slice())
            .and_then(|p| p.f_sum_dim_intlist([0i64].as_slice(), false, None::<Kind>))
            .ctx(what)
    }

    /// Sums `t` in place over the group.
    pub fn all_reduce_sum(&self, t: &mut Tensor, what: &'static str) -> Result<()> {
        match &self.comm {
            Some(c) => c.all_reduce(t, ReduceOp::Sum).map_err(self.err(what)),
            None => Ok(()),
        }
    }

    /// Every member's `t` (same shape everywhere), in member order.
    pub fn all_gather(&self, t: &Tensor, what: &'static str) -> Result<Vec<Tensor>> {
        match &self.comm {
            Some(c) => {
                let t = t.f_contiguous().ctx(what)?;
                c.all_gather(&t).map_err(self.err(what))
            }
            None => Ok(vec![t.shallow_clone()]),
        }
    }

    /// Every member's `values` (same length everywhere), in member order.
    pub fn all_gather_i64(
        &self,
        values: &[i64],
        device: Device,
        what: &'static str,
    ) -> Result<Vec<Vec<i64>>> {
        let Some(c) = &self.comm else {
            return Ok(vec![values.to_vec()]);
        };
        let t = Tensor::f_from_slice(values)
            .and_then(|t| t.f_to_device(device))
            .ctx(what)?;
        let parts = c.all_gather(&t).map_err(self.err(what))?;
        parts
            .iter()
            .map(|p| Vec::<i64>::try_from(&p.f_to_device(Device::Cpu).ctx(what)?).ctx(what))
            .collect()
    }
}
