//! The data-parallel group of a role: its rank, size and communicator.
//!
//! Every role instance (actor, reference, critic) joins the job on its own: its own store
//! connection (announced as its rank, so a crashed rank is noticed) and its own communicator under
//! a per-role, per-instance rendezvous prefix. Nothing is process-global: ranks may be threads of
//! one process (the tests) or separate processes (the host's launcher).
//!
//! With one rank every reduction is the identity and no communicator exists.

use std::sync::Arc;
use std::time::Duration;

use tch::{Device, Tensor};
use verl_comm::{
    CommError, Communicator, CpuCommunicator, CpuOptions, NcclCommunicator, NcclOptions, Pending,
    ReduceOp, StoreClient,
};
use verl_plugin_api::InitArgs;

use crate::error::{BackendError, Result, TorchContext};

pub struct Dp {
    pub rank: usize,
    pub size: usize,
    comm: Option<Box<dyn Communicator>>,
    /// Where small reduction buffers live: the communicator's device.
    device: Device,
}

impl std::fmt::Debug for Dp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dp")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("backend", &self.comm.as_ref().map(|c| c.backend().name()))
            .finish()
    }
}

impl Dp {
    /// A one-rank group.
    pub fn single() -> Dp {
        Dp {
            rank: 0,
            size: 1,
            comm: None,
            device: Device::Cpu,
        }
    }

    /// A group over an existing communicator (its rank and size); collectives on tensors of
    /// `device`.
    pub fn with_communicator(comm: Box<dyn Communicator>, device: Device) -> Dp {
        Dp {
            rank: comm.rank(),
            size: comm.world_size(),
            comm: Some(comm),
            device,
        }
    }

    /// Joins the job described by `init` as role `role` (`"actor"`, `"reference"`, `"critic"`):
    /// connects to `init.rendezvous`'s store as `init.rank` and builds a communicator (the CPU
    /// backend when `device` is the CPU, NCCL on GPU `init.local_rank` otherwise) under the prefix
    /// `verl-fsdp/<role>/<n>`, where `n` counts this role's instances on this rank, so that roles
    /// and successive instances never share a rendezvous.
    pub fn join(init: &InitArgs, role: &str, device: Device) -> Result<Dp> {
        if init.world_size <= 1 {
            return Ok(Dp::single());
        }
        if init.rank >= init.world_size {
            return Err(BackendError::config(
                "InitArgs.rank",
                format!("a rank below the world size {}", init.world_size),
                init.rank,
            ));
        }
        let rdv = init.rendezvous.as_ref().ok_or_else(|| {
            BackendError::config(
                "InitArgs.rendezvous",
                format!(
                    "the job's store (master_addr, master_port) for a world of {} ranks",
                    init.world_size
                ),
                "none",
            )
        })?;
        let (rank, world) = (init.rank as usize, init.world_size as usize);
        let timeout = Duration::from_secs(rdv.timeout_s.max(1));
        let addr = format!("{}:{}", rdv.master_addr, rdv.master_port);
        let comm_err =
            |op: &'static str| move |source: CommError| BackendError::Comm { op, source };
        let store = StoreClient::connect_as(addr.as_str(), rank, timeout)
            .map_err(|e| comm_err("connect to the rendezvous store")(e.into()))?;
        let instance = store
            .add(&format!("verl-fsdp/{role}/instances/rank{rank}"), 1)
            .map_err(|e| comm_err("rendezvous")(e.into()))?;
        let prefix = format!("verl-fsdp/{role}/{instance}");
        let store = Arc::new(store);
        let (comm, dev): (Box<dyn Communicator>, Device) = match device {
            Device::Cpu => (
                Box::new(
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
                Device::Cpu,
            ),
            Device::Cuda(gpu) => (
                Box::new(
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
                device,
            ),
            other => {
                return Err(BackendError::config(
                    "trainer.device",
                    "cpu or cuda for a multi-rank job",
                    format!("{other:?}"),
                ))
            }
        };
        // Collectives on a stream of their own: parameter gathers prefetched one unit ahead and
        // gradient reduce-scatters run while the default stream computes.
        comm.use_own_stream()
            .map_err(comm_err("communicator stream"))?;
        Ok(Dp {
            rank,
            size: world,
            comm: Some(comm),
            device: dev,
        })
    }

    pub fn is_sharded(&self) -> bool {
        self.size > 1
    }

    fn comm(&self) -> Option<&dyn Communicator> {
        self.comm.as_deref()
    }

    /// Sums plain numbers over the group (loss-normaliser counts, metrics).
    pub fn all_reduce_sum(&self, values: &mut [f64]) -> Result<()> {
        self.all_reduce_f64(
            values,
            ReduceOp::Sum,
            "all_reduce (sum of counts / metrics)",
        )
    }

    /// Maximum of plain numbers over the group.
    pub fn all_reduce_max(&self, values: &mut [f64]) -> Result<()> {
        self.all_reduce_f64(values, ReduceOp::Max, "all_reduce (max)")
    }

    fn all_reduce_f64(&self, values: &mut [f64], op: ReduceOp, what: &'static str) -> Result<()> {
        let Some(comm) = self.comm() else {
            return Ok(());
        };
        if values.is_empty() {
            return Ok(());
        }
        let mut t = Tensor::f_from_slice(values)
            .and_then(|t| t.f_to_device(self.device))
            .ctx("reduction buffer")?;
        comm.all_reduce(&mut t, op)
            .map_err(|source| BackendError::Comm { op: what, source })?;
        let host = Vec::<f64>::try_from(&t.f_to_device(Device::Cpu).ctx("reduction result")?)
            .ctx("reduction result")?;
        values.copy_from_slice(&host);
        Ok(())
    }

    /// All-gathers `input` (`[S]`) of every rank into `output` (`[size * S]`, rank-major).
    pub fn all_gather_into(&self, output: &mut Tensor, input: &Tensor) -> Result<()> {
        match self.comm() {
            Some(c) => c
                .all_gather_into(output, input)
                .map_err(|source| BackendError::Comm {
                    op: "all_gather (parameters)",
                    source,
                }),
            None => output.f_copy_(input).ctx("gather (one rank)"),
        }
    }

    /// Sums `input` (`[size * S]`) over the group and leaves this rank's block in `output` (`[S]`).
    pub fn reduce_scatter_sum(&self, output: &mut Tensor, input: &Tensor) -> Result<()> {
        match self.comm() {
            Some(c) => c
                .reduce_scatter(output, input, ReduceOp::Sum)
                .map_err(|source| BackendError::Comm {
                    op: "reduce_scatter (gradients)",
                    source,
                }),
            None => output.f_copy_(input).ctx("reduce-scatter (one rank)"),
        }
    }

    /// [`Dp::all_gather_into`] that may still be running (see [`Pending`]); one rank: a copy.
    pub fn all_gather_into_async(&self, output: &Tensor, input: &Tensor) -> Result<Pending> {
        match self.comm() {
            Some(c) => {
                c.all_gather_into_async(output, input)
                    .map_err(|source| BackendError::Comm {
                        op: "all_gather (parameters)",
                        source,
                    })
            }
            None => {
                output
                    .shallow_clone()
                    .f_copy_(input)
                    .ctx("gather (one rank)")?;
                Ok(Pending::done())
            }
        }
    }

    /// [`Dp::reduce_scatter_sum`] that may still be running (see [`Pending`]); one rank: a copy.
    pub fn reduce_scatter_sum_async(&self, output: &Tensor, input: &Tensor) -> Result<Pending> {
        match self.comm() {
            Some(c) => c
                .reduce_scatter_async(output, input, ReduceOp::Sum)
                .map_err(|source| BackendError::Comm {
                    op: "reduce_scatter (gradients)",
                    source,
                }),
            None => {
                output
                    .shallow_clone()
                    .f_copy_(input)
                    .ctx("reduce-scatter (one rank)")?;
                Ok(Pending::done())
            }
        }
    }

    /// Copies rank `root`'s `tensor` into `tensor` on every rank.
    pub fn broadcast(&self, tensor: &mut Tensor, root: usize) -> Result<()> {
        match self.comm() {
            Some(c) => c
                .broadcast(tensor, root)
                .map_err(|source| BackendError::Comm {
                    op: "broadcast (initial weights)",
                    source,
                }),
            None => Ok(()),
        }
    }

    pub fn barrier(&self, what: &'static str) -> Result<()> {
        match self.comm() {
            Some(c) => c
                .barrier()
                .map_err(|source| BackendError::Comm { op: what, source }),
            None => Ok(()),
        }
    }

    /// This group split into sub-groups: `groups` lists every sub-group (as ranks of this group),
    /// the same list on every rank; returns the one this rank is in (a one-rank group when it is
    /// alone, or in none). Members create their sub-groups in list order, so each rendezvous pairs
    /// the right ranks.
    pub fn subgroup(&self, groups: &[Vec<usize>]) -> Result<Dp> {
        let Some(comm) = self.comm() else {
            return Ok(Dp::single());
        };
        let mut mine = Dp::single();
        for g in groups.iter().filter(|g| g.len() > 1) {
            if let Some(c) = comm.new_group(g).map_err(|source| BackendError::Comm {
                op: "create a sub-group",
                source,
            })? {
                mine = Dp::with_communicator(c, self.device);
            }
        }
        Ok(mine)
    }

    /// Sums (or maxes) `t` in place over the group; one rank: unchanged.
    pub fn all_reduce_tensor(
        &self,
        t: &mut Tensor,
        op: ReduceOp,
        what: &'static str,
    ) -> Result<()> {
        match self.comm() {
            Some(c) => c
                .all_reduce(t, op)
                .map_err(|source| BackendError::Comm { op: what, source }),
            None => Ok(()),
        }
    }

    /// Every member's `t` (same shape everywhere), in rank order.
    pub fn all_gather(&self, t: &Tensor, what: &'static str) -> Result<Vec<Tensor>> {
        match self.comm() {
            Some(c) => {
                let t = t.f_contiguous().ctx(what)?;
                c.all_gather(&t)
                    .map_err(|source| BackendError::Comm { op: what, source })
            }
            None => Ok(vec![t.shallow_clone()]),
        }
    }

    /// All-to-all with unequal splits along dim 0: `input_splits[j]` rows of `input` go to rank
    /// `j`; returns the `output_splits[j]` rows from each rank `j`, in rank order.
    pub fn all_to_all_v(
        &self,
        input: &Tensor,
        input_splits: &[usize],
        output_splits: &[usize],
        what: &'static str,
    ) -> Result<Tensor> {
        let input = input.f_contiguous().ctx(what)?;
        let Some(c) = self.comm() else {
            return Ok(input);
        };
        let mut shape = input.size();
        shape[0] = output_splits.iter().sum::<usize>() as i64;
        let mut out =
            Tensor::f_empty(shape.as_slice(), (input.kind(), input.device())).ctx(what)?;
        c.all_to_all_v(&mut out, &input, output_splits, input_splits)
            .map_err(|source| BackendError::Comm { op: what, source })?;
        Ok(out)
    }

    /// Every member's `t` in rank order, where `t` is `[rows, ..]` with the same trailing
    /// dimensions and kind everywhere but any number of rows (zero included): the rows are padded
    /// to the largest count for one flat all-gather and cut back afterwards.
    pub fn all_gather_rows(&self, t: &Tensor, what: &'static str) -> Result<Vec<Tensor>> {
        if self.comm().is_none() {
            return Ok(vec![t.shallow_clone()]);
        }
        let shape = t.size();
        let rows = shape.first().copied().unwrap_or(0);
        let rest: Vec<i64> = shape.iter().skip(1).copied().collect();
        let mut counts = vec![0f64; self.size];
        counts[self.rank] = rows as f64;
        self.all_reduce_f64(&mut counts, ReduceOp::Sum, what)?;
        let max = counts.iter().fold(0f64, |a, &b| a.max(b)) as i64;
        let width: i64 = rest.iter().product();
        let padded = match rows < max {
            true => {
                let mut pad_shape = vec![max - rows];
                pad_shape.extend(&rest);
                let pad =
                    Tensor::f_zeros(pad_shape.as_slice(), (t.kind(), self.device)).ctx(what)?;
                Tensor::f_cat(&[t.f_to_device(self.device).ctx(what)?, pad], 0).ctx(what)?
            }
            false => t.f_to_device(self.device).ctx(what)?,
        };
        let flat = padded
            .f_contiguous()
            .and_then(|p| p.f_view([-1]))
            .ctx(what)?;
        let mut out =
            Tensor::f_empty([self.size as i64 * max * width], (t.kind(), self.device)).ctx(what)?;
        self.all_gather_into(&mut out, &flat)?;
        counts
            .iter()
            .enumerate()
            .map(|(r, &n)| {
                let mut s = vec![max];
                s.extend(&rest);
                out.f_narrow(0, r as i64 * max * width, max * width)
                    .and_then(|b| b.f_view(s.as_slice()))
                    .and_then(|b| b.f_narrow(0, 0, n as i64))
                    .ctx(what)
            })
            .collect()
    }

    /// Declares this rank failed with `error`, so that every other rank's pending and later
    /// collectives fail naming this rank instead of waiting for it. Returns `error`.
    pub fn fail(&self, error: BackendError) -> BackendError {
        if let Some(c) = self.comm() {
            // A peer's failure reached us: repeating it would only blur the root cause.
            if !matches!(
                error,
                BackendError::Comm {
                    source: CommError::PeerFailed { .. },
                    ..
                }
            ) {
                c.abort(&error.to_string());
            }
        }
        error
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One rank: the async collectives are copies, complete when they return.
    #[test]
    fn one_rank_async_collectives_copy() {
        let dp = Dp::single();
        let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0]);
        let out = Tensor::zeros([3], (tch::Kind::Float, Device::Cpu));
        let p = dp.all_gather_into_async(&out, &x).unwrap();
        assert!(!p.is_running());
        p.wait().unwrap();
        assert!(out.equal(&x));
        let out2 = Tensor::zeros([3], (tch::Kind::Float, Device::Cpu));
        dp.reduce_scatter_sum_async(&out2, &x)
            .unwrap()
            .wait()
            .unwrap();
        assert!(out2.equal(&x));
    }
}
